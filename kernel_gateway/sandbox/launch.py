"""Turn a profile into a ready-to-spawn sandboxed command, and spawn it safely.

:func:`prepare` compiles the profile, puts the text of each created file in a
memfd for bwrap to read, creates the sandbox's cgroup, and returns a
:class:`PreparedSandbox`.  Spawning it takes three steps, the same for
kernels, commands and ``doctor``::

    proc = Popen(prepared.argv, ..., **prepared.spawn_kwargs())   # no preexec_fn
    prepared.spawned()            # the gateway's copies of the child's fds are closed
    await prepared.started(proc.pid)   # or started_sync(): into the cgroup, then go

Nothing runs between fork and exec, so ``subprocess`` can use vfork and the
gateway is never forked whole (Python documents ``preexec_fn`` as unsafe in a
threaded process, and copying the gateway's page tables is most of a
command's start-up cost).  Instead one small static exec in front of bwrap,
the spawn helper (:func:`trampoline`, ``spawn_helper.c``), joins the
sandbox's cgroups, sets the resource limits, drops to the agent's uid and
asks to die with the gateway, then execs bwrap: everything of the sandbox is
confined from its first instruction, and the cgroup write never stalls the
event loop (a migration takes a lock that every fork on the host holds for
reading, and bwrap's own clone of its namespaces holds it for milliseconds:
the gateway writing bwrap's pid itself waited ~4 ms per spawn).
The gateway may lack CAP_SYS_RESOURCE, so it cannot ``prlimit`` another uid.

Without the built helper (no C compiler at install time), its Python twin
``spawn_helper.py`` does the same steps in the same order, run by the
gateway's own interpreter (about 12 ms slower per spawn).  Either way a
sandbox is in its cgroups and dies with the gateway from its first
instruction: a gateway killed with ``-9`` at any step of a spawn leaves
nothing outside its cgroups, where the next start's sweep finds it.

Host-side processes (the trampoline, bwrap) get :data:`HOST_ENV` and nothing else:
the sandbox's own environment, the profile's and whatever a request asks
for, reaches only the process inside, through ``--clearenv`` and
``--setenv``.  With ``run_as``, bwrap runs as that unprivileged host uid.

A note on ``--die-with-parent``: Linux ties the parent-death signal to the
*thread* that forked.  Spawn from a long-lived thread (the event loop's), never
from a short-lived worker thread, or the sandbox dies with that thread.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from . import cgroups, reach, seccomp
from .profile import CompiledSandbox, Limits, compile_profile, created_files

#: The whole environment of every host-side process the gateway starts.
HOST_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
#: Where host tools are looked up: never a PATH that a request could set.
HOST_PATH = HOST_ENV["PATH"]
#: A variable name bwrap, sh and execve all read the same way.
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class SandboxUnavailable(RuntimeError):
    """bwrap is missing or cannot run; the message says how to fix it."""


@functools.lru_cache(maxsize=8)  # on every command's path; failures are not cached
def find_bwrap(path: str | None = None) -> str:
    """The absolute path of bwrap, or :class:`SandboxUnavailable` saying how to get it."""
    candidate = path or shutil.which("bwrap", path=HOST_PATH) or shutil.which("bwrap")
    if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
        return os.path.abspath(candidate)
    where = f"at {path!r}" if path else "on PATH"
    raise SandboxUnavailable(
        f"bubblewrap (bwrap) not found {where}; install it with `apt-get install -y bubblewrap`"
        " (Debian/Ubuntu) or `dnf install bubblewrap`, or set the path of bwrap in the config"
    )


@functools.lru_cache(maxsize=4)
def find_tool(name: str) -> str:
    """A host tool (``mkfs.ext4``, ``mount``, ...) from the host's own PATH, never a request's."""
    candidate = shutil.which(name, path=HOST_PATH)
    if not candidate:
        raise SandboxUnavailable(f"{name} not found in {HOST_PATH}")
    return candidate


HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kg-spawn-helper")
HELPER_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "spawn_helper.c")
#: The helper's twin in Python, for a gateway installed without a C compiler.
HELPER_PY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "spawn_helper.py")


@functools.lru_cache(maxsize=1)
def find_helper() -> str | None:
    """The built spawn helper (``scripts/install.sh`` compiles it), or None to use its Python twin.

    Only a file no one else may change: the gateway execs it as root.  The
    twin is also chosen when the gateway's environment has
    ``KERNEL_GATEWAY_SPAWN_HELPER=python`` (to compare the two, or rule one out).
    """
    if os.environ.get("KERNEL_GATEWAY_SPAWN_HELPER") == "python":
        return None
    try:
        st = os.stat(HELPER)
    except OSError:
        return None
    trusted = st.st_uid in (0, os.geteuid()) and not st.st_mode & 0o022
    if not trusted or not os.access(HELPER, os.X_OK):
        return None
    return HELPER


def helper_argv(helper: str | None) -> list[str]:
    """How the spawn helper is run: the built one, or its twin under this very interpreter."""
    if helper is not None:
        return [helper]
    return [sys.executable, "-I", "-S", "-B", HELPER_PY]


def trampoline(
    rlimits: Sequence[tuple[int, int]],
    run_as: "RunAs | None",
    helper: str | None = None,
    cgroup_procs: Sequence[str] = (),
) -> list[str]:
    """The exec before bwrap: join the cgroups, set the rlimits, drop to the sandbox's uid, die with us.

    One small static exec (``helper``, built from ``spawn_helper.c``), or the
    same program in Python (:data:`HELPER_PY`) where it is not built.  Each
    changes only its own process, so the gateway itself is never forked:
    ``subprocess`` uses vfork.
    """
    argv = helper_argv(helper) + [f"--cgroup={path}" for path in cgroup_procs]
    argv += [f"--rlimit={int(which)}:{value}" for which, value in rlimits]
    if run_as is not None:
        argv += [f"--uid={run_as.uid}", f"--gid={run_as.gid}"]
    return argv + [f"--parent={os.getpid()}", "--"]


def exit_status(returncode: int | None) -> tuple[int | None, int | None]:
    """(exit code, signal number) of a sandbox: bwrap reports a child killed by signal N as 128+N."""
    if returncode is None:
        return None, None
    if returncode < 0:
        return None, -returncode
    if 128 < returncode <= 128 + signal.SIGRTMAX:
        return returncode, returncode - 128
    return returncode, None


def check_env_name(name: Any) -> bool:
    return isinstance(name, str) and ENV_NAME.fullmatch(name) is not None


def env_argv(env: Mapping[str, str]) -> list[str]:
    """bwrap options giving the sandboxed process exactly ``env`` (plus bwrap's PWD)."""
    argv = ["--clearenv"]
    for name, value in env.items():
        if not check_env_name(name) or not isinstance(value, str) or "\0" in value:
            raise ValueError(f"invalid environment variable {name!r}")
        argv += ["--setenv", name, value]
    return argv


@dataclass(frozen=True)
class RunAs:
    """The host uid and gid a sandbox runs as (its own group; no supplementary groups).

    ``max_processes`` becomes RLIMIT_NPROC: it counts every process of the
    uid, so with one uid per agent it caps the agent's sandboxes together.
    """

    uid: int
    gid: int
    max_processes: int | None = None


def _rlimits(limits: Limits, with_nproc: bool, per_uid: int | None = None) -> list[tuple[int, int]]:
    chosen = [(resource.RLIMIT_CORE, 0)]
    if limits.cpu_seconds is not None:
        chosen.append((resource.RLIMIT_CPU, limits.cpu_seconds))
    if limits.file_size is not None:
        chosen.append((resource.RLIMIT_FSIZE, limits.file_size))
    if limits.memory is not None:
        chosen.append((resource.RLIMIT_AS, limits.memory))
    nproc = [n for n in (limits.processes if with_nproc else None, per_uid) if n is not None]
    if nproc:
        chosen.append((resource.RLIMIT_NPROC, min(nproc)))
    return chosen


def _memfd(name: str, text: str) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    # A placeholder may be a path the agent named with bytes that are not UTF-8 (a working
    # directory in /etc/passwd): written back as the bytes they were, like every other path.
    os.write(fd, text.encode("utf-8", "surrogateescape"))
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
    run_as: RunAs | None = None

    @property
    def limits(self) -> Limits:
        return self.compiled.limits

    @property
    def env(self) -> dict[str, str]:
        """The environment of the sandboxed process."""
        return self.compiled.env

    def spawn_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for Popen / create_subprocess_exec (with ``*self.argv``)."""
        return {
            "env": dict(HOST_ENV),
            "pass_fds": tuple(self.data_fds),
            "start_new_session": True,
            "close_fds": True,
        }

    def spawned(self) -> None:
        """Call once the child exists: bwrap holds its own copies of its fds."""
        for fd in self.data_fds:
            os.close(fd)
        self.data_fds = []

    async def finish(self, timeout: float = 2.0) -> bool:
        """:meth:`cleanup` for the event loop: polls the emptying cgroup in short steps.

        bwrap returns before its sandbox's init has finished exiting (it tears
        the namespaces down), so the first pass usually finds it still there
        for a millisecond or two; waiting in 20 ms steps would be most of a
        command's time.
        """
        deadline, delay = time.monotonic() + timeout, 0.0005
        while not self.cleanup(timeout=0):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.02)
        return True

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


def _reachable_argv(argv: list[str], run_as: RunAs) -> list[str]:
    """Bind sources the sandbox uid cannot reach are bound from a reachable alias."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return out + argv[i:]
        if arg in ("--bind", "--bind-try", "--ro-bind", "--ro-bind-try", "--dev-bind", "--dev-bind-try"):
            out += [arg, reach.reachable(argv[i + 1], run_as.uid, run_as.gid), argv[i + 2]]
            i += 3
            continue
        out.append(arg)
        i += 1
    return out


def prepare(
    profile: Mapping[str, Any],
    values: Mapping[str, str],
    command: Sequence[str] | None = None,
    *,
    bwrap: str | None = None,
    name: str = "sandbox",
    extra_env: Mapping[str, str] | None = None,
    use_cgroups: bool = True,
    run_as: RunAs | None = None,
    spawn_helper: bool = True,
) -> PreparedSandbox:
    """Compile ``profile`` for one launch of ``command`` (or the profile's own command).

    ``extra_env`` is added to the profile's environment, inside the sandbox
    only.  ``run_as`` is the host uid and gid to run as (default: the
    gateway's own).
    """
    bwrap_path = find_bwrap(bwrap)
    if run_as is not None and run_as.uid == os.geteuid() and run_as.gid == os.getegid():
        run_as = None  # already that uid: nothing to drop
    files = created_files(profile, values)
    fds = [_memfd(f"created-file-{i}", text) for i, (_at, text) in enumerate(files)]
    try:
        # The seccomp filter is one more memfd that bwrap reads (--seccomp FD).
        sandbox = profile["sandbox"]
        filter_fd = seccomp.filter_fd(sandbox.get("nested_userns", False)) if sandbox.get("seccomp", True) else None
        fds += [] if filter_fd is None else [filter_fd]
        compiled = compile_profile(profile, values, bwrap=bwrap_path, data_fds=fds[: len(files)], seccomp_fd=filter_fd)
        if extra_env:
            compiled.env.update(extra_env)
        environment = env_argv(compiled.env)
        command = list(command) if command is not None else compiled.command
        if not command:
            raise ValueError("no command to run: pass one or set process.command in the profile")
        helper = find_helper() if spawn_helper else None
        bwrap_argv = compiled.argv[:-1] + environment + ["--"]
        if run_as is not None:
            bwrap_argv = _reachable_argv(bwrap_argv, run_as)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
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
        # RLIMIT_NPROC counts every process of the host uid: per sandbox only a fallback.
        rlimits = _rlimits(limits, with_nproc=group is None, per_uid=run_as.max_processes if run_as else None)
        prefix = trampoline(rlimits, run_as, helper, group.procs_files() if group is not None else ())
    except BaseException:  # a limit that cannot be set: nothing starts, nothing leaks
        for fd in fds:
            os.close(fd)
        raise
    return PreparedSandbox(
        compiled=compiled,
        argv=prefix + bwrap_argv + command,
        data_fds=fds,
        cgroup=group,
        rlimits=rlimits,
        run_as=run_as,
    )


async def spawn(prepared: PreparedSandbox, **kwargs: Any) -> asyncio.subprocess.Process:
    """Start a prepared sandbox from the event loop; ``kwargs`` go to ``create_subprocess_exec``
    (stdin, stdout, stderr).  A spawn that fails cleans the sandbox up.
    """
    try:
        process = await asyncio.create_subprocess_exec(*prepared.argv, **kwargs, **prepared.spawn_kwargs())
    except BaseException:
        prepared.cleanup()
        raise
    prepared.spawned()
    return process


def run_to_end(prepared: PreparedSandbox, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run a prepared sandbox to its end, blocking, and collect its output as text (doctor, tests)."""
    proc = subprocess.Popen(
        prepared.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, **prepared.spawn_kwargs(),
    )  # fmt: skip
    prepared.spawned()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return subprocess.CompletedProcess(prepared.argv, proc.returncode, out, err)
