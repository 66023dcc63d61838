"""Sandbox profiles: validate a profile document and compile it to a bwrap argv.

A profile is a JSON document in the shape of the seed sandbox pattern::

    {"sandbox": {...}, "limits": {...}, "process": {...}}

with ``$$name$$`` placeholders that are filled per use (``$$agent_root$$``,
``$$workspace$$``, ...).  :func:`validate_profile` checks the document's shape
once, when it is loaded; :func:`compile_profile` is a pure function from a
valid profile plus placeholder values to the bwrap argv, the resource limits
and the environment.  Nothing here touches the filesystem or spawns anything,
so the security-relevant part is small and tested by exact argv.
"""

from __future__ import annotations

import json
import posixpath
import re
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Mapping, Sequence

PLACEHOLDER = re.compile(r"\$\$([A-Za-z_][A-Za-z0-9_]*)\$\$")

#: Placeholders the gateway and the provisioner know how to fill.
KNOWN_PLACEHOLDERS = frozenset(
    {
        "agent",  # the agent key
        "agent_root",  # <root>/<agent>
        "workspace",  # the working directory of this sandbox (a session or job dir)
        "runtime_dir",  # per-kernel directory holding the ZMQ ipc sockets
        "python_prefix",  # sys.prefix of the kernel's Python environment
        "python_base_prefix",  # sys.base_prefix (differs inside a virtualenv)
        "python_bin",  # <python_prefix>/bin
        "agent_socket",  # host path of the agent's socket
        "job_dir",  # a background job's directory
        "package_dir",  # this package's own directory (kernel-gateway lab imports its glue from it)
        "lab_runtime_dir",  # kernel-gateway lab: the directory of the socket JupyterLab serves on
    }
)

SANDBOX_KEYS = {
    "uid": int,
    "gid": int,
    "linux_capabilities": list,
    "network": bool,
    "isolate_terminal": bool,
    "ends_with_parent": bool,
    "read_only": list,
    "read_write": list,
    "homes": list,
    "created_files": list,
    "proc": (str, type(None)),
    "dev": (str, type(None)),
    "tmp": (str, type(None)),
    # false (the default): bwrap --disable-userns, so no process in the sandbox
    # can make a user namespace of its own (and gain a full capability set in it).
    "nested_userns": bool,
    # true (the default): the syscall filter of sandbox/seccomp.py.
    "seccomp": bool,
}
LIMIT_KEYS = ("wall", "cpu", "processes", "file_size", "memory", "cpu_weight", "cpu_max")
#: cgroup v2's range of cpu.weight (v1 cpu.shares is scaled from it).
CPU_WEIGHT_RANGE = (1, 10000)
DEFAULT_CPU_WEIGHT = 100
PROCESS_KEYS = {"env": dict, "keep": dict, "cwd": str, "command": list}
KEEP_KEYS = ("stdout", "stderr")

# Capabilities a profile may keep (linux/capability.h); anything else is a typo.
CAPABILITIES = frozenset(
    "CAP_" + name
    for name in (
        "CHOWN DAC_OVERRIDE DAC_READ_SEARCH FOWNER FSETID KILL SETGID SETUID SETPCAP "
        "LINUX_IMMUTABLE NET_BIND_SERVICE NET_BROADCAST NET_ADMIN NET_RAW IPC_LOCK "
        "IPC_OWNER SYS_MODULE SYS_RAWIO SYS_CHROOT SYS_PTRACE SYS_PACCT SYS_ADMIN "
        "SYS_BOOT SYS_NICE SYS_RESOURCE SYS_TIME SYS_TTY_CONFIG MKNOD LEASE AUDIT_WRITE "
        "AUDIT_CONTROL SETFCAP MAC_OVERRIDE MAC_ADMIN SYSLOG WAKE_ALARM BLOCK_SUSPEND "
        "AUDIT_READ PERFMON BPF CHECKPOINT_RESTORE"
    ).split()
)

_SIZE = re.compile(r"^(\d+)([KMGT]?)$")
_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)?$")
_DURATION_UNITS = {"ms": 0.001, "s": 1, None: 1, "m": 60, "h": 3600, "d": 86400}


class ProfileError(ValueError):
    """A profile is malformed; the message names the offending field."""

    def __init__(self, field_name: str, problem: str):
        super().__init__(f"{field_name}: {problem}")
        self.field = field_name


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandbox; None means unlimited."""

    wall_seconds: float | None = None
    cpu_seconds: int | None = None
    processes: int | None = None
    file_size: int | None = None
    memory: int | None = None
    cpu_weight: int = DEFAULT_CPU_WEIGHT  # share of CPU time under contention, within the agent
    cpu_max: float | None = None  # a hard cap, in CPUs' worth of time (1.5 = one and a half CPUs)


@dataclass(frozen=True)
class CompiledSandbox:
    """What it takes to start a process in the sandbox: ``argv + command``."""

    argv: list[str]
    limits: Limits
    env: dict[str, str]
    cwd: str | None
    keep: dict[str, int] = field(default_factory=dict)
    command: list[str] | None = None
    seccomp: bool = True  # the argv names the filter's fd: pass it to bwrap
    nested_userns: bool = False


# --- units -------------------------------------------------------------------


def parse_size(value: Any, field_name: str) -> int | None:
    """Bytes from an int or a string like "256M"; None stays None."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ProfileError(field_name, f"expected a size like 256M, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ProfileError(field_name, f"must not be negative, got {value}")
        return value
    if isinstance(value, str):
        match = _SIZE.match(value.strip().upper())
        if match:
            return int(match.group(1)) * _SIZE_UNITS[match.group(2)]
    raise ProfileError(field_name, f"expected a size like 512, 64K, 256M or 2G, got {value!r}")


def parse_duration(value: Any, field_name: str) -> float | None:
    """Seconds from a number or a string like "2h", "30m", "45s"; None stays None."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ProfileError(field_name, f"expected a duration like 30s, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ProfileError(field_name, f"must not be negative, got {value}")
        return float(value)
    if isinstance(value, str):
        match = _DURATION.match(value.strip())
        if match:
            return float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    raise ProfileError(field_name, f"expected a duration like 45s, 30m or 2h, got {value!r}")


def _parse_cpus(value: Any, field_name: str) -> float | None:
    """A CPU cap as a number of CPUs (1, 0.5, "2"); None stays None."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise ProfileError(field_name, f"expected a number of CPUs like 0.5 or 2, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ProfileError(field_name, f"expected a number of CPUs like 0.5 or 2, got {value!r}")
    if not 0.01 <= value <= 1024:
        raise ProfileError(field_name, f"must be between 0.01 and 1024 CPUs, got {value}")
    return float(value)


def _parse_weight(value: Any, field_name: str) -> int:
    if value is None:
        return DEFAULT_CPU_WEIGHT
    low, high = CPU_WEIGHT_RANGE
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ProfileError(field_name, f"expected a whole number from {low} to {high} (100 is the default share), got {value!r}")
    return value


def _parse_count(value: Any, field_name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProfileError(field_name, f"expected a whole number, got {value!r}")
    if value < 1:
        raise ProfileError(field_name, f"must be at least 1, got {value}")
    return value


# --- validation ----------------------------------------------------------------


def _check_placeholders(text: str, field_name: str, known: frozenset[str]) -> None:
    for name in PLACEHOLDER.findall(text):
        if name not in known:
            raise ProfileError(
                field_name, f"unknown placeholder $${name}$$ (known: {', '.join(sorted(known))})"
            )
    leftover = PLACEHOLDER.sub("", text)
    if "$$" in leftover:
        raise ProfileError(field_name, f"malformed placeholder in {text!r}; write $$name$$")


def _check_path(value: Any, field_name: str, known: frozenset[str]) -> None:
    if not isinstance(value, str) or not value:
        raise ProfileError(field_name, f"expected a path string, got {value!r}")
    _check_placeholders(value, field_name, known)
    if not (value.startswith("/") or value.startswith("$$")):
        raise ProfileError(field_name, f"must be an absolute path, got {value!r}")


def _check_mount(entry: Any, field_name: str, known: frozenset[str]) -> None:
    """A mount is a path (bound at the same place) or {"from", "at", "optional"?}."""
    if isinstance(entry, dict):
        unknown = set(entry) - {"from", "at", "optional"}
        if unknown:
            raise ProfileError(field_name, f"unknown key {sorted(unknown)[0]!r}")
        for key in ("from", "at"):
            if key not in entry:
                raise ProfileError(field_name, f"missing {key!r}")
            _check_path(entry[key], f"{field_name}.{key}", known)
        if not isinstance(entry.get("optional", False), bool):
            raise ProfileError(f"{field_name}.optional", "expected true or false")
    else:
        _check_path(entry, field_name, known)


def _check_keys(section: Any, name: str, allowed: Sequence[str]) -> None:
    if not isinstance(section, dict):
        raise ProfileError(name, f"expected an object, got {type(section).__name__}")
    unknown = sorted(set(section) - set(allowed))
    if unknown:
        where = ""
        if (name, unknown[0]) == ("limits", "disk"):  # the tree is shared by all of an agent's sandboxes
            where = "; a disk quota is per agent, not per sandbox: set --Gateway.disk_quota"
        raise ProfileError(f"{name}.{unknown[0]}", f"unknown key (allowed: {', '.join(allowed)}){where}")


def validate_profile(profile: Any, extra_placeholders: Sequence[str] = ()) -> dict:
    """Check a profile's shape; return it unchanged or raise :class:`ProfileError`."""
    known = KNOWN_PLACEHOLDERS | frozenset(extra_placeholders)
    _check_keys(profile, "profile", ("description", "sandbox", "limits", "process"))
    if "sandbox" not in profile:
        raise ProfileError("sandbox", "missing")

    sandbox = profile["sandbox"]
    _check_keys(sandbox, "sandbox", tuple(SANDBOX_KEYS))
    for key, expected in SANDBOX_KEYS.items():
        if key in sandbox and (
            not isinstance(sandbox[key], expected)
            or (expected is int and isinstance(sandbox[key], bool))
        ):
            raise ProfileError(f"sandbox.{key}", f"wrong type {type(sandbox[key]).__name__}")
    for key in ("uid", "gid"):
        if key in sandbox and not 0 <= sandbox[key] < 2**32 - 1:
            raise ProfileError(f"sandbox.{key}", f"out of range: {sandbox[key]}")
    for i, cap in enumerate(sandbox.get("linux_capabilities", [])):
        if cap not in CAPABILITIES:
            raise ProfileError(f"sandbox.linux_capabilities[{i}]", f"unknown capability {cap!r}")
    for key in ("read_only", "read_write", "homes"):
        for i, entry in enumerate(sandbox.get(key, [])):
            _check_mount(entry, f"sandbox.{key}[{i}]", known)
    for i, created in enumerate(sandbox.get("created_files", [])):
        name = f"sandbox.created_files[{i}]"
        _check_keys(created, name, ("at", "text"))
        _check_path(created.get("at"), f"{name}.at", known)
        if not isinstance(created.get("text"), str):
            raise ProfileError(f"{name}.text", "expected a string")
        _check_placeholders(created["text"], f"{name}.text", known)
    for key in ("proc", "dev", "tmp"):
        if sandbox.get(key) is not None:
            _check_path(sandbox[key], f"sandbox.{key}", known)

    limits = profile.get("limits", {})
    _check_keys(limits, "limits", LIMIT_KEYS)
    _compile_limits(limits)

    process = profile.get("process", {})
    _check_keys(process, "process", tuple(PROCESS_KEYS))
    for key, expected in PROCESS_KEYS.items():
        if key in process and not isinstance(process[key], expected):
            raise ProfileError(f"process.{key}", f"wrong type {type(process[key]).__name__}")
    for name, value in process.get("env", {}).items():
        if not isinstance(value, str) or not name or "=" in name:
            raise ProfileError(f"process.env.{name}", "expected NAME: string")
        _check_placeholders(value, f"process.env.{name}", known)
    keep = process.get("keep", {})
    _check_keys(keep, "process.keep", KEEP_KEYS)
    for key in KEEP_KEYS:
        parse_size(keep.get(key), f"process.keep.{key}")
    if "cwd" in process:
        _check_path(process["cwd"], "process.cwd", known)
    for i, arg in enumerate(process.get("command", [])):
        if not isinstance(arg, str):
            raise ProfileError(f"process.command[{i}]", "expected a string")
        _check_placeholders(arg, f"process.command[{i}]", known)
    return profile


def load_profile(name_or_path: str, extra_placeholders: Sequence[str] = ()) -> dict:
    """Load a shipped profile by name (``kernel``, ``command``, ``job``) or a JSON file."""
    if "/" in name_or_path or name_or_path.endswith(".json"):
        where = name_or_path
        try:
            with open(name_or_path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ProfileError("profile", f"cannot read {name_or_path}: {e.strerror}") from None
    else:
        where = f"built-in profile {name_or_path!r}"
        try:
            text = resources.files(__package__).joinpath(f"profiles/{name_or_path}.json").read_text()
        except FileNotFoundError:
            raise ProfileError(
                "profile", f"no built-in profile {name_or_path!r} (kernel, command, job, lab)"
            ) from None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError("profile", f"{where} is not valid JSON: {e}") from None
    return validate_profile(document, extra_placeholders)


# --- compilation ---------------------------------------------------------------


def _fill(text: str, values: Mapping[str, str], field_name: str) -> str:
    def replace(match: re.Match) -> str:
        name = match.group(1)
        if name not in values:
            raise ProfileError(field_name, f"no value for placeholder $${name}$$")
        return str(values[name])

    return PLACEHOLDER.sub(replace, text)


def _fill_path(text: str, values: Mapping[str, str], field_name: str) -> str:
    path = _fill(text, values, field_name)
    if not path.startswith("/"):
        raise ProfileError(field_name, f"must be an absolute path, got {path!r}")
    if ".." in path.split("/"):
        raise ProfileError(field_name, f"must not contain '..', got {path!r}")
    return posixpath.normpath(path)


def _mounts(entries: Sequence[Any], values: Mapping[str, str], name: str) -> list[tuple[str, str, bool]]:
    """(from, at, optional) for each entry, without duplicates, in order."""
    seen, result = set(), []
    for i, entry in enumerate(entries):
        field_name = f"sandbox.{name}[{i}]"
        if isinstance(entry, dict):
            missing = set(PLACEHOLDER.findall(entry["from"] + entry["at"])) - set(values)
            if entry.get("optional", False) and missing:
                continue  # an optional mount whose placeholder has no value is left out
            mount = (
                _fill_path(entry["from"], values, field_name + ".from"),
                _fill_path(entry["at"], values, field_name + ".at"),
                entry.get("optional", False),
            )
        else:
            path = _fill_path(entry, values, field_name)
            mount = (path, path, False)
        if mount[:2] not in seen:
            seen.add(mount[:2])
            result.append(mount)
    return result


def _beneath(path: str, parent: str) -> bool:
    return path != parent and path.startswith(parent.rstrip("/") + "/")


def parents_first(binds: Sequence[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """The binds in their given order, except that each comes after every bind above it.

    bwrap mounts in argv order, and a later bind hides whatever was mounted
    beneath its destination: a read-only file inside a read-write tree must be
    mounted after the tree, wherever the profile lists it.  Binds with no
    parent among the others keep their places.
    """
    pending, ordered = list(binds), []
    while pending:
        # The first pending bind with no pending bind above it (there is one:
        # the shortest destination has none).
        for i, (_flag, _source, at) in enumerate(pending):
            if not any(_beneath(at, other[2]) for other in pending):
                ordered.append(pending.pop(i))
                break
    return ordered


def _compile_limits(limits: Mapping[str, Any]) -> Limits:
    cpu = parse_duration(limits.get("cpu"), "limits.cpu")
    return Limits(
        wall_seconds=parse_duration(limits.get("wall"), "limits.wall"),
        cpu_seconds=None if cpu is None else max(1, int(cpu)),
        processes=_parse_count(limits.get("processes"), "limits.processes"),
        file_size=parse_size(limits.get("file_size"), "limits.file_size"),
        memory=parse_size(limits.get("memory"), "limits.memory"),
        cpu_weight=_parse_weight(limits.get("cpu_weight"), "limits.cpu_weight"),
        cpu_max=_parse_cpus(limits.get("cpu_max"), "limits.cpu_max"),
    )


def created_files(profile: Mapping[str, Any], values: Mapping[str, str]) -> list[tuple[str, str]]:
    """(path inside the sandbox, text) of each file the profile creates."""
    return [
        (
            _fill_path(f["at"], values, f"sandbox.created_files[{i}].at"),
            _fill(f["text"], values, f"sandbox.created_files[{i}].text"),
        )
        for i, f in enumerate(profile["sandbox"].get("created_files", []))
    ]


def compile_profile(
    profile: Mapping[str, Any],
    values: Mapping[str, str],
    *,
    bwrap: str = "bwrap",
    data_fds: Sequence[int] = (),
    seccomp_fd: int | None = None,
) -> CompiledSandbox:
    """Compile a validated profile and placeholder values into a :class:`CompiledSandbox`.

    ``data_fds`` holds one readable file descriptor per ``created_files`` entry,
    carrying that file's text (see :func:`created_files`); bwrap reads each one.
    ``seccomp_fd`` holds the seccomp filter (see ``sandbox/seccomp.py``), needed
    unless the profile turns the filter off.
    The argv ends with ``--``: append the command to run.
    """
    sandbox = profile["sandbox"]
    files = created_files(profile, values)
    if len(data_fds) != len(files):
        raise ValueError(f"need {len(files)} data fds for created_files, got {len(data_fds)}")
    use_seccomp = sandbox.get("seccomp", True)
    nested_userns = sandbox.get("nested_userns", False)
    if use_seccomp and seccomp_fd is None:
        raise ValueError("the profile has a seccomp filter: pass its fd as seccomp_fd")

    argv = [bwrap, "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup"]
    if not nested_userns:
        argv.append("--disable-userns")
    if not sandbox.get("network", False):
        argv.append("--unshare-net")
    argv += ["--uid", str(sandbox.get("uid", 1000)), "--gid", str(sandbox.get("gid", 1000))]
    argv += ["--hostname", "sandbox"]
    # Fresh /proc, /dev and /tmp first: a bind under /tmp must come after the tmpfs.
    if sandbox.get("proc"):
        argv += ["--proc", _fill_path(sandbox["proc"], values, "sandbox.proc")]
    if sandbox.get("dev"):
        argv += ["--dev", _fill_path(sandbox["dev"], values, "sandbox.dev")]
    if sandbox.get("tmp"):
        argv += ["--tmpfs", _fill_path(sandbox["tmp"], values, "sandbox.tmp")]
    # Read-only system paths may be absent on some hosts (/lib64): bind them if present.
    binds = [
        ("--ro-bind-try", source, at) for source, at, _optional in _mounts(sandbox.get("read_only", []), values, "read_only")
    ]
    for key in ("read_write", "homes"):
        for source, at, optional in _mounts(sandbox.get(key, []), values, key):
            binds.append(("--bind-try" if optional else "--bind", source, at))
    for flag, source, at in parents_first(binds):
        argv += [flag, source, at]
    for (at, _text), fd in zip(files, data_fds):
        argv += ["--ro-bind-data", str(fd), at]
    # bwrap's root is a tmpfs: make it read-only, so a write outside the
    # read-write paths fails instead of vanishing into memory.
    argv += ["--remount-ro", "/"]

    process = profile.get("process", {})
    cwd = _fill_path(process["cwd"], values, "process.cwd") if "cwd" in process else None
    if cwd:
        argv += ["--chdir", cwd]
    if use_seccomp:
        argv += ["--seccomp", str(seccomp_fd)]
    argv += ["--cap-drop", "ALL"]
    for cap in sandbox.get("linux_capabilities", []):
        argv += ["--cap-add", cap]
    if sandbox.get("isolate_terminal", True):
        argv.append("--new-session")
    if sandbox.get("ends_with_parent", True):
        argv.append("--die-with-parent")
    argv.append("--")

    env = {name: _fill(value, values, f"process.env.{name}") for name, value in process.get("env", {}).items()}
    keep = {key: parse_size(value, f"process.keep.{key}") for key, value in process.get("keep", {}).items()}
    command = process.get("command")
    if command is not None:
        command = [_fill(arg, values, f"process.command[{i}]") for i, arg in enumerate(command)]
    return CompiledSandbox(
        argv=argv,
        limits=_compile_limits(profile.get("limits", {})),
        env=env,
        cwd=cwd,
        keep=keep,
        command=command,
        seccomp=use_seccomp,
        nested_userns=nested_userns,
    )
