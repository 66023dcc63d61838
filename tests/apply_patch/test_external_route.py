"""The operator's option: an external apply_patch binary, run in the command sandbox.

The reference binary is mounted read-only into the sandbox through a command
profile override, as an operator would install /usr/local/bin/apply_patch.
"""

from __future__ import annotations

import json
import os

from support import GatewayProcess

from kernel_gateway.tools.apply_patch import apply_patch

PROFILE = os.path.join(os.path.dirname(__file__), "..", "..", "kernel_gateway", "sandbox", "profiles", "command.json")
INSIDE = "/opt/reference/apply_patch"


def test_external_apply_patch_runs_sandboxed_and_matches_ours(tmp_path, reference):
    with open(PROFILE) as f:
        profile = json.load(f)
    profile["sandbox"]["read_only"].append({"from": os.path.realpath(reference), "at": INSIDE})
    (tmp_path / "command.json").write_text(json.dumps(profile))
    gw = GatewayProcess(
        tmp_path,
        f"--Gateway.command_profile={tmp_path / 'command.json'}",
        f"--Gateway.apply_patch_command={INSIDE}",
    ).start()
    try:
        gw.client.call("PUT", "/v1/agents/a")
        root = os.path.join(gw.root, "a")
        with open(os.path.join(root, "user-files", "f.txt"), "w") as f:
            f.write("one\ntwo\n")
        owner = os.stat(root)  # the agent's file, as if it had written it (sandboxes run as its uid)
        os.chown(os.path.join(root, "user-files", "f.txt"), owner.st_uid, owner.st_gid)
        ours_dir = tmp_path / "ours"
        (ours_dir / "user-files").mkdir(parents=True)
        (ours_dir / "user-files" / "f.txt").write_text("one\ntwo\n")
        patch = "*** Begin Patch\n*** Update File: user-files/f.txt\n@@\n one\n-two\n+2\n*** End Patch\n"
        status, body = gw.client.call("POST", "/v1/agents/a/patch", raw=patch.encode())
        ours = apply_patch(patch, ours_dir)
        assert status == 200 and body["ok"] is True
        assert body["output"] == ours.output
        with open(os.path.join(root, "user-files", "f.txt")) as f:
            assert f.read() == (ours_dir / "user-files" / "f.txt").read_text() == "one\n2\n"
        bad = "*** Begin Patch\n*** Update File: user-files/f.txt\n@@\n-nope\n+x\n*** End Patch\n"
        status, body = gw.client.call("POST", "/v1/agents/a/patch", raw=bad.encode())
        assert status == 422 and body["ok"] is False
        # The reference names the file by its absolute path: compare with the roots swapped.
        expected = apply_patch(bad, ours_dir).output.replace(str(ours_dir), root)
        assert body["output"] == expected and "Failed to find" in expected
    finally:
        gw.stop()


def test_external_apply_patch_takes_a_patch_past_one_argv_element(tmp_path, reference):
    """Linux caps one argv element at 128 KiB (E2BIG): the patch goes in on stdin."""
    with open(PROFILE) as f:
        profile = json.load(f)
    profile["sandbox"]["read_only"].append({"from": os.path.realpath(reference), "at": INSIDE})
    (tmp_path / "command.json").write_text(json.dumps(profile))
    gw = GatewayProcess(
        tmp_path,
        f"--Gateway.command_profile={tmp_path / 'command.json'}",
        f"--Gateway.apply_patch_command={INSIDE}",
    ).start()
    try:
        gw.client.call("PUT", "/v1/agents/a")
        lines = [f"line {n:07d} " + "x" * 40 for n in range(4000)]  # ~220 KiB
        patch = "*** Begin Patch\n*** Add File: user-files/big.txt\n" + "".join(f"+{l}\n" for l in lines)
        patch += "*** End Patch\n"
        assert len(patch.encode()) > 128 * 1024
        status, body = gw.client.call("POST", "/v1/agents/a/patch", raw=patch.encode())
        assert status == 200 and body["ok"] is True, body
        with open(os.path.join(gw.root, "a", "user-files", "big.txt")) as f:
            assert f.read() == "".join(f"{l}\n" for l in lines)
    finally:
        gw.stop()
