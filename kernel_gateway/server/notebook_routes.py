"""Routes for notebooks (read, edit, run cells, run-all) and live variables."""

from __future__ import annotations

from typing import Any

from .. import notebook_runs, variables
from ..errors import bad_request
from ..notebooks import NotebookStore
from .base import BaseHandler, StreamingHandler


class NotebookBase(BaseHandler):
    tool = "notebook"

    # Notebook writes never land in the agent's library (installed-skills/, its documents): the
    # store refuses them on the directory fd it writes through (NotebookStore.protected).

    def store(self, agent: str) -> NotebookStore:
        return self.core.notebooks(self.agent_arg(agent))

    def if_match(self) -> str | None:
        return self.request.headers.get("If-Match")

    def reply(self, result: dict, status: int = 200) -> None:
        if "etag" in result:
            self.set_header("ETag", result["etag"])
        self.send_json(result, status)


class NotebookHandler(NotebookBase):
    async def get(self, agent: str, path: str) -> None:
        store = self.store(agent)
        self.reply(await self.off_loop(store.contents, path, include_outputs=self.query_bool("outputs")))

    async def put(self, agent: str, path: str) -> None:
        store = self.store(agent)
        notebook = self.json_value(self.request.body or b"")
        if not isinstance(notebook, dict):
            raise bad_request("the body must be a notebook (a JSON object)", code="malformed_json")
        result = await self.off_loop(store.put, path, notebook, if_match=self.if_match())
        self.reply(result, 201 if result["created"] else 200)


class CellsHandler(NotebookBase):
    async def post(self, agent: str, path: str) -> None:
        store = self.store(agent)
        body = self.json_body({"index": int, "cell_type": str, "source": str}, required=("index", "source"))
        result = await self.off_loop(
            store.insert_cell,
            path, body["index"], body.get("cell_type", "code"), body["source"], if_match=self.if_match(),
        )
        self.reply(result, 201)


class CellHandler(NotebookBase):
    async def patch(self, agent: str, path: str, cell_id: str) -> None:
        store = self.store(agent)
        body = self.json_body({"source": str}, required=("source",))
        self.reply(await self.off_loop(store.replace_source, path, cell_id, body["source"], if_match=self.if_match()))

    async def delete(self, agent: str, path: str, cell_id: str) -> None:
        store = self.store(agent)
        self.reply(await self.off_loop(store.delete_cell, path, cell_id, if_match=self.if_match()))


class MoveHandler(NotebookBase):
    async def post(self, agent: str, path: str, cell_id: str) -> None:
        store = self.store(agent)
        body = self.json_body({"to_index": int}, required=("to_index",))
        self.reply(await self.off_loop(store.move_cell, path, cell_id, body["to_index"], if_match=self.if_match()))


class ClearOutputsHandler(NotebookBase):
    async def post(self, agent: str, path: str) -> None:
        store = self.store(agent)
        body = self.json_body({"cell_ids": list})
        self.reply(await self.off_loop(store.clear_outputs, path, body.get("cell_ids"), if_match=self.if_match()))


class RunBase(StreamingHandler, NotebookBase):
    tool = "notebook_run"

    async def notebook_session(self, agent: str, path: str, session: str | None) -> str:
        return self.session_arg(await self.core.notebook_session(agent, path, session))

    def executor(self, agent: str, session: str) -> Any:
        async def execute(code: str, timeout: float | None) -> dict:
            # Images inline, so the outputs saved into the notebook show in JupyterLab.
            return await self.core.sessions.execute(agent, session, code, timeout=timeout, inline_images=True)

        return execute


class ExecuteCellHandler(RunBase):
    async def post(self, agent: str, path: str, cell_id: str) -> None:
        store = self.store(agent)
        body = self.json_body({"session": str, "code": str, "timeout": (int, float, type(None)), "save_outputs": bool})
        timeout = self.check_timeout(body)
        self._code = body.get("code")
        await self.off_loop(store.contents, path)  # a missing or broken notebook fails before any kernel starts
        session = await self.notebook_session(self._agent, path, body.get("session"))
        result = await self.cancellable(
            notebook_runs.run_cell(
                store,
                path,
                cell_id,
                self.executor(self._agent, session),
                code=body.get("code"),
                save_outputs=body.get("save_outputs", True),
                timeout=timeout,
                off_loop=self.off_loop,
            )
        )
        if result is not None:
            self.reply(result)


class RunAllHandler(RunBase):
    async def post(self, agent: str, path: str) -> None:
        store = self.store(agent)
        body = self.json_body(
            {"session": str, "restart": bool, "save_outputs": bool, "timeout": (int, float, type(None))}
        )
        timeout = self.check_timeout(body)
        agent = self._agent
        await self.off_loop(store.contents, path)  # a missing or broken notebook fails before any kernel starts
        session = await self.notebook_session(agent, path, body.get("session"))

        async def restart() -> None:
            await self.core.sessions.get_or_create(agent, session)
            await self.core.sessions.restart(agent, session)

        # A client that leaves cancels the run (and so interrupts the running cell), as for execute.
        result = await self.cancellable(
            notebook_runs.run_all(
                store,
                path,
                self.executor(agent, session),
                restart if body.get("restart") else None,
                save_outputs=body.get("save_outputs", False),
                timeout=timeout,
                off_loop=self.off_loop,
            )
        )
        if result is not None:
            self.reply(result)


class NotANotebookHandler(BaseHandler):
    def prepare(self) -> None:
        super().prepare()
        raise bad_request(
            f"{self.request.path.split('/notebooks/', 1)[1]!r} is not a notebook path",
            "notebook paths end in .ipynb, e.g. user-files/analysis.ipynb",
            code="not_a_notebook",
        )


class VariablesHandler(BaseHandler):
    tool = "variables"

    async def get(self, agent: str, session: str) -> None:
        agent, session = self.agent_arg(agent), self.session_arg(session)
        limit = self.query_int("limit", 100, minimum=1)
        private = self.query_bool("include_private")
        result = await self.core.sessions.inspect(
            agent, session, lambda kc: variables.list_variables(kc, limit=limit, include_private=private)
        )
        self.send_json(result)


class VariableHandler(BaseHandler):
    tool = "variables"

    async def get(self, agent: str, session: str, name: str) -> None:
        agent, session = self.agent_arg(agent), self.session_arg(session)
        max_chars = self.query_int("max_chars", 4000, minimum=1)
        result = await self.core.sessions.inspect(
            agent, session, lambda kc: variables.preview_variable(kc, name, max_chars=max_chars)
        )
        self.send_json(result)


def routes() -> list[tuple[str, type]]:
    agent = r"/v1/agents/([^/]+)"
    notebook = agent + r"/notebooks/(.+?\.ipynb)"
    session = agent + r"/sessions/([^/]+)"
    return [
        (notebook, NotebookHandler),
        (notebook + r"/cells", CellsHandler),
        (notebook + r"/cells/([^/]+)", CellHandler),
        (notebook + r"/cells/([^/]+)/move", MoveHandler),
        (notebook + r"/cells/([^/]+)/execute", ExecuteCellHandler),
        (notebook + r"/clear-outputs", ClearOutputsHandler),
        (notebook + r"/run-all", RunAllHandler),
        (agent + r"/notebooks/(.*)", NotANotebookHandler),
        (session + r"/variables", VariablesHandler),
        (session + r"/variables/([^/]+)", VariableHandler),
    ]
