"""The gateway process: its sockets, its routes, its start and its stop.

One Tornado IOLoop serves the control socket (the full API, mode 0600 in a
0700 directory) and one socket per agent (the same routes, scoped to that
agent, bound into the agent's sandboxes).  SIGTERM stops accepting, shuts
every kernel down and removes the sockets, so a second start works at once.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import re
import os
import signal
import subprocess
import sys
from typing import Any

from tornado import web
from tornado.log import access_log

from .. import __version__
from ..sandbox import cgroups, quota, seccomp
from ..sandbox.launch import SandboxUnavailable, find_bwrap
from ..sandbox.profile import ProfileError, load_profile
from ..codex_runner import check_model_profile
from ..core import Core
from ..jobs import JobManager
from ..jupyter_api.service import JupyterAPI
from ..notebook_runs import notebook_session_id
from ..settings import DEFAULT_JUPYTER_PORT, JUPYTER_HOST, Gateway
from . import (job_routes, jupyter_routes, library_routes, notebook_routes, openapi_routes, session_routes,
               token_routes, tool_routes)
from .base import NotFoundHandler, log_request, route_label
from .connections import ConnectionGate

log = logging.getLogger("kernel_gateway")

ROUTE_MODULES = [openapi_routes, session_routes, tool_routes, notebook_routes, library_routes, job_routes, token_routes]
JUPYTER_PORT_RETRIES = 50  # as Jupyter Server's port_retries
# The per-agent shares and totals of the shared pools, shown in GET /v1/info (limits).
SHARE_SETTINGS = (
    "max_websockets_per_agent", "max_websockets_total", "max_websocket_bytes_per_agent", "max_websocket_bytes_total",
    "max_jupyter_sessions_per_agent",
    "max_jupyter_sessions_total", "max_queued_jobs_per_agent", "max_queued_jobs_total", "max_jobs_per_agent",
    "max_job_env_size", "max_job_record_size", "kernel_log_max_bytes",
)
TCP_IDLE_SECONDS = 600  # an authenticated keep-alive connection between requests (it counts against its agent)


def make_app(core: Core, scope: str | None = None) -> web.Application:
    """The app of the control socket (``scope`` None) or of one agent's socket."""
    routes = [pattern for module in ROUTE_MODULES for pattern in module.routes()]
    routes += jupyter_routes.routes()  # /agents/{agent}/api/...: Jupyter's own API, not described here
    handlers = [
        (pattern, handler, {"core": core, "scope": scope, "route": route_label(pattern)})
        for pattern, handler in routes
    ]
    return web.Application(
        handlers,
        default_handler_class=NotFoundHandler,
        default_handler_args={"core": core, "scope": scope},
        log_function=log_request,
    )


def make_jupyter_app(core: Core) -> web.Application:
    """The app of the loopback TCP port: the Jupyter routes only, each behind an agent's token."""
    args = {"core": core, "scope": None, "tcp": True}
    return web.Application(
        [(pattern, handler, {**args, "route": route_label(pattern)}) for pattern, handler in jupyter_routes.routes()],
        default_handler_class=jupyter_routes.JupyterNotFoundHandler,
        default_handler_args=args,
        websocket_max_message_size=64 << 20,
        log_function=log_request_without_token,
    )


def log_request_without_token(handler: web.RequestHandler) -> None:
    """Tornado's access log line, with any ?token= value blanked out."""
    status = handler.get_status()
    if status < 500:
        return  # as on the sockets: a flood of refused requests is no flood of log lines
    log = access_log.error
    uri = re.sub(r"([?&]token=)[^&]*", r"\1[secret]", handler.request.uri or "")
    log("%d %s %s (%s) %.2fms", status, handler.request.method, uri, handler.request.remote_ip,
        1000.0 * handler.request.request_time())


def bwrap_version(path: str) -> str:
    try:
        return subprocess.run([path, "--version"], capture_output=True, text=True, timeout=5).stdout.strip()
    except OSError:
        return "unknown"


class GatewayServer:
    """Listening sockets and lifecycle around one :class:`Core`."""

    def __init__(self, settings: Gateway):
        self.settings = settings.resolved()
        self.servers: dict[str | None, str] = {}  # the socket path of the control socket and of each agent
        self._lock_file: Any = None
        self._stopping = False
        self._cull_task: asyncio.Task | None = None
        self.core: Core | None = None

    def _prepare_dirs(self) -> None:
        s = self.settings
        os.makedirs(s.root, exist_ok=True)
        os.makedirs(s.state_dir, mode=0o700, exist_ok=True)
        os.chmod(s.state_dir, 0o700)
        # The agents' sockets, and the codex jobs' model forwarder sockets (egress/): 0711, so that every
        # agent's sandboxes reach their own socket (0600, the agent's uid) through one alias of this
        # directory (see sandbox/reach.py) and list nothing.
        for d, mode in ((os.path.dirname(s.socket), 0o700), (os.path.join(s.state_dir, "agents"), 0o711),
                        (os.path.join(s.state_dir, "egress"), 0o711)):
            os.makedirs(d, mode=mode, exist_ok=True)
            os.chmod(d, mode)
        self._lock_file = open(os.path.join(s.state_dir, "gateway.lock"), "w")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SystemExit(f"another gateway is running with the state directory {s.state_dir}") from None
        # Forwarder sockets a stopped gateway left: their jobs read ``lost`` now, nobody serves them.
        egress = os.path.join(s.state_dir, "egress")
        for name in os.listdir(egress):
            if name.endswith(".sock"):
                os.unlink(os.path.join(egress, name))

    def _listen(self, path: str, scope: str | None) -> None:
        # Through the gate: caps per agent socket, and no spinning when descriptors run out.
        self.gate.listen_unix(
            path, make_app(self.core, scope),
            scope,
            # Above the configured cap, so the handler can answer 413 in JSON.
            max_body_size=self.settings.max_body_size + (1 << 20),
            idle_connection_timeout=3600,
        )
        self.servers[scope] = path

    def _listen_jupyter(self) -> None:
        """The loopback TCP listener; the default port moves on to a free one, an explicit port must be free."""
        s = self.settings
        default = s.jupyter_port == DEFAULT_JUPYTER_PORT
        ports = [s.jupyter_port + i for i in range(JUPYTER_PORT_RETRIES + 1)] if default else [s.jupyter_port]
        for port in ports:
            try:
                sockets = self.gate.bind_tcp(port, JUPYTER_HOST)
                break
            except OSError as e:
                last = e
        else:
            raise SystemExit(
                f"kernel-gateway: cannot listen on {JUPYTER_HOST}:{ports[-1]} for the Jupyter API: {last}; "
                "choose another --jupyter-port (0: any free one) or --no-jupyter"
            )
        # Through the gate too: few and short connections until a token names their agent, then its share.
        self.gate.listen_tcp(
            sockets, make_jupyter_app(self.core),
            lambda path, headers: jupyter_routes.tcp_request_agent(self.core, path, headers),
            max_body_size=s.max_body_size + (1 << 20), idle_connection_timeout=TCP_IDLE_SECONDS,
        )
        self.core.jupyter.url = f"http://{JUPYTER_HOST}:{sockets[0].getsockname()[1]}/"

    def _agent_created(self, agent: str) -> None:
        if agent not in self.servers:
            path = self.core.agents.agent_socket(agent)
            self._listen(path, agent)
            run_as = self.core.agents.uids.run_as(agent)
            if run_as is not None:  # its sandboxes connect as the agent's uid
                os.chown(path, run_as.uid, run_as.gid, follow_symlinks=False)

    def _check_profiles(self) -> None:
        """Every profile the settings name loads, or the gateway does not start."""
        s = self.settings
        named = [(f"--Gateway.{kind}_profile", getattr(s, f"{kind}_profile")) for kind in ("kernel", "command", "job")]
        if s.codex_job_profile:
            named.append(("--Gateway.codex_job_profile", s.codex_job_profile))
        for agent, kinds in s.agent_profiles.items():
            if not isinstance(kinds, dict) or set(kinds) - {"kernel", "command", "job"}:
                raise SystemExit(
                    f"kernel-gateway: agent_profiles[{agent!r}] must map 'kernel', 'command' and/or 'job' to a profile"
                )
            named += [(f"agent_profiles[{agent!r}][{kind!r}]", path) for kind, path in kinds.items()]
        for name, model in s.model_profiles.items():
            try:
                check_model_profile(name, model)
            except ValueError as e:
                raise SystemExit(f"kernel-gateway: --Gateway.model_profiles: {e}") from None
        for where, name in named:
            try:
                load_profile(name)
            except ProfileError as e:
                raise SystemExit(f"kernel-gateway: {where}: {e}") from None
        try:
            quota.parse_quota(s.disk_quota)
        except ValueError as e:
            raise SystemExit(f"kernel-gateway: --Gateway.{e}") from None

    async def start(self) -> None:
        s = self.settings
        bwrap = find_bwrap(s.bwrap or None)
        self._check_profiles()
        self._prepare_dirs()
        self.gate = ConnectionGate(s)
        core = self.core = Core(s)
        core.info = {
            "version": __version__,
            "bwrap": {"path": bwrap, "version": bwrap_version(bwrap)},
            "sandbox": {
                "process_limits": (process_limits := cgroups.describe()) or "rlimits only (no writable cgroup)",
                "cpu": cgroups.cpu_mechanism(process_limits),
                "disk_quota": quota.describe(s),
                "seccomp_filter": _seccomp_filter(),
                "profiles": {kind: seccomp.walls(load_profile(getattr(s, f"{kind}_profile"))) for kind in ("kernel", "command")},
                "uid": core.agents.uids.describe(),
                "cgroup_prefix": core.pool.cgroup_prefix,
                "command_start": core.command_spares.describe(),
            },
            "limits": {
                "output_limit": s.output_limit,
                "max_body_size": s.max_body_size,
                "default_timeout": s.default_timeout,
                "max_sessions_per_agent": s.max_sessions_per_agent,
                "max_sessions_total": s.max_sessions_total,
                "cull_idle_timeout": s.cull_idle_timeout,
                "spare_kernels": s.spare_kernels,
                "spare_commands": core.command_spares.enabled,
                "cell_output_limit": s.cell_output_limit,
                "max_requests_per_agent_socket": s.max_requests_per_agent_socket,
                **self.gate.describe(),
                **{name: getattr(s, name) for name in SHARE_SETTINGS},
            },
            "paths": {"root": s.root, "state_dir": s.state_dir, "socket": s.socket, "runtime": core.pool.runtime_root},
        }
        core.load()
        for agent in sorted(core.agents.agents):
            # After a reboot, disk images are no longer mounted: mount first, the library writes into the tree.
            try:
                quota.mount_agent_disk(s, agent)
            except quota.QuotaError as e:
                raise SystemExit(f"kernel-gateway: disk quota of agent {agent!r}: {e.message} ({e.hint})") from None
            # Builtin skills up to date, documents and installed-skills fit for their read-only binds.
            try:
                core.library.ensure_agent(agent)
            except (OSError, ValueError) as e:
                raise SystemExit(f"kernel-gateway: cannot prepare the Agent Library of {agent!r}: {e}") from None
        core.jupyter = JupyterAPI(
            core.sessions,
            state_dir=s.state_dir,
            require_agent=core.agents.require_agent,
            agent_root=core.agents.agent_root,
            notebook_session_id=notebook_session_id,
            library=core.library,
            shares=s,
        )
        self._listen(s.socket, None)
        if s.jupyter:
            self._listen_jupyter()
        core.info["jupyter"] = {"url": core.jupyter.url}
        for agent in sorted(core.agents.agents):
            try:
                self._agent_created(agent)
            except OSError:
                log.exception("agent %s: its socket could not be bound; it stays unregistered", agent)
                core.agents.agents.discard(agent)
        core.agents.on_agent = self._agent_created
        core.jobs = JobManager(s, core)
        core.jobs.gate = self.gate
        await core.jobs.start()  # after the sweep: lost jobs' cgroups are gone
        if s.demo_agent:
            core.agents.ensure_agent(s.demo_agent)
        self._cull_task = asyncio.ensure_future(core.culler.run())

    async def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        if self._cull_task:
            self._cull_task.cancel()
        self.gate.close_all()
        if self.core.jupyter is not None:
            self.core.jupyter.bridges.close_all()
        if self.core.jobs:
            await self.core.jobs.stop()
        await self.core.close()
        for path in self.servers.values():
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.servers.clear()
        if self._lock_file:
            self._lock_file.close()


def _seccomp_filter() -> str:
    try:
        return seccomp.describe()
    except seccomp.SeccompUnavailable as e:
        return f"unavailable: {e}"


def _use_pidfd_child_watcher(loop: asyncio.AbstractEventLoop) -> None:
    """Python < 3.12 waits for each command in a thread of its own; a pidfd is cheaper."""
    if sys.version_info < (3, 12) and hasattr(asyncio, "PidfdChildWatcher"):
        try:
            watcher = asyncio.PidfdChildWatcher()
            asyncio.set_child_watcher(watcher)
            watcher.attach_loop(loop)
        except OSError:  # no pidfd_open on this kernel: keep the default
            pass


def serve(settings: Gateway) -> int:
    """Run the gateway in the foreground until SIGTERM or SIGINT."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    _use_pidfd_child_watcher(loop)
    gateway = GatewayServer(settings)
    try:
        loop.run_until_complete(gateway.start())
    except SandboxUnavailable as e:
        print(f"kernel-gateway: {e}", file=sys.stderr)
        return 1
    done = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, done.set)
    s = gateway.settings
    print(f"kernel-gateway {__version__} listening on {s.socket}", flush=True)
    print(f"  agents:    {s.root}\n  state:     {s.state_dir}\n  bwrap:     {gateway.core.info['bwrap']['version']}")
    print(f"  process limits: {gateway.core.info['sandbox']['process_limits']}")
    disk = gateway.core.info["sandbox"]["disk_quota"]
    print(f"  disk quota: {disk['mechanism']}" + (f" ({disk['reason']})" if "reason" in disk else f", {disk['size']} bytes per agent"))
    if gateway.core.jupyter.url:
        print(f"  Jupyter API: {gateway.core.jupyter.url}agents/<agent>/  (a token: kernel-gateway token <agent>)")
    agent = s.demo_agent or "demo"
    jlk = os.path.join(os.path.dirname(sys.executable), "jlk")
    print("Try, in another terminal:", flush=True)
    if not s.demo_agent:
        print(f"  curl -s --unix-socket {s.socket} -X PUT http://kg/v1/agents/{agent}")
    print(f"  {jlk} --socket {s.socket} --agent {agent} execute --code 'import sys; print(sys.version)'", flush=True)
    loop.run_until_complete(done.wait())
    print("kernel-gateway: stopping: shutting kernels down", flush=True)
    loop.run_until_complete(gateway.stop())
    loop.close()
    return 0
