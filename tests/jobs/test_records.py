"""Records that stay true (issue 49 part 6, issue 50's `ls` lies): `ls` shows the state the last look gave and its
filters find it; `ls --refresh` asks the hosts again; a run dir removed by `gc` is REMOVED with when and by whom,
never LOST; `ls --forget` drops a record; bad filters are one-line errors with exit 2; a finished job's tmux session
is closed every time. Real sshd on loopback, real tmux, real processes."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import TEST_TMUX_SOCKET, run_cli
from tests.e2e.test_kill_watch_launch_under_faults import job_file
from tests.e2e.test_launch import cli_json, status_json, wait_until, write_project


@pytest.fixture
def proj(client, tmp_path):
    p = write_project(client, tmp_path)
    assert run_cli("deploy", "box").code == 0
    return p


def ls(*args: str) -> dict[str, dict]:
    return {j["id"]: j for j in cli_json("ls", *args)["jobs"]}


def sessions() -> list[str]:
    p = subprocess.run(
        ["tmux", "-L", TEST_TMUX_SOCKET, "list-sessions", "-F", "#{session_name}"], capture_output=True, text=True
    )
    return p.stdout.split() if p.returncode == 0 else []


def test_ls_shows_the_last_verdict_and_refresh_asks_the_hosts_again(proj):
    """status says RUNNING: ls says RUNNING and `ls -s running` lists it. The job then ends with nobody looking:
    ls still shows RUNNING (as last seen), `ls --refresh` says FINISHED, and `ls -s running` then lists nothing,
    saying that no job matches (not that there are no jobs)."""
    job_id = cli_json("launch", job_file(proj, "lister", "sleep 4", "watch: {supervise: false}\n"))["id"]
    wait_until(lambda: status_json(job_id)["state"] == "RUNNING", 60)
    assert ls()[job_id]["state"] == "RUNNING"
    assert list(ls("-s", "running")) == [job_id]
    wait_until(lambda: job_id not in sessions() or "exit 0" in run_cli("logs", job_id).stdout, 60)
    wait_until(lambda: ls("--refresh")[job_id]["state"] == "FINISHED", 60)
    res = run_cli("ls", "-s", "running")
    assert res.code == 0 and res.stdout == "" and "no job of this project matches" in res.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--state", "incomplete"), "--state"),
        (("-s", "nosuch"), "--state"),
        (("--host", "nosuchhost"), "--host"),
        (("--forget", "nosuch-job"), "nosuch-job"),
    ],
)
def test_bad_ls_filters_are_one_line_errors_with_exit_2(proj, args, says):
    res = run_cli("ls", *args)
    assert res.code == 2 and res.stdout == "", res
    assert res.stderr.count("\n") == 1 and says in res.stderr, res.stderr


def test_a_run_dir_removed_by_gc_is_removed_never_lost_and_a_record_can_be_forgotten(proj):
    """gc removes an ended job's run dir: its record says REMOVED with who and when, `status` says so without
    asking the host (exit 1: its end can no longer be read), and neither `ls --refresh` nor `watch --once`
    relabels it LOST; `ls --forget` drops the record."""
    job_id = cli_json("launch", job_file(proj, "collected", "exit 0", "watch: {supervise: false}\n"))["id"]
    wait_until(lambda: status_json(job_id)["state"] == "FINISHED", 60)
    res = run_cli("gc", "box", "--older-than", "0", "--yes")
    assert res.code == 0 and job_id in res.stdout, res
    rec = ls()[job_id]
    assert rec["state"] == "REMOVED" and rec["removed_by"] and rec["removed_at"]
    res = run_cli("status", job_id, "--json")
    st = json.loads(res.stdout)
    assert res.code == 32 and st["state"] == "REMOVED" and rec["removed_by"] in st["reason"]
    assert ls("--refresh")[job_id]["state"] == "REMOVED"  # a later look relabels nothing
    run_cli("watch", job_id, "--once")
    assert ls("-s", "removed")[job_id]["state"] == "REMOVED"
    res = run_cli("ls", "--forget", job_id)
    assert res.code == 0 and job_id in res.stderr
    assert job_id not in ls()


def test_a_live_job_is_not_forgotten(proj):
    job_id = cli_json("launch", job_file(proj, "kept", "sleep 300"))["id"]
    wait_until(lambda: status_json(job_id)["state"] == "RUNNING", 60)
    res = run_cli("ls", "--forget", job_id)
    assert res.code == 2 and "kill" in res.stderr and job_id in ls()
    assert run_cli("kill", job_id).code == 0


LINGERING_LAUNCHER = """
import json, os, sys, time
run = sys.argv[1]
with open("/proc/self/stat") as f:
    start = int(f.read().rsplit(")", 1)[1].split()[19])
json.dump({"pid": os.getpid(), "start": start}, open(os.path.join(run, "wrapper.pid"), "w"))
time.sleep(1)
open(os.path.join(run, "exit_code.tmp"), "w").write("0\\n")
os.replace(os.path.join(run, "exit_code.tmp"), os.path.join(run, "exit_code"))
time.sleep(4)  # what the real launcher does after exit_code (reap, stop leftovers), held long enough to be seen
"""


def test_a_finished_jobs_session_is_closed_even_when_its_pane_dies_after_the_verdict(tmp_path):
    """The race that left one session in four: the launcher writes exit_code a moment before its pane dies; the
    supervisor, seeing the exit status, judged FINISHED and ended with the pane alive, leaving the session. Here
    that moment is held open (a pane that lingers 4 s after writing exit_code; tmux resumes a SIGSTOPped pane, so
    the real launcher cannot be held): the real supervisor, on a real tmux server, closes the session once the
    pane is dead."""
    import subprocess as sp
    import sys

    run = tmp_path / "runs" / "linger-1"
    run.mkdir(parents=True, mode=0o700)
    session = "linger-1"
    (run / "job.json").write_text(json.dumps({"id": session, "session": session, "secret_names": []}))
    (run / "supervise.json").write_text(
        json.dumps(
            {
                "session": session,
                "job_id": session,
                "tmux_socket": TEST_TMUX_SOCKET,
                "is_trainer": False,
                "watch": {"interval_s": 0.5, "restart_on": []},
            }
        )
    )
    (run / "launcher.py").write_text(LINGERING_LAUNCHER)
    tmux = ["tmux", "-L", TEST_TMUX_SOCKET]
    sp.run(
        [
            *tmux,
            "new-session",
            "-d",
            "-s",
            session,
            f"{sys.executable} {run / 'launcher.py'} {run}",
            ";",
            "set-option",
            "-w",
            "-t",
            f"={session}:",
            "remain-on-exit",
            "on",
        ],
        check=True,
    )
    sup = sp.Popen([sys.executable, "-m", "dflashctl.agent", "supervise", str(run)], stderr=sp.PIPE, text=True)
    try:
        wait_until(
            lambda: (
                (run / "verdict.json").exists()
                and json.loads((run / "verdict.json").read_text())["state"] == "FINISHED"
            ),
            60,
        )
        alive = sp.run(
            [*tmux, "display-message", "-p", "-t", f"={session}:", "#{pane_dead}"], capture_output=True, text=True
        ).stdout.strip()
        assert alive == "0", "the pane died before the verdict: the race was not held open"
        assert sup.wait(timeout=60) == 0, sup.stderr.read()
        left = session in sessions()  # before the clean-up below
    finally:
        if sup.poll() is None:
            sup.kill()
        sp.run([*tmux, "kill-session", "-t", f"={session}"], capture_output=True)
    assert json.loads((run / "supervisor.json").read_text())["ended"] == "FINISHED"
    assert not left, "the ended job's session was left behind"
