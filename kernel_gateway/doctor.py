"""`kernel-gateway doctor`: can sandboxed kernels work on this machine?

Each check tries the real thing (bwrap, namespaces, a fresh /proc, the
kernel's Python environment inside the sandbox, a sandboxed kernel that
answers) and reports OK or what is wrong and how to fix it.  Checks that need
an earlier one are left out when it fails: the first failure is the one to
fix.  The exit status is non-zero when any check fails; warnings (process and
memory caps enforced by rlimits alone) do not fail.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from .sandbox import cgroups, launch, quota, seccomp
from .sandbox.profile import load_profile

CONTAINER_FLAGS = (
    "--cap-add SYS_ADMIN --security-opt seccomp=unconfined --security-opt systempaths=unconfined"
)
CONTAINER_FIX = (
    "this looks like a container started without SYS_ADMIN, an unconfined seccomp profile "
    "and an unmasked /proc, which the worker image requires: start it with "
    f"{CONTAINER_FLAGS} (docker/README.md says why each is needed)"
)
HOST_USERNS_FIX = (
    "allow user namespaces: `sysctl -w kernel.unprivileged_userns_clone=1` (Debian/Ubuntu), "
    "`sysctl -w user.max_user_namespaces=15000`, and on Ubuntu 24.04+ "
    "`sysctl -w kernel.apparmor_restrict_unprivileged_userns=0`; or run the gateway as root. "
    f"Inside a container, start it with {CONTAINER_FLAGS}"
)
HOST_PROC_FIX = (
    "the kernel refuses a fresh /proc while parts of the current one are masked or "
    "over-mounted: give the gateway an unmasked /proc. Inside a container, start it with "
    f"{CONTAINER_FLAGS}"
)


@dataclass
class Check:
    """The outcome of one check; ``fix`` says what to do when it is not ok."""

    name: str
    ok: bool
    detail: str
    fix: str = ""
    warning: bool = False


def _in_container() -> bool:
    if os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv"):
        return True
    try:
        with open("/proc/1/cgroup") as f:
            return any(word in f.read() for word in ("docker", "containerd", "kubepods", "libpod"))
    except OSError:
        return False




def _run(argv: list[str], timeout: float = 30, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout, **kwargs
    )


def _bwrap_error(result: subprocess.CompletedProcess) -> str:
    return (result.stderr or result.stdout).strip() or f"exit status {result.returncode}"


def check_bwrap(bwrap: str | None) -> tuple[Check, str | None]:
    try:
        path = launch.find_bwrap(bwrap)
    except launch.SandboxUnavailable as e:
        message, _, fix = str(e).partition("; ")
        return Check("bwrap", False, message, fix), None
    try:
        result = _run([path, "--version"], timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return Check("bwrap", False, f"{path} does not run: {e}", "reinstall bubblewrap"), None
    if result.returncode != 0:
        return Check("bwrap", False, f"{path} --version failed: {_bwrap_error(result)}", "reinstall bubblewrap"), None
    return Check("bwrap", True, f"{path} ({result.stdout.strip()})"), path


def check_user_namespaces(bwrap: str) -> Check:
    argv = [bwrap, "--unshare-user", "--unshare-ipc", "--unshare-uts", "--unshare-net",
            "--ro-bind", "/", "/", "--cap-drop", "ALL", "--", "true"]  # fmt: skip
    result = _run(argv)
    if result.returncode != 0:
        return Check(
            "user namespaces",
            False,
            f"bwrap cannot create namespaces here: {_bwrap_error(result)}",
            CONTAINER_FIX if _in_container() else HOST_USERNS_FIX,
        )
    return Check("user namespaces", True, "bwrap creates user, ipc, uts and net namespaces")


def check_proc_in_pid_namespace(bwrap: str) -> Check:
    argv = [bwrap, "--unshare-user", "--unshare-pid", "--ro-bind", "/", "/", "--proc", "/proc",
            "--cap-drop", "ALL", "--", "sh", "-c", "echo $$"]  # fmt: skip
    result = _run(argv)
    if result.returncode != 0:
        return Check(
            "/proc in a pid namespace",
            False,
            f"bwrap cannot mount a fresh /proc in a new pid namespace: {_bwrap_error(result)}",
            CONTAINER_FIX if _in_container() else HOST_PROC_FIX,
        )
    return Check("/proc in a pid namespace", True, f"fresh /proc mounted; the sandbox sees itself as pid {result.stdout.strip()}")


def check_python_in_sandbox(bwrap: str, python: str) -> Check:
    """Run the kernel's Python under the shipped kernel profile and import ipykernel."""
    from .provisioner import python_env_paths

    prefix, base = python_env_paths(python)
    code = "import ipykernel, sys; print(sys.prefix, ipykernel.__version__)"
    with tempfile.TemporaryDirectory(prefix="kg-doctor-") as scratch:
        workspace, runtime = os.path.join(scratch, "agent"), os.path.join(scratch, "run")
        os.mkdir(workspace)
        os.mkdir(runtime)
        values = {
            "agent": "doctor",
            "agent_root": workspace,
            "workspace": workspace,
            "runtime_dir": runtime,
            "python_prefix": prefix,
            "python_base_prefix": base,
            "python_bin": os.path.join(prefix, "bin"),
        }
        prepared = launch.prepare(load_profile("kernel"), values, [python, "-c", code], bwrap=bwrap, name="doctor")
        try:
            proc = launch.run_to_end(prepared, timeout=60)
            out, err = proc.stdout, proc.stderr
        finally:
            prepared.cleanup()
    if proc.returncode != 0:
        last = (err.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        return Check(
            "Python environment in the sandbox",
            False,
            f"{python} cannot import ipykernel inside the sandbox: {last}",
            f"the kernel profile binds {prefix} and {base} read-only: install ipykernel there, "
            "and keep the environment outside the host's home and the state directory",
        )
    env_prefix, version = out.split()
    return Check("Python environment in the sandbox", True, f"{env_prefix} with ipykernel {version}")


def check_kernel(bwrap: str, python: str) -> Check:
    """Start a sandboxed kernel through jupyter_client and have it answer one cell."""
    from jupyter_client import KernelManager
    from jupyter_client.kernelspec import KernelSpecManager

    from .provisioner import kernelspec_dict

    # jupyter_client logs a traceback when a start fails; the check reports it instead.
    quiet = logging.getLogger("kernel_gateway.doctor.kernel")
    quiet.propagate = False
    quiet.addHandler(logging.NullHandler())
    with tempfile.TemporaryDirectory(prefix="kg-doctor-") as scratch:
        os.makedirs(os.path.join(scratch, "kernels", "doctor"))
        with open(os.path.join(scratch, "kernels", "doctor", "kernel.json"), "w") as f:
            json.dump(kernelspec_dict(python, {"bwrap": bwrap}), f)
        workspace = os.path.join(scratch, "agent")
        os.mkdir(workspace)
        specs = KernelSpecManager(kernel_dirs=[os.path.join(scratch, "kernels")])
        km = KernelManager(kernel_name="doctor", kernel_spec_manager=specs, log=quiet)
        started = time.monotonic()
        outputs: list[str] = []
        try:
            km.start_kernel(cwd=workspace, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            kc = km.client()
            kc.start_channels()
            try:
                kc.wait_for_ready(timeout=60)
                reply = kc.execute_interactive(
                    "import os; print(os.getpid(), os.getuid())",
                    timeout=30,
                    output_hook=lambda msg: outputs.append(msg["content"].get("text", "")),
                )
            finally:
                kc.stop_channels()
        except Exception as e:
            return Check(
                "sandboxed kernel",
                False,
                f"a test kernel did not start or answer: {type(e).__name__}: {e}",
                "fix the checks above; run a kernel by hand with its stderr visible to see why",
            )
        finally:
            if km.has_kernel:
                km.shutdown_kernel(now=True)
        elapsed = time.monotonic() - started
    if reply["content"]["status"] != "ok":
        return Check("sandboxed kernel", False, f"the test cell failed: {reply['content'].get('evalue')}", "")
    pid, uid = "".join(outputs).split()
    return Check("sandboxed kernel", True, f"started and answered in {elapsed:.1f} s (pid {pid}, uid {uid} inside)")


# Inside a sandbox of the shipped command profile: keyctl (denied by the filter) and
# unshare(CLONE_NEWUSER) in a single-threaded child (refused by the filter and --disable-userns).
WALLS_PROBE = """
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
keyctl = libc.syscall(250 if os.uname().machine == "x86_64" else 219, 0, -2, 1)
print("keyctl", "ok" if keyctl >= 0 else errno.errorcode[ctypes.get_errno()])
pid = os.fork()
if pid == 0:
    os._exit(0 if libc.unshare(0x10000000) == 0 else ctypes.get_errno())
code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print("userns", errno.errorcode[code] if code else "ok")
"""


def check_walls(bwrap: str, python: str) -> list[Check]:
    """The seccomp filter and the refusal of nested user namespaces, tried in a real command sandbox."""
    from .provisioner import python_env_paths

    try:
        described = seccomp.describe()
    except seccomp.SeccompUnavailable as e:
        message, _, fix = str(e).partition("; ")
        return [Check("seccomp filter", False, message, fix)]
    prefix, base = python_env_paths(python)
    with tempfile.TemporaryDirectory(prefix="kg-doctor-") as scratch:
        values = {
            "agent": "doctor", "agent_root": scratch, "workspace": scratch, "python_prefix": prefix,
            "python_base_prefix": base, "python_bin": os.path.join(prefix, "bin"),
        }  # fmt: skip
        prepared = launch.prepare(load_profile("command"), values, [python, "-c", WALLS_PROBE], bwrap=bwrap, name="doctor")
        try:
            result = launch.run_to_end(prepared, timeout=30)
        finally:
            prepared.cleanup()
    seen = dict(line.split() for line in result.stdout.splitlines() if len(line.split()) == 2)
    filter_check = (
        Check("seccomp filter", True, f"on in the shipped profiles: {described}; keyctl refused inside a sandbox")
        if seen.get("keyctl") == "EPERM"
        else Check(
            "seccomp filter", False,
            f"keyctl inside a sandbox gave {seen.get('keyctl') or _bwrap_error(result)}, not EPERM",
            "bwrap must be 0.5 or later (--seccomp); run a command sandbox by hand to see why",
        )  # fmt: skip
    )
    userns_check = (
        Check("nested user namespaces", True, f"off: bwrap --disable-userns; unshare(CLONE_NEWUSER) refused ({seen['userns']})")
        if seen.get("userns") in ("EPERM", "ENOSPC")
        else Check(
            "nested user namespaces", False,
            f"a sandbox could create a user namespace ({seen.get('userns') or _bwrap_error(result)})",
            "bwrap must be 0.8 or later (--disable-userns)",
        )  # fmt: skip
    )
    return [filter_check, userns_check]


def check_cpu() -> Check:
    mechanism = cgroups.describe()
    if mechanism is None or "cpu" not in mechanism:
        return Check(
            "CPU weight",
            True,
            cgroups.cpu_mechanism(mechanism),
            "give the gateway a writable cpu cgroup controller (root, or a delegated cgroup v2 subtree with cpu)",
            warning=True,
        )
    return Check("CPU weight", True, cgroups.cpu_mechanism(mechanism))


def check_disk_quota() -> Check:
    reason = quota.unavailable()
    if reason:
        return Check(
            "disk quota",
            True,
            f"none: {reason}; an agent can fill the disk its tree is on",
            "run the gateway as root on a host with loop devices, then set --Gateway.disk_quota=1G",
            warning=True,
        )
    return Check("disk quota", True, f"available: {quota.MECHANISM} (on with --Gateway.disk_quota=SIZE)")


def check_uid_mode(bwrap: str, python: str, uid_start: int) -> Check:
    """Which host uid sandboxes run as; as root, a test sandbox really runs as the first agent uid."""
    from .fs import own_tree
    from .provisioner import python_env_paths

    if os.geteuid() != 0:
        return Check("uid", True, f"sandboxes run as the gateway's own uid {os.geteuid()} (it is not root)")
    if uid_start <= 0:
        return Check(
            "uid", True, "sandboxes run as host root (--Gateway.agent_uid_start=0)",
            "leave --Gateway.agent_uid_start at its default (200000) so each agent gets its own uid",
            warning=True,
        )  # fmt: skip
    prefix, base = python_env_paths(python)
    run_as = launch.RunAs(uid_start, uid_start)
    with tempfile.TemporaryDirectory(prefix="kg-doctor-") as scratch:
        tree = os.path.join(scratch, "agent")
        os.mkdir(tree)
        own_tree(tree, uid_start, uid_start)
        values = {
            "agent": "doctor", "agent_root": tree, "workspace": tree, "python_prefix": prefix,
            "python_base_prefix": base, "python_bin": os.path.join(prefix, "bin"),
        }  # fmt: skip
        try:
            prepared = launch.prepare(
                load_profile("command"), values, ["/bin/sh", "-c", "touch probe"], bwrap=bwrap, name="doctor", run_as=run_as
            )
        except launch.SandboxUnavailable as e:
            return Check("uid", False, str(e), "install bubblewrap (see the bwrap check above)")
        try:
            proc = launch.run_to_end(prepared, timeout=60)
            err = proc.stderr
        finally:
            prepared.cleanup()
        try:
            owner = os.stat(os.path.join(tree, "probe")).st_uid
        except OSError:
            owner = None
    if proc.returncode != 0 or owner != uid_start:
        return Check(
            "uid", False,
            f"a sandbox could not run as host uid {uid_start}: {err.strip() or f'exit status {proc.returncode}'}",
            "unprivileged bwrap needs user namespaces for that uid (see the user namespaces check)",
        )  # fmt: skip
    return Check("uid", True, f"sandboxes run as per-agent host uids from {uid_start}")


def check_caps() -> Check:
    mechanism = cgroups.describe()
    if mechanism is None:
        return Check(
            "process and memory caps",
            True,
            "rlimits only: RLIMIT_NPROC is not enforced for host uid 0 and counts every process "
            "of a uid, so one agent's fork bomb can starve the others",
            "give the gateway a writable pids (and memory) cgroup: run it as root with "
            "/sys/fs/cgroup writable, or delegate a cgroup v2 subtree to its user",
            warning=True,
        )
    if "memory" not in mechanism and mechanism.startswith("cgroup v1"):
        return Check(
            "process and memory caps",
            True,
            f"{mechanism}; memory is capped by RLIMIT_AS only",
            "make the cgroup v1 memory controller writable for the gateway",
            warning=True,
        )
    return Check("process and memory caps", True, mechanism)


def check_codex(path: str) -> Check:
    """The Codex CLI that codex background jobs run (--Gateway.codex_command)."""
    fix = "npm install @openai/codex and name its native binary with --Gateway.codex_command"
    try:
        result = _run([path, "--version"], timeout=30)
    except OSError as e:
        return Check("codex", False, f"cannot run {path}: {e.strerror}", fix)
    if result.returncode != 0:
        return Check("codex", False, f"{path} --version failed: {result.stderr.strip()[-300:]}", fix)
    return Check("codex", True, f"{result.stdout.strip()} at {os.path.realpath(path)} (runs codex jobs)")


def run_checks(bwrap: str | None = None, codex: str | None = None, uid_start: int | None = None) -> list[Check]:
    """Every check, in order; later sandbox checks are left out once one fails."""
    if uid_start is None:
        from .settings import Gateway

        uid_start = Gateway().agent_uid_start
    python = sys.executable
    bwrap_check, path = check_bwrap(bwrap)
    checks = [bwrap_check]
    if path is not None:
        for check in (check_user_namespaces, check_proc_in_pid_namespace):
            checks.append(check(path))
            if not checks[-1].ok:
                break
        else:
            checks.append(check_python_in_sandbox(path, python))
            if checks[-1].ok:
                checks.append(check_kernel(path, python))
                checks.extend(check_walls(path, python))
                checks.append(check_uid_mode(path, python, uid_start))
    checks += [check_caps(), check_cpu(), check_disk_quota()]
    codex = codex or shutil.which("codex")
    if codex:  # codex jobs are optional: reported when a binary is named or on PATH
        checks.append(check_codex(codex))
    return checks


def _render(check: Check) -> str:
    status = "OK" if check.ok and not check.warning else "WARN" if check.ok else "FAIL"
    line = f"{status:<5} {check.name}: {check.detail}"
    if check.fix and (check.warning or not check.ok):
        line += f"\n      fix: {check.fix}"
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kernel-gateway doctor", description="Check that sandboxed kernels can work here."
    )
    parser.add_argument("--bwrap", metavar="PATH", help="bwrap to check (default: the one on PATH)")
    parser.add_argument("--codex", metavar="PATH", help="the Codex binary of codex jobs (default: codex on PATH)")
    parser.add_argument("--json", action="store_true", help="print the checks as a JSON list")
    parser.add_argument(
        "--uid-start", type=int, default=None, metavar="UID", help="the gateway's agent_uid_start (default 200000)"
    )
    args = parser.parse_args(argv)
    checks = run_checks(args.bwrap, args.codex, args.uid_start)
    if args.json:
        print(json.dumps([asdict(check) for check in checks], indent=2))
    else:
        for check in checks:
            print(_render(check))
    return 0 if all(check.ok for check in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
