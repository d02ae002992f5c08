"""The supervisor's files in a run dir, and what a probe reports of them (kept apart from agent/supervise.py, which
imports the probe to take its snapshots)."""

from __future__ import annotations

import os

from .common import read_json, start_time

SPEC, STATE, VERDICT, LOCK = "supervise.json", "supervisor.json", "verdict.json", ".supervisor.lock"


def state(run_dir: str) -> dict | None:
    """What a probe reports of the supervisor: whether one is expected, alive (pid and start time), its verdict."""
    if not os.path.isfile(os.path.join(run_dir, SPEC)):
        return None
    me = read_json(os.path.join(run_dir, STATE))
    me = me if isinstance(me, dict) else {}
    pid, start = me.get("pid"), me.get("start")
    alive = isinstance(pid, int) and start is not None and start_time(pid) == start and not me.get("ended")
    verdict = read_json(os.path.join(run_dir, VERDICT))
    return {"alive": bool(alive), "pid": pid, "interval_s": me.get("interval_s"), "ended": me.get("ended"),
            "verdict": verdict if isinstance(verdict, dict) else None}  # fmt: skip
