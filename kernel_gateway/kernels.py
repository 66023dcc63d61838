"""Start, adopt and stop one sandboxed kernel of one agent.

A :class:`Kernel` is an ``AsyncKernelManager`` using the bwrap provisioner
plus a started client.  The gateway keeps its kernelspec in the state
directory, so no Jupyter data directory of the host is consulted.  A spare
kernel is started in the agent's root and *adopted* by a session later: it
moves to the session's directory and learns the session's id, without
leaving a name in the user's namespace.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import Any

from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from traitlets.config import Config

from .execution import bound_iopub
from .kernel_output import KernelOutput
from .provisioner import kernelspec_dict
from .sandbox.launch import RunAs, exit_status

KERNEL_NAME = "python3"
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


class Kernel:
    """A running sandboxed kernel and its client."""

    def __init__(self, km: AsyncKernelManager, kc: Any, output: KernelOutput):
        self.km = km
        self.kc = kc
        self.output = output

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
        output = KernelOutput(os.path.join(options.log_dir, f"kernel-{agent}.log"))
        try:
            await km.start_kernel(cwd=cwd, stdout=output.write_fd, stderr=output.write_fd)
            output.start()
            kc = km.client()
            bound_iopub(kc)  # a flooding kernel must not fill the gateway's memory through ZMQ's queue
            kc.start_channels()
            try:
                await kc.wait_for_ready(timeout=options.startup_timeout)
            except Exception:
                kc.stop_channels()
                raise
        except Exception:
            if km.has_kernel:
                await km.shutdown_kernel(now=True)
            output.close()
            raise
        return cls(km, kc, output)

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
            self.kc.stop_channels()
            if self.km.has_kernel:
                await self.km.shutdown_kernel(now=now)
            else:
                # Already dead: still run the provisioner's cleanup (cgroup, runtime dir).
                await self.km.cleanup_resources()
        finally:
            self.output.close()
