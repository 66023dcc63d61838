"""A scripted model server speaking the OpenAI Responses API (HTTP + server-sent events).

No internet in tests: Codex is pointed at this server with ``base_url``.  Each
POST to ``.../responses`` gets the next scripted turn, streamed as SSE events
in the shapes Codex reads (``response.created``, ``response.output_item.done``
with a ``function_call`` or an assistant ``message``, ``response.completed``).
Every request body is kept so a test can check what Codex sent.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable


def sse(events: list[dict]) -> bytes:
    out = []
    for event in events:
        out.append(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n")
    return "".join(out).encode()


def tool_call_turn(response_id: str, call_id: str, name: str, arguments: dict) -> list[dict]:
    return [
        {"type": "response.created", "response": {"id": response_id}},
        {
            "type": "response.output_item.done",
            "item": {"type": "function_call", "call_id": call_id, "name": name, "arguments": json.dumps(arguments)},
        },
        _completed(response_id),
    ]


def message_turn(response_id: str, text: str) -> list[dict]:
    return [
        {"type": "response.created", "response": {"id": response_id}},
        {
            "type": "response.output_item.done",
            "item": {
                "type": "message",
                "role": "assistant",
                "id": f"msg-{response_id}",
                "content": [{"type": "output_text", "text": text}],
            },
        },
        _completed(response_id),
    ]


def _completed(response_id: str) -> dict:
    usage = {"input_tokens": 0, "input_tokens_details": None, "output_tokens": 0,
             "output_tokens_details": None, "total_tokens": 0}
    return {"type": "response.completed", "response": {"id": response_id, "usage": usage}}


class ScriptedResponses:
    """``script`` is a list of callables: request body -> list of SSE events."""

    def __init__(self, script: list[Callable[[dict], list[dict]]]):
        self.script = list(script)
        self.requests: list[dict] = []
        self.paths: list[str] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                owner.paths.append(self.path)
                try:
                    body = json.loads(raw or b"{}")
                except ValueError:
                    body = {"unparsed": raw.decode("utf-8", "replace")}
                owner.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                if not self.path.endswith("/responses") or not owner.script:
                    self.send_response(404)
                    self.end_headers()
                    return
                events = owner.script.pop(0)(body)
                payload = sse(events)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self):
                owner.paths.append(self.path)
                self.send_response(404)
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)  # loopback only
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> "ScriptedResponses":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def tool_names(body: dict) -> list[str]:
    return [t.get("name") or t.get("type") for t in body.get("tools", [])]
