"""Bad input that used to get a 500 now gets a clear 4xx, on every handler family, with nothing changed.

A real gateway with its Jupyter TCP port; every request is really sent.  Each
case was a 500 before (nested bodies on Jupyter and Library routes, a newline
in a contents path, a folder renamed into itself, a kernel or session started
in a missing folder, a job workspace the agent made read-only); each is now a
4xx in the error shape of its family, nothing outside what the agent may write
changes, the control socket answers and another agent is served.  The
variables cases (a kernel that refuses inspection) are in test_hostile_replies.
"""

from __future__ import annotations

import http.client
import json
import os

import pytest

from jupyter_support import JupyterClient
from support import GatewayProcess

DEEP_ARRAY = b"[" * 5000 + b"]" * 5000
DEEP_OBJECT = b'{"a":' * 5000 + b"1" + b"}" * 5000
SHALLOW_BUT_65 = json.dumps({"path": json.loads("[" * 64 + "]" * 64)}).encode()
HOSTILE_BODIES = {"deep array": DEEP_ARRAY, "deep object": DEEP_OBJECT, "65 levels": SHALLOW_BUT_65,
                  "NaN": b'{"name": NaN}', "lone surrogate": b'{"name": "\\ud800"}', "not UTF-8": b'{"name": "\xff"}'}


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    gateway = GatewayProcess(tmp_path_factory.mktemp("refusals"), "--jupyter-port", "0",
                             "--Gateway.spare_kernels=False").start()
    for agent in ("alice", "bob"):
        assert gateway.client.call("PUT", f"/v1/agents/{agent}")[0] == 201
    yield gateway
    gateway.stop()


@pytest.fixture(scope="module")
def alice(gw) -> JupyterClient:
    status, token = gw.client.call("POST", "/v1/agents/alice/tokens")
    assert status == 201, token
    return JupyterClient(token["url"], token["token"])


def snapshot(root: str) -> dict[str, tuple[int, int]]:
    found = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            st = os.lstat(os.path.join(d, n))
            found[os.path.join(d, n)] = (st.st_mode, st.st_size if not os.path.isdir(os.path.join(d, n)) else 0)
    return found


def still_served(gw) -> None:
    assert gw.client.call("GET", "/v1/info", timeout=10)[0] == 200
    status, body = gw.client.execute("bob", "s1", "'bob served'")
    assert status == 200 and body["text"] == "'bob served'\n", body


def jupyter_error(status: int, body, expected_status: int) -> None:
    assert status == expected_status, (status, body)
    assert set(body["error"]) == {"code", "message", "hint"} and body["error"]["message"], body
    assert body["message"] == body["error"]["message"] and body["reason"], body  # Jupyter's fields beside ours


JUPYTER_BODY_ROUTES = [("POST", "api/kernels"), ("POST", "api/sessions"), ("PUT", "api/contents/user-files/n.txt"),
                       ("POST", "api/contents/user-files"), ("PATCH", "api/contents/user-files/d")]


@pytest.mark.parametrize("what", list(HOSTILE_BODIES))
def test_hostile_bodies_on_jupyter_routes_are_400s_in_jupyters_shape(gw, alice, what):
    before = snapshot(gw.root)
    for method, path in JUPYTER_BODY_ROUTES:
        status, body = alice.call(method, path, raw=HOSTILE_BODIES[what], headers={"Content-Type": "application/json"})
        jupyter_error(status, body, 400)
        assert body["error"]["code"] == "malformed_json", (method, path, body)
    # The same routes on the agent's own socket: the same parser.
    status, body = gw.agent_client("alice").call("POST", "/agents/me/api/kernels", raw=HOSTILE_BODIES[what])
    jupyter_error(status, body, 400)
    assert snapshot(gw.root) == before
    assert alice.call("GET", "api/kernels")[1] == []  # no kernel was started
    still_served(gw)


@pytest.mark.parametrize("what", list(HOSTILE_BODIES))
def test_hostile_bodies_on_library_job_and_token_routes_are_400s(gw, what):
    before = snapshot(gw.root)
    raw = HOSTILE_BODIES[what]
    json_type = {"Content-Type": "application/json"}
    for method, path, headers in [
        ("PUT", "/v1/agents/alice/skills/mine", json_type),
        ("PATCH", "/v1/agents/alice/skills/jupyter-live-kernel", {}),
        ("PUT", "/v1/agents/alice/documents/SOUL.md", json_type),
        ("POST", "/v1/agents/alice/jobs", {}),
        ("POST", "/v1/agents/alice/tokens", {}),
        ("PUT", "/v1/agents/alice", {}),
    ]:
        status, body = gw.client.call(method, path, raw=raw, headers=headers)
        assert status == 400 and body["error"]["code"] == "malformed_json", (method, path, status, body)
    assert gw.client.call("GET", "/v1/agents/alice/jobs")[1]["jobs"] == []
    assert snapshot(gw.root) == before
    still_served(gw)


def location_of(alice: JupyterClient, method: str, path: str, body: dict) -> tuple[int, str | None, dict]:
    conn = http.client.HTTPConnection(alice.host, alice.port, timeout=60)
    conn.request(method, alice.prefix + path, body=json.dumps(body).encode(),
                 headers={"Authorization": f"token {alice.token}"})
    response = conn.getresponse()
    answer = json.loads(response.read())
    conn.close()
    return response.status, response.getheader("Location"), answer


@pytest.mark.parametrize("name", ["a\nb.txt", "tab\there.txt", "cr\rlf.txt", "nul-ish \x7f.txt"])
def test_control_characters_in_a_contents_path_are_encoded_in_location(gw, alice, name):
    quoted = "".join(c if c.isalnum() or c in "._-" else "%{:02X}".format(ord(c)) for c in name)
    status, location, model = location_of(alice, "PUT", f"api/contents/user-files/{quoted}",
                                          {"type": "file", "format": "text", "content": "x"})
    assert status == 201 and model["name"] == name, model
    assert location == f"/agents/alice/api/contents/user-files/{quoted}", location
    assert open(os.path.join(gw.root, "alice", "user-files", name)).read() == "x"
    status, location, model = location_of(alice, "PATCH", f"api/contents/user-files/{quoted}",
                                          {"path": f"user-files/moved-{name}"})
    assert status == 200 and location.endswith("/user-files/moved-" + quoted), (status, location, model)
    status, location, _ = location_of(alice, "POST", f"api/contents/user-files/moved-{quoted}/checkpoints", {})
    assert status == 201 and "\n" not in location and "/checkpoints/" in location, location
    assert alice.call("DELETE", f"api/contents/user-files/moved-{quoted}")[0] == 204
    still_served(gw)


def test_a_folder_renamed_into_itself_is_a_400(gw, alice):
    assert alice.call("PUT", "api/contents/user-files/folder", {"type": "directory"})[0] == 201
    assert alice.call("PUT", "api/contents/user-files/folder/inner", {"type": "directory"})[0] == 201
    before = snapshot(gw.root)
    for target in ("user-files/folder/inner/folder", "user-files/folder/new", "/user-files/folder/x/y"):
        status, body = alice.call("PATCH", "api/contents/user-files/folder", {"path": target})
        jupyter_error(status, body, 400)
    # Through a symlink inside the tree, the same move: refused by the rename itself, still no 500.
    os.symlink("folder/inner", os.path.join(gw.root, "alice", "user-files", "via"))
    status, body = alice.call("PATCH", "api/contents/user-files/folder", {"path": "user-files/via/folder"})
    assert 400 <= status < 500, (status, body)
    os.unlink(os.path.join(gw.root, "alice", "user-files", "via"))
    assert snapshot(gw.root) == before
    still_served(gw)


@pytest.mark.parametrize("route,body", [
    ("api/kernels", {"name": "python3", "path": "user-files/missing/x.ipynb"}),
    ("api/kernels", {"name": "python3", "path": "nowhere/at/all"}),
    ("api/sessions", {"path": "user-files/missing/y.ipynb", "type": "notebook", "name": "y", "kernel": {"name": "python3"}}),
    ("api/sessions", {"path": "gone/console-1", "type": "console", "name": "c", "kernel": {"name": "python3"}}),
])
def test_a_kernel_started_in_a_missing_folder_is_a_404(gw, alice, route, body):
    before = snapshot(gw.root)
    status, answer = alice.call("POST", route, body)
    jupyter_error(status, answer, 404)
    assert answer["error"]["code"] == "no_such_directory", answer
    assert alice.call("GET", "api/kernels")[1] == []
    assert snapshot(gw.root) == before
    still_served(gw)


@pytest.mark.parametrize("made_read_only", ["the workspace", "its files"])
def test_a_job_workspace_the_agent_made_read_only_is_still_deleted(gw, made_read_only):
    status, job = gw.client.call("POST", "/v1/agents/alice/jobs",
                                 {"kind": "command", "from": "user-files", "command": "echo hi > job-made.txt"})
    assert status == 201, job
    status, done = gw.client.call("GET", f"/v1/agents/alice/jobs/{job['id']}?wait=1")
    assert status == 200 and done["state"] == "succeeded", done
    target = f"jobs/{job['id']}" if made_read_only == "the workspace" else f"jobs/{job['id']}/tree"
    # The agent, in its own sandbox, takes the write bits away.
    status, ran = gw.client.call("POST", "/v1/agents/alice/commands", {"command": f"chmod -R a-w {target}"})
    assert status == 200 and ran["exit_code"] == 0, ran
    outside = {k: v for k, v in snapshot(gw.root).items() if f"/jobs/{job['id']}" not in k}
    status, body = gw.client.call("DELETE", f"/v1/agents/alice/jobs/{job['id']}")
    assert status == 200 and body == {"deleted": job["id"]}, body
    assert not os.path.exists(os.path.join(gw.root, "alice", "jobs", job["id"]))
    assert snapshot(gw.root) == outside
    still_served(gw)


def test_a_job_workspace_the_agent_cannot_free_is_a_409(gw):
    """A file in the workspace that the agent does not own (made so from the host) cannot go: 409."""
    status, job = gw.client.call("POST", "/v1/agents/alice/jobs",
                                 {"kind": "command", "from": "user-files", "command": "true"})
    assert status == 201, job
    assert gw.client.call("GET", f"/v1/agents/alice/jobs/{job['id']}?wait=1")[1]["state"] == "succeeded"
    stuck = os.path.join(gw.root, "alice", "jobs", job["id"], "root-owned")
    os.mkdir(stuck)
    open(os.path.join(stuck, "f"), "w").close()
    os.chown(stuck, 0, 0)
    os.chmod(stuck, 0o755)
    try:
        status, body = gw.client.call("DELETE", f"/v1/agents/alice/jobs/{job['id']}")
        assert status == 409 and body["error"]["code"] == "remove_failed", body
        assert len(body["error"]["message"]) < 1000 and body["error"]["hint"], body
        assert os.path.exists(os.path.join(stuck, "f"))
    finally:
        os.unlink(os.path.join(stuck, "f"))
        os.rmdir(stuck)
    assert gw.client.call("DELETE", f"/v1/agents/alice/jobs/{job['id']}")[0] == 200
    still_served(gw)
