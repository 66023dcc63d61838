"""A jupyter_client kernel provisioner that runs each kernel inside bubblewrap.

Select it from a kernelspec::

    "metadata": {"kernel_provisioner": {"provisioner_name": "bwrap-provisioner",
                                        "config": {"agent_root": "/agents/alice"}}}

and plain jupyter_client, jupyter_server and JupyterLab start sandboxed kernels.
It fits the provisioner lifecycle rather than working around it: ``pre_launch``
picks an ipc transport in a private runtime directory and compiles the
``kernel`` profile; ``launch_kernel`` spawns bwrap; ``cleanup`` removes the
cgroup and, unless restarting, the runtime directory.

Inside bwrap the kernel's parent is pid 1, which ipykernel reads as "my parent
died": ``JPY_PARENT_PID`` is never passed in, and ``--die-with-parent`` ties
the kernel's life to ours instead.  Signals do not reach a kernel inside the
sandbox, so interrupts go by message.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.provisioning import LocalProvisioner
from traitlets import Dict, Int, List, Unicode

from .sandbox import launch
from .sandbox.profile import load_profile, validate_profile

# Host variables that may cross into a sandbox; everything else stays outside.
PASSED_ENV_PREFIXES = ("KERNEL_GATEWAY_", "JLK_")
PASSED_ENV_NAMES = ("JPY_SESSION_NAME",)


@functools.lru_cache(maxsize=8)
def python_env_paths(executable: str) -> tuple[str, str]:
    """(prefix, base prefix) of the Python environment an interpreter belongs to."""
    prefix = os.path.dirname(os.path.dirname(os.path.abspath(executable)))
    base = os.path.dirname(os.path.dirname(os.path.realpath(executable)))
    return prefix, base


class SandboxedKernelProvisioner(LocalProvisioner):
    """Launches the kernel through the compiled ``kernel`` sandbox profile."""

    profile = Unicode("kernel", config=True, help="Built-in profile name or path of a profile JSON file.")
    agent_root = Unicode(
        "", config=True, help="Tree the kernel may write; default: its working directory."
    )
    agent = Unicode("", config=True, help="Agent key; default: the agent root's name.")
    agent_socket = Unicode("", config=True, help="Host path of the agent's socket to bind in.")
    bwrap = Unicode("", config=True, help="Path of bwrap; default: found on PATH.")
    runtime_root = Unicode("", config=True, help="Where per-kernel runtime dirs go; default: /tmp.")
    cgroup_prefix = Unicode("kernel", config=True, help="Name prefix of the kernel's cgroup.")
    uid = Int(-1, config=True, help="Host uid the sandbox runs as; -1: this process's own.")
    gid = Int(-1, config=True, help="Host gid the sandbox runs as; -1: the same number as uid.")
    max_processes = Int(
        -1, config=True, help="RLIMIT_NPROC of that uid (all of the agent's sandboxes together); -1: none."
    )
    values = Dict(config=True, help="Extra placeholder values for the profile.")
    env = Dict(config=True, help="Extra environment variables inside the sandbox.")
    read_write = List(config=True, help='Extra paths bound read-write (a path, or {"from", "at"}).')
    read_only = List(config=True, help='Extra paths bound read-only (a path, or {"from", "at"}).')

    runtime_dir: str | None = None
    _prepared: launch.PreparedSandbox | None = None

    def _placeholder_values(self, cwd: str, python: str) -> dict[str, str]:
        prefix, base = python_env_paths(python)
        agent_root = os.path.abspath(self.agent_root or cwd)
        values = {
            "agent": self.agent or os.path.basename(agent_root),
            "agent_root": agent_root,
            "workspace": cwd,
            "runtime_dir": self.runtime_dir,
            "python_prefix": prefix,
            "python_base_prefix": base,
            "python_bin": os.path.join(prefix, "bin"),
        }
        if self.agent_socket:
            values["agent_socket"] = self.agent_socket
        values.update({k: str(v) for k, v in self.values.items()})
        return values

    def _load_profile(self) -> dict:
        profile = load_profile(self.profile, extra_placeholders=list(self.values))
        sandbox = profile["sandbox"]
        # Copy before extending: load_profile may hand out a shared document.
        sandbox["read_only"] = list(sandbox.get("read_only", [])) + list(self.read_only)
        sandbox["read_write"] = list(sandbox.get("read_write", [])) + list(self.read_write)
        # The configured paths get the same checks as the profile's own.
        return validate_profile(profile, extra_placeholders=list(self.values))

    def _sandbox_env(self, host_env: dict[str, str]) -> dict[str, str]:
        """The allow-listed variables; they go inside the sandbox only (bwrap --setenv)."""
        env = {
            k: v
            for k, v in host_env.items()
            if k.startswith(PASSED_ENV_PREFIXES) or k in PASSED_ENV_NAMES or k in self.kernel_spec.env
        }
        env.update({k: str(v) for k, v in self.env.items()})
        return {k: v for k, v in env.items() if launch.check_env_name(k) and "\0" not in v}

    def _run_as(self) -> launch.RunAs | None:
        if self.uid < 0:
            return None
        # The uid's process cap too: without it a kernel could fork until no other sandbox of its agent starts.
        limit = self.max_processes if self.max_processes >= 0 else None
        return launch.RunAs(self.uid, self.gid if self.gid >= 0 else self.uid, limit)

    def _hand_over_runtime_dir(self, run_as: launch.RunAs | None) -> None:
        """The kernel creates its ipc sockets there and reads its connection file."""
        if run_as is None or self.runtime_dir is None:
            return
        os.chown(self.runtime_dir, run_as.uid, run_as.gid, follow_symlinks=False)
        connection_file = getattr(self.parent, "connection_file", "")
        if connection_file and os.path.dirname(connection_file) == self.runtime_dir:
            try:
                os.chown(connection_file, run_as.uid, run_as.gid, follow_symlinks=False)
            except FileNotFoundError:
                pass

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        km = self.parent
        cwd = os.path.abspath(kwargs.get("cwd") or os.getcwd())
        if self.agent_root and os.path.commonpath([cwd, os.path.abspath(self.agent_root)]) != os.path.abspath(self.agent_root):
            raise ValueError(f"the kernel's working directory {cwd} is outside agent_root {self.agent_root}")
        if self.runtime_dir is None:
            # Short path: ipc socket paths must fit in 107 bytes.
            self.runtime_dir = tempfile.mkdtemp(prefix="kg-", dir=self.runtime_root or None)
        km.transport = "ipc"
        km.ip = os.path.join(self.runtime_dir, "k")
        km.cache_ports = False
        km.connection_file = os.path.join(self.runtime_dir, "connection.json")
        self.kernel_spec.interrupt_mode = "message"

        try:
            kwargs = await super().pre_launch(**kwargs)
            cmd = kwargs["cmd"]
            if not cmd or not os.path.isfile(cmd[0]) or not os.access(cmd[0], os.X_OK):
                raise RuntimeError(
                    f"the kernel's Python environment is missing: {cmd[0] if cmd else '(empty argv)'} "
                    "is not an executable file; reinstall the environment or fix the kernelspec's argv"
                )
            profile = self._load_profile()
            run_as = self._run_as()
            self._hand_over_runtime_dir(run_as)
            self._prepared = launch.prepare(
                profile,
                self._placeholder_values(cwd, cmd[0]),
                cmd,
                bwrap=self.bwrap or None,
                name=f"{self.cgroup_prefix}-{self.kernel_id[:8]}",
                extra_env=self._sandbox_env(kwargs["env"]),
                run_as=run_as,
            )
        except Exception:
            # The kernel manager never calls cleanup() when pre_launch fails.
            self._release()
            raise
        kwargs["cmd"] = self._prepared.argv
        kwargs["cwd"] = cwd
        return kwargs

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        assert self._prepared is not None
        spawn = self._prepared.spawn_kwargs()
        try:
            self.process = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=kwargs.get("stdout"),
                stderr=kwargs.get("stderr"),
                cwd=kwargs.get("cwd"),
                **spawn,
            )
        except Exception:
            self._release()  # nor when the launch fails
            raise
        self._prepared.spawned()
        self.pid = self.pgid = self.process.pid
        self.cwd = kwargs.get("cwd")
        return self.connection_info

    async def cleanup(self, restart: bool = False) -> None:
        await super().cleanup(restart=restart)
        if self._prepared is not None:
            await self._prepared.finish()  # the cgroup empties without blocking the loop
        self._release(keep_runtime_dir=restart)

    def _release(self, keep_runtime_dir: bool = False) -> None:
        """Remove the sandbox's cgroup and, unless kept for a restart, its runtime dir."""
        if self._prepared is not None:
            # One quick pass: the waiting, if any, happened in cleanup() above.
            self._prepared.cleanup(timeout=0)
            self._prepared = None
        if not keep_runtime_dir and self.runtime_dir:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)
            self.runtime_dir = None


def _has_debugpy(python: str | None) -> bool:
    if python not in (None, sys.executable):
        return False  # another environment: not ours to look into here
    import importlib.util

    return importlib.util.find_spec("debugpy") is not None


def kernelspec_dict(python: str | None = None, config: dict | None = None) -> dict:
    """The kernel.json of a sandboxed Python kernel."""
    return {
        "argv": [python or sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (sandboxed)",
        "language": "python",
        "interrupt_mode": "message",
        "metadata": {
            "kernel_provisioner": {"provisioner_name": "bwrap-provisioner", "config": config or {}},
            # JupyterLab enables its debugger panel for kernelspecs that say so; ipykernel
            # debugs through debugpy (one of its own dependencies) inside the sandbox.
            "debugger": _has_debugpy(python),
        },
    }
