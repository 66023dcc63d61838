"""Agent-sized disk and CPU work, off the event loop, within a per-agent share of the threads.

Reading a 35 MB notebook, listing a folder of 100,000 files or applying a
patch takes seconds; on the event loop it stalls every agent and the control
socket.  :class:`AgentWorkers` runs such work on a pool of threads of its own
(not the loop's default executor, which the gateway's own short jobs use),
and bounds each agent's share of it:

- at most ``per_agent`` jobs of one agent run at once (2): one agent cannot
  hold every thread, so another's work starts as soon as a thread is free;
- at most ``per_agent_waiting`` more of that agent's jobs wait their turn
  (queued, in order); past that the request is refused at once with 429
  ``agent_busy``, a clear "retry later" that costs nothing;
- at most ``max_waiting`` jobs wait in all, past which 503 ``workers_busy``.

The threads number ``threads`` (8): the total.  Every route that does such
work for an agent calls :meth:`AgentWorkers.run` with the agent's name.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
from typing import Any, Callable

from ..errors import GatewayError

THREADS = 8
PER_AGENT = 2
PER_AGENT_WAITING = 32  # JupyterLab opens a dozen contents requests at once: they wait, not fail
MAX_WAITING = 256


class AgentWorkers:
    """A pool of threads with a per-agent share and a total."""

    def __init__(self, threads: int = THREADS, per_agent: int = PER_AGENT,
                 per_agent_waiting: int = PER_AGENT_WAITING, max_waiting: int = MAX_WAITING):
        self.threads = threads
        self.per_agent = per_agent
        self.per_agent_waiting = per_agent_waiting
        self.max_waiting = max_waiting
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="agent-work")
        self._running: dict[str, int] = {}
        self._waiters: dict[str, list[asyncio.Future]] = {}

    def running(self, agent: str) -> int:
        return self._running.get(agent, 0)

    def waiting(self, agent: str | None = None) -> int:
        if agent is not None:
            return len(self._waiters.get(agent, ()))
        return sum(len(w) for w in self._waiters.values())

    async def run(self, agent: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on a worker thread, within ``agent``'s share; its result or exception."""
        await self._acquire(agent)
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))
        finally:
            self._release(agent)

    async def _acquire(self, agent: str) -> None:
        if self._running.get(agent, 0) < self.per_agent and not self._waiters.get(agent):
            self._running[agent] = self._running.get(agent, 0) + 1
            return
        waiters = self._waiters.setdefault(agent, [])
        if len(waiters) >= self.per_agent_waiting:
            raise GatewayError(
                429, "agent_busy",
                f"agent {agent!r} already has {self.per_agent} file operations running and "
                f"{len(waiters)} waiting",
                "wait for them to finish, then retry",
            )
        if self.waiting() >= self.max_waiting:
            raise GatewayError(503, "workers_busy", "the gateway's file workers are all taken", "retry shortly")
        turn = asyncio.get_running_loop().create_future()
        waiters.append(turn)
        try:
            await turn  # _release hands its slot over: the count stays as it was
        except BaseException:
            if turn in waiters:
                waiters.remove(turn)
            elif turn.done() and not turn.cancelled():
                self._release(agent)  # handed a slot just as we were cancelled: pass it on
            self._tidy(agent, waiters)
            raise
        self._tidy(agent, waiters)

    def _tidy(self, agent: str, waiters: list) -> None:
        if not waiters and self._waiters.get(agent) is waiters:
            del self._waiters[agent]

    def _release(self, agent: str) -> None:
        waiters = self._waiters.get(agent)
        while waiters:
            turn = waiters.pop(0)
            if not turn.done():
                turn.set_result(None)  # the slot goes straight to the next in line
                return
        count = self._running.get(agent, 0) - 1
        if count > 0:
            self._running[agent] = count
        else:
            self._running.pop(agent, None)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def json_text(obj: Any) -> str:
    """``json.dumps(obj)`` for a worker thread: the encoder in Python, not the one-shot C encoder.

    The C encoder holds the GIL for the whole object (about a second for a 35 MB
    notebook, during which the event loop cannot run); this one lets the loop
    in every few milliseconds, at twice the worker's time.
    """
    return "".join(json.JSONEncoder().iterencode(obj))
