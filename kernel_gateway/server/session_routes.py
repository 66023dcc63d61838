"""Routes for agents, sessions and live execution."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from tornado import iostream

from ..errors import GatewayError, bad_request
from . import library_routes
from .base import SANDBOX_SOCKET, BaseHandler

KEEPALIVE_SECONDS = 10.0
NDJSON = "application/x-ndjson"


class InfoHandler(BaseHandler):
    def get(self) -> None:
        info = dict(self.core.info)
        if self.scope is not None:
            # An agent sees its own paths, not the gateway's state directory.
            info = {k: info[k] for k in ("version", "bwrap", "sandbox", "limits")}
            info["agent"] = self.scope
            info["root"] = self.core.sessions.agent_root(self.scope)
            info["socket"] = SANDBOX_SOCKET
        self.send_json(info)


class AgentsHandler(BaseHandler):
    def get(self) -> None:
        self.require_control_socket()
        self.send_json({"agents": [self.core.sessions.agent_json(a) for a in sorted(self.core.sessions.agents)]})


class AgentHandler(BaseHandler):
    tool = "agent"

    def put(self, agent: str) -> None:
        agent = self.agent_arg(agent)
        body = self.json_body({"documents": dict})
        if "documents" in body:
            self.require_control_socket()  # the Agent Library is read-only to the agent
        # Checked before anything is created, so a refused request leaves no agent behind.
        documents = library_routes.checked_documents(body.get("documents"))
        created = self.core.sessions.ensure_agent(agent)
        for name, text in documents.items():
            self.core.sessions.library.put_document(agent, name, text)
        self.send_json(self.agent_json(agent), 201 if created else 200)

    def get(self, agent: str) -> None:
        agent = self.agent_arg(agent)
        self.core.sessions.require_agent(agent)
        self.send_json(self.agent_json(agent))

    def agent_json(self, agent: str) -> dict:
        body = self.core.sessions.agent_json(agent)
        if self.scope is not None:
            body["socket"] = SANDBOX_SOCKET  # where the agent reaches it, not where it sits on the host
        return body

    async def delete(self, agent: str) -> None:
        agent = self.agent_arg(agent)
        self.require_control_socket()
        await self.core.sessions.stop_agent(agent)
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


class StreamingHandler(BaseHandler):
    """NDJSON responses with keep-alives; a client that leaves cancels the work."""

    _task: asyncio.Task | None = None

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

        self._task = asyncio.ensure_future(work(on_output))
        if not stream:
            try:
                result = await self._task
            except asyncio.CancelledError:
                if self.request.connection.stream.closed():
                    return  # the client left and its work was stopped: nobody to answer
                raise
            self.send_json(result, self.status_for(result))
            return
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
            if self.request.connection.stream.closed():
                return
            raise
        await self.write_line({"event": "result", **result})
        self.finish()

    def status_for(self, result: dict) -> int:
        return 200

    def on_connection_close(self) -> None:
        super().on_connection_close()
        # The client left: cancelling interrupts a running cell (see run_cell).
        if self._task is not None and not self._task.done():
            self._task.cancel()


class ExecuteHandler(StreamingHandler):
    tool = "execute"

    async def post(self, agent: str, session: str) -> None:
        agent, session = self.agent_arg(agent), self.session_arg(session)
        body = self.json_body(
            {"code": str, "timeout": (int, float, type(None)), "stream": bool, "inline_images": bool},
            required=("code",),
        )
        timeout = self.check_timeout(body)
        self.core.sessions.require_agent(agent)

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
