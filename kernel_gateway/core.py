"""The gateway's core, as one object every interface reaches: no HTTP in it.

:class:`Core` wires the pieces, each owning one concern:

- :class:`~kernel_gateway.agents.AgentRegistry`: agents, their trees, sockets, profiles;
- :class:`~kernel_gateway.kernel_pool.KernelPool`: live kernels by id, spares, start and stop;
- :class:`~kernel_gateway.sessions.Sessions`: sessions, their kernels, executions, the registry;
- :class:`~kernel_gateway.culler.Culler`: idle sessions stopped;
- :class:`~kernel_gateway.audit.AuditLog`: one line per tool call.

It also holds the tool calls that are more than one function of ``tools/``:
a command in the agent's command sandbox, apply_patch (built in or the
operator's binary), an agent's notebook store and a notebook's own session.
The HTTP handlers, and later the Jupyter API and jobs, call these.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from . import audit, workspace
from .agents import AgentRegistry
from .command_spares import CommandSpares
from .culler import Culler
from .errors import GatewayError, bad_request
from .kernel_pool import KernelPool
from .library import Library
from .notebook_runs import NOTEBOOK_SESSION, notebook_session_id
from .notebooks import NotebookStore
from .sessions import Sessions
from .settings import Gateway
from . import fs
from .fs.workers import AgentWorkers
from .tools import apply_patch
from .tools.command import run_command


class Core:
    """Settings and the plain-Python core of one gateway."""

    def __init__(self, settings: Gateway):
        self.settings = settings
        self.library = Library(settings.root, settings.state_dir)  # skills, documents, the kernel gate
        self.agents = AgentRegistry(settings, self.library)
        self.pool = KernelPool(settings, self.agents.agent_root, self.agents.agent_socket, self.library)
        self.pool.run_as = self.agents.uids.run_as
        self.sessions = Sessions(settings, self.agents, self.pool, self.library)
        self.culler = Culler(settings, self.sessions)
        self.command_spares = CommandSpares(settings.spare_commands, limit=settings.max_spare_commands)
        self.audit = audit.AuditLog(os.path.join(settings.state_dir, "audit.log"), settings.audit_code)
        self.info: dict = {}
        self.jobs: Any = None  # the JobManager, set once the server has started it
        self.jupyter: Any = None  # the Jupyter Server API (JupyterAPI), set likewise
        self._notebook_stores: dict[str, NotebookStore] = {}
        # Agent-sized disk and CPU work (contents, notebooks, patches, reads), off the loop,
        # within a per-agent share of these threads.
        self.workers = AgentWorkers()

    # --- tools ------------------------------------------------------------------

    async def run_command(
        self, agent: str, request: dict, on_event: Any = None, max_stdin: int = 1 << 20
    ) -> dict:
        """One command in a fresh sandbox from the agent's ``command`` profile."""
        agents = self.agents
        root = agents.agent_root(agent)
        return await run_command(
            request,
            agent_root=root,
            profile=self.command_profile(agent),
            values=agents.sandbox_values(agent),
            spill_dir=os.path.join(root, ".kernel-gateway", "commands"),
            on_event=on_event,
            session_cwd=lambda session: self.session_cwd(agent, session),
            output_limit=self.settings.output_limit,
            bwrap=self.settings.bwrap or None,
            max_stdin=max_stdin,
            run_as=agents.uids.run_as(agent),
            spares=self.command_spares,
            cgroup_prefix=f"{self.pool.cgroup_prefix}-",
        )

    def session_cwd(self, agent: str, session: str) -> str:
        """Where a command for ``session`` starts: its kernel's working directory.

        That is the session directory, or for a notebook's own session the
        notebook's folder; a session with no kernel yet gets the directory its
        kernel will start in.
        """
        for listed in self.sessions.list(agent):
            if listed["id"] == session:
                return listed["cwd"]
        root = self.agents.agent_root(agent)
        if session.startswith(NOTEBOOK_SESSION) and session.endswith(".ipynb"):
            try:
                folder = fs.resolve_in_root(root, session[len(NOTEBOOK_SESSION) :]).parent
            except fs.PathOutsideRoot:
                folder = None  # not a notebook of this agent: the session's own directory, below
            if folder is not None and folder.is_dir():
                return str(folder)
        # The directory its kernel will get, made the same way (no symlink followed; a FIFO or a
        # file the agent put there is a 409, as for an execute in that session).
        return workspace.make_session_dir(self.settings.root, agent, session)

    def command_profile(self, agent: str) -> dict:
        """The agent's command profile with the Agent Library's read-only binds added."""
        profile = self.agents.profile(agent, "command")
        sandbox = dict(profile["sandbox"])
        sandbox["read_only"] = list(sandbox.get("read_only", [])) + self.library.read_only_binds(agent)
        return {**profile, "sandbox": sandbox}

    def refuse_protected(self, agent: str, paths: list[str]) -> None:
        """403 when a host-side write for the agent would touch its library (documents, skills)."""
        for path in paths:
            reason = self.library.protected(agent, path)
            if reason:
                raise GatewayError(403, "read_only_path", f"{reason}: the agent cannot change it",
                                   "the operator sets it through the Agent Library on the control socket")

    async def apply_patch(self, agent: str, patch: str, cwd: str = ".") -> dict:
        """Apply a Codex-grammar patch in the agent's tree (``cwd`` relative to its root)."""
        root = self.agents.agent_root(agent)
        # Disk work in the agent's tree stays off the event loop.
        resolved, targets = await self.workers.run(agent, _patch_cwd_and_targets, root, patch, cwd)
        self.refuse_protected(agent, targets)
        external = self.settings.apply_patch_command
        if not external:
            library = self.library
            return (await self.workers.run(
                agent, apply_patch.apply_patch, patch, resolved, root=root,
                refuse=lambda path: library.protected(agent, path) is not None,
            )).__dict__
        # The operator's binary, in the command sandbox over the workspace.  The patch goes
        # on stdin: one argv element holds at most 128 KiB (E2BIG), a patch up to max_patch_size.
        ran = await self.run_command(
            agent, {"argv": [external], "cwd": resolved, "stdin": patch}, max_stdin=self.settings.max_patch_size
        )
        return {
            "ok": ran["exit_code"] == 0,
            "output": ran["stdout"] + ran["stderr"],
            "added": [],
            "modified": [],
            "deleted": [],
        }

    # --- notebooks --------------------------------------------------------------

    def notebooks(self, agent: str) -> NotebookStore:
        """The agent's notebook store (one per agent, kept)."""
        self.agents.require_agent(agent)
        store = self._notebook_stores.get(agent)
        if store is None:
            library = self.library
            store = self._notebook_stores[agent] = NotebookStore(
                self.agents.agent_root(agent), lambda physical: library.protected(agent, physical))
        return store

    async def notebook_session(self, agent: str, path: str, session: str | None = None) -> str:
        """The session a notebook's cells run in: ``session`` if named, else the notebook's own.

        The notebook's own session (one per path, shared by everyone working on
        that notebook) starts in the notebook's folder, as in Jupyter.
        """
        if session:
            return session
        session = notebook_session_id(path)
        root = self.agents.agent_root(agent)
        folder = (await asyncio.to_thread(fs.resolve_in_root, root, path)).parent
        await self.sessions.get_or_create(agent, session, cwd=str(folder))
        return session

    # --- lifecycle --------------------------------------------------------------

    def load(self) -> None:
        """Sweep what a killed predecessor left, then read its registry."""
        self.pool.sweep_leftovers()
        self.sessions.load_registry()

    async def stop_agent(self, agent: str) -> None:
        """Stop the agent's sessions and drop its spare command sandbox."""
        await self.sessions.stop_agent(agent)
        await self.command_spares.discard(self.agents.agent_root(agent))

    async def close(self) -> None:
        await self.command_spares.close()
        await self.sessions.shutdown_all()
        self.audit.close()


def _patch_cwd_and_targets(root: str, patch: str, cwd: str) -> tuple[str, list[str]]:
    """The patch's working directory, opened beneath the root, and the paths it would write."""
    try:
        resolved = fs.resolve_in_root(root, cwd)
        os.close(fs.open_in_root(root, resolved, os.O_PATH | os.O_DIRECTORY))
    except fs.PathOutsideRoot as e:
        raise GatewayError(403, "outside_workspace", str(e)) from None
    except OSError:
        raise bad_request(f"cwd {cwd!r} is not a directory in the agent's tree", code="invalid_cwd") from None
    return str(resolved), _patch_targets(root, patch, str(resolved))


def _patch_targets(root: str, patch: str, cwd: str) -> list[str]:
    """The resolved paths a patch would write, for :meth:`Core.refuse_protected`; [] if it does not parse."""
    try:
        hunks = apply_patch.parse_patch(patch)
    except Exception:
        return []  # apply_patch reports the parse error itself
    targets = []
    for hunk in hunks:
        for raw in filter(None, (hunk.path, hunk.move_to)):
            try:
                targets.append(str(fs.resolve_in_root(root, raw, cwd)))
            except (fs.PathOutsideRoot, OSError):
                pass  # apply_patch refuses it (or fails on it), with its own message
    return targets
