"""Run one cell on a live kernel and turn what it says into an execute result.

The result keeps nbformat v4 output shapes (so outputs can be saved into a
notebook as they are) plus a compact, ANSI-free ``text`` for agents.  The
kernel-side extension (:mod:`kernel_gateway.kernel_ext`) already bounds large
outputs and writes images to artifact files; it announces what it did through
two private MIME types that are turned into ``truncated``, ``spill_paths`` and
``artifacts`` here.  The gateway still bounds what it keeps, so a kernel that
bypasses the extension cannot grow the gateway without limit.
"""

from __future__ import annotations

import asyncio
import base64
import queue
import re
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

ARTIFACT_MIME = "application/vnd.kernel-gateway.artifact+json"
TRUNCATION_MIME = "application/vnd.kernel-gateway.truncation+json"
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07]*\x07")
TRACEBACK_FRAMES = 3  # library frames shown at the end of a long traceback
CELL_FRAMES = 3  # at most this many of the user's own cell frames are shown
LOCATION_CHARS = 160
CHAINED = ("The above exception was the direct cause", "During handling of the above exception")
ARROW = re.compile(r"^-*>\s*\d+")  # IPython's "---->" / "->" marker of the running line
POLL_SECONDS = 0.5
INTERRUPT_GRACE_SECONDS = 5.0

OutputCallback = Callable[[dict], Awaitable[None]]


def strip_ansi(text: str) -> str:
    return ANSI.sub("", text)


@dataclass
class KernelDied(Exception):
    """The kernel process ended while (or before) running a cell."""

    exit_code: int | None
    signal: int | None

    def how(self) -> str:
        return f"signal {self.signal}" if self.signal else f"exit code {self.exit_code}"

    def sentence(self) -> str:
        return (
            f"The kernel died ({self.how()}); every variable, import and open file of this session is lost. "
            "The next execute starts a fresh kernel."
        )

    def fresh_kernel_notice(self) -> str:
        """What the next execute says, in its fresh kernel: one sentence, nothing said twice."""
        return (
            f"The previous kernel of this session died ({self.how()}), and every variable, import and "
            "open file with it; this is a fresh kernel."
        )


@dataclass
class CellRun:
    """What one execution gathered; ``result()`` renders it."""

    limit: int
    inline_images: bool = False
    outputs: list[dict] = field(default_factory=list)
    artifacts: list[dict] = field(default_factory=list)
    spill_paths: list[str] = field(default_factory=list)
    truncated: bool = False
    error: dict | None = None
    execution_count: int | None = None
    status: str = "ok"
    notice: str | None = None

    def _stream(self, name: str, text: str) -> dict:
        last = self.outputs[-1] if self.outputs else None
        if last and last["output_type"] == "stream" and last["name"] == name:
            last["text"] += text
            # Second line of defence: the kernel side bounds output already.
            if len(last["text"]) > 2 * self.limit:
                half = self.limit // 2
                cut = len(last["text"]) - self.limit
                last["text"] = (
                    last["text"][:half]
                    + f"\n[... {cut} characters cut by the gateway ...]\n"
                    + last["text"][-half:]
                )
                self.truncated = True
            return {"output_type": "stream", "name": name, "text": text}
        output = {"output_type": "stream", "name": name, "text": text}
        self.outputs.append(dict(output))
        return output

    def _rich(self, msg_type: str, content: dict) -> dict | None:
        data = dict(content.get("data", {}))
        if TRUNCATION_MIME in data:
            note = data[TRUNCATION_MIME]
            self.truncated = True
            if note.get("path") and note["path"] not in self.spill_paths:
                self.spill_paths.append(note["path"])
            return None
        if ARTIFACT_MIME in data:
            ref = data[ARTIFACT_MIME]
            self.artifacts.append({"mime": ref.get("mime"), "path": ref.get("path")})
            if self.inline_images:
                data = inline_artifact(data)
        output = {"output_type": msg_type, "data": data, "metadata": content.get("metadata", {})}
        if msg_type == "execute_result":
            output["execution_count"] = content.get("execution_count")
        self.outputs.append(output)
        return output

    def add(self, msg_type: str, content: dict) -> dict | None:
        """Fold one iopub message in; return the output event to stream, if any."""
        if msg_type == "stream":
            return self._stream(content["name"], content["text"])
        if msg_type in ("execute_result", "display_data"):
            return self._rich(msg_type, content)
        if msg_type == "error":
            self.error = {
                "ename": content.get("ename", ""),
                "evalue": content.get("evalue", ""),
                "traceback": content.get("traceback", []),
            }
            output = {"output_type": "error", **self.error}
            self.outputs.append(output)
            return output
        if msg_type == "clear_output":
            self.outputs.clear()
        if msg_type == "execute_input":
            self.execution_count = content.get("execution_count")
        return None

    def text(self) -> str:
        parts = []
        for output in self.outputs:
            kind = output["output_type"]
            if kind == "stream":
                parts.append(output["text"])
            elif kind in ("execute_result", "display_data"):
                data = output["data"]
                if ARTIFACT_MIME in data:
                    ref = data[ARTIFACT_MIME]
                    parts.append(f"[{ref.get('mime')} saved to {ref.get('path')}]\n")
                elif "text/plain" in data:
                    plain = data["text/plain"]
                    parts.append(plain if plain.endswith("\n") else plain + "\n")
            elif kind == "error":
                parts.append(short_error(output))
        return strip_ansi("".join(parts))

    def result(self, duration_s: float) -> dict:
        return {
            "status": self.status,
            "execution_count": self.execution_count,
            "outputs": self.outputs,
            "text": self.text(),
            "error": self.error,
            "artifacts": self.artifacts,
            "truncated": self.truncated,
            "spill_paths": self.spill_paths,
            "duration_ms": round(duration_s * 1000, 2),
            **({"notice": self.notice} if self.notice else {}),
        }


def bare_result(status: str, text: str, **extra: Any) -> dict:
    """A result for a cell that produced no output of its own (died, never ran)."""
    return {
        "status": status,
        "execution_count": None,
        "outputs": [],
        "text": text,
        "error": None,
        "artifacts": [],
        "truncated": False,
        "spill_paths": [],
        "duration_ms": None,
        **extra,
    }


def _is_cell_frame(frame: str) -> bool:
    """A frame of the user's own cells (IPython names them ``Cell In[n]``)."""
    return frame.lstrip().startswith(("Cell In[", "Input In ["))


def _library_frame(frame: str) -> str:
    """A library frame as its location and the line that was running, without the context around it."""
    lines = frame.rstrip("\n").split("\n")
    header = lines[0]
    if len(header) > LOCATION_CHARS and ", in " in header:
        # Long signatures (pandas' read_csv has forty parameters) say little here.
        where, _, name = header.partition(", in ")
        header = f"{where}, in {name.split('(', 1)[0]}(...)"
    running = [line for line in lines[1:] if ARROW.match(line)]
    return "\n".join([header, *running[:1]])


def _chosen_frames(frames: list[str]) -> list[str]:
    """The frames to show: the user's cell frames, then the last library frames, within the bound.

    A cell frame is never dropped for a library one: an error raised deep in a
    library still shows the user's line that led there.
    """
    if len(frames) <= TRACEBACK_FRAMES + 1:
        keep = set(range(len(frames)))
    else:
        cells = [i for i, frame in enumerate(frames) if _is_cell_frame(frame)]
        # The outermost cell frame and the innermost ones (deep recursion stays bounded).
        keep = set(cells[:1] + cells[-(CELL_FRAMES - 1) :])
        # The last library frames: one fewer when the user's frames are there to show.
        library = TRACEBACK_FRAMES - 1 if cells else TRACEBACK_FRAMES
        keep |= set(range(len(frames) - library, len(frames)))
    shown, previous = [], -1
    for i in sorted(keep):
        if i - previous > 1:
            skipped = i - previous - 1
            shown.append(f"[... {skipped} frame{'s' if skipped > 1 else ''} ...]")
        frame = frames[i].strip("\n")
        shown.append(frame if _is_cell_frame(frame) else _library_frame(frame))
        previous = i
    return shown


def short_error(error: dict) -> str:
    """``Type: message``, the frames that matter, and where a syntax error is, for an agent to read."""
    # IPython's first lines are a rule and a "Traceback (most recent call last)" banner.
    blocks = [
        strip_ansi(block)
        for block in error.get("traceback", [])
        if not strip_ansi(block).startswith("---") and "Traceback (most recent call last)" not in strip_ansi(block)
    ]
    # A chained exception: the error reported is the last one; show its own traceback.
    for i in range(len(blocks) - 1, -1, -1):
        if blocks[i].strip().startswith(CHAINED):
            blocks = blocks[i + 1 :]
            break
    ename, evalue = error.get("ename"), error.get("evalue")
    lines = [f"{ename}: {evalue}"]
    frames = _chosen_frames(blocks[:-1]) if len(blocks) > 1 else []
    if frames:
        lines.append("Traceback (last frames):")
        lines.extend(frame.rstrip() for frame in frames)
    # The last block is the exception itself; for a SyntaxError it first says
    # where: "Cell In[3], line 2", the offending line and a caret under it.
    last = blocks[-1].rstrip("\n").split("\n") if blocks else []
    where = [line for line in last[: _exception_line(last, ename)] if line.strip()]
    if where:
        location = where[0].strip()
        if location and location in str(evalue):
            where = where[1:]  # the message already names the place
        else:
            where[0] = location
        lines.extend(line.rstrip() for line in where)
    return "\n".join(lines) + "\n"


def _exception_line(lines: list[str], ename: Any) -> int:
    """Index of the ``Type: message`` line in the exception block (0 if there is none)."""
    for i, line in enumerate(lines):
        if ename and (line.startswith(f"{ename}:") or line == ename):
            return i
    return 0


def inline_artifact(data: dict) -> dict:
    """Put an artifact's bytes back in as base64 (when the client asked for it)."""
    ref = data.get(ARTIFACT_MIME, {})
    path, mime = ref.get("path"), ref.get("mime")
    if not path or not mime:
        return data
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError:
        return data
    data = {k: v for k, v in data.items() if k != ARTIFACT_MIME}
    data[mime] = raw.decode() if mime == "image/svg+xml" else base64.b64encode(raw).decode()
    return data


async def _next_iopub(kc: Any, timeout: float) -> dict | None:
    try:
        return await kc.get_iopub_msg(timeout=timeout)
    except (queue.Empty, asyncio.TimeoutError, TimeoutError):
        return None


async def run_cell(
    kc: Any,
    code: str,
    *,
    is_alive: Callable[[], Awaitable[bool]],
    interrupt: Callable[[], Awaitable[None]],
    exit_status: Callable[[], tuple[int | None, int | None]],
    timeout: float | None,
    limit: int,
    inline_images: bool = False,
    on_output: OutputCallback | None = None,
    on_request: Callable[[str], None] | None = None,
) -> dict:
    """Execute ``code`` and gather its result.  The caller holds the session's lock.

    A timeout interrupts the kernel and returns what came so far with status
    ``timeout``; a dead kernel raises :class:`KernelDied`.  ``on_request``
    learns the execute request's msg_id.
    """
    run = CellRun(limit=limit, inline_images=inline_images)
    started = time.monotonic()
    msg_id = kc.execute(code, allow_stdin=False, stop_on_error=False)
    if on_request is not None:
        on_request(msg_id)
    deadline = None if timeout is None else started + timeout
    try:
        await _gather(kc, run, msg_id, deadline, interrupt, is_alive, exit_status, on_output)
    except asyncio.CancelledError:
        # The client went away: stop the cell rather than let it run on unseen.
        await interrupt()
        raise
    reply = await _shell_reply(kc, msg_id, 1.0 if run.status == "timeout" else 5.0)
    if reply is not None:
        run.execution_count = reply["content"].get("execution_count", run.execution_count)
        if run.status != "timeout" and reply["content"].get("status") != "ok":
            run.status = "error"
            if run.error is None:
                content = reply["content"]
                run.error = {
                    "ename": content.get("ename", "Error"),
                    "evalue": content.get("evalue", ""),
                    "traceback": content.get("traceback", []),
                }
    elif run.status != "timeout" and run.error is not None:
        run.status = "error"
    return run.result(time.monotonic() - started)


async def _gather(
    kc: Any,
    run: CellRun,
    msg_id: str,
    deadline: float | None,
    interrupt: Callable[[], Awaitable[None]],
    is_alive: Callable[[], Awaitable[bool]],
    exit_status: Callable[[], tuple[int | None, int | None]],
    on_output: OutputCallback | None,
) -> None:
    """Read iopub until the cell is idle, interrupting it once past its deadline."""
    interrupted_at = None
    while True:
        now = time.monotonic()
        if deadline is not None and now >= deadline and interrupted_at is None:
            run.status = "timeout"
            interrupted_at = now
            await interrupt()
        if interrupted_at is not None and now - interrupted_at > INTERRUPT_GRACE_SECONDS:
            # The interrupt did not land (C code that ignores it): report what we have.
            return
        wait = POLL_SECONDS if deadline is None else max(0.01, min(POLL_SECONDS, deadline - now))
        msg = await _next_iopub(kc, wait)
        if msg is None:
            if not await is_alive():
                code_, sig = exit_status()
                raise KernelDied(code_, sig)
            continue
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        msg_type, content = msg["header"]["msg_type"], msg["content"]
        if msg_type == "status" and content.get("execution_state") == "idle":
            return
        event = run.add(msg_type, content)
        if event is not None and on_output is not None:
            await on_output(event)


async def _shell_reply(kc: Any, msg_id: str, timeout: float) -> dict | None:
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            reply = await kc.get_shell_msg(timeout=left)
        except (queue.Empty, asyncio.TimeoutError, TimeoutError):
            return None
        if reply.get("parent_header", {}).get("msg_id") == msg_id:
            return reply
    return None
