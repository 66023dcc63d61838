"""One cell's output is bounded as a whole: every output kind together.

Real kernels in bwrap behind a real gateway.  The bound is tried both the
ordinary way (IPython's display) and past the kernel-side extension, with raw
messages the kernel sends on its own iopub socket.
"""

from __future__ import annotations

import json
import os

import pytest

from support import RAW_IOPUB as RAW
from support import GatewayProcess, with_agents



@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    gateway = with_agents(GatewayProcess(tmp_path_factory.mktemp("budget")), "alice")
    yield gateway
    gateway.stop()


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1])


def execute(gw, code, session="s1", **extra):
    status, raw = gw.client.call(
        "POST", f"/v1/agents/alice/sessions/{session}/execute", {"code": code, "timeout": 300, **extra}
    )
    assert status == 200, raw
    return raw, len(json.dumps(raw))


def test_a_thousand_40kb_displays_give_a_small_response_with_a_marker(gw):
    execute(gw, "1")
    before = rss_kb(gw.proc.pid)
    code = "from IPython.display import display\nfor i in range(1000):\n    display({'text/plain': f'{i:04d}' + 'x' * 40000}, raw=True)"
    body, size = execute(gw, code)
    growth_mb = (rss_kb(gw.proc.pid) - before) / 1024
    assert body["status"] == "ok"
    assert size < 1_000_000
    assert body["truncated"] is True
    [spill] = [p for p in body["spill_paths"] if p.endswith(".jsonl")]
    assert f"past this cell's output budget" in body["text"] and spill in body["text"]
    # Everything that did not fit is in the file, one output a line.
    with open(spill) as f:
        spilled = [json.loads(line) for line in f]
    shown = [o for o in body["outputs"] if o["output_type"] == "display_data" and o["data"]["text/plain"][:4].isdigit()]
    assert len(shown) + len(spilled) == 1000
    assert spilled[-1]["data"]["text/plain"] == "0999" + "x" * 40000
    assert growth_mb < 64


def test_the_budget_covers_streams_results_and_errors_together(gw):
    code = (
        "from IPython.display import display\n"
        "for i in range(40):\n"
        "    print('o' * 30000); display({'text/plain': 'd' * 30000}, raw=True)\n"
        "raise ValueError('the end')"
    )
    body, size = execute(gw, code)
    assert size < 1_000_000
    assert body["status"] == "error" and body["error"]["ename"] == "ValueError"  # the error still comes through
    assert body["truncated"] is True


@pytest.mark.parametrize("kind", ["display_data", "stream", "execute_result", "error"])
def test_raw_iopub_messages_past_the_extension_are_bounded_by_the_gateway(gw, kind):
    content = {
        "display_data": "{'data': {'text/plain': 'r' * 40000}, 'metadata': {}}",
        "stream": "{'name': 'stdout', 'text': 'r' * 40000}",
        "execute_result": "{'data': {'text/plain': 'r' * 40000}, 'metadata': {}, 'execution_count': 1}",
        "error": "{'ename': 'E', 'evalue': 'r' * 40000, 'traceback': ['r' * 40000] * 10}",
    }[kind]
    before = rss_kb(gw.proc.pid)
    body, size = execute(gw, RAW + f"for _ in range(1000): raw({kind!r}, {content})", session="raw")
    growth_mb = (rss_kb(gw.proc.pid) - before) / 1024
    assert size < 1_000_000, size
    assert body["truncated"] is True
    if kind != "error":
        assert "by the gateway" in body["text"]  # streams are cut in the middle, the rest dropped
    assert growth_mb < 64


def test_malformed_raw_messages_are_ignored_not_a_500(gw):
    code = RAW + """
raw('stream', {'name': 7, 'text': None})
raw('stream', {'name': 'stdout'})
raw('display_data', {'data': 'nope', 'metadata': []})
raw('display_data', {'data': {'application/vnd.kernel-gateway.artifact+json': 'not a dict'}})
raw('display_data', {'data': {'application/vnd.kernel-gateway.truncation+json': [1]}})
raw('execute_result', {'data': {'text/plain': 'x'}, 'execution_count': 'many'})
raw('error', {'ename': ['a'], 'evalue': {}, 'traceback': 'not a list'})
raw('execute_input', {'execution_count': {'x': 1}})
print('still here')
"""
    for inline in (False, True):
        body, _ = execute(gw, code, session="malformed", inline_images=inline)
        assert "still here" in body["text"]
    assert gw.client.call("GET", "/v1/info")[0] == 200
