"""The HTTP forwarding core: one client's requests, checked, forwarded with the operator's credential.

A :class:`Forwarder` serves one client (a codex job today: ``job:<agent>/<id>``)
on a Unix socket that the gateway binds into that client's sandbox.  Each of
its :class:`Route` s names an upstream (scheme, host, port, path prefix), the
token the client must present (a per-job dummy, ``Authorization: Bearer
<token>``) and the headers the gateway puts in its place on the way out (the
real ``Authorization``).  The real credential lives only here, in the
gateway's memory: the sandbox sees the dummy and the socket, nothing else.

Per connection, exactly one request (``Connection: close`` both ways, so
nothing after the first request is ever read: no keep-alive smuggling):

- the request head is parsed by h11 (strict HTTP/1.1: one framing, no
  ambiguous lengths), bounded to :attr:`Limits.head_bytes`; anything that is
  not HTTP gets a 400 and the connection is closed;
- the target must be origin-form, below a route's path prefix, with no ``.``
  or ``..`` segment, no encoded dot, slash or backslash; the method one the
  route allows; the token the route's, compared in constant time;
- the body is streamed to the upstream and counted against
  :attr:`Limits.body_bytes` (a declared larger ``Content-Length`` is refused
  before anything is sent);
- the response is streamed back as it arrives (server-sent events are never
  held whole), its hop-by-hop headers dropped, and the route's credential
  masked wherever it appears (an upstream that echoes a request's headers
  would otherwise hand it to the sandbox): the upstream is asked for an
  unencoded answer, and an encoded one, which could not be checked, is a 502.

Every refusal is a JSON ``{"error": {"code", "message", "hint"}}`` with a 4xx
(a 502 or 504 when the upstream fails), and never quotes the credential.
The listening socket is the gateway's accept gate's
(``ConnectionGate.listen_unix_streams``): it counts this forwarder's
connections with every other agent connection, answers those past
:attr:`Limits.connections` with a 429, and calls :meth:`Forwarder.serve_socket`;
a peer of another uid than the client's (``SO_PEERCRED``) is refused.

This is the seed of the per-agent egress proxy: more routes per client (a
domain allow-list), credentials per route, other clients (kernels, command
jobs) are additions to :class:`Route` and :class:`Forwarder`, not another
mechanism.  No Tornado here: plain asyncio streams and h11.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import socket
import ssl
import sys
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Mapping, Sequence
from urllib.parse import urlsplit

import h11

log = logging.getLogger("kernel_gateway.egress")

# Hop-by-hop headers (RFC 9110 7.6.1) and what the forwarder sets itself: never passed through.
_REQUEST_DROPPED = frozenset({
    b"connection", b"keep-alive", b"proxy-authorization", b"proxy-authenticate", b"proxy-connection",
    b"te", b"trailer", b"transfer-encoding", b"upgrade", b"host", b"authorization", b"expect",
    b"accept-encoding",  # the answer comes unencoded, so that it can be checked for the credential
})
_RESPONSE_DROPPED = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-connection", b"te", b"trailer",
    b"transfer-encoding", b"upgrade",
})
# In a path: an encoded dot, slash or backslash, which an upstream may decode into a way out of the prefix.
_ENCODED_SEPARATOR = re.compile(rb"%(2e|2f|5c)", re.IGNORECASE)


class Refused(Exception):
    """A request the forwarder will not forward: the status and JSON error it answers with."""

    def __init__(self, status: int, code: str, message: str, hint: str = ""):
        super().__init__(message)
        self.status, self.code, self.message, self.hint = status, code, message, hint

    def body(self) -> bytes:
        return json.dumps({"error": {"code": self.code, "message": self.message, "hint": self.hint}}).encode()


@dataclass(frozen=True)
class Upstream:
    """Where a route forwards to: ``scheme://host:port`` and the path prefix requests must stay under."""

    scheme: str
    host: str
    port: int
    prefix: str  # no trailing slash; "" for the whole host

    @classmethod
    def from_url(cls, url: str) -> "Upstream":
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"an upstream is an http(s) URL with a host, got {url!r}")
        if parts.username or parts.password or parts.query or parts.fragment:
            raise ValueError(f"an upstream URL has no user, query or fragment, got {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        prefix = parts.path.rstrip("/")
        if _bad_path(prefix.encode()):
            raise ValueError(f"an upstream's path has no '.', '..' or encoded separators, got {url!r}")
        return cls(parts.scheme, parts.hostname, port, prefix)

    @property
    def authority(self) -> str:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == default else f"{host}:{self.port}"

    def describe(self) -> str:
        return f"{self.scheme}://{self.authority}{self.prefix}/"


@dataclass(frozen=True)
class Route:
    """One upstream a client may reach, the token it must show, the headers put in the token's place."""

    upstream: Upstream
    token: str  # what the client sends as ``Authorization: Bearer <token>``
    inject: Mapping[str, str] = field(default_factory=dict, repr=False)  # the real credential: never shown
    methods: frozenset = frozenset({"GET", "POST"})

    def __repr__(self) -> str:  # a log line or a traceback never carries the credential
        return f"Route({self.upstream.describe()})"

    def secrets(self) -> list[bytes]:
        """The credentials this route injects (``Bearer sk-...`` gives ``sk-...``): masked in responses."""
        found = {value.split(" ", 1)[-1].encode() for value in self.inject.values()}
        return sorted((v for v in found if len(v) >= 8), key=len, reverse=True)


@dataclass(frozen=True)
class Limits:
    head_bytes: int = 64 << 10  # request line and headers, and the upstream's response head
    body_bytes: int = 64 << 20  # one request body (Codex sends the whole conversation each turn)
    connections: int = 8  # open at once per forwarder
    head_timeout: float = 30.0  # to receive the request head
    idle_timeout: float = 600.0  # between two reads of a body, either way (a model may think a while)
    connect_timeout: float = 30.0


def _bad_path(path: bytes) -> bool:
    if b"\\" in path or _ENCODED_SEPARATOR.search(path):
        return True
    return any(segment in (b".", b"..") for segment in path.split(b"/"))


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


def _header(headers: Sequence[tuple[bytes, bytes]], name: bytes) -> list[bytes]:
    return [value for key, value in headers if key == name]


class Scrubber:
    """Masks secrets in a stream of chunks (same length, so a Content-Length stays true).

    Only a chunk's tail that could be the start of a secret is held back until the next
    chunk: an event stream's events still go out as they arrive.
    """

    def __init__(self, secrets: Sequence[bytes]):
        self.secrets = [s for s in secrets if s]
        self._carry = b""

    def mask(self, data: bytes) -> bytes:
        for secret in self.secrets:
            data = data.replace(secret, b"*" * len(secret))
        return data

    def feed(self, data: bytes) -> bytes:
        data = self.mask(self._carry + data)
        hold = 0
        for secret in self.secrets:
            for n in range(min(len(secret) - 1, len(data)), hold, -1):
                if data.endswith(secret[:n]):
                    hold = n
                    break
        self._carry = data[len(data) - hold:] if hold else b""
        return data[:len(data) - hold]

    def flush(self) -> bytes:
        data, self._carry = self._carry, b""
        return data


class Forwarder:
    """One client's forwarder: its routes, its listener, its open connections."""

    def __init__(self, client: str, routes: Sequence[Route], limits: Limits | None = None,
                 ssl_context: ssl.SSLContext | None = None):
        if not routes:
            raise ValueError("a forwarder needs at least one route")
        self.client = client
        self.routes = list(routes)
        self.limits = limits or Limits()
        self.ssl_context = ssl_context
        self.peer_uid: int | None = None  # if set, only a peer of that uid is served (SO_PEERCRED)
        self.requests = 0  # forwarded
        self.refused = 0
        self._tasks: set[asyncio.Task] = set()

    # --- connections (accepted and counted by the gateway's accept gate) -----------------

    async def serve_socket(self, sock: socket.socket) -> None:
        """Serve one accepted connection: its peer checked, one request, then closed.

        The gateway's accept gate (``server/connections.py``, ``listen_unix_streams``) binds
        the socket, caps its connections at :attr:`Limits.connections` and calls this.
        """
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        writer = None
        try:
            reader, writer = await asyncio.open_unix_connection(sock=sock, limit=1 << 16)
            if not self._peer_allowed(sock):
                self.refused += 1
                await self._answer_refusal(writer, Refused(403, "forbidden_peer", "this socket serves one sandbox only"))
                return
            await self.serve(reader, writer)
        except asyncio.CancelledError:
            pass
        except Exception:  # a bug must not take the gateway's loop down; the connection just ends
            log.exception("egress forwarder %s: connection failed", self.client)
        finally:
            if task is not None:
                self._tasks.discard(task)
            if writer is not None:
                writer.close()
            else:
                sock.close()

    async def close(self) -> None:
        """End the connections still open (the gate closes the listener)."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _peer_allowed(self, sock: socket.socket) -> bool:
        if self.peer_uid is None:
            return True
        try:
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        except OSError:
            return False
        return int.from_bytes(creds[4:8], sys.byteorder) == self.peer_uid  # struct ucred: pid, uid, gid

    # --- one request --------------------------------------------------------------

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one request from ``reader``/``writer`` (any stream: tests drive it directly)."""
        client = h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.head_bytes)
        try:
            request = await self._next(client, reader, self.limits.head_timeout, "the request head", head=True)
            if not isinstance(request, h11.Request):
                raise Refused(400, "bad_request", "the connection ended before a request")
            route, target = self.check(request)
        except Refused as refusal:
            self.refused += 1
            log.info("egress forwarder %s refused: %s %s", self.client, refusal.status, refusal.code)
            await self._refuse(client, writer, refusal)
            return
        try:
            await self._forward(client, reader, writer, request, route, target)
        except Refused as refusal:
            self.refused += 1
            log.info("egress forwarder %s refused: %s %s", self.client, refusal.status, refusal.code)
            await self._refuse(client, writer, refusal)

    def check(self, request: h11.Request) -> tuple[Route, bytes]:
        """The route a request may take and the target to send upstream, or :class:`Refused`."""
        target = request.target
        if not target.startswith(b"/"):
            raise Refused(400, "not_origin_form", "the request target must be a path (origin-form)",
                          "this is not a general proxy: send requests to the model's path only")
        path = target.split(b"?", 1)[0]
        if _bad_path(path):
            raise Refused(400, "bad_path", "the request path has a '.' or '..' segment or an encoded separator")
        if _header(request.headers, b"transfer-encoding") and _header(request.headers, b"content-length"):
            raise Refused(400, "bad_request", "the request has both Transfer-Encoding and Content-Length",
                          "frame the body one way")
        tokens = _header(request.headers, b"authorization")
        for route in self.routes:
            prefix = route.upstream.prefix.encode()
            if not (path == prefix or path.startswith(prefix + b"/")):
                continue
            if request.method.decode("ascii", "replace") not in route.methods:
                raise Refused(405, "method_not_allowed", f"{request.method.decode('ascii', 'replace')} is not forwarded",
                              f"allowed: {', '.join(sorted(route.methods))}")
            if len(tokens) != 1 or not hmac.compare_digest(tokens[0], f"Bearer {route.token}".encode()):
                raise Refused(401, "bad_token", "the request does not carry this job's model token",
                              "send Authorization: Bearer <the token the job was given>")
            return route, target
        allowed = ", ".join(r.upstream.prefix + "/" for r in self.routes)
        raise Refused(403, "not_forwarded", "this path is not one the forwarder serves",
                      f"paths below: {allowed}")

    async def _forward(self, client: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       request: h11.Request, route: Route, target: bytes) -> None:
        declared = _header(request.headers, b"content-length")
        if declared and int(declared[0]) > self.limits.body_bytes:  # h11 checked it is one integer
            raise Refused(413, "body_too_large", f"the request body is over {self.limits.body_bytes} bytes")
        upstream = route.upstream
        headers = [(k, v) for k, v in request.headers if k not in _REQUEST_DROPPED]
        if _header(request.headers, b"transfer-encoding"):  # h11 took it only as chunked; so is it sent on
            headers.append((b"transfer-encoding", b"chunked"))
        headers += [(b"host", upstream.authority.encode()), (b"accept-encoding", b"identity")]
        headers += [(k.lower().encode(), v.encode()) for k, v in route.inject.items()]
        headers += [(b"connection", b"close")]
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(
                upstream.host, upstream.port,
                ssl=(self.ssl_context or ssl.create_default_context()) if upstream.scheme == "https" else None,
                server_hostname=upstream.host if upstream.scheme == "https" else None,
                limit=1 << 16,
            ), self.limits.connect_timeout)
        except (OSError, asyncio.TimeoutError, ssl.SSLError) as e:
            raise Refused(502, "upstream_unreachable", f"the model at {upstream.describe()} could not be reached: "
                          f"{type(e).__name__}") from None
        try:
            upstream_conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=self.limits.head_bytes)
            up_writer.write(upstream_conn.send(h11.Request(method=request.method, target=target, headers=headers)))
            sent, sending = 0, True
            while True:  # the body, streamed and counted (all of it: an upstream that answered early is heard)
                event = await self._next(client, reader, self.limits.idle_timeout, "the request body")
                if isinstance(event, h11.Data):
                    sent += len(event.data)
                    if sent > self.limits.body_bytes:
                        raise Refused(413, "body_too_large", f"the request body is over {self.limits.body_bytes} bytes")
                elif not isinstance(event, h11.EndOfMessage):
                    raise Refused(400, "bad_request", "the request ended before its body")
                if sending:
                    try:
                        up_writer.write(upstream_conn.send(event))
                        await up_writer.drain()
                    except OSError:
                        sending = False  # the upstream stopped reading; its answer, if any, is relayed
                if isinstance(event, h11.EndOfMessage):
                    break
            self.requests += 1
            await self._relay_response(client, writer, upstream_conn, up_reader, upstream, Scrubber(route.secrets()))
        except (OSError, h11.LocalProtocolError) as e:
            raise Refused(502, "upstream_failed", f"the model at {upstream.describe()} failed: {type(e).__name__}") from None
        finally:
            up_writer.close()

    async def _relay_response(self, client: h11.Connection, writer: asyncio.StreamWriter,
                              upstream_conn: h11.Connection, up_reader: asyncio.StreamReader,
                              upstream: Upstream, scrubber: Scrubber) -> None:
        """The upstream's answer, as it arrives, with the route's credential masked wherever it appears."""
        started = False
        try:
            while True:
                event = upstream_conn.next_event()
                if event is h11.NEED_DATA:
                    try:
                        data = await asyncio.wait_for(up_reader.read(1 << 16), self.limits.idle_timeout)
                    except asyncio.TimeoutError:
                        raise Refused(504, "upstream_timeout", f"the model at {upstream.describe()} went quiet") from None
                    upstream_conn.receive_data(data)
                    continue
                if isinstance(event, h11.InformationalResponse):
                    continue
                if isinstance(event, h11.Response):
                    encodings = {v.strip().lower() for v in b",".join(_header(event.headers, b"content-encoding")).split(b",")}
                    if encodings - {b"", b"identity"}:
                        raise Refused(502, "upstream_encoded", f"the model at {upstream.describe()} answered "
                                      "encoded although asked not to: it cannot be checked, so it is not passed on")
                    headers = [(k, scrubber.mask(v)) for k, v in event.headers if k not in _RESPONSE_DROPPED]
                    headers.append((b"connection", b"close"))
                    writer.write(client.send(h11.Response(status_code=event.status_code, headers=headers,
                                                          reason=scrubber.mask(event.reason))))
                    started = True
                elif isinstance(event, h11.Data):
                    data = scrubber.feed(bytes(event.data))  # as it comes: an event stream is never held whole
                    if data:
                        writer.write(client.send(h11.Data(data=data)))
                elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                    if started and isinstance(event, h11.EndOfMessage):
                        rest = scrubber.flush()
                        if rest:
                            writer.write(client.send(h11.Data(data=rest)))
                        writer.write(client.send(h11.EndOfMessage()))
                    break
                await writer.drain()
        except h11.RemoteProtocolError:
            if not started:
                raise Refused(502, "upstream_failed", f"the model at {upstream.describe()} sent a bad response") from None
        if not started:
            raise Refused(502, "upstream_failed", f"the model at {upstream.describe()} closed without a response")
        await writer.drain()

    # --- the client side ---------------------------------------------------------

    async def _next(self, conn: h11.Connection, reader: asyncio.StreamReader, timeout: float, what: str,
                    head: bool = False):
        """The client's next event; for the ``head``, never more than ``head_bytes`` read to find it."""
        fed = 0
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as e:
                status = e.error_status_hint
                raise Refused(431 if status == 431 else 400, "bad_request",
                              f"not a request the forwarder takes: {e}") from None
            if event is not h11.NEED_DATA:
                return event
            want = 1 << 16
            if head:
                if fed > self.limits.head_bytes:
                    raise Refused(431, "bad_request", f"the request head is over {self.limits.head_bytes} bytes")
                want = min(want, self.limits.head_bytes + 1 - fed)
            try:
                data = await asyncio.wait_for(reader.read(want), timeout)
            except asyncio.TimeoutError:
                raise Refused(408, "request_timeout", f"{what} did not arrive in {timeout:g} s") from None
            fed += len(data)
            conn.receive_data(data)

    async def _refuse(self, conn: h11.Connection, writer: asyncio.StreamWriter, refusal: Refused) -> None:
        if conn.our_state in (h11.SEND_BODY, h11.DONE, h11.MUST_CLOSE, h11.CLOSED):
            return  # the response had started: the connection just ends
        body = refusal.body()
        try:
            data = conn.send(h11.Response(status_code=refusal.status, reason=_reason(refusal.status), headers=[
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"connection", b"close")]))
            data += conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:
            await self._answer_refusal(writer, refusal)
            return
        try:
            writer.write(data)
            await writer.drain()
        except OSError:
            pass

    async def _answer_refusal(self, writer: asyncio.StreamWriter, refusal: Refused) -> None:
        body = refusal.body()
        head = (f"HTTP/1.1 {refusal.status} {_reason(refusal.status).decode()}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
        try:
            writer.write(head + body)
            await writer.drain()
        except OSError:
            pass
