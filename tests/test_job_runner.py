"""The job runner's steps directly (real bwrap, no server): what an agent's own tree can do to them.

The agent owns ``jobs/<id>/``: it can swap any part of it for a symlink at any
moment.  The gateway must then refuse, never act on what the symlink points at.
"""

from __future__ import annotations

import asyncio
import os
import pathlib

import pytest

from kernel_gateway import job_runner
from kernel_gateway.jobs import Job
from kernel_gateway.sandbox.profile import load_profile
from kernel_gateway.sessions import SessionManager
from kernel_gateway.settings import Gateway
from kernel_gateway.tools.workspace_paths import PathOutsideRoot


@pytest.fixture
def setup(tmp_path):
    settings = Gateway(root=str(tmp_path / "agents"), state_dir=str(tmp_path / "state")).resolved()
    sessions = SessionManager(settings)
    for agent in ("alice", "bob"):
        sessions.ensure_agent(agent)
    bob_files = pathlib.Path(settings.root) / "bob" / "user-files"
    (bob_files / "private.txt").write_text("bob's\n")
    job = Job(id="0123456789ab", agent="alice", kind="command", source="user-files", seq=1, created=0.0,
              command=["/bin/sh", "-c", "echo x > pwned.txt"], limits={})
    ctx = job_runner.Context(
        agent_root=sessions.agent_root("alice"),
        values=sessions.sandbox_values("alice"),
        command_profile=load_profile("command"),
        job_profile=load_profile("job"),
        bwrap=None,
        cgroup_name=f"{sessions.cgroup_prefix}-job-test",
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
    assert listing(workspace) == [".codex", "base", "base/a.txt", "skills", "temp", "tree", "tree/a.txt"]
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
