"""A hostile agent tree: every route that takes a path, called against it, judged from the host.

The agent ``alice`` fills its own tree, from inside its sandbox (a command run through the
gateway as alice), with what an agent can make there: FIFOs, a Unix socket, symlinks to host
paths (``/etc``, ``/etc/shadow``, ``/root``, the gateway's state directory and its files,
``/proc/self/{environ,root,cwd,fd/1,mem}``, ``/dev/zero``, a host directory of canary files)
and to the other agent ``bob``'s tree, relative links climbing out, link loops, sparse files
up to its 1 GiB file-size limit, a 35 MB notebook, a 40 MB text file, a folder of 50,000
files, a chain of 4,000 nested folders (paths far past PATH_MAX), unreadable folders and files,
odd names (newline, CR, non-UTF-8 bytes, leading dashes, 255-byte names, ``..`` lookalikes,
``%2e%2e``, backslashes, control and bidi characters), ``.ipynb_checkpoints`` holding FIFOs
and links out, and session directories swapped for links out, FIFOs and files.  What the
sandbox cannot make is planted from the host as root and said so where it is planted: 8 GiB
sparse files (past the sandbox's file-size limit), and checkpoints inside the read-only
Library.  A third agent, ``dave``, swaps its top-level entries from its sandbox
(``.kernel-gateway`` and each job's ``skills/`` for links, a finished job's ``from`` for a
link out, last its ``sessions/`` and ``jobs/`` for links out), and a fourth, ``carol``, has the Library's documents and ``installed-skills``
swapped for links and a FIFO from the host (they are read-only binds in every sandbox).

Every route family that takes a path is then called with those paths: ``read_file``,
``apply_patch`` (``*** Add/Update/Delete File``, ``*** Move to``, ``cwd``), notebooks (every
verb), commands (``cwd``, and the output spill), jobs (``from``, the skills copy, ``apply``),
sessions and execute (swapped session directories, kernel artifacts naming hostile paths),
the Library (documents and skills), and the Jupyter API (contents in every verb,
checkpoints, sessions and kernels with a path) on the control socket, on the agent's socket
and on the Jupyter TCP port with a token of the agent.  Meanwhile a prober thread times
``GET /v1/info`` on the control socket, over and over.

Each test (one route family on one transport) fails on:

- any 5xx, or a request left unanswered for ``REQUEST_TIMEOUT`` (30 s);
- any response carrying a canary of the host (the canary files, the line of ``/etc/shadow``,
  the state directory's canary, a variable of the gateway's own environment) or bob's;
- any change on the host outside the attackers' trees: content, mode, owner and mtime
  of the canary directory, of bob's tree, of alice's Library, of the state directory's
  files, of ``/etc/shadow`` and ``/etc/passwd``; the mode and owner of ``/``, ``/etc``,
  ``/root``, ``/tmp`` and the state directory; and a file named ``kg-hostile*`` (every
  name this test writes) appearing in any of them;
- a canary copied into an attacker's tree (a host-side read that landed in the tree);
- anything in an attacker's tree that became root-owned (only the Library's documents
  and skills were root's before the attack, as the README says);
- a stall of the control socket past ``CONTROL_BOUND`` seconds.

``CONTROL_BOUND`` is 2 s.  Measured here first (2 cores, test runs of other checkouts going on
at the same time, load average 4 to 7), with the same prober against a gateway with two
agents: ``GET /v1/info`` took p50 1.3 ms, p99 12 ms, max 23 ms while the gateway was idle
(841 probes), and p50 19 ms, p99 69 ms, max 148 ms while five threads kept it busy with
commands, executes, contents listings and 100 KB contents writes (937 probes).  2 s is more
than ten times the worst probe seen under that load, so it is no timing assert in disguise,
yet it catches the stalls of a blocked event loop (10 to 46 s: a FIFO opened on the loop, a
35 MB notebook or a folder of tens of thousands of files parsed or listed there).
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import os
import stat
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid

import pytest

from kernel_gateway.client import UnixHTTPConnection
from kernel_gateway.workspace import session_dirname
from support import GatewayProcess, wait_until

CONTROL_BOUND = 2.0  # seconds; see the module docstring for how it was measured
REQUEST_TIMEOUT = 30.0
DEEP = 4000  # nested folders under user-files/h/deep
BIG_DIR_FILES = 50_000
HUGE = 8 << 30  # host-planted sparse files: past the sandbox's 1 GiB file-size limit
ARTIFACT_MIME = "application/vnd.kernel-gateway.artifact+json"
ATTACKERS = ("alice", "carol", "dave")  # bob is the victim: nothing is asked in his name
MARK = "kg-hostile"  # every name this test asks the gateway to write starts with it
PAYLOAD = "KG-HOSTILE-PAYLOAD"
H = "user-files/h"
DEEP_REL = f"{H}/deep/" + "d/" * DEEP
NB = {"nbformat": 4, "nbformat_minor": 5, "metadata": {},
      "cells": [{"cell_type": "code", "id": "c1", "source": "1", "metadata": {}, "outputs": [],
                 "execution_count": None}]}

# Names of odd files in user-files/h/odd (bytes: some are not UTF-8).
ODD_NAMES = [
    b"new\nline.txt", b"cr\r.txt", b"\xff\xfe.txt", b"-rf", b"--help.txt", b"x" * 255, b"...", b". .",
    "..\u2024".encode(), "\uff0e\uff0e".encode(), b"%2e%2e", b"%2e%2e%2f%2e%2e%2fetc", b"..\\..\\etc",
    b"a\\b.txt", "\u202eevil.txt".encode(), b" lead", b"trail ", b"tab\t.txt", b"*", b"?", b"#frag",
    b"q?x=1", b"semi;colon", b"\x01ctl.txt", b"\x7f.txt", b"nb\n.ipynb", b"\xff.ipynb", "\u00e9.ipynb".encode(),
    "e\u0301.ipynb".encode(), b"a.ipynb.", b"-.ipynb", b"%2e%2e.ipynb",
]
ODD_DIRS = [b"%2E%2E", b"..\\", b"new\ndir", b"\xfe"]

# Runs inside alice's command sandbox, as alice: plants everything an agent can make.
PLANT = r"""
import json, os, socket, sys
p = json.loads(sys.argv[1])
H = p["H"]
os.makedirs(H)
def at(*parts):
    return os.path.join(H, *parts)
for name in ("fifo", "fifo.txt", "fifo.ipynb", "fifo.py", "fifo.md"):
    os.mkfifo(at(name))
s = socket.socket(socket.AF_UNIX)
s.bind(at("sock"))
s.close()
for name, target in p["links"].items():
    os.symlink(target, at(name))
with open(at("a.txt"), "w") as f:
    f.write("plain\n")
with open(at("n.ipynb"), "w") as f:
    json.dump(p["nb"], f)
os.mkdir(at("sub"))
with open(at("sub", "b.txt"), "w") as f:
    f.write("b\n")
# Sparse files up to the sandbox's own file-size limit (1 GiB).
for name in ("huge-inside.bin", "huge-inside.ipynb", "huge-inside.txt"):
    with open(at(name), "wb") as f:
        f.truncate((1 << 30) - 4096)
# A 35 MB notebook and a 40 MB text file.
cell = {"cell_type": "code", "metadata": {}, "execution_count": 1, "source": "print('x')",
        "outputs": [{"output_type": "stream", "name": "stdout", "text": "y" * 10000}]}
with open(at("big.ipynb"), "w") as f:
    json.dump({"nbformat": 4, "nbformat_minor": 4, "metadata": {}, "cells": [cell] * 3500}, f)
with open(at("big.txt"), "w") as f:
    line = "z" * 99 + "\n"
    for _ in range(40):
        f.write(line * 10000)
# A folder of many files.
os.mkdir(at("bigdir"))
fd = os.open(at("bigdir"), os.O_RDONLY | os.O_DIRECTORY)
for i in range(p["big_dir_files"]):
    os.close(os.open(f"f{i}.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
os.close(fd)
# Folders nested far past PATH_MAX, with a FIFO, a file, a notebook and a link out at the bottom.
os.mkdir(at("deep"))
here = os.getcwd()
os.chdir(at("deep"))
for _ in range(p["deep"]):
    os.mkdir("d")
    os.chdir("d")
os.mkfifo("fifo")
with open("a.txt", "w") as f:
    f.write("deep\n")
with open("n.ipynb", "w") as f:
    json.dump(p["nb"], f)
os.symlink("/etc", "etc")
os.chdir(here)
# Odd names.
os.mkdir(at("odd"))
for name in p["odd_names"]:
    with open(os.path.join(at("odd").encode(), bytes.fromhex(name)), "wb") as f:
        f.write(json.dumps(p["nb"]).encode() if name.endswith(b".ipynb".hex()) else b"odd\n")
for name in p["odd_dirs"]:
    d = os.path.join(at("odd").encode(), bytes.fromhex(name))
    os.mkdir(d)
    with open(os.path.join(d, b"inner.txt"), "wb") as f:
        f.write(b"inner\n")
# Unreadable folders and files.
os.mkdir(at("noperm"))
with open(at("noperm", "a.txt"), "w") as f:
    f.write("x\n")
with open(at("noperm", "n.ipynb"), "w") as f:
    json.dump(p["nb"], f)
for name in ("noperm.txt", "noperm.ipynb"):
    with open(at(name), "w") as f:
        f.write(json.dumps(p["nb"]))
for name in ("noperm", "noperm.txt", "noperm.ipynb"):
    os.chmod(at(name), 0)
# .ipynb_checkpoints holding FIFOs and links out.
def cp(folder, file=True):
    os.mkdir(at(folder))
    if file:
        with open(at(folder, "a.txt"), "w") as f:
            f.write("cp\n")
cp("cpA", file=False); os.mkdir(at("cpA", ".ipynb_checkpoints")); os.mkfifo(at("cpA", ".ipynb_checkpoints", "fifo-checkpoint.txt"))
cp("cpB"); os.symlink(p["host"], at("cpB", ".ipynb_checkpoints"))
cp("cpC"); os.mkdir(at("cpC", ".ipynb_checkpoints")); os.symlink("/etc/shadow", at("cpC", ".ipynb_checkpoints", "a-checkpoint.txt"))
cp("cpD"); os.mkdir(at("cpD", ".ipynb_checkpoints")); os.mkfifo(at("cpD", ".ipynb_checkpoints", "a-checkpoint.txt"))
cp("cpE", file=False); os.mkdir(at("cpE", ".ipynb_checkpoints")); os.symlink(p["host"], at("cpE", ".ipynb_checkpoints", "x"))
cp("cpF", file=False); os.symlink(p["host"], at("cpF", ".ipynb_checkpoints"))
cp("cpG"); os.mkdir(at("cpG", ".ipynb_checkpoints")); os.symlink(p["host"] + "/secret.txt", at("cpG", ".ipynb_checkpoints", "a-checkpoint.txt"))
cp("cpH", file=False); os.mkdir(at("cpH", ".ipynb_checkpoints")); os.symlink("/etc", at("cpH", ".ipynb_checkpoints", "etc"))
# A folder for a job to copy: a bit of everything, but nothing huge (the copy is the agent's own work).
J = at("jobsrc")
os.mkdir(J)
os.mkfifo(os.path.join(J, "fifo"))
s = socket.socket(socket.AF_UNIX)
s.bind(os.path.join(J, "sock"))
s.close()
for name, target in (("etc", "/etc"), ("shadow", "/etc/shadow"), ("host", p["host"]), ("bob", p["links"]["bob"]),
                     ("up", "../../../../etc")):
    os.symlink(target, os.path.join(J, name))
with open(os.path.join(J, "a.txt"), "w") as f:
    f.write("plain\n")
with open(os.path.join(J, "two-mb.bin"), "wb") as f:
    f.write(os.urandom(2 << 20))
for name in p["odd_names"][:12]:
    with open(os.path.join(J.encode(), bytes.fromhex(name)), "wb") as f:
        f.write(b"odd\n")
os.mkdir(os.path.join(J, "noperm"))
os.chmod(os.path.join(J, "noperm"), 0)
here = os.getcwd()
os.chdir(J)
for _ in range(300):
    os.mkdir("d")
    os.chdir("d")
os.mkfifo("fifo")
os.chdir(here)
# Folders holding only .ipynb_checkpoints (a folder Jupyter deletes whole): 3,000 levels deep,
# and 20,000 files wide.
cp("cpI", file=False); os.mkdir(at("cpI", ".ipynb_checkpoints"))
here = os.getcwd()
os.chdir(at("cpI", ".ipynb_checkpoints"))
for _ in range(3000):
    os.mkdir("d")
    os.chdir("d")
os.mkfifo("fifo")
os.chdir(here)
cp("cpJ", file=False); os.mkdir(at("cpJ", ".ipynb_checkpoints"))
fd = os.open(at("cpJ", ".ipynb_checkpoints"), os.O_RDONLY | os.O_DIRECTORY)
for i in range(20000):
    os.close(os.open(f"x{i}-checkpoint.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
os.close(fd)
# Session directories swapped for links out, a FIFO and a file.
for name, target in p["session_links"].items():
    os.symlink(target, os.path.join("sessions", name))
os.mkfifo(os.path.join("sessions", p["session_fifo"]))
with open(os.path.join("sessions", p["session_file"]), "w") as f:
    f.write("not a directory\n")
# The command output spill's folder, swapped for a link to a host folder.
os.makedirs(".kernel-gateway")
os.symlink(p["host"], os.path.join(".kernel-gateway", "commands"))
print("planted")
"""

# Runs inside dave's command sandbox: top-level swaps an agent can make.
PLANT_DAVE = r"""
import os, sys
host = sys.argv[1]
os.symlink("installed-skills", ".kernel-gateway")
os.mkdir("user-files/proj")
with open("user-files/proj/a.txt", "w") as f:
    f.write("one\n")
print("planted")
"""

# Runs in dave's command sandbox while his jobs are submitted: swaps each job's skills/ for a link.
SKILLS_RACER = r"""
import os, sys, time
host = sys.argv[1]
end = time.time() + float(sys.argv[2])
swapped = 0
while time.time() < end:
    for job in os.listdir("jobs"):
        skills = os.path.join("jobs", job, "skills")
        try:
            if os.path.isdir(skills) and not os.path.islink(skills):
                os.rename(skills, skills + ".old")
            if not os.path.lexists(skills):
                os.symlink("../../installed-skills" if swapped % 2 else host, skills)
                swapped += 1
        except OSError:
            pass
    time.sleep(0.001)
print("swapped", swapped)
"""


# --- the prober --------------------------------------------------------------------


class Prober(threading.Thread):
    """Times ``GET /v1/info`` on the control socket, back to back, for the whole module."""

    def __init__(self, socket_path: str):
        super().__init__(name="control-prober", daemon=True)
        self.socket_path = socket_path
        self.samples: list[tuple[float, float, int | None]] = []  # (start, seconds, status)
        self.inflight: float | None = None
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            start = time.monotonic()
            self.inflight = start
            status = None
            try:
                conn = UnixHTTPConnection(self.socket_path, timeout=REQUEST_TIMEOUT)
                conn.request("GET", "/v1/info")
                response = conn.getresponse()
                response.read()
                status = response.status
                conn.close()
            except OSError:
                pass
            self.samples.append((start, time.monotonic() - start, status))
            self.inflight = None
            self.halt.wait(0.02)

    def worst_since(self, t0: float) -> tuple[float, int]:
        """The longest probe that started after ``t0`` (or is still running), and how many ran."""
        window = [(d, s) for start, d, s in list(self.samples) if start >= t0]
        worst = max([d for d, _ in window], default=0.0)
        if any(s != 200 for _, s in window):
            worst = max(worst, REQUEST_TIMEOUT)
        inflight = self.inflight
        if inflight is not None:
            worst = max(worst, time.monotonic() - inflight)
        return worst, len(window)


# --- transports ------------------------------------------------------------------


class Transport:
    """One way in: the control socket, alice's socket, or the Jupyter TCP port with a token."""

    def __init__(self, name: str, socket_path: str | None, agent_segment: str, tcp: tuple[str, int, str] | None = None):
        self.name = name
        self.socket_path = socket_path
        self.agent = agent_segment  # the {agent} part of URLs
        self.tcp = tcp  # (host, port, token)

    def request(self, method: str, url: str, body=None, raw: bytes | None = None, headers=None):
        """(status, bytes), or (None, why) when no answer came."""
        hdrs = dict(headers or {})
        if self.tcp:
            host, port, token = self.tcp
            conn = http.client.HTTPConnection(host, port, timeout=REQUEST_TIMEOUT)
            hdrs["Authorization"] = f"token {token}"
        else:
            conn = UnixHTTPConnection(self.socket_path, timeout=REQUEST_TIMEOUT)
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        try:
            conn.request(method, url, body=data, headers=hdrs)
            response = conn.getresponse()
            return response.status, response.read()
        except (OSError, http.client.HTTPException) as e:
            return None, f"{type(e).__name__}: {e}".encode()
        finally:
            conn.close()


def short(text) -> str:
    """A path or label for a message: the deep chain folded, at most 160 characters."""
    text = text if isinstance(text, str) else os.fsdecode(text)
    text = text.replace("d/" * DEEP, f"(d/)*{DEEP}").replace("d/" * 100, "(d/)*100").replace("d/" * 60, "(d/)*60")
    return text if len(text) <= 160 else text[:160] + "..."


def q(path: str | bytes) -> str:
    """A path as a URL path (every byte that is not safe percent-encoded; '/' kept)."""
    return urllib.parse.quote(path, safe="/")


# --- the host's view ---------------------------------------------------------------


def _sha(path: str, size: int) -> str | None:
    if size > 64 << 20:
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _entry(path: str, content: bool = True, mtime: bool = True) -> tuple:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return ("missing",)
    kind = stat.S_IFMT(st.st_mode)
    digest = None
    if content and kind == stat.S_IFREG:
        digest = _sha(path, st.st_size)
    elif kind == stat.S_IFLNK:
        digest = os.readlink(path)
    return (kind, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns if mtime else 0,
            st.st_size if kind == stat.S_IFREG else 0, digest)


def walk_tree(top: str, visit=None, skip=None) -> list:
    """(relative path as bytes, lstat) of everything under ``top``: no link followed, any depth.

    Directory fds, not paths: the deep chain is far past PATH_MAX.  ``visit(rel, st, dir_fd,
    name)`` is called for each entry while its directory is open; ``skip(rel, name)`` leaves
    an entry out.
    """
    out = []
    try:
        stack = [(b"", os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW))]
    except OSError:
        return out
    while stack:
        rel, fd = stack.pop()
        try:
            for name in os.listdir(fd):
                if skip is not None and skip(rel, name):
                    continue
                name_b = os.fsencode(name)
                try:
                    st = os.lstat(name_b, dir_fd=fd)
                except FileNotFoundError:
                    continue
                child = rel + b"/" + name_b if rel else name_b
                out.append((child, st))
                if visit:
                    visit(child, st, fd, name_b)
                if stat.S_ISDIR(st.st_mode):
                    try:
                        stack.append((child, os.open(name_b, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)))
                    except OSError:
                        pass
        finally:
            os.close(fd)
    return out


def _sha_at(dir_fd: int, name: bytes) -> str:
    h = hashlib.sha256()
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    try:
        for chunk in iter(lambda: os.read(fd, 1 << 20), b""):
            h.update(chunk)
    finally:
        os.close(fd)
    return h.hexdigest()


def tree_snapshot(top: str, content: bool = True, mtime: bool = True) -> dict:
    snap = {b"": _entry(top, content, mtime)}

    def visit(rel, st, dir_fd, name):
        kind = stat.S_IFMT(st.st_mode)
        digest = None
        if kind == stat.S_IFLNK:
            digest = os.readlink(name, dir_fd=dir_fd)
        elif content and kind == stat.S_IFREG and st.st_size <= 64 << 20:
            digest = _sha_at(dir_fd, name)
        snap[rel] = (kind, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns if mtime else 0,
                     st.st_size if kind == stat.S_IFREG else 0, digest)

    walk_tree(top, visit)
    return snap


def _base64_strings(data: bytes) -> list[bytes]:
    """The bytes of every JSON string in ``data`` that is valid base64 (a raw read, a binary model)."""
    try:
        doc = json.loads(data)
    except ValueError:
        return []
    out, todo = [], [doc]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            todo += item.values()
        elif isinstance(item, list):
            todo += item
        elif isinstance(item, str) and len(item) >= 16:
            try:
                out.append(base64.b64decode(item, validate=True))
            except ValueError:
                pass
    return out


# --- the module's gateway, trees and prober -----------------------------------------


class Hostile:
    """Everything a test needs: the gateway, the transports, the canaries, the host's snapshot."""

    def __init__(self, tmp):
        self.tmp = tmp
        self.host = str(tmp / "host")  # a host folder outside every agent tree, with canaries
        self.canary = {name: f"{name}-canary-{uuid.uuid4().hex}" for name in ("host", "bob", "state", "env", "nb")}
        self.gw: GatewayProcess | None = None
        self.prober: Prober | None = None
        self.failures: list[str] = []
        self.before: dict = {}
        self.root_owned_before: dict[str, set] = {}

    # -- setup

    def start(self) -> None:
        os.makedirs(os.path.join(self.host, "dir"))
        for name, text in (("secret.txt", self.canary["host"]), ("a-checkpoint.txt", self.canary["host"]),
                           ("dir/x.txt", self.canary["host"])):
            with open(os.path.join(self.host, name), "w") as f:
                f.write(text + "\n")
        host_nb = {**NB, "cells": [{**NB["cells"][0], "source": self.canary["nb"]}]}
        with open(os.path.join(self.host, "secret.ipynb"), "w") as f:
            json.dump(host_nb, f)
        os.environ["KG_HOSTILE_ENV_CANARY"] = self.canary["env"]
        try:
            self.gw = GatewayProcess(self.tmp, "--jupyter-port", "0").start()
        finally:
            del os.environ["KG_HOSTILE_ENV_CANARY"]
        with open(os.path.join(self.gw.state, "canary.txt"), "w") as f:
            f.write(self.canary["state"] + "\n")
        for agent in ("alice", "bob", "carol", "dave"):
            assert self.gw.client.call("PUT", f"/v1/agents/{agent}")[0] == 201
        self.uid = {a: os.stat(self.agent_root(a)).st_uid for a in ("alice", "bob", "carol", "dave")}
        self._plant_bob()
        self._plant_alice()
        self._plant_carol()
        self.command("dave", [sys.executable, "-c", PLANT_DAVE, self.host])
        self.shadow_line = open("/etc/shadow").readline().strip() if os.path.exists("/etc/shadow") else None
        token = self.gw.client.call("POST", "/v1/agents/alice/tokens")[1]
        url = urllib.parse.urlparse(token["url"])
        self.transports = {
            "control": Transport("control", self.gw.socket, "alice"),
            "agent": Transport("agent", os.path.join(self.gw.state, "agents", "alice.sock"), "me"),
            "tcp": Transport("tcp", None, "alice", (url.hostname, url.port, token["token"])),
        }
        self.before = self.host_snapshot()
        self.root_owned_before = {a: self.root_owned(a) for a in ATTACKERS}
        self.prober = Prober(self.gw.socket)
        self.prober.start()

    def agent_root(self, agent: str) -> str:
        return os.path.join(self.gw.root, agent)

    def command(self, agent: str, argv: list[str], timeout: float = 300) -> dict:
        status, body = self.gw.client.call("POST", f"/v1/agents/{agent}/commands",
                                           {"argv": argv, "timeout": timeout}, timeout=timeout + 60)
        assert status == 200 and body["exit_code"] == 0, body
        return body

    def _plant_bob(self) -> None:
        bob = self.agent_root("bob")
        self.command("bob", ["/bin/sh", "-c",
                             f"echo {self.canary['bob']} > user-files/secret.txt && mkdir -p user-files/proj"
                             f" && echo {self.canary['bob']} > user-files/proj/a.txt"])
        bob_nb = {**NB, "cells": [{**NB["cells"][0], "source": self.canary["bob"]}]}
        self.command("bob", [sys.executable, "-c", "import json, sys; json.dump(json.loads(sys.argv[1]),"
                             " open('user-files/nb.ipynb', 'w'))", json.dumps(bob_nb)])
        assert os.path.exists(os.path.join(bob, "user-files", "nb.ipynb"))

    def _plant_alice(self) -> None:
        state, bob, host = self.gw.state, self.agent_root("bob"), self.host
        links = {
            "etc": "/etc", "shadow": "/etc/shadow", "shadow.txt": "/etc/shadow", "shadow.ipynb": "/etc/shadow",
            "passwd.txt": "/etc/passwd", "root": "/root", "root-bashrc.txt": "/root/.bashrc",
            "state": state, "tokens.json": os.path.join(state, "jupyter_tokens.json"),
            "uids.json": os.path.join(state, "agent-uids.json"), "state-canary.txt": os.path.join(state, "canary.txt"),
            "control.sock": os.path.join(state, "control.sock"),
            "proc-environ": "/proc/self/environ", "proc-environ.txt": "/proc/self/environ",
            "proc-root": "/proc/self/root", "proc-cwd": "/proc/self/cwd", "proc-fd1.txt": "/proc/self/fd/1",
            "proc-mem.txt": "/proc/self/mem", "proc-1-root": "/proc/1/root",
            "host": host, "host-secret.txt": os.path.join(host, "secret.txt"),
            "host.ipynb": os.path.join(host, "secret.ipynb"), "host-missing.txt": os.path.join(host, f"{MARK}-new.txt"),
            "host-missing.ipynb": os.path.join(host, f"{MARK}-new.ipynb"),
            "bob": bob, "bob-files": os.path.join(bob, "user-files"),
            "bob-secret.txt": os.path.join(bob, "user-files", "secret.txt"),
            "bob.ipynb": os.path.join(bob, "user-files", "nb.ipynb"), "bob-proj": os.path.join(bob, "user-files", "proj"),
            "up.txt": "../../../../../../../../../../../../etc/shadow", "up-bob": "../../../bob",
            "up-bob.ipynb": "../../../bob/user-files/nb.ipynb",
            "loop": "loop", "loopa": "loopb", "loopb": "loopa", "loop.ipynb": "loop.ipynb",
            "dangling": "/nonexistent/kg", "dangling.txt": "/nonexistent/kg.txt",
            "dev-zero.txt": "/dev/zero", "dev-zero.ipynb": "/dev/zero", "dev-urandom": "/dev/urandom",
            "self": ".", "parent": "..",
        }
        self.links = links
        self.sessions = {
            "evil-host": host, "evil-etc": "/etc", "evil-bob": os.path.join(bob, "user-files"),
            "evil-state": state, "evil-up": "../../bob/user-files",
        }
        params = {
            "H": H, "links": links, "nb": NB, "big_dir_files": BIG_DIR_FILES, "deep": DEEP, "host": host,
            "odd_names": [n.hex() for n in ODD_NAMES], "odd_dirs": [n.hex() for n in ODD_DIRS],
            "session_links": {session_dirname(s): t for s, t in self.sessions.items()},
            "session_fifo": session_dirname("evil-fifo"), "session_file": session_dirname("evil-file"),
        }
        self.command("alice", [sys.executable, "-c", PLANT, json.dumps(params)])
        root = self.agent_root("alice")
        # From the host as root: what the sandbox cannot make (past its 1 GiB file-size limit,
        # and inside the read-only Library).  Given to alice, as everything she makes is hers.
        for name in ("huge.bin", "huge.ipynb", "huge.txt"):
            path = os.path.join(root, H, name)
            with open(path, "wb") as f:
                f.truncate(HUGE)
            os.chown(path, self.uid["alice"], self.uid["alice"])
        skill_cp = os.path.join(root, "installed-skills", "jupyter-live-kernel", ".ipynb_checkpoints")
        os.mkdir(skill_cp)
        with open(os.path.join(skill_cp, "SKILL-checkpoint.md"), "w") as f:
            f.write("old\n")

    def _plant_carol(self) -> None:
        root = self.agent_root("carol")
        # From the host as root: the Library's documents and installed-skills are read-only
        # binds in every sandbox, so only the host can swap them.
        os.rename(os.path.join(root, "SOUL.md"), os.path.join(root, "SOUL.md.orig"))
        os.symlink("/etc/shadow", os.path.join(root, "SOUL.md"))
        os.rename(os.path.join(root, "MISSION.md"), os.path.join(root, "MISSION.md.orig"))
        os.symlink(os.path.join(self.host, "secret.txt"), os.path.join(root, "MISSION.md"))
        os.rename(os.path.join(root, "DESIGN.md"), os.path.join(root, "DESIGN.md.orig"))
        os.mkfifo(os.path.join(root, "DESIGN.md"))
        os.rename(os.path.join(root, "installed-skills"), os.path.join(root, "installed-skills.orig"))
        os.symlink(self.host, os.path.join(root, "installed-skills"))
        for name in ("SOUL.md", "MISSION.md", "DESIGN.md", "installed-skills"):
            os.lchown(os.path.join(root, name), self.uid["carol"], self.uid["carol"])

    # -- judging

    def host_snapshot(self) -> dict:
        state = self.gw.state
        snap = {
            "host": tree_snapshot(self.host),
            "bob": tree_snapshot(self.agent_root("bob")),
            "alice-library": {
                name: tree_snapshot(os.path.join(self.agent_root("alice"), name))
                for name in ("SOUL.md", "MISSION.md", "DESIGN.md", "installed-skills")
            },
            # The state directory changes as the gateway works: its files' modes and owners must not.
            "state": tree_snapshot(state, content=False, mtime=False),
            "files": {p: _entry(p) for p in ("/etc/shadow", "/etc/passwd", "/etc/hostname",
                                            os.path.join(state, "canary.txt"),
                                            os.path.join(state, "agent-uids.json"),
                                            os.path.join(state, "jupyter_tokens.json"), "/root/.bashrc")},
            "dirs": {p: _entry(p, content=False, mtime=False)
                     for p in ("/", "/etc", "/root", "/tmp", os.getcwd(), state, self.gw.root)},
            "marks": self.marks(),
        }
        return snap

    def marks(self) -> list[str]:
        found = []
        dirs = ["/", "/etc", "/root", "/tmp", self.host, os.path.join(self.host, "dir"), self.gw.state,
                self.gw.root, os.getcwd(), os.path.join(self.agent_root("bob"), "user-files"),
                os.path.join(self.agent_root("alice"), "installed-skills")]
        for d in dirs:
            try:
                found += [os.path.join(d, n) for n in os.listdir(d) if n.startswith(MARK)]
            except OSError:
                pass
        for top in (self.gw.state, self.agent_root("bob"), self.host):
            found += [top + "/" + os.fsdecode(rel) for rel, _ in walk_tree(top)
                      if os.path.basename(rel).startswith(MARK.encode())]
        return sorted(set(found))

    def root_owned(self, agent: str) -> set:
        return self.walk_agent_tree(agent)[0]

    def leaks(self, data: bytes) -> list[str]:
        """Which canaries ``data`` holds, as they are or base64-encoded in a JSON string (raw reads)."""
        data = data + b"".join(_base64_strings(data))
        found = [name for name, text in self.canary.items() if text.encode() in data]
        if self.shadow_line and self.shadow_line.encode() in data:
            found.append("shadow")
        if b"KG_HOSTILE_ENV_CANARY" in data:
            found.append("environ")
        return found

    def walk_agent_tree(self, agent: str) -> tuple[set, list[str]]:
        """One walk of an agent's tree: what is not the agent's, and which files hold a canary.

        On the way every FIFO is opened both ways, so that a gateway thread blocked on one
        is let go: a blocked thread is already reported (no answer, or a stall), and freeing
        it keeps one family's failure from becoming every later family's.
        """
        owned, leaks = set(), []

        def visit(rel, st, dir_fd, name):
            if st.st_uid != self.uid[agent]:
                owned.add(rel)
            if stat.S_ISREG(st.st_mode) and 0 < st.st_size <= 1 << 20:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
                try:
                    hit = self.leaks(os.read(fd, 1 << 20))
                finally:
                    os.close(fd)
                if hit:
                    leaks.append(f"{short(rel)} holds {hit}: a host-side read copied into the tree")
            elif stat.S_ISFIFO(st.st_mode):
                for flags in (os.O_RDONLY, os.O_WRONLY):
                    try:
                        os.close(os.open(name, flags | os.O_NONBLOCK, dir_fd=dir_fd))
                    except OSError:
                        pass

        walk_tree(self.agent_root(agent), visit, skip=self.planted_in_bigdir)
        return owned, leaks

    @staticmethod
    def planted_in_bigdir(rel: bytes, name: str) -> bool:
        """The many files planted in bigdir, as planted (f<N>.txt): not looked at one by one."""
        return rel == f"{H}/bigdir".encode() and name[:1] == "f" and name[1:-4].isdigit() and name.endswith(".txt")

    def judge(self, family: str, transport: str, results: list, t0: float) -> None:
        """Assert on everything one family's calls did (results: (label, status, body, seconds))."""
        problems = []
        for label, status, body, seconds in results:
            if status is None:
                problems.append(f"{short(label)}: no answer ({body[:200]!r}) after {seconds:.1f}s")
            elif status >= 500:
                problems.append(f"{short(label)}: {status} {body[:200]!r}")
            hit = self.leaks(body if isinstance(body, bytes) else b"")
            if hit:
                problems.append(f"{short(label)}: the response holds {hit} ({status})")
        worst, probes = self.prober.worst_since(t0)
        if worst > CONTROL_BOUND:
            problems.append(f"the control socket stalled: GET /v1/info took {worst:.2f}s (bound {CONTROL_BOUND}s)")
        after = self.host_snapshot()
        problems += self.host_changes(self.before, after)
        for agent in ATTACKERS:
            owned, leaks = self.walk_agent_tree(agent)
            became = owned - self.root_owned_before[agent]
            if became:
                problems.append(f"{agent}'s tree has entries not owned by {agent}: "
                                f"{sorted(short(p) for p in became)[:10]}")
                self.root_owned_before[agent] |= became  # reported once
            problems += [f"{agent}'s tree: {leak}" for leak in leaks]
        self.before = after  # a failure is reported once, by the family that caused it
        if problems:
            raise AssertionError(f"{family} on {transport}: {len(problems)} problem(s):\n" + "\n".join(problems))

    @staticmethod
    def host_changes(before: dict, after: dict) -> list[str]:
        out = []
        for group in ("host", "bob", "files", "dirs"):
            for key in sorted(set(before[group]) | set(after[group]), key=str):
                if before[group].get(key) != after[group].get(key):
                    out.append(f"host {group} {key!r} changed: {before[group].get(key)} -> {after[group].get(key)}")
        for name in before["alice-library"]:
            b, a = before["alice-library"][name], after["alice-library"][name]
            for key in sorted(set(b) | set(a)):
                if b.get(key) != a.get(key):
                    out.append(f"alice's Library {name}/{os.fsdecode(key)} changed: {b.get(key)} -> {a.get(key)}")
        b, a = before["state"], after["state"]
        for key in sorted(set(b) & set(a)):
            if b[key][:4] != a[key][:4]:  # kind, mode, owner: files come and go as the gateway works
                out.append(f"state {os.fsdecode(key)} changed: {b[key][:4]} -> {a[key][:4]}")
        for key in sorted(set(a) - set(b)):
            if a[key][2] not in (0,):
                out.append(f"state {os.fsdecode(key)} appeared owned by uid {a[key][2]}")
        new_marks = sorted(set(after["marks"]) - set(before["marks"]))
        if new_marks:
            out.append(f"files named {MARK}* written on the host: {new_marks}")
        return out

    def stop(self) -> None:
        if self.prober:
            self.prober.halt.set()
            self.prober.join(REQUEST_TIMEOUT + 5)
        if self.gw:
            self.gw.stop()
            # The deep chain is past what shutil.rmtree's recursion reaches (pytest's clean-up of
            # old temporary folders would fail on it): rm -rf it here.
            # Job workspaces may hold copies of it too.
            for agent in ATTACKERS:
                for where in (os.path.join(H, "deep"), os.path.join(H, "cpI"), "jobs"):
                    subprocess.run(["rm", "-rf", "--one-file-system", os.path.join(self.agent_root(agent), where)],
                                   check=False)


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    ctx = Hostile(tmp_path_factory.mktemp("hostile"))
    try:
        ctx.start()
        yield ctx
    finally:
        ctx.stop()


class Calls:
    """Makes one family's calls on one transport and records what came back."""

    def __init__(self, ctx: Hostile, transport: str):
        self.ctx = ctx
        self.t = ctx.transports[transport]
        self.results: list = []
        self.t0 = time.monotonic()

    def __call__(self, method: str, url: str, body=None, raw: bytes | None = None, headers=None,
                 label: str | None = None) -> tuple[int | None, bytes]:
        start = time.monotonic()
        status, data = self.t.request(method, url, body, raw, headers)
        self.results.append((label or f"{method} {url[:300]}", status, data, time.monotonic() - start))
        return status, data

    def v1(self, rest: str) -> str:
        return f"/v1/agents/{self.t.agent}/{rest}"

    def api(self, rest: str) -> str:
        return f"/agents/{self.t.agent}/api/{rest}"

    def judge(self, family: str) -> None:
        self.ctx.judge(family, self.t.name, self.results, self.t0)


# --- the hostile paths --------------------------------------------------------------


def odd_paths() -> list[str]:
    """The odd names as API paths (non-UTF-8 bytes as lone surrogates, as os.fsdecode gives them)."""
    return [f"{H}/odd/{os.fsdecode(n)}" for n in ODD_NAMES] + [f"{H}/odd/{os.fsdecode(n)}/inner.txt" for n in ODD_DIRS]


def file_paths() -> list[str]:
    """Paths a file route is asked to read: every kind of hostile entry."""
    names = ["fifo", "fifo.txt", "sock", "huge.bin", "huge.txt", "huge-inside.bin", "huge-inside.txt", "big.txt",
             "noperm.txt", "noperm/a.txt", "noperm", "bigdir", "deep", "sub/../../../../etc/shadow",
             "cpC/.ipynb_checkpoints/a-checkpoint.txt", "cpD/.ipynb_checkpoints/a-checkpoint.txt",
             "cpB/.ipynb_checkpoints/secret.txt", "loop/x"]
    names += list(ALICE_LINKS)
    names += ["etc/shadow", "etc/passwd", "root/.bashrc", "state/canary.txt", "state/jupyter_tokens.json",
              "proc-root/etc/shadow", "proc-cwd/x", "host/secret.txt", "host/dir/x.txt", "bob/user-files/secret.txt",
              "bob-files/secret.txt", "up-bob/user-files/secret.txt", "self/shadow", "parent/h/shadow"]
    paths = [f"{H}/{n}" for n in names]
    paths += [DEEP_REL + "a.txt", DEEP_REL + "fifo", DEEP_REL + "etc/shadow", f"{H}/deep/" + "d/" * 60 + "x"]
    paths += odd_paths()
    paths += [f"sessions/{session_dirname(s)}/x" for s in ("evil-host", "evil-etc", "evil-bob", "evil-state")]
    paths += [f"sessions/{session_dirname(s)}" for s in ("evil-fifo", "evil-file")]
    paths += ["/etc/shadow", "../bob/user-files/secret.txt", "..", "", ".", "user-files/../../bob", "\\etc\\shadow",
              "%2e%2e/%2e%2e/etc/shadow", "user-files/h/a.txt\0/x", "C:\\Windows", "~root/.bashrc", "//etc/shadow"]
    return paths


ALICE_LINKS = [
    "etc", "shadow", "shadow.txt", "shadow.ipynb", "passwd.txt", "root", "root-bashrc.txt", "state", "tokens.json",
    "uids.json", "state-canary.txt", "control.sock", "proc-environ", "proc-environ.txt", "proc-root", "proc-cwd",
    "proc-fd1.txt", "proc-mem.txt", "proc-1-root", "host", "host-secret.txt", "host.ipynb", "host-missing.txt",
    "host-missing.ipynb", "bob", "bob-files", "bob-secret.txt", "bob.ipynb", "bob-proj", "up.txt", "up-bob",
    "up-bob.ipynb", "loop", "loopa", "loopb", "loop.ipynb", "dangling", "dangling.txt", "dev-zero.txt",
    "dev-zero.ipynb", "dev-urandom", "self", "parent",
]


def notebook_paths() -> list[str]:
    names = ["fifo.ipynb", "huge.ipynb", "huge-inside.ipynb", "big.ipynb", "noperm.ipynb", "shadow.ipynb",
             "host.ipynb", "host-missing.ipynb", "bob.ipynb", "up-bob.ipynb", "loop.ipynb", "dev-zero.ipynb",
             "etc/kg-hostile.ipynb", "host/kg-hostile.ipynb", "host/secret.ipynb", "bob-files/nb.ipynb",
             "bob-files/kg-hostile.ipynb", "up-bob/user-files/nb.ipynb", "state/kg-hostile.ipynb",
             "root/kg-hostile.ipynb", "proc-root/etc/kg-hostile.ipynb", "proc-cwd/kg-hostile.ipynb",
             "self/host.ipynb", "parent/h/host.ipynb", "noperm/kg-hostile.ipynb", "cpB/.ipynb_checkpoints/secret.ipynb"]
    paths = [f"{H}/{n}" for n in names]
    paths += [DEEP_REL + "n.ipynb", DEEP_REL + "etc/kg-hostile.ipynb"]
    paths += [p for p in odd_paths() if p.endswith(".ipynb")]
    paths += [f"sessions/{session_dirname(s)}/kg-hostile.ipynb" for s in ("evil-host", "evil-etc", "evil-bob")]
    paths += ["installed-skills/jupyter-live-kernel/kg-hostile.ipynb", "../bob/user-files/nb.ipynb"]
    return paths


def write_targets() -> list[str]:
    """Paths a write is aimed at: through every link out, onto FIFOs and links, deep, odd."""
    names = ["etc/kg-hostile.txt", "host/kg-hostile.txt", "host/dir/kg-hostile.txt", "bob/kg-hostile.txt",
             "bob-files/kg-hostile.txt", "up-bob/user-files/kg-hostile.txt", "state/kg-hostile.txt",
             "root/kg-hostile.txt", "proc-root/tmp/kg-hostile.txt", "proc-cwd/kg-hostile.txt",
             "proc-1-root/tmp/kg-hostile.txt", "shadow.txt", "host-secret.txt", "bob-secret.txt", "state-canary.txt",
             "tokens.json", "host-missing.txt", "proc-fd1.txt", "fifo.txt", "sock", "dev-zero.txt", "loop",
             "cpB/.ipynb_checkpoints/kg-hostile.txt", "noperm/kg-hostile.txt", "huge.txt", "kg-hostile-ok.txt"]
    paths = [f"{H}/{n}" for n in names]
    paths += [DEEP_REL + "kg-hostile.txt", DEEP_REL + "etc/kg-hostile.txt", DEEP_REL + "fifo"]
    paths += [f"{H}/odd/{os.fsdecode(n)}" for n in ODD_NAMES if not n.endswith(b".ipynb")][:12]
    paths += [f"sessions/{session_dirname(s)}/kg-hostile.txt" for s in ("evil-host", "evil-etc", "evil-bob", "evil-state")]
    paths += ["installed-skills/kg-hostile.txt", "SOUL.md", "installed-skills/jupyter-live-kernel/SKILL.md"]
    return paths


# --- the route families -------------------------------------------------------------

V1 = ["control", "agent"]
ALL = ["control", "agent", "tcp"]


@pytest.mark.parametrize("transport", V1)
def test_read_file(hostile, transport):
    call = Calls(hostile, transport)
    for path in file_paths():
        call("GET", call.v1(f"files?path={urllib.parse.quote(path, safe='', errors='surrogateescape')}"),
             label=f"read_file {path[:120]!r}")
        call("GET", call.v1(f"files?raw=1&path={urllib.parse.quote(path, safe='', errors='surrogateescape')}"),
             label=f"read_file raw {path[:120]!r}")
    call.judge("read_file")


def _patch(*ops: str) -> str:
    return "*** Begin Patch\n" + "".join(ops) + "*** End Patch\n"


@pytest.mark.parametrize("transport", V1)
def test_apply_patch(hostile, transport):
    call = Calls(hostile, transport)
    for path in write_targets():
        if "\n" in path or "\r" in path:
            continue  # a patch names one path per line
        add = _patch(f"*** Add File: {path}\n+{PAYLOAD}\n")
        update = _patch(f"*** Update File: {path}\n@@\n-plain\n+{PAYLOAD}\n")
        delete = _patch(f"*** Delete File: {path}\n")
        move = _patch(f"*** Update File: {H}/a.txt\n*** Move to: {path}\n@@\n-plain\n+plain\n")
        for kind, text in (("add", add), ("update", update), ("delete", delete), ("move", move)):
            call("POST", call.v1("patch"), {"patch": text}, label=f"apply_patch {kind} {path[:100]!r}")
    for cwd in [f"{H}/etc", f"{H}/host", f"{H}/bob", f"{H}/fifo", f"{H}/proc-root", f"{H}/noperm", DEEP_REL,
                f"{H}/deep/" + "d/" * 100, f"sessions/{session_dirname('evil-host')}", "/etc", "..", "../bob"]:
        text = _patch(f"*** Add File: {MARK}-cwd.txt\n+{PAYLOAD}\n", f"*** Update File: shadow\n@@\n-x\n+y\n")
        call("POST", call.v1("patch"), {"patch": text, "cwd": cwd}, label=f"apply_patch cwd {cwd[:100]!r}")
    call.judge("apply_patch")
    # An added file is the agent's, whoever wrote it (checked by judge for the in-tree ones).


@pytest.mark.parametrize("transport", V1)
def test_notebooks(hostile, transport):
    call = Calls(hostile, transport)
    for path in notebook_paths():
        nb_url = call.v1("notebooks/" + q(path.encode("utf-8", "surrogateescape")))
        call("GET", nb_url, label=f"notebook GET {path[:100]!r}")
        call("GET", nb_url + "?outputs=1", label=f"notebook GET outputs {path[:100]!r}")
        call("PUT", nb_url, {**NB, "cells": [{**NB["cells"][0], "source": PAYLOAD}]}, label=f"notebook PUT {path[:100]!r}")
        call("POST", nb_url + "/cells", {"index": 0, "source": PAYLOAD}, label=f"cells POST {path[:100]!r}")
        call("PATCH", nb_url + "/cells/c1", {"source": PAYLOAD}, label=f"cell PATCH {path[:100]!r}")
        call("POST", nb_url + "/cells/c1/move", {"to_index": 0}, label=f"cell move {path[:100]!r}")
        call("POST", nb_url + "/clear-outputs", {}, label=f"clear-outputs {path[:100]!r}")
        call("DELETE", nb_url + "/cells/zz", label=f"cell DELETE {path[:100]!r}")
    # Running cells of notebooks that lead out: a session is made for each that opens.
    for path in [f"{H}/host.ipynb", f"{H}/bob.ipynb", f"{H}/fifo.ipynb", f"{H}/host/secret.ipynb", DEEP_REL + "n.ipynb",
                 f"{H}/noperm/n.ipynb"]:
        nb_url = call.v1("notebooks/" + q(path))
        call("POST", nb_url + "/cells/c1/execute", {"timeout": 30}, label=f"cell execute {path[:100]!r}")
        call("POST", nb_url + "/run-all", {"timeout": 30}, label=f"run-all {path[:100]!r}")
    call.judge("notebooks")


@pytest.mark.parametrize("transport", V1)
def test_commands_cwd_and_spill(hostile, transport):
    call = Calls(hostile, transport)
    cwds = [f"{H}/{n}" for n in ("etc", "host", "bob", "bob-files", "up-bob", "state", "root", "proc-root", "proc-cwd",
                                  "fifo", "sock", "noperm", "loop", "dangling", "huge.bin", "self", "parent", "bigdir",
                                  "cpF/.ipynb_checkpoints")]
    cwds += [DEEP_REL, f"{H}/deep/" + "d/" * 100, DEEP_REL + "etc"]
    cwds += [p.rsplit("/", 1)[0] for p in odd_paths() if p.endswith("inner.txt")]
    cwds += ["/etc", "..", "../bob", f"sessions/{session_dirname('evil-host')}"]
    for cwd in cwds:
        call("POST", call.v1("commands"), {"argv": ["/bin/sh", "-c", f"echo {PAYLOAD} > {MARK}-cmd.txt; pwd"],
                                           "cwd": cwd, "timeout": 30}, label=f"command cwd {cwd[:100]!r}")
    refused = {}
    for session in ("evil-host", "evil-etc", "evil-bob", "evil-fifo", "evil-file", "evil-up"):
        refused[session] = call("POST", call.v1("commands"), {"argv": ["/bin/true"], "session": session, "timeout": 30},
                                label=f"command session {session}")
    # Past the output limit the gateway spills the whole output to .kernel-gateway/commands/,
    # which alice made a link to a host folder.
    call("POST", call.v1("commands"), {"argv": ["/bin/sh", "-c", f"yes {PAYLOAD} | head -c 300000"], "timeout": 30},
         label="command output spill through a swapped .kernel-gateway/commands")
    call.judge("commands")
    # A session directory that is a link, a FIFO or a file: refused as for an execute there.
    for session, (status, body) in refused.items():
        assert status == 409 and json.loads(body)["error"]["code"] in ("symlink_in_workspace", "not_a_directory"), \
            (session, status, body)


@pytest.mark.parametrize("transport", V1)
def test_jobs_from(hostile, transport):
    call = Calls(hostile, transport)
    # (Not the in-tree links "self" and "parent": a job from them copies the whole hostile folder,
    # which is the agent's own work, but long.)
    froms = [f"{H}/{n}" for n in ("etc", "host", "bob", "bob-files", "bob-proj", "up-bob", "state", "root",
                                   "proc-root", "proc-cwd", "fifo", "sock", "noperm", "loop", "dangling", "huge.bin",
                                   "cpB/.ipynb_checkpoints", "cpF")]
    froms += [DEEP_REL, DEEP_REL + "etc", "/etc", "..", "../bob", ".", "jobs", ".kernel-gateway/commands",
              f"sessions/{session_dirname('evil-host')}"]
    froms += [p.rsplit("/", 1)[0] for p in odd_paths() if p.endswith("inner.txt")]
    froms += [f"{H}/jobsrc", f"{H}/jobsrc/etc", f"{H}/jobsrc/noperm"]
    # Each job is copied, run and diffed in sandboxes of its own: three run to the end (the
    # hostile folder, the deep chain, an odd name; on the agent socket the first), any other
    # accepted one is cancelled at once.
    run_to_end = {f"{H}/jobsrc", DEEP_REL, f"{H}/odd/{os.fsdecode(ODD_DIRS[0])}"}
    if transport != "control":
        run_to_end = {f"{H}/jobsrc"}
    ids = []
    for source in froms:
        status, body = call("POST", call.v1("jobs"), {"kind": "command", "from": source,
                                                      "argv": ["/bin/sh", "-c", f"echo {PAYLOAD} > {MARK}-job.txt"]},
                            label=f"job from {source!r}")
        if status == 201:
            job_id = json.loads(body)["id"]
            ids.append((job_id, source in run_to_end))
            if source not in run_to_end:
                call("POST", call.v1(f"jobs/{job_id}/cancel"), {}, label=f"job cancel {job_id} from {source!r}")
    for job_id, to_end in ids:
        # A job may take its time (its copy is the agent's own work): polled, then cancelled.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status, body = call("GET", call.v1(f"jobs/{job_id}"), label=f"job {job_id}")
            if status != 200 or json.loads(body)["state"] not in ("queued", "running"):
                break
            time.sleep(0.5)
        else:
            call("POST", call.v1(f"jobs/{job_id}/cancel"), {}, label=f"job cancel {job_id}")
        if to_end:
            call("GET", call.v1(f"jobs/{job_id}/patch"), label=f"job patch {job_id}")
            call("POST", call.v1(f"jobs/{job_id}/apply"), {}, label=f"job apply {job_id}")
        wait_until(lambda: call("DELETE", call.v1(f"jobs/{job_id}"), label=f"job delete {job_id}")[0] != 409, 60, 0.5)
    call("POST", call.v1("jobs"), {"kind": "codex", "from": f"{H}/host", "objective": "x"}, label="codex job from a link out")
    call.judge("jobs")


@pytest.mark.parametrize("transport", V1)
def test_sessions_and_execute(hostile, transport):
    call = Calls(hostile, transport)
    for session in ("evil-host", "evil-etc", "evil-bob", "evil-state", "evil-up", "evil-fifo", "evil-file"):
        sid = urllib.parse.quote(session, safe="")
        call("POST", call.v1("sessions"), {"session": session}, label=f"session create {session}")
        call("POST", call.v1(f"sessions/{sid}/execute"),
             {"code": f"open('{MARK}-exec.txt', 'w').write('{PAYLOAD}'); import os; print(os.getcwd())", "timeout": 60},
             label=f"execute in {session}")
        call("DELETE", call.v1(f"sessions/{sid}"), label=f"session delete {session}")
    # A kernel names hostile artifacts (bypassing its extension); the gateway inlines only a
    # regular file of the session's own folder, read off the loop.
    sid = f"art-{transport}"
    setup = (
        "import os, json\n"
        "d = os.path.join(os.getcwd(), 'outputs'); os.makedirs(d, exist_ok=True)\n"
        f"links = {{'shadow': '/etc/shadow', 'host': {json.dumps(os.path.join(hostile.host, 'secret.txt'))},"
        f" 'bob': {json.dumps(os.path.join(hostile.agent_root('bob'), 'user-files', 'secret.txt'))},"
        " 'environ': '/proc/self/environ', 'zero': '/dev/zero',"
        f" 'up': '../../../{H}/host-secret.txt'}}\n"
        "for n, t in links.items():\n"
        "    p = os.path.join(d, n)\n"
        "    os.path.lexists(p) or os.symlink(t, p)\n"
        "os.path.exists(os.path.join(d, 'fifo')) or os.mkfifo(os.path.join(d, 'fifo'))\n"
        "f = open(os.path.join(d, 'big.png'), 'wb'); f.truncate(900 << 20); f.close()\n"
        "print(os.getcwd())\n"
    )
    status, body = call("POST", call.v1(f"sessions/{sid}/execute"), {"code": setup, "timeout": 60},
                        label="execute: plant artifacts")
    cwd = json.loads(body)["text"].strip() if status == 200 else ""
    targets = [f"{cwd}/outputs/{n}" for n in ("shadow", "host", "bob", "environ", "zero", "up", "fifo", "big.png")]
    targets += [f"{cwd}/outputs/../../../{H}/host-secret.txt", "/etc/shadow", f"{cwd}/outputs/shadow/x",
                f"{cwd}/{'d/' * 3000}x", os.path.join(hostile.host, "secret.txt")]
    raw = (
        "def raw(msg_type, content):\n"
        "    k = get_ipython().kernel\n"
        "    k.session.send(k.iopub_socket, msg_type, content, parent=k.get_parent('shell'), ident=b'raw')\n"
    )
    for target in targets:
        code = raw + (f"raw('display_data', {{'data': {{{ARTIFACT_MIME!r}: {{'mime': 'image/png', "
                      f"'path': {target!r}}}}}, 'metadata': {{}}}})\n")
        call("POST", call.v1(f"sessions/{sid}/execute"), {"code": code, "inline_images": True, "timeout": 60},
             label=f"execute artifact {target[-80:]!r}")
    # A cell whose output spills, in a session whose outputs/ leads out.
    call("POST", call.v1(f"sessions/{sid}/execute"),
         {"code": "import os, shutil; shutil.rmtree('outputs'); "
                  f"os.symlink({hostile.host!r}, 'outputs'); print('{PAYLOAD}' * 20000)", "timeout": 60},
         label="execute spill into a swapped outputs/")
    call("DELETE", call.v1(f"sessions/{sid}"), label="session delete")
    call.judge("sessions and execute")


@pytest.mark.parametrize("transport", V1)
def test_library(hostile, transport):
    call = Calls(hostile, transport)
    for agent in ("carol",) if transport == "control" else ("me",):
        base = f"/v1/agents/{agent}"
        for name in ("SOUL.md", "MISSION.md", "DESIGN.md"):
            call("GET", f"{base}/documents/{name}", label=f"document GET {agent}/{name}")
            call("PUT", f"{base}/documents/{name}", raw=f"{PAYLOAD}\n".encode(), label=f"document PUT {agent}/{name}")
        call("GET", f"{base}/skills", label=f"skills list {agent}")
        call("GET", f"{base}/skills/secret.txt", label=f"skill GET {agent}/secret.txt")
        call("GET", f"{base}/skills/jupyter-live-kernel", label=f"skill GET {agent}/jupyter-live-kernel")
        status, body = call("PUT", f"{base}/skills/{MARK}",
                            {"files": {"SKILL.md": f"---\nname: {MARK}\ndescription: x\n---\n"}},
                            label=f"skill PUT {agent}/{MARK}")
        if agent == "carol":  # installed-skills is a link (planted from the host): refused, nothing written
            assert status == 409 and json.loads(body)["error"]["code"] == "library_broken", body
        call("PATCH", f"{base}/skills/jupyter-live-kernel", {"enabled": True}, label=f"skill PATCH {agent}")
        call("DELETE", f"{base}/skills/{MARK}", label=f"skill DELETE {agent}/{MARK}")
        call("DELETE", f"{base}/skills/dir", label=f"skill DELETE {agent}/dir")
    if transport == "control":
        # Creating the agent again lays its tree out over the swapped entries.
        call("PUT", "/v1/agents/carol", label="agent PUT carol (swapped Library)")
        call("GET", "/v1/agents/carol/documents/SOUL.md", label="document GET carol/SOUL.md after re-creation")
    call.judge("library")


def _jupyter_contents_calls(call: Calls, ctx: Hostile) -> None:
    for path in file_paths() + notebook_paths():
        url = call.api("contents/" + q(path.encode("utf-8", "surrogateescape")))
        label = repr(path[:100])
        call("GET", url, label=f"contents GET {label}")
        call("GET", url + "?content=0", label=f"contents GET content=0 {label}")
        call("GET", url + "?type=file&format=base64", label=f"contents GET base64 {label}")
        call("GET", url + "?type=notebook", label=f"contents GET notebook {label}")
    for path in write_targets():
        url = call.api("contents/" + q(path.encode("utf-8", "surrogateescape")))
        label = repr(path[:100])
        call("PUT", url, {"type": "file", "format": "text", "content": PAYLOAD}, label=f"contents PUT {label}")
        call("PUT", url.replace(".txt", ".ipynb"), {"type": "notebook", "content": NB}, label=f"contents PUT nb {label}")
        call("PUT", url + "-dir", {"type": "directory"}, label=f"contents PUT dir {label}")
    for folder in [f"{H}/{n}" for n in ("etc", "host", "host/dir", "bob", "bob-files", "state", "root", "proc-root/tmp",
                                         "proc-cwd", "cpF/.ipynb_checkpoints", "noperm", "fifo", "loop")] + [DEEP_REL]:
        url = call.api("contents/" + q(folder))
        call("POST", url, {"type": "file"}, label=f"contents new untitled file in {folder[:100]!r}")
        call("POST", url, {"type": "notebook"}, label=f"contents new untitled notebook in {folder[:100]!r}")
        call("POST", url, {"type": "directory"}, label=f"contents new untitled folder in {folder[:100]!r}")
        call("POST", url, {"copy_from": f"{H}/a.txt"}, label=f"contents copy into {folder[:100]!r}")
    for source in [f"{H}/{n}" for n in ("shadow.txt", "host-secret.txt", "bob-secret.txt", "host/secret.txt",
                                         "bob-files/secret.txt", "state-canary.txt", "proc-environ.txt", "fifo.txt",
                                         "dev-zero.txt", "huge.txt", "host.ipynb", "cpC/.ipynb_checkpoints/a-checkpoint.txt")]:
        call("POST", call.api(f"contents/{H}/sub"), {"copy_from": source}, label=f"contents copy from {source!r}")
    for old, new in [(f"{H}/host-secret.txt", f"{H}/sub/{MARK}-moved.txt"), (f"{H}/host/secret.txt", f"{H}/sub/{MARK}-m.txt"),
                     (f"{H}/sub/b.txt", f"{H}/host/{MARK}-r.txt"), (f"{H}/sub/b.txt", f"{H}/bob-files/{MARK}-r.txt"),
                     (f"{H}/sub/b.txt", f"{H}/etc/{MARK}-r.txt"), (f"{H}/sub", f"{H}/sub/inner/{MARK}"),
                     (f"{H}/sub/b.txt", f"{H}/fifo"), (f"{H}/sub/b.txt", f"{H}/shadow.txt"),
                     (f"{H}/bob/user-files/secret.txt", f"{H}/{MARK}-stolen.txt"), (f"{H}/sub/b.txt", "installed-skills/x"),
                     (f"{H}/sub/b.txt", DEEP_REL + f"{MARK}.txt"), (f"{H}/sub/b.txt", f"{H}/sub/b\n.txt")]:
        call("PATCH", call.api("contents/" + q(old)), {"path": new}, label=f"contents rename {old!r} -> {new[:80]!r}")
    for path in [f"{H}/{n}" for n in ("host/secret.txt", "host/dir", "bob-files/secret.txt", "etc/hostname",
                                       "state/canary.txt", "cpA", "cpE", "cpF", "cpH", "cpI", "cpJ", "fifo",
                                       "shadow.txt", "noperm",
                                       "proc-root/tmp", "root/.bashrc", "cpB/.ipynb_checkpoints/secret.txt")]:
        call("DELETE", call.api("contents/" + q(path)), label=f"contents DELETE {path!r}")
    call("DELETE", call.api("contents/" + q(DEEP_REL + "etc")), label="contents DELETE a link at the bottom of the deep chain")


@pytest.mark.parametrize("transport", ALL)
def test_jupyter_contents(hostile, transport):
    call = Calls(hostile, transport)
    _jupyter_contents_calls(call, hostile)
    call.judge("jupyter contents")


@pytest.mark.parametrize("transport", ALL)
def test_jupyter_checkpoints(hostile, transport):
    call = Calls(hostile, transport)
    for path in [f"{H}/cp{x}/a.txt" for x in "BCDG"] + [f"{H}/{n}" for n in ("fifo.txt", "shadow.txt", "host-secret.txt",
                                                                              "huge.txt", "host/secret.txt", "bob.ipynb")] \
            + [DEEP_REL + "a.txt", "installed-skills/jupyter-live-kernel/SKILL.md", "SOUL.md"]:
        url = call.api("contents/" + q(path) + "/checkpoints")
        call("GET", url, label=f"checkpoints list {path[:100]!r}")
        call("POST", url + "/checkpoint", label=f"checkpoint restore {path[:100]!r}")
        call("POST", url, label=f"checkpoint create {path[:100]!r}")
        call("DELETE", url + "/checkpoint", label=f"checkpoint delete {path[:100]!r}")
    call("DELETE", call.api("contents/installed-skills/jupyter-live-kernel/SKILL.md/checkpoints/checkpoint"),
         label="checkpoint delete inside the Library")
    call.judge("jupyter checkpoints")


@pytest.mark.parametrize("transport", ALL)
def test_jupyter_sessions_and_kernels(hostile, transport):
    call = Calls(hostile, transport)
    kernels, sessions = [], []
    # Each accepted one starts a kernel: a few of each kind.
    for path in [f"{H}/{n}" for n in ("host.ipynb", "fifo.ipynb", "host/secret.ipynb", "huge.ipynb")] + [DEEP_REL + "n.ipynb"]:
        status, body = call("POST", call.api("sessions"), {"path": path, "type": "notebook", "name": "n",
                                                           "kernel": {"name": "python3"}},
                            label=f"jupyter session notebook {path[:100]!r}")
        if status == 201:
            sessions.append(json.loads(body)["id"])
    for path in [f"{H}/{n}" for n in ("etc", "bob", "fifo", "noperm")] + [DEEP_REL, "../bob"]:
        status, body = call("POST", call.api("sessions"), {"path": path, "type": "console", "name": "c",
                                                           "kernel": {"name": "python3"}},
                            label=f"jupyter session console {path[:100]!r}")
        if path.endswith("noperm"):  # the agent's own chmod 000: no kernel can start there
            assert status == 403 and json.loads(body)["error"]["code"] == "folder_not_accessible", body
        if status == 201:
            sessions.append(json.loads(body)["id"])
        status, body = call("POST", call.api("kernels"), {"name": "python3", "path": path},
                            label=f"jupyter kernel path {path[:100]!r}")
        if status == 201:
            kernels.append(json.loads(body)["id"])
    for session_id in sessions[:1]:
        for path in (f"{H}/host.ipynb", f"{H}/etc", DEEP_REL + "n.ipynb"):
            call("PATCH", call.api(f"sessions/{session_id}"), {"path": path}, label=f"jupyter session PATCH {path[:100]!r}")
    for session_id in sessions:
        call("DELETE", call.api(f"sessions/{session_id}"), label="jupyter session DELETE")
    for kernel_id in kernels:
        call("DELETE", call.api(f"kernels/{kernel_id}"), label="jupyter kernel DELETE")
    call.judge("jupyter sessions and kernels")


def test_swapped_top_level(hostile):
    """dave's .kernel-gateway is a link to his Library, and each job's skills/ is swapped as it is made."""
    call = Calls(hostile, "control")
    status, body = call("POST", "/v1/agents/dave/commands",
                        {"argv": ["/bin/sh", "-c", f"yes {PAYLOAD} | head -c 300000"], "timeout": 30},
                        label="dave command output spill through .kernel-gateway -> installed-skills")
    spilled = json.loads(body) if status == 200 else {}
    raced = []
    racer = threading.Thread(target=lambda: raced.append(call(
        "POST", "/v1/agents/dave/commands", {"argv": [sys.executable, "-c", SKILLS_RACER, hostile.host, "8"],
                                             "timeout": 60}, label="skills racer")))
    racer.start()
    ids = []
    for _ in range(3):
        status, body = call("POST", "/v1/agents/dave/jobs", {"kind": "command", "from": "user-files/proj",
                                                              "argv": ["/bin/true"]}, label="dave job")
        if status == 201:
            ids.append(json.loads(body)["id"])
    for job_id in ids:
        call("GET", f"/v1/agents/dave/jobs/{job_id}?wait=1", label=f"dave job wait {job_id}")
    racer.join(90)
    call.judge("swapped top level")
    # Both attacks really ran: the output was past the limit, and the racer ran its course.
    assert spilled.get("exit_code") == 0 and spilled.get("truncated"), spilled
    assert raced and raced[0][0] == 200 and json.loads(raced[0][1])["exit_code"] == 0, raced


def test_job_apply_after_from_swapped(hostile):
    """A job's ``from`` swapped, once the job has ended, for a link to a host folder or to bob's: apply writes nothing there."""
    call = Calls(hostile, "control")
    status, body = call("POST", "/v1/agents/dave/jobs", {
        "kind": "command", "from": "user-files/proj",
        "argv": ["/bin/sh", "-c", f"echo {PAYLOAD} > a.txt; echo {PAYLOAD} > {MARK}-new.txt"]}, label="dave job")
    assert status == 201, body
    job_id = json.loads(body)["id"]
    assert wait_until(lambda: json.loads(call("GET", f"/v1/agents/dave/jobs/{job_id}", label="job")[1])["state"]
                      not in ("queued", "running"), 60, 0.5)
    bob_proj = os.path.join(hostile.agent_root("bob"), "user-files", "proj")
    for target in (hostile.host, bob_proj, "../../bob/user-files/proj"):
        status, body = call("POST", "/v1/agents/dave/commands", {"argv": [
            "/bin/sh", "-c", f"rm -f user-files/proj; [ -d user-files/proj.orig ] || mv user-files/proj user-files/proj.orig;"
                             f" ln -s {target} user-files/proj"]}, label=f"swap from for a link to {target}")
        assert status == 200 and json.loads(body)["exit_code"] == 0, body
        call("POST", f"/v1/agents/dave/jobs/{job_id}/apply", {}, label=f"job apply with from a link to {target}")
    call("POST", "/v1/agents/dave/commands", {"argv": ["/bin/sh", "-c", "rm user-files/proj && mv user-files/proj.orig "
                                                                         "user-files/proj"]}, label="from restored")
    status, body = call("POST", f"/v1/agents/dave/jobs/{job_id}/apply", {}, label="job apply with from restored")
    call.judge("job apply")
    assert status == 200, body  # the same job applies where it belongs
    with open(os.path.join(hostile.agent_root("dave"), "user-files", "proj", "a.txt")) as f:
        assert f.read() == PAYLOAD + "\n"


def test_top_level_folders_swapped(hostile):
    """dave swaps his sessions/ and jobs/ folders for links to a host folder, then asks for kernels and jobs."""
    call = Calls(hostile, "control")
    for name, target in (("sessions", hostile.host), ("jobs", os.path.join(hostile.agent_root("bob"), "user-files"))):
        status, body = call("POST", "/v1/agents/dave/commands", {"argv": [
            "/bin/sh", "-c", f"mv {name} {name}.orig && ln -s {target} {name}"]}, label=f"swap {name}/ for a link")
        assert status == 200 and json.loads(body)["exit_code"] == 0, body
    call("POST", "/v1/agents/dave/sessions", {"session": f"{MARK}-s"}, label="session create")
    call("POST", f"/v1/agents/dave/sessions/{MARK}-e/execute", {"code": "1", "timeout": 30}, label="execute")
    call("POST", "/v1/agents/dave/commands", {"argv": ["/bin/true"], "session": f"{MARK}-c"}, label="command in a session")
    call("POST", "/agents/dave/api/kernels", {"name": "python3"}, label="jupyter kernel")
    call("POST", "/agents/dave/api/sessions", {"path": f"{MARK}.ipynb", "type": "notebook", "name": "n",
                                                "kernel": {"name": "python3"}}, label="jupyter session")
    status, body = call("POST", "/v1/agents/dave/jobs", {"kind": "command", "from": "user-files/proj",
                                                          "argv": ["/bin/sh", "-c", f"echo {PAYLOAD} > {MARK}.txt"]},
                        label="job with jobs/ a link to bob's files")
    if status == 201:
        job_id = json.loads(body)["id"]
        wait_until(lambda: json.loads(call("GET", f"/v1/agents/dave/jobs/{job_id}", label="job")[1])["state"]
                   not in ("queued", "running"), 60, 0.5)
        call("DELETE", f"/v1/agents/dave/jobs/{job_id}", label="job delete")
    call("PUT", "/v1/agents/dave", label="agent PUT over the swapped folders")
    for session in (f"{MARK}-s", f"{MARK}-e"):
        call("DELETE", f"/v1/agents/dave/sessions/{session}", label="session delete")
    call.judge("top-level folders swapped")
