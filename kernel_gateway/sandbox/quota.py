"""Per-agent disk quota: each agent's tree is its own small filesystem.

With ``--Gateway.disk_quota=1G`` every agent's root ``<root>/<agent>`` is the
mount point of a sparse ext4 image ``<state>/disks/<agent>.img`` of that size,
loop-mounted ``nosuid,nodev``.  Every sandbox of the agent (kernels, commands)
binds that tree, so together they cannot write more than the quota: past it
a write fails with ``ENOSPC`` inside the sandbox, while other agents and the
gateway's state directory (another filesystem) are untouched.

Why a gateway setting and not a profile limit: a profile describes one
sandbox, but the quota is for the agent's whole tree, which its kernels and
commands share.  Why off by default: it needs root and loop devices, and it
costs an image per agent (sparse, so only what is written takes host space).

Lifecycle: the image is made (``mkfs.ext4``) the first time the agent is
created; the mount is kept when the gateway stops or is killed (unmounting
would race with a dying sandbox), and every start mounts any registered
agent whose tree is not mounted yet (after a reboot), so restarts and
``kill -9`` need nothing special.  The size is fixed when the image is made:
to grow it, ``truncate -s`` the image and ``resize2fs`` its loop device.

Where the gateway is not root, or there is no loop device, :func:`unavailable`
says why and the gateway runs without a quota (``doctor`` and ``/v1/info`` say
so).  An agent tree that already holds files outside an image is refused
rather than hidden under a fresh mount.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any

from ..errors import GatewayError
from .profile import ProfileError, parse_size

MECHANISM = "ext4 image per agent, loop-mounted nosuid,nodev"
MIN_SIZE = 8 << 20  # smaller ext4 filesystems hold almost nothing after their metadata
# Host tools run with a fixed environment: nothing a request sets reaches them.
_TOOL_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C"}


class QuotaError(GatewayError):
    """The agent's quota cannot be put in place; nothing of the agent is started."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(503, "disk_quota_unavailable", message, hint)


def parse_quota(value: Any) -> int | None:
    """Bytes of a quota setting ("" or 0: none), or ValueError."""
    if value in ("", None, 0, "0"):
        return None
    try:
        size = parse_size(value, "disk_quota")
    except ProfileError as e:
        raise ValueError(str(e)) from None
    if size < MIN_SIZE:
        raise ValueError(f"disk_quota: at least {MIN_SIZE >> 20}M, got {value!r}")
    return size


def unavailable() -> str | None:
    """Why a loop-mounted image cannot be used here, or None when it can."""
    if os.geteuid() != 0:
        return "the gateway is not root (mounting a loop image needs it)"
    if not os.path.exists("/dev/loop-control") and not os.path.exists("/dev/loop0"):
        return "no loop devices (/dev/loop-control is missing)"
    for tool in ("mkfs.ext4", "mount"):
        if shutil.which(tool, path=_TOOL_ENV["PATH"]) is None:
            return f"{tool} is not installed (apt-get install -y e2fsprogs mount)"
    return None


def image_path(state_dir: str, agent: str) -> str:
    return os.path.join(state_dir, "disks", f"{agent}.img")


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def mounted_source(path: str) -> str | None:
    """The device mounted exactly at ``path`` (the last mount there wins), or None."""
    target, found = os.path.realpath(path), None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                if _unescape(left.split()[4]) == target:
                    found = right.split()[1]
    except OSError:
        return None
    return found


def _backing_file(device: str) -> str | None:
    try:
        with open(f"/sys/block/{os.path.basename(device)}/loop/backing_file") as f:
            return f.read().strip()
    except OSError:
        return None


def _run(argv: list[str]) -> None:
    try:
        done = subprocess.run(argv, env=_TOOL_ENV, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise QuotaError(f"{argv[0]} failed: {e}") from None
    if done.returncode != 0:
        raise QuotaError(f"{' '.join(argv)} failed: {(done.stderr or done.stdout).strip()}")


def mount_agent_disk(settings: Any, agent: str) -> bool:
    """Put the agent's tree on its own image when a quota is set; True if it is mounted.

    Call before the tree is laid out.  Idempotent: an agent already mounted on
    its image is left as it is.
    """
    size = parse_quota(getattr(settings, "disk_quota", ""))
    if size is None or unavailable():
        return False
    top = os.path.join(settings.root, agent)
    image = image_path(settings.state_dir, agent)
    os.makedirs(top, mode=0o700, exist_ok=True)
    source = mounted_source(top)
    if source is not None:
        if _backing_file(source) == os.path.realpath(image):
            return True
        raise QuotaError(
            f"the tree of agent {agent!r} is a mount of {source}, not of its disk image",
            f"unmount {top} or turn the disk quota off",
        )
    if os.listdir(top):
        raise QuotaError(
            f"agent {agent!r} already has files in {top}, outside a disk image; mounting the image would hide them",
            "move them into the image by hand (mount it elsewhere, copy, unmount), or turn the disk quota off",
        )
    fresh = not os.path.exists(image)
    if fresh:
        os.makedirs(os.path.dirname(image), mode=0o700, exist_ok=True)
        fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)  # sparse: host space is taken only as the agent writes
        finally:
            os.close(fd)
        try:
            # -m 0: no blocks reserved for root, so the quota is what the agent gets.
            _run(["mkfs.ext4", "-q", "-F", "-m", "0", image])
        except QuotaError:
            os.unlink(image)
            raise
    _run(["mount", "-t", "ext4", "-o", "loop,nosuid,nodev", image, top])
    if fresh:
        # A fresh filesystem, not yet seen by any sandbox: lost+found is no part of the agent's tree.
        try:
            os.rmdir(os.path.join(top, "lost+found"))
        except OSError:
            pass
    return True


def describe(settings: Any) -> dict:
    """What /v1/info and doctor say about the disk quota."""
    try:
        size = parse_quota(getattr(settings, "disk_quota", ""))
    except ValueError as e:
        return {"mechanism": "none", "reason": str(e)}
    if size is None:
        return {"mechanism": "none", "reason": "off: --Gateway.disk_quota is not set"}
    reason = unavailable()
    if reason:
        return {"mechanism": "none", "reason": f"disk_quota is set but cannot be enforced: {reason}", "size": size}
    return {"mechanism": MECHANISM, "size": size}
