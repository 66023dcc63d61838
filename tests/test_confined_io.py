"""The confined lookup the gateway uses for every touch of an agent's tree.

Real files, FIFOs, symlinks and directories in a temporary tree; the owner
tests give the agent root to an unprivileged uid, as the gateway's agents get.
"""

from __future__ import annotations

import os
import threading

import pytest

from kernel_gateway import fs as wp

AGENT_UID = 200_123


@pytest.fixture
def tree(tmp_path):
    root, other = tmp_path / "alice", tmp_path / "bob"
    (root / "sessions" / "s1").mkdir(parents=True)
    other.mkdir()
    (other / "secret").write_text("bob's")
    (root / "sessions" / "s1" / "ok.txt").write_text("mine")
    return root


def test_read_regular_refuses_what_is_not_a_plain_file_of_the_tree(tree):
    s1 = tree / "sessions" / "s1"
    os.symlink(tree.parent / "bob" / "secret", s1 / "abs")
    os.symlink("../../../bob/secret", s1 / "rel")
    os.symlink("ok.txt", s1 / "inside")
    os.mkfifo(s1 / "fifo")
    assert wp.read_regular_in_root(tree, s1 / "ok.txt", 100) == b"mine"
    for name in ("abs", "rel", "inside"):
        with pytest.raises(wp.PathOutsideRoot):
            wp.read_regular_in_root(tree, s1 / name, 100)
    for path in ("/etc/shadow", "/proc/self/environ", str(tree.parent / "bob" / "secret"), "../bob/secret"):
        with pytest.raises(wp.PathOutsideRoot):
            wp.read_regular_in_root(tree, path, 100)
    with pytest.raises(wp.NotRegularFile):
        wp.read_regular_in_root(tree, s1 / "fifo", 100)  # returns at once: a FIFO is never opened for reading
    with pytest.raises(wp.NotRegularFile):
        wp.read_regular_in_root(tree, s1, 100)
    # An inside link is fine when the caller allows a final symlink.
    assert wp.read_regular_in_root(tree, s1 / "inside", 100, follow_final=True) == b"mine"


def test_read_regular_checks_the_size_before_reading(tree):
    big = tree / "sessions" / "s1" / "big"
    with open(big, "wb") as f:
        f.truncate(48 << 20)
    with pytest.raises(wp.FileTooLarge) as caught:
        wp.read_regular_in_root(tree, big, 1 << 20)
    assert caught.value.size == 48 << 20 and caught.value.cap == 1 << 20
    assert wp.read_regular_in_root(tree, big, 48 << 20)[:4] == b"\0\0\0\0"


def test_a_fifo_does_not_block_a_reader_thread(tree):
    fifo = tree / "sessions" / "s1" / "fifo"
    os.mkfifo(fifo)
    errors = []
    reader = threading.Thread(target=lambda: errors.append(pytest.raises(wp.NotRegularFile, wp.read_regular_in_root,
                                                                         tree, fifo, 10)), daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive() and errors


def test_make_dirs_nofollow_refuses_any_symlink_on_the_way(tree):
    os.rename(tree / "sessions", tree / "sessions.real")
    os.symlink(tree.parent / "bob", tree / "sessions")
    with pytest.raises(wp.SymlinkRefused):
        wp.make_dirs_nofollow(tree, "sessions/new")
    os.unlink(tree / "sessions")
    os.symlink("sessions.real", tree / "sessions")  # even one that stays inside
    with pytest.raises(wp.SymlinkRefused):
        wp.make_dirs_nofollow(tree, "sessions/new")
    with pytest.raises(wp.PathOutsideRoot):
        wp.make_dirs_nofollow(tree, "../bob/new")
    assert sorted(os.listdir(tree.parent / "bob")) == ["secret"]
    wp.make_dirs_nofollow(tree, "a/b/c")
    assert (tree / "a" / "b" / "c").is_dir()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving files to another uid needs root")
def test_what_the_gateway_creates_goes_to_the_agent_roots_owner(tree):
    os.chown(tree, AGENT_UID, AGENT_UID)
    wp.make_dirs_nofollow(tree, "x/y")
    wp.mkdirs_in_root(tree, "m/n")
    os.close(wp.open_in_root(tree, "m/n/file", os.O_WRONLY | os.O_CREAT))
    dir_fd = wp.open_in_root(tree, "x/y", os.O_PATH | os.O_DIRECTORY)
    try:
        assert wp.write_atomically_at(dir_fd, "nb.ipynb", b"{}", owner=wp.agent_owner(tree))
    finally:
        os.close(dir_fd)
    for path in ("x", "x/y", "m", "m/n", "m/n/file", "x/y/nb.ipynb"):
        assert (os.stat(tree / path).st_uid, os.stat(tree / path).st_gid) == (AGENT_UID, AGENT_UID), path
    # What existed before keeps its owner.
    assert os.stat(tree / "sessions").st_uid == 0
    os.close(wp.open_in_root(tree, "sessions/s1/ok.txt", os.O_WRONLY | os.O_CREAT))
    assert os.stat(tree / "sessions" / "s1" / "ok.txt").st_uid == 0


def test_write_atomically_leaves_the_old_file_when_refused(tree):
    dir_fd = os.open(tree, os.O_PATH | os.O_DIRECTORY)
    try:
        (tree / "f").write_bytes(b"old")
        assert wp.write_atomically_at(dir_fd, "f", b"new", before_rename=lambda: False) is False
        assert (tree / "f").read_bytes() == b"old"
        assert wp.write_atomically_at(dir_fd, "f", b"new") is True
        assert (tree / "f").read_bytes() == b"new"
        assert sorted(os.listdir(tree)) == ["f", "sessions"]  # no temporary file left
    finally:
        os.close(dir_fd)


def test_write_atomically_takes_a_name_as_long_as_a_name_may_be(tree):
    """The temporary file next to a 255-byte name must itself fit in NAME_MAX."""
    name = "n" * 249 + ".ipynb"
    dir_fd = os.open(tree, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert wp.write_atomically_at(dir_fd, name, b"{}") is True
    finally:
        os.close(dir_fd)
    assert os.listdir(tree).count(name) == 1 and (tree / name).read_bytes() == b"{}"
    assert not [n for n in os.listdir(tree) if n.endswith(".tmp")]


@pytest.mark.parametrize("path,why", [
    ("a" * 256, "component is 256 bytes"),
    ("é" * 128, "component is 256 bytes"),
    ("d/" * 2049, "4098 bytes"),
    ("a\0b", "NUL"),
    ("\ud800", "not valid UTF-8"),
])
def test_paths_no_call_could_take_are_a_400(tree, path, why):
    for call in (lambda: wp.resolve_in_root(tree, path), lambda: wp.open_in_root(tree, path, os.O_RDONLY),
                 lambda: wp.make_dirs_nofollow(tree, path), lambda: wp.resolve_in_root(tree, "x", cwd=path)):
        with pytest.raises(wp.InvalidPath, match=why) as caught:
            call()
        assert caught.value.status == 400 and caught.value.code == "invalid_path"
    assert sorted(os.listdir(tree)) == ["sessions"]


@pytest.mark.skipif(os.geteuid() != 0, reason="giving files to another uid needs root")
def test_notebooks_and_patches_the_gateway_writes_belong_to_the_agent(tree):
    from kernel_gateway.notebooks import NotebookStore
    from kernel_gateway.tools import apply_patch

    os.chown(tree, AGENT_UID, AGENT_UID)
    store = NotebookStore(tree)
    store.put("user-files/deep/n.ipynb", {"cells": [{"cell_type": "code", "source": "1"}]})
    store.insert_cell("user-files/deep/n.ipynb", 1, "code", "2")  # a rewrite keeps the owner
    patch = "*** Begin Patch\n*** Add File: user-files/new/p.txt\n+hi\n*** End Patch\n"
    assert apply_patch.apply_patch(patch, str(tree), root=str(tree)).ok
    for path in ("user-files", "user-files/deep", "user-files/deep/n.ipynb", "user-files/new/p.txt"):
        assert os.stat(tree / path).st_uid == AGENT_UID, path


def test_a_fifo_or_a_socket_named_like_a_notebook_is_refused_at_once(tree):
    import socket

    from kernel_gateway.errors import GatewayError
    from kernel_gateway.notebooks import NotebookStore

    os.mkfifo(tree / "f.ipynb")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(tree / "s.ipynb"))
    store = NotebookStore(tree)
    try:
        for name in ("f.ipynb", "s.ipynb"):
            for call in (lambda: store.contents(name), lambda: store.put(name, {"cells": []})):
                with pytest.raises(GatewayError) as caught:
                    call()
                assert (caught.value.status, caught.value.code) == (415, "not_a_notebook"), name
    finally:
        listener.close()
    assert stat_kind(tree / "f.ipynb") == "fifo"


def stat_kind(path) -> str:
    import stat

    return "fifo" if stat.S_ISFIFO(os.lstat(path).st_mode) else "other"


def test_a_patch_naming_a_fifo_fails_at_once_and_writes_nothing(tree):
    from kernel_gateway.tools import apply_patch

    os.mkfifo(tree / "pipe")
    update = "*** Begin Patch\n*** Update File: pipe\n@@\n-a\n+b\n*** End Patch\n"
    add = "*** Begin Patch\n*** Add File: pipe\n+b\n*** End Patch\n"
    for patch in (update, add):
        done = []
        worker = threading.Thread(
            target=lambda: done.append(apply_patch.apply_patch(patch, str(tree), root=str(tree))), daemon=True
        )
        worker.start()
        worker.join(30)
        assert not worker.is_alive(), "apply_patch blocked on a FIFO"
        assert done[0].ok is False
    assert stat_kind(tree / "pipe") == "fifo"
