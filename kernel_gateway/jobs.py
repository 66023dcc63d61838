"""Background Agent Jobs: durable confined work that ends in a verified patch.

A job copies a directory of the agent's tree (``from``) into its own
workspace ``jobs/<id>/`` (``tree/`` to work on, ``base/`` untouched, ``temp/``,
``skills/``), runs one command or one Codex run there in the ``job`` sandbox,
and ends with ``change.patch``: ``diff -ruN base tree``, its SHA-256 and the
files it touches.  ``apply`` brings the patch back into ``from``, all or
nothing, and refuses when a touched file changed there since the copy.

This module is the bookkeeping: requests, records, the state machine, the
queue (one running job per agent, a cap per gateway) and the records on disk
in the state directory, so a restart finds what ran (``lost``) and what waits
(``queued``).  How each step runs in a sandbox is :mod:`job_runner`; the
``codex`` kind's configuration is :mod:`codex_runner`.  No Tornado here.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import re
import secrets
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from . import codex_runner, job_runner, request_env
from .errors import GatewayError, bad_request, conflict, not_found
from .sandbox.profile import ProfileError, _parse_count, load_profile, parse_duration, parse_size
from . import fs
from . import state_files

log = logging.getLogger("kernel_gateway.jobs")

KINDS = ("command", "codex")
STATES = ("queued", "running", "succeeded", "failed", "timed_out", "cancelled", "lost")
ACTIVE = ("queued", "running")
REQUEST_FIELDS = ("kind", "from", "command", "argv", "objective", "limits", "env")
LIMIT_PARSERS = {
    "wall": parse_duration,
    "cpu": parse_duration,
    "processes": _parse_count,
    "file_size": parse_size,
    "memory": parse_size,
}
JOB_ID = re.compile(r"^[0-9a-f]{12}$")
MAX_OBJECTIVE = 64 << 10
MAX_COMMAND = 64 << 10


def check_job_id(job_id: object) -> str:
    if not isinstance(job_id, str) or not JOB_ID.match(job_id):
        raise bad_request(
            f"invalid job id {job_id!r}", "a job id is 12 hex digits, as POST .../jobs returned it",
            code="invalid_job_id",
        )
    return job_id


@dataclass
class Job:
    """One job's record; what the API shows and what the state directory keeps."""

    id: str
    agent: str
    kind: str
    source: str  # ``from``, relative to the agent root
    seq: int
    created: float
    command: list[str] | None = None  # the argv of a command job
    objective: str | None = None
    limits: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)  # kept on the host only; the API shows the names
    state: str = "queued"
    started: float | None = None
    ended: float | None = None
    exit_code: int | None = None
    signal: str | None = None
    stdout_tail: str = ""
    stderr_tail: str = ""
    patch: dict | None = None
    skipped: list = field(default_factory=list)
    error: str | None = None
    applied: float | None = None

    @property
    def workspace(self) -> str:
        return f"jobs/{self.id}"

    def to_json(self, agent_root: str) -> dict:
        return {
            "id": self.id,
            "agent": self.agent,
            "kind": self.kind,
            "state": self.state,
            "from": self.source,
            "command": self.command,
            "objective": self.objective,
            "env": sorted(self.env),
            "limits": self.limits,
            "created": self.created,
            "started": self.started,
            "ended": self.ended,
            "exit_code": self.exit_code,
            "signal": self.signal,
            "stdout_tail": self.stdout_tail,
            "stderr_tail": self.stderr_tail,
            "patch": self.patch,
            "skipped": self.skipped,
            "error": self.error,
            "applied": self.applied,
            "workspace": os.path.join(agent_root, self.workspace),
        }


class JobStore:
    """Job records as JSON files, ``<state>/jobs/<agent>/<id>.json``, written atomically."""

    def __init__(self, state_dir: str):
        self.dir = os.path.join(state_dir, "jobs")

    def save(self, job: Job) -> None:
        folder = os.path.join(self.dir, job.agent)
        os.makedirs(folder, mode=0o700, exist_ok=True)
        path = os.path.join(folder, f"{job.id}.json")
        state_files.write_json(path, asdict(job))

    def remove(self, job: Job) -> None:
        try:
            os.unlink(os.path.join(self.dir, job.agent, f"{job.id}.json"))
        except FileNotFoundError:
            pass

    def load_all(self) -> list[Job]:
        jobs = []
        try:
            agents = sorted(os.listdir(self.dir))
        except FileNotFoundError:
            return jobs
        for agent in agents:
            folder = os.path.join(self.dir, agent)
            for name in sorted(os.listdir(folder)):
                if not name.endswith(".json"):
                    continue
                try:
                    with open(os.path.join(folder, name)) as f:
                        jobs.append(Job(**json.load(f)))
                except (OSError, ValueError, TypeError) as e:
                    log.warning("skipping unreadable job record %s: %s", name, e)
        return jobs


# --- the request ---------------------------------------------------------------


def _string(body: dict, name: str, limit: int) -> str:
    value = body[name]
    if not isinstance(value, str) or not value.strip():
        raise bad_request(f"'{name}' must be a non-empty string, got {value!r}")
    if "\0" in value:
        raise bad_request(f"'{name}' contains a NUL character")
    if len(value.encode()) > limit:
        raise bad_request(f"'{name}' is over {limit} bytes", "put the long text in a file under 'from'")
    return value


def _command(body: dict) -> list[str]:
    if ("command" in body) == ("argv" in body):
        raise bad_request(
            "a command job takes exactly one of 'command' (a shell line) and 'argv' (a list of strings)",
            '{"kind": "command", "from": "user-files/repo", "command": "make test"}',
        )
    if "command" in body:
        return ["/bin/sh", "-c", _string(body, "command", MAX_COMMAND)]
    argv = body["argv"]
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) and "\0" not in a for a in argv):
        raise bad_request(f"'argv' must be a non-empty list of strings without NUL, got {argv!r}")
    if not argv[0]:
        raise bad_request("'argv' must start with the program to run, got an empty string")
    return list(argv)


def narrow_limits(profile_limits: dict, requested: Any) -> dict:
    """The profile's limits, each narrowed where the request asks; widening is refused."""
    if not isinstance(requested, dict):
        raise bad_request(f"'limits' must be an object, got {type(requested).__name__}")
    unknown = sorted(set(requested) - set(LIMIT_PARSERS))
    if unknown:
        raise bad_request(f"unknown limit {unknown[0]!r}", f"limits: {', '.join(LIMIT_PARSERS)}", code="unknown_limit")
    limits = {}
    for name, parse in LIMIT_PARSERS.items():
        ceiling = parse(profile_limits.get(name), f"limits.{name}")
        limits[name] = ceiling
        if name not in requested:
            continue
        try:
            wanted = parse(requested[name], f"limits.{name}")
        except ProfileError as e:
            raise bad_request(str(e), code="invalid_limit") from None
        if wanted is None or (ceiling is not None and wanted > ceiling):
            shown = "unlimited" if wanted is None else requested[name]
            raise bad_request(
                f"limits.{name} {shown} is above the job profile's {profile_limits.get(name)}",
                "a request may narrow the job profile's limits, never widen them",
                code="limit_too_high",
            )
        if name in ("wall", "cpu") and wanted <= 0:
            raise bad_request(f"limits.{name} must be positive, got {requested[name]!r}", code="invalid_limit")
        limits[name] = wanted
    return limits


def _source(agent_root: str, source: Any) -> str:
    """``from`` as a path relative to the agent root: an existing directory inside it."""
    if not isinstance(source, str) or not source or "\0" in source:
        raise bad_request(f"'from' must be a path in the agent's tree, got {source!r}", code="invalid_from")
    try:
        resolved = fs.resolve_in_root(agent_root, source)
    except fs.PathOutsideRoot:
        raise GatewayError(
            403, "outside_workspace", f"'from' {source!r} is outside the agent's tree",
            "name a directory inside it, e.g. user-files/repo",
        ) from None
    rel = os.path.relpath(resolved, os.path.realpath(agent_root))
    if rel == "." or rel == "jobs" or rel.startswith("jobs/") or rel.split("/")[0] == ".kernel-gateway":
        raise bad_request(
            f"'from' {source!r} cannot be copied into a job: it is the whole tree or holds the jobs themselves",
            "name a directory such as user-files/repo", code="invalid_from",
        )
    if not resolved.is_dir() or resolved.is_symlink():
        raise bad_request(f"'from' {source!r} is not a directory in the agent's tree", code="invalid_from")
    return rel


# --- the manager ---------------------------------------------------------------


class JobManager:
    """Every agent's jobs: submit, list, cancel, apply, delete; runs the queue."""

    def __init__(self, settings: Any, core: Any):
        self.settings = settings
        self.agents = core.agents  # agent roots, sandbox values, profiles
        self.pool = core.pool  # the cgroup prefix of this gateway's sandboxes
        self.library = core.library
        self.store = JobStore(settings.state_dir)
        self.jobs: dict[str, Job] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._cancel: dict[str, asyncio.Event] = {}
        self._ended: dict[str, asyncio.Event] = {}  # set when an active job ends
        self._apply_locks: dict[str, asyncio.Lock] = {}
        self._seq = 0
        self._stopping = False
        self.gate: Any = None  # the server's accept gate: codex jobs' model forwarders listen through it

    # --- lifecycle ----------------------------------------------------------------

    async def start(self) -> None:
        """Load the records of an earlier run: running jobs are ``lost``, queued ones run."""
        lost = []
        for job in self.store.load_all():
            self.jobs[job.id] = job
            self._seq = max(self._seq, job.seq)
            if job.state == "queued":
                self._ended[job.id] = asyncio.Event()
            if job.state == "running":
                job.state, job.ended = "lost", time.time()
                job.error = "the gateway stopped while this job ran; its processes ended with it"
                self.store.save(job)
                lost.append(job)
        for job in lost:
            self._tasks[job.id] = asyncio.ensure_future(self._salvage(job))
        self._schedule()

    async def stop(self) -> None:
        """Processes end with the gateway; their records stay ``running`` and read ``lost`` next time."""
        self._stopping = True
        for event in self._cancel.values():
            event.set()
        tasks = list(self._tasks.values())
        if tasks:
            await asyncio.wait(tasks, timeout=10)

    # --- the API's operations -----------------------------------------------------

    def submit(self, agent: str, body: Any) -> dict:
        if not isinstance(body, dict):
            raise bad_request("the body must be a JSON object", code="malformed_json")
        unknown = sorted(set(body) - set(REQUEST_FIELDS))
        if unknown:
            raise bad_request(f"unknown field {unknown[0]!r}", f"allowed fields: {', '.join(REQUEST_FIELDS)}",
                              code="unknown_field")
        kind = body.get("kind")
        if kind not in KINDS:
            raise bad_request(f"unknown job kind {kind!r}", "kind is 'command' or 'codex'", code="invalid_kind")
        if "from" not in body:
            raise bad_request("missing field 'from'", "the directory of the agent's tree the job works on",
                              code="missing_field")
        root = self.agents.agent_root(agent)
        source = _source(root, body["from"])
        command, objective = None, None
        if kind == "command":
            if "objective" in body:
                raise bad_request("'objective' belongs to codex jobs; a command job takes 'command' or 'argv'")
            command = _command(body)
        else:
            if "command" in body or "argv" in body:
                raise bad_request("a codex job takes an 'objective', not 'command' or 'argv'")
            if "objective" not in body:
                raise bad_request("missing field 'objective'", "what Codex is to change", code="missing_field")
            objective = _string(body, "objective", MAX_OBJECTIVE)
            codex_runner.model_for(self.settings, agent)  # refuses now if none is configured
            codex_runner.find_codex(self.settings.codex_command)
        limits = narrow_limits(self.base_profile(agent, kind).get("limits", {}), body.get("limits", {}))
        env = request_env.check(body.get("env"), f"{kind}_job", request_env.model_keys(self.settings))
        job = Job(id=secrets.token_hex(6), agent=agent, kind=kind, source=source, seq=self._seq + 1,
                  created=time.time(), command=command, objective=objective, limits=limits, env=env)
        self._check_share(job)
        self._seq += 1
        self.jobs[job.id] = job
        self._ended[job.id] = asyncio.Event()
        self.store.save(job)
        self._schedule()
        return self.render(job)

    def _check_share(self, job: Job) -> None:
        """A new job fits its agent's share of the queue and of the stored records, and its record its size."""
        s = self.settings
        env_size = sum(len(name.encode()) + len(value.encode("utf-8", "surrogatepass")) for name, value in job.env.items())
        if env_size > s.max_job_env_size:
            raise GatewayError(413, "env_too_large", f"'env' is {env_size} bytes; the limit is {s.max_job_env_size}",
                               "put big values in a file under 'from'; raise --Gateway.max_job_env_size")
        size = len(json.dumps(asdict(job)))
        if size > s.max_job_record_size:
            raise GatewayError(413, "job_too_large", f"the job's record would be {size} bytes; the limit is "
                               f"{s.max_job_record_size}", "put long text in a file under 'from'; raise "
                               "--Gateway.max_job_record_size")
        mine = [j for j in self.jobs.values() if j.agent == job.agent]
        queued = sum(1 for j in mine if j.state == "queued")
        if queued >= s.max_queued_jobs_per_agent:
            raise GatewayError(429, "too_many_jobs", f"agent {job.agent!r} already has {queued} jobs waiting",
                               "wait for them, or cancel some; raise --Gateway.max_queued_jobs_per_agent")
        if sum(1 for j in self.jobs.values() if j.state == "queued") >= s.max_queued_jobs_total:
            raise GatewayError(429, "too_many_jobs", f"the gateway already has {s.max_queued_jobs_total} jobs "
                               "waiting", "try again later; raise --Gateway.max_queued_jobs_total")
        if len(mine) >= s.max_jobs_per_agent:
            raise GatewayError(429, "too_many_jobs", f"agent {job.agent!r} keeps {len(mine)} job records",
                               "delete ended jobs: DELETE .../jobs/{id}; raise --Gateway.max_jobs_per_agent")

    def list(self, agent: str) -> list[dict]:
        mine = [j for j in self.jobs.values() if j.agent == agent]
        return [self.render(j) for j in sorted(mine, key=lambda j: j.seq, reverse=True)]

    def get(self, agent: str, job_id: str) -> Job:
        check_job_id(job_id)
        job = self.jobs.get(job_id)
        if job is None or job.agent != agent:
            raise not_found(f"no job {job_id!r} of agent {agent!r}", "GET .../jobs lists them", code="unknown_job")
        return job

    def render(self, job: Job) -> dict:
        return job.to_json(self.agents.agent_root(job.agent))

    def cancel(self, agent: str, job_id: str) -> dict:
        job = self.get(agent, job_id)
        if job.state == "queued":
            job.state, job.ended = "cancelled", time.time()
            self.store.save(job)
            self._ended.pop(job.id).set()
        elif job.state == "running":
            if job.id in self._cancel:
                self._cancel[job.id].set()
        else:
            raise conflict(f"job {job_id} has already ended ({job.state})", code="job_ended")
        return self.render(job)

    async def wait(self, agent: str, job_id: str) -> dict:
        job = self.get(agent, job_id)
        ended = self._ended.get(job.id)
        if ended is not None:
            await ended.wait()
        task = self._tasks.get(job.id)  # a lost job's salvage, or a run finishing its record
        if task is not None:
            await asyncio.shield(task)
        return self.render(job)

    async def delete(self, agent: str, job_id: str) -> None:
        job = self.get(agent, job_id)
        if job.state in ACTIVE or job.id in self._tasks:
            raise conflict(f"job {job_id} is {job.state}", "cancel it first: POST .../cancel", code="job_active")
        await job_runner.remove_workspace(self._context(job), job)
        self.store.remove(job)
        del self.jobs[job.id]

    def patch_bytes(self, agent: str, job_id: str) -> tuple[bytes, dict]:
        job = self.get(agent, job_id)
        if job.patch is None:
            raise conflict(f"job {job_id} has no patch yet ({job.state})", "wait until it ends", code="no_patch")
        if job.patch.get("sha256") is None:
            raise conflict(f"job {job_id} has no usable patch: {job.patch.get('error')}",
                           f"look at the job's files in {job.workspace}/", code="no_patch")
        data = job_runner.read_patch(self._context(job), job, self.settings.job_patch_limit)
        return data, job.patch

    async def apply(self, agent: str, job_id: str) -> dict:
        job = self.get(agent, job_id)
        # One apply at a time per agent: two applies into one directory must not interleave.
        async with self._apply_locks.setdefault(agent, asyncio.Lock()):
            if job.applied is not None:
                raise conflict(f"job {job_id} was applied already", "run a new job for a new change",
                               code="already_applied")
            data, _ = await asyncio.to_thread(self.patch_bytes, agent, job_id)  # reading and hashing it: not on the loop
            result = await job_runner.apply_patch(self._context(job), job, data)
            job.applied = time.time()
            self.store.save(job)
            return result

    # --- running ------------------------------------------------------------------

    def base_profile(self, agent: str, kind: str) -> dict:
        name = self.settings.profile_for(agent, "job")
        if kind == "codex" and self.settings.codex_job_profile:
            name = self.settings.codex_job_profile
        try:
            profile = load_profile(name)
        except ProfileError as e:
            raise GatewayError(500, "bad_profile", f"the job profile of {agent!r} is invalid: {e}") from None
        return profile

    def _context(self, job: Job) -> job_runner.Context:
        profile = copy.deepcopy(self.base_profile(job.agent, job.kind))
        profile["limits"] = dict(job.limits)
        return job_runner.Context(
            agent_root=self.agents.agent_root(job.agent),
            values=self.agents.sandbox_values(job.agent),
            command_profile=self.agents.profile(job.agent, "command"),
            job_profile=profile,
            bwrap=self.settings.bwrap or None,
            cgroup_name=f"{self.pool.cgroup_prefix}-job-{job.id}",
            output_limit=self.settings.output_limit,
            patch_limit=self.settings.job_patch_limit,
            run_as=self.agents.uids.run_as(job.agent),  # the agent's own host uid
            listen_streams=self.gate.listen_unix_streams if self.gate is not None else None,
            close_listener=self.gate.close if self.gate is not None else (lambda name: None),
        )

    def _schedule(self) -> None:
        if self._stopping:
            return
        running = {j.agent for j in self.jobs.values() if j.state == "running"}
        count = sum(1 for j in self.jobs.values() if j.state == "running")
        for job in sorted((j for j in self.jobs.values() if j.state == "queued"), key=lambda j: j.seq):
            if count >= self.settings.max_running_jobs:
                break
            if job.agent in running:
                continue
            job.state, job.started = "running", time.time()
            self.store.save(job)
            running.add(job.agent)
            count += 1
            self._cancel[job.id] = asyncio.Event()
            self._tasks[job.id] = asyncio.ensure_future(self._run(job))

    async def _run(self, job: Job) -> None:
        try:
            ctx = self._context(job)
            # Checked again: a record written by an earlier gateway went by the rules of its day.
            request_env.check(job.env, f"{job.kind}_job", request_env.model_keys(self.settings))
            extra = None
            if job.kind == "codex":
                extra = codex_runner.prepare(self.settings, job)
            library = self.library
            skills = None if library is None else (
                lambda: library.materialize_skills(job.agent, ctx.agent_root, f"{job.workspace}/skills"))
            outcome = await job_runner.run(ctx, job, self._cancel[job.id], codex=extra, skills=skills)
            if self._stopping and outcome.state == "cancelled":
                return  # the gateway is stopping: the record says running, and reads lost next start
            job.state, job.exit_code, job.signal = outcome.state, outcome.exit_code, outcome.signal
            job.stdout_tail, job.stderr_tail, job.error = outcome.stdout_tail, outcome.stderr_tail, outcome.error
            job.skipped, job.patch = outcome.skipped, outcome.patch
        except GatewayError as e:
            job.state, job.error = "failed", e.message
        except (OSError, fs.PathOutsideRoot) as e:
            # The agent owns jobs/<id>: a part swapped for a symlink or removed is refused, not followed.
            job.state, job.error = "failed", f"the job's workspace changed under it and was refused: {e}"
        except Exception as e:  # a bug must not leave the job running forever
            log.exception("job %s failed", job.id)
            job.state, job.error = "failed", f"internal error: {type(e).__name__}: {e}"
        finally:
            if not (self._stopping and job.state == "running"):
                job.ended = job.ended or time.time()
                self.store.save(job)
            self._tasks.pop(job.id, None)
            self._cancel.pop(job.id, None)
            if not self._stopping and job.id in self._ended:
                self._ended.pop(job.id).set()
            self._schedule()

    async def _salvage(self, job: Job) -> None:
        """A lost job keeps its logs' tails and the patch of what it had done."""
        try:
            ctx = self._context(job)
            job.stdout_tail, job.stderr_tail = job_runner.read_tails(ctx, job)
            job.patch = await job_runner.make_patch(ctx, job, partial=True)
            self.store.save(job)
        except Exception:
            log.exception("could not salvage lost job %s", job.id)
        finally:
            self._tasks.pop(job.id, None)
