"""Routes for the agent's computer tools: command, read_file and apply_patch."""

from __future__ import annotations

import json
from typing import Any

from ..errors import GatewayError, bad_request
from ..tools import read_file
from ..tools.command import REQUEST_KEYS
from .base import BaseHandler, StreamingHandler, check_fields


class CommandHandler(StreamingHandler):
    tool = "command"

    async def post(self, agent: str) -> None:
        agent = self.agent_arg(agent)
        self.core.agents.require_agent(agent)
        # run_command checks each field's type and value; here only the JSON and the field names.
        body = self.json_body(dict.fromkeys(REQUEST_KEYS, object))
        self._code = body.get("command") if isinstance(body.get("command"), str) else json.dumps(body.get("argv"))

        async def work(on_output: Any) -> dict:
            return await self.core.run_command(agent, body, on_output)

        await self.run(work, self.wants_stream(body))


class FileHandler(BaseHandler):
    tool = "read_file"

    async def get(self, agent: str) -> None:
        agent = self.agent_arg(agent)
        self.core.agents.require_agent(agent)
        path = self.get_query_argument("path", None)
        if path is None:
            raise bad_request("missing query parameter path", "GET .../files?path=user-files/data.csv")
        # Disk reads in the agent's tree stay off the event loop.
        result = await self.core.workers.run(
            agent, read_file.read_file,
            self.core.agents.agent_root(agent),
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

    def _patch_and_cwd(self) -> tuple[str, str]:
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
            body = self.json_object(text)
            check_fields(body, {"patch": str, "cwd": str}, required=("patch",))
            text, cwd = body["patch"], body.get("cwd", ".")
        if not text.strip():
            raise bad_request("the patch is empty", "send *** Begin Patch ... *** End Patch", code="empty_patch")
        return text, cwd

    async def post(self, agent: str) -> None:
        agent = self.agent_arg(agent)
        self.core.agents.require_agent(agent)
        patch, cwd = self._patch_and_cwd()
        self._code = patch
        result = await self.core.apply_patch(agent, patch, cwd)
        if result["ok"]:
            self.send_json(result)
        else:
            self.send_json({"error": patch_failure(result), **result}, 422)


def routes() -> list[tuple[str, type]]:
    agent = r"/v1/agents/([^/]+)"
    return [
        (agent + r"/commands", CommandHandler),
        (agent + r"/files", FileHandler),
        (agent + r"/patch", PatchHandler),
    ]
