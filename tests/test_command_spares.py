"""Spare command sandboxes: set up ahead, used once, by their own agent only, and gone when they must be.

Every test goes through a real gateway: real bwrap, the real stub, real
Unix sockets.  A command that ran in a spare is told apart from one that set
its sandbox up by the age of the sandbox's pid 1 (bwrap's init), read from
inside: a spare's was set up before the request.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from kernel_gateway.command_spares import MAX_REQUEST, encode_request, find_stub
from support import GatewayProcess, pid_alive, wait_until
from test_command import processes_with

pytestmark = pytest.mark.skipif(find_stub() is None, reason="kg-exec-stub is not built (scripts/install.sh builds it)")

GATEWAY_AGENTS = ("alice", "bob")

# Seconds since the sandbox's pid 1 (bwrap's init) started, from inside the sandbox.
AGE = ("import os; up = float(open('/proc/uptime').read().split()[0]); "
       "start = int(open('/proc/1/stat').read().rsplit(')', 1)[1].split()[19]); "
       "print(round(up - start / os.sysconf('SC_CLK_TCK'), 3))")


def run(gw, agent: str, request: dict) -> dict:
    status, body = gw.client.call("POST", f"/v1/agents/{agent}/commands", request)
    assert status == 200, body
    return body


def uid_processes(uid: int, root: str) -> list[int]:
    """Host pids of ``uid`` for this gateway (its agents' paths on their command line: other gateways
    on the machine hand out the same uids)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid and root.encode() in _cmdline(int(entry)):
                    found.append(int(entry))
            except OSError:
                pass
    return found


def stubs_of(uid: int) -> list[int]:
    """The waiting stubs (one per spare) of a host uid."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _cmdline(int(entry)).startswith(b"/run/kg-exec-stub\0"):
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    found.append(int(entry))
            except OSError:
                pass
    return found


def host_uid(gw, agent: str) -> int:
    return os.stat(os.path.join(gw.root, agent)).st_uid


def warm(gw, agent: str) -> None:
    """One command, then wait until its spare is up (the agent's uid runs the stub)."""
    run(gw, agent, {"argv": ["true"]})
    assert wait_until(lambda: any(b"kg-exec-stub" in _cmdline(pid) for pid in uid_processes(host_uid(gw, agent), gw.root)))


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def test_a_command_after_the_first_runs_in_a_spare_set_up_before_it(gw):
    warm(gw, "alice")
    time.sleep(0.3)  # the spare waits; a sandbox set up for the request would be younger than this
    body = run(gw, "alice", {"argv": ["python3", "-c", AGE]})
    assert body["exit_code"] == 0, body
    assert float(body["stdout"]) >= 0.2, body
    info = gw.client.call("GET", "/v1/info")[1]
    assert info["limits"]["spare_commands"] is True
    assert "spare sandboxes per agent" in info["sandbox"]["command_start"]


def test_a_spare_command_holds_only_stdin_stdout_stderr_and_the_requests_env(gw):
    run(gw, "alice", {"argv": ["true"], "env": {"SECRET_OF_THE_LAST": "s3cret"}})
    warm(gw, "alice")
    body = run(gw, "alice", {"argv": ["sh", "-c", "ls /proc/self/fd; echo; env"], "env": {"MINE": "yes"}})
    fds, _, env = body["stdout"].partition("\n\n")
    # ls holds its own directory fd (3) while listing; nothing else is open.
    assert fds.split() == ["0", "1", "2", "3"], body
    names = dict(line.split("=", 1) for line in env.splitlines() if "=" in line)
    assert names["MINE"] == "yes"
    assert "SECRET_OF_THE_LAST" not in env
    assert names["PWD"] == names["HOME"] == os.path.join(gw.root, "alice")
    assert names["KERNEL_GATEWAY_AGENT"] == "alice"


def test_a_spare_runs_what_it_is_given_with_stdin_cwd_and_exit_status(gw):
    os.makedirs(os.path.join(gw.root, "bob", "sub"), exist_ok=True)
    warm(gw, "bob")
    body = run(gw, "bob", {"argv": ["sh", "-c", "read x; echo got $x; pwd; exit 3"], "stdin": "hello\n"})
    assert (body["exit_code"], body["stdout"]) == (3, f"got hello\n{gw.root}/bob\n"), body
    # Another working directory is another sandbox: set up for it, still right.
    body = run(gw, "bob", {"argv": ["pwd"], "cwd": "sub"})
    assert body["stdout"] == f"{gw.root}/bob/sub\n"
    missing = run(gw, "bob", {"argv": ["no-such-program-kg"]})
    assert missing["exit_code"] == 1 and "execvp no-such-program-kg: No such file or directory" in missing["stderr"]


def test_a_spare_command_that_outlives_its_timeout_is_killed_with_its_sandbox(gw):
    warm(gw, "bob")
    body = run(gw, "bob", {"argv": ["sh", "-c", "sleep 61.4207 & echo started; sleep 61.4207"], "timeout": 1})
    assert body["timed_out"] is True and body["signal"] == "SIGKILL" and body["stdout"] == "started\n", body
    assert wait_until(lambda: processes_with("61.4207") == [])


def test_one_agents_spare_never_serves_another_agent(gw):
    warm(gw, "alice")
    warm(gw, "bob")
    for i, agent in enumerate(("alice", "bob", "alice", "bob")):
        body = run(gw, agent, {"argv": ["sh", "-c", f"touch made-{i}; pwd; echo $KERNEL_GATEWAY_AGENT"]})
        assert body["stdout"] == f"{gw.root}/{agent}\n{agent}\n", body
        # Seen from the host: the file is the agent's own, made by its own host uid.
        assert os.stat(os.path.join(gw.root, agent, f"made-{i}")).st_uid == host_uid(gw, agent)


def test_a_command_cannot_change_or_feed_the_stub(gw):
    warm(gw, "alice")
    body = run(gw, "alice", {"argv": ["sh", "-c", "echo x > /run/kg-exec-stub; echo rc=$?; ls /proc | grep '^[0-9]'"]})
    assert "rc=0" not in body["stdout"] and "Read-only file system" in body["stderr"], body
    # Its own pid namespace: the spare waiting for the next command is not visible (only bwrap's init,
    # the shell and its pipeline are).
    assert len(body["stdout"].split("\n")[1:-1]) <= 5, body
    stub = os.path.join(os.path.dirname(find_stub()), "kg-exec-stub")
    assert os.stat(stub).st_uid == 0 and not os.stat(stub).st_mode & 0o022


def test_a_request_too_large_for_the_stub_sets_up_its_own_sandbox():
    assert encode_request("/w", ["a" * MAX_REQUEST], {}) is None
    assert encode_request("/w", ["a\0b"], {}) is None
    assert encode_request("/w", ["echo", "hi"], {"A": "1"}) == b"/w\x002\x00echo\x00hi\x00A=1\x00"


def test_a_large_request_still_runs(gw):
    warm(gw, "alice")
    big = "x" * (MAX_REQUEST + 10)
    body = run(gw, "alice", {"argv": ["sh", "-c", 'echo ${#BIG}'], "env": {"BIG": big}})
    assert body["stdout"] == f"{len(big)}\n", body


def test_stopping_an_agent_ends_its_spare(tmp_path):
    gw = GatewayProcess(tmp_path).start()
    try:
        assert gw.client.call("PUT", "/v1/agents/carol")[0] == 201
        warm(gw, "carol")
        uid = host_uid(gw, "carol")
        assert gw.client.call("DELETE", "/v1/agents/carol")[0] == 200
        assert wait_until(lambda: uid_processes(uid, gw.root) == []), [_cmdline(p) for p in uid_processes(uid, gw.root)]
    finally:
        gw.stop()


def cgroups_named(prefix: str) -> list[str]:
    return [name for parent in ("/sys/fs/cgroup/pids/kernel-gateway", "/sys/fs/cgroup/memory/kernel-gateway")
            if os.path.isdir(parent) for name in os.listdir(parent) if name.startswith(prefix)]


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_no_spare_outlives_its_gateway(tmp_path, how):
    gw = GatewayProcess(tmp_path).start()
    try:
        prefix = gw.client.call("GET", "/v1/info")[1]["sandbox"]["cgroup_prefix"] + "-command-spare-"
        assert gw.client.call("PUT", "/v1/agents/dave")[0] == 201
        warm(gw, "dave")
        spares = uid_processes(host_uid(gw, "dave"), gw.root)
        assert spares and cgroups_named(prefix)
    finally:
        gw.stop(how)
    # SIGKILL gives the gateway no chance to clean up: the spawn helper's parent-death signal ends bwrap.
    assert wait_until(lambda: not any(pid_alive(p) for p in spares)), [_cmdline(p) for p in spares]
    if how == signal.SIGTERM:
        assert cgroups_named(prefix) == []
        return
    # What SIGKILL leaves (the spare's empty cgroups) is swept by the next start.
    assert cgroups_named(prefix)
    GatewayProcess(tmp_path).start().stop()
    assert cgroups_named(prefix) == []


def test_without_spares_every_command_sets_up_its_own(tmp_path):
    gw = GatewayProcess(tmp_path, "--Gateway.spare_commands=False").start()
    try:
        assert gw.client.call("PUT", "/v1/agents/erin")[0] == 201
        run(gw, "erin", {"argv": ["true"]})
        time.sleep(0.3)
        assert uid_processes(host_uid(gw, "erin"), gw.root) == []
        body = run(gw, "erin", {"argv": ["python3", "-c", AGE]})
        assert float(body["stdout"]) < 0.2, body
        info = gw.client.call("GET", "/v1/info")[1]
        assert info["limits"]["spare_commands"] is False
        assert info["sandbox"]["command_start"].endswith("(--Gateway.spare_commands=False)")
    finally:
        gw.stop()


def test_the_stub_refuses_bad_requests_without_running_anything(tmp_path):
    stub = find_stub()
    marker = tmp_path / "ran"
    cases = [
        (b"", 0, ""),  # a discarded spare: nothing asked, nothing run
        (b"/\x000\x00true\x00", 1, "bad argument count"),
        (b"/\x00x\x00true\x00", 1, "bad argument count"),
        (b"/\x002\x00true\x00", 1, "bad argument count"),
        (b"/\x001\x00touch", 1, "request not terminated"),
        (f"{tmp_path}/nowhere\x001\x00touch\x00{marker}\x00".encode(), 1, "Can't chdir to"),
    ]
    for request, code, message in cases:
        read_fd, write_fd = os.pipe()
        os.write(write_fd, request)
        os.close(write_fd)
        done = subprocess.run([stub, str(read_fd)], pass_fds=(read_fd,), capture_output=True, text=True)
        os.close(read_fd)
        assert (done.returncode, message in done.stderr) == (code, True), (request, done)
    assert not marker.exists()
    for argv in ([stub], [stub, "1"], [stub, "x"], [stub, "-5"]):
        done = subprocess.run(argv, capture_output=True, text=True)
        assert done.returncode == 1 and done.stderr.startswith("bwrap: "), (argv, done)


def test_a_spare_that_died_while_waiting_is_replaced_by_a_fresh_sandbox(gw):
    for _ in range(3):
        warm(gw, "bob")
        spare = uid_processes(host_uid(gw, "bob"), gw.root)  # the spare's bwrap processes
        for pid in spare:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # Dead, whether or not the gateway has noticed yet (both ways are taken over the runs).
        assert wait_until(lambda: not any(pid_alive(p) for p in spare), interval=0.001)
        body = run(gw, "bob", {"argv": ["echo", "still works"]})
        assert (body["exit_code"], body["stdout"]) == (0, "still works\n"), body


def test_the_gateway_keeps_no_more_spares_than_its_limit(tmp_path):
    gw = GatewayProcess(tmp_path, "--Gateway.max_spare_commands=1").start()
    try:
        for agent in ("fay", "gus"):
            assert gw.client.call("PUT", f"/v1/agents/{agent}")[0] == 201
        warm(gw, "fay")
        run(gw, "gus", {"argv": ["true"]})
        time.sleep(0.5)
        stubs = lambda agent: [p for p in uid_processes(host_uid(gw, agent), gw.root) if b"kg-exec-stub" in _cmdline(p)]
        assert stubs("fay") and not stubs("gus")
        # gus's commands still run, each in a sandbox of its own.
        body = run(gw, "gus", {"argv": ["python3", "-c", AGE]})
        assert body["exit_code"] == 0 and float(body["stdout"]) < 0.2, body
    finally:
        gw.stop()


def test_a_working_directory_whose_name_is_not_utf8_runs_fresh_and_in_a_spare(gw):
    # The agent names its directories as it likes; Linux paths are bytes, not text.
    made = run(gw, "bob", {"command": "mkdir \"$(printf 'raw\\377')\" && ln -s \"$(printf 'raw\\377')\" to-raw"})
    assert made["exit_code"] == 0, made
    for _ in range(2):  # the first sets its sandbox up, the second runs in the spare the first left
        body = run(gw, "bob", {"argv": ["python3", "-c", "import os; print(os.getcwdb())"], "cwd": "to-raw"})
        assert body["exit_code"] == 0 and body["stdout"].endswith("/bob/raw\\xff'\n"), body
        time.sleep(0.3)
    body = run(gw, "bob", {"argv": ["python3", "-c", AGE], "cwd": "to-raw"})
    assert float(body["stdout"]) >= 0.2, body


BOMB = ("import os, time\nn = 0\nwhile n < 200:\n    try:\n        pid = os.fork()\n    except OSError:\n"
        "        break\n    if pid == 0:\n        time.sleep(600)\n        os._exit(0)\n    n += 1\nprint(n)")


def test_spares_set_up_before_the_agent_hit_its_process_limit_still_run_commands(tmp_path):
    # A uid range of its own: other gateways on the machine hand out uids from 200000.
    gw = GatewayProcess(tmp_path, "--Gateway.agent_max_processes=40", "--Gateway.spare_kernels=False",
                        "--Gateway.agent_uid_start=242000").start()
    try:
        assert gw.client.call("PUT", "/v1/agents/hal")[0] == 201
        warm(gw, "hal")
        assert wait_until(lambda: len(stubs_of(host_uid(gw, "hal"))) == 2)  # both of its spares are up
        # The kernel forks until the uid's RLIMIT_NPROC says no; its children stay.
        status, body = gw.client.execute("hal", "s1", BOMB)
        assert status == 200 and 0 < int(body["text"]) < 40, body
        # The spares were set up before: their commands still run.
        for _ in range(2):
            assert run(gw, "hal", {"argv": ["echo", "in a spare"]})["stdout"] == "in a spare\n"
    finally:
        gw.stop()


def test_a_command_when_the_agents_processes_are_at_their_limit_is_a_clear_503(tmp_path):
    # No spares: every command's sandbox is set up when it is asked for, at the limit.
    gw = GatewayProcess(tmp_path, "--Gateway.agent_max_processes=40", "--Gateway.spare_kernels=False",
                        "--Gateway.spare_commands=False", "--Gateway.agent_uid_start=241000").start()
    try:
        assert gw.client.call("PUT", "/v1/agents/hal")[0] == 201
        status, body = gw.client.execute("hal", "s1", BOMB)
        assert status == 200 and 0 < int(body["text"]) < 40, body
        # A sandbox set up now cannot start: a JSON error saying why, not the command's "exit 127".
        for _ in range(2):
            status, body = gw.client.call("POST", "/v1/agents/hal/commands", {"argv": ["echo", "hi"]})
            assert status == 503 and body["error"]["code"] == "process_limit", body
            assert "limit of 40" in body["error"]["message"] and "restart or stop its session" in body["error"]["hint"]
        # Once they are gone, commands start again; a command's own exit 127 or 1 stays the command's.
        assert gw.client.call("DELETE", "/v1/agents/hal/sessions/s1")[0] == 200
        assert wait_until(lambda: len(uid_processes(host_uid(gw, "hal"), gw.root)) < 10)
        body = run(gw, "hal", {"command": "no-such-program-kg"})
        assert body["exit_code"] == 127 and "not found" in body["stderr"], body
        body = run(gw, "hal", {"command": "echo out; echo 'bwrap: x: Resource temporarily unavailable' >&2; exit 1"})
        assert (body["exit_code"], body["stdout"]) == (1, "out\n"), body
    finally:
        gw.stop()


def test_kill_minus_one_from_a_command_or_a_kernel_does_not_reach_the_waiting_spare(gw):
    # The same host uid runs every sandbox of the agent; only the pid namespaces keep them apart.
    warm(gw, "alice")
    body = run(gw, "alice", {"command": "sleep 1; kill -9 -1; echo survived"})  # its spare is up by then
    assert body["stdout"] == "survived\n", body
    time.sleep(0.3)
    assert float(run(gw, "alice", {"argv": ["python3", "-c", AGE]})["stdout"]) >= 1, "the spare was killed"
    time.sleep(0.3)
    status, body = gw.client.execute("alice", "s1", "import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\n"
                                                 "except ProcessLookupError:\n    pass  # nothing else in its namespace\n"
                                                 "print('alive')")
    assert status == 200 and body["text"] == "alive\n", body
    assert float(run(gw, "alice", {"argv": ["python3", "-c", AGE]})["stdout"]) >= 0.2, "the spare was killed"


def test_two_commands_back_to_back_both_find_a_spare_ready(gw):
    warm(gw, "bob")
    assert wait_until(lambda: len(stubs_of(host_uid(gw, "bob"))) == 2)
    time.sleep(0.3)  # both spares older than any sandbox set up for a request
    ages = [float(run(gw, "bob", {"argv": ["python3", "-c", AGE]})["stdout"]) for _ in range(2)]
    assert all(age >= 0.2 for age in ages), ages
    # And the agent is back to two once they are used.
    assert wait_until(lambda: len(stubs_of(host_uid(gw, "bob"))) == 2)
