"""Routes of Background Agent Jobs: thin handlers over :class:`kernel_gateway.jobs.JobManager`."""

from __future__ import annotations

from ..jobs import check_job_id
from .base import BaseHandler


class JobsHandler(BaseHandler):
    tool = "job"

    def post(self, agent: str) -> None:
        agent = self.agent_arg(agent)
        self.core.agents.require_agent(agent)
        body = self.json_value(self.request.body or b"{}")
        self.send_json(self.core.jobs.submit(agent, body), 201)

    def get(self, agent: str) -> None:
        agent = self.agent_arg(agent)
        self.core.agents.require_agent(agent)
        self.send_json({"jobs": self.core.jobs.list(agent)})


class _OneJob(BaseHandler):
    tool = "job"

    def _job_args(self, agent: str, job_id: str) -> tuple[str, str]:
        agent = self.agent_arg(agent)
        self.core.agents.require_agent(agent)
        return agent, check_job_id(job_id)


class JobHandler(_OneJob):
    async def get(self, agent: str, job_id: str) -> None:
        agent, job_id = self._job_args(agent, job_id)
        jobs = self.core.jobs
        if self.query_bool("wait"):
            self.send_json(await jobs.wait(agent, job_id))
        else:
            self.send_json(jobs.render(jobs.get(agent, job_id)))

    async def delete(self, agent: str, job_id: str) -> None:
        agent, job_id = self._job_args(agent, job_id)
        await self.core.jobs.delete(agent, job_id)
        self.send_json({"deleted": job_id})


class JobPatchHandler(_OneJob):
    async def get(self, agent: str, job_id: str) -> None:
        agent, job_id = self._job_args(agent, job_id)
        # Reading the patch (up to --Gateway.job_patch_limit) and hashing it is not for the loop.
        data, patch = await self.off_loop(self.core.jobs.patch_bytes, agent, job_id)
        self.set_header("Content-Type", "text/x-diff; charset=utf-8")
        self.set_header("X-Patch-SHA256", patch["sha256"])
        self._bytes_out += len(data)
        self.finish(data)


class JobApplyHandler(_OneJob):
    async def post(self, agent: str, job_id: str) -> None:
        agent, job_id = self._job_args(agent, job_id)
        self.json_body({})
        self.send_json(await self.core.jobs.apply(agent, job_id))


class JobCancelHandler(_OneJob):
    def post(self, agent: str, job_id: str) -> None:
        agent, job_id = self._job_args(agent, job_id)
        self.json_body({})
        self.send_json(self.core.jobs.cancel(agent, job_id))


def routes() -> list[tuple[str, type]]:
    job = r"/v1/agents/([^/]+)/jobs/([^/]+)"
    return [
        (r"/v1/agents/([^/]+)/jobs", JobsHandler),
        (job, JobHandler),
        (job + r"/patch", JobPatchHandler),
        (job + r"/apply", JobApplyHandler),
        (job + r"/cancel", JobCancelHandler),
    ]
