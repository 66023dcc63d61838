"""``/api/contents``: CRUD inside the agent's tree, and every way out refused with nothing changed."""

from __future__ import annotations

import base64
import json
import os

import pytest

from jupyter_support import JupyterClient
from support import GatewayProcess

NOTEBOOK = {"nbformat": 4, "nbformat_minor": 5, "metadata": {},
            "cells": [{"cell_type": "markdown", "id": "m1", "source": "# hi", "metadata": {}}]}


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    gateway = GatewayProcess(tmp_path_factory.mktemp("contents"), "--jupyter-port", "0").start()
    for agent in ("alice", "bob"):
        gateway.client.call("PUT", f"/v1/agents/{agent}")
    yield gateway
    gateway.stop()


@pytest.fixture(scope="module")
def alice(gw) -> JupyterClient:
    token = gw.client.call("POST", "/v1/agents/alice/tokens")[1]
    return JupyterClient(token["url"], token["token"])


def tree(gw, agent="alice"):
    return os.path.join(gw.root, agent)


def snapshot(top: str) -> dict:
    """Every path under ``top`` with its bytes (files) or None (dirs, links as their target)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, top)
            if os.path.islink(full):
                out[rel] = ("link", os.readlink(full))
            elif os.path.isfile(full):
                out[rel] = open(full, "rb").read()
            else:
                out[rel] = None
    return out


def test_directories_text_binary_and_notebooks(gw, alice):
    status, root = alice.call("GET", "api/contents")
    assert status == 200 and root["type"] == "directory" and root["path"] == ""
    assert {"user-files", "sessions", "SOUL.md"} <= {m["name"] for m in root["content"]}
    assert all(m["content"] is None for m in root["content"])

    status, model = alice.call("PUT", "api/contents/user-files/a.txt", {"type": "file", "format": "text",
                                                                        "content": "héllo\n"})
    assert status == 201 and model["type"] == "file" and model["content"] is None
    assert open(os.path.join(tree(gw), "user-files/a.txt"), encoding="utf-8").read() == "héllo\n"
    status, model = alice.call("PUT", "api/contents/user-files/a.txt", {"type": "file", "format": "text",
                                                                        "content": "again"})
    assert status == 200  # replaced
    got = alice.call("GET", "api/contents/user-files/a.txt")[1]
    assert got["content"] == "again" and got["format"] == "text" and got["mimetype"] == "text/plain"
    assert alice.call("GET", "api/contents/user-files/a.txt?content=0")[1]["content"] is None

    blob = bytes(range(256))
    status, _ = alice.call("PUT", "api/contents/user-files/b.bin", {"type": "file", "format": "base64",
                                                                    "content": base64.b64encode(blob).decode()})
    assert status == 201 and open(os.path.join(tree(gw), "user-files/b.bin"), "rb").read() == blob
    got = alice.call("GET", "api/contents/user-files/b.bin")[1]
    assert got["format"] == "base64" and base64.b64decode(got["content"]) == blob
    status, body = alice.call("GET", "api/contents/user-files/b.bin?format=text")
    assert status == 400 and body["error"]["code"] == "not_utf8"

    status, model = alice.call("PUT", "api/contents/user-files/n.ipynb", {"type": "notebook", "content": NOTEBOOK})
    assert status == 201 and model["type"] == "notebook"
    got = alice.call("GET", "api/contents/user-files/n.ipynb")[1]
    assert got["format"] == "json" and got["content"]["cells"][0]["source"] == "# hi"
    assert alice.call("GET", "api/contents/user-files/n.ipynb?type=file")[1]["format"] == "text"

    status, model = alice.call("PUT", "api/contents/user-files/sub", {"type": "directory"})
    assert status == 201 and os.path.isdir(os.path.join(tree(gw), "user-files/sub"))
    # Made by the root gateway, owned by the agent (its own uid), as the file it wrote beside it.
    owner = os.stat(tree(gw)).st_uid
    assert os.stat(os.path.join(tree(gw), "user-files/sub")).st_uid == owner
    assert os.stat(os.path.join(tree(gw), "user-files/a.txt")).st_uid == owner
    names = {m["name"] for m in alice.call("GET", "api/contents/user-files")[1]["content"]}
    assert names >= {"a.txt", "b.bin", "n.ipynb", "sub"}
    # No temporary file is left behind by the atomic writes.
    assert not [n for n in os.listdir(os.path.join(tree(gw), "user-files")) if n.endswith(".tmp")]


def test_untitled_copy_rename_delete_and_checkpoints(gw, alice):
    alice.call("PUT", "api/contents/work", {"type": "directory"})
    status, nb = alice.call("POST", "api/contents/work", {"type": "notebook"})
    assert status == 201 and nb["path"] == "work/Untitled.ipynb"
    assert alice.call("POST", "api/contents/work", {"type": "notebook"})[1]["path"] == "work/Untitled1.ipynb"
    assert alice.call("POST", "api/contents/work", {"type": "file", "ext": ".py"})[1]["path"] == "work/untitled.py"
    assert alice.call("POST", "api/contents/work", {"type": "directory"})[1]["path"] == "work/Untitled Folder"

    status, copy = alice.call("POST", "api/contents/work", {"copy_from": "work/Untitled.ipynb"})
    assert status == 201 and copy["path"] == "work/Untitled-Copy1.ipynb"

    status, moved = alice.call("PATCH", "api/contents/work/Untitled-Copy1.ipynb", {"path": "work/moved.ipynb"})
    assert status == 200 and moved["path"] == "work/moved.ipynb"
    assert not os.path.exists(os.path.join(tree(gw), "work/Untitled-Copy1.ipynb"))
    status, body = alice.call("PATCH", "api/contents/work/moved.ipynb", {"path": "work/Untitled.ipynb"})
    assert status == 409 and body["error"]["code"] == "exists"

    path = "work/untitled.py"
    alice.call("PUT", f"api/contents/{path}", {"type": "file", "format": "text", "content": "v1"})
    assert alice.call("GET", f"api/contents/{path}/checkpoints")[1] == []
    status, cp = alice.call("POST", f"api/contents/{path}/checkpoints")
    assert status == 201 and cp["id"] == "checkpoint"
    assert [c["id"] for c in alice.call("GET", f"api/contents/{path}/checkpoints")[1]] == ["checkpoint"]
    alice.call("PUT", f"api/contents/{path}", {"type": "file", "format": "text", "content": "v2"})
    assert alice.call("POST", f"api/contents/{path}/checkpoints/checkpoint")[0] == 204
    assert alice.call("GET", f"api/contents/{path}")[1]["content"] == "v1"
    assert alice.call("POST", f"api/contents/{path}/checkpoints/other")[0] == 404
    assert alice.call("DELETE", f"api/contents/{path}/checkpoints/checkpoint")[0] == 204
    assert alice.call("GET", f"api/contents/{path}/checkpoints")[1] == []

    status, body = alice.call("DELETE", "api/contents/work")
    assert status == 400 and body["error"]["code"] == "not_empty" and os.path.isdir(os.path.join(tree(gw), "work"))
    assert alice.call("DELETE", "api/contents/work/Untitled%20Folder")[0] == 204
    assert alice.call("DELETE", f"api/contents/{path}")[0] == 204
    assert not os.path.exists(os.path.join(tree(gw), path))
    assert alice.call("DELETE", f"api/contents/{path}")[0] == 404


def test_every_escape_is_refused_and_nothing_changes(gw, alice, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    bob_file = os.path.join(tree(gw, "bob"), "user-files", "bob.txt")
    with open(bob_file, "w") as f:
        f.write("bob's")
    home = tree(gw)
    os.symlink(str(tmp_path), os.path.join(home, "user-files", "out"))
    os.symlink(str(secret), os.path.join(home, "user-files", "secret-link"))
    os.symlink("../../bob/user-files", os.path.join(home, "user-files", "to-bob"))
    os.mkfifo(os.path.join(home, "user-files", "fifo"))
    before_alice, before_bob, before_host = snapshot(home), snapshot(tree(gw, "bob")), snapshot(str(tmp_path))

    text = {"type": "file", "format": "text", "content": "pwned"}
    attempts = [
        ("GET", "api/contents/..", None),
        ("GET", "api/contents/user-files/..%2F..%2Fbob", None),
        ("GET", "api/contents/%2Fetc%2Fpasswd", None),
        ("GET", "api/contents/user-files/out/secret.txt", None),
        ("GET", "api/contents/user-files/secret-link", None),
        ("GET", "api/contents/user-files/to-bob/bob.txt", None),
        ("GET", "api/contents/user-files/fifo", None),
        ("PUT", "api/contents/user-files/out/new.txt", text),
        ("PUT", "api/contents/user-files/to-bob/bob.txt", text),
        ("PUT", "api/contents/..%2Fbob%2Fuser-files%2Fx.txt", text),
        ("PUT", "api/contents/user-files/out", {"type": "directory"}),
        ("POST", "api/contents/user-files", {"copy_from": "user-files/secret-link"}),
        ("POST", "api/contents/user-files", {"copy_from": "/etc/passwd"}),
        ("POST", "api/contents/user-files/out", {"type": "file"}),
        ("PATCH", "api/contents/user-files/secret-link", {"path": "../stolen"}),
        ("PATCH", "api/contents/SOUL.md", {"path": "user-files/out/SOUL.md"}),
        ("PATCH", "api/contents/SOUL.md", {"path": "/tmp/SOUL.md"}),
        ("DELETE", "api/contents/user-files/out/secret.txt", None),
        ("DELETE", "api/contents/user-files/to-bob/bob.txt", None),
        ("POST", "api/contents/user-files/secret-link/checkpoints", None),
        ("GET", "api/contents/user-files/out/secret.txt/checkpoints", None),
    ]
    for method, path, body in attempts:
        status, answer = alice.call(method, path, body)
        assert status in (400, 403, 404), (method, path, status, answer)
        assert isinstance(answer, dict) and answer["error"]["code"] and answer["message"], (method, path, answer)
        assert "host secret" not in json.dumps(answer) and "bob's" not in json.dumps(answer)
    assert snapshot(home) == before_alice
    assert snapshot(tree(gw, "bob")) == before_bob
    assert snapshot(str(tmp_path)) == before_host
    # Links out of the tree and the FIFO are not listed.
    names = {m["name"] for m in alice.call("GET", "api/contents/user-files")[1]["content"]}
    assert not names & {"out", "secret-link", "to-bob", "fifo"}


@pytest.mark.parametrize("method, path, body, status, code", [
    ("GET", "api/contents/nope.txt", None, 404, "not_found"),
    ("GET", "api/contents/SOUL.md?content=2", None, 400, "invalid_content"),
    ("GET", "api/contents/SOUL.md?type=bogus", None, 400, "invalid_type"),
    ("GET", "api/contents/SOUL.md?type=directory", None, 400, "wrong_type"),
    ("GET", "api/contents/user-files?type=file", None, 400, "wrong_type"),
    ("GET", "api/contents/SOUL.md?format=zip", None, 400, "invalid_format"),
    ("PUT", "api/contents/x.txt", {"type": "file", "format": "text"}, 400, "missing_field"),
    ("PUT", "api/contents/x.txt", {"format": "text", "content": "a"}, 400, "invalid_type"),
    ("PUT", "api/contents/x.txt", {"type": "file", "format": "base64", "content": "!!!"}, 400, "bad_base64"),
    ("PUT", "api/contents/x.txt", {"type": "file", "format": "rot13", "content": "a"}, 400, "invalid_format"),
    ("PUT", "api/contents/x.txt", {"type": "file", "content": 5}, 400, "wrong_type"),
    ("PUT", "api/contents/x.ipynb", {"type": "notebook", "content": "not a notebook"}, 400, "wrong_type"),
    ("PUT", "api/contents/x.ipynb", {"type": "notebook", "content": {"nbformat": 3}}, 400, "invalid_notebook"),
    ("PUT", "api/contents/x.txt", {"type": "file", "content": "a", "chunk": 1}, 400, "unsupported"),
    ("PUT", "api/contents/x.txt", {"type": "file", "content": "a", "evil": 1}, 400, "unknown_field"),
    ("PUT", "api/contents/missing-dir/x.txt", {"type": "file", "format": "text", "content": "a"}, 404, "not_found"),
    ("PUT", "api/contents/user-files", {"type": "file", "format": "text", "content": "a"}, 400, "is_a_directory"),
    ("POST", "api/contents/SOUL.md", {"type": "file"}, 400, "not_a_directory"),
    ("POST", "api/contents/user-files", {"type": "spreadsheet"}, 400, "invalid_type"),
    ("POST", "api/contents/user-files", {"ext": "/../x"}, 400, "invalid_ext"),
    ("POST", "api/contents/user-files", {"copy_from": "nope.txt"}, 404, "not_found"),
    ("POST", "api/contents/user-files", {"copy_from": "user-files"}, 400, "is_a_directory"),
    ("POST", "api/contents/user-files", {"zzz": 1}, 400, "unknown_field"),
    ("PATCH", "api/contents/SOUL.md", {}, 400, "missing_field"),
    ("PATCH", "api/contents/nope.md", {"path": "x.md"}, 404, "not_found"),
    ("PATCH", "api/contents/user-files/a.txt", {"path": "user-files/b.bin"}, 409, "exists"),
    ("PUT", "api/contents/SOUL.md", {"type": "file", "format": "text", "content": "new soul"}, 403, "read_only"),
    ("PATCH", "api/contents/SOUL.md", {"path": "user-files/soul.md"}, 403, "read_only"),
    ("PATCH", "api/contents/user-files/a.txt", {"path": "MISSION.md"}, 403, "read_only"),
    ("DELETE", "api/contents/DESIGN.md", None, 403, "read_only"),
    ("PUT", "api/contents/installed-skills/mine", {"type": "directory"}, 403, "read_only"),
    ("POST", "api/contents/installed-skills", {"type": "file"}, 403, "read_only"),
    ("PATCH", "api/contents", {"path": "x"}, 400, "invalid_path"),
    ("DELETE", "api/contents", None, 400, "invalid_path"),
    ("POST", "api/contents/user-files/checkpoints", None, 400, "not_a_file"),
    ("PUT", "api/contents/x.txt", None, 404, "not_found"),
    ("PUT", "api/contents/SOUL.md", None, 400, "not_a_directory"),
])
def test_bad_input_is_refused_and_changes_nothing(gw, alice, method, path, body, status, code):
    before = snapshot(tree(gw))
    got, answer = alice.call(method, path, body)
    assert (got, answer["error"]["code"]) == (status, code), answer
    assert answer["message"]
    assert snapshot(tree(gw)) == before


def test_the_agents_read_only_documents_say_so(alice):
    listing = {m["name"]: m for m in alice.call("GET", "api/contents")[1]["content"]}
    assert listing["SOUL.md"]["writable"] is False and listing["installed-skills"]["writable"] is False
    assert listing["user-files"]["writable"] is True


def test_malformed_bodies(gw, alice):
    before = snapshot(tree(gw))
    for method in ("PUT", "POST", "PATCH"):
        status, answer = alice.call(method, "api/contents/x.txt", raw=b"{oops")
        assert status == 400 and answer["error"]["code"] == "malformed_json"
    assert snapshot(tree(gw)) == before
