"""Clients we did not write: jupyter_server's GatewayClient / GatewayKernelManager, and a whole
Jupyter Server in gateway mode (what JupyterLab uses), against our API."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess

import pytest

from jupyter_support import JupyterClient, KernelSocket
from support import BIN, GatewayProcess, wait_until


@pytest.fixture
def gw(tmp_path):
    gateway = GatewayProcess(tmp_path, "--jupyter-port", "0").start()
    gateway.client.call("PUT", "/v1/agents/alice")
    yield gateway
    gateway.stop()


def jupyter_sessions(gw):
    return [s["id"] for s in gw.client.call("GET", "/v1/agents/alice/sessions")[1]["sessions"]
            if s["id"].startswith("jupyter-")]


def test_gateway_kernel_manager_starts_restarts_and_shuts_down_a_kernel(gw):
    from jupyter_server.gateway.gateway_client import GatewayClient
    from jupyter_server.gateway.managers import GatewayKernelManager, GatewayKernelSpecManager

    token = gw.client.call("POST", "/v1/agents/alice/tokens")[1]
    GatewayClient.clear_instance()
    client = GatewayClient.instance(url=token["url"].rstrip("/"), auth_token=token["token"], request_timeout=120.0)
    client.init_connection_args()

    async def go():
        spec = await GatewayKernelSpecManager().get_kernel_spec("python3")
        km = GatewayKernelManager()
        await km.start_kernel(kernel_name="python3")
        started = dict(km.kernel)
        listed = jupyter_sessions(gw)
        alive = await km.is_alive()
        await km.interrupt_kernel()
        await km.restart_kernel()
        restarted = dict(km.kernel)
        await km.shutdown_kernel()
        return spec, started, listed, alive, restarted

    try:
        spec, started, listed, alive, restarted = asyncio.run(go())
    finally:
        GatewayClient.clear_instance()
    assert spec["spec"]["language"] == "python" and "sandboxed" in spec["spec"]["display_name"]
    assert started["execution_state"] == "idle"  # the real state at creation, never 'starting'
    assert started["gateway_session"] in listed and alive
    assert restarted["id"] == started["id"] and restarted["execution_state"] == "idle"
    assert jupyter_sessions(gw) == []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_jupyter_server_in_gateway_mode_runs_cells_on_our_kernels(gw, tmp_path):
    token = gw.client.call("POST", "/v1/agents/alice/tokens")[1]
    port, server_token = free_port(), "server-token"
    root = tmp_path / "server-root"
    root.mkdir()
    log = open(tmp_path / "jupyter-server.log", "wb")
    proc = subprocess.Popen(
        [os.path.join(BIN, "jupyter-server"), "--no-browser", "--allow-root", f"--ServerApp.port={port}",
         "--ServerApp.port_retries=0", "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={server_token}",
         f"--ServerApp.root_dir={root}", f"--GatewayClient.url={token['url'].rstrip('/')}",
         f"--GatewayClient.auth_token={token['token']}", "--GatewayClient.request_timeout=120"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt")},
    )
    try:
        server = JupyterClient(f"http://127.0.0.1:{port}/", server_token)

        def up():
            try:
                return server.call("GET", "api/status")[0] == 200
            except OSError:
                return False

        assert wait_until(up, timeout=60), open(tmp_path / "jupyter-server.log").read()
        specs = server.call("GET", "api/kernelspecs")[1]
        assert "sandboxed" in specs["kernelspecs"]["python3"]["spec"]["display_name"]  # ours, through the server
        status, model = server.call("POST", "api/kernels", {"name": "python3"})
        assert status == 201, model
        assert model["execution_state"] == "idle"
        assert len(jupyter_sessions(gw)) == 1  # the kernel is the gateway's

        async def go():
            ks = await KernelSocket.connect(server.base_url, model["id"], server_token)
            try:
                return await ks.run("print('through jupyter_server'); 40 + 2")
            finally:
                ks.close()

        out = asyncio.run(go())
        assert out["stdout"] == "through jupyter_server\n" and out["results"] == [{"text/plain": "42"}]
        assert server.call("DELETE", f"api/kernels/{model['id']}")[0] == 204
        assert wait_until(lambda: jupyter_sessions(gw) == [])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
