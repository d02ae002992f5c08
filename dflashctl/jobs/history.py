"""`report`'s data: each job's metrics, GPU history and watch decisions, one remote call per job."""

from __future__ import annotations

from dflashctl.errors import RefusedError
from dflashctl.jobs.find import find_job
from dflashctl.jobs.registry import JobRecord
from dflashctl.jobs.secrets import redactor
from dflashctl.remote import session
from dflashctl.remote.connect import open_runner


def histories(specs: list[str], project: str, accept_new: bool = False) -> list[tuple[JobRecord, dict]]:
    """Each job's metrics, GPU history and watch decisions, one remote call per job (running or finished).
    No spec: the newest job of the project."""
    jobs = [find_job(s, project) for s in specs] if specs else [find_job(None, project)]
    out = []
    for job in jobs:
        with open_runner(job.host, accept_new) as runner:
            hist = session.call_agent(runner, {"action": "history", "run_dir": job.run_dir, "gpus": False})
        if not hist.get("run_dir_exists"):
            raise RefusedError(f"{job.id}: its run dir {job.run_dir} is gone from {job.host_name}")
        out.append((job, redactor(job).deep(hist)))
    return out
