"""The kernel pool: every live kernel by id, one spare per agent, start and stop.

Sessions ask the pool for a kernel and give it back; the pool is the one
place kernels are started (so a start hook, a log line, a cap has one home)
and the one place that knows every live kernel, so shutdown misses none.  A
spare kernel is started in the agent's root after its first session and
adopted by the next session, which then starts in milliseconds.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import tempfile
from typing import Any, Callable

from .kernels import Kernel, KernelOptions, write_kernelspec
from .library import Library
from .sandbox import cgroups
from .settings import Gateway

log = logging.getLogger("kernel_gateway.kernels")


def log_kernel(event: str, kernel: Kernel, level: int = logging.INFO, **fields: object) -> None:
    """One line per kernel event (start, stop, death, cull), with its id and agent."""
    details = "".join(f" {k}={v}" for k, v in fields.items())
    log.log(
        level, "kernel %s: id=%s agent=%s%s", event, kernel.id, kernel.agent, details,
        extra={"fields": {"event": f"kernel_{event}", "kernel_id": kernel.id, "agent": kernel.agent, **fields}},
    )


class KernelPool:
    """Live kernels by id, and the spares."""

    def __init__(
        self, settings: Gateway, agent_root: Callable[[str], str], agent_socket: Callable[[str], str], library: Library
    ):
        self.settings = settings
        self.library = library
        self._agent_root = agent_root
        self._agent_socket = agent_socket
        self.kernels: dict[str, Kernel] = {}
        self.spares: dict[str, Kernel] = {}
        self._spare_tasks: dict[str, asyncio.Task] = {}
        self.is_agent: Callable[[str], bool] = lambda agent: True
        # The host uid an agent's sandboxes run as (None: the gateway's own); set by the core.
        self.run_as: Callable[[str], Any] = lambda agent: None
        # Called with a kernel the watcher found dead (its session learns it on its next use).
        self.on_death: Callable[[Kernel], None] = lambda kernel: None
        self._kernelspec_dir = write_kernelspec(settings.state_dir)
        # Names that belong to this state directory, so a restart can sweep what
        # a killed predecessor left (runtime dirs stay short: ipc paths <= 107 bytes).
        instance = hashlib.sha256(settings.state_dir.encode()).hexdigest()[:10]
        self.runtime_root = os.path.join(tempfile.gettempdir(), f"kg-{instance}")
        self.cgroup_prefix = f"kg-{instance}"

    def options(self, agent: str) -> KernelOptions:
        s = self.settings
        return KernelOptions(
            kernelspec_dir=self._kernelspec_dir,
            profile=s.profile_for(agent, "kernel"),
            bwrap=s.bwrap,
            log_dir=os.path.join(s.state_dir, "logs"),
            output_limit=s.output_limit,
            startup_timeout=s.startup_timeout,
            runtime_root=self.runtime_root,
            cgroup_prefix=self.cgroup_prefix,
            read_only=tuple(self.library.read_only_binds(agent)),
            cell_output_limit=s.cell_output_limit,
            run_as=self.run_as(agent),
            log_max_bytes=s.kernel_log_max_bytes,
        )

    def sweep_leftovers(self) -> None:
        """Remove runtime dirs and cgroups of kernels of an earlier run (their kernels are gone)."""
        shutil.rmtree(self.runtime_root, ignore_errors=True)
        # 0711: sandbox uids reach their own (0700) runtime dirs, and cannot list others'.
        os.makedirs(self.runtime_root, mode=0o711, exist_ok=True)
        os.chmod(self.runtime_root, 0o711)
        cgroups.sweep(self.cgroup_prefix + "-")

    def get(self, kernel_id: str) -> Kernel | None:
        return self.kernels.get(kernel_id)

    # --- start and stop -----------------------------------------------------

    async def start(self, agent: str, *, cwd: str, session_dir: str, session: str, kernel_id: str = "") -> Kernel:
        """A kernel for a session: a spare when one is ready (fast), else a fresh one.

        ``kernel_id`` keeps the id of the kernel being replaced (a restart).
        """
        kernel = await self._adopt_spare(agent, cwd, session_dir, session)
        how = "spare"
        if kernel is None:
            how = "cold"
            kernel = await self._start_fresh(agent, cwd=cwd, session_dir=session_dir, session=session)
        if kernel_id:
            kernel.id = kernel_id
        self._register(kernel)
        log_kernel("start", kernel, session=session, pid=kernel.pid, how=how)
        return kernel

    async def _start_fresh(self, agent: str, *, cwd: str, session_dir: str, session: str) -> Kernel:
        return await Kernel.start(
            self.options(agent),
            agent=agent,
            agent_root=self._agent_root(agent),
            cwd=cwd,
            session_dir=session_dir,
            agent_socket=self._agent_socket(agent),
            session=session,
        )

    async def _adopt_spare(self, agent: str, cwd: str, session_dir: str, session: str) -> Kernel | None:
        spare = self.spares.pop(agent, None)
        if spare is None:
            return None
        try:
            if await spare.is_alive():
                await spare.adopt(cwd, session_dir, session)
                return spare
        except BaseException as e:
            await spare.shutdown(now=True)
            if isinstance(e, asyncio.CancelledError):
                raise
            log.warning("spare kernel %s of agent %s could not be adopted: %s", spare.id, agent, e)
            return None
        await spare.shutdown(now=True)
        return None

    def _register(self, kernel: Kernel) -> None:
        self.kernels[kernel.id] = kernel
        kernel.on_death = self._died

    def _died(self, kernel: Kernel) -> None:
        code, sig = kernel.exit_status()
        log_kernel("death", kernel, logging.WARNING, exit_code=code, signal=sig)
        self.on_death(kernel)

    async def stop(self, kernel: Kernel, *, now: bool = False, why: str = "deleted") -> None:
        """Shut a kernel down and forget it.  ``why``: deleted, culled, restart, dead, abandoned."""
        if self.kernels.get(kernel.id) is kernel:
            del self.kernels[kernel.id]
        kernel.on_death = None
        try:
            await kernel.shutdown(now=now)
        finally:
            log_kernel("cull" if why == "culled" else "stop", kernel, why=why)

    def replenish_spare(self, agent: str) -> None:
        """Start the agent's spare kernel in the background, if spares are on and there is room."""
        if not self.settings.spare_kernels or agent in self.spares or agent in self._spare_tasks:
            return
        if not self.library.kernel_enabled(agent):
            return
        if len(self.spares) + len(self._spare_tasks) >= self.settings.max_spare_kernels:
            return

        async def start_spare() -> None:
            try:
                root = self._agent_root(agent)
                kernel = await self._start_fresh(agent, cwd=root, session_dir=root, session="")
                if self.is_agent(agent) and agent not in self.spares and self.library.kernel_enabled(agent):
                    self.spares[agent] = kernel
                    log_kernel("start", kernel, session="", pid=kernel.pid, how="spare")
                else:
                    await kernel.shutdown(now=True)
            except asyncio.CancelledError:
                raise
            except Exception:  # a spare is an optimisation; the next session starts cold
                log.exception("spare kernel of agent %s did not start", agent)
            finally:
                self._spare_tasks.pop(agent, None)

        # Spawned on the event loop thread: --die-with-parent is per thread.
        self._spare_tasks[agent] = asyncio.ensure_future(start_spare())

    async def drop_spare(self, agent: str) -> None:
        spare = self.spares.pop(agent, None)
        if spare is not None:
            await spare.shutdown(now=True)
            log_kernel("stop", spare, why="spare dropped")

    async def shutdown_all(self) -> None:
        tasks = list(self._spare_tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        kernels = list(self.kernels.values()) + list(self.spares.values())
        self.kernels.clear()
        self.spares.clear()
        results = await asyncio.gather(*(k.shutdown(now=True) for k in kernels), return_exceptions=True)
        for kernel, result in zip(kernels, results):
            if isinstance(result, BaseException):
                log.error("kernel %s of agent %s: shutdown failed", kernel.id, kernel.agent, exc_info=result)
            else:
                log_kernel("stop", kernel, why="shutdown")
        shutil.rmtree(self.runtime_root, ignore_errors=True)
