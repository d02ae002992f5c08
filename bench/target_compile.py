"""Two questions the time-to-first-step work left, on one GPU:

1. What does building the mask from the anchors cost inside a step? Host time to enqueue it, and the GPU time it
   adds when queued behind real work (a target forward), at batch 1 (the paper's training shape) and batch 6.
2. Does compiling the frozen target pay? Each decoder layer's forward compiled (regional compilation: one graph for
   all 36 layers per bucket), default mode and max-autotune-no-cudagraphs, against eager: target forward ms at seq
   3072, compile seconds, and the steps it takes to pay the compile back.

    python bench/target_compile.py --out results.json
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

from bench.common import QWEN3_8B_WORKLOAD  # noqa: E402


def event_ms(fn, reps: int = 10) -> float:
    import torch

    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch

    from trainer.config import from_dict
    from trainer.model.mask import block_mask_from_anchors
    from trainer.run.build import autocast, build, dummy_batch

    out: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    cfg = from_dict({**QWEN3_8B_WORKLOAD, "device": "cuda"})
    parts = build(cfg, device=torch.device("cuda"))
    S = 3072
    b1 = dummy_batch(parts, S).to(parts.device)
    target = parts.target

    def fwd():
        with autocast(parts):
            target.hidden_states(b1.input_ids)

    for _ in range(3):
        fwd()
    eager_ms = event_ms(fwd)
    mask: dict = {}
    for batch in (1, 6):
        anc = b1.anchors.repeat(batch, 1)
        val = b1.anchor_valid.repeat(batch, 1)
        build_mask = lambda anc=anc, val=val: block_mask_from_anchors(anc, val, S, 16)  # noqa: E731
        for _ in range(5):
            build_mask()
        torch.cuda.synchronize()
        host = []
        for _ in range(20):
            fwd()  # the GPU is busy with a target forward while the mask is enqueued, as in a step
            t0 = time.perf_counter()
            build_mask()
            host.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
        both = event_ms(lambda build_mask=build_mask: (fwd(), build_mask()))
        mask[f"batch{batch}"] = {
            "enqueue_ms": round(statistics.median(host) * 1e3, 3),
            "added_gpu_ms": round(both - eager_ms, 3),
        }
    out["mask_in_step"] = mask
    print(f"mask in step: {mask}", flush=True)

    rows = {"eager": {"target_fwd_ms": round(eager_ms, 2)}}
    last = max(target.layer_ids)
    originals = [layer.forward for layer in target.layers]
    for mode in ("default", "max-autotune-no-cudagraphs"):
        torch._dynamo.reset()
        for i, layer in enumerate(target.layers):
            layer.forward = originals[i]
            if i <= last:
                layer.forward = torch.compile(originals[i], dynamic=False, mode=None if mode == "default" else mode)
        t0 = time.perf_counter()
        fwd()
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        ms = event_ms(fwd)
        gain = eager_ms - ms
        rows[mode] = {
            "target_fwd_ms": round(ms, 2),
            "compile_s": round(compile_s, 1),
            "breakeven_steps": round(compile_s * 1e3 / gain) if gain > 0 else None,
        }
        print(f"{mode}: {rows[mode]}", flush=True)
        Path(args.out).write_text(json.dumps({**out, "target_compile": rows}, indent=1))
    out["target_compile"] = rows
    Path(args.out).write_text(json.dumps(out, indent=1))
    print("\n| target forward, seq 3072 | ms | compile s | steps to pay back |\n| --- | --- | --- | --- |")
    for k, r in rows.items():
        print(f"| {k} | {r['target_fwd_ms']} | {r.get('compile_s', '-')} | {r.get('breakeven_steps', '-')} |")


if __name__ == "__main__":
    main()
