"""What a sandboxed command cannot do, each tried for real through run_command and bwrap.

Every test runs the attack and checks the outcome on the host side as well,
and where it matters runs a control showing that the attack would have worked
without the sandbox, so a passing test means the sandbox stopped it.
"""

from __future__ import annotations

import asyncio
import copy
import fcntl
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import termios
import uuid
from pathlib import Path

import pytest

from kernel_gateway.provisioner import python_env_paths
from kernel_gateway.sandbox.profile import load_profile
from kernel_gateway.tools.command import run_command
from test_command import processes_with, values_for


@pytest.fixture
def agents(tmp_path: Path) -> Path:
    """<tmp>/agents/{alice,bob} plus a state directory and a host file beside them."""
    for name in ("alice", "bob"):
        (tmp_path / "agents" / name / "sessions" / "s1").mkdir(parents=True)
    (tmp_path / "agents" / "bob" / "secret.txt").write_text("bob's secret\n")
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "registry.json").write_text('{"hmac": "key"}')
    (tmp_path / "host-file.txt").write_text("host only\n")
    return tmp_path / "agents"


def small_profile(**limits) -> dict:
    profile = copy.deepcopy(load_profile("command"))
    profile["limits"].update(limits)
    return profile


async def run_async(root: Path, request: dict, profile: dict | None = None, **kwargs) -> dict:
    return await run_command(
        request,
        agent_root=str(root),
        profile=profile or load_profile("command"),
        values=values_for(root),
        spill_dir=str(root / ".kernel-gateway" / "commands"),
        **kwargs,
    )


def run(root: Path, command: str, profile: dict | None = None, **kwargs) -> dict:
    return asyncio.run(run_async(root, {"command": command}, profile, **kwargs))


# --- what the command can see ----------------------------------------------------------------


def test_another_agents_files_and_the_state_directory_are_invisible(agents: Path):
    alice, bob, state = agents / "alice", agents / "bob", agents.parent / "state"
    result = run(
        alice,
        f"cat {bob}/secret.txt; ls {state}; cat {state}/registry.json; cat {agents.parent}/host-file.txt;"
        f" echo agents: $(ls {agents}); echo tmp: $(ls {agents.parent})",
    )
    assert "secret" not in result["stdout"] and "hmac" not in result["stdout"] and "host only" not in result["stdout"]
    assert f"{bob}/secret.txt: No such file or directory" in result["stderr"]
    assert f"{state}': No such file or directory" in result["stderr"]
    assert result["stdout"].splitlines() == ["agents: alice", "tmp: agents"]


def test_the_hosts_private_paths_are_not_there(agents: Path):
    result = run(agents / "alice", "for p in /etc/shadow /home /var /run/docker.sock /sys/fs/cgroup; do test -e $p && echo $p; done; ls -A /root; true")
    # /root appears only where the Python environment itself lives under it (pyenv).
    python_dirs = {Path(p).parts[2] for p in python_env_paths(sys.executable) if p.startswith("/root/")}
    assert sorted(result["stdout"].split()) == sorted(python_dirs)


def test_host_processes_are_invisible(agents: Path):
    result = run(agents / "alice", f"ls /proc | grep -E '^[0-9]+$'; echo ---; cat /proc/[0-9]*/comm; kill -0 {os.getpid()}")
    pids, names = result["stdout"].split("---\n")
    assert len(pids.split()) <= 4 and max(map(int, pids.split())) < 10
    assert set(names.split()) <= {"bwrap", "sh", "ls", "grep", "cat"}  # bwrap's init and the command's own
    assert result["exit_code"] != 0 and "kill" in result["stderr"]  # the test's own pid: no such process
    assert os.path.exists(f"/proc/{os.getpid()}")


# --- network ----------------------------------------------------------------------------------


def test_no_network_a_host_listener_cannot_be_reached(agents: Path):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    abstract = f"\0kg-test-{uuid.uuid4().hex}"
    unix_listener = socket.socket(socket.AF_UNIX)
    unix_listener.bind(abstract)
    unix_listener.listen(8)
    unix_listener.setblocking(False)
    probe = (
        "import socket\n"
        "for family, address in ((socket.AF_INET, ('127.0.0.1', PORT)), (socket.AF_UNIX, ABSTRACT)):\n"
        "    s = socket.socket(family)\n"
        "    s.settimeout(3)\n"
        "    try:\n"
        "        s.connect(address)\n"
        "        print('connected')\n"
        "    except OSError as e:\n"
        "        print('refused', type(e).__name__)\n"
    ).replace("PORT", str(port)).replace("ABSTRACT", repr(abstract))
    try:
        result = asyncio.run(run_async(agents / "alice", {"argv": ["python", "-c", probe]}))
        assert result["stdout"].splitlines() == ["refused ConnectionRefusedError"] * 2, result
        for sock in (listener, unix_listener):
            with pytest.raises(BlockingIOError):
                sock.accept()  # nothing ever arrived from the sandbox
        # Control: from the host both listeners are reachable.
        socket.create_connection(("127.0.0.1", port), timeout=3).close()
        host_unix = socket.socket(socket.AF_UNIX)
        host_unix.connect(abstract)
        host_unix.close()
    finally:
        listener.close()
        unix_listener.close()


def test_only_loopback_exists_inside(agents: Path):
    result = run(agents / "alice", "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '")
    assert result["stdout"] == "lo\n"


# --- writing ----------------------------------------------------------------------------------


def test_writing_outside_the_workspace_fails_or_never_reaches_the_host(agents: Path):
    alice, bob = agents / "alice", agents / "bob"
    prefix, _base = python_env_paths(sys.executable)
    token = uuid.uuid4().hex[:8]
    system_paths = ["/usr/kg-" + token, "/bin/kg-" + token, "/etc/passwd", f"{prefix}/kg-{token}", "/proc/kg-" + token]
    attempts = "; ".join(f"(echo x >> {p}) 2>/dev/null && echo wrote {p}" for p in system_paths)
    result = run(alice, attempts + "; true")
    assert result["stdout"] == "", "read-only system paths were writable"

    # The sandbox's own scratch space (/tmp, the empty directories above the agent
    # root) may take writes, but they live in a tmpfs that dies with the command.
    scratch = [f"/tmp/kg-{token}", f"{agents.parent}/kg-{token}", f"{bob}/kg-{token}", f"/kg-{token}"]
    run(alice, "; ".join(f"mkdir -p $(dirname {p}) 2>/dev/null; echo x > {p}" for p in scratch))
    for path in scratch:
        assert not os.path.exists(path), f"{path} reached the host"
    assert sorted(os.listdir(bob)) == ["secret.txt", "sessions"]
    assert Path("/etc/passwd").read_text().startswith("root:")

    # Control: the workspace itself is writable.
    assert run(alice, "echo mine > sessions/s1/out.txt")["exit_code"] == 0
    assert (alice / "sessions" / "s1" / "out.txt").read_text() == "mine\n"


def test_a_file_past_the_size_limit_fails(agents: Path):
    alice = agents / "alice"
    profile = small_profile(file_size="1M")
    result = run(alice, "head -c 3000000 /dev/zero > big.bin; echo head=$?", profile)
    assert result["stdout"] == "head=153\n"  # 128 + SIGXFSZ
    assert (alice / "big.bin").stat().st_size == 1 << 20
    probe = "open('big2.bin', 'wb').write(bytes(3_000_000))"
    result = asyncio.run(run_async(alice, {"argv": ["python", "-c", probe]}, profile))
    assert result["exit_code"] == 1 and "File too large" in result["stderr"]
    assert (alice / "big2.bin").stat().st_size <= 1 << 20


# --- privileges -------------------------------------------------------------------------------


def test_capabilities_are_all_zero(agents: Path):
    result = run(agents / "alice", "grep -E '^(Cap|NoNewPrivs)' /proc/self/status")
    fields = dict(line.split(":\t") for line in result["stdout"].splitlines())
    assert fields == {
        "CapInh": "0000000000000000",
        "CapPrm": "0000000000000000",
        "CapEff": "0000000000000000",
        "CapBnd": "0000000000000000",
        "CapAmb": "0000000000000000",
        "NoNewPrivs": "1",
    }


def test_privileged_operations_fail(agents: Path):
    alice = agents / "alice"
    (alice / "f.txt").write_text("x")
    result = run(
        alice,
        "mkdir -p m; mount -t tmpfs none m && echo mounted;"
        " python -c \"import os; os.chown('f.txt', 0, 0)\" 2>/dev/null && echo chowned;"
        " python -c \"import os; os.setuid(0)\" 2>/dev/null && echo setuid; true",
    )
    assert result["stdout"] == ""
    assert (alice / "f.txt").stat().st_uid == 0  # host view unchanged


def test_a_setuid_root_binary_gives_no_privilege(agents: Path):
    alice = agents / "alice"
    for tool in ("id", "cat"):
        shutil.copy(shutil.which(tool), alice / f"suid-{tool}")
        os.chmod(alice / f"suid-{tool}", 0o4755)
        info = (alice / f"suid-{tool}").stat()
        assert info.st_uid == 0 and info.st_mode & stat.S_ISUID  # a real setuid-root file on the host
    result = run(alice, "./suid-id -u; ./suid-id -ru; ./suid-cat /proc/self/status | grep -E '^(Uid|CapEff|CapPrm)'")
    lines = result["stdout"].splitlines()
    assert lines[:2] == ["1000", "1000"]
    assert lines[2].split()[1:] == ["1000"] * 4
    assert lines[3:] == ["CapPrm:\t0000000000000000", "CapEff:\t0000000000000000"]


# --- the terminal ----------------------------------------------------------------------------

TIOCSTI_PROBE = """
import fcntl, termios
try:
    tty = open('/dev/tty', 'wb', buffering=0)
    fcntl.ioctl(tty, termios.TIOCSTI, b'x')
    print('injected')
except OSError as e:
    print('blocked', e.strerror)
for fd in (0, 1, 2):
    try:
        fcntl.ioctl(fd, termios.TIOCSTI, b'x')
        print('injected via', fd)
    except OSError:
        pass
"""

# Runs in a process whose controlling terminal is a fresh pty, as a gateway
# started from a terminal would: the control probe runs unsandboxed, the other
# through run_command.
TIOCSTI_HELPER = """
import asyncio, json, subprocess, sys
from kernel_gateway.tools.command import run_command
probe, kwargs = sys.argv[1], json.loads(sys.argv[2])
control = subprocess.run([sys.executable, '-c', probe], capture_output=True, text=True).stdout
sandboxed = asyncio.run(run_command({'argv': ['python', '-c', probe]}, **kwargs))
print(json.dumps({'control': control, 'sandboxed': sandboxed}))
"""


def test_tiocsti_cannot_inject_into_the_gateways_terminal(agents: Path):
    alice = agents / "alice"
    kwargs = {
        "agent_root": str(alice),
        "profile": load_profile("command"),
        "values": values_for(alice),
        "spill_dir": str(alice / ".kernel-gateway" / "commands"),
    }
    master, slave = os.openpty()
    try:
        helper = subprocess.run(
            [sys.executable, "-c", TIOCSTI_HELPER, TIOCSTI_PROBE, json.dumps(kwargs)],
            stdin=slave,
            capture_output=True,
            text=True,
            start_new_session=True,
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),  # the pty becomes its terminal
            timeout=60,
        )
    finally:
        os.close(slave)
        os.close(master)
    assert helper.returncode == 0, helper.stderr
    outcome = json.loads(helper.stdout)
    assert outcome["control"].startswith("injected\n")  # without the sandbox the attack works
    assert outcome["sandboxed"]["stdout"] == "blocked No such device or address\n"


# --- resource exhaustion ------------------------------------------------------------------------


def test_a_fork_bomb_is_contained_and_another_agent_keeps_working(agents: Path):
    token = f"bomb{uuid.uuid4().hex[:8]}"
    profile = small_profile(processes=32)

    async def scenario():
        saturated = asyncio.Event()

        async def watch(event: dict) -> None:
            if event["type"] == "stderr" and "fork" in event["text"].lower():
                saturated.set()

        bomb = asyncio.create_task(
            run_async(
                agents / "alice",
                # The main shell then spins on a builtin: it must not need a fork to stay alive.
                {"command": f": {token}; b() {{ b | b & }}; b; while :; do :; done", "timeout": 90},
                profile,
                on_event=watch,
            )
        )
        await asyncio.wait_for(saturated.wait(), 60)
        # The bomb is at its process cap right now; bob and the host carry on.
        other = await run_async(agents / "bob", {"argv": ["python", "-c", "print(sum(range(10**6)))"]}, profile)
        host = subprocess.run(["sh", "-c", "echo host ok"], capture_output=True, text=True)
        still_running = not bomb.done() or bomb.result()  # the bomb's own result, if it ended: says why
        bomb.cancel()
        try:
            await bomb
        except asyncio.CancelledError:
            pass
        return other, host, still_running

    other, host, still_running = asyncio.run(scenario())
    assert still_running is True, f"the bomb ended before the other agent's command did: {still_running}"
    assert (other["exit_code"], other["stdout"]) == (0, "499999500000\n")
    assert host.stdout == "host ok\n"
    assert processes_with(token) == []  # cancelling the call ended every process of the bomb


def test_a_memory_hog_is_contained_and_another_agent_keeps_working(agents: Path):
    profile = small_profile(memory="256M")
    hog = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))"

    async def scenario():
        return await asyncio.gather(
            run_async(agents / "alice", {"argv": ["python", "-c", hog], "timeout": 30}, profile),
            run_async(agents / "bob", {"argv": ["python", "-c", "print(len(bytearray(32 << 20)))"]}, profile),
        )

    hogged, other = asyncio.run(scenario())
    assert hogged["exit_code"] == 1 and "MemoryError" in hogged["stderr"]
    assert hogged["timed_out"] is False
    assert (other["exit_code"], other["stdout"]) == (0, f"{32 << 20}\n")
