"""The gateway through its real Unix sockets: real kernels in real bwrap."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import pytest

from support import Client, GatewayProcess, pid_alive, wait_until


def run(gw, code, agent="alice", session="s1", **extra):
    status, body = gw.client.execute(agent, session, code, **extra)
    assert status == 200, body
    return body


def test_state_persists_within_a_session_only(gw):
    assert run(gw, "x = 41")["status"] == "ok"
    assert run(gw, "x + 1")["text"] == "42\n"
    other = run(gw, "x", session="s2")
    assert other["status"] == "error" and other["error"]["ename"] == "NameError"
    # bob's sandbox holds bob's tree and nothing of alice's
    assert run(gw, f"import os; os.listdir({gw.root!r})", agent="bob")["text"] == "['bob']\n"


def test_agent_layout_and_session_dir(gw):
    root = os.path.join(gw.root, "alice")
    assert sorted(os.listdir(root)) >= sorted(
        ["DESIGN.md", "MISSION.md", "SOUL.md", "installed-skills", "jobs", "sessions", "user-files"]
    )
    body = run(gw, "import os; print(os.getcwd())", session="dir/é")
    # base64url of the UTF-8 id, no padding
    assert body["text"].strip() == os.path.join(root, "sessions", "ZGlyL8Op")
    status, again = gw.client.call("PUT", "/v1/agents/alice")
    assert status == 200 and again["agent"] == "alice"


def test_agent_socket_is_scoped(gw):
    alice = gw.agent_client("alice")
    assert alice.call("GET", "/v1/agents/me/sessions")[0] == 200
    status, body = alice.call("GET", "/v1/agents/bob/sessions")
    assert status == 403 and body["error"]["code"] == "forbidden"
    assert alice.call("POST", "/v1/agents/bob/sessions/s/execute", {"code": "1"})[0] == 403
    assert alice.call("GET", "/v1/agents")[0] == 403
    assert run(gw, "1", agent="bob", session="probe")["status"] == "ok"
    assert "probe" not in json.dumps(alice.call("GET", "/v1/agents/me")[1])


def test_agent_socket_reachable_from_own_kernel_only(gw):
    code = r"""
import os, socket, json
path = os.environ["KERNEL_GATEWAY_SOCKET"]
s = socket.socket(socket.AF_UNIX); s.connect(path)
s.sendall(b"GET /v1/agents/me HTTP/1.0\r\n\r\n")
data = b""
while chunk := s.recv(65536): data += chunk
print(json.loads(data.split(b"\r\n\r\n", 1)[1])["agent"])
"""
    assert run(gw, code)["text"] == "alice\n"
    # bob's sandbox has its own socket at the same place, scoped to bob
    assert run(gw, code, agent="bob")["text"] == "bob\n"
    probe = f"import os; print(os.path.exists({gw.socket!r}), os.path.exists({gw.state!r}))"
    assert run(gw, probe)["text"] == "False False\n"
    alice_sock = os.path.join(gw.state, "agents", "alice.sock")
    assert run(gw, f"import os; print(os.path.exists({alice_sock!r}))", agent="bob")["text"] == "False\n"


def test_timeout_interrupts_and_session_survives(gw):
    run(gw, "kept = 'yes'", session="slow")
    body = run(gw, "import time\nprint('before', flush=True)\ntime.sleep(100)", session="slow", timeout=1)
    assert body["status"] == "timeout"
    assert "before" in body["text"]
    assert run(gw, "kept", session="slow")["text"] == "'yes'\n"


def test_time_queued_behind_a_busy_cell_counts_against_the_timeout(gw):
    flag = os.path.join(gw.root, "alice", "user-files", "release-queue")
    first = {}
    thread = threading.Thread(
        target=lambda: first.update(
            body=run(gw, f"import os, time\nwhile not os.path.exists({flag!r}): time.sleep(0.05)", session="queue")
        )
    )
    thread.start()
    assert wait_until(lambda: gw.client.call("GET", "/v1/agents/alice/sessions/queue")[1].get("state") == "busy")
    queued = run(gw, "ran = True", session="queue", timeout=1)
    assert queued["status"] == "timeout" and "did not run" in queued["text"]
    open(flag, "w").close()
    thread.join(60)
    assert first["body"]["status"] == "ok"
    assert run(gw, "'ran' in dir()", session="queue")["text"] == "False\n"


def test_executions_in_one_session_run_one_at_a_time_in_arrival_order(gw):
    flag = os.path.join(gw.root, "alice", "user-files", "release-order")
    run(gw, "order = []", session="fifo")
    gate = threading.Thread(
        target=run, args=(gw, f"import os, time\nwhile not os.path.exists({flag!r}): time.sleep(0.05)"),
        kwargs={"session": "fifo"},
    )
    gate.start()
    assert wait_until(lambda: gw.client.call("GET", "/v1/agents/alice/sessions/fifo")[1].get("state") == "busy")
    threads = []
    for n in range(1, 5):
        threads.append(threading.Thread(target=run, args=(gw, f"order.append({n})"), kwargs={"session": "fifo"}))
        threads[-1].start()
        time.sleep(0.3)  # not a timing assertion: only makes the arrival order unambiguous
    open(flag, "w").close()
    for t in [gate, *threads]:
        t.join(60)
    assert run(gw, "order", session="fifo")["text"] == "[1, 2, 3, 4]\n"


def test_interrupt_route_stops_a_busy_cell(gw):
    results = {}

    def busy():
        results["body"] = run(gw, "while True: pass", session="busy")

    thread = threading.Thread(target=busy)
    thread.start()
    assert wait_until(lambda: gw.client.call("GET", "/v1/agents/alice/sessions/busy")[1].get("state") == "busy")
    status, _ = gw.client.call("POST", "/v1/agents/alice/sessions/busy/interrupt")
    assert status == 200
    thread.join(60)
    assert results["body"]["status"] == "error"
    assert results["body"]["error"]["ename"] == "KeyboardInterrupt"


def test_a_client_that_disconnects_gets_its_cell_interrupted(gw):
    code = "import time\nfor _ in range(600): time.sleep(0.1)\nfinished = True"
    conn = socket.socket(socket.AF_UNIX)
    conn.connect(gw.socket)
    body = json.dumps({"code": code}).encode()
    conn.sendall(
        b"POST /v1/agents/alice/sessions/leaver/execute HTTP/1.1\r\nHost: gw\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    )
    session = lambda: gw.client.call("GET", "/v1/agents/alice/sessions/leaver")  # noqa: E731
    assert wait_until(lambda: session()[0] == 200 and session()[1]["state"] == "busy")
    conn.close()
    # Interrupted: idle again long before the 60 s the cell would take, and it never finished.
    assert wait_until(lambda: session()[1]["state"] == "idle", timeout=20)
    assert run(gw, "'finished' in dir()", session="leaver")["text"] == "False\n"


def test_died_then_fresh_kernel_with_notice(gw):
    run(gw, "y = 1", session="dies")
    body = run(gw, "import os; os._exit(3)", session="dies")
    assert body["status"] == "died"
    assert body["exit_code"] == 3
    assert "lost" in body["text"]
    after = run(gw, "'y' in dir()", session="dies")
    assert after["text"] == "False\n"
    assert "died" in after["notice"]


def test_spare_kernel_is_moved_into_its_session(gw):
    run(gw, "1", agent="bob", session="first")
    assert wait_until(lambda: gw.client.call("GET", "/v1/agents/bob")[1]["spare_kernel_ready"])
    # Adopting the spare left no name behind in the user's namespace.
    hidden = ("In", "Out", "exit", "quit", "get_ipython", "open")
    names = run(gw, f"[n for n in dir() if not n.startswith('_') and n not in {hidden!r}]", agent="bob", session="second")
    assert names["text"] == "[]\n"
    code = "import os; print(os.getcwd(), os.environ['HOME'], os.environ['JLK_SESSION']); print('y' * 200_000)"
    body = run(gw, code, agent="bob", session="second")
    session_dir = os.path.join(gw.root, "bob", "sessions", "c2Vjb25k")
    assert body["text"].split("\n")[0] == f"{session_dir} {session_dir} second"
    [spill] = body["spill_paths"]
    assert spill.startswith(os.path.join(session_dir, "outputs") + "/")


def test_segfault_is_died_with_its_signal(gw):
    body = run(gw, "import ctypes; ctypes.string_at(0)", session="segv")
    assert body["status"] == "died" and body["signal"] == 11
    assert run(gw, "1 + 1", session="segv")["text"] == "2\n"


def test_restart_clears_state(gw):
    run(gw, "z = 5", session="restart")
    status, body = gw.client.call("POST", "/v1/agents/alice/sessions/restart/restart")
    assert status == 200 and body["state"] == "idle"
    assert run(gw, "'z' in dir()", session="restart")["text"] == "False\n"


def test_input_fails_fast(gw):
    body = run(gw, "input('name? ')", timeout=30)
    assert body["status"] == "error"
    assert body["error"]["ename"] == "StdinNotImplementedError"


def test_stream_yields_events_before_the_cell_ends(gw, tmp_path):
    flag = os.path.join(gw.root, "alice", "user-files", "go")
    code = (
        "import os, time\nprint('first', flush=True)\n"
        f"while not os.path.exists({flag!r}): time.sleep(0.05)\nprint('second')"
    )
    events = gw.client.stream("/v1/agents/alice/sessions/s1/execute", {"code": code, "stream": True})
    first = next(events)
    # The cell is still waiting for the flag: this event came before it ended.
    assert first == {"event": "output", "output": {"output_type": "stream", "name": "stdout", "text": "first\n"}}
    open(flag, "w").close()
    rest = list(events)
    assert rest[-1]["event"] == "result" and rest[-1]["status"] == "ok"
    assert rest[-1]["text"] == "first\nsecond\n"


def test_image_becomes_artifact(gw):
    code = (
        "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()"
    )
    body = run(gw, code, session="plots", timeout=120)
    assert body["status"] == "ok", body["text"]
    [artifact] = body["artifacts"]
    assert artifact["mime"] == "image/png"
    assert artifact["path"].startswith(os.path.join(gw.root, "alice", "sessions"))
    with open(artifact["path"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert not any("image/png" in o.get("data", {}) for o in body["outputs"])  # not inline unless asked
    inline = run(gw, "plt.plot([3, 1]); plt.show()", session="plots", inline_images=True)
    assert any("image/png" in o.get("data", {}) for o in inline["outputs"])


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1])


def test_100mb_output_is_bounded(gw):
    before = rss_kb(gw.proc.pid)
    body = run(gw, "print('x' * 100_000_000)", session="big", timeout=300)
    growth_mb = (rss_kb(gw.proc.pid) - before) / 1024
    assert body["status"] == "ok"
    assert body["truncated"] is True
    assert len(body["text"]) < 70_000
    [spill] = body["spill_paths"]
    assert os.path.getsize(spill) >= 100_000_000
    assert spill in body["text"]
    assert growth_mb < 64


def test_audit_log_has_one_line_per_call(gw):
    run(gw, "secret = 'do-not-log'", session="audit")

    def lines():
        with open(os.path.join(gw.state, "audit.log")) as f:
            return [json.loads(line) for line in f]

    # The line is written once the response has gone out.
    assert wait_until(lambda: any(e["session"] == "audit" and e["tool"] == "execute" for e in lines()))
    mine = [e for e in lines() if e["session"] == "audit" and e["tool"] == "execute"]
    assert mine[-1]["agent"] == "alice" and mine[-1]["status"] == 200 and mine[-1]["bytes_in"] > 0
    assert "do-not-log" not in json.dumps(lines())


# --- bad input: a clear error, and nothing changes ------------------------------------------


def snapshot(gw):
    agents = gw.client.call("GET", "/v1/agents")[1]
    return json.dumps(
        [(a["agent"], sorted((s["id"], s["execution_count"]) for s in a["sessions"])) for a in agents["agents"]]
    ), sorted(os.listdir(gw.root))


BAD_REQUESTS = [
    ("POST", "/v1/agents/alice/sessions/s1/execute", b"{not json", 400, "malformed_json"),
    ("POST", "/v1/agents/alice/sessions/s1/execute", b"[1, 2]", 400, "malformed_json"),
    ("POST", "/v1/agents/alice/sessions/s1/execute", b'{"code": 5}', 400, "wrong_type"),
    ("POST", "/v1/agents/alice/sessions/s1/execute", b'{"code": "1", "timeout": "soon"}', 400, "wrong_type"),
    ("POST", "/v1/agents/alice/sessions/s1/execute", b'{"code": "1", "timeout": true}', 400, "wrong_type"),
    ("POST", "/v1/agents/alice/sessions/s1/execute", b'{"code": "1", "timeout": -1}', 400, "invalid_timeout"),
    ("POST", "/v1/agents/alice/sessions/s1/execute", b'{"code": "1", "colour": "red"}', 400, "unknown_field"),
    ("POST", "/v1/agents/alice/sessions/s1/execute", b"{}", 400, "missing_field"),
    ("POST", "/v1/agents/alice/sessions", b'{"session": 7}', 400, "wrong_type"),
    ("POST", "/v1/agents/alice/sessions", b'{"session": ""}', 400, "invalid_session"),
    ("POST", "/v1/agents/alice/sessions", b'{"session": "' + b"s" * 129 + b'"}', 400, "invalid_session"),
    ("POST", "/v1/agents/alice/sessions", b'{"session": "a\\u0000b"}', 400, "invalid_session"),
    ("POST", "/v1/agents/alice/sessions", b'{"kernel": "julia"}', 400, "unknown_kernel"),
    ("PUT", "/v1/agents/.hidden", b"", 400, "invalid_agent"),
    ("PUT", "/v1/agents/-dash", b"", 400, "invalid_agent"),
    ("PUT", "/v1/agents/" + "a" * 65, b"", 400, "invalid_agent"),
    ("PUT", "/v1/agents/a%20b", b"", 400, "invalid_agent"),
    ("PUT", "/v1/agents/me", b"", 400, "invalid_agent"),
    ("GET", "/v1/agents/nobody", None, 404, "unknown_agent"),
    ("POST", "/v1/agents/nobody/sessions/s/execute", b'{"code": "1"}', 404, "unknown_agent"),
    ("GET", "/v1/agents/alice/sessions/never", None, 404, "unknown_session"),
    ("DELETE", "/v1/agents/alice/sessions/never", None, 404, "unknown_session"),
    ("POST", "/v1/agents/alice/sessions/never/interrupt", b"{}", 404, "unknown_session"),
    ("POST", "/v1/agents/alice/sessions/never/restart", b"{}", 404, "unknown_session"),
    ("DELETE", "/v1/info", None, 405, "method_not_allowed"),
    ("GET", "/v1/agents/alice/sessions/s1/execute", None, 405, "method_not_allowed"),
    ("GET", "/v2/anything", None, 404, "no_route"),
]


@pytest.mark.parametrize("method,path,raw,status,code", BAD_REQUESTS)
def test_bad_input_is_refused_and_changes_nothing(gw, method, path, raw, status, code):
    run(gw, "1")  # the session exists before
    before = snapshot(gw)
    got, body = gw.client.call(method, path, raw=raw)
    assert (got, body["error"]["code"]) == (status, code), body
    assert body["error"]["message"]
    assert snapshot(gw) == before


def test_oversized_body_is_413(tmp_path):
    gw = GatewayProcess(tmp_path, "--Gateway.max_body_size=1000").start()
    try:
        gw.client.call("PUT", "/v1/agents/a")
        status, body = gw.client.execute("a", "s", "x = '" + "y" * 2000 + "'")
        assert status == 413 and body["error"]["code"] == "body_too_large"
        assert gw.client.call("GET", "/v1/agents/a/sessions")[1]["sessions"] == []
    finally:
        gw.stop()


# --- caps, culling, restart of the gateway, SIGTERM ------------------------------------------


def test_caps_hold_under_concurrent_creates(tmp_path):
    gw = GatewayProcess(tmp_path, "--Gateway.max_sessions_per_agent=2", "--Gateway.spare_kernels=False").start()
    try:
        gw.client.call("PUT", "/v1/agents/a")
        statuses = []

        def create(i):
            statuses.append(gw.client.call("POST", "/v1/agents/a/sessions", {"session": f"s{i}"})[0])

        threads = [threading.Thread(target=create, args=(i,)) for i in range(5)]
        [t.start() for t in threads]
        [t.join(120) for t in threads]
        assert sorted(statuses) == [201, 201, 429, 429, 429]
        status, body = gw.client.call("POST", "/v1/agents/a/sessions", {"session": "more"})
        assert status == 429 and body["error"]["code"] == "too_many_sessions"
        assert len(gw.client.call("GET", "/v1/agents/a/sessions")[1]["sessions"]) == 2
    finally:
        gw.stop()


def test_idle_sessions_are_culled(tmp_path):
    gw = GatewayProcess(tmp_path, "--Gateway.cull_idle_timeout=1", "--Gateway.cull_interval=0.5").start()
    try:
        gw.client.call("PUT", "/v1/agents/a")
        body = gw.client.call("POST", "/v1/agents/a/sessions", {"session": "idle"})[1]
        assert wait_until(lambda: gw.client.call("GET", "/v1/agents/a/sessions")[1]["sessions"] == [], timeout=30)
        assert wait_until(lambda: not pid_alive(body["pid"]))
    finally:
        gw.stop()


def test_gateway_kill9_then_sessions_are_lost_not_orphaned(tmp_path):
    gw = GatewayProcess(tmp_path).start()
    gw.client.call("PUT", "/v1/agents/a")
    assert gw.client.execute("a", "keep", "open('note.txt', 'w').write('still here'); v = 1")[1]["status"] == "ok"
    pid = gw.client.call("GET", "/v1/agents/a/sessions/keep")[1]["pid"]
    gw.stop(signal.SIGKILL)
    assert wait_until(lambda: not pid_alive(pid)), "kernel outlived its gateway"
    gw2 = GatewayProcess(tmp_path).start()
    try:
        info = gw2.client.call("GET", "/v1/info")[1]
        # What the killed gateway could not clean up was swept at this start.
        assert os.listdir(info["paths"]["runtime"]) == []
        leftovers = [
            name
            for parent in ("/sys/fs/cgroup/pids/kernel-gateway", "/sys/fs/cgroup/unified/kernel-gateway")
            if os.path.isdir(parent)
            for name in os.listdir(parent)
            if name.startswith(info["sandbox"]["cgroup_prefix"])
        ]
        assert leftovers == []
        [session] = gw2.client.call("GET", "/v1/agents/a/sessions")[1]["sessions"]
        assert session["id"] == "keep" and session["state"] == "lost"
        body = gw2.client.execute("a", "keep", "print(open('note.txt').read()); 'v' in dir()")[1]
        assert body["text"] == "still here\nFalse\n"
        assert "restarted" in body["notice"]
    finally:
        gw2.stop()


def test_sigterm_stops_kernels_and_removes_sockets(tmp_path):
    gw = GatewayProcess(tmp_path).start()
    gw.client.call("PUT", "/v1/agents/a")
    gw.client.execute("a", "s", "1")
    pid = gw.client.call("GET", "/v1/agents/a/sessions/s")[1]["pid"]
    assert gw.stop(signal.SIGTERM) == 0
    assert not os.path.exists(gw.socket)
    assert not os.path.exists(os.path.join(gw.state, "agents", "a.sock"))
    assert wait_until(lambda: not pid_alive(pid))
    again = GatewayProcess(tmp_path).start()  # at once: no stale lock or socket
    try:
        assert again.client.call("GET", "/v1/info")[0] == 200
    finally:
        again.stop()


def test_control_socket_permissions(gw):
    assert os.stat(gw.socket).st_mode & 0o777 == 0o600
    assert os.stat(os.path.dirname(gw.socket)).st_mode & 0o777 == 0o700
    with pytest.raises(OSError):
        Client(os.path.join(gw.state, "nope.sock")).call("GET", "/v1/info")
    s = socket.socket(socket.AF_UNIX)
    s.connect(gw.socket)
    s.close()


def test_per_agent_profile_override_turns_the_network_on_for_one_agent(tmp_path):
    with open(os.path.join(os.path.dirname(__file__), "..", "kernel_gateway", "sandbox", "profiles", "kernel.json")) as f:
        profile = json.load(f)
    profile["sandbox"]["network"] = True
    override = tmp_path / "net-kernel.json"
    override.write_text(json.dumps(profile))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    gw = GatewayProcess(tmp_path, f'--Gateway.agent_profiles={{"online": {{"kernel": "{override}"}}}}').start()
    try:
        code = (
            "import socket\ns = socket.socket(); s.settimeout(5)\n"
            f"try:\n    s.connect(('127.0.0.1', {port})); print('connected')\n"
            "except OSError as e:\n    print('refused', type(e).__name__)"
        )
        for agent in ("online", "offline"):
            gw.client.call("PUT", f"/v1/agents/{agent}")
        assert gw.client.execute("online", "s", code)[1]["text"] == "connected\n"
        assert gw.client.execute("offline", "s", code)[1]["text"].startswith("refused")
    finally:
        gw.stop()
        listener.close()
