"""Descriptor floods against every listener: the Jupyter TCP port and an agent's socket.

Real gateway, real kernels, real sockets.  Idle connections, connections that
send half a request and stall, and a burst of connects while the gateway is
stopped: each is judged from the host (the gateway's own descriptor count, the
control socket, another agent's execute, what each flooding connection got),
and the gateway is seen serving again afterwards.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import time

import pytest

from jupyter_support import JupyterClient
from support import GatewayProcess, execute_ok, wait_until, with_agents

WAITING_CAP = 32  # --Gateway.max_unauthenticated_connections of this module's gateway
TCP_SHARE = 16  # --Gateway.max_jupyter_connections_per_agent
DEADLINE = 3  # --Gateway.unauthenticated_timeout, seconds
SLACK = 40  # descriptors the gateway may open meanwhile for its own work (kernel sockets, log files)


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # this test process holds the floods
    gateway = with_agents(GatewayProcess(
        tmp_path_factory.mktemp("flood"), "--jupyter-port", "0",
        f"--Gateway.max_unauthenticated_connections={WAITING_CAP}",
        f"--Gateway.max_jupyter_connections_per_agent={TCP_SHARE}",
        f"--Gateway.unauthenticated_timeout={DEADLINE}",
    ), "alice", "bob")
    info = gateway.client.call("GET", "/v1/info")[1]
    gateway.url = info["jupyter"]["url"]
    gateway.port = int(gateway.url.rstrip("/").rsplit(":", 1)[1])
    gateway.tokens = {a: gateway.client.call("POST", f"/v1/agents/{a}/tokens")[1]["token"] for a in ("alice", "bob")}
    assert execute_ok(gateway, "1", "bob", "b")["status"] == "ok"
    yield gateway
    gateway.stop()
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def descriptors(gw) -> int:
    return len(os.listdir(f"/proc/{gw.proc.pid}/fd"))


def others_are_served(gw) -> None:
    """The control socket answers, bob's kernel runs code, and bob's token works on the TCP port."""
    assert gw.client.call("GET", "/v1/info", timeout=30)[0] == 200
    body = execute_ok(gw, "print(6 * 7)", "bob", "b")
    assert body["status"] == "ok" and body["text"] == "42\n", body
    # On the TCP port a client may be told 429 "try again in a moment" while the flood's newest connections
    # are brand new (they cannot be told from a client whose request is on its way); it gets in then.
    bob = JupyterClient(gw.url + "agents/bob/", gw.tokens["bob"])
    assert wait_until(lambda: bob.call("GET", "api/status")[0] == 200, timeout=10)


_heard: dict[socket.socket, bytes] = {}


def ended(sock: socket.socket) -> bytes | None:
    """What the gateway said before closing ``sock`` (b'' for nothing), or None while it is still open."""
    sock.setblocking(False)
    try:
        while chunk := sock.recv(65536):
            _heard[sock] = _heard.get(sock, b"") + chunk
    except BlockingIOError:
        return None
    except ConnectionResetError:
        pass
    return _heard.pop(sock, b"")


def all_closed(socks: list[socket.socket]) -> dict[str, int]:
    """Wait until the gateway has closed every one; how each ended (its status line, or 'closed')."""
    outcome: dict[int, bytes] = {}

    def done() -> bool:
        for i, s in enumerate(socks):
            if i not in outcome:
                said = ended(s)
                if said is not None:
                    outcome[i] = said
        return len(outcome) == len(socks)

    assert wait_until(done, timeout=DEADLINE + 60), f"{len(socks) - len(outcome)} flood connections still open"
    counts: dict[str, int] = {}
    for said in outcome.values():
        key = said.split(b"\r\n")[0].decode() if said else "closed"
        counts[key] = counts.get(key, 0) + 1
    return counts


def flood_tcp(gw, n: int, first: bytes = b"") -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", gw.port), timeout=30)
        if first:
            s.sendall(first)
        socks.append(s)
    return socks


@pytest.mark.parametrize("first", [
    b"",  # idle: connect and say nothing
    b"GET /agents/alice/api/status HTTP/1.1\r\nHost: x\r\nAuthorization: tok",  # half a header, then a stall
    b"POST /agents/alice/api/kernels HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n{",  # no token, a body
], ids=["idle", "partial-header", "body-without-token"])
def test_a_tcp_flood_without_a_token_holds_few_descriptors_and_starves_nobody(gw, first):
    before = descriptors(gw)
    socks = flood_tcp(gw, 2000, first)
    try:
        # The gateway holds at most its waiting room of them, however many come.
        assert descriptors(gw) - before <= WAITING_CAP + SLACK
        others_are_served(gw)
        counts = all_closed(socks)  # the deadline, or a newer connection, closed every one
    finally:
        for s in socks:
            s.close()
    if first.startswith(b"POST"):
        # Answered at its headers, before its body was read: 403, never a route's work.
        assert set(counts) <= {"HTTP/1.1 403 Forbidden", "HTTP/1.1 429 Too Many Requests", "closed"}, counts
        assert counts.get("HTTP/1.1 403 Forbidden"), counts
    else:  # closed at the deadline or for a newer connection, or refused at once when all were brand new
        assert set(counts) <= {"closed", "HTTP/1.1 429 Too Many Requests"} and counts.get("closed"), counts
    assert wait_until(lambda: descriptors(gw) - before <= SLACK, timeout=30)
    alice = JupyterClient(gw.url + "agents/alice/", gw.tokens["alice"])
    assert alice.call("GET", "api/status")[0] == 200  # and the flooded port serves again


def test_a_token_holder_flooding_the_tcp_port_is_held_to_its_share(gw):
    """With alice's token each connection counts against alice: past her share, 429; bob is served."""
    held = flood_tcp(gw, 3 * TCP_SHARE, (
        "POST /agents/alice/api/sessions HTTP/1.1\r\nHost: x\r\nAuthorization: token {}\r\n"
        "Content-Length: 100\r\n\r\n{{".format(gw.tokens["alice"]).encode()  # a body that never comes
    ))
    try:
        said: dict[int, bytes] = {}

        def answered() -> int:
            for i, s in enumerate(held):
                if i not in said and (data := ended(s)) is not None:
                    said[i] = data
            return len(said)

        assert wait_until(lambda: answered() >= 2 * TCP_SHARE, timeout=60)
        time.sleep(DEADLINE + 1)  # past the deadline of connections without a token: these have one, and stay
        answered()
        statuses = {"open": len(held) - len(said)}
        for data in said.values():
            key = data.split(b"\r\n")[0].decode()
            statuses[key] = statuses.get(key, 0) + 1
            assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "too_many_connections"
        assert statuses == {"open": TCP_SHARE, "HTTP/1.1 429 Too Many Requests": 2 * TCP_SHARE}, statuses
        others_are_served(gw)
        alice = JupyterClient(gw.url + "agents/alice/", gw.tokens["alice"])
        status, body = alice.call("GET", "api/status")
        assert status == 429 and body["error"]["code"] == "too_many_connections"
    finally:
        for s in held:
            s.close()
    alice = JupyterClient(gw.url + "agents/alice/", gw.tokens["alice"])
    assert wait_until(lambda: alice.call("GET", "api/status")[0] == 200, timeout=30)


HALF_REQUESTS = r"""
import os, resource, socket
resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
FLOOD = []
for _ in range(2000):
    s = socket.socket(socket.AF_UNIX)
    s.connect(os.environ["KERNEL_GATEWAY_SOCKET"])
    try:
        s.send(b"POST /v1/agents/me/sessions/x/execute HTTP/1.1\r\nContent-Le")  # and nothing more
    except OSError:
        pass  # refused and closed already
    FLOOD.append(s)
"""

COUNT = r"""
import json, socket
kept, answers = 0, {}
for s in FLOOD:
    try:
        data = s.recv(65536, socket.MSG_DONTWAIT)
    except BlockingIOError:
        kept += 1
        continue
    except ConnectionResetError:
        data = b""
    key = data.split(b"\r\n")[0].decode() if data else "closed"
    answers[key] = answers.get(key, 0) + 1
print(json.dumps({"kept": kept, "answers": answers}))
"""


def settled_descriptors(gw) -> int:
    """The gateway's descriptor count once it stays put for a second (a spare kernel may be starting)."""
    counts = [descriptors(gw)]

    def still() -> bool:
        time.sleep(1)
        counts.append(descriptors(gw))
        return counts[-1] == counts[-2]

    assert wait_until(still, timeout=60)
    return counts[-1]


def test_half_requests_flooding_an_agent_socket_are_capped_and_starve_nobody(gw):
    assert execute_ok(gw, "1", "alice", "flood")["status"] == "ok"
    before = settled_descriptors(gw)
    body = execute_ok(gw, HALF_REQUESTS, "alice", "flood", timeout=300)
    assert body["status"] == "ok", body
    try:
        counts = json.loads(execute_ok(gw, COUNT, "alice", "flood")["text"])
        assert counts == {"kept": 64, "answers": {"HTTP/1.1 429 Too Many Requests": 2000 - 64}}, counts
        assert descriptors(gw) - before <= 64 + SLACK
        others_are_served(gw)
    finally:
        execute_ok(gw, "for s in FLOOD: s.close()\nFLOOD.clear()", "alice", "flood")
    alice = gw.agent_client("alice")
    assert wait_until(lambda: alice.call("GET", "/v1/agents/me", timeout=10)[0] == 200, timeout=30)


def listen_backlogs(pid: int) -> dict[str, int]:
    """The backlog (ss's Send-Q of a listening socket) of each socket the gateway listens on."""
    out = subprocess.run(["ss", "-lxtnpH"], capture_output=True, text=True, check=True).stdout
    backlogs = {}
    for line in out.splitlines():
        if f"pid={pid}," in line:
            netid, _state, _recv_q, send_q, local = line.split()[:5]
            backlogs[local] = int(send_q)
    return backlogs


def test_every_listener_has_a_deep_backlog_and_a_burst_of_connects_gets_no_eagain(gw):
    backlogs = listen_backlogs(gw.proc.pid)
    control, alice_sock = gw.socket, os.path.join(gw.state, "agents", "alice.sock")
    assert {control, alice_sock, f"127.0.0.1:{gw.port}"} <= set(backlogs), backlogs
    assert set(backlogs.values()) == {1024}, backlogs
    # 400 clients connect at once to sockets whose server is not accepting (the gateway is stopped):
    # each connect() is queued, none gets EAGAIN (Tornado's default backlog of 128 gave EAGAIN here).
    os.kill(gw.proc.pid, signal.SIGSTOP)
    socks: list[socket.socket] = []
    try:
        for path in (control, alice_sock):
            for _ in range(200):
                s = socket.socket(socket.AF_UNIX)
                s.setblocking(False)
                s.connect(path)  # BlockingIOError here is the EAGAIN of a full backlog
                socks.append(s)
    finally:
        os.kill(gw.proc.pid, signal.SIGCONT)
    try:
        control_socks, alice_socks = socks[:200], socks[200:]
        for s in control_socks:
            s.setblocking(True)
            s.settimeout(60)
            s.sendall(b"GET /v1/info HTTP/1.0\r\n\r\n")
        lines = {}
        for s in control_socks:
            data = b""
            while chunk := s.recv(65536):
                data += chunk
            line = data.split(b"\r\n")[0].decode()
            lines[line] = lines.get(line, 0) + 1
        assert lines == {"HTTP/1.1 200 OK": 200}, lines  # every one served
        # alice's socket: her share accepted and held, the rest answered 429 and closed.
        said: dict[int, bytes] = {}

        def answered() -> int:
            for i, s in enumerate(alice_socks):
                if i not in said and (data := ended(s)) is not None:
                    said[i] = data
            return len(said)

        assert wait_until(lambda: answered() >= 200 - 64, timeout=60)
        time.sleep(1)
        assert answered() == 200 - 64
        assert {d.split(b"\r\n")[0] for d in said.values()} == {b"HTTP/1.1 429 Too Many Requests"}
    finally:
        for s in socks:
            s.close()
    others_are_served(gw)


def test_clients_that_send_a_request_and_reset_at_once_leave_no_traceback(gw):
    """The refusal is written to a connection already gone: nothing to log but the count."""
    import struct

    log_before = os.path.getsize(gw.log)
    for i in range(300):
        s = socket.create_connection(("127.0.0.1", gw.port), timeout=30)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close sends a reset
        token = gw.tokens["bob"] if i % 2 else "wrong"  # with and without a valid token
        s.sendall(f"GET /agents/alice/api/status HTTP/1.1\r\nHost: x\r\nAuthorization: token {token}\r\n\r\n".encode())
        s.close()
    others_are_served(gw)
    with open(gw.log, errors="replace") as f:
        f.seek(log_before)
        said = f.read()
    assert "Traceback" not in said and "ERROR" not in said, said[-3000:]
