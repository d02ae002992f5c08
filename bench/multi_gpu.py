"""The trainer under torchrun with N ranks on one host, launched, watched and killed through dflashctl on this
machine's `local` host: tokens/s per GPU and scaling, preflight per rank, peak memory per rank, recompiles, and
whether `kill` leaves any process or GPU memory behind.

    python bench/multi_gpu.py --ranks 2 1 [--steps 30] [--out results.json]

Workload: the performance issue's (Qwen3-8B-shaped random target, 5-layer drafter, seq 3072, 512 anchors, block 16,
bf16), batch 1 per rank. Runs share one Inductor cache, so only the first pays the full compile.
"""

from __future__ import annotations

import argparse
import json
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

TRAINER = {
    **QWEN3_8B_WORKLOAD,
    "data": {**QWEN3_8B_WORKLOAD["data"], "synthetic_samples": 16},
    "steps": 100000,
    "log_every": 5,
}


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dflashctl", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def smi(query: str) -> list[str]:
    out = subprocess.run(["nvidia-smi", query, "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
    return [ln.strip() for ln in out.splitlines() if ln.strip()]


def one(n: int, steps: int, work: Path, cache: Path, reduce_dtype: str = "float32") -> dict:
    env = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    trainer = {**TRAINER, "grad_reduce_dtype": reduce_dtype}
    watch = {"interval_s": 5, "startup_budget_s": 1200}
    job = {
        "name": f"scale{n}-{reduce_dtype}",
        "host": "local",
        "gpus": n,
        "trainer": trainer,
        "env": env,
        "kill_grace_s": 60,
        "inductor_cache": "keep",
        "watch": watch,
    }
    path = work / f"scale{n}-{reduce_dtype}.yaml"
    path.write_text(yaml.safe_dump(job))
    t0 = time.perf_counter()
    res = cli("launch", str(path), "--json")
    if res.returncode != 0:
        return {"ranks": n, "error": res.stderr[-400:]}
    job_id = json.loads(res.stdout)["id"]
    rep: dict = {"ranks": n, "grad_reduce_dtype": reduce_dtype, "job": job_id}
    watch = subprocess.Popen(
        [sys.executable, "-m", "dflashctl", "watch", job_id, "--json"], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    for line in watch.stdout:
        rec = json.loads(line)
        if rec["state"] == "RUNNING" and "first_running_s" not in rep:
            rep["first_running_s"] = round(time.perf_counter() - t0, 1)
        if rec["state"] == "RUNNING" and (rec["step"] or 0) >= steps:
            rep["watch_record"] = {k: rec[k] for k in ("state", "reason", "step", "tokens_per_s", "remote_commands")}
            rep["watch_gpus"] = [
                {k: g[k] for k in ("index", "util_pct", "mem_used_mib", "power_w")} for g in rec["gpus"]
            ]
            break
        if rec["state"] not in ("STARTING", "RUNNING") or time.perf_counter() - t0 > 420:
            rep["watch_stopped_at"] = rec
            break
    watch.terminate()
    watch.wait()
    status = json.loads(cli("status", job_id, "--json").stdout)
    run_dir = Path(status["run_dir"])
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    pre = [r for r in recs if r.get("event") == "preflight"]
    rep["preflight_s_by_rank"] = {r["rank"]: r["seconds"] for r in pre}
    rep["same_buckets_on_all_ranks"] = len({tuple(r["buckets"]) for r in pre}) == 1 and len(pre) == n
    step_recs = [r for r in recs if "event" not in r]
    tps = [r["tokens_per_s"] for r in step_recs[5:]]
    rep["tokens_per_s"] = round(statistics.median(tps)) if tps else None
    rep["tokens_per_s_per_gpu"] = round(rep["tokens_per_s"] / n) if tps else None
    rep["peak_mem_gib_by_rank"] = [max(r["peak_mem_gib_ranks"][i] for r in step_recs) for i in range(n)]
    rep["recompiles_after_preflight_by_rank"] = {
        i: sum(1 for r in recs if r.get("event") == "recompile" and r.get("rank") == i) for i in range(n)
    }
    rep["steps_seen"] = step_recs[-1]["step"] if step_recs else 0
    t = time.perf_counter()
    kill = cli("kill", job_id, "--json")
    rep["kill_s"] = round(time.perf_counter() - t, 1)
    rep["kill"] = json.loads(kill.stdout) if kill.returncode == 0 else kill.stderr[-300:]
    time.sleep(2)
    rep["gpu_apps_after_kill"] = smi("--query-compute-apps=pid,used_memory")
    rep["gpu_mem_mib_after_kill"] = smi("--query-gpu=memory.used")
    print(json.dumps(rep), flush=True)
    return rep


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 1])
    ap.add_argument("--reduce-dtypes", nargs="+", default=["float32"], help="one run per rank count and dtype")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp())
    cache = work / "inductor-cache"
    res = cli("deploy", "local", "--json")
    assert res.returncode == 0, res.stderr
    report = {"date": time.strftime("%Y-%m-%d"), "gpus": smi("--query-gpu=index,name"), "runs": []}
    for n in args.ranks:
        for dtype in args.reduce_dtypes if n > 1 else ["float32"]:
            report["runs"].append(one(n, args.steps, work, cache, dtype))
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2))
    base = next((r for r in report["runs"] if r["ranks"] == 1 and r.get("tokens_per_s")), None)
    if base:
        for r in report["runs"]:
            if r.get("tokens_per_s"):
                r["speedup"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
                r["scaling_efficiency"] = round(r["speedup"] / r["ranks"], 3)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    cols = [
        "ranks",
        "grad_reduce_dtype",
        "tokens_per_s",
        "tokens_per_s_per_gpu",
        "speedup",
        "scaling_efficiency",
        "preflight_s_by_rank",
        "same_buckets_on_all_ranks",
        "peak_mem_gib_by_rank",
        "recompiles_after_preflight_by_rank",
        "kill_clean",
        "gpu_apps_after_kill",
    ]
    print("\n| " + " | ".join(cols) + " |\n|" + " --- |" * len(cols))
    for r in report["runs"]:
        r["kill_clean"] = r.get("kill", {}).get("clean") if isinstance(r.get("kill"), dict) else False
        print("| " + " | ".join(str(r.get(c)) for c in cols) + " |")


if __name__ == "__main__":
    main()
