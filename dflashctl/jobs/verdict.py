"""The one verdict on a job, whoever asks (`status`, `watch`, `ls`, the supervisor): the same pure judge (judge/fold.py,
judge/health.py) on the same facts, the run dir's progress history, which the supervisor keeps current.

The supervisor beside the job (agent/supervise.py) samples on its own clock, keeps that history and writes
`verdict.json`. A reader's own look is newer than the supervisor's last sample and judges the same history with the
same code, so it says what the supervisor would say now; taking the supervisor's older word instead would make a
crash or a stall wait up to one of its intervals to be seen. So the reader judges, and says how the supervisor's
word compares: it agrees, it said something else at its last sample (and when), or it is gone (and why: then
nothing restarts the job without a `dflashctl watch`).
"""

from __future__ import annotations

from collections import deque

from dflashctl.judge import fold as folding
from dflashctl.judge.assess import assess
from dflashctl.judge.facts import TERMINAL, History, Thresholds, Verdict
from dflashctl.model.jobfile import WatchConfig

FRESH_SLACK_S = 5.0  # a supervisor's differing word is said for two of its intervals and this much


def thresholds(cfg: WatchConfig) -> Thresholds:
    return Thresholds.of(cfg.model_dump())


def _same_attempt(said: dict, h: History, restarts: int | None) -> bool:
    """The verdict is of the attempt the reader sees: the same restart count, the same start."""
    if restarts is not None and said.get("restarts") != restarts:
        return False
    start = folding.number(said.get("attempt_start"))
    return start is None or not h.started_at or abs(start - h.started_at) < 2.0


def supervised(here: Verdict, h: History, supervisor: dict | None, restarts: int | None = None) -> Verdict:
    """`here`, with the supervisor's word beside it. `restarts`: the run dir's restart count in the reader's
    snapshot (a verdict of an earlier attempt says nothing of this one)."""
    if supervisor is None:  # a job launched without one (multi-node, Slurm, `supervise: false`, older releases)
        return here
    said = supervisor.get("verdict") if isinstance(supervisor.get("verdict"), dict) else None
    interval = folding.number(supervisor.get("interval_s")) or 60.0
    if supervisor.get("alive"):
        if said and isinstance(said.get("state"), str) and _same_attempt(said, h, restarts):
            at = folding.number(said.get("time")) or 0.0
            ago = max(0.0, h.now - at)
            if said["state"] == here.state:
                here.evidence.append(f"the job's supervisor agrees ({ago:.0f} s ago)")
            elif ago <= 2 * interval + FRESH_SLACK_S:
                here.evidence.append(f"the job's supervisor said {said['state']} at its last sample, {ago:.0f} s ago")
        return here
    if here.state in TERMINAL:  # a supervisor that ended with its job is no news
        return here
    ended = supervisor.get("ended")
    why = f"it ended ({ended})" if ended else "it is not running"
    here.evidence.append(f"the job's supervisor is gone ({why}): judged here; restarts need a `dflashctl watch`")
    return here


def judge(job, snap: dict, last_state: str | None = None) -> tuple[Verdict, History]:
    """The verdict on one snapshot of a single-host job (what `status` and `ls` ask): the fold, the judge, the
    supervisor's word."""
    h = History(started_at=0.0, is_trainer=job.is_trainer, kill_grace_s=job.kill_grace_s)
    folding.fold(h, snap, folding.Job(list(job.gpus), job.scheduler == "slurm"), deque(maxlen=400),
                 last_state=last_state or job.state)  # fmt: skip
    sup = snap.get("supervisor") if isinstance(snap.get("supervisor"), dict) else None
    restarts = snap.get("restarts") if isinstance(snap.get("restarts"), int) else None
    return supervised(assess(h, thresholds(job.watch)), h, sup, restarts), h
