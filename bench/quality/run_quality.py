"""Both trainers on identical work, on a real target made here: tau, step time and peak memory, side by side.

    python bench/quality/run_quality.py --work DIR --phase target      # make the target (make_target.py)
    python bench/quality/run_quality.py --work DIR --phase data        # the target's answers to the training prompts
    python bench/quality/run_quality.py --work DIR --phase features    # its hidden states, for SpecForge
    python bench/quality/run_quality.py --work DIR --phase ours        # train, then each checkpoint's bench_tau
    python bench/quality/run_quality.py --work DIR --phase specforge   # SpecForge offline, the same for it
    python bench/quality/run_quality.py --work DIR --phase lookup      # prompt lookup on the same prompts

Phases share DIR on one GPU host; `run_h200.sh` runs target and data, then the rest side by side. `data` and `ours`
are what a user runs: `trainer.regenerate` (the target's own greedy answers to the training prompts), `trainer.train`
(the paper's recipe scaled to the target: block 16, anchors, warmup then cosine, a checkpoint every N steps and the
in-run eval at the end), then `trainer.export` and `trainer.bench_tau` on the held-out prompts for every checkpoint,
side by side (the tau-versus-step curve, on the same yardstick as SpecForge's). `features` dumps the
target's hidden states for SpecForge's offline mode (specforge_side.py); `specforge` trains SpecForge's DFlash
drafter on them (same target, data, drafter shape, steps, batch and anchors), exports each checkpoint with its own
exporter, converts it to the public DFlash format and measures it with the same bench_tau. Each phase writes
DIR/<phase>.json (`ours` and `specforge` as `ours<tag>.json`, `specforge<tag>.json`: `--set tag=-s1 --set seed=1`
for another seed).
`--scale tiny` shrinks everything for a run on the CPU (SpecForge needs a GPU). `--scale real` takes a real
pretrained target instead of making one: `--set gguf=FILE --set prompts=DIR` name what `real_target.py gather`
wrote, and `run_real.sh` runs the whole pass.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

SCALES = {
    "gpu": {
        "target": ["--size", "small", "--steps", "800"],
        "prompts_train": 2000,
        "regen_tokens": 192,
        "regen_batch": 200,
        "layers": 3,
        "block": 16,
        "anchors": 64,
        "buckets": [512, 1024],
        "batch": 8,
        "steps": 1200,
        "lr": 6e-4,
        "betas": [0.9, 0.999],
        "eval_every": 300,
        "eval_prompts": 16,
        "eval_tokens": 128,
        "tau_prompts": 40,
        "tau_tokens": 128,
        "attention": "flex",
        "device": "cuda",
        "dtype": "bfloat16",
    },
    # a real pretrained target (real_target.py: a GGUF converted, ShareGPT and code-request prompts, HumanEval +
    # MT-bench held out); `--set gguf=FILE --set prompts=DIR` name the files `real_target.py gather` wrote. `data`
    # picks what ours trains on: "sub" (the first `sf_samples` answers, SpecForge's dumped set: equal work) or "full"
    "real": {
        "target": None,
        "prompts_train": None,
        "regen_tokens": 256,
        "regen_batch": 1024,
        "regen_baseline": 500,
        "regen_baseline_batch": 500,
        "layers": 3,
        "block": 16,
        "anchors": 64,
        "buckets": [512, 1024],
        "batch": 16,
        "steps": 1000,
        "data": "sub",
        "sf_samples": 8000,
        "dump_batch": 32,
        "lr": 6e-4,
        "betas": [0.9, 0.999],
        "eval_every": 500,
        "eval_at_end": False,
        "eval_prompts": 16,
        "eval_tokens": 128,
        "tau_prompts": 244,
        "tau_tokens": 256,
        "tau_batch": 256,
        "tau_workers": 1,
        "lookup_shards": 8,
        "attention": "flex",
        "device": "cuda",
        "dtype": "bfloat16",
    },
    "tiny": {
        "target": [
            "--size",
            "tiny",
            "--steps",
            "3",
            "--batch",
            "4",
            "--seq",
            "64",
            "--max-mb",
            "3",
            "--heldout-percent",
            "5",
            "--eval-tokens",
            "2000",
            "--train-prompts",
            "40",
            "--heldout-prompts",
            "6",
        ],
        "prompts_train": 40,
        "regen_tokens": 16,
        "regen_batch": 16,
        "regen_baseline": 0,
        "layers": 1,
        "block": 4,
        "anchors": 32,
        "buckets": [512],
        "batch": 2,
        "steps": 6,
        "data": "full",
        "sf_samples": 12,
        "dump_batch": 4,
        "lr": 6e-4,
        "betas": [0.9, 0.999],
        "eval_every": 3,
        "eval_prompts": 2,
        "eval_tokens": 8,
        "tau_prompts": 3,
        "tau_tokens": 8,
        "tau_batch": 4,
        "lookup_shards": 2,
        "attention": "dense",
        "device": "cpu",
        "dtype": "float32",
    },
}


def sh(cmd: list[str], log: Path, env: dict | None = None) -> float:
    """Run one step of the pipeline, its output appended to `log`; its wall seconds. A failure stops the phase."""
    t0 = time.time()
    with log.open("a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        rc = subprocess.run(
            cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, **(env or {})}
        ).returncode
    if rc != 0:
        sys.stderr.write(log.read_text()[-4000:])
        raise SystemExit(f"failed ({rc}): {' '.join(cmd)}")
    return round(time.time() - t0, 1)


class PeakGpuMemory:
    """nvidia-smi's used memory, polled every 0.5 s while a training runs: the same yardstick for both trainers."""

    def __init__(self) -> None:
        self.peak_mib, self._stop = 0, threading.Event()

    def __enter__(self):
        self._t = threading.Thread(target=self._poll, daemon=True)
        self._t.start()
        return self

    def _poll(self) -> None:
        while not self._stop.wait(0.5):
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                    capture_output=True,
                    text=True,
                    timeout=5,
                ).stdout.split()
                self.peak_mib = max([self.peak_mib, *(int(x) for x in out if x.isdigit())])
            except (OSError, subprocess.TimeoutExpired):
                return

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


def bench_tau(work: Path, drafter: Path, s: dict, tag: str = "") -> dict:
    """`trainer.bench_tau` on the held-out prompts; its own log, so several can run side by side."""
    name = f"tau-{drafter.name}{tag}"
    out, log = work / f"{name}.json", work / f"{name}.log"
    log.unlink(missing_ok=True)
    sh(
        [
            sys.executable,
            "-m",
            "trainer.bench_tau",
            "--target",
            str(work / "target"),
            "--drafter",
            str(drafter),
            "--prompts",
            str(work / "prompts" / "heldout.jsonl"),
            "--limit",
            str(s["tau_prompts"]),
            "--max-new-tokens",
            str(s["tau_tokens"]),
            "--device",
            s["device"],
            "--json",
            "--quiet",
            "--batch-size",
            str(s.get("tau_batch", 64)),
            "--out",
            str(work / f"{name}.jsonl"),
        ],
        log,
    )
    text = log.read_text().rstrip().splitlines()
    result = json.loads(next(line for line in reversed(text) if line.startswith("{")))
    out.write_text(json.dumps(result, indent=1))
    return result


def phase_target(work: Path, s: dict, log: Path) -> dict:
    """The target: made here (make_target.py), or a real one converted from its GGUF (`gguf` and `prompts` set)."""
    if s.get("gguf"):
        (work / "prompts").mkdir(parents=True, exist_ok=True)
        for name in ("train.jsonl", "heldout.jsonl", "sources.json"):
            shutil.copyfile(Path(s["prompts"]) / name, work / "prompts" / name)
        sources = json.loads((work / "prompts" / "sources.json").read_text())
        secs = sh(
            [
                sys.executable,
                str(HERE / "real_target.py"),
                "convert",
                "--gguf",
                s["gguf"],
                "--sha256",
                sources["sha256"],
                "--target",
                sources["target"],
                "--source",
                sources["source"],
                "--heldout",
                str(work / "prompts" / "heldout.jsonl"),
                "--out",
                str(work),
            ],
            log,
        )
    else:
        secs = sh([sys.executable, str(HERE / "make_target.py"), "--out", str(work), *s["target"]], log)
    return {**json.loads((work / "target.json").read_text()), "wall_s": secs}


def training_data(work: Path, s: dict) -> Path:
    """What ours trains on: every regenerated answer, or (`data: sub`) the subset SpecForge's features were dumped
    from, so that the two trainers do the same work."""
    return work / ("regen-sub.jsonl" if s.get("data") == "sub" else "regen.jsonl")


def our_config(work: Path, s: dict) -> dict:
    return {
        "target": {"path": str(work / "target"), "dtype": s["dtype"]},
        "drafter": {"num_layers": s["layers"], "block_size": s["block"], "init_std": s.get("init_std")},
        "attention": {"backend": s["attention"]},
        "data": {
            "path": str(training_data(work, s)),
            "anchors_per_seq": s["anchors"],
            "seq_buckets": s["buckets"],
            "batch_size": s["batch"],
            "holdout": 0,
        },
        "optim": {"lr": s["lr"], "betas": s["betas"], "warmup_ratio": 0.04, "grad_clip": 1.0, "gamma": 7.0},
        "steps": s["steps"],
        "log_every": 10,
        "seed": s.get("seed", 0),
        "device": s["device"],
        "checkpoint": {"every": s["eval_every"], "keep": max(1, s["steps"] // s["eval_every"])},
        "eval": {
            "every": 0,
            "at_end": bool(s.get("eval_at_end", True)),
            "prompts": s["eval_prompts"],
            "max_new_tokens": s["eval_tokens"],
            "prompt_file": str(work / "prompts" / "heldout.jsonl"),
        },
        "metrics": {"gpu_history": False},
    }


def target_forward_ms(work: Path, s: dict) -> dict:
    """The frozen target's forward (hidden states out) on one batch per bucket: what SpecForge's offline mode skips."""
    import torch
    from transformers import AutoModelForCausalLM

    dev = s["device"]
    model = AutoModelForCausalLM.from_pretrained(work / "target", dtype=getattr(torch, s["dtype"])).to(dev).eval()
    out = {}
    for seq in s["buckets"]:
        x = torch.randint(0, model.config.vocab_size, (s["batch"], seq), device=dev)
        with torch.no_grad():
            for _ in range(3):
                model(input_ids=x, output_hidden_states=True)
            if dev == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(10):
                model(input_ids=x, output_hidden_states=True)
            if dev == "cuda":
                torch.cuda.synchronize()
        out[str(seq)] = round((time.perf_counter() - t0) * 100, 2)
    del model
    return out


def regenerate(work: Path, s: dict, prompts: list[str], name: str, engine: str, batch: int, log: Path) -> dict:
    """`trainer.regenerate` on `prompts` (one JSON line each): its counts (tokens, decode seconds) and wall time."""
    (work / "prompts" / f"{name}-in.jsonl").write_text("\n".join(prompts) + "\n")
    stats = work / f"{name}-stats.json"
    wall = sh(
        [
            sys.executable,
            "-m",
            "trainer.regenerate",
            "--config",
            str(work / "ours.yaml"),
            "--input",
            str(work / "prompts" / f"{name}-in.jsonl"),
            "--output",
            str(work / f"{name}.jsonl"),
            "--max-new-tokens",
            str(s["regen_tokens"]),
            "--batch-size",
            str(batch),
            "--engine",
            engine,
            "--stats",
            str(stats),
            "--quiet",
        ],
        log,
    )
    return {**json.loads(stats.read_text()), "wall_s": wall, "prompts": len(prompts)}


def phase_data(work: Path, s: dict, log: Path) -> dict:
    """The target's own greedy answers to the training prompts (what both trainers train on), by the static engine;
    first, on the first `regen_baseline` prompts, by `model.generate` (the engine it replaces) for its speed."""
    import yaml

    (work / "ours.yaml").write_text(yaml.safe_dump(our_config(work, s), sort_keys=False))
    prompts = (work / "prompts" / "train.jsonl").read_text().splitlines()[: s["prompts_train"]]
    (work / "prompts" / "train-used.jsonl").write_text("\n".join(prompts) + "\n")
    engines = {}
    if s.get("regen_baseline"):
        engines["hf"] = regenerate(
            work,
            s,
            prompts[: s["regen_baseline"]],
            "regen-baseline",
            "hf",
            s.get("regen_baseline_batch", s["regen_batch"]),
            log,
        )
    engines["static"] = regenerate(work, s, prompts, "regen", "static", s["regen_batch"], log)
    answers = [json.loads(x)["response"] for x in (work / "regen.jsonl").read_text().splitlines() if x.strip()]
    chars = sorted(len(a) for a in answers)
    write_subset(work, s)
    return {
        "times": {"regenerate_s": engines["static"]["wall_s"]},
        "engines": engines,
        "records": len(prompts),
        "empty_answers": sum(not a.strip() for a in answers),
        "answer_chars_median": chars[len(chars) // 2] if chars else 0,
        "sample_answers": answers[:3],
        "regen_sha256": sha256_file(work / "regen.jsonl"),
        "answer_check": answer_check(work, answers),
    }


def write_subset(work: Path, s: dict) -> list[str]:
    """regen-sub.jsonl: the first `sf_samples` answers, what SpecForge's features are dumped from and what the runs
    of ours that do the same work train on (written with the answers, so that those runs need not wait)."""
    lines = [x for x in (work / "regen.jsonl").read_text().splitlines() if x.strip()][: s["sf_samples"]]
    (work / "regen-sub.jsonl").write_text("\n".join(lines) + "\n")
    return lines


def sha256_file(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def answer_check(work: Path, answers: list[str]) -> dict:
    """Whether the target's answers are worth drafting for: distinct 4-gram ratio and answers ending in a loop."""
    from real_target import text_stats
    from transformers import AutoTokenizer

    return text_stats(AutoTokenizer.from_pretrained(work / "target"), answers)


def phase_features(work: Path, s: dict, log: Path) -> dict:
    """The target's hidden states, in SpecForge's offline format, for the first `sf_samples` answers (its files take
    ~2 MB an answer: all of them would not fit the disk); those answers are also written alone, as regen-sub.jsonl,
    for the runs of ours that do the same work."""
    shutil.rmtree(work / "features", ignore_errors=True)
    lines = write_subset(work, s)
    secs = sh(
        [
            sys.executable,
            str(HERE / "specforge_side.py"),
            "dump",
            "--target",
            str(work / "target"),
            "--data",
            str(work / "regen-sub.jsonl"),
            "--layers",
            str(s["layers"]),
            "--max-len",
            str(max(s["buckets"])),
            "--batch",
            str(s.get("dump_batch", 32)),
            "--out",
            str(work / "features"),
        ],
        log,
    )
    return {
        "dump_s": secs,
        "answers": len(lines),
        "files": len(list((work / "features").glob("*.ckpt"))),
        "bytes": sum(f.stat().st_size for f in (work / "features").glob("*.ckpt")),
        "regen_sub_sha256": sha256_file(work / "regen-sub.jsonl"),
    }


def curve_point(work: Path, drafter: Path, step: int, s: dict) -> dict:
    """One checkpoint's tau on the curve's yardstick (the same `bench_tau`, prompts and length for both trainers)."""
    r = bench_tau(work, drafter, s)["sets"][0]
    return {
        "step": step,
        "tau": r["tau_prompt_mean"],
        "tau_pooled": r["tau_pooled"],
        "draft_steps": r["draft_steps"],
        "prompts": r["prompts"],
        "decode_s": r["seconds"],
    }


def ours_name(s: dict) -> str:
    """`ours`, or `ours<tag>` for a variant (`--set tag="-b2"`): its run dir, drafters, logs and results."""
    return f"ours{s.get('tag', '')}"


def export_ours(work: Path, run: Path, step: int) -> Path:
    name = run.name.removeprefix("run-")  # a variant's own name: two runs side by side never share a log
    out = work / f"drafter-{name}-step{step}"
    sh(
        [sys.executable, "-m", "trainer.export", "--run-dir", str(run), "--step", str(step), "--out", str(out)],
        work / f"export-{name}-{step}.log",
    )
    return out


def phase_ours(work: Path, s: dict, log: Path) -> dict:
    """Train our drafter on the regenerated data as a user runs it, then export and measure each checkpoint."""
    import yaml

    cfg, name = our_config(work, s), ours_name(s)
    (work / f"{name}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    for stale in (f"run-{name}", *(p.name for p in work.glob(f"drafter-{name}-step*"))):
        shutil.rmtree(work / stale, ignore_errors=True)
    run = work / f"run-{name}"
    times = {}
    with PeakGpuMemory() as mem:
        times["train_s"] = sh(
            [sys.executable, "-m", "trainer.train", "--config", str(work / f"{name}.yaml"), "--run-dir", str(run)], log
        )
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if "event" not in r and "tokens_per_s" in r]
    gaps = sorted(b["time"] - a["time"] for a, b in zip(steps, steps[1:], strict=False) if b["step"] == a["step"] + 1)
    tail = steps[len(steps) // 2 :] or steps
    result = {
        "config": cfg,
        "times": times,
        "seed": cfg["seed"],
        "step_time_ms_median": round(1000 * gaps[len(gaps) // 2], 2) if gaps else None,  # eval steps excluded
        "tokens_per_s_median": sorted(r["tokens_per_s"] for r in tail)[len(tail) // 2] if tail else None,
        "peak_mem_gib_torch": max((r.get("peak_mem_gib") or 0 for r in steps), default=None),
        "peak_mem_mib_nvidia_smi": mem.peak_mib,
        "in_run_eval_at_end": [{"step": r["step"], "tau": r["tau"]} for r in records if r.get("event") == "eval"],
        "data": next((r for r in records if r.get("event") == "data"), None),
        "preflight": next((r for r in records if r.get("event") == "preflight"), None),
    }
    save_partial(work, name, result)
    marks = tau_steps(s, range(s["eval_every"], s["steps"] + 1, s["eval_every"]))
    with ThreadPoolExecutor(s.get("tau_workers")) as pool:  # checkpoints exported and measured side by side
        curve = pool.map(lambda k: curve_point(work, export_ours(work, run, k), k, s), marks)
        result["target_forward_ms"] = target_forward_ms(work, s)
        result["tau_vs_step"] = list(curve)
    return result


def tau_steps(s: dict, saved) -> list[int]:
    """The checkpoints whose tau is measured: every one saved, or those `tau_at` names (`--set tau_at=[1200]` for the
    final one alone: measuring tau, not training, is most of a pass's GPU time on a real target)."""
    saved = sorted(saved)
    wanted = s.get("tau_at")
    return saved if wanted is None else [k for k in saved if k in set(wanted)]


def save_partial(work: Path, phase: str, result: dict) -> None:
    """What a phase has so far, so that a pass cut short by its time limit still leaves its training numbers."""
    (work / f"{phase}.partial.json").write_text(json.dumps(result, indent=1, default=str) + "\n")


def phase_lookup(work: Path, s: dict, log: Path) -> dict:
    """Prompt lookup on the held-out prompts, `lookup_shards` processes side by side (each decodes one prompt at a
    time: the GPU waits on the host, so several share it well); per-prompt rows in lookup-prompts.jsonl."""
    n = s.get("lookup_shards", 1)
    cmd = [
        sys.executable,
        str(HERE / "prompt_lookup.py"),
        "--target",
        str(work / "target"),
        "--prompts",
        str(work / "prompts" / "heldout.jsonl"),
        "--limit",
        str(s["tau_prompts"]),
        "--max-new-tokens",
        str(s["tau_tokens"]),
        "--json",
    ]
    t0 = time.time()
    with ThreadPoolExecutor(n) as pool:
        list(
            pool.map(
                lambda k: sh(
                    [*cmd, "--shard", f"{k}/{n}", "--out", str(work / f"lookup-{k}.jsonl")], work / f"lookup-{k}.log"
                ),
                range(n),
            )
        )
    rows = sorted(
        (json.loads(x) for k in range(n) for x in (work / f"lookup-{k}.jsonl").read_text().splitlines() if x.strip()),
        key=lambda r: r["index"],
    )
    (work / "lookup-prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    measured = [r for r in rows if r["tau"] is not None]
    tokens, steps = sum(r["tokens"] for r in measured), sum(r["draft_steps"] for r in measured)
    return {
        "method": "prompt_lookup",
        "prompts": len(measured),
        "shards": n,
        "max_new_tokens": s["tau_tokens"],
        "tau_prompt_mean": round(sum(r["tau"] for r in measured) / max(len(measured), 1), 4),
        "tau_pooled": round(tokens / max(steps, 1), 4),
        "tokens": tokens,
        "draft_steps": steps,
        "wall_s": round(time.time() - t0, 1),
    }


def specforge_name(s: dict) -> str:
    """`specforge`, or `specforge<tag>` for another seed (`--set tag=-s1 --set seed=1`): its run, drafters, logs."""
    return f"specforge{s.get('tag', '')}"


def specforge_drafter(work: Path, ckpt: Path, run: Path, name: str) -> Path:
    """One of its checkpoints, through its own exporter, then into the public format."""
    step = ckpt.name.rsplit("-", 1)[1]
    hf, out = work / f"{name}-hf-{step}", work / f"drafter-{name}-{step}"
    if (out / "config.json").exists():  # exported already in this phase (stale ones are removed at its start)
        return out
    log = work / f"export-{name}-{step}.log"
    sh(
        [
            sys.executable,
            "-m",
            "specforge.export.to_hf",
            "--checkpoint",
            str(ckpt),
            "--draft-config",
            str(run / "draft_config.json"),
            "--output-dir",
            str(hf),
        ],
        log,
    )
    sh([sys.executable, str(HERE / "specforge_side.py"), "convert", "--checkpoint", str(hf), "--out", str(out)], log)
    return out


def ckpt_step(ckpt: Path) -> int:
    """The step of one of SpecForge's saved checkpoints (`...-stepN`)."""
    return int(ckpt.name.rsplit("step", 1)[1])


def specforge_curve_point(work: Path, ckpt: Path, run: Path, s: dict) -> dict:
    drafter = specforge_drafter(work, ckpt, run, specforge_name(s))
    return curve_point(work, drafter, ckpt_step(ckpt), s)


def phase_specforge(work: Path, s: dict, log: Path) -> dict:
    """SpecForge on the hidden states `features` dumped: the same steps, batch, anchors and drafter; tau at 4
    checkpoints, measured side by side (each is a small model; the GPU has room for all)."""
    name = specforge_name(s)
    run = work / f"run-{name}"
    for stale in [run, *work.glob(f"{name}-hf-*"), *work.glob(f"drafter-{name}-*")]:
        shutil.rmtree(stale, ignore_errors=True)
    sh(
        [
            sys.executable,
            str(HERE / "specforge_side.py"),
            "config",
            "--target",
            str(work / "target"),
            "--features",
            str(work / "features"),
            "--layers",
            str(s["layers"]),
            "--block",
            str(s["block"]),
            "--steps",
            str(s["steps"]),
            "--batch",
            str(s["batch"]),
            "--lr",
            str(s["lr"]),
            "--anchors",
            str(s["anchors"]),
            "--max-len",
            str(max(s["buckets"])),
            "--log-interval",
            "10",
            "--save-interval",
            str(s["eval_every"]),
            "--seed",
            str(s.get("seed", 0)),
            "--out",
            str(run),
        ],
        log,
    )
    sf_log = work / f"{name}-train.log"
    with PeakGpuMemory() as mem:
        train_s = sh([sys.executable, "-m", "specforge.cli", "train", "-c", str(run / "run.yaml")], sf_log)
    result = {
        "train_s": train_s,
        "seed": s.get("seed", 0),
        "peak_mem_mib_nvidia_smi": mem.peak_mib,
        **specforge_log_stats(sf_log),
    }
    save_partial(work, name, result)
    ckpts = sorted((run / "output").glob("*-step*"), key=ckpt_step)
    keep = set(tau_steps(s, map(ckpt_step, ckpts)))
    ckpts = [c for c in ckpts if ckpt_step(c) in keep]
    with ThreadPoolExecutor(s.get("tau_workers")) as pool:
        result["tau_vs_step"] = list(pool.map(lambda c: specforge_curve_point(work, c, run, s), ckpts))
    return {**result, "checkpoints": [str(c) for c in ckpts], "log_tail": sf_log.read_text()[-3000:]}


def specforge_rows(text: str) -> list[tuple[int, dict]]:
    """Its progress lines (`step N: {...}`, a Python dict) as (step, values); a line cut short is left out."""
    import ast
    import re

    rows = []
    for m in re.finditer(r"^step (\d+): (\{.*\})$", text, re.M):
        try:
            rows.append((int(m.group(1)), ast.literal_eval(m.group(2))))
        except (ValueError, SyntaxError):
            continue
    return rows


def specforge_log_stats(sf_log: Path) -> dict:
    """Its step time (median of the second half) and loss from its own progress lines (`step N: {...}`)."""
    rows = specforge_rows(sf_log.read_text())
    times = (
        sorted(
            r["train/perf/optimizer_step_time_s"]
            for k, r in rows
            if k > rows[-1][0] // 2 and "train/perf/optimizer_step_time_s" in r
        )
        if rows
        else []
    )
    return {
        "step_time_ms_median": round(1000 * times[len(times) // 2], 2) if times else None,
        "loss": [(k, round(r["train/loss"], 4)) for k, r in rows if "train/loss" in r][::5],
    }


def parse_sets(items: list[str]) -> dict:
    """`KEY=JSON` overrides; a value that is not JSON (a bare word whose quotes a shell ate) is the string itself."""
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/quality/run_quality.py", description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--phase", required=True, choices=["target", "data", "features", "ours", "specforge", "lookup"])
    ap.add_argument("--scale", choices=sorted(SCALES), default="gpu")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="override one scale setting (JSON, else a string)",
    )
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    s = {**SCALES[args.scale], **parse_sets(args.set)}
    phase = {"ours": ours_name(s), "specforge": specforge_name(s)}.get(args.phase, args.phase)
    log = args.work / f"{phase}.log"
    t0 = time.time()
    fn = {
        "target": phase_target,
        "data": phase_data,
        "features": phase_features,
        "ours": phase_ours,
        "specforge": phase_specforge,
        "lookup": phase_lookup,
    }[args.phase]
    result = {
        "phase": args.phase,
        "scale": args.scale,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        **fn(args.work, s, log),
        "phase_wall_s": None,
    }
    result["phase_wall_s"] = round(time.time() - t0, 1)
    (args.work / f"{phase}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(
        json.dumps(
            {k: v for k, v in result.items() if k not in ("log_tail", "config", "train_loss_history")}, default=str
        )[:3000]
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
