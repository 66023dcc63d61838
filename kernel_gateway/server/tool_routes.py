"""Routes for the agent's computer tools: command, read_file and apply_patch."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from .. import workspace
from ..errors import GatewayError, bad_request
from ..tools import apply_patch, read_file, workspace_paths
from ..tools.command import REQUEST_KEYS, run_command
from . import library_routes
from .notebook_routes import NOTEBOOK_SESSION
from .session_routes import StreamingHandler
from .base import BaseHandler, check_fields, parse_json


def session_cwd(core: Any, agent: str, session: str) -> str:
    """Where a command for ``session`` starts: its kernel's working directory.

    That is the session directory, or for a notebook's own session the
    notebook's folder; a session with no kernel yet gets the directory its
    kernel will start in.
    """
    for listed in core.sessions.list(agent):
        if listed["id"] == session:
            return listed["cwd"]
    root = core.sessions.agent_root(agent)
    if session.startswith(NOTEBOOK_SESSION) and session.endswith(".ipynb"):
        try:
            folder = workspace_paths.resolve_in_root(root, session[len(NOTEBOOK_SESSION) :]).parent
        except workspace_paths.PathOutsideRoot:
            folder = None  # not a notebook of this agent: the session's own directory, below
        if folder is not None and folder.is_dir():
            return str(folder)
    directory = os.path.join(root, "sessions", workspace.session_dirname(session))
    try:
        workspace_paths.mkdirs_in_root(root, directory)
    except workspace_paths.PathOutsideRoot as e:
        raise GatewayError(403, "outside_workspace", str(e)) from None
    return directory


async def run_in_command_sandbox(core: Any, agent: str, request: dict, on_event: Any = None) -> dict:
    """One command in a fresh sandbox from the agent's ``command`` profile."""
    sessions = core.sessions
    return await run_command(
        request,
        agent_root=sessions.agent_root(agent),
        profile=library_routes.with_library_binds(sessions, agent, sessions.profile(agent, "command")),
        values=sessions.sandbox_values(agent),
        spill_dir=os.path.join(sessions.agent_root(agent), ".kernel-gateway", "commands"),
        on_event=on_event,
        session_cwd=lambda session: session_cwd(core, agent, session),
        output_limit=core.settings.output_limit,
        bwrap=core.settings.bwrap or None,
        run_as=sessions.uids.run_as(agent),
    )


class CommandHandler(StreamingHandler):
    tool = "command"

    async def post(self, agent: str) -> None:
        agent = self.agent_arg(agent)
        self.core.sessions.require_agent(agent)
        # run_command checks each field's type and value; here only the JSON and the field names.
        body = self.json_body(dict.fromkeys(REQUEST_KEYS, object))

        async def work(on_output: Any) -> dict:
            return await run_in_command_sandbox(self.core, agent, body, on_output)

        await self.run(work, self.wants_stream(body))


class FileHandler(BaseHandler):
    tool = "read_file"

    async def get(self, agent: str) -> None:
        agent = self.agent_arg(agent)
        self.core.sessions.require_agent(agent)
        path = self.get_query_argument("path", None)
        if path is None:
            raise bad_request("missing query parameter path", "GET .../files?path=user-files/data.csv")
        # Disk reads in the agent's tree stay off the event loop.
        result = await asyncio.to_thread(
            read_file.read_file,
            self.core.sessions.agent_root(agent),
            path,
            offset=self.query_int("offset", 1, minimum=1),
            limit=self.query_int("limit", 2000, minimum=1),
            raw=self.query_bool("raw"),
        )
        self.send_json(result)


def patch_failure(result: dict) -> dict:
    """The documented error object of a patch that did not apply; ``message`` is apply_patch's own text."""
    applied = result["added"] or result["modified"] or result["deleted"]
    return {
        "code": "patch_failed",
        "message": result["output"],
        "hint": (
            "the hunks before the failing one were applied (see added/modified/deleted); "
            if applied
            else "nothing was changed; "
        )
        + "read the file again and send a corrected patch",
    }


class PatchHandler(BaseHandler):
    tool = "apply_patch"

    def _patch_and_cwd(self, root: str) -> tuple[str, str]:
        raw = self.request.body or b""
        limit = self.core.settings.max_patch_size
        if len(raw) > limit:
            raise GatewayError(413, "patch_too_large", f"the patch is {len(raw)} bytes; the limit is {limit}")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise bad_request(f"the patch is not UTF-8 text: {e}", code="not_utf8") from None
        cwd = "."
        content_type = self.request.headers.get("Content-Type", "")
        # A patch never starts with "{": a JSON body is recognised even without its header.
        if content_type.startswith("application/json") or (
            not content_type.startswith("text/") and text.lstrip().startswith("{")
        ):
            body = parse_json(text)
            if not isinstance(body, dict):
                raise bad_request("the body must be a JSON object", code="malformed_json")
            check_fields(body, {"patch": str, "cwd": str}, required=("patch",))
            text, cwd = body["patch"], body.get("cwd", ".")
        if not text.strip():
            raise bad_request("the patch is empty", "send *** Begin Patch ... *** End Patch", code="empty_patch")
        try:
            resolved = workspace_paths.resolve_in_root(root, cwd)
            os.close(workspace_paths.open_in_root(root, resolved, os.O_PATH | os.O_DIRECTORY))
        except workspace_paths.PathOutsideRoot as e:
            raise GatewayError(403, "outside_workspace", str(e)) from None
        except OSError:
            raise bad_request(f"cwd {cwd!r} is not a directory in the agent's tree", code="invalid_cwd") from None
        return text, str(resolved)

    async def post(self, agent: str) -> None:
        agent = self.agent_arg(agent)
        sessions = self.core.sessions
        sessions.require_agent(agent)
        root = sessions.agent_root(agent)
        patch, cwd = await asyncio.to_thread(self._patch_and_cwd, root)
        library_routes.refuse_protected(self.core, agent, library_routes.patch_targets(root, patch, cwd))
        external = self.core.settings.apply_patch_command
        if external:
            result = await self._external(agent, external, patch, cwd)
        else:
            library = sessions.library
            result = (await asyncio.to_thread(
                apply_patch.apply_patch, patch, cwd, root=root,
                refuse=lambda path: library.protected(agent, path) is not None,
            )).__dict__
        if result["ok"]:
            self.send_json(result)
        else:
            self.send_json({"error": patch_failure(result), **result}, 422)

    async def _external(self, agent: str, command: str, patch: str, cwd: str) -> dict:
        """The operator's own apply_patch binary, in the command sandbox over the workspace."""
        ran = await run_in_command_sandbox(self.core, agent, {"argv": [command, patch], "cwd": cwd})
        return {
            "ok": ran["exit_code"] == 0,
            "output": ran["stdout"] + ran["stderr"],
            "added": [],
            "modified": [],
            "deleted": [],
        }


def routes() -> list[tuple[str, type]]:
    agent = r"/v1/agents/([^/]+)"
    return [
        (agent + r"/commands", CommandHandler),
        (agent + r"/files", FileHandler),
        (agent + r"/patch", PatchHandler),
    ]
