"""One agent flooding its own socket from inside its kernel starves nobody.

Real gateway, real kernels in bwrap, real Unix sockets: the flood is made the
way an agent would make it, from a cell, and the other agent and the control
socket are used while it is on.
"""

from __future__ import annotations

import json
import os
import threading

import pytest

from support import GatewayProcess, execute_ok, wait_until, with_agents

FLOOD = 3000  # connections held open by the flooding kernel


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    gateway = with_agents(GatewayProcess(tmp_path_factory.mktemp("caps")), "alice", "bob")
    yield gateway
    gateway.stop()


def run(gw, code, agent="alice", session="s1", **extra):
    body = execute_ok(gw, code, agent, session, **extra)
    assert body["status"] == "ok", body["text"]
    return body


OPEN_FLOOD = r"""
import os, resource, socket, select
resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
path = os.environ["KERNEL_GATEWAY_SOCKET"]
FLOOD = []
for _ in range({n}):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    FLOOD.append(s)
"""

COUNT_FLOOD = r"""
import json, socket
refused = kept = 0
answers = set()
for s in FLOOD:
    try:
        data = s.recv(65536, socket.MSG_DONTWAIT)
    except BlockingIOError:
        kept += 1  # open, and nothing said: the gateway holds it
        continue
    refused += 1
    head, _, body = data.partition(b"\r\n\r\n")
    answers.add(head.split(b"\r\n")[0].decode() + " " + json.loads(body)["error"]["code"])
print(json.dumps({"refused": refused, "kept": kept, "answers": sorted(answers)}))
"""


ASK_OWN_SOCKET = r"""
import os, socket, json
s = socket.socket(socket.AF_UNIX); s.connect(os.environ["KERNEL_GATEWAY_SOCKET"])
s.sendall(b"GET /v1/agents/me HTTP/1.0\r\n\r\n")
data = b""
while chunk := s.recv(65536): data += chunk
s.close()
print(data.split(b"\r\n")[0].decode(), json.loads(data.split(b"\r\n\r\n", 1)[1])["agent"])
"""


def test_a_connection_flood_from_a_kernel_is_capped_and_starves_nobody(gw):
    log_before = os.path.getsize(gw.log)
    run(gw, OPEN_FLOOD.format(n=FLOOD), session="flood", timeout=300)
    # The gateway answered every connection past the cap with a 429 and closed it.
    counts = json.loads(run(gw, COUNT_FLOOD, session="flood")["text"])
    assert counts["kept"] == 64 and counts["refused"] == FLOOD - 64, counts
    assert counts["answers"] == ["HTTP/1.1 429 Too Many Requests too_many_connections"]
    # While alice holds her 64: bob's kernel works, the control socket answers...
    assert run(gw, "print(6 * 7)", agent="bob")["text"] == "42\n"
    assert gw.client.call("GET", "/v1/info")[0] == 200
    # A flood is logged as a count, not as a line (or a traceback) per connection.
    assert os.path.getsize(gw.log) - log_before < 20_000
    with open(gw.log, errors="replace") as f:
        assert "Traceback" not in f.read()
    # Closing the flood gives alice her socket back.
    run(gw, "for s in FLOOD: s.close()\nFLOOD.clear()", session="flood")
    assert wait_until(lambda: "200 OK alice" in run(gw, ASK_OWN_SOCKET, session="probe")["text"], timeout=30)


HOLD_REQUESTS = r"""
import os, socket, json
SENT = []
for _ in range(20):
    s = socket.socket(socket.AF_UNIX); s.connect(os.environ["KERNEL_GATEWAY_SOCKET"])
    body = json.dumps({"code": "1", "timeout": 300}).encode()
    s.sendall(b"POST /v1/agents/me/sessions/busy/execute HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    SENT.append(s)
statuses = []
for s in SENT:
    data = b""
    while chunk := s.recv(65536): data += chunk
    statuses.append(data.split(b"\r\n")[0].decode().split(" ", 2)[1])
    s.close()
print(json.dumps(sorted(statuses)))
"""


def test_requests_in_flight_on_an_agent_socket_are_capped(gw):
    run(gw, "1", session="busy")
    sleeper = threading.Thread(target=gw.client.execute, args=("alice", "busy", "import time; time.sleep(600)"))
    sleeper.start()
    assert wait_until(lambda: gw.client.call("GET", "/v1/agents/alice/sessions/busy")[1]["state"] == "busy")
    result = {}
    sender = threading.Thread(target=lambda: result.update(body=run(gw, HOLD_REQUESTS, session="sender", timeout=600)))
    sender.start()

    def refused():
        with open(os.path.join(gw.state, "audit.log")) as f:
            lines = [json.loads(line) for line in f]
        return sum(1 for e in lines if e["tool"] == "execute" and e["status"] == 429 and e["agent"] is None)

    # Past the cap of 16 the 4 others are refused at once; the 16 wait for the busy session.
    assert wait_until(lambda: refused() >= 4, timeout=60)
    assert gw.client.call("POST", "/v1/agents/alice/sessions/busy/interrupt", {})[0] == 200
    sender.join(120)
    sleeper.join(60)
    assert json.loads(result["body"]["text"]) == ["200"] * 16 + ["429"] * 4


def test_running_out_of_descriptors_does_not_spin_or_flood_the_log(tmp_path):
    """The control socket has no cap: flooding it past the descriptor limit hits EMFILE itself."""
    import socket
    import subprocess
    import time

    import support

    gw = GatewayProcess(tmp_path)
    original = subprocess.Popen

    def limited(cmd, **kwargs):  # the gateway under a low descriptor limit, soft and hard
        return original(["prlimit", "--nofile=200:200", *cmd], **kwargs)

    support.subprocess.Popen = limited
    try:
        gw.start()
    finally:
        support.subprocess.Popen = original
    try:
        held = []
        deadline = time.monotonic() + 120
        while len(held) < 400:  # past the 200 descriptors, and past the listen backlog
            s = socket.socket(socket.AF_UNIX)
            s.setblocking(False)
            try:
                s.connect(gw.socket)
            except BlockingIOError:  # the backlog is full until the gateway sheds a connection
                s.close()
                assert time.monotonic() < deadline, f"the gateway stopped taking connections at {len(held)}"
                time.sleep(0.02)
                continue
            held.append(s)
        log_before = os.path.getsize(gw.log)
        time.sleep(3)  # the flood held: a spinning accept loop would log all along
        assert os.path.getsize(gw.log) - log_before < 5_000
        for s in held:
            s.close()
        assert wait_until(lambda: gw.client.call("GET", "/v1/info", timeout=5)[0] == 200, timeout=30)
        with open(gw.log, errors="replace") as f:
            text = f.read()
        assert "Traceback" not in text and "out of file descriptors" in text
    finally:
        gw.stop()
