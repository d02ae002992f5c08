"""The one decider, pure (judge/decider.py): recorded snapshots in, turns out. A crash restarted once and said once, a
crash outside restart_on said once, a stall, two nodes, a raced restart, giving up, a supervisor's word followed by
a reader, the job's end; and every notice's id the same whoever makes it."""

from __future__ import annotations

from dflashctl.judge.decider import HAND_OVER, Decider, Look, Outcome
from dflashctl.judge.facts import Thresholds
from dflashctl.judge.policy import GIVE_UP, RESTART, WAIT, Policy
from dflashctl.judge.report import SUPERVISOR, Judge

T0 = 2000.0


def snap(
    wall: float,
    step: int | None = 5,
    *,
    dead: int | None = None,
    restarts: int = 0,
    log: str = "",
    supervisor: dict | None = None,
    stop: bool = False,
    started: float = T0 - 10,
) -> dict:
    s = {
        "time": wall,
        "run_dir_exists": True,
        "restarts": restarts,
        "session": {"exists": True, "created": started, "pane_dead": dead is not None, "exit_status": dead},
        "exit_code": dead,
        "log": {"text": log, "offset": len(log), "size": len(log)},
        "progress": {
            "attempt_start": started,
            "step": step,
            "step_changed_at": wall,
            "attempt_age_s": wall - started,
            "step_age_s": 0.0 if step is not None else None,
        },
        "metrics": {"records": [{"time": wall, "step": step, "loss": 2.0, "tokens_per_s": 100.0}] if step else []},
        "procs": [] if dead is not None else [{"pid": 10, "start": 1, "cmd": "t", "cpu_s": 1.0}],
    }
    if stop:
        s["stop_request"] = {"time": wall}
    if supervisor is not None:
        s["supervisor"] = supervisor
    return s


CRASH_LOG = 'step 5\nTraceback (most recent call last):\n  File "t.py", line 1\nRuntimeError: boom\n'


def decider(restart_on=("CRASHED",), max_restarts=2, backoff_s=0.0, by="supervisor", nodes=1) -> Decider:
    judges = [Judge("job-1", "gpu", Thresholds(stall_after_s=60.0), is_trainer=True, max_restarts=max_restarts)]
    judges += [Judge("job-1.node1", "b", Thresholds(stall_after_s=60.0), is_trainer=False) for _ in range(nodes - 1)]
    names = ["gpu", *("b" for _ in range(nodes - 1))]
    return Decider(judges, names, Policy(tuple(restart_on), max_restarts, backoff_s), by, "job-1", "gpu")


def test_a_crash_in_restart_on_is_restarted_and_said_once_with_its_restart():
    d = decider()
    assert d.take([Look(snap(T0))], 0.0).move.kind == WAIT
    turn = d.take([Look(snap(T0 + 1, dead=1, log=CRASH_LOG))], 1.0)
    assert turn.report.state == "CRASHED" and turn.move.kind == RESTART and turn.notices == []
    assert turn.restart["attempt"] == 0 and turn.restart["cause"]["after"] == "CRASHED"
    assert turn.restart["cause"]["by"] == SUPERVISOR
    after = d.restarted(Outcome(True, 1))
    assert [n.id for n in after.notices] == ["a0-CRASHED"]
    n = after.notices[0]
    assert n.state == "CRASHED" and n.action == "restarted (1 of 2)" and n.restarts == 1 and n.restarts_left == 1
    assert n.host == "gpu" and any("RuntimeError: boom" in e for e in n.evidence)
    assert [e["decision"] for e in after.events] == ["restart"] and after.events[0]["attempt"] == 1
    assert d.restarts == 1 and d.state == "STARTING"
    # the new attempt crashes as well: the budget has one left; then none
    d.take([Look(snap(T0 + 5, dead=1, log=CRASH_LOG, restarts=1, started=T0 + 2))], 5.0)
    last = d.restarted(Outcome(True, 2))
    assert [x.id for x in last.notices] == ["a1-CRASHED"]
    end = d.take([Look(snap(T0 + 9, dead=1, log=CRASH_LOG, restarts=2, started=T0 + 6))], 9.0)
    assert end.move.kind == GIVE_UP and end.gave_up.startswith("max_restarts (2) reached")
    assert [x.id for x in end.notices] == ["a2-CRASHED"] and end.notices[0].action.startswith("not restarted")
    assert end.notices[0].restarts_left == 0
    assert [e["decision"] for e in end.events] == ["state", "no_restart"]


def test_a_crash_outside_restart_on_is_one_notice_with_what_is_done():
    d = decider(restart_on=("STALLED",), max_restarts=3)
    turn = d.take([Look(snap(T0, dead=1, log=CRASH_LOG))], 0.0)
    assert turn.move.kind == GIVE_UP and turn.gave_up == "CRASHED is not in the job's restart_on"
    assert len(turn.notices) == 1
    n = turn.notices[0]
    assert n.headline == "CRASHED, not restarted: CRASHED is not in the job's restart_on"
    assert n.restarts_left == 0, "a job that will never restart this state has none left"
    assert any("RuntimeError" in e for e in n.evidence)
    again = d.take([Look(snap(T0 + 1, dead=1, log=""))], 1.0)
    assert again.notices == [], "one notice per event, however often it is looked at"


def test_a_backoff_is_announced_with_the_failure_and_the_restart_says_nothing_more():
    d = decider(backoff_s=60.0)
    first = d.take([Look(snap(T0, dead=1, log=CRASH_LOG))], 0.0)
    assert first.move.kind == WAIT and [n.action for n in first.notices] == ["restart 1 of 2 in 60 s"]
    assert d.take([Look(snap(T0 + 30, dead=1))], 30.0).notices == []
    go = d.take([Look(snap(T0 + 61, dead=1))], 61.0)
    assert go.move.kind == RESTART and go.notices == []
    assert d.restarted(Outcome(True, 1)).notices == []
    # a restart refused after it was announced is news: said once, under its own id
    d.take([Look(snap(T0 + 70, dead=1, log=CRASH_LOG, restarts=1, started=T0 + 62))], 70.0)
    d.take([Look(snap(T0 + 200, dead=1, restarts=1, started=T0 + 62))], 200.0)
    refused = d.restarted(Outcome(False, 1, why="the disk is still full"))
    assert refused.move.kind == GIVE_UP and refused.gave_up == "the disk is still full"
    assert [n.id for n in refused.notices] == ["a1-CRASHED-refused"]
    stopped = decider()
    stopped.take([Look(snap(T0, dead=1, log=CRASH_LOG))], 0.0)
    assert stopped.restarted(Outcome(False, 0, why="a stop was requested", stopped=True)).notices == []


def test_a_stall_is_said_and_a_recovery_too():
    d = decider(restart_on=(), max_restarts=0)
    d.take([Look(snap(T0, step=5))], 0.0)
    still = snap(T0 + 100, step=5)
    still["progress"]["step_changed_at"] = T0
    still["progress"]["step_age_s"] = 100.0
    stall = d.take([Look(still)], 100.0)
    assert stall.report.state == "STALLED" and stall.move.kind == WAIT
    assert [n.headline for n in stall.notices] == ["STALLED, not restarted: STALLED is not in the job's restart_on"]
    back = d.take([Look(snap(T0 + 101, step=6))], 101.0)
    assert back.report.state == "RUNNING" and [n.id for n in back.notices] == ["a0-STALLED-recovered"]
    assert not back.notices[0].failure


def test_the_jobs_end_is_one_notice():
    d = decider()
    d.take([Look(snap(T0))], 0.0)
    done = snap(T0 + 1, dead=0, log="[dflashctl] exit 0\n")
    done["metrics"]["records"].append({"event": "finished", "time": T0 + 1, "step": 5})
    turn = d.take([Look(done)], 1.0)
    assert turn.report.state == "FINISHED" and turn.move.kind == GIVE_UP and turn.gave_up is None
    assert [(n.id, n.failure) for n in turn.notices] == [("end-FINISHED", False)]
    assert d.take([Look(done)], 2.0).notices == []


def test_a_reader_follows_an_answering_supervisor_and_makes_no_notice_of_its_own():
    """A watch on the laptop, the supervisor alive and answering: its verdict (verdict.json) is the report, its
    restart is its own (the watch waits), and the watch makes no notice."""
    d = decider(by="watch")
    verdict = {
        "state": "CRASHED",
        "reason": "the supervisor's reason",
        "evidence": ["RuntimeError: boom"],
        "restarts": 0,
        "attempt_start": T0 - 10,
        "time": T0,
    }
    sup = {"alive": True, "interval_s": 1.0, "heartbeat": {"beat": 3, "age_s": 0.1}, "verdict": verdict}
    turn = d.take([Look(snap(T0, dead=1, log=CRASH_LOG, supervisor=sup))], 0.0)
    r = turn.report
    assert r.decided_by == SUPERVISOR and r.state == "CRASHED" and "the job's supervisor agrees (0 s ago)" in r.evidence
    assert turn.move.kind == WAIT and turn.notices == [] and turn.restart is None
    # its word differs from this look's (it measured a stall this one-shot look cannot): its verdict is the report
    stalled = {**sup, "verdict": {**verdict, "state": "STALLED", "reason": "no new step for 700 s"}}
    other = decider(by="watch").take([Look(snap(T0, supervisor=stalled))], 0.0).report
    assert other.state == "STALLED" and other.reason == "no new step for 700 s"
    assert other.evidence[0] == "RuntimeError: boom"
    gave = {**sup, "verdict": {**verdict, "gave_up": "max_restarts (2) reached"}}
    end = d.take([Look(snap(T0 + 1, dead=1, supervisor=gave))], 1.0)
    assert end.move.kind == GIVE_UP and end.report.gave_up and end.notices == []
    # the supervisor stops answering (frozen): this watch decides, and says so
    frozen = {**sup, "heartbeat": {"beat": 3, "age_s": 500.0}}
    d2 = decider(by="watch")
    turn = d2.take([Look(snap(T0, dead=1, log=CRASH_LOG, supervisor=frozen))], 0.0)
    assert turn.report.decided_by == "here" and turn.move.kind == RESTART
    assert any("not answering" in e for e in turn.report.evidence)


def test_a_restart_made_elsewhere_is_seen_with_its_cause_and_a_raced_one_is_not_said_twice():
    d = decider(by="watch")
    d.take([Look(snap(T0))], 0.0)
    cause = {"attempt": 1, "after": "STALLED", "reason": "no step", "by": "supervisor", "evidence": []}
    moved = {**snap(T0 + 5, restarts=1, started=T0 + 4), "restart_cause": cause}
    turn = d.take([Look(moved)], 5.0)
    seen = [e for e in turn.events if e["decision"] == "restart"]
    assert seen == [
        {
            "decision": "restart",
            "attempt": 1,
            "after": "STALLED",
            "by": "elsewhere (supervisor)",
            "reason": "no step",
            "evidence": [],
        }
    ]
    assert d.restarts == 1
    raced = decider(by="watch")
    raced.take([Look(snap(T0, dead=1, log=CRASH_LOG))], 0.0)
    after = raced.restarted(Outcome(False, 1, raced=True, why="already restarted by another watcher (restart 1)"))
    assert after.notices == [] and after.move.kind == WAIT and raced.restarts == 1
    assert after.events[0]["by"].startswith("elsewhere")


def test_two_nodes_the_first_to_fail_is_named_and_one_node_not_reached_hands_over():
    d = decider(nodes=2)
    ok = snap(T0)
    member = snap(T0, step=None)
    d.take([Look(ok), Look(member)], 0.0)
    crashed = snap(T0 + 1, step=None, dead=1, log=CRASH_LOG)
    timeout = snap(T0 + 1, dead=1, log="Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5)\n")
    turn = d.take([Look(timeout), Look(crashed)], 1.0)
    assert turn.report.state == "CRASHED" and turn.report.reason.startswith("node b:"), turn.report
    assert [n["host"] for n in d.node_states] == ["gpu", "b"] and turn.move.kind == RESTART
    lost = decider(nodes=2)
    lost.take([Look(ok), Look(member)], 0.0)
    turn = lost.take([Look(snap(T0 + 1, dead=1, log=CRASH_LOG)), Look(None, False, "ssh: no route")], 1.0)
    assert lost.unreached == ["b: ssh: no route"]
    assert turn.move.kind in (WAIT, HAND_OVER) and turn.restart is None, "it cannot restart what it cannot reach"


def test_a_silent_scheduler_is_unreachable_whatever_the_answering_supervisor_said_before():
    """A Slurm job: the controller does not answer this look (on the login node the supervisor asks too). The
    supervisor answers, but its verdict (RUNNING) predates the silence: the look's UNREACHABLE stands, decided here,
    with the supervisor's last word in the evidence. Once the supervisor says UNREACHABLE too, it agrees."""
    judge = Judge("job-1", "gpu", Thresholds(stall_after_s=60.0), is_trainer=True, max_restarts=2, scheduled=True)
    d = Decider([judge], ["gpu"], Policy(("CRASHED",), 2, 0.0), "status", "job-1", "gpu")
    verdict = {
        "state": "RUNNING",
        "reason": "alive",
        "evidence": [],
        "restarts": 0,
        "attempt_start": T0 - 10,
        "time": T0,
    }
    sup = {"alive": True, "interval_s": 1.0, "heartbeat": {"beat": 3, "age_s": 0.1}, "verdict": verdict}
    look = snap(T0 + 2, supervisor=sup)
    look["session"]["slurm"] = {"id": "18", "state": "NO_ANSWER", "reason": "slurm_load_jobs error: timed out"}
    r = d.take([Look(look)], 0.0).report
    assert r.state == "UNREACHABLE" and r.decided_by == "here", r
    assert any("the job's supervisor said RUNNING 2 s ago" in e for e in r.evidence), r.evidence
    verdict["state"] = "UNREACHABLE"
    r = Decider([judge], ["gpu"], Policy(("CRASHED",), 2, 0.0), "status", "job-1", "gpu").take([Look(look)], 1.0).report
    assert r.state == "UNREACHABLE" and r.decided_by == SUPERVISOR and any("agrees" in e for e in r.evidence), r
