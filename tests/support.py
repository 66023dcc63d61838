"""Test support: a real gateway process and a small HTTP client over its Unix socket."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse

from kernel_gateway.client import UnixHTTPConnection

BIN = os.path.dirname(sys.executable)

# Agent uids of this test process's gateways: a block of its own, so that test runs side by
# side on one machine never share a host uid (RLIMIT_NPROC counts every process of a uid).
# A test that names its own --Gateway.agent_uid_start keeps it.
TEST_UID_BLOCK = 4096
TEST_UID_START = 400000 + (os.getpid() % 2000) * TEST_UID_BLOCK


class Client:
    """Minimal JSON client: ``status, body = client.call("POST", "/v1/...", {...})``."""

    def __init__(self, socket_path: str):
        self.socket_path = socket_path

    def call(self, method: str, path: str, body=None, headers=None, raw: bytes | None = None, timeout=120):
        conn = UnixHTTPConnection(self.socket_path, timeout=timeout)
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, path, body=data, headers=headers or {})
        response = conn.getresponse()
        payload = response.read()
        conn.close()
        try:
            return response.status, json.loads(payload)
        except ValueError:
            return response.status, payload

    def stream(self, path: str, body: dict, timeout=120):
        """Yield NDJSON events of a streaming call as they arrive."""
        conn = UnixHTTPConnection(self.socket_path, timeout=timeout)
        conn.request("POST", path, body=json.dumps(body).encode())
        response = conn.getresponse()
        assert response.status == 200, response.read()
        try:
            for line in response:
                yield json.loads(line)
        finally:
            conn.close()

    def execute(self, agent: str, session: str, code: str, **extra):
        path = f"/v1/agents/{agent}/sessions/{urllib.parse.quote(session, safe='')}/execute"
        return self.call("POST", path, {"code": code, **extra})


class GatewayProcess:
    """``kernel-gateway serve`` in a temp directory, as a user would run it."""

    def __init__(self, tmp_path, *args: str):
        self.root = str(tmp_path / "agents")
        self.state = str(tmp_path / "state")
        self.socket = os.path.join(self.state, "control.sock")
        self.args = list(args)
        if not any(a.startswith("--Gateway.agent_uid_start") for a in args):
            self.args += [f"--Gateway.agent_uid_start={TEST_UID_START}", f"--Gateway.agent_uid_count={TEST_UID_BLOCK}"]
        self.proc: subprocess.Popen | None = None
        self.log = str(tmp_path / "gateway.log")

    def start(self) -> "GatewayProcess":
        cmd = [os.path.join(BIN, "kernel-gateway"), "serve", "--root", self.root, "--state-dir", self.state, *self.args]
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited: {open(self.log).read()}")
            try:
                if Client(self.socket).call("GET", "/v1/info", timeout=5)[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"gateway did not answer: {open(self.log).read()}")

    @property
    def client(self) -> Client:
        return Client(self.socket)

    def agent_client(self, agent: str) -> Client:
        return Client(os.path.join(self.state, "agents", f"{agent}.sock"))

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                return self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                return self.proc.wait()
        return self.proc.returncode if self.proc else None


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def wait_until(predicate, timeout: float = 30, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


class InProcessGateway:
    """The real gateway (app, core, sockets, bwrap'd kernels) on a loop thread of the test process.

    Handler-level tests reach it through the same Unix sockets as a user would
    (``client``), and reach into its core with ``call(coro_fn, ...)``, which runs
    a coroutine on the gateway's loop and returns its result.
    """

    def __init__(self, tmp_path, **settings):
        import asyncio as _asyncio
        import threading as _threading

        from kernel_gateway.server.app import GatewayServer
        from kernel_gateway.settings import Gateway

        self.root = str(tmp_path / "agents")
        self.state = str(tmp_path / "state")
        self.socket = os.path.join(self.state, "control.sock")
        settings.setdefault("agent_uid_start", TEST_UID_START)
        settings.setdefault("agent_uid_count", TEST_UID_BLOCK)
        self.server = GatewayServer(Gateway(root=self.root, state_dir=self.state, **settings))
        self.loop = _asyncio.new_event_loop()
        self._thread = _threading.Thread(target=self.loop.run_forever, name="gateway-loop", daemon=True)
        self._asyncio = _asyncio

    def start(self) -> "InProcessGateway":
        self._thread.start()
        self.run(self.server.start())
        return self

    @property
    def core(self):
        return self.server.core

    @property
    def sessions(self):
        return self.server.core.sessions

    def run(self, coro, timeout: float = 120):
        """Run a coroutine on the gateway's loop; return its result (or raise its exception)."""
        return self._asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro):
        """Start a coroutine on the gateway's loop; returns a concurrent.futures.Future."""
        return self._asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call_soon(self, fn, *args):
        self.loop.call_soon_threadsafe(fn, *args)

    @property
    def client(self) -> Client:
        return Client(self.socket)

    def agent_client(self, agent: str) -> Client:
        return Client(os.path.join(self.state, "agents", f"{agent}.sock"))

    def stop(self) -> None:
        try:
            self.run(self.server.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(30)


def child_sandboxes() -> list[int]:
    """Pids of live bwrap processes whose parent is this (test) process."""
    me, found = os.getpid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        if comm == "bwrap" and int(fields[1]) == me and fields[0] != "Z":
            found.append(int(name))
    return found
def with_agents(gateway: GatewayProcess, *agents: str) -> GatewayProcess:
    """The gateway, started, with each agent created."""
    gateway.start()
    for agent in agents:
        assert gateway.client.call("PUT", f"/v1/agents/{agent}")[0] in (200, 201)
    return gateway


def execute_ok(gw: GatewayProcess, code: str, agent: str = "alice", session: str = "s1", **extra) -> dict:
    """The result of an execute that the gateway answered with 200."""
    status, body = gw.client.execute(agent, session, code, **extra)
    assert status == 200, body
    return body


# Defines raw(msg_type, content) in a kernel: one iopub message sent as the kernel's own
# session, past the output-bounding extension, the way a hostile kernel can.
RAW_IOPUB = """
def raw(msg_type, content):
    k = get_ipython().kernel
    k.session.send(k.iopub_socket, msg_type, content, parent=k.get_parent("shell"), ident=b"raw")
"""
