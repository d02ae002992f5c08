"""Trainer core on one GPU: preflight per bucket, step time, tokens/s, peak memory, recompiles after preflight,
flex against the dense reference, and the same run with TORCH_COMPILE_DISABLE=1 (must stop with DenseFallbackError).

    python bench/trainer_h200.py [--steps 12] [--out results.json]

Workload: Qwen3-8B-shaped target with random weights (36 layers, hidden 4096, 32/8 heads, vocab 151936), 5-layer
drafter, buckets 2048 and 3072, 512 anchors, block 16, bf16 autocast.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from trainer.config import from_dict  # noqa: E402
from trainer.model.attention import DenseBackend, FlexBackend  # noqa: E402
from trainer.model.compile_policy import unfreeze_compiles  # noqa: E402
from trainer.model.mask import sample_anchors  # noqa: E402
from trainer.run.training import train  # noqa: E402

CONFIG = {
    "target": {"random_preset": "qwen3-8b", "dtype": "bfloat16"},
    "drafter": {"num_layers": 5, "block_size": 16},
    "attention": {"backend": "flex"},
    "data": {"anchors_per_seq": 512, "seq_buckets": [2048, 3072], "batch_size": 1, "synthetic_samples": 32},
    "device": "cuda",
}


def flex_vs_dense(seq_len=1024, anchors=64, block=16, H=32, G=8, D=128, reps=20) -> dict:
    g = torch.Generator().manual_seed(0)
    dev = "cuda"
    q = torch.randn(1, H, anchors * block, D, generator=g).to(dev, torch.bfloat16)
    k = torch.randn(1, G, seq_len + anchors * block, D, generator=g).to(dev, torch.bfloat16)
    v = torch.randn(1, G, seq_len + anchors * block, D, generator=g).to(dev, torch.bfloat16)
    anc = sample_anchors(torch.ones(seq_len, dtype=torch.long), seq_len, anchors, g).view(1, -1).to(dev)
    valid = torch.ones_like(anc, dtype=torch.bool)
    out = {}
    results = {}
    for name, backend in (("flex", FlexBackend()), ("dense", DenseBackend(max_gib=64))):
        mask = backend.build_mask(anc, valid, seq_len, block, H)
        results[name] = backend(q, k, v, mask)  # warm-up / compile
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        for _ in range(reps):
            backend(q, k, v, mask)
        torch.cuda.synchronize()
        out[f"{name}_ms"] = (time.perf_counter() - t0) / reps * 1e3
        out[f"{name}_peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    out["max_abs_diff"] = (results["flex"].float() - results["dense"].float()).abs().max().item()
    out["shape"] = f"seq {seq_len}, {anchors} anchors, block {block}, {H}/{G} heads, d {D}, bf16"
    return out


def compile_disabled_run(steps: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        import yaml

        cfg = Path(d) / "c.yaml"
        cfg.write_text(yaml.safe_dump({**CONFIG, "steps": steps}))
        env = {**os.environ, "TORCH_COMPILE_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainer.train", "--config", str(cfg)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=Path(__file__).resolve().parents[1],
        )
        lines, t_built = [], None
        for line in proc.stdout:
            lines.append(line.rstrip())
            if line.startswith("data:") and t_built is None:
                t_built = time.perf_counter() - t0
        rc = proc.wait()
        total = time.perf_counter() - t0
    err = [x for x in lines if "DenseFallbackError" in x or "OutOfMemory" in x or "out of memory" in x]
    return {
        "exit_code": rc,
        "seconds_total": round(total, 1),
        "seconds_after_build": round(total - (t_built or 0), 2),
        "oom": any("memory" in x.lower() and "out of" in x.lower() for x in lines),
        "error_line": err[-1][:400] if err else (lines[-1][:400] if lines else ""),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-train", action="store_true", help="only flex vs dense and the compile-disabled run")
    args = ap.parse_args()
    report: dict = {"torch_version": torch.__version__, "gpu": torch.cuda.get_device_name()}
    if not args.skip_train:
        report.update(train_run(args.steps))
    unfreeze_compiles()  # the preflight froze compiles for the training run; the kernels below are new shapes
    torch.cuda.empty_cache()
    report["flex_vs_dense"] = flex_vs_dense()
    print(json.dumps(report["flex_vs_dense"]), flush=True)
    report["compile_disabled"] = compile_disabled_run(args.steps)
    print(json.dumps(report["compile_disabled"]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    print("\n| measurement | value |\n| --- | --- |")
    for k, v in report.items():
        print(f"| {k} | {v} |")


def train_run(steps: int) -> dict:
    cfg = from_dict({**CONFIG, "steps": steps, "log_every": 1})
    t0 = time.perf_counter()
    result = train(cfg, log=lambda s: print(s, flush=True))
    wall = time.perf_counter() - t0
    tps = result.tokens_per_s[3:]  # after warm-up steps
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "preflight_seconds": {str(k): round(v, 2) for k, v in result.preflight.seconds.items()},
        "preflight_peak_mem_gib": {str(k): round(v, 2) for k, v in result.preflight.peak_mem_gib.items()},
        "train_peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "tokens_per_s_median": round(sorted(tps)[len(tps) // 2]),
        "recompiles_after_preflight": result.recompiles_after_preflight,
        "final_loss": round(result.losses[-1], 4),
        "wall_s": round(wall, 1),
    }
    print(json.dumps(report), flush=True)
    return report


if __name__ == "__main__":
    main()
