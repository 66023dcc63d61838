"""Hostile websocket frames and kernel messages on the kernel websocket: bounded before parsed.

A real gateway with a real sandboxed kernel; each frame is really sent, on
the three ways in (the Jupyter TCP port with a token, the agent's own socket,
the control socket), in both protocols.  Each malformed frame is refused
with a ``MalformedFrame`` Jupyter message, the gateway allocates nothing the
frame only declares (its peak memory stays put), the same websocket then runs
an execute and gets its reply, the control socket answers and another agent
is served.  Before, one 6-byte legacy frame declaring 2^31 buffers made the
gateway allocate 4 GB and stall for everyone.
"""

from __future__ import annotations

import asyncio
import json
import os
import struct

import pytest

from jupyter_support import V1, JupyterClient, KernelSocket
from support import GatewayProcess


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    gateway = GatewayProcess(tmp_path_factory.mktemp("frames"), "--jupyter-port", "0",
                             "--Gateway.spare_kernels=False").start()
    for agent in ("alice", "bob"):
        assert gateway.client.call("PUT", f"/v1/agents/{agent}")[0] == 201
    yield gateway
    gateway.stop()


@pytest.fixture(scope="module")
def alice(gw) -> JupyterClient:
    status, token = gw.client.call("POST", "/v1/agents/alice/tokens")
    assert status == 201, token
    return JupyterClient(token["url"], token["token"])


@pytest.fixture(scope="module")
def kernel(alice):
    status, model = alice.call("POST", "api/kernels", {"name": "python3"})
    assert status == 201, model
    yield model
    alice.call("DELETE", f"api/kernels/{model['id']}")


def peak_rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def tree(root: str) -> dict[str, int]:
    return {os.path.join(d, n): os.lstat(os.path.join(d, n)).st_mtime_ns
            for d, dirs, files in os.walk(root) for n in dirs + files}


def legacy(parts: list[bytes], count: int | None = None, offsets: list[int] | None = None) -> bytes:
    """A legacy binary frame (count, offsets, parts), with the count or offsets made up if given."""
    n = len(parts)
    real = [4 * (n + 1)]
    for part in parts[:-1]:
        real.append(real[-1] + len(part))
    table = offsets if offsets is not None else real
    return struct.pack("!i", n if count is None else count) + b"".join(struct.pack("!I", o) for o in table) + b"".join(parts)


def v1(parts: list[bytes], count: int | None = None, offsets: list[int] | None = None) -> bytes:
    n = len(parts) + 1
    real = [8 * (n + 1)]
    for part in parts:
        real.append(real[-1] + len(part))
    table = offsets if offsets is not None else real
    return (n if count is None else count).to_bytes(8, "little") + b"".join(o.to_bytes(8, "little") for o in table) \
        + b"".join(parts)


HEADER = json.dumps({"msg_id": "bad-1", "msg_type": "execute_request", "session": "s", "username": "u",
                     "date": "2026-01-01T00:00:00Z", "version": "5.3"}).encode()
GOOD_JSON = json.dumps({"header": json.loads(HEADER), "parent_header": {}, "metadata": {},
                        "content": {"code": "1"}, "channel": "shell"}).encode()

LEGACY_FRAMES = {
    "6 bytes declaring 2^31-1 buffers": b"\x7f\xff\xff\xff\x00\x00",
    "huge declared offsets": legacy([GOOD_JSON, b"buf"], offsets=[12, 0xFFFFFFF0]),
    "negative part count": struct.pack("!i", -7) + b"\x00" * 16,
    "unsorted offsets": legacy([GOOD_JSON, b"a" * 64, b"b" * 64], offsets=[16, 200, 40]),
    "a first offset past the table": legacy([GOOD_JSON], offsets=[1 << 20]),
    "truncated": legacy([GOOD_JSON, b"buffer"])[:40],
    "a non-JSON message part": legacy([b"\xff\xfe not json at all", b"x"]),
    "JSON nested 100000 deep": legacy([b"[" * 100_000]),
    "a message without a header": legacy([b'{"content": {}}']),
    "1025 parts": legacy([GOOD_JSON] + [b""] * 1024),
}
V1_FRAMES = {
    "2^63 offsets in 8 bytes": (1 << 63).to_bytes(8, "little"),
    "huge declared offsets": v1([b"shell", HEADER, b"{}", b"{}", b"{}"], offsets=[56, 61, 1 << 40, 1 << 41, 1 << 42, 1 << 43]),
    "unsorted offsets": v1([b"shell", HEADER, b"{}", b"{}", b"{}"], offsets=[56, 300, 61, 70, 80, 90]),
    "too few offsets": v1([b"shell"], count=2, offsets=[24, 29]),
    "truncated": v1([b"shell", HEADER, b"{}", b"{}", b"{}"])[:60],
    "a non-JSON header": v1([b"shell", b"\xff not json", b"{}", b"{}", b"{}"]),
    "a header nested 100000 deep": v1([b"shell", b"[" * 100_000, b"{}", b"{}", b"{}"]),
    "content that is not an object": v1([b"shell", HEADER, b"{}", b"{}", b"[1, 2]"]),
    "the iopub channel": v1([b"iopub", HEADER, b"{}", b"{}", b"{}"]),
    "a channel that is not UTF-8": v1([b"\xff\xfe", HEADER, b"{}", b"{}", b"{}"]),
}
LEGACY_TEXT = {
    "text nested 100000 deep": "[" * 100_000,
    "text with NaN": '{"header": {"msg_id": "x", "msg_type": "execute_request"}, "content": {"a": NaN}}',
    "text that is not JSON": "{",
}


def ways_in(gw, alice, kernel):
    """(name, base URL, token, Unix socket): the TCP port, the agent's socket, the control socket."""
    return [
        ("tcp", alice.base_url, alice.token, None),
        ("agent socket", "http://kg/agents/me/", None, os.path.join(gw.state, "agents", "alice.sock")),
        ("control socket", "http://kg/agents/alice/", None, gw.socket),
    ]


async def execute_after(ks: KernelSocket, code: str) -> tuple[dict, list[dict]]:
    """The reply to an execute over ``ks``, and the MalformedFrame notices that came before it."""
    msg_id = ks.execute(code)
    notices, reply, idle, results = [], None, False, []
    while reply is None or not idle:
        try:
            msg = await ks.receive(60)
        except RecursionError:
            continue  # the v1 protocol relays a kernel's message parts as they are: the hostile one too
        assert msg is not None, "the websocket closed"
        if msg["msg_type"] == "error" and msg["content"].get("ename") == "MalformedFrame":
            notices.append(msg)
        mine = msg["parent_header"].get("msg_id") == msg_id
        if mine and msg["channel"] == "shell":
            reply = msg["content"]
        elif mine and msg["msg_type"] == "execute_result":
            results.append(msg["content"]["data"]["text/plain"])
        elif mine and msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            idle = True
    return {"reply": reply, "results": results}, notices


@pytest.mark.parametrize("way", ["tcp", "agent socket", "control socket"])
@pytest.mark.parametrize("protocol", [None, V1])
def test_hostile_frames_are_refused_and_the_connection_goes_on(gw, alice, kernel, way, protocol):
    name, base, token, unix = next(w for w in ways_in(gw, alice, kernel) if w[0] == way)
    frames = dict(V1_FRAMES) if protocol == V1 else {**LEGACY_FRAMES, **LEGACY_TEXT}
    bob = tree(os.path.join(gw.root, "bob"))
    peak = peak_rss_kb(gw.proc.pid)

    async def go():
        ks = await KernelSocket.connect(base, kernel["id"], token, protocol, unix_socket=unix)
        try:
            for n, (what, frame) in enumerate(frames.items()):
                ks.ws.write_message(frame, binary=isinstance(frame, bytes))
                out, notices = await execute_after(ks, f"{n} * 2")
                # Refused with a clear Jupyter message, then the same websocket runs code.
                assert notices and all(m["content"]["evalue"] for m in notices), (way, what)
                assert out["reply"]["status"] == "ok" and out["results"] == [str(n * 2)], (way, what, out)
                assert gw.client.call("GET", "/v1/info", timeout=10)[0] == 200, what
        finally:
            ks.close()

    asyncio.run(go())
    # Nothing a frame declared was allocated: the gateway's peak memory is where it was (+64 MiB slack).
    assert peak_rss_kb(gw.proc.pid) - peak < 64 << 10
    assert tree(os.path.join(gw.root, "bob")) == bob  # nothing done to another agent's tree
    status, body = gw.client.execute("bob", f"s-{way.replace(' ', '-')}-{protocol is None}", "'bob served'")
    assert status == 200 and body["text"] == "'bob served'\n", body


def test_a_request_whose_header_was_read_gets_an_error_reply(gw, alice, kernel):
    """A v1 frame whose content is refused still answers its request: an error execute_reply."""
    async def go():
        ks = await KernelSocket.connect(alice.base_url, kernel["id"], alice.token, V1)
        try:
            ks.ws.write_message(v1([b"shell", HEADER, b"{}", b"{}", b'{"code": NaN}']), binary=True)
            replies = []
            while not replies:
                msg = await ks.receive(60)
                if msg["channel"] == "shell":
                    replies.append(msg)
            return replies[0]
        finally:
            ks.close()

    reply = asyncio.run(go())
    assert reply["msg_type"] == "execute_reply" and reply["parent_header"]["msg_id"] == "bad-1"
    assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "MalformedFrame"
    assert "NaN" in reply["content"]["evalue"]


# A kernel sends a raw iopub message, signed as itself, with a part the gateway must not trust.
RAW_PART = """
k = get_ipython().kernel
s = k.session
msg = s.msg("stream", {"name": "stdout", "text": "x"}, parent=k.get_parent("shell"))
parts = [s.pack(msg["header"]), s.pack(msg["parent_header"]), b"{}", s.pack(msg["content"])]
parts[WHICH] = b"[" * 100000
k.iopub_socket.send_multipart([b"raw", b"<IDS|MSG>", s.sign(parts)] + parts)
'done'
"""


@pytest.mark.parametrize("protocol", [None, V1])
@pytest.mark.parametrize("which", [0, 3])
def test_a_kernels_deeply_nested_message_does_not_stop_the_relay(gw, alice, kernel, protocol, which):
    """Header (read by the bridge for the kernel's state) or content (unpacked for the legacy protocol)."""
    async def go():
        ks = await KernelSocket.connect(alice.base_url, kernel["id"], alice.token, protocol)
        try:
            first, _ = await execute_after(ks, RAW_PART.replace("WHICH", str(which)))
            second, _ = await execute_after(ks, "'relayed'")
            return first, second
        finally:
            ks.close()

    first, second = asyncio.run(go())
    assert first["reply"]["status"] == "ok", first
    assert second["results"] == ["'relayed'"], second
    assert gw.client.call("GET", "/v1/info", timeout=10)[0] == 200
