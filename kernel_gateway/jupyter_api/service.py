"""Everything the Jupyter Server API serves, for every agent: tokens, kernelspecs, kernels, websockets."""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from .channels import Bridges
from .contents import Contents
from .kernels import AgentKernels
from .kernelspecs import KernelSpecs
from .tokens import TokenStore


class JupyterAPI:
    """Built over the gateway's sessions and what it knows of agents, given as plain callables."""

    def __init__(
        self,
        sessions: Any,
        *,
        state_dir: str,
        require_agent: Callable[[str], None],
        agent_root: Callable[[str], str],
        notebook_session_id: Callable[[str], str],
        library: Any = None,
        shares: Any = None,
    ):
        self.sessions = sessions
        self.require_agent = require_agent
        self.agent_root = agent_root
        self.library = library
        self.tokens = TokenStore(state_dir)
        self.kernelspecs = KernelSpecs(os.path.join(state_dir, "kernels"))
        # Per-agent shares and totals (the Gateway settings): websockets and Jupyter sessions.
        self.shares = shares
        self.bridges = Bridges(sessions) if shares is None else Bridges(
            sessions, shares.max_websockets_per_agent, shares.max_websockets_total,
            shares.max_websocket_bytes_per_agent, shares.max_websocket_bytes_total)
        self.notebook_session_id = notebook_session_id
        self.started = time.time()
        self.url: str | None = None  # http://127.0.0.1:PORT/ once the TCP listener is up
        self._agents: dict[str, AgentKernels] = {}

    def kernels(self, agent: str) -> AgentKernels:
        self.require_agent(agent)
        if agent not in self._agents:
            kernels = AgentKernels(agent, self.sessions, self.notebook_session_id,
                                   self.bridges.connections, self.require_agent, self.agent_root)
            kernels.sessions_total = self.jupyter_sessions_total
            if self.shares is not None:
                kernels.max_sessions = self.shares.max_jupyter_sessions_per_agent
                kernels.max_sessions_total = self.shares.max_jupyter_sessions_total
            self._agents[agent] = kernels
        return self._agents[agent]

    def jupyter_sessions_total(self) -> int:
        return sum(len(k.jupyter_sessions) for k in self._agents.values())

    def contents(self, agent: str) -> Contents:
        self.require_agent(agent)
        library = self.library
        protected = (lambda physical: library.protected(agent, physical)) if library is not None else None
        return Contents(self.agent_root(agent), protected)

    def require_kernel(self, agent: str) -> None:
        """403 skill_disabled when the agent's live-kernel skill is off."""
        if self.library is not None:
            self.library.require_kernel(agent)

    def agent_url(self, agent: str) -> str | None:
        return f"{self.url}agents/{agent}/" if self.url else None
