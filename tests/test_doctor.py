"""`kernel-gateway doctor` for real: all OK here, and clear failures where sandboxing cannot work.

The failure cases are real too: the doctor runs inside an outer bwrap that
forbids user namespaces (``--disable-userns``) or that masks part of /proc the
way Docker does, and must say so.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from kernel_gateway import doctor

NAMES = [
    "bwrap",
    "user namespaces",
    "/proc in a pid namespace",
    "Python environment in the sandbox",
    "sandboxed kernel",
    "seccomp filter",
    "nested user namespaces",
    "uid",
    "process and memory caps",
    "CPU weight",
    "disk quota",
]


def leftovers() -> set[str]:
    """The doctor's scratch dirs and cgroups that still exist (probe-* is shared with the server)."""
    patterns = ["/tmp/kg-doctor-*", "/sys/fs/cgroup/pids/kernel-gateway/doctor-*"]
    return {path for pattern in patterns for path in glob.glob(pattern)}


def doctor_cli(*args: str, outer: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m kernel_gateway.doctor``, optionally inside an ``outer`` bwrap argv."""
    command = [sys.executable, "-m", "kernel_gateway.doctor", *args]
    return subprocess.run(
        (outer or []) + command, capture_output=True, text=True, timeout=120, cwd=os.path.dirname(__file__)
    )


# The checkout may itself live under /tmp (a CI clone): bind it back over the tmpfs.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def outer_bwrap(*options: str) -> list[str]:
    """A plain outer sandbox that still sees the repository and this Python environment."""
    return [
        "bwrap", "--unshare-user", "--unshare-pid", *options,
        "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
        "--tmpfs", "/tmp", "--ro-bind", sys.prefix, sys.prefix, "--ro-bind", REPO, REPO,
        "--cap-drop", "ALL", "--",
    ]  # fmt: skip


def test_every_check_passes_here():
    before = leftovers()
    checks = doctor.run_checks()
    assert [c.name for c in checks] == NAMES
    assert [(c.name, c.ok, c.warning) for c in checks] == [(name, True, False) for name in NAMES]
    assert checks[0].detail.startswith("/usr/bin/bwrap (bubblewrap ")
    assert "uid 1000 inside" in checks[4].detail
    assert checks[5].detail.startswith("on in the shipped profiles: 53 syscalls denied with EPERM (libseccomp, ")
    assert checks[5].detail.endswith("; keyctl refused inside a sandbox")
    assert checks[6].detail == "off: bwrap --disable-userns; unshare(CLONE_NEWUSER) refused (EPERM)"
    assert checks[8].detail == "cgroup v1 (pids, memory, cpu)"
    assert checks[9].detail.startswith("cgroup v1 cpu.shares, cpu.cfs_quota_us: equal weight per agent")
    assert checks[10].detail.startswith("available: ext4 image per agent, loop-mounted nosuid,nodev")
    assert checks[7].detail == "sandboxes run as per-agent host uids from 200000"
    assert leftovers() <= before


def test_uid_mode_is_reported_and_root_sandboxes_are_a_warning():
    python = sys.executable
    check = doctor.check_uid_mode("/usr/bin/bwrap", python, 230000)
    assert (check.ok, check.warning, check.detail) == (True, False, "sandboxes run as per-agent host uids from 230000")
    root = doctor.check_uid_mode("/usr/bin/bwrap", python, 0)
    assert root.ok and root.warning and "host root" in root.detail


def test_cli_prints_ok_lines_and_exits_0():
    result = doctor_cli()
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == [f"OK    {name}" for name in NAMES]
    assert result.stderr == ""


def test_cli_json_lists_the_checks():
    result = doctor_cli("--json")
    assert result.returncode == 0
    checks = json.loads(result.stdout)
    assert [c["name"] for c in checks] == NAMES
    assert all(set(c) == {"name", "ok", "detail", "fix", "warning"} and c["ok"] for c in checks)


def test_missing_bwrap_fails_clearly_with_exit_1():
    result = doctor_cli("--bwrap", "/nonexistent")
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert lines[0] == "FAIL  bwrap: bubblewrap (bwrap) not found at '/nonexistent'"
    assert lines[1].startswith("      fix: install it with `apt-get install -y bubblewrap`")
    # The sandbox checks that need bwrap are left out; the caps report still runs.
    assert [line.split(":")[0] for line in lines if not line.startswith(" ")][1:] == [
        "OK    process and memory caps", "OK    CPU weight", "OK    disk quota"
    ]
    assert lines[2] == "OK    process and memory caps: cgroup v1 (pids, memory, cpu)"
    assert result.stderr == ""


def test_no_user_namespaces_is_named_with_the_fix():
    result = doctor_cli(outer=outer_bwrap("--disable-userns"))
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert lines[0].startswith("OK    bwrap: ")
    assert lines[1].startswith("FAIL  user namespaces: bwrap cannot create namespaces here: bwrap: ")
    assert "--cap-add SYS_ADMIN --security-opt seccomp=unconfined --security-opt systempaths=unconfined" in lines[2]
    assert "Traceback" not in result.stdout + result.stderr


def test_masked_proc_is_named_with_the_fix():
    # Docker masks parts of /proc with over-mounts; then no fresh /proc may be mounted.
    result = doctor_cli(outer=outer_bwrap("--uid", "1000", "--gid", "1000", "--tmpfs", "/proc/bus"))
    lines = result.stdout.splitlines()
    assert result.returncode == 1
    assert lines[1].startswith("OK    user namespaces: ")
    assert lines[2] == (
        "FAIL  /proc in a pid namespace: bwrap cannot mount a fresh /proc in a new pid namespace: "
        "bwrap: Can't mount proc on /newroot/proc: Operation not permitted"
    )
    assert "--security-opt systempaths=unconfined" in lines[3]
    # Without cgroups in the outer sandbox, the caps fall back to rlimits: a warning.
    assert any(line.startswith("WARN  process and memory caps: rlimits only") for line in lines)
    # Nor a cpu controller, nor root for a loop mount: warnings, each with its fix.
    assert any(line.startswith("WARN  CPU weight: none: no writable cpu cgroup") for line in lines)
    assert any(line.startswith("WARN  disk quota: none: the gateway is not root") for line in lines)


def test_python_without_ipykernel_is_named():
    base_python = os.path.join(sys.base_prefix, "bin", "python3")
    check = doctor.check_python_in_sandbox("/usr/bin/bwrap", base_python)
    assert not check.ok
    assert check.detail == (
        f"{base_python} cannot import ipykernel inside the sandbox: "
        "ModuleNotFoundError: No module named 'ipykernel'"
    )
    assert "install ipykernel there" in check.fix


CODEX = os.path.join(REPO, ".reference", "bin", "codex")


@pytest.mark.skipif(not os.path.exists(CODEX), reason="no Codex binary: run tests/apply_patch/get_reference.sh")
def test_codex_of_codex_jobs_is_reported_when_named():
    result = doctor_cli("--codex", CODEX)
    assert result.returncode == 0, result.stdout
    assert result.stdout.splitlines()[-1] == f"OK    codex: codex-cli 0.171.0 at {os.path.realpath(CODEX)} (runs codex jobs)"
    missing = doctor_cli("--codex", "/nonexistent/codex")
    assert missing.returncode == 1
    assert missing.stdout.splitlines()[-2] == "FAIL  codex: cannot run /nonexistent/codex: No such file or directory"
