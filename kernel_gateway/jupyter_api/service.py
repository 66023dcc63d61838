"""Everything the Jupyter Server API serves, for every agent: tokens, kernelspecs, kernels, websockets."""

from __future__ import annotations

import os
import time
from typing import Callable

from ..sessions import SessionManager
from .channels import Bridges
from .contents import Contents
from .kernels import AgentKernels
from .kernelspecs import KernelSpecs
from .tokens import TokenStore


class JupyterAPI:
    def __init__(self, sessions: SessionManager, notebook_session_id: Callable[[str], str]):
        self.sessions = sessions
        state_dir = sessions.settings.state_dir
        self.tokens = TokenStore(state_dir)
        self.kernelspecs = KernelSpecs(os.path.join(state_dir, "kernels"))
        self.bridges = Bridges(sessions)
        self.notebook_session_id = notebook_session_id
        self.started = time.time()
        self.url: str | None = None  # http://127.0.0.1:PORT/ once the TCP listener is up
        self._agents: dict[str, AgentKernels] = {}

    def kernels(self, agent: str) -> AgentKernels:
        self.sessions.require_agent(agent)
        if agent not in self._agents:
            self._agents[agent] = AgentKernels(agent, self.sessions, self.notebook_session_id,
                                               self.bridges.connections)
        return self._agents[agent]

    def contents(self, agent: str) -> Contents:
        self.sessions.require_agent(agent)
        library = getattr(self.sessions, "library", None)
        protected = (lambda physical: library.protected(agent, physical)) if library is not None else None
        return Contents(self.sessions.agent_root(agent), protected)

    def agent_url(self, agent: str) -> str | None:
        return f"{self.url}agents/{agent}/" if self.url else None
