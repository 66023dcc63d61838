"""The one parser of JSON the gateway did not write itself: request bodies, websocket frames, kernel replies.

Everything an agent or a kernel sends is hostile, so a text is bounded
before it is parsed: its size is checked first, then it is decoded with
``NaN``/``Infinity`` refused, nesting deeper than :data:`MAX_DEPTH` refused
(the C decoder stops at the interpreter's recursion limit, long before a
10^6-deep text costs anything; the walk after it enforces the lower bound)
and strings or keys holding lone surrogates refused, since no file, kernel
or log can take them.  Whatever goes wrong is one :class:`JSONRefused`
(a ``ValueError``) with a message fit for the client: this parser never
throws anything else, so a caller turns it into a 4xx, a websocket refusal
or a kernel-reply error, never a 500.  Core modules use it directly; the
HTTP base (``server/base.py: parse_json``) turns it into 400 ``malformed_json``.
"""

from __future__ import annotations

import json
import re
from itertools import chain, compress, repeat
from typing import Any

MAX_DEPTH = 64  # arrays and objects; deeper texts are refused, not recursed into
# Values (and keys) in one text, counted before decoding: the C decoder holds the GIL, so the event loop, for
# about 0.3 to 1 us per value (a 16 MiB body of [1,1,...] held it 2.5 s); a million is a fraction of a second.
MAX_VALUES = 1_000_000
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_STRING_BYTES = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


class JSONRefused(ValueError):
    """A text that is not JSON the gateway will take; the message says why."""


def loads(raw: bytes | str, *, max_bytes: int, what: str = "the body", max_depth: int = MAX_DEPTH) -> Any:
    """``raw`` as JSON, or :class:`JSONRefused`; ``raw`` longer than ``max_bytes`` is refused unread."""
    if not isinstance(raw, (bytes, bytearray, memoryview, str)):
        raise JSONRefused(f"{what} is not text")
    if len(raw) > max_bytes:  # (a str's length in characters: at most its size in UTF-8 bytes)
        raise JSONRefused(f"{what} is {len(raw)} bytes; the limit is {max_bytes}")

    _count_values(bytes(raw) if isinstance(raw, memoryview) else raw, what)

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not a JSON number")

    try:
        value = json.loads(bytes(raw) if isinstance(raw, memoryview) else raw, parse_constant=no_constants)
    except RecursionError:
        raise JSONRefused(f"{what} is nested deeper than {max_depth} levels") from None
    except MemoryError:
        raise JSONRefused(f"{what} is too large to decode") from None
    except (ValueError, UnicodeDecodeError, TypeError) as e:
        raise JSONRefused(f"{what} is not valid JSON: {e}") from None
    _check_tree(value, what, max_depth)
    return value


def _separators(text: bytes | bytearray | str) -> int:
    if isinstance(text, str):
        return text.count(",") + text.count(":") + text.count("[") + text.count("{")
    return text.count(b",") + text.count(b":") + text.count(b"[") + text.count(b"{")


def _count_values(raw: bytes | bytearray | str, what: str) -> None:
    """Refuse a text of more than MAX_VALUES values before decoding it, with C-speed counts only.

    Every value but the first follows a ``,``, ``:``, ``[`` or ``{``; counted over the whole text that
    is at least their number (strings may hold such characters too).  Only past the bound are the
    strings taken out (one regex pass, as cheap as the text has strings) and the count made exact.
    """
    # Each string adds 1 or 2 to quotes minus escaped quotes (only its closing quote can look escaped,
    # after an escaped backslash), a quote escaped inside it 0: past twice the bound, so are the strings.
    quote, escaped = ('"', '\\"') if isinstance(raw, str) else (b'"', b'\\"')
    if raw.count(quote) - raw.count(escaped) > 2 * MAX_VALUES:
        raise JSONRefused(f"{what} holds more than {MAX_VALUES} values")
    if _separators(raw) <= MAX_VALUES:
        return
    stripped = _STRING.sub('""', raw) if isinstance(raw, str) else _STRING_BYTES.sub(b'""', raw)
    if _separators(stripped) > MAX_VALUES:
        raise JSONRefused(f"{what} holds more than {MAX_VALUES} values")


def _check_tree(value: Any, what: str, max_depth: int) -> None:
    """Depth and lone surrogates, one level of the tree at a time, each level in C-speed passes.

    A walk in Python, item by item, cost about 0.5 us per value: 4 to 5 s on the event loop for a
    16 MiB body of ``[1,1,...]`` or ``[[],[],...]``, for every agent and the control socket.
    """
    level, depth = [value], 0
    while level:
        depth += 1  # ``level``: every value at this depth (the top one is at 1)
        lists = list(compress(level, map(isinstance, level, repeat(list))))
        dicts = list(compress(level, map(isinstance, level, repeat(dict))))
        strings = list(chain(compress(level, map(isinstance, level, repeat(str))), chain.from_iterable(dicts)))
        try:  # (joined with NUL, so that two lone halves cannot pair up; keys are strings too)
            "\x00".join(strings).encode("utf-8")
        except UnicodeEncodeError:
            raise JSONRefused(f"{what} holds a string with a lone surrogate (\\ud800-\\udfff)") from None
        if not lists and not dicts:
            return
        if depth > max_depth:
            raise JSONRefused(f"{what} is nested deeper than {max_depth} levels")
        level = list(chain(chain.from_iterable(lists), chain.from_iterable(map(dict.values, dicts))))


def loads_object(raw: bytes | str, *, max_bytes: int, what: str = "the body") -> dict:
    """As :func:`loads`, and the value must be a JSON object."""
    value = loads(raw, max_bytes=max_bytes, what=what)
    if not isinstance(value, dict):
        raise JSONRefused(f"{what} must be a JSON object")
    return value
