"""``/agents/{agent}/api/kernels/{id}/channels``: the kernel websocket, legacy and v1 protocols.

The handler derives from the one HTTP base (``base.BaseHandler``, under
tornado's ``WebSocketHandler``): the same agent scoping and token check, the
same error renderer for a refused handshake.  The ZMQ side, one connection
per websocket with buffered replay, is ``jupyter_api.channels``.
jupyter_server's ``ZMQChannelsWebsocketConnection`` itself needs its
``MappingKernelManager`` and ``JupyterHandler``; our kernels are the
gateway's sessions, so this handler does the same job over them.

Every frame a client sends is bounded before it is parsed (see
:func:`parse_legacy_binary` and :func:`check_v1_frame`): counts capped,
offsets checked against the frame's actual size, JSON parts through
:mod:`kernel_gateway.json_input`.  A malformed frame is dropped and the
client told so in a Jupyter message (an iopub ``error`` whose ``ename`` is
``MalformedFrame``, and an error ``*_reply`` when the request's header could
be read); the connection goes on.  Outgoing kernel messages use
jupyter_server's serializers.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from jupyter_client.jsonutil import json_default
from jupyter_server.services.kernels.connection.base import (
    deserialize_msg_from_ws_v1,
    serialize_binary_message,
    serialize_msg_to_ws_v1,
)
from tornado import websocket

from .. import json_input
from ..errors import GatewayError
from .base import BaseHandler

log = logging.getLogger("kernel_gateway.jupyter")

V1 = "v1.kernel.websocket.jupyter.org"
MAX_MESSAGE = 64 << 20  # largest websocket frame accepted from a client (tornado refuses larger ones unread)
MAX_PARTS = 1024  # parts (buffers) of one frame, in either protocol
MAX_NOTICES_PENDING = 64  # refusal notices not yet flushed to a client that does not read: past this, no more


class MalformedFrame(ValueError):
    """A client frame that is refused; ``header`` is its request's header when that could be read."""

    def __init__(self, reason: str, header: dict | None = None, channel: str | None = None):
        super().__init__(reason)
        self.header = header
        self.channel = channel


class ChannelsHandler(websocket.WebSocketHandler, BaseHandler):
    tool = "jupyter_channels"
    jupyter_errors = True
    takes_request_slot = False  # open for hours: the bridges have their own caps

    def initialize(self, core: Any, scope: str | None = None, route: str = "", tcp: bool = False) -> None:
        super().initialize(core, scope, route, tcp)
        self.bridge: Any = None
        self.protocol: str | None = None
        self._notices_pending = 0
        self._not_reading = False  # closed for letting its share of unsent messages fill

    def set_default_headers(self) -> None:
        self.set_header("Cache-Control", "no-store")  # (no JSON Content-Type on a 101; errors set their own)

    async def get(self, agent: str, kernel_id: str) -> None:
        # Refusals are GatewayErrors, rendered by the base's write_error, as on every other route.
        self.agent = self.agent_arg(agent)
        self.core.jupyter.require_agent(self.agent)
        session = self.core.jupyter.kernels(self.agent).session_of(kernel_id)
        self.core.jupyter.require_kernel(self.agent)
        session_id = (self.get_query_argument("session_id", None) or uuid.uuid4().hex)[:256]
        # Before the upgrade: past the agent's share the answer is a plain 429 in JSON.
        self.core.jupyter.bridges.make_room(self.agent, kernel_id, session_id)
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

    def deliver(self, channel: str, parts: list) -> Any:
        """One kernel message to this websocket, in its protocol; the write's future, or None.

        Until the client has read it, the message is held in the gateway's memory: it counts
        against the agent's share of those bytes, and a client that lets it fill is closed.
        """
        bridges, size = self.core.jupyter.bridges, sum(len(p) for p in parts)
        if self._not_reading:
            return None
        if not bridges.hold(self.agent, size):
            self._not_reading = True
            log.warning("kernel websocket of agent %s closed: its client is not reading (%d bytes held)",
                        self.agent, bridges.held(self.agent))
            self.close(1008, "not reading: past this agent's share of unsent kernel messages")
            return None
        future = None
        try:
            if self.protocol == V1:
                future = self.write_message(serialize_msg_to_ws_v1(parts, channel), binary=True)
            else:
                msg = _unpack(parts)
                msg["channel"] = channel
                if msg["buffers"]:
                    future = self.write_message(serialize_binary_message(msg), binary=True)
                else:
                    future = self.write_message(json.dumps(msg, default=json_default))
        except websocket.WebSocketClosedError:
            pass
        except (ValueError, TypeError, KeyError) as e:
            log.warning("kernel %s sent a message that could not be relayed: %s", self.kernel_id, e)
        if future is None:
            bridges.release(self.agent, size)
        else:
            future.add_done_callback(lambda _f: bridges.release(self.agent, size))
        return future

    def gone(self) -> None:
        try:
            self.close(1000, "the kernel is gone")
        except Exception:
            pass

    def on_message(self, message: str | bytes) -> None:
        if self.bridge is None:
            return
        try:
            channel, msg_list = self._decode(message)
        except MalformedFrame as e:
            log.debug("malformed websocket frame refused: %s", e)  # (a flood of them is no flood of log lines)
            self.refuse(e)
            return
        self.bridge.send(channel, msg_list)

    def _decode(self, message: str | bytes) -> tuple[str, list]:
        """(channel, [header, parent, metadata, content, *buffers]) of a client frame, or MalformedFrame."""
        if len(message) > MAX_MESSAGE:
            raise MalformedFrame(f"a frame of {len(message)} bytes is over the limit of {MAX_MESSAGE}")
        if self.protocol == V1:
            if not isinstance(message, bytes):
                raise MalformedFrame("the v1 protocol sends binary frames")
            check_v1_frame(message)
            try:
                channel, msg_list = deserialize_msg_from_ws_v1(message)  # (its offset table is checked above)
            except UnicodeDecodeError:
                raise MalformedFrame("the channel of a v1 frame is not UTF-8") from None
            if len(msg_list) < 4:
                raise MalformedFrame("a message has header, parent_header, metadata and content")
            names = ("header", "parent_header", "metadata", "content")
            header = None
            for name, part in zip(names, msg_list):
                try:
                    value = json_input.loads_object(part, max_bytes=len(message), what=f"the {name}")
                except json_input.JSONRefused as e:
                    raise MalformedFrame(str(e), header, channel) from None
                if name == "header":
                    header = value
            check_channel(channel, header)
            return channel, msg_list
        if isinstance(message, bytes):
            msg = parse_legacy_binary(message)
        else:
            try:
                msg = json_input.loads_object(message, max_bytes=MAX_MESSAGE, what="the message")
            except json_input.JSONRefused as e:
                raise MalformedFrame(str(e)) from None
            msg["buffers"] = []
        header = msg.get("header")
        if not isinstance(header, dict):
            raise MalformedFrame("a message is an object with a header")
        channel = msg.get("channel") or "shell"
        check_channel(channel, header)
        for name in ("parent_header", "metadata", "content"):
            if not isinstance(msg.get(name) or {}, dict):
                raise MalformedFrame(f"the {name} of a message is an object", header, channel)
        session = self.bridge.session
        parts = [session.pack(header)] + [session.pack(msg.get(name) or {})
                                          for name in ("parent_header", "metadata", "content")]
        return channel, parts + list(msg["buffers"])

    def refuse(self, error: MalformedFrame) -> None:
        """Tell the client its frame was dropped, in Jupyter messages; the connection goes on."""
        session = self.bridge.session if self.bridge is not None else None
        if session is None or self._notices_pending >= MAX_NOTICES_PENDING:
            return  # a client that sends garbage without reading gets no pile of notices
        reason = str(error)
        header = error.header if _readable_header(error.header) else None
        notices = [("iopub", session.msg("error", {
            "ename": "MalformedFrame", "evalue": reason,
            "traceback": [f"MalformedFrame: the gateway dropped a websocket frame: {reason}"],
        }, parent=header or {}))]
        if header is not None and header["msg_type"].endswith("_request") and error.channel in REQUEST_CHANNELS:
            reply_type = header["msg_type"][: -len("_request")] + "_reply"
            notices.append((error.channel, session.msg(reply_type, {
                "status": "error", "ename": "MalformedFrame", "evalue": reason, "traceback": [],
            }, parent=header)))
        for channel, msg in notices:
            parts = [session.pack(msg[k]) for k in ("header", "parent_header", "metadata", "content")]
            future = self.deliver(channel, parts)
            if future is not None:
                self._notices_pending += 1
                future.add_done_callback(self._notice_flushed)

    def _notice_flushed(self, _future: Any) -> None:
        self._notices_pending -= 1

    def on_close(self) -> None:
        if self.bridge is not None:
            self.core.jupyter.bridges.detached(self.bridge, self)
            self.bridge = None


REQUEST_CHANNELS = ("shell", "control", "stdin")


def check_channel(channel: Any, header: dict | None) -> None:
    if channel not in REQUEST_CHANNELS:
        raise MalformedFrame(f"a client sends on shell, control or stdin, not {str(channel)[:40]!r}", header)


def _readable_header(header: Any) -> bool:
    return (isinstance(header, dict) and isinstance(header.get("msg_id"), str)
            and isinstance(header.get("msg_type"), str) and len(header["msg_type"]) <= 100)


def check_v1_frame(message: bytes) -> None:
    """Refuse a v1 frame whose offset table does not fit in it, before decoding trusts that table.

    A v1 frame: 8 bytes of offset count n (little-endian), then n offsets of
    8 bytes, the first of which is where the table ends; the parts (channel,
    header, parent_header, metadata, content, buffers) lie between them.
    """
    if len(message) < 8:
        raise MalformedFrame("a v1 frame starts with its offset count")
    count = int.from_bytes(message[:8], "little")
    if not 3 <= count <= MAX_PARTS + 2 or 8 * (count + 1) > len(message):
        raise MalformedFrame(f"a v1 frame of {len(message)} bytes cannot hold {count} offsets")
    offsets = [int.from_bytes(message[8 * (i + 1): 8 * (i + 2)], "little") for i in range(count)]
    if offsets[0] != 8 * (count + 1) or any(a > b for a, b in zip(offsets, offsets[1:])) or offsets[-1] > len(message):
        raise MalformedFrame("the offsets of a v1 frame are out of order or out of range")


def parse_legacy_binary(message: bytes) -> dict:
    """A legacy-protocol binary frame as a message dict with ``buffers``, or MalformedFrame.

    Our own, not jupyter_server's ``deserialize_binary_message``: that one
    builds a struct format of as many items as the frame's first 4 bytes
    declare before it looks at the frame's size (one 6-byte frame declaring
    2^31 buffers allocated 4 GB and held the loop for 20 s), slices at
    offsets it never checks (unsorted offsets copy the frame once per part)
    and decodes the JSON part unbounded.  The format: 4 bytes of part count n
    (big-endian), n offsets of 4 bytes, the first of which is where the table
    ends; part 0 is the JSON message, the others its binary buffers.
    """
    if len(message) < 8:
        raise MalformedFrame("a binary frame starts with its part count and offsets")
    count = int.from_bytes(message[:4], "big", signed=True)
    if not 1 <= count <= MAX_PARTS or 4 * (count + 1) > len(message):
        raise MalformedFrame(f"a binary frame of {len(message)} bytes cannot hold {count} parts")
    offsets = [int.from_bytes(message[4 * (i + 1): 4 * (i + 2)], "big") for i in range(count)] + [len(message)]
    if offsets[0] != 4 * (count + 1) or any(a > b for a, b in zip(offsets, offsets[1:])):
        raise MalformedFrame("the offsets of a binary frame are out of order or out of range")
    try:
        msg = json_input.loads_object(message[offsets[0]:offsets[1]], max_bytes=len(message), what="the message")
    except json_input.JSONRefused as e:
        raise MalformedFrame(str(e)) from None
    msg["buffers"] = [message[a:b] for a, b in zip(offsets[1:-1], offsets[2:])]
    return msg


KERNEL_PART_MAX = MAX_MESSAGE  # one JSON part of a kernel message, relayed in the legacy protocol


def _unpack(parts: list) -> dict:
    """A kernel message as a dict for the legacy protocol (what Session.deserialize builds), bounded."""
    header, parent, metadata, content = (
        json_input.loads(p, max_bytes=KERNEL_PART_MAX, what="a kernel message part") for p in parts[:4]
    )
    if not isinstance(header, dict):
        raise ValueError("a kernel message header is not an object")
    return {
        "header": header,
        "msg_id": header.get("msg_id"),
        "msg_type": header.get("msg_type"),
        "parent_header": parent,
        "metadata": metadata,
        "content": content,
        "buffers": [bytes(b) for b in parts[4:]],
    }
