"""``/agents/{agent}/api/kernels/{id}/channels``: the kernel websocket, legacy and v1 protocols.

The wire formats are jupyter_server's own helpers
(``jupyter_server.services.kernels.connection.base``); the ZMQ side, one
connection per websocket with buffered replay, is ``jupyter_api.channels``.
jupyter_server's ``ZMQChannelsWebsocketConnection`` itself needs its
``MappingKernelManager`` and ``JupyterHandler``; our kernels are the
gateway's sessions, so this handler does the same job over them.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from jupyter_client.jsonutil import extract_dates, json_default
from jupyter_server.services.kernels.connection.base import (
    deserialize_binary_message,
    deserialize_msg_from_ws_v1,
    serialize_binary_message,
    serialize_msg_to_ws_v1,
)
from tornado import websocket

from ..errors import GatewayError
from .jupyter_routes import request_token, resolve_agent

log = logging.getLogger("kernel_gateway.jupyter")

V1 = "v1.kernel.websocket.jupyter.org"
MAX_MESSAGE = 64 << 20  # largest websocket frame accepted from a client


class ChannelsHandler(websocket.WebSocketHandler):
    def initialize(self, core: Any, scope: str | None = None, tcp: bool = False, route: str = "") -> None:
        self.core = core
        self.route = route
        self.scope = scope
        self.tcp = tcp
        self.bridge: Any = None
        self.protocol: str | None = None

    async def get(self, agent: str, kernel_id: str) -> None:
        try:
            self.agent = resolve_agent(self.core, self.scope, self.tcp, agent, request_token(self))
            kernels = self.core.jupyter.kernels(self.agent)
            session = kernels.session_of(kernel_id)
            self.core.jupyter.require_kernel(self.agent)
            session_id = (self.get_query_argument("session_id", None) or uuid.uuid4().hex)[:256]
            # Before the upgrade: past the agent's share the answer is a plain 429 in JSON.
            self.core.jupyter.bridges.make_room(self.agent, kernel_id, session_id)
        except GatewayError as e:
            self.set_status(e.status)
            self.set_header("Content-Type", "application/json")
            self.finish(json.dumps({"message": e.message, "reason": self._reason, "error": e.to_json()["error"]}))
            return
        self.kernel_id = kernel_id
        self.gateway_session = session.id
        self.session_id = session_id
        await super().get(agent, kernel_id)

    def check_origin(self, origin: str) -> bool:
        # Non-browser clients send no Origin; a browser page must come from this very host.
        return super().check_origin(origin)

    def select_subprotocol(self, subprotocols: list[str]) -> str | None:
        return V1 if V1 in subprotocols else None

    def get_compression_options(self) -> None:
        return None

    async def open(self, agent: str, kernel_id: str) -> None:
        self.protocol = self.selected_subprotocol
        # Many small frames in a row (status, stream, reply): Nagle plus delayed ACKs would add ~40 ms.
        self.set_nodelay(True)
        bridges = self.core.jupyter.bridges
        try:
            self.bridge, reused = bridges.open(self.agent, self.gateway_session, kernel_id, self.session_id)
        except LookupError:
            self.close(1011, "the kernel is gone")
            return
        except GatewayError as e:
            self.close(1013, e.message[:120])  # try again later
            return
        stale = bridges.attached(self.bridge, self)
        if stale is not None and stale is not self:
            stale.bridge = None  # the same session id again: the newer websocket wins, as in jupyter_server
            stale.close(1000, "replaced by a newer connection with the same session_id")
        for channel, parts in self.bridge.attach(self.deliver, self.gone):
            self.deliver(channel, parts)
        if not reused:
            # on_message waits for open: nothing the client sends goes out before iopub is live.
            await self.bridge.nudge()

    def deliver(self, channel: str, parts: list) -> None:
        """One kernel message to this websocket, in its protocol."""
        try:
            if self.protocol == V1:
                self.write_message(serialize_msg_to_ws_v1(parts, channel), binary=True)
                return
            session = self.bridge.session
            msg = _unpack(session, parts)
            msg["channel"] = channel
            if msg["buffers"]:
                self.write_message(serialize_binary_message(msg), binary=True)
            else:
                self.write_message(json.dumps(msg, default=json_default))
        except websocket.WebSocketClosedError:
            pass
        except (ValueError, TypeError, KeyError) as e:
            log.warning("kernel %s sent a message that could not be relayed: %s", self.kernel_id, e)

    def gone(self) -> None:
        try:
            self.close(1000, "the kernel is gone")
        except Exception:
            pass

    def on_message(self, message: str | bytes) -> None:
        if self.bridge is None:
            return
        if len(message) > MAX_MESSAGE:
            log.warning("websocket message of %d bytes refused", len(message))
            return
        try:
            channel, msg_list = self._decode(message)
        except (ValueError, TypeError, KeyError, IndexError, UnicodeDecodeError) as e:
            log.info("malformed websocket message ignored: %s", e)
            return
        if channel not in ("shell", "control", "stdin"):
            return
        self.bridge.send(channel, msg_list)

    def _decode(self, message: str | bytes) -> tuple[str, list]:
        """(channel, [header, parent, metadata, content, *buffers]) of a client message."""
        session = self.bridge.session
        if self.protocol == V1:
            if not isinstance(message, bytes):
                raise ValueError("the v1 protocol sends binary frames")
            check_v1_frame(message)
            channel, msg_list = deserialize_msg_from_ws_v1(message)
            if len(msg_list) < 4:
                raise ValueError("a message has header, parent_header, metadata and content")
            for part in msg_list[:4]:
                if not isinstance(json.loads(part), dict):
                    raise ValueError("message parts are JSON objects")
            return channel, msg_list
        msg = deserialize_binary_message(message) if isinstance(message, bytes) else json.loads(message)
        if not isinstance(msg, dict) or not isinstance(msg.get("header"), dict):
            raise ValueError("a message is an object with a header")
        channel = msg.pop("channel", None) or "shell"
        parts = [
            session.pack(msg["header"]),
            session.pack(msg.get("parent_header") or {}),
            session.pack(msg.get("metadata") or {}),
            session.pack(msg.get("content") or {}),
        ]
        buffers = msg.get("buffers") or []
        if not all(isinstance(b, (bytes, memoryview)) for b in buffers):
            raise ValueError("buffers are binary")
        return channel, parts + list(buffers)

    def on_close(self) -> None:
        if self.bridge is not None:
            self.core.jupyter.bridges.detached(self.bridge, self)
            self.bridge = None


def check_v1_frame(message: bytes) -> None:
    """Refuse a v1 frame whose offset table does not fit in it, before decoding trusts that table."""
    if len(message) < 8:
        raise ValueError("a v1 frame starts with its offset count")
    count = int.from_bytes(message[:8], "little")
    if not 3 <= count <= 1024 or 8 * (count + 1) > len(message):
        raise ValueError(f"a v1 frame of {len(message)} bytes cannot hold {count} offsets")
    offsets = [int.from_bytes(message[8 * (i + 1): 8 * (i + 2)], "little") for i in range(count)]
    if offsets != sorted(offsets) or offsets[0] != 8 * (count + 1) or offsets[-1] > len(message):
        raise ValueError("the offsets of a v1 frame are out of order or out of range")


def _unpack(session: Any, parts: list) -> dict:
    """A kernel message as a dict for the legacy protocol (what Session.deserialize builds)."""
    header = extract_dates(session.unpack(parts[0]))
    return {
        "header": header,
        "msg_id": header.get("msg_id"),
        "msg_type": header.get("msg_type"),
        "parent_header": extract_dates(session.unpack(parts[1])),
        "metadata": session.unpack(parts[2]),
        "content": session.unpack(parts[3]),
        "buffers": [bytes(b) for b in parts[4:]],
    }
