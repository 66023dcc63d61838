"""command, read_file, apply_patch, notebooks and variables through the real sockets."""

from __future__ import annotations

import hashlib
import json
import os
import urllib.parse

import pytest




def tree_digest(root: str) -> str:
    """A digest of every path and file content under root: 'nothing changed' made checkable."""
    h = hashlib.sha256()
    for top, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(top, name)
            h.update(path.encode())
            if os.path.isfile(path) and not os.path.islink(path):
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def test_command_runs_in_the_agents_workspace(gw):
    status, body = gw.client.call("POST", "/v1/agents/alice/commands", {"command": "pwd; id -u; ls " + gw.root})
    assert status == 200
    assert body["stdout"].split() == [os.path.join(gw.root, "alice"), "1000", "alice"]
    assert body["exit_code"] == 0 and body["timed_out"] is False


def test_command_streams_ndjson(gw):
    events = list(gw.client.stream("/v1/agents/alice/commands", {"command": "echo one; echo two >&2", "stream": True}))
    assert events[-1]["event"] == "result" and events[-1]["exit_code"] == 0
    outputs = [e["output"] for e in events if e["event"] == "output"]
    assert {"type": "stdout", "text": "one\n"} in outputs


def test_jlk_inside_a_command_reaches_only_its_own_agent(gw):
    gw.client.execute("alice", "default", "secret = 7")
    ok = gw.client.call("POST", "/v1/agents/alice/commands", {"command": "jlk execute --code 'print(secret * 6)'"})[1]
    assert ok["exit_code"] == 0, ok
    assert ok["stdout"] == "42\n"
    other = gw.client.call(
        "POST", "/v1/agents/alice/commands", {"command": "jlk --agent bob execute --code 'print(1)'"}
    )[1]
    assert other["exit_code"] != 0
    assert "out of reach" in other["stdout"] + other["stderr"]


def test_a_command_for_a_session_runs_where_its_kernel_does(gw):
    # The kernel writes with a relative path; the command for its session reads the same relative path.
    status, ran = gw.client.execute("alice", "rel", "open('made-by-kernel.txt', 'w').write('k')\nimport os\nprint(os.getcwd())")
    assert status == 200 and ran["status"] == "ok", ran
    kernel_cwd = ran["text"].strip()
    status, body = gw.client.call(
        "POST", "/v1/agents/alice/commands",
        {"command": 'pwd; cat made-by-kernel.txt; echo; echo "$JLK_SESSION"; echo "$KERNEL_GATEWAY_AGENT_ROOT"',
         "session": "rel"},
    )
    assert status == 200, body
    assert body["stdout"].splitlines() == [kernel_cwd, "k", "rel", os.path.join(gw.root, "alice")]
    # The kernel sees the same way to the agent root.
    status, ran = gw.client.execute("alice", "rel", "import os\nprint(os.environ['KERNEL_GATEWAY_AGENT_ROOT'])")
    assert ran["text"] == os.path.join(gw.root, "alice") + "\n"
    # An explicit cwd still wins, relative to the agent root.
    body = gw.client.call("POST", "/v1/agents/alice/commands", {"command": "pwd", "session": "rel", "cwd": "user-files"})[1]
    assert body["stdout"] == os.path.join(gw.root, "alice", "user-files") + "\n"
    # Without a session: the agent root, and no JLK_SESSION.
    body = gw.client.call("POST", "/v1/agents/alice/commands", {"command": 'pwd; echo "[$JLK_SESSION]"'})[1]
    assert body["stdout"] == os.path.join(gw.root, "alice") + "\n[]\n"


def test_a_command_for_a_session_without_a_kernel_starts_in_its_directory(gw):
    body = gw.client.call("POST", "/v1/agents/alice/commands", {"command": "pwd", "session": "not started"})[1]
    assert body["stdout"] == os.path.join(gw.root, "alice", "sessions", "bm90IHN0YXJ0ZWQ") + "\n"
    status, _ = gw.client.call("GET", "/v1/agents/alice/sessions/not%20started")
    assert status == 404  # a command starts no kernel


def test_a_command_for_a_notebooks_session_runs_in_the_notebooks_folder(gw):
    path = "/v1/agents/alice/notebooks/user-files/nbdir/cmd.ipynb"
    os.makedirs(os.path.join(gw.root, "alice", "user-files", "nbdir"), exist_ok=True)
    owner = os.stat(os.path.join(gw.root, "alice"))  # the agent's folder, as if it had made it
    os.chown(os.path.join(gw.root, "alice", "user-files", "nbdir"), owner.st_uid, owner.st_gid)
    gw.client.call("PUT", path, NOTEBOOK)
    cell = gw.client.call("POST", path + "/cells", {"index": 0, "source": "open('near.txt', 'w').write('n')"})[1]["id"]
    assert gw.client.call("POST", f"{path}/cells/{cell}/execute", {})[1]["status"] == "ok"
    body = gw.client.call(
        "POST", "/v1/agents/alice/commands", {"command": "pwd; cat near.txt", "session": "notebook:user-files/nbdir/cmd.ipynb"}
    )[1]
    assert body["stdout"] == os.path.join(gw.root, "alice", "user-files", "nbdir") + "\nn"
    # Before the notebook's kernel has started, too: where it will start.
    body = gw.client.call(
        "POST", "/v1/agents/alice/commands", {"command": "pwd", "session": "notebook:user-files/nbdir/other.ipynb"}
    )[1]
    assert body["stdout"] == os.path.join(gw.root, "alice", "user-files", "nbdir") + "\n"
    # A session id that only looks like one of another tree's notebooks runs in its own directory.
    body = gw.client.call(
        "POST", "/v1/agents/alice/commands", {"command": "pwd", "session": "notebook:../bob/x.ipynb"}
    )[1]
    assert body["stdout"].startswith(os.path.join(gw.root, "alice", "sessions") + "/")


def test_read_file_and_patch_round_trip(gw):
    patch = "*** Begin Patch\n*** Add File: user-files/notes.txt\n+alpha\n+beta\n*** End Patch\n"
    status, body = gw.client.call("POST", "/v1/agents/alice/patch", raw=patch.encode(), headers={"Content-Type": "text/plain"})
    assert status == 200 and body["ok"] and body["added"] == ["user-files/notes.txt"]
    assert body["output"] == "Success. Updated the following files:\nA user-files/notes.txt\n"
    status, body = gw.client.call("GET", "/v1/agents/alice/files?path=user-files/notes.txt&offset=2&limit=1")
    assert status == 200 and body["content"] == "beta\n" and body["total_lines"] == 2
    update = {"patch": "*** Begin Patch\n*** Update File: notes.txt\n@@\n-beta\n+gamma\n*** End Patch", "cwd": "user-files"}
    status, body = gw.client.call("POST", "/v1/agents/alice/patch", update)
    assert status == 200 and body["modified"] == ["notes.txt"]
    with open(os.path.join(gw.root, "alice", "user-files", "notes.txt")) as f:
        assert f.read() == "alpha\ngamma\n"


def test_failed_patch_is_422_with_the_reference_text(gw):
    patch = "*** Begin Patch\n*** Update File: user-files/missing.txt\n@@\n-a\n+b\n*** End Patch\n"
    before = tree_digest(os.path.join(gw.root, "alice"))
    status, body = gw.client.call("POST", "/v1/agents/alice/patch", raw=patch.encode())
    assert status == 422 and body["ok"] is False and "missing.txt" in body["output"]
    # The documented error shape, with apply_patch's own text as the message, byte for byte.
    assert body["error"] == {
        "code": "patch_failed",
        "message": body["output"],
        "hint": "nothing was changed; read the file again and send a corrected patch",
    }
    assert tree_digest(os.path.join(gw.root, "alice")) == before


def test_partly_applied_patch_says_so_in_its_hint(gw):
    patch = ("*** Begin Patch\n*** Add File: user-files/partial.txt\n+p\n"
             "*** Update File: user-files/missing.txt\n@@\n-a\n+b\n*** End Patch\n")
    status, body = gw.client.call("POST", "/v1/agents/alice/patch", raw=patch.encode())
    assert status == 422 and body["added"] == ["user-files/partial.txt"]
    assert body["error"]["code"] == "patch_failed" and body["error"]["message"] == body["output"]
    assert body["error"]["hint"].startswith("the hunks before the failing one were applied")
    os.unlink(os.path.join(gw.root, "alice", "user-files", "partial.txt"))


def test_agent_socket_tools_are_scoped(gw):
    alice = gw.agent_client("alice")
    assert alice.call("POST", "/v1/agents/me/commands", {"command": "true"})[0] == 200
    assert alice.call("POST", "/v1/agents/bob/commands", {"command": "touch /tmp/x"})[0] == 403
    assert alice.call("GET", "/v1/agents/bob/files?path=SOUL.md")[0] == 403
    assert alice.call("POST", "/v1/agents/bob/patch", raw=b"*** Begin Patch\n*** End Patch")[0] == 403
    assert alice.call("GET", "/v1/agents/bob/notebooks/x.ipynb")[0] == 403


NOTEBOOK = {"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}

BAD = [
    ("POST", "/v1/agents/alice/commands", {"command": 1}, 400),
    ("POST", "/v1/agents/alice/commands", {}, 400),
    ("POST", "/v1/agents/alice/commands", {"command": "touch x", "argv": ["touch", "y"]}, 400),
    ("POST", "/v1/agents/alice/commands", {"command": "touch x", "cwd": "../bob"}, 403),
    ("POST", "/v1/agents/alice/commands", {"command": "touch x", "timeout": -1}, 400),
    ("POST", "/v1/agents/alice/commands", {"command": "touch x", "env": {"A": 1}}, 400),
    ("POST", "/v1/agents/alice/commands", {"command": "touch x", "shell": True}, 400),
    ("POST", "/v1/agents/alice/commands", {"command": "touch x", "stream": "yes"}, 400),
    ("POST", "/v1/agents/alice/commands", {"command": "touch x", "session": 7}, 400),
    ("POST", "/v1/agents/alice/commands", {"command": "touch x", "session": "fresh", "timeout": -1}, 400),
    ("POST", "/v1/agents/alice/commands", {"command": "touch x", "session": "s" * 129}, 400),
    ("POST", "/v1/agents/alice/commands", {"command": "touch x", "session": "bad\nid"}, 400),
    ("GET", "/v1/agents/alice/files", None, 400),
    ("GET", "/v1/agents/alice/files?path=../bob/SOUL.md", None, 403),
    ("GET", "/v1/agents/alice/files?path=/etc/passwd", None, 403),
    ("GET", "/v1/agents/alice/files?path=user-files", None, 400),
    ("GET", "/v1/agents/alice/files?path=nope.txt", None, 404),
    ("GET", "/v1/agents/alice/files?path=SOUL.md&offset=0", None, 400),
    ("GET", "/v1/agents/alice/files?path=SOUL.md&limit=abc", None, 400),
    ("POST", "/v1/agents/alice/patch", b"", 400),
    ("POST", "/v1/agents/alice/patch", b"\xff\xfe not utf-8", 400),
    ("POST", "/v1/agents/alice/patch", b"*** Begin Patch\n*** Add File: ../bob/x\n+x\n*** End Patch", 422),
    ("POST", "/v1/agents/alice/patch", b"*" * (10 << 20), 413),
    ("PUT", "/v1/agents/alice/notebooks/user-files/n.ipynb", b"{broken", 400),
    ("PUT", "/v1/agents/alice/notebooks/../bob/n.ipynb", NOTEBOOK, 403),
    ("GET", "/v1/agents/alice/notebooks/user-files/none.ipynb", None, 404),
    ("GET", "/v1/agents/alice/notebooks/user-files/notes.txt", None, 400),
    ("POST", "/v1/agents/alice/notebooks/user-files/book.ipynb/cells", {"index": 99, "source": "x"}, 400),
    ("POST", "/v1/agents/alice/notebooks/user-files/book.ipynb/cells", {"index": 0, "source": 5}, 400),
    ("PATCH", "/v1/agents/alice/notebooks/user-files/book.ipynb/cells/nope", {"source": "x"}, 404),
    ("POST", "/v1/agents/alice/notebooks/user-files/book.ipynb/cells/nope/move", {"to_index": 0}, 404),
    ("GET", "/v1/agents/alice/sessions/default/variables?limit=0", None, 400),
    ("GET", "/v1/agents/alice/sessions/default/variables/not_defined_anywhere", None, 404),
    ("GET", "/v1/agents/alice/sessions/nosuch/variables", None, 404),
]


@pytest.mark.parametrize("method,path,body,status", BAD)
def test_tool_bad_input_changes_nothing(gw, method, path, body, status):
    gw.client.call("PUT", "/v1/agents/alice/notebooks/user-files/book.ipynb", NOTEBOOK)
    gw.client.execute("alice", "default", "1")
    roots = [os.path.join(gw.root, a) for a in ("alice", "bob")]
    before = [tree_digest(r) for r in roots]
    raw = body if isinstance(body, bytes) else None
    got, reply = gw.client.call(method, path, None if raw is not None else body, raw=raw)
    assert got == status, reply
    assert reply["error"]["message"]
    if status == 422:
        assert reply["ok"] is False and reply["error"]["code"] == "patch_failed"
    assert [tree_digest(r) for r in roots] == before


def test_stale_etag_is_409_and_file_untouched(gw):
    path = "/v1/agents/alice/notebooks/user-files/etag.ipynb"
    etag = gw.client.call("PUT", path, NOTEBOOK)[1]["etag"]
    gw.client.call("POST", path + "/cells", {"index": 0, "source": "a = 1"})  # the etag is now stale
    on_disk = os.path.join(gw.root, "alice", "user-files", "etag.ipynb")
    before = open(on_disk, "rb").read()
    status, body = gw.client.call(
        "POST", path + "/cells", {"index": 0, "source": "b = 2"}, headers={"If-Match": etag}
    )
    assert status == 409 and body["error"]["code"] == "etag_mismatch"
    assert open(on_disk, "rb").read() == before


def test_notebook_cell_execute_saves_outputs(gw):
    path = "/v1/agents/alice/notebooks/user-files/run.ipynb"
    gw.client.call("PUT", path, NOTEBOOK)
    cell = gw.client.call("POST", path + "/cells", {"index": 0, "source": "print('saved')\n6 * 7"})[1]["id"]
    status, body = gw.client.call("POST", f"{path}/cells/{cell}/execute", {})
    assert status == 200 and body["status"] == "ok" and body["saved"] is True
    with open(os.path.join(gw.root, "alice", "user-files", "run.ipynb")) as f:
        saved = json.load(f)["cells"][0]
    assert saved["execution_count"] == body["execution_count"]
    streams = [o for o in saved["outputs"] if o["output_type"] == "stream"]
    assert "".join(streams[0]["text"]) == "saved\n"
    session = urllib.parse.quote("notebook:user-files/run.ipynb", safe="")
    status, info = gw.client.call("GET", f"/v1/agents/alice/sessions/{session}")
    assert status == 200
    # The notebook's own session works in the notebook's folder, as in Jupyter;
    # its spilled outputs and artifacts still go to the session directory.
    assert info["cwd"] == os.path.join(gw.root, "alice", "user-files")
    assert info["directory"].startswith(os.path.join(gw.root, "alice", "sessions") + "/")
    cwd_cell = gw.client.call("POST", path + "/cells", {"index": 1, "source": "import os\nprint(os.getcwd())\nprint('z' * 100_000)"})[1]["id"]
    body = gw.client.call("POST", f"{path}/cells/{cwd_cell}/execute", {})[1]
    assert body["text"].startswith(info["cwd"] + "\n")
    assert body["spill_paths"][0].startswith(os.path.join(info["directory"], "outputs") + "/")
