"""The one JSON parser's refusals, at their boundaries (kernel_gateway/json_input.py).

The depth and lone-surrogate checks run one level of the tree at a time in
C-speed passes (a 16 MiB body of small values no longer costs seconds of
Python on the event loop); these show they refuse exactly what the item by
item walk did, wherever in the tree it sits.  A text of more values than
MAX_VALUES is refused before the C decoder (which holds the GIL) sees it:
a 15 MiB body of [1,1,...] on an agent's socket held the control socket
4.5 s, [[],[],...] 8.5 s; now it is a 400 at once.
"""

from __future__ import annotations

import json
import os
import socket

import pytest

from kernel_gateway import json_input
from support import GatewayProcess, with_agents
from kernel_gateway.json_input import MAX_DEPTH, JSONRefused


def nested_lists(depth: int, inner: str = "") -> str:
    return "[" * depth + inner + "]" * depth


def nested_objects(depth: int, inner: str = "1") -> str:
    return '{"k": ' * depth + inner + "}" * depth


@pytest.mark.parametrize("text", [
    nested_lists(MAX_DEPTH), nested_objects(MAX_DEPTH - 1, "{}"), nested_objects(MAX_DEPTH // 2, nested_lists(MAX_DEPTH // 2)),
    '[1, [2, [3]], {"a": [{"b": {}}]}]', '"\\ud83d\\ude00"', '["\\ud83d\\ude00", {"\\ud83d\\ude00": "x"}]', "1", '""', "[]",
    '["a\\u0000b"]',
])
def test_taken(text):
    json_input.loads(text, max_bytes=1 << 20)
    json_input.loads(text.encode(), max_bytes=1 << 20)


@pytest.mark.parametrize("text, why", [
    (nested_lists(MAX_DEPTH + 1), "nested deeper"),
    (nested_objects(MAX_DEPTH, "{}"), "nested deeper"),
    ("[1, 2, " + nested_lists(MAX_DEPTH, "[]") + ", 3]", "nested deeper"),  # deep in one branch only
    ('{"a": 1, "b": ' + nested_objects(MAX_DEPTH, "[]") + "}", "nested deeper"),
    ('"\\ud800"', "lone surrogate"),
    ('["ok", "\\udfff"]', "lone surrogate"),
    ('{"\\udc00": 1}', "lone surrogate"),  # a key
    ('[{"a": [{"b": "x\\ud83d"}]}]', "lone surrogate"),  # deep down
    ('["\\ud83d", "\\ude00"]', "lone surrogate"),  # two halves in two strings are no pair
    ('{"\\ud83d": "\\ude00"}', "lone surrogate"),
    ("[NaN]", "not a JSON number"),
    ("[1,", "not valid JSON"),
])
def test_refused(text, why):
    for raw in (text, text.encode("utf-8", "surrogatepass")):
        with pytest.raises(JSONRefused, match=why):
            json_input.loads(raw, max_bytes=1 << 20)


def test_raw_surrogate_bytes_and_sizes_are_refused():
    with pytest.raises(JSONRefused, match="lone surrogate"):
        json_input.loads(b'["\xed\xa0\x80"]', max_bytes=1 << 20)
    with pytest.raises(JSONRefused, match="limit"):
        json_input.loads(b"[" + b"1," * 100 + b"1]", max_bytes=100)
    with pytest.raises(JSONRefused, match="not text"):
        json_input.loads(42, max_bytes=100)  # type: ignore[arg-type]


def test_wide_bodies_of_small_values_are_checked_whole():
    wide = "[" + ",".join(["[]"] * 100_000) + ', ["\\udfff"]]'
    with pytest.raises(JSONRefused, match="lone surrogate"):
        json_input.loads(wide, max_bytes=1 << 20)
    assert len(json_input.loads("[" + ",".join(["{}"] * 100_000) + "]", max_bytes=1 << 20)) == 100_000


MANY = json_input.MAX_VALUES


@pytest.mark.parametrize("text", [
    "[" + ",".join(["1"] * (MANY + 1)) + "]",
    "[" + ",".join(["[]"] * (MANY + 1)) + "]",
    "[" + ",".join(['""'] * (MANY + 1)) + "]",
    "[" + ",".join(['"\\\\"'] * (MANY + 1)) + "]",  # strings ending in an escaped backslash
    "{" + ",".join(f'"{i}":0' for i in range(MANY // 2 + 1)) + "}",  # keys count too
], ids=["numbers", "arrays", "strings", "backslash strings", "keys and values"])
def test_more_values_than_the_bound_are_refused_before_decoding(text):
    for raw in (text, text.encode()):
        with pytest.raises(JSONRefused, match=f"more than {MANY} values"):
            json_input.loads(raw, max_bytes=64 << 20)


@pytest.mark.parametrize("text", [
    "[" + ",".join(["1"] * MANY) + "]",
    '{"code": "' + "f(a, b[1], {2: 3}), " * (MANY // 2) + '"}',  # separators inside a string are no values
    '{"code": "' + '\\"a\\": [1, 2], ' * (MANY // 2) + '"}',  # nor are escaped quotes strings
])
def test_up_to_the_bound_and_separators_inside_strings_are_taken(text):
    for raw in (text, text.encode()):
        json_input.loads(raw, max_bytes=64 << 20)


def post_on_unix_socket(path: str, target: str, body: bytes) -> tuple[int, dict]:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(120)
        s.connect(path)
        s.sendall(f"POST {target} HTTP/1.1\r\nHost: kg\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    head, _, payload = out.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


def test_an_agents_body_of_millions_of_values_is_a_clear_400_and_others_are_served(tmp_path):
    gw = with_agents(GatewayProcess(tmp_path), "alice", "bob")
    try:
        alice_sock = os.path.join(gw.state, "agents", "alice.sock")
        for body in (b"[" + b",".join([b"1"] * (7 << 20)) + b"]", b'{"code": [' + b",".join([b"[]"] * (5 << 20)) + b"]}"):
            status, reply = post_on_unix_socket(alice_sock, "/v1/agents/me/sessions/s1/execute", body)
            assert status == 400 and reply["error"]["code"] == "malformed_json", reply
            assert "values" in reply["error"]["message"], reply
        assert gw.client.call("GET", "/v1/info", timeout=30)[0] == 200
        status, out = gw.client.call("POST", "/v1/agents/bob/sessions/s1/execute", {"code": "6 * 7"}, timeout=120)
        assert status == 200 and "42" in str(out), out
    finally:
        gw.stop()
