"""Test support for the Jupyter API: an HTTP client for the TCP port and websocket helpers."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import urllib.parse
import uuid

from jupyter_client.session import Session
from jupyter_server.services.kernels.connection.base import deserialize_msg_from_ws_v1, serialize_msg_to_ws_v1
from tornado import httpclient, netutil, websocket

V1 = "v1.kernel.websocket.jupyter.org"


class JupyterClient:
    """``status, body = jc.call("GET", "api/kernels")`` against one agent's base URL."""

    def __init__(self, base_url: str, token: str | None):
        self.base_url = base_url  # http://127.0.0.1:PORT/agents/alice/
        self.token = token
        parsed = urllib.parse.urlparse(base_url)
        self.host, self.port, self.prefix = parsed.hostname, parsed.port, parsed.path

    def call(self, method: str, path: str, body=None, token: str | None = "default", raw: bytes | None = None,
             headers: dict | None = None):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
        token = self.token if token == "default" else token
        hdrs = dict(headers or {})
        if token is not None:
            hdrs["Authorization"] = f"token {token}"
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, self.prefix + path, body=data, headers=hdrs)
        response = conn.getresponse()
        payload = response.read()
        conn.close()
        try:
            return response.status, json.loads(payload) if payload else None
        except ValueError:
            return response.status, payload


class UnixResolver(netutil.Resolver):
    """Every host name resolves to one Unix socket: websockets to the gateway's sockets."""

    def initialize(self, path: str) -> None:
        self.path = path

    async def resolve(self, host, port, family=socket.AF_UNSPEC):
        return [(socket.AF_UNIX, self.path)]


class KernelSocket:
    """A websocket on /api/kernels/{id}/channels, in the legacy or the v1 protocol."""

    def __init__(self, ws, protocol: str | None, session_id: str):
        self.ws = ws
        self.protocol = protocol
        self.session = Session(session=session_id, key=b"")

    @classmethod
    async def connect(cls, base_url: str, kernel_id: str, token: str | None, protocol: str | None = None,
                      session_id: str | None = None, unix_socket: str | None = None) -> "KernelSocket":
        """``base_url`` is http://host:port/agents/A/, or with ``unix_socket`` http://kg/agents/A/ on that socket."""
        session_id = session_id or uuid.uuid4().hex
        url = f"{base_url.replace('http://', 'ws://')}api/kernels/{kernel_id}/channels?session_id={session_id}"
        headers = {"Authorization": f"token {token}"} if token else {}
        ws = await websocket.websocket_connect(
            httpclient.HTTPRequest(url, headers=headers), subprotocols=[protocol] if protocol else None,
            resolver=UnixResolver(path=unix_socket) if unix_socket else None,
        )
        assert ws.selected_subprotocol == protocol
        return cls(ws, protocol, session_id)

    def send(self, msg_type: str, content: dict, channel: str = "shell") -> str:
        msg = self.session.msg(msg_type, content)
        if self.protocol == V1:
            self.ws.write_message(serialize_msg_to_ws_v1(msg, channel, self.session.pack), binary=True)
        else:
            msg["channel"] = channel
            self.ws.write_message(json.dumps(msg, default=str))
        return msg["header"]["msg_id"]

    def execute(self, code: str) -> str:
        return self.send("execute_request", {"code": code, "silent": False, "store_history": True,
                                             "user_expressions": {}, "allow_stdin": False})

    async def receive(self, timeout: float = 60) -> dict | None:
        raw = await asyncio.wait_for(self.ws.read_message(), timeout)
        if raw is None:
            return None
        if self.protocol == V1:
            channel, parts = deserialize_msg_from_ws_v1(raw)
            header, parent, _, content = (json.loads(p) for p in parts[:4])
            return {"channel": channel, "header": header, "parent_header": parent, "content": content,
                    "msg_type": header["msg_type"]}
        msg = json.loads(raw)
        msg["msg_type"] = msg["header"]["msg_type"]
        return msg

    async def run(self, code: str, timeout: float = 60) -> dict:
        """Execute and gather this request's outputs and reply; also every reply to others seen."""
        return await self.collect(self.execute(code), timeout)

    async def collect(self, msg_id: str, timeout: float = 60) -> dict:
        out = {"stdout": "", "results": [], "displays": [], "reply": None, "idle": False, "foreign_replies": []}
        while out["reply"] is None or not out["idle"]:
            msg = await self.receive(timeout)
            assert msg is not None, "the websocket closed"
            mine = msg["parent_header"].get("msg_id") == msg_id
            if msg["channel"] == "shell":
                if mine:
                    out["reply"] = msg["content"]
                else:
                    out["foreign_replies"].append(msg)
            elif mine and msg["msg_type"] == "stream":
                out["stdout"] += msg["content"]["text"]
            elif mine and msg["msg_type"] == "execute_result":
                out["results"].append(msg["content"]["data"])
            elif mine and msg["msg_type"] == "display_data":
                out["displays"].append(msg["content"]["data"])
            elif mine and msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                out["idle"] = True
        return out

    def close(self) -> None:
        self.ws.close()
