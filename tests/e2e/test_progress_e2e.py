"""A real `command:` job on the built-in `local` host whose script prints progress the way Hugging Face's Trainer does
(the real tqdm, its bar on stderr; the logged dict written through the bar as ProgressCallback writes it, its values
as transformers 5 prints them): `status --json`, `watch --once` and `ls` show its step, loss, throughput and time
left; when its step stops while its log still grows, its supervisor and `status` say STALLED."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.e2e.test_launch import cli_json, status_json, wait_until

SCRIPT = """
import os, sys, time
from tqdm import tqdm

stop = os.path.join(os.environ["DFLASHCTL_RUN_DIR"], "stall-now")
total = 100000
bar = tqdm(total=total)  # the Trainer's bar: tqdm(total=max_steps), on stderr
step = 0
while True:
    if os.path.exists(stop):  # stuck: the step stands, the log still grows
        print("waiting for a batch from the data loader", file=sys.stderr, flush=True)
        time.sleep(0.5)
        continue
    time.sleep(0.02)
    step += 1
    bar.update(1)
    if step % 20 == 0:  # ProgressCallback.on_log: training_bar.write(str(logs))
        bar.write(str({"loss": f"{3.0 - step / 10000:.4g}", "grad_norm": "0.9076", "learning_rate": "4.5e-05",
                       "epoch": f"{step / total:.2g}"}))
"""


def project(client) -> Path:
    p = client.project
    (p / "train_like_hf.py").write_text(SCRIPT)
    (p / "jobs").mkdir()
    job = p / "jobs" / "bar.yaml"
    # restart_on: [] so that the stall stays to be read; interval 1 s: the supervisor samples often
    job.write_text(
        f"name: bar\nhost: local\ncommand: {sys.executable} -u train_like_hf.py\nkill_grace_s: 2\n"
        "watch:\n  interval_s: 1\n  stall_after_s: 10\n  restart_on: []\n"
    )
    return job


@pytest.mark.slow
def test_a_scripts_progress_bar_gives_status_watch_and_ls_its_step_loss_throughput_and_eta(client):
    job = project(client)
    assert run_cli("deploy", "local").code == 0
    job_id = cli_json("launch", str(job))["id"]
    try:
        st = wait_until(lambda: (s := status_json(job_id))["loss"] is not None and s["step"] and s, 120)
        assert st["state"] == "RUNNING" and "(its log)" in st["reason"], st
        assert st["step"] >= 20 and 2.0 < st["loss"] < 3.0
        assert st["throughput_unit"] == "it/s" and st["throughput"] > 0 and st["tokens_per_s"] is None
        assert st["eta_s"] > 0  # 100,000 steps at ~50 a second: the bar's own estimate
        once = run_cli("watch", job_id, "--once", "--json")
        rec = json.loads(once.stdout)
        assert once.code == 0 and rec["state"] == "RUNNING" and rec["throughput_unit"] == "it/s"
        assert rec["step"] >= st["step"] and rec["eta_s"] > 0
        line = run_cli("watch", job_id, "--once").stdout  # not a terminal: one line a poll
        assert "it/s now" in line and "ETA " in line and "tok/s" not in line, line
        listed = next(j for j in cli_json("ls")["jobs"] if j["id"] == job_id)
        assert listed["state"] == "RUNNING" and "step" in listed["reason"], listed
        # the script keeps printing but its step stands: after stall_after_s its supervisor says STALLED, and so
        # does status (it reads the supervisor's word while the supervisor answers)
        Path(st["run_dir"], "stall-now").touch()
        stalled = wait_until(lambda: (s := status_json(job_id))["state"] == "STALLED" and s, 120)
        assert any("no new step in its log" in e for e in stalled["evidence"]), stalled["evidence"]
        assert stalled["restarts"] == 0
    finally:
        run_cli("kill", job_id, "--grace", "1")
