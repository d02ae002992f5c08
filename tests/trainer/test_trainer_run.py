"""The training run as a process: run dir files, exact resume after SIGKILL, crash-safe checkpoints, two ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trainer.run import checkpoint
from trainer.run.metrics import validate_record

ROOT = Path(__file__).resolve().parents[2]
CONFIG = """
target: {random_preset: tiny-qwen3, dtype: float32}
drafter: {num_layers: 1, block_size: 8}
attention: {backend: dense}
data: {anchors_per_seq: 16, seq_buckets: [128], synthetic_samples: 12, holdout: 2, batch_size: BATCH}
device: cpu
steps: 6
heartbeat_s: 0.2
checkpoint: {every: 3, keep: 2}
eval: {prompts: 2, max_new_tokens: 16}
"""


def write_config(tmp_path: Path, batch: int = 2, extra: str = "") -> Path:
    path = tmp_path / f"train-{batch}.yaml"
    path.write_text(CONFIG.replace("BATCH", str(batch)) + extra)
    return path


def trainer_cmd(cfg: Path, run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "trainer.train", "--config", str(cfg), "--run-dir", str(run_dir), *extra]


def run(cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, **(env or {})})


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def step_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir) if "event" not in r}


def wait_for(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def has_event(run_dir: Path, event: str, **fields) -> bool:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return False
    return any(r.get("event") == event and all(r.get(k) == v for k, v in fields.items()) for r in records(run_dir))


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """One uninterrupted run of the module's config (6 steps, checkpoints at 3 and 6), trained once for the tests
    that only read it or copy it: the metrics contract, the bitwise reference, the checkpoint fallback."""
    d = tmp_path_factory.mktemp("straight")
    proc = run(trainer_cmd(write_config(d), d / "run"))
    assert proc.returncode == 0, proc.stderr
    return d / "run", proc


def test_run_dir_follows_the_metrics_contract(straight):
    run_dir, proc = straight
    recs = records(run_dir)
    for rec in recs:
        assert validate_record(rec) == [], rec
    events = [r.get("event") for r in recs]
    assert [e for e in events if e != "preflight_progress"][:3] == ["data", "start", "preflight"]
    assert events[-1] == "finished" and events.index("preflight_progress") < events.index("preflight")
    (pre,) = [r for r in recs if r.get("event") == "preflight"]  # the attention it compiled, and why
    attention = pre["attention"]
    assert attention["backend"] == "dense" and attention["patches"] == []
    if attention["flex_backend"] is not None:  # flex for evaluation: Triton on the CPU, with the reason
        assert attention["flex_backend"] == "triton" and "CUDA" in attention["why"]
    assert [r["step"] for r in recs if "event" not in r] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in recs if r.get("event") == "checkpoint"] == [3, 6]
    assert any(r.get("event") == "eval" and r["tau"] >= 1.0 for r in recs)
    hb = json.loads((run_dir / "heartbeat").read_text())
    assert hb["step"] == 6 and hb["phase"] == "train"
    assert [p.name for p in checkpoint.complete(run_dir / "checkpoints")] == ["step-00000003", "step-00000006"]
    assert "step 6/6" in proc.stdout and "finished: 6 steps" in proc.stdout


def test_resume_after_sigkill_is_bitwise_exact(tmp_path, straight):
    cfg = write_config(tmp_path)
    straight = straight[0]  # the same config, never interrupted

    killed = tmp_path / "killed"
    env = {**os.environ, "TRAINER_FAULT": "hang@4"}  # alive and past the step-3 checkpoint when killed
    proc = subprocess.Popen(trainer_cmd(cfg, killed), cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    try:
        wait_for(lambda: has_event(killed, "checkpoint", step=3))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert max(step_losses(killed)) == 3
    resumed = run(trainer_cmd(cfg, killed, "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout and "from step 3" in resumed.stdout

    # CPU kernels are deterministic for the same shapes and order, so equality is exact, not approximate
    assert step_losses(killed) == step_losses(straight)
    a = load_file(str(checkpoint.latest(straight / "checkpoints") / "drafter.safetensors"))
    b = load_file(str(checkpoint.latest(killed / "checkpoints") / "drafter.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sigkill_while_writing_a_checkpoint_keeps_the_previous_one(tmp_path):
    cfg = write_config(tmp_path)
    run_dir = tmp_path / "run"
    env = {**os.environ, "TRAINER_FAULT": "hang-in-checkpoint@6"}
    proc = subprocess.Popen(trainer_cmd(cfg, run_dir), cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    ckpts = run_dir / "checkpoints"
    try:
        wait_for(lambda: (ckpts / "step-00000006.tmp" / "drafter.safetensors").exists())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert checkpoint.latest(ckpts).name == "step-00000003"
    loaded = checkpoint.load(checkpoint.latest(ckpts))
    assert loaded.position.step == 3 and loaded.weights
    resumed = run(trainer_cmd(cfg, run_dir, "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    assert checkpoint.latest(ckpts).name == "step-00000006" and not list(ckpts.glob("*.tmp"))


def test_two_ranks_under_torchrun_match_one_process(tmp_path):
    """2 ranks x batch 1 see the same global batches as 1 process x batch 2; the loss is normalised globally."""
    single = tmp_path / "single"
    assert run(trainer_cmd(write_config(tmp_path, batch=2), single)).returncode == 0
    two = tmp_path / "two"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(ROOT / "tests" / "dist_worker.py"),
        str(write_config(tmp_path, batch=1)),
        str(two),
    ]
    proc = run(cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = step_losses(single), step_losses(two)
    assert a.keys() == b.keys()
    for step in a:
        assert abs(a[step] - b[step]) < 1e-4 * max(1.0, abs(a[step])), (step, a[step], b[step])
    r0 = torch.load(two / "params-rank0.pt")
    r1 = torch.load(two / "params-rank1.pt")
    assert all(torch.equal(r0[k], r1[k]) for k in r0), "drafter replicas diverged across ranks"
    ref = load_file(str(checkpoint.latest(single / "checkpoints") / "drafter.safetensors"))
    assert all(torch.allclose(ref[k], r0[k], atol=1e-5) for k in ref)
    start = next(r for r in records(two) if r.get("event") == "start")
    assert start["world_size"] == 2
    assert sorted(r["rank"] for r in records(two) if r.get("event") == "preflight") == [0, 1]
    assert all(len(r["peak_mem_gib_ranks"]) == 2 for r in records(two) if "event" not in r)


def test_dense_fallback_and_config_error_leave_a_fatal_record(tmp_path):
    # flex for decoding on the CPU: its compiled forward exists, so with compile disabled the guard must fire
    cfg = tmp_path / "flex-eval.yaml"
    cfg.write_text(CONFIG.replace("BATCH", "2").replace("eval: {prompts: 2", "eval: {backend: flex, prompts: 2"))
    run_dir = tmp_path / "fallback"
    proc = run(trainer_cmd(cfg, run_dir), env={"TORCH_COMPILE_DISABLE": "1"})
    assert proc.returncode == 3, proc.stderr
    fatal = records(run_dir)[-1]
    assert validate_record(fatal) == [] and fatal["kind"] == "dense_fallback"
    assert "TORCH_COMPILE_DISABLE" in fatal["message"]

    bad = tmp_path / "bad.yaml"
    bad.write_text(CONFIG.replace("BATCH", "2") + "optim: {learning_rate: 1}\n")
    run_dir = tmp_path / "config"
    proc = run(trainer_cmd(bad, run_dir))
    assert proc.returncode == 2
    fatal = records(run_dir)[-1]
    assert fatal["kind"] == "config" and "optim.learning_rate" in fatal["message"]


def test_crash_is_exit_1_with_traceback_and_fatal_record(tmp_path):
    run_dir = tmp_path / "run"
    proc = run(trainer_cmd(write_config(tmp_path), run_dir), env={"TRAINER_FAULT": "crash@2"})
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "RuntimeError: injected fault at step 2" in proc.stderr
    fatal = records(run_dir)[-1]
    assert fatal["event"] == "fatal" and fatal["kind"] == "crash"


@pytest.mark.parametrize("field, value", [("step", "three"), ("loss", None)])
def test_validate_record_rejects_bad_records(field, value):
    rec = {
        "time": 1.0,
        "step": 1,
        "epoch": 0,
        "tokens_per_s": 1.0,
        "loss": 1.0,
        "acc": 0.0,
        "lr": 1e-3,
        "grad_norm": 1.0,
        "peak_mem_gib": 0.0,
    }
    assert validate_record(rec) == []
    assert validate_record({**rec, field: value})
    assert validate_record({"time": 1.0, "event": "fatal", "kind": "oops", "message": "x"})


def flip_first_byte(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])


def test_resume_falls_back_to_the_newest_intact_checkpoint(tmp_path, straight):
    """A truncated state.pt, a flipped safetensors header or a missing file in the newest checkpoint: resume uses the
    previous one and says so in metrics.jsonl; when none is intact it is a config-class error (exit 2, no restart)."""
    import shutil

    cfg = write_config(tmp_path)
    base = straight[0]  # copied before any damage: the shared run stays as trained
    ckpts = lambda d: d / "checkpoints"  # noqa: E731
    damages = {
        "truncated": lambda c: (c / "state.pt").write_bytes((c / "state.pt").read_bytes()[:100]),
        "flipped": lambda c: flip_first_byte(c / "drafter.safetensors"),
        "missing": lambda c: (c / "state.pt").unlink(),
    }
    for name, damage in damages.items():
        d = tmp_path / name
        shutil.copytree(base, d)
        damage(ckpts(d) / "step-00000006")
        path, loaded, skipped = checkpoint.load_newest_intact(ckpts(d))
        assert path.name == "step-00000003" and loaded.position.step == 3, name
        assert [s["path"].endswith("step-00000006") for s in skipped] == [True], skipped

    resumed = run(trainer_cmd(cfg, tmp_path / "truncated", "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    recs = records(tmp_path / "truncated")
    fallback = [r for r in recs if r.get("event") == "checkpoint_fallback"]
    assert len(fallback) == 1 and fallback[0]["using"].endswith("step-00000003")
    assert validate_record(fallback[0]) == []
    starts = [r for r in recs if r.get("event") == "start"]
    assert starts[-1]["resumed_from"] == 3

    ruined = tmp_path / "ruined"
    shutil.copytree(base, ruined)
    damages["missing"](ckpts(ruined) / "step-00000003")
    damages["flipped"](ckpts(ruined) / "step-00000006")
    res = run(trainer_cmd(cfg, ruined, "--resume"))
    assert res.returncode == 2 and "no intact checkpoint" in res.stderr + res.stdout
    assert any(r.get("event") == "fatal" and r.get("kind") == "config" for r in records(ruined))
