"""Per-sandbox cgroups: the process and memory caps that rlimits cannot give.

``RLIMIT_NPROC`` counts every process of a host uid and is not enforced at
all when the host uid is 0, so one agent's fork bomb could starve the others
or the gateway.  Where the host lets us (root, or a delegated subtree), each
sandbox gets its own cgroup with ``pids.max`` and a memory cap.  Both the
cgroup v1 controllers and the unified v2 hierarchy are supported.  When
neither is writable, :func:`create` returns None and the caller falls back to
rlimits alone (``kernel-gateway doctor`` says so).

CPU: every sandbox gets a CPU weight (v2 ``cpu.weight``, v1 ``cpu.shares``
scaled from it, 100 <-> 1024) and, when its profile asks, a hard cap
(``cpu.max`` / ``cpu.cfs_quota_us``).  The weights are per agent, not per
sandbox: each agent has a parent group ``kernel-gateway.agent-<key>-<hash>``
with the default weight, and its sandboxes share that agent's part.  So four
busy sessions of one agent get no more CPU than one session of another.  The
agent groups sit beside ``kernel-gateway/``, not inside it: inside one shared
parent that busy agents keep saturated, an idle agent's kernel would wait for
that parent's turn on every wake-up; beside it, the idle agent's own group
is the one that slept, and the scheduler runs it at once.

A limit that cannot be written fails the start (:class:`LimitNotApplied`): a
cap that silently does not hold is worse than none.  Only the absence of a
controller falls back (to rlimits for processes and memory; for CPU, to no
weight, and a cap then fails the start too).
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import signal
import time
import uuid
from dataclasses import dataclass
from typing import Mapping

from ..errors import GatewayError

PARENT = "kernel-gateway"
AGENT_GROUP_PREFIX = f"{PARENT}.agent-"
CFS_PERIOD_US = 100_000


class LimitNotApplied(GatewayError):
    """A cgroup limit could not be written: the sandbox does not start."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(503, "limit_not_applied", message, hint)


def agent_group_name(values: Mapping[str, str]) -> str | None:
    """The per-agent CPU group of a sandbox: key plus a hash of its tree (two gateways never share one)."""
    agent, root = values.get("agent"), values.get("agent_root")
    if not agent or not root:
        return None
    return f"{AGENT_GROUP_PREFIX}{agent}-{hashlib.sha256(root.encode()).hexdigest()[:8]}"


def v1_shares(weight: int) -> int:
    """cgroup v1 cpu.shares for a v2 cpu.weight (100 is the default of both: 1024 shares)."""
    return max(2, min(262144, weight * 1024 // 100))


@functools.lru_cache(maxsize=8)  # on every sandbox's path; the gateway's own cgroup stays put
def _own_cgroup(controller: str) -> str:
    """This process's cgroup path under one v1 controller ("" for v2)."""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _id, controllers, path = line.rstrip("\n").split(":", 2)
                if controller in controllers.split(","):
                    return path
    except OSError:
        pass
    return "/"


@functools.lru_cache(maxsize=1)  # on every sandbox's path: /proc/self/mounts can be long
def _mounts() -> dict[str, str]:
    """Mount points: {"pids": ..., "memory": ..., "unified": ...} where present."""
    found: dict[str, str] = {}
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                _dev, where, kind, options = line.split()[:4]
                if kind == "cgroup2":
                    found.setdefault("unified", where)
                elif kind == "cgroup":
                    for controller in ("pids", "memory", "cpu"):
                        if controller in options.split(","):
                            found.setdefault(controller, where)
    except OSError:
        pass
    return found


def _writable_dir(path: str) -> bool:
    try:
        os.makedirs(path, exist_ok=True)
        return os.access(path, os.W_OK)
    except OSError:
        return False


def _write(path: str, text: str) -> bool:
    try:
        with open(path, "w") as f:
            f.write(text)
        return True
    except OSError:
        return False


def _set_limit(path: str, text: str) -> None:
    """Write one limit, or :class:`LimitNotApplied` naming it."""
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        raise LimitNotApplied(
            f"cannot set the sandbox limit {os.path.basename(path)}={text} in {os.path.dirname(path)}: {e.strerror}",
            "the cgroup hierarchy is not writable as expected; `kernel-gateway doctor` shows what is in force",
        ) from None


def _make_under(parent_dir: str, leaf: str) -> str:
    """mkdir parent/leaf, re-creating the parent if an emptied agent group was just removed."""
    for _attempt in range(3):
        try:
            os.makedirs(parent_dir, exist_ok=True)
            os.mkdir(os.path.join(parent_dir, leaf))
            return os.path.join(parent_dir, leaf)
        except FileNotFoundError:
            continue
    raise LimitNotApplied(f"cannot create the cgroup {os.path.join(parent_dir, leaf)}")


def _v2_parent(mount: str) -> str | None:
    """<mount>/kernel-gateway with pids and memory enabled for its children."""
    parent = os.path.join(mount, PARENT)
    try:
        available = open(os.path.join(mount, "cgroup.controllers")).read().split()
    except OSError:
        return None
    if "pids" not in available or not _writable_dir(parent):
        return None
    wanted = [c for c in ("pids", "memory", "cpu") if c in available]
    for where in (mount, parent):
        _write(os.path.join(where, "cgroup.subtree_control"), " ".join("+" + c for c in wanted))
    return parent


@dataclass
class SandboxCgroup:
    """The cgroup directories of one sandbox (one per v1 controller, or one v2)."""

    dirs: list[str]
    mechanism: str
    groups: tuple[str, ...] = ()  # per-agent parents, removed once empty

    @property
    def cpu(self) -> bool:
        return "cpu" in self.mechanism

    def procs_files(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def pids(self) -> set[int]:
        found: set[int] = set()
        for path in self.procs_files():
            try:
                with open(path) as f:
                    found.update(int(line) for line in f if line.strip())
            except OSError:
                pass
        return found

    def remove(self, timeout: float = 2.0) -> None:
        """Kill whatever is still inside, then remove the directories."""
        deadline = time.monotonic() + timeout
        while True:
            pids = self.pids()
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for d in list(self.dirs):
                try:
                    os.rmdir(d)
                    self.dirs.remove(d)
                except FileNotFoundError:
                    self.dirs.remove(d)
                except OSError:
                    pass
            if not self.dirs or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        if not self.dirs:
            for group in self.groups:  # busy while another sandbox of the agent lives: fine
                try:
                    os.rmdir(group)
                except OSError:
                    pass


def _cpu_limits(leaf_dir: str, v2: bool, cpu_weight: int, cpu_max: float | None) -> None:
    if v2:
        _set_limit(os.path.join(leaf_dir, "cpu.weight"), str(cpu_weight))
        if cpu_max is not None:
            _set_limit(os.path.join(leaf_dir, "cpu.max"), f"{max(1000, int(cpu_max * CFS_PERIOD_US))} {CFS_PERIOD_US}")
        return
    _set_limit(os.path.join(leaf_dir, "cpu.shares"), str(v1_shares(cpu_weight)))
    if cpu_max is not None:
        _set_limit(os.path.join(leaf_dir, "cpu.cfs_period_us"), str(CFS_PERIOD_US))
        _set_limit(os.path.join(leaf_dir, "cpu.cfs_quota_us"), str(max(1000, int(cpu_max * CFS_PERIOD_US))))


def _no_cpu_cap(cpu_max: float | None) -> None:
    if cpu_max is not None:
        raise LimitNotApplied(
            f"the profile caps CPU (limits.cpu_max={cpu_max:g}) but no cpu cgroup controller is writable here",
            "run the gateway as root with the cpu controller mounted, or remove limits.cpu_max",
        )


def create(
    name: str,
    processes: int | None,
    memory: int | None,
    *,
    cpu_weight: int = 100,
    cpu_max: float | None = None,
    agent_group: str | None = None,
) -> SandboxCgroup | None:
    """A fresh cgroup with the given caps, or None where cgroups are not ours to use.

    ``agent_group`` (see :func:`agent_group_name`) nests the CPU part under that
    agent's parent group; a limit that cannot be written raises :class:`LimitNotApplied`.
    """
    leaf = f"{name}-{uuid.uuid4().hex[:8]}"
    mounts = _mounts()
    if "pids" in mounts:
        dirs: list[str] = []
        pids_dir = os.path.join(mounts["pids"] + _own_cgroup("pids"), PARENT, leaf)
        if _writable_dir(pids_dir):
            group = SandboxCgroup(dirs, "")
            dirs.append(pids_dir)
            try:
                _set_limit(os.path.join(pids_dir, "pids.max"), str(processes) if processes else "max")
                kinds = ["pids"]
                if "memory" in mounts and memory:
                    mem_dir = os.path.join(mounts["memory"] + _own_cgroup("memory"), PARENT, leaf)
                    if _writable_dir(mem_dir):
                        dirs.append(mem_dir)
                        _set_limit(os.path.join(mem_dir, "memory.limit_in_bytes"), str(memory))
                        kinds.append("memory")
                cpu_base = mounts["cpu"] + _own_cgroup("cpu") if "cpu" in mounts else None
                cpu_parent = os.path.join(cpu_base, PARENT) if cpu_base else None
                if cpu_parent and _writable_dir(cpu_parent):
                    if agent_group:
                        group.groups = (os.path.join(cpu_base, agent_group),)
                        cpu_dir = _make_under(group.groups[0], leaf)
                        # Every agent's group has the default weight: agents share alike.
                        _set_limit(os.path.join(group.groups[0], "cpu.shares"), str(v1_shares(100)))
                    else:
                        cpu_dir = _make_under(cpu_parent, leaf)
                    dirs.append(cpu_dir)
                    _cpu_limits(cpu_dir, False, cpu_weight, cpu_max)
                    kinds.append("cpu")
                else:
                    _no_cpu_cap(cpu_max)
            except BaseException:
                group.remove(0)
                raise
            group.mechanism = f"cgroup v1 ({', '.join(kinds)})"
            return group
    if "unified" in mounts:
        parent = _v2_parent(mounts["unified"])
        if parent:
            group = SandboxCgroup([], "cgroup v2")
            try:
                where = parent
                if agent_group:
                    where = os.path.join(mounts["unified"], agent_group)
                    os.makedirs(where, exist_ok=True)
                    group.groups = (where,)
                    _write(os.path.join(where, "cgroup.subtree_control"), "+pids +memory +cpu")
                leaf_dir = _make_under(where, leaf)
                group.dirs.append(leaf_dir)
                if os.path.exists(os.path.join(leaf_dir, "pids.max")):
                    _set_limit(os.path.join(leaf_dir, "pids.max"), str(processes) if processes else "max")
                    if memory:
                        _set_limit(os.path.join(leaf_dir, "memory.max"), str(memory))
                    if os.path.exists(os.path.join(leaf_dir, "cpu.weight")):
                        _cpu_limits(leaf_dir, True, cpu_weight, cpu_max)
                        group.mechanism = "cgroup v2 (pids, memory, cpu)"
                    else:
                        _no_cpu_cap(cpu_max)
                        group.mechanism = "cgroup v2 (pids, memory)"
                    return group
            except OSError:
                pass
            except BaseException:
                group.remove(0)
                raise
            group.remove(0)
    _no_cpu_cap(cpu_max)
    return None


def _parents() -> list[str]:
    """Every kernel-gateway parent directory this process would create leaves in."""
    mounts, parents = _mounts(), []
    for controller in ("pids", "memory", "cpu"):
        if controller in mounts:
            parents.append(os.path.join(mounts[controller] + _own_cgroup(controller), PARENT))
    if "unified" in mounts:
        parents.append(os.path.join(mounts["unified"], PARENT))
    return parents


def sweep(prefix: str) -> int:
    """Kill and remove leftover cgroups whose name starts with ``prefix``; return how many.

    A gateway killed with SIGKILL cannot clean up: its kernels die with it
    (--die-with-parent) but their empty cgroups stay until the next start.
    """
    removed = 0
    for parent in _parents():
        try:
            names = [n for n in os.listdir(parent) if n.startswith(prefix)]
        except OSError:
            continue
        for name in names:
            group = SandboxCgroup([os.path.join(parent, name)], "leftover")
            group.remove()
            removed += not group.dirs
        base = os.path.dirname(parent)
        try:
            agent_groups = [n for n in os.listdir(base) if n.startswith(AGENT_GROUP_PREFIX)]
        except OSError:
            agent_groups = []
        for agent_group in agent_groups:
            where = os.path.join(base, agent_group)
            try:
                names = [n for n in os.listdir(where) if n.startswith(prefix)]
            except OSError:
                continue
            for name in names:
                group = SandboxCgroup([os.path.join(where, name)], "leftover", (where,))
                group.remove()
                removed += not group.dirs
    return removed


def describe() -> str | None:
    """Which cgroup mechanism sandboxes get here, or None."""
    # Probe with a memory cap too, or the memory controller is never tried.
    group = create("probe", 8, 64 << 20, agent_group=f"{AGENT_GROUP_PREFIX}probe-{os.getpid()}")
    if group is None:
        return None
    group.remove()
    return group.mechanism


def cpu_mechanism(mechanism: str | None) -> str:
    """How CPU is shared, given :func:`describe`'s answer."""
    if mechanism and "cpu" in mechanism:
        files = "cpu.weight, cpu.max" if mechanism.startswith("cgroup v2") else "cpu.shares, cpu.cfs_quota_us"
        return f"{mechanism.split(' (')[0]} {files}: equal weight per agent, the profile's cpu_weight per sandbox"
    return "none: no writable cpu cgroup, so an agent's busy loop competes with everyone at the same priority"
