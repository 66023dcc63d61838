"""The one check of a request's env: its three rules, on their own (the routes' tests use them end to end)."""

from __future__ import annotations

import pytest

from kernel_gateway import request_env
from kernel_gateway.errors import GatewayError

DENIED = ["HTTP_PROXY", "http_proxy", "Https_Proxy", "ALL_PROXY", "NO_PROXY", "PROXY", "PIP_PROXY", "GIT_CONFIG_COUNT",
          "CURL_HOME", "WGETRC", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
          "NODE_EXTRA_CA_CERTS", "NODE_OPTIONS", "NODE_TLS_REJECT_UNAUTHORIZED", "GIT_SSL_NO_VERIFY", "LD_PRELOAD",
          "LD_LIBRARY_PATH", "GLIBC_TUNABLES", "CODEX_HOME_X", "codex_api_key", "RUST_LOG", "OPENAI_API_KEY",
          "OPENAI_BASE_URL", "AZURE_OPENAI_ENDPOINT", "ANTHROPIC_API_KEY", "KERNEL_GATEWAY_MODEL_TOKEN", "JLK_SESSION",
          "MY_MODEL_KEY", "my_model_key"]


@pytest.mark.parametrize("name", DENIED)
def test_jobs_refuse_what_redirects_or_reroots_a_process(name):
    for rule in ("command_job", "codex_job"):
        with pytest.raises(GatewayError) as e:
            request_env.check({name: "x"}, rule, model_keys=["MY_MODEL_KEY"])
        assert (e.value.status, e.value.code) == (400, "env_not_allowed")
        assert f"'env.{name}'" in e.value.message and e.value.hint
    assert request_env.check({name: "x"}, "command") == {name: "x"}  # the agent's own sandbox


def test_codex_jobs_take_the_allow_list_only():
    allowed = {"LANG": "C.UTF-8", "TZ": "UTC", "JOB_NOTE": "x", "PYTHONHASHSEED": "0"}
    assert request_env.check(allowed, "codex_job") == allowed
    for name in ("PATH", "PYTHONPATH", "PYTHONWARNINGS", "BASH_ENV", "XDG_CONFIG_HOME", "job_note"):
        with pytest.raises(GatewayError) as e:
            request_env.check({name: "x"}, "codex_job")
        assert e.value.code == "env_not_allowed" and "allow-list" in e.value.message
    assert request_env.check({"PATH": "/x", "PYTHONPATH": "/y"}, "command_job") == {"PATH": "/x", "PYTHONPATH": "/y"}


@pytest.mark.parametrize("env, code", [
    ({"HOME": "/"}, "reserved_env"), ({"TMPDIR": "/"}, "reserved_env"), ({"CODEX_HOME": "/"}, "reserved_env"),
    ({"A=B": "x"}, "bad_request"), ({"1A": "x"}, "bad_request"), ({"A" * 129: "x"}, "bad_request"),
    ({"A": 1}, "bad_request"), ({"A": "x\0y"}, "bad_request"), (["A=B"], "bad_request"),
])
def test_malformed_or_reserved_is_refused(env, code):
    for rule in ("command_job", "codex_job"):
        with pytest.raises(GatewayError) as e:
            request_env.check(env, rule)
        assert (e.value.status, e.value.code) == (400, code)


def test_model_keys_are_every_profiles_env_key():
    class Settings:
        model_profiles = {"a": {"env_key": "A_KEY"}, "b": {"model": "m"}, "c": "not a profile"}

    assert request_env.model_keys(Settings()) == ["A_KEY"]
    assert request_env.check(None, "codex_job") == {}
