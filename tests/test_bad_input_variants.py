"""Bad input of every shape is a clear 4xx that changes nothing, never a 500.

Through a real gateway's real socket; each request is sent as raw bytes, so
that what a JSON library would refuse to produce is tried too.  After all of
them, the gateway's log shows no unexpected error.
"""

from __future__ import annotations

import json
import os
import urllib.parse

import pytest

from support import GatewayProcess


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    gateway = GatewayProcess(tmp_path_factory.mktemp("badinput")).start()
    assert gateway.client.call("PUT", "/v1/agents/alice")[0] in (200, 201)
    status, body = gateway.client.call("PUT", "/v1/agents/alice/notebooks/user-files/n.ipynb",
                                       {"cells": [{"cell_type": "code", "source": "1"}], "metadata": {}})
    assert status == 201, body
    assert gateway.client.execute("alice", "s1", "1")[0] == 200
    yield gateway
    gateway.stop()
    with open(gateway.log) as f:
        log = f.read()
    assert "unexpected error" not in log and "Traceback" not in log, log[-5000:]


def listing(root: str) -> list:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        out += [(os.path.join(dirpath, n), os.lstat(os.path.join(dirpath, n)).st_mtime_ns)
                for n in dirnames + filenames]
    return sorted(out)


def snapshot(gw):
    agents = gw.client.call("GET", "/v1/agents")[1]
    return json.dumps(agents["agents"][0]["sessions"], sort_keys=True, default=str).count('"id"'), listing(gw.root)


def deep(n: int) -> bytes:
    return b'{"code": ' + b"[" * n + b"]" * n + b"}"


LONG = "a" * 256
NB = "/v1/agents/alice/notebooks/"
EXECUTE = "/v1/agents/alice/sessions/s1/execute"
CASES = [
    # agent keys: the whole string must match
    ("PUT", "/v1/agents/alice%0A", None, None, 400, "invalid_agent"),
    ("PUT", "/v1/agents/bob%0A", None, None, 400, "invalid_agent"),
    ("PUT", "/v1/agents/%0Abob", None, None, 400, "invalid_agent"),
    ("PUT", "/v1/agents/bob%00", None, None, 400, "invalid_agent"),
    ("GET", "/v1/agents/alice%0A/sessions", None, None, 400, "invalid_agent"),
    ("POST", "/v1/agents/alice%0A/sessions/s/execute", b'{"code": "1"}', None, 400, "invalid_agent"),
    ("POST", "/v1/agents/alice/sessions", b'{"session": "s\\n"}', None, 400, "invalid_session"),
    # JSON bodies: deep, non-objects, invalid UTF-8, surrogates, non-numbers, huge numbers
    ("POST", EXECUTE, deep(100_000), None, 400, "malformed_json"),
    ("POST", EXECUTE, deep(1_000), None, 400, "malformed_json"),
    ("POST", EXECUTE, deep(65), None, 400, "malformed_json"),
    ("PUT", NB + "user-files/deep.ipynb", b'{"cells": [], "metadata": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5001,
     None, 400, "malformed_json"),
    ("POST", "/v1/agents/alice/patch", b'{"patch": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
     {"Content-Type": "application/json"}, 400, "malformed_json"),
    ("POST", "/v1/agents/alice/commands", deep(100_000), None, 400, "malformed_json"),
    ("POST", EXECUTE, b"[]", None, 400, "malformed_json"),
    ("POST", EXECUTE, b"null", None, 400, "malformed_json"),
    ("POST", EXECUTE, b"1", None, 400, "malformed_json"),
    ("POST", EXECUTE, b'"code"', None, 400, "malformed_json"),
    ("PUT", NB + "user-files/x.ipynb", b"[1]", None, 400, "malformed_json"),
    ("POST", EXECUTE, b'{"code": "\xff\xfe"}', None, 400, "malformed_json"),
    ("POST", EXECUTE, b'{"code": "\\ud800"}', None, 400, "malformed_json"),
    ("POST", EXECUTE, b'{"\\udfff": "1"}', None, 400, "malformed_json"),
    ("PUT", NB + "user-files/s.ipynb", b'{"cells": [{"cell_type": "code", "source": "\\udc80"}]}',
     None, 400, "malformed_json"),
    ("POST", "/v1/agents/alice/commands", b'{"command": "echo \\ud83d"}', None, 400, "malformed_json"),
    ("POST", EXECUTE, b'{"code": "1", "timeout": NaN}', None, 400, "malformed_json"),
    ("POST", EXECUTE, b'{"code": "1", "timeout": Infinity}', None, 400, "malformed_json"),
    ("POST", EXECUTE, b'{"code": "1", "timeout": 1e999}', None, 400, "invalid_timeout"),
    ("POST", EXECUTE, b'{"code": "1", "timeout": ' + b"9" * 5000 + b"}", None, 400, "malformed_json"),
    ("POST", NB + "user-files/n.ipynb/cells", b'{"index": ' + b"9" * 4000 + b', "source": "x"}', None, 400,
     "invalid_index"),
    # path components over 255 bytes, whole paths over 4096, NUL bytes
    ("GET", NB + f"user-files/{LONG}.ipynb", None, None, 400, "invalid_path"),
    ("PUT", NB + f"user-files/{LONG}.ipynb", b'{"cells": []}', None, 400, "invalid_path"),
    ("PUT", NB + f"{LONG}/n.ipynb", b'{"cells": []}', None, 400, "invalid_path"),
    ("PUT", NB + "/".join(["d" * 200] * 21) + "/n.ipynb", b'{"cells": []}', None, 400, "invalid_path"),
    ("PUT", NB + "user-files/" + urllib.parse.quote("é" * 128) + ".ipynb", b'{"cells": []}', None, 400, "invalid_path"),
    ("GET", NB + "user-files/a%00b.ipynb", None, None, 400, "invalid_path"),
    ("POST", "/v1/agents/alice/commands", json.dumps({"command": "pwd", "cwd": LONG}).encode(), None, 400,
     "invalid_path"),
    ("POST", "/v1/agents/alice/commands", json.dumps({"command": "pwd", "cwd": "x/" * 2100}).encode(), None,
     400, "invalid_path"),
    ("GET", "/v1/agents/alice/files?path=" + LONG, None, None, 400, "invalid_path"),
    ("GET", "/v1/agents/alice/files?path=" + "d/" * 2100 + "f", None, None, 400, "invalid_path"),
    ("POST", "/v1/agents/alice/patch", json.dumps({"patch": "*** Begin Patch\n*** End Patch", "cwd": LONG}).encode(),
     {"Content-Type": "application/json"}, 400, "invalid_path"),
]


@pytest.mark.parametrize("method,path,raw,headers,status,code", CASES, ids=[f"{i}" for i in range(len(CASES))])
def test_bad_input_is_a_clear_4xx_and_changes_nothing(gw, method, path, raw, headers, status, code):
    before = snapshot(gw)
    got, body = gw.client.call(method, path, raw=raw, headers=headers)
    assert isinstance(body, dict), body
    assert (got, body["error"]["code"]) == (status, code), body
    assert body["error"]["message"]
    assert snapshot(gw) == before
    assert not os.path.exists(os.path.join(gw.root, "alice\n")) and not os.path.exists(os.path.join(gw.root, "bob"))


def test_a_patch_naming_a_path_over_255_bytes_fails_cleanly(gw):
    before = snapshot(gw)
    patch = f"*** Begin Patch\n*** Add File: user-files/{LONG}.txt\n+hi\n*** End Patch\n"
    status, body = gw.client.call("POST", "/v1/agents/alice/patch", raw=patch.encode(),
                                  headers={"Content-Type": "text/plain"})
    assert status in (400, 422), body
    assert snapshot(gw) == before
