"""Start, adopt and stop one sandboxed kernel of one agent.

A :class:`Kernel` is an ``AsyncKernelManager`` using the bwrap provisioner,
a kernel id (a UUID, as in Jupyter), the clients attached to it and the state
observed on its iopub channel.  The gateway keeps its kernelspec in the state
directory, so no Jupyter data directory of the host is consulted.  A spare
kernel is started in the agent's root and *adopted* by a session later: it
moves to the session's directory and learns the session's id, without
leaving a name in the user's namespace.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import queue
import shutil
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from jupyter_client.session import Session
from traitlets.config import Config

from . import json_input, variables
from .execution import bound_iopub
from .kernel_output import KernelOutput
from .provisioner import kernelspec_dict
from .sandbox.launch import RunAs, exit_status

log = logging.getLogger("kernel_gateway.kernels")

KERNEL_NAME = "python3"
WATCH_POLL_SECONDS = 2.0  # how often a silent kernel is checked for being alive
SETTLE_SECONDS = 2.0
AGENT_SOCKET_INSIDE = "/run/kernel-gateway.sock"
# The output-bounding extension is one stdlib-only file, bound read-only into
# the sandbox: it works whether the package is installed or run from a checkout.
KERNEL_EXTENSION = "kernel_gateway_ext"
EXTENSION_DIR_INSIDE = "/run/kernel-gateway/python"
EXTENSION_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel_ext.py")


# The kernelspec's logos, which JupyterLab's launcher shows (package data).
LOGO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernelspec")
LOGO_FILES = ("logo-32x32.png", "logo-64x64.png", "logo-svg.svg")


def copy_logos(spec_dir: str) -> None:
    """Put the kernelspec's logo files into ``spec_dir`` (a kernelspec directory of ours)."""
    for name in LOGO_FILES:
        shutil.copyfile(os.path.join(LOGO_DIR, name), os.path.join(spec_dir, name))


def write_kernelspec(state_dir: str) -> str:
    """The gateway's own kernelspec directory (rewritten at each start)."""
    kernels = os.path.join(state_dir, "kernels")
    spec_dir = os.path.join(kernels, KERNEL_NAME)
    os.makedirs(spec_dir, exist_ok=True)
    spec = kernelspec_dict()
    spec["argv"] += [f"--IPKernelApp.extensions={KERNEL_EXTENSION}"]
    with open(os.path.join(spec_dir, "kernel.json"), "w") as f:
        json.dump(spec, f, indent=1)
    copy_logos(spec_dir)
    return kernels



KERNEL_PART_MAX = 64 << 20  # one JSON part of a kernel message, as the gateway's clients read it


def dropped_message(reason: str) -> dict:
    """What a gateway client gets in place of a kernel message it could not read: no one waits for it."""
    header = {"msg_id": "", "msg_type": "gateway_dropped", "session": "", "username": "", "date": None, "version": ""}
    return {"header": header, "msg_id": "", "msg_type": "gateway_dropped", "parent_header": {}, "metadata": {},
            "content": {"reason": reason[:200]}, "buffers": []}


def bound_session(session: Session) -> Session:
    """Make ``session`` read a kernel's messages with the bounded parser, and drop what it refuses.

    jupyter_client unpacks each part with ``json.loads``, unbounded: a kernel's
    10^5-deep header raised RecursionError out of ``get_iopub_msg``, a 500
    for the execute and the end of the kernel's iopub watcher.  Here every
    part goes through :mod:`kernel_gateway.json_input`, and a message that
    cannot be read (a bad signature, too deep or large, parts that are not
    objects, no ``msg_id``) becomes :func:`dropped_message`, which matches no
    request and no status the readers look for.
    """
    deserialize = session.deserialize

    def unpack(data: Any) -> Any:
        return json_input.loads(data, max_bytes=KERNEL_PART_MAX, what="a kernel message part")

    def bounded_deserialize(msg_list: list, content: bool = True, copy: bool = True) -> dict:
        try:
            msg = deserialize(msg_list, content=content, copy=copy)
            if not all(isinstance(msg[k], dict) for k in ("header", "parent_header", "metadata")) or (
                    content and not isinstance(msg["content"], dict)):
                raise ValueError("a part of the message is not an object")
            return msg
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            log.debug("a kernel message was dropped: %s", e)
            return dropped_message(str(e))

    session.unpack = unpack
    session.deserialize = bounded_deserialize
    return session


@dataclass
class KernelOptions:
    """Everything a kernel start needs that is not per-session."""

    kernelspec_dir: str
    profile: str
    bwrap: str
    log_dir: str
    output_limit: int
    startup_timeout: float
    runtime_root: str
    cgroup_prefix: str
    read_only: tuple = ()  # more read-only binds (the Agent Library's), after the profile's
    # The kernel side spills at half the gateway's per-cell budget, so its own marker still fits.
    cell_output_limit: int = 0
    run_as: RunAs | None = None  # the agent's host uid; None: the gateway's own
    log_max_bytes: int = 4 << 20  # the agent's kernel log, every kernel and restart together (then rotated)


MAX_EXECUTION_COUNT = 1 << 53  # what a JSON number holds exactly; a larger one is no count


class Kernel:
    """A running sandboxed kernel: its id, its manager, and the clients attached to it.

    Each user of the kernel has a client (a connection) of its own, so none
    reads another's replies: ``kc`` is the gateway's executor, ``probe`` the
    variables inspector, :meth:`connect` hands out more (Jupyter websockets).
    A watcher client reads iopub only and keeps the observed state:
    ``execution_state`` (``starting | idle | busy | dead``),
    ``last_activity``, as jupyter_server's ``start_watching_activity`` does,
    and ``execution_count``, from the ``execute_input`` every client's cell
    announces (the executor's, a Jupyter websocket's, a paired JupyterLab's).
    """

    def __init__(self, km: AsyncKernelManager, kc: Any, output: KernelOutput, *, agent: str = "", kernel_id: str = ""):
        self.km = km
        self.kc = kc
        self.output = output  # the kernel's stdout and stderr, drained from a pipe
        self.id = kernel_id or str(uuid.uuid4())
        self.agent = agent
        self.execution_state = "starting"
        self.execution_count = 0
        self.last_activity = time.time()
        self.connections = 0
        self.on_death: Callable[["Kernel"], Any] | None = None
        self._probe: Any = None
        self._watch: Any = None
        self._watch_task: asyncio.Task | None = None
        self._idle_for: collections.deque[str] = collections.deque(maxlen=256)
        self._state_changed = asyncio.Event()

    @classmethod
    async def start(
        cls,
        options: KernelOptions,
        *,
        agent: str,
        agent_root: str,
        cwd: str,
        session_dir: str,
        agent_socket: str,
        session: str = "",
    ) -> "Kernel":
        config = Config()
        config.SandboxedKernelProvisioner.profile = options.profile
        config.SandboxedKernelProvisioner.agent_root = agent_root
        config.SandboxedKernelProvisioner.agent = agent
        config.SandboxedKernelProvisioner.agent_socket = agent_socket
        config.SandboxedKernelProvisioner.bwrap = options.bwrap
        config.SandboxedKernelProvisioner.runtime_root = options.runtime_root
        config.SandboxedKernelProvisioner.cgroup_prefix = options.cgroup_prefix
        if options.run_as is not None:
            config.SandboxedKernelProvisioner.uid = options.run_as.uid
            config.SandboxedKernelProvisioner.gid = options.run_as.gid
            if options.run_as.max_processes is not None:
                config.SandboxedKernelProvisioner.max_processes = options.run_as.max_processes
        config.SandboxedKernelProvisioner.read_only = [
            {"from": EXTENSION_FILE, "at": f"{EXTENSION_DIR_INSIDE}/{KERNEL_EXTENSION}.py"}
        ] + list(options.read_only)
        config.SandboxedKernelProvisioner.env = {
            "PYTHONPATH": EXTENSION_DIR_INSIDE,
            "KERNEL_GATEWAY_AGENT": agent,
            "KERNEL_GATEWAY_AGENT_ROOT": agent_root,
            "KERNEL_GATEWAY_SOCKET": AGENT_SOCKET_INSIDE,
            "KERNEL_GATEWAY_OUTPUT_LIMIT": str(options.output_limit),
            "KERNEL_GATEWAY_OUTPUT_DIR": os.path.join(session_dir, "outputs"),
            "HOME": session_dir,
            "JLK_SESSION": session,
            **({"KERNEL_GATEWAY_CELL_OUTPUT_LIMIT": str(options.cell_output_limit // 2)}
               if options.cell_output_limit else {}),
        }
        km = AsyncKernelManager(
            kernel_name=KERNEL_NAME,
            kernel_spec_manager=KernelSpecManager(kernel_dirs=[options.kernelspec_dir]),
            config=config,
        )
        os.makedirs(options.log_dir, mode=0o700, exist_ok=True)
        # The kernel's fds 1 and 2 are a pipe we drain, not the log file itself.
        output = KernelOutput(os.path.join(options.log_dir, f"kernel-{agent}.log"), options.log_max_bytes)
        try:
            await km.start_kernel(cwd=cwd, stdout=output.write_fd, stderr=output.write_fd)
            output.start()
            kc = km.client()
            bound_session(kc.session)  # (each client has a session of its own: each is bounded)
            bound_iopub(kc)  # a flooding kernel must not fill the gateway's memory through ZMQ's queue
            kc.start_channels()
            kernel = cls(km, kc, output, agent=agent)
            # Watching starts before the kernel answers, so its first statuses are seen.
            kernel._start_watching()
            try:
                await kc.wait_for_ready(timeout=options.startup_timeout)
                await kernel._settle(kc.kernel_info())
                if kernel.execution_state == "starting":  # it answered: idle, whatever the watcher missed
                    kernel.execution_state = "idle"
            except BaseException:
                await kernel._stop_watching()
                kc.stop_channels()
                raise
        except BaseException:
            # Cancelled (the client left) or failed: the half-started sandbox goes too.
            async def clean_up() -> None:
                try:
                    if km.has_kernel:
                        await km.shutdown_kernel(now=True)
                    else:
                        await km.cleanup_resources()
                except Exception:
                    log.exception("cleaning up after a failed kernel start of agent %s", agent)
                finally:
                    output.close()

            # Shielded: a second cancellation must not stop the cleanup half-way and leak the sandbox.
            await asyncio.shield(asyncio.ensure_future(clean_up()))
            raise
        return kernel

    async def adopt(self, cwd: str, session_dir: str, session: str) -> None:
        """Move a spare kernel into a session: its cwd and environment, no names left behind."""
        env = {
            "HOME": session_dir,
            "JLK_SESSION": session,
            "KERNEL_GATEWAY_OUTPUT_DIR": os.path.join(session_dir, "outputs"),
        }
        code = f"(lambda os: (os.chdir({cwd!r}), os.environ.update({env!r})))(__import__('os'))"
        msg_id = self.kc.execute(code, silent=True, store_history=False, allow_stdin=False)
        while True:
            reply = await self.kc.get_shell_msg(timeout=10)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"could not move the spare kernel into {cwd}: {reply['content'].get('evalue')}")
        await self._settle(msg_id)

    # --- observed state -----------------------------------------------------

    def _new_client(self, bound: Callable[[Any], None] | None = None, **channels: bool) -> Any:
        """A client with sockets and a Jupyter session of its own.

        Sharing the manager's session object between two clients that send on
        shell makes ipykernel stop publishing for the first one's requests.
        """
        session = bound_session(Session(key=self.km.session.key, signature_scheme=self.km.session.signature_scheme))
        client = self.km.client(session=session)
        if channels.get("iopub", True):
            bound_iopub(client)  # every iopub reader of the gateway is bounded, not only the executor's
        if bound is not None:
            bound(client)
        client.start_channels(**channels)
        return client

    def _start_watching(self) -> None:
        self._watch = self.km.client()
        bound_session(self._watch.session)
        bound_iopub(self._watch)  # a flood must not queue up in the watcher's socket either
        self._watch.start_channels(shell=False, iopub=True, stdin=False, hb=False, control=False)
        self._watch_task = asyncio.ensure_future(self._watch_iopub())

    async def _watch_iopub(self) -> None:
        """Every iopub message is activity; status messages are the state."""
        try:
            while True:
                try:
                    msg = await self._watch.get_iopub_msg(timeout=WATCH_POLL_SECONDS)
                except (queue.Empty, asyncio.TimeoutError, TimeoutError):
                    if not await self.km.is_alive():
                        self._died()
                        return
                    continue
                except (ValueError, TypeError, RecursionError):  # a wrong signature, a part that is no JSON
                    continue  # (read off the socket already): the kernel's message is skipped, not the watcher
                self.last_activity = time.time()
                try:
                    self._observe(msg)
                except (AttributeError, TypeError, KeyError):  # parts of the wrong type: the kernel's word
                    continue
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("kernel %s of agent %s: watching its iopub failed", self.id, self.agent)

    def _observe(self, msg: dict) -> None:
        """One iopub message: the execution count of a cell's input, the state of a status."""
        msg_type = msg["header"].get("msg_type")
        if msg_type == "execute_input":
            count = msg["content"].get("execution_count")
            if type(count) is int and 0 < count < MAX_EXECUTION_COUNT:  # the kernel's word: checked
                self.execution_count = count
        elif msg_type == "status":
            state = msg["content"].get("execution_state")
            if state in ("starting", "idle", "busy"):
                self.execution_state = state
            if state == "idle":
                parent = msg.get("parent_header")
                msg_id = parent.get("msg_id", "") if isinstance(parent, dict) else ""
                self._idle_for.append(msg_id if isinstance(msg_id, str) else "")
            self._state_changed.set()
            self._state_changed = asyncio.Event()

    def _died(self) -> None:
        if self.execution_state == "dead":
            return
        self.execution_state = "dead"
        self._state_changed.set()
        if self.on_death is not None:
            self.on_death(self)

    def mark_dead(self) -> None:
        """The executor saw the process end: the state says so at once."""
        self._died()

    async def _settle(self, msg_id: str, timeout: float = SETTLE_SECONDS) -> None:
        """Wait (briefly) until the watcher has seen the idle status of request ``msg_id``.

        The executor and the watcher read iopub on separate connections; after
        this, the observed state is no older than the reply the caller got.
        """
        deadline = time.monotonic() + timeout
        while msg_id not in self._idle_for and self.execution_state != "dead":
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                await asyncio.wait_for(self._state_changed.wait(), left)
            except asyncio.TimeoutError:
                return

    async def settle(self, msg_id: str | None) -> None:
        if msg_id:
            await self._settle(msg_id)

    def touch(self) -> None:
        """Client traffic counts as activity, as in jupyter_server."""
        self.last_activity = time.time()

    async def _stop_watching(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()
            try:
                await self._watch_task
            except asyncio.CancelledError:
                pass
            self._watch_task = None
        if self._watch is not None:
            self._watch.stop_channels()
            self._watch = None

    # --- clients ------------------------------------------------------------

    def probe_client(self) -> Any:
        """The variables inspector's own client (shell only): it never reads the executor's replies."""
        if self._probe is None or not self._probe.channels_running:  # (stopped after an oversized reply)
            # Its replies are the kernel's to make: the shell socket takes none over the inspector's cap.
            self._probe = self._new_client(bound=variables.bound_inspector,
                                           shell=True, iopub=False, stdin=False, hb=False, control=False)
        return self._probe

    def connect(self, **channels: bool) -> Any:
        """A new client of this kernel with its own sockets; counted in ``connections``.

        Call :meth:`disconnect` with it when done.
        """
        client = self._new_client(**channels)
        self.connections += 1
        self.touch()
        return client

    def disconnect(self, client: Any) -> None:
        client.stop_channels()
        self.connections = max(0, self.connections - 1)
        self.touch()

    def to_json(self) -> dict:
        """The kernel's model, in Jupyter Server's shape."""
        return {
            "id": self.id,
            "name": KERNEL_NAME,
            "execution_state": self.execution_state,
            "last_activity": self.last_activity,
            "connections": self.connections,
        }

    async def is_alive(self) -> bool:
        return await self.km.is_alive()

    async def interrupt(self) -> None:
        await self.km.interrupt_kernel()

    def exit_status(self) -> tuple[int | None, int | None]:
        process = getattr(self.km.provisioner, "process", None)
        return exit_status(process.poll() if process is not None else None)

    @property
    def pid(self) -> int | None:
        return getattr(self.km.provisioner, "pid", None)

    async def shutdown(self, now: bool = False) -> None:
        try:
            await self._stop_watching()
            if self._probe is not None:
                self._probe.stop_channels()
                self._probe = None
            self.kc.stop_channels()
            if self.km.has_kernel:
                await self.km.shutdown_kernel(now=now)
            else:
                # Already dead: still run the provisioner's cleanup (cgroup, runtime dir).
                await self.km.cleanup_resources()
        finally:
            self.execution_state = "dead"
            self.output.close()
