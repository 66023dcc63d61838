"""``kernel-gateway lab AGENT``: start JupyterLab for one agent of a running gateway, in its own sandbox.

What it does, in order (each failure is a message and exit status 1, or 2
for a bad argument, before anything has been started or changed):

1. checks the agent's name, asks the gateway's control socket for the agent
   (``GET /v1/agents/{agent}``): its tree and the host path of its socket;
2. binds ``127.0.0.1:PORT``;
3. checks that the ``lab`` extra is installed (jupyterlab, jupyter-collaboration),
   by finding its modules, not importing them: importing JupyterLab takes
   seconds, and a bad agent, a busy port or no gateway is refused at once;
4. starts ``python -m kernel_gateway.lab.server`` in the ``lab`` sandbox
   profile, as the agent's host uid (the owner of its tree, as for its
   kernels): the agent's tree read-write, the Python environment read-only,
   no network, the agent's socket at ``/run/kernel-gateway.sock`` (how Lab
   reaches its kernels) and a private directory at ``/run/lab`` holding the
   Unix socket Lab serves on;
5. relays ``127.0.0.1:PORT`` to that socket (:mod:`.forwarder`), prints the
   URL and waits for Ctrl-C, SIGTERM or Lab's own end;
6. stops Lab through its own ``/api/shutdown``, kills what is left of the
   sandbox, removes its cgroup and the socket directory.  The agent's kernels
   keep running: they are the agent's.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile

from ..errors import GatewayError
from ..library import DOCUMENTS, SKILLS_DIR
from ..provisioner import python_env_paths
from ..sandbox import launch
from ..sandbox.profile import ProfileError, load_profile
from ..workspace import check_agent_key
from .forwarder import Forwarder, SocketInDirectory
from .resolver import GATEWAY_HOST, SANDBOX_SOCKET

DEFAULT_PORT = 8888
HOST = "127.0.0.1"
RUNTIME_INSIDE = "/run/lab"
SOCKET_NAME = "lab.sock"
READY_TIMEOUT = 180.0  # seconds JupyterLab may take to start (a busy 2-core CI machine)
STOP_TIMEOUT = 15.0
#: Importable modules of the ``lab`` extra.
LAB_MODULES = ("jupyterlab", "jupyter_server", "jupyter_collaboration", "jupyter_server_ydoc")
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class LabError(Exception):
    """A reason not to start; ``status`` is the exit status."""

    def __init__(self, message: str, hint: str = "", status: int = 1):
        super().__init__(message)
        self.message, self.hint, self.status = message, hint, status


def check_lab_installed() -> None:
    import importlib.util

    missing = []
    for module in LAB_MODULES:
        try:
            found = importlib.util.find_spec(module) is not None  # found, not imported (that takes seconds)
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(module)
    if missing:
        raise LabError(
            f"JupyterLab is not installed here (missing: {', '.join(missing)})",
            "install the lab extra: pip install 'live-kernel-gateway[lab]'"
            " (in a checkout: .venv/bin/pip install -e '.[lab]')",
        )


def gateway_agent(socket_path: str, agent: str) -> dict:
    """The agent's record from the running gateway's control socket."""
    from ..client import UnixHTTPConnection

    conn = UnixHTTPConnection(socket_path, timeout=30)
    try:
        conn.request("GET", f"/v1/agents/{agent}")
        response = conn.getresponse()
        body = json.loads(response.read() or b"{}")
    except (OSError, ValueError) as e:
        raise LabError(
            f"no gateway answers on {socket_path}: {e}",
            "start one with `kernel-gateway serve`, or name its control socket with --socket (or --state-dir)",
        ) from None
    finally:
        conn.close()
    if response.status == 404:
        raise LabError(
            f"the gateway on {socket_path} has no agent {agent!r}",
            f"create it first: curl --unix-socket {socket_path} -X PUT http://kg/v1/agents/{agent}",
        )
    if response.status != 200 or not isinstance(body.get("root"), str) or not isinstance(body.get("socket"), str):
        error = body.get("error", {}) if isinstance(body, dict) else {}
        raise LabError(f"the gateway refused: {error.get('message', response.status)}", error.get("hint", ""))
    return body


def tree_owner(root: str) -> launch.RunAs | None:
    """The uid the agent's sandboxes run as: the owner of its tree (None: this process's own)."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise LabError(f"cannot open the agent's tree {root}: {e.strerror}") from None
    try:
        uid = os.fstat(fd).st_uid
    finally:
        os.close(fd)
    if uid == os.geteuid():
        return None
    if os.geteuid() != 0:
        raise LabError(
            f"the agent's tree belongs to uid {uid}: only root can start its sandbox as that uid",
            "run kernel-gateway lab as the user the gateway runs as (root)",
        )
    # Under the agent uid's RLIMIT_NPROC, as all its sandboxes (the gateway's default cap).
    from ..settings import Gateway

    return launch.RunAs(uid, uid, Gateway.agent_max_processes.default_value)


def listen(port: int) -> socket.socket:
    """A listening socket on 127.0.0.1:port (0: any free port)."""
    if not 0 <= port <= 65535:
        raise LabError(f"--port {port} is not a TCP port", "give 1-65535, or 0 for any free port", status=2)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((HOST, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise LabError(f"port {port} on {HOST} is in use", "choose another --port (0: any free one)") from None
        raise LabError(f"cannot listen on {HOST}:{port}: {e.strerror}") from None
    sock.listen(socket.SOMAXCONN)  # a burst of browser connections waits, never gets EAGAIN
    sock.setblocking(False)
    return sock


def lab_argv(root: str, log_level: str) -> list[str]:
    """The LabApp options: gateway mode over the agent's socket, paired sessions, a Unix socket, no terminals."""
    managers = "kernel_gateway.lab.managers"
    return [
        f"--ServerApp.sock={RUNTIME_INSIDE}/{SOCKET_NAME}",
        "--ServerApp.sock_mode=0600",
        f"--ServerApp.root_dir={root}",
        "--ServerApp.open_browser=False",
        "--ServerApp.terminals_enabled=False",
        f"--ServerApp.kernel_manager_class={managers}.PairedKernelManager",
        f"--ServerApp.session_manager_class={managers}.PairedSessionManager",
        "--ServerApp.kernel_websocket_connection_class=kernel_gateway.lab.connections.SameProtocolGatewayConnection",
        f"--GatewayClient.url=http://{GATEWAY_HOST}/agents/me",
        "--ServerApp.ip=127.0.0.1",  # only names the server in its log: it serves on the socket
        # No network in the sandbox: nothing to check or install from.
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--LabApp.extension_manager=readonly",
        # jupyter_server's websocket keep-alive is in milliseconds (30000, and a timeout of 3 pings) where
        # tornado now reads seconds and warns that the timeout is longer than the interval: equal, no warning.
        '--ServerApp.tornado_settings={"ws_ping_interval": 30000, "ws_ping_timeout": 30000}',
        f"--ServerApp.log_level={log_level}",
        f"--Application.log_level={log_level}",  # the extensions' own apps (LabApp, FileIdExtension) too
    ]


def sandbox_values(agent: str, root: str, agent_socket: str, runtime_dir: str) -> dict[str, str]:
    prefix, base = python_env_paths(sys.executable)
    return {
        "agent": agent,
        "agent_root": root,
        "workspace": root,
        "python_prefix": prefix,
        "python_base_prefix": base,
        "python_bin": os.path.join(prefix, "bin"),
        "agent_socket": agent_socket,
        "package_dir": PACKAGE_DIR,
        "lab_runtime_dir": runtime_dir,
    }


def lab_profile(name_or_path: str, root: str) -> dict:
    try:
        profile = load_profile(name_or_path)
    except ProfileError as e:
        raise LabError(f"bad sandbox profile: {e}", status=2) from None
    sandbox = profile["sandbox"]
    # The Library's files are read-only in Lab as in every sandbox of the agent (mounted after the tree).
    sandbox["read_only"] = list(sandbox.get("read_only", [])) + [
        os.path.join(root, name) for name in (SKILLS_DIR, *DOCUMENTS)
    ]
    return profile


async def _http(target: SocketInDirectory, method: str, path: str, token: str, timeout: float = 5.0) -> int:
    """The status of one HTTP request to Lab's Unix socket (0 if it did not answer)."""
    try:
        reader, writer = await asyncio.wait_for(target.connect(), timeout)
    except (OSError, asyncio.TimeoutError):
        return 0
    try:
        writer.write(
            f"{method} {path} HTTP/1.1\r\nHost: {HOST}\r\nAuthorization: token {token}\r\n"
            "Content-Length: 0\r\nConnection: close\r\n\r\n".encode()
        )
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout)
        parts = line.split()
        return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else 0
    except (OSError, asyncio.TimeoutError, ValueError):
        return 0
    finally:
        writer.close()


class LabProcess:
    """JupyterLab in its sandbox, from start to a clean end."""

    def __init__(self, prepared: launch.PreparedSandbox, runtime_dir: str, token: str, owner: int):
        self.prepared, self.runtime_dir, self.token = prepared, runtime_dir, token
        self.socket = SocketInDirectory(runtime_dir, SOCKET_NAME, owner)
        self.process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self.process = await launch.spawn(self.prepared, stdin=asyncio.subprocess.PIPE)
        assert self.process.stdin is not None
        self.process.stdin.write(self.token.encode() + b"\n")
        await self.process.stdin.drain()
        self.process.stdin.close()

    async def ready(self) -> None:
        """Wait until Lab answers on its socket; LabError if it ends or takes too long."""
        assert self.process is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + READY_TIMEOUT
        while loop.time() < deadline:
            if self.process.returncode is not None:
                raise LabError(f"JupyterLab exited with status {self.process.returncode} before it was ready",
                               "its messages are above")
            if self.socket.exists() and await _http(self.socket, "GET", "/api/status", self.token) == 200:
                return
            try:
                await asyncio.wait_for(asyncio.shield(self.process.wait()), 0.2)
            except asyncio.TimeoutError:
                pass
        raise LabError(f"JupyterLab did not answer within {READY_TIMEOUT:.0f} s")

    async def stop(self) -> None:
        process = self.process
        if process is not None and process.returncode is None:
            await _http(self.socket, "POST", "/api/shutdown", self.token)
            try:
                await asyncio.wait_for(process.wait(), STOP_TIMEOUT)
            except asyncio.TimeoutError:
                os.killpg(process.pid, signal.SIGKILL)  # bwrap; --die-with-parent takes its sandbox along
                await process.wait()
        await self.prepared.finish()
        self.prepared.cleanup()
        self.socket.close()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)  # fd-based: never follows a link Lab left there


async def run(args: argparse.Namespace) -> int:
    try:
        agent = check_agent_key(args.agent)
    except GatewayError as e:
        raise LabError(f"{e.message}", e.hint, status=2) from None
    socket_path = args.socket or os.path.join(args.state_dir, "control.sock")
    record = gateway_agent(socket_path, agent)
    root, agent_socket = record["root"], record["socket"]
    run_as = tree_owner(root)
    profile = lab_profile(args.profile, root)
    listener = listen(args.port)
    try:
        check_lab_installed()
    except LabError:
        listener.close()
        raise
    port = listener.getsockname()[1]
    # From here on a signal stops JupyterLab cleanly (its sandbox, cgroup and socket directory removed),
    # also while it is still starting: it is waited for, then stopped.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(signum, stop.set)
    runtime_dir = tempfile.mkdtemp(prefix="kg-lab-")
    lab = None
    try:
        if run_as is not None:
            os.chown(runtime_dir, run_as.uid, run_as.gid)
        command = [sys.executable, "-m", "kernel_gateway.lab.server", *lab_argv(root, args.log_level)]
        try:
            prepared = launch.prepare(
                profile, sandbox_values(agent, root, agent_socket, runtime_dir), command,
                name=f"lab-{agent}", run_as=run_as,
            )  # fmt: skip
        except (launch.SandboxUnavailable, ProfileError, OSError) as e:
            raise LabError(f"cannot prepare JupyterLab's sandbox: {e}") from None
        owner = run_as.uid if run_as is not None else os.geteuid()
        lab = LabProcess(prepared, runtime_dir, secrets.token_urlsafe(32), owner)
        await lab.start()
        await lab.ready()
        if stop.is_set():  # asked to stop while it started
            print("kernel-gateway lab: stopping JupyterLab", file=sys.stderr, flush=True)
            return 0
        forwarder = Forwarder(listener, lab.socket)
        await forwarder.start()
        url = f"http://{HOST}:{port}/lab?token={lab.token}"
        print(f"JupyterLab for agent {agent!r}: files {root}, kernels the gateway's ({socket_path})", flush=True)
        print(f"  open:  {url}", flush=True)
        print(f"  from another machine: ssh -L {port}:{HOST}:{port} THIS_HOST, then open the same URL there", flush=True)
        print("  Ctrl-C stops JupyterLab; the agent's kernels keep running", flush=True)
        assert lab.process is not None
        ended = asyncio.ensure_future(lab.process.wait())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait([ended, stopped], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        await forwarder.close()
        if ended.done():
            print(f"kernel-gateway lab: JupyterLab exited with status {lab.process.returncode}", file=sys.stderr)
            return 1
        ended.cancel()
        print("kernel-gateway lab: stopping JupyterLab", file=sys.stderr, flush=True)
        return 0
    finally:
        listener.close()
        if lab is not None:
            await lab.stop()
        else:
            shutil.rmtree(runtime_dir, ignore_errors=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="kernel-gateway lab",
        description="Start JupyterLab for one agent of a running gateway: its files, its live kernels, in a sandbox.",
    )
    parser.add_argument("agent")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help=f"the port on {HOST} (default {DEFAULT_PORT}; 0: any free one)")
    parser.add_argument("--socket", help="the gateway's control socket (default: <state-dir>/control.sock)")
    parser.add_argument("--state-dir", default="var/state", help="the gateway's state directory")
    parser.add_argument("--profile", default="lab", help="the sandbox profile: 'lab' or a JSON file")
    parser.add_argument("--log-level", default="WARN", choices=["DEBUG", "INFO", "WARN", "ERROR", "CRITICAL"],
                        help="JupyterLab's own log level (its log goes to stderr)")
    args = parser.parse_args(argv)
    try:
        return asyncio.run(run(args))
    except LabError as e:
        print(f"kernel-gateway lab: {e.message}", file=sys.stderr)
        if e.hint:
            print(f"  {e.hint}", file=sys.stderr)
        return e.status
    except KeyboardInterrupt:
        return 130
