"""The walls inside the sandbox: no nested user namespaces, and the seccomp filter.

Every attempt is really made, inside real sandboxes started by a real gateway
(a kernel and a command each), and the same attempt is made in a sandbox whose
profile opts out, to show that the refusal comes from the wall and not from
something else (a missing capability, an unconfigured kernel feature).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from kernel_gateway.sandbox import seccomp
from kernel_gateway.sandbox.profile import load_profile

from support import GatewayProcess

# One real attempt per denied syscall class; prints {name: errno name, or 0 for success}.
# The arguments are chosen so that, without the filter, each call gets an answer
# other than EPERM wherever the kernel's own checks allow it.
PROBE = r'''
import ctypes, errno, json
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
BAD = ctypes.c_void_p(1)  # an invalid user pointer: EFAULT once the kernel looks at it
def call(nr, *args):
    ctypes.set_errno(0)
    args = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    return 0 if libc.syscall(nr, *args) >= 0 else ctypes.get_errno()
s = lambda text: ctypes.c_char_p(text.encode())
handle = ctypes.create_string_buffer(128)
handle[0] = b"\x80"  # handle_bytes: room for any handle
tries = {
    "keyctl": lambda: call(250, 0, -2, 1),
    "add_key": lambda: call(248, s("user"), s("probe"), s("v"), 1, -2),
    "request_key": lambda: call(249, s("user"), s("no-such-key"), None, 0),
    "bpf": lambda: call(321, 9999, None, 0),
    "perf_event_open": lambda: call(298, None, 0, -1, -1, 0),
    "userfaultfd": lambda: call(323, 1),
    "io_uring_setup": lambda: call(425, 1, None),
    "kexec_load": lambda: call(246, 0, 0, None, 0xDEAD0000),
    "init_module": lambda: call(175, None, 0, s("")),
    "delete_module": lambda: call(176, s("no_such_module_kg"), 0),
    "name_to_handle_at": lambda: call(303, -100, s("/"), handle, BAD, 0),
    "open_by_handle_at": lambda: call(304, -100, None, 0),
    "reboot": lambda: call(169, 0, 0, 0, None),
    "swapon": lambda: call(167, s("/no/such/swap"), 0),
    "acct": lambda: call(163, s("/no/such/acct")),
    "quotactl": lambda: call(179, 0x800001, None, 0, None),
    "settimeofday": lambda: call(164, BAD, None),
    "clock_settime": lambda: call(227, 0, BAD),
    "iopl": lambda: call(172, 0),
    "ioperm": lambda: call(173, 0, 1, 0),
    "syslog": lambda: call(103, 10, None, 0),
    "mount": lambda: call(165, None, None, BAD, 0, None),
    "umount2": lambda: call(166, s("/no/such/mount"), 0x7FFFFFF0),
    "pivot_root": lambda: call(155, s("/no/such"), s("/no/such")),
    "unshare": lambda: call(272, 0x200),
    "setns": lambda: call(308, -1, 0),
    "x32 keyctl": lambda: call(0x40000000 | 250, 0, -2, 1),
}
print("PROBE" + json.dumps({name: errno.errorcode.get(try_(), 0) or 0 for name, try_ in tries.items()}))
'''
CLASSES = ["keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup",
           "kexec_load", "init_module", "delete_module", "name_to_handle_at", "open_by_handle_at", "reboot",
           "swapon", "acct", "quotactl", "settimeofday", "clock_settime", "iopl", "ioperm", "syslog", "mount",
           "umount2", "pivot_root", "unshare", "setns", "x32 keyctl"]  # fmt: skip
# Without the filter these still get EPERM in a sandbox: every capability is dropped.
CAPABILITY_GATED = {"reboot", "swapon", "acct", "syslog", "pivot_root"}

# unshare(CLONE_NEWUSER) from Python (3.11 has no os.unshare) and util-linux's unshare -Urm.
USERNS = r'''
import ctypes, errno, os, subprocess
libc = ctypes.CDLL(None, use_errno=True)
pid = os.fork()  # a kernel has threads, and unshare(CLONE_NEWUSER) wants a single-threaded caller
if pid == 0:
    os._exit(0 if libc.unshare(0x10000000) == 0 else ctypes.get_errno())
code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print("USERNS" + (errno.errorcode[code] if code else "0"))
done = subprocess.run(["unshare", "-Urm", "sh", "-c", "id -u"], capture_output=True, text=True)
print("UNSHARE_URM", done.returncode, done.stdout.strip())
'''

ORDINARY_WORK = r'''
import multiprocessing, subprocess, threading, numpy, pandas, matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
def square(x):
    return x * x
box = []
worker = threading.Thread(target=lambda: box.append(sum(range(1000))))
worker.start(); worker.join()
with multiprocessing.get_context("fork").Pool(2) as pool:
    squares = pool.map(square, range(5))
fig, ax = plt.subplots(); ax.plot([1, 2, 3]); fig.savefig("plot.png")
out = subprocess.run(["sh", "-c", "echo sub"], capture_output=True, text=True).stdout.strip()
print("WORK", box[0], squares, float(numpy.arange(4).sum()), len(pandas.DataFrame({"a": [1, 2]})), out)
'''
ORDINARY_RESULT = "WORK 499500 [0, 1, 4, 9, 16] 6.0 2 sub"


def _variant(tmp_path, name: str, **sandbox) -> dict:
    paths = {}
    for kind in ("kernel", "command"):
        profile = load_profile(kind)
        profile["sandbox"].update(sandbox)
        path = tmp_path / f"{name}-{kind}.json"
        path.write_text(json.dumps(profile))
        paths[kind] = str(path)
    return paths


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """Agents ``walled`` (shipped profiles), ``open`` (both walls off) and ``no-filter`` (seccomp off)."""
    tmp = tmp_path_factory.mktemp("walls")
    overrides = {
        "open": _variant(tmp, "open", nested_userns=True, seccomp=False),
        "no-filter": _variant(tmp, "no-filter", seccomp=False),
    }
    gw = GatewayProcess(tmp, f"--Gateway.agent_profiles={json.dumps(overrides)}").start()
    for agent in ("walled", "open", "no-filter"):
        assert gw.client.call("PUT", f"/v1/agents/{agent}")[0] in (200, 201)
        with open(os.path.join(gw.root, agent, "user-files", "probe.py"), "w") as f:
            f.write(PROBE)
        with open(os.path.join(gw.root, agent, "user-files", "userns.py"), "w") as f:
            f.write(USERNS)
    yield gw
    gw.stop()


def _marked(text: str, mark: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith(mark)]
    assert lines, f"no {mark} line in {text!r}"
    return lines[-1][len(mark) :]


def _in_command(gw, agent: str, script: str) -> str:
    path = os.path.join(gw.root, agent, "user-files", script)
    status, body = gw.client.call("POST", f"/v1/agents/{agent}/commands", {"argv": ["python3", path]})
    assert status == 200 and body["exit_code"] == 0, body
    return body["stdout"]


def _in_kernel(gw, agent: str, script: str) -> str:
    path = os.path.join(gw.root, agent, "user-files", script)
    status, body = gw.client.execute(agent, "walls", f"exec(open({path!r}).read())")
    assert status == 200 and body["status"] == "ok", body
    return body["text"]


RUNNERS = {"command": _in_command, "kernel": _in_kernel}


@pytest.mark.parametrize("where", RUNNERS)
def test_every_denied_syscall_class_gets_eperm_inside_the_sandbox(gateway, where):
    results = json.loads(_marked(RUNNERS[where](gateway, "walled", "probe.py"), "PROBE"))
    assert results == {name: "EPERM" for name in CLASSES}


@pytest.mark.parametrize("where", RUNNERS)
def test_with_the_filter_off_the_same_calls_are_not_blocked_by_us(gateway, where):
    results = json.loads(_marked(RUNNERS[where](gateway, "open", "probe.py"), "PROBE"))
    assert set(results) == set(CLASSES)
    blocked = {name for name, outcome in results.items() if outcome == "EPERM"}
    assert blocked <= CAPABILITY_GATED, f"refused with EPERM though the filter is off: {blocked - CAPABILITY_GATED}"
    assert results["keyctl"] == results["add_key"] == results["userfaultfd"] == results["unshare"] == 0


def test_the_filter_refuses_even_a_process_with_every_capability(tmp_path):
    """The capability-gated calls, tried by host root with and without the filter."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the point is a process holding every capability")
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    bwrap = shutil.which("bwrap")
    argv = [bwrap, "--dev-bind", "/", "/"]
    plain = subprocess.run([*argv, "--", sys.executable, str(script)], capture_output=True, text=True)
    unfiltered = json.loads(_marked(plain.stdout, "PROBE"))
    assert "EPERM" not in unfiltered.values(), unfiltered
    fd = seccomp.filter_fd()
    try:
        walled = subprocess.run(
            [*argv, "--seccomp", str(fd), "--", sys.executable, str(script)],
            capture_output=True, text=True, pass_fds=(fd,),
        )  # fmt: skip
    finally:
        os.close(fd)
    assert json.loads(_marked(walled.stdout, "PROBE")) == {name: "EPERM" for name in CLASSES}


@pytest.mark.parametrize("where", RUNNERS)
def test_no_nested_user_namespace_inside_the_sandbox(gateway, where):
    walled = RUNNERS[where](gateway, "walled", "userns.py")
    assert _marked(walled, "USERNS") == "EPERM"  # the filter refuses unshare itself
    assert _marked(walled, "UNSHARE_URM").split()[0] != "0"
    # Without the filter, --disable-userns alone refuses it (the namespace limit is 0).
    alone = RUNNERS[where](gateway, "no-filter", "userns.py")
    assert _marked(alone, "USERNS") == "ENOSPC"
    assert _marked(alone, "UNSHARE_URM").split()[0] != "0"


@pytest.mark.parametrize("where", RUNNERS)
def test_a_profile_can_allow_nested_user_namespaces(gateway, where):
    opened = RUNNERS[where](gateway, "open", "userns.py")
    assert _marked(opened, "USERNS") == "0"
    assert _marked(opened, "UNSHARE_URM").split() == ["0", "0"]  # root inside the nested namespace


def test_ordinary_work_runs_behind_the_walls(gateway):
    status, body = gateway.client.execute("walled", "work", ORDINARY_WORK, timeout=120)
    assert status == 200 and body["status"] == "ok", body
    assert ORDINARY_RESULT in body["text"]
    path = os.path.join(gateway.root, "walled", "user-files", "work.py")
    with open(path, "w") as f:
        f.write(ORDINARY_WORK)
    assert ORDINARY_RESULT in _in_command(gateway, "walled", "work.py")


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build an i386-ABI call")
def test_the_i386_abi_is_filtered_too(gateway):
    """`int $0x80` from a 64-bit process uses the i386 syscall table: keyctl there is 288."""
    source = os.path.join(gateway.root, "walled", "user-files", "int80.c")
    with open(source, "w") as f:
        f.write(
            "#include <stdio.h>\n"
            "int main(void) { long r; __asm__ volatile (\"int $0x80\" : \"=a\"(r)"
            " : \"a\"(288L), \"b\"(0L), \"c\"(-2L), \"d\"(1L) : \"memory\"); printf(\"%ld\\n\", r); return 0; }\n"
        )
    for agent in ("walled", "open"):
        binary = os.path.join(gateway.root, agent, "user-files", "int80")
        subprocess.run(["gcc", "-O0", "-o", binary, source], check=True)
        status, body = gateway.client.call("POST", f"/v1/agents/{agent}/commands", {"argv": [binary]})
        assert status == 200 and body["exit_code"] == 0, body
        result = int(body["stdout"])
        if agent == "walled":
            assert result == -1  # -EPERM
        else:
            assert result != -1
