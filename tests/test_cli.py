"""The kernel-gateway command: help, bad commands, bad options, bad profiles."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from support import BIN

KG = os.path.join(BIN, "kernel-gateway")


def kg(*args, cwd=None):
    return subprocess.run([KG, *args], capture_output=True, text=True, timeout=60, cwd=cwd)


def test_help_and_version():
    assert kg("--help").returncode == 0 and "serve" in kg("--help").stdout
    assert kg().returncode == 2
    assert kg("--version").stdout.strip() == "0.1.0"
    serve_help = kg("serve", "--help")
    assert serve_help.returncode == 0 and "--state-dir" in serve_help.stdout


@pytest.mark.parametrize(
    "args,code,message",
    [
        (["bogus"], 2, "unknown command 'bogus'"),
        (["serve", "--Gateway.output_limit=abc"], 2, "bad option"),
        (["serve", "--config", "/nonexistent.json"], 1, "no config file /nonexistent.json"),
        (["serve", "--bwrap", "/nonexistent"], 1, "bubblewrap (bwrap) not found at '/nonexistent'"),
        (["serve", "--Gateway.kernel_profile=/nonexistent.json"], 1, "cannot read /nonexistent.json"),
        (["serve", "--Gateway.command_profile=nosuch"], 1, "no built-in profile 'nosuch'"),
    ],
)
def test_bad_invocations_fail_clearly_and_create_nothing(tmp_path, args, code, message):
    result = kg(*args, "--root", str(tmp_path / "agents"), "--state-dir", str(tmp_path / "state"), cwd=tmp_path)
    assert result.returncode == code, result.stderr
    assert message in result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert os.listdir(tmp_path) == []


def test_a_bad_agent_profile_override_names_the_field(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"sandbox": {"uid": 1000, "colour": "red"}}))
    result = kg(
        "serve",
        "--root", str(tmp_path / "agents"),
        "--state-dir", str(tmp_path / "state"),
        f'--Gateway.agent_profiles={{"alice": {{"kernel": "{bad}"}}}}',
    )  # fmt: skip
    assert result.returncode == 1
    assert "agent_profiles['alice']['kernel']: sandbox.colour: unknown key" in result.stderr
    assert sorted(os.listdir(tmp_path)) == ["bad.json"]
