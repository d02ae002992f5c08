"""Where the first bucket's cold preflight goes, against the second's: both buckets at the paper shape in one process
with empty Inductor and Triton caches, each under its own profiler; and the compile stack's fixed start-up costs
(Inductor's import, its worker pool, Triton's driver, a first and a second tiny compile), in a fresh process of their
own.

    python bench/first_bucket_profile.py [--buckets 1024 2048] [--top 45] [--out FILE]

Prints, per bucket, the wall seconds and the functions with the most cumulative and own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FIXED = r"""
import time, json
T = {}
t = time.perf_counter()
import torch
T["import torch"] = time.perf_counter() - t; t = time.perf_counter()
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
T["cuda context"] = time.perf_counter() - t; t = time.perf_counter()
import torch._inductor.compile_fx  # noqa
T["import inductor"] = time.perf_counter() - t; t = time.perf_counter()
from torch._inductor.async_compile import AsyncCompile, maybe_warm_pool
maybe_warm_pool()
T["pool started"] = time.perf_counter() - t; t = time.perf_counter()
AsyncCompile.wait_pool_ready()
T["pool ready"] = time.perf_counter() - t; t = time.perf_counter()
from triton.runtime import driver
driver.active.get_current_device(); driver.active.utils
T["triton driver"] = time.perf_counter() - t; t = time.perf_counter()
f = torch.compile(lambda x: x * 2 + 1)
f(torch.randn(1024, device="cuda")); torch.cuda.synchronize()
T["first tiny compile"] = time.perf_counter() - t; t = time.perf_counter()
g = torch.compile(lambda x: (x.sin() * 3).sum(-1))
g(torch.randn(64, 1024, device="cuda")); torch.cuda.synchronize()
T["second tiny compile"] = time.perf_counter() - t; t = time.perf_counter()
print("FIXED " + json.dumps({k: round(v, 3) for k, v in T.items()}))
"""


def fixed_costs(work: Path) -> dict:
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(work / "fixed-inductor"),
        "TRITON_CACHE_DIR": str(work / "fixed-triton"),
    }
    proc = subprocess.run([sys.executable, "-c", FIXED], capture_output=True, text=True, env=env, timeout=300)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("FIXED ")), None)
    return json.loads(line[6:]) if line else {"error": proc.stderr[-2000:]}


def table(prof: cProfile.Profile, key: str, top: int) -> str:
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats(key).print_stats(top)
    return s.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--buckets", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--top", type=int, default=45)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="first-bucket-"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(work / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(work / "triton")
    rep: dict = {"fixed_s": fixed_costs(work)}
    print("fixed start-up costs (s):", rep["fixed_s"], flush=True)

    t0 = time.perf_counter()
    import torch

    from bench.common import QWEN3_8B_WORKLOAD
    from trainer.config import from_dict
    from trainer.run.build import build, dummy_batch, forward_loss

    cfg = from_dict(
        {**QWEN3_8B_WORKLOAD, "device": "cuda", "data": {**QWEN3_8B_WORKLOAD["data"], "seq_buckets": args.buckets}}
    )
    rep["import_s"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    parts = build(cfg, device=torch.device("cuda"))
    torch.cuda.synchronize()
    rep["build_s"] = round(time.perf_counter() - t0, 2)
    print(f"imports {rep['import_s']} s, build {rep['build_s']} s", flush=True)
    rep["bucket_s"] = {}
    for S in args.buckets:
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        loss_sum, w_sum, _ = forward_loss(parts, dummy_batch(parts, S))
        (loss_sum / w_sum.clamp(min=1)).backward()
        parts.drafter.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        prof.disable()
        rep["bucket_s"][S] = round(time.perf_counter() - t0, 2)
        print(f"\n===== bucket {S}: {rep['bucket_s'][S]} s (profiled) =====", flush=True)
        print(table(prof, "cumulative", args.top))
        print(table(prof, "tottime", 25), flush=True)
    print("SUMMARY " + json.dumps(rep))
    if args.out:
        args.out.write_text(json.dumps(rep, indent=1) + "\n")


if __name__ == "__main__":
    main()
