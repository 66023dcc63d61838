"""JupyterLab's kernel and session managers for a Lab paired with one agent.

In gateway mode jupyter_server only knows kernels it started itself
(``GatewayMappingKernelManager.list_kernels`` filters the gateway's list down
to them), so a notebook opened in Lab would get a kernel of its own.  Here a
notebook's session asks the gateway for *that notebook's* kernel, the one
``jlk execute --path P`` and the notebook routes use (``POST /api/sessions``
with the path answers with the notebook's own gateway session), and attaches
to it by id: jupyter_server's ``GatewayKernelManager.start_kernel(kernel_id=...)``
adopts an existing kernel instead of starting one.

Those kernels belong to the agent: Lab leaving must not stop them, so at
shutdown Lab forgets its kernels rather than deleting them (the gateway's
culler stops them when they are idle, as any other).
"""

from __future__ import annotations

import posixpath
from typing import Any

from jupyter_server.gateway.gateway_client import GatewayClient, gateway_request
from jupyter_server.gateway.managers import GatewayMappingKernelManager, GatewaySessionManager
from jupyter_server.utils import url_path_join
from tornado.escape import json_decode, json_encode

#: A document JupyterLab opens through its collaborative drive has this prefix on its path.
RTC_DRIVE = "RTC:"


def notebook_path(path: str | None, name: Any) -> str | None:
    """The notebook a new Lab session is for.

    JupyterLab starts a document's session at a placeholder path beside it
    (``<folder>/<uuid>``, named after the file) and moves it to the file's
    path once it has its kernel; ``name`` is the notebook's file name.
    """
    if path and path.startswith(RTC_DRIVE):
        path = path[len(RTC_DRIVE):]
    named = isinstance(name, str) and name.endswith(".ipynb") and "/" not in name
    if path and named and posixpath.basename(path) != name:
        path = posixpath.join(posixpath.dirname(path), name)
    return path


class PairedSessionManager(GatewaySessionManager):
    """A notebook's session runs on the agent's own kernel for that notebook."""

    async def notebook_kernel_id(self, path: str, kernel_name: str | None) -> str:
        """The id of the gateway's kernel for the notebook at ``path`` (started there if need be)."""
        body: dict[str, Any] = {"path": path, "type": "notebook", "name": path.rsplit("/", 1)[-1]}
        if kernel_name:
            body["kernel"] = {"name": kernel_name}
        response = await gateway_request(
            url_path_join(GatewayClient.instance().url, "api/sessions"),
            method="POST",
            headers={"Content-Type": "application/json"},
            body=json_encode(body),
        )
        return json_decode(response.body)["kernel"]["id"]

    async def start_kernel_for_session(  # type: ignore[override]
        self,
        session_id: str,
        path: str | None,
        name: Any,
        type: str | None,
        kernel_name: Any,
        kernel_id: str | None = None,
    ) -> str:
        notebook = notebook_path(path, name)
        self.log.info("session %s for %s %r (named %r): the notebook %r", session_id, type, path, name, notebook)
        if type == "notebook" and notebook and kernel_id is None:
            kernel_id = await self.notebook_kernel_id(notebook, kernel_name)
            if kernel_id in self.kernel_manager:
                return kernel_id  # another Lab session of this notebook has it already
        # With a kernel id, GatewayKernelManager.start_kernel adopts that kernel instead of starting one.
        return await super().start_kernel_for_session(session_id, path, name, type, kernel_name, kernel_id=kernel_id)


class PairedKernelManager(GatewayMappingKernelManager):
    """Lab's kernels, which are the agent's: shutting Lab down leaves them running."""

    async def shutdown_all(self, now: bool = False) -> None:
        for kernel_id in list(self._kernels):
            self.remove_kernel(kernel_id)
