"""Cold preflight per bucket: each run is `python -m trainer.train` at the paper shape with buckets 1024 / 2048 / 3072
and empty Inductor and Triton caches of its own. With `--env KEY=VALUE` (repeatable), a variant (the same run with
that environment) alternates with the plain run, so that the machine's drift falls on both; a `cfg.KEY=VALUE` sets
a top-level key of the trainer's config instead (`--variant cfg.steps=5`).

    python bench/cold_preflight.py [--repeat 2] [--env KEY=VALUE ...] [--out bench/results/h200-cold-preflight.json]

Per run: the preflight's seconds per bucket (its metrics record), and the wall time from the process's start to the
preflight's start (imports, target load, data) and to the first step, so a change that only moved time would show.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import QWEN3_8B_WORKLOAD  # noqa: E402

BUCKETS = [1024, 2048, 3072]


def run(work: Path, name: str, extra_env: dict[str, str], share: str = "none") -> dict:
    variant = ",".join(f"{k}={v}" for k, v in extra_env.items()) or "plain"
    data = {**QWEN3_8B_WORKLOAD["data"], "seq_buckets": BUCKETS, "synthetic_samples": 6}
    cfg = {
        **QWEN3_8B_WORKLOAD,
        "data": data,
        "device": "cuda",
        "steps": 3,
        "log_every": 1,
        "checkpoint": {"every": 1000, "keep": 1},
        **{k[4:]: yaml.safe_load(v) for k, v in extra_env.items() if k.startswith("cfg.")},
    }
    extra_env = {k: v for k, v in extra_env.items() if not k.startswith("cfg.")}
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run_dir = work / name
    cache = work / f"{name}-cache"
    host = work / "host-cache"  # what the runs share, as jobs on one host would: the first run fills it
    inductor = host / "inductor" if share == "all" else cache / "inductor"
    triton = host / "triton" if share in ("triton", "all") else cache / "triton"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor), "TRITON_CACHE_DIR": str(triton), **extra_env}
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.train", "--config", str(path), "--run-dir", str(run_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    pre = next((r for r in recs if r.get("event") == "preflight"), None)
    first_progress = next((r for r in recs if r.get("event") == "preflight_progress"), None)
    steps = [r for r in recs if "event" not in r]
    first_step = steps[0] if steps else None
    seconds = {int(k): v for k, v in pre["seconds"].items()} if pre else {}
    return {
        "variant": variant,
        "exit": proc.returncode,
        "compile_cache": pre.get("compile_cache") if pre else None,
        "preflight_s": [round(seconds.get(b, float("nan")), 2) for b in BUCKETS],
        "to_preflight_s": round(first_progress["time"] - t0, 1) if first_progress else None,
        "to_first_step_s": round(first_step["time"] - t0, 1) if first_step else None,
        "last_step_tokens_per_s": steps[-1].get("tokens_per_s") if steps else None,
        "recompiles": sum(1 for r in recs if r.get("event") == "recompile"),
        "stderr_tail": proc.stderr.strip().splitlines()[-3:],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE of the variant run beside the plain one")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="KEY=VALUE[,KEY=VALUE...]: one more variant, run in turn with the plain one (repeatable)",
    )
    ap.add_argument(
        "--share",
        choices=["none", "triton", "all"],
        default="none",
        help="caches the runs share, as jobs on one host: none (each run cold), Triton's compiled kernels, "
        "or Triton's and Inductor's; the first run fills what is shared",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    variants = [{}] + ([dict(e.split("=", 1) for e in args.env)] if args.env else [])
    variants += [dict(e.split("=", 1) for e in v.split(",")) for v in args.variant]
    import torch

    runs = []
    with tempfile.TemporaryDirectory() as d:
        for i in range(args.repeat):
            for j, extra in enumerate(variants):
                runs.append(run(Path(d), f"r{i}-{j}", extra, args.share))
                print(json.dumps(runs[-1]), flush=True)
    print("| run | preflight s per bucket 1024 / 2048 / 3072 | start to preflight s | start to first step s |")
    print("| --- | --- | --- | --- |")
    summary = {}
    for name in dict.fromkeys(r["variant"] for r in runs):
        mine = [r for r in runs if r["variant"] == name and r["exit"] == 0]
        if not mine:
            last = [r for r in runs if r["variant"] == name][-1]
            print(f"| {name} | failed (exit {last['exit']}): {last['stderr_tail'][-1:]} | | |")
            continue
        med = [round(statistics.median(r["preflight_s"][j] for r in mine), 2) for j in range(len(BUCKETS))]
        pre = statistics.median(r["to_preflight_s"] for r in mine)
        first = statistics.median(r["to_first_step_s"] for r in mine)
        summary[name] = {"preflight_s": med, "to_preflight_s": pre, "to_first_step_s": first}
        print(f"| {name} | {' / '.join(f'{x:.2f}' for x in med)} | {pre:.1f} | {first:.1f} |")
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "command": " ".join(["python", *sys.argv]),
        "buckets": BUCKETS,
        "share": args.share,
        "runs": runs,
        "median": summary,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
