"""Profiles compile to an exact bwrap argv; bad profiles are refused naming the field.

Pure-function tests in the manner of Codex's bwrap.rs tests: policy in, argv out.
"""

from __future__ import annotations

import copy
import json

import pytest

from kernel_gateway.sandbox.profile import (
    Limits,
    ProfileError,
    compile_profile,
    created_files,
    load_profile,
    validate_profile,
)

VALUES = {
    "agent": "alice",
    "agent_root": "/srv/agents/alice",
    "workspace": "/srv/agents/alice/sessions/s1",
    "runtime_dir": "/tmp/kg-abc",
    "python_prefix": "/opt/venv",
    "python_base_prefix": "/usr/local",
    "python_bin": "/opt/venv/bin",
    "job_dir": "/srv/agents/alice/jobs/j1",
}

# Every default profile starts the same way: all namespaces, no network, uid 1000,
# then a fresh /proc, a minimal /dev and a private /tmp before any bind.
CONFINED_PREFIX = [
    "/usr/bin/bwrap",
    "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup",
    "--disable-userns",
    "--unshare-net",
    "--uid", "1000", "--gid", "1000",
    "--hostname", "sandbox",
    "--proc", "/proc",
    "--dev", "/dev",
    "--tmpfs", "/tmp",
]  # fmt: skip
SYSTEM_READ_ONLY = [
    "--ro-bind-try", "/usr", "/usr",
    "--ro-bind-try", "/bin", "/bin",
    "--ro-bind-try", "/sbin", "/sbin",
    "--ro-bind-try", "/lib", "/lib",
    "--ro-bind-try", "/lib64", "/lib64",
    "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache",
    "--ro-bind-try", "/etc/alternatives", "/etc/alternatives",
    "--ro-bind-try", "/etc/localtime", "/etc/localtime",
    "--ro-bind-try", "/etc/ssl/certs", "/etc/ssl/certs",
    "--ro-bind-try", "/etc/mime.types", "/etc/mime.types",
    "--ro-bind-try", "/etc/fonts", "/etc/fonts",
    "--ro-bind-try", "/usr/local", "/usr/local",
    "--ro-bind-try", "/opt/venv", "/opt/venv",
]  # fmt: skip
# The seccomp filter (fd 9 here), then no capabilities, a session of its own.
NO_CAPABILITIES_OWN_SESSION = [
    "--seccomp", "9", "--cap-drop", "ALL", "--new-session", "--die-with-parent", "--",
]  # fmt: skip


def compiled(name_or_profile, values=VALUES, fds=(5, 6), seccomp_fd=9):
    profile = load_profile(name_or_profile) if isinstance(name_or_profile, str) else name_or_profile
    return compile_profile(profile, values, bwrap="/usr/bin/bwrap", data_fds=fds, seccomp_fd=seccomp_fd)


# --- the shipped profiles -------------------------------------------------------------


def test_kernel_profile_argv():
    result = compiled("kernel")
    assert result.argv == CONFINED_PREFIX + SYSTEM_READ_ONLY + [
        "--bind", "/srv/agents/alice", "/srv/agents/alice",
        "--bind", "/tmp/kg-abc", "/tmp/kg-abc",
        "--ro-bind-data", "5", "/etc/passwd",
        "--ro-bind-data", "6", "/etc/group",
        "--remount-ro", "/",
        "--chdir", "/srv/agents/alice/sessions/s1",
    ] + NO_CAPABILITIES_OWN_SESSION  # fmt: skip
    assert result.limits == Limits(processes=256, file_size=1 << 30, memory=4 << 30)
    assert result.cwd == "/srv/agents/alice/sessions/s1"
    assert result.env["HOME"] == "/srv/agents/alice/sessions/s1"
    assert result.env["PATH"] == "/opt/venv/bin:/usr/local/bin:/usr/bin:/bin"
    assert result.keep == {"stdout": 64 << 10, "stderr": 64 << 10}


def test_kernel_profile_binds_the_agent_socket_when_there_is_one():
    values = dict(VALUES, agent_socket="/run/kg/agents/alice.sock")
    argv = compiled("kernel", values).argv
    bind = ["--bind-try", "/run/kg/agents/alice.sock", "/run/kernel-gateway.sock"]
    assert argv[argv.index("/tmp/kg-abc") + 2 : argv.index("--ro-bind-data")] == bind


def test_command_profile_argv():
    result = compiled("command")
    assert result.argv == CONFINED_PREFIX + SYSTEM_READ_ONLY + [
        "--bind", "/srv/agents/alice", "/srv/agents/alice",
        "--ro-bind-data", "5", "/etc/passwd",
        "--ro-bind-data", "6", "/etc/group",
        "--remount-ro", "/",
        "--chdir", "/srv/agents/alice/sessions/s1",
    ] + NO_CAPABILITIES_OWN_SESSION  # fmt: skip
    assert result.limits == Limits(
        wall_seconds=600, cpu_seconds=600, processes=256, file_size=1 << 30, memory=4 << 30
    )


def test_job_profile_argv_is_confined_to_the_job_directory():
    result = compiled("job")
    assert result.argv == CONFINED_PREFIX + SYSTEM_READ_ONLY + [
        "--bind", "/srv/agents/alice/jobs/j1", "/srv/agents/alice/jobs/j1",
        "--ro-bind-data", "5", "/etc/passwd",
        "--ro-bind-data", "6", "/etc/group",
        "--remount-ro", "/",
        "--chdir", "/srv/agents/alice/jobs/j1",
    ] + NO_CAPABILITIES_OWN_SESSION  # fmt: skip
    # The seed pattern's limits: two hours, an hour of CPU, 512 processes, files of 256M.
    assert result.limits == Limits(
        wall_seconds=7200, cpu_seconds=3600, processes=512, file_size=256 << 20, memory=4 << 30
    )
    assert created_files(load_profile("job"), VALUES)[0] == (
        "/etc/passwd",
        "agent:x:1000:1000:agent:/srv/agents/alice/jobs/j1:/bin/sh\n",
    )


def test_default_profiles_never_mount_the_host_home():
    for name in ("kernel", "command", "job"):
        argv = compiled(name).argv
        assert not [arg for arg in argv if arg == "/root" or arg.startswith("/root/")]
        assert not [arg for arg in argv if arg == "/home" or arg.startswith("/home/")]


# --- a seed-shaped profile with everything switched on -----------------------------------

SEED_LIKE = {
    "sandbox": {
        "uid": 2000,
        "gid": 3000,
        "linux_capabilities": ["CAP_NET_BIND_SERVICE"],
        "network": True,
        "isolate_terminal": False,
        "ends_with_parent": False,
        "read_only": ["/usr", "/usr", "/etc/resolv.conf"],
        "read_write": ["$$workspace$$", {"from": "$$job_dir$$/out", "at": "/out"}],
        "homes": ["/root/.codex"],
        "created_files": [{"at": "/etc/passwd", "text": "$$agent$$:x:2000:3000::$$workspace$$:/bin/sh\n"}],
        "proc": "/proc",
        "dev": "/dev",
        "tmp": None,
        "nested_userns": True,
        "seccomp": False,
    },
    "limits": {"wall": "2h", "cpu": 3600, "processes": 512, "file_size": "256M"},
    "process": {"cwd": "$$workspace$$", "command": ["/bin/sh", "-c", "cd $$workspace$$"]},
}


def test_seed_shaped_profile_argv():
    result = compiled(validate_profile(copy.deepcopy(SEED_LIKE)), fds=(7,))
    assert result.argv == [
        "/usr/bin/bwrap",
        "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup",
        "--uid", "2000", "--gid", "3000",
        "--hostname", "sandbox",
        "--proc", "/proc",
        "--dev", "/dev",
        "--ro-bind-try", "/usr", "/usr",
        "--ro-bind-try", "/etc/resolv.conf", "/etc/resolv.conf",
        "--bind", "/srv/agents/alice/sessions/s1", "/srv/agents/alice/sessions/s1",
        "--bind", "/srv/agents/alice/jobs/j1/out", "/out",
        "--bind", "/root/.codex", "/root/.codex",
        "--ro-bind-data", "7", "/etc/passwd",
        "--remount-ro", "/",
        "--chdir", "/srv/agents/alice/sessions/s1",
        "--cap-drop", "ALL",
        "--cap-add", "CAP_NET_BIND_SERVICE",
        "--",
    ]  # fmt: skip
    assert result.command == ["/bin/sh", "-c", "cd /srv/agents/alice/sessions/s1"]
    assert result.limits == Limits(
        wall_seconds=7200, cpu_seconds=3600, processes=512, file_size=256 << 20
    )


def test_nested_user_namespaces_are_off_unless_the_profile_opts_out():
    for name in ("kernel", "command", "job"):
        profile = load_profile(name)
        assert profile["sandbox"]["nested_userns"] is False
        confined = compiled(profile).argv
        assert confined[:7] == CONFINED_PREFIX[:7] and confined[6] == "--disable-userns"
        profile["sandbox"]["nested_userns"] = True
        opted_out = compiled(profile)
        assert opted_out.nested_userns is True
        assert opted_out.argv == confined[:6] + confined[7:]


def test_the_seccomp_filter_is_on_unless_the_profile_turns_it_off():
    for name in ("kernel", "command", "job"):
        profile = load_profile(name)
        assert profile["sandbox"]["seccomp"] is True
        filtered = compiled(profile, seccomp_fd=11)
        at = filtered.argv.index("--seccomp")
        assert filtered.argv[at : at + 4] == ["--seccomp", "11", "--cap-drop", "ALL"]
        assert filtered.seccomp is True
        with pytest.raises(ValueError, match="seccomp_fd"):
            compiled(profile, seccomp_fd=None)
        profile["sandbox"]["seccomp"] = False
        unfiltered = compiled(profile, seccomp_fd=None)
        assert unfiltered.seccomp is False
        assert unfiltered.argv == filtered.argv[:at] + filtered.argv[at + 2 :]


def test_a_profile_that_predates_the_switches_gets_both_walls():
    profile = load_profile("command")
    del profile["sandbox"]["nested_userns"], profile["sandbox"]["seccomp"]
    del profile["limits"]["cpu_weight"], profile["limits"]["cpu_max"]
    result = compiled(validate_profile(profile))
    assert "--disable-userns" in result.argv
    assert result.argv[result.argv.index("--seccomp") + 1] == "9"
    assert (result.limits.cpu_weight, result.limits.cpu_max) == (100, None)


@pytest.mark.parametrize(("value", "cpus"), [(2, 2.0), (0.5, 0.5), ("1.5", 1.5), (" 3 ", 3.0), (None, None)])
def test_cpu_max_is_a_number_of_cpus(value, cpus):
    assert compiled(with_change("limits", "cpu_max", value)).limits.cpu_max == cpus


def test_cpu_weight_is_compiled_into_the_limits():
    assert compiled(with_change("limits", "cpu_weight", 250)).limits.cpu_weight == 250


def test_compiling_does_not_change_the_profile():
    profile = validate_profile(copy.deepcopy(SEED_LIKE))
    compiled(profile, fds=(7,))
    assert profile == SEED_LIKE


def test_compile_wants_one_data_fd_per_created_file():
    with pytest.raises(ValueError, match="need 2 data fds"):
        compiled("kernel", fds=(5,))


# --- bad profiles are refused, naming the field --------------------------------------


def with_change(section: str, key: str, value) -> dict:
    profile = load_profile("kernel")
    profile[section][key] = value
    return profile


BAD_PROFILES = [
    # (profile, field named, words in the message)
    ({"sandbox": {}, "extra": 1}, "profile.extra", "unknown key"),
    ({"limits": {}}, "sandbox", "missing"),
    (with_change("sandbox", "netwrk", False), "sandbox.netwrk", "unknown key"),
    (with_change("limits", "disk", "1G"), "limits.disk", "unknown key"),
    (with_change("limits", "disk", "1G"), "limits.disk", "per agent, not per sandbox: set --Gateway.disk_quota"),
    (with_change("process", "user", "codex-task"), "process.user", "unknown key"),
    (with_change("sandbox", "network", "no"), "sandbox.network", "wrong type"),
    (with_change("sandbox", "uid", -1), "sandbox.uid", "out of range"),
    (with_change("sandbox", "read_only", ["usr/lib"]), "sandbox.read_only[0]", "absolute path"),
    (with_change("sandbox", "read_write", ["/srv", "$$home$$/x"]), "sandbox.read_write[1]", "unknown placeholder $$home$$"),
    (with_change("sandbox", "read_write", ["$$workspace/x"]), "sandbox.read_write[0]", "malformed placeholder"),
    (with_change("sandbox", "read_write", [{"from": "/a", "to": "/b"}]), "sandbox.read_write[0]", "unknown key 'to'"),
    (with_change("sandbox", "homes", [{"from": "/root/.codex"}]), "sandbox.homes[0]", "missing 'at'"),
    (with_change("sandbox", "tmp", "tmp"), "sandbox.tmp", "absolute path"),
    (with_change("sandbox", "linux_capabilities", ["CAP_SYS_ADMN"]), "sandbox.linux_capabilities[0]", "unknown capability"),
    (with_change("sandbox", "created_files", [{"at": "/etc/x"}]), "sandbox.created_files[0].text", "expected a string"),
    (with_change("limits", "file_size", "12Q"), "limits.file_size", "'12Q'"),
    (with_change("limits", "memory", "12Q"), "limits.memory", "'12Q'"),
    (with_change("limits", "memory", -1), "limits.memory", "must not be negative"),
    (with_change("limits", "cpu", -5), "limits.cpu", "must not be negative"),
    (with_change("limits", "wall", "soon"), "limits.wall", "'soon'"),
    (with_change("limits", "processes", -1), "limits.processes", "at least 1"),
    (with_change("limits", "processes", "many"), "limits.processes", "whole number"),
    (with_change("process", "env", {"HOME": "$$host_home$$"}), "process.env.HOME", "unknown placeholder $$host_home$$"),
    (with_change("process", "keep", {"stdout": "12Q"}), "process.keep.stdout", "'12Q'"),
    (with_change("process", "cwd", "sessions"), "process.cwd", "absolute path"),
    (with_change("sandbox", "nested_userns", "no"), "sandbox.nested_userns", "wrong type"),
    (with_change("sandbox", "nested_userns", 0), "sandbox.nested_userns", "wrong type"),
    (with_change("sandbox", "seccomp", "default"), "sandbox.seccomp", "wrong type"),
    (with_change("sandbox", "seccomp", None), "sandbox.seccomp", "wrong type"),
    (with_change("limits", "cpu_weight", 0), "limits.cpu_weight", "from 1 to 10000"),
    (with_change("limits", "cpu_weight", 10001), "limits.cpu_weight", "from 1 to 10000"),
    (with_change("limits", "cpu_weight", "high"), "limits.cpu_weight", "'high'"),
    (with_change("limits", "cpu_weight", True), "limits.cpu_weight", "True"),
    (with_change("limits", "cpu_weight", 1.5), "limits.cpu_weight", "1.5"),
    (with_change("limits", "cpu_max", 0), "limits.cpu_max", "between 0.01 and 1024"),
    (with_change("limits", "cpu_max", -1), "limits.cpu_max", "between 0.01 and 1024"),
    (with_change("limits", "cpu_max", "two"), "limits.cpu_max", "'two'"),
    (with_change("limits", "cpu_max", "nan"), "limits.cpu_max", "nan"),
    (with_change("limits", "cpu_max", True), "limits.cpu_max", "True"),
    (with_change("limits", "cpu_max", [2]), "limits.cpu_max", "[2]"),
]


@pytest.mark.parametrize(
    ("profile", "field", "words"), BAD_PROFILES, ids=[case[1] + ":" + case[2] for case in BAD_PROFILES]
)
def test_bad_profile_is_refused_naming_the_field(profile, field, words):
    before = copy.deepcopy(profile)
    with pytest.raises(ProfileError) as refused:
        validate_profile(profile)
    assert refused.value.field == field
    assert str(refused.value).startswith(f"{field}: ")
    assert words in str(refused.value)
    assert profile == before


def test_values_that_break_a_path_are_refused_at_compile_time():
    profile = load_profile("kernel")
    for name, value, words in [
        ("agent_root", "relative/alice", "absolute path"),
        ("agent_root", "/srv/agents/../bob", "'..'"),
    ]:
        with pytest.raises(ProfileError) as refused:
            compiled(profile, dict(VALUES, **{name: value}))
        assert refused.value.field == "sandbox.read_write[0]"
        assert words in str(refused.value)


def test_a_placeholder_without_a_value_is_refused_at_compile_time():
    values = {k: v for k, v in VALUES.items() if k != "runtime_dir"}
    with pytest.raises(ProfileError) as refused:
        compiled("kernel", values)
    assert refused.value.field == "sandbox.read_write[1]"
    assert "no value for placeholder $$runtime_dir$$" in str(refused.value)


def test_extra_placeholders_are_accepted_when_declared():
    profile = with_change("sandbox", "read_only", ["$$datasets$$"])
    with pytest.raises(ProfileError, match=r"unknown placeholder \$\$datasets\$\$"):
        validate_profile(copy.deepcopy(profile))
    validate_profile(profile, extra_placeholders=["datasets"])
    argv = compiled(profile, dict(VALUES, datasets="/data/shared")).argv
    assert argv[argv.index("--ro-bind-try") : argv.index("--ro-bind-try") + 3] == [
        "--ro-bind-try", "/data/shared", "/data/shared",
    ]  # fmt: skip


# --- loading ------------------------------------------------------------------------


def test_load_profile_from_a_file(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(SEED_LIKE))
    assert load_profile(str(path)) == SEED_LIKE


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("kernal", "no built-in profile 'kernal' (kernel, command, job, lab)"),
        ("/nonexistent/profile.json", "cannot read /nonexistent/profile.json"),
    ],
)
def test_load_profile_refuses_what_it_cannot_find(name, words):
    with pytest.raises(ProfileError) as refused:
        load_profile(name)
    assert refused.value.field == "profile"
    assert words in str(refused.value)


def test_load_profile_refuses_invalid_json(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"sandbox": {')
    with pytest.raises(ProfileError, match="is not valid JSON"):
        load_profile(str(path))


# --- mount order: a parent before anything beneath it ------------------------------------


def test_a_read_only_path_inside_the_read_write_tree_is_mounted_after_the_tree():
    # bwrap mounts in argv order: listed first, the read-only file would be hidden.
    profile = with_change(
        "sandbox",
        "read_only",
        ["/usr", "$$agent_root$$/SOUL.md", {"from": "/opt/skill", "at": "$$agent_root$$/installed-skills/s"}],
    )
    argv = compiled(validate_profile(profile)).argv
    start = argv.index("--ro-bind-try")
    assert argv[start : argv.index("--ro-bind-data")] == [
        "--ro-bind-try", "/usr", "/usr",
        "--bind", "/srv/agents/alice", "/srv/agents/alice",
        "--ro-bind-try", "/srv/agents/alice/SOUL.md", "/srv/agents/alice/SOUL.md",
        "--ro-bind-try", "/opt/skill", "/srv/agents/alice/installed-skills/s",
        "--bind", "/tmp/kg-abc", "/tmp/kg-abc",
    ]  # fmt: skip


def test_nested_binds_follow_their_parents_at_any_depth_and_others_keep_their_places():
    profile = with_change(
        "sandbox",
        "read_only",
        ["$$agent_root$$/a/b/c", "/usr", "$$agent_root$$/a", "/srv/agents/alice-other"],
    )
    profile["sandbox"]["read_write"] = ["$$agent_root$$/a/b", "$$agent_root$$"]
    argv = compiled(validate_profile(profile)).argv
    start = argv.index("--tmpfs") + 2
    assert argv[start : argv.index("--ro-bind-data")] == [
        "--ro-bind-try", "/usr", "/usr",
        # "alice-other" is not beneath "alice": a sibling keeps its place.
        "--ro-bind-try", "/srv/agents/alice-other", "/srv/agents/alice-other",
        "--bind", "/srv/agents/alice", "/srv/agents/alice",
        "--ro-bind-try", "/srv/agents/alice/a", "/srv/agents/alice/a",
        "--bind", "/srv/agents/alice/a/b", "/srv/agents/alice/a/b",
        "--ro-bind-try", "/srv/agents/alice/a/b/c", "/srv/agents/alice/a/b/c",
    ]  # fmt: skip


def test_the_same_destination_twice_keeps_the_given_order():
    profile = with_change("sandbox", "read_only", [{"from": "/x", "at": "$$agent_root$$"}])
    profile["sandbox"]["read_write"] = ["$$agent_root$$"]
    argv = compiled(validate_profile(profile)).argv
    start = argv.index("--tmpfs") + 2
    assert argv[start : argv.index("--ro-bind-data")] == [
        "--ro-bind-try", "/x", "/srv/agents/alice",
        "--bind", "/srv/agents/alice", "/srv/agents/alice",
    ]  # fmt: skip
