"""Every route that takes a path, against an agent tree built to hurt the gateway.

The tree holds FIFOs (also where a notebook or the checkpoints folder goes), a
Unix socket, symlinks to host paths, to another agent's tree, to itself and
into ``installed-skills/``, sparse files of 100 MB, a folder 100 levels deep
and odd names (a newline, bytes that are not UTF-8, 255 bytes, ``%2F``).  Each
path goes through Jupyter contents (reads, then writes, then deletes),
checkpoints, read_file, the notebook store, apply_patch and a command's cwd,
while a prober times ``GET /v1/info`` on the control socket.

The test fails on any 5xx, on a change to ``/etc``, another agent's tree or
the Library's files, and on the control socket answering slower than
PROBE_BOUND (3 s: measured worst here 0.3-1.0 s on a loaded 2-core machine;
a FIFO opened on the event loop would hold it until the request timed out).
"""

from __future__ import annotations

import os
import socket
import urllib.parse

import pytest

from jupyter_support import JupyterClient
from support import GatewayProcess
from test_fs_confinement import PROBE_BOUND, Prober, etc_fingerprint, fingerprint


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    gateway = GatewayProcess(tmp_path_factory.mktemp("hostile"), "--jupyter-port", "0").start()
    for agent in ("alice", "bob"):
        assert gateway.client.call("PUT", f"/v1/agents/{agent}")[0] in (200, 201)
    yield gateway
    gateway.stop()


def build_hostile_tree(top: str, bob: str) -> list[bytes]:
    """The hostile entries under ``top/h``; their names relative to ``h``, as bytes."""
    h = os.path.join(top, "h").encode()
    os.mkdir(h)
    os.makedirs(os.path.join(bob, "user-files"), exist_ok=True)
    with open(os.path.join(bob, "user-files", "nb.ipynb"), "w") as f:
        f.write('{"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": []}')
    names: list[bytes] = []

    def add(name: bytes, make):
        make(os.path.join(h, name))
        names.append(name)

    add(b"x.txt", lambda p: open(p, "w").write("plain\n"))
    for name in (b"fifo", b"fifo.ipynb", b"fifo.txt"):
        add(name, os.mkfifo)
    add(b"dir-with-fifo-checkpoints", lambda p: (os.mkdir(p), os.mkfifo(os.path.join(p, b".ipynb_checkpoints"))))
    add(b"sock", lambda p: socket.socket(socket.AF_UNIX).bind(p))
    add(b"etc", lambda p: os.symlink("/etc", p))
    add(b"passwd", lambda p: os.symlink("/etc/passwd", p))
    add(b"shadow.ipynb", lambda p: os.symlink("/etc/shadow", p))
    add(b"bob", lambda p: os.symlink(bob.encode(), p))
    add(b"bob.ipynb", lambda p: os.symlink(os.path.join(bob, "user-files", "nb.ipynb").encode(), p))
    add(b"loop", lambda p: os.symlink(b"loop", p))
    add(b"skills", lambda p: os.symlink(b"../installed-skills", p))
    add(b"skill.md", lambda p: os.symlink(b"../installed-skills/jupyter-live-kernel/SKILL.md", p))
    for name in (b"huge.bin", b"huge.ipynb"):
        add(name, lambda p: os.truncate(os.open(p, os.O_WRONLY | os.O_CREAT, 0o644), 100 << 20))
    deep = b"deep"
    add(deep, os.mkdir)
    path = os.path.join(h, deep)
    for _ in range(100):
        path = os.path.join(path, b"d")
        os.mkdir(path)
    names.append(b"deep/" + b"d/" * 99 + b"d")
    for name in (b"new\nline.txt", b"\xff\xfe.txt", b"n" * 255, b"a%2Fb.txt", b"-dash.txt", b"sp ace.ipynb"):
        add(name, lambda p: open(p, "wb").write(b"odd\n"))
    return names


def test_every_path_route_against_a_hostile_tree(gw):
    top, bob = os.path.join(gw.root, "alice"), os.path.join(gw.root, "bob")
    names = build_hostile_tree(top, bob)
    os.system(f"chown -R --no-dereference {os.stat(top).st_uid}:{os.stat(top).st_gid} {top}/h")
    token = gw.client.call("POST", "/v1/agents/alice/tokens")[1]
    alice = JupyterClient(token["url"], token["token"])
    before_etc, before_bob = etc_fingerprint(), fingerprint(bob)
    before_skills = fingerprint(os.path.join(top, "installed-skills"))
    answers: list[tuple[int, str, str]] = []

    def jupyter(method, rel, body=None, suffix=""):
        url = "api/contents/" + urllib.parse.quote(os.fsencode(rel)) + suffix
        status, reply = alice.call(method, url, body)
        answers.append((status, method, url))

    def v1(method, url, body=None):
        status, reply = gw.client.call(method, url, body, timeout=120)
        answers.append((status, method, url))

    rels = ["h/" + os.fsdecode(name) for name in names]
    with Prober(gw) as prober:
        for rel in rels:  # reads first: nothing changes yet
            quoted = urllib.parse.quote(os.fsencode(rel))
            jupyter("GET", rel)
            jupyter("GET", rel, suffix="?content=0")
            jupyter("GET", rel, suffix="?format=base64&type=file")
            jupyter("GET", rel, suffix="/checkpoints")
            v1("GET", f"/v1/agents/alice/files?path={quoted}")
            v1("GET", f"/v1/agents/alice/notebooks/{quoted}")
            v1("POST", "/v1/agents/alice/commands", {"argv": ["true"], "cwd": rel})
        for rel in rels:  # then writes
            jupyter("POST", rel, suffix="/checkpoints")
            jupyter("POST", rel, suffix="/checkpoints/checkpoint")
            jupyter("DELETE", rel, suffix="/checkpoints/checkpoint")
            jupyter("POST", "h", {"copy_from": rel})
            jupyter("PUT", rel, {"type": "file", "format": "text", "content": "written"})
            jupyter("PUT", rel + "/inner.txt", {"type": "file", "format": "text", "content": "written"})
            jupyter("PATCH", rel, {"path": rel + "-renamed"})
            jupyter("PATCH", rel + "-renamed", {"path": rel})
            patch = f"*** Begin Patch\n*** Update File: {rel}\n@@\n-odd\n+even\n*** End Patch\n"
            v1("POST", "/v1/agents/alice/patch", {"patch": patch})
            patch = f"*** Begin Patch\n*** Add File: {rel}/added.txt\n+new\n*** End Patch\n"
            v1("POST", "/v1/agents/alice/patch", {"patch": patch})
            if rel.endswith(".ipynb"):
                v1("PUT", f"/v1/agents/alice/notebooks/{urllib.parse.quote(os.fsencode(rel))}",
                   {"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": []})
        for rel in reversed(rels):  # then deletes
            jupyter("DELETE", rel)
        jupyter("DELETE", "h/deep")
    server_errors = [a for a in answers if a[0] >= 500]
    assert not server_errors, server_errors
    assert len(answers) > 400
    statuses = {status for status, _, _ in answers}
    assert {200, 201, 204, 400, 403, 404} <= statuses, sorted(statuses)  # served, and refused each way
    assert etc_fingerprint() == before_etc
    assert fingerprint(bob) == before_bob
    assert fingerprint(os.path.join(top, "installed-skills")) == before_skills
    assert not prober.failures and prober.worst < PROBE_BOUND, (prober.worst, len(prober.times))
