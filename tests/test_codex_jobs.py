"""The codex kind end to end: the real Codex CLI in the job sandbox, a scripted model, no internet.

The model is ``tests/responses_server.py`` on 127.0.0.1, speaking the Responses
API over server-sent events.  Codex jobs have no network: the job reaches the
model through the gateway's forwarder (a Unix socket bound into the sandbox),
which puts the real key in place of the job's dummy token.  The first turn
asks Codex to run a shell line that edits a file in the job's tree; the second
ends with a message.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest

from responses_server import ScriptedResponses, message_turn, tool_call_turn, tool_names
from support import GatewayProcess, wait_until

ROOT = pathlib.Path(__file__).resolve().parent.parent
CODEX = ROOT / ".reference" / "bin" / "codex"
KEY = "sk-scripted-test-key-3f9a"
FINAL = "Changed greeting.txt to say hello, world; checked it with cat."

pytestmark = pytest.mark.skipif(
    not CODEX.exists(), reason="no Codex binary: run `bash tests/apply_patch/get_reference.sh`"
)


def test_codex_job_edits_the_tree_and_ends_with_its_last_message(tmp_path, monkeypatch):
    seen = {}

    def first(body):
        seen["tools"] = tool_names(body)
        seen["prompt"] = json.dumps(body.get("input"))
        return tool_call_turn("resp-1", "call-1", "exec_command",
                              {"cmd": "printf 'hello, world\\n' > greeting.txt && echo niceness=$(nice) home=$CODEX_HOME"})

    def second(body):
        seen["outputs"] = [i for i in body["input"] if i.get("type") == "function_call_output"]
        return message_turn("resp-2", FINAL)

    monkeypatch.setenv("SCRIPTED_MODEL_KEY", KEY)
    with ScriptedResponses([first, second]) as model:
        models = {"heavy": {"provider": "scripted", "model": "gpt-5-codex", "base_url": model.base_url,
                            "env_key": "SCRIPTED_MODEL_KEY"}}
        gw = GatewayProcess(tmp_path, f"--Gateway.codex_command={CODEX}",
                            f"--Gateway.model_profiles={json.dumps(models)}").start()
        try:
            gw.client.call("PUT", "/v1/agents/alice")
            repo = pathlib.Path(gw.root) / "alice" / "user-files" / "repo"
            repo.mkdir(parents=True)
            (repo / "greeting.txt").write_text("hello\n")
            (repo / "other.txt").write_text("untouched\n")
            owner = os.stat(pathlib.Path(gw.root) / "alice")  # the agent's own files, as if it wrote them
            for where in (repo, *repo.iterdir()):
                os.chown(where, owner.st_uid, owner.st_gid, follow_symlinks=False)
            status, job = gw.client.call("POST", "/v1/agents/alice/jobs", {
                "kind": "codex", "from": "user-files/repo", "objective": "Make greeting.txt say hello, world.",
            })
            assert status == 201, job
            status, job = gw.client.call("GET", f"/v1/agents/alice/jobs/{job['id']}?wait=1", timeout=300)
            assert status == 200
            assert job["state"] == "succeeded", job
            assert job["stdout_tail"] == FINAL + "\n"  # Codex's last message is its stdout
            assert job["patch"]["files"] == ["greeting.txt"] and job["patch"]["binary_files"] == []
            status, patch = gw.client.call("GET", f"/v1/agents/alice/jobs/{job['id']}/patch")
            hunks = [line for line in patch.decode().splitlines() if line[:1] in "+-@ " and not line.startswith(("+++", "---"))]
            assert hunks == ["@@ -1 +1 @@", "-hello", "+hello, world"]

            # What Codex was given and sent: our tools, our preamble, the tool's output back.
            assert "exec_command" in seen["tools"]
            assert "make in its files the change this objective asks" in seen["prompt"]
            assert "Make greeting.txt say hello, world." in seen["prompt"]
            assert [o["call_id"] for o in seen["outputs"]] == ["call-1"]
            # Codex ran the line niced, with its home in the sandbox's own /tmp (what Codex returned to the model).
            assert "niceness=10 home=/tmp/codex-home" in seen["outputs"][0]["output"]
            # The model saw the real key, which the gateway's forwarder put in place of the job's token.
            headers = {k.lower(): v for k, v in model.requests[0]["headers"].items()}
            assert headers.get("authorization") == f"Bearer {KEY}"

            # The key never entered the sandbox: not in the job's files; Codex's config is not there either.
            workspace = pathlib.Path(job["workspace"])
            assert not (workspace / ".codex").exists()
            found = subprocess.run(["grep", "-rl", KEY, str(workspace)], capture_output=True, text=True)
            assert found.stdout == ""

            # And it applies to the agent's own files.
            status, applied = gw.client.call("POST", f"/v1/agents/alice/jobs/{job['id']}/apply")
            assert status == 200, applied
            assert (repo / "greeting.txt").read_text() == "hello, world\n"
            assert (repo / "other.txt").read_text() == "untouched\n"
        finally:
            gw.stop()


def test_codex_job_without_a_model_is_refused_and_creates_nothing(tmp_path):
    gw = GatewayProcess(tmp_path, f"--Gateway.codex_command={CODEX}").start()
    try:
        gw.client.call("PUT", "/v1/agents/alice")
        (pathlib.Path(gw.root) / "alice" / "user-files" / "repo").mkdir()
        status, body = gw.client.call("POST", "/v1/agents/alice/jobs",
                                      {"kind": "codex", "from": "user-files/repo", "objective": "x"})
        assert status == 409 and body["error"]["code"] == "no_model"
        assert os.listdir(os.path.join(gw.root, "alice", "jobs")) == []
        assert gw.client.call("GET", "/v1/agents/alice/jobs")[1] == {"jobs": []}
    finally:
        gw.stop()
