"""A run that diverges: the trainer skips non-finite steps, stops with a `diverged` record and exit 4, and never
writes a non-finite checkpoint or export (the last good checkpoint survives the rotation)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from trainer.errors import EXIT_DIVERGED
from trainer.run import checkpoint
from trainer.run.metrics import validate_record

ROOT = Path(__file__).resolve().parents[2]
CONFIG = """
drafter: {num_layers: 1, block_size: 8}
attention: {backend: dense}
data: {anchors_per_seq: 16, seq_buckets: [128], synthetic_samples: 12, holdout: 2, batch_size: 2}
device: cpu
heartbeat_s: 0.2
eval: {at_end: false}
optim: {max_nonfinite_steps: 4}
"""


def train(tmp_path: Path, target: str, steps: int, extra: str = "", env: dict | None = None):
    cfg = tmp_path / "train.yaml"
    cfg.write_text(f"target: {target}\nsteps: {steps}\n{CONFIG}{extra}")
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "trainer.train", "--config", str(cfg), "--run-dir", str(run_dir)]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return proc, run_dir, recs


def overflowing_target(tmp_path: Path) -> Path:
    """The tiny target with its embedding scaled past float32's range: every hidden state is inf, every loss NaN."""
    from trainer.data.tiny import write_tiny_target

    out = write_tiny_target(tmp_path / "tiny")
    target = out if (out / "config.json").exists() else out / "target"
    weights = target / "model.safetensors"
    state = load_file(str(weights))
    key = next(k for k in state if k.endswith("embed_tokens.weight"))
    state[key] = state[key] * 3e38
    save_file(state, str(weights), metadata={"format": "pt"})
    return target


@pytest.mark.slow
def test_a_target_that_overflows_diverges_with_exit_4_and_writes_nothing_non_finite(tmp_path):
    target = overflowing_target(tmp_path)
    proc, run_dir, recs = train(tmp_path, f"{{path: {target}, dtype: float32}}", 12, "checkpoint: {every: 2}\n")
    assert proc.returncode == EXIT_DIVERGED, proc.stderr[-2000:]
    steps = [r for r in recs if "event" not in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]  # stopped at the limit, not at steps: 12
    assert all(r["skipped"] and r["nonfinite_steps"] == i + 1 for i, r in enumerate(steps))
    assert all(r["loss"] is None or r["grad_norm"] is None for r in steps)  # NaN is not JSON: null stands for it
    assert all(validate_record(r) == [] for r in recs)
    fatal = next(r for r in recs if r.get("event") == "fatal")
    assert fatal["kind"] == "diverged" and fatal["first_bad_step"] == 1 and fatal["checkpoint"] is None
    assert "non-finite for 4 steps in a row from step 1" in fatal["message"]
    assert not any(r.get("event") in ("finished", "export", "checkpoint") for r in recs)
    assert not (run_dir / "export").exists() and checkpoint.complete(run_dir / "checkpoints") == []
    assert any(r.get("event") == "checkpoint_skipped" for r in recs)  # step 2 and 4 fell in the streak
    from dflashctl.judge.diagnosis import diagnose_text  # what any log reader (diagnose, a watcher) makes of it

    assert diagnose_text(proc.stdout + proc.stderr).state == "DIVERGED"


@pytest.mark.slow
def test_a_run_that_turns_nan_keeps_its_last_finite_checkpoint_and_resume_starts_there(tmp_path):
    proc, run_dir, recs = train(
        tmp_path,
        "{random_preset: tiny-qwen3, dtype: float32}",
        20,
        "checkpoint: {every: 2, keep: 3}\n",
        env={"TRAINER_FAULT": "nan@7"},
    )
    assert proc.returncode == EXIT_DIVERGED, proc.stderr[-2000:]
    kept = checkpoint.complete(run_dir / "checkpoints")
    assert [p.name for p in kept] == ["step-00000002", "step-00000004", "step-00000006"]  # none after step 6
    for p in kept:
        assert checkpoint.nonfinite(load_file(str(p / "drafter.safetensors"))) == []
    fatal = next(r for r in recs if r.get("event") == "fatal")
    assert fatal["first_bad_step"] == 7 and fatal["last_finite_step"] == 6 and math.isfinite(fatal["last_finite_loss"])
    assert fatal["checkpoint"].endswith("step-00000006") and "newest checkpoint from before" in fatal["message"]
    # the newest checkpoint made non-finite by hand (a copy, a disk error, an older trainer): resume skips it
    bad = kept[-1] / "drafter.safetensors"
    state = load_file(str(bad))
    state = {k: v.fill_(float("nan")) if v.is_floating_point() else v for k, v in state.items()}
    save_file(state, str(bad))
    manifest = json.loads((kept[-1] / "manifest.json").read_text())
    manifest["files"]["drafter.safetensors"]["sha256"] = checkpoint._sha256(bad)
    manifest["files"]["drafter.safetensors"]["size"] = bad.stat().st_size
    (kept[-1] / "manifest.json").write_text(json.dumps(manifest))
    path, loaded, skipped = checkpoint.load_newest_intact(run_dir / "checkpoints")
    assert path == kept[-2] and "not finite" in skipped[0]["why"]


def test_non_finite_weights_are_never_saved_or_exported(tmp_path):
    from trainer.errors import NonFiniteWeightsError
    from trainer.model.dflash_format import write_export

    lin = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(lin.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    root = tmp_path / "checkpoints"
    checkpoint.save(root, checkpoint.Position(1, 0, 1), lin, opt, sched, [checkpoint.rng_state()], keep=1)
    with torch.no_grad():
        lin.weight[0, 0] = float("inf")
    with pytest.raises(NonFiniteWeightsError, match="step 2: 1 drafter tensors are non-finite"):
        checkpoint.save(root, checkpoint.Position(2, 0, 2), lin, opt, sched, [checkpoint.rng_state()], keep=1)
    assert [p.name for p in checkpoint.complete(root)] == ["step-00000001"]  # the good one was not rotated out
    assert not list(root.glob("*.tmp"))
    with pytest.raises(NonFiniteWeightsError):
        write_export(tmp_path / "export", {"fc.weight": lin.weight.detach()}, {"architectures": ["DFlashDraftModel"]})
    assert not (tmp_path / "export").exists()


def test_a_non_finite_step_is_skipped_by_the_optimizer_itself_and_a_finite_one_updates():
    """The update is queued before the host reads the step's numbers (Run._step_update): the fused AdamW skips it
    on the device when the loss sum or the grad norm is not finite. A skipped step leaves weights, moments and the
    step count as they were; the next finite step updates as if the bad one never happened."""
    from types import SimpleNamespace

    from trainer.run.training import Run

    torch.manual_seed(0)
    p, q = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))
    q.data.copy_(p.data)
    run = SimpleNamespace(opt=torch.optim.AdamW([p], lr=0.1, fused=True))
    ref = torch.optim.AdamW([q], lr=0.1, fused=True)  # never sees the bad step
    grad = torch.randn(4)
    numbers = torch.tensor([3.0, 1.0, 0.5, 8.0, 2.0], dtype=torch.float64)  # loss, correct, peak, weight, grad norm
    for bad in ([float("nan"), 1.0, 0.5, 8.0, 2.0], [3.0, 1.0, 0.5, 8.0, float("inf")]):
        before = p.detach().clone()
        p.grad = grad.clone()
        host = Run._step_update(run, torch.tensor(bad, dtype=torch.float64))
        assert not math.isfinite(host[0]) or not math.isfinite(host[-1])
        assert torch.equal(p.detach(), before) and float(run.opt.state[p]["step"]) == 0
    p.grad, q.grad = grad.clone(), grad.clone()
    assert Run._step_update(run, numbers) == numbers.tolist()
    ref.step()
    assert torch.equal(p.detach(), q.detach()) and float(run.opt.state[p]["step"]) == 1


@pytest.mark.parametrize("grad_size", [0.01, 50.0])  # under the clip (no change) and far over it (scaled down)
def test_the_clip_folded_into_the_update_trains_as_clip_grad_norm_then_step(grad_size):
    """clip_into_update hands the clip to the fused AdamW as its grad_scale instead of scaling every gradient in a
    pass of its own: over three steps the weights and moments match clip_grad_norm_ + step, and the norm returned
    is the same pre-clip norm."""
    from trainer.run.update import clip_into_update

    torch.manual_seed(0)
    shapes = [(7, 5), (5,), (3, 7)]
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = torch.optim.AdamW(ours, lr=0.05, betas=(0.9, 0.95), fused=True)
    opt_ref = torch.optim.AdamW(ref, lr=0.05, betas=(0.9, 0.95), fused=True)
    for _ in range(3):
        grads = [torch.randn(s) * grad_size for s in shapes]
        for p, q, g in zip(ours, ref, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        norm = clip_into_update(opt, ours, 1.0)
        norm_ref = torch.nn.utils.clip_grad_norm_(ref, 1.0)
        assert torch.allclose(norm, norm_ref)
        assert (float(opt.grad_scale) > 1.0) == (grad_size > 1.0)
        opt.step()
        opt_ref.step()
    for p, q in zip(ours, ref, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(opt.state[p]["exp_avg"], opt_ref.state[q]["exp_avg"], rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], opt_ref.state[q]["exp_avg_sq"], rtol=1e-5, atol=1e-12)
