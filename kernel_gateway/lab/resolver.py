"""A tornado Resolver that sends one placeholder host to a Unix socket.

JupyterLab's gateway client (jupyter_server's ``GatewayClient``) speaks HTTP
and websockets through tornado, which connects wherever its ``Resolver``
says.  Inside the ``lab`` sandbox there is no network at all, only the
agent's socket at ``/run/kernel-gateway.sock``: resolving the placeholder
host :data:`GATEWAY_HOST` to that socket lets the unmodified gateway client
reach the gateway's ``/agents/me/`` routes.  Every other host resolves as
usual (and, with no network in the sandbox, fails to connect).
"""

from __future__ import annotations

import socket
from typing import Any

from tornado.netutil import DefaultLoopResolver, Resolver

#: The host name Lab's GatewayClient.url names; no real host has it (.invalid, RFC 6761).
GATEWAY_HOST = "kernel-gateway.invalid"
SANDBOX_SOCKET = "/run/kernel-gateway.sock"


class AgentSocketResolver(Resolver):
    """:data:`GATEWAY_HOST` is the agent's Unix socket; anything else goes to the default resolver."""

    def initialize(self, socket_path: str = SANDBOX_SOCKET) -> None:  # type: ignore[override]
        self.socket_path = socket_path
        self.fallback = DefaultLoopResolver()

    async def resolve(
        self, host: str, port: int, family: socket.AddressFamily = socket.AF_UNSPEC
    ) -> list[tuple[int, Any]]:
        if host.lower() == GATEWAY_HOST:
            # tornado's TCPClient makes socket.socket(family) and connects to the address: a path here.
            return [(socket.AF_UNIX, self.socket_path)]
        return await self.fallback.resolve(host, port, family)


def install(socket_path: str = SANDBOX_SOCKET) -> None:
    """Make every tornado client of this process (HTTP and websocket) resolve through the socket."""
    Resolver.configure(AgentSocketResolver, socket_path=socket_path)
