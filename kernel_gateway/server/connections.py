"""Accepting connections on the gateway's sockets without letting one agent starve the rest.

Tornado's own accept loop takes every pending connection, and when the process
runs out of descriptors its ``accept`` fails with EMFILE while the listening
socket stays readable: the loop spins at full CPU and logs a traceback per
turn.  An agent can cause that from inside its kernel by opening thousands of
connections to its own socket.  So each listening socket here gets our own
accept handler:

- An agent socket holds at most ``max_connections_per_agent_socket`` open
  connections, and all agent sockets together stay below the descriptor limit
  minus ``fd_reserve``.  A connection past a cap is answered with a short 429
  JSON response and closed at once: cheap, clear, and no descriptor kept.
  The control socket has no cap but the descriptor limit.
- On EMFILE/ENFILE one spare descriptor, kept open for this, is released to
  accept and close the waiting connection, and the socket pauses for a
  moment: the loop never spins on a condition it cannot clear.
- Refusals are logged once per interval per socket with a count, not per
  connection, so a flood cannot flood the log too.

The soft ``RLIMIT_NOFILE`` is raised to the hard one at start
(:func:`raise_descriptor_limit`) so that the reserve is real.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import resource
import socket
import time
from typing import Any

from tornado import httpserver
from tornado.ioloop import IOLoop

log = logging.getLogger("kernel_gateway")

ACCEPTS_PER_EVENT = 128  # like Tornado: other work gets the loop between batches
PAUSE_SECONDS = 0.1  # after EMFILE: let connections close before accepting again
LOG_INTERVAL_SECONDS = 10.0


def raise_descriptor_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def refusal(status: int, code: str, message: str, hint: str) -> bytes:
    """A whole HTTP response, sent as it is to a connection that is refused."""
    body = json.dumps({"error": {"code": code, "message": message, "hint": hint}}).encode()
    head = (
        f"HTTP/1.1 {status} Too Many Requests\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class ConnectionGate:
    """Accept handlers for every listening socket of one gateway, with their caps."""

    def __init__(self, per_agent_socket: int, fd_reserve: int):
        self.per_agent_socket = per_agent_socket
        self.fd_limit = raise_descriptor_limit()
        # Every agent socket together; the rest of the limit serves kernels, files and the control socket.
        self.agent_total = max(per_agent_socket, (self.fd_limit - fd_reserve) // 2)
        self._servers: dict[str | None, httpserver.HTTPServer] = {}
        self._sockets: dict[str | None, socket.socket] = {}
        self._spare_fd: int | None = self._open_spare()
        self._refused: dict[str | None, int] = {}
        self._last_log: dict[str | None, float] = {}
        self.refused_total = 0

    @staticmethod
    def _open_spare() -> int | None:
        try:
            return os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None

    def listen(self, sock: socket.socket, server: httpserver.HTTPServer, scope: str | None) -> None:
        """Serve ``sock`` with ``server``; ``scope`` is its agent (None: the control socket)."""
        sock.setblocking(False)
        self._servers[scope] = server
        self._sockets[scope] = sock
        IOLoop.current().add_handler(sock, lambda _fd, _events: self._accept(scope), IOLoop.READ)

    def close(self, scope: str | None) -> None:
        sock = self._sockets.pop(scope, None)
        self._servers.pop(scope, None)
        if sock is not None:
            try:
                IOLoop.current().remove_handler(sock)
            except (KeyError, ValueError):
                pass
            sock.close()

    def close_all(self) -> None:
        for scope in list(self._sockets):
            self.close(scope)
        if self._spare_fd is not None:
            os.close(self._spare_fd)
            self._spare_fd = None

    def open_connections(self, scope: str | None) -> int:
        server = self._servers.get(scope)
        return len(server._connections) if server is not None else 0

    def _agent_connections(self) -> int:
        return sum(self.open_connections(scope) for scope in self._servers if scope is not None)

    def _accept(self, scope: str | None) -> None:
        sock = self._sockets.get(scope)
        for _ in range(ACCEPTS_PER_EVENT):
            if sock is None or sock.fileno() < 0:
                return
            try:
                connection, address = sock.accept()
            except BlockingIOError:
                return
            except ConnectionAbortedError:
                continue
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE):
                    self._out_of_descriptors(scope, sock)
                    return
                raise
            if scope is not None:
                why = self._over_cap(scope)
                if why is not None:
                    self._refuse(scope, connection, why)
                    continue
            self._servers[scope]._handle_connection(connection, address)

    def _over_cap(self, scope: str) -> tuple[str, str] | None:
        if self.open_connections(scope) >= self.per_agent_socket:
            return (
                f"this agent socket already has {self.per_agent_socket} open connections; close some",
                "raise --Gateway.max_connections_per_agent_socket",
            )
        if self._agent_connections() >= self.agent_total:
            return (
                f"the gateway holds {self.agent_total} connections of agents in all; try again later",
                "raise the descriptor limit (ulimit -n) or --Gateway.fd_reserve lower",
            )
        return None

    def _refuse(self, scope: str | None, connection: socket.socket, why: tuple[str, str]) -> None:
        try:
            connection.setblocking(False)
            connection.send(refusal(429, "too_many_connections", *why))
        except OSError:
            pass
        finally:
            connection.close()
        self._count_refusal(scope, why[0])

    def _out_of_descriptors(self, scope: str | None, sock: socket.socket) -> None:
        """EMFILE: shed the waiting connection with the spare descriptor, then pause this socket."""
        if self._spare_fd is not None:
            os.close(self._spare_fd)
            self._spare_fd = None
            try:
                connection, _ = sock.accept()
                connection.close()
            except OSError:
                pass
            self._spare_fd = self._open_spare()
        self._count_refusal(scope, "out of file descriptors")
        loop = IOLoop.current()
        try:
            loop.remove_handler(sock)
        except (KeyError, ValueError):
            return
        loop.call_later(PAUSE_SECONDS, self._resume, scope, sock)

    def _resume(self, scope: str | None, sock: socket.socket) -> None:
        if self._sockets.get(scope) is sock:
            IOLoop.current().add_handler(sock, lambda _fd, _events: self._accept(scope), IOLoop.READ)

    def _count_refusal(self, scope: str | None, why: str) -> None:
        self.refused_total += 1
        self._refused[scope] = self._refused.get(scope, 0) + 1
        now = time.monotonic()
        if now - self._last_log.get(scope, float("-inf")) >= LOG_INTERVAL_SECONDS:
            where = f"agent socket of {scope!r}" if scope is not None else "control socket"
            log.warning("%s: refused %d connections (%s)", where, self._refused[scope], why)
            self._last_log[scope] = now
            self._refused[scope] = 0

    def describe(self) -> dict[str, Any]:
        return {
            "max_connections_per_agent_socket": self.per_agent_socket,
            "max_agent_connections_total": self.agent_total,
            "descriptor_limit": self.fd_limit,
        }
