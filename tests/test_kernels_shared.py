"""Kernels as first-class objects: ids, several clients at once, observed state.

The gateway runs in the test process (real bwrap'd kernels, real sockets), so
a test can attach a second real client to a session's kernel, the way a
Jupyter websocket will, and drive both at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import uuid

import pytest

from support import InProcessGateway, wait_until


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shared")
    profile = tmp / "kernel.json"
    with open(os.path.join(os.path.dirname(__file__), "..", "kernel_gateway", "sandbox", "profiles", "kernel.json")) as f:
        profile.write_text(f.read())
    gateway = InProcessGateway(
        tmp, spare_kernels=False, cull_idle_timeout=3600.0, agent_profiles={"fragile": {"kernel": str(profile)}}
    ).start()
    gateway.fragile_profile = profile
    for agent in ("a", "fragile"):
        assert gateway.client.call("PUT", f"/v1/agents/{agent}")[0] == 201
    yield gateway
    gateway.stop()


def session(gw, sid: str, agent: str = "a") -> dict:
    status, body = gw.client.call("GET", f"/v1/agents/{agent}/sessions/{sid}")
    assert status == 200, body
    return body


def kernel_of(gw, sid: str, agent: str = "a"):
    return gw.core.pool.get(session(gw, sid, agent)["kernel_id"])


async def run_on(client, code: str, timeout: float = 60) -> dict:
    """Execute on a raw client; collect exactly what belongs to this request."""
    msg_id = client.execute(code, allow_stdin=False)
    stdout, others = "", []
    deadline = time.monotonic() + timeout
    while True:
        msg = await client.get_iopub_msg(timeout=deadline - time.monotonic())
        if msg["parent_header"].get("msg_id") != msg_id:
            others.append(msg["parent_header"].get("msg_id"))
            continue
        if msg["msg_type"] == "stream":
            stdout += msg["content"]["text"]
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    while True:
        reply = await client.get_shell_msg(timeout=deadline - time.monotonic())
        if reply["parent_header"].get("msg_id") == msg_id:
            break
        pytest.fail(f"a reply to someone else's request reached this client: {reply['parent_header']}")
    return {"stdout": stdout, "status": reply["content"]["status"], "msg_id": msg_id}


def test_sessions_name_their_kernel_by_id(gw):
    gw.client.execute("a", "ids", "1")
    body = session(gw, "ids")
    assert uuid.UUID(body["kernel_id"])
    assert body["execution_state"] == "idle" and body["connections"] == 0
    [listed] = [s for s in gw.client.call("GET", "/v1/agents/a/sessions")[1]["sessions"] if s["id"] == "ids"]
    assert listed["kernel_id"] == body["kernel_id"]


def test_a_restart_keeps_the_kernel_id_and_a_death_gives_a_new_one(gw):
    gw.client.execute("a", "life", "v = 1")
    first = session(gw, "life")
    status, restarted = gw.client.call("POST", "/v1/agents/a/sessions/life/restart", {})
    assert status == 200 and restarted["kernel_id"] == first["kernel_id"]
    assert restarted["pid"] != first["pid"] and restarted["state"] == "idle"
    died = gw.client.execute("a", "life", "import os; os._exit(1)")[1]
    assert died["status"] == "died"
    assert session(gw, "life")["kernel_id"] is None and session(gw, "life")["state"] == "dead"
    after = gw.client.execute("a", "life", "1")[1]
    fresh = session(gw, "life")
    assert fresh["kernel_id"] not in (None, first["kernel_id"])
    assert fresh["previous_kernel_id"] == first["kernel_id"] and "fresh kernel" in after["notice"]


def test_two_clients_on_one_kernel_each_get_exactly_their_own(gw):
    gw.client.execute("a", "pair", "import time")
    kernel = kernel_of(gw, "pair")
    other = gw.run(asyncio.sleep(0, kernel.connect()))
    assert session(gw, "pair")["connections"] == 1
    ours = {}
    code = "for i in range(5):\n    print('gateway', i, flush=True); time.sleep(0.1)"
    thread = threading.Thread(target=lambda: ours.update(r=gw.client.execute("a", "pair", code)[1]))
    thread.start()
    theirs = gw.run(run_on(other, "for i in range(5):\n    print('websocket', i, flush=True); time.sleep(0.1)"))
    thread.join(60)
    assert ours["r"]["status"] == "ok"
    assert ours["r"]["text"] == "".join(f"gateway {i}\n" for i in range(5))
    assert theirs["status"] == "ok"
    assert theirs["stdout"] == "".join(f"websocket {i}\n" for i in range(5))
    # A variables probe meanwhile has its own connection too, and steals nothing.
    status, listing = gw.client.call("GET", "/v1/agents/a/sessions/pair/variables")
    # Modules are not in the table, only named apart; nothing broke.
    assert status == 200 and "time" not in [v["name"] for v in listing["variables"]], listing
    assert listing["modules"] == ["time"], listing
    again = gw.run(run_on(other, "print('still mine')"))
    assert again["stdout"] == "still mine\n"
    gw.call_soon(kernel.disconnect, other)
    assert wait_until(lambda: session(gw, "pair")["connections"] == 0)


def test_state_is_observed_and_the_culler_spares_a_kernel_busy_for_another_client(gw):
    gw.client.execute("a", "watched", "import time")
    kernel = kernel_of(gw, "watched")
    other = gw.run(asyncio.sleep(0, kernel.connect()))
    flag = os.path.join(gw.root, "a", "user-files", "release-watched")
    running = gw.submit(run_on(other, f"import os\nwhile not os.path.exists({flag!r}): time.sleep(0.05)", timeout=120))
    # Busy for the other client: seen on iopub, though the gateway's own executor is idle.
    assert wait_until(lambda: session(gw, "watched")["execution_state"] == "busy")
    gw.core.settings.cull_idle_timeout = 0.01
    try:
        kernel.last_activity = 0.0  # as if nothing had happened for a long time
        assert "watched" not in gw.run(gw.core.culler.cull_idle())
        open(flag, "w").close()
        assert running.result(60)["status"] == "ok"
        assert wait_until(lambda: session(gw, "watched")["execution_state"] == "idle")
        kernel.last_activity = 0.0
        assert "watched" not in gw.run(gw.core.culler.cull_idle())  # still connected: not culled
        gw.call_soon(kernel.disconnect, other)
        assert wait_until(lambda: session(gw, "watched")["connections"] == 0)
        kernel.last_activity = 0.0
        assert "watched" in gw.run(gw.core.culler.cull_idle())
    finally:
        gw.core.settings.cull_idle_timeout = 3600.0
    assert gw.client.call("GET", "/v1/agents/a/sessions/watched")[0] == 404
    assert gw.core.pool.get(kernel.id) is None


def test_a_failed_restart_leaves_a_dead_session_not_an_idle_one(gw):
    gw.client.execute("fragile", "r", "1", timeout=60)
    good = gw.fragile_profile.read_text()
    gw.fragile_profile.write_text("{ not a profile")
    try:
        status, body = gw.client.call("POST", "/v1/agents/fragile/sessions/r/restart", {})
        assert status == 500 and body["error"]["code"] == "kernel_start_failed", body
        after = session(gw, "r", "fragile")
        assert after["state"] == "dead" and after["kernel_id"] is None and after["pid"] is None
    finally:
        gw.fragile_profile.write_text(good)
    body = gw.client.execute("fragile", "r", "print('back')")[1]
    assert body["text"] == "back\n"
    assert session(gw, "r", "fragile")["state"] == "idle"
