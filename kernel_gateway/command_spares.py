"""Spare command sandboxes: a command's sandbox set up before the command is asked for.

Setting up a command's sandbox (namespaces, some thirty mounts, the seccomp
filter, its cgroup, the drop to the agent's uid) is most of what a short
command costs.  So while an agent's command runs, the gateway sets up its next
ones in the background (two, see :class:`CommandSpares`): the same profile, values and uid, fully confined and
released, with :file:`kg-exec-stub` (``sandbox/exec_stub.c``) as its payload,
blocked reading a pipe that only the gateway holds.  The next command of that
agent with the same sandbox (same profile, same working directory) writes
its argv, environment and working directory to that pipe; the stub closes
every descriptor above 2 and execs it.  Nothing of the agent's runs in a
spare before that, and each spare serves one command: a command still gets
a sandbox of its own, only earlier.

A spare is dropped when its agent is stopped, when it has waited
:attr:`CommandSpares.idle_seconds`, when the next command needs a different
sandbox, and when the gateway stops; at most :attr:`CommandSpares.limit` are kept in all.  Dropping closes the pipe: the stub
reads an empty request and exits 0.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import os
import signal
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from .sandbox import launch

log = logging.getLogger("kernel_gateway.commands")

STUB = os.path.join(os.path.dirname(os.path.abspath(launch.__file__)), "kg-exec-stub")
#: Where the stub is bound inside the sandbox (read-only).
STUB_AT = "/run/kg-exec-stub"
#: The largest request (argv + env) handed to a spare; a bigger one starts a sandbox of its own.
#: A fresh pipe holds 64 KiB, so writing it never blocks the event loop.
MAX_REQUEST = 60 * 1024


@functools.lru_cache(maxsize=1)
def find_stub() -> str | None:
    """The built stub (``scripts/install.sh`` compiles it), or None: no spares then."""
    try:
        st = os.stat(STUB)
    except OSError:
        return None
    if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022 or not os.access(STUB, os.X_OK):
        return None
    return STUB


def sandbox_key(profile: Mapping[str, Any], values: Mapping[str, str], run_as: launch.RunAs | None, bwrap: str | None) -> str:
    """What makes two command sandboxes the same: a spare serves only a command with its key."""
    text = json.dumps([profile, sorted(values.items()), run_as and [run_as.uid, run_as.gid, run_as.max_processes], bwrap],
                      sort_keys=True, default=str)  # fmt: skip
    return hashlib.sha256(text.encode()).hexdigest()


def encode_request(cwd: str, argv: Sequence[str], env: Mapping[str, str]) -> bytes | None:
    """The stub's request, or None when it is too large for a spare (or holds a NUL)."""
    parts = [cwd, str(len(argv)), *argv, *(f"{name}={value}" for name, value in env.items())]
    if any("\0" in part for part in parts):
        return None
    data = b"".join(part.encode("utf-8", "surrogateescape") + b"\0" for part in parts)
    return data if len(data) <= MAX_REQUEST else None


@dataclass
class SpareCommand:
    """A released sandbox whose stub waits for one command."""

    key: str
    prepared: launch.PreparedSandbox
    process: asyncio.subprocess.Process
    request_fd: int
    expiry: asyncio.TimerHandle | None = None

    def start(self, request: bytes) -> bool:
        """Hand the stub its command (see :func:`encode_request`); it execs at once.

        False when the spare is gone already (its stub no longer reads): drop it, start afresh.
        """
        if self.expiry is not None:
            self.expiry.cancel()
        try:
            view = memoryview(request)
            while view:  # fits the empty pipe: never blocks
                view = view[os.write(self.request_fd, view) :]
            return True
        except OSError:  # EPIPE: the spare died (and was not reaped yet)
            return False
        finally:
            os.close(self.request_fd)
            self.request_fd = -1

    async def drop(self) -> None:
        """End the unused spare: an empty request, then its sandbox is cleaned up."""
        if self.expiry is not None:
            self.expiry.cancel()
        if self.request_fd >= 0:
            os.close(self.request_fd)
            self.request_fd = -1
        try:
            await asyncio.wait_for(self.process.wait(), 5)
        except asyncio.TimeoutError:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await self.process.wait()
        await self.prepared.finish()


Prepare = Callable[[list[str], Mapping[str, Any]], launch.PreparedSandbox]


class CommandSpares:
    """Up to :attr:`per_agent` spare command sandboxes per agent, ready or being set up.

    Two, not one: setting a sandbox up takes about as long as a short command's round trip,
    so with one spare an agent that runs commands back to back would wait for the spare
    still being set up; with two, each has the time of two commands to get ready.
    """

    def __init__(self, enabled: bool = True, idle_seconds: float = 300.0, limit: int = 32, per_agent: int = 2):
        self.enabled = enabled and find_stub() is not None and limit > 0 and per_agent > 0
        self.limit = limit
        self.per_agent = per_agent
        self.idle_seconds = idle_seconds
        self._ready: dict[str, list[SpareCommand]] = {}
        self._filling: dict[str, list[tuple[str, asyncio.Task]]] = {}
        self._closed = False
        self._tasks: set[asyncio.Task] = set()  # drops under way: kept referenced until done

    def _pop_ready(self, agent: str, key: str) -> SpareCommand | None:
        """A live ready spare of the agent for ``key``; the agent's spares for other keys are dropped."""
        ready = self._ready.get(agent, [])
        chosen = None
        for spare in list(ready):
            if spare.key != key or spare.process.returncode is not None:
                ready.remove(spare)
                self._background(spare.drop())
            elif chosen is None:
                chosen = spare
                ready.remove(spare)
        if not ready:
            self._ready.pop(agent, None)
        return chosen

    async def take(self, agent: str, key: str) -> SpareCommand | None:
        """The agent's spare for ``key`` (waiting for one being set up if none is ready), or None."""
        if not self.enabled:
            return None
        spare = self._pop_ready(agent, key)
        if spare is None:
            coming = [task for k, task in self._filling.get(agent, []) if k == key]
            if coming:
                await asyncio.shield(coming[0])  # never raises: _fill logs its own failure
                spare = self._pop_ready(agent, key)
        return spare

    def refill(self, agent: str, key: str, prepare: Prepare) -> None:
        """Set up spares of the agent for ``key`` in the background, up to :attr:`per_agent`."""
        if not self.enabled or self._closed:
            return
        have = len([s for s in self._ready.get(agent, []) if s.key == key])
        have += len([k for k, _ in self._filling.get(agent, []) if k == key])
        while have < self.per_agent and self._total() < self.limit:
            task = asyncio.get_running_loop().create_task(self._fill(agent, key, prepare))
            self._filling.setdefault(agent, []).append((key, task))
            have += 1
        # Past the limit: this agent's next commands set their sandboxes up when asked for.

    def _total(self) -> int:
        return sum(map(len, self._ready.values())) + sum(map(len, self._filling.values()))

    async def _fill(self, agent: str, key: str, prepare: Prepare) -> None:
        task = asyncio.current_task()
        try:
            spare = await self._spawn(key, prepare)
        except Exception as e:  # the next command starts a sandbox of its own, and says why if it fails
            log.warning("spare command sandbox of agent %s could not be set up: %s", agent, e)
            return
        finally:
            filling = self._filling.get(agent, [])
            filling[:] = [entry for entry in filling if entry[1] is not task]
            if not filling:
                self._filling.pop(agent, None)
        if self._closed:
            await spare.drop()
            return
        self._ready.setdefault(agent, []).append(spare)
        spare.expiry = asyncio.get_running_loop().call_later(self.idle_seconds, self._expire, agent, spare)

    async def _spawn(self, key: str, prepare: Prepare) -> SpareCommand:
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
        try:
            prepared = prepare([STUB_AT, str(read_fd)], {"from": STUB, "at": STUB_AT})
        except BaseException:
            os.close(read_fd)
            os.close(write_fd)
            raise
        prepared.data_fds.append(read_fd)  # passed to bwrap with the others, closed once it runs
        try:
            process = await launch.spawn(
                prepared, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
            )
        except BaseException:
            os.close(write_fd)
            raise
        return SpareCommand(key, prepared, process, write_fd)

    def _expire(self, agent: str, spare: SpareCommand) -> None:
        ready = self._ready.get(agent, [])
        if spare in ready:
            ready.remove(spare)
            if not ready:
                self._ready.pop(agent, None)
            self._background(spare.drop())

    async def discard(self, agent: str) -> None:
        """Drop the agent's spares, and those being set up (its agent stopped)."""
        for _key, task in list(self._filling.get(agent, [])):
            await asyncio.shield(task)
        spares = self._ready.pop(agent, [])
        await asyncio.gather(*(spare.drop() for spare in spares), return_exceptions=True)

    async def close(self) -> None:
        """Drop every spare (the gateway stops)."""
        self._closed = True
        for filling in list(self._filling.values()):
            for _key, task in list(filling):
                await asyncio.shield(task)
        spares = [spare for ready in self._ready.values() for spare in ready]
        self._ready = {}
        await asyncio.gather(*(spare.drop() for spare in spares), *self._tasks, return_exceptions=True)

    def count(self) -> int:
        return sum(map(len, self._ready.values()))

    def describe(self) -> str:
        """How commands start, for ``/v1/info`` and ``doctor``."""
        if self.enabled:
            return f"up to {self.per_agent} spare sandboxes per agent, set up while its commands run (kg-exec-stub)"
        if find_stub() is None:
            return "a sandbox set up per command (kg-exec-stub is not built: run scripts/install.sh)"
        if self.limit <= 0:
            return "a sandbox set up per command (--Gateway.max_spare_commands=0)"
        return "a sandbox set up per command (--Gateway.spare_commands=False)"

    def _background(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
