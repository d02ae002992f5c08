"""Time that cannot lie (issue 49, part 3), for a one-shot look: `status` and the first poll of a `watch` measure
every age on the remote's own monotonic clock (the progress history keeps a monotonic stamp and the boot id beside
each wall stamp), so a wall clock stepped by hours changes no verdict, from the first look on. Real sshd on
loopback, real tmux, the real supervisor and probe processes; pure tests of the fold and of the history's stamps."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from dflashctl.agent import snapshot as agent_snapshot
from dflashctl.judge import facts
from dflashctl.judge.report import Judge
from tests.conftest import run_cli, start_sshd
from tests.e2e.test_kill_watch_launch_under_faults import job_file, run_dir_of, starts
from tests.e2e.test_launch import cli_json, status_json, wait_until, write_project
from tests.e2e.test_supervisor_decides import swap_supervisor, verdict
from tests.jobs.test_records import ls

# a healthy job that steps like a trainer: a step record in metrics.jsonl and a heartbeat (written whole) each 0.3 s
STEPPING = (
    'i=0; while true; do i=$((i+1)); t=$(date +%s.%N); r="$DFLASHCTL_RUN_DIR"; '
    'echo "{\\"step\\": $i, \\"time\\": $t, \\"loss\\": 1.0}" >> "$r/metrics.jsonl"; '
    'echo "{\\"time\\": $t, \\"step\\": $i, \\"phase\\": \\"train\\"}" > "$r/hb.tmp"; '
    'mv "$r/hb.tmp" "$r/heartbeat"; echo tick; sleep 0.3; done'
)


@pytest.fixture(scope="module")
def shift_file(tmp_path_factory) -> Path:
    """The remote's faked wall clock: every agent process the test sshd starts reads its shift from this file."""
    path = tmp_path_factory.mktemp("clock") / "shift"
    path.write_text("0")
    return path


@pytest.fixture(scope="module")
def sshd(tmp_path_factory, shift_file):
    """This module's own sshd (it overrides the suite's): its sessions carry the wall-shift hook's variable, so the
    probes of `status` and `watch` run with the remote's faked wall clock, as the supervisor does."""
    server = start_sshd(tmp_path_factory.mktemp("sshd"), {"DFLASHCTL_TEST_WALL_SHIFT_FILE": str(shift_file)})
    yield server
    server.stop()


@pytest.fixture
def proj(client, tmp_path, shift_file):
    shift_file.write_text("0")
    p = write_project(client, tmp_path)
    assert run_cli("deploy", "box").code == 0
    yield p
    shift_file.write_text("0")


@pytest.mark.parametrize("step_s", [7200, -3600])
def test_status_and_watch_once_right_after_a_clock_step_say_running(proj, shift_file, step_s):
    """The remote's wall clock steps 2 h forward (or 1 h back) under a healthy job, and `status`, `watch --once` and
    `ls --refresh` look at once, before the supervisor's next sample (its interval is 30 s): all say RUNNING, with
    the step's and the heartbeat's true ages, and nothing is restarted. The old code's one-shot look subtracted the
    heartbeat's and the newest step's wall stamps from the stepped now: STALLED, the heartbeat 7200 s old.

    The wall clock is faked (DFLASHCTL_TEST_WALL_SHIFT_FILE: the agent's tests-only hook, read by the probe and the
    supervisor alike; monotonic time is untouched), because a real clock step cannot be made here without
    disturbing every other process on the machine."""
    extra = (
        "watch: {interval_s: 30, backoff_s: 0, max_restarts: 1, restart_on: [STALLED, CRASHED], stall_after_s: 20}\n"
    )
    job_id = cli_json("launch", job_file(proj, "steady", STEPPING, extra))["id"]
    run = run_dir_of(job_id)
    sup = swap_supervisor(run, shift_file)
    try:
        wait_until(lambda: verdict(run).get("state") == "RUNNING", 30)
        assert status_json(job_id)["state"] == "RUNNING"  # a look before the step: the history has this attempt
        shift_file.write_text(str(step_s))
        st = status_json(job_id)
        assert st["state"] == "RUNNING" and st["step"], st
        assert st["heartbeat_age_s"] is not None and st["heartbeat_age_s"] < 60, st  # not 7200
        once = run_cli("watch", job_id, "--once", "--json")
        assert once.code == 0, once.stdout + once.stderr
        assert json.loads(once.stdout.splitlines()[-1])["state"] == "RUNNING"
        assert ls("--refresh")[job_id]["state"] == "RUNNING"
        assert not (run / "restarts").exists() and starts(run) == 1
    finally:
        assert run_cli("kill", job_id).code == 0
        sup.wait(30)


def test_a_clock_stepped_back_an_hour_hides_no_stall(proj, shift_file):
    """A job that printed once and froze is STALLED; the remote's wall clock then steps back 1 h: `status` and
    `watch --once` still say STALLED, with the true age. The old code took every stamp after the stepped-back now to
    be "now": the frozen job read RUNNING for the next hour.

    The wall clock is faked (the agent's tests-only hook, as above): a real clock step cannot be made here."""
    extra = "watch: {supervise: false, stall_after_s: 3}\n"
    job_id = cli_json("launch", job_file(proj, "frozen", "echo once; sleep 600", extra))["id"]
    try:
        wait_until(lambda: status_json(job_id)["state"] == "STALLED", 60)
        shift_file.write_text("-3600")
        st = status_json(job_id)
        assert st["state"] == "STALLED", st
        assert "no sign of progress for" in st["evidence"][0], st["evidence"]
        once = run_cli("watch", job_id, "--once", "--json")
        assert json.loads(once.stdout.splitlines()[-1])["state"] == "STALLED", once.stdout + once.stderr
    finally:
        assert run_cli("kill", job_id).code == 0


# ---------------------------------------------------------------------------------------------- pure: the fold


def snap(wall: float, **progress) -> dict:
    """A trainer's snapshot at remote wall time `wall`: step 6, its history's wall stamps from before a step."""
    prog = {"attempt_start": 1000.0, "step": 6, "step_changed_at": 2001.0, "heartbeat_changed_at": 2001.0, **progress}
    return {
        "time": wall,
        "run_dir_exists": True,
        "session": {"exists": True, "created": 1000.0},
        "progress": prog,
        "heartbeat": {"time": 2001.0, "mtime": 2001.0, "step": 6, "phase": "train"},
        "metrics": {"records": [{"time": 2001.0, "step": 6, "loss": 2.0, "tokens_per_s": 100.0}]},
    }


AGES = {"step_age_s": 1.5, "heartbeat_age_s": 0.5, "attempt_age_s": 1002.0}


@pytest.mark.parametrize("wall", [2002.0 + 7200, 2002.0 - 3600])
@pytest.mark.parametrize("mono_now", [None, 50.0])
def test_the_first_look_judges_by_the_remotes_monotonic_ages(wall, mono_now):
    """The remote's wall clock stepped 2 h forward (or 1 h back) just after the newest step: with the ages the
    remote measured on its monotonic clock, a Judge's first look (a one-shot one, or a watch's first poll) says
    RUNNING with the true ages; without them, the wall stamps judge, clamped (forward: STALLED, the old answer)."""
    th = facts.Thresholds(stall_after_s=60.0, heartbeat_max_age_s=30.0)
    j = Judge("j", "h", th)
    r = j.take(snap(wall, **AGES), mono_now)
    assert r.state == "RUNNING", r
    assert j.h.heartbeat_age_s == 0.5 and j.h.now - j.h.step_changed_at == pytest.approx(1.5)
    old = Judge("j", "h", th).take(snap(wall), mono_now)
    assert old.state == ("STALLED" if wall > 2002.0 else "RUNNING"), old


def test_the_startup_budget_and_a_command_jobs_quiet_are_monotonic_ages():
    """No first step yet, the wall clock 2 h ahead: the attempt is 30 s old by the remote's monotonic clock, so it
    is STARTING, not past its startup budget; a command job's last sign of progress is 2 s old, so RUNNING."""
    s = snap(1030.0 + 7200, attempt_age_s=30.0, activity_age_s=2.0, activity="log grew", activity_at=1028.0)
    s["progress"].pop("step")
    s["metrics"] = {"records": []}
    th = facts.Thresholds(stall_after_s=60.0, startup_budget_s=600.0, heartbeat_max_age_s=1e9)
    r = Judge("j", "h", th).take(s)
    assert r.state == "STARTING" and "30 s since start" in r.reason, r
    r = Judge("j", "h", th, is_trainer=False).take(s)
    assert r.state == "RUNNING" and "log grew 2 s ago" in r.reason, r
    s["progress"].pop("attempt_age_s")
    s["progress"].pop("activity_age_s")
    assert Judge("j", "h", th).take(s).state == "STALLED"  # the wall's difference: 7230 s, past the budget


@pytest.mark.parametrize("trainer", [True, False])
def test_a_long_watch_of_a_frozen_job_stalls_on_the_remotes_ages(trainer):
    """A long watch (one Judge, its own monotonic clock) of a job that stopped moving: the remote's monotonic ages
    grow with every poll, and the watch says STALLED once they pass the limit, whatever the wall clock does between
    polls (here it steps 2 h forward halfway); the ages are not taken for fresh changes at every poll."""
    th = facts.Thresholds(stall_after_s=60.0, heartbeat_max_age_s=1e9)
    j = Judge("j", "h", th, is_trainer=trainer)
    states = []
    for i in range(8):  # a poll each 10 s on both clocks; the quiet began 3.3 s before the first
        wall = 2010.0 + 10 * i + (7200 if i >= 4 else 0)
        s = snap(
            wall,
            step_age_s=3.3 + 10 * i,
            heartbeat_age_s=3.3 + 10 * i,
            attempt_age_s=1010.0 + 10 * i,
            activity_age_s=3.3 + 10 * i,
            activity="log grew",
            activity_at=2006.7,
        )
        if not trainer:
            s["progress"].pop("step")
            s["metrics"] = {"records": []}
        states.append(j.take(s, 100.0 + 10 * i).state)
    assert states == ["RUNNING"] * 6 + ["STALLED"] * 2, states


def test_a_kill_in_progress_is_not_presumed_dead_by_a_stepped_clock():
    """`dflashctl kill` asked 5 s ago (the remote's monotonic age of its request) and the wall clock then stepped 2 h
    forward: STOPPING, not KILL_FAILED ("requested 7200 s ago, no result"); without that age the wall judges."""
    s = snap(2000.0 + 7200, stop_age_s=5.0)
    s["stop_request"] = {"time": 1995.0}
    assert Judge("j", "h", facts.Thresholds()).take(s).state == "STOPPING"
    s["progress"].pop("stop_age_s")
    assert Judge("j", "h", facts.Thresholds()).take(s).state == "KILL_FAILED"


@pytest.mark.parametrize("bad", [-5.0, "7", True, None, float("nan"), float("inf"), [1.0]])
def test_a_malformed_age_is_no_age(bad):
    """A negative, string, bool, list, NaN or infinite age is ignored: the wall stamps judge, clamped as before."""
    r = Judge("j", "h", facts.Thresholds(stall_after_s=60.0)).take(snap(2002.0 + 7200, step_age_s=bad))
    assert r.state == "STALLED", r


# ---------------------------------------------------------------------------------------------- the agent's history


def history_snap(run: Path, now: float) -> dict:
    return {
        "session": {"exists": True, "created": now - 100.0},
        "procs": [],
        "log": {"size": (run / "train.log").stat().st_size},
    }


def test_the_history_keeps_monotonic_stamps_and_a_changed_boot_id_falls_back_to_the_wall(tmp_path):
    """The run dir's progress history, written and read by the real agent code on real files: a sign seen 1 s
    before on the monotonic clock is 1 s old even when the wall stamps say 2 h (the clock stepped); the same stamps
    under another boot id are not comparable with this boot's monotonic now, and the wall stamp judges, clamped
    (converted once: the next look keeps that conversion on this boot's clock)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "train.log").write_text("tick\n")
    now, mono = time.time(), time.monotonic()
    first = agent_snapshot.update_progress(str(run), now, history_snap(run, now), [], -1, mono)
    assert first["attempt_age_s"] == pytest.approx(100.0, abs=0.1)
    hist = json.loads((run / "progress.json").read_text())
    assert hist["clock"]["boot"] == agent_snapshot.boot_id() and hist["log_size"]["boot"] == hist["clock"]["boot"]
    # the wall clock steps 2 h forward: the log unchanged, looked at again 1 s later on the monotonic clock
    later = agent_snapshot.update_progress(str(run), now + 7200, history_snap(run, now), [], -1, mono + 1.0)
    assert later["activity"] == "log grew" and later["activity_age_s"] == pytest.approx(1.0 + first["activity_age_s"])
    assert later["attempt_age_s"] == pytest.approx(101.0, abs=0.1)
    # a reboot since (another boot id on every stamp): the monotonic stamps are not this boot's
    hist = json.loads((run / "progress.json").read_text())
    for entry in (hist["clock"], hist["log_size"], hist["cpu_s"]):
        entry["boot"] = "another-boot"
    (run / "progress.json").write_text(json.dumps(hist))
    rebooted = agent_snapshot.update_progress(str(run), now + 7200, history_snap(run, now), [], -1, mono + 2.0)
    assert rebooted["activity_age_s"] == pytest.approx(7200.0, abs=0.2)  # the wall stamps' difference
    assert rebooted["attempt_age_s"] == pytest.approx(7300.0, abs=0.2)  # from the wall stamps, converted once
    hist = json.loads((run / "progress.json").read_text())
    assert hist["clock"]["boot"] == hist["log_size"]["boot"] == agent_snapshot.boot_id()  # converted, kept


def test_a_monotonic_stamp_after_now_is_no_evidence(tmp_path):
    """A history whose monotonic stamps lie in the future (a forged file): each is taken back to its wall stamp,
    clamped, never believed fresh."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "train.log").write_text("tick\n")
    now, mono = time.time(), time.monotonic()
    agent_snapshot.update_progress(str(run), now, history_snap(run, now), [], -1, mono)
    hist = json.loads((run / "progress.json").read_text())
    hist["log_size"]["mono"] = mono + 10**6
    hist["cpu_s"]["mono"] = mono + 10**6
    hist["log_size"]["changed_at"] = now - 50.0
    (run / "progress.json").write_text(json.dumps(hist))
    got = agent_snapshot.update_progress(str(run), now + 10, history_snap(run, now), [], -1, mono + 10.0)
    assert got["activity_age_s"] >= 10.0, got


def test_a_clock_stepped_back_under_a_young_attempt_loses_none_of_its_steps(tmp_path):
    """The clock steps back 1 h ten minutes into an attempt: the trainer's next step record is stamped before the
    attempt's (wall) start. The history reads on from where it stopped, so the step is this attempt's: it is seen,
    and its age is the monotonic one (the old code skipped it as an earlier attempt's: no new step, STALLED)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "train.log").write_text("tick\n")
    now, mono = time.time(), time.monotonic()
    metrics = run / "metrics.jsonl"
    metrics.write_text(
        json.dumps({"step": 4, "time": now - 700.0})
        + "\n"  # an earlier attempt's
        + json.dumps({"step": 5, "time": now - 10.0})
        + "\n"
    )
    look = {"session": {"exists": True, "created": now - 600.0}, "procs": [], "log": {"size": 5}}
    first = agent_snapshot.update_progress(str(run), now, look, [], -1, mono)
    assert first["step"] == 5
    back = now - 3600.0 + 30.0  # 30 s later, the wall clock 1 h behind
    with metrics.open("a") as f:
        f.write(json.dumps({"step": 6, "time": back - 5.0}) + "\n")
    later = agent_snapshot.update_progress(str(run), back, look, [], -1, mono + 30.0)
    assert later["step"] == 6 and later["step_age_s"] <= 30.0, later


def test_the_history_dates_a_stop_request_and_an_exit_on_the_monotonic_clock(tmp_path):
    """A stop request and an exit status first seen after a 2 h forward step: their ages are bounded by the time
    since the previous look on the monotonic clock (10 s), not the 2 h their wall stamps claim."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "train.log").write_text("tick\n")
    now, mono = time.time(), time.monotonic()
    agent_snapshot.update_progress(str(run), now, history_snap(run, now), [], -1, mono)
    look = {**history_snap(run, now), "stop_request": {"time": now + 1.0}, "exit_code": 143, "exit_time": now + 2.0}
    got = agent_snapshot.update_progress(str(run), now + 7210, look, [], -1, mono + 10.0)
    assert got["stop_age_s"] <= 10.0 and got["exit_age_s"] <= 10.0, got
    again = agent_snapshot.update_progress(str(run), now + 7215, look, [], -1, mono + 15.0)
    assert again["stop_age_s"] == pytest.approx(got["stop_age_s"] + 5.0)  # one request: dated once
