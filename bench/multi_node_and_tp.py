"""Two GPUs, two ways of spanning them, and a target larger than one GPU.

    python bench/multi_node_and_tp.py --out results.json [--part nodes|tp|all] [--steps 60]

nodes (through dflashctl, the Qwen3-8B-shaped workload): one host entry with both GPUs (1 node x 2 processes) against
two host entries on this machine with their own workdirs and one GPU each (2 nodes x 1 process, torchrun's static
rendezvous on the loopback). tokens/s is the mean of the head's step records after the first ten.

tp (the trainer under torchrun): a Llama-3.3-70B-shaped random target with `target.parallel: {tensor: 2}` and a
5-layer drafter (MLP width 8192: the target's 28672 would not fit next to the target's shard with fp32 AdamW, as the
memory plan says), seq 3072, 512 anchors; then the same target replicated on one GPU, refused by the memory plan.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import QWEN3_8B_WORKLOAD  # noqa: E402


def cli(*args: str, env: dict, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dflashctl", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def steps_of(run_dir: str) -> list[dict]:
    recs = [json.loads(x) for x in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "event" not in r]


def run_nodes(work: Path, steps: int) -> dict:
    import yaml

    hosts = {
        "hosts": {name: {"workdir": str(work / name), "python": sys.executable} for name in ("both", "gpu0", "gpu1")}
    }
    (work / "hosts.yaml").write_text(yaml.safe_dump(hosts))
    env = {
        **os.environ,
        "DFLASHCTL_HOSTS": str(work / "hosts.yaml"),
        "DFLASHCTL_STATE_DIR": str(work / "state"),
        "DFLASHCTL_TMUX_SOCKET": "bench-nodes",
    }
    for h in ("both", "gpu0", "gpu1"):
        res = cli("deploy", h, env=env)
        assert res.returncode == 0, res.stderr
    trainer = {**QWEN3_8B_WORKLOAD, "steps": steps, "log_every": 10, "heartbeat_s": 2}
    jobs = {
        "1 node x 2 GPUs": {"name": "one-node", "host": "both", "gpus": [0, 1], "nproc_per_node": 2},
        "2 nodes x 1 GPU": {
            "name": "two-nodes",
            "nproc_per_node": 1,
            "hosts": [{"host": "gpu0", "gpus": [0]}, {"host": "gpu1", "gpus": [1]}],
        },
    }
    out = {}
    for label, job in jobs.items():
        path = work / f"{job['name']}.yaml"
        path.write_text(yaml.safe_dump({**job, "trainer": trainer, "watch": {"interval_s": 3}}))
        t0 = time.perf_counter()
        res = cli("launch", str(path), "--json", env=env)
        assert res.returncode == 0, res.stderr
        rep = json.loads(res.stdout)
        watch = cli("watch", rep["id"], "--until-done", "--json", "--interval", "3", env=env, timeout=900)
        wall = time.perf_counter() - t0
        polls = [json.loads(x) for x in watch.stdout.splitlines() if x.startswith("{")]
        first_running = next((p["time"] for p in polls if p["state"] == "RUNNING"), None)
        recs = steps_of(rep["run_dir"])
        tps = [r["tokens_per_s"] for r in recs if r["step"] > 10]
        out[label] = {
            "job": rep["id"],
            "final_state": polls[-1]["state"] if polls else None,
            "wall_s": round(wall, 1),
            "steps": len(recs),
            "tokens_per_s": round(statistics.mean(tps), 1) if tps else None,
            "peak_mem_gib_ranks": recs[-1].get("peak_mem_gib_ranks") if recs else None,
            "command": rep["command"],
            "nodes": [n["host"] for n in rep.get("nodes") or []] or [rep["host"]],
            "launch_to_running_s": round(first_running - polls[0]["time"], 1) if first_running else None,
            "gpus_seen_by_watch": sorted(
                {f"{g.get('node', rep['host'])}:{g['index']}" for p in polls for g in p.get("gpus", [])}
            ),
        }
        print(label, out[label], flush=True)
    a, b = out["1 node x 2 GPUs"]["tokens_per_s"], out["2 nodes x 1 GPU"]["tokens_per_s"]
    out["two_nodes_over_one_node"] = round(b / a, 3) if a and b else None
    return out


def llama_cfg(parallel, anchors: int = 512, steps: int = 12) -> dict:
    return {
        "target": {"random_preset": "llama3-70b", "dtype": "bfloat16", "parallel": parallel},
        "drafter": {"num_layers": 5, "block_size": 16, "intermediate_size": 8192},
        "attention": {"backend": "flex"},
        "device": "auto",
        "steps": steps,
        "log_every": 1,
        "heartbeat_s": 2,
        "data": {
            "anchors_per_seq": anchors,
            "seq_buckets": [3072],
            "batch_size": 1,
            "synthetic_samples": 8,
            "holdout": 0,
        },
        "eval": {"at_end": False},
        "checkpoint": {"every": 0},
    }


def non_attention_flops(S: int, A: int, bs: int) -> float:
    """The performance issue's count without attention scores: target forward to the last layer id, drafter forward
    and backward (dX, dW), LM head and loss forward and backward; for the 70B shape and the drafter above."""
    from trainer.model.target import default_layer_ids, llama3_70b_config

    t = llama3_70b_config()
    C, H, G, D, inter, V = (
        t["hidden_size"],
        t["num_attention_heads"],
        t["num_key_value_heads"],
        t["head_dim"],
        t["intermediate_size"],
        t["vocab_size"],
    )
    n_target = max(default_layer_ids(t["num_hidden_layers"], 5)) + 1
    layer = C * H * D + 2 * C * G * D + H * D * C + 3 * C * inter
    target = n_target * 2 * S * layer
    Q, di = A * bs, 8192
    dl = 2 * Q * (C * H * D * 2 + 3 * C * di) + 2 * (S + Q) * 2 * C * G * D
    fc = 2 * S * 5 * C * C
    drafter = 5 * dl * 3 + 2 * fc
    head = 2 * 2 * A * (bs - 1) * C * V
    return float(target + drafter + head)


def run_plan_check(work: Path) -> dict:
    """One GPU: the memory plan of the Qwen3-8B workload against the peak the run then measures."""
    conf = work / "q8b.json"
    conf.write_text(json.dumps({**QWEN3_8B_WORKLOAD, "steps": 12, "log_every": 4}))
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.train", "--config", str(conf), "--run-dir", str(work / "q8b")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    recs = [json.loads(x) for x in (work / "q8b" / "metrics.jsonl").read_text().splitlines()]
    start = next(r for r in recs if r.get("event") == "start")
    steps = [r for r in recs if "event" not in r]
    out = {
        "exit": proc.returncode,
        "memory_plan_gib": start.get("memory_plan"),
        "measured_peak_gib": max(r["peak_mem_gib"] for r in steps) if steps else None,
        "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in steps[3:]), 1) if steps else None,
    }
    print("plan", out, flush=True)
    return out


def run_tp(work: Path, refuse_only: bool = False) -> dict:
    out: dict = {}
    env = {**os.environ, "OMP_NUM_THREADS": "4"}
    refuse = work / "70b-replicate.json"
    refuse.write_text(json.dumps(llama_cfg("replicate")))
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.train", "--config", str(refuse), "--run-dir", str(work / "refused")],
        cwd=ROOT,
        env={**env, "CUDA_VISIBLE_DEVICES": "0"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    out["replicate_on_one_gpu"] = {
        "exit": proc.returncode,
        "seconds": round(time.perf_counter() - t0, 1),
        "message": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "",
    }
    print("refusal", out["replicate_on_one_gpu"], flush=True)
    if refuse_only:
        out["plan_against_a_run"] = run_plan_check(work)
        return out
    for anchors in (512, 256):
        conf = work / f"70b-tp2-{anchors}.json"
        conf.write_text(json.dumps(llama_cfg({"tensor": 2}, anchors)))
        run = work / f"tp2-{anchors}"
        t0 = time.perf_counter()
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                "-m",
                "trainer.train",
                "--config",
                str(conf),
                "--run-dir",
                str(run),
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        wall = time.perf_counter() - t0
        res = {"anchors": anchors, "exit": proc.returncode, "wall_s": round(wall, 1)}
        if proc.returncode != 0:
            res["tail"] = proc.stdout[-1500:] + proc.stderr[-2500:]
            out[f"tensor2_{anchors}"] = res
            print("tp2", anchors, "failed", res["tail"][-1500:], flush=True)
            continue
        recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in recs if "event" not in r]
        start = next(r for r in recs if r.get("event") == "start")
        pre = [r for r in recs if r.get("event") == "preflight"]
        step_s = statistics.median(3072 / r["tokens_per_s"] for r in steps[3:])
        flops = non_attention_flops(3072, anchors, 16)
        res.update(
            tokens_per_s=round(3072 / step_s, 1),
            step_ms=round(step_s * 1e3, 1),
            achieved_tflops_per_gpu=round(flops / step_s / 2 / 1e12, 1),
            mfu_vs_989=round(flops / step_s / 2 / 989e12, 4),
            peak_mem_gib_ranks=steps[-1].get("peak_mem_gib_ranks"),
            memory_plan=start.get("memory_plan"),
            mesh=start.get("mesh"),
            preflight_s=[r.get("seconds") for r in pre],
            recompiles=sum(1 for r in recs if r.get("event") == "recompile"),
        )
        out[f"tensor2_{anchors}"] = res
        print("tp2", res, flush=True)
        break
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--part", choices=["nodes", "tp", "all", "one-gpu"], default="all")
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    import torch

    results = {
        "date": time.strftime("%Y-%m-%d"),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "torch": torch.__version__,
    }
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        if args.part == "one-gpu":
            results["tp"] = run_tp(work, refuse_only=True)
        if args.part in ("tp", "all"):
            results["tp"] = run_tp(work)
            Path(args.out).write_text(json.dumps(results, indent=1))
        if args.part in ("nodes", "all"):
            results["nodes"] = run_nodes(work, args.steps)
    Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
