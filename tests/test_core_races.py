"""Races, leaks and stalls of the core, on the real gateway run in the test process.

Each test here was written to fail against the bug it names: a kernel that a
DELETE or a cancelled start leaks, an agent half-registered after a failed
bind, an event loop held by a lock or a sleep, a cgroup cap that silently did
not apply.  Kernels are real bwrap'd ipykernels; leaks are checked on the real
process table and the real runtime directory.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import urllib.parse

import pytest

from kernel_gateway.errors import GatewayError
from kernel_gateway.sandbox import cgroups
from support import GatewayProcess, InProcessGateway, child_sandboxes, wait_until


@pytest.fixture
def gw(tmp_path):
    gateway = InProcessGateway(tmp_path, spare_kernels=False, busy_timeout=1.0).start()
    assert gateway.client.call("PUT", "/v1/agents/a")[0] == 201
    yield gateway
    try:
        gateway.stop()
    finally:
        for pid in child_sandboxes():  # whatever a failing test leaked: ours, by pid
            os.kill(pid, signal.SIGKILL)


def runtime_dirs(gw) -> list[str]:
    return os.listdir(gw.core.info["paths"]["runtime"])


def no_kernel_left(gw) -> bool:
    return wait_until(lambda: child_sandboxes() == [] and runtime_dirs(gw) == [], timeout=15)


def test_delete_during_a_sessions_start_leaves_no_kernel(gw):
    answer = {}
    creating = threading.Thread(
        target=lambda: answer.update(r=gw.client.call("POST", "/v1/agents/a/sessions", {"session": "s"}))
    )
    creating.start()
    assert wait_until(lambda: gw.client.call("GET", "/v1/agents/a/sessions/s")[0] == 200, interval=0.01)
    status, body = gw.client.call("DELETE", "/v1/agents/a/sessions/s")
    assert status == 200, body
    creating.join(60)
    status, body = answer["r"]
    assert status == 409 and body["error"]["code"] == "session_stopped", body
    assert gw.client.call("GET", "/v1/agents/a/sessions")[1]["sessions"] == []
    assert no_kernel_left(gw)


def test_a_cancelled_start_is_a_cancellation_and_leaves_no_kernel(gw):
    async def scenario() -> str:
        task = asyncio.ensure_future(gw.sessions.get_or_create("a", "s"))
        while not runtime_dirs(gw):  # the kernel is being launched
            await asyncio.sleep(0.01)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "cancelled"
        except GatewayError as e:
            return f"GatewayError {e.status} {e.code}"
        return "started"

    assert gw.run(scenario()) == "cancelled"
    assert no_kernel_left(gw)
    assert gw.client.call("GET", "/v1/agents/a/sessions")[1]["sessions"] == []


def test_a_client_leaving_during_a_cold_start_leaves_no_kernel(gw):
    """A client that leaves while its session's kernel starts cancels the start: no kernel is left.

    The gateway may see the close only after the start has finished (the close
    races the start); then the execute simply ran and its session owns the
    kernel, which is no leak.  Every attempt is checked for a leak (a kernel
    that belongs to no session); at least one must have been cancelled.
    """
    cancelled = 0
    for attempt in range(6):
        session = f"cold{attempt}"
        conn = socket.socket(socket.AF_UNIX)
        conn.connect(gw.socket)
        body = json.dumps({"code": "1"}).encode()
        conn.sendall(
            f"POST /v1/agents/a/sessions/{session}/execute HTTP/1.1\r\nHost: gw\r\n".encode()
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )
        assert wait_until(lambda: runtime_dirs(gw) != [], interval=0.01)
        conn.close()
        if no_kernel_left(gw):
            cancelled += 1
            if cancelled >= 2:
                break
            continue
        # Not a leak only if the session owns the kernel that is left.
        status, listed = gw.client.call("GET", f"/v1/agents/a/sessions/{session}")
        assert status == 200 and listed["pid"] in child_sandboxes(), (status, listed, child_sandboxes())
        assert gw.client.call("DELETE", f"/v1/agents/a/sessions/{session}")[0] == 200
        assert no_kernel_left(gw)
    assert cancelled >= 1


def test_a_second_waiter_after_a_failed_create_leaves_no_orphan_kernel(gw):
    """Two creates of one session at once; the first start fails.  The second waiter must
    start over on a session that exists (its own), never start a kernel for the one that
    was dropped, which no session would then own."""
    pool, original = gw.core.pool, gw.core.pool.start
    calls = []

    async def failing_once(*args, **kwargs):
        calls.append(kwargs.get("session"))
        if len(calls) == 1:
            await asyncio.sleep(0.3)  # the second create is waiting on the session's lock by now
            raise GatewayError(500, "kernel_start_failed", "the first start fails (test)")
        return await original(*args, **kwargs)

    pool.start = failing_once
    try:
        async def both():
            first = asyncio.ensure_future(gw.core.sessions.get_or_create("a", "twice"))
            await asyncio.sleep(0.05)
            second = asyncio.ensure_future(gw.core.sessions.get_or_create("a", "twice"))
            return await asyncio.gather(first, second, return_exceptions=True)

        first, second = gw.run(both())
    finally:
        pool.start = original
    assert isinstance(first, GatewayError) and first.code == "kernel_start_failed"
    session, _created = second
    assert session.kernel is not None
    # The kernel that started is the live session's, and the only one.
    assert gw.core.sessions.sessions.get(("a", "twice")) is session
    assert [k.id for k in pool.kernels.values()] == [session.kernel.id]
    assert child_sandboxes() == [session.kernel.pid]
    assert gw.client.call("DELETE", "/v1/agents/a/sessions/twice")[0] == 200
    assert no_kernel_left(gw)


def test_an_agent_whose_socket_cannot_be_bound_is_not_registered(gw):
    key = "k" * 64
    assert len(os.path.join(gw.state, "agents", f"{key}.sock")) > 107
    for _ in range(2):  # the second PUT must not say 200 either
        status, body = gw.client.call("PUT", f"/v1/agents/{key}")
        assert status == 400 and body["error"]["code"] == "agent_socket_path_too_long", body
        assert "107" in body["error"]["message"]
    assert gw.client.call("GET", f"/v1/agents/{key}")[0] == 404
    assert key not in [a["agent"] for a in gw.client.call("GET", "/v1/agents")[1]["agents"]]
    assert not os.path.exists(os.path.join(gw.root, key))


def test_audit_code_records_the_code_when_asked(tmp_path):
    gateway = InProcessGateway(tmp_path, spare_kernels=False, audit_code=True).start()
    try:
        gateway.client.call("PUT", "/v1/agents/a")
        assert gateway.client.execute("a", "s", "marker = 'audited-code'")[0] == 200

        def entries():
            with open(os.path.join(gateway.state, "audit.log")) as f:
                return [json.loads(line) for line in f]

        assert wait_until(lambda: any(e["tool"] == "execute" for e in entries()))
        [entry] = [e for e in entries() if e["tool"] == "execute"]
        assert entry["code"] == "marker = 'audited-code'"
    finally:
        gateway.stop()


def test_a_held_notebook_lock_does_not_stall_the_loop(gw):
    from kernel_gateway import notebooks

    path = "user-files/held.ipynb"
    nb = {"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    assert gw.client.call("PUT", f"/v1/agents/a/notebooks/{path}", nb)[0] == 201
    target = os.path.realpath(os.path.join(gw.root, "a", path))
    waiting = threading.Event()

    class WatchedLock:
        """The notebook's real lock, saying when someone starts waiting on it."""

        def __init__(self):
            self.inner = threading.Lock()

        def acquire(self, *args):
            if self.inner.locked():
                waiting.set()
            return self.inner.acquire(*args)

        def release(self):
            self.inner.release()

        def locked(self):
            return self.inner.locked()

        __enter__ = acquire

        def __exit__(self, *exc):
            self.release()

    lock = WatchedLock()
    notebooks._path_locks[str(notebooks.Path(target))] = lock
    with lock:  # as a run-all saving its outputs from a worker thread would
        writer = threading.Thread(target=gw.client.call, args=("PUT", f"/v1/agents/a/notebooks/{path}", nb))
        writer.start()
        assert waiting.wait(30)
        # The PUT waits for the lock; the loop still answers everyone else.
        status, _ = gw.client.call("GET", "/v1/info", timeout=10)
        assert status == 200
    writer.join(30)
    assert not writer.is_alive()


def busy_session(gw, session: str):
    """Start a cell that waits for a flag file; return (thread, flag path)."""
    flag = os.path.join(gw.root, "a", "user-files", f"release-{session}")
    gw.client.execute("a", session, "ready = 1")
    code = f"import os, time\nwhile not os.path.exists({flag!r}): time.sleep(0.05)"
    thread = threading.Thread(target=gw.client.execute, args=("a", session, code))
    thread.start()
    path = f"/v1/agents/a/sessions/{session}"
    assert wait_until(lambda: gw.client.call("GET", path)[1].get("state") == "busy")
    return thread, flag


def test_restart_and_variables_of_a_busy_session_answer_instead_of_hanging(gw):
    thread, flag = busy_session(gw, "busy")
    try:
        status, body = gw.client.call("POST", "/v1/agents/a/sessions/busy/restart", {}, timeout=20)
        assert status == 409 and body["error"]["code"] == "session_busy", body
        status, body = gw.client.call("GET", "/v1/agents/a/sessions/busy/variables", timeout=30)
        assert status == 409 and body["error"]["code"] == "session_busy", body
    finally:
        open(flag, "w").close()
        thread.join(60)
    # Once idle, both work again.
    assert gw.client.call("GET", "/v1/agents/a/sessions/busy/variables")[0] == 200
    assert gw.client.call("POST", "/v1/agents/a/sessions/busy/restart", {})[0] == 200


def test_long_notebook_paths_get_their_own_sessions():
    from kernel_gateway.notebook_runs import notebook_session_id
    from kernel_gateway.workspace import check_session_id

    prefix = "user-files/" + "d" * 150
    first, second = notebook_session_id(prefix + "/a.ipynb"), notebook_session_id(prefix + "/b.ipynb")
    assert first != second
    for sid in (first, second):
        assert check_session_id(sid) == sid
        assert sid.startswith("notebook:user-files/ddd")
    assert notebook_session_id("user-files/short.ipynb") == "notebook:user-files/short.ipynb"


def test_a_cgroup_limit_that_cannot_be_written_fails_the_start():
    if cgroups.describe() is None:
        pytest.skip("no writable cgroup on this machine")
    # The kernel refuses a negative pids.max (EINVAL): the sandbox must not start uncapped.
    with pytest.raises(cgroups.LimitNotApplied) as error:
        cgroups.create("kg-test-badcap", -5, None)
    assert "pids.max" in str(error.value)
    leftovers = [
        name
        for parent in cgroups._parents()
        if os.path.isdir(parent)
        for name in os.listdir(parent)
        if name.startswith("kg-test-badcap")
    ]
    assert leftovers == []


def test_sandbox_cleanup_does_not_hold_the_loop(tmp_path):
    """A cgroup that cannot be removed at once (here: it has a child) is waited for without blocking."""
    from kernel_gateway.sandbox import launch
    from kernel_gateway.sandbox.profile import load_profile

    if cgroups.describe() is None:
        pytest.skip("no writable cgroup on this machine")
    prepared = launch.prepare(
        load_profile("command"), {"agent": "t", "agent_root": str(tmp_path), "workspace": str(tmp_path),
                                  "python_prefix": "/usr", "python_base_prefix": "/usr", "python_bin": "/usr/bin",
                                  "agent_socket": str(tmp_path / "none.sock")},
        ["true"], name="kg-test-cleanup",
    )
    assert prepared.cgroup is not None
    child = os.path.join(prepared.cgroup.dirs[0], "child")
    os.mkdir(child)

    async def scenario() -> int:
        ticks = 0
        cleanup = asyncio.ensure_future(prepared.finish(timeout=1.0))
        while not cleanup.done():
            await asyncio.sleep(0.01)
            ticks += 1
        await cleanup
        return ticks

    try:
        assert asyncio.run(scenario()) > 10  # the loop kept running while cleanup waited
    finally:
        os.rmdir(child)
        prepared.cleanup()
    assert prepared.cgroup is None


def test_a_client_leaving_a_run_all_cancels_it(gw):
    path = "user-files/long.ipynb"
    nb = {
        "cells": [
            {"cell_type": "code", "source": "import time\nstarted = True"},
            {"cell_type": "code", "source": "for _ in range(600): time.sleep(0.1)\nfinished = True"},
        ],
        "metadata": {}, "nbformat": 4, "nbformat_minor": 5,
    }
    assert gw.client.call("PUT", f"/v1/agents/a/notebooks/{path}", nb)[0] == 201
    conn = socket.socket(socket.AF_UNIX)
    conn.connect(gw.socket)
    body = json.dumps({"timeout": 600}).encode()
    conn.sendall(
        f"POST /v1/agents/a/notebooks/{path}/run-all HTTP/1.1\r\nHost: gw\r\n".encode()
        + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    )
    sid = urllib.parse.quote(f"notebook:{path}", safe="")
    state = lambda: gw.client.call("GET", f"/v1/agents/a/sessions/{sid}")[1].get("state")  # noqa: E731
    assert wait_until(lambda: state() == "busy")
    conn.close()
    # Cancelled: the running cell is interrupted long before its 60 s, and the run goes no further.
    assert wait_until(lambda: state() == "idle", timeout=20)
    status, listing = gw.client.call("GET", f"/v1/agents/a/sessions/{sid}/variables")
    names = [v["name"] for v in listing["variables"]]
    assert status == 200 and "started" in names and "finished" not in names
