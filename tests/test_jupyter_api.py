"""The Jupyter Server API per agent: a real gateway, real sandboxed kernels, real websockets."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time

import pytest

from jupyter_support import V1, JupyterClient, KernelSocket
from support import GatewayProcess, wait_until


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    gateway = GatewayProcess(tmp_path_factory.mktemp("jupyter"), "--jupyter-port", "0").start()
    for agent in ("alice", "bob"):
        assert gateway.client.call("PUT", f"/v1/agents/{agent}")[0] == 201
    yield gateway
    gateway.stop()


def mint(gw, agent: str) -> dict:
    status, body = gw.client.call("POST", f"/v1/agents/{agent}/tokens")
    assert status == 201, body
    return body


@pytest.fixture(scope="module")
def alice(gw) -> JupyterClient:
    token = mint(gw, "alice")
    return JupyterClient(token["url"], token["token"])


@pytest.fixture(scope="module")
def kernel(alice):
    status, model = alice.call("POST", "api/kernels", {"name": "python3"})
    assert status == 201, model
    yield model
    alice.call("DELETE", f"api/kernels/{model['id']}")


def run(coro):
    return asyncio.run(coro)


def v1_sessions(gw, agent="alice"):
    return {s["id"]: s for s in gw.client.call("GET", f"/v1/agents/{agent}/sessions")[1]["sessions"]}


# --- the listener and tokens ---------------------------------------------------------


def test_info_shows_the_jupyter_url_and_tokens_follow_jupyters_rules(gw, alice):
    status, info = gw.client.call("GET", "/v1/info")
    assert status == 200 and info["jupyter"]["url"].startswith("http://127.0.0.1:")
    assert alice.base_url == info["jupyter"]["url"] + "agents/alice/"

    assert alice.call("GET", "api/kernels")[0] == 200
    for token in (None, "wrong", alice.token + "x", ""):
        status, body = alice.call("GET", "api/kernels", token=token)
        assert status == 403 and body["error"]["code"] == "invalid_token" and body["message"]
    # ?token= works as in Jupyter; a Bearer header too.
    assert alice.call("GET", f"api/kernels?token={alice.token}", token=None)[0] == 200
    assert alice.call("GET", "api/kernels", token=None, headers={"Authorization": f"Bearer {alice.token}"})[0] == 200
    # alice's token does not open bob's API, nor an unknown agent's, nor 'me'.
    for other in ("bob", "nobody", "me"):
        bob = JupyterClient(alice.base_url.replace("/alice/", f"/{other}/"), alice.token)
        status, body = bob.call("GET", "api/kernels")
        assert status == 403, (other, body)


def test_tokens_are_listed_without_secrets_revoked_and_stored_hashed(gw):
    minted = mint(gw, "bob")
    assert set(minted) == {"id", "token", "created", "url"} and minted["url"].endswith("/agents/bob/")
    bob = JupyterClient(minted["url"], minted["token"])
    assert bob.call("GET", "api")[0] == 200

    status, listed = gw.client.call("GET", "/v1/agents/bob/tokens")
    assert status == 200 and minted["id"] in [t["id"] for t in listed["tokens"]]
    assert minted["token"] not in json.dumps(listed)
    stored = open(os.path.join(gw.state, "jupyter_tokens.json")).read()
    assert minted["token"] not in stored and minted["id"] in stored
    assert os.stat(os.path.join(gw.state, "jupyter_tokens.json")).st_mode & 0o777 == 0o600

    # Tokens are minted on the control socket only.
    status, body = gw.agent_client("bob").call("POST", "/v1/agents/me/tokens")
    assert status == 403, body
    assert gw.client.call("POST", "/v1/agents/nobody/tokens")[0] == 404
    assert gw.client.call("POST", "/v1/agents/bob/tokens", raw=b'{"x": 1}')[0] == 400
    # Revoking an unknown id changes nothing; revoking the token closes the door.
    before = gw.client.call("GET", "/v1/agents/bob/tokens")[1]
    assert gw.client.call("DELETE", "/v1/agents/bob/tokens/nope")[0] == 404
    assert gw.client.call("GET", "/v1/agents/bob/tokens")[1] == before
    assert gw.client.call("DELETE", f"/v1/agents/bob/tokens/{minted['id']}")[0] == 200
    assert bob.call("GET", "api")[0] == 403


def test_tokens_survive_a_restart_and_the_cli_mints_one(tmp_path):
    import subprocess

    from support import BIN

    gateway = GatewayProcess(tmp_path, "--jupyter-port", "0").start()
    try:
        gateway.client.call("PUT", "/v1/agents/carol")
        out = subprocess.run([os.path.join(BIN, "kernel-gateway"), "token", "carol", "--state-dir", gateway.state],
                             capture_output=True, text=True, check=True).stdout
        lines = dict(line.split(":", 1) for line in out.splitlines())
        token = lines["token"].strip()
        assert lines["url"].strip().endswith("/agents/carol/")
        bad = subprocess.run([os.path.join(BIN, "kernel-gateway"), "token", "nobody", "--state-dir", gateway.state],
                             capture_output=True, text=True)
        assert bad.returncode == 1 and "no agent 'nobody'" in bad.stderr
    finally:
        gateway.stop()
    gateway.start()
    try:
        url = gateway.client.call("GET", "/v1/info")[1]["jupyter"]["url"]
        assert JupyterClient(url + "agents/carol/", token).call("GET", "api/status")[0] == 200
        assert JupyterClient(url + "agents/carol/", "not-it").call("GET", "api/status")[0] == 403
    finally:
        gateway.stop()


def test_the_same_routes_on_the_sockets_without_tokens_and_scoped(gw):
    status, spec = gw.client.call("GET", "/agents/alice/api/kernelspecs")
    assert status == 200 and spec["default"] == "python3"
    agent = gw.agent_client("alice")
    assert agent.call("GET", "/agents/me/api/status")[0] == 200
    assert agent.call("GET", "/agents/alice/api/kernels")[0] == 200
    status, body = agent.call("GET", "/agents/bob/api/kernels")
    assert status == 403 and body["error"]["code"] == "forbidden"
    assert gw.client.call("GET", "/agents/me/api/kernels")[0] == 400
    assert gw.client.call("GET", "/agents/nobody/api/kernels")[0] == 404


def test_no_jupyter_flag_turns_the_port_off(tmp_path):
    gateway = GatewayProcess(tmp_path, "--no-jupyter").start()
    try:
        assert gateway.client.call("GET", "/v1/info")[1]["jupyter"] == {"url": None}
    finally:
        gateway.stop()


# --- api, kernelspecs -----------------------------------------------------------------


def test_api_status_and_kernelspecs(gw, alice):
    status, body = alice.call("GET", "api")
    assert status == 200 and body["version"]
    status, body = alice.call("GET", "api/status")
    assert status == 200 and set(body) >= {"started", "last_activity", "connections", "kernels"}

    status, specs = alice.call("GET", "api/kernelspecs")
    assert status == 200 and specs["default"] == "python3"
    spec = specs["kernelspecs"]["python3"]
    assert spec["spec"]["language"] == "python" and "sandboxed" in spec["spec"]["display_name"]
    assert "kernel_provisioner" not in spec["spec"]["metadata"]  # no host-side settings shown
    assert alice.call("GET", "api/kernelspecs/python3")[1] == spec
    status, body = alice.call("GET", "api/kernelspecs/nope")
    assert status == 404 and body["error"]["code"] == "unknown_kernelspec"

    # Whatever logo the kernelspec directory holds is listed and served.
    logo = os.path.join(gw.state, "kernels", "python3", "logo-64x64.png")
    png = b"\x89PNG\r\n\x1a\n" + b"0" * 40
    if not os.path.exists(logo):
        with open(logo, "wb") as f:
            f.write(png)
    expected = open(logo, "rb").read()
    spec = alice.call("GET", "api/kernelspecs/python3")[1]
    assert spec["resources"]["logo-64x64"] == "/agents/alice/kernelspecs/python3/logo-64x64.png"
    status, data = alice.call("GET", "kernelspecs/python3/logo-64x64.png")
    assert status == 200 and data == expected
    for bad in ("kernelspecs/python3/kernel.json", "kernelspecs/python3/..%2F..%2Fjupyter_tokens.json",
                "kernelspecs/nope/logo-64x64.png"):
        assert alice.call("GET", bad)[0] == 404, bad


# --- kernels ----------------------------------------------------------------------------


def test_kernels_crud_interrupt_restart_and_one_set_of_kernels(gw, alice):
    status, model = alice.call("POST", "api/kernels", {"name": "python3"})
    assert status == 201 and model["execution_state"] == "idle" and model["connections"] == 0
    kid = model["id"]
    # A kernel started over the API is a gateway session ...
    assert model["gateway_session"] in v1_sessions(gw)
    # ... and a jlk session's kernel is listed by the API.
    assert gw.client.execute("alice", "from-jlk", "y = 1")[1]["status"] == "ok"
    listed = {k["gateway_session"]: k for k in alice.call("GET", "api/kernels")[1]}
    assert {"from-jlk", model["gateway_session"]} <= set(listed)
    assert set(listed) == set(v1_sessions(gw))

    assert alice.call("GET", f"api/kernels/{kid}")[1]["id"] == kid
    status, _ = alice.call("POST", f"api/kernels/{kid}/interrupt")
    assert status == 204
    status, restarted = alice.call("POST", f"api/kernels/{kid}/restart")
    assert status == 200 and restarted["id"] == kid and restarted["execution_state"] == "idle"

    status, _ = alice.call("DELETE", f"api/kernels/{kid}")
    assert status == 204
    assert alice.call("GET", f"api/kernels/{kid}")[0] == 404
    assert model["gateway_session"] not in v1_sessions(gw)


@pytest.mark.parametrize("body, code", [
    ({"name": "nope"}, "unknown_kernel"),
    ({"name": 7}, "unknown_kernel"),
    ({"bogus": 1}, "unknown_field"),
    ({"env": "LD_PRELOAD=/tmp/x.so"}, "wrong_type"),
    ({"env": {"A": 1}}, "wrong_type"),
    ({"kernel_id": "3c237be6-2e16-534f-8fa5-964c8bcb6a89"}, "unsupported"),
    ({"path": "../bob"}, "path_outside_root"),
    ({"path": 5}, "wrong_type"),
])
def test_kernel_start_refuses_bad_input_and_starts_nothing(gw, alice, body, code):
    before = v1_sessions(gw)
    status, answer = alice.call("POST", "api/kernels", body)
    assert status == 400 and answer["error"]["code"] == code, answer
    assert v1_sessions(gw).keys() == before.keys()


def test_a_clients_env_never_reaches_the_kernel(gw, alice):
    status, model = alice.call("POST", "api/kernels", {"env": {"LD_PRELOAD": "/tmp/x.so", "KERNEL_USERNAME": "x"}})
    assert status == 201
    try:
        status, result = gw.client.execute("alice", model["gateway_session"],
                                           "import os; print(os.environ.get('LD_PRELOAD'), os.environ.get('KERNEL_USERNAME'))")
        assert result["text"] == "None None\n"
    finally:
        alice.call("DELETE", f"api/kernels/{model['id']}")


def test_kernel_routes_refuse_bad_input(gw, alice):
    assert alice.call("POST", "api/kernels", raw=b"{not json")[0] == 400
    assert alice.call("POST", "api/kernels", raw=b"[1]")[0] == 400
    for method, path in (("GET", "api/kernels/nope"), ("DELETE", "api/kernels/nope"),
                         ("POST", "api/kernels/nope/interrupt"), ("POST", "api/kernels/nope/restart"),
                         ("GET", "api/kernels/0d8a3b52-1111-4222-8333-444455556666")):
        status, body = alice.call(method, path)
        assert status == 404 and body["error"]["code"] == "unknown_kernel", (method, path)
    # Another agent's API never reaches alice's kernel, even by its id.
    kid = alice.call("POST", "api/kernels", {})[1]["id"]
    try:
        for method, path in (("GET", f"/agents/bob/api/kernels/{kid}"), ("DELETE", f"/agents/bob/api/kernels/{kid}"),
                             ("POST", f"/agents/bob/api/kernels/{kid}/restart")):
            assert gw.client.call(method, path)[0] == 404, path
        assert alice.call("GET", f"api/kernels/{kid}")[1]["execution_state"] == "idle"
    finally:
        alice.call("DELETE", f"api/kernels/{kid}")
    status, body = alice.call("PUT", "api/kernels")
    assert status == 405 and body["message"]
    status, body = alice.call("GET", "api/nothing-here")
    assert status == 404 and body["message"]


# --- the websocket ---------------------------------------------------------------------


CELL = "from IPython.display import display\nprint('out')\ndisplay({'text/plain': 'shown'}, raw=True)\n6 * 7"


@pytest.mark.parametrize("protocol", [None, V1])
def test_websocket_execute_on_both_protocols(alice, kernel, protocol):
    async def go():
        ks = await KernelSocket.connect(alice.base_url, kernel["id"], alice.token, protocol)
        try:
            return await ks.run(CELL)
        finally:
            ks.close()

    out = run(go())
    assert out["reply"]["status"] == "ok"
    assert out["stdout"] == "out\n"
    assert out["displays"] == [{"text/plain": "shown"}]
    assert out["results"] == [{"text/plain": "42"}]


def test_websocket_refuses_bad_tokens_unknown_kernels_and_survives_garbage(alice, kernel, gw):
    async def refused(kid, token):
        try:
            await KernelSocket.connect(alice.base_url, kid, token)
        except Exception as e:  # tornado raises HTTPClientError for a refused upgrade
            return getattr(e, "code", None)
        return None

    assert run(refused(kernel["id"], None)) == 403
    assert run(refused(kernel["id"], "wrong")) == 403
    assert run(refused("nope", alice.token)) == 404

    async def garbage():
        ks = await KernelSocket.connect(alice.base_url, kernel["id"], alice.token, V1)
        try:
            for junk in (b"", b"\x00" * 7, b"\xff" * 64, "text on a binary protocol"):
                ks.ws.write_message(junk, binary=isinstance(junk, bytes))
            return await ks.run("'still here'")
        finally:
            ks.close()

    assert run(garbage())["results"] == [{"text/plain": "'still here'"}]

    async def legacy_garbage():
        ks = await KernelSocket.connect(alice.base_url, kernel["id"], alice.token)
        try:
            for junk in ("{", "[]", '{"header": 5}', json.dumps({"channel": "iopub", "header": {}})):
                ks.ws.write_message(junk)
            return await ks.run("'fine'")
        finally:
            ks.close()

    assert run(legacy_garbage())["results"] == [{"text/plain": "'fine'"}]


def test_two_websockets_and_a_jlk_client_on_one_kernel_each_get_their_own_replies(gw, alice, kernel):
    session = kernel["gateway_session"]

    async def go():
        a = await KernelSocket.connect(alice.base_url, kernel["id"], alice.token, V1)
        b = await KernelSocket.connect(alice.base_url, kernel["id"], alice.token)
        try:
            assert alice.call("GET", f"api/kernels/{kernel['id']}")[1]["connections"] == 2
            http = asyncio.to_thread(gw.client.execute, "alice", session, "print('from jlk')")
            ra, rb, (status, rc) = await asyncio.gather(a.run("print('from a')"), b.run("print('from b')"), http)
            return ra, rb, status, rc
        finally:
            a.close()
            b.close()

    ra, rb, status, rc = run(go())
    assert ra["stdout"] == "from a\n" and ra["reply"]["status"] == "ok"
    assert rb["stdout"] == "from b\n" and rb["reply"]["status"] == "ok"
    assert status == 200 and rc["status"] == "ok" and rc["text"] == "from jlk\n"
    # Shell replies go to their own client only.
    assert ra["foreign_replies"] == [] and rb["foreign_replies"] == []
    assert wait_until(lambda: alice.call("GET", f"api/kernels/{kernel['id']}")[1]["connections"] == 0)


def test_reconnect_with_the_same_session_id_replays_what_was_missed(alice, kernel):
    async def go():
        first = await KernelSocket.connect(alice.base_url, kernel["id"], alice.token, V1, session_id="replay-me")
        msg_id = first.execute("import time; time.sleep(1.5); print('while you were away')")
        await first.receive()  # the request is in (status busy)
        first.close()
        await asyncio.sleep(0.2)
        while alice.call("GET", f"api/kernels/{kernel['id']}")[1]["execution_state"] != "idle":
            await asyncio.sleep(0.2)
        again = await KernelSocket.connect(alice.base_url, kernel["id"], alice.token, V1, session_id="replay-me")
        try:
            return await again.collect(msg_id, timeout=30)
        finally:
            again.close()

    out = run(go())
    assert out["stdout"] == "while you were away\n" and out["reply"]["status"] == "ok"


def test_websocket_follows_a_restart(alice):
    status, model = alice.call("POST", "api/kernels", {})
    kid = model["id"]

    async def go():
        ks = await KernelSocket.connect(alice.base_url, kid, alice.token, V1)
        try:
            await ks.run("z = 5")
            status, _ = await asyncio.to_thread(alice.call, "POST", f"api/kernels/{kid}/restart")
            assert status == 200
            states = []
            out = None
            msg_id = ks.execute("print('z' in dir())")
            out = await ks.collect(msg_id)
            return out, states
        finally:
            ks.close()

    try:
        out, _ = run(go())
        assert out["stdout"] == "False\n"  # a fresh kernel, reached over the same websocket
    finally:
        alice.call("DELETE", f"api/kernels/{kid}")


# --- sessions ---------------------------------------------------------------------------


NOTEBOOK = {"nbformat": 4, "nbformat_minor": 5, "metadata": {},
            "cells": [{"cell_type": "code", "id": "c1", "source": "shared = 'from the agent'", "metadata": {},
                       "outputs": [], "execution_count": None}]}


def test_a_notebook_session_shares_the_notebooks_own_gateway_session(gw, alice):
    assert alice.call("PUT", "api/contents/user-files/paired.ipynb",
                      {"type": "notebook", "content": NOTEBOOK})[0] == 201
    # The agent runs the cell through the socket ...
    status, ran = gw.client.call("POST", "/v1/agents/alice/notebooks/user-files/paired.ipynb/cells/c1/execute", {})
    assert status == 200, ran
    # ... and a Jupyter session for that notebook lands on the very same kernel.
    status, model = alice.call("POST", "api/sessions", {"path": "user-files/paired.ipynb", "type": "notebook",
                                                       "name": "paired.ipynb", "kernel": {"name": "python3"}})
    assert status == 201, model
    assert model["kernel"]["gateway_session"] == "notebook:user-files/paired.ipynb"
    assert model["path"] == "user-files/paired.ipynb" and model["type"] == "notebook"

    async def go():
        ks = await KernelSocket.connect(alice.base_url, model["kernel"]["id"], alice.token, V1)
        try:
            return await ks.run("print(shared)")
        finally:
            ks.close()

    assert run(go())["stdout"] == "from the agent\n"
    # The same path again answers the existing session.
    again = alice.call("POST", "api/sessions", {"path": "user-files/paired.ipynb", "type": "notebook"})[1]
    assert again["id"] == model["id"]
    assert model["id"] in [s["id"] for s in alice.call("GET", "api/sessions")[1]]
    assert alice.call("GET", f"api/sessions/{model['id']}")[1]["kernel"]["id"] == model["kernel"]["id"]
    status, patched = alice.call("PATCH", f"api/sessions/{model['id']}", {"name": "renamed"})
    assert status == 200 and patched["name"] == "renamed" and patched["kernel"]["id"] == model["kernel"]["id"]
    assert alice.call("DELETE", f"api/sessions/{model['id']}")[0] == 204
    assert alice.call("GET", f"api/sessions/{model['id']}")[0] == 404
    assert "notebook:user-files/paired.ipynb" not in v1_sessions(gw)  # its kernel shut down, as in Jupyter


def test_a_console_session_gets_a_kernel_of_its_own_and_patch_can_move_it(gw, alice, kernel):
    status, model = alice.call("POST", "api/sessions", {"path": "user-files/console-1", "type": "console"})
    assert status == 201 and model["kernel"]["execution_state"] == "idle"
    own = model["kernel"]["gateway_session"]
    assert own.startswith("jupyter-") and own in v1_sessions(gw)
    status, moved = alice.call("PATCH", f"api/sessions/{model['id']}", {"kernel": {"id": kernel["id"]}})
    assert status == 200 and moved["kernel"]["id"] == kernel["id"]
    assert own not in v1_sessions(gw)  # the kernel it left was shut down, as jupyter_server does
    assert alice.call("DELETE", f"api/sessions/{model['id']}")[0] == 204


@pytest.mark.parametrize("body, code", [
    (None, "malformed_json"),
    ({"type": "notebook"}, "missing_field"),
    ({"path": "x.ipynb"}, "missing_field"),
    ({"path": "x.ipynb", "type": "spreadsheet"}, "invalid_type"),
    ({"path": 3, "type": "notebook"}, "wrong_type"),
    ({"path": "x.ipynb", "type": "notebook", "kernel": {"name": "nope"}}, "unknown_kernel"),
    ({"path": "x.ipynb", "type": "notebook", "kernel": {"id": "nope"}}, "unknown_kernel"),
    ({"path": "x.ipynb", "type": "notebook", "kernel": "python3"}, "wrong_type"),
    ({"path": "x.ipynb", "type": "notebook", "bogus": 1}, "unknown_field"),
    ({"path": "../../bob/x.ipynb", "type": "notebook"}, "path_outside_root"),
])
def test_session_create_refuses_bad_input_and_changes_nothing(gw, alice, body, code):
    before_sessions, before_v1 = alice.call("GET", "api/sessions")[1], v1_sessions(gw).keys()
    status, answer = alice.call("POST", "api/sessions", body)
    assert status == 400 and answer["error"]["code"] == code, answer
    assert alice.call("GET", "api/sessions")[1] == before_sessions
    assert v1_sessions(gw).keys() == before_v1


def test_session_routes_refuse_unknown_ids_and_bad_patches(alice):
    for method in ("GET", "DELETE"):
        assert alice.call(method, "api/sessions/nope")[0] == 404
    assert alice.call("PATCH", "api/sessions/nope", {"name": "x"})[0] == 404
    status, model = alice.call("POST", "api/sessions", {"path": "user-files/c2", "type": "console"})
    try:
        for body, code in (({"kernel": {}}, "missing_field"), ({"kernel": {"id": "nope"}}, "unknown_kernel"),
                           ({"type": "x"}, "invalid_type"), ({"zzz": 1}, "unknown_field")):
            status, answer = alice.call("PATCH", f"api/sessions/{model['id']}", body)
            assert status == 400 and answer["error"]["code"] == code, (body, answer)
        assert alice.call("GET", f"api/sessions/{model['id']}")[1] == model | {
            "kernel": alice.call("GET", f"api/sessions/{model['id']}")[1]["kernel"]}
        assert alice.call("GET", f"api/sessions/{model['id']}")[1]["type"] == "console"
    finally:
        alice.call("DELETE", f"api/sessions/{model['id']}")


# --- the culler --------------------------------------------------------------------------


def test_the_culler_never_kills_a_kernel_busy_over_a_websocket(tmp_path):
    gateway = GatewayProcess(tmp_path, "--jupyter-port", "0", "--Gateway.cull_idle_timeout=1",
                             "--Gateway.cull_interval=0.3", "--Gateway.spare_kernels=False").start()
    try:
        gateway.client.call("PUT", "/v1/agents/dave")
        token = mint(gateway, "dave")
        dave = JupyterClient(token["url"], token["token"])
        kid = dave.call("POST", "api/kernels", {})[1]["id"]

        async def go():
            ks = await KernelSocket.connect(dave.base_url, kid, dave.token, V1)
            try:
                # Silent and busy for several cull timeouts.
                return await ks.run("import time; time.sleep(4); 'survived'", timeout=60)
            finally:
                ks.close()

        assert run(go())["results"] == [{"text/plain": "'survived'"}]
        # Idle afterwards, it is culled as any idle kernel is.
        assert wait_until(lambda: dave.call("GET", f"api/kernels/{kid}")[0] == 404, timeout=30)
    finally:
        gateway.stop()


def test_a_disabled_live_kernel_skill_closes_the_kernel_routes(gw):
    assert gw.client.call("PUT", "/v1/agents/erin")[0] == 201
    token = mint(gw, "erin")
    erin = JupyterClient(token["url"], token["token"])
    kid = erin.call("POST", "api/kernels", {})[1]["id"]
    status, body = gw.client.call("PATCH", "/v1/agents/erin/skills/jupyter-live-kernel", {"enabled": False})
    assert status == 200, body
    try:
        for method, path, body in (("POST", "api/kernels", {}),
                                   ("POST", "api/sessions", {"path": "x.ipynb", "type": "notebook"})):
            status, answer = erin.call(method, path, body)
            assert status == 403 and answer["error"]["code"] == "skill_disabled", (path, answer)
        assert kid not in [k["id"] for k in erin.call("GET", "api/kernels")[1]]  # its kernels were stopped
        assert erin.call("GET", "api/contents")[0] == 200  # files stay reachable
    finally:
        gw.client.call("PATCH", "/v1/agents/erin/skills/jupyter-live-kernel", {"enabled": True})


def test_cells_a_jupyter_client_runs_count_in_the_session(gw, alice):
    """``jlk sessions`` reads execution_count from the kernel, whoever ran the cells (a browser too)."""
    assert gw.client.execute("alice", "counted", "1")[0] == 200
    kernel_id = v1_sessions(gw)["counted"]["kernel_id"]

    async def two_cells_from_a_websocket():
        ks = await KernelSocket.connect(alice.base_url, kernel_id, alice.token, V1)
        try:
            for code in ("2", "3"):
                assert (await ks.run(code))["reply"]["status"] == "ok"
        finally:
            ks.close()

    run(two_cells_from_a_websocket())
    assert wait_until(lambda: v1_sessions(gw)["counted"]["execution_count"] == 3), v1_sessions(gw)["counted"]
    # The agent's own next cell follows on from there.
    status, body = gw.client.execute("alice", "counted", "4")
    assert status == 200 and body["execution_count"] == 4, body
    assert v1_sessions(gw)["counted"]["execution_count"] == 4
    # A kernel's restart starts the count again.
    assert gw.client.call("POST", "/v1/agents/alice/sessions/counted/restart")[0] == 200
    assert v1_sessions(gw)["counted"]["execution_count"] == 0
