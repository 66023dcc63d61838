"""Background Agent Jobs through the real sockets: real bwrap, real processes, real files."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import uuid

import pytest

from support import GatewayProcess, wait_until
from test_tool_routes import tree_digest


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    gateway = GatewayProcess(tmp_path_factory.mktemp("jobs"), "--Gateway.max_running_jobs=2").start()
    for agent in ("alice", "bob"):
        gateway.client.call("PUT", f"/v1/agents/{agent}")
    yield gateway
    gateway.stop()


def make_repo(gw, agent: str = "alice", files: dict | None = None) -> tuple[str, pathlib.Path]:
    """A fresh directory under user-files; returns (its path from the agent root, its host path)."""
    rel = f"user-files/repo-{uuid.uuid4().hex[:8]}"
    path = pathlib.Path(gw.root) / agent / rel
    for name, content in (files or {"README.md": "# repo\n", "src/app.py": "print('v1')\n"}).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    path.mkdir(parents=True, exist_ok=True)
    # The agent's own files, as if it had written them (its sandboxes run as its uid).
    owner = os.stat(pathlib.Path(gw.root) / agent)
    for where in [path, *path.rglob("*")]:
        os.chown(where, owner.st_uid, owner.st_gid, follow_symlinks=False)
    return rel, path


def submit(gw, body: dict, agent: str = "alice", client=None) -> dict:
    status, job = (client or gw.client).call("POST", f"/v1/agents/{agent}/jobs", body)
    assert status == 201, job
    return job


def wait(gw, job: dict, agent: str = "alice") -> dict:
    status, done = gw.client.call("GET", f"/v1/agents/{agent}/jobs/{job['id']}?wait=1", timeout=300)
    assert status == 200, done
    return done


def state(gw, job: dict, agent: str = "alice") -> str:
    return gw.client.call("GET", f"/v1/agents/{agent}/jobs/{job['id']}")[1]["state"]


def host_processes(*argv: str) -> list[int]:
    """Pids of host processes whose command line is exactly ``argv``."""
    wanted = "\0".join(argv) + "\0"
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline") as f:
                    if f.read() == wanted:
                        found.append(int(pid))
            except OSError:
                pass
    return found


# --- the patch ---------------------------------------------------------------


def test_command_job_gives_a_patch_that_patch_p1_applies_and_matches_its_sha256(gw, tmp_path):
    rel, repo = make_repo(gw, files={"README.md": "# repo\n", "src/app.py": "print('v1')\n", "old.txt": "bye\n",
                                     "logo.bin": b"\x00\x01\x02"})
    job = wait(gw, submit(gw, {"kind": "command", "from": rel, "command":
                               "sed -i s/v1/v2/ src/app.py && echo new > docs.txt && rm old.txt && "
                               "printf '\\000\\003' > logo.bin && echo edited"}))
    assert job["state"] == "succeeded" and job["exit_code"] == 0, job
    assert job["stdout_tail"] == "edited\n"
    patch = job["patch"]
    assert patch["files"] == ["docs.txt", "old.txt", "src/app.py"]
    assert patch["binary_files"] == ["logo.bin"] and patch["partial"] is False

    status, body = gw.client.call("GET", f"/v1/agents/alice/jobs/{job['id']}/patch")
    assert status == 200 and isinstance(body, bytes) and len(body) == patch["bytes"]
    assert hashlib.sha256(body).hexdigest() == patch["sha256"]

    # The receiver's check, then patch -p1 on a copy of the original files.
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(repo), str(copy)], check=True)
    subprocess.run(["patch", "-p1", "-E", "-s"], input=body, cwd=copy, check=True)
    assert (copy / "src/app.py").read_text() == "print('v2')\n"
    assert (copy / "docs.txt").read_text() == "new\n" and not (copy / "old.txt").exists()
    # The workspace has the documented shape.
    workspace = pathlib.Path(job["workspace"])
    assert sorted(p.name for p in workspace.iterdir()) == [
        "base", "change.patch", "skills", "stderr.log", "stdout.log", "temp", "tree"]
    assert (workspace / "base/src/app.py").read_text() == "print('v1')\n"


def test_a_job_that_changes_nothing_has_an_empty_patch(gw):
    rel, _ = make_repo(gw)
    job = wait(gw, submit(gw, {"kind": "command", "from": rel, "argv": ["cat", "README.md"]}))
    assert job["state"] == "succeeded" and job["stdout_tail"] == "# repo\n"
    assert job["patch"]["bytes"] == 0 and job["patch"]["files"] == []
    assert job["patch"]["sha256"] == hashlib.sha256(b"").hexdigest()


def test_failed_job_still_gets_its_patch_marked_partial(gw):
    rel, _ = make_repo(gw)
    job = wait(gw, submit(gw, {"kind": "command", "from": rel, "command": "echo half > part.txt; echo oops >&2; exit 3"}))
    assert job["state"] == "failed" and job["exit_code"] == 3 and job["stderr_tail"] == "oops\n"
    assert job["patch"]["files"] == ["part.txt"] and job["patch"]["partial"] is True


def test_symlinks_fifos_in_from_are_left_out_and_listed(gw):
    rel, repo = make_repo(gw)
    os.symlink("/etc/shadow", repo / "shadow")
    os.symlink("../../../bob", repo / "bob")
    os.mkfifo(repo / "pipe")
    job = wait(gw, submit(gw, {"kind": "command", "from": rel, "command": "ls -A"}))
    assert job["state"] == "succeeded"
    assert sorted(job["stdout_tail"].split()) == ["README.md", "src"]
    assert job["skipped"] == [{"path": "bob", "type": "symlink"}, {"path": "pipe", "type": "fifo"},
                              {"path": "shadow", "type": "symlink"}]


# --- apply -------------------------------------------------------------------


def test_apply_applies_the_whole_patch_and_binary_files(gw):
    rel, repo = make_repo(gw, files={"a.txt": "one\n", "b.txt": "two\n", "img.bin": b"\x00\x01"})
    job = wait(gw, submit(gw, {"kind": "command", "from": rel, "command":
                               "echo ONE > a.txt; rm b.txt; mkdir -p new/dir; echo c > new/dir/c.txt; printf '\\000\\002' > img.bin"}))
    status, result = gw.client.call("POST", f"/v1/agents/alice/jobs/{job['id']}/apply")
    assert status == 200, result
    assert result["files"] == ["a.txt", "b.txt", "new/dir/c.txt"] and result["binary_files"] == ["img.bin"]
    assert (repo / "a.txt").read_text() == "ONE\n" and not (repo / "b.txt").exists()
    assert (repo / "new/dir/c.txt").read_text() == "c\n" and (repo / "img.bin").read_bytes() == b"\x00\x02"
    assert gw.client.call("GET", f"/v1/agents/alice/jobs/{job['id']}")[1]["applied"] is not None
    before = tree_digest(str(repo))
    status, body = gw.client.call("POST", f"/v1/agents/alice/jobs/{job['id']}/apply")
    assert status == 409 and body["error"]["code"] == "already_applied"
    assert tree_digest(str(repo)) == before


def test_two_applies_at_once_apply_once(gw):
    import concurrent.futures

    rel, repo = make_repo(gw, files={"a.txt": "one\n"})
    job = wait(gw, submit(gw, {"kind": "command", "from": rel, "command": "echo ONE > a.txt"}))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: gw.client.call("POST", f"/v1/agents/alice/jobs/{job['id']}/apply"), range(4)))
    assert sorted(status for status, _ in answers) == [200, 409, 409, 409], answers
    assert (repo / "a.txt").read_text() == "ONE\n"


def test_apply_after_a_conflicting_change_is_409_and_changes_nothing(gw):
    rel, repo = make_repo(gw, files={"a.txt": "one\n", "b.txt": "two\n"})
    job = wait(gw, submit(gw, {"kind": "command", "from": rel, "command": "echo ONE > a.txt; echo TWO > b.txt"}))
    (repo / "b.txt").write_text("changed meanwhile\n")
    before = tree_digest(str(repo))
    status, body = gw.client.call("POST", f"/v1/agents/alice/jobs/{job['id']}/apply")
    assert status == 409 and body["error"]["code"] == "source_changed", body
    assert "b.txt" in body["error"]["message"] and "a.txt" not in body["error"]["message"]
    assert tree_digest(str(repo)) == before


def test_apply_refuses_a_patch_altered_after_the_job(gw):
    rel, repo = make_repo(gw, files={"a.txt": "one\n"})
    job = wait(gw, submit(gw, {"kind": "command", "from": rel, "command": "echo ONE > a.txt"}))
    with open(os.path.join(job["workspace"], "change.patch"), "a") as f:
        f.write("--- base/x\n+++ tree/x\n")
    before = tree_digest(str(repo))
    status, body = gw.client.call("POST", f"/v1/agents/alice/jobs/{job['id']}/apply")
    assert status == 409 and body["error"]["code"] == "patch_changed"
    assert gw.client.call("GET", f"/v1/agents/alice/jobs/{job['id']}/patch")[0] == 409
    assert tree_digest(str(repo)) == before


# --- confinement and limits -----------------------------------------------------


def test_a_job_sees_only_its_own_workspace(gw):
    rel, _ = make_repo(gw)
    root = os.path.join(gw.root, "alice")
    (pathlib.Path(root) / "user-files" / "secret.txt").write_text("secret\n")
    targets = [f"{root}/user-files/secret.txt", f"{root}/{rel}", f"{root}/SOUL.md", f"{gw.root}/bob", gw.state,
               f"{gw.state}/control.sock", "/run/kernel-gateway.sock", "/root/.bashrc", "/etc/shadow"]
    skill_md = "---\nname: demo\ndescription: A demo skill.\n---\n# demo skill\n"
    status, body = gw.client.call("PUT", "/v1/agents/alice/skills/demo", {"files": {"SKILL.md": skill_md}})
    assert status in (200, 201), body
    checks = "; ".join(f"test -e '{t}' && echo 'SEEN {t}'" for t in targets)
    job = wait(gw, submit(gw, {"kind": "command", "from": rel, "command":
                               f"{checks}; ls {root}/jobs; id -u; pwd; tail -n 1 ../skills/demo/SKILL.md; ls ../skills; "
                               "touch ../skills/new 2>/dev/null && echo SEEN-writable-skills; true"}))
    lines = job["stdout_tail"].splitlines()
    assert not [line for line in lines if line.startswith("SEEN")], lines
    assert lines == [job["id"], "1000", os.path.join(job["workspace"], "tree"), "# demo skill",
                     "demo", "jupyter-live-kernel"]  # the agent's enabled skills, read-only


OPEN_FDS = "import os\nopen_fds = []\nfor fd in range(4096):\n    try:\n        os.fstat(fd)\n        open_fds.append(fd)\n    except OSError:\n        pass\nprint(open_fds)"


def test_a_job_starts_with_only_stdin_stdout_and_stderr(gw):
    rel, _ = make_repo(gw)
    job = wait(gw, submit(gw, {"kind": "command", "from": rel, "argv": ["python3", "-I", "-c", OPEN_FDS]}))
    assert job["stdout_tail"] == "[0, 1, 2]\n", job


def test_wall_limit_ends_the_job_and_its_background_children(gw):
    rel, _ = make_repo(gw)
    job = submit(gw, {"kind": "command", "from": rel, "limits": {"wall": "3s"},
                      "command": "sleep 31337 & (sleep 31338 &) ; sleep 31339"})
    assert wait_until(lambda: host_processes("sleep", "31338") and host_processes("sleep", "31337"))
    job = wait(gw, job)
    assert job["state"] == "timed_out" and job["exit_code"] is None
    assert "wall limit" in job["error"] and job["limits"]["wall"] == 3.0
    assert job["patch"] is not None and job["patch"]["partial"] is True
    for n in ("31337", "31338", "31339"):
        assert host_processes("sleep", n) == []


def test_cancel_ends_every_process(gw):
    rel, _ = make_repo(gw)
    job = submit(gw, {"kind": "command", "from": rel, "command": "sleep 31340 & (sleep 31341 &); sleep 31342"})
    assert wait_until(lambda: host_processes("sleep", "31341") and host_processes("sleep", "31342"))
    status, body = gw.client.call("POST", f"/v1/agents/alice/jobs/{job['id']}/cancel")
    assert status == 200
    job = wait(gw, job)
    assert job["state"] == "cancelled"
    for n in ("31340", "31341", "31342"):
        assert host_processes("sleep", n) == []
    status, body = gw.client.call("POST", f"/v1/agents/alice/jobs/{job['id']}/cancel")
    assert status == 409 and body["error"]["code"] == "job_ended"


FORKS = """
import os, time
n = 0
try:
    while n < 100:
        if os.fork() == 0:
            time.sleep(5)
            os._exit(0)
        n += 1
    print("forked", n)
except OSError as e:
    print("refused after", n, e.strerror)
"""


def test_process_file_size_and_memory_limits_hold(gw):
    rel, _ = make_repo(gw)
    forks = wait(gw, submit(gw, {"kind": "command", "from": rel, "argv": ["python3", "-c", FORKS],
                                 "limits": {"processes": 16}}))
    out = forks["stdout_tail"].split()
    assert out[:2] == ["refused", "after"] and int(out[2]) < 16, forks

    big = wait(gw, submit(gw, {"kind": "command", "from": rel, "limits": {"file_size": "1M"},
                               "command": "head -c 3000000 /dev/zero > big.bin; echo rc=$?; wc -c < big.bin"}))
    assert big["stdout_tail"].split() == ["rc=153", str(1 << 20)], big  # 128 + SIGXFSZ

    memory = wait(gw, submit(gw, {"kind": "command", "from": rel, "limits": {"memory": "256M"},
                                  "argv": ["python3", "-c", "b = bytearray(1 << 30)"]}))
    assert memory["state"] == "failed" and "MemoryError" in memory["stderr_tail"], memory


# --- the queue -------------------------------------------------------------------


def test_two_jobs_of_one_agent_run_one_after_the_other(gw):
    rel, _ = make_repo(gw)
    first = submit(gw, {"kind": "command", "from": rel, "command": "sleep 2; echo first"})
    second = submit(gw, {"kind": "command", "from": rel, "command": "echo second"})
    assert second["state"] == "queued"
    second = wait(gw, second)  # waiting on a queued job waits until it has run
    first = wait(gw, first)
    assert first["state"] == second["state"] == "succeeded"
    assert second["started"] >= first["ended"]
    ids = [j["id"] for j in gw.client.call("GET", "/v1/agents/alice/jobs")[1]["jobs"]]
    assert ids.index(second["id"]) < ids.index(first["id"])  # newest first


def test_jobs_of_two_agents_run_side_by_side(gw):
    rel_a, _ = make_repo(gw, "alice")
    rel_b, _ = make_repo(gw, "bob")
    a = submit(gw, {"kind": "command", "from": rel_a, "command": "sleep 31343"})
    b = submit(gw, {"kind": "command", "from": rel_b, "command": "sleep 31344"}, agent="bob")
    assert wait_until(lambda: host_processes("sleep", "31343") and host_processes("sleep", "31344"))
    assert state(gw, a) == "running" and state(gw, b, "bob") == "running"
    for job, agent in ((a, "alice"), (b, "bob")):
        gw.client.call("POST", f"/v1/agents/{agent}/jobs/{job['id']}/cancel")
        assert wait(gw, job, agent)["state"] == "cancelled"


def test_after_kill_9_a_running_job_is_lost_and_a_queued_one_runs(tmp_path):
    gw = GatewayProcess(tmp_path).start()
    try:
        gw.client.call("PUT", "/v1/agents/alice")
        rel, repo = make_repo(gw)
        running = submit(gw, {"kind": "command", "from": rel, "command": "echo started; echo partial > p.txt; sleep 31345"})
        queued = submit(gw, {"kind": "command", "from": rel, "command": "echo after > after.txt"})
        assert wait_until(lambda: host_processes("sleep", "31345"))
        gw.stop(signal.SIGKILL)
        assert wait_until(lambda: not host_processes("sleep", "31345"))  # it ended with its gateway
        gw.start()
        lost = gw.client.call("GET", f"/v1/agents/alice/jobs/{running['id']}")[1]
        assert lost["state"] == "lost" and "gateway stopped" in lost["error"]
        done = wait(gw, queued)
        assert done["state"] == "succeeded" and done["patch"]["files"] == ["after.txt"]
        lost = wait(gw, running)
        assert lost["stdout_tail"] == "started\n"
        assert lost["patch"]["files"] == ["p.txt"] and lost["patch"]["partial"] is True
    finally:
        gw.stop()


# --- delete, scoping ---------------------------------------------------------------


def test_delete_removes_a_finished_job_and_refuses_a_running_one(gw):
    rel, _ = make_repo(gw)
    running = submit(gw, {"kind": "command", "from": rel, "command": "sleep 31346"})
    assert wait_until(lambda: state(gw, running) == "running")
    status, body = gw.client.call("DELETE", f"/v1/agents/alice/jobs/{running['id']}")
    assert status == 409 and body["error"]["code"] == "job_active"
    gw.client.call("POST", f"/v1/agents/alice/jobs/{running['id']}/cancel")
    workspace = wait(gw, running)["workspace"]
    assert os.path.isdir(workspace)
    status, body = gw.client.call("DELETE", f"/v1/agents/alice/jobs/{running['id']}")
    assert status == 200 and body == {"deleted": running["id"]}
    assert not os.path.exists(workspace)
    assert gw.client.call("GET", f"/v1/agents/alice/jobs/{running['id']}")[0] == 404


def test_agent_socket_reaches_only_its_own_jobs(gw):
    rel, _ = make_repo(gw, "bob")
    bob = gw.agent_client("bob")
    job = wait(gw, submit(gw, {"kind": "command", "from": rel, "command": "true"}, agent="me", client=bob), "bob")
    assert job["state"] == "succeeded"
    assert bob.call("GET", f"/v1/agents/me/jobs/{job['id']}")[0] == 200
    status, body = bob.call("GET", "/v1/agents/alice/jobs")
    assert status == 403 and body["error"]["code"] == "forbidden"
    status, body = gw.agent_client("alice").call("GET", f"/v1/agents/me/jobs/{job['id']}")
    assert status == 404 and body["error"]["code"] == "unknown_job"


# --- bad input ------------------------------------------------------------------------


BAD_REQUESTS = [
    ({"kind": "python", "from": "R", "command": "x"}, 400, "invalid_kind"),
    ({"from": "R", "command": "x"}, 400, "invalid_kind"),
    ({"kind": "command", "command": "x"}, 400, "missing_field"),
    ({"kind": "command", "from": "../bob/user-files", "command": "x"}, 403, "outside_workspace"),
    ({"kind": "command", "from": "/etc", "command": "x"}, 403, "outside_workspace"),
    ({"kind": "command", "from": "R/../../../..", "command": "x"}, 403, "outside_workspace"),
    ({"kind": "command", "from": "user-files/out", "command": "x"}, 403, "outside_workspace"),
    ({"kind": "command", "from": ".", "command": "x"}, 400, "invalid_from"),
    ({"kind": "command", "from": "jobs", "command": "x"}, 400, "invalid_from"),
    ({"kind": "command", "from": "R/README.md", "command": "x"}, 400, "invalid_from"),
    ({"kind": "command", "from": "user-files/missing", "command": "x"}, 400, "invalid_from"),
    ({"kind": "command", "from": 7, "command": "x"}, 400, "invalid_from"),
    ({"kind": "command", "from": "R"}, 400, "bad_request"),
    ({"kind": "command", "from": "R", "command": "x", "argv": ["x"]}, 400, "bad_request"),
    ({"kind": "command", "from": "R", "command": ""}, 400, "bad_request"),
    ({"kind": "command", "from": "R", "argv": "ls"}, 400, "bad_request"),
    ({"kind": "command", "from": "R", "command": "x", "objective": "y"}, 400, "bad_request"),
    ({"kind": "codex", "from": "R", "command": "x"}, 400, "bad_request"),
    ({"kind": "command", "from": "R", "command": "x", "limits": {"wall": "3h"}}, 400, "limit_too_high"),
    ({"kind": "command", "from": "R", "command": "x", "limits": {"processes": 100000}}, 400, "limit_too_high"),
    ({"kind": "command", "from": "R", "command": "x", "limits": {"memory": "64G"}}, 400, "limit_too_high"),
    ({"kind": "command", "from": "R", "command": "x", "limits": {"wall": None}}, 400, "limit_too_high"),
    ({"kind": "command", "from": "R", "command": "x", "limits": {"wall": "soon"}}, 400, "invalid_limit"),
    ({"kind": "command", "from": "R", "command": "x", "limits": {"wall": 0}}, 400, "invalid_limit"),
    ({"kind": "command", "from": "R", "command": "x", "limits": {"disk": "1G"}}, 400, "unknown_limit"),
    ({"kind": "command", "from": "R", "command": "x", "limits": []}, 400, "bad_request"),
    ({"kind": "command", "from": "R", "command": "x", "env": {"HOME": "/"}}, 400, "reserved_env"),
    ({"kind": "command", "from": "R", "command": "x", "env": {"A=B": "c"}}, 400, "bad_request"),
    ({"kind": "command", "from": "R", "command": "x", "env": {"A": 1}}, 400, "bad_request"),
    ({"kind": "command", "from": "R", "command": "x", "nice": 5}, 400, "unknown_field"),
]


@pytest.mark.parametrize("body, status, code", BAD_REQUESTS)
def test_bad_job_requests_are_refused_and_create_nothing(gw, body, status, code):
    rel, repo = make_repo(gw)
    out = pathlib.Path(gw.root) / "alice" / "user-files" / "out"
    if not out.is_symlink():
        out.symlink_to(gw.state)
    body = {k: (v.replace("R", rel, 1) if isinstance(v, str) and v.startswith("R") else v) for k, v in body.items()}
    jobs_before = gw.client.call("GET", "/v1/agents/alice/jobs")[1]["jobs"]
    workspaces = sorted(os.listdir(os.path.join(gw.root, "alice", "jobs")))
    got, error = gw.client.call("POST", "/v1/agents/alice/jobs", body)
    assert (got, error["error"]["code"]) == (status, code), error
    assert error["error"]["message"]
    assert gw.client.call("GET", "/v1/agents/alice/jobs")[1]["jobs"] == jobs_before
    assert sorted(os.listdir(os.path.join(gw.root, "alice", "jobs"))) == workspaces


def test_malformed_bodies_and_bad_ids(gw):
    for raw in (b"not json", b"[1]", b'"x"'):
        status, body = gw.client.call("POST", "/v1/agents/alice/jobs", raw=raw)
        assert status == 400 and body["error"]["code"] == "malformed_json", raw
    for bad in ("..", "%2e%2e", "ABCDEF012345", "123", "..%2f..%2fstate", "0123456789abc"):
        for method, suffix in (("GET", ""), ("GET", "/patch"), ("POST", "/apply"), ("POST", "/cancel"), ("DELETE", "")):
            status, body = gw.client.call(method, f"/v1/agents/alice/jobs/{bad}{suffix}")
            assert status in (400, 404), (bad, suffix, status, body)
            assert isinstance(body, dict) and body["error"]["code"] in ("invalid_job_id", "no_route"), body
    status, body = gw.client.call("GET", "/v1/agents/alice/jobs/0123456789ab")
    assert status == 404 and body["error"]["code"] == "unknown_job"
    status, body = gw.client.call("GET", "/v1/agents/nobody/jobs")
    assert status == 404 and body["error"]["code"] == "unknown_agent"
    status, body = gw.client.call("POST", "/v1/agents/alice/jobs/0123456789ab/apply", {"force": True})
    assert status == 400 and body["error"]["code"] == "unknown_field"


# --- jlk ---------------------------------------------------------------------------


JLK = str(pathlib.Path(__file__).resolve().parent.parent / "skills" / "jupyter-live-kernel" / "scripts" / "jlk")


def jlk(gw, *args, agent="alice"):
    return subprocess.run(["python3", JLK, "--socket", gw.socket, "--agent", agent, *args],
                          capture_output=True, text=True, timeout=300)


def test_jlk_job_run_wait_patch_apply_and_exit_codes(gw, tmp_path):
    rel, repo = make_repo(gw, files={"calc.py": "def add(a, b):\n    return a - b\n"})
    ran = jlk(gw, "job", "run", "--from", rel, "--wait", "--command",
              "sed -i 's/a - b/a + b/' calc.py && python3 -c 'import calc; assert calc.add(2, 3) == 5' && echo tests pass")
    assert ran.returncode == 0, ran.stderr
    first = ran.stdout.splitlines()
    assert first[0].startswith("job ") and first[0].endswith(f" command succeeded (exit 0) from {rel}")
    assert "    calc.py" in first and "    tests pass" in first
    job_id = first[0].split()[1]

    patch = jlk(gw, "job", "patch", job_id)
    assert patch.returncode == 0 and patch.stdout.startswith("diff -ruN")
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(repo), str(copy)], check=True)
    subprocess.run(["patch", "-p1", "-s"], input=patch.stdout, text=True, cwd=copy, check=True)
    assert (copy / "calc.py").read_text() == "def add(a, b):\n    return a + b\n"

    applied = jlk(gw, "job", "apply", job_id)
    assert applied.returncode == 0 and applied.stdout == f"applied job {job_id}: 1 file(s)\n    calc.py\n"
    again = jlk(gw, "job", "apply", job_id)
    assert again.returncode == 2 and "was applied already" in again.stderr

    failed = jlk(gw, "job", "run", "--from", rel, "--wait", "--command", "exit 7")
    assert failed.returncode == 1 and "failed (exit 7)" in failed.stdout
    timed = jlk(gw, "job", "run", "--from", rel, "--wait", "--wall", "1", "--command", "sleep 60")
    assert timed.returncode == 124 and "timed_out" in timed.stdout
    listed = jlk(gw, "job", "list")
    assert listed.returncode == 0 and listed.stdout.split()[:6] == ["id", "kind", "state", "from", "age", "files"]

    started = jlk(gw, "job", "run", "--from", rel, "--command", "sleep 31347")
    assert started.returncode == 0, started.stderr
    started_id = started.stdout.split()[1]
    assert jlk(gw, "job", "cancel", started_id).returncode == 0
    assert jlk(gw, "job", "wait", started_id).returncode == 6


def test_jlk_a_failed_job_says_it_failed_and_what_to_look_at_first(gw):
    rel, _repo = make_repo(gw, files={"calc.py": "def add(a, b):\n    return a - b\n"})
    failed = jlk(gw, "job", "run", "--from", rel, "--wait", "--command",
                 "sed -i 's/a - b/a * b/' calc.py; echo 'AssertionError: add(2, 3) is 6' >&2; exit 7")
    assert failed.returncode == 1
    lines = failed.stdout.splitlines()
    job_id = lines[0].split()[1]
    assert "    AssertionError: add(2, 3) is 6" in lines  # its stderr, shown
    assert f"review: jlk job patch {job_id}; then: jlk job apply {job_id}" not in lines  # as after a success
    advice = lines[lines.index("the job failed: its command exited 7."):]
    assert advice[1] == (f"look first at its stderr above; all of it: `jlk read --path jobs/{job_id}/stderr.log` "
                         f"(and jobs/{job_id}/stdout.log)")
    assert advice[2].startswith(f"its patch is partial, what it changed before it ended: `jlk job patch {job_id}`")
    # The log it names is there for `jlk read`.
    log = jlk(gw, "read", "--path", f"jobs/{job_id}/stderr.log")
    assert (log.returncode, log.stdout) == (0, "AssertionError: add(2, 3) is 6\n")

    silent = jlk(gw, "job", "run", "--from", rel, "--wait", "--command", "exit 3")
    assert silent.returncode == 1
    assert silent.stdout.splitlines()[-2:] == [
        f"it printed nothing; its logs: `jlk read --path jobs/{silent.stdout.split()[1]}/stderr.log` "
        f"(and jobs/{silent.stdout.split()[1]}/stdout.log)",
        "fix the cause and run it again: `jlk job run --from DIR ...`",
    ]


def test_jlk_job_refusals_speak_of_options_not_http(gw):
    rel, _repo = make_repo(gw, files={"a.txt": "a\n"})
    for args, hint in (
        (["job", "show", "0123456789ab"], "`jlk job list` lists your jobs"),
        (["job", "apply", "nothex"], "`jlk job list` lists your jobs"),
        (["job", "run", "--from", "user-files/none", "--command", "true"], "--from names a directory"),
    ):
        done = jlk(gw, *args)
        assert done.returncode == 2, (args, done.stderr)
        assert f"hint: " in done.stderr and hint in done.stderr, (args, done.stderr)
        for http in ("GET ", "POST ", ".../", "/v1/", "'from'"):
            assert http not in done.stderr, (args, done.stderr)
    started = jlk(gw, "job", "run", "--from", rel, "--command", "sleep 31347")
    started_id = started.stdout.split()[1]
    try:
        early = jlk(gw, "job", "apply", started_id)
        assert early.returncode == 2 and "hint: wait until it ends: `jlk job wait ID`" in early.stderr
    finally:
        assert jlk(gw, "job", "cancel", started_id).returncode == 0


def test_jlk_job_bad_usage(gw):
    for args, message in ((["job", "show"], "needs the job's id"),
                          (["job", "run", "--from", "user-files"], "--command LINE"),
                          (["job", "run", "--from", "x", "--command", "a", "--objective", "b"], "one of them"),
                          (["job", "show", "nothex"], "invalid job id")):
        done = jlk(gw, *args)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)


# --- operator configuration ----------------------------------------------------------


def test_an_agents_own_job_profile_sets_its_limits(tmp_path):
    profile = json.loads((pathlib.Path(__file__).resolve().parent.parent / "kernel_gateway" / "sandbox" /
                          "profiles" / "job.json").read_text())
    profile["limits"]["wall"] = "5s"
    path = tmp_path / "short-job.json"
    path.write_text(json.dumps(profile))
    gw = GatewayProcess(tmp_path, f"--Gateway.agent_profiles={json.dumps({'alice': {'job': str(path)}})}").start()
    try:
        for agent in ("alice", "bob"):
            gw.client.call("PUT", f"/v1/agents/{agent}")
        rel, _ = make_repo(gw)
        status, body = gw.client.call("POST", "/v1/agents/alice/jobs",
                                      {"kind": "command", "from": rel, "command": "true", "limits": {"wall": "10s"}})
        assert status == 400 and body["error"]["message"] == "limits.wall 10s is above the job profile's 5s"
        job = wait(gw, submit(gw, {"kind": "command", "from": rel, "command": "true"}))
        assert job["limits"]["wall"] == 5.0 and job["state"] == "succeeded"
        rel_b, _ = make_repo(gw, "bob")
        assert submit(gw, {"kind": "command", "from": rel_b, "command": "true"}, agent="bob")["limits"]["wall"] == 7200.0
    finally:
        gw.stop()


@pytest.mark.parametrize("option, message", [
    ('--Gateway.model_profiles={"heavy": {"model": "m"}}', "'base_url' must be a non-empty string"),
    ('--Gateway.model_profiles={"heavy": {"model": "m", "base_url": "ftp://x"}}', "base_url must be an http(s) URL"),
    ('--Gateway.model_profiles={"heavy": {"model": "m", "base_url": "http://x", "wire_api": "chat"}}',
     "wire_api must be 'responses'"),
    ('--Gateway.model_profiles={"heavy": {"model": "m", "base_url": "http://x", "key": "sk-1"}}', "unknown field 'key'"),
    ('--Gateway.agent_profiles={"alice": {"jobs": "x"}}', "must map 'kernel', 'command' and/or 'job'"),
    ("--Gateway.job_profile=/nonexistent.json", "cannot read /nonexistent.json"),
])
def test_bad_job_settings_stop_the_gateway_at_start(tmp_path, option, message):
    done = subprocess.run([os.path.join(os.path.dirname(sys.executable), "kernel-gateway"), "serve",
                           "--root", str(tmp_path / "agents"), "--state-dir", str(tmp_path / "state"), option],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and message in done.stderr, done.stderr


def test_codex_jobs_need_a_codex_binary(tmp_path, monkeypatch):
    models = {"heavy": {"model": "gpt-5-codex", "base_url": "http://127.0.0.1:9/v1", "env_key": "SOME_KEY"}}
    gw = GatewayProcess(tmp_path, f"--Gateway.model_profiles={json.dumps(models)}",
                        "--Gateway.codex_command=/nonexistent/codex").start()
    try:
        gw.client.call("PUT", "/v1/agents/alice")
        rel, _ = make_repo(gw)
        body = {"kind": "codex", "from": rel, "objective": "x"}
        status, error = gw.client.call("POST", "/v1/agents/alice/jobs", body)
        assert status == 409 and error["error"]["code"] == "model_key_missing"  # SOME_KEY is not set
    finally:
        gw.stop()
    monkeypatch.setenv("SOME_KEY", "k")
    gw.start()
    try:
        status, error = gw.client.call("POST", "/v1/agents/alice/jobs", body)
        assert status == 409 and error["error"]["code"] == "codex_unavailable"
        assert gw.client.call("GET", "/v1/agents/alice/jobs")[1] == {"jobs": []}
        assert os.listdir(os.path.join(gw.root, "alice", "jobs")) == []
    finally:
        gw.stop()


def test_a_patch_over_the_limit_is_recorded_without_being_read(tmp_path):
    gw = GatewayProcess(tmp_path, "--Gateway.job_patch_limit=1000").start()
    try:
        gw.client.call("PUT", "/v1/agents/alice")
        rel, _ = make_repo(gw)
        job = wait(gw, submit(gw, {"kind": "command", "from": rel, "command": "seq 1000 > numbers.txt"}))
        assert job["state"] == "succeeded"
        assert job["patch"]["sha256"] is None and job["patch"]["bytes"] > 1000
        assert "over the limit of 1000 bytes" in job["patch"]["error"]
        status, body = gw.client.call("GET", f"/v1/agents/alice/jobs/{job['id']}/patch")
        assert status == 409 and body["error"]["code"] == "no_patch"
        status, body = gw.client.call("POST", f"/v1/agents/alice/jobs/{job['id']}/apply")
        assert status == 409 and body["error"]["code"] == "no_patch"
    finally:
        gw.stop()


def test_full_logs_stay_in_the_workspace_bounded_by_the_file_size_limit(gw):
    rel, _ = make_repo(gw)
    job = wait(gw, submit(gw, {"kind": "command", "from": rel, "limits": {"file_size": "1M"},
                               "command": "echo to-stderr >&2; head -c 3000000 /dev/zero | tr '\\0' x"}))
    assert job["state"] == "failed" and job["exit_code"] == 153  # tr got SIGXFSZ at the limit
    log = pathlib.Path(job["workspace"]) / "stdout.log"
    assert log.stat().st_size == 1 << 20
    assert job["stdout_tail"] == "x" * 4096 and job["stderr_tail"].startswith("to-stderr\n")


def test_apply_into_an_unwritable_file_or_directory_is_409_and_changes_nothing(gw):
    rel, repo = make_repo(gw, files={"a.txt": "one\n", "locked/b.txt": "two\n", "c.txt": "three\n"})
    job = wait(gw, submit(gw, {"kind": "command", "from": rel,
                               "command": "echo ONE > a.txt; echo TWO > locked/b.txt; echo new > locked/new.txt; rm c.txt"}))
    # The agent made a directory read-only after the job copied it (its own tree, its own choice).
    os.chmod(repo / "locked", 0o555)
    try:
        before = tree_digest(str(repo))
        status, body = gw.client.call("POST", f"/v1/agents/alice/jobs/{job['id']}/apply")
        assert status == 409 and body["error"]["code"] == "target_not_writable", body
        assert "locked/b.txt" in body["error"]["message"] and "locked/new.txt" in body["error"]["message"]
        assert "a.txt," not in body["error"]["message"]
        assert tree_digest(str(repo)) == before  # a.txt and c.txt untouched too
        assert gw.client.call("GET", f"/v1/agents/alice/jobs/{job['id']}")[1]["applied"] is None
    finally:
        os.chmod(repo / "locked", 0o755)
    # Writable again: the same apply goes through, whole.
    status, body = gw.client.call("POST", f"/v1/agents/alice/jobs/{job['id']}/apply")
    assert status == 200, body
    assert (repo / "locked/b.txt").read_text() == "TWO\n" and (repo / "locked/new.txt").read_text() == "new\n"
    assert (repo / "a.txt").read_text() == "ONE\n" and not (repo / "c.txt").exists()


def _own(gw, path, agent: str = "alice") -> None:
    owner = os.stat(pathlib.Path(gw.root) / agent)
    os.chown(path, owner.st_uid, owner.st_gid, follow_symlinks=False)


def test_apply_is_not_misled_by_a_file_planted_where_it_stages_the_patch(gw):
    rel, repo = make_repo(gw, files={"a.txt": "one\n"})
    job = wait(gw, submit(gw, {"kind": "command", "from": rel, "command": "echo ONE > a.txt"}))
    # The agent owns the job's directory: it can put anything at any fixed name there first
    # (the apply's shell always has pid 2 in its sandbox).
    for pid in range(1, 8):
        planted = pathlib.Path(job["workspace"]) / "temp" / f"apply-{pid}.patch"
        planted.mkdir(parents=True)
        _own(gw, planted)
    status, body = gw.client.call("POST", f"/v1/agents/alice/jobs/{job['id']}/apply")
    assert status == 200 and body["applied"] is True, body
    assert (repo / "a.txt").read_text() == "ONE\n"


@pytest.mark.parametrize("swap", ["symlinked_directory", "symlinked_binary_file", "fifo"])
def test_apply_over_a_file_or_directory_swapped_for_something_else_is_409_and_changes_nothing(gw, swap):
    files = {"a.txt": "one\n", "sub/b.txt": "two\n", "other/b.txt": "two\n", "sub/z.bin": b"\0z", "other/z.bin": b"\0z"}
    rel, repo = make_repo(gw, agent="bob", files=files)
    change = "echo ONE > a.txt; echo TWO > sub/b.txt; printf '\\000Z' > sub/z.bin"
    job = wait(gw, submit(gw, {"kind": "command", "from": rel, "command": change}, agent="bob"), agent="bob")
    assert job["patch"]["binary_files"] == ["sub/z.bin"], job
    if swap == "fifo":  # cmp would wait for a writer until the command's wall limit
        os.unlink(repo / "sub/b.txt")
        os.mkfifo(repo / "sub/b.txt")
        _own(gw, repo / "sub/b.txt", "bob")
    elif swap == "symlinked_directory":  # same content behind it; patch refuses such a name part-way
        for name in os.listdir(repo / "sub"):
            os.unlink(repo / "sub" / name)
        os.rmdir(repo / "sub")
        os.symlink("other", repo / "sub")
        _own(gw, repo / "sub", "bob")
    else:  # same content behind it; cp would write through it into other/
        os.unlink(repo / "sub/z.bin")
        os.symlink("../other/z.bin", repo / "sub/z.bin")
        _own(gw, repo / "sub/z.bin", "bob")
    swapped = "sub/z.bin" if swap == "symlinked_binary_file" else "sub/b.txt"
    before = tree_digest(str(repo))
    status, body = gw.client.call("POST", f"/v1/agents/bob/jobs/{job['id']}/apply", timeout=60)
    assert status == 409 and body["error"]["code"] == "source_changed", body
    assert swapped in body["error"]["message"] and "a.txt," not in body["error"]["message"], body
    assert tree_digest(str(repo)) == before and (repo / "a.txt").read_text() == "one\n"


@pytest.mark.parametrize("swap", ["unreadable", "fifo"])
def test_apply_when_a_binary_file_in_the_jobs_tree_changed_is_409_and_changes_nothing(gw, swap):
    rel, repo = make_repo(gw, files={"a.txt": "one\n", "z.bin": b"\0z"})
    job = wait(gw, submit(gw, {"kind": "command", "from": rel, "command": "echo ONE > a.txt; printf '\\000Z' > z.bin"}))
    assert job["patch"]["binary_files"] == ["z.bin"], job
    # The job's tree/ is the agent's: after the job it can change it like any of its files.
    carried = pathlib.Path(job["workspace"]) / "tree" / "z.bin"
    if swap == "unreadable":  # cp would fail after a.txt was patched
        os.chmod(carried, 0)
    else:  # not a regular file: the source's z.bin would be deleted instead
        os.unlink(carried)
        os.mkfifo(carried)
        _own(gw, carried)
    before = tree_digest(str(repo))
    status, body = gw.client.call("POST", f"/v1/agents/alice/jobs/{job['id']}/apply")
    assert status == 409 and body["error"]["code"] == "job_tree_changed" and "z.bin" in body["error"]["message"], body
    assert tree_digest(str(repo)) == before and (repo / "z.bin").read_bytes() == b"\0z"
