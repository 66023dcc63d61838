"""The job runner's steps directly (real bwrap, no server): what an agent's own tree can do to them.

The agent owns ``jobs/<id>/``: it can swap any part of it for a symlink at any
moment.  The gateway must then refuse, never act on what the symlink points at.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import pathlib

import pytest

from kernel_gateway import job_runner
from kernel_gateway.jobs import Job
from kernel_gateway.sandbox.profile import load_profile
from kernel_gateway.core import Core
from kernel_gateway.settings import Gateway
from kernel_gateway.fs import PathOutsideRoot


@pytest.fixture
def setup(tmp_path):
    settings = Gateway(root=str(tmp_path / "agents"), state_dir=str(tmp_path / "state")).resolved()
    core = Core(settings)
    for agent in ("alice", "bob"):
        core.agents.ensure_agent(agent)
    bob_files = pathlib.Path(settings.root) / "bob" / "user-files"
    (bob_files / "private.txt").write_text("bob's\n")
    job = Job(id="0123456789ab", agent="alice", kind="command", source="user-files", seq=1, created=0.0,
              command=["/bin/sh", "-c", "echo x > pwned.txt"], limits={})
    ctx = job_runner.Context(
        agent_root=core.agents.agent_root("alice"),
        values=core.agents.sandbox_values("alice"),
        command_profile=load_profile("command"),
        job_profile=load_profile("job"),
        bwrap=None,
        cgroup_name=f"{core.pool.cgroup_prefix}-job-test",
        run_as=core.agents.uids.run_as("alice"),  # as the gateway's jobs do: the agent's own uid
    )
    return ctx, job, bob_files


def listing(path: pathlib.Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_copy_makes_the_workspace_and_refuses_an_existing_one(setup):
    ctx, job, _ = setup
    files = pathlib.Path(ctx.agent_root) / "user-files"
    (files / "a.txt").write_text("a\n")
    assert asyncio.run(job_runner.copy_in(ctx, job)) == []
    workspace = pathlib.Path(ctx.agent_root) / job.workspace
    assert listing(workspace) == ["base", "base/a.txt", "skills", "temp", "tree", "tree/a.txt"]
    with pytest.raises(Exception, match="copy_failed|File exists"):
        asyncio.run(job_runner.copy_in(ctx, job))


def test_a_job_directory_swapped_for_a_symlink_out_is_refused(setup):
    ctx, job, bob_files = setup
    before = listing(bob_files)
    jobs = pathlib.Path(ctx.agent_root) / "jobs"
    (jobs / job.id).symlink_to("../../bob/user-files")  # what an agent can do to its own tree
    with pytest.raises((OSError, PathOutsideRoot)):
        asyncio.run(job_runner.run_main(ctx, job, asyncio.Event(), None))
    with pytest.raises((OSError, PathOutsideRoot)):
        asyncio.run(job_runner.make_patch(ctx, job, partial=False))
    assert listing(bob_files) == before


def test_a_job_directory_swapped_for_a_symlink_inside_is_refused_too(setup):
    ctx, job, _ = setup
    root = pathlib.Path(ctx.agent_root)
    (root / "user-files" / "elsewhere").mkdir()
    for name in ("tree", "base", "temp", "skills"):
        (root / "user-files" / "elsewhere" / name).mkdir()
    (root / "jobs" / job.id).symlink_to("../user-files/elsewhere")
    with pytest.raises(OSError):
        asyncio.run(job_runner.make_patch(ctx, job, partial=False))
    assert not (root / "user-files" / "elsewhere" / "change.patch").exists()


def test_logs_swapped_for_symlinks_are_refused(setup):
    ctx, job, bob_files = setup
    asyncio.run(job_runner.copy_in(ctx, job))
    workspace = pathlib.Path(ctx.agent_root) / job.workspace
    (workspace / "stdout.log").symlink_to("../../../bob/user-files/private.txt")
    with pytest.raises((OSError, PathOutsideRoot)):
        asyncio.run(job_runner.run_main(ctx, job, asyncio.Event(), None))
    assert (bob_files / "private.txt").read_text() == "bob's\n"


def summarize(text: bytes) -> dict:
    summary = job_runner.PatchSummary()
    for i in range(0, len(text), 7):  # in small chunks: lines cut across reads
        summary.feed(text[i:i + 7])
    return summary.result()


def test_patch_summary_is_not_fooled_by_lines_that_look_like_headers():
    patch = (
        b"diff -ruN --no-dereference base/a.txt tree/a.txt\n"
        b"--- base/a.txt\t2026-01-01 00:00:00.000000000 +0000\n"
        b"+++ tree/a.txt\t2026-01-01 00:00:01.000000000 +0000\n"
        b"@@ -1,2 +1,3 @@\n"
        b" keep\n"
        b"-- base/evil\n"
        b"+++ tree/evil\n"
        b"+Binary files base/x and tree/x differ\n"
        b"\\ No newline at end of file\n"
        b"Binary files base/img.png and tree/img.png differ\n"
        b"Only in tree: fifo\n"
        b"diff -ruN --no-dereference base/new file.txt tree/new file.txt\n"
        b"--- base/new file.txt\t1970-01-01 00:00:00.000000000 +0000\n"
        b"+++ tree/new file.txt\t2026-01-01 00:00:01.000000000 +0000\n"
        b"@@ -0,0 +1 @@\n"
        b"+x"
    )
    result = summarize(patch)
    assert result["files"] == ["a.txt", "new file.txt"]
    assert result["binary_files"] == ["img.png"] and result["not_carried"] == ["tree/fifo"]
    assert result["bytes"] == len(patch)
    assert result["sha256"] == hashlib.sha256(patch).hexdigest()
