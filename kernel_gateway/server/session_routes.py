"""Routes for agents, sessions and live execution."""

from __future__ import annotations

from typing import Any

from . import library_routes
from .base import SANDBOX_SOCKET, BaseHandler, StreamingHandler


class InfoHandler(BaseHandler):
    def get(self) -> None:
        info = dict(self.core.info)
        if self.scope is not None:
            # An agent sees its own paths, not the gateway's state directory.
            info = {k: info[k] for k in ("version", "bwrap", "sandbox", "limits")}
            info["agent"] = self.scope
            info["root"] = self.core.agents.agent_root(self.scope)
            info["socket"] = SANDBOX_SOCKET
        self.send_json(info)


class AgentsHandler(BaseHandler):
    def get(self) -> None:
        self.require_control_socket()
        self.send_json({"agents": [self.core.sessions.agent_json(a) for a in sorted(self.core.agents.agents)]})


class AgentHandler(BaseHandler):
    tool = "agent"

    async def put(self, agent: str) -> None:
        agent = self.agent_arg(agent)
        body = self.json_body({"documents": dict})
        if "documents" in body:
            self.require_control_socket()  # the Agent Library is read-only to the agent
        # Checked before anything is created, so a refused request leaves no agent behind.
        documents = library_routes.checked_documents(body.get("documents"))
        created = self.core.agents.ensure_agent(agent)
        for name, text in documents.items():
            await self.off_loop(self.core.library.put_document, agent, name, text)
        self.send_json(self.agent_json(agent), 201 if created else 200)

    def get(self, agent: str) -> None:
        agent = self.agent_arg(agent)
        self.core.agents.require_agent(agent)
        self.send_json(self.agent_json(agent))

    def agent_json(self, agent: str) -> dict:
        body = self.core.sessions.agent_json(agent)
        if self.scope is not None:
            body["socket"] = SANDBOX_SOCKET  # where the agent reaches it, not where it sits on the host
        return body

    async def delete(self, agent: str) -> None:
        agent = self.agent_arg(agent)
        self.require_control_socket()
        await self.core.stop_agent(agent)
        self.send_json(self.agent_json(agent))


class SessionsHandler(BaseHandler):
    tool = "session"

    async def post(self, agent: str) -> None:
        agent = self.agent_arg(agent)
        body = self.json_body({"session": str, "kernel": str})
        session_id = self.session_arg(body.get("session", "default"))
        session, created = await self.core.sessions.get_or_create(agent, session_id, body.get("kernel"))
        self.send_json(session.to_json(), 201 if created else 200)

    def get(self, agent: str) -> None:
        agent = self.agent_arg(agent)
        self.send_json({"sessions": self.core.sessions.list(agent)})


class SessionHandler(BaseHandler):
    tool = "session"

    def get(self, agent: str, session: str) -> None:
        agent, session = self.agent_arg(agent), self.session_arg(session)
        self.send_json(self.core.sessions.get(agent, session).to_json())

    async def delete(self, agent: str, session: str) -> None:
        agent, session = self.agent_arg(agent), self.session_arg(session)
        await self.core.sessions.stop(agent, session)
        self.send_json({"id": session, "state": "stopped"})


class InterruptHandler(BaseHandler):
    tool = "interrupt"

    async def post(self, agent: str, session: str) -> None:
        agent, session = self.agent_arg(agent), self.session_arg(session)
        self.json_body({})
        self.send_json(await self.core.sessions.interrupt(agent, session))


class RestartHandler(BaseHandler):
    tool = "restart"

    async def post(self, agent: str, session: str) -> None:
        agent, session = self.agent_arg(agent), self.session_arg(session)
        self.json_body({})
        self.send_json(await self.core.sessions.restart(agent, session))


class ExecuteHandler(StreamingHandler):
    tool = "execute"

    async def post(self, agent: str, session: str) -> None:
        agent, session = self.agent_arg(agent), self.session_arg(session)
        body = self.json_body(
            {"code": str, "timeout": (int, float, type(None)), "stream": bool, "inline_images": bool},
            required=("code",),
        )
        timeout = self.check_timeout(body)
        self.core.agents.require_agent(agent)
        self._code = body["code"]

        async def work(on_output: Any) -> dict:
            return await self.core.sessions.execute(
                agent,
                session,
                body["code"],
                timeout=timeout,
                inline_images=body.get("inline_images", False),
                on_output=on_output,
            )

        await self.run(work, self.wants_stream(body))


def routes() -> list[tuple[str, type]]:
    agent = r"/v1/agents/([^/]+)"
    session = agent + r"/sessions/([^/]+)"
    return [
        (r"/v1/info", InfoHandler),
        (r"/v1/agents/?", AgentsHandler),
        (agent + r"/?", AgentHandler),
        (agent + r"/sessions/?", SessionsHandler),
        (session + r"/?", SessionHandler),
        (session + r"/execute", ExecuteHandler),
        (session + r"/interrupt", InterruptHandler),
        (session + r"/restart", RestartHandler),
    ]
