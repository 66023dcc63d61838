"""Sandboxed kernels through plain jupyter_client: confinement, limits, lifecycle, errors.

Every kernel here is started by ``KernelManager`` from a kernelspec whose
metadata selects ``bwrap-provisioner`` (see conftest.py): real bwrap, real
ipykernel.  Kernels are shared per module where the tests stay independent.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from jupyter_client import KernelManager

from kernel_gateway.sandbox.launch import SandboxUnavailable
from kernel_gateway.sandbox.profile import ProfileError, load_profile
from kernel_gateway.provisioner import python_env_paths

PIDS_CGROUPS = "/sys/fs/cgroup/pids/kernel-gateway"


@pytest.fixture(scope="module")
def agents(tmp_path_factory):
    """An agents root with alice (with one session) and bob, plus a gateway state dir."""
    root = tmp_path_factory.mktemp("agents")
    alice = root / "alice"
    session = alice / "sessions" / "s1"
    session.mkdir(parents=True)
    (root / "bob").mkdir()
    (root / "bob" / "SOUL.md").write_text("bob's secrets\n")
    state = tmp_path_factory.mktemp("state")
    (state / "registry.json").write_text("{}\n")
    return {"alice": alice, "session": session, "bob": root / "bob", "state": state}


@pytest.fixture(scope="module")
def home_marker():
    """A file in the host's real home, which no sandbox may see."""
    marker = Path("/root") / f"kg-test-marker-{uuid.uuid4().hex[:8]}"
    marker.write_text("host only\n")
    yield marker
    marker.unlink()


@pytest.fixture(scope="module")
def kernel(sandboxed_kernel, agents):
    """alice's kernel under the shipped default ``kernel`` profile."""
    with sandboxed_kernel(agents["session"], {"agent_root": str(agents["alice"])}) as k:
        yield k


def processes_mentioning(*needles: str) -> list[int]:
    """Pids of live processes whose command line contains any of ``needles``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:
            continue
        if any(needle in cmdline for needle in needles):
            found.append(int(entry))
    return found


def kernel_cgroups(kernel_id: str) -> list[str]:
    return glob.glob(f"{PIDS_CGROUPS}/kernel-{kernel_id[:8]}-*")


# --- confinement -----------------------------------------------------------------


def test_root_holds_only_what_the_profile_mounts(kernel, agents):
    prefix, base = python_env_paths(sys.executable)
    mounted = ["/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc", "/proc", "/dev", "/tmp", prefix, base]
    mounted += [str(agents["alice"]), kernel.runtime_dir]
    expected = {Path(p).parts[1] for p in mounted if os.path.exists(p)}
    assert set(kernel.value("__import__('os').listdir('/')")) == expected


def test_host_home_project_state_and_other_agents_are_absent(kernel, agents, home_marker):
    prefix, base = python_env_paths(sys.executable)
    # /root exists only as the path leading to the Python install under /root/.pyenv.
    assert base.startswith("/root/.pyenv/")
    assert kernel.value("__import__('os').listdir('/root')") == [".pyenv"]
    # The checkout's own files are hidden, wherever it lives (its .venv may be
    # bound read-only, which makes the directories leading to it exist).
    checkout = Path(__file__).resolve().parent.parent
    hidden = [str(home_marker), "/root/.bashrc", str(checkout / "README.md"), str(checkout / "kernel_gateway"),
              str(checkout / "tests"), str(agents["state"]), str(agents["bob"])]
    assert all(os.path.exists(p) for p in hidden), "the host side of this test is not set up"
    seen = kernel.value(f"[p for p in {hidden!r} if __import__('os').path.exists(p)]")
    assert seen == []
    # Every directory above the Python environment shows only the next step towards it.
    for env in {prefix, base}:
        parts = Path(env).parts
        for depth in range(2, len(parts)):
            above = str(Path(*parts[:depth]))
            if above == "/tmp":
                continue  # the sandbox's own tmpfs: the kernel's files (.ipython, ...) live there too
            listed = set(kernel.value(f"__import__('os').listdir({above!r})"))
            leading = {Path(p).parts[depth] for p in (prefix, base, str(agents["alice"]), kernel.runtime_dir)
                       if len(Path(p).parts) > depth and str(Path(*Path(p).parts[:depth])) == above}
            assert listed == leading, above
    # ...while the agent's own tree and the Python environment are there.
    visible = [str(agents["session"]), prefix, base]
    assert kernel.value(f"[p for p in {visible!r} if __import__('os').path.isdir(p)]") == visible
    assert kernel.value("__import__('os').getcwd()") == str(agents["session"])


def test_host_loopback_is_unreachable(kernel):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        cell = kernel.run(
            "import socket\n"
            f"socket.create_connection(('127.0.0.1', {port}), timeout=5)"
        )
        assert cell.status == "error"
        assert cell.ename in {"ConnectionRefusedError", "TimeoutError", "OSError"}
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever arrived


def test_no_capabilities_and_not_root(kernel):
    status = kernel.value("open('/proc/self/status').read()")
    assert "CapEff:\t0000000000000000" in status.splitlines()
    assert kernel.value("__import__('os').getuid()") != 0


def test_environment_and_transport(kernel, agents):
    env = kernel.value("dict(__import__('os').environ)")
    assert "JPY_PARENT_PID" not in env  # ipykernel would read pid 1 as "parent died"
    assert "JUPYTER_PATH" not in env  # set on the host by conftest: host variables stay out
    assert env["HOME"] == str(agents["session"])
    with open(kernel.connection_file) as f:
        info = json.load(f)
    assert info["transport"] == "ipc"
    assert info["ip"] == os.path.join(kernel.runtime_dir, "k")
    # The socket files are in the runtime dir, bound into the sandbox at the same path.
    assert kernel.value(f"sorted(__import__('os').listdir({kernel.runtime_dir!r}))") == sorted(
        os.listdir(kernel.runtime_dir)
    )


def test_without_config_the_workspace_is_the_working_directory(sandboxed_kernel, agents):
    (agents["alice"] / "SOUL.md").write_text("alice's soul\n")
    try:
        with sandboxed_kernel(agents["session"]) as k:
            code = "import os; open('made-here', 'w').write('x'); print(os.path.exists('../../SOUL.md'))"
            cell = k.run(code)
            assert (cell.status, cell.stdout) == ("ok", "False\n")
            assert (agents["session"] / "made-here").exists()
    finally:
        (agents["alice"] / "SOUL.md").unlink()
        (agents["session"] / "made-here").unlink(missing_ok=True)


def test_writes_outside_read_write_paths_fail(kernel):
    prefix, base = python_env_paths(sys.executable)
    name = f"kg-probe-{uuid.uuid4().hex[:8]}"
    targets = [f"/usr/{name}", f"{prefix}/{name}", f"{base}/{name}", "/etc/passwd"]
    code = (
        "errors = {}\n"
        f"for path in {targets!r}:\n"
        "    try:\n"
        "        open(path, 'a').write('x')\n"
        "        errors[path] = None\n"
        "    except OSError as e:\n"
        "        errors[path] = e.errno\n"
        "print(__import__('json').dumps(errors))"
    )
    cell = kernel.run(code)
    assert cell.status == "ok"
    refused = json.loads(cell.stdout)
    assert refused == {path: refused[path] for path in targets}
    for path, err in refused.items():
        assert err in (errno.EROFS, errno.EACCES, errno.EPERM), f"{path} was writable"
    for path in targets[:3]:
        assert not os.path.exists(path)
    assert "agent:x:1000" in kernel.value("open('/etc/passwd').read()")


def test_workspace_is_writable_and_tmp_is_private(kernel, agents):
    name = f"kg-probe-{uuid.uuid4().hex[:8]}"
    cell = kernel.run(f"open('{name}', 'w').write('hi'); open('/tmp/{name}', 'w').write('hi')")
    assert cell.status == "ok"
    assert (agents["session"] / name).read_text() == "hi"
    assert not os.path.exists(f"/tmp/{name}")
    (agents["session"] / name).unlink()


def test_pandas_imports_under_the_default_profile(kernel):
    cell = kernel.run("import pandas as pd\nint(pd.DataFrame({'a': [1, 2]}).a.sum())")
    assert (cell.status, cell.result) == ("ok", "3")


# --- interrupt --------------------------------------------------------------------


@pytest.mark.parametrize("busy_code", ["while True: pass", "import time; time.sleep(1000)"])
def test_interrupt_stops_a_busy_cell(kernel, busy_code):
    kernel.run("survivor = 41")
    msg_id = kernel.kc.execute(f"print('started', flush=True)\n{busy_code}")
    kernel.wait_for_output(msg_id, "started")
    kernel.km.interrupt_kernel()
    cell = kernel.collect(msg_id, timeout=30)
    assert (cell.status, cell.ename) == ("error", "KeyboardInterrupt")
    assert kernel.value("survivor + 1") == 42


# --- limits -----------------------------------------------------------------------

TEST_LIMITS = {"processes": 64, "file_size": "1M", "memory": "1G"}


@pytest.fixture(scope="module")
def limited(sandboxed_kernel, agents, tmp_path_factory):
    """alice's kernel under the default profile with small limits, from a profile file."""
    profile = load_profile("kernel")
    profile["limits"] = dict(profile["limits"], **TEST_LIMITS)
    path = tmp_path_factory.mktemp("profiles") / "small.json"
    path.write_text(json.dumps(profile))
    config = {"agent_root": str(agents["alice"]), "profile": str(path)}
    with sandboxed_kernel(agents["session"], config) as k:
        yield k


def test_fork_past_the_process_limit_fails_only_inside(limited, kernel):
    start_children = (
        "import subprocess\n"
        "children, failure = [], None\n"
        "try:\n"
        "    for _ in range(200):\n"
        "        children.append(subprocess.Popen(['sleep', '60']))\n"
        "except OSError as e:\n"
        "    failure = e.errno\n"
        "print(len(children), failure)"
    )
    cell = limited.run(start_children)
    try:
        assert cell.status == "ok", cell.evalue
        started, failure = cell.stdout.split()
        assert int(started) < TEST_LIMITS["processes"]
        assert int(failure) == errno.EAGAIN
        # With the sandbox at its cap, the host and another sandbox still fork.
        assert subprocess.run(["true"]).returncode == 0
        assert kernel.value("__import__('subprocess').run(['true']).returncode") == 0
    finally:
        limited.run("for c in children: c.kill(); c.wait()")
    assert limited.value("__import__('subprocess').run(['true']).returncode") == 0


def test_writing_past_file_size_fails(limited, agents):
    cell = limited.run("open('big.bin', 'wb').write(b'x' * (2 << 20))")
    try:
        assert (cell.status, cell.ename) == ("error", "OSError")
        assert "File too large" in cell.evalue
        assert (agents["session"] / "big.bin").stat().st_size <= 1 << 20
    finally:
        (agents["session"] / "big.bin").unlink()


def test_allocating_past_memory_raises_memory_error(limited):
    cell = limited.run("hog = bytearray(2 << 30)")
    assert (cell.status, cell.ename) == ("error", "MemoryError")
    assert limited.value("len(bytearray(1 << 20))") == 1 << 20


# --- lifecycle --------------------------------------------------------------------


def test_restart_then_shutdown_leaves_nothing_behind(sandboxed_kernel, agents):
    with sandboxed_kernel(agents["session"], {"agent_root": str(agents["alice"])}) as k:
        kernel_id = k.km.kernel_id
        assert k.value("__import__('os').getpid()") != k.km.provisioner.pid
        k.run("state = 'before restart'")
        k.km.restart_kernel(now=True)
        k.kc.wait_for_ready(timeout=30)
        cell = k.run("state")
        assert (cell.status, cell.ename) == ("error", "NameError")
        assert k.value("1 + 1") == 2
        assert len(kernel_cgroups(kernel_id)) == 1  # the first run's cgroup is gone
        assert os.path.isdir(k.runtime_dir)
    assert processes_mentioning(k.runtime_dir, k.connection_file) == []
    assert not os.path.exists(k.runtime_dir)
    assert kernel_cgroups(kernel_id) == []


# --- errors -----------------------------------------------------------------------


def start_should_fail(make_kernelspec, tmp_path, config, python=None):
    """start_kernel's exception, after checking it left no runtime dir, process or cgroup."""
    runtime_root = tmp_path / "runtime"
    runtime_root.mkdir()
    cwd = tmp_path / "workspace"
    cwd.mkdir()
    config = dict(config, runtime_root=str(runtime_root))
    km = KernelManager(kernel_name=make_kernelspec(config, python))
    with pytest.raises(Exception) as failure:
        km.start_kernel(cwd=str(cwd), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert list(runtime_root.iterdir()) == []
    assert processes_mentioning(str(runtime_root)) == []
    assert km.kernel_id and kernel_cgroups(km.kernel_id) == []
    assert not km.has_kernel
    return failure.value


def test_missing_bwrap_is_a_clear_error(make_kernelspec, tmp_path):
    error = start_should_fail(make_kernelspec, tmp_path, {"bwrap": "/nonexistent/bwrap"})
    assert isinstance(error, SandboxUnavailable)
    assert "bubblewrap (bwrap) not found at '/nonexistent/bwrap'" in str(error)
    assert "apt-get install -y bubblewrap" in str(error)


def test_missing_python_environment_is_a_clear_error(make_kernelspec, tmp_path):
    # A virtualenv whose base interpreter has been removed: bin/python dangles.
    (tmp_path / "env" / "bin").mkdir(parents=True)
    python = tmp_path / "env" / "bin" / "python"
    python.symlink_to(tmp_path / "removed" / "python3")
    error = start_should_fail(make_kernelspec, tmp_path, {}, python=str(python))
    assert isinstance(error, RuntimeError)
    assert f"the kernel's Python environment is missing: {python}" in str(error)


def test_bad_profile_is_a_clear_error_naming_the_field(make_kernelspec, tmp_path):
    profile = load_profile("kernel")
    profile["limits"]["memory"] = "12Q"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(profile))
    error = start_should_fail(make_kernelspec, tmp_path, {"profile": str(path)})
    assert isinstance(error, ProfileError)
    assert error.field == "limits.memory"
    assert "'12Q'" in str(error)


def test_a_bad_extra_path_in_the_config_is_a_clear_error(make_kernelspec, tmp_path):
    error = start_should_fail(make_kernelspec, tmp_path, {"read_write": ["/srv/data", {"from": "/srv/x"}]})
    assert isinstance(error, ProfileError)
    index = len(load_profile("kernel")["sandbox"]["read_write"]) + 1
    assert str(error) == f"sandbox.read_write[{index}]: missing 'at'"
