"""Listing and previewing the live variables of a Python kernel, without disturbing it.

The gateway owns a session's iopub channel, so inspection travels on the shell
channel alone: one ``execute_request`` with empty code, ``silent=True``,
``store_history=False`` and a single ``user_expressions`` entry, answered by
the matching ``execute_reply``.  A silent request does not advance
``execution_count`` or touch ``In``/``Out``/``_``, and the inspection code runs
in a fresh dict passed to ``exec``, so it creates no name in the user's
namespace.

Inspection must be safe on anything a user holds: it never calls an object's
own ``repr``/``len``/``__getattr__`` except where the type is known (builtin
scalars and containers, pandas and numpy objects, whose bounded renderers it
uses: ``DataFrame.head(n).to_string()``, ``numpy.array2string`` with a
threshold).  A weird object is described by its type and attribute names.

The caller must not read the kernel's shell channel concurrently (hold the
session's shell lock): replies that are not ours are skipped.

The kernel is the agent's, so its reply is hostile too: the inspector's
shell socket takes no message over :data:`MAX_REPLY_BYTES` (ZMQ drops the
connection, which is watched, so a too-large reply is refused at once, not
waited for), and the answer is bounded before it is parsed: the kernel
sends its JSON base64-encoded, so IPython's text/plain of it is that ASCII
between quotes, which is checked (at most :data:`MAX_REPLY_CHARS`) and
decoded without evaluating anything, then parsed by
:mod:`kernel_gateway.json_input`.
A kernel that refuses the inspection or answers garbage gets 409
``inspection_failed`` / ``bad_kernel_reply``, never a 500.
"""

from __future__ import annotations

import base64
import binascii
import re
import asyncio
import keyword
import queue
import time
import uuid
from typing import Any

import zmq
from jupyter_client.asynchronous import AsyncKernelClient

from kernel_gateway import json_input
from kernel_gateway.errors import GatewayError, bad_request, not_found
from kernel_gateway.execution import with_socket_options

MAX_LIMIT = 10_000
MAX_PREVIEW_CHARS = 1_000_000
# The answer's text/plain: the repr of its base64 (a 10,000-name listing, or a 1,000,000-character
# preview of \uXXXX escapes, fits); and the whole execute_reply, as the inspector's shell socket takes it.
MAX_REPLY_CHARS = 12 << 20
MAX_REPLY_BYTES = 32 << 20
_QUOTED_BASE64 = re.compile(r"'([A-Za-z0-9+/]*={0,2})'")

# Runs inside the kernel, via exec() in a fresh dict holding ``user_ns`` and
# ``args``; it leaves its answer, a JSON string, in ``result``.
_KERNEL_SOURCE = r'''
import base64, inspect, itertools, json, re, sys, types

IPYTHON_NAMES = {"In", "Out", "exit", "quit", "get_ipython"}
MACHINERY = IPYTHON_NAMES | {
    "_", "__", "___", "_i", "_ii", "_iii", "_ih", "_oh", "_dh", "__builtins__", "__builtin__",
    "__name__", "__doc__", "__package__", "__loader__", "__spec__",
}
NUMBERED_HISTORY = re.compile(r"_i?\d+")
SCALARS = (int, float, complex, bool, type(None))
CONTAINERS = (list, tuple, dict, set, frozenset)
CALLABLES = (types.FunctionType, types.BuiltinFunctionType, types.MethodType)


def optional_type(module, name):
    # Only modules the user already imported: importing pandas just to look is costly.
    loaded = sys.modules.get(module)
    return getattr(loaded, name, None) if loaded is not None else None


DataFrame = optional_type("pandas", "DataFrame")
Series = optional_type("pandas", "Series")
ndarray = optional_type("numpy", "ndarray")
# numpy's scalars (what pandas aggregations return): numbers and bools, whose str is bounded.
numpy_scalar = tuple(filter(None, (optional_type("numpy", "number"), optional_type("numpy", "bool_"))))
SERIES_ROWS = 10


def is_a(value, cls):
    # issubclass(type(v)) and not isinstance(): isinstance() may consult a user-defined __class__.
    return cls is not None and issubclass(type(value), cls)


def container_base(value):
    for base in type(value).__mro__:
        if base in CONTAINERS:
            return base
    return None


def clip(text, width):
    return text if len(text) <= width else text[: width - 1] + "\u2026"


def label(key):
    # A dict key or column label: shown only when it is a plain value.
    if type(key) is str:
        return clip(repr(key), 40)
    if type(key) in SCALARS:
        return scalar_repr(key)
    if type(key) is tuple and len(key) <= 4:
        return "(" + ", ".join(label(part) for part in key) + ")"
    return "<" + type(key).__qualname__ + ">"


def scalar_repr(value):
    if type(value) is int and value.bit_length() > 128:
        return "<%d-bit int>" % value.bit_length()
    return clip(repr(value), 80)


def ipython_hidden_names():
    # What IPython itself put in the namespace (open, exit, ...), as %who hides it.
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "user_ns_hidden", {})


HIDDEN = ipython_hidden_names()


def size_text(size):
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return ("%d %s" if unit == "bytes" else "%.1f %s") % (size, unit)
        size /= 1024


def visible(name, value, include_private):
    if name in MACHINERY or NUMBERED_HISTORY.fullmatch(name):
        return False
    if name in HIDDEN and HIDDEN[name] is value:
        return False
    if include_private:
        return True
    return not name.startswith("_") and not issubclass(type(value), types.ModuleType)


def summary(value):
    kind = type(value)
    if is_a(value, DataFrame):
        rows, columns = value.shape
        dtypes = ", ".join(
            "%s %s" % (label(column), dtype) for column, dtype in itertools.islice(value.dtypes.items(), 8)
        )
        more = ", \u2026" if columns > 8 else ""
        return "%d rows \u00d7 %d columns; dtypes: %s%s" % (rows, columns, dtypes, more)
    if is_a(value, Series):
        return "length %d; dtype %s" % (len(value), value.dtype)
    if is_a(value, ndarray):
        return "shape %s; dtype %s" % (tuple(value.shape), value.dtype)
    if kind in SCALARS:
        return scalar_repr(value)
    if numpy_scalar and issubclass(kind, numpy_scalar):
        return clip(str(value), 80)
    if kind is str:
        return "length %d: %s" % (len(value), clip(repr(value[:80]), 80))
    if kind in (bytes, bytearray):
        return "length %d" % len(value)
    base = container_base(value)
    if base is not None:
        return "length %d" % base.__len__(value)
    if issubclass(kind, types.ModuleType):
        return "module %s" % clip(str(vars(value).get("__name__", "?")), 80)
    if issubclass(kind, type):
        return "class %s" % clip(value.__qualname__, 80)
    if issubclass(kind, CALLABLES):
        try:
            return clip(value.__name__ + str(inspect.signature(value)), 120)
        except (TypeError, ValueError):
            return clip(value.__name__ + "(...)", 120)
    return "%s object" % clip(kind.__module__ + "." + kind.__qualname__, 120)


def describe(name, value):
    try:
        text = summary(value)
    except Exception as error:  # one odd object must not spoil the listing
        text = "<no summary: %s>" % type(error).__name__
    return {"name": name, "type": type(value).__qualname__, "summary": text}


def list_names(user_ns, limit, include_private):
    items = list(user_ns.items())
    names = sorted(
        name for name, value in items
        if type(name) is str and visible(name, value, include_private)
    )
    shown = [describe(name, user_ns[name]) for name in names[:limit]]
    answer = {"variables": shown, "count": len(names), "truncated": len(names) > limit}
    if not include_private:
        # Imported modules are not variables to inspect, but they are named, so none seems lost.
        answer["modules"] = sorted(
            name for name, value in items
            if type(name) is str and not name.startswith("_") and issubclass(type(value), types.ModuleType)
            and visible(name, value, True)
        )[:limit]
    return answer


def preview_text(value):
    kind = type(value)
    if is_a(value, DataFrame):
        rows, columns = value.shape
        memory = int(value.memory_usage(index=True, deep=False).sum())
        return "\n".join([
            "DataFrame: %d rows \u00d7 %d columns" % (rows, columns),
            "dtypes:",
            value.dtypes.iloc[:50].to_string() + ("\n\u2026 %d more columns" % (columns - 50) if columns > 50 else ""),
            "memory usage: %s (object contents not counted)" % size_text(memory),
            "first rows (%d of %d shown):" % (min(rows, 10), rows) if rows > 10 else "rows:",
            value.head(10).to_string(max_cols=30, max_colwidth=60),
        ])
    if is_a(value, Series):
        shown = min(len(value), SERIES_ROWS)
        more = "\n[%d of %d values shown]" % (shown, len(value)) if len(value) > shown else ""
        return "Series %s: length %d, dtype %s\n%s%s" % (
            label(value.name), len(value), value.dtype, value.head(SERIES_ROWS).to_string(max_rows=SERIES_ROWS), more
        )
    if is_a(value, ndarray):
        numpy = sys.modules["numpy"]
        return "ndarray: shape %s, dtype %s, %s\n%s" % (
            tuple(value.shape), value.dtype, size_text(value.nbytes),
            numpy.array2string(value, threshold=200, edgeitems=3, max_line_width=120),
        )
    if kind is str:
        return value[: args["max_chars"] + 1]
    if kind in SCALARS:
        return repr(value) if kind is not int or value.bit_length() <= 4096 else scalar_repr(value)
    if numpy_scalar and issubclass(kind, numpy_scalar):
        return "%s (numpy %s)" % (clip(str(value), 200), kind.__name__)
    if kind in (bytes, bytearray):
        return "%s, length %d: %s" % (kind.__name__, len(value), repr(value[: args["max_chars"]]))
    base = container_base(value)
    if base is not None:
        if base is dict:
            items = (
                "%s: %s" % (label(key), type_and_summary(item))
                for key, item in itertools.islice(dict.items(value), 50)
            )
        else:
            first = itertools.islice(base.__iter__(value), 50)
            items = ("[%d] %s" % (i, type_and_summary(item)) for i, item in enumerate(first))
        return "%s, length %d\n%s" % (kind.__qualname__, base.__len__(value), "\n".join(items))
    if issubclass(kind, (types.ModuleType, type) + CALLABLES):
        return summary(value) + "\n" + (inspect.getdoc(value) or "")[:2000]
    try:
        attributes = object.__getattribute__(value, "__dict__")
    except (AttributeError, TypeError):
        attributes = {}
    if type(attributes) is not dict:  # a __dict__ property may return anything
        attributes = {}
    lines = [summary(value)]
    lines += [
        "  .%s: %s" % (clip(str(attr), 60), type_and_summary(item))
        for attr, item in itertools.islice(dict.items(attributes), 50)
        if type(attr) is str
    ]
    return "\n".join(lines)


def type_and_summary(value):
    described = describe("", value)
    return "%s %s" % (described["type"], described["summary"])


def preview(user_ns, name, max_chars):
    if name not in user_ns:
        return {"error": "unknown_variable"}
    value = user_ns[name]
    described = describe(name, value)
    text = preview_text(value)
    described["preview"] = text[:max_chars]
    described["truncated"] = len(text) > max_chars
    return described


if args["action"] == "list":
    answer = list_names(user_ns, args["limit"], args["include_private"])
else:
    answer = preview(user_ns, args["name"], args["max_chars"])
result = base64.b64encode(json.dumps(answer).encode("ascii")).decode("ascii")
'''


async def list_variables(
    kc: AsyncKernelClient, *, limit: int = 100, include_private: bool = False, timeout: float = 10
) -> dict:
    """The user's variables: ``{"variables": [{"name", "type", "summary"}], "count", "truncated"}``.

    Sorted by name, at most ``limit``.  Without ``include_private``, names
    starting with ``_``, IPython's own names and modules are hidden; IPython's
    history machinery (``In``, ``Out``, ``_``, ``_i3``, ...) is always hidden.
    """
    _check_bound("limit", limit, MAX_LIMIT)
    if not isinstance(include_private, bool):
        raise bad_request("include_private must be true or false", code="invalid_include_private")
    return await _inspect(kc, {"action": "list", "limit": limit, "include_private": include_private}, timeout)


async def preview_variable(kc: AsyncKernelClient, name: str, *, max_chars: int = 4000, timeout: float = 10) -> dict:
    """A bounded text preview of one variable: ``{"name", "type", "summary", "preview", "truncated"}``.

    DataFrames show shape, dtypes, memory usage and the first rows as a text
    table; arrays shape, dtype and an abbreviated rendering; containers their
    length and a summary of their first items; strings their first characters.
    """
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        raise bad_request(f"{name!r} is not a Python identifier", code="invalid_name")
    _check_bound("max_chars", max_chars, MAX_PREVIEW_CHARS)
    answer = await _inspect(kc, {"action": "preview", "name": name, "max_chars": max_chars}, timeout)
    if answer.get("error") == "unknown_variable":
        raise not_found(
            f"no variable named {name!r} in the kernel",
            "list the variables to see what is defined",
            code="unknown_variable",
        )
    return answer


def _check_bound(name: str, value: Any, highest: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= highest:
        raise bad_request(f"{name} must be an integer from 1 to {highest}", code=f"invalid_{name}")


async def _inspect(kc: AsyncKernelClient, args: dict, timeout: float) -> dict:
    """Run the inspection code with ``args`` through user_expressions; return its answer."""
    # args holds only validated str/int/bool values, so its repr is a safe literal.
    expression = (
        f"(lambda scope: (exec({_KERNEL_SOURCE!r}, scope), scope['result'])[1])"
        f"({{'user_ns': globals(), 'args': {args!r}}})"
    )
    # Watched from before the request goes out: a reply over the size cap drops the connection.
    socket = kc.shell_channel.socket
    # (A fresh address each time: the last monitor's may still be bound while ZMQ lets it go.)
    monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED, addr=f"inproc://kg-inspect-{uuid.uuid4().hex}")
    dropped = asyncio.ensure_future(monitor.recv_multipart())
    try:
        msg_id = kc.execute(
            "", silent=True, store_history=False, user_expressions={"inspection": expression}, allow_stdin=False
        )
        reply = await _shell_reply(kc, msg_id, timeout, dropped)
    finally:
        dropped.cancel()
        if kc.shell_channel.socket is not None:
            socket.disable_monitor()
        monitor.close(linger=0)
    return _answer(reply)


def _refused(message: str, code: str = "bad_kernel_reply") -> GatewayError:
    return GatewayError(409, code, message, "variables work with Python (ipykernel) kernels; "
                                            "restart the kernel if its inspection machinery was changed")


def _answer(reply: Any) -> dict:
    """The inspection's answer in a kernel's execute_reply, bounded before parsed, or a 409."""
    if not isinstance(reply, dict) or reply.get("status") != "ok":
        evalue = reply.get("evalue", "") if isinstance(reply, dict) else ""
        raise _refused(f"the kernel refused the inspection: {str(evalue)[:200]}", "inspection_failed")
    expressions = reply.get("user_expressions")
    evaluated = expressions.get("inspection") if isinstance(expressions, dict) else None
    if not isinstance(evaluated, dict):
        raise _refused("this kernel does not evaluate user_expressions", "unsupported_kernel")
    if evaluated.get("status") != "ok":
        raise _refused(
            f"inspecting variables failed in the kernel: {str(evaluated.get('ename'))[:100]}: "
            f"{str(evaluated.get('evalue'))[:200]}", "inspection_failed",
        )
    data = evaluated.get("data")
    text = data.get("text/plain") if isinstance(data, dict) else None
    # The value is a str of base64; IPython sends its repr as text/plain: 'QUJD...'.
    if not isinstance(text, str):
        raise _refused("the kernel's inspection answer is not text")
    if len(text) > MAX_REPLY_CHARS:
        raise _refused(f"the kernel's inspection answer is {len(text)} characters; the limit is {MAX_REPLY_CHARS}")
    quoted = _QUOTED_BASE64.fullmatch(text)
    try:
        value = base64.b64decode(quoted.group(1), validate=True) if quoted else None
    except (binascii.Error, ValueError):
        value = None
    if value is None:
        raise _refused("the kernel's inspection answer is not the quoted base64 the inspection sends")
    try:
        answer = json_input.loads_object(value, max_bytes=MAX_REPLY_CHARS, what="the kernel's inspection answer")
    except json_input.JSONRefused as e:
        raise _refused(str(e)) from None
    return answer


def bound_inspector(kc: Any) -> None:
    """Make ``kc``'s shell socket (not yet connected) take no message over :data:`MAX_REPLY_BYTES`."""
    with_socket_options(kc, "shell", {zmq.MAXMSGSIZE: MAX_REPLY_BYTES})


async def _shell_reply(kc: AsyncKernelClient, msg_id: str, timeout: float, dropped: asyncio.Future) -> dict:
    """The content of the execute_reply to ``msg_id``; other replies are skipped.

    ``dropped`` resolves when ZMQ drops the connection: a reply over the
    shell socket's size cap.  The client is then stopped, not reused: its
    reconnection would carry the same identity, which the kernel's ROUTER
    refuses while it still holds the old one, and a send with no peer blocks
    the loop.  (``Kernel.probe_client`` makes a new one next time.)
    """
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        reply = asyncio.ensure_future(kc.get_shell_msg(timeout=max(remaining, 0.001)))
        await asyncio.wait({reply, dropped}, return_when=asyncio.FIRST_COMPLETED)
        if not reply.done():
            reply.cancel()
            kc.stop_channels()
            raise _refused(f"the kernel's reply to the inspection was over {MAX_REPLY_BYTES} bytes")
        try:
            msg = reply.result()
        except queue.Empty:
            msg = None
        if msg is not None and msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "execute_reply":
            return msg["content"]
        if msg is None or remaining <= 0:
            raise GatewayError(
                504,
                "kernel_busy",
                f"the kernel did not answer within {timeout:g}s",
                "it may be running a cell; try again when it is idle, or interrupt it",
            )
