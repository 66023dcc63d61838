"""The agent registry: which agents exist, their trees, sockets and sandbox settings.

An agent is registered fully or not at all: its tree is laid out, its socket
bound (through the ``on_agent`` hook the server sets), and only then is it
known and saved.  Everything per agent that is not a session lives here: the
paths of its root and socket, its sandbox profiles (loaded once) and the
placeholder values of its command sandboxes.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from typing import Any, Callable

from . import agent_uids, workspace
from .errors import GatewayError, not_found
from .library import DOCUMENTS, SKILLS_DIR, Library
from .provisioner import python_env_paths
from .sandbox import quota
from .sandbox.profile import ProfileError, load_profile
from .settings import Gateway

log = logging.getLogger("kernel_gateway.agents")

# sun_path holds 108 bytes with its terminating NUL.
MAX_SOCKET_PATH = 107


class AgentRegistry:
    """Known agents and what belongs to each."""

    def __init__(self, settings: Gateway, library: Library):
        self.settings = settings
        self.library = library
        # One unprivileged host uid per agent, owning its tree (the gateway's own uid when not root).
        self.uids = agent_uids.AgentUids(
            settings.state_dir,
            settings.agent_uid_start,
            settings.agent_uid_count,
            root=settings.root,
            max_processes=settings.agent_max_processes,
            keep=(SKILLS_DIR, *DOCUMENTS),  # the Library's: the operator's, read-only in every sandbox
        )
        self.agents: set[str] = set()
        # Binds the agent's socket; set by the server.  Raises OSError when it cannot.
        self.on_agent: Callable[[str], Any] = lambda agent: None
        # Persists the registry; set by the sessions, which save agents and sessions together.
        self.on_change: Callable[[], Any] = lambda: None

    def __contains__(self, agent: str) -> bool:
        return agent in self.agents

    def agent_root(self, agent: str) -> str:
        return workspace.agent_root(self.settings.root, agent)

    def agent_socket(self, agent: str) -> str:
        return os.path.join(self.settings.state_dir, "agents", f"{agent}.sock")

    def ensure_agent(self, agent: str) -> bool:
        """Create the agent's tree and socket if needed; True if the agent is new.

        The agent is registered only once its socket is bound: a refused agent
        leaves nothing behind in memory or in the registry.
        """
        workspace.check_agent_key(agent)
        if agent not in self.agents:
            self._check_socket_path(agent)
        quota.mount_agent_disk(self.settings, agent)  # the tree goes on the agent's own disk, if it has one
        created = workspace.create_agent_tree(self.settings.root, agent)
        self.library.ensure_agent(agent)
        self.uids.own_tree(agent, self.agent_root(agent))
        if agent not in self.agents:
            try:
                self.on_agent(agent)
            except OSError as e:
                log.exception("agent %s: its socket could not be bound", agent)
                raise GatewayError(
                    500, "agent_socket_failed", f"the socket of agent {agent!r} could not be bound: {e}",
                    "see the gateway's log",
                ) from e
            self.agents.add(agent)
            self.on_change()
            log.info("agent registered: agent=%s", agent)
            created = True
        return created

    def _check_socket_path(self, agent: str) -> None:
        path = os.fsencode(self.agent_socket(agent))
        if len(path) > MAX_SOCKET_PATH:
            raise GatewayError(
                400,
                "agent_socket_path_too_long",
                f"the socket of agent {agent!r} would be {os.fsdecode(path)} ({len(path)} bytes); "
                f"Unix socket paths are at most {MAX_SOCKET_PATH} bytes",
                "use a shorter agent key, or run the gateway with a shorter --state-dir",
            )

    def require_agent(self, agent: str) -> None:
        workspace.check_agent_key(agent)
        if agent not in self.agents:
            raise not_found(
                f"no agent {agent!r}", f"create it first: PUT /v1/agents/{agent}", code="unknown_agent"
            )

    def load(self, saved: list[str]) -> None:
        """Agents of an earlier run whose trees are still there."""
        for agent in saved:
            if os.path.isdir(self.agent_root(agent)):
                self.agents.add(agent)

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
