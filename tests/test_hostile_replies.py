"""A kernel's variables reply is the agent's to shape: bounded before parsed, never a 500.

Real gateway, real sandboxed ipykernel.  Code run in the kernel replaces its
own ``user_expressions`` (the machinery the inspection goes through) so that
its reply is deeply nested, huge, not a string, garbage or a refusal.  Each
``GET .../variables`` is then a clear 409 JSON error (``bad_kernel_reply``,
``inspection_failed``, ``unsupported_kernel``); before, each was a 500.  The
control socket keeps answering and another agent is served.  A structure
really 10^6 deep, or a 200 MB string, is listed and previewed as usual.
"""

from __future__ import annotations

import pytest

from support import GatewayProcess


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    gateway = GatewayProcess(tmp_path_factory.mktemp("replies"), "--Gateway.spare_kernels=False").start()
    for agent in ("alice", "bob"):
        assert gateway.client.call("PUT", f"/v1/agents/{agent}")[0] == 201
    yield gateway
    gateway.stop()


def answering(text_plain: str) -> str:
    """Kernel code: every user expression now evaluates to ``text_plain`` (an expression of the kernel)."""
    return ("ip = get_ipython()\n"
            f"ip.user_expressions = lambda exprs: {{k: {{'status': 'ok', 'data': {{'text/plain': {text_plain}}},"
            " 'metadata': {}} for k in exprs}\n")


def b64(data: str) -> str:
    """Kernel code: the repr of the base64 of ``data`` (an expression of bytes), as the inspection sends."""
    return f"repr(__import__('base64').b64encode({data}).decode())"


HOSTILE = {
    "JSON nested 10^6 deep": (answering(b64("b'[' * 10**6")), "bad_kernel_reply"),
    "a Python literal nested 10^6 deep": (answering("'[' * 10**6"), "bad_kernel_reply"),
    "a 13 MB string literal": (answering("repr('x' * (13 << 20))"), "bad_kernel_reply"),
    "a 40 MB reply": (answering("repr('y' * (40 << 20))"), "bad_kernel_reply"),
    "JSON that is not an object": (answering(b64("b'[1, 2, 3]'")), "bad_kernel_reply"),
    "NaN in the answer": (answering(b64("b'{\"variables\": NaN}'")), "bad_kernel_reply"),
    "not base64": (answering("repr('not base64!')"), "bad_kernel_reply"),
    "an expression that is not a dict": (
        "get_ipython().user_expressions = lambda exprs: {k: 5 for k in exprs}\n", "unsupported_kernel"),
    "a refused expression": (
        "get_ipython().user_expressions = lambda exprs: {k: {'status': 'error', 'ename': 'Nope',"
        " 'evalue': 'not today', 'traceback': []} for k in exprs}\n", "inspection_failed"),
    "no user_expressions at all": ("get_ipython().user_expressions = lambda exprs: {}\n", "unsupported_kernel"),
    "an execute_reply in error": (
        "k = get_ipython().kernel\n"
        "async def refuse(*args, **kwargs):\n"
        "    return {'status': 'error', 'ename': 'Refused', 'evalue': 'no inspection', 'traceback': [],"
        " 'execution_count': 0}\n"
        "k.do_execute = refuse\n", "inspection_failed"),
}


@pytest.mark.parametrize("what", list(HOSTILE))
def test_a_hostile_variables_reply_is_a_clear_409(gw, what):
    code, expected = HOSTILE[what]
    session = "h" + str(list(HOSTILE).index(what))
    status, body = gw.client.execute("alice", session, code)
    assert status == 200 and body["status"] == "ok", body
    for path in (f"/v1/agents/alice/sessions/{session}/variables",
                 f"/v1/agents/alice/sessions/{session}/variables/ip"):
        status, answer = gw.client.call("GET", path)
        assert status == 409, (what, status, answer)
        assert answer["error"]["code"] == expected and answer["error"]["message"], answer
        assert len(str(answer)) < 2000  # the refusal does not echo the reply back
    # On the agent's own socket too, and the control socket keeps answering.
    status, answer = gw.agent_client("alice").call("GET", f"/v1/agents/me/sessions/{session}/variables")
    assert status == 409 and answer["error"]["code"] == expected
    assert gw.client.call("GET", "/v1/info", timeout=10)[0] == 200
    if "user_expressions" in code:  # put the kernel's own machinery back: inspection works again
        status, body = gw.client.execute("alice", session, "del get_ipython().user_expressions\nkept = 1")
        assert status == 200 and body["status"] == "ok", body
        status, listing = gw.client.call("GET", f"/v1/agents/alice/sessions/{session}/variables")
        assert status == 200 and "kept" in [v["name"] for v in listing["variables"]], listing
    gw.client.call("DELETE", f"/v1/agents/alice/sessions/{session}")


def test_deep_and_huge_values_are_still_listed_and_previewed(gw):
    code = "deep = []\nfor _ in range(10**6):\n    deep = [deep]\nbig = 'z' * 200_000_000\n"
    status, body = gw.client.execute("alice", "real", code)
    assert status == 200 and body["status"] == "ok", body
    status, listing = gw.client.call("GET", "/v1/agents/alice/sessions/real/variables")
    assert status == 200, listing
    summaries = {v["name"]: v["summary"] for v in listing["variables"]}
    assert summaries["deep"] == "length 1" and summaries["big"].startswith("length 200000000")
    status, preview = gw.client.call("GET", "/v1/agents/alice/sessions/real/variables/big?max_chars=100")
    assert status == 200 and preview["truncated"] and len(preview["preview"]) == 100, preview
    status, preview = gw.client.call("GET", "/v1/agents/alice/sessions/real/variables/deep")
    assert status == 200 and preview["preview"].startswith("list, length 1"), preview
    status, body = gw.client.execute("bob", "s1", "'bob served'")
    assert status == 200 and body["text"] == "'bob served'\n", body
    gw.client.call("DELETE", "/v1/agents/alice/sessions/real")


# The kernel sends a raw iopub message, signed as itself, with one part the gateway must not trust.
RAW_IOPUB_PART = """
k = get_ipython().kernel
s = k.session
msg = s.msg("stream", {"name": "stdout", "text": "x"}, parent=k.get_parent("shell"))
parts = [s.pack(msg["header"]), s.pack(msg["parent_header"]), b"{}", s.pack(msg["content"])]
parts[WHICH] = PART
k.iopub_socket.send_multipart([b"raw", b"<IDS|MSG>", s.sign(parts)] + parts)
print("after the raw message")
"""


@pytest.mark.parametrize("which", [0, 1, 2, 3])
@pytest.mark.parametrize("part", ["b'[' * 100000", "b'[1, 2]'", "b'{\"a\": NaN}'", "b'\\\\xff'"])
def test_a_kernel_message_the_gateway_cannot_read_is_dropped_not_a_500(gw, which, part):
    """Header, parent, metadata or content 10^5 deep, not an object, NaN or not UTF-8: the executor,
    the kernel's watcher and the variables probe read every part bounded and drop such a message."""
    code = RAW_IOPUB_PART.replace("WHICH", str(which)).replace("PART", part)
    status, body = gw.client.execute("alice", "raw", code)
    assert status == 200 and body["status"] == "ok" and "after the raw message" in body["text"], body
    status, body = gw.client.execute("alice", "raw", "6 * 7")
    assert status == 200 and body["text"] == "42\n", body
    status, listing = gw.client.call("GET", "/v1/agents/alice/sessions/raw/variables")
    assert status == 200, listing
    assert gw.client.call("GET", "/v1/info", timeout=10)[0] == 200
