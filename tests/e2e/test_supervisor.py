"""The job keeps its own watch (issue 39): a supervisor beside every single-host tmux job judges it on its own clock and
restarts it with no laptop attached; every asker gets the same word; stamps, an unwritable history, a first look
and a kill of an ended job do not fool the verdict. Real sshd on loopback, real tmux, real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflashctl.judge.facts import EXIT_BY_STATE
from tests.conftest import run_cli
from tests.e2e.test_kill_watch_launch_under_faults import job_file, run_dir_of, starts
from tests.e2e.test_launch import alive, cli_json, status_json, wait_until, write_project

FAST = "watch: {interval_s: 0.5, backoff_s: 0, max_restarts: 1, restart_on: [CRASHED], stall_after_s: 600}\n"
AT_GO = 'while [ ! -e "$RUN/go" ]; do sleep 0.1; done'  # a job that fails when the test says, not after a sleep
BUSY_THEN_HANG = (
    f"{sys.executable} -c 'import time; t = time.time()\nwhile time.time() - t < 1.2: pass\ntime.sleep(600)'"
)


@pytest.fixture
def proj(client, tmp_path):
    p = write_project(client, tmp_path)
    assert run_cli("deploy", "box").code == 0
    return p


def events(run: Path) -> list[dict]:
    path = run / "events.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []


def supervisor(run: Path) -> dict:
    return json.loads((run / "supervisor.json").read_text())


def test_a_crash_is_restarted_by_the_supervisor_after_the_laptops_watch_died(proj):
    """A watch is started and SIGKILLed (the laptop slept); the job crashes; its supervisor restarts it once
    (max_restarts 1), then says CRASHED for good and ends. The run dir's events say who restarted it."""
    job_id = cli_json(
        "launch", job_file(proj, "crashy", f"echo working; {AT_GO}; exit 3", FAST + "env: {HF_TOKEN: hf_sup3r}\n")
    )["id"]
    watch = subprocess.Popen(
        [sys.executable, "-m", "dflashctl", "watch", job_id, "--json"], stdout=subprocess.PIPE, text=True
    )
    first = json.loads(watch.stdout.readline())
    assert first["state"] in ("RUNNING", "STARTING")
    watch.send_signal(signal.SIGKILL)
    watch.wait()
    run = run_dir_of(job_id)
    (run / "go").touch()  # the crash comes once the watch is dead, however slow this machine
    wait_until(lambda: supervisor(run).get("ended"), 90)
    assert starts(run) == 2, (run / "train.log").read_text()
    assert (run / "restarts").read_text().strip() == "1"
    restarts = [e for e in events(run) if e.get("decision") == "restart"]
    assert len(restarts) == 1 and restarts[0]["by"] == "supervisor" and restarts[0]["after"] == "CRASHED"
    assert any(e.get("decision") == "no_restart" and "max_restarts" in e["why"] for e in events(run))
    st = status_json(job_id)
    assert st["state"] == "CRASHED" and "exit status 3" in st["reason"]
    assert st["supervisor"]["alive"] is False and st["supervisor"]["ended"] == supervisor(run)["ended"]
    assert st["gave_up"] is True and st["decided_by"] == "supervisor"  # its final word is everyone's
    assert "CRASHED" in supervisor(run)["ended"]
    # it ended for good: its secret is no longer at rest in any file of the run dir, and no dead pane is left
    assert not [f for f in run.rglob("*") if f.is_file() and b"hf_sup3r" in f.read_bytes()]
    from tests.conftest import TEST_TMUX_SOCKET

    has = subprocess.run(
        ["tmux", "-L", TEST_TMUX_SOCKET, "has-session", "-t", f"={st['run_dir'].split('/')[-1]}"], capture_output=True
    )
    assert has.returncode != 0, "the ended job's tmux session was left behind"


def test_the_supervisor_two_watchers_and_a_kill_agree(proj):
    """Two watchers and the supervisor on one crashing job restart it once in all; a kill during the next attempt
    ends the supervisor and no restart follows it."""
    extra = "watch: {interval_s: 0.3, backoff_s: 0, max_restarts: 2, restart_on: [CRASHED]}\n"
    job_id = cli_json("launch", job_file(proj, "racy", "sleep 1; exit 1", extra))["id"]
    run = run_dir_of(job_id)
    wait_until(lambda: (run / "restarts").exists() and (run / "restarts").read_text().strip() == "2", 90)
    wait_until(lambda: supervisor(run).get("ended"), 60)
    assert starts(run) == 3
    who = [e["by"] for e in events(run) if e.get("decision") == "restart"]
    assert who == ["supervisor", "supervisor"], events(run)

    job_id = cli_json("launch", job_file(proj, "killme", "sleep 300", extra))["id"]
    run = run_dir_of(job_id)
    me = wait_until(lambda: (run / "supervisor.json").exists() and supervisor(run), 30)
    assert alive(me["pid"])
    assert cli_json("kill", job_id)["result"] == "KILLED"
    wait_until(lambda: not alive(me["pid"]), 15)
    time.sleep(1.0)
    assert starts(run) == 1 and not (run / "restarts").exists()
    assert status_json(job_id)["state"] == "KILLED"


def test_one_supervisor_per_run_dir_and_a_dead_one_is_said(proj):
    job_id = cli_json("launch", job_file(proj, "lonely", "sleep 300", FAST))["id"]
    run = run_dir_of(job_id)
    me = wait_until(lambda: (run / "supervisor.json").exists() and supervisor(run), 30)
    second = subprocess.run([sys.executable, "-S", str(run / "agent.pyz"), "supervise", str(run)], timeout=30)
    assert second.returncode == 0 and supervisor(run)["pid"] == me["pid"]  # the first keeps the watch
    wait_until(lambda: (run / "verdict.json").exists(), 15)
    st = status_json(job_id)
    assert st["state"] == "RUNNING" and any("supervisor agrees" in e for e in st["evidence"]), st["evidence"]
    os.kill(me["pid"], signal.SIGKILL)
    wait_until(lambda: not alive(me["pid"]), 10)
    st = status_json(job_id)
    assert st["state"] == "RUNNING" and st["supervisor"]["alive"] is False
    assert any("supervisor is gone" in e for e in st["evidence"]), st["evidence"]
    assert cli_json("kill", job_id)["result"] == "KILLED"


def test_a_kill_of_an_ended_job_keeps_its_verdict(proj):
    crash = f"{sys.executable} -c 'raise RuntimeError(\"boom at step 7\")'"
    job_id = cli_json("launch", job_file(proj, "ended", crash, "watch: {restart_on: []}\n"))["id"]
    wait_until(lambda: status_json(job_id)["state"] == "CRASHED", 30)
    res = run_cli("kill", job_id)
    assert res.code == EXIT_BY_STATE["CRASHED"], res
    assert "had already ended" in res.stdout and "CRASHED" in res.stdout
    st = status_json(job_id)
    assert st["state"] == "CRASHED" and "RuntimeError" in st["reason"]
    assert any("after the job had ended" in e for e in st["evidence"])
    assert json.loads(run_cli("ls", "--json").stdout)["jobs"][0]["state"] == "CRASHED"


def test_a_first_look_at_a_job_that_worked_a_second_and_hung_is_stalled(proj):
    """No supervisor and no earlier look: the CPU it used once proves nothing now; a short sample shows it idle."""
    extra = "watch: {supervise: false, stall_after_s: 3}\n"
    job_id = cli_json("launch", job_file(proj, "hung", BUSY_THEN_HANG, extra))["id"]
    time.sleep(6)
    st = status_json(job_id)
    assert st["state"] == "STALLED", st
    assert run_cli("kill", job_id).code == 0


def test_a_history_that_cannot_be_written_is_evidence_and_the_job_still_stalls(proj):
    extra = "watch: {supervise: false, stall_after_s: 3}\n"
    job_id = cli_json("launch", job_file(proj, "nohist", BUSY_THEN_HANG, extra))["id"]
    run = run_dir_of(job_id)
    (run / "progress.json").unlink(missing_ok=True)
    (run / "progress.json").mkdir()  # a folder in its place: the history cannot be written
    time.sleep(6)
    for _ in range(2):  # every look is a first look: still STALLED, and said
        st = status_json(job_id)
        assert st["state"] == "STALLED", st
        assert any("progress history cannot be written" in e for e in st["evidence"]), st["evidence"]
    assert run_cli("kill", job_id).code == 0


def test_stamps_from_the_future_do_not_keep_a_frozen_job_running(proj):
    extra = "watch: {supervise: false, stall_after_s: 3}\n"
    job_id = cli_json("launch", job_file(proj, "future", "echo once; sleep 600", extra))["id"]
    run = run_dir_of(job_id)
    wait_until(lambda: (run / "progress.json").is_file() or status_json(job_id), 10)
    time.sleep(5)
    hist = json.loads((run / "progress.json").read_text())
    far = time.time() + 10**6
    for key in ("heartbeat", "log_size", "cpu_s", "gpu", "step"):
        if isinstance(hist.get(key), dict):
            hist[key]["changed_at"] = far
    hist["seen_at"] = far
    (run / "progress.json").write_text(json.dumps(hist))
    st = status_json(job_id)
    assert st["state"] == "STALLED", st
    assert run_cli("kill", job_id).code == 0


def test_status_and_watch_once_agree_when_the_host_is_down(proj, client):
    job_id = cli_json("launch", job_file(proj, "faraway", "sleep 300"))["id"]
    assert status_json(job_id)["state"] == "RUNNING"
    config = client.home / ".ssh" / "config"
    good = config.read_text()
    config.write_text("\n".join(ln if "Port" not in ln else "  Port 9" for ln in good.splitlines()) + "\n")
    try:
        st = status_json(job_id)
        assert st["state"] == "UNREACHABLE" and "last state RUNNING" in st["evidence"][0]
        once = run_cli("watch", job_id, "--once", "--json")
        assert once.code == EXIT_BY_STATE["UNREACHABLE"] == 18
        assert json.loads(once.stdout.splitlines()[-1])["state"] == "UNREACHABLE"
    finally:
        config.write_text(good)
    assert run_cli("kill", job_id).code == 0


def test_a_run_dirs_agent_replaced_after_launch_is_checked_before_the_restart_runs_it(proj, tmp_path):
    """RUN/agent.pyz is what the restarted pane runs as the launcher: edited after launch, it is replaced with the
    checked bytes before the restart, by the supervisor as by any watcher; the planted code never runs."""
    import io
    import zipfile

    from dflashctl.remote.agent_bundle import AGENT

    job_id = cli_json("launch", job_file(proj, "tampered", f"{AT_GO}; exit 1", FAST))["id"]
    run = run_dir_of(job_id)
    pwned = tmp_path / "pwned"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("__main__.py", f"import pathlib; pathlib.Path({str(pwned)!r}).touch()\n")
    (run / "agent.pyz").write_bytes(buf.getvalue())
    (run / "go").touch()  # the crash comes after the edit, however slow this machine
    wait_until(lambda: supervisor(run).get("ended"), 90)
    assert starts(run) == 2 and not pwned.exists()
    assert (run / "agent.pyz").read_bytes() == AGENT
    (restart,) = [e for e in events(run) if e.get("decision") == "restart"]
    assert restart["by"] == "supervisor" and restart.get("agent_replaced") is True


def test_the_supervisor_sees_an_end_at_once_not_at_its_next_interval(proj):
    """A 60 s interval: the tmux server killed under the job is judged (LOST) within seconds, and the supervisor
    ends, leaving nothing behind."""
    from tests.conftest import TEST_TMUX_SOCKET

    job_id = cli_json("launch", job_file(proj, "slowwatch", "sleep 300", "watch: {interval_s: 60}\n"))["id"]
    run = run_dir_of(job_id)
    me = wait_until(lambda: (run / "verdict.json").exists() and supervisor(run), 30)
    first_look = json.loads((run / "verdict.json").read_text())["time"]
    subprocess.run(["tmux", "-L", TEST_TMUX_SOCKET, "kill-server"], check=False)
    ended = wait_until(lambda: supervisor(run).get("ended"), 90)
    # before its next look by the clock (60 s after the first), however slow this machine: the end woke it
    assert supervisor(run)["ended_at"] - first_look < 60 and "LOST" in ended, ended
    wait_until(lambda: not alive(me["pid"]), 10)
