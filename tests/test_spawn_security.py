"""The host-side spawn path, attacked for real: environment, descriptors, host uid, setuid.

Every process the gateway starts on the host (prlimit, setpriv, bwrap) gets a
fixed environment; what an agent asks for reaches only the process inside the
sandbox.  Sandboxes hold only fds 0, 1 and 2; a kernel's 1 and 2 are a pipe
the gateway drains.  Sandboxes run as their agent's own unprivileged host
uid, which owns the agent's tree, so a setuid copy of a binary is nobody's
privilege.  Each attempt is made through the real gateway, its real sockets,
real bwrap and real kernels, and its effect is checked from the host.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import sys
import stat
import textwrap
import threading

import pytest

from kernel_gateway import agent_uids, fs
from kernel_gateway.kernel_output import LINE_MAX, LOG_MAX, KernelOutput
from kernel_gateway.sandbox import launch, reach

from support import GatewayProcess, wait_until

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="per-agent uids need a root gateway")

# A shared object that, once loaded anywhere, says where it ran and tries to
# leave a marker in a host directory that no sandbox has.
PRELOAD_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
__attribute__((constructor)) static void pwn(void) {
    const char *dir = "MARKER_DIR";
    char path[512];
    snprintf(path, sizeof path, "%s/ran-as-%d-pid-%d", dir, (int)getuid(), (int)getpid());
    FILE *f = fopen(path, "w");
    if (f) { fputs("constructor ran here\n", f); fclose(f); }
    fprintf(stderr, "PRELOADED uid=%d\n", (int)getuid());
}
"""


@pytest.fixture(scope="module")
def marker_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("host-marker")
    os.chmod(path, 0o777)  # writable by anyone on the host, root or an agent uid
    return str(path)


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    gateway = GatewayProcess(tmp_path_factory.mktemp("spawn")).start()
    for agent in ("alice", "bob"):
        assert gateway.client.call("PUT", f"/v1/agents/{agent}")[0] in (200, 201)
    yield gateway
    gateway.stop()


def command(gw, request, agent="alice"):
    status, body = gw.client.call("POST", f"/v1/agents/{agent}/commands", request)
    assert status == 200, body
    return body


def execute(gw, code, agent="alice", session="s1"):
    status, body = gw.client.execute(agent, session, code)
    assert status == 200, body
    assert body["status"] == "ok", body
    return body["text"]


@pytest.fixture(scope="module")
def preload_so(gw, marker_dir):
    """Compiled by the agent, in its own tree, from a command."""
    source = PRELOAD_C.replace("MARKER_DIR", marker_dir)
    result = command(gw, {"argv": ["/bin/sh", "-c", "cat > pwn.c && gcc -shared -fPIC -o pwn.so pwn.c"], "stdin": source})
    assert result["exit_code"] == 0, result
    path = os.path.join(gw.root, "alice", "pwn.so")
    assert os.path.isfile(path)
    return path


# --- class 1: the environment of host-side processes --------------------------------


def test_ld_preload_in_a_command_env_runs_only_inside(gw, preload_so, marker_dir):
    for name in ("LD_PRELOAD", "LD_AUDIT"):
        result = command(gw, {"command": "true", "env": {name: preload_so}})
        # It did load, inside the sandbox, as the sandbox's uid (so the attempt was real) ...
        assert "PRELOADED uid=1000" in result["stderr"], result
        # ... and nowhere on the host: the marker directory exists only there.
        assert os.listdir(marker_dir) == [], name


def test_ld_preload_through_the_agent_socket_from_a_kernel(gw, preload_so, marker_dir):
    code = textwrap.dedent(f"""
        import json, socket
        body = json.dumps({{"command": "echo inside", "env": {{"LD_PRELOAD": {preload_so!r}}}}}).encode()
        s = socket.socket(socket.AF_UNIX)
        s.connect("/run/kernel-gateway.sock")
        s.sendall(b"POST /v1/agents/me/commands HTTP/1.1\\r\\nHost: kg\\r\\nConnection: close\\r\\n"
                  + b"Content-Length: " + str(len(body)).encode() + b"\\r\\n\\r\\n" + body)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
        result = json.loads(reply.split(b"\\r\\n\\r\\n", 1)[1])
        print(result["stdout"].strip(), "PRELOADED uid=1000" in result["stderr"])
    """)
    assert execute(gw, code) == "inside True\n"
    assert os.listdir(marker_dir) == []


def test_planted_host_tools_and_library_path_are_never_used(gw, preload_so, marker_dir):
    # Fake bwrap, prlimit and setpriv in the agent's tree, first on a requested PATH; and
    # LD_LIBRARY_PATH naming a directory whose libc.so.6 is the agent's library.
    script = f"#!/bin/sh\ntouch {marker_dir}/planted-$(basename $0)\nexec /usr/bin/$(basename $0) \"$@\"\n"
    for tool in ("bwrap", "prlimit", "setpriv", "sh"):
        assert command(gw, {"command": f"mkdir -p bin && cat > bin/{tool} && chmod +x bin/{tool}", "stdin": script})["exit_code"] == 0
    assert command(gw, {"command": "mkdir -p lib && cp pwn.so lib/libc.so.6"})["exit_code"] == 0
    agent_root = os.path.join(gw.root, "alice")
    env = {
        "PATH": f"{agent_root}/bin:/usr/bin:/bin",
        "LD_LIBRARY_PATH": f"{agent_root}/lib",
        "BASH_ENV": f"{agent_root}/pwn.so",
        "ENV": f"{agent_root}/pwn.so",
    }
    result = command(gw, {"argv": ["/usr/bin/env"], "env": env})
    assert result["exit_code"] != 0 or "PATH=" in result["stdout"]  # the agent may break its own command
    assert os.listdir(marker_dir) == []


def test_bad_env_names_are_refused_and_nothing_runs(gw, marker_dir):
    for name in ("A B", "1ABC", "-x", "X\n", "X=Y", "", "LD-PRELOAD", "é"):
        status, body = gw.client.call(
            "POST", "/v1/agents/alice/commands", {"command": f"touch {marker_dir}/ran", "env": {name: "v"}}
        )
        assert status == 400 and body["error"]["code"] == "bad_request", (name, body)
    assert os.listdir(marker_dir) == []


def test_env_argv_and_host_env_are_fixed():
    assert launch.env_argv({"HOME": "/w", "X": "a b"}) == ["--clearenv", "--setenv", "HOME", "/w", "--setenv", "X", "a b"]
    for bad in ("A B", "1A", "-A", "A=B", "", "A\n"):
        with pytest.raises(ValueError):
            launch.env_argv({bad: "v"})
    assert launch.HOST_ENV == {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}


def test_trampoline_argv_is_exact():
    import resource

    limits, run_as = [(resource.RLIMIT_CORE, 0), (resource.RLIMIT_AS, 4096)], launch.RunAs(200001, 200001)
    assert launch.trampoline(limits, run_as, "/h", ["/cg/pids/x/cgroup.procs"]) == [
        "/h", "--cgroup=/cg/pids/x/cgroup.procs", f"--rlimit={resource.RLIMIT_CORE}:0",
        f"--rlimit={resource.RLIMIT_AS}:4096", "--uid=200001", "--gid=200001", f"--parent={os.getpid()}", "--",
    ]  # fmt: skip
    twin = [sys.executable, "-I", "-S", "-B", launch.HELPER_PY]
    assert launch.trampoline(limits, run_as) == twin + [
        f"--rlimit={resource.RLIMIT_CORE}:0", f"--rlimit={resource.RLIMIT_AS}:4096", "--uid=200001", "--gid=200001",
        f"--parent={os.getpid()}", "--",
    ]  # fmt: skip
    assert launch.trampoline([(resource.RLIMIT_CORE, 0)], None) == twin + [
        f"--rlimit={resource.RLIMIT_CORE}:0", f"--parent={os.getpid()}", "--",
    ]


@pytest.mark.parametrize("helper", [True, False], ids=["spawn-helper", "python-twin"])
def test_both_trampolines_set_limits_and_uid_before_bwrap(tmp_path, helper):
    if helper and launch.find_helper() is None:
        pytest.skip("the spawn helper is not built (scripts/install.sh builds it)")
    import subprocess
    import sys

    from kernel_gateway.provisioner import python_env_paths
    from kernel_gateway.sandbox.profile import load_profile

    tree = tmp_path / "agent"
    tree.mkdir()
    fs.own_tree(str(tree), 232000, 232000)
    prefix, base = python_env_paths(sys.executable)
    values = {"agent": "t", "agent_root": str(tree), "workspace": str(tree), "python_prefix": prefix,
              "python_base_prefix": base, "python_bin": os.path.join(prefix, "bin")}  # fmt: skip
    prepared = launch.prepare(
        load_profile("command"), values, ["/bin/sh", "-c", "grep -E 'core|file size|address' /proc/self/limits; touch t"],
        run_as=launch.RunAs(232000, 232000, 500), spawn_helper=helper,
    )  # fmt: skip
    assert (prepared.argv[0] == launch.HELPER) == helper
    assert helper or prepared.argv[:5] == [sys.executable, "-I", "-S", "-B", launch.HELPER_PY]
    try:
        proc = subprocess.Popen(prepared.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **prepared.spawn_kwargs())
        prepared.spawned()
        out, err = proc.communicate(timeout=60)
    finally:
        prepared.cleanup()
    assert proc.returncode == 0, err
    rows = {line[:25].strip(): line[25:].split()[:2] for line in out.decode().splitlines()}
    assert rows == {
        "Max file size": [str(1 << 30)] * 2, "Max core file size": ["0", "0"], "Max address space": [str(4 << 30)] * 2,
    }  # fmt: skip
    assert os.stat(tree / "t").st_uid == 232000


@pytest.mark.parametrize("helper", [True, False], ids=["spawn-helper", "python-twin"])
def test_the_spawn_helper_refuses_bad_input_before_running_anything(tmp_path, helper):
    import subprocess

    if helper and launch.find_helper() is None:
        pytest.skip("the spawn helper is not built (scripts/install.sh builds it)")
    prefix = launch.helper_argv(launch.find_helper() if helper else None)
    marker = tmp_path / "ran"
    for args in (["--uid=5", "--"], ["--rlimit=x:1", "--"], ["--rlimit=4", "--"], ["--bogus", "--"], ["--"],
                 ["--uid=5", "--gid=5"], ["--uid=-1", "--gid=5", "--"]):  # fmt: skip
        argv = [*prefix, *args] + (["/bin/touch", str(marker)] if args[-1] == "--" else [])
        if args == ["--"]:
            argv = [*prefix, "--", "touch", str(marker)]  # not an absolute path
        result = subprocess.run(argv, capture_output=True, text=True)
        assert result.returncode == 127 and result.stderr.startswith("kg-spawn-helper: "), (args, result)
    assert not marker.exists()


# --- class 3: descriptors -----------------------------------------------------------


def test_a_command_holds_only_0_1_2(gw):
    # The shell's own fds, listed by a child (ls would list its own directory fd).
    result = command(gw, {"argv": ["/bin/sh", "-c", "ls /proc/$$/fd"]})
    assert sorted(result["stdout"].split()) == ["0", "1", "2"], result


def test_a_kernel_holds_no_host_file_and_its_output_is_a_pipe(gw):
    code = textwrap.dedent("""
        import os
        def fds(pid):
            out = {}
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    out[int(fd)] = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    pass
            return out
        mine, init = fds("self"), fds(1)
        print(mine[0], mine[1].split(":")[0], mine[2].split(":")[0])
        print(sorted(fd for fd, target in init.items() if target != "anon_inode:[eventfd]"))
        print(sorted({t for t in mine.values() if t.startswith("/")}))
    """)
    first, init, paths = execute(gw, code).splitlines()
    assert first == "/dev/null pipe pipe"
    # bwrap's init in the sandbox: its own eventfd, and no memfd, info or block fd of ours.
    assert init == "[0, 1, 2]"
    # The kernel's own (ipykernel, zmq) files are inside the sandbox; nothing of the state dir.
    assert gw.state not in paths and "kernel-alice.log" not in paths, paths


def test_kernel_output_reaches_the_log_through_the_pipe(gw):
    execute(gw, "import os; os.write(2, b'straight-to-fd-2\\n'); os.write(1, b'straight-to-fd-1\\n')")
    log = os.path.join(gw.state, "logs", "kernel-alice.log")
    assert wait_until(lambda: b"straight-to-fd-2" in open(log, "rb").read(), timeout=10)
    assert b"straight-to-fd-1" in open(log, "rb").read()
    assert stat.S_IMODE(os.stat(os.path.dirname(log)).st_mode) == 0o700


def test_kernel_output_is_bounded_in_memory_and_in_the_log(tmp_path):
    async def main():
        out = KernelOutput(str(tmp_path / "k.log"))
        writer = os.dup(out.write_fd)
        out.start()
        # One endless line, then many lines: far more than either bound.
        os.set_blocking(writer, False)
        sent = 0
        payload = b"x" * 100_000 + b"\n" + b"line\n" * 400_000
        view = memoryview(payload)
        while view:
            try:
                n = os.write(writer, view[:65536])
            except BlockingIOError:
                await asyncio.sleep(0.001)
                continue
            view, sent = view[n:], sent + n
            await asyncio.sleep(0)
        os.close(writer)
        for _ in range(1000):
            if out.read_fd < 0:
                break
            await asyncio.sleep(0.01)
        return out, sent

    out, sent = asyncio.run(main())
    data = (tmp_path / "k.log").read_bytes()
    assert sent > 2 * LOG_MAX
    assert len(data) <= LOG_MAX + 100
    assert data.startswith(b"x" * LINE_MAX + b" [... line cut]\n")
    assert data.endswith(b"not logged]\n")
    assert out.read_fd == -1 and len(out.tail) <= 16 << 10 and out.text().endswith("line\n")


# --- class 4: the host uid ----------------------------------------------------------


def _uid_of(gw, agent):
    with open(os.path.join(gw.state, agent_uids.FILE_NAME)) as f:
        return json.load(f)["agents"][agent]


def test_each_agent_has_its_own_uid_and_owns_its_tree(gw):
    alice, bob = _uid_of(gw, "alice"), _uid_of(gw, "bob")
    assert alice != bob and min(alice, bob) >= 200000
    for agent, uid in (("alice", alice), ("bob", bob)):
        st = os.stat(os.path.join(gw.root, agent))
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (uid, uid, 0o700)
        for name in ("user-files", "sessions", "jobs"):
            assert os.stat(os.path.join(gw.root, agent, name)).st_uid == uid, name
        # The Library's documents and skills stay the operator's (read-only in every sandbox).
        for name in ("SOUL.md", "installed-skills"):
            assert os.stat(os.path.join(gw.root, agent, name)).st_uid == 0, name
        assert os.stat(os.path.join(gw.state, "agents", f"{agent}.sock")).st_uid == uid


def test_files_from_a_kernel_and_a_command_belong_to_the_agent(gw):
    uid = _uid_of(gw, "alice")
    execute(gw, "open('from-kernel.txt', 'w').write('k'); import os; os.makedirs('made/by/kernel')")
    assert command(gw, {"command": "echo c > from-command.txt"})["exit_code"] == 0
    root = os.path.join(gw.root, "alice")
    session_dir = os.path.join(root, "sessions", "czE")
    for path in (os.path.join(session_dir, "from-kernel.txt"), os.path.join(session_dir, "made"),
                 os.path.join(root, "from-command.txt"), session_dir):  # fmt: skip
        st = os.stat(path)
        assert (st.st_uid, st.st_gid) == (uid, uid), path
    # From the host: the kernel process itself runs as the agent's uid, not as root.
    pid = int(execute(gw, "import os; print(os.getpid())"))  # pid inside; look from outside instead
    assert pid > 0
    status, listing = gw.client.call("GET", "/v1/agents/alice/sessions/s1")
    bwrap_pid = listing["pid"]
    with open(f"/proc/{bwrap_pid}/status") as f:
        uids = [line.split()[1:] for line in f if line.startswith("Uid:")][0]
    assert uids == [str(uid)] * 4


def test_a_setuid_copy_gives_no_privilege(gw):
    result = command(gw, {"command": "cp /usr/bin/id ./myid && chmod 4755 ./myid && ./myid -u && grep ' /proc ' /proc/self/mounts | head -1; awk '$2 ~ /alice$/ {print $4}' /proc/self/mounts"})
    assert result["exit_code"] == 0, result
    lines = result["stdout"].splitlines()
    assert lines[0] == "1000"  # the setuid bit gave nothing: still the sandbox's own uid
    assert "nosuid" in lines[-1].split(",") and "nodev" in lines[-1].split(","), lines
    st = os.stat(os.path.join(gw.root, "alice", "myid"))
    assert st.st_mode & stat.S_ISUID  # the bit is there ...
    assert st.st_uid == _uid_of(gw, "alice") != 0  # ... on a file of the agent's uid: no setuid-root program


def test_agent_uid_survives_a_restart(tmp_path):
    first = GatewayProcess(tmp_path).start()
    try:
        assert first.client.call("PUT", "/v1/agents/carol")[0] == 201
        uid = _uid_of(first, "carol")
    finally:
        first.stop()
    second = GatewayProcess(tmp_path).start()
    try:
        assert second.client.call("PUT", "/v1/agents/dave")[0] == 201
        assert _uid_of(second, "carol") == uid != _uid_of(second, "dave")
        result = second.client.call("POST", "/v1/agents/carol/commands", {"command": "touch after-restart"})
        assert result[0] == 200 and result[1]["exit_code"] == 0
        assert os.stat(os.path.join(second.root, "carol", "after-restart")).st_uid == uid
    finally:
        second.stop()


def test_uid_allocation_is_stable_and_bounded(tmp_path):
    uids = agent_uids.AgentUids(str(tmp_path), 300000, 2, enabled=True)
    a, b = uids.run_as("a"), uids.run_as("b")
    assert (a.uid, b.uid) == (300000, 300001) and uids.run_as("a") == a
    with pytest.raises(agent_uids.UidRangeExhausted):
        uids.run_as("c")
    again = agent_uids.AgentUids(str(tmp_path), 300000, 2, enabled=True)
    assert again.run_as("b") == b
    assert stat.S_IMODE(os.stat(again.path).st_mode) == 0o600


def test_own_tree_keeps_what_it_is_told_to_keep(tmp_path):
    tree = tmp_path / "tree"
    (tree / "installed-skills" / "s").mkdir(parents=True)
    (tree / "SOUL.md").write_text("soul")
    (tree / "user-files").mkdir()
    fs.own_tree(str(tree), 300124, 300124, keep=("installed-skills", "SOUL.md"))
    assert os.stat(tree / "user-files").st_uid == 300124
    for path in (tree / "installed-skills", tree / "installed-skills" / "s", tree / "SOUL.md"):
        assert os.stat(path).st_uid == 0, path


def test_own_tree_never_follows_symlinks_or_hard_links(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("host file")
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "file").write_text("x")
    os.symlink(outside, tree / "link")
    os.link(outside, tree / "hard")
    fs.own_tree(str(tree), 300123, 300123)
    assert os.stat(outside).st_uid == 0  # neither through the symlink nor through the hard link
    assert os.lstat(tree / "link").st_uid == 300123
    for path in (tree, tree / "sub", tree / "sub" / "file"):
        assert os.stat(path).st_uid == 300123
    assert stat.S_IMODE(os.stat(tree).st_mode) == 0o700


def test_can_search_reads_the_right_permission_bits(tmp_path):
    private = tmp_path / "private"
    (private / "inner").mkdir(parents=True)
    os.chmod(private, 0o700)
    target = str(private / "inner")
    assert reach.can_search("/usr/bin/env", 200000, 200000)
    assert not reach.can_search(target, 200000, 200000)
    os.chown(private, 200000, 0)
    assert reach.can_search(target, 200000, 200000) == reach.can_search(str(tmp_path), 200000, 200000)


# --- the provisioner path (plain jupyter_client) -----------------------------------


def test_provisioner_kernel_runs_as_the_configured_uid_with_a_clean_host_env(sandboxed_kernel, tmp_path, marker_dir, monkeypatch):
    uid = 231000
    tree = tmp_path / "agent"
    tree.mkdir()
    fs.own_tree(str(tree), uid, uid)
    # An os.environ-derived env that tries to reach the host-side processes.
    monkeypatch.setenv("LD_PRELOAD", "/nonexistent/host-side.so")
    monkeypatch.setenv("KERNEL_GATEWAY_BAD NAME", "x")
    with sandboxed_kernel(tree, {"agent_root": str(tree), "uid": uid}) as kernel:
        assert kernel.value("__import__('os').getuid()") == 1000
        kernel.run("open('from-provisioned-kernel', 'w').write('x')")
        env = kernel.value("dict(__import__('os').environ)")
        pid = kernel.km.provisioner.pid
        with open(f"/proc/{pid}/environ", "rb") as f:  # bwrap's own environment, on the host
            host_env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if item)
        with open(f"/proc/{pid}/status") as f:
            host_uid = [line.split()[1] for line in f if line.startswith("Uid:")][0]
    assert host_env == {k.encode(): v.encode() for k, v in launch.HOST_ENV.items()}
    assert host_uid == str(uid)
    assert "LD_PRELOAD" not in env and not any(" " in name for name in env)
    assert os.stat(tree / "from-provisioned-kernel").st_uid == uid
    assert os.stat(tree).st_uid == uid and stat.S_IMODE(os.stat(tree).st_mode) == 0o700


def test_rlimit_nproc_caps_an_agent_uid_across_its_sandboxes(tmp_path):
    # A uid range of its own: the module's gateway holds uids from 200000 at the same time.
    gw = GatewayProcess(
        tmp_path, "--Gateway.agent_max_processes=40", "--Gateway.spare_kernels=False", "--Gateway.agent_uid_start=240000"
    ).start()
    try:
        for agent in ("erin", "frank"):
            assert gw.client.call("PUT", f"/v1/agents/{agent}")[0] == 201
        uid = _uid_of(gw, "erin")

        def tasks_of(uid):
            count = 0
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    for task in os.listdir(f"/proc/{pid}/task"):
                        with open(f"/proc/{pid}/task/{task}/status") as f:
                            if any(line.startswith("Uid:") and line.split()[1] == str(uid) for line in f):
                                count += 1
                except OSError:
                    pass
            return count

        seen, done = [0], threading.Event()

        def watch():
            while not done.is_set():
                seen[0] = max(seen[0], tasks_of(uid))

        watcher = threading.Thread(target=watch)
        watcher.start()
        # 100 sleeping children, far past the cap; the sandbox then lives 4 s more.
        bomb = (
            "import os, time\nforked, error = 0, None\nfor i in range(100):\n    try:\n"
            "        if os.fork() == 0:\n            time.sleep(30)\n            os._exit(0)\n"
            "        forked += 1\n    except OSError as e:\n        error = e.errno\n"
            "print(forked, error, flush=True)\ntime.sleep(4)\n"
        )
        answers = []
        bombing = threading.Thread(target=lambda: answers.append(gw.client.call(
            "POST", "/v1/agents/erin/commands", {"argv": ["python3", "-c", bomb], "timeout": 20})))
        bombing.start()
        try:
            assert wait_until(lambda: seen[0] > 20, timeout=15)
            # Meanwhile another agent, with a uid of its own, forks freely.
            other = gw.client.call(
                "POST", "/v1/agents/frank/commands", {"command": "for i in $(seq 30); do sleep 0.5 & done; wait; echo ok"}
            )
        finally:
            bombing.join()
            done.set()
            watcher.join()
        status, body = answers[0]
        assert status == 200, body
        forked, error = body["stdout"].split()
        assert 20 < int(forked) < 40 and int(error) == errno.EAGAIN, body  # forks past the cap failed
        assert 20 < seen[0] <= 40, (seen, body)  # seen from the host: the uid never held more
        assert other[0] == 200 and other[1]["stdout"] == "ok\n" and other[1]["stderr"] == "", other
    finally:
        gw.stop()


def test_reach_aliases_only_symlink_free_paths_and_binds_what_it_opened(tmp_path):
    private = tmp_path / "private"
    (private / "data").mkdir(parents=True)
    (private / "data" / "f.txt").write_text("readable")
    os.chmod(private, 0o700)
    os.symlink("data", private / "link")
    uid = 234000
    alias = reach.reachable(str(private / "data"), uid, uid)
    assert alias != str(private / "data") and alias.startswith(reach.ALIAS_DIR + "/")
    assert reach.can_search(alias, uid, uid)
    assert open(os.path.join(alias, "f.txt")).read() == "readable"  # the same directory, bound
    # A symlink on the way: left for bwrap to resolve as the sandbox's uid (and fail).
    assert reach.reachable(str(private / "link"), uid, uid) == str(private / "link")
    # Reachable and missing paths are left alone.
    assert reach.reachable("/usr/bin", uid, uid) == "/usr/bin"
    # A missing source below a directory the uid cannot search: a missing path it can look at,
    # so that bwrap skips a --bind-try source (ENOENT) instead of failing on EACCES.
    missing = reach.reachable(str(private / "missing"), uid, uid)
    assert missing.startswith(reach.ALIAS_DIR + "/") and not os.path.exists(missing)
    assert not os.path.exists(reach.reachable("/nonexistent/x", uid, uid))
    # Asked again (another uid too): the same alias, not a second mount.
    assert reach.reachable(str(private / "data"), uid + 1, uid + 1) == alias
    with open("/proc/self/mountinfo") as f:
        assert sum(line.split()[4] == alias for line in f) == 1


def test_sources_below_one_unsearchable_directory_share_one_alias(tmp_path):
    """The host's mounts do not grow with the agents: every bwrap start reads them all."""
    private = tmp_path / "private"
    for agent in ("a", "b", "c"):
        (private / "agents" / agent).mkdir(parents=True)
        os.chown(private / "agents" / agent, 234100, 234100)
        os.chmod(private / "agents" / agent, 0o700)
        (private / "agents" / agent / "SOUL.md").write_text(agent)
        os.chown(private / "agents" / agent / "SOUL.md", 234100, 234100)
    os.chmod(private, 0o700)
    os.chmod(private / "agents", 0o711)
    with open("/proc/self/mountinfo") as f:
        before = len(f.readlines())
    seen = [reach.reachable(str(private / "agents" / agent / name), 234100, 234100)
            for agent in ("a", "b", "c") for name in ("", "SOUL.md")]
    with open("/proc/self/mountinfo") as f:
        assert len(f.readlines()) == before + 1, seen
    point = seen[0].rstrip("/").rsplit("/", 1)[0]
    assert all(path.startswith(point + "/") for path in seen)
    assert open(seen[1]).read() == "a" and open(seen[5]).read() == "c"
    # Below the alias point each directory's own mode still rules: another uid is stopped at the tree.
    assert not reach._may_search(seen[0].rstrip("/"), 234101, 234101)
    assert reach.can_search(seen[1], 234100, 234100)


def test_aliases_of_a_gateway_that_is_gone_are_swept(tmp_path):
    private = tmp_path / "private"
    (private / "data").mkdir(parents=True)
    os.chmod(private, 0o700)
    # A dead process's alias directory, with one alias still mounted in it.
    dead = os.path.join(reach.ALIAS_DIR, "999999999-1")
    os.makedirs(dead, exist_ok=True)
    point = os.path.join(dead, "x")
    os.mkdir(point)
    assert reach._libc.mount(str(private / "data").encode(), point.encode(), None, reach._MS_BIND, None) == 0
    reach._sweep(keep=reach._process_tag(os.getpid()))
    assert not os.path.exists(dead)
    with open("/proc/self/mountinfo") as f:
        assert dead not in f.read()
    assert (private / "data").is_dir()  # the source itself is untouched


def test_the_shared_alias_of_the_agents_sockets_lets_each_uid_reach_only_its_own(tmp_path):
    gw = GatewayProcess(tmp_path).start()
    try:
        for agent in ("alice", "bob"):
            assert gw.client.call("PUT", f"/v1/agents/{agent}")[0] == 201
            assert gw.client.call("POST", f"/v1/agents/{agent}/commands", {"argv": ["true"]})[0] == 200
        sockets = os.path.join(gw.state, "agents")
        assert stat.S_IMODE(os.stat(sockets).st_mode) == 0o711
        uid = {a: os.stat(os.path.join(gw.root, a)).st_uid for a in ("alice", "bob")}
        alias = reach.reachable(os.path.join(sockets, "alice.sock"), uid["alice"], uid["alice"])
        where = os.path.dirname(alias)
        assert where != sockets and where.startswith(reach.ALIAS_DIR + "/")
        probe = ("import socket, sys, os\n"
                 "for name in sys.argv[1:]:\n"
                 "    s = socket.socket(socket.AF_UNIX)\n"
                 "    try:\n"
                 "        s.connect(name); print('connected', os.path.basename(name))\n"
                 "    except OSError as e:\n"
                 "        print('refused', os.path.basename(name), e.errno)\n"
                 "try:\n"
                 "    os.listdir(os.path.dirname(sys.argv[1])); print('listed')\n"
                 "except OSError as e:\n"
                 "    print('no listing', e.errno)\n")
        import subprocess
        import sys

        done = subprocess.run(
            ["setpriv", f"--reuid={uid['alice']}", f"--regid={uid['alice']}", "--clear-groups", sys.executable, "-I",
             "-c", probe, os.path.join(where, "alice.sock"), os.path.join(where, "bob.sock")],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert done.stdout.splitlines() == ["connected alice.sock", f"refused bob.sock {errno.EACCES}",
                                            f"no listing {errno.EACCES}"], done
    finally:
        gw.stop()
