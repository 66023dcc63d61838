"""Spare command sandboxes: a command's sandbox set up before the command is asked for.

Setting up a command's sandbox (namespaces, some thirty mounts, the seccomp
filter, its cgroup, the drop to the agent's uid) is most of what a short
command costs.  So after an agent's command, the gateway sets up the next one
in the background: the same profile, values and uid, fully confined and
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
    """At most one spare command sandbox per agent, and the one being set up."""

    def __init__(self, enabled: bool = True, idle_seconds: float = 300.0, limit: int = 32):
        self.enabled = enabled and find_stub() is not None and limit > 0
        self.limit = limit
        self.idle_seconds = idle_seconds
        self._ready: dict[str, SpareCommand] = {}
        self._filling: dict[str, tuple[str, asyncio.Task]] = {}
        self._closed = False
        self._tasks: set[asyncio.Task] = set()  # drops under way: kept referenced until done

    async def take(self, agent: str, key: str) -> SpareCommand | None:
        """The agent's spare for ``key`` (waiting for one being set up), or None."""
        if not self.enabled:
            return None
        filling = self._filling.get(agent)
        if filling is not None and filling[0] == key:
            await asyncio.shield(filling[1])  # never raises: _fill logs its own failure
        spare = self._ready.pop(agent, None)
        if spare is None:
            return None
        if spare.key != key or spare.process.returncode is not None:
            self._background(spare.drop())
            return None
        return spare

    def refill(self, agent: str, key: str, prepare: Prepare) -> None:
        """Set up the agent's next spare for ``key`` in the background, unless one is there or coming."""
        if not self.enabled or self._closed or agent in self._filling:
            return
        spare = self._ready.get(agent)
        if spare is not None and spare.key == key:
            return
        if spare is None and len(self._ready) + len(self._filling) >= self.limit:
            return  # as many as the gateway keeps: this agent's next command sets its sandbox up
        task = asyncio.get_running_loop().create_task(self._fill(agent, key, prepare))
        self._filling[agent] = (key, task)

    async def _fill(self, agent: str, key: str, prepare: Prepare) -> None:
        try:
            spare = await self._spawn(key, prepare)
        except Exception as e:  # the next command starts a sandbox of its own, and says why if it fails
            log.warning("spare command sandbox of agent %s could not be set up: %s", agent, e)
            return
        finally:
            self._filling.pop(agent, None)
        old = self._ready.pop(agent, None)
        if old is not None:
            self._background(old.drop())
        if self._closed:
            await spare.drop()
            return
        self._ready[agent] = spare
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
        if self._ready.get(agent) is spare:
            del self._ready[agent]
            self._background(spare.drop())

    async def discard(self, agent: str) -> None:
        """Drop the agent's spare, and the one being set up (its agent stopped)."""
        filling = self._filling.pop(agent, None)
        if filling is not None:
            await asyncio.shield(filling[1])
        spare = self._ready.pop(agent, None)
        if spare is not None:
            await spare.drop()

    async def close(self) -> None:
        """Drop every spare (the gateway stops)."""
        self._closed = True
        for _key, task in list(self._filling.values()):
            await asyncio.shield(task)
        spares, self._ready = list(self._ready.values()), {}
        await asyncio.gather(*(spare.drop() for spare in spares), *self._tasks, return_exceptions=True)

    def count(self) -> int:
        return len(self._ready)

    def describe(self) -> str:
        """How commands start, for ``/v1/info`` and ``doctor``."""
        if self.enabled:
            return "a spare sandbox per agent, set up while its last command ran (kg-exec-stub)"
        if find_stub() is None:
            return "a sandbox set up per command (kg-exec-stub is not built: run scripts/install.sh)"
        if self.limit <= 0:
            return "a sandbox set up per command (--Gateway.max_spare_commands=0)"
        return "a sandbox set up per command (--Gateway.spare_commands=False)"

    def _background(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
