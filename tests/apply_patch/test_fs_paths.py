"""kernel_gateway.fs: lexical and symlink escapes refused, inside links allowed,
and no open through a directory being swapped for a symlink lands outside."""

import os
import threading

import pytest

from kernel_gateway.fs import paths as wp
from kernel_gateway.fs import PathOutsideRoot


@pytest.fixture
def tree(tmp_path):
    root, outside, sibling = tmp_path / "agent", tmp_path / "outside", tmp_path / "agent2"
    for d in (root / "a" / "b", outside / "x" / "y", sibling):
        d.mkdir(parents=True)
    (outside / "secret").write_text("secret")
    (outside / "x" / "y" / "secret").write_text("deep secret")
    (sibling / "secret").write_text("sibling")
    (root / "a" / "b" / "file").write_text("inside")
    os.symlink(str(outside), root / "abs_out")
    os.symlink("../outside", root / "rel_out")
    os.symlink("../../../outside/x", root / "a" / "b" / "deep_out")
    os.symlink("../agent2", root / "sib")
    os.symlink("a/b", root / "ab")
    return root


@pytest.mark.parametrize("path", [
    "../outside/secret", "a/../../outside/secret", "{tmp}/outside/secret", "{tmp}/agent2/secret",
    "abs_out/secret", "rel_out/secret", "a/b/deep_out/y/secret", "sib/secret", "abs_out",
])
def test_escapes_are_refused(tree, path):
    path = path.format(tmp=tree.parent)
    with pytest.raises(PathOutsideRoot, match="outside the workspace root"):
        wp.resolve_in_root(tree, path)
    with pytest.raises(PathOutsideRoot):
        wp.open_in_root(tree, path, os.O_RDONLY)


def test_message_names_the_path(tree):
    with pytest.raises(PathOutsideRoot, match="'rel_out/secret'"):
        wp.open_in_root(tree, "rel_out/secret", os.O_RDONLY)


def test_inside_symlink_is_allowed(tree):
    assert wp.resolve_in_root(tree, "ab/file") == tree / "a" / "b" / "file"
    fd = wp.open_in_root(tree, "ab/file", os.O_RDONLY)
    with os.fdopen(fd) as f:
        assert f.read() == "inside"


def test_missing_paths_and_cwd(tree):
    assert wp.resolve_in_root(tree, "new/dir/f") == tree / "new" / "dir" / "f"
    assert wp.resolve_in_root(tree, "../file", cwd=tree / "a" / "b") == tree / "a" / "file"
    with pytest.raises(PathOutsideRoot):
        wp.resolve_in_root(tree, "x", cwd=tree.parent)


def test_helpers_stay_beneath(tree):
    wp.mkdirs_in_root(tree, "n1/n2")
    assert (tree / "n1" / "n2").is_dir()
    fd = wp.open_in_root(tree, "n1/n2/f", os.O_WRONLY | os.O_CREAT)
    os.close(fd)
    wp.unlink_in_root(tree, "n1/n2/f")
    assert not (tree / "n1" / "n2" / "f").exists()
    wp.unlink_in_root(tree, "abs_out")  # the link itself, not what it points to
    assert (tree.parent / "outside" / "secret").exists()
    with pytest.raises(PathOutsideRoot):
        wp.mkdirs_in_root(tree, "rel_out/made")
    assert not (tree.parent / "outside" / "made").exists()


@pytest.mark.parametrize("walk", [False, True], ids=["openat2", "walk"])
def test_swap_race_never_escapes(tree, monkeypatch, walk):
    """A thread flips a/b between a directory and a symlink to outside while
    the main thread keeps opening a/b/secret: every open fails or reads inside."""
    if walk:
        monkeypatch.setattr(wp, "_OPENAT2", None)
    (tree / "a" / "b" / "secret").write_text("inside")
    real, parked = tree / "a" / "b", tree / "a" / "parked"
    stop = threading.Event()

    def flip():
        while not stop.is_set():
            os.rename(real, parked)
            os.symlink("../../outside", real)  # relative: only the beneath rule stops it
            os.unlink(real)
            os.rename(parked, real)

    flipper = threading.Thread(target=flip)
    flipper.start()
    seen = set()
    try:
        # At least 3000 tries, and on until one has read the file inside (on a loaded
        # machine the flipper can win thousands of times in a row).
        tries = 0
        while tries < 3000 or ("inside" not in seen and tries < 300_000):
            tries += 1
            try:
                fd = wp.open_in_root(tree, "a/b/secret", os.O_RDONLY)
            except (OSError, PathOutsideRoot) as err:
                seen.add(type(err).__name__)
                continue
            with os.fdopen(fd) as f:
                seen.add(f.read())
    finally:
        stop.set()
        flipper.join()
    assert "secret" not in seen and "inside" in seen
