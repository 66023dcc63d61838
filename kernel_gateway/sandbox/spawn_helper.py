"""kg-spawn-helper in Python: the exec between the gateway and bwrap where the C helper is not built.

    python3 -I -S spawn_helper.py [--cgroup=/abs/.../cgroup.procs]... [--rlimit=RESOURCE:VALUE]...
                                  [--uid=UID --gid=GID] [--parent=PID] -- /abs/program [ARG]...

The same options, order of steps and failures as ``spawn_helper.c`` (read it
for the why): join each cgroup, set each limit (soft and hard), drop every
supplementary group and become UID/GID, ask for SIGKILL when the gateway dies
and exit at once if it is gone already, then exec the program.  Any failure
exits 127 with a ``kg-spawn-helper:`` line before the program runs.

So a sandbox is in its cgroups and dies with the gateway from its first
instruction on both spawn paths: a gateway killed at any step of a spawn
leaves nothing behind outside its cgroups.  It runs as the gateway's own
Python, isolated (``-I -S``), importing only what the interpreter has built
in; it is a host-side program and never imported by the gateway.
"""

import ctypes  # for prctl, the one call Python's os module lacks; loaded before the uid change
import os
import resource
import sys

PR_SET_PDEATHSIG = 1


def fail(what: str, error: OSError | None = None) -> None:
    detail = f": {error.strerror}" if error is not None and error.strerror else ""
    os.write(2, f"kg-spawn-helper: {what}{detail}\n".encode("utf-8", "backslashreplace"))
    os._exit(127)


def number(text: str, arg: str) -> int:
    if not text.isdigit() or not text.isascii():
        fail(f"not a number in {arg}")
    return int(text)


def main(args: list[str]) -> None:
    uid = gid = parent = None
    for i, arg in enumerate(args):
        if arg == "--":
            program = args[i + 1 :]
            break
        if arg.startswith("--cgroup="):
            path = arg[len("--cgroup=") :]
            if not path.startswith("/"):
                fail(f"expected an absolute cgroup.procs path, got {arg}")
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            except OSError as e:
                fail(f"cannot open {path}", e)
            try:
                os.write(fd, b"0")
            except OSError as e:
                fail(f"cannot join {path}", e)
            os.close(fd)
        elif arg.startswith("--parent="):
            parent = number(arg[len("--parent=") :], arg)
        elif arg.startswith("--rlimit="):
            which, colon, value = arg[len("--rlimit=") :].partition(":")
            if not colon:
                fail(f"expected --rlimit=RESOURCE:VALUE, got {arg}")
            limit = number(value, arg)
            try:
                resource.setrlimit(number(which, arg), (limit, limit))
            except (OSError, ValueError) as e:
                fail(f"cannot set {arg}", e if isinstance(e, OSError) else None)
        elif arg.startswith("--uid="):
            uid = number(arg[len("--uid=") :], arg)
        elif arg.startswith("--gid="):
            gid = number(arg[len("--gid=") :], arg)
        else:
            fail(f"unknown option {arg}")
    else:
        program = []
    if not program or not program[0].startswith("/"):
        fail("expected -- and an absolute program path")
    libc = ctypes.CDLL(None, use_errno=True) if parent is not None else None  # the interpreter may sit where
    # the agent's uid cannot read (under /root): everything is loaded before the uid changes.
    if (uid is None) != (gid is None) or (uid or 0) >= 2**32 - 1 or (gid or 0) >= 2**32 - 1:
        fail("give both --uid and --gid")
    if uid is not None:
        try:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        except OSError as e:
            fail("cannot change uid", e)
        if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid) or os.getgroups():
            fail("uid did not change")
    if parent is not None:
        # After the uid change, which clears it; it survives the exec of an ordinary bwrap.
        if libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0) != 0:
            fail("prctl PR_SET_PDEATHSIG", OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno())))
        if os.getppid() != parent:
            os._exit(127)  # the gateway is gone already
    try:
        os.execv(program[0], program)
    except OSError as e:
        fail(f"cannot exec {program[0]}", e)


if __name__ == "__main__":
    main(sys.argv[1:])
