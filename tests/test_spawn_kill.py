"""A gateway killed with ``-9`` at any step of a spawn leaves no sandbox outside its cgroups.

Both spawn paths (the built ``kg-spawn-helper`` and its Python twin) join the
sandbox's cgroups first, drop to the agent's uid, ask for SIGKILL when the
gateway dies and exit if it is gone already, then exec bwrap.  The outer
bwrap dies with the gateway; a sandbox already made (bwrap's init in its pid
namespace) lives on in its cgroups, which the next start of the gateway
sweeps.  These tests hold a spawn at each step, kill the gateway there, and
look at the host: every process of the agent's uid (every sandbox process
runs as it) is in one of the gateway's cgroups, and none is left once the
gateway has started again.  A leftover is named by its command line in the
failure.

The steps:

- in the helper, before it joins its cgroup (held on a FIFO given as the
  cgroup file: ``open`` blocks until the test reads it), run directly;
- in the helper's program, after the parent-death request (a program that
  waits), run directly;
- through a real gateway: between the helper and bwrap (a bwrap wrapper that
  waits on a FIFO), while the command runs, while a kernel runs, while spares
  wait, and at a sweep of delays after the request over the whole spawn.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from kernel_gateway.sandbox import launch
from support import TEST_UID_BLOCK, TEST_UID_START, GatewayProcess, pid_alive, wait_until

PATHS = ["spawn-helper", "python-twin"]


@pytest.fixture(params=PATHS)
def spawn_path(request, monkeypatch):
    if request.param == "spawn-helper":
        if launch.find_helper() is None:
            if os.environ.get("CI") == "true":
                pytest.fail("the spawn helper is not built (scripts/install.sh builds it)")
            pytest.skip("the spawn helper is not built (scripts/install.sh builds it)")
        monkeypatch.delenv("KERNEL_GATEWAY_SPAWN_HELPER", raising=False)
    else:
        monkeypatch.setenv("KERNEL_GATEWAY_SPAWN_HELPER", "python")
    return request.param


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def processes_of(uid: int) -> dict[int, str]:
    """Live processes of host ``uid``, with their command lines."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid and pid_alive(int(entry)):
                    found[int(entry)] = _cmdline(int(entry))
            except OSError:
                pass
    return found


def assert_none_left(uid: int, step: str) -> None:
    wait_until(lambda: not processes_of(uid), timeout=10)
    left = processes_of(uid)
    assert not left, f"killed {step}: left behind (pid: command line): {left}"


def _fifo_dir() -> str:
    """A directory the agent's uid can walk into and write to (pytest's own is 0700 root's)."""
    path = tempfile.mkdtemp(prefix="kg-spawn-kill-")
    os.chmod(path, 0o1777)
    return path


# --- the helper alone, with a parent the test kills -----------------------------------


def _parent_running_helper(helper_args: list[str]) -> subprocess.Popen:
    """A throwaway parent that starts the helper with --parent=itself, then waits forever."""
    code = (
        "import os, subprocess, sys, time\n"
        "args = [a.replace('PARENT', str(os.getpid())) for a in sys.argv[1:]]\n"
        "subprocess.Popen(args, start_new_session=True)\n"
        "time.sleep(3600)\n"
    )
    return subprocess.Popen([sys.executable, "-c", code, *helper_args])


def _helper_prefix(spawn_path: str) -> list[str]:
    return launch.helper_argv(launch.find_helper() if spawn_path == "spawn-helper" else None)


UID = 7_300_000 + (os.getpid() % 1000)  # a uid no other process of the machine has


def test_the_helper_killed_before_it_joins_its_cgroup_runs_nothing(tmp_path, spawn_path):
    fifo_dir = _fifo_dir()
    fifo, marker = os.path.join(fifo_dir, "cgroup.procs"), os.path.join(fifo_dir, "ran")
    os.mkfifo(fifo, 0o600)
    parent = _parent_running_helper(
        _helper_prefix(spawn_path)
        + [f"--cgroup={fifo}", f"--uid={UID}", f"--gid={UID}", "--parent=PARENT", "--", "/bin/touch", marker]
    )
    try:
        # The helper now blocks opening the "cgroup" (a FIFO with no reader yet).
        assert wait_until(lambda: any(fifo in cmd for cmd in _children_cmdlines(parent.pid)), timeout=30)
        parent.kill()
        parent.wait()
        with open(fifo, "rb") as f:  # release it: it joins, drops to UID, finds its gateway gone
            f.read()
        assert_none_left(UID, "in the helper, before it joined its cgroup")
        assert not os.path.exists(marker), "the program ran after the gateway was gone"
    finally:
        parent.kill()


def test_the_helper_killed_after_its_exec_takes_the_program_down(tmp_path, spawn_path):
    parent = _parent_running_helper(
        _helper_prefix(spawn_path)
        + [f"--uid={UID}", f"--gid={UID}", "--parent=PARENT", "--", "/bin/sh", "-c", "read x < /dev/zero; sleep 3600"]
    )
    try:
        assert wait_until(lambda: any("/bin/sh" in cmd for cmd in processes_of(UID).values()), timeout=30)
        parent.kill()
        parent.wait()
        assert_none_left(UID, "with its program running")
    finally:
        parent.kill()


def _children_cmdlines(pid: int) -> list[str]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
                if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                    out.append(_cmdline(int(entry)))
            except (OSError, ValueError, IndexError):
                pass
    return out


# --- a real gateway, killed at each step ------------------------------------------------


def _agent_uid(gw: GatewayProcess, agent: str) -> int:
    return os.stat(os.path.join(gw.root, agent)).st_uid


_uids = itertools.count(TEST_UID_START + TEST_UID_BLOCK // 2, 16)


def _start(tmp_path, *args: str) -> GatewayProcess:
    """A gateway whose agents' uids no other gateway of this run has (a leftover is told apart)."""
    if not any(a.startswith("--Gateway.agent_uid_start") for a in args):
        args += (f"--Gateway.agent_uid_start={next(_uids)}", "--Gateway.agent_uid_count=16")
    gw = GatewayProcess(tmp_path, "--Gateway.spare_kernels=False", *args).start()
    assert gw.client.call("PUT", "/v1/agents/alice")[0] in (200, 201)
    return gw


def _cgroups_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            return f.read()
    except OSError:
        return ""


def kill_and_check(gw: GatewayProcess, tmp_path, uid: int, step: str, *args: str) -> None:
    """Kill the gateway with -9; nothing of the agent's outside its cgroups; nothing once it starts again."""
    gw.proc.kill()
    gw.proc.wait()
    prefix = "kg-" + hashlib.sha256(gw.state.encode()).hexdigest()[:10]

    def outside() -> dict[int, str]:
        # A process that is exiting has let go of its memory (no command line) and its cgroups: not counted
        # here, and gone by the check after the restart.
        return {pid: cmd for pid, cmd in processes_of(uid).items() if cmd and prefix not in (_cgroups_of(pid) or prefix)}

    wait_until(lambda: not outside(), timeout=10)
    outside = outside()
    assert not outside, f"killed {step}: outside the gateway's cgroups (pid: command line): {outside}"
    again = GatewayProcess(tmp_path, *gw.args).start()  # its start sweeps what the killed one left
    try:
        assert_none_left(uid, f"{step}, then started again")
    finally:
        again.stop()


def _request_in_background(gw: GatewayProcess, method: str, path: str, body: dict) -> threading.Thread:
    def call():
        try:
            gw.client.call(method, path, body, timeout=60)
        except OSError:
            pass  # the gateway is killed under it

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread


def test_a_gateway_killed_between_the_helper_and_bwrap(tmp_path, spawn_path):
    fifo_dir = _fifo_dir()
    fifo, hold = os.path.join(fifo_dir, "hold"), os.path.join(fifo_dir, "holding")
    os.mkfifo(fifo, 0o666)
    wrapper = os.path.join(fifo_dir, "bwrap")
    with open(wrapper, "w") as f:  # bwrap, held (builtins only: nothing of its own to leave) when asked to
        f.write(f"#!/bin/sh\nif [ -e {hold} ]; then : > {hold}.$$; read x < {fifo}; fi\nexec /usr/bin/bwrap \"$@\"\n")
    os.chmod(wrapper, 0o755)
    args = (f"--Gateway.bwrap={wrapper}", "--Gateway.spare_commands=False")
    gw = _start(tmp_path, *args)
    try:
        uid = _agent_uid(gw, "alice")
        open(hold, "w").close()
        _request_in_background(gw, "POST", "/v1/agents/alice/commands", {"argv": ["sleep", "3600"]})
        assert wait_until(lambda: any(n.startswith("holding.") for n in os.listdir(fifo_dir)), timeout=30)
        os.unlink(hold)
        kill_and_check(gw, tmp_path, uid, "between the helper and bwrap", *args)
    finally:
        gw.stop(signal.SIGKILL)


@pytest.mark.parametrize("what", ["command", "kernel", "spares"])
def test_a_gateway_killed_while_its_sandboxes_run(tmp_path, spawn_path, what):
    # The command case without spares: the kill then meets that command's own sandbox alone (a kill
    # while spares wait is the "spares" case; one while a spare is being set up is not covered here).
    gw = _start(tmp_path, *(("--Gateway.spare_commands=False",) if what == "command" else ()))
    try:
        uid = _agent_uid(gw, "alice")
        if what == "command":
            _request_in_background(gw, "POST", "/v1/agents/alice/commands", {"argv": ["sleep", "3600"]})
            assert wait_until(lambda: any("sleep 3600" in c for c in processes_of(uid).values()), timeout=30)
        elif what == "kernel":
            status, body = gw.client.execute("alice", "s", "print(1)")
            assert status == 200, body
        else:
            status, body = gw.client.call("POST", "/v1/agents/alice/commands", {"argv": ["true"]})
            assert status == 200, body
            stub = os.path.join(os.path.dirname(launch.__file__), "kg-exec-stub")
            if os.path.exists(stub):  # built by scripts/install.sh: spares wait on it
                assert wait_until(lambda: any("kg-exec-stub" in c for c in processes_of(uid).values()), timeout=30)
        assert processes_of(uid)
        kill_and_check(gw, tmp_path, uid, f"with a {what} running")
    finally:
        gw.stop(signal.SIGKILL)


def test_a_gateway_killed_anywhere_in_a_spawn(tmp_path, spawn_path):
    """A sweep of kill points from the request on, over a spawn's whole length (a few ms to ~50 ms)."""
    for i, delay in enumerate([0.0, 0.002, 0.005, 0.01, 0.02, 0.05]):
        (tmp_path / str(i)).mkdir()
        gw = _start(tmp_path / str(i), "--Gateway.spare_commands=False")
        try:
            uid = _agent_uid(gw, "alice")
            _request_in_background(gw, "POST", "/v1/agents/alice/commands", {"argv": ["sleep", "3600"]})
            time.sleep(delay)
            kill_and_check(gw, tmp_path / str(i), uid, f"{delay * 1000:.1f} ms after a command was asked for",
                           "--Gateway.spare_commands=False")
        finally:
            gw.stop(signal.SIGKILL)
