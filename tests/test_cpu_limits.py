"""CPU weight and cap per sandbox, under one parent group per agent (real cgroups, real bwrap)."""

from __future__ import annotations

import os
import sys

import pytest

from kernel_gateway.provisioner import python_env_paths
from kernel_gateway.sandbox import cgroups, launch
from kernel_gateway.sandbox.profile import load_profile

MECHANISM = cgroups.describe() or ""
pytestmark = pytest.mark.skipif("cpu" not in MECHANISM, reason=f"no writable cpu cgroup here ({MECHANISM or 'none'})")
V2 = MECHANISM.startswith("cgroup v2")
BUSY_SECOND = "import time\nt = time.time()\nwhile time.time() - t < 1: pass"


def _values(tmp_path, agent: str) -> dict:
    root = tmp_path / agent
    root.mkdir(exist_ok=True)
    prefix, base = python_env_paths(sys.executable)
    return {
        "agent": agent, "agent_root": str(root), "workspace": str(root),
        "python_prefix": prefix, "python_base_prefix": base, "python_bin": os.path.join(prefix, "bin"),
    }  # fmt: skip


def _profile(**limits) -> dict:
    profile = load_profile("command")
    profile["limits"].update(limits)
    return profile


def _cpu_dir(prepared: launch.PreparedSandbox) -> str:
    (found,) = [d for d in prepared.cgroup.dirs if os.path.exists(os.path.join(d, "cpu.weight" if V2 else "cpu.shares"))]
    return found


def _read(directory: str, name: str) -> str:
    with open(os.path.join(directory, name)) as f:
        return f.read().strip()


def test_a_sandbox_gets_its_weight_and_cap_inside_its_agents_group(tmp_path):
    values = _values(tmp_path, "cpu-alice")
    prepared = launch.prepare(_profile(cpu_weight=300, cpu_max=0.2), values, ["python3", "-c", BUSY_SECOND], name="cputest")
    cpu_dir = _cpu_dir(prepared)
    agent_group = os.path.dirname(cpu_dir)
    try:
        assert os.path.basename(agent_group) == cgroups.agent_group_name(values)
        assert os.path.basename(agent_group).startswith("kernel-gateway.agent-cpu-alice-")
        if V2:
            assert _read(cpu_dir, "cpu.weight") == "300"
            assert _read(cpu_dir, "cpu.max") == "20000 100000"
        else:
            assert _read(cpu_dir, "cpu.shares") == "3072"
            assert _read(cpu_dir, "cpu.cfs_quota_us") == "20000"
            assert _read(agent_group, "cpu.shares") == "1024"
        done = launch.run_to_end(prepared)  # spawn (into its cgroup from the first instruction), wait
        assert done.returncode == 0, done.stderr
        stat = dict(line.split() for line in _read(cpu_dir, "cpu.stat").splitlines())
        assert int(stat["nr_throttled"]) > 0  # the busy second really ran into the cap
    finally:
        assert prepared.cleanup()
    assert not os.path.exists(cpu_dir)
    assert not os.path.exists(agent_group)  # emptied agent groups go too


def test_sandboxes_of_one_agent_share_a_group_and_other_agents_get_their_own(tmp_path):
    first = launch.prepare(_profile(), _values(tmp_path, "cpu-bob"), ["true"], name="cputest")
    second = launch.prepare(_profile(), _values(tmp_path, "cpu-bob"), ["true"], name="cputest")
    other = launch.prepare(_profile(), _values(tmp_path, "cpu-carol"), ["true"], name="cputest")
    try:
        groups = [os.path.dirname(_cpu_dir(p)) for p in (first, second, other)]
        assert groups[0] == groups[1] != groups[2]
        assert os.path.dirname(groups[0]) == os.path.dirname(groups[2])  # both beside kernel-gateway/
        # The shipped profiles give the default weight.
        assert _read(_cpu_dir(first), "cpu.weight" if V2 else "cpu.shares") == ("100" if V2 else "1024")
        first.cleanup()
        assert os.path.isdir(groups[0])  # still in use by the second sandbox
    finally:
        for prepared in (first, second, other):
            prepared.cleanup()
    assert not os.path.exists(groups[0]) and not os.path.exists(groups[2])


@pytest.mark.skipif(V2, reason="uses cgroup v1's rule that a child's quota fits its parent's")
def test_a_limit_the_kernel_refuses_fails_the_start(tmp_path):
    """An operator capped this agent at half a CPU; a profile asking for two cannot start."""
    values = _values(tmp_path, "cpu-dave")
    probe = launch.prepare(_profile(), values, ["true"], name="cputest")  # keeps the agent's group alive
    agent_group = os.path.dirname(_cpu_dir(probe))
    try:
        with open(os.path.join(agent_group, "cpu.cfs_quota_us"), "w") as f:
            f.write("50000")
        before = set(os.listdir(agent_group))
        open_fds = len(os.listdir("/proc/self/fd"))
        with pytest.raises(cgroups.LimitNotApplied) as refused:
            launch.prepare(_profile(cpu_max=2), values, ["true"], name="cputest")
        assert "cpu.cfs_quota_us=200000" in refused.value.message
        assert refused.value.status == 503 and refused.value.code == "limit_not_applied"
        assert set(os.listdir(agent_group)) == before  # no leftover cgroup
        assert len(os.listdir("/proc/self/fd")) == open_fds  # no leaked memfd
    finally:
        probe.cleanup()
        if os.path.isdir(agent_group):
            os.rmdir(agent_group)


def test_sweep_removes_leftovers_inside_agent_groups(tmp_path):
    values = _values(tmp_path, "cpu-erin")
    prepared = launch.prepare(_profile(), values, ["true"], name="kg-sweeptest-x")
    cpu_dir = _cpu_dir(prepared)
    prepared.cgroup = None  # as if the gateway had been killed: nobody cleans up
    assert os.path.isdir(cpu_dir)
    assert cgroups.sweep("kg-sweeptest-") >= 1
    assert not os.path.exists(cpu_dir) and not os.path.exists(os.path.dirname(cpu_dir))
    prepared.spawned()
