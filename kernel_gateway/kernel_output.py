"""A kernel's stdout and stderr: a pipe the gateway drains, never a file the kernel holds.

A kernel that inherited the gateway's log file could write anything into the
state directory.  Instead both of its output fds are the write end of one
pipe; the event loop reads the other end without ever blocking, keeps the
last :data:`KEEP` bytes in memory (for a start failure's message) and appends
what it reads to the agent's kernel log, each line cut at :data:`LINE_MAX`
bytes and at most :data:`LOG_MAX` bytes per kernel.  What is past those
bounds is read and dropped, so a kernel that floods its stderr costs the
gateway CPU time but neither memory nor disk.

An agent's kernels share one log file, and restarting a kernel is free: so
the file itself is capped (``--Gateway.kernel_log_max_bytes``).  A write that
would take it past its cap first renames it to ``.1`` (replacing the older
one) and starts a new file; every kernel of the agent writes to whichever file
is at the path now.  An agent's kernel log never takes more than about twice
its cap, however many kernels or restarts.
"""

from __future__ import annotations

import asyncio
import os

KEEP = 16 << 10
LINE_MAX = 4 << 10
LOG_MAX = 1 << 20
READ_CHUNK = 1 << 16


class KernelOutput:
    """One pipe: ``write_fd`` goes to the kernel as fds 1 and 2, the gateway reads the rest."""

    def __init__(self, log_path: str, log_max_bytes: int = 4 << 20):
        self.read_fd, self.write_fd = os.pipe2(os.O_CLOEXEC)
        self._log_path = log_path
        self._log_max = log_max_bytes
        self._log_fd: int | None = None
        self.tail = bytearray()
        self.logged = 0
        self._partial = bytearray()
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """Call once the kernel holds ``write_fd``: closes our copy and starts draining."""
        self._close_write_end()
        os.set_blocking(self.read_fd, False)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.read_fd, self._readable)

    def _close_write_end(self) -> None:
        if self.write_fd >= 0:
            os.close(self.write_fd)
            self.write_fd = -1

    def _readable(self) -> None:
        try:
            data = os.read(self.read_fd, READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.close()
            return
        self.tail += data
        if len(self.tail) > KEEP:
            del self.tail[: len(self.tail) - KEEP]
        self._log(data)

    def _log(self, data: bytes) -> None:
        if self.logged >= LOG_MAX:
            return
        self._partial += data
        lines = self._partial.split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > LINE_MAX:  # a line without end is cut, not kept growing
            lines.append(self._partial)
            self._partial = bytearray()
        out = bytearray()
        for line in lines:
            if len(line) > LINE_MAX:
                line = line[:LINE_MAX] + b" [... line cut]"
            out += line + b"\n"
        if self.logged + len(out) > LOG_MAX:
            out = out[: max(0, LOG_MAX - self.logged)] + b"\n[... kernel output past 1 MiB not logged]\n"
        if out:
            self._write_log(bytes(out))

    def _write_log(self, data: bytes) -> None:
        try:
            fd = self._current_log()
            if os.fstat(fd).st_size + len(data) > self._log_max:
                os.replace(self._log_path, self._log_path + ".1")  # the agent's log is full: rotate it
                fd = self._current_log()
            os.write(fd, data)
        except OSError:
            pass  # a full disk costs the log, not the kernel
        self.logged += len(data)

    def _current_log(self) -> int:
        """An fd of the file at the log's path now (another kernel of the agent may have rotated it)."""
        if self._log_fd is not None:
            try:
                current = os.stat(self._log_path).st_ino == os.fstat(self._log_fd).st_ino
            except FileNotFoundError:
                current = False
            if current:
                return self._log_fd
            os.close(self._log_fd)
            self._log_fd = None
        self._log_fd = os.open(self._log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        return self._log_fd

    def text(self) -> str:
        """The last output, for an error message."""
        return bytes(self.tail).decode("utf-8", errors="replace")

    def close(self) -> None:
        self._close_write_end()
        if self.read_fd >= 0:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self.read_fd)
            os.close(self.read_fd)
            self.read_fd = -1
        if self._log_fd is not None:
            os.close(self._log_fd)
            self._log_fd = None
