"""The one accept gate: every listening socket of the gateway, and what each may hold.

Every listener is bound here and served here: the control socket, each
agent's socket, the Jupyter API's loopback TCP port and each codex job's
model forwarder socket (:meth:`ConnectionGate.listen_unix_streams`: the gate
accepts and counts, the egress forwarder serves).  Nothing else in the
package binds or serves a socket (``tests/test_source_guards.py`` checks).

Tornado's own accept loop takes every pending connection, and when the
process runs out of descriptors its ``accept`` fails with EMFILE while the
listening socket stays readable: the loop spins at full CPU and logs a
traceback per turn.  An agent can cause that from inside its kernel by opening
thousands of connections to its own socket, and any local process could do it
to the TCP port.  So each listening socket gets our own accept handler, which
hands each accepted connection to :class:`GatedServer` (an ``HTTPServer``
through its public ``handle_stream``) and counts it until its stream closes:

- An agent socket holds at most ``max_connections_per_agent_socket`` open
  connections.  The control socket has no cap but the descriptor limit.
- On the TCP port a connection belongs to no agent until a request on it
  carries a valid token.  Such connections are few (``max_unauthenticated_
  connections``: past it the oldest of them, if not brand new, is closed to
  make room, so idle connections do not shut a token holder out) and short: one that has not
  sent a request with a token within ``unauthenticated_timeout`` is closed.  The token is checked once the
  headers are in, before the body is read and before any route runs; a
  request without a valid token is answered and the connection closed.  Then
  the connection counts against its agent's share
  (``max_jupyter_connections_per_agent``).
- All connections of agents together (their sockets and the TCP port) stay
  below the descriptor limit minus ``fd_reserve``.
- A connection past a cap is answered with a short 429 JSON response and
  closed at once: cheap, clear, and no descriptor kept.
- On EMFILE/ENFILE one spare descriptor, kept open for this, is released to
  accept and close the waiting connection, and the socket pauses for a
  moment: the loop never spins on a condition it cannot clear.
- Refusals are logged once per interval per listener with a count, not per
  connection, so a flood cannot flood the log too.
- Every listener's backlog is ``listen_backlog``: a burst of clients connecting
  at once while the loop is busy waits in the kernel's queue instead of
  getting EAGAIN from ``connect()``.

The soft ``RLIMIT_NOFILE`` is raised to the hard one at start
(:func:`raise_descriptor_limit`) so that the reserve is real.
"""

from __future__ import annotations

import errno
import http.client
import json
import logging
import os
import resource
import socket
import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from tornado import httpserver, httputil, iostream, netutil, web
from tornado.ioloop import IOLoop

from ..errors import GatewayError

log = logging.getLogger("kernel_gateway")

ACCEPTS_PER_EVENT = 128  # like Tornado: other work gets the loop between batches
PAUSE_SECONDS = 0.1  # after EMFILE: let connections close before accepting again
LOG_INTERVAL_SECONDS = 10.0
EVICT_AFTER_SECONDS = 0.1  # a TCP connection without a token this old may be closed for a newer one
TCP = "tcp"  # the listener name of the Jupyter TCP port (agent sockets are named by their agent)


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


def refusal(status: int, code: str, message: str, hint: str, jupyter: bool = False) -> bytes:
    """A whole HTTP response, sent as it is to a connection that is refused.

    ``jupyter``: Jupyter clients read ``message`` and ``reason`` beside our ``error`` object.
    """
    reason = http.client.responses.get(status, "Refused")
    error: dict[str, Any] = {"error": {"code": code, "message": message, "hint": hint}}
    if jupyter:
        error = {"message": message, "reason": reason, **error}
    body = json.dumps(error).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class CountedStream(iostream.IOStream):
    """An IOStream that tells the gate once when it closes, whoever closes it (HTTP, websocket, peer)."""

    def __init__(self, sock: socket.socket, on_close: Callable[[], None], **kwargs: Any):
        super().__init__(sock, **kwargs)
        self._on_close: Callable[[], None] | None = on_close
        self.gate_connection: Connection | None = None

    def close(self, exc_info: Any = False) -> None:
        super().close(exc_info)
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()


@dataclass(eq=False)
class Connection:
    """One accepted connection: the listener it came in on, and the agent it counts against."""

    listener: str | None
    agent: str | None  # an agent socket's agent; on the TCP port, None until a token says whose it is
    stream: CountedStream | None = None
    deadline: Any = None  # the unauthenticated timeout's handle
    opened: float = 0.0  # IOLoop time of the accept


@dataclass(eq=False)
class Listener:
    name: str | None  # None: the control socket; an agent name; TCP; or a stream listener's own name
    sockets: list[socket.socket]
    server: "GatedServer | None"  # None: a stream listener, whose connections go to ``serve``
    path: str | None = None
    connections: set[Connection] = field(default_factory=set)
    serve: Callable[[socket.socket], Awaitable[None]] | None = None
    cap: int | None = None  # its own cap of open connections (else an agent socket's)


class _TokenCheck(httputil.HTTPMessageDelegate):
    """Checks a TCP request's token once its headers are in: before its body is read, before any route."""

    def __init__(self, gate: "ConnectionGate", conn: Connection, request_conn: Any, inner: httputil.HTTPMessageDelegate):
        self.gate, self.conn, self.request_conn, self.inner = gate, conn, request_conn, inner

    def headers_received(self, start_line: Any, headers: httputil.HTTPHeaders) -> Any:
        try:
            agent = self.gate.authenticate(start_line.path, headers)
            self.gate.claim(self.conn, agent)
        except GatewayError as e:
            self.gate.count_refusal(TCP, e.code)
            stream = self.request_conn.detach()  # no body is read, nothing else runs
            try:
                written = stream.write(refusal(e.status, e.code, e.message, e.hint, jupyter=True))
            except iostream.StreamClosedError:  # the client left already
                stream.close()
                return None
            written.add_done_callback(lambda _f: stream.close())
            return None
        return self.inner.headers_received(start_line, headers)

    def data_received(self, chunk: bytes) -> Any:
        return self.inner.data_received(chunk)

    def finish(self) -> None:
        self.inner.finish()

    def on_connection_close(self) -> None:
        self.inner.on_connection_close()


class GatedServer(httpserver.HTTPServer):
    """An HTTPServer fed by the gate through its public ``handle_stream`` (never by its own accept loop).

    On the TCP port each request passes the token check (:class:`_TokenCheck`) before Tornado reads its body.
    """

    gate: "ConnectionGate"
    name: str | None

    def start_request(self, server_conn: object, request_conn: httputil.HTTPConnection) -> httputil.HTTPMessageDelegate:
        delegate = super().start_request(server_conn, request_conn)
        if self.name != TCP:
            return delegate
        conn = self.gate.connection_of(request_conn)
        return _TokenCheck(self.gate, conn, request_conn, delegate) if conn is not None else delegate


class ConnectionGate:
    """Every listening socket of one gateway, with their accept handlers and their caps."""

    def __init__(self, settings: Any):
        s = settings
        self.per_agent_socket = s.max_connections_per_agent_socket
        self.per_agent_tcp = s.max_jupyter_connections_per_agent
        self.unauthenticated_cap = s.max_unauthenticated_connections
        self.unauthenticated_timeout = s.unauthenticated_timeout
        self.backlog = s.listen_backlog
        self.fd_limit = raise_descriptor_limit()
        # Every agent connection together; the rest of the limit serves kernels, files and the control socket.
        self.agent_total = max(self.per_agent_socket, (self.fd_limit - s.fd_reserve) // 2)
        self.authenticate: Callable[[str, httputil.HTTPHeaders], str] = _no_tcp
        self._listeners: dict[str | None, Listener] = {}
        self._agents_open = 0  # every connection but the control socket's
        self._waiting: dict[Connection, None] = {}  # TCP connections without a token yet, oldest first
        self._tcp_by_agent: dict[str, int] = {}
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

    # --- listeners -----------------------------------------------------------------

    def listen_unix(self, path: str, app: web.Application, name: str | None, **http: Any) -> socket.socket:
        """Bind ``path`` (mode 0600) and serve ``app`` there; ``name`` is its agent (None: the control socket)."""
        sock = netutil.bind_unix_socket(path, mode=0o600, backlog=self.backlog)
        self._serve(Listener(name, [sock], self._server(app, name, http), path=path))
        return sock

    def listen_unix_streams(self, path: str, name: str, serve: Callable[[socket.socket], Awaitable[None]],
                            cap: int, owner: tuple[int, int] | None = None) -> socket.socket:
        """Bind ``path`` (mode 0600, owned by ``owner`` (uid, gid) if given) and hand each connection,
        accepted and counted here, to ``serve(sock)``; it counts until that coroutine returns.

        ``name`` must be new (e.g. ``egress:<job id>``); past ``cap`` open connections a new one gets a 429.
        A socket file left at ``path`` is replaced; :meth:`close` removes it.
        """
        if name in self._listeners or name in (None, TCP):
            raise ValueError(f"a listener named {name!r} exists already")
        sock = netutil.bind_unix_socket(path, mode=0o600, backlog=self.backlog)
        try:
            if owner is not None:
                os.chown(path, owner[0], owner[1], follow_symlinks=False)
        except BaseException:
            sock.close()
            raise
        self._serve(Listener(name, [sock], None, path=path, serve=serve, cap=cap))
        return sock

    def bind_tcp(self, port: int, host: str) -> list[socket.socket]:
        """Listening sockets on host:port (0: a free port); OSError if it is taken."""
        return netutil.bind_sockets(port, host, backlog=self.backlog)

    def listen_tcp(self, sockets: list[socket.socket], app: web.Application,
                   authenticate: Callable[[str, httputil.HTTPHeaders], str], **http: Any) -> None:
        """Serve ``app`` on the TCP sockets; ``authenticate(path, headers)`` names the agent or raises GatewayError."""
        self.authenticate = authenticate
        self._serve(Listener(TCP, sockets, self._server(app, TCP, http)))

    def _server(self, app: web.Application, name: str | None, http: dict) -> GatedServer:
        server = GatedServer(app, **http)
        server.gate, server.name = self, name
        return server

    def _serve(self, listener: Listener) -> None:
        self._listeners[listener.name] = listener
        for sock in listener.sockets:
            sock.setblocking(False)
            self._watch(listener, sock)

    def _watch(self, listener: Listener, sock: socket.socket) -> None:
        IOLoop.current().add_handler(sock, lambda _fd, _events: self._accept(listener, sock), IOLoop.READ)

    def close(self, name: str | None) -> None:
        listener = self._listeners.pop(name, None)
        if listener is None:
            return
        for sock in listener.sockets:
            try:
                IOLoop.current().remove_handler(sock)
            except (KeyError, ValueError):
                pass
            sock.close()
        if listener.serve is not None and listener.path is not None:
            try:  # a stream listener's socket file is the gate's own (a new one is bound per use)
                os.unlink(listener.path)
            except FileNotFoundError:
                pass

    def close_all(self) -> None:
        for name in list(self._listeners):
            self.close(name)
        if self._spare_fd is not None:
            os.close(self._spare_fd)
            self._spare_fd = None

    # --- counting --------------------------------------------------------------------

    def open_connections(self, name: str | None) -> int:
        listener = self._listeners.get(name)
        return len(listener.connections) if listener is not None else 0

    def tcp_connections(self, agent: str) -> int:
        return self._tcp_by_agent.get(agent, 0)

    @staticmethod
    def connection_of(request_conn: Any) -> Connection | None:
        return getattr(getattr(request_conn, "stream", None), "gate_connection", None)

    def _opened(self, listener: Listener, connection: socket.socket, address: Any) -> None:
        if listener.serve is not None:
            self._opened_stream(listener, connection)
            return
        server = listener.server
        assert server is not None
        conn = Connection(listener.name, listener.name if listener.name not in (None, TCP) else None,
                          opened=IOLoop.current().time())
        stream = CountedStream(connection, lambda: self._closed(listener, conn),
                               max_buffer_size=server.max_buffer_size, read_chunk_size=server.read_chunk_size)
        conn.stream = stream
        stream.gate_connection = conn
        listener.connections.add(conn)
        if listener.name is not None:
            self._agents_open += 1
        if listener.name == TCP:
            self._waiting[conn] = None
            conn.deadline = IOLoop.current().call_later(self.unauthenticated_timeout, self._expire, conn)
        server.handle_stream(stream, address)

    def _opened_stream(self, listener: Listener, connection: socket.socket) -> None:
        conn = Connection(listener.name, None, opened=IOLoop.current().time())
        listener.connections.add(conn)
        self._agents_open += 1
        assert listener.serve is not None
        try:
            task = asyncio.ensure_future(listener.serve(connection))
        except BaseException:
            connection.close()
            self._closed(listener, conn)
            raise
        task.add_done_callback(lambda _t: self._closed(listener, conn))

    def _closed(self, listener: Listener, conn: Connection) -> None:
        listener.connections.discard(conn)
        if listener.name is not None:
            self._agents_open -= 1
        if listener.name == TCP:
            if conn.deadline is not None:
                IOLoop.current().remove_timeout(conn.deadline)
            if conn.agent is None:
                self._waiting.pop(conn, None)
            else:
                self._tcp_by_agent[conn.agent] -= 1
        conn.stream = None

    def _expire(self, conn: Connection) -> None:
        """An unauthenticated TCP connection's time is up: it is closed, whatever it was sending."""
        conn.deadline = None
        if conn.agent is None and conn.stream is not None:
            self.count_refusal(TCP, "no request with a valid token in time")
            conn.stream.close()

    def _evict_oldest_waiting(self) -> bool:
        """The TCP port's waiting room is full: its oldest connection makes room for the new one.

        Refusing every new one instead would let anyone who holds that many idle connections shut
        every token holder out; this way a client that sends its request at once is served.  One
        that came in the last moment is not evicted (its request may be in the loop's next turn):
        then the new one is refused.
        """
        oldest = next(iter(self._waiting))
        if IOLoop.current().time() - oldest.opened < EVICT_AFTER_SECONDS:
            return False
        self._waiting.pop(oldest)
        self.count_refusal(TCP, f"{self.unauthenticated_cap} connections without a token: the oldest closed")
        if oldest.stream is not None:
            oldest.stream.close()
        return True

    def claim(self, conn: Connection, agent: str) -> None:
        """A TCP connection carried a request with ``agent``'s token: it counts against that agent now."""
        if conn.agent == agent:
            return
        if self._tcp_by_agent.get(agent, 0) >= self.per_agent_tcp:
            raise GatewayError(429, "too_many_connections",
                          f"agent {agent!r} already has {self.per_agent_tcp} open connections on this port; close some",
                          "reuse connections, or raise --Gateway.max_jupyter_connections_per_agent")
        if conn.agent is None:
            self._waiting.pop(conn, None)
            if conn.deadline is not None:
                IOLoop.current().remove_timeout(conn.deadline)
                conn.deadline = None
        else:
            self._tcp_by_agent[conn.agent] -= 1
        conn.agent = agent
        self._tcp_by_agent[agent] = self._tcp_by_agent.get(agent, 0) + 1

    # --- accepting -------------------------------------------------------------------

    def _accept(self, listener: Listener, sock: socket.socket) -> None:
        for _ in range(ACCEPTS_PER_EVENT):
            if self._listeners.get(listener.name) is not listener or sock.fileno() < 0:
                return
            try:
                connection, address = sock.accept()
            except BlockingIOError:
                return
            except ConnectionAbortedError:
                continue
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE):
                    self._out_of_descriptors(listener, sock)
                    return
                raise
            why = self._over_cap(listener)
            if why is not None:
                self._refuse(listener, connection, why)
                continue
            self._opened(listener, connection, address)

    def _over_cap(self, listener: Listener) -> tuple[str, str] | None:
        if listener.name is None:
            return None
        if listener.name == TCP:
            if len(self._waiting) >= self.unauthenticated_cap and not self._evict_oldest_waiting():
                return (
                    f"this port already has {self.unauthenticated_cap} connections that sent no valid token yet; "
                    "try again in a moment",
                    "send a request with an agent's token at once; raise --Gateway.max_unauthenticated_connections",
                )
        elif listener.cap is not None:
            if len(listener.connections) >= listener.cap:
                return (f"this socket already has {listener.cap} open connections; wait for one to end", "")
        elif len(listener.connections) >= self.per_agent_socket:
            return (
                f"this agent socket already has {self.per_agent_socket} open connections; close some",
                "raise --Gateway.max_connections_per_agent_socket",
            )
        if self._agents_open >= self.agent_total:
            return (
                f"the gateway holds {self.agent_total} connections of agents in all; try again later",
                "raise the descriptor limit (ulimit -n) or --Gateway.fd_reserve lower",
            )
        return None

    def _refuse(self, listener: Listener, connection: socket.socket, why: tuple[str, str]) -> None:
        try:
            connection.setblocking(False)
            connection.send(refusal(429, "too_many_connections", *why, jupyter=listener.name == TCP))
        except OSError:
            pass
        finally:
            connection.close()
        self.count_refusal(listener.name, why[0])

    def _out_of_descriptors(self, listener: Listener, sock: socket.socket) -> None:
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
        self.count_refusal(listener.name, "out of file descriptors")
        loop = IOLoop.current()
        try:
            loop.remove_handler(sock)
        except (KeyError, ValueError):
            return
        loop.call_later(PAUSE_SECONDS, self._resume, listener, sock)

    def _resume(self, listener: Listener, sock: socket.socket) -> None:
        if self._listeners.get(listener.name) is listener and sock.fileno() >= 0:
            self._watch(listener, sock)

    def count_refusal(self, name: str | None, why: str) -> None:
        self.refused_total += 1
        self._refused[name] = self._refused.get(name, 0) + 1
        now = time.monotonic()
        if now - self._last_log.get(name, float("-inf")) >= LOG_INTERVAL_SECONDS:
            where = ("Jupyter TCP port" if name == TCP else f"agent socket of {name!r}" if name is not None
                     else "control socket")
            log.warning("%s: refused %d connections (%s)", where, self._refused[name], why)
            self._last_log[name] = now
            self._refused[name] = 0

    def describe(self) -> dict[str, Any]:
        return {
            "max_connections_per_agent_socket": self.per_agent_socket,
            "max_jupyter_connections_per_agent": self.per_agent_tcp,
            "max_unauthenticated_connections": self.unauthenticated_cap,
            "unauthenticated_timeout": self.unauthenticated_timeout,
            "max_agent_connections_total": self.agent_total,
            "listen_backlog": self.backlog,
            "descriptor_limit": self.fd_limit,
        }


def _no_tcp(path: str, headers: httputil.HTTPHeaders) -> str:
    raise GatewayError(404, "no_route", "this gateway serves no API on TCP")
