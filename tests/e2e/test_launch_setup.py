"""A job file's `setup:` through the real CLI on the `local` host: it runs once per release however many launches
come at once (its output in the run dir's setup.log), a failure or a hang is SETUP_FAILED with its evidence and is
never restarted, and a kill during it leaves nothing behind."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from dflashctl.agent import procs
from dflashctl.judge.facts import EXIT_BY_STATE
from tests.conftest import run_cli
from tests.e2e.test_launch import cli_json, status_json, wait_until, write_project


def local_job(p: Path, name: str, command: str, setup: str, extra: str = "") -> str:
    """A job file on `local` outside the project's tree (writing it leaves the deployed code current)."""
    path = p.parent / "jobfiles" / f"{name}.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(
        f"name: {name}\nhost: local\nkill_grace_s: 2\ncommand: {json.dumps(command)}\n"
        f"setup: {json.dumps(setup)}\n{extra}"
    )
    return str(path)


@pytest.fixture
def local_proj(client, tmp_path):
    p = write_project(client, tmp_path)
    assert run_cli("deploy", "local").code == 0
    return p


def tagged(job_id: str) -> list[int]:
    return [p for p in procs.proc_table() if procs.has_job_tag(p, job_id)]


def test_setup_runs_once_per_release_however_many_launch_at_once(local_proj, tmp_path):
    count = tmp_path / "setup-runs"
    setup = f"echo installing; echo run >> {count}; sleep 2; echo installed"
    # the supervisor samples every second: its verdict (which `status` shows) follows the end of the setup at once
    quick = "watch: {interval_s: 1}\n"
    files = [local_job(local_proj, f"once{k}", "echo job-ran; sleep 300", setup, quick) for k in range(2)]
    results: list = [None, None]

    def go(k: int) -> None:
        results[k] = run_cli("launch", files[k], "--json")

    threads = [threading.Thread(target=go, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.code for r in results] == [0, 0], [r.stderr for r in results]
    reps = [json.loads(r.stdout) for r in results]
    for rep in reps:
        wait_until(lambda rep=rep: "job-ran" in run_cli("logs", rep["id"], "-n", "20").stdout, 60)
    assert count.read_text() == "run\n"  # one setup for the release, though two launches came at once
    logs = [(Path(rep["run_dir"]) / "setup.log").read_text() for rep in reps]
    assert sum("installed" in text for text in logs) == 1 and sum("already done" in text for text in logs) == 1
    for rep in reps:
        wait_until(lambda rep=rep: status_json(rep["id"])["state"] == "RUNNING", 30)
        assert status_json(rep["id"])["setup"]["state"] == "done"
    assert sorted(status_json(rep["id"])["setup"]["skipped"] for rep in reps) == [False, True]
    for rep in reps:
        assert cli_json("kill", rep["id"])["result"] == "KILLED"
    # a later launch of the same release skips it too, and so does its restart
    crashing = local_job(
        local_proj,
        "once2",
        "echo job-ran; sleep 1; exit 1",
        setup,
        "watch: {interval_s: 0.3, backoff_s: 0, max_restarts: 1}\n",
    )
    later = cli_json("launch", crashing)["id"]
    assert run_cli("watch", later, "--json", timeout=120).code == 10
    run = Path(status_json(later)["run_dir"])
    assert (run / "restarts").read_text().strip() == "1" and (run / "train.log").read_text().count("job-ran") == 2
    assert count.read_text() == "run\n" and (run / "setup.log").read_text().count("already done") == 2


def test_a_failed_setup_is_its_own_verdict_with_evidence_and_never_restarted(local_proj, tmp_path):
    f = local_job(
        local_proj,
        "badsetup",
        "echo job-ran; sleep 300",
        'echo "index $HF_TOKEN"; echo "ERROR: No matching distribution for nosuchpkg==9" >&2; exit 3',
        "env: {HF_TOKEN: hf_setup_secret}\nwatch: {interval_s: 0.5, backoff_s: 0, restart_on: [CRASHED]}\n",
    )
    job_id = cli_json("launch", f)["id"]
    res = run_cli("watch", job_id, "--json", timeout=120)
    polls = [json.loads(line) for line in res.stdout.splitlines()]
    last = polls[-1]
    assert res.code == EXIT_BY_STATE["SETUP_FAILED"] == 33 and last["state"] == "SETUP_FAILED", polls[-3:]
    assert "exit 3" in last["reason"] and any("No matching distribution" in e for e in last["evidence"]), last
    assert "hf_setup_secret" not in res.stdout and any("index ***" in e for e in last["evidence"]), last["evidence"]
    assert "Not restarted" in last["advice"]
    run = Path(status_json(job_id)["run_dir"])
    assert not (run / "restarts").exists() and "job-ran" not in (run / "train.log").read_text()
    assert "nosuchpkg" in (run / "setup.log").read_text()
    assert (run / "exit_code").read_text().strip() == "3"
    table = run_cli("ls").stdout
    assert "SETUP_FAILED" in table
    # no success was recorded: the next launch of the same release runs the setup again
    again = cli_json("launch", f)["id"]
    wait_until(lambda: status_json(again)["state"] == "SETUP_FAILED", 60)


def test_a_hung_setup_times_out_whole_and_a_kill_during_setup_leaves_nothing(local_proj, tmp_path):
    f = local_job(local_proj, "hung", "echo job-ran; sleep 300", "echo hangs; sleep 300", "setup_timeout_s: 2\n")
    hung = cli_json("launch", f)["id"]
    wait_until(lambda: status_json(hung)["state"] == "SETUP_FAILED", 60)
    st = status_json(hung)
    assert "timed out" in st["reason"] and st["setup"]["timed_out"] is True, st
    wait_until(lambda: tagged(hung) == [], 30)  # the setup's sleep went with its process group
    slow = cli_json("launch", local_job(local_proj, "slow", "echo job-ran; sleep 300", "sleep 300"))["id"]
    wait_until(lambda: status_json(slow)["reason"].startswith("setup: running"), 60)
    assert status_json(slow)["state"] == "STARTING"
    killed = cli_json("kill", slow)
    assert killed["result"] == "KILLED" and killed["remaining"] == [] and killed["term"], killed
    assert tagged(slow) == [] and status_json(slow)["state"] == "KILLED"
    run = Path(status_json(slow)["run_dir"])
    assert "job-ran" not in (run / "train.log").read_text()
    assert not list(run.parent.parent.glob("setup/*/*.json")), "a killed setup recorded a success"


@pytest.mark.parametrize(
    "body, expect",
    [
        ("setup: ''\n", "setup: must be a non-empty command line"),
        ("setup: [pip, install]\n", "setup"),
        ("setup: echo hi\nsetup_timeout_s: 0\n", "setup_timeout_s"),
        ("setup: echo hi\nsetpu_timeout_s: 5\n", "did you mean `setup_timeout_s`"),
    ],
)
def test_bad_setup_keys_are_one_line_exit_2(local_proj, body, expect):
    path = local_proj.parent / "jobfiles" / "bad.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(f"name: bad\nhost: local\ncommand: sleep 1\n{body}")
    res = run_cli("launch", str(path))
    assert res.code == 2 and expect in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert cli_json("ls") == {"jobs": []}
