"""A kernel's messages are hostile: the paths, sizes and shapes in them.

A real gateway with real kernels in bwrap.  Each cell here does what a
malicious agent would do from inside its kernel (name host paths as
artifacts, plant symlinks and FIFOs, send raw iopub messages past the output
extension), and each check looks from the host: at the response bytes, the
gateway's memory, the other agent's tree and the saved notebook.
"""

from __future__ import annotations

import json
import os
import threading

import pytest

from support import RAW_IOPUB as RAW
from support import GatewayProcess, execute_ok as run, with_agents

ARTIFACT = "application/vnd.kernel-gateway.artifact+json"
SECRET = "kg-test-gateway-secret-5d1f"



@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    old = os.environ.get("KG_TEST_SECRET")
    os.environ["KG_TEST_SECRET"] = SECRET  # in the gateway's own /proc/self/environ
    try:
        gateway = with_agents(GatewayProcess(tmp_path_factory.mktemp("hostile")), "alice", "bob", "mallory")
    finally:
        if old is None:
            os.environ.pop("KG_TEST_SECRET")
        else:
            os.environ["KG_TEST_SECRET"] = old
    os.makedirs(os.path.join(gateway.root, "bob", "user-files"), exist_ok=True)
    with open(os.path.join(gateway.root, "bob", "user-files", "secret.txt"), "w") as f:
        f.write("bob-secret-9a7c")
    yield gateway
    gateway.stop()


def tree_listing(path: str) -> list:
    out = []
    for dirpath, dirnames, filenames in os.walk(path):
        out += [os.path.join(dirpath, n) for n in sorted(dirnames + filenames)]
    return sorted(out)


def show_artifact(path_expr: str, mime: str = "image/png", raw_message: bool = False) -> str:
    """A cell that names ``path_expr`` (Python) as an artifact of the given mime."""
    ref = f"{{'mime': {mime!r}, 'path': {path_expr}}}"
    if raw_message:
        return RAW + f"raw('display_data', {{'data': {{{ARTIFACT!r}: {ref}}}, 'metadata': {{}}}})"
    return f"from IPython.display import publish_display_data\npublish_display_data({{{ARTIFACT!r}: {ref}}})"


def shadow_line() -> str:
    with open("/etc/shadow") as f:
        return f.readline().strip()


@pytest.mark.parametrize("raw_message", [False, True], ids=["display", "raw-iopub"])
@pytest.mark.parametrize(
    "target",
    [
        "'/etc/shadow'",
        "'/proc/self/environ'",
        "'/proc/1/environ'",
        "{bob!r}",
        "os.path.join(os.environ['HOME'], '..', '..', '..', 'bob', 'user-files', 'secret.txt')",
        "'outputs/../../../../bob/user-files/secret.txt'",
    ],
    ids=["shadow", "gateway-environ", "pid1-environ", "other-agent", "dotdot", "relative"],
)
def test_host_paths_named_as_artifacts_are_never_read(gw, target, raw_message):
    bob = os.path.join(gw.root, "bob", "user-files", "secret.txt")
    code = "import os\n" + show_artifact(target.format(bob=bob), raw_message=raw_message)
    status, body = gw.client.execute("alice", "s1", code, inline_images=True)
    text = json.dumps(body)
    assert status == 200 and body["status"] == "ok", body
    for secret in (shadow_line(), SECRET, "bob-secret-9a7c"):
        assert secret not in text
    [output] = [o for o in body["outputs"] if o["output_type"] == "display_data"]
    assert "not_inlined" in output["data"][ARTIFACT]
    assert "not inlined" in body["text"]


def test_symlinks_in_the_own_tree_pointing_out_are_not_followed(gw):
    bob = os.path.join(gw.root, "bob", "user-files", "secret.txt")
    code = f"""
import os
out = os.path.join(os.environ["HOME"], "outputs"); os.makedirs(out, exist_ok=True)
for name, target in [("abs.png", {bob!r}), ("rel.png", "../../../../bob/user-files/secret.txt"),
                     ("shadow.png", "/etc/shadow"), ("own.png", "plain.png")]:
    p = os.path.join(out, name)
    if os.path.lexists(p): os.unlink(p)
    os.symlink(target, p)
open(os.path.join(out, "plain.png"), "wb").write(b"own bytes")
from IPython.display import publish_display_data
for name in ("abs.png", "rel.png", "shadow.png", "own.png"):
    publish_display_data({{{ARTIFACT!r}: {{"mime": "image/png", "path": os.path.join(out, name)}}}})
"""
    body = run(gw, code, session="links", inline_images=True)
    text = json.dumps(body)
    assert body["status"] == "ok", body["text"]
    assert "bob-secret-9a7c" not in text and shadow_line() not in text
    refs = [o["data"][ARTIFACT] for o in body["outputs"] if o["output_type"] == "display_data"]
    assert len(refs) == 4 and all("not_inlined" in ref for ref in refs)


def test_a_fifo_artifact_gets_a_clear_refusal_and_the_gateway_keeps_answering(gw):
    code = f"""
import os
out = os.path.join(os.environ["HOME"], "outputs"); os.makedirs(out, exist_ok=True)
fifo = os.path.join(out, "pipe.png")
if not os.path.exists(fifo): os.mkfifo(fifo)
from IPython.display import publish_display_data
publish_display_data({{{ARTIFACT!r}: {{"mime": "image/png", "path": fifo}}}})
import time; time.sleep(3)
"""
    result = {}
    worker = threading.Thread(target=lambda: result.update(body=run(gw, code, session="fifo", inline_images=True)))
    worker.start()
    # While that cell runs: the other agent executes and the control socket answers.
    assert run(gw, "print('bob ok')", agent="bob")["text"] == "bob ok\n"
    assert gw.client.call("GET", "/v1/info")[0] == 200
    worker.join(120)
    [ref] = [o["data"][ARTIFACT] for o in result["body"]["outputs"] if o["output_type"] == "display_data"]
    assert ref["not_inlined"] == "not a regular file"


def test_a_huge_artifact_is_refused_before_reading_and_the_response_stays_small(gw):
    code = """
import os
out = os.path.join(os.environ["HOME"], "outputs"); os.makedirs(out, exist_ok=True)
big = os.path.join(out, "big.png")
with open(big, "wb") as f: f.truncate(48 << 20)
from IPython.display import publish_display_data
publish_display_data({"%s": {"mime": "image/png", "path": big}})
""" % ARTIFACT
    status, body = gw.client.execute("alice", "huge", code, inline_images=True)
    assert status == 200 and len(json.dumps(body)) < 100_000
    [ref] = [o["data"][ARTIFACT] for o in body["outputs"] if o["output_type"] == "display_data"]
    assert "50331648 bytes" in ref["not_inlined"]


def test_a_non_utf8_svg_artifact_is_not_inlined_and_is_no_500(gw):
    code = """
import os
out = os.path.join(os.environ["HOME"], "outputs"); os.makedirs(out, exist_ok=True)
p = os.path.join(out, "bad.svg"); open(p, "wb").write(b"<svg>\\xff\\xfe</svg>")
from IPython.display import publish_display_data
publish_display_data({"%s": {"mime": "image/svg+xml", "path": p}})
""" % ARTIFACT
    body = run(gw, code, session="svg", inline_images=True)
    [ref] = [o["data"][ARTIFACT] for o in body["outputs"] if o["output_type"] == "display_data"]
    assert ref["not_inlined"] == "an SVG that is not UTF-8 text"


def test_the_own_artifact_in_the_session_directory_is_still_inlined(gw):
    code = """
import os
out = os.path.join(os.environ["HOME"], "outputs"); os.makedirs(out, exist_ok=True)
p = os.path.join(out, "mine.svg"); open(p, "w").write("<svg>mine</svg>")
from IPython.display import publish_display_data
publish_display_data({"%s": {"mime": "image/svg+xml", "path": p}})
""" % ARTIFACT
    body = run(gw, code, session="svg", inline_images=True)
    [output] = [o for o in body["outputs"] if o["output_type"] == "display_data"]
    assert output["data"] == {"image/svg+xml": "<svg>mine</svg>"}


def test_saving_such_outputs_into_a_notebook_saves_no_secret(gw):
    bob = os.path.join(gw.root, "bob", "user-files", "secret.txt")
    code = "import os\n" + show_artifact("'/etc/shadow'") + "\n" + show_artifact(repr(bob), raw_message=True)
    notebook = {"cells": [{"cell_type": "code", "source": code}], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    assert gw.client.call("PUT", "/v1/agents/alice/notebooks/user-files/n.ipynb", notebook)[0] == 201
    status, body = gw.client.call("POST", "/v1/agents/alice/notebooks/user-files/n.ipynb/run-all",
                                  {"save_outputs": True})
    assert status == 200, body
    with open(os.path.join(gw.root, "alice", "user-files", "n.ipynb")) as f:
        saved = f.read()
    assert ARTIFACT in saved  # the outputs were saved, as references
    assert shadow_line() not in saved and "bob-secret-9a7c" not in saved


def test_a_sessions_symlink_into_another_agents_tree_creates_nothing_there(gw):
    bob_sessions = os.path.join(gw.root, "bob", "sessions")
    before = tree_listing(os.path.join(gw.root, "bob"))
    # mallory swaps her sessions directory for a symlink to bob's, from inside her kernel.
    code = f"""
import os
root = os.path.join({gw.root!r}, "mallory")
os.rename(os.path.join(root, "sessions"), os.path.join(root, "sessions.real"))
os.symlink({bob_sessions!r}, os.path.join(root, "sessions"))
"""
    assert run(gw, code, agent="mallory", session="m")["status"] == "ok"
    for attempt in (
        lambda: gw.client.call("POST", "/v1/agents/mallory/sessions", {"session": "new"}),
        lambda: gw.client.execute("mallory", "other", "1"),
        lambda: gw.agent_client("mallory").call("POST", "/v1/agents/me/sessions", {"session": "third"}),
        lambda: gw.client.call("PUT", "/v1/agents/mallory"),
    ):
        status, body = attempt()
        assert status == 409 and body["error"]["code"] == "symlink_in_workspace", body
    # The same with a relative symlink, and with a planted session directory symlink.
    root = os.path.join(gw.root, "mallory")
    os.unlink(os.path.join(root, "sessions"))
    os.symlink("../bob/sessions", os.path.join(root, "sessions"))
    assert gw.client.execute("mallory", "rel", "1")[0] == 409
    os.unlink(os.path.join(root, "sessions"))
    os.rename(os.path.join(root, "sessions.real"), os.path.join(root, "sessions"))
    os.symlink(bob_sessions, os.path.join(root, "sessions", "cGxhbnRlZA"))  # base64url of "planted"
    assert gw.client.execute("mallory", "planted", "1")[0] == 409
    assert tree_listing(os.path.join(gw.root, "bob")) == before
    # Nothing half-made either: mallory's failed sessions are not listed, and she still works.
    listed = [s["id"] for s in gw.client.call("GET", "/v1/agents/mallory/sessions")[1]["sessions"]]
    assert listed == ["m"]
    assert run(gw, "print(1)", agent="mallory", session="m")["text"] == "1\n"
