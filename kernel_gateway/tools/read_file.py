"""The ``read_file`` tool: read one file of an agent's tree, safely and in bounded size.

Text (UTF-8) comes back as lines ``offset .. offset+limit-1`` (1-based, as in
Codex's read_file), exactly as stored, without added line numbers; a line
longer than :data:`MAX_LINE_CHARS` is cut with a marker.  Images (PNG, JPEG,
GIF, WebP, recognised by their magic bytes) come back as base64 with their
MIME type.  Other binary files are refused with 415 unless ``raw=True`` asks
for base64.

The file is opened once, beneath the agent root (``openat2`` with
``RESOLVE_BENEATH``), so no ``..``, absolute path or symlink, not even one
swapped in while we look, can lead outside the tree; everything after that
works on the open descriptor.  At most ``max_bytes`` are ever read.
"""

from __future__ import annotations

import base64
import codecs
import errno
import mimetypes
import os
import stat

from ..errors import GatewayError, bad_request, not_found
from ..fs import PathOutsideRoot, fd_path, open_in_root, read_at_most

MAX_TEXT_BYTES = 10 << 20
MAX_IMAGE_BYTES = 10 << 20
MAX_RAW_BYTES = 10 << 20
MAX_LINE_CHARS = 2000
SNIFF_BYTES = 8192

IMAGE_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
)
BINARY_MAGIC = (
    (b"%PDF-", "application/pdf"),
    (b"PK\x03\x04", "application/zip"),
    (b"\x1f\x8b", "application/gzip"),
    (b"\x7fELF", "application/x-executable"),
)


def _image_mime(head: bytes) -> str | None:
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    return next((mime for magic, mime in IMAGE_MAGIC if head.startswith(magic)), None)


def _binary_mime(head: bytes, path: str) -> str:
    for magic, mime in BINARY_MAGIC:
        if head.startswith(magic):
            return mime
    return mimetypes.guess_type(path)[0] or "application/octet-stream"


def _looks_like_text(head: bytes) -> bool:
    """UTF-8 without NUL bytes; a character cut at the end of the sample is fine."""
    if b"\0" in head:
        return False
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return True


def _check_args(path: object, offset: object, limit: object, raw: object) -> None:
    if not isinstance(path, str) or not path:
        raise bad_request(f"'path' must be a non-empty string, got {path!r}")
    if "\0" in path:
        raise bad_request("'path' contains a NUL character")
    for name, value in (("offset", offset), ("limit", limit)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad_request(f"'{name}' must be a whole number >= 1, got {value!r}", "lines count from 1")
    if not isinstance(raw, bool):
        raise bad_request(f"'raw' must be true or false, got {raw!r}")


def _open(agent_root: str, path: str) -> int:
    try:
        # O_NONBLOCK: opening a FIFO the agent made must not hang the gateway.
        return open_in_root(agent_root, path, os.O_RDONLY | os.O_NONBLOCK)
    except PathOutsideRoot:
        raise GatewayError(
            403,
            "outside_workspace",
            f"{path!r} is outside the agent's workspace {agent_root}",
            "use a path relative to the agent root, or an absolute path inside it;"
            " symlinks must not lead out of it",
        ) from None
    except FileNotFoundError:
        raise not_found(f"no such file: {path!r}", "list the directory with the command tool") from None
    except NotADirectoryError:
        raise not_found(f"no such file: {path!r} (a part of the path is not a directory)") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise bad_request(f"{path!r} has too many levels of symlinks", code="symlink_loop") from None
        raise GatewayError(403, "permission_denied", f"cannot open {path!r}: {e.strerror}") from None


def _too_large(path: str, size: int, cap: int, what: str, hint: str) -> GatewayError:
    return GatewayError(
        413, "too_large", f"{path!r} is {size} bytes, over the {cap}-byte limit for {what}", hint
    )


def _split_lines(text: str) -> list[str]:
    """Lines with their endings; only "\\n" ends a line (a lone "\\r" stays inside it)."""
    lines = text.split("\n")
    last = lines.pop()
    lines = [line + "\n" for line in lines]
    if last:
        lines.append(last)
    return lines


def _cut_long_line(line: str) -> tuple[str, bool]:
    body = line.rstrip("\r\n")
    if len(body) <= MAX_LINE_CHARS:
        return line, False
    ending = line[len(body) :]
    marker = f" [... line cut: {len(body) - MAX_LINE_CHARS} more characters ...]"
    return body[:MAX_LINE_CHARS] + marker + ending, True


def read_file(
    agent_root: str,
    path: str,
    offset: int = 1,
    limit: int = 2000,
    raw: bool = False,
    *,
    max_text_bytes: int = MAX_TEXT_BYTES,
    max_image_bytes: int = MAX_IMAGE_BYTES,
    max_raw_bytes: int = MAX_RAW_BYTES,
) -> dict:
    """Read ``path`` (relative to ``agent_root`` unless absolute) as text, image or raw bytes."""
    _check_args(path, offset, limit, raw)
    fd = _open(agent_root, path)
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise bad_request(
                f"{path!r} is a directory", "list it with the command tool: ls", code="is_a_directory"
            )
        if not stat.S_ISREG(info.st_mode):
            raise bad_request(f"{path!r} is not a regular file", code="not_a_regular_file")
        # Back to blocking reads now that we know it is a regular file.
        os.set_blocking(fd, True)
        size = info.st_size
        head = os.pread(fd, SNIFF_BYTES, 0)
        image_mime = _image_mime(head)
        shown_path = fd_path(fd)  # the file actually opened

        if image_mime or raw or not _looks_like_text(head):
            mime = image_mime or _binary_mime(head, path)
            if not (image_mime or raw):
                raise GatewayError(
                    415,
                    "binary_file",
                    f"{path!r} is a binary file ({mime}, {size} bytes), not UTF-8 text",
                    "pass raw=true to get its bytes as base64",
                )
            cap = max_image_bytes if image_mime else max_raw_bytes
            data = read_at_most(fd, cap)
            if len(data) > cap:
                raise _too_large(
                    path, max(size, len(data)), cap, "base64 reads", "copy or convert it with the command tool"
                )
            return {
                "path": shown_path,
                "content": base64.b64encode(data).decode("ascii"),
                "encoding": "base64",
                "mime": mime,
                "size": len(data),
                "total_lines": None,
                "offset": None,
                "limit": None,
                "truncated": False,
            }

        data = read_at_most(fd, max_text_bytes)
        if len(data) > max_text_bytes:
            raise _too_large(
                path,
                max(size, len(data)),
                max_text_bytes,
                "text reads",
                "read a part of it with the command tool, e.g. sed -n '1,200p' FILE or tail -n 200 FILE",
            )
    finally:
        os.close(fd)

    lines = _split_lines(data.decode("utf-8", errors="replace"))
    if offset > max(len(lines), 1):
        raise bad_request(
            f"offset {offset} is past the end of {path!r}, which has {len(lines)} lines",
            code="offset_out_of_range",
        )
    window = lines[offset - 1 : offset - 1 + limit]
    shown = [_cut_long_line(line) for line in window]
    return {
        "path": shown_path,
        "content": "".join(text for text, _cut in shown),
        "encoding": "utf-8",
        "mime": mimetypes.guess_type(path)[0] or "text/plain",
        "size": len(data),
        "total_lines": len(lines),
        "offset": offset,
        "limit": limit,
        # More lines follow the window, or a line in it was cut.
        "truncated": offset - 1 + limit < len(lines) or any(cut for _text, cut in shown),
    }
