"""Expose a Unix socket on a TCP listener: bytes both ways, one Unix connection per TCP one.

JupyterLab serves on a Unix socket inside its sandbox (it has no network
namespace of the host); ``kernel-gateway lab`` listens on 127.0.0.1 and
relays each connection to that socket unchanged, HTTP and websockets alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

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


class Forwarder:
    """Relays connections accepted on ``listener`` (a bound TCP socket) to the Unix socket ``target``."""

    def __init__(self, listener: socket.socket, target: str):
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
                upstream_reader, upstream_writer = await asyncio.open_unix_connection(self.target)
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
