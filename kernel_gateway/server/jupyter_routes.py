"""The Jupyter Server API per agent: ``/agents/{agent}/api/...`` (thin handlers over ``jupyter_api``).

Served three ways: on the loopback TCP port, where every request carries a
token of the agent its URL names (``Authorization: token T`` or
``?token=T``); on the control socket (mode 0600, root only: no token, like
every other route there); and on each agent's socket under ``/agents/me/``,
scoped to that agent as every route there is.  The handlers derive from the
one HTTP base (``base.BaseHandler``): its body parser, its agent scoping (the
token check included) and its error renderer, which on these routes puts
Jupyter Server's ``message`` and ``reason`` beside our own ``error`` object,
so Jupyter clients and ours both read them.  Tokens are minted on the
control socket: ``POST /v1/agents/{agent}/tokens``.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from typing import Any

from .. import __version__
from ..errors import GatewayError, bad_request
from ..fs.workers import json_text
from ..jupyter_api.kernels import iso8601
from .base import BaseHandler, check_token


def api_path(group: str | None) -> str:
    """The contents path of a URL group ('' or '/a/b'): one leading slash is the URL's own."""
    group = group or ""
    return group[1:] if group.startswith("/") else group

try:
    from jupyter_server import __version__ as JUPYTER_SERVER_VERSION
except ImportError:  # the API is ours; the version only tells clients which one it follows
    JUPYTER_SERVER_VERSION = "2.14.0"


def tcp_request_agent(core: Any, path: str, headers: Any) -> str:
    """The agent a request on the TCP port acts for, from its URL and token alone.

    The accept gate calls this once the headers are in, before the body is read and before any
    route runs; a GatewayError here is the whole answer, and the connection is closed.
    """
    match = re.match(r"/agents/([^/?#]+)/", path)
    if match is None:
        raise GatewayError(404, "no_route", f"no route {path.split('?')[0][:200]!r}",
                           "the API of an agent is under /agents/{agent}/api/")
    agent = urllib.parse.unquote(match.group(1))
    header = headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    token = value.strip() if scheme.lower() in ("token", "bearer") and value.strip() else None
    if token is None:
        token = (urllib.parse.parse_qs(urllib.parse.urlsplit(path).query).get("token") or [None])[-1]
    check_token(core, agent, token)  # the same check as the handlers' (BaseHandler.agent_arg)
    core.jupyter.require_agent(agent)
    return agent


class JupyterHandler(BaseHandler):
    """A Jupyter API route of one agent; the agent is the first path group."""

    tool = "jupyter"
    jupyter_errors = True

    def prepare(self) -> None:
        super().prepare()
        self.url_agent = self.path_args[0] if self.path_args else ""
        self.agent = self.agent_arg(self.url_agent)
        self.core.jupyter.require_agent(self.agent)
        self.kernels = self.core.jupyter.kernels(self.agent)

    @property
    def base_url(self) -> str:
        return f"/agents/{self.url_agent}/"

    def url(self, *parts: str) -> str:
        """A URL of this agent's API, each part (agent text: a contents path) percent-encoded."""
        return self.base_url + "/".join(urllib.parse.quote(p, safe="/") for p in parts)

    def body(self, optional: bool = False) -> dict | None:
        if not self.request.body:
            if optional:
                return None
            raise bad_request("No JSON data provided", code="malformed_json")
        return self.json_object()

    def no_content(self) -> None:
        self.set_status(204)
        self.clear_header("Content-Type")
        self.finish()


class ApiHandler(JupyterHandler):
    def get(self, agent: str) -> None:
        self.send_json({"version": JUPYTER_SERVER_VERSION, "gateway": __version__})


class StatusHandler(JupyterHandler):
    def get(self, agent: str) -> None:
        kernels = self.kernels.list()
        last = max(self.core.jupyter.started, self.kernels.last_activity() or 0)
        self.send_json({
            "started": iso8601(self.core.jupyter.started),
            "last_activity": iso8601(last),
            "connections": sum(k["connections"] for k in kernels),
            "kernels": len(kernels),
        })


class KernelSpecsHandler(JupyterHandler):
    def get(self, agent: str) -> None:
        self.send_json(self.core.jupyter.kernelspecs.all(self.base_url))


class KernelSpecHandler(JupyterHandler):
    def get(self, agent: str, name: str) -> None:
        self.send_json(self.core.jupyter.kernelspecs.model(name, self.base_url))


class KernelSpecResourceHandler(JupyterHandler):
    def get(self, agent: str, name: str, resource: str) -> None:
        data, content_type = self.core.jupyter.kernelspecs.resource(name, resource)
        self.set_header("Content-Type", content_type)
        self.set_header("Cache-Control", "max-age=3600")
        self.finish(data)


class KernelsHandler(JupyterHandler):
    tool = "jupyter_kernel"

    def get(self, agent: str) -> None:
        self.send_json(self.kernels.list())

    async def post(self, agent: str) -> None:
        body = self.body(optional=True) or {}
        unknown = sorted(set(body) - {"name", "path", "env", "kernel_id"})
        if unknown:
            raise bad_request(f"unknown field {unknown[0]!r}", "allowed: name, path", code="unknown_field")
        if body.get("kernel_id") is not None:
            raise bad_request("a kernel id is chosen by the gateway", "leave kernel_id out", code="unsupported")
        env = body.get("env")
        if env is not None and not (isinstance(env, dict) and all(isinstance(v, str) for v in env.values())):
            raise bad_request("field 'env' must be an object of strings", code="wrong_type")
        # GatewayClient sends its KERNEL_* variables; they are ignored: a client never
        # chooses what a sandboxed kernel's environment holds (LD_PRELOAD, PYTHONPATH, ...).
        model = await self.kernels.start(body.get("name"), body.get("path"))
        self.set_header("Location", self.url("api/kernels", model["id"]))
        self.send_json(model, 201)


class KernelHandler(JupyterHandler):
    tool = "jupyter_kernel"

    def get(self, agent: str, kernel_id: str) -> None:
        self.send_json(self.kernels.get(kernel_id))

    async def delete(self, agent: str, kernel_id: str) -> None:
        await self.kernels.shutdown(kernel_id)
        self.core.jupyter.bridges.check(kernel_id)
        self.no_content()


class KernelActionHandler(JupyterHandler):
    tool = "jupyter_kernel"

    async def post(self, agent: str, kernel_id: str, action: str) -> None:
        if action == "interrupt":
            await self.kernels.interrupt(kernel_id)
            self.no_content()
            return
        model = await self.kernels.restart(kernel_id)
        self.core.jupyter.bridges.check(kernel_id)
        self.send_json(model)


class SessionsHandler(JupyterHandler):
    tool = "jupyter_session"

    def get(self, agent: str) -> None:
        self.send_json(self.kernels.list_sessions())

    async def post(self, agent: str) -> None:
        model = await self.kernels.create_session(self.body())
        self.set_header("Location", self.url("api/sessions", model["id"]))
        self.send_json(model, 201)


class SessionHandler(JupyterHandler):
    tool = "jupyter_session"

    def get(self, agent: str, session_id: str) -> None:
        self.send_json(self.kernels.get_session(session_id))

    async def patch(self, agent: str, session_id: str) -> None:
        self.send_json(await self.kernels.update_session(session_id, self.body()))

    async def delete(self, agent: str, session_id: str) -> None:
        await self.kernels.delete_session(session_id)
        self.no_content()


class ContentsWork(JupyterHandler):
    """Jupyter contents: every call is disk work sized by the agent, so it runs on a worker
    thread within the agent's share (``core.workers``), and so does encoding the reply."""

    tool = "jupyter_contents"

    def contents(self):
        return self.core.jupyter.contents(self.agent)

    async def work(self, fn, *args, **kwargs):
        return await self.off_loop(fn, *args, **kwargs)

    async def reply(self, model: Any, status: int = 200, location: bool = True) -> None:
        if location:
            self.set_header("Location", self.url("api/contents", model["path"]))
        text = await self.work(json_text, model)  # a 35 MB notebook is not encoded on the loop
        self.set_status(status)
        text = self.scrub(text)
        self._bytes_out += len(text)
        self.finish(text)


class ContentsHandler(ContentsWork):
    async def get(self, agent: str, path: str | None) -> None:
        content = self.get_query_argument("content", "1")
        if content not in ("0", "1"):
            raise bad_request(f"Content {content!r} is invalid", "0 or 1", code="invalid_content")
        model = await self.work(
            self.contents().get, api_path(path), content=content == "1",
            type_=self.get_query_argument("type", None) or None,
            format_=self.get_query_argument("format", None) or None,
        )
        await self.reply(model)

    async def put(self, agent: str, path: str | None) -> None:
        contents = self.contents()
        model = self.body(optional=True)
        path = api_path(path)
        if model is None:
            await self.reply(await self.work(contents.new_untitled, path), 201)
            return

        def save() -> tuple[bool, dict]:
            existed = contents.exists(path)
            return existed, contents.save(path, model)

        existed, result = await self.work(save)
        await self.reply(result, 200 if existed else 201)

    async def post(self, agent: str, path: str | None) -> None:
        contents = self.contents()
        model = self.body(optional=True) or {}
        unknown = sorted(set(model) - {"copy_from", "ext", "type"})
        if unknown:
            raise bad_request(f"unknown field {unknown[0]!r}", "allowed: copy_from, ext, type", code="unknown_field")
        if model.get("copy_from") is not None:
            created = await self.work(contents.copy, model["copy_from"], api_path(path))
        else:
            created = await self.work(contents.new_untitled, api_path(path), model.get("type", ""), model.get("ext", ""))
        await self.reply(created, 201)

    async def patch(self, agent: str, path: str | None) -> None:
        model = self.body()
        new = model.get("path")
        if not isinstance(new, str):
            raise bad_request("the body needs the new 'path'", code="missing_field")
        await self.reply(await self.work(self.contents().rename, api_path(path), new))

    async def delete(self, agent: str, path: str | None) -> None:
        await self.work(self.contents().delete, api_path(path))
        self.no_content()


class CheckpointsHandler(ContentsWork):
    async def get(self, agent: str, path: str | None) -> None:
        await self.reply(await self.work(self.contents().list_checkpoints, api_path(path)), location=False)

    async def post(self, agent: str, path: str | None) -> None:
        model = await self.work(self.contents().create_checkpoint, api_path(path))
        self.set_header("Location", self.url("api/contents", api_path(path), "checkpoints", model["id"]))
        await self.reply(model, 201, location=False)


class CheckpointHandler(ContentsWork):
    async def post(self, agent: str, path: str | None, checkpoint_id: str) -> None:
        await self.work(self.contents().restore_checkpoint, api_path(path), checkpoint_id)
        self.no_content()

    async def delete(self, agent: str, path: str | None, checkpoint_id: str) -> None:
        await self.work(self.contents().delete_checkpoint, api_path(path), checkpoint_id)
        self.no_content()


class JupyterNotFoundHandler(BaseHandler):
    """Unknown paths on the TCP port: a JSON 404 in Jupyter's shape."""

    jupyter_errors = True

    def prepare(self) -> None:
        raise GatewayError(404, "no_route", f"no route {self.request.method} {self.request.path}",
                           "the API of an agent is under /agents/{agent}/api/")


# --- tokens, on the control socket ------------------------------------------------


class TokensHandler(BaseHandler):
    tool = "token"

    def post(self, agent: str) -> None:
        self.require_control_socket()
        agent = self.agent_arg(agent)
        self.json_body({})
        self.core.jupyter.require_agent(agent)
        minted = self.core.jupyter.tokens.mint(agent)
        self.send_json({**minted, "url": self.core.jupyter.agent_url(agent)}, 201)

    def get(self, agent: str) -> None:
        self.require_control_socket()
        agent = self.agent_arg(agent)
        self.core.jupyter.require_agent(agent)
        self.send_json({"tokens": self.core.jupyter.tokens.list(agent), "url": self.core.jupyter.agent_url(agent)})


class TokenHandler(BaseHandler):
    tool = "token"

    def delete(self, agent: str, token_id: str) -> None:
        self.require_control_socket()
        agent = self.agent_arg(agent)
        self.core.jupyter.require_agent(agent)
        self.core.jupyter.tokens.revoke(agent, token_id)
        self.send_json({"id": token_id, "revoked": True})


def routes() -> list[tuple[str, type]]:
    """The Jupyter routes of one agent, under ``/agents/{agent}/``."""
    from .jupyter_channels import ChannelsHandler

    a = r"/agents/([^/]+)"
    path = r"((?:/[^/]+)+|/?)"  # jupyter_server's path pattern: '' or '/a/b'
    kid = r"([^/]+)"
    return [
        (a + r"/api/?", ApiHandler),
        (a + r"/api/status/?", StatusHandler),
        (a + r"/api/kernelspecs/?", KernelSpecsHandler),
        (a + r"/api/kernelspecs/([^/]+)/?", KernelSpecHandler),
        (a + r"/kernelspecs/([^/]+)/([^/]+)", KernelSpecResourceHandler),
        (a + r"/api/kernels/?", KernelsHandler),
        (a + rf"/api/kernels/{kid}/?", KernelHandler),
        (a + rf"/api/kernels/{kid}/(interrupt|restart)/?", KernelActionHandler),
        (a + rf"/api/kernels/{kid}/channels", ChannelsHandler),
        (a + r"/api/sessions/?", SessionsHandler),
        (a + r"/api/sessions/([^/]+)/?", SessionHandler),
        (a + rf"/api/contents{path}/checkpoints/?", CheckpointsHandler),
        (a + rf"/api/contents{path}/checkpoints/([^/]+)/?", CheckpointHandler),
        (a + rf"/api/contents{path}", ContentsHandler),
    ]


def token_routes() -> list[tuple[str, type]]:
    agent = r"/v1/agents/([^/]+)"
    return [(agent + r"/tokens/?", TokensHandler), (agent + r"/tokens/([^/]+)/?", TokenHandler)]
