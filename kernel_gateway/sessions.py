"""Agents and their sessions: the gateway's core, with no HTTP in it.

One :class:`SessionManager` owns every live kernel.  Executions in one
session run one at a time in arrival order (an ``asyncio.Lock`` is FIFO);
different sessions run in parallel.  Caps are checked and the slot taken in
one synchronous step, so concurrent creates cannot exceed them.  The registry
on disk lists every session; after a gateway restart the earlier ones show as
``lost`` until they are used again.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from . import agent_uids, audit, workspace
from .errors import GatewayError, bad_request, disk_full, not_found
from .execution import KernelDied, OutputCallback, bare_result, run_cell
from .kernels import KERNEL_NAME, Kernel, KernelOptions, write_kernelspec
from .library import DOCUMENTS, SKILLS_DIR, Library
from .provisioner import python_env_paths
from .sandbox import cgroups, quota
from .sandbox.profile import ProfileError, load_profile
from .settings import Gateway

LIVE_STATES = ("starting", "idle", "busy")


@dataclass
class Session:
    agent: str
    id: str
    directory: str  # sessions/<base64url id>/: HOME, spilled outputs and artifacts
    cwd: str = ""  # the kernel's working directory; the session directory unless set
    kernel_name: str = KERNEL_NAME
    state: str = "starting"
    created: float = field(default_factory=time.time)
    last_activity: float = field(default_factory=time.time)
    execution_count: int = 0
    kernel: Kernel | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    notice: str | None = None

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "agent": self.agent,
            "state": self.state,
            "kernel": self.kernel_name,
            "cwd": self.cwd or self.directory,
            "directory": self.directory,
            "execution_count": self.execution_count,
            "created": self.created,
            "last_activity": self.last_activity,
            "pid": self.kernel.pid if self.kernel else None,
        }


class SessionManager:
    """Agents, sessions, spare kernels, caps and culling."""

    def __init__(self, settings: Gateway, on_agent: Callable[[str], Any] | None = None):
        self.settings = settings
        self.on_agent = on_agent or (lambda agent: None)
        self.sessions: dict[tuple[str, str], Session] = {}
        self.agents: set[str] = set()
        self.spares: dict[str, Kernel] = {}
        self._spare_tasks: dict[str, asyncio.Task] = {}
        self._registry_path = os.path.join(settings.state_dir, "registry.json")
        self.library = Library(settings.root, settings.state_dir)  # skills, documents, the kernel gate
        self.audit = audit.AuditLog(os.path.join(settings.state_dir, "audit.log"), settings.audit_code)
        self.uids = agent_uids.AgentUids(
            settings.state_dir,
            settings.agent_uid_start,
            settings.agent_uid_count,
            root=settings.root,
            max_processes=settings.agent_max_processes,
            keep=(SKILLS_DIR, *DOCUMENTS),  # the Library's: the operator's, read-only in every sandbox
        )
        kernelspec_dir = write_kernelspec(settings.state_dir)
        # Names that belong to this state directory, so a restart can sweep what
        # a killed predecessor left (runtime dirs stay short: ipc paths <= 107 bytes).
        instance = hashlib.sha256(settings.state_dir.encode()).hexdigest()[:10]
        self.runtime_root = os.path.join(tempfile.gettempdir(), f"kg-{instance}")
        self.cgroup_prefix = f"kg-{instance}"
        self._options = lambda agent: KernelOptions(
            kernelspec_dir=kernelspec_dir,
            profile=settings.profile_for(agent, "kernel"),
            bwrap=settings.bwrap,
            log_dir=os.path.join(settings.state_dir, "logs"),
            output_limit=settings.output_limit,
            startup_timeout=settings.startup_timeout,
            runtime_root=self.runtime_root,
            cgroup_prefix=self.cgroup_prefix,
            read_only=tuple(self.library.read_only_binds(agent)),
            cell_output_limit=settings.cell_output_limit,
            run_as=self.uids.run_as(agent),
        )

    def sweep_leftovers(self) -> None:
        """Remove runtime dirs and cgroups of kernels of an earlier run (their kernels are gone)."""
        shutil.rmtree(self.runtime_root, ignore_errors=True)
        # 0711: sandbox uids reach their own (0700) runtime dirs, and cannot list others'.
        os.makedirs(self.runtime_root, mode=0o711, exist_ok=True)
        os.chmod(self.runtime_root, 0o711)
        cgroups.sweep(self.cgroup_prefix + "-")

    # --- registry ---------------------------------------------------------------

    def load_registry(self) -> None:
        """Read the registry left by an earlier run: its sessions are ``lost``."""
        try:
            with open(self._registry_path) as f:
                saved = json.load(f)
        except (OSError, ValueError):
            saved = {}
        for agent in saved.get("agents", []):
            if os.path.isdir(workspace.agent_root(self.settings.root, agent)):
                self.agents.add(agent)
        for item in saved.get("sessions", []):
            if item.get("agent") in self.agents:
                session = Session(
                    agent=item["agent"],
                    id=item["id"],
                    directory=workspace.session_dir(self.settings.root, item["agent"], item["id"]),
                    cwd=item["cwd"],
                    state="lost",
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
            "agents": sorted(self.agents),
            "sessions": [
                {k: v for k, v in s.to_json().items() if k not in ("state", "pid")}
                for s in self.sessions.values()
                if s.state != "stopped"
            ],
        }
        tmp = self._registry_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._registry_path)

    # --- agents -----------------------------------------------------------------

    def agent_root(self, agent: str) -> str:
        return workspace.agent_root(self.settings.root, agent)

    def agent_socket(self, agent: str) -> str:
        return os.path.join(self.settings.state_dir, "agents", f"{agent}.sock")

    @functools.lru_cache(maxsize=None)
    def profile(self, agent: str, kind: str) -> dict:
        """The agent's sandbox profile of one kind, loaded once."""
        try:
            return load_profile(self.settings.profile_for(agent, kind))
        except ProfileError as e:
            raise GatewayError(500, "bad_profile", f"the {kind} profile of {agent!r} is invalid: {e}") from None

    def sandbox_values(self, agent: str) -> dict[str, str]:
        """Placeholder values for an agent's command sandboxes (``workspace`` is set per call)."""
        prefix, base = python_env_paths(sys.executable)
        return {
            "agent": agent,
            "agent_root": self.agent_root(agent),
            "python_prefix": prefix,
            "python_base_prefix": base,
            "python_bin": os.path.join(prefix, "bin"),
            "agent_socket": self.agent_socket(agent),
        }

    def ensure_agent(self, agent: str) -> bool:
        """Create the agent's tree and socket if needed; True if the agent is new."""
        workspace.check_agent_key(agent)
        quota.mount_agent_disk(self.settings, agent)  # the tree goes on the agent's own disk, if it has one
        created = workspace.create_agent_tree(self.settings.root, agent)
        self.library.ensure_agent(agent)
        self.uids.own_tree(agent, self.agent_root(agent))
        if agent not in self.agents:
            self.agents.add(agent)
            self.on_agent(agent)
            self.save_registry()
            created = True
        return created

    def require_agent(self, agent: str) -> None:
        workspace.check_agent_key(agent)
        if agent not in self.agents:
            raise not_found(
                f"no agent {agent!r}", f"create it first: PUT /v1/agents/{agent}", code="unknown_agent"
            )

    def agent_json(self, agent: str) -> dict:
        return {
            "agent": agent,
            "root": self.agent_root(agent),
            "socket": self.agent_socket(agent),
            "spare_kernel_ready": agent in self.spares,
            "sessions": [s.to_json() for (a, _), s in self.sessions.items() if a == agent and s.state != "stopped"],
        }

    async def stop_agent(self, agent: str) -> None:
        self.require_agent(agent)
        for (a, sid) in list(self.sessions):
            if a == agent:
                await self.stop(agent, sid)
        spare = self.spares.pop(agent, None)
        if spare:
            await spare.shutdown(now=True)

    # --- sessions ---------------------------------------------------------------

    def get(self, agent: str, session_id: str) -> Session:
        self.require_agent(agent)
        workspace.check_session_id(session_id)
        session = self.sessions.get((agent, session_id))
        if session is None or session.state == "stopped":
            raise not_found(
                f"no session {session_id!r} for agent {agent!r}",
                f"create it: POST /v1/agents/{agent}/sessions",
                code="unknown_session",
            )
        return session

    def list(self, agent: str) -> list[dict]:
        self.require_agent(agent)
        return [s.to_json() for (a, _), s in self.sessions.items() if a == agent and s.state != "stopped"]

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
        self.require_agent(agent)
        self.library.require_kernel(agent)
        workspace.check_session_id(session_id)
        if kernel is not None and kernel != KERNEL_NAME:
            raise bad_request(f"unknown kernel {kernel!r}", f"available: {KERNEL_NAME}", code="unknown_kernel")
        key = (agent, session_id)
        session = self.sessions.get(key)
        created = session is None
        if created:
            # Check the caps and take the slot with no await in between.
            self._check_caps(agent)
            directory = workspace.session_dir(self.settings.root, agent, session_id)
            session = Session(agent=agent, id=session_id, directory=directory, cwd=cwd or directory)
            self.sessions[key] = session
        if session.kernel is None:  # a live session is returned at once, even while busy
            async with session.lock:
                if session.kernel is None:
                    try:
                        await self._start_kernel(session, check_caps=not created)
                    except BaseException:
                        if created:
                            self.sessions.pop(key, None)
                        raise
        return session, created

    async def _start_kernel(self, session: Session, check_caps: bool = True) -> None:
        """Give a session without a kernel a fresh one.  The caller holds its lock."""
        if check_caps:
            self._check_caps(session.agent)
        previous, session.state = session.state, "starting"
        try:
            await asyncio.to_thread(workspace.make_session_dir, self.settings.root, session.agent, session.id)
            session.kernel = await self._kernel_for(session)
        except BaseException as e:
            session.state = previous
            if isinstance(e, GatewayError):
                raise
            raise disk_full(e) or GatewayError(
                500, "kernel_start_failed", f"the kernel could not start: {e}", "run `kernel-gateway doctor`"
            ) from e
        if not self.library.kernel_enabled(session.agent):
            # Narrowed while this kernel started: it does not outlive the switch.
            kernel, session.kernel, session.state = session.kernel, None, previous
            await kernel.shutdown(now=True)
            self.library.require_kernel(session.agent)
        session.state = "idle"
        session.last_activity = time.time()
        self.save_registry()
        self._replenish_spare(session.agent)

    async def _kernel_for(self, session: Session) -> Kernel:
        """A spare kernel when one is ready (fast), else a fresh one."""
        agent = session.agent
        spare = self.spares.pop(agent, None)
        if spare is not None:
            try:
                if await spare.is_alive():
                    await spare.adopt(session.cwd, session.directory, session.id)
                    return spare
            except Exception:
                pass
            await spare.shutdown(now=True)
        return await Kernel.start(
            self._options(agent),
            agent=agent,
            agent_root=self.agent_root(agent),
            cwd=session.cwd,
            session_dir=session.directory,
            agent_socket=self.agent_socket(agent),
            session=session.id,
        )

    def _replenish_spare(self, agent: str) -> None:
        if not self.settings.spare_kernels or agent in self.spares or agent in self._spare_tasks:
            return
        if not self.library.kernel_enabled(agent):
            return
        if len(self.spares) + len(self._spare_tasks) >= self.settings.max_spare_kernels:
            return

        async def start_spare() -> None:
            try:
                kernel = await Kernel.start(
                    self._options(agent),
                    agent=agent,
                    agent_root=self.agent_root(agent),
                    cwd=self.agent_root(agent),
                    session_dir=self.agent_root(agent),
                    agent_socket=self.agent_socket(agent),
                )
                if agent in self.agents and agent not in self.spares and self.library.kernel_enabled(agent):
                    self.spares[agent] = kernel
                else:
                    await kernel.shutdown(now=True)
            except Exception:
                pass  # a spare is an optimisation; the next session starts cold
            finally:
                self._spare_tasks.pop(agent, None)

        # Spawned on the event loop thread: --die-with-parent is per thread.
        self._spare_tasks[agent] = asyncio.ensure_future(start_spare())

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
            if session.kernel is None:
                # Died or lost since: a fresh kernel, and the result says so.
                notice = session.notice
                await self._start_kernel(session)
            session.state = "busy"
            session.last_activity = time.time()
            kernel = session.kernel
            assert kernel is not None
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
                    cell_limit=self.settings.cell_output_limit,
                    agent_root=self.agent_root(agent),
                    session_dir=session.directory,
                )
            except KernelDied as died:
                await self._bury(session, died)
                return bare_result(
                    "died", died.sentence() + "\n", exit_code=died.exit_code, signal=died.signal, notice=died.sentence()
                )
            finally:
                if session.state == "busy":
                    session.state = "idle"
                session.last_activity = time.time()
            if result.get("execution_count"):
                session.execution_count = result["execution_count"]
            if notice:
                result["notice"] = notice
                session.notice = None
            return result
        finally:
            session.lock.release()

    async def _bury(self, session: Session, died: KernelDied) -> None:
        session.state = "dead"
        session.notice = died.fresh_kernel_notice()
        kernel, session.kernel = session.kernel, None
        if kernel is not None:
            await kernel.shutdown(now=True)

    async def inspect(self, agent: str, session_id: str, probe: Callable[[Any], Any]) -> dict:
        """Run ``probe(kernel_client)`` between executions of a live session."""
        self.library.require_kernel(agent)
        session = self.get(agent, session_id)
        async with session.lock:
            if session.kernel is None:
                raise GatewayError(
                    409, "no_kernel", f"session {session_id!r} has no running kernel ({session.state})",
                    "execute something in it first",
                )
            session.last_activity = time.time()
            return await probe(session.kernel.kc)

    async def interrupt(self, agent: str, session_id: str) -> dict:
        self.library.require_kernel(agent)
        session = self.get(agent, session_id)
        if session.kernel is None or session.state not in LIVE_STATES:
            raise GatewayError(409, "no_kernel", f"session {session_id!r} has no running kernel ({session.state})")
        await session.kernel.interrupt()
        return session.to_json()

    async def restart(self, agent: str, session_id: str) -> dict:
        self.library.require_kernel(agent)
        session = self.get(agent, session_id)
        async with session.lock:
            old, session.kernel = session.kernel, None
            if old is not None:
                await old.shutdown(now=True)
            await self._start_kernel(session, check_caps=False)
            session.execution_count = 0
            session.notice = None
        return session.to_json()

    async def stop(self, agent: str, session_id: str) -> None:
        session = self.get(agent, session_id)
        kernel, session.kernel = session.kernel, None
        session.state = "stopped"
        self.sessions.pop((agent, session_id), None)
        self.save_registry()
        if kernel is not None:
            await kernel.shutdown()

    async def cull_idle(self) -> list[str]:
        """Stop sessions idle longer than the configured time; return their ids."""
        limit = self.settings.cull_idle_timeout
        if limit <= 0:
            return []
        now, culled = time.time(), []
        for (agent, sid), session in list(self.sessions.items()):
            if session.state == "idle" and not session.lock.locked() and now - session.last_activity > limit:
                await self.stop(agent, sid)
                culled.append(sid)
        return culled

    async def shutdown_all(self) -> None:
        for task in list(self._spare_tasks.values()):
            task.cancel()
        kernels = [s.kernel for s in self.sessions.values() if s.kernel] + list(self.spares.values())
        for session in self.sessions.values():
            session.kernel = None
        self.spares.clear()
        self.save_registry()
        await asyncio.gather(*(k.shutdown(now=True) for k in kernels), return_exceptions=True)
        shutil.rmtree(self.runtime_root, ignore_errors=True)
