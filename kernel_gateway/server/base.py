"""The one base of every HTTP handler: JSON in and out, errors, agent scoping, audit.

Every handler family derives from :class:`BaseHandler`: ``/v1``, the
Library, jobs, tokens, the Jupyter Server API and its kernel websocket
(``ChannelsHandler`` is a ``WebSocketHandler`` over this same base), and
whatever comes next (``tests/test_source_guards.py`` fails on a handler that
does not).  So there is one body parser (:meth:`BaseHandler.json_value`:
size checked before parsing, then :mod:`kernel_gateway.json_input`), one
error renderer (:meth:`BaseHandler.write_error`, with the host-path scrub)
and one agent scoping (:meth:`BaseHandler.agent_arg`).

Handlers stay thin: parse, call the core, render.  Whatever goes wrong
reaches the client as ``{"error": {"code", "message", "hint"}}`` with a
fitting status, never as a traceback; an unexpected exception (a 500) is a
bug, logged with its traceback.  Jupyter routes put Jupyter Server's
``message`` and ``reason`` beside that object (``jupyter_errors``).  On an
agent socket every route is scoped to that one agent (``me`` is its alias);
on the Jupyter TCP port every request carries a token of the agent its URL
names; anything else is 403, and no response to an agent names a path of
the gateway's state directory.  Each agent socket has a cap on requests in
flight, so one agent cannot tie up the event loop's work.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from typing import Any

from tornado import iostream, web

from .. import fs, json_input
from ..errors import GatewayError, bad_request, disk_full
from ..workspace import check_agent_key

log = logging.getLogger("kernel_gateway")
request_log = logging.getLogger("kernel_gateway.requests")

KEEPALIVE_SECONDS = 10.0
NDJSON = "application/x-ndjson"

MAX_JSON_DEPTH = json_input.MAX_DEPTH  # arrays and objects; deeper bodies are refused, not recursed into
# Where the agent's own socket sits inside its sandboxes.
SANDBOX_SOCKET = "/run/kernel-gateway.sock"

_HTTP_CODES = {
    400: "bad_request",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    411: "length_required",
    413: "body_too_large",
    415: "unsupported_media_type",
    429: "too_many_requests",
}


class BaseHandler(web.RequestHandler):
    """JSON handlers over the plain-Python core in ``self.core``."""

    tool = "api"
    jupyter_errors = False  # errors also carry Jupyter Server's "message" and "reason"
    takes_request_slot = True  # a websocket lives long: it has caps of its own instead

    def initialize(self, core: Any, scope: str | None = None, route: str = "", tcp: bool = False) -> None:
        self.core = core
        self.scope = scope  # the agent of an agent socket; None on the control socket and the TCP port
        self.tcp = tcp  # the Jupyter TCP port: every request carries a token of the agent its URL names
        self.route = route  # the route pattern, for the log: /v1/agents/{agent}/sessions
        self._started = time.monotonic()
        self._agent: str | None = None
        self._session: str | None = None
        self._bytes_out = 0
        self._code: str | None = None  # what the audit log records when audit_code is on

    def set_default_headers(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")

    def prepare(self) -> None:
        if self.scope is not None and self.takes_request_slot:
            self._take_request_slot()
        limit = self.core.settings.max_body_size
        if len(self.request.body or b"") > limit:
            raise GatewayError(
                413, "body_too_large", f"request body is {len(self.request.body)} bytes; the limit is {limit}",
                "send less, or raise --Gateway.max_body_size",
            )

    _holds_slot = False

    def _take_request_slot(self) -> None:
        """Count this request against its agent socket's cap on requests in flight."""
        in_flight = self.application.settings.setdefault("in_flight", [0])
        cap = self.core.settings.max_requests_per_agent_socket
        if in_flight[0] >= cap:
            raise GatewayError(
                429, "too_many_requests", f"this agent socket already has {cap} requests in flight",
                "wait for one to finish; raise --Gateway.max_requests_per_agent_socket",
            )
        in_flight[0] += 1
        self._holds_slot = True

    def _release_request_slot(self) -> None:
        if self._holds_slot:
            self._holds_slot = False
            self.application.settings["in_flight"][0] -= 1

    def on_connection_close(self) -> None:
        self._release_request_slot()

    # --- parsing ----------------------------------------------------------------

    def agent_arg(self, agent: str) -> str:
        """The agent a route names, checked against the socket's scope (or, on the TCP port, the token)."""
        if self.tcp:
            check_token(self.core, agent, self.request_token())
        elif self.scope is not None:
            if agent == "me":
                agent = self.scope
            if agent != self.scope:
                raise GatewayError(
                    403, "forbidden", f"this socket belongs to agent {self.scope!r}; {agent!r} is out of reach"
                )
        elif agent == "me":
            raise bad_request("'me' only means something on an agent socket", "name the agent", code="invalid_agent")
        self._agent = agent
        return agent

    def request_token(self) -> str | None:
        """The token of a request, as Jupyter Server reads it: the Authorization header, then ?token=."""
        header = self.request.headers.get("Authorization", "")
        scheme, _, value = header.partition(" ")
        if scheme.lower() in ("token", "bearer") and value.strip():
            return value.strip()
        return self.get_query_argument("token", None)

    def session_arg(self, session: str) -> str:
        self._session = session
        return session

    def require_control_socket(self) -> None:
        if self.scope is not None:
            raise GatewayError(403, "forbidden", "this route is only on the control socket")

    def json_value(self, raw: bytes | str | None = None) -> Any:
        """The body (or ``raw``) as JSON: the one parser of request data (see :func:`parse_json`)."""
        return parse_json(self.request.body if raw is None else raw, self.core.settings.max_body_size)

    def json_object(self, raw: bytes | str | None = None, hint: str = "") -> dict:
        body = self.json_value(raw)
        if not isinstance(body, dict):
            raise bad_request("the body must be a JSON object", hint, code="malformed_json")
        return body

    def json_body(self, fields: dict[str, Any], required: tuple[str, ...] = ()) -> dict:
        """The body as a JSON object with only ``fields`` (name -> type or tuple of types)."""
        return check_fields(self.json_object(self.request.body or b"{}"), fields, required)

    async def off_loop(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Disk work on an agent's tree (anything agent-sized) runs on a worker thread within the agent's
        share (``core.workers``: fs/workers.py), never on the loop.  Call it after :meth:`agent_arg`."""
        if self._agent is None:
            raise RuntimeError("off_loop before agent_arg: whose share would this work count against?")
        try:
            return await self.core.workers.run(self._agent, fn, *args, **kwargs)
        except OSError as err:  # the tree changed under the work, or a name no call could take: a clear 4xx
            refused = fs.refusal(err, self.request.path)
            if refused is None:
                raise
            raise refused from None

    def query_int(self, name: str, default: int | None, minimum: int = 0) -> int | None:
        raw = self.get_query_argument(name, None)
        if raw is None:
            return default
        try:
            value = int(raw)
        except ValueError:
            raise bad_request(f"query parameter {name} must be a whole number, got {raw!r}") from None
        if value < minimum:
            raise bad_request(f"query parameter {name} must be at least {minimum}, got {value}")
        return value

    def query_bool(self, name: str) -> bool:
        raw = self.get_query_argument(name, "0").lower()
        if raw not in ("0", "1", "true", "false", "yes", "no", ""):
            raise bad_request(f"query parameter {name} must be 0 or 1, got {raw!r}")
        return raw in ("1", "true", "yes")

    # --- rendering --------------------------------------------------------------

    def send_json(self, obj: Any, status: int = 200) -> None:
        self.set_status(status)
        text = self.scrub(json.dumps(obj))
        self._bytes_out += len(text)
        self.finish(text)

    def scrub(self, text: str) -> str:
        """To an agent (its socket, or the TCP port), no path of the gateway's state directory goes out.

        Routes say the sandbox's paths themselves; this is the net under them
        (an error message that quotes a host path, say).
        """
        if self.scope is None and not self.tcp:
            return text  # the control socket: the operator's
        agent = self.scope or self._agent
        pairs = [(self.core.settings.state_dir, "<gateway state>")]
        if agent is not None:
            pairs.insert(0, (self.core.agents.agent_socket(agent), SANDBOX_SOCKET))
        for host, shown in pairs:
            text = text.replace(json.dumps(host)[1:-1], shown)
        return text

    def set_header(self, name: str, value: Any) -> None:
        """Headers built from agent text (a contents path in ``Location``) refuse control characters as a 400."""
        try:
            super().set_header(name, value)
        except ValueError:
            raise bad_request(f"the {name} header of this answer would hold a control character",
                              "use names without control characters (newline, tab, NUL)",
                              code="unsafe_header") from None

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        """The one error renderer: our error object (and Jupyter's fields beside it on Jupyter routes)."""
        error = kwargs.get("exc_info", (None, None, None))[1]
        error = disk_full(error) or error
        if isinstance(error, GatewayError):
            body = error.to_json()["error"]
        elif isinstance(error, web.HTTPError) and status_code < 500:
            body = {
                "code": _HTTP_CODES.get(status_code, "http_error"),
                "message": error.log_message or self._reason,
                "hint": "see GET /v1/info and the README for the routes" if status_code in (404, 405) else "",
            }
        else:
            body = {"code": "internal", "message": "internal error", "hint": "see the gateway's log"}
        answer: dict = {"error": body}
        if self.jupyter_errors:
            # Jupyter clients read 'message' (and 'reason'); ours read 'error'.
            answer = {"message": body["message"], "reason": self._reason, "error": body}
        self.set_header("Content-Type", "application/json")
        self.finish(self.scrub(json.dumps(answer)))

    def send_error(self, status_code: int = 500, **kwargs: Any) -> None:
        error = kwargs.get("exc_info", (None, None, None))[1]
        error = disk_full(error) or error
        if isinstance(error, GatewayError):
            status_code = error.status
        super().send_error(status_code, **kwargs)

    def log_exception(self, typ: Any, value: Any, tb: Any) -> None:
        if isinstance(value, GatewayError) and value.status < 500:
            return  # a client error, already in the response and the audit log
        if disk_full(value) or (isinstance(value, GatewayError) and value.code == "disk_full"):
            log.warning("%s %s: %s", self.request.method, self.request.path, value)  # a full quota is no bug
            return
        if isinstance(value, web.HTTPError) and value.status_code < 500:
            return super().log_exception(typ, value, tb)
        # Anything else is a bug in the gateway: say where, with the traceback.
        log.error(
            "unexpected error in %s %s (agent %s)", self.request.method, self.route or self.request.path,
            self._agent, exc_info=(typ, value, tb),
        )

    def on_finish(self) -> None:
        self._release_request_slot()
        if self.tool == "api" and self.get_status() < 400 and self.request.method == "GET":
            return  # reads of the API itself are not tool calls
        self.core.audit.record(
            agent=self._agent,
            session=self._session,
            tool=self.tool,
            status=self.get_status(),
            duration_ms=(time.monotonic() - self._started) * 1000,
            bytes_in=len(self.request.body or b""),
            bytes_out=self._bytes_out,
            code=self._code,
        )


def check_token(core: Any, agent: str, token: str | None) -> None:
    """On the TCP port, ``token`` must be one of ``agent``'s (else 403 ``invalid_token``).

    The one check of a Jupyter token: :meth:`BaseHandler.agent_arg` and the
    accept gate (``jupyter_routes.tcp_request_agent``, before a body is read).
    """
    try:
        check_agent_key(agent)
    except GatewayError:
        raise GatewayError(403, "invalid_token", "a valid token of this agent is required") from None
    if not core.jupyter.tokens.check(agent, token):
        raise GatewayError(
            403, "invalid_token", "missing or wrong token for agent " + repr(agent),
            f"mint one on the control socket: POST /v1/agents/{agent}/tokens, or `kernel-gateway token {agent}`",
        )


def log_request(handler: web.RequestHandler) -> None:
    """The access line: method, route pattern, agent, status, duration (never the body)."""
    status = handler.get_status()
    duration_ms = round(handler.request.request_time() * 1000, 2)
    route = getattr(handler, "route", "") or "(no route)"
    agent = getattr(handler, "_agent", None)
    level = logging.ERROR if status >= 500 else logging.INFO
    request_log.log(
        level,
        "%s %s %s agent=%s %.1fms",
        handler.request.method, route, status, agent or "-", duration_ms,
        extra={"fields": {"method": handler.request.method, "route": route, "agent": agent,
                          "status": status, "duration_ms": duration_ms}},
    )


def route_label(pattern: str) -> str:
    """A route regex as people read it: ``/v1/agents/([^/]+)/sessions`` -> ``/v1/agents/{agent}/sessions``."""
    names = {"agents": "agent", "sessions": "session", "notebooks": "path", "cells": "cell", "variables": "name"}

    def name(match: "re.Match[str]") -> str:
        segment = match.group(1)
        return f"/{segment}/{{{names.get(segment, segment)}}}"

    label = re.sub(r"/([\w-]+)/\([^)]*\)", name, pattern)
    return label.removesuffix("/?").removesuffix("$") or "/"


def parse_json(raw: bytes | str, max_bytes: int) -> Any:
    """A request body as JSON, refusing what would trip up the code behind it.

    Refused with 400 ``malformed_json`` (see :mod:`kernel_gateway.json_input`):
    more than ``max_bytes`` (checked before parsing), invalid JSON or UTF-8,
    ``NaN`` and ``Infinity``, nesting deeper than :data:`MAX_JSON_DEPTH`, and
    strings (or keys) holding lone surrogates.
    """
    try:
        return json_input.loads(raw, max_bytes=max_bytes, what="the body")
    except json_input.JSONRefused as e:
        hint = "send valid Unicode text" if "surrogate" in str(e) else ""
        raise bad_request(str(e), hint, code="malformed_json") from None


def check_fields(body: dict, fields: dict[str, Any], required: tuple[str, ...] = ()) -> dict:
    """Refuse unknown fields, missing required ones, and wrong types (bool is not a number)."""
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise bad_request(
            f"unknown field {unknown[0]!r}", f"allowed fields: {', '.join(sorted(fields))}", code="unknown_field"
        )
    for name in required:
        if name not in body:
            raise bad_request(f"missing field {name!r}", code="missing_field")
    for name, expected in fields.items():
        if name not in body:
            continue
        value = body[name]
        types = expected if isinstance(expected, tuple) else (expected,)
        numeric = any(t in (int, float) for t in types)
        if not isinstance(value, types) or (numeric and isinstance(value, bool) and bool not in types):
            names = " or ".join(t.__name__ if t is not type(None) else "null" for t in types)
            raise bad_request(
                f"field {name!r} must be {names}, got {type(value).__name__}", code="wrong_type"
            )
    return body


class StreamingHandler(BaseHandler):
    """NDJSON responses with keep-alives; a client that leaves cancels the work."""

    _task: asyncio.Task | None = None
    _client_left = False

    def wants_stream(self, body: dict) -> bool:
        return body.get("stream") is True or NDJSON in self.request.headers.get("Accept", "")

    def check_timeout(self, body: dict) -> float:
        settings = self.core.settings
        timeout = body.get("timeout", settings.default_timeout)
        if timeout is None:
            return settings.default_timeout
        if not 0 < timeout <= settings.max_timeout:
            raise bad_request(
                f"timeout must be more than 0 and at most {settings.max_timeout} seconds, got {timeout}",
                code="invalid_timeout",
            )
        return float(timeout)

    async def write_line(self, obj: dict) -> None:
        line = self.scrub(json.dumps(obj)) + "\n"
        self._bytes_out += len(line)
        self.write(line)
        try:
            await self.flush()
        except iostream.StreamClosedError:
            pass

    async def run(self, work: Any, stream: bool) -> None:
        """Run ``work(on_output)``; stream events when asked; render the result."""
        on_output = None
        if stream:
            self.set_header("Content-Type", NDJSON)

            async def on_output(event: dict) -> None:
                await self.write_line({"event": "output", "output": event})

        if not stream:
            result = await self.cancellable(work(on_output))
            if result is not None:
                self.send_json(result, self.status_for(result))
            return
        self._task = asyncio.ensure_future(work(on_output))
        while True:
            done, _ = await asyncio.wait({self._task}, timeout=KEEPALIVE_SECONDS)
            if done:
                break
            await self.write_line({"event": "keepalive"})
        try:
            result = self._task.result()
        except GatewayError as e:
            result = e.to_json()
        except asyncio.CancelledError:
            return  # the client left
        await self.write_line({"event": "result", **result})
        self.finish()

    async def cancellable(self, work: Any) -> Any:
        """Await ``work``, cancelled if the client leaves; None then (no one to answer)."""
        self._task = asyncio.ensure_future(work)
        try:
            return await self._task
        except asyncio.CancelledError:
            if self._client_left:
                return None
            raise

    def status_for(self, result: dict) -> int:
        return 200

    def on_connection_close(self) -> None:
        super().on_connection_close()
        # The client left: cancelling interrupts a running cell (see run_cell).
        self._client_left = True
        if self._task is not None and not self._task.done():
            self._task.cancel()


class NotFoundHandler(BaseHandler):
    """Unknown paths get a JSON 404 too."""

    def prepare(self) -> None:
        raise GatewayError(404, "no_route", f"no route {self.request.method} {self.request.path}",
                           "see the README for the routes")
