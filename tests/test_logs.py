"""The operator's log, read from a real gateway process's stderr."""

from __future__ import annotations

import json

from support import GatewayProcess, wait_until

SECRET = "code-that-must-not-be-logged"


def json_lines(gw) -> list[dict]:
    with open(gw.log) as f:
        return [json.loads(line) for line in f if line.startswith("{")]


def test_json_log_has_requests_and_kernel_events_and_no_code(tmp_path):
    gw = GatewayProcess(tmp_path, "--log-format", "json", "--Gateway.spare_kernels=False").start()
    try:
        assert gw.client.call("PUT", "/v1/agents/a")[0] == 201
        assert gw.client.execute("a", "s", f"print({SECRET!r})")[1]["status"] == "ok"
        kernel_id = gw.client.call("GET", "/v1/agents/a/sessions/s")[1]["kernel_id"]
        assert gw.client.call("POST", "/v1/agents/a/sessions/s/execute", {"code": 5})[0] == 400
        assert gw.client.call("DELETE", "/v1/agents/a/sessions/s")[0] == 200
        assert wait_until(lambda: any(e.get("event") == "kernel_stop" for e in json_lines(gw)))
    finally:
        gw.stop()
    lines = json_lines(gw)
    requests = [e for e in lines if e["logger"] == "kernel_gateway.requests"]
    put = next(e for e in requests if e["method"] == "PUT")
    assert put["route"] == "/v1/agents/{agent}" and put["agent"] == "a" and put["status"] == 201
    assert put["duration_ms"] >= 0
    executes = [e for e in requests if e["route"] == "/v1/agents/{agent}/sessions/{session}/execute"]
    assert sorted(e["status"] for e in executes) == [200, 400]
    [start] = [e for e in lines if e.get("event") == "kernel_start"]
    [stop] = [e for e in lines if e.get("event") == "kernel_stop"]
    assert start["kernel_id"] == stop["kernel_id"] == kernel_id and start["agent"] == stop["agent"] == "a"
    assert stop["why"] == "deleted"
    with open(gw.log) as f:
        assert SECRET not in f.read()


def test_text_log_is_one_readable_line_per_request(tmp_path):
    gw = GatewayProcess(tmp_path).start()
    try:
        gw.client.call("PUT", "/v1/agents/a")
        gw.client.call("GET", "/v1/agents/nobody")
    finally:
        gw.stop()
    with open(gw.log) as f:
        text = f.read()
    assert "kernel_gateway.requests: PUT /v1/agents/{agent} 201 agent=a" in text
    assert "kernel_gateway.requests: GET /v1/agents/{agent} 404 agent=nobody" in text
    assert not any(line.startswith("{") for line in text.splitlines())


def test_an_unexpected_error_is_a_json_500_and_logged_with_its_traceback(tmp_path, caplog):
    """A bug in the core (here one planted in read_file) reaches the client as the error
    shape and the operator's log as one line naming the route and agent, with the traceback."""
    from kernel_gateway.tools import read_file
    from support import InProcessGateway

    gw = InProcessGateway(tmp_path, spare_kernels=False).start()
    original = read_file.read_file

    def broken(*args, **kwargs):
        raise RuntimeError("a planted bug")

    try:
        assert gw.client.call("PUT", "/v1/agents/a")[0] == 201
        read_file.read_file = broken
        with caplog.at_level("ERROR"):
            status, body = gw.client.call("GET", "/v1/agents/a/files?path=SOUL.md")
    finally:
        read_file.read_file = original
        gw.stop()
    assert status == 500
    assert body == {"error": {"code": "internal", "message": "internal error", "hint": "see the gateway's log"}}
    [record] = [r for r in caplog.records if r.getMessage().startswith("unexpected error in GET")]
    assert "/v1/agents/{agent}/files" in record.getMessage() and "agent a" in record.getMessage()
    assert record.exc_info is not None and "a planted bug" in str(record.exc_info[1])
