"""The idle culler: stops sessions whose kernels nobody has used for a while.

Idle means observed idle: the kernel's iopub says ``idle``, no execution of
ours holds the session, no other client is connected to it, and nothing was
seen on any of its connections for ``cull_idle_timeout`` seconds.  A kernel
busy for any client is never culled.
"""

from __future__ import annotations

import asyncio
import logging
import time

from .sessions import Sessions
from .settings import Gateway

log = logging.getLogger("kernel_gateway.culler")


class Culler:
    def __init__(self, settings: Gateway, sessions: Sessions):
        self.settings = settings
        self.sessions = sessions

    def idle_sessions(self, now: float | None = None) -> list[tuple[str, str]]:
        limit = self.settings.cull_idle_timeout
        if limit <= 0:
            return []
        now = time.time() if now is None else now
        return [
            key
            for key, s in self.sessions.sessions.items()
            if s.kernel is not None
            and s.state == "idle"
            and not s.lock.locked()
            and s.kernel.connections == 0
            and now - s.activity > limit
        ]

    async def cull_idle(self) -> list[str]:
        """Stop the idle sessions; return their ids."""
        culled = []
        for agent, sid in self.idle_sessions():
            await self.sessions.stop(agent, sid, why="culled")  # the pool logs the cull
            culled.append(sid)
        return culled

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.cull_interval)
            try:
                await self.cull_idle()
                self.sessions.save_registry()
            except Exception:  # a failed cull must not stop the next one
                log.exception("culling idle sessions failed")
