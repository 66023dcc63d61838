"""Sessions: the names an agent gives its kernels, with no HTTP in it.

A session is ``(agent, id)``, a directory and, while it runs, a kernel from
the :class:`~kernel_gateway.kernel_pool.KernelPool`.  Executions in one
session run one at a time in arrival order (an ``asyncio.Lock`` is FIFO);
different sessions run in parallel.  Caps are checked and the slot taken in
one synchronous step, so concurrent creates cannot exceed them.  A session's
state is its kernel's observed state; without a kernel it is ``starting``,
``dead`` (its kernel died or a restart failed) or ``lost`` (the gateway
restarted).  The registry on disk lists every session; after a gateway
restart the earlier ones show as ``lost`` until they are used again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from . import workspace
from .agents import AgentRegistry
from .errors import GatewayError, bad_request, disk_full, not_found
from .execution import KernelDied, OutputCallback, bare_result, run_cell
from .kernel_pool import KernelPool
from .kernels import KERNEL_NAME, Kernel
from .library import Library
from .settings import Gateway
from . import state_files

log = logging.getLogger("kernel_gateway.sessions")

LIVE_STATES = ("starting", "idle", "busy")


@dataclass
class Session:
    agent: str
    id: str
    directory: str  # sessions/<base64url id>/: HOME, spilled outputs and artifacts
    cwd: str = ""  # the kernel's working directory; the session directory unless set
    kernel_name: str = KERNEL_NAME
    status: str = "starting"  # the state while there is no kernel: starting | dead | lost | stopped
    created: float = field(default_factory=time.time)
    last_activity: float = field(default_factory=time.time)
    execution_count: int = 0
    kernel: Kernel | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    notice: str | None = None
    previous_kernel_id: str | None = None  # the kernel that died; the next one has a new id
    restarting_kernel_id: str | None = None  # set while a restart replaces the kernel under this id

    @property
    def state(self) -> str:
        """Observed: the kernel's execution state, or why there is no kernel."""
        if self.status == "stopped" or self.kernel is None:
            return self.status
        return self.kernel.execution_state

    @property
    def activity(self) -> float:
        return max(self.last_activity, self.kernel.last_activity if self.kernel else 0.0)

    @property
    def cells_run(self) -> int:
        """Observed: the kernel's execution count, whichever client ran its cells; else the last known."""
        if self.kernel is not None and self.kernel.execution_count:
            return self.kernel.execution_count
        return self.execution_count

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "agent": self.agent,
            "state": self.state,
            "execution_state": self.state,
            "kernel": self.kernel_name,
            "kernel_id": self.kernel.id if self.kernel else None,
            "previous_kernel_id": self.previous_kernel_id,
            "connections": self.kernel.connections if self.kernel else 0,
            "cwd": self.cwd or self.directory,
            "directory": self.directory,
            "execution_count": self.cells_run,
            "created": self.created,
            "last_activity": self.activity,
            "pid": self.kernel.pid if self.kernel else None,
        }

    def saved(self) -> dict:
        """What the registry keeps: nothing of the kernel, which does not survive the gateway."""
        return {
            "id": self.id,
            "agent": self.agent,
            "kernel": self.kernel_name,
            "cwd": self.cwd or self.directory,
            "directory": self.directory,
            "execution_count": self.cells_run,
            "created": self.created,
            "last_activity": self.activity,
        }


class Sessions:
    """Every session of every agent, their kernels' lifecycle and their executions."""

    def __init__(self, settings: Gateway, agents: AgentRegistry, pool: KernelPool, library: Library):
        self.settings = settings
        self.agents = agents
        self.pool = pool
        self.library = library  # its gate: no kernel while the jupyter-live-kernel skill is disabled
        self.sessions: dict[tuple[str, str], Session] = {}
        self._registry_path = os.path.join(settings.state_dir, "registry.json")
        agents.on_change = self.save_registry
        pool.is_agent = lambda agent: agent in agents

    # --- registry ---------------------------------------------------------------

    def load_registry(self) -> None:
        """Read the registry left by an earlier run: its sessions are ``lost``."""
        try:
            with open(self._registry_path) as f:
                saved = json.load(f)
        except (OSError, ValueError):
            saved = {}
        self.agents.load(saved.get("agents", []))
        for item in saved.get("sessions", []):
            if item.get("agent") in self.agents:
                session = Session(
                    agent=item["agent"],
                    id=item["id"],
                    directory=workspace.session_dir(self.settings.root, item["agent"], item["id"]),
                    cwd=item["cwd"],
                    status="lost",
                    created=item.get("created", time.time()),
                    last_activity=item.get("last_activity", time.time()),
                    execution_count=item.get("execution_count", 0),
                )
                session.notice = (
                    "The gateway restarted since this session last ran: its kernel and every "
                    "variable in it were lost; this is a fresh kernel. Files in the workspace are kept."
                )
                self.sessions[(session.agent, session.id)] = session

    def save_registry(self) -> None:
        data = {
            "agents": sorted(self.agents.agents),
            "sessions": [s.saved() for s in self.sessions.values() if s.status != "stopped"],
        }
        state_files.write_json(self._registry_path, data)

    # --- agents (their sessions) ------------------------------------------------

    def agent_json(self, agent: str) -> dict:
        return {
            "agent": agent,
            "root": self.agents.agent_root(agent),
            "socket": self.agents.agent_socket(agent),
            "spare_kernel_ready": agent in self.pool.spares,
            "sessions": self.list(agent),
        }

    async def stop_agent(self, agent: str) -> None:
        self.agents.require_agent(agent)
        for (a, sid) in list(self.sessions):
            if a == agent:
                await self.stop(agent, sid)
        await self.pool.drop_spare(agent)

    # --- sessions ---------------------------------------------------------------

    def get(self, agent: str, session_id: str) -> Session:
        self.agents.require_agent(agent)
        workspace.check_session_id(session_id)
        session = self.sessions.get((agent, session_id))
        if session is None or session.status == "stopped":
            raise not_found(
                f"no session {session_id!r} for agent {agent!r}",
                f"create it: POST /v1/agents/{agent}/sessions",
                code="unknown_session",
            )
        return session

    def by_kernel(self, kernel_id: str) -> Session | None:
        for session in self.sessions.values():
            if session.kernel is not None and session.kernel.id == kernel_id:
                return session
        return None

    def list(self, agent: str) -> list[dict]:
        self.agents.require_agent(agent)
        return [s.to_json() for (a, _), s in self.sessions.items() if a == agent and s.status != "stopped"]

    def _check_caps(self, agent: str) -> None:
        live = [s for s in self.sessions.values() if s.state in LIVE_STATES]
        if sum(1 for s in live if s.agent == agent) >= self.settings.max_sessions_per_agent:
            raise GatewayError(
                429,
                "too_many_sessions",
                f"agent {agent!r} already has {self.settings.max_sessions_per_agent} live sessions",
                "stop one (DELETE .../sessions/{id}) or wait for idle ones to be culled",
            )
        if len(live) >= self.settings.max_sessions_total:
            raise GatewayError(
                429,
                "gateway_full",
                f"the gateway already runs {self.settings.max_sessions_total} sessions",
                "try again later",
            )

    async def get_or_create(
        self, agent: str, session_id: str, kernel: str | None = None, cwd: str | None = None
    ) -> tuple[Session, bool]:
        """The session, started if needed.  ``cwd`` (inside the agent's tree) applies to a new one."""
        self.agents.require_agent(agent)
        self.library.require_kernel(agent)
        workspace.check_session_id(session_id)
        if kernel is not None and kernel != KERNEL_NAME:
            raise bad_request(f"unknown kernel {kernel!r}", f"available: {KERNEL_NAME}", code="unknown_kernel")
        key = (agent, session_id)
        while True:
            session = self.sessions.get(key)
            created = session is None
            if created:
                # Check the caps and take the slot with no await in between.
                self._check_caps(agent)
                directory = workspace.session_dir(self.settings.root, agent, session_id)
                session = Session(agent=agent, id=session_id, directory=directory, cwd=cwd or directory)
                self.sessions[key] = session
            if session.kernel is not None:  # a live session is returned at once, even while busy
                return session, created
            async with session.lock:
                if self.sessions.get(key) is not session:
                    continue  # stopped, or its creation failed, while we waited: start over
                if session.kernel is None:
                    try:
                        await self._start_kernel(session, check_caps=not created)
                    except BaseException:
                        if created and self.sessions.get(key) is session:
                            self.sessions.pop(key, None)
                        raise
            return session, created

    async def _start_kernel(self, session: Session, check_caps: bool = True, kernel_id: str = "") -> None:
        """Give a session without a kernel a kernel.  The caller holds its lock.

        On failure the session keeps no kernel and says why (``dead``, ``lost``),
        never ``idle``.
        """
        if check_caps:
            self._check_caps(session.agent)
        previous, session.status = session.status, "starting"
        try:
            await asyncio.to_thread(workspace.make_session_dir, self.settings.root, session.agent, session.id)
            await asyncio.to_thread(workspace.require_enterable, self.settings.root, session.agent, session.cwd)
            kernel = await self.pool.start(
                session.agent, cwd=session.cwd, session_dir=session.directory, session=session.id,
                kernel_id=kernel_id,
            )
        except BaseException as e:
            if session.status == "starting":
                session.status = previous if previous in ("lost", "dead") else "dead"
            if isinstance(e, (GatewayError, asyncio.CancelledError)):
                raise
            full = disk_full(e)
            if full is not None:  # a full quota is the agent's, not a bug: no traceback
                log.warning("agent %s session %s: the kernel could not start: %s", session.agent, session.id, e)
                raise full from e
            log.exception("agent %s session %s: the kernel could not start", session.agent, session.id)
            raise GatewayError(
                500, "kernel_start_failed", f"the kernel could not start: {e}", "run `kernel-gateway doctor`"
            ) from e
        if not self.library.kernel_enabled(session.agent):
            # Narrowed while this kernel started: it does not outlive the switch.
            if session.status != "stopped":
                session.status = previous if previous in ("lost", "dead") else "dead"
            await self.pool.stop(kernel, now=True, why="abandoned")
            self.library.require_kernel(session.agent)
        if session.status == "stopped":
            # Deleted while it started: the kernel belongs to no one, so it goes now.
            await self.pool.stop(kernel, now=True, why="abandoned")
            raise GatewayError(
                409, "session_stopped", f"session {session.id!r} was stopped while its kernel started",
                "create it again if you still need it",
            )
        session.kernel = kernel
        session.status = "running"
        session.last_activity = time.time()
        self.save_registry()
        self.pool.replenish_spare(session.agent)

    async def execute(
        self,
        agent: str,
        session_id: str,
        code: str,
        *,
        timeout: float | None,
        inline_images: bool = False,
        on_output: OutputCallback | None = None,
    ) -> dict:
        known = self.sessions.get((agent, session_id))
        # A lost or dead session gets a fresh kernel below or in get_or_create: say so.
        notice = known.notice if known is not None and known.kernel is None else None
        deadline = None if timeout is None else time.monotonic() + timeout
        session, _ = await self.get_or_create(agent, session_id)
        # The timeout counts from arrival: time spent queued behind another
        # execution of this session is part of it.
        try:
            if session.lock.locked():
                await asyncio.wait_for(session.lock.acquire(), None if deadline is None else deadline - time.monotonic())
            else:
                await session.lock.acquire()  # a free session is taken at once, however short the timeout
        except asyncio.TimeoutError:
            return bare_result(
                "timeout",
                f"The session {session_id!r} was busy with another execution for the whole timeout "
                f"({timeout:g} s); this code did not run.\n",
            )
        try:
            if session.kernel is not None and session.kernel.execution_state == "dead":
                # Died between executions (the watcher saw it): buried now, restarted below.
                await self._bury(session, KernelDied(*session.kernel.exit_status()))
            if session.kernel is None:
                # Died or lost since: a fresh kernel, and the result says so.
                notice = session.notice
                await self._start_kernel(session)
            session.last_activity = time.time()
            kernel = session.kernel
            assert kernel is not None
            kernel.touch()
            sent: list[str] = []
            try:
                result = await run_cell(
                    kernel.kc,
                    code,
                    is_alive=kernel.is_alive,
                    interrupt=kernel.interrupt,
                    exit_status=kernel.exit_status,
                    timeout=None if deadline is None else max(0.0, deadline - time.monotonic()),
                    limit=self.settings.output_limit,
                    inline_images=inline_images,
                    on_output=on_output,
                    on_request=sent.append,
                    cell_limit=self.settings.cell_output_limit,
                    agent_root=self.agents.agent_root(agent),
                    session_dir=session.directory,
                )
            except KernelDied as died:
                await self._bury(session, died)
                return bare_result(
                    "died", died.sentence() + "\n", exit_code=died.exit_code, signal=died.signal, notice=died.sentence()
                )
            finally:
                session.last_activity = time.time()
            await kernel.settle(sent[0] if sent else None)
            if result.get("execution_count"):
                session.execution_count = result["execution_count"]
            if notice:
                result["notice"] = notice
                session.notice = None
            return result
        finally:
            session.lock.release()

    async def _bury(self, session: Session, died: KernelDied) -> None:
        kernel, session.kernel = session.kernel, None
        session.status = "dead"
        session.previous_kernel_id = kernel.id if kernel is not None else None
        session.notice = died.fresh_kernel_notice()
        if kernel is not None:
            kernel.mark_dead()
            await self.pool.stop(kernel, now=True, why="dead")

    async def _acquire_unless_busy(self, session: Session, doing: str) -> None:
        """Take the session's lock, or 409 once it stayed busy for ``busy_timeout`` seconds."""
        try:
            await asyncio.wait_for(session.lock.acquire(), self.settings.busy_timeout)
        except asyncio.TimeoutError:
            raise GatewayError(
                409, "session_busy",
                f"session {session.id!r} stayed busy for {self.settings.busy_timeout:g} s; could not {doing}",
                "wait for the running cell, or interrupt it: POST .../interrupt",
            ) from None

    async def inspect(self, agent: str, session_id: str, probe: Callable[[Any], Any]) -> dict:
        """Run ``probe(client)`` on the kernel's own inspector connection, between executions."""
        self.library.require_kernel(agent)
        session = self.get(agent, session_id)
        await self._acquire_unless_busy(session, "inspect its variables")
        try:
            if session.kernel is None or session.kernel.execution_state == "dead":
                raise GatewayError(
                    409, "no_kernel", f"session {session_id!r} has no running kernel ({session.state})",
                    "execute something in it first",
                )
            session.kernel.touch()
            return await probe(session.kernel.probe_client())
        finally:
            session.lock.release()

    async def interrupt(self, agent: str, session_id: str) -> dict:
        self.library.require_kernel(agent)
        session = self.get(agent, session_id)
        if session.kernel is None or session.state not in LIVE_STATES:
            raise GatewayError(409, "no_kernel", f"session {session_id!r} has no running kernel ({session.state})")
        await session.kernel.interrupt()
        return session.to_json()

    async def restart(self, agent: str, session_id: str) -> dict:
        """A fresh kernel process under the same kernel id, as Jupyter Server restarts."""
        self.library.require_kernel(agent)
        session = self.get(agent, session_id)
        await self._acquire_unless_busy(session, "restart it")
        try:
            old, session.kernel = session.kernel, None
            kernel_id = ""
            if old is not None:
                kernel_id = old.id
                session.restarting_kernel_id = kernel_id  # a Jupyter client still lists it, as "restarting"
                session.status = "dead"  # until the new kernel is up: never idle without a kernel
                await self.pool.stop(old, now=True, why="restart")
            await self._start_kernel(session, check_caps=False, kernel_id=kernel_id)
            session.execution_count = 0
            session.notice = None
        finally:
            session.restarting_kernel_id = None
            session.lock.release()
        return session.to_json()

    async def stop(self, agent: str, session_id: str, why: str = "deleted") -> None:
        session = self.get(agent, session_id)
        kernel, session.kernel = session.kernel, None
        session.status = "stopped"
        self.sessions.pop((agent, session_id), None)
        self.save_registry()
        if kernel is not None:
            await self.pool.stop(kernel, why=why)

    async def shutdown_all(self) -> None:
        for session in self.sessions.values():
            session.kernel = None
        self.save_registry()
        await self.pool.shutdown_all()
