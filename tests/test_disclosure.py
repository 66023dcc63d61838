"""An agent's own socket never tells where the gateway keeps its state.

Every route is called on the agent socket, successes and failures alike, and
every response byte is searched for the state directory's host path.
"""

from __future__ import annotations

import json

import pytest

from support import GatewayProcess, with_agents


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    gateway = with_agents(GatewayProcess(tmp_path_factory.mktemp("disclosure")), "alice", "bob")
    yield gateway
    gateway.stop()


NB = {"cells": [{"cell_type": "code", "source": "print(1)"}], "metadata": {}}
CALLS = [
    ("GET", "/v1/info", None),
    ("GET", "/v1/agents/me", None),
    ("PUT", "/v1/agents/me", None),
    ("GET", "/v1/agents/alice", None),
    ("GET", "/v1/agents", None),
    ("DELETE", "/v1/agents/me", None),
    ("GET", "/v1/agents/bob", None),
    ("POST", "/v1/agents/me/sessions", {"session": "s1"}),
    ("GET", "/v1/agents/me/sessions", None),
    ("GET", "/v1/agents/me/sessions/s1", None),
    ("POST", "/v1/agents/me/sessions/s1/execute", {"code": "import os; print(os.environ.get('KERNEL_GATEWAY_SOCKET'))"}),
    ("POST", "/v1/agents/me/sessions/s1/execute", {"code": "1/0"}),
    ("POST", "/v1/agents/me/sessions/s1/execute", {"code": "x = 1", "stream": True}),
    ("GET", "/v1/agents/me/sessions/s1/variables", None),
    ("GET", "/v1/agents/me/sessions/s1/variables/x", None),
    ("GET", "/v1/agents/me/sessions/s1/variables/nope", None),
    ("POST", "/v1/agents/me/sessions/s1/interrupt", {}),
    ("POST", "/v1/agents/me/sessions/s1/restart", {}),
    ("POST", "/v1/agents/me/commands", {"command": "echo $KERNEL_GATEWAY_SOCKET; ls /run"}),
    ("POST", "/v1/agents/me/commands", {"command": "true", "cwd": "/etc"}),
    ("GET", "/v1/agents/me/files?path=SOUL.md", None),
    ("GET", "/v1/agents/me/files?path=/etc/passwd", None),
    ("GET", "/v1/agents/me/files?path=nope.txt", None),
    ("POST", "/v1/agents/me/patch", {"patch": "*** Begin Patch\n*** Add File: user-files/a.txt\n+a\n*** End Patch\n"}),
    ("POST", "/v1/agents/me/patch", {"patch": "*** Begin Patch\n*** Update File: nope.txt\n@@\n-a\n+b\n*** End Patch\n"}),
    ("POST", "/v1/agents/me/patch", {"patch": "*** Begin Patch\n*** End Patch", "cwd": "../.."}),
    ("PUT", "/v1/agents/me/notebooks/user-files/n.ipynb", NB),
    ("GET", "/v1/agents/me/notebooks/user-files/n.ipynb", None),
    ("GET", "/v1/agents/me/notebooks/../../n.ipynb", None),
    ("GET", "/v1/agents/me/notebooks/user-files/missing.ipynb", None),
    ("POST", "/v1/agents/me/notebooks/user-files/n.ipynb/run-all", {"save_outputs": True}),
    ("POST", "/v1/agents/me/notebooks/user-files/n.txt/run-all", {}),
    ("DELETE", "/v1/agents/me/sessions/s1", None),
    ("GET", "/v1/agents/me/sessions/s1", None),
    ("GET", "/v2/nothing", None),
    ("DELETE", "/v1/info", None),
]


def test_no_agent_socket_response_names_the_state_directory(gw):
    agent = gw.agent_client("alice")
    seen = []
    for method, path, body in CALLS:
        if isinstance(body, dict) and body.get("stream"):
            events = list(agent.stream(path, body))
            seen.append((path, 200, json.dumps(events)))
            continue
        status, answer = agent.call(method, path, body)
        seen.append((path, status, answer if isinstance(answer, bytes) else json.dumps(answer)))
    statuses = {status for _, status, _ in seen}
    assert {200, 400, 403, 404, 405} <= statuses  # successes and failures were both tried
    for path, status, text in seen:
        text = text.decode(errors="replace") if isinstance(text, bytes) else text
        assert gw.state not in text, (path, status, text)
    me = json.loads(next(text for path, _, text in seen if path == "/v1/agents/me"))
    assert me["socket"] == "/run/kernel-gateway.sock"
    info = json.loads(seen[0][2])
    assert info["socket"] == "/run/kernel-gateway.sock" and "paths" not in info


def test_the_control_socket_still_shows_the_host_paths(gw):
    status, body = gw.client.call("GET", "/v1/agents/alice")
    assert status == 200 and body["socket"].startswith(gw.state)
