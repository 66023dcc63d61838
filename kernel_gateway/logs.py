"""The operator's log: plain text on a terminal, JSON lines with ``--log-format json``.

What is logged: one line per request (method, route pattern, agent, status,
duration), one per kernel start, stop, death and cull (with its id and
agent), and every caught unexpected exception with its traceback.  No code
and no output ever goes here; the audit log (:mod:`kernel_gateway.audit`) is
where an operator asks for code.  Fields beyond the message travel as
``extra={"fields": {...}}`` so the JSON form keeps them apart.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import traceback

LOGGERS = ("kernel_gateway", "tornado")
FORMATS = ("text", "json")


class JSONFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, fields, traceback."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **getattr(record, "fields", {}),
        }
        if record.exc_info:
            entry["traceback"] = "".join(traceback.format_exception(*record.exc_info))
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}"


def configure(level: int | str = logging.INFO, fmt: str = "text", stream=None) -> None:
    """Send the gateway's and Tornado's records to ``stream`` (stderr) in one format."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JSONFormatter() if fmt == "json" else TextFormatter())
    for name in LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level)
        logger.propagate = False
    # Tornado's own access line is replaced by ours (see server.base.log_request).
    logging.getLogger("tornado.access").setLevel(logging.CRITICAL)
