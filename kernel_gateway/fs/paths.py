"""Confinement of filesystem access to a workspace root.

Paths are taken relative to ``cwd`` (default: the root) and folded lexically;
``..`` that climbs above the root, absolute paths elsewhere, and symlinks that
are absolute or climb out are refused with :class:`PathOutsideRoot`.  Symlinks
with relative targets that stay inside the root are followed.

Checking a path and then using it is racy (a directory can be swapped for a
symlink in between), so the ``*_in_root`` helpers never hand a full path to the
kernel: they open relative to an fd of the root with Linux ``openat2(2)``
(``RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS``), or, where that syscall is
missing, walk the path one component at a time with ``O_NOFOLLOW`` and expand
symlinks themselves, keeping every step beneath the root fd.

The gateway runs with more privilege than the agent, so everything it does in
an agent's tree goes through here: reading a file a kernel named
(:func:`read_regular_in_root`: non-blocking, regular files only, size capped
before reading), creating directories without following any symlink
(:func:`make_dirs_nofollow`), and writing a file atomically
(:func:`write_atomically_at`).  What the gateway creates for an agent is
given to the owner of the agent root, so the agent can still change it.
Paths that no filesystem call could take (NUL bytes, lone surrogates, a
component over 255 bytes, more than 4096 bytes in all) are refused up front
with :class:`InvalidPath`, a 400, rather than failing half-way.
"""

from __future__ import annotations

import ctypes
import errno
import os
import pathlib
import platform
import stat
import uuid

from ..errors import GatewayError, disk_full

# openat2 has the same number on every architecture using the unified syscall
# table (x86_64, aarch64, arm, riscv, ppc, s390x, i386); elsewhere we walk.
_OPENAT2 = 437 if platform.machine() in {
    "x86_64", "amd64", "aarch64", "arm64", "armv7l", "armv8l", "riscv64",
    "ppc64le", "ppc64", "s390x", "i386", "i686",
} else None
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
AT_FDCWD = -100
_MAX_SYMLINKS = 40  # the kernel's limit, after which it answers ELOOP
NAME_MAX = 255  # bytes in one path component
PATH_MAX = 4096  # bytes in a whole path

_libc = ctypes.CDLL(None, use_errno=True)


class PathOutsideRoot(ValueError):
    """A path, or a symlink on its way, leads outside the workspace root."""

    def __init__(self, path, root):
        super().__init__(f"path '{os.fspath(path)}' is outside the workspace root '{os.fspath(root)}'")
        self.path = os.fspath(path)


class InvalidPath(GatewayError):
    """A path no filesystem call could take: refused as bad input (400), nothing touched."""

    def __init__(self, path, why: str):
        shown = os.fspath(path) if isinstance(path, (str, bytes, os.PathLike)) else path
        if isinstance(shown, str) and len(shown) > 200:
            shown = shown[:200] + "..."
        super().__init__(400, "invalid_path", f"invalid path {shown!r}: {why}",
                         f"components are at most {NAME_MAX} bytes, paths at most {PATH_MAX}, in UTF-8")


class NotRegularFile(OSError):
    """The path names a directory, FIFO, socket or device where a regular file is needed."""


class FileTooLarge(OSError):
    """The file is larger than the caller's cap; nothing of it was read."""

    def __init__(self, path, size: int, cap: int):
        super().__init__(errno.EFBIG, f"{size} bytes, over the {cap}-byte limit", os.fspath(path))
        self.size, self.cap = size, cap


class SymlinkRefused(PathOutsideRoot):
    """A symlink stands where the gateway creates or writes and follows none."""

    def __init__(self, path, root):
        ValueError.__init__(self, f"path '{os.fspath(path)}' goes through a symlink; refused")
        self.path = os.fspath(path)


def check_path_text(path) -> None:
    """Refuse, as :class:`InvalidPath`, what no filesystem call could take."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if isinstance(path, bytes):
        raw = path
    elif isinstance(path, str):
        try:
            raw = os.fsencode(path)  # names read from disk carry their non-UTF-8 bytes as surrogates
        except UnicodeEncodeError:
            raise InvalidPath(path.encode("utf-8", "backslashreplace").decode(), "it is not valid UTF-8 text") from None
    else:
        raise InvalidPath(repr(path), f"a path is a string, not {type(path).__name__}")
    if b"\0" in raw:
        raise InvalidPath(path, "it contains a NUL byte")
    if len(raw) > PATH_MAX:
        raise InvalidPath(path, f"it is {len(raw)} bytes long")
    longest = max((len(part) for part in raw.split(b"/")), default=0)
    if longest > NAME_MAX:
        raise InvalidPath(path, f"a component is {longest} bytes long")


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _relative_parts(root: str, path, cwd) -> list[str]:
    """Components of `path` (taken from `cwd`) below the real root, folded lexically."""
    check_path_text(path)
    if cwd is not None:
        check_path_text(cwd)
    root_real = os.path.realpath(root)
    base = root_real
    if cwd is not None:
        base = os.path.join(root_real, os.fspath(cwd))  # a relative cwd is taken from the root
        if _relative(root, root_real, base) is None:
            raise PathOutsideRoot(cwd, root)
    rel = _relative(root, root_real, _fold(os.path.join(base, os.fspath(path)).split("/")))
    if rel is None:
        raise PathOutsideRoot(path, root)
    return [p for p in rel.split("/") if p]


def _fold(parts: list[str]) -> str:
    out: list[str] = []
    for part in parts:
        if part == "..":
            out = out[:-1]
        elif part not in ("", "."):
            out.append(part)
    return "/" + "/".join(out)


def _relative(root: str, root_real: str, absolute: str) -> str | None:
    """`absolute` relative to the root as given or as resolved; None if outside."""
    absolute = _fold(absolute.split("/"))
    for prefix in (root_real, _fold(os.path.abspath(root).split("/"))):
        if absolute == prefix:
            return ""
        if absolute.startswith(prefix.rstrip("/") + "/"):
            return absolute[len(prefix.rstrip("/")) + 1:]
    return None


def _walk(root: str, parts: list[str], follow_final: bool = True, create_dirs: bool = False):
    """Resolve `parts` beneath the root by hand, one O_NOFOLLOW step at a time.

    Returns (fds, name, resolved, exists): fds[-1] is the directory holding
    `name` ("" when the path is that directory itself), `resolved` the
    physical components below the root.  If a directory on the way is missing
    the rest is folded lexically and `exists` is False.  The caller closes fds.
    """
    fds = [os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)]
    resolved: list[str] = []
    todo, links = list(parts), 0
    try:
        while todo:
            name = todo.pop(0)
            if name in ("", "."):
                continue
            if name == "..":
                if not resolved:
                    raise PathOutsideRoot("/".join(parts), root)
                os.close(fds.pop())
                resolved.pop()
                continue
            last = not any(p not in ("", ".") for p in todo)
            try:
                st = os.stat(name, dir_fd=fds[-1], follow_symlinks=False)
            except FileNotFoundError:
                if create_dirs:
                    os.mkdir(name, 0o777, dir_fd=fds[-1])
                    _give_to_owner(fds[-1], name, _owner(fds[0]))
                    todo.insert(0, name)
                    continue
                if last:
                    return fds, name, resolved + [name], True
                return fds, name, _fold_tail(root, parts, resolved + [name], todo), False
            if stat.S_ISLNK(st.st_mode) and (follow_final or not last):
                target = os.readlink(name, dir_fd=fds[-1])
                links += 1
                if target.startswith("/") or links > _MAX_SYMLINKS:
                    raise PathOutsideRoot("/".join(parts), root)
                todo[:0] = target.split("/")
                continue
            if last and not create_dirs:
                return fds, name, resolved + [name], True
            # O_NOFOLLOW: a symlink swapped in since the stat is refused (ENOTDIR).
            flags = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            if not stat.S_ISDIR(st.st_mode) and not create_dirs:
                # A file on the way: nothing lies beyond it, as with a missing directory.
                return fds, name, _fold_tail(root, parts, resolved + [name], todo), False
            fds.append(os.open(name, flags, dir_fd=fds[-1]))
            resolved.append(name)
        return fds, "", resolved, True
    except BaseException:
        _close_all(fds)
        raise


def search_denied(root, path) -> str | None:
    """The first directory from `root` down to `path` that the root's owner may not enter.

    A kernel runs as that owner (the agent's uid) in `path`: where a directory on the way
    lacks the search permission for it (the agent's own ``chmod 000``) the kernel dies while
    starting.  Links inside the tree are followed as the sandbox would; only modes are
    read, by descriptor.  Returns the directory relative to the root, or None (also for a
    path that does not exist, or that is not a directory: left to other checks).
    """
    root = os.fspath(root)
    fds, name, resolved, exists = _walk(root, _relative_parts(root, path, None))
    try:
        if not exists:
            return None
        owner = os.fstat(fds[0])
        steps = [(fd, "/".join(resolved[:i])) for i, fd in enumerate(fds)]
        if name:
            steps.append((None, "/".join(resolved)))
        for fd, shown in steps:
            info = os.fstat(fd) if fd is not None else os.stat(name, dir_fd=fds[-1], follow_symlinks=False)
            if not stat.S_ISDIR(info.st_mode):
                return None
            if info.st_uid == owner.st_uid:
                bit = stat.S_IXUSR
            elif info.st_gid == owner.st_gid:
                bit = stat.S_IXGRP
            else:
                bit = stat.S_IXOTH
            if not info.st_mode & bit:
                return shown or "."
        return None
    finally:
        _close_all(fds)


def _fold_tail(root, parts, resolved, todo) -> list[str]:
    """Past a missing directory nothing is a symlink: fold the rest lexically."""
    out = list(resolved)
    for name in todo:
        if name == "..":
            if not out:
                raise PathOutsideRoot("/".join(parts), root)
            out.pop()
        elif name not in ("", "."):
            out.append(name)
    return out


def _close_all(fds) -> None:
    for fd in fds:
        os.close(fd)


def resolve_in_root(root, path, cwd=None) -> pathlib.Path:
    """Absolute path of `path` (relative to `cwd`, default the root) with its
    symlinks resolved; raises PathOutsideRoot if it, or a symlink on its way,
    leaves the root.  A path that does not exist yet is fine."""
    root = os.fspath(root)
    fds, _, resolved, _ = _walk(root, _relative_parts(root, path, cwd))
    _close_all(fds)
    return pathlib.Path(os.path.realpath(root), *resolved)


def openat2(dir_fd: int, rel: str, flags: int, mode: int = 0,
            resolve: int = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS) -> int:
    """Linux ``openat2(2)``: ``rel`` opened from ``dir_fd`` under the ``resolve`` rules.

    The package's only binding of the syscall.  Raises OSError (ENOSYS where
    the architecture's number is unknown or the kernel predates it).
    """
    if _OPENAT2 is None:
        raise OSError(errno.ENOSYS, "openat2 is not available here", rel)
    how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0, resolve)
    fd = _libc.syscall(_OPENAT2, dir_fd, os.fsencode(rel or "."), ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), rel)
    return fd


def open_in_root(root, path, flags, mode=0o644, cwd=None) -> int:
    """An fd for `path` opened beneath `root`; no symlink can take it outside.

    Symlinks inside the tree are followed (the agent's own links are part of
    its tree); writers of the gateway's own files use :func:`open_nofollow`.
    Always ``O_NONBLOCK | O_NOCTTY``: a FIFO or a terminal never holds the caller.
    """
    root = os.fspath(root)
    parts = _relative_parts(root, path, cwd)
    if not flags & os.O_PATH:  # openat2 refuses any other flag beside O_PATH
        flags |= os.O_NONBLOCK | os.O_NOCTTY
    if _OPENAT2 is not None:
        root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if flags & os.O_CREAT and not flags & os.O_EXCL:
                # Exclusive first, so a file made here (and only such) goes to the agent.
                try:
                    fd = openat2(root_fd, "/".join(parts), flags | os.O_EXCL, mode)
                except FileExistsError:
                    pass
                else:
                    _give_fd_to_owner(fd, _owner(root_fd))
                    return fd
            fd = openat2(root_fd, "/".join(parts), flags, mode)
            if flags & os.O_EXCL:
                _give_fd_to_owner(fd, _owner(root_fd))
            return fd
        except OSError as err:
            if err.errno == errno.EXDEV:
                raise PathOutsideRoot(path, root) from err
            if err.errno != errno.ENOSYS:
                raise
        finally:
            os.close(root_fd)
    return _open_walking(root, path, parts, flags, mode)


def _open_walking(root, path, parts, flags, mode) -> int:
    fds, name, _, exists = _walk(root, parts)
    try:
        if not exists:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", os.fspath(path))
        # The walk expanded a final symlink; one appearing since is refused.
        return os.open(name or ".", flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fds[-1])
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise PathOutsideRoot(path, root) from err
        raise
    finally:
        _close_all(fds)


def mkdirs_in_root(root, path, cwd=None) -> None:
    """Create the directory `path` and its missing parents beneath `root`."""
    root = os.fspath(root)
    fds, _, _, _ = _walk(root, _relative_parts(root, path, cwd), create_dirs=True)
    _close_all(fds)


def unlink_in_root(root, path, cwd=None) -> None:
    """Remove the file at `path` beneath `root` (a final symlink itself, not its target)."""
    root = os.fspath(root)
    fds, name, _, exists = _walk(root, _relative_parts(root, path, cwd), follow_final=False)
    try:
        if not exists or not name:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", os.fspath(path))
        os.unlink(name, dir_fd=fds[-1])
    finally:
        _close_all(fds)


def rename_in_root(root, src, dst, cwd=None) -> None:
    """Rename `src` to `dst`, both beneath `root` (final symlinks are renamed, not followed)."""
    root = os.fspath(root)
    src_fds, src_name, _, src_exists = _walk(root, _relative_parts(root, src, cwd), follow_final=False)
    try:
        dst_fds, dst_name, _, _ = _walk(root, _relative_parts(root, dst, cwd), follow_final=False)
        try:
            if not src_exists or not src_name:
                raise FileNotFoundError(errno.ENOENT, "No such file or directory", os.fspath(src))
            if not dst_name:
                raise IsADirectoryError(errno.EISDIR, "Is a directory", os.fspath(dst))
            os.rename(src_name, dst_name, src_dir_fd=src_fds[-1], dst_dir_fd=dst_fds[-1])
        finally:
            _close_all(dst_fds)
    finally:
        _close_all(src_fds)


class TooManyEntries(OSError):
    """A directory (or a tree) holds more entries, or is deeper, than the caller's cap; nothing was changed."""

    def __init__(self, path, cap: int, what: str = "entries"):
        super().__init__(errno.EFBIG, f"more than {cap} {what}", os.fspath(path))
        self.cap = cap


MAX_LIST_ENTRIES = 20_000  # entries of one directory listed for an agent
MAX_REMOVE_ENTRIES = 100_000  # entries of one tree removed for an agent
MAX_TREE_DEPTH = 64  # levels of one tree removed for an agent
# Directories below a directory fd: no symlink followed, and a FIFO swapped in is ENOTDIR, never opened.
_SUBDIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def list_dir_at(dir_fd: int, cap: int = MAX_LIST_ENTRIES, path="") -> list[tuple[str, os.stat_result]]:
    """(name, lstat) of each entry of the directory open as `dir_fd`, at most `cap` of them.

    Nothing is opened and no symlink followed: the entries are read with
    getdents and stat-ed with ``fstatat(AT_SYMLINK_NOFOLLOW)``.  Past the cap,
    TooManyEntries.  An entry that vanishes meanwhile is left out.
    """
    out = []
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            if len(out) >= cap:
                raise TooManyEntries(path, cap)
            try:
                out.append((entry.name, entry.stat(follow_symlinks=False)))
            except FileNotFoundError:
                continue
    return out


def _count_tree(dir_fd: int, budget: list[int], depth: int, path) -> None:
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            budget[0] -= 1
            if budget[0] < 0:
                raise TooManyEntries(path, MAX_REMOVE_ENTRIES)
            if entry.is_dir(follow_symlinks=False):  # d_type, or an lstat: never an open
                if depth >= MAX_TREE_DEPTH:
                    raise TooManyEntries(path, MAX_TREE_DEPTH, "levels")
                fd = os.open(entry.name, _SUBDIR, dir_fd=dir_fd)
                try:
                    _count_tree(fd, budget, depth + 1, path)
                finally:
                    os.close(fd)


def _remove_entries(dir_fd: int) -> None:
    """Empty the directory open as `dir_fd`, never following a symlink nor opening anything but a directory."""
    for entry in list(os.scandir(dir_fd)):
        if entry.is_dir(follow_symlinks=False):
            fd = os.open(entry.name, _SUBDIR, dir_fd=dir_fd)
            try:
                _remove_entries(fd)
            finally:
                os.close(fd)
            os.rmdir(entry.name, dir_fd=dir_fd)
        else:
            os.unlink(entry.name, dir_fd=dir_fd)  # a FIFO, a socket, a symlink: the name goes, nothing is opened


def remove_tree_at(dir_fd: int, name: str, max_entries: int = MAX_REMOVE_ENTRIES, path=None) -> None:
    """Remove `name` in the directory `dir_fd` and all beneath it, fd-relative and bounded.

    A symlink, FIFO or socket is unlinked, never followed nor opened; a
    directory is opened ``O_NOFOLLOW | O_DIRECTORY | O_NONBLOCK`` only.  The
    tree is counted first: past `max_entries` entries or MAX_TREE_DEPTH
    levels TooManyEntries is raised and nothing is removed.
    """
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return
    fd = os.open(name, _SUBDIR, dir_fd=dir_fd)
    try:
        _count_tree(fd, [max_entries], 1, path if path is not None else name)
        _remove_entries(fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


def remove_tree_in_root(root, path, cwd=None, max_entries: int = MAX_REMOVE_ENTRIES) -> None:
    """Remove `path` beneath `root` and everything in it (:func:`remove_tree_at`); a final symlink is removed."""
    root = os.fspath(root)
    fds, name, _, exists = _walk(root, _relative_parts(root, path, cwd), follow_final=False)
    try:
        if not exists or not name:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", os.fspath(path))
        remove_tree_at(fds[-1], name, max_entries, path)
    finally:
        _close_all(fds)


def lstat_in_root(root, path, cwd=None) -> os.stat_result | None:
    """The entry at `path` beneath `root` itself (a final symlink is not followed); None if missing."""
    root = os.fspath(root)
    fds, name, _, exists = _walk(root, _relative_parts(root, path, cwd), follow_final=False)
    try:
        if not exists:
            return None
        try:
            return os.stat(name or ".", dir_fd=fds[-1], follow_symlinks=False)
        except FileNotFoundError:
            return None
    finally:
        _close_all(fds)


def read_tree_in_root(root, path, max_files: int, max_bytes: int, cwd=None) -> dict[str, bytes] | None:
    """Every regular file under the directory `path` beneath `root`, by relative path.

    None when `path` is not a real directory, holds anything but regular files
    and directories (a symlink, a FIFO, a device), or exceeds the caps.
    """
    root = os.fspath(root)
    fds, name, _, exists = _walk(root, _relative_parts(root, path, cwd), follow_final=False)
    try:
        if not exists:
            return None
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            top = os.open(name or ".", flags, dir_fd=fds[-1])
        except OSError:
            return None
    finally:
        _close_all(fds)
    files: dict[str, bytes] = {}
    budget = [max_bytes]

    def read_dir(dir_fd: int, prefix: str) -> bool:
        for entry in sorted(os.scandir(dir_fd), key=lambda e: e.name):
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                fd = os.open(entry.name, flags, dir_fd=dir_fd)
                try:
                    if not read_dir(fd, prefix + entry.name + "/"):
                        return False
                finally:
                    os.close(fd)
            elif stat.S_ISREG(st.st_mode) and st.st_size <= budget[0] and len(files) < max_files:
                fd = os.open(entry.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
                with os.fdopen(fd, "rb") as f:
                    data = f.read(budget[0] + 1)
                if len(data) > budget[0]:
                    return False
                budget[0] -= len(data)
                files[prefix + entry.name] = data
            else:
                return False
        return True

    try:
        return files if read_dir(top, "") else None
    finally:
        os.close(top)


_ERRNO_REFUSALS = {
    errno.ENOENT: (404, "not_found", "no such file or directory"),
    errno.ENOTDIR: (404, "not_found", "a part of the path is not a directory"),
    errno.ENAMETOOLONG: (400, "invalid_path", "a name would be too long"),
    errno.EISDIR: (400, "is_a_directory", "it is a directory"),
    errno.ENOTEMPTY: (400, "not_empty", "the directory is not empty"),
    errno.EEXIST: (409, "exists", "it already exists"),
    errno.ELOOP: (403, "path_outside_root", "it is, or goes through, a symlink"),
    errno.EXDEV: (403, "path_outside_root", "it leads outside the agent's tree"),
    errno.EACCES: (403, "permission_denied", "permission denied"),
    errno.EPERM: (403, "permission_denied", "operation not permitted"),
    errno.EROFS: (403, "read_only", "read-only"),
    errno.ENXIO: (400, "not_a_file", "it is a FIFO or socket with no other end"),
    errno.EINVAL: (400, "invalid_path", "the operation does not apply to it"),
    errno.EFBIG: (413, "too_large", "it is over a limit"),
    errno.ENOSPC: (507, "disk_full", "the agent's disk is full"),
    errno.EDQUOT: (507, "disk_full", "the agent's disk quota is used up"),
}


def refusal(err: OSError, path) -> GatewayError | None:
    """The clear 4xx (507 for a full disk) for an OSError of a call of this layer, or None."""
    full = disk_full(err)  # the one 507, with its hint on the agent's disk quota
    if full is not None:
        return full
    known = _ERRNO_REFUSALS.get(err.errno)
    if known is None:
        return None
    status, code, why = known
    shown = os.fspath(path) if isinstance(path, (str, bytes, os.PathLike)) else str(path)
    return GatewayError(status, code, f"{shown[:300]}: {why}")


def fd_path(fd: int) -> str:
    """The physical path of what `fd` has open: a check on it is a check on what was opened."""
    return os.readlink(f"/proc/self/fd/{fd}")


def _refused(path) -> PermissionError:
    return PermissionError(errno.EACCES, "Permission denied", os.fspath(path))


def open_in_root_unless(root, path, flags, refuse, mode=0o644, cwd=None, _followed=False) -> int:
    """:func:`open_in_root`, raising PermissionError when ``refuse(physical path)`` is true.

    The check is made on the file actually opened (or, for a new file, on its
    parent directory held open while the file is created), so a symlink
    swapped in between a caller's check and this open cannot redirect it.
    """
    existing = flags & ~(os.O_CREAT | os.O_TRUNC | os.O_EXCL)
    if not (flags & os.O_CREAT and flags & os.O_EXCL):
        try:
            fd = open_in_root(root, path, existing, mode, cwd)
        except FileNotFoundError:
            if not flags & os.O_CREAT:
                raise
        else:
            if refuse(fd_path(fd)):
                os.close(fd)
                raise _refused(path)
            if flags & os.O_TRUNC:
                os.ftruncate(fd, 0)
            return fd
    parent, name = os.path.split(os.fspath(path))
    if not name:
        raise IsADirectoryError(errno.EISDIR, "Is a directory", os.fspath(path))
    parent_fd = open_in_root(root, parent or ".", os.O_PATH | os.O_DIRECTORY, cwd=cwd)
    try:
        if refuse(os.path.join(fd_path(parent_fd), name)):
            raise _refused(path)
        # O_NOFOLLOW: a symlink at the name is not followed here...
        return _create_at(parent_fd, name, flags | os.O_NOFOLLOW, mode, agent_owner(root))
    except OSError as err:
        if err.errno != errno.ELOOP or _followed:
            raise
    finally:
        os.close(parent_fd)
    # ... but resolved (beneath the root, as open_in_root would) and created at its target.
    target = resolve_in_root(root, path, cwd)
    return open_in_root_unless(root, target, flags, refuse, mode, _followed=True)


def unlink_in_root_unless(root, path, refuse, cwd=None) -> None:
    """:func:`unlink_in_root`, raising PermissionError when ``refuse(physical path)`` is true."""
    root = os.fspath(root)
    fds, name, _, exists = _walk(root, _relative_parts(root, path, cwd), follow_final=False)
    try:
        if not exists or not name:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", os.fspath(path))
        if refuse(os.path.join(fd_path(fds[-1]), name)):
            raise _refused(path)
        os.unlink(name, dir_fd=fds[-1])
    finally:
        _close_all(fds)

# --- the gateway's own writes and reads in an agent's tree --------------------------


def _owner(root_fd: int) -> tuple[int, int]:
    st = os.fstat(root_fd)
    return st.st_uid, st.st_gid


def _should_chown(owner: tuple[int, int]) -> bool:
    return os.geteuid() == 0 and owner != (os.geteuid(), os.getegid())


def _give_to_owner(dir_fd: int, name: str, owner: tuple[int, int]) -> None:
    if _should_chown(owner):
        os.chown(name, *owner, dir_fd=dir_fd, follow_symlinks=False)


def give_to_dir_owner(dir_fd: int, name: str) -> None:
    """``name`` in ``dir_fd`` (just made by the gateway) becomes the directory owner's, not root's."""
    _give_to_owner(dir_fd, name, _owner(dir_fd))


def _give_fd_to_owner(fd: int, owner: tuple[int, int]) -> None:
    if _should_chown(owner):
        os.fchown(fd, *owner)


def agent_owner(root) -> tuple[int, int]:
    """(uid, gid) owning the agent root: what the gateway creates there becomes theirs."""
    st = os.stat(os.fspath(root))
    return st.st_uid, st.st_gid


def read_at_most(fd: int, cap: int) -> bytes:
    """Up to cap + 1 bytes: one more than allowed tells that the file is too large."""
    chunks, wanted = [], cap + 1
    while wanted > 0:
        chunk = os.read(fd, min(wanted, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        wanted -= len(chunk)
    return b"".join(chunks)


def read_regular_in_root(root, path, max_bytes: int, cwd=None, follow_final: bool = False) -> bytes:
    """The bytes of the regular file `path` beneath `root`, at most `max_bytes`.

    The file is first opened ``O_PATH`` (no open side effects on a FIFO or a
    device), checked with fstat to be a regular file no larger than the cap,
    and only then reopened for reading.  A final symlink is refused unless
    `follow_final` (it would have to stay beneath the root anyway).  Raises
    PathOutsideRoot (SymlinkRefused), InvalidPath, FileNotFoundError,
    NotRegularFile or FileTooLarge.
    """
    flags = os.O_PATH | (0 if follow_final else os.O_NOFOLLOW)
    try:
        fd = open_in_root(root, path, flags, cwd=cwd)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise SymlinkRefused(path, root) from None
        raise
    try:
        info = os.fstat(fd)
        if stat.S_ISLNK(info.st_mode):
            raise SymlinkRefused(path, root)
        if not stat.S_ISREG(info.st_mode):
            raise NotRegularFile(errno.EINVAL, "not a regular file", os.fspath(path))
        if info.st_size > max_bytes:
            raise FileTooLarge(path, info.st_size, max_bytes)
        # Reopen the very inode the O_PATH fd holds, now known to be a regular file.
        reading = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    finally:
        os.close(fd)
    try:
        data = read_at_most(reading, max_bytes)
    finally:
        os.close(reading)
    if len(data) > max_bytes:  # it grew since the fstat
        raise FileTooLarge(path, len(data), max_bytes)
    return data


def make_dirs_nofollow(root, path, cwd=None, keep_ours: bool = False) -> None:
    """Create `path` and its missing parents beneath `root`, following no symlink at all.

    Each step is ``mkdirat`` then an ``O_NOFOLLOW | O_DIRECTORY`` open of what
    is there, so a component the agent replaced with a symlink (even one that
    points inside its own tree) is refused with SymlinkRefused, and nothing is
    created past it.  Created directories go to the agent root's owner, unless
    `keep_ours` (what the operator manages there: the Library's).
    """
    root = os.fspath(root)
    parts = _relative_parts(root, path, cwd)
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        owner = (os.geteuid(), os.getegid()) if keep_ours else _owner(fd)
        for name in parts:
            try:
                os.mkdir(name, 0o777, dir_fd=fd)
            except FileExistsError:
                pass
            else:
                _give_to_owner(fd, name, owner)
            try:
                step = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except (NotADirectoryError, OSError) as err:
                if err.errno in (errno.ENOTDIR, errno.ELOOP) and stat.S_ISLNK(
                    os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
                ):
                    raise SymlinkRefused(path, root) from None
                raise
            os.close(fd)
            fd = step
    finally:
        os.close(fd)


# --- fd-relative steps, for callers that hold a directory fd of the tree -----------------


def lstat_at(dir_fd: int, name: str) -> os.stat_result | None:
    """The entry `name` of `dir_fd` itself (a symlink is not followed); None if missing."""
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def mkdir_at(dir_fd: int, name: str, mode: int = 0o755) -> None:
    """``mkdirat``; the new directory goes to the owner of `dir_fd` (the agent), not to root."""
    os.mkdir(name, mode, dir_fd=dir_fd)
    give_to_dir_owner(dir_fd, name)


def unlink_at(dir_fd: int, name: str) -> None:
    """``unlinkat``: a symlink or FIFO itself goes, nothing is followed or opened."""
    os.unlink(name, dir_fd=dir_fd)


def rmdir_at(dir_fd: int, name: str) -> None:
    os.rmdir(name, dir_fd=dir_fd)


def rename_at(src_fd: int, src: str, dst_fd: int, dst: str) -> None:
    """``renameat`` between two directory fds of the tree (a symlink is renamed, not followed)."""
    os.rename(src, dst, src_dir_fd=src_fd, dst_dir_fd=dst_fd)


def open_dir_at(dir_fd: int, name: str) -> int:
    """A readable fd of the directory `name` in `dir_fd`: no symlink followed, a FIFO never opened."""
    return os.open(name, _SUBDIR, dir_fd=dir_fd)


def open_file_at(dir_fd: int, name: str, flags: int = os.O_RDONLY) -> int:
    """``openat`` of `name` in `dir_fd` itself: never through a symlink, never waiting on a FIFO."""
    return os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=dir_fd)


def protected_at(dir_fd: int, name: str, protected) -> str | None:
    """``protected(physical path)`` of `name` in the directory actually open as `dir_fd`.

    The Library's guard judged on the fd reached, not on a path string a
    symlink could redirect after the check.
    """
    return protected(os.path.join(fd_path(dir_fd), name) if name else fd_path(dir_fd))


def _create_at(dir_fd: int, name: str, flags: int, mode: int, owner: tuple[int, int]) -> int:
    """``openat`` that gives a file it creates (and only such) to `owner`: exclusive first."""
    flags |= os.O_CLOEXEC
    if flags & os.O_CREAT and not flags & os.O_EXCL:
        try:
            fd = os.open(name, flags | os.O_EXCL, mode, dir_fd=dir_fd)
        except FileExistsError:
            return os.open(name, flags & ~os.O_CREAT, mode, dir_fd=dir_fd)
    else:
        fd = os.open(name, flags, mode, dir_fd=dir_fd)
    if flags & os.O_CREAT:
        _give_fd_to_owner(fd, owner)
    return fd


def open_nofollow(root, path, flags, mode=0o644, cwd=None, regular: bool = True, keep_ours: bool = False) -> int:
    """An fd for `path` beneath `root`, reached through no symlink at all.

    For the gateway's own writes in an agent's tree (spilled output, job
    logs, a job's ``skills/``): even a symlink that stays inside the tree is
    refused (SymlinkRefused), since it could lead into what the agent may only
    read (``installed-skills/``).  ``O_NONBLOCK`` always, so a FIFO never
    waits; with `regular` anything but a regular file is refused
    (NotRegularFile) unless a directory or ``O_PATH`` was asked for.  A file
    created here belongs to the agent root's owner, unless `keep_ours` (the
    Library's files, which the operator manages and the agent only reads).
    """
    root = os.fspath(root)
    parts = _relative_parts(root, path, cwd)
    flags |= os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    fds = [root_fd]
    try:
        owner = (os.geteuid(), os.getegid()) if keep_ours else _owner(root_fd)
        if not parts:
            fd = os.open(".", flags & ~(os.O_CREAT | os.O_EXCL), dir_fd=root_fd)
        else:
            # Each directory on the way O_NOFOLLOW from the one before (openat2 RESOLVE_NO_SYMLINKS
            # would do it in one call; the walk works everywhere and refuses the same things).
            for name in parts[:-1]:
                fds.append(os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fds[-1]))
            fd = _create_at(fds[-1], parts[-1], flags, mode, owner)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR) and _symlink_on_way(fds[-1], parts[len(fds) - 1:]):
            raise SymlinkRefused(path, root) from None
        raise
    finally:
        _close_all(fds)
    if regular and not flags & (os.O_PATH | os.O_DIRECTORY) and not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotRegularFile(errno.EINVAL, "not a regular file", os.fspath(path))
    return fd


def _symlink_on_way(dir_fd: int, rest: list[str]) -> bool:
    try:
        return bool(rest) and stat.S_ISLNK(os.stat(rest[0], dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def write_atomically_at(dir_fd: int, name: str, data: bytes, *, owner: tuple[int, int] | None = None,
                        mode: int | None = None, before_rename=None) -> bool:
    """Replace `name` in the directory `dir_fd` with `data`, all or nothing.

    A temporary file is created next to it (``O_EXCL | O_NOFOLLOW``), given to
    `owner`, written, fsynced and renamed over `name` within the directory
    (renameat); then the directory is fsynced.  If `before_rename` returns
    False the temporary file is removed and False returned.
    """
    temp = f".{name[:200]}.{uuid.uuid4().hex[:12]}.tmp"  # within NAME_MAX for any name that fits
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temp, flags, 0o666, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as handle:
            if owner is not None:
                _give_fd_to_owner(fd, owner)
            if mode is not None:
                os.fchmod(fd, mode)
            handle.write(data)
            handle.flush()
            os.fsync(fd)
        if before_rename is not None and not before_rename():
            os.unlink(temp, dir_fd=dir_fd)
            return False
        os.rename(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(temp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        raise
    directory = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        os.fsync(directory)  # make the rename itself durable
    finally:
        os.close(directory)
    return True


__all__ = [
    "RESOLVE_NO_MAGICLINKS",
    "RESOLVE_NO_SYMLINKS",
    "RESOLVE_BENEATH",
    "AT_FDCWD",
    "NAME_MAX",
    "PATH_MAX",
    "PathOutsideRoot",
    "InvalidPath",
    "NotRegularFile",
    "FileTooLarge",
    "SymlinkRefused",
    "check_path_text",
    "resolve_in_root",
    "search_denied",
    "openat2",
    "open_in_root",
    "mkdirs_in_root",
    "unlink_in_root",
    "rename_in_root",
    "TooManyEntries",
    "MAX_LIST_ENTRIES",
    "MAX_REMOVE_ENTRIES",
    "MAX_TREE_DEPTH",
    "list_dir_at",
    "remove_tree_at",
    "remove_tree_in_root",
    "lstat_in_root",
    "read_tree_in_root",
    "refusal",
    "fd_path",
    "open_in_root_unless",
    "unlink_in_root_unless",
    "give_to_dir_owner",
    "agent_owner",
    "read_at_most",
    "read_regular_in_root",
    "make_dirs_nofollow",
    "lstat_at",
    "mkdir_at",
    "unlink_at",
    "rmdir_at",
    "rename_at",
    "open_dir_at",
    "open_file_at",
    "protected_at",
    "open_nofollow",
    "write_atomically_at",
]
