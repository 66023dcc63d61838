"""Shared fixtures: a real gateway per test module, and sandboxed kernels through plain jupyter_client.

``gw`` is one ``kernel-gateway serve`` process for a whole test module, with
the agents that module names in ``GATEWAY_AGENTS`` (default alice and bob)
already created, started with the module's ``GATEWAY_ARGS`` (``{tmp}`` is its
temporary directory).

``jupyter_path`` is a temporary JUPYTER_PATH for the whole test session;
``make_kernelspec`` writes a kernelspec there (one per provisioner config);
``sandboxed_kernel`` starts a kernel from it with ``KernelManager``, the way jupyter_server or
JupyterLab would.  Use it as a context manager, from a test or from a
module-scoped fixture when several tests can share one kernel.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
from jupyter_client import KernelManager
from jupyter_client.blocking import BlockingKernelClient

from kernel_gateway.provisioner import kernelspec_dict
from support import GatewayProcess


@pytest.fixture(scope="module")
def gw(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A real gateway for the test module (real bwrap, real kernels, real Unix sockets)."""
    module = request.module
    tmp = tmp_path_factory.mktemp(module.__name__.rsplit(".", 1)[-1])
    args = [arg.format(tmp=tmp) for arg in getattr(module, "GATEWAY_ARGS", ())]
    gateway = GatewayProcess(tmp, *args).start()
    try:
        for agent in getattr(module, "GATEWAY_AGENTS", ("alice", "bob")):
            status, body = gateway.client.call("PUT", f"/v1/agents/{agent}")
            assert status in (200, 201), body
        yield gateway
    finally:
        gateway.stop()


@dataclass
class CellResult:
    """What one execute request produced, flattened for assertions."""

    status: str
    stdout: str = ""
    stderr: str = ""
    result: str | None = None  # text/plain of the execute_result
    ename: str | None = None
    evalue: str | None = None


@dataclass
class SandboxedKernel:
    """A started kernel, its client, and the runtime paths worth checking afterwards."""

    km: KernelManager
    kc: BlockingKernelClient
    runtime_dir: str
    connection_file: str
    log_path: Path

    def run(self, code: str, timeout: float = 30) -> CellResult:
        """Execute ``code`` and collect its outputs until the kernel is idle again."""
        return self.collect(self.kc.execute(code, store_history=False), timeout)

    def collect(self, msg_id: str, timeout: float = 30) -> CellResult:
        """The outputs and reply of an execute request sent earlier with ``kc.execute``."""
        cell = CellResult(status="unknown")
        while True:
            try:
                msg = self.kc.get_iopub_msg(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no idle status within {timeout}s for request {msg_id}") from None
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                if content["name"] == "stdout":
                    cell.stdout += content["text"]
                else:
                    cell.stderr += content["text"]
            elif kind == "execute_result":
                cell.result = content["data"].get("text/plain")
            elif kind == "error":
                cell.ename, cell.evalue = content["ename"], content["evalue"]
            elif kind == "status" and content["execution_state"] == "idle":
                break
        # Skip stale replies (wait_for_ready may leave a late kernel_info_reply behind).
        reply = self.kc.get_shell_msg(timeout=timeout)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = self.kc.get_shell_msg(timeout=timeout)
        cell.status = reply["content"]["status"]
        return cell

    def wait_for_output(self, msg_id: str, text: str, timeout: float = 30) -> None:
        """Block until the running request ``msg_id`` has printed ``text`` to stdout."""
        seen = ""
        while text not in seen:
            try:
                msg = self.kc.get_iopub_msg(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"{text!r} not printed within {timeout}s") from None
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
                seen += msg["content"]["text"]

    def value(self, expression: str, timeout: float = 30) -> Any:
        """The value of a JSON-serialisable ``expression`` evaluated in the kernel."""
        cell = self.run(f"import json as _json; print(_json.dumps({expression}))", timeout)
        assert cell.status == "ok", f"{expression!r} failed: {cell.ename}: {cell.evalue}"
        return json.loads(cell.stdout)


@pytest.fixture(scope="session")
def jupyter_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private JUPYTER_PATH so the test kernelspecs never touch the user's own."""
    path = tmp_path_factory.mktemp("jupyter_path")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JUPYTER_PATH", str(path))
        yield path


@pytest.fixture(scope="session")
def make_kernelspec(jupyter_path: Path):
    """Factory: ``make_kernelspec(config, python=None)`` writes a sandboxed kernelspec, returns its name."""

    def write(config: dict[str, Any], python: str | None = None) -> str:
        name = f"sbx-{uuid.uuid4().hex[:8]}"
        spec_dir = jupyter_path / "kernels" / name
        spec_dir.mkdir(parents=True)
        (spec_dir / "kernel.json").write_text(json.dumps(kernelspec_dict(python, config)))
        return name

    return write


@pytest.fixture(scope="session")
def sandboxed_kernel(make_kernelspec, tmp_path_factory: pytest.TempPathFactory):
    """Factory: ``with sandboxed_kernel(cwd, config) as kernel:`` yields a :class:`SandboxedKernel`.

    ``config`` is the provisioner config of the kernelspec (agent_root, profile,
    bwrap, ...).  On exit the kernel is shut down and the client stopped.
    """

    @contextmanager
    def start(cwd: str | os.PathLike, config: dict[str, Any] | None = None) -> Iterator[SandboxedKernel]:
        name = make_kernelspec(config or {})
        log_path = tmp_path_factory.mktemp("kernel-log") / "stderr.txt"
        km = KernelManager(kernel_name=name)
        # The log stays open for the kernel's life: a restart reuses the same stderr.
        with open(log_path, "w") as log:
            km.start_kernel(cwd=str(cwd), stdout=subprocess.DEVNULL, stderr=log)
            kc = km.client()
            kc.start_channels()
            kernel = SandboxedKernel(km, kc, km.provisioner.runtime_dir, km.connection_file, log_path)
            try:
                kc.wait_for_ready(timeout=30)
                yield kernel
            finally:
                kc.stop_channels()
                if km.has_kernel:
                    km.shutdown_kernel(now=True)

    return start
