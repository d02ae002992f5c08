"""The new failure states for real, through dflashctl over the suite's sshd and tmux: a divergence of the bundled
trainer, a command that SIGKILLs itself, a tmpfs that fills, a GPU whose readings show uncorrectable ECC errors, and a
hung command judged the same by `status`, `watch --once` and a long `watch`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from dflashctl.judge.facts import EXIT_BY_STATE
from tests.conftest import run_cli, tmpfs
from tests.e2e.test_launch import cli_json, status_json, wait_until, write_project
from tests.e2e.test_watch import ROOT, box, launch, watch_json, write_job  # noqa: F401 - box is a fixture

FIXTURES = Path(__file__).parents[1] / "fixtures" / "nvidia-smi"


@pytest.mark.slow
def test_a_diverging_trainer_is_diverged_with_no_restart_and_nothing_non_finite(box):  # noqa: F811
    job = write_job(box, "nan", 40, env={"TRAINER_FAULT": "nan@6"}, trainer_extra="  optim: {max_nonfinite_steps: 3}\n")
    job_id = launch(job)
    code, records, err = watch_json(job_id)
    assert code == EXIT_BY_STATE["DIVERGED"] and records[-1]["state"] == "DIVERGED", (records[-1], err)
    assert records[-1]["restarts"] == 0  # not in the default restart_on: it would diverge again
    assert "fatal record: diverged" in records[-1]["reason"]
    assert any("from step 6" in e for e in records[-1]["evidence"])
    run_dir = Path(status_json(job_id)["run_dir"])
    assert not (run_dir / "export").exists()
    assert status_json(job_id)["state"] == "DIVERGED"  # whoever asks


def _command_job(p: Path, name: str, command: str, watch: str = "") -> Path:
    path = p / "jobs" / f"{name}.yaml"
    path.write_text(
        f"name: {name}\nhost: box\ncommand: {json.dumps(command)}\nkill_grace_s: 2\n"
        f"watch:\n  interval_s: 1\n  backoff_s: 0\n{watch}"
    )
    return path


@pytest.mark.slow
def test_a_hung_command_is_stalled_for_status_watch_once_and_watch_alike(client, tmp_path):
    p = write_project(client, tmp_path)
    # restart_on: [] : its supervisor would otherwise restart the stalled job (the default policy) before it is read
    job = _command_job(p, "hung", "echo one line; sleep 600", "  stall_after_s: 15\n  restart_on: []\n")
    assert run_cli("deploy", "box").code == 0
    job_id = cli_json("launch", str(job))["id"]
    try:
        # within stall_after_s of its one line (15 s: a loaded machine's launch and first look take a few)
        assert status_json(job_id)["state"] == "RUNNING"
        # status keeps nothing of its own: the run dir's history says how long the job is quiet
        st = wait_until(lambda: (s := status_json(job_id))["state"] != "RUNNING" and s, 60)
        assert st["state"] == "STALLED" and "no sign of progress" in " ".join(st["evidence"]), st
        once = run_cli("watch", job_id, "--once", "--json")
        assert once.code == EXIT_BY_STATE["STALLED"] and json.loads(once.stdout)["state"] == "STALLED"
    finally:
        run_cli("kill", job_id, "--grace", "1")


@pytest.mark.slow
def test_a_command_killed_by_sigkill_is_host_oom_and_not_restarted(client, tmp_path):
    p = write_project(client, tmp_path)
    cmd = f"echo working; {sys.executable} -c 'import os, signal; os.kill(os.getpid(), signal.SIGKILL)'"
    job = _command_job(p, "oomed", cmd)
    assert run_cli("deploy", "box").code == 0
    job_id = cli_json("launch", str(job))["id"]
    res = run_cli("watch", job_id, "--json", timeout=120)
    last = json.loads(res.stdout.splitlines()[-1])
    assert res.code == EXIT_BY_STATE["HOST_OOM"] and last["state"] == "HOST_OOM", last
    assert "SIGKILL" in last["reason"] and ("likely" in last["reason"] or "confirmed" in last["reason"])
    assert last["restarts"] == 0 and "host RAM" in last["advice"]


@pytest.fixture
def tiny_disk(tmp_path):
    with tmpfs(tmp_path / "tiny", "1100m") as mnt:  # room for a release and a launch (1 GiB free), then it fills
        yield mnt


@pytest.mark.slow
def test_a_filling_disk_is_disk_full_and_the_restart_is_refused_while_it_is_full(client, tmp_path, tiny_disk):
    p = write_project(client, tmp_path)
    (p / "dflashctl.yaml").write_text(
        f"hosts:\n  box: {{ssh: testbox, python: {sys.executable}, workdir: {tiny_disk}/wd}}\n"
    )
    fill = 'head -c 2G /dev/zero > "$DFLASHCTL_RUN_DIR/blob"'
    job = _command_job(p, "filler", fill, "  restart_on: [DISK_FULL]\n  max_restarts: 2\n")
    assert run_cli("deploy", "box").code == 0
    job_id = cli_json("launch", str(job))["id"]
    res = run_cli("watch", job_id, "--json", timeout=120)
    last = json.loads(res.stdout.splitlines()[-1])
    assert res.code == EXIT_BY_STATE["DISK_FULL"] and last["state"] == "DISK_FULL", (last, res.stderr)
    assert "No space left on device" in " ".join(last["evidence"])
    assert last["restarts"] == 0 and "the disk is still full" in res.stderr


@pytest.mark.slow
def test_a_gpu_with_uncorrectable_ecc_errors_is_refused_by_launch_and_shown_by_doctor(client, tmp_path, sshd):
    p = write_project(client, tmp_path)
    gpus = sshd.dir / "nvidia-gpus.csv"
    recorded = gpus.read_text()
    (p / "jobs" / "on-gpu0.yaml").write_text("name: on-gpu0\nhost: box\ngpus: [0]\ncommand: sleep 300\n")
    (sshd.dir / "nvidia-apps.csv").write_text("")
    assert run_cli("deploy", "box").code == 0
    try:  # the recorded H200 reading with its uncorrected volatile ECC count (the last field) at 2
        gpus.write_text(recorded.rstrip("\n").rsplit(",", 1)[0] + ", 2\n")
        res = run_cli("launch", "jobs/on-gpu0.yaml")
        assert res.code == 2 and "GPU 0 is faulty: 2 uncorrectable ECC errors" in res.stderr, res.stderr
        assert "--force" in res.stderr
        doc = run_cli("doctor", "box")
        assert "2 uncorrectable ECC errors" in doc.stdout + doc.stderr
    finally:
        gpus.write_text(recorded)
        (sshd.dir / "nvidia-apps.csv").write_text((FIXTURES / "h200-query-compute-apps.csv").read_text())
