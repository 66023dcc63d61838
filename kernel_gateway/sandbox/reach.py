"""Bind sources an unprivileged sandbox uid could not reach, made reachable by an alias.

An unprivileged bwrap resolves each bind source with its own uid, so a source
below a directory it may not search (a Python under ``/root``, a state
directory of mode 0700, a test's private temp dir) fails with EACCES.  The
sources are the operator's and the gateway's own paths, never the agent's,
so instead of loosening the host's permissions the gateway binds the
highest directory above such a source from which the uid can walk down to it
(the child of the deepest directory it may not search) on an empty mount
point under :data:`ALIAS_DIR` (mode 0711, one directory per gateway process),
and bwrap binds the source from there.  Every source beneath that directory
shares the one mount (the agents' trees, the agents' sockets): the mounts stay
a handful however many agents there are, which matters because each mount in
the host's namespace makes every bwrap start slower.  An alias only skips the
search permission of the directories above it: below it, the owner and mode
of each directory and of the source still decide who may go on (an agent's
tree is 0700 and its own, its socket 0600 and its own).  The aliases are unmounted
when the gateway exits, and a later gateway sweeps those of one that died.

The aliases live in the host's mount namespace, as every other mount the
gateway makes (an agent's disk image) does: a namespace of its own would
hide those from the host.

Only a path without any symlink on it is aliased, and the alias point is
opened with ``openat2(RESOLVE_NO_SYMLINKS)`` and mounted through that fd, so
nothing an agent can rename or relink can make the gateway (root) mount
something else; the rest of the way, below the alias point, is resolved by
bwrap as the sandbox's own uid, which reaches nothing that uid could not.  A
path that does not qualify is left for bwrap to resolve with the sandbox's
own uid (and fails there, clearly, if that uid may not reach it).
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import os
import stat
import threading

from ..fs.paths import AT_FDCWD, RESOLVE_NO_SYMLINKS, openat2

ALIAS_DIR = "/tmp/kg-reach"
_MS_BIND, _MS_REC = 0x1000, 0x4000
_MNT_DETACH = 2

_libc = ctypes.CDLL(None, use_errno=True)


def _open_no_symlinks(path: str) -> int:
    """An O_PATH fd of ``path``, refused if any component is a symlink."""
    try:
        return openat2(AT_FDCWD, path, os.O_PATH, resolve=RESOLVE_NO_SYMLINKS)
    except OSError as err:
        raise Unreachable(err.errno, f"cannot open {path} without following symlinks: {err.strerror}") from None


_lock = threading.Lock()
_aliases: dict[str, str] = {}  # real path -> its mount point, in this process
_answers: dict[tuple[str, int, int], str] = {}


class Unreachable(OSError):
    """A bind source cannot be made reachable for the sandbox uid."""


def _may_search(directory: str, uid: int, gid: int) -> bool:
    """Whether ``uid``/``gid`` (no supplementary groups) may search ``directory`` itself."""
    try:
        st = os.stat(directory)
    except OSError:
        return False
    if st.st_uid == uid:
        bit = stat.S_IXUSR
    elif st.st_gid == gid:
        bit = stat.S_IXGRP
    else:
        bit = stat.S_IXOTH
    return bool(st.st_mode & bit)


def can_search(path: str, uid: int, gid: int) -> bool:
    """Whether ``uid``/``gid`` (no supplementary groups) may search every directory above ``path``."""
    parent = os.path.dirname(path)
    while True:
        if not _may_search(parent, uid, gid):
            return False
        if parent == "/":
            return True
        parent = os.path.dirname(parent)


def _alias_point(real: str, uid: int, gid: int) -> str:
    """The highest directory above ``real`` (or ``real`` itself) from which ``uid`` can walk down to it.

    Its parent is one ``uid`` may not search.  Aliasing it, not each source, lets every source
    beneath it share one mount: each mount in the host's namespace makes every bwrap start
    slower (bwrap reads the mount table for each of its binds), so their number must not
    grow with the number of agents.
    """
    point = real
    while True:
        parent = os.path.dirname(point)
        if parent == point or not _may_search(parent, uid, gid):
            return point
        point = parent


def _process_tag(pid: int | str) -> str | None:
    """pid and start time: names a process uniquely, even once its pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f"{pid}-{f.read().rsplit(')', 1)[1].split()[19]}"
    except (OSError, IndexError):
        return None


def _own_dir(path: str) -> None:
    try:
        os.mkdir(path, 0o711)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0:
        raise Unreachable(0, f"{path} is not a directory owned by root")
    os.chmod(path, 0o711)


def _remove_aliases(where: str) -> None:
    """Unmount and remove every alias in ``where``; never removes anything but empty mount points."""
    try:
        entries = os.listdir(where)
    except OSError:
        return
    for entry in entries:
        path = os.path.join(where, entry)
        # Detach every mount stacked there (each unmount uncovers the one below).
        while _libc.umount2(path.encode(), _MNT_DETACH) == 0:
            pass
        try:
            if entry.endswith(".f"):
                if os.lstat(path).st_size == 0:
                    os.unlink(path)
            else:
                os.rmdir(path)  # fails, harmlessly, on anything not empty
        except OSError:
            pass
    try:
        os.rmdir(where)
    except OSError:
        pass


def _sweep(keep: str) -> None:
    """Remove the aliases of gateway processes that are gone."""
    for name in os.listdir(ALIAS_DIR):
        if name != keep and _process_tag(name.split("-", 1)[0]) != name:
            _remove_aliases(os.path.join(ALIAS_DIR, name))


@functools.lru_cache(maxsize=1)
def _alias_dir() -> str:
    _own_dir(ALIAS_DIR)
    mine = _process_tag(os.getpid())
    _sweep(keep=mine)
    where = os.path.join(ALIAS_DIR, mine)
    _own_dir(where)
    atexit.register(_remove_aliases, where)
    return where


def _alias(real: str) -> str:
    if real in _aliases:
        return _aliases[real]
    fd = _open_no_symlinks(real)
    try:
        _aliases[real] = _mount_alias(real, fd)
    finally:
        os.close(fd)
    return _aliases[real]


def _mount_alias(real: str, fd: int) -> str:
    is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
    target = os.path.join(_alias_dir(), hashlib.sha256(real.encode()).hexdigest()[:24] + ("" if is_dir else ".f"))
    try:
        if is_dir:
            os.mkdir(target, 0o755)
        else:
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
    except FileExistsError:
        pass  # left by a try of this process that failed to mount
    st = os.lstat(target)
    if st.st_uid != 0 or stat.S_ISLNK(st.st_mode) or stat.S_ISDIR(st.st_mode) != is_dir:
        raise Unreachable(0, f"{target} is not a mount point the gateway made")
    # Through the fd: what was opened is what gets bound, whatever the path now leads to.
    if _libc.mount(f"/proc/self/fd/{fd}".encode(), target.encode(), None, _MS_BIND | _MS_REC, None) != 0:
        err = ctypes.get_errno()
        raise Unreachable(err, f"cannot bind {real} on {target}: {os.strerror(err)}")
    return target


def reachable(source: str, uid: int, gid: int) -> str:
    """``source``, or an alias of it that ``uid`` can reach.

    A missing source, one ``uid`` can reach, and one with a symlink on its
    way stay as they are: bwrap resolves those itself, as the sandbox's uid.
    """
    key = (source, uid, gid)
    known = _answers.get(key)
    if known is not None:
        return known
    real = os.path.realpath(source)
    if not os.path.exists(real):
        # Not remembered: it may appear later.  Where the uid could not even look, bwrap would
        # fail with EACCES instead of skipping a missing --bind-try source: give it a missing path.
        if can_search(real, uid, gid):
            return source
        return os.path.join(_alias_dir(), "missing-" + hashlib.sha256(real.encode()).hexdigest()[:24])
    if real != os.path.normpath(source) or can_search(real, uid, gid):
        answer = source
    else:
        point = _alias_point(real, uid, gid)
        with _lock:
            alias = _alias(point)
        answer = alias if point == real else os.path.join(alias, os.path.relpath(real, point))
    if len(_answers) < 4096:  # on every spawn's path: each bind source is looked at once
        _answers[key] = answer
    return answer


def alias_of_fd(fd: int, uid: int, gid: int) -> str | None:
    """An alias bound from an already opened (pinned) fd, or None when ``uid`` reaches its path.

    bwrap resolves ``--bind-fd`` through the fd's path, with its own uid.
    """
    real = os.readlink(f"/proc/self/fd/{fd}")
    if not real.startswith("/") or can_search(real, uid, gid):
        return None
    with _lock:
        if real not in _aliases:
            _aliases[real] = _mount_alias(real, fd)
        return _aliases[real]
