"""The judge's front door, pure (no I/O, no clock): the state table, the one restart policy, and a Judge whose ages are
its own monotonic clock's whatever the snapshots' wall stamps do."""

from __future__ import annotations

import pytest

from dflashctl.jobs.poller import ELSEWHERE, seen_restarted
from dflashctl.judge import facts
from dflashctl.judge.cause import bounded, recorded
from dflashctl.judge.policy import GIVE_UP, RESTART, WAIT, Policy, next_move
from dflashctl.judge.report import HERE, SUPERVISOR, Judge, Report


def test_one_state_table_gives_every_list():
    codes = [s.code for s in facts.STATES if s.code]
    assert len(codes) == len(set(codes)), "a non-zero exit code names one state"
    assert facts.EXIT_BY_STATE["NCCL_ERROR"] == 31 and "NCCL_ERROR" in facts.FAILURES + facts.TERMINAL
    assert "connection reset" in facts.ADVICE["NCCL_ERROR"].lower()
    assert set(facts.FAILURES) == {s.name for s in facts.STATES if s.failure}
    assert "STALLED" in facts.FAILURES and "STALLED" not in facts.TERMINAL  # a stall can end
    assert "KILLED" in facts.TERMINAL and "KILLED" not in facts.FAILURES
    text = facts.exit_codes_help()
    assert "31 NCCL_ERROR" in text and text.startswith("0 STARTING, RUNNING")
    assert facts.exit_code("NO_SUCH") == 1


def report(state: str, **kw) -> Report:
    return Report("j", "h", state, "why", **kw)


POLICY = Policy(("CRASHED", "STALLED"), max_restarts=2, backoff_s=6.0)


@pytest.mark.parametrize(
    ("r", "restarts", "failed_at", "now", "kind"),
    [
        (report("RUNNING"), 0, None, 0.0, WAIT),
        (report("CRASHED"), 0, 100.0, 103.0, WAIT),  # 3 s into a 6 s backoff
        (report("CRASHED"), 0, 100.0, 106.0, RESTART),
        (report("CRASHED"), 1, 100.0, 106.0, WAIT),  # the second waits 12 s
        (report("CRASHED"), 2, 100.0, 1e9, GIVE_UP),  # the budget is spent
        (report("CRASHED", gave_up=True), 0, 100.0, 1e9, GIVE_UP),  # the supervisor gave up: nobody restarts
        (report("CRASHED", stop_requested=True), 0, 100.0, 1e9, GIVE_UP),
        (report("STOPPING", stop_requested=True), 0, None, 0.0, WAIT),
        (report("DENSE_FALLBACK"), 0, None, 0.0, GIVE_UP),
        (report("FINISHED"), 0, None, 0.0, GIVE_UP),
        (report("STALLED"), 0, None, 5.0, WAIT),  # first seen now: the backoff starts now
    ],
)
def test_next_move_is_the_one_restart_policy(r, restarts, failed_at, now, kind):
    move = next_move(r, restarts, POLICY, failed_at, now)
    assert move.kind == kind, move
    if kind == WAIT and move.wait_s is not None:
        assert 0 < move.wait_s <= POLICY.backoff_s * 2**restarts


def snap(wall: float, step: int, beat: int | None = None, alive: bool = True) -> dict:
    s = {
        "time": wall,
        "run_dir_exists": True,
        "session": {"exists": True, "created": 1000.0},
        "progress": {"attempt_start": 1000.0, "step": step, "step_changed_at": wall},
        "metrics": {"records": [{"time": wall, "step": step, "loss": 2.0, "tokens_per_s": 100.0}]},
    }
    if beat is not None:
        s["supervisor"] = {
            "alive": alive,
            "interval_s": 1.0,
            "heartbeat": {"beat": beat, "age_s": 0.1},
            "verdict": None,
        }
    return s


def test_a_wall_clock_step_between_looks_changes_no_age():
    """The snapshots' wall time jumps 2 h between two looks 1 s apart on the judge's own clock: the new step is 1 s
    old, not 2 h; and a step that stands still is judged by the own clock too."""
    j = Judge("j", "h", facts.Thresholds(stall_after_s=60.0))
    assert j.take(snap(2000.0, 5), mono_now=10.0).state == "RUNNING"
    jumped = snap(2000.0 + 7200, 6)
    jumped["progress"]["step_changed_at"] = 2001.0  # the history's stamp, from before the step
    assert j.take(jumped, mono_now=11.0).state == "RUNNING"
    still = snap(2000.0 + 7200, 6)
    still["progress"]["step_changed_at"] = 2001.0
    r = j.take(still, mono_now=11.0 + 61)
    assert r.state == "STALLED" and r.evidence[0] == "no new step for 62 s (limit 60)", r.evidence


def test_a_heartbeat_that_stands_still_on_the_readers_own_clock_is_not_answering():
    j = Judge("j", "h", facts.Thresholds())
    assert j.take(snap(2000.0, 5, beat=1), mono_now=0.0).decided_by == SUPERVISOR
    assert j.take(snap(2001.0, 6, beat=2), mono_now=5.0).decided_by == SUPERVISOR
    r = j.take(snap(2002.0, 7, beat=2), mono_now=5.0 + 11)  # alive by pid, the remote's age fresh, yet unmoved
    assert r.decided_by == HERE and "not answering" in r.decided_why and r.supervisor["alive"] is True
    r = j.take(snap(2003.0, 8, beat=3), mono_now=17.0)
    assert r.decided_by == SUPERVISOR  # it answers again
    assert j.take(snap(2004.0, 9, beat=4, alive=False), mono_now=18.0).decided_by == HERE
    assert Judge("j", "h", facts.Thresholds()).take(snap(2000.0, 5)).decided_by == HERE  # no supervisor at all


GARBLED = [
    {"attempt": True, "after": "CRASHED"},
    {"attempt": 1.0, "after": "CRASHED"},
    {"attempt": "1", "after": "CRASHED"},
    {"attempt": 1, "after": ["CRASHED"]},
    {"attempt": 1, "after": ""},
    {"attempt": 2, "after": "CRASHED"},
    "CRASHED",
    [],
    None,
]


@pytest.mark.parametrize("cause", GARBLED)
def test_a_restart_cause_the_job_garbled_is_unknown_to_every_reader(cause):
    """The job can write its run dir's restart_cause.json as well as the decider can. A cause that is not restart 1's
    in its one shape is said as unknown by both readers: the watch that finds the restart done (its event), and a look
    inside the restart (its evidence). Never a state nobody decided on (JSON's true is not attempt 1)."""
    event = seen_restarted(1, cause)
    assert event["after"] is None and event["by"] == ELSEWHERE, event
    look = {**snap(2000.0, 5), "restarts": 0, "restarting": True, "restart_cause": cause}
    r = Judge("j", "h", facts.Thresholds()).take(look, mono_now=0.0)
    assert r.state == "STARTING" and len(r.evidence) == 1 and "restart lock is held" in r.evidence[0], r.evidence


def test_a_restart_cause_is_bounded_on_the_way_in_and_out():
    """What the decider writes (bounded) reads back whole; what the job wrote huge reads back bounded, by both
    readers."""
    huge = {"attempt": 1, "after": "CRASHED" * 100, "reason": "r" * 10_000, "by": 7, "evidence": ["e" * 1000] * 50}
    written = bounded(huge, 1)
    assert recorded(written, 1) == written and recorded(written, 2) is None
    event = seen_restarted(1, huge)
    assert len(event["after"]) == 40 and len(event["reason"]) == 400 and event["by"] == ELSEWHERE
    assert len(event["evidence"]) == 5 and {len(e) for e in event["evidence"]} == {400}
    look = {**snap(2000.0, 5), "restarts": 0, "restarting": True, "restart_cause": huge}
    r = Judge("j", "h", facts.Thresholds()).take(look, mono_now=0.0)
    assert r.state == "STARTING" and len(r.evidence) == 5 and max(map(len, r.evidence)) <= 400, r.evidence
    said = seen_restarted(1, {"attempt": 1, "after": "STALLED", "by": "supervisor", "reason": "no step"})
    assert said["after"] == "STALLED" and said["by"] == "elsewhere (supervisor)" and said["evidence"] == []
