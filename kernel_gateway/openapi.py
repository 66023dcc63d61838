"""The OpenAPI 3.1 document of the gateway's ``/v1`` API, served at ``GET /v1/openapi.json``.

The document is written by hand, route by route, next to what each route
accepts; it is not derived from the route table, so a test can hold the two
against each other (``tests/test_openapi.py``): a route missing from the
document, or a documented route that does not exist, fails it.  The same
document drives the fuzzer (schemathesis), which checks that no request gets
a 5xx and every 4xx has the error shape below.
"""

from __future__ import annotations

from typing import Any

JSON = "application/json"
NDJSON = "application/x-ndjson"

AGENT_KEY_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$"

ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message", "hint"],
            "properties": {
                "code": {"type": "string", "description": "A stable, machine-readable reason."},
                "message": {"type": "string", "description": "What went wrong, for a person."},
                "hint": {"type": "string", "description": "What to do about it; may be empty."},
            },
        }
    },
}

# Why each status is used; a route lists the ones it can give.
STATUS_TEXT = {
    "400": "Bad input; nothing changed.",
    "403": "Out of this socket's scope, outside the workspace, or a disabled skill.",
    "404": "No such agent, session, notebook, cell, variable or file.",
    "405": "The route exists, the method does not.",
    "409": "A stale ETag, or no running kernel.",
    "413": "The body is too large.",
    "415": "A binary file asked for as text.",
    "422": "The patch did not apply; nothing changed.",
    "429": "Over a session or connection cap.",
    "507": "The agent's disk quota is full; nothing changed.",
}

SESSION = {
    "type": "object",
    "required": ["id", "agent", "state"],
    "properties": {
        "id": {"type": "string"},
        "agent": {"type": "string"},
        "state": {"type": "string", "description": "starting | idle | busy | dead | lost | stopped"},
        "kernel": {"type": "string"},
        "cwd": {"type": "string"},
        "execution_count": {"type": "integer"},
        "created": {"type": "number"},
        "last_activity": {"type": "number"},
    },
}

OUTPUT = {"type": "object", "required": ["output_type"], "properties": {"output_type": {"type": "string"}}}

EXECUTE_RESULT = {
    "type": "object",
    "required": ["status", "outputs", "text"],
    "properties": {
        "status": {"type": "string", "enum": ["ok", "error", "timeout", "died"]},
        "execution_count": {"type": ["integer", "null"]},
        "outputs": {"type": "array", "items": OUTPUT},
        "text": {"type": "string", "description": "Plain text of every output, ANSI stripped, for agents."},
        "error": {"type": ["object", "null"]},
        "artifacts": {"type": "array", "items": {"type": "object"}},
        "truncated": {"type": "boolean"},
        "spill_paths": {"type": "array", "items": {"type": "string"}},
        "duration_ms": {"type": ["number", "null"], "description": "null when the code never ran."},
        "notice": {"type": "string"},
    },
}

TIMEOUT = {"type": ["number", "null"], "exclusiveMinimum": 0, "description": "Seconds; the default is the gateway's."}


def _obj(properties: dict, required: tuple[str, ...] = (), description: str = "") -> dict:
    schema: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        schema["required"] = list(required)
    if description:
        schema["description"] = description
    return schema


EMPTY_BODY = _obj({}, description="An empty object, or no body at all.")


def _param(name: str, where: str, schema: dict, description: str, required: bool = False) -> dict:
    return {"name": name, "in": where, "required": required or where == "path", "schema": schema,
            "description": description}


PATH_PARAMS = {
    "agent": _param("agent", "path", {"type": "string", "pattern": AGENT_KEY_PATTERN},
                    "The agent key; `me` on an agent socket."),
    "session": _param("session", "path", {"type": "string", "minLength": 1, "maxLength": 128},
                      "A session id: 1-128 printable characters."),
    "path": _param("path", "path", {"type": "string", "pattern": r"\.ipynb$"},
                   "A notebook path in the agent's tree, ending in .ipynb."),
    "cell_id": _param("cell_id", "path", {"type": "string"}, "A cell id of the notebook."),
    "name": _param("name", "path", {"type": "string"}, "A variable name in the session's kernel."),
    "skill": _param("skill", "path", {"type": "string"}, "A skill's name (its directory in installed-skills/)."),
    "job": _param("job", "path", {"type": "string"}, "A job id."),
    "token": _param("token", "path", {"type": "string"}, "A Jupyter API token's id (never the token itself)."),
    "document": _param("document", "path", {"type": "string", "enum": ["SOUL.md", "MISSION.md", "DESIGN.md"]},
                       "One of the agent's documents."),
}

IF_MATCH = _param("If-Match", "header", {"type": "string"}, "The ETag the change is based on; stale gives 409.")


def _op(summary: str, *, ok: str = "200", result: dict | None = None, body: dict | None = None,
        errors: tuple[str, ...] = ("400", "404"), query: tuple[dict, ...] = (), stream: bool = False,
        body_types: tuple[str, ...] = (JSON,), if_match: bool = False, extra_ok: tuple[str, ...] = (),
        error_schemas: dict | None = None) -> dict:
    op: dict[str, Any] = {"summary": summary, "parameters": list(query)}
    if if_match:
        op["parameters"].append(IF_MATCH)
    if body is not None:
        op["requestBody"] = {"required": False, "content": {t: {"schema": body} for t in body_types}}
    content = {JSON: {"schema": result or {"type": "object"}}}
    if stream:
        # (A media type object has no description in OpenAPI 3.1: it goes in the schema.)
        content[NDJSON] = {"schema": {"type": "string",
                                      "description": "One JSON event a line: output, keepalive, then result."}}
    op["responses"] = {ok: {"description": "Success.", "content": content}}
    for status in extra_ok:
        op["responses"][status] = {"description": "Success.", "content": {JSON: {"schema": result or {"type": "object"}}}}
    for status in ("403",) + errors + ("405", "507"):
        schema = (error_schemas or {}).get(status, ERROR)
        op["responses"][status] = {"description": STATUS_TEXT[status], "content": {JSON: {"schema": schema}}}
    return op


def _text_op(op: dict, media: str) -> dict:
    """An operation whose success is plain text of one media type, not JSON."""
    op["responses"]["200"]["content"] = {media: {"schema": {"type": "string"}}}
    return op


def _path(*names: str, **methods: dict) -> dict:
    return {"parameters": [PATH_PARAMS[n] for n in names], **methods}


SKILL = {
    "type": "object",
    "required": ["name", "enabled"],
    "properties": {
        "name": {"type": "string"}, "description": {"type": "string"}, "builtin": {"type": "boolean"},
        "default_enabled": {"type": "boolean"}, "enabled": {"type": "boolean"}, "path": {"type": "string"},
    },
}
DOCUMENT = {"type": "object", "required": ["etag"], "properties": {"etag": {"type": "string"}}}

PATCH_RESULT = {
    "type": "object",
    "required": ["ok", "output"],
    "properties": {
        "ok": {"type": "boolean"},
        "output": {"type": "string", "description": "Codex's own output text, byte for byte."},
        "added": {"type": "array", "items": {"type": "string"}},
        "modified": {"type": "array", "items": {"type": "string"}},
        "deleted": {"type": "array", "items": {"type": "string"}},
    },
}
# A failed patch is an error, and keeps Codex's fields beside it.
PATCH_FAILED = {"allOf": [ERROR, PATCH_RESULT]}

JOB = {
    "type": "object",
    "required": ["id", "kind", "state"],
    "properties": {
        "id": {"type": "string"}, "kind": {"type": "string"},
        "state": {"type": "string", "enum": ["queued", "running", "succeeded", "failed", "timed_out",
                                             "cancelled", "lost"]},
        "created": {"type": ["number", "null"]}, "started": {"type": ["number", "null"]},
        "ended": {"type": ["number", "null"]}, "exit_code": {"type": ["integer", "null"]},
        "stdout_tail": {"type": "string"}, "stderr_tail": {"type": "string"},
        "patch": {"type": ["object", "null"]},
    },
}

NOTEBOOK_EDIT = _obj({"etag": {"type": "string"}}, ("etag",))
NOTEBOOK_ERRORS = ("400", "404", "409")

ROUTES: dict[str, dict] = {
    "/v1/info": _path(get=_op("Version, bwrap, sandbox checks, limits and paths.", errors=())),
    "/v1/openapi.json": _path(get=_op("This document.", errors=())),
    "/v1/agents": _path(get=_op("Every agent (control socket only).", errors=())),
    "/v1/agents/{agent}": _path(
        "agent",
        put=_op("Create the agent and its workspace (201), or return it (200); optionally set its documents.",
                ok="201", extra_ok=("200",), errors=("400", "413"),
                body=_obj({"documents": {"type": "object", "additionalProperties": {"type": "string"},
                                         "description": "SOUL.md, MISSION.md and/or DESIGN.md to write."}})),
        get=_op("One agent, with its sessions."),
        delete=_op("Stop the agent's sessions; its files stay (control socket only)."),
    ),
    "/v1/agents/{agent}/sessions": _path(
        "agent",
        post=_op("Get or create a session: 201 new, 200 existing.", ok="201", extra_ok=("200",), result=SESSION,
                 body=_obj({"session": {"type": "string"}, "kernel": {"type": "string"}}),
                 errors=("400", "404", "429")),
        get=_op("The agent's sessions.",
                result=_obj({"sessions": {"type": "array", "items": SESSION}}, ("sessions",))),
    ),
    "/v1/agents/{agent}/sessions/{session}": _path(
        "agent", "session",
        get=_op("One session.", result=SESSION),
        delete=_op("Shut the session's kernel down."),
    ),
    "/v1/agents/{agent}/sessions/{session}/execute": _path(
        "agent", "session",
        post=_op("Run a cell in the session's live kernel (created if needed).", result=EXECUTE_RESULT,
                 body=_obj({"code": {"type": "string"}, "timeout": TIMEOUT, "stream": {"type": "boolean"},
                            "inline_images": {"type": "boolean"}}, ("code",)),
                 stream=True, errors=("400", "404", "409", "429")),
    ),
    "/v1/agents/{agent}/sessions/{session}/interrupt": _path(
        "agent", "session", post=_op("Interrupt the running cell.", result=SESSION, body=EMPTY_BODY,
                                     errors=("400", "404", "409"))),
    "/v1/agents/{agent}/sessions/{session}/restart": _path(
        "agent", "session", post=_op("Restart the kernel; variables are lost.", result=SESSION, body=EMPTY_BODY,
                                     errors=("400", "404", "409"))),
    "/v1/agents/{agent}/sessions/{session}/variables": _path(
        "agent", "session",
        get=_op("The live variables of the session.", errors=("400", "404", "409"),
                query=(_param("limit", "query", {"type": "integer", "minimum": 1}, "At most this many."),
                       _param("include_private", "query", {"type": "string", "enum": ["0", "1"]},
                              "Also names starting with _, and modules in the list (otherwise named apart, in modules)."))),
    ),
    "/v1/agents/{agent}/sessions/{session}/variables/{name}": _path(
        "agent", "session", "name",
        get=_op("A preview of one variable (DataFrames: shape, dtypes, head).", errors=("400", "404", "409"),
                query=(_param("max_chars", "query", {"type": "integer", "minimum": 1}, "Cut the preview here."),)),
    ),
    "/v1/agents/{agent}/commands": _path(
        "agent",
        post=_op("Run a shell command in a fresh sandbox over the agent's tree.", stream=True,
                 body=_obj({"command": {"type": "string"}, "argv": {"type": "array", "items": {"type": "string"}},
                            "cwd": {"type": "string"},
                            "session": {"type": "string", "description": "Run in this session's working "
                                        "directory, with $JLK_SESSION set."},
                            "timeout": TIMEOUT,
                            "env": {"type": "object", "additionalProperties": {"type": "string"}},
                            "stdin": {"type": "string"}, "stream": {"type": "boolean"}},
                           description="Exactly one of command and argv."),
                 errors=("400", "404", "413")),
    ),
    "/v1/agents/{agent}/files": _path(
        "agent",
        get=_op("Read a file of the agent's tree (lines, or base64 for images and raw).",
                errors=("400", "404", "415"),
                query=(_param("path", "query", {"type": "string"}, "Relative to the agent root.", required=True),
                       _param("offset", "query", {"type": "integer", "minimum": 1}, "First line, 1-based."),
                       _param("limit", "query", {"type": "integer", "minimum": 1}, "At most this many lines."),
                       _param("raw", "query", {"type": "string", "enum": ["0", "1"]}, "Binary files as base64."))),
    ),
    "/v1/agents/{agent}/patch": _path(
        "agent",
        post=_op("Apply a patch in Codex's apply_patch grammar.",
                 body=_obj({"patch": {"type": "string"}, "cwd": {"type": "string"}}, ("patch",)),
                 body_types=(JSON, "text/plain"), result=PATCH_RESULT,
                 errors=("400", "404", "413", "422"), error_schemas={"422": PATCH_FAILED}),
    ),
    "/v1/agents/{agent}/notebooks/{path}": _path(
        "agent", "path",
        get=_op("A notebook's cells, metadata and ETag.",
                query=(_param("outputs", "query", {"type": "string", "enum": ["0", "1"]}, "Include outputs."),)),
        put=_op("Create (201) or replace (200) a notebook: an nbformat v4 document.", ok="201", extra_ok=("200",),
                body={"type": "object", "description": "An nbformat v4 notebook."}, if_match=True,
                errors=NOTEBOOK_ERRORS),
    ),
    "/v1/agents/{agent}/notebooks/{path}/cells": _path(
        "agent", "path",
        post=_op("Insert a cell.", ok="201", if_match=True, errors=NOTEBOOK_ERRORS,
                 body=_obj({"index": {"type": "integer"}, "cell_type": {"type": "string"},
                            "source": {"type": "string"}}, ("index", "source"))),
    ),
    "/v1/agents/{agent}/notebooks/{path}/cells/{cell_id}": _path(
        "agent", "path", "cell_id",
        patch=_op("Replace a cell's source.", result=NOTEBOOK_EDIT, if_match=True, errors=NOTEBOOK_ERRORS,
                  body=_obj({"source": {"type": "string"}}, ("source",))),
        delete=_op("Delete a cell.", result=NOTEBOOK_EDIT, if_match=True, errors=NOTEBOOK_ERRORS),
    ),
    "/v1/agents/{agent}/notebooks/{path}/cells/{cell_id}/move": _path(
        "agent", "path", "cell_id",
        post=_op("Move a cell.", result=NOTEBOOK_EDIT, if_match=True, errors=NOTEBOOK_ERRORS,
                 body=_obj({"to_index": {"type": "integer"}}, ("to_index",))),
    ),
    "/v1/agents/{agent}/notebooks/{path}/cells/{cell_id}/execute": _path(
        "agent", "path", "cell_id",
        post=_op("Run one cell in the notebook's own session and save its outputs.",
                 errors=("400", "404", "409", "429"),
                 body=_obj({"session": {"type": "string"}, "code": {"type": "string"}, "timeout": TIMEOUT,
                            "save_outputs": {"type": "boolean"}})),
    ),
    "/v1/agents/{agent}/notebooks/{path}/clear-outputs": _path(
        "agent", "path",
        post=_op("Clear the outputs of some or all cells.", result=NOTEBOOK_EDIT, if_match=True,
                 errors=NOTEBOOK_ERRORS,
                 body=_obj({"cell_ids": {"type": "array", "items": {"type": "string"}}})),
    ),
    "/v1/agents/{agent}/notebooks/{path}/run-all": _path(
        "agent", "path",
        post=_op("Run every code cell in order (optionally after a restart).", errors=("400", "404", "409", "429"),
                 body=_obj({"session": {"type": "string"}, "restart": {"type": "boolean"},
                            "save_outputs": {"type": "boolean"}, "timeout": TIMEOUT})),
    ),
    "/v1/agents/{agent}/skills": _path(
        "agent",
        get=_op("The agent's skills: name, description, builtin, default_enabled, enabled, path.",
                result=_obj({"skills": {"type": "array", "items": SKILL}}, ("skills",))),
    ),
    "/v1/agents/{agent}/skills/{skill}": _path(
        "agent", "skill",
        get=_op("One skill.", result=SKILL),
        put=_op("Install or replace a user skill (control socket only): {\"files\": {...}} or a tar.gz.",
                ok="201", extra_ok=("200",), result=SKILL, errors=("400", "404", "413"),
                body_types=(JSON, "application/gzip"),
                body=_obj({"files": {"type": "object", "additionalProperties": {"type": "string"}}}, ("files",))),
        patch=_op("Enable or disable a skill (control socket only); disabling jupyter-live-kernel stops "
                  "the agent's kernels.", result=SKILL, body=_obj({"enabled": {"type": "boolean"}}, ("enabled",))),
        delete=_op("Remove a user skill (control socket only); builtin ones can only be disabled.",
                   errors=("400", "404", "409")),
    ),
    "/v1/agents/{agent}/documents/{document}": _path(
        "agent", "document",
        get=_op("A document's text and ETag.", result=DOCUMENT),
        put=_op("Replace a document (control socket only): the text, or {\"text\": ...} as JSON.",
                result=DOCUMENT, if_match=True, errors=("400", "404", "409", "413"),
                body_types=(JSON, "text/plain"), body=_obj({"text": {"type": "string"}}, ("text",))),
    ),
    "/v1/agents/{agent}/tokens": _path(
        "agent",
        post=_op("Mint a token for the agent's Jupyter API (control socket only); the secret is shown once.",
                 ok="201", result=_obj({"id": {"type": "string"}, "token": {"type": "string"},
                                        "created": {"type": "number"}, "url": {"type": ["string", "null"]}},
                                       ("id", "token", "created", "url")), body=_obj({})),
        get=_op("The agent's token ids and creation times, never the secrets (control socket only).",
                result=_obj({"tokens": {"type": "array", "items": _obj(
                    {"id": {"type": "string"}, "created": {"type": ["number", "null"]}}, ("id",))},
                    "url": {"type": ["string", "null"]}}, ("tokens", "url"))),
    ),
    "/v1/agents/{agent}/tokens/{token}": _path(
        "agent", "token",
        delete=_op("Revoke a token (control socket only).",
                   result=_obj({"id": {"type": "string"}, "revoked": {"type": "boolean"}}, ("id", "revoked"))),
    ),
    "/v1/agents/{agent}/jobs": _path(
        "agent",
        post=_op("Start a background job over a copy of a directory of the agent's tree; it ends in a patch.",
                 ok="201", result=JOB, errors=("400", "404", "409", "413", "429"),
                 body=_obj({"kind": {"type": "string", "enum": ["command", "codex"]},
                            "from": {"type": "string", "description": "A directory inside the agent's tree."},
                            "command": {"type": "string"}, "argv": {"type": "array", "items": {"type": "string"}},
                            "objective": {"type": "string"},
                            "limits": {"type": "object", "description": "wall, cpu, processes, file_size, memory: "
                                       "narrower than the job profile's, never wider."},
                            "env": {"type": "object", "additionalProperties": {"type": "string"},
                                    "description": "Variables for the job's process. Proxy, TLS, loader, Codex, model "
                                    "and gateway names are refused (400 env_not_allowed); a codex job takes only "
                                    "locale, time zone, terminal and build switches and JOB_* names."}},
                           ("kind", "from"))),
        get=_op("The agent's jobs, newest first.", result=_obj({"jobs": {"type": "array", "items": JOB}}, ("jobs",))),
    ),
    "/v1/agents/{agent}/jobs/{job}": _path(
        "agent", "job",
        get=_op("One job.", result=JOB,
                query=(_param("wait", "query", {"type": "string", "enum": ["0", "1"]},
                              "Answer once the job has ended."),)),
        delete=_op("Remove a finished job and its workspace.", errors=("400", "404", "409")),
    ),
    "/v1/agents/{agent}/jobs/{job}/patch": _path(
        "agent", "job",
        get=_text_op(_op("The job's change.patch, a unified diff; its SHA-256 in X-Patch-SHA256.",
                         errors=("400", "404", "409", "413")), "text/x-diff"),
    ),
    "/v1/agents/{agent}/jobs/{job}/apply": _path(
        "agent", "job",
        post=_op("Apply the job's patch to its `from` directory: all of it or nothing; 409 if the source changed.",
                 body=EMPTY_BODY, errors=("400", "404", "409")),
    ),
    "/v1/agents/{agent}/jobs/{job}/cancel": _path(
        "agent", "job",
        post=_op("Cancel a queued or running job; every process of it ends.", result=JOB, body=EMPTY_BODY,
                 errors=("400", "404", "409")),
    ),
}


def document(version: str) -> dict:
    """The whole OpenAPI document."""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "live-kernel-gateway",
            "version": version,
            "description": (
                "HTTP/1.1 over Unix sockets, JSON in and out. The control socket has every route; an agent's "
                "own socket has the same routes scoped to that agent (`me` is its alias), anything else is 403. "
                "Every error is {\"error\": {\"code\", \"message\", \"hint\"}} and changes nothing."
            ),
        },
        "servers": [{"url": "http://localhost", "description": "Over the gateway's Unix socket."}],
        "paths": ROUTES,
        "components": {"schemas": {"Error": ERROR, "Session": SESSION, "ExecuteResult": EXECUTE_RESULT}},
    }
