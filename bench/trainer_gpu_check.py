"""The bundled trainer end to end on one GPU at the paper shape, as `python -m trainer.train` runs it: 20 steps with
the fused loss (tokens/s, peak memory, recompiles, the export), then the same run turning NaN at step 6 (exit 4, a
`diverged` record, no export, every checkpoint finite).

    python bench/trainer_gpu_check.py [--out results.json]
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


def run(work: Path, name: str, steps: int, extra: dict, env: dict, every: int = 4) -> dict:
    cfg = {
        **QWEN3_8B_WORKLOAD,
        "device": "cuda",
        "steps": steps,
        "log_every": 5,
        "checkpoint": {"every": every, "keep": 3},
        **extra,
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run_dir = work / name
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.train", "--config", str(path), "--run-dir", str(run_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=900,
    )
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in recs if "event" not in r]
    tps = [r["tokens_per_s"] for r in steps_[3:]]
    fatal = next((r for r in recs if r.get("event") == "fatal"), None)
    from safetensors.torch import load_file

    from trainer.model.dflash_format import nonfinite

    ckpts = sorted((run_dir / "checkpoints").glob("step-*")) if (run_dir / "checkpoints").exists() else []
    return {
        "exit": proc.returncode,
        "wall_s": round(time.time() - t0, 1),
        "steps": len(steps_),
        "tokens_per_s_median": round(statistics.median(tps)) if tps else None,
        "peak_mem_gib": max((r.get("peak_mem_gib") or 0) for r in steps_) if steps_ else None,
        "recompiles": sum(1 for r in recs if r.get("event") == "recompile"),
        "skipped_steps": sum(1 for r in steps_ if r.get("skipped")),
        "export": (run_dir / "export").is_dir(),
        "checkpoints": [p.name for p in ckpts],
        "checkpoints_finite": all(not nonfinite(load_file(str(p / "drafter.safetensors"))) for p in ckpts),
        "fatal": {k: fatal.get(k) for k in ("kind", "first_bad_step", "last_finite_step", "checkpoint")}
        if fatal
        else None,
        "stderr_tail": proc.stderr.strip().splitlines()[-2:],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--every", type=int, default=4, help="steps between checkpoints (each is 12.6 GB at this shape)")
    args = ap.parse_args()
    import torch

    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        report = {
            "date": time.strftime("%Y-%m-%d"),
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "clean": run(work, "clean", args.steps, {}, {}, args.every),
            "nan": run(
                work, "nan", args.steps, {"optim": {"max_nonfinite_steps": 3}}, {"TRAINER_FAULT": "nan@6"}, args.every
            ),
        }
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
