"""The egress forwarding core: a real Unix socket of the real accept gate, a real upstream on loopback, raw clients.

What it must do: forward a request under the route's prefix that carries the
route's token, with the token replaced by the real credential; stream the
response as it comes; refuse everything else with a clear JSON error, the
upstream seeing nothing of it.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kernel_gateway.egress.forwarder import Forwarder, Limits, Route, Upstream
from kernel_gateway.server.connections import ConnectionGate
from kernel_gateway.settings import Gateway

REAL = "sk-real-operator-key-7c1e"
DUMMY = "kg-job-dummy-token-0001"


class Upstream_:
    """A loopback HTTP server that records what reaches it; /v1/stream sends one event, waits, sends another."""

    def __init__(self):
        self.requests: list[dict] = []
        self.release = threading.Event()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _record(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                owner.requests.append({"method": self.command, "path": self.path,
                                       "headers": {k.lower(): v for k, v in self.headers.items()}, "body": body})

            def do_GET(self):
                self._record()
                self._send(b'{"ok": true}')

            def do_POST(self):
                self._record()
                if self.path == "/v1/stream":
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    self._chunk(b"event: one\ndata: 1\n\n")
                    owner.release.wait(60)  # the second event only once the client has the first
                    self._chunk(b"event: two\ndata: 2\n\n")
                    self._chunk(b"")
                    return
                if self.path == "/v1/echo":  # a careless upstream: it echoes the request's credential
                    auth = owner.requests[-1]["headers"]["authorization"].encode()
                    self.send_response(401)
                    self.send_header("X-Echo", auth.decode())
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    half = len(auth) // 2
                    self._chunk(b"data: " + auth[:half])  # split across chunks
                    self._chunk(auth[half:] + b" and again " + auth + b"\n\n")
                    self._chunk(b"")
                    return
                if self.path == "/v1/echo-reason":  # a careless upstream: the credential in its reason phrase
                    auth = owner.requests[-1]["headers"]["authorization"]
                    self.send_response(401, f"Unauthorized: {auth}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if self.path == "/v1/gzip":
                    self.send_response(200)
                    self.send_header("Content-Encoding", "gzip")
                    self.send_header("Content-Length", "3")
                    self.end_headers()
                    self.wfile.write(b"xyz")
                    return
                self._send(b'{"echo": %d}' % len(owner.requests[-1]["body"]))

            def _chunk(self, data: bytes):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            def _send(self, body: bytes):
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


class Served:
    """A forwarder listening through a real ConnectionGate, on an asyncio loop of its own thread."""

    def __init__(self, forwarder: Forwarder, path: str, peer_uid: int | None = None):
        self.forwarder, self.path = forwarder, path
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def listen():
            self.gate = ConnectionGate(Gateway())
            forwarder.peer_uid = peer_uid
            self.gate.listen_unix_streams(path, "egress:test", forwarder.serve_socket, forwarder.limits.connections,
                                          (os.getuid(), os.getgid()))

        self.run(listen())

    def run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(30)

    def close(self):
        async def close():
            self.gate.close_all()
            await self.forwarder.close()

        self.run(close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def setup(tmp_path):
    upstream = Upstream_()
    route = Route(Upstream.from_url(upstream.url), DUMMY, {"Authorization": f"Bearer {REAL}"})
    forwarder = Forwarder("job:alice/000000000001", [route], Limits(head_bytes=8 << 10, body_bytes=1 << 20,
                                                                     connections=4, head_timeout=5))
    path = str(tmp_path / "model.sock")
    served = Served(forwarder, path)
    yield forwarder, upstream, path
    served.close()
    upstream.close()


def _exchange(path: str, data: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(path)
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused part-way: the answer is still there to read
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            out += chunk
        return out


def _request(method: str, target: str, body: bytes = b"", token: str | None = DUMMY, extra: str = "") -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token is not None else ""
    return (f"{method} {target} HTTP/1.1\r\nHost: 127.0.0.1:1234\r\n{auth}{extra}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def _error(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_forwards_with_the_real_credential_and_only_that(setup):
    forwarder, upstream, path = setup
    response = _exchange(path, _request("POST", "/v1/responses?x=1", b'{"input": "hi"}',
                                        extra="Proxy-Authorization: Basic eA==\r\nX-Codex-Turn: 7\r\n"))
    assert response.startswith(b"HTTP/1.1 200")
    assert b"connection: close" in response.lower()
    assert response.endswith(b'{"echo": 15}')
    [seen] = upstream.requests
    assert seen["path"] == "/v1/responses?x=1" and seen["body"] == b'{"input": "hi"}'
    assert seen["headers"]["authorization"] == f"Bearer {REAL}"
    assert seen["headers"]["host"] == upstream.url.split("/")[2]
    assert seen["headers"]["x-codex-turn"] == "7"
    assert "proxy-authorization" not in seen["headers"]
    assert DUMMY not in json.dumps(seen["headers"])
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_streams_the_response_as_it_arrives(setup):
    forwarder, upstream, path = setup
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(path)
        s.sendall(_request("POST", "/v1/stream", b"{}"))
        got = b""
        while b"data: 1" not in got:  # the first event arrives while the upstream still holds the second
            chunk = s.recv(65536)
            assert chunk, got
            got += chunk
        assert b"data: 2" not in got
        upstream.release.set()
        while chunk := s.recv(65536):
            got += chunk
    assert b"data: 2" in got and got.endswith(b"0\r\n\r\n")


@pytest.mark.parametrize("request_bytes, status, code", [
    (_request("POST", "/v1/responses", b"{}", token=None), 401, "bad_token"),
    (_request("POST", "/v1/responses", b"{}", token="sk-guess"), 401, "bad_token"),
    (_request("POST", "/v1/responses", b"{}", extra=f"Authorization: Bearer {DUMMY}\r\n"), 401, "bad_token"),
    (_request("POST", "/v2/responses", b"{}"), 403, "not_forwarded"),
    (_request("POST", "/v1x/responses", b"{}"), 403, "not_forwarded"),
    (_request("POST", "/v1/../admin", b"{}"), 400, "bad_path"),
    (_request("POST", "/v1/%2e%2e/admin", b"{}"), 400, "bad_path"),
    (_request("POST", "/v1/a%2Fb", b"{}"), 400, "bad_path"),
    (_request("POST", "http://evil.example/v1/responses", b"{}"), 400, "not_origin_form"),
    (_request("CONNECT", "evil.example:443"), 400, "not_origin_form"),
    (_request("DELETE", "/v1/files/x"), 405, "method_not_allowed"),
    (_request("POST", "/v1/responses", b"x" * 10, extra="Content-Length: 11\r\n"), 400, "bad_request"),
    (_request("POST", "/v1/responses", b"0\r\n\r\n", extra="Transfer-Encoding: chunked\r\n"), 400, "bad_request"),
    (b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + DUMMY.encode()
     + b"\r\nX-Big: " + b"a" * (16 << 10) + b"\r\n\r\n", 431, "bad_request"),
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + os.urandom(64), 400, "bad_request"),
    (b"SSH-2.0-OpenSSH_9.6\r\n", 408, "request_timeout"),  # not HTTP, and no head ever ends
])
def test_refuses_with_a_clear_error_and_the_upstream_sees_nothing(setup, request_bytes, status, code):
    forwarder, upstream, path = setup
    got_status, error = _error(_exchange(path, request_bytes))
    assert (got_status, error["code"]) == (status, code), error
    assert error["message"] and REAL not in json.dumps(error)
    assert upstream.requests == []


def test_a_body_over_the_limit_is_refused_before_and_while_sending(setup):
    forwarder, upstream, path = setup
    big = (1 << 20) + 1
    declared = f"POST /v1/responses HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {DUMMY}\r\nContent-Length: {big}\r\n\r\n"
    assert _error(_exchange(path, declared.encode()))[0] == 413
    assert upstream.requests == []
    chunked = (f"POST /v1/responses HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {DUMMY}\r\n"
               f"Transfer-Encoding: chunked\r\n\r\n").encode()
    chunk = b"x" * (256 << 10)
    chunked += (b"%x\r\n%s\r\n" % (len(chunk), chunk)) * 5 + b"0\r\n\r\n"
    status, error = _error(_exchange(path, chunked))
    assert (status, error["code"]) == (413, "body_too_large")


def test_one_request_per_connection_nothing_smuggled_after_it(setup):
    forwarder, upstream, path = setup
    second = _request("POST", "/v2/admin", b"{}", token=DUMMY)
    response = _exchange(path, _request("POST", "/v1/responses", b"{}") + second)
    assert response.count(b"HTTP/1.1 ") == 1 and response.startswith(b"HTTP/1.1 200")
    assert [r["path"] for r in upstream.requests] == ["/v1/responses"]


def test_an_unreachable_upstream_is_a_502(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends: nothing listens there
    route = Route(Upstream.from_url(f"http://127.0.0.1:{port}/v1"), DUMMY, {"Authorization": f"Bearer {REAL}"})
    path = str(tmp_path / "f.sock")
    served = Served(Forwarder("t", [route]), path)
    try:
        status, error = _error(_exchange(path, _request("POST", "/v1/responses", b"{}")))
    finally:
        served.close()
    assert (status, error["code"]) == (502, "upstream_unreachable") and REAL not in json.dumps(error)


def test_connections_past_the_cap_get_a_429(setup):
    forwarder, upstream, path = setup
    held = []
    try:
        for _ in range(forwarder.limits.connections):
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            s.sendall(b"POST /v1/responses HTTP/1.1\r\n")  # a head that never ends
            held.append(s)
        status, error = _error(_exchange(path, _request("POST", "/v1/responses", b"{}")))
        assert (status, error["code"]) == (429, "too_many_connections")
    finally:
        for s in held:
            s.close()


def test_another_uid_is_not_served(tmp_path):
    upstream = Upstream_()
    route = Route(Upstream.from_url(upstream.url), DUMMY, {"Authorization": f"Bearer {REAL}"})
    path = str(tmp_path / "f.sock")
    served = Served(Forwarder("t", [route]), path, peer_uid=os.getuid() + 1)  # serves another uid than ours
    try:
        status, error = _error(_exchange(path, _request("POST", "/v1/responses", b"{}")))
        assert (status, error["code"]) == (403, "forbidden_peer")
        assert upstream.requests == []
    finally:
        served.close()
        upstream.close()


def test_upstream_urls_and_reprs():
    up = Upstream.from_url("https://api.example.com/v1/")
    assert (up.scheme, up.host, up.port, up.prefix, up.authority) == ("https", "api.example.com", 443, "/v1", "api.example.com")
    for bad in ("ftp://x/v1", "http:///v1", "http://u:p@x/v1", "http://x/v1?a=1", "http://x/v1/../y"):
        with pytest.raises(ValueError):
            Upstream.from_url(bad)
    route = Route(up, DUMMY, {"Authorization": f"Bearer {REAL}"})
    assert REAL not in repr(route) and REAL not in str([route])


def test_the_credential_is_masked_in_what_comes_back_and_encoded_answers_refused(setup):
    forwarder, upstream, path = setup
    response = _exchange(path, _request("POST", "/v1/echo", b"{}", extra="Accept-Encoding: gzip, zstd\r\n"))
    assert response.startswith(b"HTTP/1.1 401") and b"data: Bearer " in response and b" and again Bearer " in response
    assert REAL.encode() not in response and b"*" * len(REAL) in response
    assert response.lower().count(b"x-echo: bearer " + b"*" * len(REAL)) == 1
    assert upstream.requests[-1]["headers"]["accept-encoding"] == "identity"
    response = _exchange(path, _request("POST", "/v1/echo-reason", b"{}"))
    assert response.startswith(b"HTTP/1.1 401 Unauthorized: Bearer " + b"*" * len(REAL) + b"\r\n"), response
    assert REAL.encode() not in response
    status, error = _error(_exchange(path, _request("POST", "/v1/gzip", b"{}")))
    assert (status, error["code"]) == (502, "upstream_encoded")


def test_the_scrubber_holds_back_only_what_could_start_a_secret():
    from kernel_gateway.egress.forwarder import Scrubber

    scrubber = Scrubber([b"sk-secret-1234"])
    assert scrubber.feed(b"event: a\n\n") == b"event: a\n\n"  # nothing held: streams as it comes
    assert scrubber.feed(b"x sk-sec") == b"x "
    assert scrubber.feed(b"ret-1234 y sk") == b"*" * 14 + b" y "
    assert scrubber.feed(b"ip") == b"skip"
    assert scrubber.feed(b"sk-secret-12") == b""
    assert scrubber.flush() == b"sk-secret-12"  # the end of the answer: what was held goes out
