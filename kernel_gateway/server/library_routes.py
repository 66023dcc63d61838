"""Routes of the Agent Library: an agent's skills and documents.

Reads work on both sockets; every change is for the control socket only: the
library is the operator's, and read-only to the agent.  Every call into the
library is disk work in the agent's tree (and unpacking a skill's tar.gz is
CPU work the size of the body), so it runs off the loop (``off_loop``);
changes of one agent's library run one at a time.
"""

from __future__ import annotations

import asyncio
from typing import Any

from .. import library
from ..errors import GatewayError, bad_request
from .base import BaseHandler, check_fields

GZIP_TYPES = ("application/gzip", "application/x-gzip", "application/x-tar+gzip", "application/tar+gzip")


def checked_documents(documents: Any) -> dict[str, bytes]:
    """The ``documents`` of PUT /v1/agents/{a}, checked before anything is created."""
    if documents is None:
        return {}
    for name, text in documents.items():
        if name not in library.DOCUMENTS:  # a bad field of the body, not a missing resource
            raise bad_request(f"no document {name!r}", f"the documents are {', '.join(library.DOCUMENTS)}",
                              code="unknown_document")
        library.check_document_text(name, text)
    return documents


class LibraryBase(BaseHandler):
    tool = "library"

    def agent_checked(self, agent: str) -> str:
        agent = self.agent_arg(agent)
        self.core.agents.require_agent(agent)
        return agent

    def change(self, agent: str) -> str:
        agent = self.agent_checked(agent)
        if self.scope is not None:
            raise GatewayError(403, "read_only_library",
                               "the Agent Library is read-only to the agent: skills and documents change "
                               "only on the control socket", "ask the operator")
        return agent

    async def changing(self, agent: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """A change of ``agent``'s library, off the loop, after any other change of it has finished."""
        locks = self.application.settings.setdefault("library_locks", {})
        async with locks.setdefault(agent, asyncio.Lock()):
            return await self.off_loop(fn, *args, **kwargs)


class SkillsHandler(LibraryBase):
    async def get(self, agent: str) -> None:
        agent = self.agent_checked(agent)
        self.send_json({"skills": await self.off_loop(self.core.library.list_skills, agent)})


class SkillHandler(LibraryBase):
    async def get(self, agent: str, name: str) -> None:
        agent = self.agent_checked(agent)
        self.send_json(await self.off_loop(self.core.library.skill, agent, name))

    async def put(self, agent: str, name: str) -> None:
        agent = self.change(agent)
        library.check_skill_name(name)
        body = self.request.body or b""
        content_type = self.request.headers.get("Content-Type", "").split(";")[0].strip()
        if content_type in GZIP_TYPES or body[:2] == b"\x1f\x8b":
            files = await self.off_loop(library.files_from_tar_gz, name, body)
        else:
            files = library.files_from_json(self.json_value(body or b"null"))
        item, created = await self.changing(agent, self.core.library.install_skill, agent, name, files)
        self.send_json(item, 201 if created else 200)

    async def patch(self, agent: str, name: str) -> None:
        agent = self.change(agent)
        body = self.json_body({"enabled": bool}, required=("enabled",))
        item = await self.changing(agent, self.core.library.set_enabled, agent, name, body["enabled"])
        if name == library.KERNEL_SKILL and not body["enabled"]:
            # Narrowed: its kernels and its spare stop now.
            await self.core.stop_agent(agent)
        self.send_json(item)

    async def delete(self, agent: str, name: str) -> None:
        agent = self.change(agent)
        await self.changing(agent, self.core.library.remove_skill, agent, name)
        self.send_json({"name": name, "removed": True})


class DocumentHandler(LibraryBase):
    def reply(self, result: dict) -> None:
        self.set_header("ETag", result["etag"])
        self.send_json(result)

    async def get(self, agent: str, name: str) -> None:
        agent = self.agent_checked(agent)
        self.reply(await self.off_loop(self.core.library.get_document, agent, name))

    async def put(self, agent: str, name: str) -> None:
        agent = self.change(agent)
        library.check_document_name(name)
        raw = self.request.body or b""
        if self.request.headers.get("Content-Type", "").startswith("application/json"):
            body = self.json_object(raw, hint='send {"text": "..."}')
            text = check_fields(body, {"text": str}, required=("text",))["text"]
        else:
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise bad_request(f"{name} must be UTF-8 text: {e}", code="not_utf8") from None
        result = await self.changing(
            agent, self.core.library.put_document, agent, name, text, if_match=self.request.headers.get("If-Match")
        )
        self.reply(result)


def routes() -> list[tuple[str, type]]:
    agent = r"/v1/agents/([^/]+)"
    return [
        (agent + r"/skills/?", SkillsHandler),
        (agent + r"/skills/([^/]+)/?", SkillHandler),
        (agent + r"/documents/([^/]+)", DocumentHandler),
    ]
