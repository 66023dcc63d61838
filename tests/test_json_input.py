"""The one JSON parser's refusals, at their boundaries (kernel_gateway/json_input.py).

The depth and lone-surrogate checks run one level of the tree at a time in
C-speed passes (a 16 MiB body of small values no longer costs seconds of
Python on the event loop); these show they refuse exactly what the item by
item walk did, wherever in the tree it sits.
"""

from __future__ import annotations

import pytest

from kernel_gateway import json_input
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
