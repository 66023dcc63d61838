"""Test support for ``kernel-gateway lab``: the command as a user runs it, and a client of the Lab it serves."""

from __future__ import annotations

import http.client
import json
import os
import queue
import signal
import subprocess
import threading
import time
import urllib.parse

from support import BIN, GatewayProcess

LAB_READY_TIMEOUT = 240  # a busy CI machine starting JupyterLab


def lab_server_pids() -> dict[int, int]:
    """pid -> parent pid of every process running JupyterLab's sandboxed server."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if argv[1:3] == [b"-m", b"kernel_gateway.lab.server"] and fields[0] != "Z":  # not bwrap, which names it too
            found[int(entry)] = int(fields[1])
    return found


def descendants_of(pid: int, pids: dict[int, int]) -> list[int]:
    """The pids among ``pids`` whose ancestry leads to ``pid`` (through any process)."""
    def parent(p: int) -> int:
        try:
            with open(f"/proc/{p}/stat") as f:
                return int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            return 0

    out = []
    for candidate in pids:
        p = candidate
        while p > 1:
            p = parent(p)
            if p == pid:
                out.append(candidate)
                break
    return out


def lab_runtime_dirs() -> set[str]:
    import tempfile

    where = tempfile.gettempdir()
    return {name for name in os.listdir(where) if name.startswith("kg-lab-")}


def run_lab_command(*args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """``kernel-gateway lab ARGS`` to its end (the error paths)."""
    return subprocess.run([os.path.join(BIN, "kernel-gateway"), "lab", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


class LabProcess:
    """``kernel-gateway lab AGENT`` in the foreground, as a user runs it; ``url`` once it printed one."""

    def __init__(self, gw: GatewayProcess, agent: str, log_path: str, *extra: str):
        self.gw, self.agent, self.log_path, self.extra = gw, agent, log_path, list(extra)
        self.proc: subprocess.Popen | None = None
        self.stdout = ""
        self.url = self.base = self.token = ""

    def start(self) -> "LabProcess":
        cmd = [os.path.join(BIN, "kernel-gateway"), "lab", self.agent, "--socket", self.gw.socket, "--port", "0",
               *self.extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(self.log_path, "ab"), text=True)
        # A thread reads stdout line by line (select on a buffered pipe would miss lines already read).
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        deadline = time.monotonic() + LAB_READY_TIMEOUT
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1.0)
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    break
                continue
            if line is None:
                break
            if line.strip().startswith("open:"):
                self.url = line.split("open:", 1)[1].strip()
                self.base, _, self.token = self.url.partition("/lab?token=")
                return self
        self.kill()
        raise RuntimeError(f"kernel-gateway lab did not start:\n{self.stdout}\n{open(self.log_path).read()[-4000:]}")

    def _read_stdout(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.stdout += line
            self.lines.put(line)
        self.lines.put(None)

    @property
    def port(self) -> int:
        return urllib.parse.urlparse(self.base).port

    def call(self, method: str, path: str, body=None, token: str | None = "default"):
        """``status, json`` of one request to the Lab server (through the 127.0.0.1 forwarder)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        headers = {}
        token = self.token if token == "default" else token
        if token:
            headers["Authorization"] = f"token {token}"
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers=headers)
        response = conn.getresponse()
        payload = response.read()
        conn.close()
        try:
            return response.status, json.loads(payload) if payload else None
        except ValueError:
            return response.status, payload

    def server_pids(self) -> list[int]:
        assert self.proc is not None
        return descendants_of(self.proc.pid, lab_server_pids())

    def stop(self, sig: int = signal.SIGINT, timeout: float = 60) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
