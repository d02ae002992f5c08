"""What a drafter and a run look like at the real shape, on one GPU: the export of a Qwen3-8B drafter, bench_tau's
cost per prompt, and a 300-step run with its GPU history for `dflashctl report`.

    python bench/serve_and_report.py --out results.json --run-dir RUN

1. Export: a 5-layer, block-16 drafter of the Qwen3-8B shape written in the public DFlash format (bf16): parameters,
   bytes on disk, seconds to write; read back into a fresh drafter (strict names), seconds; written again, byte-equal.
2. bench_tau: the Qwen3-8B-shaped random target with that drafter decoding GSM8K-format prompts through a chat
   template (the tiny tokenizer's: the ids exist in the 151,936-row vocabulary), 128 new tokens each: seconds per
   prompt and per drafting step. A random drafter's tau is about 1: the point is the cost, not the figure.
3. A 300-step run (seq 3072, 512 anchors, flex) with `metrics.gpu_history` (NVML every heartbeat, 2 s), an eval at
   the end; RUN keeps metrics.jsonl and gpu.jsonl for `dflashctl report` (drawn where matplotlib is installed).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import QWEN3_8B_WORKLOAD  # noqa: E402


def export_bench(work: Path) -> dict:
    import torch

    from trainer.config import from_dict
    from trainer.model.dflash_format import draft_config, read_export, write_export
    from trainer.model.drafter import Drafter, drafter_dims
    from trainer.run.build import build

    cfg = from_dict({**QWEN3_8B_WORKLOAD, "device": "cuda"})
    parts = build(cfg, for_training=False)
    dims = drafter_dims(parts.target.config, 5, len(parts.target.layer_ids), {})
    config = draft_config(dims, 16, parts.target.layer_ids, parts.mask_token_id, parts.target.config)
    state = {k: v.detach() for k, v in parts.drafter.state_dict().items()}
    t0 = time.perf_counter()
    out = write_export(work / "export", state, config, "bfloat16")
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    cfg_back, weights = read_export(out)
    fresh = Drafter(dims).to("cuda")
    fresh.load_state_dict(weights, strict=True)
    torch.cuda.synchronize()
    read_s = time.perf_counter() - t0
    again = write_export(work / "again", {k: v.detach() for k, v in fresh.state_dict().items()}, cfg_back, "bfloat16")
    same = (out / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
    params = sum(v.numel() for v in state.values())
    size = (out / "model.safetensors").stat().st_size
    del parts
    torch.cuda.empty_cache()
    return {
        "drafter_params": params,
        "model_safetensors_bytes": size,
        "tensors": len(weights),
        "write_s": round(write_s, 2),
        "read_and_load_s": round(read_s, 2),
        "round_trip_byte_identical": same,
        "mask_token_id": config["dflash_config"]["mask_token_id"],
        "target_layer_ids": config["dflash_config"]["target_layer_ids"],
    }


def bench_tau_bench(work: Path, prompts: int, max_new: int) -> dict:
    import torch

    from trainer.config import from_dict
    from trainer.data.prompts import read_prompts
    from trainer.data.tiny import build_tokenizer, chat_samples
    from trainer.run.build import build
    from trainer.serve import bench_tau

    tok = build_tokenizer()
    qs = [r["messages"][-2]["content"] for r in chat_samples(prompts, seed=3)]
    (work / "gsm8k.jsonl").write_text("".join(json.dumps({"question": q, "answer": "-"}) + "\n" for q in qs))
    name, convs = read_prompts(work / "gsm8k.jsonl")
    limit = bench_tau.length_limit([64], 1, max_new, 16)
    target = {**QWEN3_8B_WORKLOAD["target"], "compile": "off"}  # lengths vary while decoding
    drafter = {"num_layers": 5, "block_size": 16, "init_from": str(work / "export")}
    cfg = from_dict(
        {
            **QWEN3_8B_WORKLOAD,
            "target": target,
            "device": "cuda",
            "drafter": drafter,
            "attention": {"backend": "dense", "dense_max_gib": 64.0},
            "data": {"seq_buckets": sorted({*range(512, limit, 512), limit})},
        }
    )
    parts = build(cfg, for_training=False)
    parts.drafter.eval()
    args = argparse.Namespace(max_new_tokens=max_new, thinking="off", quiet=True)
    res = bench_tau.bench_set(parts, tok, name, convs, args, limit, None)
    torch.cuda.synchronize()
    del parts
    torch.cuda.empty_cache()
    return {
        "prompt_set": name,
        "prompts": res.prompts,
        "max_new_tokens": max_new,
        "tau_prompt_mean": res.tau_prompt_mean,
        "tau_pooled": res.tau_pooled,
        "draft_steps": res.draft_steps,
        "seconds": res.seconds,
        "seconds_per_prompt": round(res.seconds / max(res.prompts, 1), 2),
        "ms_per_draft_step": round(1000 * res.seconds / max(res.draft_steps, 1), 1),
    }


def run_bench(run_dir: Path, steps: int) -> dict:
    cfg = {
        **QWEN3_8B_WORKLOAD,
        "steps": steps,
        "heartbeat_s": 2.0,
        "log_every": 50,
        "data": {**QWEN3_8B_WORKLOAD["data"], "synthetic_samples": 32, "holdout": 4},
        "eval": {"at_end": True, "prompts": 4, "max_new_tokens": 64},
        "metrics": {"gpu_history": True},
    }
    conf = run_dir.parent / "run300.yaml"
    conf.write_text(json.dumps(cfg))
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.train", "--config", str(conf), "--run-dir", str(run_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    print(proc.stdout[-1500:], proc.stderr[-1500:], sep="\n")
    gpu_file = run_dir / "gpu.jsonl"
    gpu = [json.loads(x) for x in gpu_file.read_text().splitlines()] if gpu_file.exists() else []
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in recs if "event" not in r]
    return {
        "exit": proc.returncode,
        "wall_s": round(wall, 1),
        "steps": len(steps_),
        "gpu_samples": len(gpu),
        "gpu_sample_fields": sorted(gpu[0]["gpus"][0]) if gpu else [],
        "mean_tokens_per_s": round(sum(r["tokens_per_s"] for r in steps_[10:]) / max(len(steps_) - 10, 1), 1),
        "peak_util_pct": max((g["util_pct"] or 0) for s in gpu for g in s["gpus"]) if gpu else None,
        "max_mem_used_mib": max((g["mem_used_mib"] or 0) for s in gpu for g in s["gpus"]) if gpu else None,
        "max_power_w": max((g["power_w"] or 0) for s in gpu for g in s["gpus"]) if gpu else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    import torch

    results = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        results["export"] = export_bench(work)
        print("export", results["export"], flush=True)
        results["bench_tau"] = bench_tau_bench(work, args.prompts, args.max_new_tokens)
        print("bench_tau", results["bench_tau"], flush=True)
    results["run"] = run_bench(Path(args.run_dir), args.steps)
    print("run", results["run"], flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
