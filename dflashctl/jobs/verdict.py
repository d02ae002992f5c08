"""The one verdict on a job, whoever asks (`status`, `watch`, `ls`): the supervisor's word where it has the newest one,
else the same pure judge (judge/fold.py, judge/health.py) run here, saying that it was.

The supervisor beside the job (agent/supervise.py) samples on its own clock and writes `verdict.json`. A reader takes
it while the supervisor is alive and its verdict is at least as new as every fact the reader sees (an exit status,
a stop request or its result written after the verdict are newer: then the reader judges, with the same code).
"""

from __future__ import annotations

from collections import deque

from dflashctl.judge import fold as folding
from dflashctl.judge.health import History, Thresholds, Verdict, assess
from dflashctl.model.jobfile import WatchConfig

FRESH_SLACK_S = 5.0  # a supervisor's verdict is current for two of its intervals and this much


def thresholds(cfg: WatchConfig) -> Thresholds:
    return Thresholds(cfg.stall_after_s, cfg.startup_budget_s or 3600.0, cfg.heartbeat_max_age_s, cfg.throughput_floor,
                      cfg.throughput_drop, cfg.slow_polls)  # fmt: skip


def _newest_fact(h: History) -> float:
    """When the newest fact a reader sees that ends or stops an attempt was written (remote clock)."""
    times = [h.exit_time, (h.stop_request or {}).get("time"), (h.stop_result or {}).get("time")]
    return max((t for t in times if isinstance(t, (int, float)) and not isinstance(t, bool)), default=0.0)


def supervised(here: Verdict, h: History, supervisor: dict | None) -> Verdict:
    """The supervisor's verdict where it is current; else `here`, with why the supervisor's was not taken."""
    if supervisor is None:  # a job launched without one (multi-node, Slurm, `supervise: false`, older releases)
        return here
    said = supervisor.get("verdict") if isinstance(supervisor.get("verdict"), dict) else None
    interval = folding.number(supervisor.get("interval_s")) or 60.0
    if supervisor.get("alive") and said and isinstance(said.get("state"), str):
        at = folding.number(said.get("time")) or 0.0
        current = h.now - at <= 2 * interval + FRESH_SLACK_S and at >= _newest_fact(h)
        if current:
            ev = [str(e) for e in said.get("evidence") or []][:12]
            ev.append(f"judged by the job's supervisor {max(0.0, h.now - at):.0f} s ago")
            step = said.get("step") if isinstance(said.get("step"), int) else here.step
            return Verdict(said["state"], str(said.get("reason") or ""), ev, said.get("advice") or here.advice, step)
    if supervisor.get("alive"):
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
    return supervised(assess(h, thresholds(job.watch)), h, sup), h
