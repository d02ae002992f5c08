"""The compile helper (trainer/run/compile_helper.py): a real second process compiling the first bucket through
Inductor on the CPU, the trainer finding its graphs in the shared cache with the same losses, and the helper's edges
(no helper, another run's state file, a dead or reused pid, the trainer killed while it compiles)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import TESTS, run_trainer_cli
from trainer.run import compile_helper

CONFIG = """
target: {random_preset: tiny-qwen3, dtype: float32, compile: off}
drafter: {num_layers: 1, block_size: 8, compile: on}
attention: {backend: dense}
data: {anchors_per_seq: 16, seq_buckets: [128], synthetic_samples: 4, holdout: 1}
eval: {at_end: false}
device: cpu
steps: 2
compile_helper: HELPER
"""


def write_state(run_dir: Path, **fields) -> None:
    compile_helper.state_path(run_dir).write_text(json.dumps({"token": str(os.getppid()), **fields}))


def test_no_helper_no_wait(tmp_path):
    assert compile_helper.wait_for(tmp_path)["state"] == "none"


def test_another_runs_state_file_is_never_taken_for_this_ones(tmp_path):
    compile_helper.state_path(tmp_path).write_text(json.dumps({"token": "1", "state": "done", "pid": 1}))
    assert compile_helper.read_state(tmp_path) is None and compile_helper.wait_for(tmp_path)["state"] == "none"
    compile_helper.state_path(tmp_path).write_text("{garbage")
    assert compile_helper.wait_for(tmp_path)["state"] == "none"
    write_state(tmp_path, state="skipped", reason="no room", pid=1)
    assert compile_helper.wait_for(tmp_path) | {"waited_s": 0} == {
        "token": str(os.getppid()), "state": "skipped", "reason": "no room", "pid": 1, "waited_s": 0}  # fmt: skip


def test_a_helper_that_died_or_whose_pid_was_reused_is_not_waited_for(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    write_state(tmp_path, state="compiling", pid=gone.pid)
    assert compile_helper.wait_for(tmp_path, limit_s=30)["state"] == "died"
    other = subprocess.Popen(["sleep", "30"])  # alive, but not a helper: a pid reused by another program
    try:
        write_state(tmp_path, state="compiling", pid=other.pid)
        assert compile_helper.wait_for(tmp_path, limit_s=30)["state"] == "died"
    finally:
        other.kill()
        other.wait()


def test_on_and_off_read_as_yaml_booleans_are_accepted(tmp_path):
    from trainer.config import load_config

    path = tmp_path / "t.yaml"
    path.write_text(CONFIG.replace("HELPER", "off").replace("compile: on", "compile: true"))
    cfg = load_config(str(path))
    assert (cfg.compile_helper, cfg.drafter.compile, cfg.target.compile) == ("off", "on", "off")


def run(tmp_path: Path, name: str, helper: str) -> tuple[list[dict], subprocess.CompletedProcess]:
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(CONFIG.replace("HELPER", helper))
    run_dir = tmp_path / name
    proc = run_trainer_cli(cfg, "--run-dir", str(run_dir), env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"{name}-c")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()], proc


@pytest.mark.slow
def test_the_trainer_finds_the_helpers_graphs_and_trains_the_same(tmp_path):
    """Inductor for real (C++ on the CPU): the helper compiles the first bucket through hollow models, the trainer's
    own first bucket is all cache hits, and its losses are the ones of a run without a helper, to the bit."""
    with_helper, proc = run(tmp_path, "with", "on")
    pre = next(r for r in with_helper if r.get("event") == "preflight")
    assert pre["compile_helper"]["state"] == "done", pre
    assert pre["compile_cache"]["hits"] > 0 and pre["compile_cache"]["misses"] == 0, pre
    assert "compile helper: done" in proc.stdout and "compile helper" not in proc.stderr
    assert (tmp_path / "with" / "compile-helper.log").exists()
    without, _ = run(tmp_path, "without", "off")
    pre = next(r for r in without if r.get("event") == "preflight")
    assert "compile_helper" not in pre and pre["compile_cache"]["misses"] > 0
    losses = [[r["loss"] for r in recs if "event" not in r] for recs in (with_helper, without)]
    assert losses[0] == losses[1] and len(losses[0]) == 2


def test_the_helper_dies_with_a_killed_trainer(tmp_path):
    """SIGKILL gives the trainer no chance to stop its helper: the kernel's parent-death signal does."""
    cfg = tmp_path / "k.yaml"
    cfg.write_text(CONFIG.replace("HELPER", "on"))
    run_dir = tmp_path / "k"
    trainer = subprocess.Popen([sys.executable, "-m", "trainer.train", "--config", str(cfg), "--run-dir", str(run_dir)],
                               cwd=TESTS.parent, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        state = None
        while time.monotonic() < deadline:
            try:
                state = json.loads(compile_helper.state_path(run_dir).read_text())
            except (OSError, ValueError):
                state = None
            if state and state.get("state") in ("starting", "compiling"):
                break
            time.sleep(0.05)
        assert state and state["token"] == str(os.getpid()), state  # the trainer's parent
        helper_pid = state["pid"]
        assert Path(f"/proc/{helper_pid}").exists()
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{helper_pid}").exists() and time.monotonic() < deadline:
        if Path(f"/proc/{helper_pid}/stat").read_text().split()[2] == "Z":
            break  # dead, waiting for its parent's parent (this test's process) to reap it
        time.sleep(0.05)
    alive = Path(f"/proc/{helper_pid}").exists() and Path(f"/proc/{helper_pid}/stat").read_text().split()[2] != "Z"
    assert not alive


def test_a_restart_in_the_same_run_dir_never_reads_the_last_runs_state(tmp_path, monkeypatch):
    """A restart under the same parent (the launcher's wrapper) has the same token: rank 0 removes the old state at
    its start, whether or not this run has a helper."""
    from trainer.config import load_config

    path = tmp_path / "t.yaml"
    path.write_text(CONFIG.replace("HELPER", "off"))
    write_state(tmp_path, state="done", pid=1)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert compile_helper.spawn(str(path), tmp_path, load_config(str(path))) is None
    assert not compile_helper.state_path(tmp_path).exists() and compile_helper.wait_for(tmp_path)["state"] == "none"
