"""The training step, stage by stage, in one run of the trainer's own steps, adding up to the step's time.

The trainer's `forward_loss` takes a `mark` that is told where each stage ends, in stream order (the LM head and
loss backward end where the gradient reaches the drafter's output: a hook there). Here each mark records a CUDA event
(the host clock after a synchronize, on the CPU), so consecutive marks split the whole step on the device's stream
with nothing left over or counted twice; what the stream spends waiting for the host is inside the stage that waits.
Steps run back to back as the trainer runs them (its one wait a step, for its numbers); the time from a step's last
mark to the next step's first is `between_steps`, and the stages plus that gap are checked against the wall time.
A profiler pass over the same kind of steps then sorts the device's kernel time by what the kernels are (matmul,
attention, norms, RoPE, loss, optimizer, copies, other elementwise), cuts it into the same stages (a zero-cycle
separator kernel at each mark), and lists the longest stretches with no kernel running and what surrounds them.

    python bench/step_breakdown.py --device cpu        # the tiny preset: the arithmetic, not a speed
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STAGES = [
    "target_fwd",
    "embed_and_mask",
    "drafter_fwd",
    "lm_head_loss_fwd",
    "lm_head_loss_bwd",
    "drafter_bwd",
    "optimizer",
]
KERNEL_CLASSES = [  # first match wins: a kernel's name says what it computes (cuBLAS/cuDNN/CUTLASS, Inductor's names)
    ("attention", re.compile(r"flex_attention|flash|fmha|attention|sdpa", re.I)),
    ("matmul", re.compile(r"gemm|nvjet|xmma|cutlass|\bmm\b|_mm_|addmm|bmm|matmul|wgmma|sm90_", re.I)),
    ("norm", re.compile(r"rsqrt|rms_?norm|layer_?norm|_norm", re.I)),
    ("rope", re.compile(r"rotary|rope|_cos_|_sin_|^(?=.*_cat)(?=.*_neg)", re.I)),  # rotate_half: cat(-x2, x1)
    ("loss", re.compile(r"cross_entropy|log_softmax|logsumexp|nll|_ce_", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy_|cat\b|index", re.I)),
]


def kernel_class(name: str) -> str:
    """What a device kernel computes, from its name; `elementwise` for the rest (Inductor's fused pointwise and
    reduction kernels without a telling op in their name)."""
    for cls, pattern in KERNEL_CLASSES:
        if pattern.search(name):
            return cls
    return "elementwise"


class Timeline:
    """Stage ends in stream order: CUDA events on a GPU (read after one synchronize at the step's end), the host
    clock after a synchronize elsewhere. With `separators`, each mark also launches a spin kernel of zero cycles, so
    that a profile of the step can be cut into the same stages by the kernels' own start times (`stage_table`)."""

    def __init__(self, device, separators: bool = False) -> None:
        import torch

        self.torch, self.cuda = torch, device.type == "cuda"
        self.separators = separators and self.cuda
        self.names: list[str] = []
        self.points: list = []

    def start(self) -> None:
        self.names, self.points = [], []
        self("start")

    def __call__(self, name: str) -> None:
        if self.cuda:
            event = self.torch.cuda.Event(enable_timing=True)
            event.record()
            self.points.append(event)
            if self.separators:
                self.torch.cuda._sleep(0)
        else:
            self.points.append(time.perf_counter())
        self.names.append(name)

    def since_end_ms(self, later: Timeline) -> float:
        """Milliseconds from this timeline's last mark to `later`'s first: the time between two steps."""
        if self.cuda:
            self.torch.cuda.synchronize()
            return self.points[-1].elapsed_time(later.points[0])
        return 1e3 * (later.points[0] - self.points[-1])

    def spans_ms(self) -> dict[str, float]:
        """Each stage's milliseconds, from the mark before it to its own."""
        if self.cuda:
            self.torch.cuda.synchronize()
            gaps = [a.elapsed_time(b) for a, b in zip(self.points, self.points[1:], strict=False)]
        else:
            gaps = [1e3 * (b - a) for a, b in zip(self.points, self.points[1:], strict=False)]
        return dict(zip(self.names[1:], gaps, strict=True))


def trainer_step(parts, opt, batch, mark=None, fold_clip: bool = True) -> None:
    """The trainer's step (trainer/run/training.py `train_step`): forward_loss, backward, the clip folded into the
    fused AdamW (`fold_clip=False`, or an AdamW that is not fused, as on the CPU: clip_grad_norm_'s own scaling pass
    first), the update queued, and the host waiting, as the trainer does for the step's numbers, only until the
    gradient norm is done: the update runs while the host prepares the next step. `mark`, when given, is told where
    each stage ends."""
    import torch

    from trainer.run.build import forward_loss
    from trainer.run.update import clip_into_update

    loss_sum, w_sum, _ = forward_loss(parts, batch, mark=mark)
    (loss_sum / w_sum).backward()
    if mark:
        mark("drafter_bwd")
    if fold_clip and getattr(opt, "defaults", {}).get("fused"):
        clip_into_update(opt, parts.drafter.parameters(), parts.cfg.optim.grad_clip)
    else:
        opt.grad_scale = None
        torch.nn.utils.clip_grad_norm_(parts.drafter.parameters(), parts.cfg.optim.grad_clip)
    numbers = torch.cuda.Event() if parts.device.type == "cuda" else None
    if numbers is not None:
        numbers.record()
    opt.step()
    if mark:
        mark("optimizer")
    if numbers is not None:
        numbers.synchronize()  # the trainer's one wait a step: its numbers, copied before the update
    opt.zero_grad(set_to_none=True)


def run_steps(parts, opt, batches, timelines: list[Timeline] | None = None) -> float:
    """`batches` through the trainer's step back to back, as the trainer runs them (no wait between steps but the
    trainer's own); wall milliseconds per step, to the end of the last one on the device."""
    import torch

    cuda = parts.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i, batch in enumerate(batches):
        if timelines is not None:
            timelines[i].start()
        trainer_step(parts, opt, batch, timelines[i] if timelines is not None else None)
    if cuda:
        torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0) / len(batches)


def breakdown(
    parts, opt, batch_of, steps: int, flops: dict | None = None, ceiling_tflops: float | None = None, warmup: int = 2
) -> dict:
    """`steps` marked steps back to back (after `warmup`): each stage's median time, the device's time from one
    step's start to the next one's (`step_ms`, its median; `mean_step_ms`), the part of it between a step's update
    and the next step's first kernel (`between_steps_ms`: the host preparing the step), the wall time per step of the
    same run (`wall_step_ms`), whether the steps' stages and gaps add up to the wall time within 5 % (mean against
    mean: one slow step moves both), and each stage's FLOPs and fraction of the ceiling."""
    batches = [batch_of(i) for i in range(warmup + steps + 1)]
    run_steps(parts, opt, batches[:warmup])
    timelines = [Timeline(parts.device) for _ in range(steps + 1)]
    wall = run_steps(parts, opt, batches[warmup:], timelines)  # the last step only ends the last gap
    spans = [t.spans_ms() for t in timelines[:steps]]
    gaps = [timelines[i].since_end_ms(timelines[i + 1]) for i in range(steps)]
    totals = [sum(s.values()) + g for s, g in zip(spans, gaps, strict=True)]
    stage_ms = {k: statistics.median(s[k] for s in spans) for k in STAGES}
    step_ms, gap_ms = statistics.median(totals), statistics.median(gaps)
    mean_ms = statistics.fmean(totals)  # the wall time is a mean over the same steps: like with like
    out: dict = {
        "steps": steps,
        "step_ms": round(step_ms, 3),
        "stages_ms": {k: round(v, 3) for k, v in stage_ms.items()},
        "stages_sum_ms": round(sum(stage_ms.values()), 3),
        "between_steps_ms": round(gap_ms, 3),
        "mean_step_ms": round(mean_ms, 3),
        "wall_step_ms": round(wall, 3),
        "adds_up_within": round(abs(wall - mean_ms) / wall, 4),
        "adds_up": abs(wall - mean_ms) <= 0.05 * wall,
    }
    if flops:
        per_stage = stage_flops(flops)
        out["stage_tflop"] = {k: round(v / 1e12, 3) for k, v in per_stage.items()}
        if ceiling_tflops:
            out["stage_fraction_of_ceiling"] = {
                k: round(per_stage[k] / 1e12 / ceiling_tflops / (stage_ms[k] / 1e3), 3)
                for k in per_stage
                if stage_ms.get(k)
            }
            out["mfu"] = round(sum(per_stage.values()) / 1e12 / ceiling_tflops / (step_ms / 1e3), 4)
    return out


def stage_flops(flops: dict) -> dict[str, float]:
    """The step's counted FLOPs (bench/h200_perf.py `step_flops`) laid on the stages. The LM head's are all in its
    forward stage: the fused loss kernel (trainer/model/ce_kernel.py) computes the gradient there, and its backward
    only hands it on."""
    return {
        "target_fwd": flops.get("target_fwd", 0.0),
        "drafter_fwd": flops.get("drafter_fwd", 0.0),
        "lm_head_loss_fwd": flops.get("lm_head_loss", 0.0),
        "drafter_bwd": flops.get("drafter_bwd", 0.0),
    }


SEPARATOR = "spin_kernel"  # torch.cuda._sleep's kernel: a Timeline's mark in a profile


def trace_kernels(trace: dict) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of every kernel, copy and memset on the device in a Chrome trace (torch.profiler's
    export, the same format in every release), by start time."""
    device = ("kernel", "gpu_memcpy", "gpu_memset")
    rows = [
        (str(e.get("name", "")), float(e["ts"]), float(e.get("dur", 0.0)))
        for e in trace.get("traceEvents", [])
        if isinstance(e, dict) and e.get("ph") == "X" and e.get("cat") in device and "ts" in e
    ]
    return sorted(rows, key=lambda r: r[1])


def stage_table(kernels: list[tuple[str, float, float]], marks: list[str], steps: int) -> dict | None:
    """The device's time per step in each stage, by kernel class. `marks` are the Timeline's names in the order they
    were marked over all profiled steps; each launched one separator kernel, so the k-th separator is the k-th mark
    and a kernel belongs to the stage of the first separator after its start. A stage's `span_ms` runs from the end of
    the separator before it to the start of its own; `idle_ms` is the span less its kernels' time (below zero where
    kernels of two streams overlapped). `between_steps` runs from a step's last mark to the next step's start, and
    holds any kernel outside a step's marks. None when the separators do not match the marks (a profile that lost
    events)."""

    seps = [k for k in kernels if SEPARATOR in k[0]]
    if not marks or len(seps) != len(marks):
        return None
    starts = [k[1] for k in seps]
    table: dict[str, dict] = {}

    def row(stage: str) -> dict:
        return table.setdefault(stage, {"span_ms": 0.0, "busy_ms": 0.0, "classes": {}})

    for name, ts, dur in kernels:
        if SEPARATOR in name:
            continue
        r = row(_stage_at(starts, marks, ts))
        cls = kernel_class(name)
        r["classes"][cls] = r["classes"].get(cls, 0.0) + dur / 1e3 / steps
        r["busy_ms"] += dur / 1e3 / steps
    for i, stage in enumerate(marks):
        if i:
            span = (seps[i][1] - seps[i - 1][1] - seps[i - 1][2]) / 1e3 / steps
            row("between_steps" if stage == "start" else stage)["span_ms"] += span
    out = {}
    for stage, r in table.items():
        idle = r["span_ms"] - r["busy_ms"]
        classes = sorted(r["classes"].items(), key=lambda kv: -kv[1])
        out[stage] = {
            "span_ms": round(r["span_ms"], 3),
            "busy_ms": round(r["busy_ms"], 3),
            "idle_ms": round(idle, 3),
            "classes": {k: round(v, 3) for k, v in classes},
        }
    return out


def _stage_at(starts: list[float], marks: list[str], ts: float) -> str:
    """The stage a kernel starting at `ts` belongs to: that of the first separator after it."""
    i = bisect.bisect_right(starts, ts)
    return marks[i] if i < len(marks) and marks[i] != "start" else "between_steps"


def largest_gaps(kernels: list[tuple[str, float, float]], marks: list[str], n: int = 6) -> list[dict]:
    """The `n` longest stretches with nothing running on the device, each with its stage and the kernels on either
    side (a separator's name there is a stage's edge): where the device waited for the host."""
    seps = [k for k in kernels if SEPARATOR in k[0]]
    if not kernels or len(seps) != len(marks):
        return []
    starts = [k[1] for k in seps]
    gaps, end, before = [], None, None
    for name, ts, dur in sorted(kernels, key=lambda k: k[1]):
        if end is not None and ts > end:
            stage = _stage_at(starts, marks, ts)
            if SEPARATOR in name:  # the gap ends at a mark: it is the stage that mark ends
                mark = marks[bisect.bisect_left(starts, ts)]
                stage = "between_steps" if mark == "start" else mark
            gaps.append({"ms": round((ts - end) / 1e3, 3), "stage": stage, "after": before[:70], "before": name[:70]})
        if end is None or ts + dur > end:
            end, before = ts + dur, name
    return sorted(gaps, key=lambda g: -g["ms"])[:n]


def top_kernels(kernels: list[tuple[str, float, float]], steps: int, n: int = 12) -> list[tuple[str, str, float]]:
    """The `n` kernel names with the most device time per step: (class, name cut to 90 characters, ms)."""
    total: dict[str, float] = {}
    for name, _, dur in kernels:
        if SEPARATOR not in name:
            total[name] = total.get(name, 0.0) + dur / 1e3 / steps
    top = sorted(total.items(), key=lambda kv: -kv[1])[:n]
    return [(kernel_class(name), name[:90], round(ms, 3)) for name, ms in top]


def kernel_time(parts, opt, batch_of, steps: int = 3) -> dict:
    """Device time per step by kernel class (torch.profiler over `steps` marked steps back to back), the device's
    idle time (the wall time less every kernel's), the same cut into the step's stages (`stage_table`), and the
    kernels that take the most time."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    cuda = parts.device.type == "cuda"
    batches = [batch_of(i) for i in range(steps + 1)]
    run_steps(parts, opt, batches[:1])
    timelines = [Timeline(parts.device, separators=True) for _ in range(steps)]
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        wall = run_steps(parts, opt, batches[1:], timelines)
    marks = [name for t in timelines for name in t.names]
    kernels: list[tuple[str, float, float]] = []
    if cuda:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            prof.export_chrome_trace(f.name)
            kernels = trace_kernels(json.loads(Path(f.name).read_text()))
    classes: dict[str, float] = {}
    for name, _, dur in kernels:
        if SEPARATOR not in name:
            cls = kernel_class(name)
            classes[cls] = classes.get(cls, 0.0) + dur / 1e3 / steps
    busy = sum(classes.values())
    return {
        "kernel_ms": {k: round(v, 3) for k, v in sorted(classes.items(), key=lambda kv: -kv[1])},
        "busy_ms": round(busy, 3),
        "idle_ms": round(wall - busy, 3) if cuda else None,
        "by_stage": stage_table(kernels, marks, steps) if cuda else None,
        "top": top_kernels(kernels, steps) if cuda else None,
        "largest_gaps": largest_gaps(kernels, marks) if cuda else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/step_breakdown.py", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    import torch

    from trainer.config import from_dict
    from trainer.run.build import build, dummy_batch

    cfg = from_dict(
        {
            "target": {"random_preset": "tiny-qwen3", "dtype": "float32"},
            "drafter": {"num_layers": 2, "block_size": 8},
            "attention": {"backend": "dense"},
            "data": {"anchors_per_seq": 16, "seq_buckets": [256], "batch_size": 2, "synthetic_samples": 8},
            "device": args.device,
            "steps": 1,
        }
    )
    parts = build(cfg, device=torch.device(args.device))
    opt = torch.optim.AdamW(parts.drafter.parameters(), lr=1e-4, fused=args.device == "cuda")
    batch = dummy_batch(parts, 256)
    rep = breakdown(parts, opt, lambda i: batch, args.steps)
    print(json.dumps(rep, indent=1))
    if not rep["adds_up"]:  # the check the tests leave to this benchmark: on a busy machine steps vary
        print(
            f"the stages and gaps ({rep['mean_step_ms']} ms a step) do not add up to the wall time "
            f"({rep['wall_step_ms']} ms a step) within 5 %: another process took the CPU, or a stage is "
            "left out",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
