"""Pure-Python re-implementation of OpenAI Codex's ``apply_patch`` tool.

It reproduces the behaviour of the native ``apply_patch`` shipped in
``@openai/codex`` 0.171.0 (the pinned reference, see
``tests/apply_patch/get_reference.sh``): the same grammar and leniency, the
same four-pass line matching, the same order of application (hunks are applied
one by one, so a failing hunk leaves the earlier ones on disk), and the same
text.  The differential tests in ``tests/apply_patch`` hold it to that.

``PatchResult.output`` is exactly what the reference prints.  The reference
never prints to both streams in one run: on success (exit 0) it prints the
summary on stdout; on any failure (exit 1) it prints one message on stderr.
Error messages name files by their absolute, lexically normalised path
(``cwd`` joined with the patch path, ``.``/``..`` folded without touching the
disk, like the reference); the summary names them as written in the patch.

With ``root`` set, every path the patch touches is checked first (see
``kernel_gateway.fs``) and the patch is refused, unchanged, if any would leave
``root``; the files are then read and written through fds opened beneath
``root``.  That refusal text is ours: the reference has no confinement.

Reference behaviour worth knowing: context lines keep the file's own text
(only ``-``/``+`` runs are edited); pure additions go to the end of the file;
an ``*** End of File`` chunk must match exactly at the end; a moved file is
written, then its source removed (so moving onto itself deletes it); every
line of an updated file ends with a newline, in the style (LF or CRLF) of the
file's first line break; tabs and CRs inside a path are dropped.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field

from kernel_gateway import fs

# Rust's char::is_whitespace (Unicode White_Space); Python's str.strip() would
# also strip U+001C..U+001F, which Rust keeps.
_WS = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"

BEGIN, END = "*** Begin Patch", "*** End Patch"
ADD, DELETE, UPDATE = "*** Add File: ", "*** Delete File: ", "*** Update File: "
MOVE, EOF_MARK = "*** Move to: ", "*** End of File"
HEADERS = (ADD, DELETE, UPDATE)

# The last matching pass folds typographic punctuation and spaces to ASCII.
_PUNCT = str.maketrans(
    {
        **dict.fromkeys("\u2010\u2011\u2012\u2013\u2014\u2015\u2212", "-"),
        **dict.fromkeys("\u2018\u2019\u201a\u201b", "'"),
        **dict.fromkeys("\u201c\u201d\u201e\u201f", '"'),
        **dict.fromkeys(
            "\u00a0\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u202f\u205f\u3000",
            " ",
        ),
    }
)

# The reference is a static musl binary: where musl's strerror differs from
# glibc's (which os.strerror uses) we print musl's.
_MUSL_STRERROR = {40: "Symbolic link loop", 36: "Filename too long"}


@dataclass
class PatchResult:
    """`output` is the reference's text; the lists name files as the patch does
    (on failure: what was applied before the failing hunk, which stays on disk)."""

    ok: bool
    output: str
    added: list[str] = field(default_factory=list)
    modified: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)


class PatchError(Exception):
    """A failure whose message is printed verbatim by the reference."""


@dataclass
class Chunk:
    context: str | None
    # (" ", text) context, ("-", text) removed, ("+", text) added, in patch order
    lines: list[tuple[str, str]] = field(default_factory=list)
    eof: bool = False

    @property
    def old(self) -> list[str]:
        return [text for mark, text in self.lines if mark != "+"]

    @property
    def new(self) -> list[str]:
        return [text for mark, text in self.lines if mark != "-"]


@dataclass
class Hunk:
    kind: str  # "add" | "delete" | "update"
    path: str
    contents: str = ""
    move_to: str | None = None
    chunks: list[Chunk] = field(default_factory=list)


# ---------------------------------------------------------------- parsing


def _lines(text: str) -> list[str]:
    """Split on LF with every trailing CR dropped, and no final empty line."""
    parts = text.split("\n")
    if parts[-1] == "":
        parts.pop()
    return [p.rstrip("\r") for p in parts]


def _hunk_error(line_number: int, message: str) -> PatchError:
    return PatchError(f"Invalid patch hunk on line {line_number}: {message}")


def _check_boundaries(lines: list[str]) -> None:
    first = lines[0].strip(_WS) if lines else None
    last = lines[-1].strip(_WS) if lines else None
    if first == BEGIN and last == END:
        return
    if first is not None and first != BEGIN:
        raise PatchError("Invalid patch: The first line of the patch must be '*** Begin Patch'")
    raise PatchError("Invalid patch: The last line of the patch must be '*** End Patch'")


def parse_patch(patch: str) -> list[Hunk]:
    lines = _lines(patch.strip(_WS))
    try:
        _check_boundaries(lines)
    except PatchError:
        # Lenient mode: an argv that still carries its shell heredoc wrapper.
        if not (
            len(lines) >= 4
            and lines[0] in ("<<EOF", "<<'EOF'", '<<"EOF"')
            and lines[-1].endswith("EOF")
        ):
            raise
        lines = lines[1:-1]
        _check_boundaries(lines)
    hunks, body, line_number = [], lines[1:-1], 2
    while body:
        if body[0].strip(_WS) == END:
            # A second end marker (a doubled `*** End Patch`) ends the patch
            # when only blank lines follow it; anything else after it means
            # the first one was not the end, as the reference reports.
            if any(line.strip(_WS) for line in body[1:]):
                raise PatchError("Invalid patch: The last line of the patch must be '*** End Patch'")
            break
        hunk, used = _parse_hunk(body, line_number)
        hunks.append(hunk)
        body, line_number = body[used:], line_number + used
    return hunks


def _parse_hunk(lines: list[str], line_number: int) -> tuple[Hunk, int]:
    header = lines[0].strip(_WS)
    if header.startswith(ADD):
        used = 1
        while used < len(lines) and lines[used].startswith("+"):
            used += 1
        contents = "".join(line[1:] + "\n" for line in lines[1:used])
        return Hunk("add", header[len(ADD):], contents=contents), used
    if header.startswith(DELETE):
        return Hunk("delete", header[len(DELETE):]), 1
    if header.startswith(UPDATE):
        return _parse_update(lines, line_number, header[len(UPDATE):])
    raise _hunk_error(
        line_number,
        f"'{header}' is not a valid hunk header. Valid hunk headers: "
        "'*** Add File: {path}', '*** Delete File: {path}', '*** Update File: {path}'",
    )


def _parse_update(lines: list[str], line_number: int, path: str) -> tuple[Hunk, int]:
    hunk, i = Hunk("update", path), 1
    while i < len(lines):
        line = lines[i]
        # Before the first chunk: one Move to, and stray End of File lines
        # (skipped).  Blank lines after an End of File chunk are skipped too;
        # after any other chunk an empty line is context and a whitespace-only
        # one starts the next chunk (and fails without its @@), as in the reference.
        if not hunk.chunks and hunk.move_to is None and line.rstrip(_WS).startswith(MOVE):
            hunk.move_to = line.rstrip(_WS)[len(MOVE):]
            i += 1
            continue
        if (not hunk.chunks and line.rstrip(_WS) == EOF_MARK) or (
            hunk.chunks and hunk.chunks[-1].eof and not line.strip(_WS)
        ):
            i += 1
            continue
        if line.startswith(HEADERS) or line.rstrip(_WS) == END:
            break
        chunk, used = _parse_chunk(lines[i:], line_number + i, first=not hunk.chunks)
        hunk.chunks.append(chunk)
        i += used
    if not hunk.chunks:
        raise _hunk_error(line_number, f"Update file hunk for path '{path}' is empty")
    return hunk, i


def _parse_chunk(lines: list[str], line_number: int, first: bool) -> tuple[Chunk, int]:
    head = lines[0].rstrip(_WS)
    if head == "@@":
        chunk, start = Chunk(None), 1
    elif head.startswith("@@ "):
        chunk, start = Chunk(head[3:]), 1
    elif first:
        chunk, start = Chunk(None), 0
    else:
        raise _hunk_error(
            line_number,
            f"Expected update hunk to start with a @@ context marker, got: '{lines[0]}'",
        )
    if start >= len(lines):
        raise _hunk_error(line_number + 1, "Update hunk does not contain any lines")
    parsed = 0
    for line in lines[start:]:
        if line.rstrip(_WS) == END:
            break  # an inner end marker ends the chunk, as the end of the patch does
        if line.rstrip(_WS) == EOF_MARK:
            if parsed == 0:
                raise _hunk_error(line_number + 1, "Update hunk does not contain any lines")
            chunk.eof = True
            parsed += 1
            break
        marker, text = line[:1] or " ", line[1:]
        if marker in " +-":
            chunk.lines.append((marker, text))
        elif parsed == 0:
            raise _hunk_error(
                line_number + start,
                f"Unexpected line found in update hunk: '{line}'. Every line should start "
                "with ' ' (context line), '+' (added line), or '-' (removed line)",
            )
        else:
            break
        parsed += 1
    if parsed == 0:
        raise _hunk_error(line_number + 1, "Update hunk does not contain any lines")
    return chunk, start + parsed


# ---------------------------------------------------------------- matching


def seek_sequence(lines: list[str], pattern: list[str], start: int, eof: bool) -> int | None:
    """Index where `pattern` occurs in `lines` at or after `start`, trying four
    ever looser comparisons; an end-of-file pattern may only match at the end."""
    if not pattern:
        return start
    if len(pattern) > len(lines):
        return None
    first = max(start, len(lines) - len(pattern)) if eof else start
    candidates = range(first, len(lines) - len(pattern) + 1)
    for norm in (
        lambda s: s,
        lambda s: s.rstrip(_WS),
        lambda s: s.strip(_WS),
        lambda s: s.strip(_WS).translate(_PUNCT),
    ):
        want = [norm(p) for p in pattern]
        for i in candidates:
            if all(norm(lines[i + k]) == w for k, w in enumerate(want)):
                return i
    return None


def _without_final_newline(lines: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Drop the last old line, and the last new line if it is empty: a trailing
    empty line in a chunk stands for the file's final newline."""
    lines = list(lines)
    for side, other in (("-", "+"), ("+", "-")):
        i = max(i for i, (mark, _) in enumerate(lines) if mark != other)
        if side == "+" and lines[i][1] != "":
            break
        mark, text = lines[i]
        if mark == " ":  # a context line leaves only the other side
            lines[i] = (other, text)
        else:
            del lines[i]
        if not any(mark != "-" for mark, _ in lines):
            break
    return lines


def _edits(start: int, lines: list[tuple[str, str]]) -> list[tuple]:
    """(file index, lines removed, lines added) for each run of -/+ lines;
    context lines are left untouched, so the file keeps its own text there."""
    out, pos, run_start, removed, added = [], start, start, 0, []
    for mark, text in lines + [(" ", "")]:
        if mark == " ":
            if removed or added:
                out.append((run_start, removed, added))
            pos += 1
            run_start, removed, added = pos, 0, []
        elif mark == "-":
            removed += 1
            pos += 1
        else:
            added = added + [text]
    return out


def _replacements(lines: list[str], chunks: list[Chunk], shown: str) -> list[tuple]:
    out, index = [], 0
    for chunk in chunks:
        if chunk.context is not None:
            found = seek_sequence(lines, [chunk.context], index, False)
            if found is None:
                raise PatchError(f"Failed to find context '{chunk.context}' in {shown}")
            index = found + 1
        if not chunk.old:  # pure addition: appended at the end of the file
            out.append((len(lines), 0, chunk.new))
            continue
        ops = chunk.lines
        found = seek_sequence(lines, chunk.old, index, chunk.eof)
        if found is None and chunk.old[-1] == "":
            ops = _without_final_newline(ops)
            found = seek_sequence(lines, [t for m, t in ops if m != "+"], index, chunk.eof)
        if found is None:
            raise PatchError(
                f"Failed to find expected lines in {shown}:\n" + "\n".join(chunk.old)
            )
        out += _edits(found, ops)
        index = found + sum(mark != "+" for mark, _ in ops)
    return sorted(out, key=lambda r: r[0])


def _apply_chunks(original: str, chunks: list[Chunk], shown: str) -> str:
    # Each line keeps its own ending; new lines, and a last line that had
    # none, take the ending of the file's first line break (LF by default).
    texts, endings = [], []
    for piece in original.split("\n")[:-1]:
        crlf = piece.endswith("\r")
        texts.append(piece[:-1] if crlf else piece)
        endings.append("\r\n" if crlf else "\n")
    tail = original.rsplit("\n", 1)[-1]
    if tail:
        texts.append(tail)
        endings.append(None)
    preferred = endings[0] if endings and endings[0] else "\n"
    result, pos = [], 0
    for start, length, new in _replacements(texts, chunks, shown):
        result += zip(texts[pos:start], endings[pos:start])
        result += ((text, preferred) for text in new)
        pos = start + length
    result += zip(texts[pos:], endings[pos:])
    return "".join(text + (ending or preferred) for text, ending in result)


# ---------------------------------------------------------------- filesystem


def _normalise(cwd: str, path: str) -> str:
    """cwd joined with path, `.` and `..` folded lexically, tabs and CRs
    dropped (as the reference does; its summary still shows them)."""
    parts: list[str] = []
    for part in os.path.join(cwd, path.replace("\t", "").replace("\r", "")).split("/"):
        if part == "..":
            parts = parts[:-1]
        elif part not in ("", "."):
            parts.append(part)
    return "/" + "/".join(parts)


def _os_error(err: OSError) -> str:
    text = _MUSL_STRERROR.get(err.errno) or os.strerror(err.errno)
    return f"{text} (os error {err.errno})"


def _utf8_error(err: UnicodeDecodeError) -> str:
    if err.reason == "unexpected end of data":
        return f"incomplete utf-8 byte sequence from index {err.start}"
    return f"invalid utf-8 sequence of {err.end - err.start} bytes from index {err.start}"


class _Files:
    """Plain filesystem access, as the reference does it."""

    def open(self, path: str, flags: int) -> int:
        return os.open(path, flags, 0o666)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def unlink(self, path: str) -> None:
        os.unlink(path)


class _ConfinedFiles(_Files):
    """Every access resolved beneath `root` (openat2 or an O_NOFOLLOW walk)."""

    def __init__(self, root: str, refuse=None):
        self.root = root
        self.refuse = refuse  # refuse(physical path): paths this patch may not write

    def open(self, path: str, flags: int) -> int:
        if self.refuse is not None and flags & (os.O_WRONLY | os.O_RDWR):
            return fs.open_in_root_unless(self.root, path, flags, self.refuse, 0o666)
        return fs.open_in_root(self.root, path, flags, 0o666)

    def makedirs(self, path: str) -> None:
        fs.mkdirs_in_root(self.root, path)

    def unlink(self, path: str) -> None:
        if self.refuse is not None:
            fs.unlink_in_root_unless(self.root, path, self.refuse)
        else:
            fs.unlink_in_root(self.root, path)


MAX_UPDATE_BYTES = 256 << 20


def _read_text(files: _Files, path: str) -> str:
    try:
        # O_NONBLOCK: a FIFO in the agent's tree must not hang the gateway (it is refused below).
        fd = files.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise PatchError(f"Failed to read file to update {path}: path `{path}` is not a file")
            if info.st_size > MAX_UPDATE_BYTES:  # the gateway holds the file in memory
                raise PatchError(f"Failed to read file to update {path}: larger than {MAX_UPDATE_BYTES} bytes")
            with os.fdopen(os.dup(fd), "rb") as f:
                data = f.read()
        finally:
            os.close(fd)
        return data.decode("utf-8")
    except OSError as err:
        raise PatchError(f"Failed to read file to update {path}: {_os_error(err)}") from err
    except UnicodeDecodeError as err:
        raise PatchError(f"Failed to read file to update {path}: {_utf8_error(err)}") from err


def _write_text(files: _Files, path: str, text: str) -> None:
    try:
        try:  # the reference ignores a failure here; the write then reports it
            files.makedirs(os.path.dirname(path))
        except OSError:
            pass
        # O_NONBLOCK: opening a FIFO for writing fails at once (ENXIO) instead of waiting for a reader.
        fd = files.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode("utf-8"))
    except OSError as err:
        raise PatchError(f"Failed to write file {path}") from err


def _unlink(files: _Files, path: str, what: str) -> None:
    try:
        files.unlink(path)
    except OSError as err:
        raise PatchError(f"{what} {path}") from err


def _apply(hunks: list[Hunk], cwd: str, files: _Files, result: PatchResult) -> None:
    for hunk in hunks:
        path = _normalise(cwd, hunk.path)
        if hunk.kind == "add":
            _write_text(files, path, hunk.contents)
            result.added.append(hunk.path)
        elif hunk.kind == "delete":
            _unlink(files, path, "Failed to delete file")
            result.deleted.append(hunk.path)
        else:
            text = _apply_chunks(_read_text(files, path), hunk.chunks, path)
            if hunk.move_to is None:
                _write_text(files, path, text)
                result.modified.append(hunk.path)
            else:  # written, then the source removed: a move onto itself deletes it
                _write_text(files, _normalise(cwd, hunk.move_to), text)
                _unlink(files, path, "Failed to remove original")
                result.modified.append(hunk.move_to)


def _check_confined(hunks: list[Hunk], cwd: str, root: str) -> None:
    for hunk in hunks:
        for raw in filter(None, (hunk.path, hunk.move_to)):
            try:
                fs.resolve_in_root(root, _normalise(cwd, raw))
            except fs.PathOutsideRoot as err:  # name it as the patch does
                raise fs.PathOutsideRoot(raw, root) from err


def apply_patch(
    patch: str, cwd: str | os.PathLike, root: str | os.PathLike | None = None, refuse=None
) -> PatchResult:
    """Apply `patch` relative to `cwd` exactly as the reference `apply_patch` would.

    With `root`, ``refuse(physical path)`` may name paths beneath it that no
    write or delete may touch (checked on what is actually opened).
    """
    # The reference resolves against getcwd(), i.e. the physical directory.
    cwd = os.path.realpath(cwd)
    result = PatchResult(ok=False, output="")
    try:
        hunks = parse_patch(patch)
        if not hunks:
            raise PatchError("No files were modified.")
        files = _Files()
        if root is not None:
            _check_confined(hunks, cwd, os.fspath(root))
            files = _ConfinedFiles(os.fspath(root), refuse)
        _apply(hunks, cwd, files, result)
    except PatchError as err:
        result.output = f"{err}\n"
        return result
    except fs.PathOutsideRoot as err:
        result.output = f"Refused: {err}\n"
        return result
    lines = [f"A {p}" for p in result.added] + [f"M {p}" for p in result.modified]
    lines += [f"D {p}" for p in result.deleted]
    result.ok = True
    result.output = "Success. Updated the following files:\n" + "".join(l + "\n" for l in lines)
    return result
