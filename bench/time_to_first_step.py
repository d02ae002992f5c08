"""Time to first step on one GPU: the mask built from the anchors, cold and warm preflight per bucket, launch to the
first RUNNING verdict through dflashctl, and the step itself (tokens/s, MFU) at the paper shape.

    python bench/time_to_first_step.py --out results.json [--skip-step]

1. The mask: tile maps against the dense mask (batch 6: lengths 3072, 2000, 700, 130 and two more, anchors among
   response positions), time of `block_mask_from_anchors` (first call, then the median of 50), and compiled flex
   forward+backward with that mask against the dense reference (bf16, seq 1024, 128 anchors).
2. `dflashctl launch` on this machine's `local` host (a host entry with its own workdir and a shared Inductor cache,
   `inductor_cache: keep`), the Qwen3-8B-shaped workload with buckets 1024/2048/3072: the first launch with an empty
   cache (cold), the second with the cache the first one filled (warm). Launch to the first RUNNING verdict of
   `watch`, and the preflight seconds per bucket from metrics.jsonl.
3. The step at seq 3072 with 512 anchors (bench/h200_perf.py's step benchmark): tokens/s, MFU, recompiles.
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


def mask_bench() -> dict:
    import torch

    from trainer.model.attention import DenseBackend, FlexBackend
    from trainer.model.mask import (
        TILE,
        anchor_generator,
        block_mask_from_anchors,
        dense_mask,
        sample_anchors,
        tile_maps,
    )

    dev = torch.device("cuda")
    S, A, bs = 3072, 512, 16
    lengths = [3072, 2000, 700, 130, 2900, 1500]
    anchors = torch.zeros(len(lengths), A, dtype=torch.long)
    valid = torch.zeros(len(lengths), A, dtype=torch.bool)
    for b, length in enumerate(lengths):
        resp = torch.zeros(length, dtype=torch.long)
        resp[length // 2 :] = 1  # response-only second half
        got = sample_anchors(resp, length, A, anchor_generator(0, 0, b))
        anchors[b, : got.numel()], valid[b, : got.numel()] = got, True
    anchors, valid = anchors.to(dev), valid.to(dev)
    rep: dict = {}
    partial, full = tile_maps(anchors, valid, S, bs)
    dense = dense_mask(anchors, valid, S, bs)[:, 0]
    B, Q, KV = dense.shape
    tiles = dense.view(B, Q // TILE, TILE, KV // TILE, TILE)
    allowed = tiles.any(dim=(2, 4))
    rep["tiles_missed"] = int((allowed & ~(partial | full)).sum())
    rep["full_tiles_not_all_allowed"] = int((full & ~tiles.all(dim=(2, 4))).sum())
    rep["empty_tiles_marked"] = int(((partial | full) & ~allowed).sum())
    rep["tiles_partial_full_total"] = [int(partial.sum()), int(full.sum()), int(partial.numel())]
    del dense, tiles
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    block_mask_from_anchors(anchors, valid, S, bs)
    torch.cuda.synchronize()
    rep["mask_first_call_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
    times = []
    for _ in range(50):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        block_mask_from_anchors(anchors, valid, S, bs)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    rep["mask_build_ms"] = round(statistics.median(times) * 1e3, 3)

    # flex forward + backward with the anchor-built mask against the dense reference, on fresh random inputs
    S2, A2, H, G, D = 1024, 128, 32, 8, 128
    g = torch.Generator().manual_seed(3)
    anc = torch.stack(
        [sample_anchors(torch.ones(S2, dtype=torch.long), S2, A2, anchor_generator(1, 0, b)) for b in range(2)]
    ).to(dev)
    val = torch.ones_like(anc, dtype=torch.bool)
    val[1, A2 // 2 :] = False  # padding blocks in the second sequence
    q = torch.randn(2, H, A2 * bs, D, generator=g).to(dev, torch.bfloat16).requires_grad_()
    k = torch.randn(2, G, S2 + A2 * bs, D, generator=g).to(dev, torch.bfloat16).requires_grad_()
    v = torch.randn(2, G, S2 + A2 * bs, D, generator=g).to(dev, torch.bfloat16).requires_grad_()
    flex, ref = FlexBackend(), DenseBackend(64.0)
    t0 = time.perf_counter()
    out = flex(q, k, v, flex.build_mask(anc, val, S2, bs, H))
    out.float().square().sum().backward()
    torch.cuda.synchronize()
    rep["flex_fwd_bwd_cold_compile_s"] = round(time.perf_counter() - t0, 2)
    grads = [t.grad.float().clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    out_ref = ref(q, k, v, ref.build_mask(anc, val, S2, bs, H))
    out_ref.float().square().sum().backward()
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())  # noqa: E731
    rep["flex_vs_dense_rel_err"] = {
        "out": rel(out, out_ref),
        "dq": rel(grads[0], q.grad),
        "dk": rel(grads[1], k.grad),
        "dv": rel(grads[2], v.grad),
    }
    rep["flex_vs_dense_max_abs_out"] = float((out.float() - out_ref.float()).abs().max())
    print(f"mask: {rep}", flush=True)
    return rep


def cli(env: dict, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dflashctl", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def launch_to_running(env: dict, job: Path, label: str) -> dict:
    """Launch, follow `watch --json` to the first RUNNING and on to FINISHED; the run's preflight from metrics."""
    import yaml  # noqa: F401 - the job file is YAML; PyYAML is there

    t0 = time.perf_counter()
    res = cli(env, "launch", str(job), "--json")
    if res.returncode != 0:
        return {"error": res.stderr[-400:]}
    job_id = json.loads(res.stdout)["id"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflashctl", "watch", job_id, "--json", "--interval", "1"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    rep: dict = {"id": job_id, "states": []}
    for line in proc.stdout:
        rec = json.loads(line)
        if not rep["states"] or rep["states"][-1][1] != rec["state"]:
            rep["states"].append((round(time.perf_counter() - t0, 1), rec["state"], rec["reason"][:120]))
        if rec["state"] == "RUNNING" and "launch_to_running_s" not in rep:
            rep["launch_to_running_s"] = round(time.perf_counter() - t0, 1)
        if rec["state"] == "STARTING" and "preflight bucket" in rec["reason"]:
            rep.setdefault("starting_reasons", []).append(rec["reason"][:140])
    proc.wait()
    rep["watch_exit"] = proc.returncode
    st = json.loads(cli(env, "status", job_id, "--json").stdout)
    records = [json.loads(x) for x in (Path(st["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    pre = [r for r in records if r.get("event") == "preflight" and r.get("rank", 0) == 0]
    rep["preflight_s"] = pre[-1]["seconds"] if pre else None
    rep["preflight_peak_gib"] = pre[-1]["peak_mem_gib"] if pre else None
    rep["progress_events"] = sum(1 for r in records if r.get("event") == "preflight_progress")
    rep["recompiles"] = [r for r in records if r.get("event") == "recompile"]
    print(f"{label}: {rep}", flush=True)
    return rep


def dflashctl_runs() -> dict:
    import yaml

    work = Path(tempfile.mkdtemp(prefix="ttfs-"))
    env = {
        **os.environ,
        "DFLASHCTL_STATE_DIR": str(work / "state"),
        "DFLASHCTL_TMUX_SOCKET": "dflashctl-bench",
        "DFLASHCTL_HOSTS": str(work / "hosts.yaml"),
    }
    (work / "hosts.yaml").write_text(f"hosts:\n  gpu: {{python: {sys.executable}, workdir: {work / 'wd'}}}\n")
    res = cli(env, "deploy", "gpu", "--json")
    if res.returncode != 0:
        return {"error": res.stderr[-400:]}
    trainer = {
        **QWEN3_8B_WORKLOAD,
        "device": "cuda",
        "steps": 20,
        "log_every": 10,
        "heartbeat_s": 1,
        "data": {**QWEN3_8B_WORKLOAD["data"], "seq_buckets": [1024, 2048, 3072], "synthetic_samples": 12},
        "checkpoint": {"every": 0},
    }
    job = work / "job.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "name": "ttfs",
                "host": "gpu",
                "gpus": [0],
                "trainer": trainer,
                "inductor_cache": "keep",
                "kill_grace_s": 30,
                "watch": {"interval_s": 1, "restart_on": []},
            }
        )
    )
    return {"cold": launch_to_running(env, job, "cold"), "warm": launch_to_running(env, job, "warm")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip-step", action="store_true")
    args = ap.parse_args()
    import torch

    out: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    out["dflashctl"] = dflashctl_runs()  # first: its cold run must find no kernel compiled by this process before
    out["mask"] = mask_bench()
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    if not args.skip_step:
        from bench import h200_perf

        step = h200_perf.step_benchmark(steady_steps=30, isolated=False)
        out["step"] = {
            k: step[k]
            for k in (
                "tokens_per_s",
                "mfu",
                "step_ms",
                "preflight_s",
                "preflight_peak_gib",
                "recompiles_after_preflight",
                "memory_by_step",
                "peak_matmul_tflops",
                "build_s",
            )
            if k in step
        }
        Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    c, w = out["dflashctl"].get("cold", {}), out["dflashctl"].get("warm", {})
    print("\n| measure | value |\n| --- | --- |")
    print(f"| mask_build_ms (batch 6, seq 3072, 512 anchors) | {out['mask']['mask_build_ms']} |")
    print(
        f"| tiles missed / full-not-allowed / empty-marked | {out['mask']['tiles_missed']} / "
        f"{out['mask']['full_tiles_not_all_allowed']} / {out['mask']['empty_tiles_marked']} |"
    )
    print(f"| cold_preflight_s per bucket | {c.get('preflight_s')} |")
    print(f"| warm_preflight_s per bucket | {w.get('preflight_s')} |")
    print(f"| launch_to_running_cold_s / warm_s | {c.get('launch_to_running_s')} / {w.get('launch_to_running_s')} |")
    if "step" in out:
        print(f"| tokens_per_s / mfu | {out['step']['tokens_per_s']} / {out['step']['mfu']} |")


if __name__ == "__main__":
    main()
