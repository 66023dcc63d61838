"""The performance suite: the gateway measured against its own bare baselines.

Starts its own gateways in a temp directory, measures each metric together
with the baseline it is judged against (in the same run, because these
machines are noisy), prints progress to stderr and one JSON object on the
last line of stdout, whose "targets" say which targets were met.

    python -m benchmarks [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from kernel_gateway.client import UnixHTTPConnection

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JLK = os.path.join(REPO, "skills", "jupyter-live-kernel", "scripts", "jlk")
BIN = os.path.dirname(sys.executable)
PYTHON_START_CODE = "import json, socket, http.client"


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile; p in [0, 100]."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, int(round(p / 100 * len(ordered) + 0.5)) - 1))
    return ordered[rank]


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def vm_rss_kb(pid: int, field: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants, from /proc/<pid>/task/*/children."""
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        try:
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except FileNotFoundError:
            pass
    return tree


def tree_rss_kb(pid: int) -> int:
    total = 0
    for member in process_tree(pid):
        try:
            total += vm_rss_kb(member)
        except FileNotFoundError:
            pass
    return total


# --- the socket client ------------------------------------------------------------


class Client:
    """One kept-alive HTTP/1.1 connection to the gateway's control socket."""

    def __init__(self, socket_path: str):
        self.conn = UnixHTTPConnection(socket_path, timeout=300)

    def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        try:
            self.conn.request(method, path, body=data, headers=headers)
            response = self.conn.getresponse()
        except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
            # The server closed the kept-alive connection while it idled: once more on a new one.
            self.conn.close()
            self.conn.request(method, path, body=data, headers=headers)
            response = self.conn.getresponse()
        payload = response.read()
        return response.status, json.loads(payload) if payload else {}

    def ok(self, method: str, path: str, body: dict | None = None) -> dict:
        status, answer = self.call(method, path, body)
        if status >= 300:
            raise RuntimeError(f"{method} {path} -> {status}: {answer}")
        return answer

    def close(self) -> None:
        self.conn.close()


class Gateway:
    """``kernel-gateway serve`` in its own directory, as an operator would run it."""

    def __init__(self, base: str, name: str, *args: str):
        self.dir = os.path.join(base, name)
        os.makedirs(self.dir)
        self.state = os.path.join(self.dir, "state")
        self.socket = os.path.join(self.state, "control.sock")
        cmd = [os.path.join(BIN, "kernel-gateway"), "serve", "--root", os.path.join(self.dir, "agents"),
               "--state-dir", self.state, *args]
        self.log_path = os.path.join(self.dir, "gateway.log")
        self.proc = subprocess.Popen(cmd, stdout=open(self.log_path, "ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway did not start: {open(self.log_path).read()}")
            try:
                probe = Client(self.socket)
                probe.ok("GET", "/v1/info")
                probe.close()
                break
            except OSError:
                time.sleep(0.05)
        self.client = Client(self.socket)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def agent(self, agent: str) -> None:
        self.client.ok("PUT", f"/v1/agents/{agent}", {})

    def session(self, agent: str, session: str) -> dict:
        return self.client.ok("POST", f"/v1/agents/{agent}/sessions", {"session": session})

    def delete_session(self, agent: str, session: str) -> None:
        self.client.ok("DELETE", f"/v1/agents/{agent}/sessions/{session}")

    def execute(self, agent: str, session: str, code: str, client: Client | None = None) -> dict:
        answer = (client or self.client).ok("POST", f"/v1/agents/{agent}/sessions/{session}/execute", {"code": code})
        if answer.get("status") != "ok":
            raise RuntimeError(f"execute failed: {answer}")
        return answer

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# --- bare jupyter_client baselines ------------------------------------------------------


async def bare_kernel_start() -> tuple[float, object, object]:
    """Start python3 with AsyncKernelManager, no sandbox; seconds to wait_for_ready.

    ZMQ over ipc, as the gateway's kernels use, so the comparison is of the gateway alone.
    """
    from jupyter_client import AsyncKernelManager

    started = time.perf_counter()
    km = AsyncKernelManager(kernel_name="python3", transport="ipc", ip=tempfile.mktemp(prefix="kg-bench-ipc-"))
    await km.start_kernel(stderr=subprocess.DEVNULL)
    kc = km.client()
    kc.start_channels()
    await kc.wait_for_ready(timeout=60)
    return time.perf_counter() - started, km, kc


async def bare_stop(km, kc) -> None:
    kc.stop_channels()
    await km.shutdown_kernel(now=True)


async def bare_execute_once(kc) -> float:
    """`x = 1`: send execute, wait for its shell reply and its iopub idle."""
    started = time.perf_counter()
    msg_id = kc.execute("x = 1")
    reply = await kc.get_shell_msg(timeout=30)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = await kc.get_shell_msg(timeout=30)
    while True:
        msg = await kc.get_iopub_msg(timeout=30)
        if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle"):
            return time.perf_counter() - started


# --- the suite ------------------------------------------------------------------------


def timed_runs(argv: list[str], repetitions: int, env: dict | None = None) -> list[float]:
    samples = []
    for _ in range(repetitions):
        started = time.perf_counter()
        done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        samples.append(time.perf_counter() - started)
        if done.returncode != 0:
            raise RuntimeError(f"{argv} exited {done.returncode}: {done.stderr.decode()[-500:]}")
    return samples


def measure_starts(base: str, n: int, results: dict) -> None:
    """Bare kernel start and cold session start, interleaved so noise hits both alike."""
    log(f"cold start: gateway with spare kernels off, {n} bare / cold pairs")
    cold_gateway = Gateway(base, "cold", "--Gateway.spare_kernels=False")
    bare, cold = [], []
    try:
        # One throwaway pair: first imports and page cache.
        asyncio.run(_bare_once())
        cold_gateway.agent("warmup")
        cold_gateway.session("warmup", "s")
        cold_gateway.delete_session("warmup", "s")
        for i in range(n):
            bare.append(asyncio.run(_bare_once()))
            agent = f"cold{i}"
            cold_gateway.agent(agent)
            started = time.perf_counter()
            cold_gateway.session(agent, "s")
            cold.append(time.perf_counter() - started)
            cold_gateway.delete_session(agent, "s")
            log(f"  bare {ms(bare[-1])} ms, cold session {ms(cold[-1])} ms")
    finally:
        cold_gateway.stop()
    results["bare_kernel_start_ms"] = ms(statistics.median(bare))
    results["session_start_cold_ms"] = ms(statistics.median(cold))
    results["cold_start_vs_bare"] = round(statistics.median(cold) / statistics.median(bare), 3)


async def _bare_once() -> float:
    seconds, km, kc = await bare_kernel_start()
    await bare_stop(km, kc)
    return seconds


def measure_spare_start(gw: Gateway, n: int, results: dict) -> None:
    log(f"spare start: {n} sessions, each after its spare had 3 s to get ready")
    gw.agent("spare")
    gw.session("spare", "first")
    previous = "first"
    samples = []
    for i in range(n):
        time.sleep(3)
        started = time.perf_counter()
        gw.session("spare", f"s{i}")
        samples.append(time.perf_counter() - started)
        gw.delete_session("spare", previous)
        previous = f"s{i}"
        log(f"  spare session {ms(samples[-1])} ms")
    gw.delete_session("spare", previous)
    results["session_start_spare_ms"] = {"p50": ms(percentile(samples, 50)), "max": ms(max(samples)), "n": n}


def measure_execute(gw: Gateway, n: int, results: dict) -> None:
    log(f"execute round trip: {n} x `x = 1`, bare jupyter_client and through the socket, interleaved")
    gw.agent("rtt")
    gw.session("rtt", "s")

    def via_gateway() -> float:
        started = time.perf_counter()
        gw.execute("rtt", "s", "x = 1")
        return time.perf_counter() - started

    async def both() -> tuple[list[float], list[float]]:
        _, km, kc = await bare_kernel_start()
        bare, via = [], []
        try:
            for i in range(n + 10):  # the first 10 of each are warm-up
                bare.append(await bare_execute_once(kc))
                via.append(via_gateway())  # blocks this loop, while the bare kernel idles
            return bare[10:], via[10:]
        finally:
            await bare_stop(km, kc)

    bare, via = asyncio.run(both())
    results["bare_execute_rtt_ms"] = {"p50": ms(percentile(bare, 50)), "p99": ms(percentile(bare, 99))}
    results["execute_rtt_ms"] = {"p50": ms(percentile(via, 50)), "p99": ms(percentile(via, 99)), "n": n}


def measure_cpu_fairness(gw: Gateway, n: int, results: dict, rounds: int = 3) -> None:
    """Another agent's execute round trip while one agent keeps 4 sessions busy (cgroup CPU weights).

    Idle and loaded phases alternate (``rounds`` of each), so a change in the
    machine's own load during the run lands on both sides.
    """
    log(f"cpu fairness: {n} x `x = 1` for agent 'calm', idle and while agent 'hog' spins in 4 sessions")
    gw.agent("calm")
    gw.agent("hog")
    gw.session("calm", "s")
    for i in range(4):
        gw.session("hog", f"busy{i}")

    def rtt_samples(count: int) -> list[float]:
        samples = []
        for _ in range(count):
            started = time.perf_counter()
            gw.execute("calm", "s", "x = 1")
            samples.append(time.perf_counter() - started)
        return samples

    for _ in range(10):  # warm-up
        gw.execute("calm", "s", "x = 1")
    per_round = max(1, n // rounds)
    idle, loaded = [], []
    for _ in range(rounds):
        idle += rtt_samples(per_round)
        spin_seconds = 1.5 + per_round * 0.05
        busy_code = f"import time\nt = time.time()\nwhile time.time() - t < {spin_seconds}: pass"
        hogs = [threading.Thread(target=lambda i=i: gw.execute("hog", f"busy{i}", busy_code, client=Client(gw.socket)))
                for i in range(4)]  # fmt: skip
        for hog in hogs:
            hog.start()
        time.sleep(0.5)  # let all four spin
        loaded += rtt_samples(per_round)
        for hog in hogs:
            hog.join()
    idle_p50, loaded_p50 = percentile(idle, 50), percentile(loaded, 50)
    results["cpu_fairness"] = {
        "idle_rtt_p50_ms": ms(idle_p50),
        "rtt_p50_ms_with_4_busy_sessions_of_another_agent": ms(loaded_p50),
        "ratio": round(loaded_p50 / idle_p50, 2),
        "n": len(loaded),
    }


def measure_jupyter(gw: Gateway, n_rtt: int, n_start: int, results: dict) -> None:
    """`x = 1` over our kernel websocket (v1 protocol) beside bare jupyter_client; POST /api/kernels with a spare."""
    from jupyter_client.session import Session
    from jupyter_server.services.kernels.connection.base import deserialize_msg_from_ws_v1, serialize_msg_to_ws_v1
    from tornado import httpclient, websocket

    log(f"jupyter websocket round trip: {n_rtt} x `x = 1`, bare jupyter_client and over /api/kernels/{{id}}/channels")
    gw.agent("jupyter")
    token = gw.client.ok("POST", "/v1/agents/jupyter/tokens", {})
    base, auth = token["url"], {"Authorization": f"token {token['token']}"}

    def api(method: str, path: str, body: dict | None = None) -> dict:
        parsed = http.client.urlsplit(base)
        conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=120)
        conn.request(method, parsed.path + path, body=None if body is None else json.dumps(body), headers=auth)
        response = conn.getresponse()
        payload = response.read()
        conn.close()
        if response.status >= 300:
            raise RuntimeError(f"{method} {path}: {response.status} {payload[:300]!r}")
        return json.loads(payload) if payload else {}

    kernel = api("POST", "api/kernels", {})

    async def ws_once(ws, session) -> float:
        started = time.perf_counter()
        msg = session.msg("execute_request", {"code": "x = 1", "silent": False, "store_history": True,
                                              "user_expressions": {}, "allow_stdin": False})
        ws.write_message(serialize_msg_to_ws_v1(msg, "shell", session.pack), binary=True)
        replied = idle = False
        while not (replied and idle):
            channel, parts = deserialize_msg_from_ws_v1(await ws.read_message())
            if json.loads(parts[1]).get("msg_id") != msg["header"]["msg_id"]:
                continue
            header = json.loads(parts[0])
            replied = replied or (channel == "shell" and header["msg_type"] == "execute_reply")
            idle = idle or (header["msg_type"] == "status" and json.loads(parts[3])["execution_state"] == "idle")
        return time.perf_counter() - started

    async def both() -> tuple[list[float], list[float]]:
        _, km, kc = await bare_kernel_start()
        url = base.replace("http://", "ws://") + f"api/kernels/{kernel['id']}/channels?session_id=bench"
        ws = await websocket.websocket_connect(httpclient.HTTPRequest(url, headers=auth),
                                               subprotocols=["v1.kernel.websocket.jupyter.org"])
        ws.protocol.set_nodelay(True)  # as browsers do
        session = Session(session="bench", key=b"")
        bare, via = [], []
        try:
            for _ in range(n_rtt + 10):  # the first 10 of each are warm-up
                bare.append(await bare_execute_once(kc))
                via.append(await ws_once(ws, session))
            return bare[10:], via[10:]
        finally:
            ws.close()
            await bare_stop(km, kc)

    bare, via = asyncio.run(both())
    results["ws_bare_execute_rtt_ms"] = {"p50": ms(percentile(bare, 50)), "p99": ms(percentile(bare, 99))}
    results["ws_execute_rtt_ms"] = {"p50": ms(percentile(via, 50)), "p99": ms(percentile(via, 99)), "n": n_rtt}
    api("DELETE", f"api/kernels/{kernel['id']}")

    log(f"jupyter kernel start: {n_start} x POST /api/kernels, each after its spare had 3 s to get ready")
    samples, started_ids = [], []
    for _ in range(n_start):
        time.sleep(3)
        started = time.perf_counter()
        model = api("POST", "api/kernels", {})
        samples.append(time.perf_counter() - started)
        if model["execution_state"] != "idle":
            raise RuntimeError(f"POST /api/kernels answered {model['execution_state']!r}, not idle")
        for kid in started_ids:
            api("DELETE", f"api/kernels/{kid}")
        started_ids = [model["id"]]
        log(f"  jupyter kernel start {ms(samples[-1])} ms")
    for kid in started_ids:
        api("DELETE", f"api/kernels/{kid}")
    results["jupyter_kernel_start_ms"] = {"p50": ms(percentile(samples, 50)), "max": ms(max(samples)), "n": n_start}


def measure_cli(gw: Gateway, n: int, results: dict) -> None:
    log(f"CLI: {n} x `jlk execute` and {n} x bare python start")
    # jlk is run by the same interpreter as the baseline (python3 on PATH may be a slow shim).
    jlk_argv = [sys.executable, JLK, "--socket", gw.socket, "--agent", "rtt", "--session", "s",
                "execute", "--code", "x = 1"]
    python_argv = [sys.executable, "-I", "-c", PYTHON_START_CODE]
    isolated_argv = [sys.executable, "-I", *jlk_argv[1:]]
    timed_runs(jlk_argv, 3)  # warm-up
    python_start, cli, cli_isolated = [], [], []
    for _ in range(n):
        python_start += timed_runs(python_argv, 1)
        cli += timed_runs(jlk_argv, 1)
        cli_isolated += timed_runs(isolated_argv, 1)
    results["python_start_ms"] = ms(percentile(python_start, 50))
    results["cli_execute_ms"] = ms(percentile(cli, 50))
    results["cli_execute_isolated_ms"] = ms(percentile(cli_isolated, 50))
    results["cli_vs_python_start"] = round(percentile(cli, 50) / percentile(python_start, 50), 3)


def measure_throughput(gw: Gateway, seconds: float, results: dict) -> None:
    log(f"throughput: 10 sessions executing `x = 1` concurrently for {seconds} s")
    gw.agent("tp")
    sessions = [f"t{i}" for i in range(10)]
    for s in sessions:
        gw.session("tp", s)
    counts = [0] * len(sessions)
    errors: list[BaseException] = []
    start_line = threading.Barrier(len(sessions) + 1)
    deadline = [0.0]

    def worker(index: int) -> None:
        client = Client(gw.socket)
        try:
            gw.execute("tp", sessions[index], "x = 1", client)
            start_line.wait()
            while time.perf_counter() < deadline[0]:
                gw.execute("tp", sessions[index], "x = 1", client)
                counts[index] += 1
        except BaseException as e:  # reported below, not lost in the thread
            errors.append(e)
        finally:
            client.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(sessions))]
    for t in threads:
        t.start()
    deadline[0] = time.perf_counter() + 3600
    start_line.wait()
    began = time.perf_counter()
    deadline[0] = began + seconds
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - began
    if errors:
        raise errors[0]
    results["throughput_exec_per_s"] = round(sum(counts) / elapsed, 1)
    for s in sessions:
        gw.delete_session("tp", s)


def measure_command(gw: Gateway, n: int, results: dict) -> None:
    log(f"command overhead: {n} x /bin/true through the socket and bare")
    gw.agent("cmd")
    bare, via, inside, profile_only = [], [], [], []
    profile_only_run = command_profile_runner(["/bin/true"])
    for i in range(n + 5):  # interleaved; the first 5 of each are warm-up
        started = time.perf_counter()
        subprocess.run(["/bin/true"])
        bare.append(time.perf_counter() - started)
        started = time.perf_counter()
        profile_only_run()
        profile_only.append(time.perf_counter() - started)
        started = time.perf_counter()
        answer = gw.client.ok("POST", "/v1/agents/cmd/commands", {"argv": ["/bin/true"]})
        via.append(time.perf_counter() - started)
        if answer.get("exit_code") != 0:
            raise RuntimeError(f"/bin/true failed in the command sandbox: {answer}")
        inside.append(answer["duration_ms"] / 1000)
    bare, via, inside, profile_only = bare[5:], via[5:], inside[5:], profile_only[5:]
    results["bare_true_ms"] = ms(percentile(bare, 50))
    # The command profile's bwrap alone (run by this process, no gateway): the floor of a command.
    results["command_profile_bwrap_ms"] = ms(percentile(profile_only, 50))
    results["command_true_ms"] = ms(percentile(via, 50))
    # The gateway's own duration_ms: spawn of bwrap to its exit, so the rest is HTTP, prepare and cleanup.
    results["command_sandbox_run_ms"] = ms(percentile(inside, 50))
    results["command_overhead_ms"] = ms(percentile(via, 50) - percentile(bare, 50))
    results["command_start"] = gw.client.ok("GET", "/v1/info")["sandbox"]["command_start"]


def measure_command_cold(base: str, n: int, results: dict) -> None:
    """The same /bin/true with no spare sandboxes: every command sets its own up (for comparison)."""
    log(f"command overhead without spare sandboxes: {n} x /bin/true")
    gw = Gateway(base, "cold-commands", "--Gateway.spare_commands=False")
    try:
        gw.agent("cmd")
        bare, via = [], []
        for i in range(n + 5):
            started = time.perf_counter()
            subprocess.run(["/bin/true"])
            bare.append(time.perf_counter() - started)
            started = time.perf_counter()
            gw.client.ok("POST", "/v1/agents/cmd/commands", {"argv": ["/bin/true"]})
            via.append(time.perf_counter() - started)
        bare, via = bare[5:], via[5:]
        results["command_true_cold_ms"] = ms(percentile(via, 50))
        results["command_overhead_cold_ms"] = ms(percentile(via, 50) - percentile(bare, 50))
    finally:
        gw.stop()


def measure_jobs(gw: Gateway, base: str, n: int, results: dict) -> None:
    """A background job of /bin/true on 20 small files, submit to ended, against the same steps bare."""
    log(f"job overhead: {n} x a /bin/true job, through the socket and bare (cp, true, diff)")
    gw.agent("jobs")
    source = os.path.join(gw.dir, "agents", "jobs", "user-files", "src")
    os.makedirs(source)
    for i in range(20):
        with open(os.path.join(source, f"f{i}.txt"), "w") as f:
            f.write("line\n" * 100)
    bare, via = [], []
    for i in range(n + 2):  # interleaved; the first 2 of each are warm-up
        work = os.path.join(base, f"bare-job-{i}")
        started = time.perf_counter()
        os.makedirs(work)
        subprocess.run(["cp", "-a", source, os.path.join(work, "tree")])
        subprocess.run(["cp", "-a", source, os.path.join(work, "base")])
        subprocess.run(["/bin/true"])
        with open(os.path.join(work, "change.patch"), "wb") as out:
            subprocess.run(["diff", "-ruN", "base", "tree"], cwd=work, stdout=out)
        bare.append(time.perf_counter() - started)
        started = time.perf_counter()
        job = gw.client.ok("POST", "/v1/agents/jobs/jobs", {"kind": "command", "from": "user-files/src", "argv": ["/bin/true"]})
        job = gw.client.ok("GET", f"/v1/agents/jobs/jobs/{job['id']}?wait=1")
        via.append(time.perf_counter() - started)
        if job["state"] != "succeeded":
            raise RuntimeError(f"the benchmark job failed: {job}")
    bare, via = bare[2:], via[2:]
    results["bare_job_steps_ms"] = ms(percentile(bare, 50))
    results["job_true_ms"] = ms(percentile(via, 50))
    results["job_overhead_ms"] = ms(percentile(via, 50) - percentile(bare, 50))


def command_profile_runner(command: list[str]):
    """A function running bwrap with the shipped command profile over a scratch tree, as the gateway compiles it."""
    from kernel_gateway.provisioner import python_env_paths
    from kernel_gateway.sandbox import launch, seccomp
    from kernel_gateway.sandbox.profile import compile_profile, load_profile

    prefix, base = python_env_paths(sys.executable)
    tree = tempfile.mkdtemp(prefix="kg-bench-profile-")
    values = {"agent": "bench", "agent_root": tree, "workspace": tree, "python_prefix": prefix,
              "python_base_prefix": base, "python_bin": os.path.join(prefix, "bin")}
    profile = load_profile("command")
    # Created files become empty ones here: no data fds to hand over.
    profile = {**profile, "sandbox": {**profile["sandbox"], "created_files": []}}

    def run() -> None:
        filter_fd = seccomp.filter_fd(profile["sandbox"].get("nested_userns", False))  # read once by bwrap
        try:
            compiled = compile_profile(profile, values, bwrap=launch.find_bwrap(), seccomp_fd=filter_fd)
            argv = compiled.argv[:-1] + launch.env_argv(compiled.env) + ["--"] + command
            subprocess.run(argv, check=True, pass_fds=(filter_fd,), env=launch.HOST_ENV)
        finally:
            os.close(filter_fd)

    return run


def measure_memory(base: str, idle: int, results: dict) -> None:
    log(f"memory: gateway RSS over {idle} idle sessions, one kernel's RSS, a 100 MB cell")
    gw = Gateway(base, "memory", "--Gateway.spare_kernels=False", f"--Gateway.max_sessions_per_agent={idle + 2}")
    try:
        gw.agent("mem")
        # Warm the code paths (imports, first kernel) before the baseline.
        gw.session("mem", "warm")
        gw.execute("mem", "warm", "x = 1")
        before = vm_rss_kb(gw.pid)
        for i in range(idle):
            gw.session("mem", f"idle{i}")
        time.sleep(1)
        after = vm_rss_kb(gw.pid)
        results["gateway_rss_kb_per_idle_session"] = round((after - before) / idle, 1)
        kernel_pid = gw.client.ok("GET", "/v1/agents/mem/sessions/idle0")["pid"]
        results["kernel_rss_kb"] = tree_rss_kb(kernel_pid)
        for i in range(idle):
            gw.delete_session("mem", f"idle{i}")

        before = vm_rss_kb(gw.pid)
        peak_before = vm_rss_kb(gw.pid, "VmHWM")
        started = time.perf_counter()
        gw.execute("mem", "warm", "print('x' * 100_000_000)")
        elapsed = time.perf_counter() - started
        after = vm_rss_kb(gw.pid)
        peak_after = vm_rss_kb(gw.pid, "VmHWM")
        results["gateway_rss_growth_mb_100mb_output"] = round((after - before) / 1024, 1)
        results["gateway_peak_rss_growth_mb_100mb_output"] = round(max(0, peak_after - peak_before) / 1024, 1)
        results["execute_100mb_output_ms"] = ms(elapsed)
    finally:
        gw.stop()


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


FLOOD_CODE = r"""
import os, resource, socket
resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
FLOOD = []
for _ in range({n}):
    s = socket.socket(socket.AF_UNIX); s.connect(os.environ["KERNEL_GATEWAY_SOCKET"]); FLOOD.append(s)
"""

FIFO_CODE = r"""
import os
from IPython.display import publish_display_data
out = os.path.join(os.environ["HOME"], "outputs"); os.makedirs(out, exist_ok=True)
fifo = os.path.join(out, "pipe.png")
if not os.path.exists(fifo): os.mkfifo(fifo)
for _ in range(20):
    publish_display_data({"application/vnd.kernel-gateway.artifact+json": {"mime": "image/png", "path": fifo}})
"""


def measure_starvation(base: str, n: int, results: dict) -> None:
    """Another agent's execute and the control socket while one agent floods its socket or names FIFOs."""
    log(f"starvation: victim execute round trip idle, while a kernel holds 3000 connections, and among FIFO artifacts")
    gw = Gateway(base, "starve")
    try:
        for agent in ("victim", "flood"):
            gw.agent(agent)
            gw.session(agent, "s")

        def rtts(agent: str = "victim") -> list[float]:
            samples = []
            for _ in range(n):
                started = time.perf_counter()
                gw.execute(agent, "s", "x = 1")
                samples.append(time.perf_counter() - started)
            return samples

        def info_rtts() -> list[float]:
            samples = []
            for _ in range(n):
                started = time.perf_counter()
                gw.client.ok("GET", "/v1/info")
                samples.append(time.perf_counter() - started)
            return samples

        idle = rtts()
        gw.execute("flood", "s", FLOOD_CODE.format(n=3000))
        log_before, cpu_before, wall_before = os.path.getsize(gw.log_path), cpu_seconds(gw.pid), time.monotonic()
        flooded, info = rtts(), info_rtts()
        cpu_pct = 100 * (cpu_seconds(gw.pid) - cpu_before) / (time.monotonic() - wall_before)
        log_bytes = os.path.getsize(gw.log_path) - log_before
        gw.execute("flood", "s", "for s in FLOOD: s.close()")
        stop = threading.Event()
        flooder = Client(gw.socket)

        def fifo_loop() -> None:
            while not stop.is_set():
                flooder.ok("POST", "/v1/agents/flood/sessions/s/execute", {"code": FIFO_CODE, "inline_images": True})

        worker = threading.Thread(target=fifo_loop)
        worker.start()
        try:
            fifo = rtts()
        finally:
            stop.set()
            worker.join(120)
            flooder.close()
        before = vm_rss_kb(gw.pid)
        rich = gw.client.ok("POST", "/v1/agents/victim/sessions/s/execute", {
            "code": "from IPython.display import display\nfor i in range(1000): display({'text/plain': 'x' * 40000}, raw=True)"})
        results["starvation"] = {
            "victim_execute_rtt_idle_p50_ms": ms(percentile(idle, 50)),
            "victim_execute_rtt_socket_flooded_p50_ms": ms(percentile(flooded, 50)),
            "control_info_rtt_socket_flooded_p50_ms": ms(percentile(info, 50)),
            "gateway_cpu_percent_socket_flooded": round(cpu_pct, 1),
            "gateway_log_bytes_socket_flooded": log_bytes,
            "victim_execute_rtt_fifo_artifacts_p50_ms": ms(percentile(fifo, 50)),
            "rich_1000x40kb_response_bytes": len(json.dumps(rich)),
            "rich_1000x40kb_gateway_growth_mb": round((vm_rss_kb(gw.pid) - before) / 1024, 1),
            "n": n,
        }
    finally:
        gw.stop()


def targets(r: dict) -> dict:
    def target(value: float, op: str, limit: float, text: str) -> dict:
        met = value <= limit if op == "<=" else value < limit
        return {"value": value, "target": text, "met": met}

    bare_rtt = r["bare_execute_rtt_ms"]["p50"]
    return {
        "cold_start_vs_bare": target(r["cold_start_vs_bare"], "<=", 1.25, "<= 1.25"),
        "session_start_spare_p50_ms": target(r["session_start_spare_ms"]["p50"], "<", 100, "< 100"),
        "execute_rtt_p50_ms": target(r["execute_rtt_ms"]["p50"], "<=", bare_rtt + 2,
                                     f"<= bare + 2 = {round(bare_rtt + 2, 3)}"),
        "gateway_kb_per_idle_session": target(r["gateway_rss_kb_per_idle_session"], "<=", 2048, "<= 2048"),
        "gateway_growth_mb_100mb_output": target(r["gateway_rss_growth_mb_100mb_output"], "<=", 64, "<= 64"),
        "command_overhead_p50_ms": target(r["command_overhead_ms"], "<=", 8, "<= 8"),
        "cli_vs_python_start": target(r["cli_vs_python_start"], "<=", 1.3, "<= 1.3"),
        "execute_rtt_with_busy_agent_vs_idle": target(r["cpu_fairness"]["ratio"], "<=", 2, "<= 2"),
        "ws_execute_rtt_p50_ms": target(r["ws_execute_rtt_ms"]["p50"], "<=", r["ws_bare_execute_rtt_ms"]["p50"] + 2,
                                        f"<= bare + 2 = {round(r['ws_bare_execute_rtt_ms']['p50'] + 2, 3)}"),
        "jupyter_kernel_start_p50_ms": target(r["jupyter_kernel_start_ms"]["p50"], "<", 100, "< 100"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run, noisier numbers)")
    args = parser.parse_args(argv)
    quick = args.quick
    n_start, n_spare, n_rtt, n_cli, n_cmd = (3, 3, 50, 10, 20) if quick else (5, 8, 200, 30, 50)
    results: dict = {"quick": quick, "python": sys.version.split()[0], "cpus": os.cpu_count(),
                     "load_average_at_start": os.getloadavg()[0]}
    base = tempfile.mkdtemp(prefix="kg-bench-")
    began = time.perf_counter()
    try:
        measure_starts(base, n_start, results)
        gw = Gateway(base, "main", "--jupyter-port", "0")
        try:
            measure_execute(gw, n_rtt, results)
            measure_jupyter(gw, n_rtt, n_spare, results)
            measure_cli(gw, n_cli, results)
            measure_command(gw, n_cmd, results)
            measure_jobs(gw, base, 5 if quick else 10, results)
            measure_throughput(gw, 2.0 if quick else 4.0, results)
            measure_spare_start(gw, n_spare, results)
            measure_cpu_fairness(gw, n_rtt // 4, results)
        finally:
            gw.stop()
        measure_command_cold(base, n_cmd, results)
        measure_memory(base, 20, results)
        measure_starvation(base, 20 if quick else 50, results)
        from .fairness import measure_pool_fairness  # it builds on this module

        measure_pool_fairness(base, 20 if quick else 50, results)
    except BaseException:
        # What the gateways said is the first thing needed to understand a failed run.
        for name in sorted(os.listdir(base)):
            path = os.path.join(base, name, "gateway.log")
            if os.path.exists(path):
                log(f"gateway {name!r} log tail:\n" + open(path, errors="replace").read()[-3000:])
        raise
    finally:
        shutil.rmtree(base, ignore_errors=True)
    results["targets"] = targets(results)
    results["all_met"] = all(t["met"] for t in results["targets"].values())
    results["duration_s"] = round(time.perf_counter() - began, 1)
    results["load_average_at_end"] = os.getloadavg()[0]
    log(f"done in {results['duration_s']} s")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
