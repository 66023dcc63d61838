"""JupyterLab's kernel websockets, relayed to the gateway in the protocol the browser chose.

jupyter_server's ``GatewayWebSocketConnection`` forces the legacy JSON
protocol on the browser: JupyterLab offers only
``v1.kernel.websocket.jupyter.org``, Chromium fails that handshake, and
JupyterLab retries without a subprotocol.  The failed first try still made
a gateway websocket with the same ``session_id``, which races the second
one for the kernel's replies (a cell run just then can lose its output).

The gateway speaks both protocols, so here the browser gets the one it asks
for and the gateway websocket is opened with the same one: frames pass
through unchanged (binary frames as binary).  When the gateway side ends,
the browser's websocket is closed too (code 1012) and JupyterLab reconnects itself.
"""

from __future__ import annotations

from typing import Any

from jupyter_server.gateway.connections import GatewayWebSocketConnection
from jupyter_server.gateway.gateway_client import GatewayClient
from jupyter_server.utils import url_path_join
from tornado import websocket
from tornado.escape import url_escape
from tornado.httpclient import HTTPRequest
from tornado.ioloop import IOLoop
from traitlets import Unicode


class SameProtocolGatewayConnection(GatewayWebSocketConnection):
    # None: jupyter_server's handler selects v1 when the browser offers it, else the legacy protocol.
    kernel_ws_protocol = Unicode(None, allow_none=True, config=True)

    async def connect(self) -> None:
        self.ws = None
        client = GatewayClient.instance()
        url = url_path_join(client.ws_url or "", client.kernels_endpoint, url_escape(self.kernel_id), "channels")
        if self.session_id:
            url += f"?session_id={url_escape(self.session_id)}"
        protocol = self.websocket_handler.selected_subprotocol
        request = HTTPRequest(url, **client.load_connection_args())
        self.ws_future = websocket.websocket_connect(request, subprotocols=[protocol] if protocol else None)
        self.ws_future.add_done_callback(self._connection_done)
        IOLoop.current().add_future(self.ws_future, lambda _: self._read_messages())

    async def _read_messages(self) -> None:  # type: ignore[override]
        while self.ws is not None and not self.disconnected:
            try:
                message = await self.ws.read_message()
            except Exception as e:  # the gateway went away mid-frame
                self.log.warning("kernel %s: reading from the gateway failed: %s", self.kernel_id, e)
                message = None
            if message is None:
                break
            self.handle_outgoing_message(message)
        if not self.disconnected:
            self.log.warning("kernel %s: the gateway closed its websocket; closing the browser's", self.kernel_id)
            # Not 1000/1001, after which JupyterLab would stay disconnected: it reconnects (a new gateway websocket).
            self.websocket_handler.close(code=1012, reason="the gateway closed the kernel's websocket")

    def handle_outgoing_message(self, incoming_msg: Any, *args: Any) -> None:
        try:
            self.websocket_handler.write_message(incoming_msg, binary=isinstance(incoming_msg, bytes))
        except websocket.WebSocketClosedError:
            pass  # the browser left; its messages are the gateway's to buffer

    def _write_message(self, message: Any) -> None:
        try:
            if not self.disconnected and self.ws is not None:
                self.ws.write_message(message, binary=isinstance(message, bytes))
        except Exception as e:
            self.log.error("kernel %s: writing to the gateway failed: %s", self.kernel_id, e)
