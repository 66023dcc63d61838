"""IPython extension that bounds cell output at its source, inside the kernel.

ipykernel can send one 50 MB ``print`` as a single iopub message, so a bound
applied in the gateway comes too late.  Loaded into every gateway kernel
(``--IPKernelApp.extensions=['kernel_gateway.kernel_ext']``), this extension
keeps large payloads from ever crossing ZMQ:

* Streams (stdout/stderr, including fd-level output that ipykernel's pipe
  watcher feeds into the same ``OutStream.write``): the first half of the limit
  passes through live; after that only a rolling tail of half the limit stays
  in memory while the full text goes to ``cell-<n>-<stream>.txt``.  When the
  cell ends, a marker ``[... N bytes cut: full output in <path> ...]``, the
  tail and a one-line footer naming the file again are emitted (a reader of
  only the end, ``| tail``, learns where the rest went).  Output between cells (background threads) is closed at
  the next cell's start; a forked child, which sees no cell end, says where
  its output went as soon as it cuts.
* Rich results (display_data, execute_result): binary mimetypes are written
  to artifact files ``cell-<n>-<k>.<ext>`` and replaced by a reference under
  ``application/vnd.kernel-gateway.artifact+json``; text larger than the limit
  is cut to head + marker + tail (+ the footer, for text/plain), the full text spilled to
  ``cell-<n>-out-<k>.<ext>``; JSON values and SVG larger than the limit become
  artifacts (cutting them would leave something that no longer parses).
* The whole cell has a budget too, over every stream and result together
  (``KERNEL_GATEWAY_CELL_OUTPUT_LIMIT``, default four times the limit): a
  thousand displays of 40 KB each pass the per-output bound one by one.  Past
  the budget, results are not sent: each goes as one JSON line into
  ``cell-<n>-outputs.jsonl`` and, when the cell ends, one marker says how
  many went there.  ``clear_output`` gives the budget back.
* Every cut is announced with a display_data whose only data is
  ``application/vnd.kernel-gateway.truncation+json``.

``<n>`` is the execution count the execute_reply reports.  Files are created
exclusively: when a name is taken (a restarted kernel counts from 1 again,
``store_history=False`` cells share a count) the next free number is used.

``input()`` needs nothing here: the gateway sends ``allow_stdin=False`` and
ipykernel then raises ``StdinNotImplementedError`` at once.

Configuration, from the environment the gateway gives the kernel:
``KERNEL_GATEWAY_OUTPUT_LIMIT`` (bytes kept per stream or result per cell,
head + tail; default 65536), ``KERNEL_GATEWAY_CELL_OUTPUT_LIMIT`` (bytes sent
per cell in all; default four times that) and ``KERNEL_GATEWAY_OUTPUT_DIR``
(default ``<cwd>/outputs``).

A failure in here must never break the kernel or reach user code: every hook
catches its errors, reports them once on the kernel's own stderr, and lets the
output through as ipykernel would have sent it.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import struct
import sys
import termios
import threading
import time
import traceback
from typing import Any, BinaryIO, Callable

DEFAULT_LIMIT = 65536
ARTIFACT_MIME = "application/vnd.kernel-gateway.artifact+json"
TRUNCATION_MIME = "application/vnd.kernel-gateway.truncation+json"
BINARY_MIMES = {"image/png", "image/jpeg", "image/gif", "image/webp", "application/pdf"}
SVG_MIME = "image/svg+xml"
EXTENSIONS = {
    "image/png": "png",
    "image/jpeg": "jpg",
    "image/gif": "gif",
    "image/webp": "webp",
    "application/pdf": "pdf",
    SVG_MIME: "svg",
    "text/plain": "txt",
    "text/html": "html",
    "text/markdown": "md",
    "text/latex": "tex",
    "application/javascript": "js",
    "text/javascript": "js",
}
# Upper bound on how long a finishing cell waits for fd-level output that is
# already in ipykernel's pipe; a background process writing forever must not
# hold every cell up for long.
FD_DRAIN_TIMEOUT = 1.0
# Spill writes are gathered up to this size; our own buffer (not the file
# object's) so that a forked child can drop what belongs to its parent.
SPILL_BUFFER = 1 << 16
# Large stream writes are encoded and spilled in slices so that bounding one
# 100 MB print never needs a second 100 MB copy.
SLICE_CHARS = 1 << 20

_reported: set[str] = set()


def _log(text: str) -> None:
    """Write to the kernel's real stderr (what the gateway logs), never to a client.

    Not ``sys.stderr``: that is the bounded stream itself, and fd 2 is
    ipykernel's pipe back into it.
    """
    fd = getattr(sys.stderr, "_original_stdstream_copy", None)
    try:
        os.write(fd if fd is not None else 2, f"kernel_gateway.kernel_ext: {text}\n".encode("utf-8", "replace"))
    except OSError:
        pass


def _report_failure(where: str) -> None:
    """Log the current exception, once per place, so a broken hook cannot flood the log."""
    if where not in _reported:
        _reported.add(where)
        _log(f"{where} failed\n{traceback.format_exc()}")


def output_limit(environ: dict[str, str]) -> int:
    """``KERNEL_GATEWAY_OUTPUT_LIMIT`` as an int >= 2; the default if unset or bad."""
    raw = environ.get("KERNEL_GATEWAY_OUTPUT_LIMIT", "")
    if raw.strip().isdigit() and int(raw) >= 2:
        return int(raw)
    if raw:
        _log(f"KERNEL_GATEWAY_OUTPUT_LIMIT={raw!r} is not an integer >= 2; using {DEFAULT_LIMIT}")
    return DEFAULT_LIMIT


def char_start(data: bytes | bytearray, index: int) -> int:
    """The largest index <= ``index`` that does not fall inside a UTF-8 character."""
    while 0 < index < len(data) and data[index] & 0xC0 == 0x80:
        index -= 1
    return index


def cut_marker(cut_bytes: int, path: str | None) -> str:
    where = f"full output in {path}" if path else "full output could not be saved"
    return f"\n[... {cut_bytes} bytes cut: {where} ...]\n"


def cut_footer(cut_bytes: int, total_bytes: int, path: str | None) -> str:
    """The last line of a cut output: what is missing and where all of it is."""
    where = f"full output in {path}" if path else "the full output could not be saved"
    return f"[output cut: {cut_bytes} of {total_bytes} bytes not shown; {where}]\n"


def output_dir() -> str:
    """Looked up per cell: a spare kernel moves into its session after the extension loaded."""
    return os.path.abspath(os.environ.get("KERNEL_GATEWAY_OUTPUT_DIR") or "outputs")


class OutputFiles:
    """Names and creates the spill and artifact files of the running cell."""

    def __init__(self) -> None:
        self.directory = output_dir()
        self.execution_count = 0
        self.next_index = 1
        self._lock = threading.Lock()

    def after_fork_in_child(self) -> None:
        self._lock = threading.Lock()  # the parent's may be held by one of its threads

    def start_cell(self, execution_count: int) -> None:
        with self._lock:
            self.execution_count = execution_count
            self.next_index = 1
            self.directory = output_dir()

    def create_stream_file(self, stream_name: str, ext: str = "txt") -> tuple[str, BinaryIO]:
        stem = f"cell-{self.execution_count}-{stream_name}"
        _, path, file = self._create(lambda i: f"{stem}.{ext}" if i == 1 else f"{stem}-{i}.{ext}", 1)
        return path, file

    def create_numbered(self, prefix: str, ext: str) -> tuple[str, BinaryIO]:
        """``cell-<n>-<prefix><k>.<ext>`` with the cell's next free ``k``."""
        stem = f"cell-{self.execution_count}-{prefix}"
        with self._lock:
            number, path, file = self._create(lambda k: f"{stem}{k}.{ext}", self.next_index)
            self.next_index = number + 1
        return path, file

    def _create(self, name: Callable[[int], str], first: int) -> tuple[int, str, BinaryIO]:
        os.makedirs(self.directory, exist_ok=True)
        number = first
        while True:
            path = os.path.join(self.directory, name(number))
            try:
                return number, path, open(path, "xb", buffering=0)
            except FileExistsError:
                number += 1

    def write_new(self, prefix: str, ext: str, data: bytes) -> str:
        path, file = self.create_numbered(prefix, ext)
        with file:
            file.write(data)
        return path


class StreamBound:
    """Installed as ``write`` of one ipykernel OutStream: head live, tail kept, all spilled."""

    def __init__(self, stream: Any, limit: int, files: OutputFiles, announce: Callable[[dict], None]):
        self.stream = stream
        self.name = stream.name
        self.downstream = stream.write
        self.head_size = limit // 2
        self.tail_size = limit - self.head_size
        self.files = files
        self.announce = announce
        # The fd watcher thread writes too.
        self._lock = threading.RLock()
        self.spill_buffer_size = SPILL_BUFFER
        self.in_forked_child = False
        self._start_window()

    def after_fork_in_child(self) -> None:
        """Start over in a forked child (multiprocessing, say).

        The parent's lock may be held by one of its threads and its spill file
        and buffer are the parent's.  No cell ends in a child, so its spill
        is written through and its marker goes out as soon as it cuts.
        """
        self._lock = threading.RLock()
        if self.spill is not None:
            self.spill.close()  # unbuffered: closes the child's fd, writes nothing
        self.spill_buffer_size = 0
        self.in_forked_child = True
        self._start_window()

    def _start_window(self) -> None:
        self.total_bytes = 0
        self.head = bytearray()
        self.head_bytes = 0
        self.tail = bytearray()
        self.cutting = False
        self.spill: BinaryIO | None = None
        self.spill_path: str | None = None
        self.spill_buffer = bytearray()

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            return self.downstream(text)  # ipykernel's own TypeError
        try:
            with self._lock:
                if len(text) <= SLICE_CHARS:
                    self._accept(text.encode("utf-8", "replace"), text)
                else:
                    for start in range(0, len(text), SLICE_CHARS):
                        self._accept(text[start : start + SLICE_CHARS].encode("utf-8", "replace"), None)
        except Exception:
            _report_failure(f"bounding {self.name}")
            return self.downstream(text)
        return len(text)

    def _accept(self, data: bytes, text: str | None) -> None:
        self.total_bytes += len(data)
        if not self.cutting:
            room = self.head_size - len(self.head)
            if len(data) <= room:
                self.head += data
                self.downstream(text if text is not None else data.decode("utf-8", "replace"))
                return
            split = char_start(data, room)
            if split:
                self.head += data[:split]
                self.downstream(data[:split].decode("utf-8", "replace"))
            self._start_cutting()
            data = data[split:]
        if self.spill is not None:
            self._spill(data)
        self.tail += data[-self.tail_size :]
        del self.tail[: -self.tail_size]

    def _start_cutting(self) -> None:
        self.cutting = True
        self.head_bytes = len(self.head)
        try:
            self.spill_path, self.spill = self.files.create_stream_file(self.name)
        except OSError:
            _report_failure(f"creating the {self.name} spill file")
        else:
            self._spill(bytes(self.head))
        self.head = bytearray()  # it is on disk now; keep only its length
        if self.in_forked_child:
            where = f"in {self.spill_path}" if self.spill_path else "not saved"
            self.downstream(f"\n[... output of process {os.getpid()} beyond {self.head_bytes} bytes {where} ...]\n")

    def _spill(self, data: bytes) -> None:
        self.spill_buffer += data
        if len(self.spill_buffer) > self.spill_buffer_size:
            self._flush_spill()

    def _flush_spill(self) -> None:
        pending, self.spill_buffer = memoryview(self.spill_buffer), bytearray()
        try:
            while pending:
                pending = pending[self.spill.write(pending) :]
        except OSError:  # disk full, or the sandbox's file size limit
            _report_failure(f"writing {self.spill_path}")
            self._drop_spill()

    def _close_spill(self) -> None:
        self._flush_spill()
        if self.spill is not None:
            self.spill.close()

    def _drop_spill(self) -> None:
        """Give up on an incomplete spill file: the marker must not promise the full output."""
        self.spill.close()
        try:
            os.unlink(self.spill_path)
        except OSError:
            pass
        self.spill, self.spill_path = None, None

    def finish(self) -> None:
        """Close the current window: emit marker and tail, announce the cut, start afresh."""
        with self._lock:
            try:
                if self.cutting:
                    self._emit_cut()
            except Exception:
                _report_failure(f"finishing {self.name}")
            finally:
                self._start_window()

    def _emit_cut(self) -> None:
        if self.spill is not None:
            self._close_spill()
        tail = self.tail[self._tail_start() :]
        cut_bytes = self.total_bytes - self.head_bytes - len(tail)
        if cut_bytes == 0:
            # Between half and the whole limit: everything fits after all.
            if self.spill_path:
                os.unlink(self.spill_path)
            self.downstream(tail.decode("utf-8", "replace"))
            return
        # The head goes out in its own message, so no message exceeds the limit.
        self.stream.flush()
        self.downstream(cut_marker(cut_bytes, self.spill_path))
        tail_text = tail.decode("utf-8", "replace")
        self.downstream(tail_text + ("" if tail_text.endswith("\n") else "\n")
                        + cut_footer(cut_bytes, self.total_bytes, self.spill_path))
        self.announce(
            {
                "kind": "stream",
                "name": self.name,
                "cut_bytes": cut_bytes,
                "total_bytes": self.total_bytes,
                "path": self.spill_path,
            }
        )

    def _tail_start(self) -> int:
        start = 0
        while start < len(self.tail) and self.tail[start] & 0xC0 == 0x80:
            start += 1
        return start


def wait_for_fd_pipe(stream: Any) -> None:
    """Let ipykernel's watcher thread take in fd-level output already in its pipe.

    ``os.system`` and C code write to fd 1/2, which ipykernel redirects into a
    pipe read by a thread; what is still in the pipe when the cell ends would
    otherwise land in the next window.
    """
    fid = getattr(stream, "_fid", None)
    if fid is None or not getattr(stream, "_should_watch", False):
        return
    deadline = time.monotonic() + FD_DRAIN_TIMEOUT
    while time.monotonic() < deadline:
        pending = struct.unpack("i", fcntl.ioctl(fid, termios.FIONREAD, b"\0\0\0\0"))[0]
        if not pending:
            return
        time.sleep(0.005)


class ResultBound:
    """Turns a mime bundle into one that is small: artifacts for binaries, cuts for big text."""

    def __init__(self, limit: int, files: OutputFiles, announce: Callable[[dict], None]):
        self.limit = limit
        self.files = files
        self.announce = announce

    def bound(self, data: dict[str, Any]) -> dict[str, Any]:
        bounded: dict[str, Any] = {}
        artifacts = []
        for mime, value in data.items():
            if _is_binary(mime):
                raw = value if isinstance(value, bytes) else base64.b64decode(value)
                artifacts.append(self._artifact(mime, raw))
            elif isinstance(value, str):
                encoded = value.encode("utf-8", "replace")
                if len(encoded) <= self.limit:
                    bounded[mime] = value
                elif mime == SVG_MIME:
                    artifacts.append(self._artifact(mime, encoded))
                else:
                    bounded[mime] = self._cut_text(mime, encoded)
            else:
                encoded = json.dumps(value).encode("utf-8", "replace")
                if len(encoded) <= self.limit:
                    bounded[mime] = value
                else:
                    artifacts.append(self._artifact(mime, encoded))
        if artifacts:
            # One artifact is the common case and keeps the documented shape;
            # further ones (say png + pdf of one figure) ride along in "more".
            reference = dict(artifacts[0])
            if len(artifacts) > 1:
                reference["more"] = artifacts[1:]
            bounded[ARTIFACT_MIME] = reference
        return bounded

    def _artifact(self, mime: str, raw: bytes) -> dict[str, Any]:
        ext = EXTENSIONS.get(mime, "json" if mime.endswith("json") else "bin")
        path = self.files.write_new("", ext, raw)
        return {"mime": mime, "path": path, "size": len(raw)}

    def _cut_text(self, mime: str, encoded: bytes) -> str:
        head = encoded[: char_start(encoded, self.limit // 2)]
        tail = encoded[char_start(encoded, len(encoded) - (self.limit - self.limit // 2)) :]
        cut_bytes = len(encoded) - len(head) - len(tail)
        try:
            path = self.files.write_new("out-", EXTENSIONS.get(mime, "txt"), encoded)
        except OSError:
            _report_failure(f"spilling a large {mime} result")
            path = None
        self.announce(
            {"kind": "result", "name": mime, "cut_bytes": cut_bytes, "total_bytes": len(encoded), "path": path}
        )
        text = head.decode("utf-8", "replace") + cut_marker(cut_bytes, path) + tail.decode("utf-8", "replace")
        if mime == "text/plain":  # a footer in HTML or JSON text would change what it is
            text += ("" if text.endswith("\n") else "\n") + cut_footer(cut_bytes, len(encoded), path).rstrip("\n")
        return text


def cell_output_limit(environ: dict[str, str], limit: int) -> int:
    """``KERNEL_GATEWAY_CELL_OUTPUT_LIMIT`` as an int >= 2; four times ``limit`` if unset or bad."""
    raw = environ.get("KERNEL_GATEWAY_CELL_OUTPUT_LIMIT", "")
    if raw.strip().isdigit() and int(raw) >= 2:
        return int(raw)
    if raw:
        _log(f"KERNEL_GATEWAY_CELL_OUTPUT_LIMIT={raw!r} is not an integer >= 2; using {4 * limit}")
    return 4 * limit


class CellBudget:
    """Bytes of output one cell may send, every kind together; past it results go to a file."""

    def __init__(self, limit: int, files: OutputFiles):
        self.limit = limit
        self.files = files
        self._lock = threading.Lock()
        self.start_cell()

    def start_cell(self) -> None:
        self.used = 0
        self.over_count = 0
        self.over_bytes = 0
        self.spill: BinaryIO | None = None
        self.spill_path: str | None = None
        self.spill_failed = False

    def after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self.spill = None  # the parent's file; a child's results over budget are dropped
        self.spill_failed = True

    def count(self, size: int) -> None:
        """Output that goes out whatever happens (streams, already bounded on their own)."""
        with self._lock:
            self.used += size

    def give_back(self) -> None:
        """``clear_output``: what was sent is gone from the client's view."""
        with self._lock:
            self.used = 0

    def full(self) -> bool:
        return self.used >= self.limit

    def take(self, output: dict[str, Any]) -> bool:
        """True if ``output`` fits and may be sent; else it is written to the cell's file."""
        line = json.dumps(output, default=repr).encode("utf-8", "replace") + b"\n"
        with self._lock:
            if self.used + len(line) <= self.limit:
                self.used += len(line)
                return True
            self.over_count += 1
            self.over_bytes += len(line)
            if self.spill is None and not self.spill_failed:
                try:
                    self.spill_path, self.spill = self.files.create_stream_file("outputs", "jsonl")
                except OSError:
                    _report_failure("creating the cell's output file")
                    self.spill_failed = True
            if self.spill is not None:
                try:
                    self.spill.write(line)
                except OSError:  # disk full: the marker must not promise the file
                    _report_failure(f"writing {self.spill_path}")
                    self.spill.close()
                    self.spill, self.spill_failed = None, True
            return False

    def finish(self) -> dict[str, Any] | None:
        """Close the cell's file; the marker's mime bundle and cut note if anything went over."""
        with self._lock:
            if self.spill is not None:
                self.spill.close()
            if not self.over_count:
                return None
            path = None if self.spill_failed else self.spill_path
            where = f"saved to {path}" if path else "not saved"
            text = (
                f"[... {self.over_count} outputs ({self.over_bytes} bytes) past this cell's output budget of "
                f"{self.limit} bytes: {where} ...]"
            )
            note = {"kind": "cell", "name": "outputs", "cut_bytes": self.over_bytes,
                    "total_bytes": self.used + self.over_bytes, "path": path}
            return {"text": text, "note": note}


def _is_binary(mime: str) -> bool:
    return mime in BINARY_MIMES or (mime.startswith("image/") and mime != SVG_MIME)


class OutputBounds:
    """The extension's state in one kernel and the hooks it installs.

    There is no unloading: IPython's history tee (see ``_skip_history_tee``)
    restores whatever ``write`` it found when its cell ends, so taking the
    hooks out from inside a cell cannot be done cleanly.
    """

    def __init__(self, shell: Any, limit: int):
        self.shell = shell
        self.files = OutputFiles()
        self.display_pub = shell.display_pub
        self.displayhook = shell.displayhook
        self.original_publish = self.display_pub.publish
        self.original_write_format_data = self.displayhook.write_format_data
        self.results = ResultBound(limit, self.files, self.announce)
        self.budget = CellBudget(cell_output_limit(os.environ, limit), self.files)
        self.original_clear_output = self.display_pub.clear_output
        self.streams = [
            StreamBound(stream, limit, self.files, self.announce)
            for stream in (sys.stdout, sys.stderr)
            if hasattr(stream, "session") and hasattr(stream, "name")  # ipykernel OutStreams only
        ]
        for bound in self.streams:
            bound.downstream = self._counted(bound.downstream)
        self.depth = 0  # run_cell can be nested from user code; only the outer one is the cell

    def install(self) -> None:
        for bound in self.streams:
            bound.stream.write = bound.write
        self.display_pub.publish = self.publish
        self.display_pub.clear_output = self.clear_output
        self.displayhook.write_format_data = self.write_format_data
        self.shell.events.register("pre_execute", self.pre_execute)
        self.shell.events.register("post_execute", self.post_execute)
        os.register_at_fork(after_in_child=self.after_fork_in_child)

    def after_fork_in_child(self) -> None:
        self.files.after_fork_in_child()
        self.budget.after_fork_in_child()
        for bound in self.streams:
            bound.after_fork_in_child()

    def announce(self, cut: dict[str, Any]) -> None:
        self.original_publish(data={TRUNCATION_MIME: cut}, metadata={})

    def pre_execute(self) -> None:
        self.depth += 1
        if self.depth > 1:
            return
        try:
            for bound in self.streams:
                bound.finish()  # output that came between cells
                self._skip_history_tee(bound)
            # ipykernel reports execution_count - 1 in the reply, whether or
            # not the cell is stored in history; name the files alike.
            self.files.start_cell(self.shell.execution_count - 1)
            self.budget.start_cell()
        except Exception:
            _report_failure("pre_execute")

    def post_execute(self) -> None:
        self.depth = max(self.depth - 1, 0)
        if self.depth:
            return
        for bound in self.streams:
            try:
                wait_for_fd_pipe(bound.stream)
            except Exception:
                _report_failure("waiting for fd output")
            bound.finish()
        try:
            over = self.budget.finish()
            if over is not None:
                self.original_publish(data={"text/plain": over["text"]}, metadata={})
                self.announce(over["note"])
        except Exception:
            _report_failure("finishing the cell's output budget")

    def _counted(self, downstream: Callable[[str], Any]) -> Callable[[str], Any]:
        """Stream output sent counts against the cell's budget (it is bounded on its own)."""

        def write(text: str) -> Any:
            try:
                self.budget.count(len(text))
            except Exception:
                _report_failure("counting stream output")
            return downstream(text)

        return write

    def clear_output(self, *args: Any, **kwargs: Any) -> Any:
        try:
            self.budget.give_back()
        except Exception:
            _report_failure("clear_output")
        return self.original_clear_output(*args, **kwargs)

    @staticmethod
    def _skip_history_tee(bound: StreamBound) -> None:
        """Take IPython's history tee off the stream for this cell.

        IPython 9's ``run_cell`` wraps ``stream.write`` to append every write
        to ``history_manager.outputs`` for the kernel's lifetime, so a 100 MB
        print would stay in kernel memory forever.  The tee puts back what it
        found (our ``write``) when the cell ends.
        """
        if getattr(bound.stream.write, "__qualname__", "").startswith("InteractiveShell._tee."):
            bound.stream.write = bound.write

    def publish(self, data: dict[str, Any], metadata: dict | None = None, *args: Any, **kwargs: Any) -> None:
        try:
            if self.budget.full():  # straight to the cell's outputs file: no artifact or spill files each
                self.budget.take({"output_type": "display_data", "data": data, "metadata": metadata or {}})
                return None
            data = self.results.bound(data)
            output = {"output_type": "display_data", "data": data, "metadata": metadata or {}}
            if not self.budget.take(output):
                return None  # in the cell's outputs file; the marker comes at the cell's end
        except Exception:
            _report_failure("bounding display_data")
        return self.original_publish(data, metadata, *args, **kwargs)

    def write_format_data(self, format_dict: dict[str, Any], md_dict: dict | None = None) -> None:
        try:
            bounded = self.results.bound(format_dict)
            output = {"output_type": "execute_result", "data": bounded, "metadata": md_dict or {}}
            if not self.budget.take(output):
                bounded = {"text/plain": "[... this result is past the cell's output budget: see the marker below ...]"}
            # In place: IPython logs this same dict into its output history.
            format_dict.clear()
            format_dict.update(bounded)
        except Exception:
            _report_failure("bounding execute_result")
        return self.original_write_format_data(format_dict, md_dict)


def name_cells_in_syntax_errors(shell: Any) -> None:
    """Make a SyntaxError in a cell name the cell, ``(Cell In[3], line 2)``, not IPython's hash file name.

    IPython compiles each cell under a cache file name such as ``1063758517.py``
    and ``str()`` of the error, which becomes the error message's ``evalue``,
    shows it.  The traceback IPython renders already says ``Cell In[3]``; this
    gives the message the same name, before ipykernel reads it.
    """
    original = shell._showtraceback

    def _showtraceback(etype: Any, evalue: Any, stb: Any) -> Any:
        try:
            if isinstance(evalue, SyntaxError) and evalue.filename:
                label = shell.compile.format_code_name(evalue.filename)
                if label:
                    evalue.filename = " ".join(label)
        except Exception:
            _report_failure("naming the cell of a SyntaxError")
        return original(etype, evalue, stb)

    shell._showtraceback = _showtraceback


def load_ipython_extension(ip: Any) -> None:
    """Install the bounds; load at kernel start (IPKernelApp.extensions), once."""
    if getattr(ip, "_kernel_gateway_output_bounds", None) is not None:
        return
    try:
        name_cells_in_syntax_errors(ip)
    except Exception:
        _report_failure("installing the SyntaxError names")
    try:
        bounds = OutputBounds(ip, output_limit(os.environ))
        bounds.install()
    except Exception:
        _report_failure("loading the extension")
        return
    ip._kernel_gateway_output_bounds = bounds
