"""Every shared pool has a per-agent share and a total: kernel websockets, Jupyter sessions, the job
queue and its records, the kernel log.

Real gateway, real kernels, real sockets (the TCP port and the agents' own sockets).  One agent
floods each pool past its share and is refused with a clear error; another agent is still served
from the same pool; what the gateway holds is judged from the host.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import pathlib
import socket

import pytest

from jupyter_support import JupyterClient, KernelSocket
from support import RAW_IOPUB, GatewayProcess, execute_ok, wait_until, with_agents

WS_SHARE, WS_TOTAL = 4, 6
SESSION_SHARE, SESSION_TOTAL = 5, 8
QUEUED_SHARE, QUEUED_TOTAL, RECORDS = 2, 3, 6
LOG_CAP = 128 << 10
WS_BYTES = 8 << 20


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    gateway = with_agents(GatewayProcess(
        tmp_path_factory.mktemp("shares"), "--jupyter-port", "0", "--Gateway.max_running_jobs=2",
        f"--Gateway.max_websockets_per_agent={WS_SHARE}", f"--Gateway.max_websockets_total={WS_TOTAL}",
        f"--Gateway.max_jupyter_sessions_per_agent={SESSION_SHARE}",
        f"--Gateway.max_jupyter_sessions_total={SESSION_TOTAL}",
        f"--Gateway.max_queued_jobs_per_agent={QUEUED_SHARE}", f"--Gateway.max_queued_jobs_total={QUEUED_TOTAL}",
        f"--Gateway.max_jobs_per_agent={RECORDS}", f"--Gateway.kernel_log_max_bytes={LOG_CAP}",
        f"--Gateway.max_websocket_bytes_per_agent={WS_BYTES}",
    ), "alice", "bob", "carol")
    info = gateway.client.call("GET", "/v1/info")[1]
    gateway.url = info["jupyter"]["url"]
    gateway.port = int(gateway.url.rstrip("/").rsplit(":", 1)[1])
    gateway.jc = {}
    for agent in ("alice", "bob", "carol"):
        token = gateway.client.call("POST", f"/v1/agents/{agent}/tokens")[1]["token"]
        gateway.jc[agent] = JupyterClient(gateway.url + f"agents/{agent}/", token)
    yield gateway
    gateway.stop()


def test_the_shares_are_shown_in_info(gw):
    limits = gw.client.call("GET", "/v1/info")[1]["limits"]
    assert limits["max_websockets_per_agent"] == WS_SHARE and limits["max_websockets_total"] == WS_TOTAL
    assert limits["max_jupyter_sessions_per_agent"] == SESSION_SHARE
    assert limits["max_queued_jobs_per_agent"] == QUEUED_SHARE and limits["max_jobs_per_agent"] == RECORDS
    assert limits["kernel_log_max_bytes"] == LOG_CAP and limits["max_job_env_size"] == 64 << 10


# --- kernel websockets ---------------------------------------------------------------


def kernel_of(gw, agent: str) -> str:
    status, model = gw.jc[agent].call("POST", "api/kernels", {})
    assert status == 201, model
    return model["id"]


def ws_open(gw, agent: str, kid: str, session_id: str, via: str = "tcp") -> tuple[socket.socket, str, dict | None]:
    """A websocket handshake by hand, on the TCP port (with the agent's token) or on the agent's socket.

    Returns the socket (held open on success), the status line, and a JSON body if there was one.
    """
    if via == "tcp":
        sock = socket.create_connection(("127.0.0.1", gw.port), timeout=60)
        path, auth = f"/agents/{agent}/api/kernels/{kid}/channels", f"Authorization: token {gw.jc[agent].token}\r\n"
    else:
        sock = socket.socket(socket.AF_UNIX)
        sock.settimeout(60)
        sock.connect(os.path.join(gw.state, "agents", f"{agent}.sock"))
        path, auth = f"/agents/me/api/kernels/{kid}/channels", ""
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall((f"GET {path}?session_id={session_id} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                  f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n{auth}\r\n").encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = head.split(b"\r\n")[0].decode()
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0)
    while len(body) < length:
        body += sock.recv(65536)
    return sock, status, json.loads(body) if length else None


def bob_runs_code_over_a_websocket(gw, kid: str) -> None:
    async def go():
        ks = await KernelSocket.connect(gw.jc["bob"].base_url, kid, gw.jc["bob"].token)
        try:
            return await ks.run("6 * 7")
        finally:
            ks.close()

    assert asyncio.run(go())["results"] == [{"text/plain": "42"}]


def test_one_agents_websockets_stop_at_its_share_and_the_total_and_others_still_connect(gw):
    alice_kid, bob_kid, carol_kid = kernel_of(gw, "alice"), kernel_of(gw, "bob"), kernel_of(gw, "carol")
    held = []
    try:
        # alice on the TCP port: her share opens, the next is refused before the upgrade.
        for i in range(WS_SHARE):
            sock, status, _ = ws_open(gw, "alice", alice_kid, f"a{i}")
            assert status == "HTTP/1.1 101 Switching Protocols", status
            held.append(sock)
        sock, status, body = ws_open(gw, "alice", alice_kid, "a-more")
        assert status == "HTTP/1.1 429 Too Many Requests" and body["error"]["code"] == "too_many_websockets"
        sock.close()
        # ...and from her own socket, as her kernel would: refused too.
        sock, status, body = ws_open(gw, "alice", alice_kid, "a-sock", via="socket")
        assert status == "HTTP/1.1 429 Too Many Requests" and body["error"]["code"] == "too_many_websockets"
        sock.close()
        # bob opens one and runs code over it while alice holds her share.
        bob_runs_code_over_a_websocket(gw, bob_kid)
        # The total, 6: alice's 4, bob's closed one (buffering for a reconnect) and a new one of bob's.
        sock, status, _ = ws_open(gw, "bob", bob_kid, "b-held")
        assert status == "HTTP/1.1 101 Switching Protocols", status
        held.append(sock)
        # carol's first takes the place of bob's buffer (a buffer is dropped, never an open websocket)...
        sock, status, _ = ws_open(gw, "carol", carol_kid, "c0")
        assert status == "HTTP/1.1 101 Switching Protocols", status
        held.append(sock)
        sock, status, body = ws_open(gw, "carol", carol_kid, "c1")  # ...and with 6 open, hers is refused
        assert status == "HTTP/1.1 429 Too Many Requests" and "6 kernel websockets" in body["error"]["message"]
        sock.close()
        # The kernel lists exactly the websockets alice holds open.
        assert gw.jc["alice"].call("GET", f"api/kernels/{alice_kid}")[1]["connections"] == WS_SHARE
        # alice closes two: they buffer for a reconnect, still hers; a new one takes her own oldest buffer's place.
        for sock in held[:2]:
            sock.close()
        assert wait_until(lambda: gw.jc["alice"].call("GET", f"api/kernels/{alice_kid}")[1]["connections"] == 2)
        for i in range(2):
            sock, status, _ = ws_open(gw, "alice", alice_kid, f"a-new{i}", via="socket")
            assert status == "HTTP/1.1 101 Switching Protocols", status
            held.append(sock)
        sock, status, body = ws_open(gw, "alice", alice_kid, "a-new2", via="socket")
        assert status == "HTTP/1.1 429 Too Many Requests", status
        sock.close()
    finally:
        for sock in held:
            sock.close()
        for agent, kid in (("alice", alice_kid), ("bob", bob_kid), ("carol", carol_kid)):
            gw.jc[agent].call("DELETE", f"api/kernels/{kid}")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


FLOOD_IOPUB = RAW_IOPUB + "for _ in range(150): raw('stream', {'name': 'stdout', 'text': 'x' * (1 << 20)})\n"


def test_kernel_messages_held_for_an_agents_websockets_stop_at_its_share(gw):
    """150 MB from alice's kernel to a websocket whose client never reads, then to buffers of websockets that left."""
    model = gw.jc["alice"].call("POST", "api/kernels", {})[1]
    kid, session = model["id"], model["gateway_session"]
    bob_kid = kernel_of(gw, "bob")
    try:
        assert execute_ok(gw, "1", "alice", session)["status"] == "ok"
        before = rss_mb(gw.proc.pid)
        stalled, status, _ = ws_open(gw, "alice", kid, "never-reads")
        assert status == "HTTP/1.1 101 Switching Protocols"
        assert execute_ok(gw, FLOOD_IOPUB, "alice", session, timeout=300)["status"] == "ok"
        # The gateway closed the websocket that did not read, and holds none of it.
        assert rss_mb(gw.proc.pid) - before < 60, (before, rss_mb(gw.proc.pid))
        stalled.settimeout(60)
        received = 0
        while chunk := stalled.recv(1 << 20):
            received += len(chunk)
        assert received < 150 << 20
        bob_runs_code_over_a_websocket(gw, bob_kid)
        # Websockets that left: their buffers for a reconnect share the same bytes.
        for i in range(3):
            sock, status, _ = ws_open(gw, "alice", kid, f"left{i}")
            assert status == "HTTP/1.1 101 Switching Protocols"
            sock.close()
        assert wait_until(lambda: gw.jc["alice"].call("GET", f"api/kernels/{kid}")[1]["connections"] == 0)
        assert execute_ok(gw, FLOOD_IOPUB, "alice", session, timeout=300)["status"] == "ok"
        assert rss_mb(gw.proc.pid) - before < 60, (before, rss_mb(gw.proc.pid))
        bob_runs_code_over_a_websocket(gw, bob_kid)
    finally:
        gw.jc["alice"].call("DELETE", f"api/kernels/{kid}")
        gw.jc["bob"].call("DELETE", f"api/kernels/{bob_kid}")


# --- Jupyter sessions -----------------------------------------------------------------


def test_jupyter_sessions_stop_at_the_share_and_the_total_and_their_names_are_bounded(gw):
    kids = {agent: kernel_of(gw, agent) for agent in ("alice", "bob", "carol")}

    def create(agent: str, path: str, name: str | None = None, client=None):
        body = {"path": path, "type": "console", "kernel": {"id": kids[agent]}, **({"name": name} if name else {})}
        if client is not None:
            return client.call("POST", f"/agents/{agent}/api/sessions", body)
        return gw.jc[agent].call("POST", "api/sessions", body)

    try:
        for i in range(SESSION_SHARE):
            assert create("alice", f"c{i}")[0] == 201
        status, body = create("alice", "one-more")
        assert status == 429 and body["error"]["code"] == "too_many_sessions"
        status, body = create("alice", "through-the-socket", client=gw.agent_client("alice"))  # not through another way
        assert status == 429 and body["error"]["code"] == "too_many_sessions"
        assert len(gw.jc["alice"].call("GET", "api/sessions")[1]) == SESSION_SHARE
        # The same path again replaces its session: no room needed.
        assert create("alice", "c0")[0] == 201
        # bob is served; then carol reaches the total (5 + 1 + 2).
        assert create("bob", "b0")[0] == 201
        assert create("carol", "k0")[0] == 201 and create("carol", "k1")[0] == 201
        status, body = create("carol", "k2")
        assert status == 429 and f"{SESSION_TOTAL} Jupyter sessions" in body["error"]["message"]
        # A huge name or path is refused, on create and on rename, and changes nothing.
        assert create("bob", "b1", name="n" * 100_000)[1]["error"]["code"] == "invalid_name"
        assert create("bob", "p" * 5000)[1]["error"]["code"] == "invalid_path"
        sid = gw.jc["bob"].call("GET", "api/sessions")[1][0]["id"]
        status, body = gw.jc["bob"].call("PATCH", f"api/sessions/{sid}", {"name": "n" * 100_000})
        assert status == 400 and body["error"]["code"] == "invalid_name"
        assert [s["name"] for s in gw.jc["bob"].call("GET", "api/sessions")[1]] == ["b0"]
        # Deleting one makes room again.
        first = gw.jc["alice"].call("GET", "api/sessions")[1][0]["id"]
        assert gw.jc["alice"].call("DELETE", f"api/sessions/{first}")[0] == 204
        assert create("carol", "k2")[0] == 201
    finally:
        for agent, kid in kids.items():
            gw.jc[agent].call("DELETE", f"api/kernels/{kid}")


# --- the job queue and its records ------------------------------------------------------


def make_dir(gw, agent: str) -> str:
    rel = "user-files/repo"
    path = pathlib.Path(gw.root) / agent / rel
    path.mkdir(parents=True, exist_ok=True)
    owner = os.stat(pathlib.Path(gw.root) / agent)
    for where in (path.parent, path):
        os.chown(where, owner.st_uid, owner.st_gid)
    return rel


def submit(gw, agent: str, **extra):
    body = {"kind": "command", "from": make_dir(gw, agent), "command": "sleep 120", **extra}
    body = {k: v for k, v in body.items() if v is not None}
    return gw.client.call("POST", f"/v1/agents/{agent}/jobs", body)


def records(gw, agent: str) -> list[pathlib.Path]:
    return sorted((pathlib.Path(gw.state) / "jobs" / agent).glob("*.json"))


def test_the_job_queue_and_its_records_stop_at_the_share_and_the_total(gw):
    submitted = []

    def ok(agent: str, **extra) -> dict:
        status, job = submit(gw, agent, **extra)
        assert status == 201, job
        submitted.append((agent, job["id"]))
        return job

    try:
        ok("alice")  # runs
        assert wait_until(lambda: gw.client.call("GET", f"/v1/agents/alice/jobs/{submitted[0][1]}")[1]["state"]
                          == "running")
        ok("alice"), ok("alice")  # wait
        status, body = submit(gw, "alice")
        assert status == 429 and body["error"]["code"] == "too_many_jobs" and "waiting" in body["error"]["message"]
        # A huge env or a huge command is refused whatever the queue, before anything is stored.
        status, body = submit(gw, "carol", env={"BIG": "x" * (15 << 20)})
        assert status == 413 and body["error"]["code"] == "env_too_large"
        status, body = submit(gw, "carol", env={f"V{i}": "x" * 1000 for i in range(100)})
        assert status == 413 and body["error"]["code"] == "env_too_large"
        status, body = submit(gw, "carol", command=None, argv=["/bin/true"] + ["y" * 60_000] * 40)
        assert status == 413 and body["error"]["code"] == "job_too_large"
        assert records(gw, "carol") == []
        # bob is served: his job runs beside alice's, his next waits; then the total of waiting jobs is reached.
        ok("bob")
        ok("bob")
        status, body = submit(gw, "carol")
        assert status == 429 and f"{QUEUED_TOTAL} jobs waiting" in body["error"]["message"]
        # Records: cancelled jobs still count until deleted, so alice stops at her share of records.
        for agent, job_id in submitted[1:3]:
            assert gw.client.call("POST", f"/v1/agents/{agent}/jobs/{job_id}/cancel")[0] == 200
        while len(records(gw, "alice")) < RECORDS:
            job = ok("alice")
            assert gw.client.call("POST", f"/v1/agents/alice/jobs/{job['id']}/cancel")[0] == 200
        status, body = submit(gw, "alice")
        assert status == 429 and "job records" in body["error"]["message"]
        assert len(records(gw, "alice")) == RECORDS
        assert sum(p.stat().st_size for p in records(gw, "alice")) < RECORDS * (64 << 10)
        # Deleting an ended job makes room again.
        ended = [j for a, j in submitted if a == "alice"][-1]
        assert gw.client.call("DELETE", f"/v1/agents/alice/jobs/{ended}")[0] == 200
        submitted.remove(("alice", ended))
        ok("alice")
    finally:
        for agent, job_id in submitted:
            gw.client.call("POST", f"/v1/agents/{agent}/jobs/{job_id}/cancel")


# --- the kernel log ------------------------------------------------------------------------


NOISE = "import os\nfor _ in range({n}): os.write(2, (b'{mark}' * 999)[:999] + b'\\n')\n"


def log_files(gw, agent: str) -> list[pathlib.Path]:
    return [p for p in (pathlib.Path(gw.state) / "logs").glob(f"kernel-{agent}.log*")]


def log_bytes(gw, agent: str) -> int:
    return sum(p.stat().st_size for p in log_files(gw, agent))


def logged(gw, agent: str, mark: str) -> bool:
    current = pathlib.Path(gw.state) / "logs" / f"kernel-{agent}.log"
    return current.exists() and mark.encode() * 10 in current.read_bytes()


BOUND = 2 * LOG_CAP + 2 * (64 << 10)  # the file and its .1, each at most one read past the cap


def test_kernel_restarts_in_a_loop_do_not_grow_the_kernel_log_past_its_cap(gw):
    for i in range(8):  # each kernel writes 150 KB to its stderr, then is restarted: a fresh 1 MiB allowance
        mark = "abcdefgh"[i]
        assert execute_ok(gw, NOISE.format(n=150, mark=mark), "alice", "noisy")["status"] == "ok"
        assert wait_until(lambda: logged(gw, "alice", mark), timeout=30)  # the newest output is kept
        assert log_bytes(gw, "alice") <= BOUND
        assert gw.client.call("POST", "/v1/agents/alice/sessions/noisy/restart", {})[0] == 200
    assert len(log_files(gw, "alice")) == 2 and log_bytes(gw, "alice") <= BOUND
    # The same through the Jupyter API's restart, and bob's log is his own.
    kid = kernel_of(gw, "bob")
    try:
        for i in range(4):
            mark = "ijkl"[i]
            session = gw.jc["bob"].call("GET", f"api/kernels/{kid}")[1]["gateway_session"]
            assert execute_ok(gw, NOISE.format(n=150, mark=mark), "bob", session)["status"] == "ok"
            assert wait_until(lambda: logged(gw, "bob", mark), timeout=30)
            assert gw.jc["bob"].call("POST", f"api/kernels/{kid}/restart")[0] == 200
            assert log_bytes(gw, "bob") <= BOUND
    finally:
        gw.jc["bob"].call("DELETE", f"api/kernels/{kid}")


def test_many_kernels_of_one_agent_writing_at_once_share_one_capped_log(gw):
    sessions = [f"many{i}" for i in range(3)]
    for s in sessions:
        assert execute_ok(gw, "1", "carol", s)["status"] == "ok"
    for _ in range(2):
        for s, mark in zip(sessions, "xyz"):
            assert execute_ok(gw, NOISE.format(n=200, mark=mark), "carol", s)["status"] == "ok"
    assert wait_until(lambda: logged(gw, "carol", "z"), timeout=30)
    assert log_bytes(gw, "carol") <= BOUND
    for s in sessions:
        gw.client.call("DELETE", f"/v1/agents/carol/sessions/{s}")
