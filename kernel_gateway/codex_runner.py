"""The ``codex`` kind of background job: the real Codex CLI inside the job sandbox.

The gateway is Codex's sandbox, so Codex's own is bypassed
(``--dangerously-bypass-approvals-and-sandbox``).  ``CODEX_HOME`` is
``jobs/<id>/.codex``, whose ``config.toml`` is written from the operator's
model configuration (provider, model, base URL, ``wire_api``, ``env_key``);
the key itself only travels as an environment variable of the sandbox,
never into the job's files.  stdin is ``/dev/null``; Codex runs niced; its
last message is its stdout.

Which model: the agent's Background Agent Jobs profile if set, else the
gateway's, else the agent's heavy profile, else the gateway's (see the
``model_profiles`` settings).  No Tornado here.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from typing import Any

from .errors import GatewayError

PREAMBLE = (
    "This directory holds the files of a check-in, with no version control: make in its files the "
    "change this objective asks, and nothing more; remove any file you made only to build or check it; "
    "do not commit. Your last message says what you changed and what you checked. The objective:"
)
# What name lookup and TLS read (the seed's profile binds the same); /etc/passwd is created by the profile.
NETWORK_FILES = ("/etc/resolv.conf", "/etc/hosts", "/etc/nsswitch.conf", "/etc/ssl/certs")
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


def config_toml(model: dict) -> str:
    """Codex's config.toml for one job: JSON strings are valid TOML basic strings."""
    provider = model["provider"]
    lines = [
        f"model = {json.dumps(model['model'])}",
        f"model_provider = {json.dumps(provider)}",
        "",
        f"[model_providers.{provider}]",
        f"name = {json.dumps(provider)}",
        f"base_url = {json.dumps(model['base_url'])}",
        'wire_api = "responses"',
    ]
    if model["env_key"]:
        lines.append(f"env_key = {json.dumps(model['env_key'])}")
    return "\n".join(lines) + "\n"


def network_profile(job_profile: dict) -> dict:
    """The job profile with the network on and the files name lookup and TLS read."""
    profile = copy.deepcopy(job_profile)
    sandbox = profile["sandbox"]
    sandbox["network"] = True
    sandbox["read_only"] = list(sandbox.get("read_only", [])) + [
        p for p in NETWORK_FILES if p not in sandbox.get("read_only", [])
    ]
    return profile


def prepare(settings: Any, job: Any) -> Any:
    """The argv, environment, config and binds of one codex job's run step."""
    from .job_runner import CodexRun

    codex = find_codex(settings.codex_command)
    model = model_for(settings, job.agent)
    env = {}  # CODEX_HOME is set by the run step, which knows the job directory
    if model["env_key"]:
        env[model["env_key"]] = os.environ[model["env_key"]]
    return CodexRun(
        argv=["nice", "-n", "10", codex, "exec", "--dangerously-bypass-approvals-and-sandbox",
              "--skip-git-repo-check", f"{PREAMBLE} {job.objective}"],
        env=env,
        config_toml=config_toml(model),
        read_only=[codex],
    )
