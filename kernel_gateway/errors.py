"""The one error type the core raises and the HTTP layer renders.

Every error reaches a client as ``{"error": {"code", "message", "hint"}}`` with
a fitting HTTP status.  Core modules raise :class:`GatewayError`; they never
import Tornado.
"""

from __future__ import annotations

import errno


class GatewayError(Exception):
    """An error a client caused or can act on."""

    def __init__(self, status: int, code: str, message: str, hint: str = ""):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.hint = hint

    def to_json(self) -> dict:
        return {"error": {"code": self.code, "message": self.message, "hint": self.hint}}


def bad_request(message: str, hint: str = "", code: str = "bad_request") -> GatewayError:
    return GatewayError(400, code, message, hint)


def not_found(message: str, hint: str = "", code: str = "not_found") -> GatewayError:
    return GatewayError(404, code, message, hint)


def conflict(message: str, hint: str = "", code: str = "conflict") -> GatewayError:
    return GatewayError(409, code, message, hint)


def disk_full(error: BaseException) -> GatewayError | None:
    """507 for a write that found no space (an agent's disk quota, usually), else None."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return GatewayError(
            507, "disk_full", "no space left on the disk this request writes to",
            "if the agent has a disk quota (GET /v1/info, sandbox.disk_quota), delete files in its tree",
        )  # fmt: skip
    return None
