"""Kernels and sessions of the Jupyter Server API, over the gateway's own sessions.

There is one set of kernels.  Every kernel ``GET /api/kernels`` lists is the
kernel of a live gateway session of the agent, and every live gateway session
is listed, whoever started it (jlk, ``/v1``, a notebook run, this API).  A
kernel started over this API is a gateway session named ``jupyter-<hex>``; a
Jupyter session for a notebook path uses that notebook's own gateway session,
the one ``POST .../notebooks/P/cells/{id}/execute`` runs in, so a human in
JupyterLab and the agent share one live kernel.

Jupyter sessions (``/api/sessions``) are kept in memory, as jupyter_server
keeps them; one whose kernel has gone is dropped when next listed.
"""

from __future__ import annotations

import datetime
import os
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import GatewayError, bad_request, not_found
from ..kernels import KERNEL_NAME
from ..sessions import LIVE_STATES
from .. import fs

KERNEL_ID_NAMESPACE = uuid.UUID("6f1b2c52-7a0e-4a57-9d0c-1d3f6e2b9a10")
SESSION_TYPES = ("notebook", "console", "file")
MAX_SESSION_PATH = 4096  # characters
MAX_SESSION_NAME = 1024


def kernel_id(session: Any) -> str:
    """The kernel id of a gateway session's kernel."""
    known = (getattr(session.kernel, "id", None) or getattr(session, "restarting_kernel_id", None)
             or getattr(session, "kernel_id", None))
    if known:
        return known
    return str(uuid.uuid5(KERNEL_ID_NAMESPACE, f"{session.agent}\0{session.id}"))


def _restarting(session: Any) -> bool:
    return session.kernel is None and bool(getattr(session, "restarting_kernel_id", None))


def activity(session: Any) -> float:
    """When the session's kernel last did or got anything (observed where the core observes it)."""
    return getattr(session, "activity", None) or session.last_activity


def iso8601(when: float) -> str:
    return datetime.datetime.fromtimestamp(when, datetime.timezone.utc).isoformat().replace("+00:00", "Z")


@dataclass
class JupyterSession:
    id: str
    path: str
    name: str
    type: str
    gateway_session: str


@dataclass
class AgentKernels:
    """The Jupyter view of one agent's kernels and sessions."""

    agent: str
    sessions: Any  # the gateway's sessions: .sessions, get_or_create, get, stop, interrupt, restart
    notebook_session_id: Callable[[str], str]
    connections: Callable[[str], int]
    require_agent: Callable[[str], None]
    agent_root: Callable[[str], str]
    jupyter_sessions: dict[str, JupyterSession] = field(default_factory=dict)
    # Shares of the Jupyter sessions kept in memory: this agent's, and every agent's (counted by the caller).
    max_sessions: int = 64
    max_sessions_total: int = 1024
    sessions_total: Callable[[], int] = lambda: 0

    # --- kernels ----------------------------------------------------------------

    def _live(self) -> list:
        # A kernel being restarted stays listed (as Jupyter Server lists it): clients in gateway
        # mode drop a kernel the gateway stops listing, and with it the restart they asked for.
        return [
            s for (a, _), s in list(self.sessions.sessions.items())
            if a == self.agent and ((s.state in LIVE_STATES and s.kernel is not None) or _restarting(s))
        ]

    def session_of(self, kid: str) -> Any:
        """The live gateway session whose kernel has id ``kid``."""
        for session in self._live():
            if kernel_id(session) == kid:
                return session
        raise not_found(f"no kernel {kid!r} for agent {self.agent!r}", "list them: GET .../api/kernels",
                        code="unknown_kernel")

    def model(self, session: Any) -> dict:
        kid = kernel_id(session)
        state = session.state if session.kernel is not None else "restarting" if _restarting(session) else "dead"
        return {
            "id": kid,
            "name": session.kernel_name,
            "last_activity": iso8601(activity(session)),
            "execution_state": state,
            "connections": self.connections(kid),
            # Which gateway session this is, for /v1 and jlk users.
            "gateway_session": session.id,
        }

    def list(self) -> list[dict]:
        self.require_agent(self.agent)
        return [self.model(s) for s in self._live()]

    def last_activity(self) -> float | None:
        return max((activity(s) for s in self._live()), default=None)

    def get(self, kid: str) -> dict:
        return self.model(self.session_of(kid))

    @staticmethod
    def check_kernel_name(name: Any) -> str:
        if name is None:
            return KERNEL_NAME
        if name != KERNEL_NAME:
            raise bad_request(f"no such kernel {name!r}", f"available: {KERNEL_NAME}", code="unknown_kernel")
        return name

    def _folder(self, path: str | None) -> str | None:
        """The kernel's working directory for ``path`` (a file or folder in the tree), as Jupyter does."""
        if not path:
            return None
        root = self.agent_root(self.agent)
        try:
            where = fs.resolve_in_root(root, path.lstrip("/"))
        except fs.PathOutsideRoot:
            raise bad_request(f"path {path!r} is outside the agent's tree", code="path_outside_root") from None
        folder = where if where.is_dir() else where.parent
        if not folder.is_dir():  # (Jupyter Server walks up to a folder that exists; a clear 404 says more)
            raise not_found(f"the folder of path {path!r} does not exist in the agent's tree",
                            "create it first (PUT .../api/contents/<folder> with {\"type\": \"directory\"}), "
                            "or leave 'path' out", code="no_such_directory")
        return str(folder)

    async def start(self, name: Any = None, path: Any = None) -> dict:
        """A new kernel (a fresh gateway session), answered once it is ready."""
        self.check_kernel_name(name)
        if path is not None and not isinstance(path, str):
            raise bad_request("field 'path' must be a string", code="wrong_type")
        cwd = self._folder(path)
        session, _ = await self.sessions.get_or_create(self.agent, f"jupyter-{uuid.uuid4().hex[:12]}", cwd=cwd)
        return self.model(session)

    async def shutdown(self, kid: str) -> None:
        session = self.session_of(kid)
        await self.sessions.stop(self.agent, session.id)

    async def interrupt(self, kid: str) -> None:
        session = self.session_of(kid)
        await self.sessions.interrupt(self.agent, session.id)

    async def restart(self, kid: str) -> dict:
        session = self.session_of(kid)
        await self.sessions.restart(self.agent, session.id)
        return self.model(self.sessions.get(self.agent, session.id))

    # --- Jupyter sessions -------------------------------------------------------

    def _session_model(self, js: JupyterSession) -> dict:
        session = self.sessions.sessions.get((self.agent, js.gateway_session))
        if session is None or session.state not in LIVE_STATES or session.kernel is None:
            raise KeyError(js.id)
        return {
            "id": js.id,
            "path": js.path,
            "name": js.name,
            "type": js.type,
            "kernel": self.model(session),
            "notebook": {"path": js.path, "name": js.name},
        }

    def list_sessions(self) -> list[dict]:
        self.require_agent(self.agent)
        models = []
        for sid, js in list(self.jupyter_sessions.items()):
            try:
                models.append(self._session_model(js))
            except KeyError:
                self.jupyter_sessions.pop(sid, None)  # its kernel is gone, as jupyter_server prunes
        return models

    def get_session(self, sid: str) -> dict:
        js = self.jupyter_sessions.get(sid)
        if js is not None:
            try:
                return self._session_model(js)
            except KeyError:
                self.jupyter_sessions.pop(sid, None)
        raise not_found(f"no session {sid!r} for agent {self.agent!r}", code="unknown_session")

    async def _gateway_session_for(self, path: str, type_: str, kernel: dict) -> str:
        """The gateway session a new or patched Jupyter session runs in."""
        kid = kernel.get("id")
        if kid is not None:
            if not isinstance(kid, str):
                raise bad_request("kernel.id must be a string", code="wrong_type")
            try:
                return self.session_of(kid).id
            except GatewayError:
                raise bad_request(f"no such kernel: {kid}", code="unknown_kernel") from None
        self.check_kernel_name(kernel.get("name"))
        if type_ == "notebook":
            # The notebook's own session: the kernel the agent's notebook runs use.
            sid = self.notebook_session_id(path)
        else:
            sid = f"jupyter-{uuid.uuid4().hex[:12]}"
        session, _ = await self.sessions.get_or_create(self.agent, sid, cwd=self._folder(path))
        return session.id

    async def create_session(self, body: dict) -> dict:
        path, type_, name, kernel = _session_fields(body, required=True)
        self.require_agent(self.agent)
        for js in self.jupyter_sessions.values():
            if js.path == path:
                try:
                    return self._session_model(js)  # exists: returned as it is, as jupyter_server does
                except KeyError:
                    break
        self._check_room(path)
        gateway_session = await self._gateway_session_for(path, type_, kernel or {})
        self._check_room(path)  # again: others may have been made while the kernel started
        js = JupyterSession(str(uuid.uuid4()), path, name or os.path.basename(path), type_, gateway_session)
        self.jupyter_sessions = {k: v for k, v in self.jupyter_sessions.items() if v.path != path}
        self.jupyter_sessions[js.id] = js
        return self._session_model(js)

    def _check_room(self, path: str) -> None:
        """429 past this agent's share of Jupyter sessions or the total (a session for ``path`` is replaced)."""
        self.list_sessions()  # drops those whose kernel has gone
        if any(js.path == path for js in self.jupyter_sessions.values()):
            return
        if len(self.jupyter_sessions) >= self.max_sessions:
            raise GatewayError(
                429, "too_many_sessions", f"agent {self.agent!r} already has {self.max_sessions} Jupyter sessions",
                "delete some: DELETE .../api/sessions/{id}; raise --Gateway.max_jupyter_sessions_per_agent",
            )
        if self.sessions_total() >= self.max_sessions_total:
            raise GatewayError(
                429, "too_many_sessions", f"the gateway already holds {self.max_sessions_total} Jupyter sessions",
                "try again later; raise --Gateway.max_jupyter_sessions_total",
            )

    async def update_session(self, sid: str, body: dict) -> dict:
        self.get_session(sid)
        path, type_, name, kernel = _session_fields(body, required=False)
        js = self.jupyter_sessions[sid]
        before = js.gateway_session
        if kernel is not None:
            if kernel.get("id") is None and kernel.get("name") is None:
                raise bad_request("kernel needs an id or a name", code="missing_field")
            js_path, js_type = path or js.path, type_ or js.type
            if kernel.get("id") is None:
                # A new kernel by name: a fresh session, never the notebook's own one again.
                self.check_kernel_name(kernel.get("name"))
                fresh, _ = await self.sessions.get_or_create(
                    self.agent, f"jupyter-{uuid.uuid4().hex[:12]}", cwd=self._folder(js_path))
                js.gateway_session = fresh.id
            else:
                js.gateway_session = await self._gateway_session_for(js_path, js_type, kernel)
        js.path = path if path is not None else js.path
        js.type = type_ if type_ is not None else js.type
        js.name = name if name is not None else js.name
        if js.gateway_session != before and not any(
            j.gateway_session == before for j in self.jupyter_sessions.values()
        ):
            try:
                await self.sessions.stop(self.agent, before)  # as jupyter_server shuts the old kernel down
            except GatewayError:
                pass
        return self._session_model(js)

    async def delete_session(self, sid: str) -> None:
        self.get_session(sid)
        js = self.jupyter_sessions.pop(sid)
        if not any(j.gateway_session == js.gateway_session for j in self.jupyter_sessions.values()):
            try:
                await self.sessions.stop(self.agent, js.gateway_session)
            except GatewayError:
                pass


def _session_fields(body: dict, required: bool) -> tuple:
    """(path, type, name, kernel) of a session body, checked as jupyter_server reads them."""
    if "notebook" in body and isinstance(body["notebook"], dict):  # the old API
        body = {**body, "type": "notebook", "path": body["notebook"].get("path", body["notebook"].get("name"))}
    allowed = {"path", "type", "name", "kernel", "notebook", "id"}
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad_request(f"unknown field {unknown[0]!r}", f"allowed: {', '.join(sorted(allowed))}",
                          code="unknown_field")
    if required:
        for key in ("path", "type"):
            if key not in body:
                raise bad_request(f"Missing field in JSON data: {key}", code="missing_field")
    path, type_, name, kernel = body.get("path"), body.get("type"), body.get("name"), body.get("kernel")
    for key, value in (("path", path), ("type", type_), ("name", name)):
        if value is not None and not isinstance(value, str):
            raise bad_request(f"field {key!r} must be a string", code="wrong_type")
    if path is not None and (not path or len(path) > MAX_SESSION_PATH or "\0" in path):
        raise bad_request(f"field 'path' must be 1-{MAX_SESSION_PATH} characters without NUL", code="invalid_path")
    if name is not None and (len(name) > MAX_SESSION_NAME or "\0" in name):
        raise bad_request(f"field 'name' must be at most {MAX_SESSION_NAME} characters without NUL",
                          code="invalid_name")
    if type_ is not None and type_ not in SESSION_TYPES:
        raise bad_request(f"field 'type' must be one of {', '.join(SESSION_TYPES)}", code="invalid_type")
    if kernel is not None and not isinstance(kernel, dict):
        raise bad_request("field 'kernel' must be an object", code="wrong_type")
    if kernel is not None:
        extra = sorted(set(kernel) - {"id", "name"})
        if extra:
            raise bad_request(f"unknown field kernel.{extra[0]}", "allowed: id, name", code="unknown_field")
        if kernel.get("name") is not None and not isinstance(kernel["name"], str):
            raise bad_request("kernel.name must be a string", code="wrong_type")
    return path, type_, name, kernel
