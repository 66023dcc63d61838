"""The confined filesystem layer against a hostile agent, on a real gateway with real bwrap.

Two classes of hole, each tried several ways, each judged from the host:

- blocking or following filesystem work on agent paths: a FIFO or a symlink
  where the gateway expects the checkpoints folder, a ``.kernel-gateway`` or a
  job's ``skills/`` replaced by a link into ``installed-skills/``, a
  checkpoint inside what the Library protects, files made by ``apply_patch``
  left to root;
- disk and CPU work on the event loop: a 35 MB notebook and a folder of
  120,000 files, while a prober times ``GET /v1/info`` on the control socket
  and another agent executes code.

The agent's moves are made as the agent makes them, with commands in its
sandbox, where it can; the host checks that nothing outside what the agent may
write changed (contents, owners, mtimes) and that the control socket answered.
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from jupyter_support import JupyterClient
from kernel_gateway import fs
from kernel_gateway.library import Library
from support import Client, GatewayProcess, execute_ok, wait_until

# Seconds the control socket may take to answer while an agent's contents work runs: generous
# (the GIL and the collector still pause the loop for up to about a second while a worker builds a
# 35 MB notebook), and far below what the loop-bound handlers took (see the class-4 tests).
PROBE_BOUND = 3.0


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    gateway = GatewayProcess(tmp_path_factory.mktemp("fsconf"), "--jupyter-port", "0").start()
    for agent in ("alice", "bob"):
        assert gateway.client.call("PUT", f"/v1/agents/{agent}")[0] in (200, 201)
    yield gateway
    gateway.stop()


@pytest.fixture(scope="module")
def alice(gw) -> JupyterClient:
    token = gw.client.call("POST", "/v1/agents/alice/tokens")[1]
    return JupyterClient(token["url"], token["token"])


def tree(gw, agent="alice") -> str:
    return os.path.join(gw.root, agent)


def sh(gw, command: str, agent: str = "alice") -> dict:
    """A command in the agent's own sandbox: how the agent changes its tree."""
    status, body = gw.client.call("POST", f"/v1/agents/{agent}/commands", {"command": command})
    assert status == 200, body
    return body


def fingerprint(top: str) -> dict:
    """Every entry under ``top`` (not followed): its kind, owner, mode, mtime and bytes."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in [""] + dirnames + filenames:
            full = os.path.join(dirpath, name) if name else dirpath
            st = os.lstat(full)
            data = None
            if os.path.isfile(full) and not os.path.islink(full):
                with open(full, "rb") as f:
                    data = f.read()
            out[os.path.relpath(full, top)] = (st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns, data,
                                               os.readlink(full) if os.path.islink(full) else None)
    return out


def etc_fingerprint() -> dict:
    return {p: (os.lstat(p).st_mtime_ns, os.lstat(p).st_mode, os.lstat(p).st_uid)
            for p in ("/etc", "/etc/passwd", "/etc/hostname", "/etc/hosts") if os.path.lexists(p)}


class Prober:
    """Times GET /v1/info on the control socket, over and over, until stopped."""

    def __init__(self, gw):
        self.client = Client(gw.socket)
        self.times: list[float] = []
        self.failures: list[object] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            start = time.monotonic()
            try:
                status, _ = self.client.call("GET", "/v1/info", timeout=60)
                if status != 200:
                    self.failures.append(status)
            except OSError as e:
                self.failures.append(e)
            self.times.append(time.monotonic() - start)
            time.sleep(0.05)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(90)

    @property
    def worst(self) -> float:
        return max(self.times, default=0.0)


# --- class 3: blocking or following filesystem work on agent paths ---------------------------


def test_a_fifo_where_the_checkpoints_folder_goes_neither_blocks_nor_stays(gw, alice):
    """Deleting a folder removes its .ipynb_checkpoints; a FIFO there (or in it) is unlinked, never opened."""
    sh(gw, "mkdir -p user-files/f1 user-files/f2/.ipynb_checkpoints && mkfifo user-files/f1/.ipynb_checkpoints"
           " && mkfifo user-files/f2/.ipynb_checkpoints/pipe")
    with Prober(gw) as prober:
        for folder in ("user-files/f1", "user-files/f2"):
            status, body = alice.call("DELETE", f"api/contents/{folder}")
            assert status == 204, body
            assert not os.path.lexists(os.path.join(tree(gw), folder))
    assert not prober.failures and prober.worst < PROBE_BOUND, (prober.worst, prober.failures)


@pytest.mark.parametrize("target", ["/etc", "other agent"])
def test_a_symlinked_checkpoints_folder_is_neither_followed_nor_emptied(gw, alice, target):
    """``.ipynb_checkpoints`` -> /etc or another agent's tree: delete, list, restore and delete a
    checkpoint all leave the target as it was; deleting the folder removes the link itself."""
    bob_dir = os.path.join(tree(gw, "bob"), "user-files", "cp")
    os.makedirs(bob_dir, exist_ok=True)
    with open(os.path.join(bob_dir, "x-checkpoint.txt"), "w") as f:
        f.write("bob's checkpoint\n")
    with open(os.path.join(bob_dir, "hosts-checkpoint"), "w") as f:
        f.write("bob's\n")
    link = "/etc" if target == "/etc" else bob_dir
    sh(gw, f"mkdir -p user-files/s && printf mine > user-files/s/x.txt && printf mine > user-files/s/hosts"
           f" && ln -sfn {link} user-files/s/.ipynb_checkpoints")
    before_etc, before_bob = etc_fingerprint(), fingerprint(tree(gw, "bob"))

    for name in ("x.txt", "hosts"):
        path = f"user-files/s/{name}"
        status, body = alice.call("GET", f"api/contents/{path}/checkpoints")
        assert status == 403 and body["error"]["code"] == "path_outside_root", body
        assert alice.call("POST", f"api/contents/{path}/checkpoints/checkpoint")[0] == 403  # restore
        assert alice.call("DELETE", f"api/contents/{path}/checkpoints/checkpoint")[0] == 403
        assert alice.call("POST", f"api/contents/{path}/checkpoints")[0] == 403  # create
        with open(os.path.join(tree(gw), path)) as f:
            assert f.read() == "mine"
    sh(gw, "rm user-files/s/x.txt user-files/s/hosts")
    status, body = alice.call("DELETE", "api/contents/user-files/s")
    assert status == 204, body
    assert not os.path.lexists(os.path.join(tree(gw), "user-files/s"))
    assert etc_fingerprint() == before_etc
    assert fingerprint(tree(gw, "bob")) == before_bob


def _spill_attempt(gw, replace: str) -> tuple[dict, dict]:
    skills = os.path.join(tree(gw), "installed-skills")
    before = fingerprint(skills)
    sh(gw, replace)
    result = sh(gw, "head -c 300000 /dev/zero | tr '\\0' x")  # over the 64 KiB kept: it would spill
    return result, before


@pytest.mark.parametrize("replace", [
    "rm -rf .kernel-gateway && ln -s installed-skills .kernel-gateway",
    "rm -rf .kernel-gateway && mkdir .kernel-gateway && ln -s ../installed-skills/jupyter-live-kernel"
    " .kernel-gateway/commands",
])
def test_the_output_spill_follows_no_link_into_installed_skills(gw, replace):
    result, before = _spill_attempt(gw, replace)
    assert result["exit_code"] == 0 and "stdout_path" not in result, result
    assert "could not be saved" in result["stdout"]
    assert fingerprint(os.path.join(tree(gw), "installed-skills")) == before
    # Put back, the spill works again and its file is the agent's.
    sh(gw, "rm -rf .kernel-gateway")
    result = sh(gw, "head -c 300000 /dev/zero | tr '\\0' x")
    spilled = os.path.join(tree(gw), ".kernel-gateway", "commands", os.path.basename(result["stdout_path"]))
    assert os.stat(spilled).st_uid == os.stat(tree(gw)).st_uid != 0


def _library_tree(tmp_path) -> tuple[Library, str]:
    root, state = tmp_path / "agents", tmp_path / "state"
    (root / "alice").mkdir(parents=True)
    library = Library(str(root), str(state))
    from kernel_gateway import workspace
    workspace.create_agent_tree(str(root), "alice")
    library.ensure_agent("alice")
    return library, str(root / "alice")


@pytest.mark.parametrize("swap", ["skills", "job"])
def test_job_skills_follow_no_link_into_installed_skills(tmp_path, swap):
    """A job's ``skills/`` (or the job's folder) replaced by a link into ``installed-skills/``: the
    copy of the agent's skills is refused and the Library's files stay as they were."""
    library, top = _library_tree(tmp_path)
    job = os.path.join(top, "jobs", "0123456789ab")
    if swap == "skills":
        os.makedirs(job)
        os.symlink("../../installed-skills", os.path.join(job, "skills"))
    else:
        os.makedirs(os.path.join(top, "user-files", "fake", "skills"))
        os.symlink("../installed-skills", job)
    before = fingerprint(os.path.join(top, "installed-skills"))
    with pytest.raises(fs.SymlinkRefused):
        library.materialize_skills("alice", top, "jobs/0123456789ab/skills")
    assert fingerprint(os.path.join(top, "installed-skills")) == before
    # A real folder is filled.
    os.unlink(os.path.join(job, "skills") if swap == "skills" else job)
    os.makedirs(os.path.join(job, "skills"), exist_ok=True)
    assert library.materialize_skills("alice", top, "jobs/0123456789ab/skills") == ["jupyter-live-kernel"]


def test_a_job_whose_skills_are_swapped_for_a_link_while_it_starts_writes_nothing_there(gw):
    """The same through the gateway: a loop in the agent's sandbox keeps replacing every job's
    ``skills/`` with a link to ``installed-skills`` while jobs start; whichever wins each race,
    the host's ``installed-skills`` never changes."""
    skills = os.path.join(tree(gw), "installed-skills")
    before = fingerprint(skills)
    sh(gw, "mkdir -p user-files/src && echo hi > user-files/src/a.txt")
    swapper = ("nohup sh -c 'end=$(($(date +%s)+40)); while [ $(date +%s) -lt $end ]; do for d in jobs/*/; do "
               "[ -d \"$d\" ] && [ ! -L \"$d\"skills ] && rm -rf \"$d\"skills && ln -s ../../installed-skills "
               "\"$d\"skills; done; done' >/dev/null 2>&1 &")
    status, body = gw.client.execute("alice", "swap", f"import subprocess; subprocess.run({swapper!r}, shell=True)")
    assert status == 200, body
    ids = []
    for _ in range(3):
        status, job = gw.client.call("POST", "/v1/agents/alice/jobs",
                                     {"kind": "command", "from": "user-files/src", "command": "true"})
        assert status == 201, job
        ids.append(job["id"])
    for job_id in ids:
        status, done = gw.client.call("GET", f"/v1/agents/alice/jobs/{job_id}?wait=1", timeout=300)
        assert status == 200 and done["state"] not in ("queued", "running"), done
    assert fingerprint(skills) == before


def _install_demo_skill(gw, extra: dict) -> str:
    files = {"SKILL.md": "---\nname: demo\ndescription: a demo skill\n---\nhi\n", **extra}
    status, body = gw.client.call("PUT", "/v1/agents/alice/skills/demo", {"files": files})
    assert status in (200, 201), body
    return os.path.join(tree(gw), "installed-skills", "demo")


def test_delete_checkpoint_is_refused_where_the_library_protects_the_folder_reached(gw, alice):
    demo = _install_demo_skill(gw, {".ipynb_checkpoints/SKILL-checkpoint.md": "operator's\n",
                                    "SOUL-checkpoint.md": "operator's too\n"})
    for rel in ("", "SKILL.md", ".ipynb_checkpoints", ".ipynb_checkpoints/SKILL-checkpoint.md"):
        assert os.stat(os.path.join(demo, rel)).st_uid == os.geteuid()  # the Library's, not the agent's
    before = fingerprint(demo)
    # Straight at the skill's own checkpoint...
    status, body = alice.call("DELETE", "api/contents/installed-skills/demo/SKILL.md/checkpoints/checkpoint")
    assert status == 403 and body["error"]["code"] == "read_only", body
    # ... and through a link the agent made: .ipynb_checkpoints at its top -> the skill's folder.
    sh(gw, "rm -rf .ipynb_checkpoints && ln -s installed-skills/demo .ipynb_checkpoints")
    status, body = alice.call("DELETE", "api/contents/SOUL.md/checkpoints/checkpoint")
    assert status == 403 and body["error"]["code"] == "read_only", body
    assert alice.call("POST", "api/contents/SOUL.md/checkpoints")[0] == 403  # nor written there
    assert fingerprint(demo) == before
    sh(gw, "rm .ipynb_checkpoints")


def test_files_apply_patch_creates_are_the_agents_and_it_can_edit_them(gw):
    patch = ("*** Begin Patch\n*** Add File: user-files/p/new.txt\n+one\n"
             "*** Add File: user-files/p/old.txt\n+two\n*** End Patch\n")
    status, body = gw.client.call("POST", "/v1/agents/alice/patch", {"patch": patch})
    assert status == 200 and body["ok"], body
    move = ("*** Begin Patch\n*** Update File: user-files/p/old.txt\n*** Move to: user-files/q/moved.txt\n"
            "@@\n-two\n+three\n*** End Patch\n")
    status, body = gw.client.call("POST", "/v1/agents/alice/patch", {"patch": move})
    assert status == 200 and body["ok"], body
    agent_uid = os.stat(tree(gw)).st_uid
    assert agent_uid != 0
    for rel in ("user-files/p/new.txt", "user-files/q/moved.txt", "user-files/q"):
        st = os.stat(os.path.join(tree(gw), rel))
        assert (st.st_uid, st.st_gid) == (agent_uid, os.stat(tree(gw)).st_gid), rel
    result = sh(gw, "echo more >> user-files/p/new.txt && echo more >> user-files/q/moved.txt && echo ok")
    assert result["exit_code"] == 0 and result["stdout"] == "ok\n", result
    with open(os.path.join(tree(gw), "user-files/q/moved.txt")) as f:
        assert f.read() == "three\nmore\n"


# --- class 4: disk and CPU work on the event loop -----------------------------------------------


def _big_notebook(path: str, megabytes: int = 35) -> None:
    """``megabytes`` MB in 1 kB cells: parsing and validating it is seconds of CPU."""
    outputs = [{"output_type": "stream", "name": "stdout", "text": ["x" * 900 + "\n"]}]
    cells = [{"cell_type": "code", "id": f"c{i}", "execution_count": 1, "metadata": {}, "source": f"print({i})",
              "outputs": outputs} for i in range(megabytes * 1000)]
    with open(path, "w") as f:
        json.dump({"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": cells}, f)


def test_a_35_mb_notebook_is_read_off_the_loop(gw, alice):
    """GET of a 35 MB notebook (35,000 cells), twice at once, while the control socket is probed and bob executes.

    Measured on 2 cores with other test runs alongside (load 8), one GET: the handler on the
    event loop stalled the prober for 8.4 s (the GET took 9.2 s); on a worker thread the prober's
    worst answer was 1.2-1.8 s, the pauses left being the GIL held by json.loads and the cyclic
    collector while the notebook's objects are built.  Bound asserted: PROBE_BOUND (3 s).
    """
    nb = os.path.join(tree(gw), "user-files", "big.ipynb")
    _big_notebook(nb)
    os.chown(nb, os.stat(tree(gw)).st_uid, os.stat(tree(gw)).st_gid)
    assert os.path.getsize(nb) > 35_000_000
    results: list = []

    def get():
        results.append(alice.call("GET", "api/contents/user-files/big.ipynb"))

    execute_ok(gw, "1", agent="bob")  # bob's kernel up before the load
    with Prober(gw) as prober:
        readers = [threading.Thread(target=get) for _ in range(2)]
        for reader in readers:
            reader.start()
        served = execute_ok(gw, "print(6 * 7)", agent="bob")
        for reader in readers:
            reader.join(300)
    assert served["status"] == "ok" and "42" in served["text"]
    assert [status for status, _ in results] == [200, 200]
    assert len(results[0][1]["content"]["cells"]) == 35_000
    assert not prober.failures and prober.worst < PROBE_BOUND, (prober.worst, len(prober.times))


def test_a_folder_of_120000_files_is_listed_off_the_loop_and_capped(gw, alice):
    """Listing a folder of 120,000 files answers 413 at the cap; 15,000 are listed, off the loop.

    Measured on 2 cores under load: listing all 120,000 on the event loop took 29.9 s and stalled
    the prober 29.4 s; now the capped listing answers 413 in 0.3 s and the prober's worst was
    0.2 s.  Bound asserted: PROBE_BOUND (3 s).
    """
    owner = os.stat(tree(gw))
    for name, count in (("many", 120_000), ("some", 15_000)):
        folder = os.path.join(tree(gw), "user-files", name)
        os.mkdir(folder)
        for i in range(count):
            os.close(os.open(os.path.join(folder, f"f{i:06d}.txt"), os.O_WRONLY | os.O_CREAT, 0o644))
        os.chown(folder, owner.st_uid, owner.st_gid)
    with Prober(gw) as prober:
        status, body = alice.call("GET", "api/contents/user-files/many")
        assert status == 413 and body["error"]["code"] == "too_many_entries", body
        status, body = alice.call("GET", "api/contents/user-files/some")
        assert status == 200 and len(body["content"]) == 15_000
        served = execute_ok(gw, "print(6 * 7)", agent="bob")
    assert served["status"] == "ok"
    assert not prober.failures and prober.worst < PROBE_BOUND, (prober.worst, len(prober.times))


def test_one_agent_cannot_take_every_worker(gw, alice):
    """Forty slow GETs at once from alice: past her share (2 running, 32 waiting) they are refused
    with 429 agent_busy, and bob's contents are served meanwhile."""
    nb = os.path.join(tree(gw), "user-files", "mid.ipynb")
    _big_notebook(nb, megabytes=2)
    token = gw.client.call("POST", "/v1/agents/bob/tokens")[1]
    bob = JupyterClient(token["url"], token["token"])
    results: list = []
    readers = [threading.Thread(target=lambda: results.append(alice.call("GET", "api/contents/user-files/mid.ipynb")))
               for _ in range(40)]
    for reader in readers:
        reader.start()
    status, body = bob.call("GET", "api/contents")
    assert status == 200 and body["type"] == "directory"
    assert len([s for s, _ in results if s == 200]) < 40  # served while alice's were still being read
    for reader in readers:
        reader.join(600)
    statuses = sorted(status for status, _ in results)
    assert set(statuses) <= {200, 429} and statuses.count(429) >= 1 and statuses.count(200) >= 2, statuses
    refused = next(body for status, body in results if status == 429)
    assert refused["error"]["code"] == "agent_busy"


# --- the per-agent share of the workers -------------------------------------------------------


def test_the_workers_share_is_per_agent_and_refuses_past_it():
    """2 running and 2 waiting per agent: a third waiter is refused (429), another agent still runs."""
    import asyncio

    from kernel_gateway.errors import GatewayError
    from kernel_gateway.fs.workers import AgentWorkers

    async def scenario():
        workers = AgentWorkers(threads=4, per_agent=2, per_agent_waiting=2)
        release = threading.Event()
        running = []

        def block(tag):
            running.append(tag)
            release.wait(30)
            return tag

        alice = [asyncio.ensure_future(workers.run("alice", block, f"a{i}")) for i in range(4)]
        await asyncio.sleep(0)
        assert wait_until(lambda: len(running) == 2, timeout=10)
        assert workers.running("alice") == 2 and workers.waiting("alice") == 2
        with pytest.raises(GatewayError) as refused:
            await workers.run("alice", block, "a-too-many")
        assert refused.value.status == 429 and refused.value.code == "agent_busy"
        bob = await asyncio.wait_for(workers.run("bob", lambda: "bob ran"), 30)  # not behind alice's queue
        assert bob == "bob ran" and sorted(running) == ["a0", "a1"]
        release.set()
        assert sorted(await asyncio.gather(*alice)) == ["a0", "a1", "a2", "a3"]
        assert workers.running("alice") == 0 and workers.waiting() == 0
        workers.shutdown()

    asyncio.run(scenario())


def test_notebook_writes_through_a_link_into_the_library_are_refused(gw, alice):
    """A folder link into ``installed-skills/`` (the agent's own, inside its tree): the notebook store
    and contents both refuse to write a notebook there, judged on the folder actually reached."""
    status, _ = gw.client.call("GET", "/v1/agents/alice/skills/demo")
    demo = os.path.join(tree(gw), "installed-skills", "demo") if status == 200 else _install_demo_skill(gw, {})
    before = fingerprint(demo)
    sh(gw, "ln -sfn ../installed-skills/demo user-files/lk")
    nb = {"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    status, body = gw.client.call("PUT", "/v1/agents/alice/notebooks/user-files/lk/x.ipynb", nb)
    assert status == 403 and body["error"]["code"] == "read_only_path", body
    status, body = gw.client.call("PUT", "/v1/agents/alice/notebooks/user-files/lk/new/x.ipynb", nb)
    assert status == 403 and body["error"]["code"] == "read_only_path", body
    status, body = alice.call("PUT", "api/contents/user-files/lk/x.ipynb", {"type": "notebook", "content": nb})
    assert status == 403 and body["error"]["code"] == "read_only", body
    assert fingerprint(demo) == before
    sh(gw, "rm user-files/lk")
