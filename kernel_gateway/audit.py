"""The audit trail: one JSON line per tool call, in the state directory.

Operators read it to answer "who ran what, when, and how did it end".  By
default it records no code and no output, only sizes; ``audit_code`` adds the
code.
"""

from __future__ import annotations

import json
import os
import time


class AuditLog:
    def __init__(self, path: str, include_code: bool = False):
        self.path = path
        self.include_code = include_code
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._file = open(path, "a", buffering=1)

    def record(
        self,
        *,
        agent: str | None,
        tool: str,
        status: str | int,
        duration_ms: float,
        session: str | None = None,
        bytes_in: int = 0,
        bytes_out: int = 0,
        code: str | None = None,
    ) -> None:
        entry = {
            "time": round(time.time(), 3),
            "agent": agent,
            "session": session,
            "tool": tool,
            "status": status,
            "duration_ms": round(duration_ms, 2),
            "bytes_in": bytes_in,
            "bytes_out": bytes_out,
        }
        if self.include_code and code is not None:
            entry["code"] = code
        self._file.write(json.dumps(entry) + "\n")

    def close(self) -> None:
        self._file.close()
