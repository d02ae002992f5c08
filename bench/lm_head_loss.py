"""The LM head and loss alone at the paper shape (fwd+bwd, frozen head): 7,680 labelled positions (512 anchors x 15)
x 4,096 -> 151,936, bf16. The plain fp32-logits path, the chunked autograd function, the fused Triton kernel at a few
chunk and block sizes, and the two matmuls alone (the floor); loss and gradient against the plain path.

    python bench/lm_head_loss.py [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", type=int, default=512 * 15)
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F

    from trainer.model import ce_kernel
    from trainer.model.loss import linear_cross_entropy

    dev = torch.device("cuda")
    N, C, V = args.rows, 4096, 151936
    g = torch.Generator(device=dev).manual_seed(0)
    W = (torch.randn(V, C, device=dev, generator=g) * 0.02).to(torch.bfloat16)
    h0 = torch.randn(N, C, device=dev, generator=g).to(torch.bfloat16)
    labels = torch.randint(0, V, (N,), device=dev, generator=g)
    w = torch.rand(N, device=dev, generator=g)

    def plain(h):
        logits = (h @ W.t()).float()
        loss = (F.cross_entropy(logits, labels, reduction="none") * w).sum()
        correct = ((logits.argmax(-1) == labels).float() * w).sum()
        return loss, correct

    def timed(fn, reps=10) -> tuple[float, float, tuple]:
        for _ in range(3):
            h = h0.clone().requires_grad_(True)
            loss, correct = fn(h)
            loss.backward()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ts = []
        for _ in range(reps):
            h = h0.clone().requires_grad_(True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss, correct = fn(h)
            loss.backward()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        return statistics.median(ts) * 1e3, peak, (loss.detach().float().item(), correct.item(), h.grad.float())

    rows: dict = {}
    ref_ms, ref_peak, (ref_loss, ref_correct, ref_grad) = timed(plain)
    rows["plain fp32 logits"] = {"ms": ref_ms, "peak_gib": ref_peak}
    ms, peak, (loss, _, grad) = timed(lambda h: linear_cross_entropy(h, W, labels, w))
    rows["chunked autograd (fp32 passes)"] = {"ms": ms, "peak_gib": peak, "loss_rel": abs(loss - ref_loss) / ref_loss}
    for chunk in (4096, 8192):
        for block in (2048, 4096, 8192):
            ce_kernel.BLOCK_V = block

            def fused(h, c=chunk):
                return ce_kernel.fused_linear_cross_entropy(h, W, labels, w, c)

            ms, peak, (loss, correct, grad) = timed(fused)
            err = ((grad - ref_grad).abs().max() / ref_grad.abs().max()).item()
            rows[f"fused triton, chunk {chunk}, block {block}"] = {
                "ms": ms,
                "peak_gib": peak,
                "loss_rel": abs(loss - ref_loss) / ref_loss,
                "correct_equal": correct == ref_correct,
                "grad_max_rel": err,
            }
    ce_kernel.BLOCK_V = 4096

    def floor() -> float:  # the two matmuls alone (logits, then grad_h), no autograd: what any fusion leaves
        with torch.no_grad():
            for _ in range(3):
                (h0 @ W.t()) @ W
            torch.cuda.synchronize()
            ts = []
            for _ in range(10):
                t0 = time.perf_counter()
                (h0 @ W.t()) @ W
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e3

    rows["two matmuls alone (floor)"] = {"ms": floor(), "peak_gib": 0.0}
    tflop = 2 * 2 * N * C * V / 1e12
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": ce_kernel.triton.__version__,
        "shape": f"{N} x {C} -> {V}, bf16, frozen head",
        "tflop_two_matmuls": round(tflop, 2),
        "rows": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    print(f"\n{report['shape']} on {report['gpu']} (torch {report['torch']}, triton {report['triton']})")
    print("| implementation | ms | TFLOP/s (2 matmuls) | peak GiB | loss rel. diff | grad max rel. diff |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in rows.items():
        print(
            f"| {name} | {r['ms']:.1f} | {tflop / (r['ms'] / 1e3):.0f} | {r['peak_gib']:.2f} | "
            f"{r.get('loss_rel', 0):.1e} | {r.get('grad_max_rel', 0):.1e} |"
        )


if __name__ == "__main__":
    main()
