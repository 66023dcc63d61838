"""The seccomp filter of every sandbox: syscalls a kernel or a shell never needs.

The model is Docker's default profile, turned around: Docker allows a list and
denies the rest; we allow everything and deny the syscalls below, each for a
reason.  A denied syscall fails with ``EPERM`` (the process is not killed), so
programs get a clean error they usually already handle.  The filter is built
with libseccomp (Debian's ``libseccomp2``) through ctypes, exported as a BPF
program and handed to ``bwrap --seccomp FD``, which loads it just before it
runs the sandboxed command.  libseccomp checks the architecture of each call:
the same names are denied for the native ABI and its compat ABIs (i386 and x32
on x86_64, arm on aarch64), and a call from any other ABI kills the process.

Denied, with the reason (``DENIED`` below is the source of truth):

================================  ==============================================
keyctl, add_key, request_key      the kernel keyring is not namespaced
bpf                               eBPF programs are kernel attack surface
perf_event_open                   host-wide performance data, kernel attack surface
userfaultfd                       a classic exploit aid (stalls kernel page faults)
io_uring_setup/_enter/_register   a large, frequently exploited kernel interface
kexec_load, kexec_file_load       loads a new kernel
init_module, finit_module,        loads or unloads kernel modules
delete_module, create_module,
query_module, get_kernel_syms
open_by_handle_at,                opens files by handle, around mount confinement
name_to_handle_at                 (the "shocker" container escape)
reboot                            reboots the host
swapon, swapoff                   host swap configuration
acct                              host process accounting
quotactl, quotactl_fd             host disk quota configuration
settimeofday, clock_settime,      the host clock is shared by every sandbox
clock_adjtime, stime
iopl, ioperm                      raw I/O port access
syslog                            the host kernel log
lookup_dcookie, nfsservctl,       obsolete interfaces with no place in a sandbox
sysfs, _sysctl, uselib, ustat,
vm86, vm86old
================================  ==============================================

and, unless the profile allows nested user namespaces (``nested_userns``):

================================  ==============================================
mount, umount, umount2,           every process in the sandbox lacks CAP_SYS_ADMIN,
pivot_root, fsopen, fsconfig,     so these can only fail; denying them keeps their
fsmount, fspick, move_mount,      argument parsing out of reach.  With a nested
open_tree, mount_setattr          user namespace they are what it is for.
unshare, setns                    new or other namespaces (user namespaces are also
                                  refused by ``bwrap --disable-userns``)
================================  ==============================================

Allowed on purpose: ``ptrace``, ``process_vm_readv/writev``, ``kcmp`` and
``pidfd_getfd`` (debuggers and profilers in a kernel trace its own children;
the pid namespace hides every other process and, on Linux 4.8 and later,
ptrace cannot be used to get around seccomp, which is why Docker allows it
too); ``personality`` (gdb turns off ASLR for its inferior); ``clone`` and
``clone3`` (threads; new namespaces need CAP_SYS_ADMIN, which is dropped, and
user namespaces are refused by ``--disable-userns``); the NUMA calls
(``mbind``, ``set_mempolicy``, ``move_pages``: acting on other processes needs
CAP_SYS_NICE, which is dropped).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import platform

#: (syscall names, reason), denied in every filter.
DENIED: tuple[tuple[tuple[str, ...], str], ...] = (
    (("keyctl", "add_key", "request_key"), "the kernel keyring is not namespaced"),
    (("bpf",), "eBPF programs are kernel attack surface"),
    (("perf_event_open",), "host-wide performance data, kernel attack surface"),
    (("userfaultfd",), "a classic exploit aid (stalls kernel page faults)"),
    (("io_uring_setup", "io_uring_enter", "io_uring_register"), "a large, frequently exploited kernel interface"),
    (("kexec_load", "kexec_file_load"), "loads a new kernel"),
    (
        ("init_module", "finit_module", "delete_module", "create_module", "query_module", "get_kernel_syms"),
        "loads or unloads kernel modules",
    ),
    (("open_by_handle_at", "name_to_handle_at"), "opens files by handle, around mount confinement"),
    (("reboot",), "reboots the host"),
    (("swapon", "swapoff"), "host swap configuration"),
    (("acct",), "host process accounting"),
    (("quotactl", "quotactl_fd"), "host disk quota configuration"),
    (("settimeofday", "clock_settime", "clock_adjtime", "stime"), "the host clock is shared by every sandbox"),
    (("iopl", "ioperm"), "raw I/O port access"),
    (("syslog",), "the host kernel log"),
    (
        ("lookup_dcookie", "nfsservctl", "sysfs", "_sysctl", "uselib", "ustat", "vm86", "vm86old"),
        "obsolete interfaces with no place in a sandbox",
    ),
)

#: Denied unless the profile allows nested user namespaces.
DENIED_WITHOUT_NESTED_USERNS: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        ("mount", "umount", "umount2", "pivot_root", "fsopen", "fsconfig", "fsmount", "fspick",
         "move_mount", "open_tree", "mount_setattr"),
        "needs CAP_SYS_ADMIN, which no process in the sandbox has",
    ),  # fmt: skip
    (("unshare", "setns"), "new or other namespaces"),
)

# Compat ABIs of each native architecture: a filter that checked only the
# native one would let `int $0x80` (i386) or x32 calls through.
_COMPAT_ARCHES = {"x86_64": ("x86", "x32"), "aarch64": ("arm",)}

_SCMP_ACT_ALLOW = 0x7FFF0000
_NR_SCMP_ERROR = -1


def _act_errno(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


class SeccompUnavailable(RuntimeError):
    """libseccomp cannot be loaded or refused the filter; the message says how to fix it."""


def denied_syscalls(nested_userns: bool = False) -> list[str]:
    """Every syscall name the filter denies."""
    groups = DENIED + (() if nested_userns else DENIED_WITHOUT_NESTED_USERNS)
    return [name for names, _reason in groups for name in names]


@functools.lru_cache(maxsize=1)
def _libseccomp() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    except OSError as e:
        raise SeccompUnavailable(
            f"libseccomp is not available ({e}); install it with `apt-get install -y libseccomp2`,"
            ' or turn the filter off in the profile ("sandbox": {"seccomp": false})'
        ) from None
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_arch_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_arch_resolve_name.restype = ctypes.c_uint32
    lib.seccomp_arch_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib


@functools.lru_cache(maxsize=4)
def filter_program(nested_userns: bool = False) -> bytes:
    """The BPF program (an array of ``struct sock_filter``) that ``bwrap --seccomp`` loads."""
    lib = _libseccomp()
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
    if not ctx:
        raise SeccompUnavailable("seccomp_init failed")
    try:
        for arch in _COMPAT_ARCHES.get(platform.machine(), ()):
            token = lib.seccomp_arch_resolve_name(arch.encode())
            rc = lib.seccomp_arch_add(ctx, token) if token else 0
            if rc not in (0, -errno.EEXIST):
                raise SeccompUnavailable(f"libseccomp cannot add the {arch} ABI: {os.strerror(-rc)}")
        for name in denied_syscalls(nested_userns):
            number = lib.seccomp_syscall_resolve_name(name.encode())
            if number == _NR_SCMP_ERROR:
                raise SeccompUnavailable(f"this libseccomp does not know the syscall {name!r}; upgrade libseccomp2")
            # A pseudo number (< 0) is a syscall that some of the ABIs lack: libseccomp skips those.
            rc = lib.seccomp_rule_add(ctx, _act_errno(errno.EPERM), number, 0)
            if rc != 0:
                raise SeccompUnavailable(f"libseccomp refused a rule for {name}: {os.strerror(-rc)}")
        fd = os.memfd_create("seccomp-export", os.MFD_CLOEXEC)
        try:
            rc = lib.seccomp_export_bpf(ctx, fd)
            if rc != 0:
                raise SeccompUnavailable(f"seccomp_export_bpf failed: {os.strerror(-rc)}")
            size = os.lseek(fd, 0, os.SEEK_END)
            return os.pread(fd, size, 0)
        finally:
            os.close(fd)
    finally:
        lib.seccomp_release(ctx)


def filter_fd(nested_userns: bool = False) -> int:
    """A fresh memfd holding the filter, positioned at its start, for one bwrap to read."""
    program = filter_program(nested_userns)
    fd = os.memfd_create("seccomp-filter", 0)
    os.write(fd, program)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def describe(nested_userns: bool = False) -> str:
    """One line for doctor and /v1/info, or :class:`SeccompUnavailable`."""
    program = filter_program(nested_userns)
    return (
        f"{len(denied_syscalls(nested_userns))} syscalls denied with EPERM "
        f"(libseccomp, {len(program) // 8} BPF instructions)"
    )


def walls(profile: dict) -> dict:
    """The profile's switches, for /v1/info: is the filter on, are nested user namespaces allowed."""
    sandbox = profile.get("sandbox", {})
    return {"seccomp": sandbox.get("seccomp", True), "nested_userns": sandbox.get("nested_userns", False)}
