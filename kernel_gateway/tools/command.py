"""The ``command`` tool: one shell command in a fresh sandbox over the agent's tree.

:func:`run_command` validates the request body, compiles the ``command``
profile with the working directory as ``$$workspace$$``, spawns bwrap from the
event loop, feeds stdin, and collects stdout and stderr.  Each stream is kept
whole up to ``output_limit`` bytes; past that only its head and tail stay in
memory, with a marker between them, and the full stream goes to a spill file
in ``spill_dir`` (inside the agent's tree, so the agent can read it).

A timeout kills bwrap's process group and everything left in the sandbox's
cgroup.  Nothing escapes the kill: bwrap runs the command in a new pid
namespace whose init dies with bwrap (``--die-with-parent``), and the kernel
then kills every process in that namespace, background jobs included.
"""

from __future__ import annotations

import asyncio
import codecs
import errno
import math
import os
import signal
import time
import uuid
from typing import Any, Awaitable, Callable, Mapping

from .. import command_spares, request_env
from ..errors import GatewayError, bad_request
from ..workspace import check_session_id
from ..sandbox import launch
from ..fs import PathOutsideRoot, fd_path, make_dirs_nofollow, open_in_root, open_nofollow, resolve_in_root

REQUEST_KEYS = ("command", "argv", "cwd", "session", "timeout", "env", "stdin", "stream")
READ_CHUNK = 1 << 16
SANDBOX_SOCKET = "/run/kernel-gateway.sock"  # where the command profile binds the agent socket

EventSink = Callable[[dict], Awaitable[None]]
SessionCwd = Callable[[str], str]  # session id -> the working directory of its kernel


# --- the request -----------------------------------------------------------------


def _no_nul(text: str, what: str) -> str:
    if "\0" in text:
        raise bad_request(f"{what} contains a NUL character", "remove the \\0 from it")
    return text


def _command_argv(request: Mapping[str, Any]) -> list[str]:
    has_command, has_argv = "command" in request, "argv" in request
    if has_command == has_argv:
        raise bad_request(
            "give exactly one of 'command' (a shell command line) and 'argv' (a list of strings)"
            + (", not both" if has_command else ""),
            'e.g. {"command": "ls -la"} or {"argv": ["ls", "-la"]}',
        )
    if has_command:
        command = request["command"]
        if not isinstance(command, str) or not command.strip():
            raise bad_request(f"'command' must be a non-empty string, got {command!r}")
        return ["/bin/sh", "-c", _no_nul(command, "'command'")]
    argv = request["argv"]
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise bad_request(f"'argv' must be a non-empty list of strings, got {argv!r}")
    if not argv[0]:
        raise bad_request("'argv' must start with the program to run, got an empty string")
    return [_no_nul(a, f"'argv[{i}]'") for i, a in enumerate(argv)]


def _requested_timeout(request: Mapping[str, Any]) -> float | None:
    timeout = request.get("timeout")
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout):
        raise bad_request(f"'timeout' must be a number of seconds, got {timeout!r}")
    if timeout <= 0:
        raise bad_request(f"'timeout' must be positive, got {timeout!r}")
    return float(timeout)


def _stdin(request: Mapping[str, Any], max_stdin: int) -> bytes:
    stdin = request.get("stdin", "")
    if not isinstance(stdin, str):
        raise bad_request(f"'stdin' must be a string, got {type(stdin).__name__}")
    data = stdin.encode("utf-8", errors="surrogateescape")
    if len(data) > max_stdin:
        raise bad_request(
            f"'stdin' is {len(data)} bytes, over the limit of {max_stdin} bytes",
            "write the input to a file in the workspace and redirect it: cmd < file",
            code="stdin_too_large",
        )
    return data


def requested_session(request: Any) -> str | None:
    """The session a command runs for, if the request names one (checked like every session id)."""
    if not isinstance(request, dict) or request.get("session") is None:
        return None
    return check_session_id(request["session"])


def _cwd(
    request: Mapping[str, Any], agent_root: str, session: str | None, session_cwd: SessionCwd | None
) -> str:
    """An explicit ``cwd`` (agent-root relative), else the session's working directory, else the root."""
    cwd = request.get("cwd")
    if cwd is None and session is not None and session_cwd is not None:
        # The session's kernel's cwd, so a relative path means the same in both
        # tools; still looked up beneath the root, as it is a path in the agent's tree.
        cwd = session_cwd(session)
    if cwd is None:
        return str(resolve_in_root(agent_root, "."))
    if not isinstance(cwd, str) or not cwd:
        raise bad_request(f"'cwd' must be a non-empty path string, got {cwd!r}")
    try:
        resolved = resolve_in_root(agent_root, _no_nul(cwd, "'cwd'"))
    except PathOutsideRoot:
        raise GatewayError(
            403,
            "outside_workspace",
            f"'cwd' {cwd!r} is outside the agent's workspace {agent_root}",
            "use a path relative to the agent root, or an absolute path inside it",
        ) from None
    try:
        os.close(open_in_root(agent_root, resolved, os.O_PATH | os.O_DIRECTORY))
    except (OSError, PathOutsideRoot):
        raise bad_request(f"'cwd' {cwd!r} is not an existing directory", code="bad_cwd") from None
    return str(resolved)


# --- bounded output ----------------------------------------------------------------


def _decode_head(data: bytes) -> str:
    # Drop a character cut in half at the end instead of showing a replacement mark.
    return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(data, final=False)


def _decode_tail(data: bytes) -> str:
    start = 0
    while start < min(3, len(data)) and data[start] & 0xC0 == 0x80:
        start += 1  # skip the continuation bytes of a character cut at the start
    return data[start:].decode("utf-8", errors="replace")


class BoundedStream:
    """One output stream: whole up to ``limit`` bytes, then head + tail + spill file."""

    def __init__(self, name: str, limit: int, open_spill: Callable[[str], tuple[str, int]]):
        self.name = name
        self.limit = limit
        self.head_size = limit // 2
        self.tail_size = limit - self.head_size
        self._open_spill = open_spill
        self.kept = bytearray()  # all output so far; once spilled, only the head
        self.tail = bytearray()
        self.total = 0
        self.spill_path: str | None = None
        self.spill_error: str | None = None
        self._spill_fd: int | None = None
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    @property
    def truncated(self) -> bool:
        return self.total > self.limit

    def add(self, data: bytes) -> str:
        """Take one chunk; return the text to stream right away ("" once past the limit)."""
        before = self.total
        self.total += len(data)
        if before > self.limit:
            self._spill(data)
            self.tail += data
            if len(self.tail) > self.tail_size:
                del self.tail[: len(self.tail) - self.tail_size]
            return ""
        if self.total <= self.limit:
            self.kept += data
            return self._decoder.decode(data)
        # This chunk crosses the limit: spill everything so far and keep head and tail.
        shown = self._decoder.decode(data[: self.limit - before])
        self.kept += data
        try:
            self.spill_path, self._spill_fd = self._open_spill(self.name)
        except OSError as e:
            self.spill_error = e.strerror or str(e)
        self._spill(self.kept)
        self.tail = self.kept[-self.tail_size :]
        del self.kept[self.head_size :]
        return shown + "\n" + self._marker("output continues") + "\n"

    def _spill(self, data: bytes) -> None:
        if self._spill_fd is None:
            return
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._spill_fd, view) :]
        except OSError as e:
            # A full disk costs the spill file, not the command.
            self.spill_error = e.strerror or str(e)
            self.close()

    def _marker(self, what: str) -> str:
        if self.spill_error:
            where = f"full output could not be saved: {self.spill_error}"
        else:
            where = f"full output in {self.spill_path}"
        return f"[... {what}: {where} ...]"

    def text(self) -> str:
        if not self.truncated:
            return bytes(self.kept).decode("utf-8", errors="replace")
        cut = self.total - len(self.kept) - len(self.tail)
        marker = self._marker(f"{cut} bytes cut")
        return _decode_head(bytes(self.kept)) + "\n" + marker + "\n" + _decode_tail(bytes(self.tail))

    def close(self) -> None:
        if self._spill_fd is not None:
            os.close(self._spill_fd)
            self._spill_fd = None


def _spill_opener(agent_root: str, spill_dir: str, run_id: str) -> Callable[[str], tuple[str, int]]:
    """Creates spill files beneath the agent root, through no symlink at all.

    The agent could replace ``.kernel-gateway`` or ``commands`` with a symlink,
    even one inside its tree (into ``installed-skills/``, which it may only
    read): the gateway writes as root, so it follows none.  The file is the
    agent's (``open_nofollow`` gives it to the root's owner).
    """

    def open_spill(stream: str) -> tuple[str, int]:
        path = os.path.join(spill_dir, f"{stream}-{run_id}.txt")
        try:
            make_dirs_nofollow(agent_root, spill_dir)
            fd = open_nofollow(agent_root, path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except PathOutsideRoot:
            raise OSError(errno.EXDEV, f"{spill_dir} is, or goes through, a symlink; refused") from None
        return fd_path(fd), fd

    return open_spill


# --- running -----------------------------------------------------------------------


def _with_read_only(profile: dict, bind: Mapping[str, str]) -> dict:
    """``profile`` with one more read-only bind (a spare's stub)."""
    sandbox = profile["sandbox"]
    return {**profile, "sandbox": {**sandbox, "read_only": [*sandbox.get("read_only", []), dict(bind)]}}


async def _pump(reader: asyncio.StreamReader, stream: BoundedStream, on_event: EventSink | None) -> None:
    while chunk := await reader.read(READ_CHUNK):
        shown = stream.add(chunk)
        if on_event is not None and shown:
            await on_event({"type": stream.name, "text": shown})


async def _feed(writer: asyncio.StreamWriter, data: bytes) -> None:
    try:
        if data:
            writer.write(data)
            await writer.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the command did not read all of its input; that is its business
    finally:
        writer.close()


# How a sandbox that never started ends: the spawn helper (127) or bwrap itself (1) says why in one line.
_UNSTARTED = {127: "kg-spawn-helper: ", 1: "bwrap: "}


def _refuse_unstarted(exit_code: int | None, out: BoundedStream, err: BoundedStream, run_as: launch.RunAs | None) -> None:
    """503 when a fresh sandbox could not start because the agent's uid is at its process limit.

    Every process of an agent counts against one RLIMIT_NPROC (a fork bomb in its kernel uses it
    up); the helper's exec or bwrap's clone then fails with EAGAIN before anything of the
    command's runs, which would otherwise read as the command's own exit 127 or 1.
    """
    line = bytes(err.kept).decode("utf-8", "replace")
    prefix = _UNSTARTED.get(exit_code) if exit_code is not None else None
    if prefix is None or out.total or err.truncated or not line.startswith(prefix) or line.count("\n") != 1:
        return
    if not line.rstrip("\n").endswith(os.strerror(errno.EAGAIN)):
        return
    limit = f" of {run_as.max_processes}" if run_as is not None and run_as.max_processes else ""
    raise GatewayError(
        503, "process_limit",
        f"the command's sandbox could not start: the agent's processes are at their limit{limit} ({line.strip()})",
        "end some of the agent's processes (a kernel that forked too many: restart or stop its session), then retry",
    )


async def run_command(
    request: dict,
    *,
    agent_root: str,
    profile: dict,
    values: dict,
    spill_dir: str,
    on_event: EventSink | None = None,
    session_cwd: SessionCwd | None = None,
    output_limit: int = 65536,
    max_stdin: int = 1 << 20,
    bwrap: str | None = None,
    run_as: launch.RunAs | None = None,
    spares: command_spares.CommandSpares | None = None,
    cgroup_prefix: str = "",
) -> dict:
    """Run one command in a fresh sandbox; return its exit status and bounded output.

    With ``spares``, the sandbox may be one set up ahead for this agent (see
    :mod:`kernel_gateway.command_spares`), and its next ones are set up while it runs.
    ``cgroup_prefix`` starts the name of the sandbox's cgroup (the gateway's own
    prefix, so that a later start sweeps what a killed gateway left).

    Invalid requests raise :class:`GatewayError` before anything runs: 400, or
    403 ``outside_workspace`` for a ``cwd`` outside the agent's tree.  A request
    naming a ``session`` runs where ``session_cwd(session)`` says (its kernel's
    working directory) unless it gives a ``cwd``, and sees ``$JLK_SESSION``.
    """
    if not isinstance(request, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(request).__name__}")
    unknown = sorted(set(request) - set(REQUEST_KEYS))
    if unknown:
        raise bad_request(f"unknown key {unknown[0]!r}", f"allowed keys: {', '.join(REQUEST_KEYS)}")
    if not isinstance(request.get("stream", False), bool):
        raise bad_request(f"'stream' must be true or false, got {request['stream']!r}")
    argv = _command_argv(request)
    requested_timeout = _requested_timeout(request)
    env = request_env.check(request.get("env"), "command")
    stdin = _stdin(request, max_stdin)
    session = requested_session(request)
    cwd = _cwd(request, agent_root, session, session_cwd)

    values = {**values, "agent_root": agent_root, "workspace": cwd}
    env["KERNEL_GATEWAY_AGENT"] = values.get("agent", os.path.basename(agent_root))
    env["KERNEL_GATEWAY_AGENT_ROOT"] = agent_root
    if session is not None:
        env["JLK_SESSION"] = session
    if values.get("agent_socket"):
        env["KERNEL_GATEWAY_SOCKET"] = SANDBOX_SOCKET
    run_id = uuid.uuid4().hex[:12]

    def prepare(command: list[str], stub: Mapping[str, str] | None = None) -> launch.PreparedSandbox:
        # ``env`` reaches only the command inside the sandbox (bwrap --setenv), never a host process.
        if stub is None:
            name = f"{cgroup_prefix}command-{run_id}"
            return launch.prepare(profile, values, command, bwrap=bwrap, name=name, extra_env=env, run_as=run_as)
        # A spare's stub sets the environment of the command it is handed; this request's is not its.
        name = f"{cgroup_prefix}command-spare-{uuid.uuid4().hex[:12]}"
        return launch.prepare(_with_read_only(profile, stub), values, command, bwrap=bwrap, name=name, run_as=run_as)

    key = command_spares.sandbox_key(profile, values, run_as, bwrap) if spares is not None else ""
    spare = await spares.take(agent_root, key) if spares is not None else None
    request_data = spare and command_spares.encode_request(cwd, argv, {**spare.prepared.env, **env, "PWD": cwd})
    # Too large for the stub's pipe, or the spare is gone: a sandbox of its own.
    if spare is not None and (request_data is None or not spare.start(request_data)):
        await spare.drop()
        spare = None
    prepared = spare.prepared if spare is not None else prepare(argv)
    timeout, wall = requested_timeout, prepared.limits.wall_seconds
    if wall is not None:
        timeout = wall if timeout is None else min(timeout, wall)

    opener = _spill_opener(agent_root, spill_dir, run_id)
    out, err = BoundedStream("stdout", output_limit, opener), BoundedStream("stderr", output_limit, opener)
    started = time.monotonic()
    if spare is not None:
        process = spare.process  # started above
    else:
        # A profile's process.cwd becomes bwrap's --chdir, so the host side need not enter the
        # agent's tree; only a profile without one still relies on the host working directory.
        process = await launch.spawn(
            prepared,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            **({} if prepared.compiled.cwd else {"cwd": cwd}),
        )
    if spares is not None:
        spares.refill(agent_root, key, prepare)  # set up while this one runs: the agent's next command starts in it

    timed_out = False
    supervise = asyncio.gather(
        _pump(process.stdout, out, on_event),
        _pump(process.stderr, err, on_event),
        _feed(process.stdin, stdin),
        process.wait(),
    )
    try:
        try:
            await asyncio.wait_for(supervise, timeout)
        except asyncio.TimeoutError:
            timed_out = True
    finally:
        # After a failing on_event the other parts would still be running.
        supervise.cancel()
        if process.returncode is None:
            # Timed out, or the caller went away: end the whole sandbox now.
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await process.wait()
        duration_ms = round((time.monotonic() - started) * 1000, 1)
        # Kills whatever is left in the cgroup and waits, without blocking the loop, until it is gone.
        await prepared.finish()
        out.close()
        err.close()

    exit_code, signum = launch.exit_status(process.returncode)
    _refuse_unstarted(exit_code, out, err, run_as)  # a spare too: its set-up may have failed the same way
    signal_name = signal.Signals(signum).name if signum else None
    result = {
        "exit_code": exit_code,
        "signal": signal_name,
        "stdout": out.text(),
        "stderr": err.text(),
        "timed_out": timed_out,
        "truncated": out.truncated or err.truncated,
        "duration_ms": duration_ms,
    }
    for stream in (out, err):
        if stream.spill_path and not stream.spill_error:
            result[f"{stream.name}_path"] = stream.spill_path
    return result

