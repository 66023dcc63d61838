"""Per-agent fairness of the shared pools: another agent's execute while one agent floods each pool in turn.

For each pool, agent ``victim``'s execute round trip (``x = 1``) is measured
idle, then while agent ``flood`` holds its whole share of that pool and keeps
asking for more from several processes; the figure is the ratio of the two
medians (1.0: the flood costs the victim nothing).  The idle samples are taken
just before each flood, so a change in the machine's own load lands on both.

The pools: connections on the flood agent's socket (held from its kernel) and
on the Jupyter TCP port (idle connections without a token), kernel websockets,
the job queue (many jobs, then jobs with a 15 MB ``env``), Jupyter sessions,
and the contents workers (listings of a folder of 20,000 files); for the last
the victim's own contents listing is measured too, since it needs a worker.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import multiprocessing
import os
import resource
import socket
import threading
import time
import uuid
from typing import Callable, Iterator

from .run import FLOOD_CODE, Client, Gateway, log, ms, percentile

PRESSERS = 4  # processes that keep asking past the share during a flood


class Pressure:
    """Processes that repeat ``attempt`` until stopped, counting what each attempt got.

    Processes, not threads: the flood must not share this process's GIL with the round trips measured.
    """

    def __init__(self, attempt: Callable[[], str], workers: int = PRESSERS):
        self.attempt, self.outcomes = attempt, {}
        context = multiprocessing.get_context("fork")
        self._stop = context.Event()
        self._results = context.Queue()
        self._procs = [context.Process(target=self._loop, daemon=True) for _ in range(workers)]

    def _loop(self) -> None:
        outcomes: dict[str, int] = {}
        while not self._stop.is_set():
            try:
                outcome = self.attempt()
            except OSError as e:
                outcome = type(e).__name__
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        self._results.put(outcomes)

    def __enter__(self) -> "Pressure":
        for p in self._procs:
            p.start()
        time.sleep(0.5)  # let them get going
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for _ in self._procs:
            for outcome, count in self._results.get(timeout=120).items():
                self.outcomes[outcome] = self.outcomes.get(outcome, 0) + count
        for p in self._procs:
            p.join(30)


def http_status(sock: socket.socket, request: bytes) -> str:
    """Send ``request`` on ``sock``, return the status code of the answer ('closed' if none)."""
    sock.sendall(request)
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return "closed"
        data += chunk
    return data.split(b" ", 2)[1].decode()


class Fairness:
    def __init__(self, base: str, n: int):
        self.n = n
        self.gw = Gateway(base, "fair", "--jupyter-port", "0")
        gw = self.gw
        for agent in ("victim", "flood"):
            gw.agent(agent)
            gw.session(agent, "s")
        self.root = os.path.join(gw.dir, "agents")
        token = gw.client.ok("POST", "/v1/agents/flood/tokens", {})
        self.token, url = token["token"], token["url"]
        parsed = http.client.urlsplit(url)
        self.host, self.port, self.prefix = parsed.hostname, parsed.port, parsed.path
        self.victim_client = Client(gw.socket)

    # --- what is measured ------------------------------------------------------------------

    def execute_rtts(self) -> list[float]:
        samples = []
        for _ in range(self.n):
            started = time.perf_counter()
            self.gw.execute("victim", "s", "x = 1", client=self.victim_client)
            samples.append(time.perf_counter() - started)
        return samples

    def listing_rtts(self) -> list[float]:
        samples = []
        for _ in range(self.n):
            started = time.perf_counter()
            self.victim_client.ok("GET", "/agents/victim/api/contents/user-files?content=1")
            samples.append(time.perf_counter() - started)
        return samples

    # --- the flood agent's requests ----------------------------------------------------------

    def tcp_request(self, method: str, path: str, body: dict | bytes | None = None) -> str:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
        try:
            data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
            conn.request(method, self.prefix + path, body=data, headers={"Authorization": f"token {self.token}"})
            response = conn.getresponse()
            response.read()
            return str(response.status)
        finally:
            conn.close()

    def control(self, method: str, path: str, body: dict | bytes | None = None) -> str:
        client = Client(self.gw.socket)
        try:
            data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
            client.conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            response = client.conn.getresponse()
            response.read()
            return str(response.status)
        finally:
            client.close()

    def owned_dir(self, agent: str, rel: str) -> str:
        path = os.path.join(self.root, agent, rel)
        os.makedirs(path, exist_ok=True)
        owner = os.stat(os.path.join(self.root, agent))
        for where in (os.path.dirname(path), path):
            os.chown(where, owner.st_uid, owner.st_gid)
        return path

    # --- the floods ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def agent_socket_connections(self) -> Iterator[Pressure]:
        self.gw.execute("flood", "s", FLOOD_CODE.format(n=3000))
        path = os.path.join(self.gw.state, "agents", "flood.sock")

        def attempt() -> str:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(path)
                return http_status(s, b"GET /v1/agents/me HTTP/1.0\r\n\r\n")

        try:
            with Pressure(attempt) as pressure:
                yield pressure
        finally:
            self.gw.execute("flood", "s", "for s in FLOOD: s.close()\nFLOOD.clear()")

    @contextlib.contextmanager
    def tcp_connections(self) -> Iterator[Pressure]:
        held: list[socket.socket] = []
        lock = threading.Lock()

        def attempt() -> str:  # a new idle connection; the flood keeps 2,000 of its newest
            s = socket.create_connection((self.host, self.port), timeout=30)
            with lock:
                held.append(s)
                if len(held) > 2000:
                    held.pop(0).close()
            return "held"

        try:
            for _ in range(2000):
                attempt()
            with Pressure(attempt) as pressure:
                yield pressure
        finally:
            for s in held:
                s.close()

    @contextlib.contextmanager
    def websockets(self) -> Iterator[Pressure]:
        kid = json.loads(self._get_tcp("api/kernels"))[0]["id"]
        key = base64.b64encode(os.urandom(16)).decode()
        def handshake() -> tuple[socket.socket, str]:
            s = socket.create_connection((self.host, self.port), timeout=60)
            status = http_status(s, (
                f"GET {self.prefix}api/kernels/{kid}/channels?session_id={uuid.uuid4().hex} HTTP/1.1\r\nHost: x\r\n"
                f"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                f"Sec-WebSocket-Version: 13\r\nAuthorization: token {self.token}\r\n\r\n").encode())
            return s, status

        held = []
        try:
            while True:
                s, status = handshake()
                if status != "101":
                    s.close()
                    break
                held.append(s)

            def attempt() -> str:
                s, status = handshake()
                s.close()
                return status

            with Pressure(attempt) as pressure:
                pressure.outcomes["held"] = len(held)
                yield pressure
        finally:
            for s in held:
                s.close()

    def _get_tcp(self, path: str) -> bytes:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
        try:
            conn.request("GET", self.prefix + path, headers={"Authorization": f"token {self.token}"})
            return conn.getresponse().read()
        finally:
            conn.close()

    @contextlib.contextmanager
    def job_queue(self, env_bytes: int = 0) -> Iterator[Pressure]:
        self.owned_dir("flood", "user-files/q")
        body = {"kind": "command", "from": "user-files/q", "command": "sleep 600"}
        submitted = []
        while True:
            client = Client(self.gw.socket)
            status, job = client.call("POST", "/v1/agents/flood/jobs", body)
            client.close()
            if status != 201:
                break
            submitted.append(job["id"])
        big = dict(body, env={"BIG": "x" * env_bytes}) if env_bytes else body
        raw = json.dumps(big).encode()
        try:
            with Pressure(lambda: self.control("POST", "/v1/agents/flood/jobs", raw)) as pressure:
                pressure.outcomes["held"] = len(submitted)
                yield pressure
        finally:
            for job_id in submitted:
                self.control("POST", f"/v1/agents/flood/jobs/{job_id}/cancel")
            for job_id in submitted:
                client = Client(self.gw.socket)
                client.call("GET", f"/v1/agents/flood/jobs/{job_id}?wait=1")
                client.call("DELETE", f"/v1/agents/flood/jobs/{job_id}")
                client.close()

    @contextlib.contextmanager
    def jupyter_sessions(self) -> Iterator[Pressure]:
        kid = json.loads(self._get_tcp("api/kernels"))[0]["id"]
        def attempt() -> str:
            return self.tcp_request("POST", "api/sessions",
                                    {"path": uuid.uuid4().hex, "type": "console", "kernel": {"id": kid}})

        made = 0
        while attempt() == "201":
            made += 1
        try:
            with Pressure(attempt) as pressure:
                pressure.outcomes["held"] = made
                yield pressure
        finally:
            for session in json.loads(self._get_tcp("api/sessions")):
                self.tcp_request("DELETE", f"api/sessions/{session['id']}")

    @contextlib.contextmanager
    def contents_threads(self) -> Iterator[Pressure]:
        with Pressure(lambda: self.tcp_request("GET", "api/contents/user-files/big?content=1"),
                      workers=12) as pressure:
            yield pressure

    def make_big_folder(self) -> None:
        big = self.owned_dir("flood", "user-files/big")
        owner = os.stat(big)
        for i in range(20_000):
            path = os.path.join(big, f"f{i:05d}.txt")
            with open(path, "w") as f:
                f.write("x")
            os.chown(path, owner.st_uid, owner.st_gid)
        victim = self.owned_dir("victim", "user-files")
        with open(os.path.join(victim, "notes.txt"), "w") as f:
            f.write("notes\n")

    def stop(self) -> None:
        self.victim_client.close()
        self.gw.stop()


def measure_pool_fairness(base: str, n: int, results: dict) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the TCP flood is held by this process
    log(f"pool fairness: {n} x `x = 1` for agent 'victim', idle and while agent 'flood' floods each pool in turn")
    fair = Fairness(base, n)
    try:
        fair.make_big_folder()
        for _ in range(10):  # warm-up
            fair.gw.execute("victim", "s", "x = 1")
        floods = [
            ("agent_socket_connections", fair.agent_socket_connections),
            ("tcp_connections", fair.tcp_connections),
            ("websockets", fair.websockets),
            ("job_queue", fair.job_queue),
            ("job_queue_15mb_env", lambda: fair.job_queue(env_bytes=15 << 20)),
            ("jupyter_sessions", fair.jupyter_sessions),
            ("contents_threads", fair.contents_threads),
        ]
        ratios, idle_ms, refused = {}, {}, {}
        for name, flood in floods:
            idle = percentile(fair.execute_rtts(), 50)
            with flood() as pressure:
                flooded = percentile(fair.execute_rtts(), 50)
                if name == "contents_threads":
                    listing_flooded = percentile(fair.listing_rtts(), 50)
            if name == "contents_threads":
                listing_idle = percentile(fair.listing_rtts(), 50)
                ratios["contents_threads_victim_listing"] = round(listing_flooded / listing_idle, 2)
            ratios[name] = round(flooded / idle, 2)
            idle_ms[name] = ms(idle)
            refused[name] = dict(sorted(pressure.outcomes.items()))
            log(f"  {name}: victim execute p50 {ms(idle)} ms idle, {ms(flooded)} ms flooded; flood got {refused[name]}")
        results["pool_fairness"] = {
            "victim_execute_rtt_vs_idle": ratios,
            "victim_execute_rtt_idle_p50_ms": idle_ms,
            "flood_outcomes": refused,
            "n": n,
        }
    finally:
        fair.stop()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
