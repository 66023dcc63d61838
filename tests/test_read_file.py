"""read_file on real files: text windows, images, binaries, caps, and confinement."""

from __future__ import annotations

import base64
import os
import threading
from pathlib import Path

import pytest

from kernel_gateway.errors import GatewayError
from kernel_gateway.tools.read_file import MAX_LINE_CHARS, read_file

PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x06\x00\x00\x00\x1f\x15\xc4\x89"
JPEG = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00\xff\xd9"
GIF = b"GIF89a\x01\x00\x01\x00\x80\x00\x00\x00\x00\x00\xff\xff\xff!\xf9\x04\x01\x00\x00\x00\x00,\x00\x00\x00\x00\x01\x00\x01\x00\x00\x02\x02D\x01\x00;"
WEBP = b"RIFF\x1a\x00\x00\x00WEBPVP8L\x0d\x00\x00\x00/\x00\x00\x00\x10\x07\x10\x11\x11\x88\x88\xfe\x07\x00"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """An agent root, with a secret file next to it that must stay unreadable."""
    agent = tmp_path / "agents" / "alice"
    (agent / "sessions" / "s1").mkdir(parents=True)
    (tmp_path / "agents" / "bob").mkdir()
    (tmp_path / "agents" / "bob" / "secret.txt").write_text("bob's secret\n")
    (tmp_path / "secret.txt").write_text("host secret\n")
    return agent


def tree(path: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry under path with its mode, size and modification time."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            info = os.lstat(os.path.join(dirpath, name))
            found[os.path.join(dirpath, name)] = (info.st_mode, info.st_size, info.st_mtime_ns)
    return found


def error_of(root: Path, *args, **kwargs) -> GatewayError:
    before = tree(root.parent.parent)
    with pytest.raises(GatewayError) as caught:
        read_file(str(root), *args, **kwargs)
    assert tree(root.parent.parent) == before, "a failed read changed files"
    return caught.value


# --- text ------------------------------------------------------------------------


def test_reads_whole_text_file_exactly_as_stored(root: Path):
    (root / "notes.md").write_bytes(b"# Title\r\nline two\n\n\ttabbed \xc3\xa9\nno newline at end")
    result = read_file(str(root), "notes.md")
    assert result == {
        "path": str(root / "notes.md"),
        "content": "# Title\r\nline two\n\n\ttabbed é\nno newline at end",
        "encoding": "utf-8",
        "mime": "text/markdown",
        "size": 47,
        "total_lines": 5,
        "offset": 1,
        "limit": 2000,
        "truncated": False,
    }


def test_offset_and_limit_select_lines_counting_from_one(root: Path):
    (root / "n.txt").write_text("".join(f"line {i}\n" for i in range(1, 11)))
    result = read_file(str(root), "n.txt", offset=3, limit=4)
    assert result["content"] == "line 3\nline 4\nline 5\nline 6\n"
    assert (result["offset"], result["limit"], result["total_lines"]) == (3, 4, 10)
    assert result["truncated"] is True
    tail = read_file(str(root), "n.txt", offset=9, limit=4)
    assert tail["content"] == "line 9\nline 10\n"
    assert tail["truncated"] is False


def test_default_limit_is_2000_lines(root: Path):
    (root / "long.txt").write_text("".join(f"{i}\n" for i in range(1, 2501)))
    result = read_file(str(root), "long.txt")
    assert result["content"].splitlines() == [str(i) for i in range(1, 2001)]
    assert result["total_lines"] == 2500
    assert result["truncated"] is True


def test_a_line_longer_than_2000_characters_is_cut_with_a_marker(root: Path):
    (root / "wide.csv").write_text("a" * 5000 + "\nshort\n")
    result = read_file(str(root), "wide.csv")
    first, second = result["content"].split("\n")[:2]
    assert first == "a" * MAX_LINE_CHARS + " [... line cut: 3000 more characters ...]"
    assert second == "short"
    assert result["truncated"] is True


def test_empty_file_reads_as_no_lines(root: Path):
    (root / "empty.txt").write_bytes(b"")
    result = read_file(str(root), "empty.txt")
    assert (result["content"], result["total_lines"], result["size"], result["truncated"]) == ("", 0, 0, False)


def test_offset_past_the_end_is_a_clear_error(root: Path):
    (root / "three.txt").write_text("1\n2\n3\n")
    error = error_of(root, "three.txt", offset=4)
    assert (error.status, error.code) == (400, "offset_out_of_range")
    assert "has 3 lines" in error.message


def test_absolute_path_inside_the_root_and_paths_through_sessions(root: Path):
    (root / "sessions" / "s1" / "out.txt").write_text("hello\n")
    assert read_file(str(root), str(root / "sessions" / "s1" / "out.txt"))["content"] == "hello\n"
    assert read_file(str(root), "sessions/s1/../s1/out.txt")["content"] == "hello\n"


def test_symlink_that_stays_inside_is_followed(root: Path):
    (root / "user-files").mkdir()
    (root / "user-files" / "data.txt").write_text("inside\n")
    os.symlink("../user-files/data.txt", root / "sessions" / "link.txt")
    result = read_file(str(root), "sessions/link.txt")
    assert result["content"] == "inside\n"
    assert result["path"] == str(root / "user-files" / "data.txt")


# --- images and binaries -------------------------------------------------------------


@pytest.mark.parametrize(
    "name, data, mime",
    [("a.png", PNG, "image/png"), ("b.jpg", JPEG, "image/jpeg"), ("c.gif", GIF, "image/gif"), ("d.webp", WEBP, "image/webp")],
)
def test_images_come_back_as_base64_with_their_mime(root: Path, name: str, data: bytes, mime: str):
    (root / name).write_bytes(data)
    result = read_file(str(root), name)
    assert result["encoding"] == "base64"
    assert result["mime"] == mime
    assert base64.b64decode(result["content"]) == data
    assert result["size"] == len(data)


def test_images_are_recognised_by_magic_bytes_not_by_name(root: Path):
    (root / "plot.txt").write_bytes(PNG)
    assert read_file(str(root), "plot.txt")["mime"] == "image/png"
    (root / "fake.png").write_text("not really a png\n")
    assert read_file(str(root), "fake.png")["encoding"] == "utf-8"


def test_other_binary_files_are_refused_with_415_naming_size_and_mime(root: Path):
    (root / "archive.gz").write_bytes(b"\x1f\x8b\x08\x00" + bytes(range(256)) * 4)
    error = error_of(root, "archive.gz")
    assert (error.status, error.code) == (415, "binary_file")
    assert "application/gzip" in error.message and "1028 bytes" in error.message
    assert "raw=true" in error.hint


def test_non_utf8_text_counts_as_binary(root: Path):
    (root / "latin1.txt").write_bytes("café\n".encode("latin-1"))
    error = error_of(root, "latin1.txt")
    assert (error.status, error.code) == (415, "binary_file")
    assert "text/plain" in error.message


def test_raw_returns_any_file_as_base64(root: Path):
    data = b"\x00\x01binary\xff" * 10
    (root / "blob.bin").write_bytes(data)
    result = read_file(str(root), "blob.bin", raw=True)
    assert (result["encoding"], result["mime"]) == ("base64", "application/octet-stream")
    assert base64.b64decode(result["content"]) == data


# --- size caps ------------------------------------------------------------------------


def test_text_over_the_cap_is_refused_with_413(root: Path):
    (root / "big.log").write_text("x" * 99 + "\n" + "y" * 100)
    error = error_of(root, "big.log", max_text_bytes=100)
    assert (error.status, error.code) == (413, "too_large")
    assert "200 bytes" in error.message and "100-byte limit" in error.message
    assert read_file(str(root), "big.log", max_text_bytes=200)["total_lines"] == 2


def test_a_5_gb_file_is_refused_without_reading_it(root: Path):
    with open(root / "huge.txt", "wb") as f:
        f.truncate(5 << 30)  # sparse: costs no disk, reads as zero bytes
    error = error_of(root, "huge.txt")
    # The sniffed zero bytes make it binary; as raw it hits the cap.
    assert (error.status, error.code) == (415, "binary_file")
    error = error_of(root, "huge.txt", raw=True)
    assert (error.status, error.code) == (413, "too_large")
    assert str(5 << 30) in error.message


def test_a_5_gb_text_file_is_refused_without_reading_it(root: Path):
    with open(root / "huge.log", "wb") as f:
        f.write(b"text line\n" * 1000)
        f.truncate(5 << 30)
    error = error_of(root, "huge.log")
    assert (error.status, error.code) == (413, "too_large")
    assert "sed -n" in error.hint


def test_an_image_over_its_cap_is_refused(root: Path):
    (root / "big.png").write_bytes(PNG + bytes(1000))
    error = error_of(root, "big.png", max_image_bytes=500)
    assert (error.status, error.code) == (413, "too_large")


# --- what is not a readable file -------------------------------------------------------


def test_a_directory_is_a_clear_error(root: Path):
    error = error_of(root, "sessions")
    assert (error.status, error.code) == (400, "is_a_directory")


def test_a_missing_file_is_404(root: Path):
    error = error_of(root, "sessions/nope.txt")
    assert (error.status, error.code) == (404, "not_found")
    error = error_of(root, "nodir/nope.txt")
    assert (error.status, error.code) == (404, "not_found")


def test_a_fifo_is_refused_without_blocking(root: Path):
    os.mkfifo(root / "pipe")
    error = error_of(root, "pipe")
    assert (error.status, error.code) == (400, "not_a_regular_file")


@pytest.mark.parametrize(
    "path, message",
    [
        ("", "non-empty string"),
        (None, "non-empty string"),
        ("a\0b", "NUL"),
    ],
)
def test_bad_paths_are_400(root: Path, path, message: str):
    error = error_of(root, path)
    assert error.status == 400 and message in error.message


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"offset": 0}, "'offset' must be a whole number >= 1, got 0"),
        ({"offset": -3}, "'offset' must be a whole number >= 1, got -3"),
        ({"offset": "2"}, "'offset' must be a whole number >= 1, got '2'"),
        ({"offset": True}, "'offset' must be a whole number >= 1, got True"),
        ({"limit": 0}, "'limit' must be a whole number >= 1, got 0"),
        ({"limit": 1.5}, "'limit' must be a whole number >= 1, got 1.5"),
        ({"raw": "yes"}, "'raw' must be true or false, got 'yes'"),
    ],
)
def test_bad_arguments_are_400(root: Path, kwargs: dict, message: str):
    (root / "f.txt").write_text("x\n")
    error = error_of(root, "f.txt", **kwargs)
    assert (error.status, error.message) == (400, message)


# --- confinement ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "../bob/secret.txt",
        "../../secret.txt",
        "sessions/../../../secret.txt",
        "/etc/passwd",
        "/etc/../etc/hostname",
    ],
)
def test_paths_outside_the_tree_are_403(root: Path, path: str):
    error = error_of(root, path)
    assert (error.status, error.code) == (403, "outside_workspace")


def test_absolute_path_into_another_agent_is_403(root: Path):
    error = error_of(root, str(root.parent / "bob" / "secret.txt"))
    assert (error.status, error.code) == (403, "outside_workspace")
    assert "secret" not in error.hint


def test_symlinks_leading_out_are_403_at_any_depth(root: Path, tmp_path: Path):
    deep = root / "a" / "b" / "c"
    deep.mkdir(parents=True)
    os.symlink(tmp_path / "secret.txt", root / "abs-link.txt")
    os.symlink("../../../../../secret.txt", deep / "rel-link.txt")
    os.symlink(tmp_path, root / "a" / "escape-dir")
    os.symlink("../../../bob", root / "a" / "b" / "bob-dir")
    for path in ("abs-link.txt", "a/b/c/rel-link.txt", "a/escape-dir/secret.txt", "a/b/bob-dir/secret.txt"):
        error = error_of(root, path)
        assert (error.status, error.code) == (403, "outside_workspace"), path


def test_a_symlink_swapped_in_while_reading_never_leaks(root: Path, tmp_path: Path):
    """A thread flips a path between an inside file and a symlink out; no read ever leaks."""
    (root / "safe.txt").write_text("inside\n")
    os.symlink("safe.txt", root / "flip.txt")
    stop = threading.Event()

    def flipper():
        while not stop.is_set():
            for target in (tmp_path / "secret.txt", "safe.txt"):
                os.symlink(target, root / "tmp-link")
                os.replace(root / "tmp-link", root / "flip.txt")

    thread = threading.Thread(target=flipper)
    thread.start()
    outcomes = set()
    try:
        # Until both states were hit, so the race was really run.
        for _ in range(50_000):
            try:
                outcomes.add(read_file(str(root), "flip.txt")["content"])
            except GatewayError as e:
                outcomes.add(e.code)
            if {"inside\n", "outside_workspace"} <= outcomes:
                break
    finally:
        stop.set()
        thread.join()
    assert "host secret\n" not in outcomes
    assert {"inside\n", "outside_workspace"} <= outcomes <= {"inside\n", "outside_workspace", "not_found"}
