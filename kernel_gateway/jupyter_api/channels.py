"""One kernel connection per websocket, and buffered replay when a websocket drops.

Each websocket of ``/api/kernels/{id}/channels`` gets its own ZMQ sockets to
the kernel (a jupyter_client ``AsyncKernelClient`` built from the kernel's
connection info, with the websocket's ``session_id`` as its ZMQ identity), so
the kernel routes its shell, control and stdin replies to that websocket only,
never to the gateway's own executor or to another websocket.

When a websocket closes, its sockets stay open for :data:`BUFFER_SECONDS` and
what the kernel sends is kept (bounded in messages and bytes); a websocket
that reconnects with the same ``session_id`` gets it replayed, as
jupyter_server's ``start_buffering`` / ``get_buffer`` do.  A bridge also
watches its gateway session: after a restart it reconnects to the new kernel
(telling the client ``restarting`` only when the kernel id changed, as after a
death: a restart that was asked for keeps the id and says nothing, as in
Jupyter Server), and after a shutdown it says ``dead``.

The bridge reports the kernel's iopub ``status`` messages and its traffic to
the gateway session, so ``execution_state`` and ``last_activity`` are the
observed ones and the idle culler never takes a kernel busy over a websocket.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

import zmq
from jupyter_client.asynchronous import AsyncKernelClient
from jupyter_client.session import Session as ZMQSession

from .. import json_input
from ..errors import GatewayError
from ..execution import with_socket_options
from ..sessions import LIVE_STATES

log = logging.getLogger("kernel_gateway.jupyter")

CHANNELS = ("shell", "control", "stdin", "iopub")
BUFFER_SECONDS = 120.0
BUFFER_MAX_MESSAGES = 10_000
BUFFER_MAX_BYTES = 32 << 20
WATCH_SECONDS = 0.5
MAX_BRIDGES = 256  # open or buffering, in all: each holds four ZMQ sockets (--Gateway.max_websockets_total)
MAX_BRIDGES_PER_AGENT = 32  # --Gateway.max_websockets_per_agent
HELD_BYTES_PER_AGENT = 64 << 20  # buffered or not yet written to a websocket (--Gateway.max_websocket_bytes_per_agent)
HELD_BYTES = 512 << 20  # the same, every agent together (--Gateway.max_websocket_bytes_total)
HEADER_MAX = 1 << 20  # a kernel message's header or status content, as read here (bounded, then parsed)
# What each of a bridge's ZMQ sockets holds for the gateway (ZMQ reads ahead of the loop): a kernel that
# sends faster than the loop relays loses what is past the queue, and a larger frame drops its connection.
KERNEL_QUEUE = 16  # messages
KERNEL_MAX_FRAME = 16 << 20  # bytes

# deliver(channel, parts): parts are [header, parent_header, metadata, content, *buffers] (bytes).
Deliver = Callable[[str, list], None]


class Bridge:
    """The ZMQ side of one websocket session on one kernel."""

    def __init__(self, registry: "Bridges", agent: str, gateway_session: str, kernel_id: str, session_id: str):
        self.registry = registry
        self.agent = agent
        self.gateway_session = gateway_session
        self.kernel_id = kernel_id
        self.session_id = session_id
        self.kernel: Any = None
        self.client: AsyncKernelClient | None = None
        self.sockets: dict[str, Any] = {}
        self.session: ZMQSession | None = None
        self._tasks: list[asyncio.Task] = []
        self._deliver: Deliver | None = None
        self._on_gone: Callable[[], None] | None = None
        self.buffer: list[tuple[str, list]] = []
        self._buffer_bytes = 0
        self._buffer_overflow = False
        self._expiry: asyncio.TimerHandle | None = None
        self.closed = False
        self._iopub_live = asyncio.Event()
        self._nudges: set[str] = set()

    # --- the gateway session ------------------------------------------------------

    def _gateway(self) -> Any:
        session = self.registry.sessions.sessions.get((self.agent, self.gateway_session))
        if session is None or (session.state not in LIVE_STATES and not getattr(session, "restarting_kernel_id", None)):
            return None  # (a restart in progress is not an end: the watcher follows it to the new kernel)
        return session

    def connect(self) -> None:
        """Open this bridge's own sockets to the session's current kernel."""
        session = self._gateway()
        if session is None or session.kernel is None:
            raise LookupError("the kernel is gone")
        self._close_sockets()
        if self._deliver is not None:  # attached: its connection moves to the new kernel
            self._count(self.kernel, -1)
            self._count(session.kernel, +1)
        self.kernel = session.kernel
        info = self.kernel.km.get_connection_info(session=False)
        self.session = ZMQSession(
            key=info["key"], signature_scheme=info.get("signature_scheme", "hmac-sha256"),
            session=self.session_id, username="jupyter",
        )
        client = AsyncKernelClient(session=self.session)
        client.load_connection_info(info)
        for channel in CHANNELS:  # the nudge's control socket too
            with_socket_options(client, channel, {zmq.RCVHWM: KERNEL_QUEUE, zmq.MAXMSGSIZE: KERNEL_MAX_FRAME})
        identity = self.session.bsession
        self.sockets = {
            "shell": client.connect_shell(identity=identity),
            "control": client.connect_control(identity=identity),
            "stdin": client.connect_stdin(identity=identity),
            "iopub": client.connect_iopub(),
        }
        self.client = client
        self._iopub_live = asyncio.Event()
        self._tasks = [asyncio.ensure_future(self._receive(name, sock)) for name, sock in self.sockets.items()]
        self._tasks.append(asyncio.ensure_future(self._watch()))

    def _close_sockets(self) -> None:
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        self._tasks = []
        for sock in self.sockets.values():
            sock.close(linger=0)
        self.sockets = {}

    async def _receive(self, channel: str, sock: Any) -> None:
        while True:
            try:
                frames = await sock.recv_multipart(copy=True)
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError:
                return
            try:
                _, parts = self.session.feed_identities(frames, copy=True)
            except ValueError:
                continue  # not a Jupyter message
            if len(parts) < 5:
                continue
            parts = parts[1:]  # the signature is ours to check, not the client's
            if channel == "iopub":
                self._iopub_live.set()
                if self._nudges and self._is_nudge(parts):
                    continue
                self._observe(parts)
            self._touch()
            self._emit(channel, parts)

    async def nudge(self, timeout: float = 10.0) -> bool:
        """Wait until this bridge's iopub subscription is live, as jupyter_server's ``nudge`` does.

        A ZMQ SUB socket misses what is published before its subscription
        reaches the kernel, so the first outputs of a client could be lost.
        ``kernel_info_request`` is sent on a transient control socket (answered
        even while the kernel is busy) until an iopub message arrives; the
        replies and their iopub status messages are not relayed.
        """
        if self.client is None or self.session is None:
            return False
        control = self.client.connect_control()
        try:
            loop = asyncio.get_event_loop()
            deadline = loop.time() + timeout
            while not self._iopub_live.is_set() and loop.time() < deadline:
                msg = self.session.msg("kernel_info_request", {})
                self._nudges.add(msg["header"]["msg_id"])
                self.session.send(control, msg)
                try:
                    await asyncio.wait_for(self._iopub_live.wait(), 0.2)
                except asyncio.TimeoutError:
                    pass
            return self._iopub_live.is_set()
        finally:
            control.close(linger=0)
            # Late iopub echoes of the nudges are still dropped for a moment.
            asyncio.get_event_loop().call_later(2.0, self._nudges.clear)

    def _is_nudge(self, parts: list) -> bool:
        try:
            return json_input.loads(parts[1], max_bytes=HEADER_MAX, what="a parent header").get("msg_id") in self._nudges
        except (ValueError, AttributeError):
            return False

    def _observe(self, parts: list) -> None:
        """The kernel's execution state, from its iopub status messages."""
        try:
            header = json_input.loads(parts[0], max_bytes=HEADER_MAX, what="a header")
            if header.get("msg_type") != "status":
                return
            state = json_input.loads(parts[3], max_bytes=HEADER_MAX, what="a status").get("execution_state")
        except (ValueError, AttributeError, TypeError):
            return
        session = self._gateway()
        if session is None or state not in ("busy", "idle"):
            return
        if hasattr(session.kernel, "execution_state"):
            return  # the kernel watches its own iopub
        if not session.lock.locked():  # the gateway's executor keeps its own state while it runs
            session.state = state

    def _touch(self) -> None:
        """Client traffic is activity, as in jupyter_server."""
        touch = getattr(self.kernel, "touch", None)
        if touch is not None:
            touch()
            return
        session = self._gateway()
        if session is not None:
            session.last_activity = time.time()

    def _count(self, kernel: Any, delta: int) -> None:
        """An open websocket is a connection of its kernel (the culler leaves connected kernels alone)."""
        if kernel is not None and hasattr(kernel, "connections"):
            kernel.connections = max(0, kernel.connections + delta)

    def _emit(self, channel: str, parts: list) -> None:
        if self._deliver is not None:
            self._deliver(channel, parts)
            return
        if self._buffer_overflow:
            return
        size = sum(len(p) for p in parts)
        if (len(self.buffer) >= BUFFER_MAX_MESSAGES or self._buffer_bytes + size > BUFFER_MAX_BYTES
                or not self.registry.hold(self.agent, size)):
            # Past the bound a replay could not be complete: drop it all rather than replay a part.
            self._buffer_overflow = True
            self._drop_buffer()
            return
        self.buffer.append((channel, parts))
        self._buffer_bytes += size

    def _drop_buffer(self) -> None:
        self.registry.release(self.agent, self._buffer_bytes)
        self.buffer = []
        self._buffer_bytes = 0

    async def _watch(self) -> None:
        """Follow the gateway session: a new kernel after a restart, or none after a shutdown."""
        while not self.closed:
            await asyncio.sleep(WATCH_SECONDS)
            if self.check_kernel():
                return  # connect() started a new watcher

    def check_kernel(self) -> bool:
        """True if the bridge moved to a new kernel."""
        if self.closed:
            return False
        session = self._gateway()
        if session is None or session.kernel is None:
            if session is not None and (session.state == "starting" or getattr(session, "restarting_kernel_id", None)):
                return False  # a kernel on its way (a restart's new one included): follow it when it is up
            self._status("dead")
            self.close()
            return False
        if session.kernel is not self.kernel:
            # A restart asked for (same kernel id) says nothing, as in Jupyter Server: JupyterLab reads
            # "restarting" as the kernel having died and restarted by itself, and says so in a dialog.
            if getattr(session.kernel, "id", None) != getattr(self.kernel, "id", None):
                self._status("restarting")
            try:
                self.connect()
            except LookupError:
                self.close()
                return False
            # The new kernel's iopub must be live before the client's next request goes out.
            self._held: list = []
            asyncio.ensure_future(self._nudge_then_flush())
            return True
        return False

    def _status(self, state: str) -> None:
        if self.session is None:
            return
        msg = self.session.msg("status", {"execution_state": state})
        parts = [self.session.pack(msg[k]) for k in ("header", "parent_header", "metadata", "content")]
        self._emit("iopub", parts)

    # --- the websocket side ---------------------------------------------------------

    def attach(self, deliver: Deliver, on_gone: Callable[[], None]) -> list[tuple[str, list]]:
        """A websocket takes this bridge; returns what was buffered while none had it."""
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        replay = self.buffer
        self._drop_buffer()  # handed to the websocket, whose writes are held in its turn
        self._buffer_overflow = False
        if self._deliver is None:
            self._count(self.kernel, +1)
        self._deliver, self._on_gone = deliver, on_gone
        return replay

    def detach(self) -> None:
        """The websocket closed: keep the sockets and buffer for a reconnect, for a while."""
        if self._deliver is not None:
            self._count(self.kernel, -1)
        self._deliver = self._on_gone = None
        if self.closed:
            return
        loop = asyncio.get_event_loop()
        self._expiry = loop.call_later(BUFFER_SECONDS, self.close)

    async def _nudge_then_flush(self) -> None:
        await self.nudge()
        held, self._held = getattr(self, "_held", None) or [], None
        for channel, msg_list in held:
            self.send(channel, msg_list)

    def send(self, channel: str, msg_list: list) -> None:
        """A message from the websocket: [header, parent, metadata, content, *buffers], signed here."""
        held = getattr(self, "_held", None)
        if held is not None:
            if len(held) < 1000:
                held.append((channel, msg_list))
            return
        sock = self.sockets.get(channel)
        if sock is None or channel == "iopub" or self.session is None:
            return
        self._touch()
        try:
            self.session.send_raw(sock, msg_list, flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("kernel %s is not reading its %s channel; a message was dropped", self.kernel_id, channel)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._expiry is not None:
            self._expiry.cancel()
        self._close_sockets()
        self._drop_buffer()
        if self._deliver is not None:
            self._count(self.kernel, -1)
        on_gone, self._on_gone, self._deliver = self._on_gone, None, None
        self.registry._forget(self)
        if on_gone is not None:
            on_gone()


class Bridges:
    """Every bridge, by (kernel id, websocket session id), and the open websockets per kernel.

    Each agent holds at most ``per_agent`` bridges (open or buffering) and all agents ``total``:
    past its share, an agent's own oldest buffer makes room, and with none to drop the websocket is
    refused with 429, so one agent's websockets never use up what another agent needs.  The kernel
    messages they keep in the gateway's memory (buffered for a reconnect, or written to a websocket
    whose client does not read them yet) have a share too, in bytes (:meth:`hold`): past it a
    buffer is dropped, and a websocket that does not read is closed.
    """

    def __init__(self, sessions: Any, per_agent: int = MAX_BRIDGES_PER_AGENT, total: int = MAX_BRIDGES,
                 bytes_per_agent: int = HELD_BYTES_PER_AGENT, bytes_total: int = HELD_BYTES):
        self.sessions = sessions
        self.per_agent, self.total = per_agent, total
        self.bytes_per_agent, self.bytes_total = bytes_per_agent, bytes_total
        self._held: dict[str, int] = {}
        self._held_total = 0
        self._bridges: dict[tuple[str, str], Bridge] = {}
        self._attached: dict[tuple[str, str], Any] = {}

    def make_room(self, agent: str, kernel_id: str, session_id: str) -> None:
        """Room for one more bridge of ``agent`` (dropping a buffer if need be), or a 429 GatewayError."""
        key = (kernel_id, session_id)
        if key in self._bridges and key not in self._attached:
            return  # a reconnect takes its own buffer over
        mine = [k for k, b in self._bridges.items() if b.agent == agent and k != key]
        if len(mine) >= self.per_agent:
            waiting = [k for k in mine if k not in self._attached]
            if not waiting:
                raise GatewayError(
                    429, "too_many_websockets", f"agent {agent!r} already has {self.per_agent} kernel websockets open",
                    "close some; raise --Gateway.max_websockets_per_agent",
                )
            self._bridges[waiting[0]].close()  # its own oldest buffer
        if len(self._bridges) >= self.total:
            # The oldest buffer of a websocket that left, the agent's own first; never an open one.
            waiting = sorted((k for k in self._bridges if k not in self._attached and k != key),
                             key=lambda k: self._bridges[k].agent != agent)
            if not waiting:
                raise GatewayError(
                    429, "too_many_websockets", f"the gateway already holds {self.total} kernel websockets",
                    "try again later; raise --Gateway.max_websockets_total",
                )
            self._bridges[waiting[0]].close()

    def open(self, agent: str, gateway_session: str, kernel_id: str, session_id: str) -> tuple[Bridge, bool]:
        """(bridge, reused): a buffering bridge of the same session id is taken over."""
        key = (kernel_id, session_id)
        bridge = self._bridges.get(key)
        if bridge is not None and not bridge.closed and bridge.gateway_session == gateway_session:
            return bridge, True
        if bridge is not None:
            bridge.close()
        self.make_room(agent, kernel_id, session_id)
        bridge = Bridge(self, agent, gateway_session, kernel_id, session_id)
        bridge.connect()
        self._bridges[key] = bridge
        return bridge, False

    def hold(self, agent: str, size: int) -> bool:
        """Count ``size`` bytes of kernel messages kept for ``agent``'s websockets, if its share and the total allow."""
        if self._held.get(agent, 0) + size > self.bytes_per_agent or self._held_total + size > self.bytes_total:
            return False
        self._held[agent] = self._held.get(agent, 0) + size
        self._held_total += size
        return True

    def release(self, agent: str, size: int) -> None:
        self._held[agent] = self._held.get(agent, 0) - size
        self._held_total -= size

    def held(self, agent: str) -> int:
        return self._held.get(agent, 0)

    def of_agent(self, agent: str) -> int:
        return sum(1 for b in self._bridges.values() if b.agent == agent)

    def attached(self, bridge: Bridge, handler: Any) -> Any:
        """Mark ``handler`` as the websocket of ``bridge``; returns the one it replaces, if any."""
        key = (bridge.kernel_id, bridge.session_id)
        previous = self._attached.get(key)
        self._attached[key] = handler
        return previous

    def detached(self, bridge: Bridge, handler: Any) -> None:
        key = (bridge.kernel_id, bridge.session_id)
        if self._attached.get(key) is handler:
            del self._attached[key]
            bridge.detach()

    def connections(self, kernel_id: str) -> int:
        return sum(1 for (kid, _) in self._attached if kid == kernel_id)

    def total_connections(self) -> int:
        return len(self._attached)

    def check(self, kernel_id: str) -> None:
        """Look again at once (after a restart or shutdown through the API)."""
        for (kid, _), bridge in list(self._bridges.items()):
            if kid == kernel_id:
                bridge.check_kernel()

    def _forget(self, bridge: Bridge) -> None:
        key = (bridge.kernel_id, bridge.session_id)
        if self._bridges.get(key) is bridge:
            del self._bridges[key]
        self._attached.pop(key, None)

    def close_all(self) -> None:
        for bridge in list(self._bridges.values()):
            bridge.close()
