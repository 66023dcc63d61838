"""The gateway's settings: one traitlets Configurable, set from a config file or flags.

As elsewhere in Jupyter, every option can be given on the command line
(``--Gateway.max_sessions_per_agent=8`` or a short alias such as ``--root``)
or in a config file (``kernel_gateway_config.py`` / ``.json``) named with
``--config``.  The embedded defaults run a demo from the project folder:
agents under ``./var/agents``, state under ``./var/state``.
"""

from __future__ import annotations

import os

from traitlets import Bool, Dict, Float, Int, Unicode
from traitlets.config import Configurable


DEFAULT_JUPYTER_PORT = 8890  # Jupyter Server's own is 8888; ours stays clear of it
JUPYTER_HOST = "127.0.0.1"  # loopback only: every request there still needs an agent's token


class Gateway(Configurable):
    """Settings of one gateway process."""

    root = Unicode("var/agents", config=True, help="Directory holding every agent's tree.")
    state_dir = Unicode(
        "var/state", config=True, help="Control-plane state: registry, logs, sockets. Never mounted into a sandbox."
    )
    socket = Unicode("", config=True, help="Control socket path; default: <state_dir>/control.sock.")
    bwrap = Unicode("", config=True, help="Path of bwrap; default: found on PATH.")
    kernel_profile = Unicode("kernel", config=True, help="Sandbox profile of kernels (built-in name or JSON path).")
    command_profile = Unicode("command", config=True, help="Sandbox profile of commands.")
    agent_profiles = Dict(
        config=True,
        help='Per-agent profile overrides: {"alice": {"kernel": "/etc/kg/net-kernel.json"}}.',
    )
    # 64 KiB: a cell's or a command's output goes into an agent's context window, where this is
    # about 16k tokens at most, head and tail; less cut tables and tracebacks an agent needs whole
    # (a 200-row frame, a long pip error), and the cut is never silent: the last line names the
    # file holding everything.  Operators of small-context agents set --Gateway.output_limit lower.
    output_limit = Int(64 << 10, config=True, help="Bytes of each stream or result kept (head and tail).")
    cell_output_limit = Int(
        384 << 10, config=True,
        help="Bytes of output kept per cell, every stream and result together; the rest is spilled to files.",
    )
    max_connections_per_agent_socket = Int(
        64, config=True, help="Open connections one agent socket accepts; more are refused with 429."
    )
    max_requests_per_agent_socket = Int(16, config=True, help="Requests in flight on one agent socket; more get 429.")
    fd_reserve = Int(
        256, config=True,
        help="File descriptors kept free for the control socket and the gateway's own work; agent sockets refuse "
        "connections that would eat into them.",
    )
    max_body_size = Int(16 << 20, config=True, help="Largest request body accepted, in bytes.")
    default_timeout = Float(600.0, config=True, help="Execute timeout when a request gives none, in seconds.")
    max_timeout = Float(24 * 3600.0, config=True, help="Largest timeout a request may ask for.")
    startup_timeout = Float(60.0, config=True, help="Seconds a kernel may take to answer after start.")
    max_sessions_per_agent = Int(16, config=True, help="Live sessions one agent may hold.")
    max_sessions_total = Int(256, config=True, help="Live sessions in all.")
    max_spare_kernels = Int(8, config=True, help="Ready kernels kept in all (one per active agent at most).")
    spare_kernels = Bool(True, config=True, help="Keep one ready kernel per agent after its first session.")
    spare_commands = Bool(
        True, config=True,
        help="Set up each agent's next command sandbox while its last command runs, so that one starts at once.",
    )  # fmt: skip
    max_spare_commands = Int(
        32, config=True, help="Spare command sandboxes kept in all (two per agent at most; each holds 3 small processes)."
    )
    busy_timeout = Float(
        10.0, config=True, help="Seconds restart and variables wait for a busy session before answering 409."
    )
    cull_idle_timeout = Float(3600.0, config=True, help="Shut down sessions idle this long (0: never).")
    cull_interval = Float(60.0, config=True, help="How often to look for idle sessions, in seconds.")
    max_patch_size = Int(4 << 20, config=True, help="Largest patch accepted by apply_patch, in bytes.")
    apply_patch_command = Unicode(
        "", config=True, help="An external apply_patch executable to use instead (run in the command sandbox)."
    )
    disk_quota = Unicode(
        "",
        config=True,
        help="Disk quota of each agent's tree (e.g. 1G): an ext4 image per agent in <state_dir>/disks, "
        "loop-mounted nosuid,nodev at the agent's root (needs root and loop devices). Empty: no quota.",
    )
    job_profile = Unicode("job", config=True, help="Sandbox profile of background jobs.")
    codex_job_profile = Unicode(
        "", config=True,
        help="Sandbox profile of codex jobs; default: the job profile (no network: Codex reaches its model through the gateway's forwarder).",
    )
    max_running_jobs = Int(2, config=True, help="Background jobs running at once in all (one per agent at most).")
    job_patch_limit = Int(64 << 20, config=True, help="Largest job patch served or applied, in bytes.")
    codex_command = Unicode("", config=True, help="Path of the Codex CLI binary for codex jobs; default: codex on PATH.")
    model_profiles = Dict(
        config=True,
        help='Model profiles for codex jobs: {"heavy": {"model": "gpt-5-codex", "base_url": "https://api.openai.com/v1",'
        ' "provider"?: "openai", "env_key"?: "OPENAI_API_KEY"}}.',
    )
    jobs_model_profile = Unicode("", config=True, help="The Background Agent Jobs model profile (a model_profiles name).")
    heavy_model_profile = Unicode("heavy", config=True, help="The heavy model profile, used when no jobs profile is set.")
    agent_model_profiles = Dict(
        config=True, help='Per-agent model profile choices: {"alice": {"jobs": "name", "heavy": "name"}}.'
    )
    agent_uid_start = Int(
        200000,
        config=True,
        help="First host uid of agents' sandboxes when the gateway runs as root (one per agent; 0: run as root).",
    )
    agent_uid_count = Int(65536, config=True, help="How many host uids from agent_uid_start agents may take.")
    agent_max_processes = Int(
        2048,
        config=True,
        help="RLIMIT_NPROC of an agent's own uid: all its sandboxes' processes and threads together (0: none).",
    )
    demo_agent = Unicode("", config=True, help="Create this agent at start (the quick start uses 'demo').")
    audit_code = Bool(False, config=True, help="Also write the code of each call to the audit log.")
    jupyter = Bool(True, config=True, help="Serve the Jupyter Server API per agent on a loopback TCP port.")
    jupyter_port = Int(
        DEFAULT_JUPYTER_PORT,
        config=True,
        help="Loopback TCP port of the Jupyter Server API (0: a free port). If the default port is taken, "
        "the next free one of the following 50 is used, as Jupyter Server does.",
    )

    # --- per-agent shares of the gateway's shared pools (each also has a total) ---------------
    listen_backlog = Int(
        1024, config=True,
        help="Listen backlog of every socket (the kernel caps it at net.core.somaxconn): clients connecting at once "
        "while the gateway is busy wait in this queue instead of getting EAGAIN.",
    )
    max_jupyter_connections_per_agent = Int(
        64, config=True,
        help="Open connections of one agent on the Jupyter TCP port (counted from its first request with a valid "
        "token); more are refused with 429.",
    )
    max_unauthenticated_connections = Int(
        128, config=True,
        help="Connections to the Jupyter TCP port that have not yet sent a request with a valid token; past it "
        "the oldest of them is closed to make room.",
    )
    unauthenticated_timeout = Float(
        10.0, config=True,
        help="Seconds a connection to the Jupyter TCP port has to send a request with a valid token; then it is closed.",
    )

    max_websockets_per_agent = Int(
        32, config=True, help="Kernel websockets (open, or buffering for a reconnect) of one agent; more get 429."
    )
    max_websockets_total = Int(256, config=True, help="Kernel websockets of all agents together.")
    max_websocket_bytes_per_agent = Int(
        64 << 20, config=True,
        help="Bytes of kernel messages the gateway keeps for one agent's websockets (buffered for a reconnect, or "
        "not yet read by the client); past it a buffer is dropped and a websocket that does not read is closed.",
    )
    max_websocket_bytes_total = Int(512 << 20, config=True, help="The same, every agent together.")
    max_jupyter_sessions_per_agent = Int(
        64, config=True, help="Jupyter sessions (/api/sessions) one agent may hold; more get 429."
    )
    max_jupyter_sessions_total = Int(1024, config=True, help="Jupyter sessions of all agents together.")
    max_queued_jobs_per_agent = Int(8, config=True, help="Background jobs one agent may have waiting; more get 429.")
    max_queued_jobs_total = Int(64, config=True, help="Background jobs waiting, of all agents together.")
    max_jobs_per_agent = Int(
        256, config=True, help="Job records one agent may keep (ended ones too: delete them to make room)."
    )
    max_job_env_size = Int(64 << 10, config=True, help="Bytes of a job's 'env' (names and values together).")
    max_job_record_size = Int(
        1 << 20, config=True, help="Bytes of a job's stored record (its command, objective, env and outputs)."
    )
    kernel_log_max_bytes = Int(
        4 << 20, config=True,
        help="Bytes of one agent's kernel log (<state_dir>/logs/kernel-AGENT.log), every kernel and restart "
        "together; past it the log is rotated to .1, so an agent's kernels keep at most twice this on disk.",
    )

    def resolved(self) -> "Gateway":
        """Absolute paths, so later chdirs cannot move them."""
        self.root = os.path.abspath(self.root)
        self.state_dir = os.path.abspath(self.state_dir)
        self.socket = os.path.abspath(self.socket or os.path.join(self.state_dir, "control.sock"))
        return self

    def profile_for(self, agent: str, kind: str) -> str:
        return self.agent_profiles.get(agent, {}).get(kind) or getattr(self, f"{kind}_profile")
