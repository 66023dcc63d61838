"""``kernel-gateway lab AGENT``: a real JupyterLab for one agent, against a real gateway.

What is shown here without a browser (``test_lab_browser.py`` drives one):
every reason not to start is a clear message and an exit status, with
nothing started or changed; Lab's notebook sessions use the agent's own
kernel for that notebook, whichever side opened it first; Lab runs as the
agent's uid with no network and sees only the agent's tree, even through
symlinks the agent planted; Ctrl-C stops it and leaves the agent's kernels.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.parse
import uuid

import pytest

from lab_support import LabProcess, lab_runtime_dirs, lab_server_pids, run_lab_command
from support import BIN, wait_until

GATEWAY_ARGS = ("--jupyter-port", "0", "--Gateway.spare_kernels=False")
JLK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "skills", "jupyter-live-kernel",
                   "scripts", "jlk")


def jlk(gw, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "JLK_SESSION"}
    done = subprocess.run([sys.executable, JLK, "--socket", gw.socket, "--agent", "alice", *args],
                          capture_output=True, text=True, timeout=180, env=env)
    if check:
        assert done.returncode == 0, done.stdout + done.stderr
    return done


def sessions(gw, agent: str = "alice") -> dict:
    return {s["id"]: s for s in gw.client.call("GET", f"/v1/agents/{agent}/sessions")[1]["sessions"]}


def root_of(gw, agent: str) -> str:
    return gw.client.call("GET", f"/v1/agents/{agent}")[1]["root"]


@pytest.fixture(scope="module")
def lab(gw, tmp_path_factory):
    process = LabProcess(gw, "alice", str(tmp_path_factory.mktemp("lab") / "lab.log")).start()
    yield process
    process.stop()


# --- reasons not to start ----------------------------------------------------------------------


def _snapshot(gw):
    return {
        "runtime_dirs": lab_runtime_dirs(),
        "lab_servers": set(lab_server_pids()),
        "agents": sorted(a["agent"] for a in gw.client.call("GET", "/v1/agents")[1]["agents"]),
        "tokens": gw.client.call("GET", "/v1/agents/alice/tokens")[1]["tokens"],
    }


def test_a_gateway_that_is_not_running_is_named_and_nothing_starts(gw, tmp_path):
    before = _snapshot(gw)
    done = run_lab_command("alice", "--socket", str(tmp_path / "nowhere" / "control.sock"))
    assert done.returncode == 1, done.stderr
    assert f"kernel-gateway lab: no gateway answers on {tmp_path / 'nowhere' / 'control.sock'}" in done.stderr
    assert "start one with `kernel-gateway serve`" in done.stderr
    assert done.stdout == "" and _snapshot(gw) == before


def test_an_unknown_agent_is_refused_and_not_created(gw):
    before = _snapshot(gw)
    done = run_lab_command("carol", "--socket", gw.socket)
    assert done.returncode == 1, done.stderr
    assert f"kernel-gateway lab: the gateway on {gw.socket} has no agent 'carol'" in done.stderr
    assert "PUT http://kg/v1/agents/carol" in done.stderr  # how to create it
    assert gw.client.call("GET", "/v1/agents/carol")[0] == 404
    assert done.stdout == "" and _snapshot(gw) == before


@pytest.mark.parametrize("agent", ["../alice", "alice/../bob", ".hidden", "", "a b"])
def test_a_malformed_agent_name_is_a_usage_error(gw, agent):
    before = _snapshot(gw)
    done = run_lab_command(agent, "--socket", gw.socket)
    assert done.returncode == 2, done.stderr
    assert f"kernel-gateway lab: invalid agent key {agent!r}" in done.stderr
    assert _snapshot(gw) == before


def test_a_port_in_use_is_named(gw):
    before = _snapshot(gw)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        done = run_lab_command("alice", "--socket", gw.socket, "--port", str(port))
    finally:
        taken.close()
    assert done.returncode == 1, done.stderr
    assert f"kernel-gateway lab: port {port} on 127.0.0.1 is in use" in done.stderr
    assert "choose another --port (0: any free one)" in done.stderr
    assert _snapshot(gw) == before


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_a_port_out_of_range_is_a_usage_error(gw, port):
    before = _snapshot(gw)
    done = run_lab_command("alice", "--socket", gw.socket, f"--port={port}")
    assert done.returncode == 2, done.stderr
    assert f"kernel-gateway lab: --port {port} is not a TCP port" in done.stderr
    assert _snapshot(gw) == before


@pytest.mark.parametrize("refusal", ["no gateway", "unknown agent", "bad agent", "busy port"])
def test_a_refusal_comes_before_jupyterlab_is_imported(gw, tmp_path, refusal):
    """Importing JupyterLab takes seconds: a bad agent, a busy port or no gateway is refused without it."""
    fake = tmp_path / "fake-lab"
    marker = tmp_path / "imported"
    for module in ("jupyterlab", "jupyter_collaboration", "jupyter_server_ydoc"):
        (fake / module).mkdir(parents=True)
        (fake / module / "__init__.py").write_text(f"open({str(marker)!r}, 'a').write({module!r} + '\\n')\n")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    args = {
        "no gateway": ("alice", "--socket", str(tmp_path / "nowhere.sock")),
        "unknown agent": ("carol", "--socket", gw.socket),
        "bad agent": ("../alice", "--socket", gw.socket),
        "busy port": ("alice", "--socket", gw.socket, "--port", str(taken.getsockname()[1])),
    }[refusal]
    try:
        done = run_lab_command(*args, env=dict(os.environ, PYTHONPATH=str(fake)))
    finally:
        taken.close()
    assert done.returncode in (1, 2) and done.stderr.startswith("kernel-gateway lab: "), done.stderr
    assert not marker.exists(), f"JupyterLab was imported before the refusal: {marker.read_text()}"


def test_a_missing_lab_extra_says_what_to_install(gw):
    before = _snapshot(gw)
    # The lab extra's packages made unimportable in this one process (None in sys.modules: ImportError).
    code = ("import sys; sys.modules['jupyterlab'] = sys.modules['jupyter_collaboration'] = None; "
            "from kernel_gateway.cli import main; sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", code, "lab", "alice", "--socket", gw.socket],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    missing = "missing: jupyterlab, jupyter_collaboration"
    assert f"kernel-gateway lab: JupyterLab is not installed here ({missing})" in done.stderr
    assert "pip install 'live-kernel-gateway[lab]'" in done.stderr
    assert _snapshot(gw) == before


def test_a_bad_profile_is_a_usage_error(gw, tmp_path):
    bad = tmp_path / "lab.json"
    bad.write_text(json.dumps({"sandbox": {"network": "yes"}}))
    before = _snapshot(gw)
    done = run_lab_command("alice", "--socket", gw.socket, "--profile", str(bad))
    assert done.returncode == 2, done.stderr
    assert "kernel-gateway lab: bad sandbox profile: sandbox.network: wrong type str" in done.stderr
    assert _snapshot(gw) == before


def test_lab_is_listed_in_the_usage():
    done = subprocess.run([os.path.join(BIN, "kernel-gateway"), "--help"], capture_output=True, text=True)
    assert "lab AGENT" in done.stdout


# --- pairing ---------------------------------------------------------------------------------


def test_a_notebook_the_agent_ran_opens_on_the_agents_kernel(gw, lab):
    jlk(gw, "new", "--path", "user-files/agent-first.ipynb")
    jlk(gw, "edit", "--path", "user-files/agent-first.ipynb", "insert", "--source", "from_agent = 6 * 7")
    jlk(gw, "execute", "--path", "user-files/agent-first.ipynb", "--index", "0")
    own = sessions(gw)["notebook:user-files/agent-first.ipynb"]
    # As JupyterLab starts a document's session: a placeholder path beside it, named after the file.
    status, model = lab.call("POST", "/api/sessions", {
        "path": f"user-files/{uuid.uuid4()}", "name": "agent-first.ipynb", "type": "notebook",
        "kernel": {"name": "python3"}})
    assert status == 201, model
    assert model["kernel"]["id"] == own["kernel_id"]
    status, moved = lab.call("PATCH", f"/api/sessions/{model['id']}", {"path": "user-files/agent-first.ipynb"})
    assert status == 200 and moved["kernel"]["id"] == own["kernel_id"]
    # Lab lists that kernel as its own; the gateway still has exactly the one session for the notebook.
    status, kernels = lab.call("GET", "/api/kernels")
    assert own["kernel_id"] in [k["id"] for k in kernels]
    assert sessions(gw)["notebook:user-files/agent-first.ipynb"]["kernel_id"] == own["kernel_id"]


def test_a_notebook_first_opened_in_lab_is_the_one_jlk_then_runs_in(gw, lab):
    notebook = {"cells": [{"cell_type": "code", "source": "print(who)", "metadata": {}, "outputs": [],
                           "execution_count": None}], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    status, _ = lab.call("PUT", "/api/contents/user-files/lab-first.ipynb",
                         {"type": "notebook", "format": "json", "content": notebook})
    assert status == 201
    status, model = lab.call("POST", "/api/sessions", {
        "path": "user-files/lab-first.ipynb", "name": "lab-first.ipynb", "type": "notebook",
        "kernel": {"name": "python3"}})
    assert status == 201, model
    kernel_id = model["kernel"]["id"]
    assert sessions(gw)["notebook:user-files/lab-first.ipynb"]["kernel_id"] == kernel_id
    # A variable set on that kernel by someone in Lab (here the agent's own execute, same kernel) ...
    status, _ = gw.client.execute("alice", "notebook:user-files/lab-first.ipynb", "who = 'set in lab'")
    assert status == 200
    done = jlk(gw, "execute", "--path", "user-files/lab-first.ipynb", "--index", "0")
    assert done.stdout.strip() == "set in lab"
    assert sessions(gw)["notebook:user-files/lab-first.ipynb"]["kernel_id"] == kernel_id


def test_other_session_types_get_kernels_of_their_own(gw, lab):
    status, model = lab.call("POST", "/api/sessions", {"path": "console-1", "name": "Console 1", "type": "console",
                                                      "kernel": {"name": "python3"}})
    assert status == 201, model
    owner = [s for s in sessions(gw).values() if s["kernel_id"] == model["kernel"]["id"]]
    assert len(owner) == 1 and owner[0]["id"].startswith("jupyter-")
    assert lab.call("DELETE", f"/api/sessions/{model['id']}")[0] == 204
    assert wait_until(lambda: owner[0]["id"] not in sessions(gw), timeout=60)


# --- the sandbox -----------------------------------------------------------------------------


def _status_ids(pid: int, field: str) -> list[int]:
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return [int(x) for x in line.split()[1:]]


def test_lab_runs_as_the_agents_uid_in_namespaces_of_its_own(gw, lab):
    pids = lab.server_pids()
    assert len(pids) == 1, pids
    pid = pids[0]
    owner = os.stat(root_of(gw, "alice")).st_uid
    assert _status_ids(pid, "Uid") == [owner] * 4 and _status_ids(pid, "Gid") == [owner] * 4
    if os.geteuid() == 0:
        assert owner != 0  # a root gateway gives each agent an uid of its own
    with open(f"/proc/{pid}/status") as f:
        caps = {line.split(":")[0]: line.split()[1] for line in f if line.startswith("Cap")}
    assert int(caps["CapEff"], 16) == 0 and int(caps["CapPrm"], 16) == 0
    for ns in ("net", "pid", "user", "ipc", "uts", "mnt"):
        assert os.readlink(f"/proc/{pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}"), ns
    with open(f"/proc/{pid}/status") as f:
        assert any(line.split() == ["Seccomp:", "2"] for line in f)  # a filter is loaded
    # No network: the only interface of its namespace is loopback.
    with open(f"/proc/{pid}/net/dev") as f:
        interfaces = {line.split(":")[0].strip() for line in f.readlines()[2:]}
    assert interfaces == {"lo"}


def _mounts(pid: int) -> dict[str, set[str]]:
    """mount point -> its options, as the sandbox sees them."""
    out = {}
    with open(f"/proc/{pid}/mountinfo") as f:
        for line in f:
            fields = line.split()
            out[fields[4].replace("\\040", " ")] = set(fields[5].split(","))
    return out


def test_lab_sees_the_agents_tree_read_write_and_the_python_environment_read_only(gw, lab):
    pid = lab.server_pids()[0]
    mounts = _mounts(pid)
    alice = root_of(gw, "alice")
    assert "rw" in mounts[alice] and {"nosuid", "nodev"} <= mounts[alice]
    assert "ro" in mounts[sys.prefix]
    assert "ro" in mounts["/"] and "ro" in mounts["/usr"]
    for name in ("SOUL.md", "MISSION.md", "DESIGN.md", "installed-skills"):
        assert "ro" in mounts[os.path.join(alice, name)], name
    seen = f"/proc/{pid}/root"
    assert os.path.isdir(seen + alice)
    # (/root may exist as the way to a Python environment under it, and holds nothing else.)
    for hidden in (gw.state, root_of(gw, "bob"), os.path.dirname(alice) + "/bob", "/root/.ssh", "/root/.bashrc",
                   "/home", "/etc/shadow", "/var", os.path.dirname(gw.state) + "/gateway.log"):
        assert not os.path.exists(seen + hidden), hidden
    with open(seen + "/etc/passwd") as f:
        assert f.read() == "agent:x:1000:1000:agent:/tmp/home:/bin/sh\n"


def test_lab_contents_stay_in_the_tree_through_symlinks_the_agent_planted(gw, lab):
    alice, bob = root_of(gw, "alice"), root_of(gw, "bob")
    status, _ = gw.client.call("PUT", "/v1/agents/bob/documents/SOUL.md", raw=b"bob's soul")
    assert status == 200
    before_bob = sorted(os.listdir(bob))
    # The agent plants the links itself, from its own sandbox.
    status, result = gw.client.call("POST", "/v1/agents/alice/commands", {"command": (
        f"ln -s /etc user-files/etc-link && ln -s {bob} user-files/bob-link && ln -s {gw.state} user-files/state-link"
        " && ln -s /etc/passwd user-files/passwd-link && ln -s ../.. user-files/up-link"), "cwd": "."})
    assert status == 200 and result["exit_code"] == 0, result

    status, listing = lab.call("GET", "/api/contents/user-files/etc-link")
    if status == 200:  # the sandbox's own /etc: a few read-only system files, never the host's
        names = {entry["name"] for entry in listing["content"]}
        assert not names & {"shadow", "hostname", "machine-id", "sudoers", "ssh"}, names
    else:
        assert status in (403, 404)
    for missing in ("user-files/etc-link/shadow", "user-files/etc-link/hostname", "user-files/bob-link",
                    "user-files/bob-link/SOUL.md", "user-files/state-link", "user-files/state-link/control.sock",
                    "user-files/state-link/jupyter_tokens.json"):
        status, body = lab.call("GET", "/api/contents/" + missing)
        assert status in (400, 403, 404), (missing, status, body)
    status, body = lab.call("GET", "/api/contents/user-files/passwd-link?content=1&type=file&format=text")
    if status == 200:
        assert body["content"] == "agent:x:1000:1000:agent:/tmp/home:/bin/sh\n"  # the sandbox's, not the host's
    # up-link is the agent root's parent: inside the sandbox, an empty directory of mount points at most.
    status, body = lab.call("GET", "/api/contents/user-files/up-link")
    if status == 200:
        assert {e["name"] for e in body["content"]} <= {os.path.basename(alice)}
    for path in ("user-files/etc-link/evil.txt", "user-files/bob-link/evil.txt", "user-files/state-link/evil.txt",
                 "SOUL.md"):
        status, body = lab.call("PUT", "/api/contents/" + path, {"type": "file", "format": "text", "content": "evil"})
        assert not 200 <= status < 300, (path, status, body)
    assert not os.path.exists("/etc/evil.txt") and not os.path.exists(os.path.join(gw.state, "evil.txt"))
    assert sorted(os.listdir(bob)) == before_bob and not os.path.exists(os.path.join(bob, "evil.txt"))
    with open(os.path.join(bob, "SOUL.md")) as f:
        assert f.read() == "bob's soul"
    with open(os.path.join(alice, "SOUL.md")) as f:
        assert "evil" not in f.read()
    # ... while the agent's own files are Lab's to read and write.
    status, _ = lab.call("PUT", "/api/contents/user-files/from-lab.txt", {"type": "file", "format": "text",
                                                                           "content": "hello"})
    assert status == 201
    with open(os.path.join(alice, "user-files", "from-lab.txt")) as f:
        assert f.read() == "hello"
    assert os.stat(os.path.join(alice, "user-files", "from-lab.txt")).st_uid == os.stat(alice).st_uid


def test_lab_needs_its_token(gw, lab):
    assert lab.call("GET", "/api/contents", token=None)[0] == 403
    assert lab.call("GET", "/api/contents", token="wrong")[0] == 403
    assert lab.call("GET", f"/api/contents?token={urllib.parse.quote(lab.token)}", token=None)[0] == 200
    # Listening on loopback only.
    with socket.socket() as probe:
        probe.settimeout(5)
        assert probe.connect_ex(("127.0.0.1", lab.port)) == 0


def test_terminals_are_off(gw, lab):
    status, _ = lab.call("POST", "/api/terminals")
    assert status == 404


# --- the end -----------------------------------------------------------------------------------


def test_ctrl_c_stops_lab_cleanly_and_the_agents_kernels_keep_running(gw, tmp_path):
    jlk(gw, "new", "--path", "user-files/kept.ipynb")
    jlk(gw, "edit", "--path", "user-files/kept.ipynb", "insert", "--source", "kept = 1")
    jlk(gw, "execute", "--path", "user-files/kept.ipynb", "--index", "0")
    kernel_id = sessions(gw)["notebook:user-files/kept.ipynb"]["kernel_id"]
    dirs_before = lab_runtime_dirs()
    second = LabProcess(gw, "alice", str(tmp_path / "lab.log")).start()
    status, model = second.call("POST", "/api/sessions", {"path": "user-files/kept.ipynb", "name": "kept.ipynb",
                                                         "type": "notebook", "kernel": {"name": "python3"}})
    assert status == 201 and model["kernel"]["id"] == kernel_id
    pids = second.server_pids()
    assert len(pids) == 1 and len(lab_runtime_dirs() - dirs_before) == 1
    assert second.stop(signal.SIGINT) == 0, open(tmp_path / "lab.log").read()[-3000:]
    assert wait_until(lambda: not any(os.path.exists(f"/proc/{p}") for p in pids), timeout=30)
    assert lab_runtime_dirs() == dirs_before
    with socket.socket() as again:  # the port is free again
        again.bind(("127.0.0.1", second.port))
    kept = sessions(gw)["notebook:user-files/kept.ipynb"]
    assert kept["kernel_id"] == kernel_id and kept["state"] in ("idle", "busy")
    assert jlk(gw, "--session", "notebook:user-files/kept.ipynb", "execute", "--code", "kept + 1").stdout.strip() == "2"


def test_sigterm_stops_lab_too(gw, tmp_path):
    third = LabProcess(gw, "alice", str(tmp_path / "lab.log")).start()
    pids = third.server_pids()
    assert third.stop(signal.SIGTERM) == 0
    assert wait_until(lambda: not any(os.path.exists(f"/proc/{p}") for p in pids), timeout=30)


def test_a_clean_start_and_stop_print_no_error(gw, tmp_path):
    """No browser ever opened it: stopping it printed jupyter_server_ydoc's "WebsocketServer not running"
    traceback (its collaboration server only starts when a document is opened)."""
    log = tmp_path / "lab.log"
    quiet = LabProcess(gw, "alice", str(log), "--log-level", "INFO").start()
    assert quiet.stop(signal.SIGTERM) == 0
    text = open(log, errors="replace").read()
    flagged = [line for line in text.splitlines()
               if line.startswith(("[E ", "[W ", "[C ")) or "Traceback" in line or "exception" in line.lower()]
    assert not flagged, text[-3000:]


def test_the_lab_profile_has_the_walls_of_every_profile():
    from kernel_gateway.lab.command import sandbox_values
    from kernel_gateway.sandbox.profile import compile_profile, created_files, load_profile

    profile = load_profile("lab")
    values = sandbox_values("alice", "/srv/agents/alice", "/srv/state/agents/alice.sock", "/tmp/kg-lab-x")
    files = created_files(profile, values)
    argv = compile_profile(profile, values, data_fds=list(range(20, 20 + len(files))), seccomp_fd=9).argv
    for flag in ("--unshare-net", "--disable-userns", "--unshare-user", "--unshare-pid", "--new-session",
                 "--die-with-parent"):
        assert flag in argv, flag
    assert argv[argv.index("--seccomp") + 1] == "9" and argv[argv.index("--cap-drop") + 1] == "ALL"
    binds = [(argv[i], argv[i + 1], argv[i + 2]) for i, a in enumerate(argv) if a.startswith("--") and "bind" in a
             and a != "--ro-bind-data"]
    writable = {at for flag, _, at in binds if flag in ("--bind", "--bind-try")}
    assert writable == {"/srv/agents/alice", "/run/lab", "/run/kernel-gateway.sock"}
    assert ("--bind", "/srv/state/agents/alice.sock", "/run/kernel-gateway.sock") in binds
    assert not any(source.startswith("/srv/state") and at != "/run/kernel-gateway.sock" for _, source, at in binds)


def test_the_relay_never_connects_through_a_link_jupyterlab_could_plant(tmp_path):
    """The relay runs as root; the socket's directory is JupyterLab's (the agent's uid) to write."""
    import asyncio

    from kernel_gateway.lab.forwarder import SocketInDirectory

    secret = socket.socket(socket.AF_UNIX)  # stands for the gateway's control socket
    secret.bind(str(tmp_path / "control.sock"))
    secret.listen(4)
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    (runtime / "lab.sock").symlink_to(tmp_path / "control.sock")
    target = SocketInDirectory(str(runtime), "lab.sock", os.geteuid())

    async def attempt():
        reader, writer = await target.connect()
        writer.close()

    assert not target.exists()
    with pytest.raises(ConnectionRefusedError, match="not a socket of uid"):
        asyncio.run(attempt())
    secret.settimeout(0.5)
    with pytest.raises(socket.timeout):
        secret.accept()  # nothing reached it
    # A real socket there, of the wrong owner: refused too; of the right owner: connected.
    (runtime / "lab.sock").unlink()
    lab = socket.socket(socket.AF_UNIX)
    lab.bind(str(runtime / "lab.sock"))
    lab.listen(4)
    if os.geteuid() == 0:
        os.chown(runtime / "lab.sock", 54321, 54321, follow_symlinks=False)
        with pytest.raises(ConnectionRefusedError):
            asyncio.run(attempt())
        os.chown(runtime / "lab.sock", 0, 0, follow_symlinks=False)
    assert target.exists()
    asyncio.run(attempt())
    lab.settimeout(5)
    lab.accept()[0].close()
    target.close()


def test_a_signal_while_lab_starts_stops_it_cleanly(gw, tmp_path):
    """SIGTERM before the URL is printed: the command still stops Lab, its sandbox and runtime directory."""
    dirs_before = lab_runtime_dirs()
    proc = subprocess.Popen([os.path.join(BIN, "kernel-gateway"), "lab", "alice", "--socket", gw.socket, "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Its runtime directory exists once it has passed its checks and is starting JupyterLab.
    assert wait_until(lambda: lab_runtime_dirs() - dirs_before, timeout=120)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "stopping JupyterLab" in err
    assert wait_until(lambda: lab_runtime_dirs() == dirs_before, timeout=30)
