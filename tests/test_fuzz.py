"""schemathesis fuzzes a real gateway through its own OpenAPI document.

Every documented operation gets generated requests (valid and invalid), sent
over the real control socket to a real gateway with real sandboxed kernels.
No response may be a 5xx, every 4xx must have the error shape, documented
responses must match their schemas, and no request may hang past its client
timeout.  Afterwards the gateway's descriptors are back to their baseline
(plus one listening socket per agent the fuzzer created) and its memory has
not run away.  ``KG_FUZZ_EXAMPLES`` sets the examples per operation.
"""

from __future__ import annotations

import os
import socket
import time
import zlib

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection
from urllib3.connectionpool import HTTPConnectionPool

from kernel_gateway import __version__, openapi
from support import GatewayProcess

EXAMPLES = int(os.environ.get("KG_FUZZ_EXAMPLES", "60"))
REQUEST_TIMEOUT = 60  # seconds: past this a request counts as hung (the fuzz gateway caps cells at 10 s)
AGENT, SESSION, NOTEBOOK = "fuzz", "s1", "nb.ipynb"


# --- requests over a Unix socket ------------------------------------------------------


class _UnixConnection(HTTPConnection):
    def __init__(self, socket_path: str, *args, **kwargs):
        self._socket_path = socket_path
        super().__init__("localhost", *args, **kwargs)

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout if isinstance(self.timeout, (int, float)) else REQUEST_TIMEOUT)
        self.sock.connect(self._socket_path)


class _UnixPool(HTTPConnectionPool):
    def __init__(self, socket_path: str, **kwargs):
        super().__init__("localhost", **kwargs)
        self._socket_path = socket_path

    def _new_conn(self) -> HTTPConnection:
        return _UnixConnection(self._socket_path, timeout=REQUEST_TIMEOUT)


class UnixAdapter(HTTPAdapter):
    def __init__(self, socket_path: str):
        super().__init__()
        self._pool = _UnixPool(socket_path, maxsize=4)

    def get_connection_with_tls_context(self, request, verify, proxies=None, cert=None):
        return self._pool

    def close(self) -> None:
        self._pool.close()
        super().close()


# --- the gateway under test -------------------------------------------------------------


def _fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.fixture(scope="module")
def fuzz_gateway(tmp_path_factory):
    gw = GatewayProcess(
        tmp_path_factory.mktemp("fuzz"),
        "--Gateway.default_timeout=10",
        "--Gateway.max_timeout=10",
        "--Gateway.max_sessions_per_agent=4",
        "--Gateway.max_sessions_total=12",
        "--Gateway.spare_kernels=False",
    ).start()
    client = gw.client
    assert client.call("PUT", f"/v1/agents/{AGENT}")[0] == 201
    assert client.execute(AGENT, SESSION, "x = 41")[1]["status"] == "ok"
    notebook = {"nbformat": 4, "nbformat_minor": 5, "metadata": {},
                "cells": [{"cell_type": "code", "id": "c1", "source": "1 + 1", "metadata": {}, "outputs": [],
                           "execution_count": None}]}
    assert client.call("PUT", f"/v1/agents/{AGENT}/notebooks/{NOTEBOOK}", notebook)[0] == 201
    # A warm-up like the fuzz itself, so its one-time allocations are in the baseline.
    client.call("POST", f"/v1/agents/{AGENT}/commands", {"command": "true"})
    session = requests.Session()
    session.mount("http://localhost", UnixAdapter(gw.socket))
    gw.http = session
    gw.baseline = {"fds": _fd_count(gw.proc.pid), "rss_kb": _rss_kb(gw.proc.pid)}
    yield gw
    session.close()
    gw.stop()


schema = schemathesis.openapi.from_dict(openapi.document(__version__))

# Half the cases aim at the agent, session and notebook that exist, so the
# fuzzer gets past 404 into the routes' own validation and work.
KNOWN = {"agent": AGENT, "session": SESSION, "path": NOTEBOOK, "cell_id": "c1", "name": "x",
         "skill": "jupyter-live-kernel", "document": "SOUL.md", "job": "j1", "token": "0123456789ab"}


def _aim(case) -> None:
    params = case.path_parameters or {}
    if params and zlib.crc32(repr(sorted(params.items())).encode()) % 2 == 0:
        for name in params:
            params[name] = KNOWN[name]


def _error_shape(response: requests.Response) -> None:
    if 400 <= response.status_code < 500:
        body = response.json()
        # A failed patch also keeps Codex's own fields beside "error" (documented).
        assert "error" in body, body
        assert set(body["error"]) == {"code", "message", "hint"}, body
        assert all(isinstance(body["error"][k], str) for k in ("code", "message", "hint")), body


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.generate],
)
def test_no_request_gets_a_5xx_or_a_shapeless_error(case, fuzz_gateway):
    _aim(case)
    started = time.monotonic()
    response = case.call(session=fuzz_gateway.http, base_url="http://localhost", timeout=REQUEST_TIMEOUT)
    assert time.monotonic() - started < REQUEST_TIMEOUT
    assert response.status_code < 500, (case.method, case.formatted_path, response.status_code, response.text[:500])
    if response.headers.get("Content-Type", "").startswith("application/json"):
        _error_shape(response)
    case.validate_response(response, checks=[
        schemathesis.checks.not_a_server_error,
        schemathesis.checks.status_code_conformance,
        schemathesis.checks.content_type_conformance,
        schemathesis.checks.response_schema_conformance,
    ])


def test_zz_resources_return_to_baseline(fuzz_gateway):
    """Runs after the fuzz (module order): stop everything it started, then compare."""
    client = fuzz_gateway.client
    status, listed = client.call("GET", "/v1/agents")
    assert status == 200
    agents = [a["agent"] for a in listed["agents"]]
    for agent in agents:
        assert client.call("DELETE", f"/v1/agents/{agent}")[0] == 200
    assert client.call("GET", "/v1/info")[0] == 200
    pid = fuzz_gateway.proc.pid
    # The fixture's agent had one session (one kernel's ZMQ sockets) at baseline; each
    # agent the fuzzer created adds its listening socket, which stays with the agent.
    new_agents = len(agents) - 1
    deadline = time.monotonic() + 30
    while _fd_count(pid) > fuzz_gateway.baseline["fds"] + new_agents and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _fd_count(pid) <= fuzz_gateway.baseline["fds"] + new_agents
    grown_mb = (_rss_kb(pid) - fuzz_gateway.baseline["rss_kb"]) / 1024
    assert grown_mb < 64, f"the gateway grew by {grown_mb:.1f} MB over the fuzz"
