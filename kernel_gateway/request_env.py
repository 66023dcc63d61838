"""The one way a request's ``env`` becomes part of a process's environment.

Requests name environment variables in two route families: a command
(``POST .../commands``) and a job (``POST .../jobs``, ``command`` or
``codex``).  Each goes through :func:`check` with its kind's rule, and nothing
else in the package builds an environment from request data (a source guard
in the tests holds this).  The gateway's own variables are added after the
request's, so a request never overrides them; where a name is the gateway's,
the request is refused rather than silently overridden.

The rules:

- ``command``: any well-formed name.  The command runs a shell in the agent's
  own sandbox, which holds no secret and has no network; whatever a variable
  could change there, the command line could change too.
- ``command_job``: any well-formed name except those that redirect or
  re-root what a process trusts or talks to: proxies (any name with
  ``PROXY``, in any case; ``GIT_CONFIG*``, ``CURL_HOME``, ``WGETRC``), TLS trust (``SSL_*``, ``*_CA_BUNDLE``, ``NODE_*``...), the dynamic
  loader (``LD_*``), Codex's and the model's own (``CODEX_*``, ``OPENAI_*``,
  every model profile's ``env_key``) and the gateway's (``KERNEL_GATEWAY_*``,
  ``JLK_*``).  A command job is the agent's own code, but it is the same job
  machinery that holds an operator's model credential for codex jobs, and
  the egress proxy that grows from :mod:`kernel_gateway.egress` will hold
  more: none of these names may reach a job's process from a request.
- ``codex_job``: only the names of :data:`CODEX_JOB_ALLOWED` (locale, time
  zone, terminal, a few build and test switches) and the agent's own
  ``JOB_*`` variables, and none of the names above.  Codex is the process
  that talks to the model: the request decides nothing about how it does.

A refusal is a 400 naming the variable and the rule it broke.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

from .errors import GatewayError, bad_request
from .sandbox.launch import check_env_name

RULES = ("command", "command_job", "codex_job")
MAX_NAME = 128

#: Set by the gateway for every job; a request naming one is refused (``reserved_env``).
RESERVED = ("CODEX_HOME", "HOME", "TMPDIR")

#: What a codex job's request may set, besides ``JOB_*``.
CODEX_JOB_ALLOWED = (
    "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "LC_MESSAGES", "LC_COLLATE", "LC_NUMERIC", "LC_TIME", "TZ",
    "TERM", "NO_COLOR", "CI", "COLUMNS", "LINES",
    "PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONIOENCODING", "PYTEST_ADDOPTS",
    "MAKEFLAGS", "CFLAGS", "CXXFLAGS", "LDFLAGS", "GOFLAGS", "CARGO_TERM_COLOR", "RUST_BACKTRACE",
)
CODEX_JOB_PREFIX = "JOB_"

# (pattern over the upper-cased name, why it is refused): the deny-list of both job kinds.
DENIED: tuple[tuple[re.Pattern, str], ...] = tuple((re.compile(p), why) for p, why in (
    (r".*PROXY.*", "proxy variables (*_PROXY and any name with PROXY, in any case) send a process's requests "
                   "through another endpoint"),
    (r"GIT_CONFIG.*|CURL_HOME|WGETRC", "these name configuration that can set a proxy or TLS trust"),
    (r"SSL_.*|.*_CA_BUNDLE|.*_CA_CERTS?|.*CERT_FILE|.*CERT_DIR|.*_TLS_.*|TLS_.*|GIT_SSL_.*|PIP_CERT",
     "TLS variables change which servers a process trusts"),
    (r"NODE_.*|NPM_CONFIG_.*", "Node variables (NODE_*) load code and change TLS trust in every Node process"),
    (r"LD_.*|GCONV_PATH|MALLOC_.*|GLIBC_TUNABLES", "dynamic loader variables load code into every process"),
    (r"CODEX_.*|RUST_LOG", "Codex's own variables are the gateway's to set"),
    (r"OPENAI_.*|AZURE_OPENAI_.*|ANTHROPIC_.*", "model variables name a model endpoint or credential"),
    (r"KERNEL_GATEWAY_.*|JLK_.*", "the gateway's own variables are set by the gateway"),
))


def _refuse(name: str, rule: str, why: str, hint: str) -> GatewayError:
    kind = {"command_job": "a command job", "codex_job": "a codex job"}.get(rule, "a command")
    return bad_request(f"'env.{name}' is not allowed in {kind}: {why}", hint, code="env_not_allowed")


def denied(name: str, model_keys: Iterable[str] = ()) -> str | None:
    """Why ``name`` may not come from a job's request, or None."""
    upper = name.upper()
    if upper in {k.upper() for k in model_keys}:
        return "it is the variable a model profile reads its key from (env_key)"
    for pattern, why in DENIED:
        if pattern.fullmatch(upper):
            return why
    return None


def check(env: Any, rule: str, model_keys: Iterable[str] = ()) -> dict[str, str]:
    """A request's ``env``, checked against ``rule`` (one of :data:`RULES`); raises a 400 saying why not.

    ``model_keys`` are the ``env_key`` names of the gateway's model profiles.
    """
    if rule not in RULES:
        raise ValueError(f"unknown env rule {rule!r}")
    if env is None:
        return {}
    if not isinstance(env, dict):
        raise bad_request(f"'env' must be an object of NAME: string, got {type(env).__name__}")
    model_keys = list(model_keys)
    checked: dict[str, str] = {}
    for name, value in env.items():
        if not check_env_name(name) or len(name) > MAX_NAME:
            raise bad_request(f"'env' has an invalid variable name {name!r}",
                              "names are letters, digits and _, not starting with a digit")
        if not isinstance(value, str):
            raise bad_request(f"'env.{name}' must be a string, got {type(value).__name__}",
                              f'quote it: "{name}": "{value}"')
        if "\0" in value:
            raise bad_request(f"'env.{name}' contains a NUL character", "remove the \\0 from it")
        if rule != "command":
            if name in RESERVED:
                raise bad_request(f"'env.{name}' is set by the gateway for every job", code="reserved_env")
            why = denied(name, model_keys)
            if why is not None:
                raise _refuse(name, rule, why, "set it in the job's own command if the job needs it"
                              if rule == "command_job" else _codex_hint())
            if rule == "codex_job" and name not in CODEX_JOB_ALLOWED and not name.startswith(CODEX_JOB_PREFIX):
                raise _refuse(name, rule, "a codex job's env is an allow-list", _codex_hint())
        checked[name] = value
    return checked


def _codex_hint() -> str:
    return f"a codex job's env takes only {', '.join(CODEX_JOB_ALLOWED)} and {CODEX_JOB_PREFIX}* names"


def model_keys(settings: Any) -> list[str]:
    """The ``env_key`` of every model profile the gateway knows (well-formed or not)."""
    keys = []
    for profile in (getattr(settings, "model_profiles", None) or {}).values():
        if isinstance(profile, dict) and isinstance(profile.get("env_key"), str):
            keys.append(profile["env_key"])
    return keys

