"""The AdamW update in one Triton kernel (trainer/run/adamw_kernel.py), in Triton's interpreter on the CPU: the same
weights and moments as torch's AdamW step after step, with the clip's grad_scale, a skipped non-finite step, a
changing learning rate and weight decay; checkpoints that load into either optimizer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("triton")

CHECK = r'''
import torch
from trainer.run.adamw_kernel import TritonAdamW, available

assert available(torch.device("cpu"))
torch.manual_seed(0)
shapes = [(4096 + 7,), (3, 5000), (1,), (64, 64)]  # a partial last block, several blocks, a scalar-like one
ours = [torch.randn(s) for s in shapes]
ref = [p.clone() for p in ours]
for p in ours + ref:
    p.requires_grad_(True)
kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
opt, ref_opt = TritonAdamW(ours, fused=True, **kw), torch.optim.AdamW(ref, foreach=False, **kw)
for step in range(6):
    grads = [torch.randn(s) * (step + 1) for s in shapes]
    scale = torch.tensor(1.0 + step)  # the clip's factor: the update divides by it
    skip = step == 3  # a non-finite step: the device skips it, the step count too
    for p, r, g in zip(ours, ref, grads):
        p.grad, r.grad = g.clone(), g / scale
    opt.grad_scale = scale
    opt.found_inf = torch.tensor(1.0 if skip else 0.0)
    opt.step()
    if not skip:
        ref_opt.step()
    for group in (opt.param_groups[0], ref_opt.param_groups[0]):
        group["lr"] *= 0.7  # a schedule moves it between steps
for p, r in zip(ours, ref):
    torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    s, t = opt.state[p], ref_opt.state[r]
    torch.testing.assert_close(s["exp_avg"], t["exp_avg"], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(s["exp_avg_sq"], t["exp_avg_sq"], rtol=1e-5, atol=1e-9)
    assert float(s["step"]) == float(t["step"]) == 5.0
assert (ours[0] - ref[0]).abs().max() < 1e-5 and ours[0].grad.abs().sum() > 0

# a checkpoint of one loads into the other, and both go on alike
import io

def saved(o):  # through bytes, as a checkpoint on disk: no tensor shared with the optimizer it came from
    buf = io.BytesIO()
    torch.save(o.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf)

other = [p.detach().clone().requires_grad_(True) for p in ours]
torch_opt = torch.optim.AdamW(other, fused=True, **kw)
torch_opt.load_state_dict(saved(opt))
back = TritonAdamW([p.detach().clone().requires_grad_(True) for p in ours], fused=True, **kw)
back.load_state_dict(saved(torch_opt))
g = [torch.randn(s) for s in shapes]
for i, (p, q) in enumerate(zip(other, back.param_groups[0]["params"])):
    p.grad, q.grad = g[i].clone(), g[i].clone()
torch_opt.step()
back.step()
for p, q in zip(other, back.param_groups[0]["params"]):
    torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
print("ok")
'''


def run_check(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_the_kernel_updates_as_torch_adamw_with_the_clip_a_skipped_step_and_a_moving_lr_and_checkpoints_cross():
    proc = run_check(CHECK)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
