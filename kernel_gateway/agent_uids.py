"""One unprivileged host uid per agent: who its sandboxes run as and who owns its tree.

A gateway running as root gives each agent its own uid (and a group of the
same number) from ``Gateway.agent_uid_start`` on, recorded in
``<state>/agent-uids.json`` so that an agent keeps its uid, and therefore
the ownership of its files, across restarts.  A gateway that is not root
cannot switch uids: its sandboxes run as its own uid, as before.

The agent's tree is made its own with ``fchown`` through file descriptors
opened without following symlinks, so nothing the agent placed in its tree
can turn the gateway's chown onto a file elsewhere.
"""

from __future__ import annotations

import ctypes
import json
import os
import stat
import threading

from .errors import GatewayError
from .sandbox.launch import RunAs
from . import state_files

FILE_NAME = "agent-uids.json"


class UidRangeExhausted(GatewayError):
    """Every uid of the configured range is taken."""

    def __init__(self, start: int, count: int):
        super().__init__(
            503,
            "uid_range_exhausted",
            f"all {count} agent uids from {start} are taken",
            "raise --Gateway.agent_uid_count, or move the range with --Gateway.agent_uid_start",
        )


class AgentUids:
    """The registry of agent uids in one state directory.

    ``root`` is where agents' trees live: a tree that exists when its agent
    first gets a uid (one made before per-agent uids) is handed over then.
    ``max_processes`` is RLIMIT_NPROC of every sandbox of an agent: with a
    uid of its own, it bounds all of that agent's processes together.
    ``keep`` names top-level entries of a tree that stay the gateway's.
    """

    def __init__(
        self,
        state_dir: str,
        start: int,
        count: int,
        *,
        root: str | None = None,
        max_processes: int | None = None,
        keep: tuple[str, ...] = (),
        enabled: bool | None = None,
    ):
        self.path = os.path.join(state_dir, FILE_NAME)
        self.root = root
        self.keep = tuple(keep)
        self.max_processes = max_processes if max_processes and max_processes > 0 else None
        self.start, self.count = start, count
        self.enabled = (os.geteuid() == 0 and start > 0) if enabled is None else enabled
        self._lock = threading.Lock()
        self._uids: dict[str, int] = {}
        try:
            with open(self.path) as f:
                saved = json.load(f)
            self._uids = {a: u for a, u in saved.get("agents", {}).items() if isinstance(u, int)}
        except (OSError, ValueError, AttributeError):
            pass

    def describe(self) -> str:
        if self.enabled:
            return f"sandboxes run as per-agent host uids from {self.start}"
        return f"sandboxes run as the gateway's own uid {os.geteuid()} (it is not root)"

    def run_as(self, agent: str) -> RunAs | None:
        """The agent's host uid and gid (allocated on first use); None: the gateway's own."""
        if not self.enabled:
            return None
        with self._lock:
            uid = self._uids.get(agent)
            if uid is None:
                taken = set(self._uids.values())
                free = (u for u in range(self.start, self.start + self.count) if u not in taken)
                uid = next(free, None)
                if uid is None:
                    raise UidRangeExhausted(self.start, self.count)
                self._uids[agent] = uid
                self._save()
                if self.root and os.path.isdir(os.path.join(self.root, agent)):
                    own_tree(os.path.join(self.root, agent), uid, uid, self.keep)
        return RunAs(uid, uid, self.max_processes)

    def _save(self) -> None:
        state_files.write_json(self.path, {"agents": self._uids}, mode=0o600, indent=1, sort_keys=True)

    def own_tree(self, agent: str, top: str) -> None:
        """Make the agent's tree its own: the root 0700, and what the gateway made in it."""
        run_as = self.run_as(agent)
        if run_as is None:
            return
        own_tree(top, run_as.uid, run_as.gid, self.keep)


def own_tree(top: str, uid: int, gid: int, keep: tuple[str, ...] = ()) -> None:
    """chown ``top`` (mode 0700) and what in it is still owned by root: its top level, and the first time everything.

    Only root-owned entries change hands: the gateway made them (or an earlier
    version's root-uid sandboxes did).  Regular files with several links are
    left alone, so a hard link cannot hand the agent a file from elsewhere.
    The entries named in ``keep`` (at the top) stay the gateway's, with all
    beneath them: what the operator manages there is not the agent's.
    """
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        first_time = st.st_uid != uid
        if first_time:
            for dirpath, dirnames, filenames, dir_fd in os.fwalk(dir_fd=fd, follow_symlinks=False):
                if dirpath == ".":
                    dirnames[:] = [n for n in dirnames if n not in keep]
                    filenames = [n for n in filenames if n not in keep]
                for name in dirnames + filenames:
                    _own_entry(name, dir_fd, uid, gid)
            os.fchown(fd, uid, gid)
        else:  # what the gateway laid out since (a new directory of the layout)
            for name in os.listdir(fd):
                if name not in keep:
                    _own_entry(name, fd, uid, gid)
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


_libc = ctypes.CDLL(None, use_errno=True)
_AT_EMPTY_PATH = 0x1000


def _own_entry(name: str, dir_fd: int, uid: int, gid: int) -> None:
    # The checked inode is the one that changes hands: an O_PATH fd of the entry itself (a
    # symlink is not followed), fstat'd, then chowned through that fd (fchownat with
    # AT_EMPTY_PATH), so a running sandbox that swaps the name meanwhile changes nothing.
    try:
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return
    try:
        st = os.fstat(fd)
        if st.st_uid != 0 or (stat.S_ISREG(st.st_mode) and st.st_nlink > 1):
            return
        if _libc.fchownat(fd, b"", uid, gid, _AT_EMPTY_PATH) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), name)
    finally:
        os.close(fd)
