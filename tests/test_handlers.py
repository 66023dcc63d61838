"""Handler-level behaviour on the in-process gateway: caps, notices, error shapes.

The app and its core run on a loop thread of the test process
(:class:`support.InProcessGateway`), reached through its real Unix socket, so
these need no extra gateway process; kernels are still real bwrap'd ones.
"""

from __future__ import annotations

import pytest

from support import InProcessGateway


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    gateway = InProcessGateway(
        tmp_path_factory.mktemp("handlers"), spare_kernels=False, max_sessions_per_agent=1, max_sessions_total=2
    ).start()
    for agent in ("a", "b", "c"):
        assert gateway.client.call("PUT", f"/v1/agents/{agent}")[0] == 201
    yield gateway
    gateway.stop()


def error_of(reply) -> tuple[int, str]:
    status, body = reply
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "hint"}, body
    assert body["error"]["message"]
    return status, body["error"]["code"]


def test_caps_per_agent_and_in_all_are_429_and_change_nothing(gw):
    assert gw.client.call("POST", "/v1/agents/a/sessions", {"session": "one"})[0] == 201
    assert error_of(gw.client.call("POST", "/v1/agents/a/sessions", {"session": "two"})) == (429, "too_many_sessions")
    assert [s["id"] for s in gw.client.call("GET", "/v1/agents/a/sessions")[1]["sessions"]] == ["one"]
    assert gw.client.call("POST", "/v1/agents/b/sessions", {"session": "one"})[0] == 201
    assert error_of(gw.client.call("POST", "/v1/agents/c/sessions", {"session": "x"})) == (429, "gateway_full")
    assert gw.client.call("GET", "/v1/agents/c/sessions")[1]["sessions"] == []
    assert gw.client.call("POST", "/v1/agents/a/sessions", {"session": "one"})[0] == 200  # get, not create
    for agent in ("a", "b"):
        assert gw.client.call("DELETE", f"/v1/agents/{agent}/sessions/one")[0] == 200


def test_a_death_is_noticed_once_on_the_next_execute(gw):
    status, died = gw.client.execute("a", "d", "import os; os._exit(7)")
    assert status == 200 and died["status"] == "died" and died["exit_code"] == 7
    after = gw.client.execute("a", "d", "1")[1]
    assert "died" in after["notice"] and "exit code 7" in after["notice"]
    assert "notice" not in gw.client.execute("a", "d", "2")[1]
    gw.client.call("DELETE", "/v1/agents/a/sessions/d")


@pytest.mark.parametrize(
    "method,path,body,expected",
    [
        ("GET", "/v1/agents/zed/sessions", None, (404, "unknown_agent")),
        ("POST", "/v1/agents/a/sessions/none/restart", {}, (404, "unknown_session")),
        ("POST", "/v1/agents/a/sessions", {"kernel": "julia"}, (400, "unknown_kernel")),
        ("PUT", "/v1/agents/me", None, (400, "invalid_agent")),
        ("PATCH", "/v1/info", None, (405, "method_not_allowed")),
        ("GET", "/nowhere", None, (404, "no_route")),
    ],
)
def test_error_shapes(gw, method, path, body, expected):
    assert error_of(gw.client.call(method, path, body)) == expected
