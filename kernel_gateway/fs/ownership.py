"""Who owns what in an agent's tree: the first hand-over of a tree to its agent's uid.

``fchown`` through file descriptors opened without following symlinks, so
nothing the agent placed in its tree can turn the gateway's chown onto a
file elsewhere.  (What the gateway creates later is given to the agent as it
is created: see :mod:`.paths`.)
"""

from __future__ import annotations

import ctypes
import os
import stat

__all__ = ["own_tree"]


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
