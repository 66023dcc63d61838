"""Turn a profile into a ready-to-spawn sandboxed command.

:func:`prepare` compiles the profile, puts the text of each created file in a
memfd for bwrap to read, creates the sandbox's cgroup, and returns the keyword
arguments for ``subprocess.Popen`` or ``asyncio.create_subprocess_exec``.  The
resource limits are applied in the child between fork and exec, so they hold
for bwrap and everything it starts.

A note on ``--die-with-parent``: Linux ties the parent-death signal to the
*thread* that forked.  Spawn from a long-lived thread (the event loop's), never
from a short-lived worker thread, or the sandbox dies with that thread.
"""

from __future__ import annotations

import asyncio
import functools
import os
import resource
import shutil
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from . import cgroups, seccomp
from .profile import CompiledSandbox, Limits, compile_profile, created_files


class SandboxUnavailable(RuntimeError):
    """bwrap is missing or cannot run; the message says how to fix it."""


@functools.lru_cache(maxsize=8)  # on every command's path; failures are not cached
def find_bwrap(path: str | None = None) -> str:
    """The absolute path of bwrap, or :class:`SandboxUnavailable` saying how to get it."""
    candidate = path or shutil.which("bwrap")
    if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
        return os.path.abspath(candidate)
    where = f"at {path!r}" if path else "on PATH"
    raise SandboxUnavailable(
        f"bubblewrap (bwrap) not found {where}; install it with `apt-get install -y bubblewrap`"
        " (Debian/Ubuntu) or `dnf install bubblewrap`, or set the path of bwrap in the config"
    )


def exit_status(returncode: int | None) -> tuple[int | None, int | None]:
    """(exit code, signal number) of a sandbox: bwrap reports a child killed by signal N as 128+N."""
    if returncode is None:
        return None, None
    if returncode < 0:
        return None, -returncode
    if 128 < returncode <= 128 + signal.SIGRTMAX:
        return returncode, returncode - 128
    return returncode, None


def _rlimits(limits: Limits, with_nproc: bool) -> list[tuple[int, int]]:
    chosen = [(resource.RLIMIT_CORE, 0)]
    if limits.cpu_seconds is not None:
        chosen.append((resource.RLIMIT_CPU, limits.cpu_seconds))
    if limits.file_size is not None:
        chosen.append((resource.RLIMIT_FSIZE, limits.file_size))
    if limits.memory is not None:
        chosen.append((resource.RLIMIT_AS, limits.memory))
    if with_nproc and limits.processes is not None:
        chosen.append((resource.RLIMIT_NPROC, limits.processes))
    return chosen


def _memfd(name: str, text: str) -> int:
    fd = os.memfd_create(name, 0)
    os.write(fd, text.encode())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


@dataclass
class PreparedSandbox:
    """A compiled sandbox plus the per-launch resources it needs."""

    compiled: CompiledSandbox
    argv: list[str]
    data_fds: list[int]
    cgroup: cgroups.SandboxCgroup | None
    rlimits: list[tuple[int, int]] = field(default_factory=list)

    @property
    def limits(self) -> Limits:
        return self.compiled.limits

    def _in_child(self) -> None:
        # Runs between fork and exec: no allocation-heavy work, no locks.
        for which, value in self.rlimits:
            resource.setrlimit(which, (value, value))
        if self.cgroup is not None:
            pid = str(os.getpid()).encode()
            for path in self.cgroup.procs_files():
                fd = os.open(path, os.O_WRONLY)
                try:
                    os.write(fd, pid)
                finally:
                    os.close(fd)

    def spawn_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for Popen / create_subprocess_exec (with ``*self.argv``)."""
        return {
            "env": self.compiled.env,
            "pass_fds": tuple(self.data_fds),
            "preexec_fn": self._in_child,
            "start_new_session": True,
            "close_fds": True,
        }

    def spawned(self) -> None:
        """Call once the child exists: bwrap holds its own copies of the data fds."""
        for fd in self.data_fds:
            os.close(fd)
        self.data_fds = []

    def cleanup(self, timeout: float = 2.0) -> bool:
        """Call once the sandbox has ended: kills stragglers and removes the cgroup.

        Returns whether everything is gone; with ``timeout=0`` it makes one
        quick pass, which is all it takes once bwrap has exited (its pid
        namespace ends with it), so callers can skip a worker thread.
        """
        self.spawned()
        if self.cgroup is not None:
            self.cgroup.remove(timeout)
            if self.cgroup.dirs:
                return False
            self.cgroup = None
        return True


    async def cleanup_async(self, timeout: float = 2.0) -> bool:
        """:meth:`cleanup` for the event loop: it waits between passes without blocking the loop."""
        deadline = time.monotonic() + timeout
        while not self.cleanup(timeout=0):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True


def prepare(
    profile: Mapping[str, Any],
    values: Mapping[str, str],
    command: Sequence[str] | None = None,
    *,
    bwrap: str | None = None,
    name: str = "sandbox",
    extra_env: Mapping[str, str] | None = None,
    use_cgroups: bool = True,
) -> PreparedSandbox:
    """Compile ``profile`` for one launch of ``command`` (or the profile's own command)."""
    bwrap_path = find_bwrap(bwrap)
    files = created_files(profile, values)
    fds = [_memfd(f"created-file-{i}", text) for i, (_at, text) in enumerate(files)]
    try:
        # The seccomp filter is one more memfd that bwrap reads (--seccomp FD).
        sandbox = profile["sandbox"]
        filter_fd = seccomp.filter_fd(sandbox.get("nested_userns", False)) if sandbox.get("seccomp", True) else None
        fds += [] if filter_fd is None else [filter_fd]
        compiled = compile_profile(profile, values, bwrap=bwrap_path, data_fds=fds[: len(files)], seccomp_fd=filter_fd)
    except Exception:
        for fd in fds:
            os.close(fd)
        raise
    if extra_env:
        compiled.env.update(extra_env)
    command = list(command) if command is not None else compiled.command
    if not command:
        raise ValueError("no command to run: pass one or set process.command in the profile")
    limits = compiled.limits
    try:
        group = (
            cgroups.create(
                name, limits.processes, limits.memory,
                cpu_weight=limits.cpu_weight, cpu_max=limits.cpu_max, agent_group=cgroups.agent_group_name(values),
            )  # fmt: skip
            if use_cgroups
            else None
        )
    except Exception:  # a limit that cannot be set: nothing starts, nothing leaks
        for fd in fds:
            os.close(fd)
        raise
    # RLIMIT_NPROC counts every process of the host uid: only a fallback.
    return PreparedSandbox(
        compiled=compiled,
        argv=compiled.argv + command,
        data_fds=fds,
        cgroup=group,
        rlimits=_rlimits(limits, with_nproc=group is None),
    )

