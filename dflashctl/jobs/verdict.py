"""The one verdict on a job, whoever asks (`status`, `ls`, `watch`, `kill`): a `Judge` (judge/report.py) made for
the job's record, the same one the supervisor beside the job asks. This module only builds it from a JobRecord."""

from __future__ import annotations

from dflashctl.judge.facts import Thresholds
from dflashctl.judge.policy import Policy
from dflashctl.judge.report import Judge
from dflashctl.model.jobfile import WatchConfig
from dflashctl.model.record import JobRecord


def thresholds(cfg: WatchConfig) -> Thresholds:
    return Thresholds.of(cfg.model_dump())


def policy(cfg: WatchConfig) -> Policy:
    return Policy.of(cfg.model_dump())


def judge_for(job: JobRecord, is_trainer: bool | None = None) -> Judge:
    """A Judge for one host of the job (`is_trainer` False for the other nodes of a job over several hosts: only
    the head writes metrics and the heartbeat)."""
    return Judge(
        job.id,
        job.host_name,
        thresholds(job.watch),
        is_trainer=job.is_trainer if is_trainer is None else is_trainer,
        kill_grace_s=job.kill_grace_s,
        gpus=list(job.gpus),
        scheduled=job.scheduler == "slurm",
        total_steps=job.steps,
        max_restarts=job.watch.max_restarts,
        restarts=job.restarts,
        last_state=job.state,
    )
