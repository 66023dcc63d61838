"""Expose a Unix socket on a TCP listener: bytes both ways, one Unix connection per TCP one.

JupyterLab serves on a Unix socket inside its sandbox (it has no network
namespace of the host); ``kernel-gateway lab`` listens on 127.0.0.1 and
relays each connection to that socket unchanged, HTTP and websockets alike.

The socket's directory is writable by JupyterLab (the agent's uid), and the
relay runs as root: it never connects through a path JupyterLab could point
elsewhere (a symlink to the gateway's control socket would hand every local
user the gateway).  :class:`SocketInDirectory` opens the directory once, then
for each connection the socket's own inode (``O_PATH | O_NOFOLLOW``), checks
that it is a socket of the expected owner and connects to exactly that inode
(``/proc/self/fd/N``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat

CHUNK = 1 << 16


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            data = await reader.read(CHUNK)
            if not data:
                break
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()  # a half-close passes through: the other way may still be talking
    except (ConnectionError, OSError):
        writer.close()


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError, OSError):
        await writer.wait_closed()


class SocketInDirectory:
    """The Unix socket ``name`` in ``directory``, reached without following anything the directory's owner made."""

    def __init__(self, directory: str, name: str, owner: int):
        self.name, self.owner = name, owner
        self.dir_fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)

    def _open(self) -> int:
        fd = os.open(self.name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.dir_fd)
        st = os.fstat(fd)
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != self.owner:
            os.close(fd)
            raise ConnectionRefusedError(f"{self.name} is not a socket of uid {self.owner}")
        return fd

    def exists(self) -> bool:
        try:
            os.close(self._open())
            return True
        except OSError:
            return False

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        fd = self._open()
        try:
            return await asyncio.open_unix_connection(f"/proc/self/fd/{fd}")  # that inode, whatever the name is now
        finally:
            os.close(fd)

    def close(self) -> None:
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
            self.dir_fd = -1


class Forwarder:
    """Relays connections accepted on ``listener`` (a bound TCP socket) to the Unix socket ``target``."""

    def __init__(self, listener: socket.socket, target: SocketInDirectory):
        self.listener, self.target = listener, target
        self.server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, sock=self.listener)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            try:
                upstream_reader, upstream_writer = await self.target.connect()
            except OSError:
                await _close(writer)
                return
            self._writers |= {writer, upstream_writer}
            try:
                await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))
            finally:
                self._writers -= {writer, upstream_writer}
                await _close(upstream_writer)
                await _close(writer)
        finally:
            if task is not None:
                self._tasks.discard(task)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for writer in list(self._writers):
            writer.transport.abort()  # both pipes of the connection see it end, and return
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.server is not None:
            await self.server.wait_closed()
