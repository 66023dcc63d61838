"""Per-agent disk quota: a real gateway, real loop-mounted ext4 images, real writes past the quota."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from kernel_gateway.sandbox import quota
from support import GatewayProcess, wait_until

pytestmark = pytest.mark.skipif(quota.unavailable() is not None, reason=f"no disk quota here: {quota.unavailable()}")
QUOTA = "24M"
FILL = "dd if=/dev/zero of=big bs=1M count=64 2>&1; echo dd=$?; sync"
FILL_FROM_KERNEL = r"""
import errno
try:
    with open("fill.bin", "wb") as f:
        for _ in range(64):
            f.write(b"\0" * (1 << 20))
            f.flush()
            os.fsync(f.fileno())
    print("WROTE ALL")
except OSError as e:
    print("ERRNO", errno.errorcode[e.errno])
"""


def _unmount_all(root: str) -> None:
    """Unmount every agent's image (a sandbox's bwrap parent may hold its cwd there a moment longer)."""
    if not os.path.isdir(root):
        return
    for agent in os.listdir(root):
        top = os.path.join(root, agent)

        def unmounted() -> bool:
            while quota.mounted_source(top):
                if subprocess.run(["umount", top], capture_output=True).returncode != 0:
                    return False
            return True

        assert wait_until(unmounted, timeout=20), f"{top} stays busy"


@pytest.fixture
def quota_gateway(tmp_path):
    gw = GatewayProcess(tmp_path, f"--Gateway.disk_quota={QUOTA}").start()
    yield gw
    gw.stop()
    _unmount_all(gw.root)


def _command(gw, agent: str, command: str) -> dict:
    status, body = gw.client.call("POST", f"/v1/agents/{agent}/commands", {"command": command})
    assert status == 200, body
    return body


def _allocated(path: str) -> int:
    return os.stat(path).st_blocks * 512


def test_writing_past_the_quota_fails_with_enospc_and_others_carry_on(quota_gateway):
    gw = quota_gateway
    for agent in ("filler", "other"):
        assert gw.client.call("PUT", f"/v1/agents/{agent}")[0] == 201
    image = quota.image_path(gw.state, "filler")
    top = os.path.join(gw.root, "filler")
    assert quota.mounted_source(top).startswith("/dev/loop")
    assert sorted(os.listdir(top)) == sorted(["SOUL.md", "MISSION.md", "DESIGN.md", "user-files",
                                              "installed-skills", "sessions", "jobs"])  # fmt: skip

    # A command fills the quota: dd stops with ENOSPC.
    body = _command(gw, "filler", f"cd {top} && " + FILL)
    assert "No space left on device" in body["stdout"], body
    assert "dd=1" in body["stdout"]
    # A kernel of the same agent shares the tree, so it finds the disk full too.
    status, result = gw.client.execute("filler", "k", FILL_FROM_KERNEL)
    assert status == 200 and result["status"] == "ok", result
    assert "ERRNO ENOSPC" in result["text"]
    # What the agent wrote is inside its image; the image never outgrew the quota.
    assert _allocated(image) <= 24 << 20
    assert os.path.getsize(image) == 24 << 20

    # Meanwhile another agent's kernel and commands work, and so does the gateway.
    status, result = gw.client.execute("other", "s", "print(6 * 7)")
    assert status == 200 and result["status"] == "ok" and result["text"] == "42\n"
    body = _command(gw, "other", f"cd {gw.root}/other && dd if=/dev/zero of=ok.bin bs=1M count=4 2>/dev/null; echo dd=$?")
    assert "dd=0" in body["stdout"]
    status, info = gw.client.call("GET", "/v1/info")
    assert status == 200
    assert info["sandbox"]["disk_quota"] == {"mechanism": quota.MECHANISM, "size": 24 << 20}
    assert gw.client.call("PUT", "/v1/agents/third")[0] == 201  # the state directory still takes writes
    assert "third" in {a["agent"] for a in gw.client.call("GET", "/v1/agents")[1]["agents"]}
    # Fill the last blocks too: then what the gateway writes for the agent gets a clear 507.
    _command(gw, "filler", f"cd {top} && dd if=/dev/zero of=big2 bs=1K count=8000; dd if=/dev/zero of=big3 bs=64 count=8000")
    files_before = sorted(os.listdir(os.path.join(top, "user-files")))
    sessions_before = sorted(os.listdir(os.path.join(top, "sessions")))
    status, refused = gw.client.call("POST", "/v1/agents/filler/sessions", {"session": "new"})
    assert (status, refused["error"]["code"]) == (507, "disk_full"), refused
    status, refused = gw.client.call("PUT", "/v1/agents/filler/notebooks/user-files/a.ipynb", {"cells": []})
    assert (status, refused["error"]["code"]) == (507, "disk_full"), refused
    assert "disk quota" in refused["error"]["hint"]
    assert sorted(os.listdir(os.path.join(top, "user-files"))) == files_before
    assert sorted(os.listdir(os.path.join(top, "sessions"))) == sessions_before
    status, result = gw.client.execute("other", "s", "print(7 * 6)")
    assert status == 200 and result["text"] == "42\n"
    assert gw.client.call("GET", "/v1/info")[0] == 200
    assert "Traceback" not in open(gw.log).read()

    # And once the agent frees space, it can write again.
    body = _command(gw, "filler", f"cd {top} && rm -f big big2 big3 sessions/*/fill.bin && echo hi > small.txt && cat small.txt")
    assert body["exit_code"] == 0 and body["stdout"] == "hi\n"
    assert gw.client.call("POST", "/v1/agents/filler/sessions", {"session": "new"})[0] == 201
    assert gw.client.call("PUT", "/v1/agents/filler/notebooks/user-files/a.ipynb", {"cells": []})[0] == 201


def test_the_mount_is_nosuid_and_nodev(quota_gateway):
    gw = quota_gateway
    assert gw.client.call("PUT", "/v1/agents/alice")[0] == 201
    with open("/proc/self/mountinfo") as f:
        (line,) = [line for line in f if line.split()[4] == os.path.realpath(os.path.join(gw.root, "alice"))]
    options = line.split()[5].split(",")
    assert "nosuid" in options and "nodev" in options


def test_restarts_and_kill_9_keep_the_agents_disk(tmp_path):
    gw = GatewayProcess(tmp_path, f"--Gateway.disk_quota={QUOTA}").start()
    try:
        assert gw.client.call("PUT", "/v1/agents/alice")[0] == 201
        note = os.path.join(gw.root, "alice", "user-files", "note.txt")  # the same path inside the sandbox
        assert _command(gw, "alice", f"echo kept > {note}")["exit_code"] == 0
        gw.stop()
        gw.start()  # a clean restart: the image is still mounted, and reused
        assert _command(gw, "alice", f"cat {note}")["stdout"] == "kept\n"
        gw.stop(signal.SIGKILL)
        gw.start()
        status, result = gw.client.execute("alice", "s", f"print(open({note!r}).read())")
        assert status == 200 and result["text"] == "kept\n\n"
        # As after a reboot: the image is not mounted; the next start mounts it again.
        gw.stop()
        _unmount_all(gw.root)
        assert os.listdir(os.path.join(gw.root, "alice")) == []
        gw.start()
        assert quota.mounted_source(os.path.join(gw.root, "alice"))
        assert _command(gw, "alice", f"cat {note}")["stdout"] == "kept\n"
    finally:
        gw.stop()
        _unmount_all(gw.root)


def test_an_existing_tree_outside_an_image_is_refused_not_hidden(tmp_path):
    plain = GatewayProcess(tmp_path).start()
    try:
        assert plain.client.call("PUT", "/v1/agents/bob")[0] == 201
    finally:
        plain.stop()
    gw = GatewayProcess(tmp_path, f"--Gateway.disk_quota={QUOTA}")
    try:
        with pytest.raises(RuntimeError, match="agent 'bob' already has files in .*outside a disk image"):
            gw.start()
        assert quota.mounted_source(os.path.join(gw.root, "bob")) is None
        assert "SOUL.md" in os.listdir(os.path.join(gw.root, "bob"))  # nothing hidden, nothing changed
        assert not os.path.exists(quota.image_path(gw.state, "bob"))
    finally:
        gw.stop()
        _unmount_all(gw.root)


@pytest.mark.parametrize(("value", "words"), [("12Q", "'12Q'"), ("1M", "at least 8M"), ("-5", "'-5'")])
def test_a_bad_quota_setting_stops_the_gateway_from_starting(tmp_path, value, words):
    gw = GatewayProcess(tmp_path, f"--Gateway.disk_quota={value}")
    with pytest.raises(RuntimeError) as refused:
        gw.start()
    assert "disk_quota" in str(refused.value) and words in str(refused.value)
    assert not os.path.exists(os.path.join(gw.state, "disks"))


def test_without_a_quota_info_says_none(tmp_path):
    gw = GatewayProcess(tmp_path).start()
    try:
        info = gw.client.call("GET", "/v1/info")[1]
        assert info["sandbox"]["disk_quota"]["mechanism"] == "none"
        assert "off" in info["sandbox"]["disk_quota"]["reason"]
        assert "per agent" in info["sandbox"]["cpu"]
        assert info["sandbox"]["profiles"]["kernel"] == {"seccomp": True, "nested_userns": False}
        assert info["sandbox"]["seccomp_filter"].startswith("53 syscalls denied with EPERM (libseccomp, ")
    finally:
        gw.stop()
