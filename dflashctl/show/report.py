"""What a run looks like as numbers: series and a summary from one `history` answer of the remote agent. Pure.

`plots.py` draws these; `--json` prints the summary. Nothing here trusts the files: a record of the wrong shape is
skipped (a list, a string loss, NaN), never fatal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dflashctl.judge.facts import QUIET

QUIET_STATES = (*QUIET, "FINISHED")  # verdicts not worth a line on a curve (the state table's `quiet`, and the end)


def check_out_file(path) -> None:
    """`report --out FILE`: a file in a folder that exists, not a folder itself (one-line errors, exit 2)."""
    import os
    from pathlib import Path

    from dflashctl.errors import ConfigError

    path = Path(path)
    if path.is_symlink():
        raise ConfigError(
            str(path),
            "--out",
            "is a symlink: refusing to write through it (its target may be someone's file); give the real path",
        )
    if path.is_dir():
        raise ConfigError(str(path), "--out", "is a folder: give FILE.png or FILE.html")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigError(str(path), "--out", f"the folder {parent} does not exist")
    if not os.access(parent, os.W_OK) or str(parent.resolve()).startswith(("/proc", "/sys")):
        raise ConfigError(str(path), "--out", f"cannot write into {parent}")


MAX_DRAWN = 1e15  # beyond this no curve means anything (and plotting libraries overflow): skipped and counted
MAX_STEP = 2**53


def _num(value) -> float | None:
    """A value to draw: a finite number of sane size (an int of 400 digits, 1e308 or NaN is not one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        v = float(value)
    except OverflowError:
        return None
    return v if math.isfinite(v) and abs(v) < MAX_DRAWN else None


def _extreme(value) -> bool:
    """A number that is there but cannot be drawn: too large (not NaN/inf: those are a divergence, named)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value)) and abs(float(value)) >= MAX_DRAWN
    except OverflowError:
        return True


@dataclass
class Marker:
    time: float  # seconds since the run's first record
    step: int | None  # the step it applies to (a resume: the step resumed from), when known
    label: str
    kind: str  # "restart" | "verdict"


@dataclass
class RunSeries:
    job: str
    steps: list[int] = field(default_factory=list)
    step_time: list[float] = field(default_factory=list)  # seconds since the first record
    loss: list[float | None] = field(default_factory=list)
    acc: list[float | None] = field(default_factory=list)
    tokens_per_s: list[float | None] = field(default_factory=list)
    lr: list[float | None] = field(default_factory=list)
    grad_norm: list[float | None] = field(default_factory=list)
    evals: list[tuple[int, float, str]] = field(default_factory=list)  # (step, tau, prompt set)
    preflight: list[tuple[float, float]] = field(default_factory=list)  # (start, end) seconds, one per attempt
    markers: list[Marker] = field(default_factory=list)
    gpu: dict[int, dict[str, list]] = field(default_factory=dict)  # index -> time, util, mem_gib, power_w
    malformed: int = 0
    nonfinite_steps: list[int] = field(default_factory=list)  # steps whose loss or grad norm was NaN/inf (skipped)


def smooth(values: list[float | None], weight: float = 0.9) -> list[float | None]:
    """TensorBoard's debiased exponential moving average (gaps stay gaps)."""
    out, last, n = [], 0.0, 0
    for v in values:
        if v is None:
            out.append(None)
            continue
        n += 1
        last = last * weight + (1 - weight) * v
        out.append(last / (1 - weight**n))
    return out


def series(job: str, hist: dict) -> RunSeries:
    """Curves of one run from the agent's `history` answer."""
    recs = [r for r in hist.get("metrics") or [] if isinstance(r, dict)]
    decisions = [r for r in hist.get("events") or [] if isinstance(r, dict)]
    samples = [r for r in hist.get("gpu") or [] if isinstance(r, dict)]
    starts = [t for t in (_num(r.get("time")) for r in recs if r.get("event") == "start") if t is not None]
    times = starts or [t for t in (_num(r.get("time")) for r in recs + decisions + samples) if t is not None]
    t0 = min(times) if times else 0.0  # the run's first start: a stray record's odd time cannot shift the axes
    s = RunSeries(job, malformed=sum(int(hist.get(k) or 0) for k in ("metrics_malformed", "gpu_malformed")))
    candidates = [r for r in recs if "event" not in r]
    steps = sorted(
        (
            r
            for r in candidates
            if isinstance(r.get("step"), int)
            and not isinstance(r["step"], bool)
            and 0 <= r["step"] < MAX_STEP
            and _num(r.get("time")) is not None
            and not any(_extreme(r.get(k)) for k in ("loss", "acc", "tokens_per_s", "lr", "grad_norm"))
        ),
        key=lambda r: r["time"],
    )
    s.malformed += len(candidates) - len(steps)  # no step, no time, or a value past drawing: skipped and counted
    for r in steps:
        s.steps.append(r["step"])
        s.step_time.append(r["time"] - t0)
        for name in ("loss", "acc", "tokens_per_s", "lr", "grad_norm"):
            getattr(s, name).append(_num(r.get(name)))
        if r.get("skipped") is True or any(
            isinstance(r.get(k), float) and not math.isfinite(r[k]) for k in ("loss", "grad_norm")
        ):
            s.nonfinite_steps.append(r["step"])
    if s.nonfinite_steps:
        first = s.nonfinite_steps[0]
        t = s.step_time[s.steps.index(first)]
        label = f"loss NaN/inf from step {first} ({len(s.nonfinite_steps)} steps)"
        s.markers.append(Marker(t, first, label, "verdict"))
    events = sorted((r for r in recs if "event" in r and _num(r.get("time")) is not None), key=lambda r: r["time"])
    start = None
    for r in events:
        t = r["time"] - t0
        if r["event"] == "start":
            start = t
            if isinstance(r.get("resumed_from"), int):
                s.markers.append(Marker(t, r["resumed_from"], f"resumed from {r['resumed_from']}", "restart"))
        elif r["event"] == "preflight" and start is not None:
            if s.preflight and s.preflight[-1][0] == start:  # every rank writes one: the span ends with the last
                s.preflight[-1] = (start, max(s.preflight[-1][1], t))
            else:
                s.preflight.append((start, t))
        elif r["event"] == "eval" and isinstance(r.get("step"), int) and _num(r.get("tau")) is not None:
            s.evals.append((r["step"], float(r["tau"]), str(r.get("prompt_set") or "holdout")[:40]))
    for d in decisions:
        t = _num(d.get("time"))
        if t is None:
            continue
        if d.get("decision") == "restart":
            label = f"restart {d.get('attempt', '')} after {d.get('after') or '?'}"
            s.markers.append(Marker(t - t0, None, label, "restart"))
        elif d.get("decision") == "state" and d.get("state") not in QUIET_STATES:
            s.markers.append(Marker(t - t0, None, str(d.get("state"))[:24], "verdict"))
    for sample in samples:
        t = _num(sample.get("time"))
        for g in sample.get("gpus") or []:
            if t is None or not isinstance(g, dict) or not isinstance(g.get("index"), int):
                continue
            row = s.gpu.setdefault(g["index"], {"time": [], "util": [], "mem_gib": [], "power_w": []})
            row["time"].append(t - t0)
            row["util"].append(_num(g.get("util_pct")))
            mem = _num(g.get("mem_used_mib"))
            row["mem_gib"].append(mem / 1024 if mem is not None else None)
            row["power_w"].append(_num(g.get("power_w")))
    s.markers.sort(key=lambda m: m.time)
    return s


def summary(s: RunSeries, hist: dict, gpus_asked: int) -> dict:
    """The numbers `report --json` gives (docs/cli-json.md)."""
    losses = [v for v in s.loss if v is not None]
    tps = [v for v in s.tokens_per_s if v is not None]
    best = max(s.evals, key=lambda e: e[1]) if s.evals else None
    times = [t for t in s.step_time] + [m.time for m in s.markers] + [p[1] for p in s.preflight]
    elapsed = max(times) if times else None
    gpus = len(s.gpu) or gpus_asked
    fig = hist.get("figures") if isinstance(hist.get("figures"), dict) else {}
    return {
        "id": s.job,  # the job's key, as `ls` and `status` name it
        "step": s.steps[-1] if s.steps else None,
        "step_records": hist.get("step_records", len(s.steps)),
        # the run's own numbers where the agent gave them (the same definition `status` shows), else from the series
        "elapsed_s": fig.get("elapsed_s", round(elapsed, 1) if elapsed is not None else None),
        "first_loss": fig.get("first_loss", losses[0] if losses else None),
        "loss": fig.get("last_loss", losses[-1] if losses else None),  # the newest, as `status` names it
        "min_loss": min(losses) if losses else None,
        "mean_tokens_per_s": fig.get("mean_tokens_per_s", round(sum(tps) / len(tps), 1) if tps else None),
        "best_tau": best[1] if best else None,
        "best_tau_step": best[0] if best else None,
        "best_tau_set": best[2] if best else None,
        "restarts": int(hist.get("restarts") or 0),
        "preflight_s": [round(b - a, 1) for a, b in s.preflight],
        "gpus": gpus,
        "gpu_hours": round(gpus * elapsed / 3600, 3) if elapsed is not None else None,
        "gpu_samples": sum(len(g["time"]) for g in s.gpu.values()),
        "exit_code": hist.get("exit_code"),
        "malformed_records": s.malformed,
        "nonfinite_steps": len(s.nonfinite_steps),
        "nonfinite_from_step": s.nonfinite_steps[0] if s.nonfinite_steps else None,
        "tau": s.evals[-1][1] if s.evals else None,  # the newest, as `status` gives it; best_tau beside it
    }
