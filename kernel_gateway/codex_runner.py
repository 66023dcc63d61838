"""The ``codex`` kind of background job: the real Codex CLI inside the job sandbox.

The gateway is Codex's sandbox, so Codex's own is bypassed
(``--dangerously-bypass-approvals-and-sandbox``).  stdin is ``/dev/null``;
Codex runs niced; its last message is its stdout.

**No operator secret enters the sandbox.**  Codex gets a per-job dummy token
(in its config's ``http_headers``, never in an argv or environment that ``ps``
shows on the host) and reaches the model only through the
gateway's egress forwarder (:mod:`kernel_gateway.egress.forwarder`), which
listens on a Unix socket of this job bound into the sandbox at
:data:`MODEL_SOCKET`, and which replaces the dummy with the real key (the
model profile's ``env_key``, read from the gateway's own environment) for the
model's base URL and nothing else.  Inside, Codex needs an http URL: the run
step starts :data:`RELAY_SCRIPT`, which listens on 127.0.0.1 in the sandbox's
own network namespace (the job profile has no network), relays each
connection to the socket, and starts Codex with that URL.

Codex's configuration is the gateway's alone: ``config.toml`` is made in
memory and bound read-only at ``$CODEX_HOME/config.toml``; ``CODEX_HOME``
(:data:`CODEX_HOME`, where Codex writes its sessions, logs and state) is in
the sandbox's own ``/tmp``, which nothing outside the job can reach; the
model provider and its URL are also given on Codex's command line, above
every config layer.  The agent's tree holds none of it.

Which model: the agent's Background Agent Jobs profile if set, else the
gateway's, else the agent's heavy profile, else the gateway's (see the
``model_profiles`` settings).  No Tornado here.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from typing import Any

from .egress.forwarder import Route, Upstream
from .errors import GatewayError

PREAMBLE = (
    "This directory holds the files of a check-in, with no version control: make in its files the "
    "change this objective asks, and nothing more; remove any file you made only to build or check it; "
    "do not commit. Your last message says what you changed and what you checked. The objective:"
)
MODEL_SOCKET = "/run/kernel-gateway-model.sock"  # the forwarder's socket, inside the job sandbox
CODEX_HOME = "/tmp/codex-home"  # in the job sandbox's own tmpfs
RELAY_URL = "@relay@"  # replaced by the relay with http://127.0.0.1:PORT once it listens

# Runs in the job sandbox, as the agent; argv: SOCKET INDEX COMMAND...  Listens on 127.0.0.1 (the
# sandbox's own loopback), puts its URL in COMMAND[INDEX], relays every connection to SOCKET byte
# for byte, runs COMMAND and exits as it did.  It never writes to stdout (Codex's last message).
RELAY_SCRIPT = r"""
import os, signal, socket, subprocess, sys, threading
path, index, command = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
listener.bind(("127.0.0.1", 0))
listener.listen(16)
command[index] = command[index].replace("@relay@", "http://127.0.0.1:%d" % listener.getsockname()[1])

def pump(src, dst):
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    try:
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass

def serve(conn):
    with conn:
        try:
            gateway = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            gateway.connect(path)
        except OSError as e:
            sys.stderr.write("model relay: the gateway's forwarder cannot be reached: %s\n" % e)
            return
        with gateway:
            back = threading.Thread(target=pump, args=(gateway, conn), daemon=True)
            back.start()
            pump(conn, gateway)
            back.join()

def accept():
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()

threading.Thread(target=accept, daemon=True).start()
child = subprocess.Popen(command)
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, lambda s, f: child.send_signal(s))
code = child.wait()
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""
MODEL_FIELDS = {"provider", "model", "base_url", "wire_api", "env_key"}
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


def find_codex(configured: str) -> str:
    """The Codex binary's real path (so it can be bound into the sandbox), or 409 saying how to get one."""
    candidate = configured or shutil.which("codex") or ""
    real = os.path.realpath(candidate) if candidate else ""
    if real and os.path.isfile(real) and os.access(real, os.X_OK):
        return real
    raise GatewayError(
        409, "codex_unavailable",
        f"no Codex binary {'at ' + repr(configured) if configured else 'on PATH'}",
        "install it (npm install @openai/codex) and set --Gateway.codex_command to its native binary",
    )


def check_model_profile(name: str, profile: Any) -> dict:
    """One entry of ``model_profiles``, checked; raises ValueError saying what is wrong."""
    if not isinstance(profile, dict):
        raise ValueError(f"model profile {name!r} must be an object")
    unknown = sorted(set(profile) - MODEL_FIELDS)
    if unknown:
        raise ValueError(f"model profile {name!r}: unknown field {unknown[0]!r} (allowed: {', '.join(sorted(MODEL_FIELDS))})")
    for key in ("model", "base_url"):
        if not isinstance(profile.get(key), str) or not profile[key]:
            raise ValueError(f"model profile {name!r}: {key!r} must be a non-empty string")
    if not re.match(r"^https?://[^\s\"]+$", profile["base_url"]):
        raise ValueError(f"model profile {name!r}: base_url must be an http(s) URL, got {profile['base_url']!r}")
    try:
        Upstream.from_url(profile["base_url"])  # what the forwarder will allow, and nothing else
    except ValueError as e:
        raise ValueError(f"model profile {name!r}: base_url: {e}") from None
    provider = profile.get("provider", name)
    if not isinstance(provider, str) or not _NAME.match(provider):
        raise ValueError(f"model profile {name!r}: provider must be 1-64 of A-Z a-z 0-9 _ -")
    if profile.get("wire_api", "responses") != "responses":
        raise ValueError(f"model profile {name!r}: wire_api must be 'responses'")
    env_key = profile.get("env_key")
    if env_key is not None and (not isinstance(env_key, str) or not _ENV.match(env_key)):
        raise ValueError(f"model profile {name!r}: env_key must be an environment variable name")
    return {"provider": provider, "model": profile["model"], "base_url": profile["base_url"],
            "wire_api": "responses", "env_key": env_key}


def model_for(settings: Any, agent: str) -> dict:
    """The model a codex job of ``agent`` uses: jobs profile, else heavy profile; 409 if none."""
    own = settings.agent_model_profiles.get(agent, {})
    for name in (own.get("jobs"), settings.jobs_model_profile, own.get("heavy"), settings.heavy_model_profile):
        if name and name in settings.model_profiles:
            try:
                model = check_model_profile(name, settings.model_profiles[name])
            except ValueError as e:
                raise GatewayError(500, "bad_model_profile", str(e)) from None
            if model["env_key"] and model["env_key"] not in os.environ:
                raise GatewayError(
                    409, "model_key_missing",
                    f"the model profile {name!r} reads its key from ${model['env_key']}, which the gateway does not have",
                    "start the gateway with that variable set",
                )
            return model
    raise GatewayError(
        409, "no_model",
        "no model is configured for codex jobs",
        'set --Gateway.model_profiles=\'{"heavy": {"model": ..., "base_url": ..., "env_key": ...}}\'',
    )


def config_toml(model: dict, token: str) -> str:
    """Codex's config.toml for one job: JSON strings are valid TOML basic strings.

    Codex sends the job's dummy ``token`` as its key (``http_headers``: no ``env_key``,
    so no variable holds it).  The base URL is the relay's, known once it listens: the
    run step gives it on the command line (``-c``), which also restates the provider
    over any other layer.
    """
    provider = model["provider"]
    lines = [
        f"model = {json.dumps(model['model'])}",
        f"model_provider = {json.dumps(provider)}",
        "",
        f"[model_providers.{provider}]",
        f"name = {json.dumps(provider)}",
        'wire_api = "responses"',
        f"http_headers = {{ Authorization = {json.dumps('Bearer ' + token)} }}",
    ]
    return "\n".join(lines) + "\n"


def model_route(model: dict, token: str) -> Route:
    """The forwarder's one route for a job: the model's base URL, the job's token, the real key."""
    inject = {}
    if model["env_key"]:
        inject["Authorization"] = f"Bearer {os.environ[model['env_key']]}"  # read here, in the gateway only
    return Route(Upstream.from_url(model["base_url"]), token, inject, frozenset({"GET", "POST"}))


def prepare(settings: Any, job: Any) -> Any:
    """The argv, environment, config, binds and forwarder route of one codex job's run step."""
    from .job_runner import CodexRun

    codex = find_codex(settings.codex_command)
    model = model_for(settings, job.agent)
    token = f"kg-job-{job.id}-{secrets.token_hex(16)}"
    provider = model["provider"]
    prefix = Upstream.from_url(model["base_url"]).prefix
    codex_argv = [
        "nice", "-n", "10", codex, "exec",
        "-c", f"model_providers.{provider}.base_url={json.dumps(RELAY_URL + prefix)}",
        "-c", f"model_provider={json.dumps(provider)}",
        "--dangerously-bypass-approvals-and-sandbox", "--skip-git-repo-check", f"{PREAMBLE} {job.objective}",
    ]
    return CodexRun(
        argv=["python3", "-I", "-c", RELAY_SCRIPT, MODEL_SOCKET, str(codex_argv.index("-c") + 1), *codex_argv],
        env={"CODEX_HOME": CODEX_HOME},
        config_toml=config_toml(model, token),
        read_only=[codex],
        route=model_route(model, token),
        socket_path=os.path.join(settings.state_dir, "egress", f"{job.id}.sock"),
    )
