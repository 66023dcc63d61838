"""Per-sandbox cgroups: the process and memory caps that rlimits cannot give.

``RLIMIT_NPROC`` counts every process of a host uid and is not enforced at
all when the host uid is 0, so one agent's fork bomb could starve the others
or the gateway.  Where the host lets us (root, or a delegated subtree), each
sandbox gets its own cgroup with ``pids.max`` and a memory cap.  Both the
cgroup v1 controllers and the unified v2 hierarchy are supported.  When
neither is writable, :func:`create` returns None and the caller falls back to
rlimits alone (``kernel-gateway doctor`` says so).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from dataclasses import dataclass

PARENT = "kernel-gateway"


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
                    for controller in ("pids", "memory"):
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


def _v2_parent(mount: str) -> str | None:
    """<mount>/kernel-gateway with pids and memory enabled for its children."""
    parent = os.path.join(mount, PARENT)
    try:
        available = open(os.path.join(mount, "cgroup.controllers")).read().split()
    except OSError:
        return None
    if "pids" not in available or not _writable_dir(parent):
        return None
    wanted = [c for c in ("pids", "memory") if c in available]
    for where in (mount, parent):
        _write(os.path.join(where, "cgroup.subtree_control"), " ".join("+" + c for c in wanted))
    return parent


@dataclass
class SandboxCgroup:
    """The cgroup directories of one sandbox (one per v1 controller, or one v2)."""

    dirs: list[str]
    mechanism: str

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
                return
            time.sleep(0.02)


def create(name: str, processes: int | None, memory: int | None) -> SandboxCgroup | None:
    """A fresh cgroup with the given caps, or None where cgroups are not ours to use."""
    leaf = f"{name}-{uuid.uuid4().hex[:8]}"
    mounts = _mounts()
    if "pids" in mounts:
        dirs = []
        pids_dir = os.path.join(mounts["pids"] + _own_cgroup("pids"), PARENT, leaf)
        if _writable_dir(pids_dir):
            dirs.append(pids_dir)
            _write(os.path.join(pids_dir, "pids.max"), str(processes) if processes else "max")
            if "memory" in mounts and memory:
                mem_dir = os.path.join(mounts["memory"] + _own_cgroup("memory"), PARENT, leaf)
                if _writable_dir(mem_dir):
                    dirs.append(mem_dir)
                    _write(os.path.join(mem_dir, "memory.limit_in_bytes"), str(memory))
            return SandboxCgroup(dirs, "cgroup v1 (pids" + (", memory)" if len(dirs) > 1 else ")"))
    if "unified" in mounts:
        parent = _v2_parent(mounts["unified"])
        if parent:
            leaf_dir = os.path.join(parent, leaf)
            if _writable_dir(leaf_dir) and os.path.exists(os.path.join(leaf_dir, "pids.max")):
                _write(os.path.join(leaf_dir, "pids.max"), str(processes) if processes else "max")
                if memory:
                    _write(os.path.join(leaf_dir, "memory.max"), str(memory))
                return SandboxCgroup([leaf_dir], "cgroup v2")
            try:
                os.rmdir(leaf_dir)
            except OSError:
                pass
    return None


def _parents() -> list[str]:
    """Every kernel-gateway parent directory this process would create leaves in."""
    mounts, parents = _mounts(), []
    for controller in ("pids", "memory"):
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
    return removed


def describe() -> str | None:
    """Which cgroup mechanism sandboxes get here, or None."""
    # Probe with a memory cap too, or the memory controller is never tried.
    group = create("probe", 8, 64 << 20)
    if group is None:
        return None
    group.remove()
    return group.mechanism
