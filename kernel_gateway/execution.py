"""Run one cell on a live kernel and turn what it says into an execute result.

The result keeps nbformat v4 output shapes (so outputs can be saved into a
notebook as they are) plus a compact, ANSI-free ``text`` for agents.  The
kernel-side extension (:mod:`kernel_gateway.kernel_ext`) already bounds large
outputs and writes images to artifact files; it announces what it did through
two private MIME types that are turned into ``truncated``, ``spill_paths`` and
``artifacts`` here.

Everything a kernel sends is hostile input: it can bypass the extension and
write raw messages to its iopub socket.  So the gateway bounds what it keeps
of a cell in all (``cell_limit`` bytes over every output kind together;
past it outputs are dropped as they arrive and one marker says so), ignores
messages of the wrong shape, and reads an artifact a message names only
through the confined lookup of :mod:`kernel_gateway.fs`:
a regular file inside the session's directory, beneath the agent root, no
larger than what is left of the cell's budget, read in a worker thread.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import queue
import re
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from . import fs

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
DEFAULT_CELL_LIMIT = 384 << 10
# What an error output keeps once the cell's budget is spent: an error always comes through.
ERROR_KEEP_CHARS = 16 << 10
MAX_SPILL_PATHS = 64  # listed in a result; the files themselves are all there

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
    cell_limit: int = DEFAULT_CELL_LIMIT
    agent_root: str | None = None  # where artifacts may be read from (None: never inlined)
    session_dir: str | None = None
    outputs: list[dict] = field(default_factory=list)
    artifacts: list[dict] = field(default_factory=list)
    spill_paths: list[str] = field(default_factory=list)
    truncated: bool = False
    error: dict | None = None
    execution_count: int | None = None
    status: str = "ok"
    notice: str | None = None
    kept: int = 0  # bytes of output held, every kind together
    dropped: int = 0  # outputs dropped past the budget
    dropped_bytes: int = 0
    ignored: int = 0  # messages of the wrong shape
    reply: dict | None = None  # the execute_reply, when it was seen before the final "idle"
    _over_budget_error: dict | None = None
    # Artifacts whose bytes were put back into their output (by id of the output): the text
    # still names the file, as for every other cell, so an image reads the same however it ran.
    _inlined: dict[int, tuple[dict, dict]] = field(default_factory=dict)

    def _fits(self, size: int) -> bool:
        """Take ``size`` bytes of the cell's budget, or count a dropped output."""
        if self.kept + size <= self.cell_limit:
            self.kept += size
            return True
        self.dropped += 1
        self.dropped_bytes += size
        self.truncated = True
        return False

    def _drop_marker(self) -> dict | None:
        """The event that tells a streaming client, once, that outputs are being dropped."""
        if self.dropped != 1:
            return None
        return {"output_type": "stream", "name": "stderr", "text": self._marker_text()}

    def _marker_text(self) -> str:
        return (
            f"\n[... output past this cell's budget of {self.cell_limit} bytes dropped by the gateway:"
            f" {self.dropped} outputs, {self.dropped_bytes} bytes; write large results to a file ...]\n"
        )

    def _stream(self, name: str, text: str) -> dict | None:
        if not self._fits(len(text)):
            return self._drop_marker()
        last = self.outputs[-1] if self.outputs else None
        if last and last["output_type"] == "stream" and last["name"] == name:
            last["text"] += text
            # Second line of defence: the kernel side bounds output already.
            if len(last["text"]) > 2 * self.limit:
                half = self.limit // 2
                cut = len(last["text"]) - self.limit
                self.kept -= cut
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
        data, metadata = content.get("data", {}), content.get("metadata", {})
        if not isinstance(data, dict) or not isinstance(metadata, dict):
            self.ignored += 1
            return None
        if TRUNCATION_MIME in data:
            # A note, not an output: nothing of it is kept but a path, and only so many of those.
            note = data[TRUNCATION_MIME]
            self.truncated = True
            path = note.get("path") if isinstance(note, dict) else None
            if isinstance(path, str) and len(path) <= 4096 and path not in self.spill_paths:
                if len(self.spill_paths) < MAX_SPILL_PATHS:
                    self.spill_paths.append(path)
            return None
        if not self._fits(len(json.dumps(data)) + len(json.dumps(metadata))):
            return self._drop_marker()
        data = dict(data)
        if ARTIFACT_MIME in data:
            ref = data[ARTIFACT_MIME]
            if not isinstance(ref, dict) or not isinstance(ref.get("path"), str) or not isinstance(
                ref.get("mime"), str
            ):
                self.ignored += 1
                return None
            self.artifacts.append({"mime": ref["mime"], "path": ref["path"]})
        output = {"output_type": msg_type, "data": data, "metadata": metadata}
        if msg_type == "execute_result":
            count = content.get("execution_count")
            output["execution_count"] = count if isinstance(count, int) and not isinstance(count, bool) else None
        self.outputs.append(output)
        return output

    def _error(self, content: dict) -> dict:
        """An error always comes through; past the budget it is cut to its last lines."""
        ename, evalue, traceback = content.get("ename", ""), content.get("evalue", ""), content.get("traceback", [])
        ename, evalue = str(ename)[:ERROR_KEEP_CHARS], str(evalue)[:ERROR_KEEP_CHARS]
        lines = [str(line) for line in traceback] if isinstance(traceback, list) else []
        size = len(ename) + len(evalue) + sum(len(line) for line in lines)
        over = self.kept + size > self.cell_limit
        if over:
            kept, left = [], ERROR_KEEP_CHARS
            for line in reversed(lines):
                if len(line) > left:
                    break
                kept.insert(0, line)
                left -= len(line)
            lines = kept
            self.truncated = True
        self.error = {"ename": ename, "evalue": evalue, "traceback": lines}
        output = {"output_type": "error", **self.error}
        if over and self._over_budget_error is not None:
            # Past the budget only the latest error is held, in the place of the one before.
            self.outputs[self.outputs.index(self._over_budget_error)] = output
            self.dropped += 1
        else:
            self.kept += len(ename) + len(evalue) + sum(len(line) for line in lines)
            self.outputs.append(output)
        if over:
            self._over_budget_error = output
        return output

    def add(self, msg_type: str, content: dict) -> dict | None:
        """Fold one iopub message in; return the output event to stream, if any.

        A message of the wrong shape (the kernel is not trusted) is ignored.
        """
        if not isinstance(content, dict):
            self.ignored += 1
            return None
        if msg_type == "stream":
            name, text = content.get("name"), content.get("text")
            if name not in ("stdout", "stderr") or not isinstance(text, str):
                self.ignored += 1
                return None
            return self._stream(name, text)
        if msg_type in ("execute_result", "display_data"):
            return self._rich(msg_type, content)
        if msg_type == "error":
            return self._error(content)
        if msg_type == "clear_output":
            self.outputs.clear()
            self._over_budget_error = None
            self.kept = 0  # the budget bounds what is held, and nothing is now
        if msg_type == "execute_input":
            count = content.get("execution_count")
            if isinstance(count, int) and not isinstance(count, bool):
                self.execution_count = count
        return None

    async def inline(self, output: dict) -> None:
        """Put an artifact's bytes into ``output`` if they fit what is left of the budget."""
        room = (self.cell_limit - self.kept) * 3 // 4  # base64 grows by a third
        data, reason = await asyncio.to_thread(
            inline_artifact, output["data"], self.agent_root, self.session_dir, max(room, 0)
        )
        if reason is None:
            self.kept += sum(len(v) for k, v in data.items() if k not in output["data"])
            self._inlined[id(output)] = (output, output["data"][ARTIFACT_MIME])  # held: ids stay unique
        output["data"] = data

    def text(self) -> str:
        parts = []
        for output in self.outputs:
            kind = output["output_type"]
            if kind == "stream":
                parts.append(output["text"])
            elif kind in ("execute_result", "display_data"):
                data = output["data"]
                inlined = self._inlined.get(id(output))
                ref = data.get(ARTIFACT_MIME) or (inlined[1] if inlined and inlined[0] is output else None)
                if ref is not None:
                    why = f"; not inlined: {ref['not_inlined']}" if ref.get("not_inlined") else ""
                    parts.append(f"[{ref.get('mime')} saved to {ref.get('path')}{why}]\n")
                elif "text/plain" in data:
                    plain = data["text/plain"]
                    parts.append(plain if plain.endswith("\n") else plain + "\n")
            elif kind == "error":
                parts.append(short_error(output))
        return strip_ansi("".join(parts))

    def result(self, duration_s: float) -> dict:
        if self.dropped:
            self.outputs.append({"output_type": "stream", "name": "stderr", "text": self._marker_text()})
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


def inline_artifact(
    data: dict, agent_root: str | None, session_dir: str | None, max_bytes: int
) -> tuple[dict, str | None]:
    """``data`` with an artifact's bytes put back in as base64 (when the client asked for it).

    The path comes from the kernel, so it is hostile: only a regular file in
    the session's directory, reached beneath the agent root with no symlink
    out and no FIFO or device, at most ``max_bytes``, is read.  Blocking I/O:
    call it in a worker thread.  Returns (data, None), or the data unchanged
    but for a ``not_inlined`` reason in the reference.
    """
    ref = data.get(ARTIFACT_MIME, {})
    path, mime = ref.get("path"), ref.get("mime")
    reason = _artifact_refusal(path, agent_root, session_dir)
    raw = b""
    if reason is None:
        try:
            raw = fs.read_regular_in_root(agent_root, path, max_bytes)
        except fs.FileTooLarge as e:
            reason = f"{e.size} bytes, more than the {e.cap} bytes left of this cell's output budget"
        except fs.NotRegularFile:
            reason = "not a regular file"
        except (fs.PathOutsideRoot, fs.InvalidPath):
            reason = "not a file in this session's directory (symlinks are not followed)"
        except OSError as e:
            reason = e.strerror or str(e)
    if reason is None:
        try:
            text = raw.decode("utf-8") if mime == "image/svg+xml" else base64.b64encode(raw).decode()
        except UnicodeDecodeError:
            reason = "an SVG that is not UTF-8 text"
    if reason is not None:
        return {**data, ARTIFACT_MIME: {**ref, "not_inlined": reason}}, reason
    data = {k: v for k, v in data.items() if k != ARTIFACT_MIME}
    data[mime] = text
    return data, None


def _artifact_refusal(path: Any, agent_root: str | None, session_dir: str | None) -> str | None:
    if agent_root is None or session_dir is None:
        return "no session directory to read it from"
    if not isinstance(path, str) or not path.startswith(session_dir.rstrip("/") + "/"):
        return "not a file in this session's directory"
    parts = path[len(session_dir.rstrip("/")) + 1 :].split("/")
    if ".." in parts:
        return "not a file in this session's directory"
    return None


IOPUB_QUEUE = 16  # messages ZMQ holds for us before the kernel's side drops them
IOPUB_MAX_FRAME = 4 << 20  # a larger frame disconnects the kernel's iopub until it reconnects


def bound_iopub(kc: Any) -> None:
    """Make ``kc``'s iopub socket (not yet connected) hold little of what a kernel floods it with.

    ZMQ reads ahead into its own queue, in the gateway's memory, however
    slowly the gateway takes messages from it: 1,000 raw messages of 400 KB
    each would sit there whole.  A short receive queue and a frame size cap
    bound that; what a kernel sends past them is its own loss.
    """
    import zmq

    with_socket_options(kc, "iopub", {zmq.RCVHWM: IOPUB_QUEUE, zmq.MAXMSGSIZE: IOPUB_MAX_FRAME})


def with_socket_options(kc: Any, channel: str, options: dict[int, int]) -> None:
    """Connect ``kc``'s ``channel`` socket (not yet connected) with these ZMQ options.

    jupyter_client makes a channel's socket from its context's defaults, so the
    options are set there for that one connect and the defaults put back after.
    """
    connect = getattr(type(kc), f"connect_{channel}")

    def connect_with_options(identity: bytes | None = None) -> Any:
        context = kc.context
        saved = dict(context.sockopts)
        for option, value in options.items():
            context.setsockopt(option, value)
        try:
            return connect(kc, identity)
        finally:
            context.sockopts.clear()
            context.sockopts.update(saved)

    setattr(kc, f"connect_{channel}", connect_with_options)


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
    cell_limit: int = DEFAULT_CELL_LIMIT,
    agent_root: str | None = None,
    session_dir: str | None = None,
) -> dict:
    """Execute ``code`` and gather its result.  The caller holds the session's lock.

    A timeout interrupts the kernel and returns what came so far with status
    ``timeout``; a dead kernel raises :class:`KernelDied`.  ``on_request``
    learns the execute request's msg_id.  Artifacts are inlined (with
    ``inline_images``) only from ``session_dir`` beneath ``agent_root``.
    """
    run = CellRun(
        limit=limit, inline_images=inline_images, cell_limit=cell_limit, agent_root=agent_root,
        session_dir=session_dir,
    )
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
    reply = run.reply or await _shell_reply(kc, msg_id, 1.0 if run.status == "timeout" else 5.0)
    content = reply.get("content") if reply is not None else None
    if isinstance(content, dict):
        count = content.get("execution_count")
        if isinstance(count, int) and not isinstance(count, bool):
            run.execution_count = count
        if run.status != "timeout" and content.get("status") != "ok":
            run.status = "error"
            if run.error is None:
                run._error({"ename": "Error", **content})
                run.outputs.pop()  # the reply's error is reported in "error", not as an output
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
            # A kernel that floods its iopub socket past ZMQ's high-water mark loses
            # messages, its final "idle" among them: the reply on shell says it is done.
            run.reply = await _shell_reply(kc, msg_id, 0.001)
            if run.reply is not None:
                return
            if not await is_alive():
                code_, sig = exit_status()
                raise KernelDied(code_, sig)
            continue
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        msg_type, content = msg["header"]["msg_type"], msg["content"]
        if msg_type == "status" and isinstance(content, dict) and content.get("execution_state") == "idle":
            return
        event = run.add(msg_type, content)
        if event is not None and run.inline_images and ARTIFACT_MIME in event.get("data", {}):
            await run.inline(event)
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
