"""One H200: the trainer step split and counted, its MFU, attention in the step vs the isolated kernel, flex vs
per-block SDPA vs eager dense, memory steadiness, and the dflashctl cycle on this machine's `local` host.

    python bench/h200_perf.py --out results.json [--steady-steps 105] [--skip-cli]

Workload (the performance issue's): Qwen3-8B-shaped target with random weights (36 layers, hidden 4096, 32/8 heads,
vocab 151936), 5-layer drafter (hidden 4096, intermediate 12288), seq 3072, 512 anchors, block 16, bf16, batch 1.
FLOPs are counted from the shapes (below); MFU is against the bf16 matmul rate measured in the same run.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import QWEN3_8B_WORKLOAD  # noqa: E402
from bench.step_breakdown import breakdown, kernel_time, run_steps, trainer_step  # noqa: E402

if "--trainer-from" in sys.argv:  # another tree's trainer package (a baseline), this tree's benchmark: first on the
    sys.path.insert(0, str(Path(sys.argv[sys.argv.index("--trainer-from") + 1]).resolve()))  # path, after the above

CONFIG = {**QWEN3_8B_WORKLOAD, "device": "cuda", "steps": 1000}


# ---------------------------------------------------------------- the dflashctl cycle (run first: a clean GPU)


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dflashctl", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def job_file(d: Path, name: str, trainer: dict, env: dict | None = None) -> Path:
    import yaml

    body = {
        "name": name,
        "host": "local",
        "gpus": [0],
        "trainer": trainer,
        "kill_grace_s": 30,
        "watch": {"interval_s": 2, "startup_budget_s": 1200},
        "env": env or {},
    }
    path = d / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def gpu_apps() -> list[str]:
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
    ).stdout
    return [ln.strip() for ln in out.splitlines() if ln.strip()]


def gpu_mem_used_mib() -> int:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True
    ).stdout
    return int(out.split()[0])


def cli_cycle() -> dict:
    rep: dict = {}
    d = Path(tempfile.mkdtemp())
    t = time.perf_counter()
    res = cli("deploy", "local", "--json")
    rep["deploy_s"] = round(time.perf_counter() - t, 2)
    rep["deploy"] = json.loads(res.stdout) if res.returncode == 0 else res.stderr[-300:]
    # 1. time to diagnosis of a dense fallback
    fb = {**CONFIG, "steps": 10}
    path = job_file(d, "fallback", fb, {"TORCH_COMPILE_DISABLE": "1"})
    t0 = time.perf_counter()
    res = cli("launch", str(path), "--json")
    if res.returncode != 0:
        return {**rep, "error": res.stderr[-500:]}
    job_id = json.loads(res.stdout)["id"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflashctl", "watch", job_id, "--json", "--interval", "2"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    states = []
    for line in proc.stdout:
        rec = json.loads(line)
        states.append((round(time.perf_counter() - t0, 1), rec["state"]))
        if rec["state"] == "DENSE_FALLBACK":
            rep["dense_fallback_diagnosis_s"] = round(time.perf_counter() - t0, 1)
            rep["dense_fallback_evidence"] = rec["evidence"][:2]
    proc.wait()
    rep["dense_fallback_watch_exit"] = proc.returncode
    rep["dense_fallback_states"] = states
    # 2. a real job: launch, watch with GPU readings until RUNNING, kill, GPU memory freed
    real = {
        **CONFIG,
        "attention": {"backend": "dense", "dense_max_gib": 16},
        "data": {**CONFIG["data"], "seq_buckets": [1024], "anchors_per_seq": 64},
        "steps": 100000,
    }
    before = gpu_mem_used_mib()
    res = cli("launch", str(job_file(d, "real", real)), "--json")
    job_id = json.loads(res.stdout)["id"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflashctl", "watch", job_id, "--json", "--interval", "3"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    t0 = time.perf_counter()
    for line in proc.stdout:
        rec = json.loads(line)
        if rec["state"] == "RUNNING" and rec["gpus"]:
            rep["watch_running_record"] = {
                k: rec[k] for k in ("state", "reason", "step", "tokens_per_s", "gpus", "remote_commands")
            }
            rep["watch_to_running_s"] = round(time.perf_counter() - t0, 1)
            break
        if time.perf_counter() - t0 > 240 or rec["state"] not in ("STARTING", "RUNNING"):
            rep["watch_last"] = rec
            break
    proc.terminate()
    proc.wait()
    t = time.perf_counter()
    once = subprocess.run(
        [sys.executable, "-m", "dflashctl", "watch", job_id, "--once", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    rep["watch_once_s"] = round(time.perf_counter() - t, 2)
    rep["during_gpu_mem_mib"] = gpu_mem_used_mib()
    res = cli("kill", job_id, "--json")
    rep["kill"] = json.loads(res.stdout) if res.returncode == 0 else res.stderr[-500:]
    time.sleep(2)
    rep["after_kill_gpu_apps"] = gpu_apps()
    rep["gpu_mem_mib_before_launch_during_after"] = [before, rep.pop("during_gpu_mem_mib"), gpu_mem_used_mib()]
    rep["watch_once_state"] = json.loads(once.stdout)["state"] if once.returncode in (0, 13) else once.stderr[-200:]
    return rep


# ---------------------------------------------------------------- the step, counted


def matmul_tflops(n: int = 8192, reps: int = 30) -> float:
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12


def allowed_pairs(anchors, valid, S: int, bs: int) -> int:
    """Query-key pairs the block mask allows: each block sees the context before its anchor and its own block."""
    a = anchors[valid].long()
    return int(((a + bs) * bs).sum())


def step_flops(parts, S: int, A: int, bs: int, pairs: int) -> dict:
    tc, d = parts.target.config, parts.drafter.d
    C, H, G, D = tc.hidden_size, tc.num_attention_heads, tc.num_key_value_heads, tc.head_dim
    inter = tc.intermediate_size
    n_target = max(parts.target.layer_ids) + 1
    layer = C * H * D + 2 * C * G * D + H * D * C + 3 * C * inter
    target = n_target * (2 * S * layer + 2 * S * S * H * D)  # causal attention: half of 4*S*S*H*D
    Q = A * bs
    dl_q = 2 * Q * (d.hidden * d.num_heads * d.head_dim * 2 + 3 * d.hidden * d.intermediate)  # q, o, MLP
    dl_kv = 2 * (S + Q) * 2 * d.hidden * d.num_kv_heads * d.head_dim
    attn = 4 * d.num_heads * d.head_dim * pairs
    fc = 2 * S * d.num_target_layers * d.hidden * d.hidden
    drafter_fwd = d.num_layers * (dl_q + dl_kv + attn) + fc
    drafter_bwd = d.num_layers * (2 * (dl_q + dl_kv) + 2.5 * attn) + fc  # dX and dW; flex backward ~2.5x forward
    n_lab = A * (bs - 1)
    head = 2 * n_lab * C * tc.vocab_size
    return {
        "target_fwd": target,
        "drafter_fwd": drafter_fwd,
        "drafter_bwd": drafter_bwd,
        "lm_head_loss": 2 * head,
        "attention_fwd": d.num_layers * attn,
        "attention_bwd": d.num_layers * 2.5 * attn,
    }


def real_step(parts, opt, batch, fold_clip: bool = True) -> float:
    """One trainer step alone (bench/step_breakdown.py `trainer_step`), synchronized before and after; seconds.
    `fold_clip=False`: clip_grad_norm_'s own scaling pass, then the update (the trainer until round 7)."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    trainer_step(parts, opt, batch, fold_clip=fold_clip)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def steady(parts, opt, batch_of, n: int, blocks: int = 3) -> tuple[float, dict]:
    """Steps back to back as the trainer runs them, in `blocks` runs of `n` after 3 to warm up: the median of the
    blocks' milliseconds per step, and memory after the first block and the last."""
    import torch

    run_steps(parts, opt, [batch_of(i) for i in range(3)])
    per_step, mem = [], {}
    for k in range(blocks):
        torch.cuda.reset_peak_memory_stats()
        per_step.append(run_steps(parts, opt, [batch_of(3 + k * n + i) for i in range(n)]))
        if k in (0, blocks - 1):
            mem[3 + (k + 1) * n] = {
                "allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 3),
                "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3),
            }
    return statistics.median(per_step), mem


def trainers_adamw(parts):
    """The optimizer the trainer makes (trainer/run/update.py `make_adamw`), or, for a trainer from before it
    existed, the fused AdamW it made then."""
    import torch

    try:
        from trainer.run.update import make_adamw
    except ImportError:
        return torch.optim.AdamW(parts.drafter.parameters(), lr=6e-4, betas=(0.9, 0.999), fused=True)
    return make_adamw(parts.drafter.parameters(), parts.cfg.optim)


def variants(parts, opt, batch, S: int) -> dict:
    """Each improvement switched off in turn, on the same compiled graphs: tokens/s and peak memory."""
    import torch

    from trainer.model.drafter import RMSNorm

    out = {}

    def run(tag: str, n: int = 12, fold_clip: bool = True) -> None:
        times, peaks = [], []
        for i in range(n):
            torch.cuda.reset_peak_memory_stats()
            times.append(real_step(parts, opt, batch(i), fold_clip))
            peaks.append(torch.cuda.max_memory_allocated() / 2**30)
        out[f"tokens_per_s_{tag}"] = round(S / statistics.median(times[2:]))
        out[f"peak_gib_{tag}"] = round(max(peaks[2:]), 2)

    run("default")
    run("unfolded_clip", fold_clip=False)
    run("default_again")  # the spread between two runs of the same code
    parts.cfg.optim.loss_kernel = "plain"
    run("plain_loss")
    parts.cfg.optim.loss_kernel = "auto"
    parts.cfg.optim.chunked_loss = True
    run("chunked_loss")
    parts.cfg.optim.chunked_loss = False
    fused_norm = RMSNorm.forward
    RMSNorm.forward = torch.nn.RMSNorm.forward  # the composite norm (bf16 input, fp32 weight)
    run("composite_rmsnorm")
    RMSNorm.forward = fused_norm
    for name, kw in (("foreach", {"foreach": True}), ("fused", {"fused": True})):
        o = torch.optim.AdamW(parts.drafter.parameters(), lr=1e-9, **kw)
        for p in parts.drafter.parameters():
            p.grad = torch.zeros_like(p)
        o.step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            o.step()
        torch.cuda.synchronize()
        out[f"adamw_{name}_ms"] = round((time.perf_counter() - t0) / 5 * 1e3, 2)
        del o
    parts.drafter.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    return out


def profile_attention(parts, opt, batch) -> dict:
    """Device time of the compiled flex region (forward: CompiledFunction, backward: CompiledFunctionBackward)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    steps = 3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            real_step(parts, opt, batch)
    rows = prof.key_averages()

    def dev(e) -> float:
        return float(getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0))

    top = sorted(rows, key=dev, reverse=True)[:25]
    table = [(e.key[:80], round(dev(e) / 1e3 / steps, 2), e.count // steps) for e in top]
    fwd = sum(dev(e) for e in rows if e.key == "CompiledFunction") / 1e3 / steps
    bwd = sum(dev(e) for e in rows if e.key == "CompiledFunctionBackward") / 1e3 / steps
    return {"attn_fwd_ms": fwd, "attn_bwd_ms": bwd, "top_device_ms_per_step": table, "torch": torch.__version__}


def isolated_attention(parts, batch, reps: int = 20) -> dict:
    """The same q/k/v shapes and mask as in the step: compiled flex (fwd, fwd+bwd), per-block SDPA, eager dense."""
    import torch
    import torch.nn.functional as F

    from trainer.model.attention import DenseBackend, FlexBackend

    b = batch.to("cuda")
    S, A, bs = b.seq_len, b.anchors.shape[1], b.block_size
    d = parts.drafter.d
    H, G, D, Q, KV = d.num_heads, d.num_kv_heads, d.head_dim, A * bs, S + A * bs
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, H, Q, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, G, KV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, G, KV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    pairs = allowed_pairs(b.anchors, b.anchor_valid, S, bs)
    fwd_flops = 4 * H * D * pairs
    out: dict = {"shape": f"B=1 H={H} G={G} Q={Q} KV={KV} D={D} bf16, {pairs / (Q * KV):.1%} of pairs allowed"}

    def timed(fn, n=reps) -> tuple[float, float]:
        fn()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e3, (torch.cuda.max_memory_allocated() - base) / 2**30

    flex = FlexBackend()
    mask = flex.build_mask(b.anchors, b.anchor_valid, S, bs, H)
    out["flex_ms"], out["flex_peak_gib"] = timed(lambda: flex(q, k, v, mask))
    out["isolated_flex_tflops"] = fwd_flops / (out["flex_ms"] / 1e3) / 1e12
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))

    def fwd_bwd():
        flex(qg, kg, vg, mask).sum().backward()

    out["flex_fwd_bwd_ms"], out["flex_fwd_bwd_peak_gib"] = timed(fwd_bwd, 10)
    out["isolated_flex_fwd_bwd_tflops"] = 3.5 * fwd_flops / (out["flex_fwd_bwd_ms"] / 1e3) / 1e12
    anchors = b.anchors[0].tolist()

    def sdpa_blockwise():
        outs = []
        for j, a in enumerate(anchors):
            kj = torch.cat([k[:, :, :a], k[:, :, S + j * bs : S + (j + 1) * bs]], dim=2)
            vj = torch.cat([v[:, :, :a], v[:, :, S + j * bs : S + (j + 1) * bs]], dim=2)
            outs.append(F.scaled_dot_product_attention(q[:, :, j * bs : (j + 1) * bs], kj, vj, enable_gqa=True))
        return torch.cat(outs, dim=2)

    out["sdpa_blockwise_ms"], out["sdpa_blockwise_peak_gib"] = timed(sdpa_blockwise, 3)
    dense = DenseBackend(max_gib=64)
    dmask = dense.build_mask(b.anchors, b.anchor_valid, S, bs, H)
    ref = dense(q, k, v, dmask)
    out["dense_ms"], out["dense_peak_gib"] = timed(lambda: dense(q, k, v, dmask), 3)
    out["flex_vs_dense_max_abs_diff"] = (flex(q, k, v, mask).float() - ref.float()).abs().max().item()
    out["sdpa_vs_dense_max_abs_diff"] = (sdpa_blockwise().float() - ref.float()).abs().max().item()
    out["fwd_flops"] = fwd_flops
    return out


def step_benchmark(
    steady_steps: int, isolated: bool = True, extras: bool = True, args_expand_kv: bool | None = None
) -> dict:
    import torch

    from trainer.config import from_dict
    from trainer.model.compile_policy import graphs_compiled, unfreeze_compiles
    from trainer.run.build import build, dummy_batch, make_batch, preflight

    rep: dict = {"peak_matmul_tflops": round(matmul_tflops(), 1)}
    print(f"matmul: {rep['peak_matmul_tflops']} TFLOP/s", flush=True)
    cfg = from_dict(CONFIG)
    t0 = time.perf_counter()
    parts = build(cfg, device=torch.device("cuda"))
    rep["build_s"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    if args_expand_kv is not None:
        parts.backend.expand_kv = args_expand_kv
    rep["attention_kernel"] = getattr(parts, "attention_kernel", None)
    pf = preflight(parts)
    rep["preflight_s"] = round(time.perf_counter() - t0, 1)
    rep["preflight_peak_gib"] = {k: round(v, 2) for k, v in pf.peak_mem_gib.items()}
    rep["preflight_bucket_s"] = {k: round(v, 2) for k, v in pf.seconds.items()}
    try:  # where the preflight's compile time went (Dynamo's own accounting, cumulative per phase)
        from torch._dynamo.utils import compile_times

        rep["compile_times"] = str(compile_times(repr="str", aggregate=True))[:4000]
    except Exception as e:  # its signature moves between releases
        rep["compile_times"] = f"{type(e).__name__}: {e}"
    print(f"built in {rep['build_s']} s, preflight {rep['preflight_s']} s", flush=True)
    baseline = graphs_compiled()
    opt = trainers_adamw(parts)
    rep["optimizer"] = type(opt).__name__
    S, A, bs = 3072, 512, 16

    class Full:  # full-length sequences, anchors resampled per step like real epochs
        samples = []

    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        ids = torch.randint(0, 151936, (S,), generator=g)
        Full.samples.append((ids, torch.ones(S, dtype=torch.long)))

    def batch(i: int):
        return make_batch(parts, Full, S, [i % 4], i // 4)

    fixed = dummy_batch(parts, S)
    pairs = allowed_pairs(fixed.anchors, fixed.anchor_valid, S, bs)
    flops = step_flops(parts, S, A, bs, pairs)
    rep["flops_per_step_tflop"] = {k: round(v / 1e12, 2) for k, v in flops.items()}
    # the trainer's own step, its stages marked in stream order, steps back to back (bench/step_breakdown.py)
    total = sum(v for k, v in flops.items() if not k.startswith("attention"))
    rep["breakdown"] = breakdown(parts, opt, batch, 9, flops, rep["peak_matmul_tflops"], warmup=3)
    rep["kernel_time"] = kernel_time(parts, opt, batch)
    print(f"breakdown: {rep['breakdown']}\nkernels: {rep['kernel_time']}", flush=True)
    step_ms, mem = steady(parts, opt, batch, steady_steps)
    step_s = step_ms / 1e3
    rep["step_ms"] = round(step_ms, 1)
    rep["tokens_per_s"] = round(S / step_s)
    rep["block_tokens_per_s"] = round(A * bs / step_s)
    rep["achieved_tflops"] = round(total / step_s / 1e12, 1)
    rep["mfu"] = round(total / step_s / 1e12 / rep["peak_matmul_tflops"], 4)
    rep["memory_by_step"] = mem
    rep["memory_steady"] = len({json.dumps(m, sort_keys=True) for m in mem.values()}) == 1
    if extras:
        rep.update(variants(parts, opt, batch, S))
    rep["recompiles_after_preflight"] = graphs_compiled() - baseline
    print(f"step {rep['step_ms']} ms, {rep['tokens_per_s']} tok/s, MFU {rep['mfu']}", flush=True)
    if not extras:
        return rep

    prof = profile_attention(parts, opt, fixed)
    attn_ms = prof["attn_fwd_ms"] + prof["attn_bwd_ms"]
    rep["attention_ms_in_step"] = round(attn_ms, 2)
    rep["attention_share"] = round(attn_ms / rep["step_ms"], 3)
    attn_flops = flops["attention_fwd"] + flops["attention_bwd"]
    rep["attention_tflops"] = round(attn_flops / (attn_ms / 1e3) / 1e12, 1) if attn_ms else None
    rep["profile_top"] = prof["top_device_ms_per_step"]
    if not isolated:
        return rep
    unfreeze_compiles()  # new shapes below (no grad): compile them rather than fail
    iso = isolated_attention(parts, fixed)
    rep["isolated"] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in iso.items()}
    rep["isolated_flex_tflops"] = round(iso["isolated_flex_tflops"], 1)
    rep["flex_ms"] = round(iso["flex_ms"], 3)
    rep["sdpa_blockwise_ms"] = round(iso["sdpa_blockwise_ms"], 2)
    rep["dense_peak_gib"] = round(iso["dense_peak_gib"], 2)
    rep["flex_peak_gib"] = round(iso["flex_peak_gib"], 3)
    return rep


def baseline_run(args) -> dict:
    """This benchmark with the trainer from `args.baseline`, in a process of its own (same steps, no extras): the
    step, MFU, breakdown and preflight of the code it is compared with, measured in the same run."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "baseline.json"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--trainer-from",
            args.baseline,
            "--skip-cli",
            "--skip-isolated",
            "--no-extras",
            "--steady-steps",
            str(args.steady_steps),
            "--out",
            str(out),
        ]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0 or not out.is_file():
            return {"error": proc.stderr[-2000:]}
        raw = json.loads(out.read_text())
    keys = (
        "trainer_from",
        "optimizer",
        "step_ms",
        "tokens_per_s",
        "mfu",
        "peak_matmul_tflops",
        "memory_by_step",
        "preflight_bucket_s",
        "breakdown",
        "kernel_time",
        "recompiles_after_preflight",
    )
    return {k: raw.get(k) for k in keys}


def cold_reports(paths: str | None) -> dict | None:
    """cold_preflight_s for the record from bench/cold_preflight.py reports: per report (named by what its runs
    shared), each run's seconds per bucket."""
    if not paths:
        return None
    out = {}
    for path in paths.split(","):
        rep = json.loads(Path(path).read_text())
        good = [r for r in rep["runs"] if not r["exit"]]
        runs = [dict(zip(map(str, rep["buckets"]), r["preflight_s"], strict=True)) for r in good]
        out[f"share_{rep.get('share', 'none')}"] = runs
    return out


RECORD_KEYS = (
    "date",
    "torch_version",
    "gpu",
    "peak_matmul_tflops",
    "optimizer",
    "mfu",
    "step_ms",
    "tokens_per_s",
    "peak_gib",
    "breakdown",
    "kernel_time",
    "preflight_bucket_s",
    "cold_preflight_s",
    "launch_to_running_cold_s",
    "recompiles_after_preflight",
    "baseline",
    "against_baseline",
)


def record_of(
    report: dict, source: str, launch_to_running_cold_s: float | None = None, cold: dict | None = None
) -> dict:
    """The one current record (bench/results/h200.json, what the README quotes) from a run's full report: every key
    always there, None where that run did not measure it, and the raw file it came from. `cold`: cold_reports'."""
    peaks = [m.get("peak_gib") for m in (report.get("memory_by_step") or {}).values() if isinstance(m, dict)]
    derived = {
        "peak_gib": max(peaks) if peaks else None,
        "cold_preflight_s": cold,
        "launch_to_running_cold_s": launch_to_running_cold_s,
    }
    return {**{k: derived[k] if k in derived else report.get(k) for k in RECORD_KEYS}, "source": source}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--steady-steps", type=int, default=105)
    ap.add_argument("--skip-cli", action="store_true")
    ap.add_argument("--skip-isolated", action="store_true", help="no isolated kernel / SDPA / dense comparison")
    ap.add_argument(
        "--drafter-compile",
        choices=["auto", "on", "off"],
        default="auto",
        help="drafter.compile: its layers compiled whole (auto on CUDA), or the flex call alone (off)",
    )
    ap.add_argument(
        "--buckets",
        type=int,
        nargs="+",
        default=[3072],
        help="seq buckets the preflight compiles (the step runs at 3072), timed per bucket",
    )
    ap.add_argument("--flex-options", default="{}", help="flex_attention kernel_options, JSON (bench/flex_tiles.py)")
    ap.add_argument(
        "--flex-backend",
        choices=["auto", "triton", "flash"],
        default=None,
        help="attention.flex_backend (left out: the config's default)",
    )
    ap.add_argument(
        "--expand-kv",
        choices=["on", "off"],
        default=None,
        help="keys and values repeated to every query head in training (default: on)",
    )
    ap.add_argument("--no-extras", action="store_true", help="the step alone: no variants, profile or isolated kernels")
    ap.add_argument("--trainer-from", default=None, help="import the trainer from this tree (a baseline's copy)")
    ap.add_argument(
        "--baseline",
        default=None,
        help="first the same measurement with the trainer from this tree "
        "(a copy of an earlier commit), in its own process with its own empty caches, kept as `baseline`",
    )
    ap.add_argument(
        "--cold-from",
        default=None,
        help="bench/cold_preflight.py reports, comma-separated, for the record's cold_preflight_s",
    )
    ap.add_argument("--record", default=None, help="also write the one current record here (bench/results/h200.json)")
    ap.add_argument("--record-from", default=None, help="no run: make --record from this raw report (a JSON file)")
    ap.add_argument(
        "--launch-to-running-cold-s",
        type=float,
        default=None,
        help="from bench/time_to_first_step.py's cold launch, for the record",
    )
    args = ap.parse_args()
    if args.record_from:
        raw = json.loads(Path(args.record_from).read_text())
        rec = record_of(raw, args.record_from, args.launch_to_running_cold_s, cold_reports(args.cold_from))
        Path(args.record).write_text(json.dumps(rec, indent=1) + "\n")
        print(json.dumps(rec))
        return
    if args.baseline or args.trainer_from:  # each side compiles from empty caches of its own: a fair preflight
        import os

        fresh = Path(tempfile.mkdtemp(prefix="h200-perf-cache-"))
        os.environ["TORCHINDUCTOR_CACHE_DIR"], os.environ["TRITON_CACHE_DIR"] = str(fresh / "i"), str(fresh / "t")
    CONFIG["drafter"] = {**CONFIG.get("drafter", {}), "compile": args.drafter_compile}
    if args.flex_backend:  # only when given: a baseline's trainer may not know the key
        CONFIG["attention"] = {**CONFIG.get("attention", {}), "flex_backend": args.flex_backend}
    CONFIG["data"] = {**CONFIG["data"], "seq_buckets": sorted(set(args.buckets) | {3072})}
    from trainer.model import attention

    attention.KERNEL_OPTIONS.update(json.loads(args.flex_options))
    import torch

    # no CUDA in this process before the cycle: its context would count as an unknown process on the GPU
    report: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "torch_version": torch.__version__,
        "two_gpu_speedup": None,
        "drafter_compile": args.drafter_compile,
        "flex_options": attention.KERNEL_OPTIONS,
    }
    if not args.skip_cli:
        try:
            report["cli"] = cli_cycle()
            report["dense_fallback_diagnosis_s"] = report["cli"].get("dense_fallback_diagnosis_s")
        except Exception as e:  # keep the GPU numbers even if the cycle breaks
            report["cli"] = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(report["cli"], default=str)[:3000], flush=True)
    report["gpu"] = torch.cuda.get_device_name()
    if args.baseline:
        report["baseline"] = baseline_run(args)
    report["trainer_from"] = args.trainer_from or "this tree"
    expand = None if args.expand_kv is None else args.expand_kv == "on"
    report.update(step_benchmark(args.steady_steps, not args.skip_isolated, not args.no_extras, expand))
    if report.get("baseline", {}).get("step_ms"):
        base = report["baseline"]
        ceiling = max(base["peak_matmul_tflops"], report["peak_matmul_tflops"])  # one ceiling for both sides
        mfus = [round(r["mfu"] * r["peak_matmul_tflops"] / ceiling, 4) for r in (base, report)]
        report["against_baseline"] = {
            "step_ms": [base["step_ms"], report["step_ms"]],
            "mfu_at_one_ceiling": mfus,
            "ceiling_tflops": ceiling,
            "speedup": round(base["step_ms"] / report["step_ms"], 4),
        }
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    if args.record:
        rec = record_of(
            report, args.out or "(this run's output)", args.launch_to_running_cold_s, cold_reports(args.cold_from)
        )
        Path(args.record).write_text(json.dumps(rec, indent=1, default=str) + "\n")
    print("\n| measurement | value |\n| --- | --- |")
    for k, v in report.items():
        if k not in ("profile_top", "cli", "isolated", "compile_times"):
            print(f"| {k} | {v} |")
    print("\nprofile (device ms per step):")
    for row in report.get("profile_top", [])[:15]:
        print(row)


if __name__ == "__main__":
    main()
