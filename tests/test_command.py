"""run_command through real bwrap: results, cwd, env, stdin, timeouts, bounded output, bad input.

The helpers shared with the security tests (``values_for``, ``processes_with``)
live here; tests/conftest.py belongs to the kernel fixtures.
"""

from __future__ import annotations

import asyncio
import copy
import os
import sys
import uuid
from pathlib import Path

import pytest

from kernel_gateway.errors import GatewayError
from kernel_gateway.provisioner import python_env_paths
from kernel_gateway.sandbox.profile import load_profile
from kernel_gateway.tools.command import run_command

RESULT_KEYS = {"exit_code", "signal", "stdout", "stderr", "timed_out", "truncated", "duration_ms"}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    agent = tmp_path / "agents" / "alice"
    (agent / "sessions" / "s1").mkdir(parents=True)
    (agent / "user-files").mkdir()
    (tmp_path / "agents" / "bob").mkdir()
    return agent


def values_for(root: Path) -> dict[str, str]:
    """Placeholder values as the provisioner builds them (workspace is set per call)."""
    prefix, base = python_env_paths(sys.executable)
    return {
        "agent": root.name,
        "agent_root": str(root),
        "python_prefix": prefix,
        "python_base_prefix": base,
        "python_bin": os.path.join(prefix, "bin"),
    }


def spill_dir(root: Path) -> Path:
    return root / ".kernel-gateway" / "commands"


def run(root: Path, request, profile: dict | None = None, **kwargs) -> dict:
    return asyncio.run(
        run_command(
            request,
            agent_root=str(root),
            profile=profile or load_profile("command"),
            values=values_for(root),
            spill_dir=str(spill_dir(root)),
            **kwargs,
        )
    )


def processes_with(token: str) -> list[int]:
    """Host pids whose command line contains token (sandboxed processes show up here too)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if token.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


# --- results --------------------------------------------------------------------------


def test_shell_command_result(root: Path):
    result = run(root, {"command": "echo out; echo err >&2; exit 3"})
    assert set(result) == RESULT_KEYS
    assert (result["exit_code"], result["signal"]) == (3, None)
    assert (result["stdout"], result["stderr"]) == ("out\n", "err\n")
    assert result["timed_out"] is False and result["truncated"] is False
    assert isinstance(result["duration_ms"], float) and result["duration_ms"] > 0


def test_argv_is_passed_verbatim_without_a_shell(root: Path):
    result = run(root, {"argv": ["printf", "%s|", "two words", "$HOME", "'q'", "*"]})
    assert result["stdout"] == "two words|$HOME|'q'|*|"
    assert result["exit_code"] == 0


def test_default_cwd_is_the_agent_root_and_the_sandbox_runs_as_agent(root: Path):
    result = run(root, {"command": "pwd; id -un; echo $HOME; echo $KERNEL_GATEWAY_AGENT"})
    assert result["stdout"].splitlines() == [str(root), "agent", str(root), "alice"]


@pytest.mark.parametrize("cwd", ["sessions/s1", "sessions/../sessions/s1", "SESSION_ABS"])
def test_cwd_relative_to_the_root_or_absolute_inside_it(root: Path, cwd: str):
    if cwd == "SESSION_ABS":
        cwd = str(root / "sessions" / "s1")
    result = run(root, {"command": "pwd; echo $HOME; touch made-here", "cwd": cwd})
    assert result["stdout"].splitlines() == [str(root / "sessions" / "s1")] * 2
    assert (root / "sessions" / "s1" / "made-here").exists()


def test_cwd_through_a_symlink_inside_the_root(root: Path):
    os.symlink("sessions/s1", root / "current")
    result = run(root, {"command": "pwd", "cwd": "current"})
    assert result["stdout"] == f"{root / 'sessions' / 's1'}\n"


def test_env_is_added_to_the_profile_env(root: Path):
    result = run(root, {"argv": ["sh", "-c", 'echo "$GREETING|$LANG|$EMPTY|"'], "env": {"GREETING": "hi there", "EMPTY": ""}})
    assert result["stdout"] == "hi there|C.UTF-8||\n"


def test_host_environment_does_not_leak_in(root: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HOST_ONLY_SECRET", "s3cret")
    result = run(root, {"command": "env"})
    assert "s3cret" not in result["stdout"]
    assert "KERNEL_GATEWAY_AGENT=alice" in result["stdout"]


def test_stdin_is_fed_to_the_command(root: Path):
    result = run(root, {"command": "tr a-z A-Z", "stdin": "hello\nworld\n"})
    assert result["stdout"] == "HELLO\nWORLD\n"
    big = "x" * (512 << 10)
    assert run(root, {"command": "wc -c", "stdin": big})["stdout"].strip() == str(len(big))


def test_a_command_that_ignores_its_stdin_still_finishes(root: Path):
    result = run(root, {"command": "echo done", "stdin": "y" * (1 << 20)})
    assert (result["exit_code"], result["stdout"]) == (0, "done\n")


def test_a_command_ended_by_a_signal_reports_it(root: Path):
    result = run(root, {"command": "kill -TERM $$"})
    assert (result["exit_code"], result["signal"], result["timed_out"]) == (143, "SIGTERM", False)


def test_a_missing_program_is_a_normal_failed_result(root: Path):
    result = run(root, {"argv": ["no-such-program-here"]})
    assert result["exit_code"] != 0
    assert "no-such-program-here" in result["stderr"]


# --- timeouts and background processes -------------------------------------------------------


def test_timeout_kills_the_whole_tree_including_background_jobs(root: Path):
    token = f"987.{uuid.uuid4().int % 10**6}"
    result = run(
        root,
        {"command": f"trap '' TERM HUP; sleep {token} & (sleep {token} &); echo started; sleep {token}", "timeout": 0.5},
    )
    assert result["timed_out"] is True
    assert (result["exit_code"], result["signal"]) == (None, "SIGKILL")
    assert result["stdout"] == "started\n"
    assert processes_with(token) == []


def test_background_jobs_do_not_outlive_a_command_that_finished(root: Path):
    token = f"876.{uuid.uuid4().int % 10**6}"
    result = run(root, {"command": f"nohup sleep {token} >/dev/null 2>&1 & echo finished"})
    assert (result["exit_code"], result["stdout"], result["timed_out"]) == (0, "finished\n", False)
    assert processes_with(token) == []


def test_the_profile_wall_limit_caps_the_requested_timeout(root: Path):
    profile = copy.deepcopy(load_profile("command"))
    profile["limits"]["wall"] = "0.5s"
    result = run(root, {"command": "sleep 30", "timeout": 600}, profile=profile)
    assert result["timed_out"] is True


def test_the_profile_wall_limit_applies_without_a_requested_timeout(root: Path):
    profile = copy.deepcopy(load_profile("command"))
    profile["limits"]["wall"] = "0.5s"
    assert run(root, {"command": "sleep 30"}, profile=profile)["timed_out"] is True


# --- bounded output ----------------------------------------------------------------------------


def test_output_under_the_limit_is_whole_and_nothing_is_spilled(root: Path):
    result = run(root, {"command": "seq 1 100"}, output_limit=1000)
    assert result["stdout"] == "".join(f"{i}\n" for i in range(1, 101))
    assert "stdout_path" not in result and not spill_dir(root).exists()


def test_large_output_keeps_head_and_tail_and_spills_the_whole_stream(root: Path):
    expected = "".join(f"{i}\n" for i in range(1, 200_001)).encode()
    result = run(root, {"command": "seq 1 200000"}, output_limit=1000)
    assert result["truncated"] is True
    path = result["stdout_path"]
    assert path.startswith(str(spill_dir(root)) + "/stdout-")
    assert Path(path).read_bytes() == expected
    marker = f"[... {len(expected) - 1000} bytes cut: full output in {path} ...]"
    assert result["stdout"] == expected[:500].decode() + "\n" + marker + "\n" + expected[-500:].decode()
    assert "stderr_path" not in result and result["stderr"] == ""


def test_each_stream_is_bounded_and_spilled_on_its_own(root: Path):
    result = run(root, {"command": "seq 1 50000 >&2; echo small"}, output_limit=2000)
    assert result["stdout"] == "small\n" and "stdout_path" not in result
    assert result["truncated"] is True
    assert Path(result["stderr_path"]).name.startswith("stderr-")
    assert Path(result["stderr_path"]).read_text() == "".join(f"{i}\n" for i in range(1, 50001))
    assert len(result["stderr"].encode()) < 2000 + 200


def test_multibyte_characters_cut_at_the_edges_are_dropped_not_garbled(root: Path):
    result = run(root, {"argv": ["python", "-c", "print('é' * 5000, end='')"]}, output_limit=101)
    assert "\ufffd" not in result["stdout"]
    assert result["stdout"].startswith("é" * 25 + "\n[... ")
    assert result["stdout"].endswith("]\n" + "é" * 25)


def test_a_spill_directory_swapped_for_a_symlink_out_is_not_written(root: Path, tmp_path: Path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / ".kernel-gateway").mkdir()
    os.symlink(outside, spill_dir(root))
    result = run(root, {"command": "seq 1 10000"}, output_limit=100)
    assert list(outside.iterdir()) == []
    assert "stdout_path" not in result
    assert "full output could not be saved" in result["stdout"]
    assert result["stdout"].startswith("1\n2\n")


# --- streaming -----------------------------------------------------------------------------------


def test_events_arrive_while_the_command_is_still_running(root: Path):
    """The command waits for a file that only the first event's handler creates."""
    events = []

    async def on_event(event: dict) -> None:
        events.append(event)
        if event["text"].startswith("first"):
            (root / "go").touch()

    command = "echo first; while [ ! -e go ]; do sleep 0.01; done; echo second >&2"
    result = run(root, {"command": command, "timeout": 30, "stream": True}, on_event=on_event)
    assert result["timed_out"] is False
    assert events == [{"type": "stdout", "text": "first\n"}, {"type": "stderr", "text": "second\n"}]
    assert (result["stdout"], result["stderr"]) == ("first\n", "second\n")


def test_streamed_events_stop_at_the_limit_with_a_marker(root: Path):
    events = []

    async def on_event(event: dict) -> None:
        events.append(event)

    result = run(root, {"command": "seq 1 100000"}, on_event=on_event, output_limit=1000)
    streamed = "".join(e["text"] for e in events)
    assert streamed.startswith("".join(f"{i}\n" for i in range(1, 100))[:1000])
    assert streamed.endswith(f"[... output continues: full output in {result['stdout_path']} ...]\n")
    assert len(streamed) < 1200


def test_a_failing_event_handler_ends_the_command(root: Path):
    token = f"765.{uuid.uuid4().int % 10**6}"

    async def on_event(event: dict) -> None:
        raise ConnectionError("client went away")

    with pytest.raises(ConnectionError):
        run(root, {"command": f"echo hi; sleep {token}"}, on_event=on_event)
    assert processes_with(token) == []


# --- bad input: a clear 400 and nothing run -------------------------------------------------------


BAD_REQUESTS = [
    (["touch marker"], "the request body must be a JSON object, got list"),
    ({}, "give exactly one of 'command'"),
    ({"command": "touch marker", "argv": ["touch", "marker"]}, "not both"),
    ({"command": ["touch", "marker"]}, "'command' must be a non-empty string"),
    ({"command": "  "}, "'command' must be a non-empty string"),
    ({"command": "touch marker\0"}, "'command' contains a NUL character"),
    ({"argv": "touch marker"}, "'argv' must be a non-empty list of strings"),
    ({"argv": []}, "'argv' must be a non-empty list of strings"),
    ({"argv": ["touch", 5]}, "'argv' must be a non-empty list of strings"),
    ({"argv": ["", "marker"]}, "'argv' must start with the program to run"),
    ({"command": "touch marker", "shell": "bash"}, "unknown key 'shell'"),
    ({"command": "touch marker", "env": {"N": 1}}, "'env.N' must be a string, got int"),
    ({"command": "touch marker", "env": {"A=B": "x"}}, "invalid variable name 'A=B'"),
    ({"command": "touch marker", "env": ["A=B"]}, "'env' must be an object"),
    ({"command": "touch marker", "timeout": -1}, "'timeout' must be positive, got -1"),
    ({"command": "touch marker", "timeout": 0}, "'timeout' must be positive, got 0"),
    ({"command": "touch marker", "timeout": "10"}, "'timeout' must be a number of seconds, got '10'"),
    ({"command": "touch marker", "timeout": True}, "'timeout' must be a number of seconds, got True"),
    ({"command": "touch marker", "stdin": 5}, "'stdin' must be a string, got int"),
    ({"command": "touch marker", "stream": "yes"}, "'stream' must be true or false, got 'yes'"),
    ({"command": "touch marker", "cwd": 7}, "'cwd' must be a non-empty path string, got 7"),
    ({"command": "touch marker", "cwd": "no/such/dir"}, "'cwd' 'no/such/dir' is not an existing directory"),
    ({"command": "touch marker", "cwd": "user-files/file.txt"}, "is not an existing directory"),
]


def attempt(root: Path, request_body) -> GatewayError:
    """Run a bad request; return its error after checking that nothing ran or changed."""
    (root / "user-files" / "file.txt").write_text("x")
    os.symlink(root.parent / "bob", root / "escape")
    before = sorted(p.name for p in root.rglob("*"))
    with pytest.raises(GatewayError) as caught:
        run(root, request_body)
    assert sorted(p.name for p in root.rglob("*")) == before
    assert not (root / "marker").exists() and not (root.parent / "bob" / "marker").exists()
    return caught.value


@pytest.mark.parametrize("request_body, message", BAD_REQUESTS)
def test_bad_requests_are_400_and_run_nothing(root: Path, request_body, message: str):
    error = attempt(root, request_body)
    assert error.status == 400
    assert message in error.message


@pytest.mark.parametrize("cwd", ["../bob", "/etc", "/tmp", "escape", "escape/../../bob"])
def test_cwd_outside_the_tree_is_403_and_runs_nothing(root: Path, cwd: str):
    error = attempt(root, {"command": "touch marker", "cwd": cwd})
    assert (error.status, error.code) == (403, "outside_workspace")
    assert f"'cwd' {cwd!r} is outside the agent's workspace" in error.message


def test_stdin_over_the_cap_is_400_and_runs_nothing(root: Path):
    with pytest.raises(GatewayError) as caught:
        run(root, {"command": "cat > marker", "stdin": "z" * 101}, max_stdin=100)
    assert (caught.value.status, caught.value.code) == (400, "stdin_too_large")
    assert "101 bytes, over the limit of 100 bytes" in caught.value.message
    assert not (root / "marker").exists()
    assert run(root, {"command": "cat > marker", "stdin": "z" * 100}, max_stdin=100)["exit_code"] == 0
    assert (root / "marker").read_text() == "z" * 100
