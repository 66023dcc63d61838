"""Running one background job, step by step, each step in a sandbox.

1. **Copy** (command sandbox over the agent's tree, as the agent): make
   ``jobs/<id>/{tree,base,temp,skills}`` and copy ``from`` into ``tree`` and
   ``base``; then the Agent Library copies the agent's enabled skills into
   ``skills``.
   The copy runs *inside* the sandbox so the gateway never opens the agent's
   files: a symlink pointing out, a FIFO, a device node or a huge file can
   only reach, block or fill what the agent itself could, within the
   sandbox's limits.  Only regular files and directories are copied; anything
   else is left out and listed in ``skipped``.
2. **Run** (job sandbox over ``jobs/<id>`` only): the command, or ``codex exec``,
   with stdout and stderr going to ``stdout.log`` / ``stderr.log`` in the job
   directory (the file-size limit bounds them).  A codex run also gets its
   configuration, bound read-only from the gateway's memory, and its model
   forwarder's socket (see :mod:`codex_runner`); the forwarder lives exactly
   as long as the run.  The wall limit and a cancel
   kill bwrap's process group and the sandbox's cgroup; ``--die-with-parent``
   ends the pid namespace, background children included.
3. **Diff** (job sandbox again, fresh limits): ``diff -ruN base tree >
   change.patch``, also after a failure, a timeout or a cancel.  The gateway
   then reads only ``change.patch``, through the confined opener, size-capped,
   to record its SHA-256 and the files it touches.
4. **Apply** (command sandbox over the agent's tree, on request): check every
   touched file of ``from`` against ``base``, ``patch -p1 --dry-run``, then
   ``patch -p1``; binary files are copied from ``tree``.

No Tornado here.
"""

from __future__ import annotations

import asyncio
import codecs
import errno
import hashlib
import json
import os
import re
import signal
import stat
import subprocess
from dataclasses import dataclass, field
from typing import Any, Callable

from . import codex_runner
from .egress.forwarder import Forwarder, Route
from .errors import GatewayError, conflict
from .sandbox import launch, reach
from .sandbox.profile import parse_duration
from . import fs
from .tools.command import run_command

STEP_WALL = 600.0  # seconds for the copy, diff and apply steps (within their profiles' own walls)

# Runs inside the command sandbox, as the agent; argv: FROM JOB.
COPY_SCRIPT = r"""
import json, os, stat, sys
source, job = sys.argv[1:3]
skipped = []
KINDS = {stat.S_IFLNK: "symlink", stat.S_IFIFO: "fifo", stat.S_IFSOCK: "socket",
         stat.S_IFCHR: "character device", stat.S_IFBLK: "block device"}

def copy_file(path, targets, mode):
    # O_NOFOLLOW | O_NONBLOCK: a file swapped for a symlink or a FIFO neither leads out nor blocks.
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        outs = [os.open(t, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode) for t in targets]
        while chunk := os.read(fd, 1 << 20):
            for out in outs:
                view = memoryview(chunk)
                while view:
                    view = view[os.write(out, view):]
        for out in outs:
            os.close(out)
        return True
    finally:
        os.close(fd)

def copy_tree(top, targets, label, rel=""):
    with os.scandir(os.path.join(top, rel) if rel else top) as it:
        entries = sorted(it, key=lambda e: e.name)
    for entry in entries:
        sub = os.path.join(rel, entry.name) if rel else entry.name
        st = entry.stat(follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            for t in targets:
                os.mkdir(os.path.join(t, sub), (st.st_mode & 0o777) | 0o700)
            copy_tree(top, targets, label, sub)
        elif stat.S_ISREG(st.st_mode) and copy_file(
                os.path.join(top, sub), [os.path.join(t, sub) for t in targets], (st.st_mode & 0o777) | 0o600):
            pass
        else:
            kind = KINDS.get(stat.S_IFMT(st.st_mode), "special file")
            skipped.append({"path": os.path.join(label, sub), "type": kind})

os.mkdir(job, 0o755)
for name in ("tree", "base", "temp", "skills"):
    os.mkdir(os.path.join(job, name), 0o755)
copy_tree(source, [os.path.join(job, "tree"), os.path.join(job, "base")], "")
print(json.dumps(skipped))
"""

# Runs inside the job sandbox; argv: JOB.  Lists what diff cannot carry, then diffs; exits as diff does.
DIFF_SCRIPT = r"""
cd "$1" || exit 3
rm -f change.patch temp/not-carried.txt temp/diff-errors.txt
find base tree ! -type f ! -type d -print > temp/not-carried.txt 2>/dev/null
diff -ruN --no-dereference base tree > change.patch 2> temp/diff-errors.txt
"""

# Runs inside the command sandbox, in ``from``, as the agent; argv: JOB then T:path / B:path
# per touched file (T a text file patch carries, B a binary file copied from tree).
APPLY_SCRIPT = r"""
job=$1; shift
# The patch waits in the sandbox's own /tmp: a fixed name in the agent's tree (the shell's pid is
# always 2 here) could be a directory, a FIFO or a symlink the agent put there first.
patch_file=$(mktemp /tmp/apply.XXXXXXXX) || exit 5
cat > "$patch_file" || exit 5
top=$(pwd -P)
bad=0
for entry in "$@"; do
    f=${entry#?:}
    # Every directory on the way must still be a directory, not a symlink to one: patch refuses
    # names through a symlink part-way, and cp would write wherever it led.
    d=$(dirname -- "$f")
    while [ ! -e "$d" ] && [ ! -L "$d" ]; do d=$(dirname -- "$d"); done
    want=$top; [ "$d" = . ] || want="$top/$d"
    real=$(cd -P -- "$d" 2>/dev/null && pwd -P) || real=
    if [ "$real" != "$want" ]; then
        printf 'conflict: %s\n' "$f"; bad=1
    elif [ -e "$job/base/$f" ]; then
        # Only the regular file it was (cmp would block on a FIFO, and follow a symlink).
        if [ -L "$f" ] || [ ! -f "$f" ] || ! cmp -s -- "$job/base/$f" "$f"; then
            printf 'conflict: %s\n' "$f"; bad=1
        fi
    elif [ -e "$f" ] || [ -L "$f" ]; then
        printf 'conflict: %s\n' "$f"; bad=1
    fi
done
[ $bad = 0 ] || { rm -f "$patch_file"; exit 3; }
# Every file the patch writes must be writable, and so must the directory it is
# (or will be) in: patch and cp replace files there. Checked first, so that a
# read-only file or directory stops the apply before anything changed.
for entry in "$@"; do
    f=${entry#?:}
    d=$(dirname -- "$f")
    while [ ! -e "$d" ] && [ ! -L "$d" ]; do d=$(dirname -- "$d"); done
    if { [ -e "$f" ] && [ ! -w "$f" ]; } || [ ! -d "$d" ] || [ ! -w "$d" ]; then
        printf 'unwritable: %s\n' "$f"; bad=1
    fi
done
[ $bad = 0 ] || { rm -f "$patch_file"; exit 7; }
# A binary file is copied from the job's tree/ after the text is patched: it must still be the
# regular, readable file the patch was made from, or the copy would fail part-way (or follow a link).
for entry in "$@"; do
    case $entry in
    B:*) t="$job/tree/${entry#B:}"
         if { [ -e "$t" ] || [ -L "$t" ]; } && { [ -L "$t" ] || [ ! -f "$t" ] || [ ! -r "$t" ]; }; then
             printf 'unreadable: %s\n' "${entry#B:}"; bad=1
         fi;;
    esac
done
[ $bad = 0 ] || { rm -f "$patch_file"; exit 8; }
if [ -s "$patch_file" ]; then
    patch -p1 -E -N -f -s --dry-run -i "$patch_file" || { rm -f "$patch_file"; exit 4; }
    patch -p1 -E -N -f -s -i "$patch_file" || { rm -f "$patch_file"; exit 6; }
fi
rm -f "$patch_file"
for entry in "$@"; do
    case $entry in
    B:*) f=${entry#B:}
         if [ -f "$job/tree/$f" ]; then mkdir -p -- "$(dirname -- "$f")" && cp -- "$job/tree/$f" "$f" || exit 6
         else rm -f -- "$f" || exit 6; fi;;
    esac
done
"""

_BINARY = re.compile(r"^Binary files base/(.*) and tree/(.*) differ$")
_ONLY_IN = re.compile(r"^Only in (base|tree)(/.*)?: (.*)$")


@dataclass
class Context:
    """What running a job needs from the gateway, resolved per job."""

    agent_root: str
    values: dict
    command_profile: dict
    job_profile: dict  # the job's own profile: its limits already narrowed
    bwrap: str | None
    cgroup_name: str
    output_limit: int = 65536
    patch_limit: int = 64 << 20
    run_as: launch.RunAs | None = None  # the host uid the job's sandboxes run as; None: the gateway's
    # The accept gate's ``listen_unix_streams``: a codex run's model forwarder listens through it.
    listen_streams: Callable[..., Any] | None = None
    close_listener: Callable[[str], None] = lambda name: None


@dataclass
class Outcome:
    state: str
    exit_code: int | None = None
    signal: str | None = None
    stdout_tail: str = ""
    stderr_tail: str = ""
    error: str | None = None
    skipped: list = field(default_factory=list)
    patch: dict | None = None


@dataclass
class CodexRun:
    """What the codex kind adds to the run step (see :mod:`codex_runner`)."""

    argv: list[str]
    env: dict[str, str]  # CODEX_HOME: never a secret
    config_toml: str  # bound read-only at CODEX_HOME/config.toml from memory; holds the job's dummy token
    read_only: list[str]
    route: Route = field(repr=False)  # the forwarder's route: the model's URL and the real key
    socket_path: str = ""  # the forwarder's socket on the host (in the state directory)


def job_dir(ctx: Context, job: Any) -> str:
    return os.path.join(os.path.realpath(ctx.agent_root), job.workspace)


def _job_values(ctx: Context, job: Any) -> dict:
    values = {k: v for k, v in ctx.values.items() if k != "agent_socket"}  # a job has no gateway socket
    values["job_dir"] = job_dir(ctx, job)
    return values


def _step_profile(profile: dict) -> dict:
    """A profile for a short helper step: its own limits, with a wall of at most STEP_WALL."""
    step = dict(profile)
    limits = dict(profile.get("limits", {}))
    wall = parse_duration(limits.get("wall"), "limits.wall")
    limits["wall"] = STEP_WALL if wall is None else min(wall, STEP_WALL)
    step["limits"] = limits
    return step


async def _in_command_sandbox(ctx: Context, argv: list[str], cwd: str, stdin: str = "") -> dict:
    return await run_command(
        {"argv": argv, "cwd": cwd, "stdin": stdin},
        agent_root=ctx.agent_root,
        profile=_step_profile(ctx.command_profile),
        values=ctx.values,
        spill_dir=os.path.join(ctx.agent_root, ".kernel-gateway", "commands"),
        output_limit=ctx.output_limit,
        max_stdin=ctx.patch_limit,
        bwrap=ctx.bwrap,
        run_as=ctx.run_as,
    )


# --- step 1: copy ----------------------------------------------------------------


async def copy_in(ctx: Context, job: Any) -> list:
    """Make the job's workspace from ``from``; return what was left out."""
    root = os.path.realpath(ctx.agent_root)
    ran = await _in_command_sandbox(
        ctx,
        ["python3", "-I", "-c", COPY_SCRIPT, os.path.join(root, job.source), job_dir(ctx, job)],
        cwd=".",
    )
    if ran["exit_code"] != 0 or ran["timed_out"]:
        if ran["timed_out"]:
            why = "it took too long"
        elif ran["signal"] == "SIGXFSZ":
            why = "a file in it is over the file-size limit"
        else:
            why = (ran["stderr"].strip().splitlines() or [f"exit {ran['exit_code']}"])[-1]
        raise GatewayError(500, "copy_failed", f"copying {job.source!r} into the job failed: {why}")
    try:
        return json.loads(ran["stdout"].strip().splitlines()[-1])
    except (ValueError, IndexError):
        return []


# --- step 2: run -----------------------------------------------------------------


def _tail(fd: int, keep: int) -> str:
    """The last ``keep`` bytes of a log the gateway holds open (no path lookup)."""
    size = os.fstat(fd).st_size
    data = os.pread(fd, keep, max(0, size - keep))
    start = 0
    if size > keep:
        while start < min(3, len(data)) and data[start] & 0xC0 == 0x80:
            start += 1  # a character cut at the start
    return codecs.decode(data[start:], "utf-8", "replace")


def _open_log(ctx: Context, job: Any, name: str) -> int:
    path = os.path.join(job.workspace, name)
    # O_EXCL through no symlink: whatever the agent put there, this is a new file (the agent's).
    return _open_nofollow(ctx, path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)


def _open_nofollow(ctx: Context, rel: str, flags: int, mode: int = 0o644) -> int:
    """``fs.open_nofollow`` beneath the agent root; a symlink on the way is an OSError (ELOOP) here."""
    try:
        return fs.open_nofollow(ctx.agent_root, rel, flags, mode)
    except fs.PathOutsideRoot:
        raise OSError(errno.ELOOP, "it is, or goes through, a symlink; refused", rel) from None


def _pin(ctx: Context, rel: str) -> int:
    """An O_PATH fd of a directory of the job, opened beneath the agent root.

    bwrap would resolve a path as root on the host, following a symlink the
    agent swapped in (``jobs/<id>`` -> another agent's files); binding the fd
    binds the very directory we checked.
    """
    fd = _open_nofollow(ctx, rel, os.O_PATH | os.O_DIRECTORY)
    if not stat.S_ISDIR(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.ENOTDIR, "not a directory", rel)
    return fd


def _fd_bind(option: str, fd: int, at: str, run_as: launch.RunAs | None) -> list[str]:
    """Bind a pinned fd; an unprivileged bwrap that could not reach its path gets an alias of that fd."""
    if run_as is not None:
        alias = reach.alias_of_fd(fd, run_as.uid, run_as.gid)
        if alias is not None:
            return [option, alias, at]  # the alias holds the directory: the fd is not passed on
    return [f"{option}-fd", str(fd), at]


def _bind_pinned(prepared: launch.PreparedSandbox, command_len: int, directory: str, job_fd: int,
                 read_only: list[tuple[int, str]]) -> None:
    """Bind the job directory from its fd, then ``read_only`` (fd, path) pairs over it."""
    argv = prepared.argv
    for i in range(len(argv) - command_len - 2):
        # The source may already be an alias the sandbox's uid can reach (launch.prepare).
        if argv[i] == "--bind" and argv[i + 2] == directory:
            argv[i:i + 3] = _fd_bind("--bind", job_fd, directory, prepared.run_as)
            break
    else:
        raise RuntimeError("the job profile does not bind $$job_dir$$ read-write")
    at = len(argv) - command_len - 1
    if argv[at] != "--":
        raise RuntimeError("unexpected sandbox argv: no '--' before the command")
    extra: list[str] = []
    for fd, path in read_only:
        extra += _fd_bind("--ro-bind", fd, path, prepared.run_as)
    argv[at:at] = extra
    # The fds bwrap binds are passed to it and closed once spawned; those bound through an alias now.
    for fd in [job_fd] + [fd for fd, _ in read_only]:
        if any(argv[i] in ("--bind-fd", "--ro-bind-fd") and argv[i + 1] == str(fd) for i in range(len(argv) - 1)):
            prepared.data_fds.append(fd)
        else:
            os.close(fd)


async def _in_job_sandbox(ctx: Context, job: Any, profile: dict, argv: list[str], env: dict,
                          stdout: int, stderr: int, cancel: asyncio.Event | None,
                          read_only: tuple[str, ...] = ()) -> tuple[int | None, str | None, Any]:
    """Run ``argv`` in the job sandbox; returns (returncode, "cancelled"/"timed_out"/None, limits)."""
    directory = job_dir(ctx, job)
    fds = [_pin(ctx, job.workspace)]
    try:
        fds += [_pin(ctx, os.path.join(job.workspace, rel)) for rel in read_only]
        prepared = launch.prepare(profile, _job_values(ctx, job), argv, bwrap=ctx.bwrap,
                                  name=ctx.cgroup_name, extra_env=env, run_as=ctx.run_as)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    _bind_pinned(prepared, len(argv), directory, fds[0],
                 [(fd, os.path.join(directory, rel)) for fd, rel in zip(fds[1:], read_only)])
    process = await launch.spawn(prepared, stdin=asyncio.subprocess.DEVNULL, stdout=stdout, stderr=stderr)
    ended = None
    waiter = asyncio.ensure_future(process.wait())
    waits = {waiter}
    if cancel is not None:
        cancelled = asyncio.ensure_future(cancel.wait())
        waits.add(cancelled)
    try:
        done, _ = await asyncio.wait(waits, timeout=prepared.limits.wall_seconds,
                                     return_when=asyncio.FIRST_COMPLETED)
        if waiter not in done:
            ended = "cancelled" if cancel is not None and cancelled in done else "timed_out"
    finally:
        for task in waits:
            if task is not waiter:
                task.cancel()
        if process.returncode is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)  # bwrap; its pid namespace ends with it
            except ProcessLookupError:
                pass
            await process.wait()
        # Whatever is left in the cgroup (nothing, once the namespace is gone) is killed too.
        await prepared.finish()
    return process.returncode, ended, prepared


def _codex_profile(profile: dict, codex: CodexRun) -> dict:
    """The job profile plus what a codex run needs: Codex's binary, its config, the forwarder's socket."""
    sandbox = dict(profile["sandbox"])
    sandbox["read_only"] = list(sandbox.get("read_only", [])) + codex.read_only
    sandbox["read_write"] = list(sandbox.get("read_write", [])) + [{"from": codex.socket_path, "at": codex_runner.MODEL_SOCKET}]
    sandbox["created_files"] = list(sandbox.get("created_files", [])) + [
        {"at": f"{codex_runner.CODEX_HOME}/config.toml", "text": codex.config_toml}]
    return dict(profile, sandbox=sandbox)


async def _start_forwarder(ctx: Context, job: Any, codex: CodexRun) -> Forwarder:
    """The job's model forwarder, on a fresh socket of the accept gate that only the job's uid may use."""
    if ctx.listen_streams is None:
        raise GatewayError(500, "no_forwarder", "codex jobs need the gateway's accept gate for their model forwarder")
    forwarder = Forwarder(f"job:{job.agent}/{job.id}", [codex.route])
    run_as = ctx.run_as
    forwarder.peer_uid = run_as.uid if run_as is not None else None
    ctx.listen_streams(codex.socket_path, forwarder_name(job), forwarder.serve_socket, forwarder.limits.connections,
                       (run_as.uid, run_as.gid) if run_as is not None else None)
    return forwarder


def forwarder_name(job: Any) -> str:
    return f"egress:{job.id}"


async def run_main(ctx: Context, job: Any, cancel: asyncio.Event, codex: CodexRun | None) -> Outcome:
    profile = dict(ctx.job_profile)
    profile["process"] = dict(profile.get("process", {}), cwd="$$job_dir$$/tree")
    if codex is None:
        return await _run_main(ctx, job, cancel, profile, job.command, {})
    forwarder = await _start_forwarder(ctx, job, codex)
    try:
        return await _run_main(ctx, job, cancel, _codex_profile(profile, codex), codex.argv, codex.env)
    finally:  # the forwarder lives exactly as long as the run; the gate removes its socket
        ctx.close_listener(forwarder_name(job))
        await forwarder.close()


async def _run_main(ctx: Context, job: Any, cancel: asyncio.Event, profile: dict, argv: list[str],
                    extra_env: dict[str, str]) -> Outcome:
    # job.env was checked by request_env (when submitted, and again before this run).
    env = {**job.env, "TMPDIR": os.path.join(job_dir(ctx, job), "temp"), **extra_env}
    out_fd, err_fd = _open_log(ctx, job, "stdout.log"), _open_log(ctx, job, "stderr.log")
    try:
        returncode, ended, prepared = await _in_job_sandbox(
            ctx, job, profile, argv, env, out_fd, err_fd, cancel, read_only=("skills",))
        keep = prepared.compiled.keep
        exit_code, signum = launch.exit_status(returncode)
        state = ended or ("succeeded" if returncode == 0 else "failed")
        return Outcome(
            state=state,
            exit_code=exit_code if state in ("succeeded", "failed") else None,
            signal=signal.Signals(signum).name if signum and state == "failed" else None,
            stdout_tail=_tail(out_fd, keep.get("stdout", 4096)),
            stderr_tail=_tail(err_fd, keep.get("stderr", 2048)),
            error={"timed_out": f"the wall limit of {prepared.limits.wall_seconds:g} s ended the job",
                   "cancelled": "cancelled on request"}.get(state),
        )
    finally:
        os.close(out_fd)
        os.close(err_fd)


def read_tails(ctx: Context, job: Any) -> tuple[str, str]:
    """The logs' tails of a job the gateway no longer holds (after a restart)."""
    tails = []
    keep = {"stdout": 4096, "stderr": 2048}
    for name in ("stdout", "stderr"):
        try:
            fd = _open_regular(ctx, os.path.join(job.workspace, f"{name}.log"))
        except (OSError, fs.PathOutsideRoot):
            tails.append("")
            continue
        try:
            tails.append(_tail(fd, keep[name]))
        finally:
            os.close(fd)
    return tails[0], tails[1]


# --- step 3: diff ----------------------------------------------------------------


def _open_regular(ctx: Context, rel: str) -> int:
    return _open_nofollow(ctx, rel, os.O_RDONLY)  # a regular file, reached through no symlink


_HUNK = re.compile(rb"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")


class PatchSummary:
    """Reads a ``diff -ruN base tree`` output line by line: SHA-256, size, touched files.

    Hunk bodies are skipped by their line counts, so a changed line that reads
    like a header (an added line ``++ tree/x`` shows as ``+++ tree/x``) is not
    taken for one.
    """

    def __init__(self) -> None:
        self.digest = hashlib.sha256()
        self.size = 0
        self.files: list[str] = []
        self.binary: list[str] = []
        self.only: list[str] = []
        self._old = self._new = 0  # lines left in the current hunk
        self._pending = b""

    def feed(self, chunk: bytes) -> None:
        self.digest.update(chunk)
        self.size += len(chunk)
        lines = (self._pending + chunk).split(b"\n")
        self._pending = lines.pop()
        for line in lines:
            self._line(line)

    def _line(self, raw: bytes) -> None:
        if self._old > 0 or self._new > 0:
            tag = raw[:1]
            if tag in (b" ", b""):
                self._old, self._new = self._old - 1, self._new - 1
            elif tag == b"-":
                self._old -= 1
            elif tag == b"+":
                self._new -= 1
            return  # "\ No newline at end of file" and the rest of a hunk
        if (m := _HUNK.match(raw)) is not None:
            self._old = int(m.group(1) or 1)
            self._new = int(m.group(2) or 1)
            return
        line = raw.decode("utf-8", "surrogateescape")
        if line.startswith("+++ tree/"):
            self.files.append(line[len("+++ tree/"):].split("\t")[0])
        elif m := _BINARY.match(line):
            self.binary.append(m.group(2))
        elif m := _ONLY_IN.match(line):
            self.only.append(os.path.join(m.group(1) + (m.group(2) or ""), m.group(3)))

    def result(self) -> dict:
        if self._pending:
            self._line(self._pending)
            self._pending = b""
        return {"bytes": self.size, "sha256": self.digest.hexdigest(), "files": self.files,
                "binary_files": self.binary, "not_carried": self.only}


def summarize_patch(fd: int) -> dict:
    """SHA-256, size and touched files of a ``diff -ruN base tree`` output, read from ``fd``."""
    summary = PatchSummary()
    while chunk := os.read(fd, 1 << 16):
        summary.feed(chunk)
    return summary.result()


def _read_small(ctx: Context, rel: str, limit: int = 65536) -> str:
    try:
        fd = _open_regular(ctx, rel)
    except (OSError, fs.PathOutsideRoot):
        return ""
    try:
        return os.read(fd, limit).decode("utf-8", "replace")
    finally:
        os.close(fd)


async def make_patch(ctx: Context, job: Any, partial: bool) -> dict:
    """Write ``change.patch`` in the job sandbox and record what it holds."""
    returncode, ended, _ = await _in_job_sandbox(
        ctx, job, _step_profile(ctx.job_profile), ["/bin/sh", "-c", DIFF_SCRIPT, "diff", job_dir(ctx, job)],
        {}, subprocess.DEVNULL, subprocess.DEVNULL, None)
    special = [line for line in _read_small(ctx, os.path.join(job.workspace, "temp", "not-carried.txt")).splitlines() if line]
    warnings = _read_small(ctx, os.path.join(job.workspace, "temp", "diff-errors.txt"))[-2048:]
    try:
        fd = _open_regular(ctx, os.path.join(job.workspace, "change.patch"))
    except (OSError, fs.PathOutsideRoot) as e:
        return {"bytes": None, "sha256": None, "files": [], "binary_files": [], "not_carried": special,
                "partial": partial, "error": f"no change.patch: {getattr(e, 'strerror', None) or e}",
                "warnings": warnings}
    try:
        size = os.fstat(fd).st_size
        if size > ctx.patch_limit:  # the agent may have put any file there; never read it all
            return {"bytes": size, "sha256": None, "files": [], "binary_files": [], "not_carried": special,
                    "partial": partial, "error": f"change.patch is over the limit of {ctx.patch_limit} bytes",
                    "warnings": warnings}
        summary = await asyncio.to_thread(summarize_patch, fd)  # hashing 64 MiB is not for the event loop
    finally:
        os.close(fd)
    summary["not_carried"] = sorted(set(summary["not_carried"]) | set(special))
    summary["partial"] = partial
    if ended or returncode not in (0, 1):
        summary["warnings"] = warnings or f"diff ended with {returncode}" + (f" ({ended})" if ended else "")
    elif warnings:
        summary["warnings"] = warnings
    return summary


async def run(ctx: Context, job: Any, cancel: asyncio.Event, codex: CodexRun | None = None,
              skills: Callable[[], Any] | None = None) -> Outcome:
    """Copy, run, diff: the whole life of a running job.

    ``skills`` fills ``jobs/<id>/skills`` with the agent's enabled skills (the
    Agent Library's ``materialize_skills``); the run step binds it read-only.
    """
    skipped = await copy_in(ctx, job)
    if skills is not None:
        await asyncio.to_thread(skills)  # up to megabytes of files: not on the event loop
    if cancel.is_set():
        outcome = Outcome(state="cancelled", error="cancelled on request")
    else:
        outcome = await run_main(ctx, job, cancel, codex)
    outcome.skipped = skipped
    outcome.patch = await make_patch(ctx, job, partial=outcome.state != "succeeded")
    return outcome


# --- reading the patch, applying it, removing the workspace ------------------------


def read_patch(ctx: Context, job: Any, limit: int) -> bytes:
    """The recorded patch, re-read confined and checked against its recorded SHA-256."""
    try:
        fd = _open_regular(ctx, os.path.join(job.workspace, "change.patch"))
    except (OSError, fs.PathOutsideRoot):
        raise conflict(f"the patch of job {job.id} is gone from its workspace", code="patch_changed") from None
    try:
        if os.fstat(fd).st_size > limit:
            raise GatewayError(413, "patch_too_large", f"the patch is over {limit} bytes",
                               f"read it in the job's workspace: {job.workspace}/change.patch")
        data = b""
        while chunk := os.read(fd, 1 << 20):
            data += chunk
            if len(data) > limit:
                raise GatewayError(413, "patch_too_large", f"the patch is over {limit} bytes")
    finally:
        os.close(fd)
    if hashlib.sha256(data).hexdigest() != job.patch["sha256"]:
        raise conflict(
            f"change.patch of job {job.id} changed since the job ended (its SHA-256 differs)",
            "run the job again", code="patch_changed",
        )
    return data


async def apply_patch(ctx: Context, job: Any, data: bytes) -> dict:
    """Apply the job's patch to ``from``: all of it or nothing; 409 if ``from`` changed."""
    patch = job.patch
    files = [f"T:{f}" for f in patch["files"]] + [f"B:{f}" for f in patch["binary_files"]]
    if not files:
        return {"applied": True, "files": [], "binary_files": [], "output": "the patch is empty: nothing to do"}
    ran = await _in_command_sandbox(
        ctx, ["/bin/sh", "-c", APPLY_SCRIPT, "apply", job_dir(ctx, job), *files],
        cwd=job.source, stdin=data.decode("utf-8", "surrogateescape"),
    )
    output = (ran["stdout"] + ran["stderr"]).strip()
    def listed(prefix: str) -> list[str]:  # the paths the apply script named on lines "PREFIX: path"
        return [line[len(prefix) :] for line in ran["stdout"].splitlines() if line.startswith(prefix)]

    if ran["exit_code"] == 3:
        changed = listed("conflict: ")
        raise GatewayError(
            409, "source_changed",
            f"{len(changed)} file(s) in {job.source!r} changed since the job copied them: {', '.join(changed)}; nothing was applied",
            "look at the patch (GET .../patch) and merge by hand, or run the job again on the current files",
        )
    if ran["exit_code"] == 7:
        unwritable = listed("unwritable: ")
        raise GatewayError(
            409, "target_not_writable",
            f"{len(unwritable)} file(s) the patch writes in {job.source!r} cannot be written: {', '.join(unwritable)};"
            " nothing was applied",
            "make them (and their directories) writable again, then apply; read-only Library files cannot be patched",
        )
    if ran["exit_code"] == 8:
        unreadable = listed("unreadable: ")
        raise GatewayError(
            409, "job_tree_changed",
            f"{len(unreadable)} binary file(s) in the job's tree/ are no longer regular, readable files: "
            f"{', '.join(unreadable)}; nothing was applied",
            "run the job again (its tree/ is what the patch carries for binary files)",
        )
    if ran["exit_code"] == 4:
        raise GatewayError(409, "patch_does_not_apply", f"the patch does not apply to {job.source!r}; nothing was applied: {output}")
    if ran["exit_code"] != 0 or ran["timed_out"]:
        raise GatewayError(500, "apply_failed", f"applying the patch failed part-way: {output}",
                           "the job's tree/ holds the intended files")
    return {"applied": True, "files": patch["files"], "binary_files": patch["binary_files"], "output": output}


async def remove_workspace(ctx: Context, job: Any) -> None:
    """``rm -rf jobs/<id>`` as the agent, in its command sandbox (never as root on the host).

    The workspace is the agent's: made read-only, it is made writable again
    first (as the agent, who owns it); what still cannot go is a 409.
    """
    ran = await _in_command_sandbox(
        ctx, ["/bin/sh", "-c", 'chmod -R u+w -- "$1" 2>/dev/null; rm -rf -- "$1"', "remove", job.workspace], cwd=".")
    if ran["exit_code"] != 0:
        lines = ran["stderr"].strip().splitlines()
        raise GatewayError(
            409, "remove_failed",
            f"could not remove {job.workspace}: {'; '.join(lines[:3])[:500]}" + (f" (and {len(lines) - 3} more)" if len(lines) > 3 else ""),
            f"make {job.workspace} and what is in it writable and owned by the agent, then delete again",
        )
