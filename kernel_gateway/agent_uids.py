"""One unprivileged host uid per agent: who its sandboxes run as and who owns its tree.

A gateway running as root gives each agent its own uid (and a group of the
same number) from ``Gateway.agent_uid_start`` on, recorded in
``<state>/agent-uids.json`` so that an agent keeps its uid, and therefore
the ownership of its files, across restarts.  A gateway that is not root
cannot switch uids: its sandboxes run as its own uid, as before.

The agent's tree is made its own by :func:`kernel_gateway.fs.own_tree`.
"""

from __future__ import annotations

import json
import os
import stat
import threading

from . import fs
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
                    fs.own_tree(os.path.join(self.root, agent), uid, uid, self.keep)
        return RunAs(uid, uid, self.max_processes)

    def _save(self) -> None:
        state_files.write_json(self.path, {"agents": self._uids}, mode=0o600, indent=1, sort_keys=True)

    def own_tree(self, agent: str, top: str) -> None:
        """Make the agent's tree its own: the root 0700, and what the gateway made in it."""
        run_as = self.run_as(agent)
        if run_as is None:
            return
        fs.own_tree(top, run_as.uid, run_as.gid, self.keep)
