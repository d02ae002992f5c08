"""The fused LM-head loss kernel (trainer/model/ce_kernel.py) in Triton's interpreter on the CPU: the same loss,
accuracy and gradient as the plain bf16-logits path, in chunks, with ties, with zero weights, and without grad."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_trainer_cli

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("triton")

CHECK = r"""
import torch, torch.nn.functional as F
from trainer.model.ce_kernel import available, fused_linear_cross_entropy
from trainer.model.drafter import block_loss

assert available(torch.device("cpu"))
torch.manual_seed(0)
for N, C, V, chunk in ((37, 16, 1000, 16), (8, 32, 4100, 8), (5, 8, 7, 64)):
    h = torch.randn(N, C, dtype=torch.bfloat16, requires_grad=True)
    W = (torch.randn(V, C) * 0.5).to(torch.bfloat16)
    labels = torch.randint(0, V, (N,))
    w = torch.rand(N)
    w[0] = 0.0  # a position that does not count
    loss, correct = fused_linear_cross_entropy(h, W, labels, w, chunk)
    loss.backward()
    h2 = h.detach().clone().requires_grad_(True)
    logits = (h2 @ W.t()).float()  # the plain path: bf16 logits, then fp32
    ref = (F.cross_entropy(logits, labels, reduction="none") * w).sum()
    ref_c = ((logits.argmax(-1) == labels).float() * w).sum()
    ref.backward()
    assert torch.allclose(loss, ref, rtol=1e-5, atol=1e-4), (loss, ref)
    assert torch.allclose(correct, ref_c), (correct, ref_c)
    err = (h.grad.float() - h2.grad.float()).abs().max().item()
    assert err <= 0.02 * h2.grad.abs().max().item() + 1e-6, err  # bf16 noise
# ties: the first maximum wins, as torch.argmax (several blocks of equal logits)
W = torch.zeros(9000, 4, dtype=torch.bfloat16)
h = torch.ones(3, 4, dtype=torch.bfloat16)
_, correct = fused_linear_cross_entropy(h, W, torch.tensor([0, 1, 4096]), torch.ones(3))
assert correct.item() == 1.0, correct
# no grad asked: the same loss, no gradient kept
with torch.no_grad():
    loss_ng, _ = fused_linear_cross_entropy(h, W, torch.tensor([0, 1, 4096]), torch.ones(3))
assert torch.isclose(loss_ng, torch.log(torch.tensor(9000.0)) * 3)
# through the trainer's block_loss with the fused kernel asked for
head = torch.nn.Linear(16, 1000, bias=False).to(torch.bfloat16)
hid = torch.randn(2, 4, 16, requires_grad=True)
lab = torch.randint(0, 1000, (2, 4)); wts = torch.tensor([[1.0, 0.5, 0.0, 1.0], [0.0, 0.0, 1.0, 1.0]])
a = block_loss(hid, head, lab, wts, kernel="fused")
b = block_loss(hid, head, lab, wts, kernel="plain")
assert torch.allclose(a[0], b[0], rtol=1e-4) and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]), (a, b)
print("ok")
"""


def test_the_kernel_matches_the_plain_path_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_fused_is_a_config_error_where_it_cannot_run(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "target: {random_preset: tiny-qwen3, dtype: float32}\ndrafter: {num_layers: 1, block_size: 8}\n"
        "attention: {backend: dense}\ndata: {anchors_per_seq: 16, seq_buckets: [128]}\ndevice: cpu\n"
        "optim: {loss_kernel: fused}\nsteps: 1\n"
    )
    proc = run_trainer_cli(cfg, unset=("TRITON_INTERPRET",))
    assert proc.returncode == 2 and "optim.loss_kernel" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
