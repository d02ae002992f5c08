"""Pure: the one restart policy. The supervisor beside the job and a watch that decides (no supervisor answers)
both ask `next_move`; nobody else computes a backoff. Times are the decider's monotonic clock (`failed_at`, `now`):
a wall clock stepped by hours delays no restart by more than one interval.
"""

from __future__ import annotations

from dataclasses import dataclass

from .facts import FAILURES, TERMINAL

WAIT, RESTART, GIVE_UP = "wait", "restart", "give_up"


@dataclass
class Policy:
    restart_on: tuple = ()  # the states restarted
    max_restarts: int = 0
    backoff_s: float = 0.0  # the first restart waits this long, each next one twice as long

    @classmethod
    def of(cls, watch: dict) -> Policy:
        """From a job file's `watch` as a mapping (what the CLI validated, what the supervisor reads)."""
        on = tuple(s for s in watch.get("restart_on") or () if isinstance(s, str))
        return cls(on, int(watch.get("max_restarts") or 0), float(watch.get("backoff_s") or 0.0))


@dataclass
class Move:
    kind: str  # WAIT (keep watching; `wait_s`: until the backoff ends, None: the usual interval), RESTART, GIVE_UP
    why: str = ""
    wait_s: float | None = None
    refused: bool = False  # GIVE_UP of a state the policy restarts (the budget spent, the supervisor gave up)


def backoff_s(policy: Policy, restarts: int) -> float:
    return policy.backoff_s * (2**restarts)


def next_move(report, restarts: int, policy: Policy, failed_at: float | None, now: float) -> Move:
    """What to do after `report` (a judge Report: state, stop_requested, gave_up). `failed_at`: when this failure
    was first seen, on the same monotonic clock as `now` (None: just now)."""
    state = report.state
    if report.stop_requested:
        return Move(GIVE_UP, f"stopped: {state}") if state in TERMINAL else Move(WAIT)
    if state in policy.restart_on:
        if report.gave_up:
            return Move(GIVE_UP, "the job's supervisor gave up on it", refused=True)
        if restarts >= policy.max_restarts:
            return Move(GIVE_UP, f"max_restarts ({policy.max_restarts}) reached", refused=True)
        left = backoff_s(policy, restarts) - (now - failed_at if failed_at is not None else 0.0)
        return Move(WAIT, f"restart {restarts + 1} in {left:.0f} s", max(0.0, left)) if left > 0 else Move(RESTART)
    if state in TERMINAL:  # a failure not restarted, or an end
        return Move(GIVE_UP, f"{state} is not in the job's restart_on" if state in FAILURES else state)
    return Move(WAIT)
