"""The real-target pass in one record: the target, every run's tau per checkpoint with its GPU seconds, the paired
comparison at the final step, the comparison at equal GPU seconds, and the plot.

    python bench/quality/collect_real.py WORK --out bench/results/quality-real.json --plot docs/quality-real.png

Reads what `run_quality.py --scale real` left in WORK: target.json, data.json, ours*.json, specforge*.json,
lookup.json and the per-prompt `tau-drafter-NAME-stepK.jsonl` files. GPU seconds of a run at step k are k times its
median step time, measured while the runs shared one GPU (the same load for both trainers, not each one alone).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from pair_taus import paired, per_prompt
from run_quality import specforge_rows

# a run's result file: `NAME-sK.json` (NAME `ours`, `specforge` or a "why" variant of ours such as `ours-i2`, K its
# seed), or `NAME-sK.partial.json` while its checkpoints are being measured
RUN_FILE = re.compile(r"((?:ours|specforge)(?:-[a-z0-9]+)*?)-s(\d+)(\.partial)?")


def measured_checkpoints(work: Path, name: str) -> list[dict]:
    """The checkpoints of a run cut short whose tau was measured before the cut (`tau-drafter-NAME-stepK.json`, as
    bench_tau wrote them): {step, tau, tau_pooled, prompts, decode_s}, by step."""
    out = []
    for f in work.glob(f"tau-drafter-{name}-step*.json"):
        step = f.stem.rsplit("-step", 1)[1]
        if not step.isdigit():
            continue
        r = json.loads(f.read_text())["sets"][0]
        out.append(
            {
                "step": int(step),
                "tau": r["tau_prompt_mean"],
                "tau_pooled": r["tau_pooled"],
                "prompts": r["prompts"],
                "decode_s": r["seconds"],
            }
        )
    return sorted(out, key=lambda p: p["step"])


def runs_of(work: Path) -> list[dict]:
    """One row per trainer, seed and measured checkpoint of every run: {trainer, seed, name, step, gpu_s, tau,
    tau_pooled}; a run cut short (only its `.partial.json`) gives the checkpoints measured before the cut."""
    rows = []
    for f in sorted(work.glob("*-s*.json")):
        m = RUN_FILE.fullmatch(f.stem)
        if not m:
            continue
        name = f"{m.group(1)}-s{m.group(2)}"
        if m.group(3) and (work / f"{name}.json").exists():
            continue
        r = json.loads(f.read_text())
        ms = r.get("step_time_ms_median")
        for p in measured_checkpoints(work, name) if m.group(3) else r.get("tau_vs_step", []):
            rows.append(
                {
                    "trainer": m.group(1),
                    "seed": int(m.group(2)),
                    "name": name,
                    "step": p["step"],
                    "gpu_s": round(p["step"] * ms / 1000, 1) if ms else None,
                    "tau": p["tau"],
                    "tau_pooled": p["tau_pooled"],
                    "step_ms": ms,
                    "prompts": p.get("prompts"),
                    "decode_s": p.get("decode_s"),
                    "cut_short": bool(m.group(3)),
                }
            )
    return rows


def lookup_of(work: Path) -> dict:
    """Prompt lookup's result: lookup.json, or, where the lookup phase was cut short, what its finished shards
    measured (`lookup-K.jsonl`; marked partial, with the prompts they cover). Writes lookup-prompts.jsonl then."""
    if (work / "lookup.json").exists():
        return json.loads((work / "lookup.json").read_text())
    rows = sorted(
        (
            json.loads(x)
            for f in sorted(work.glob("lookup-[0-9]*.jsonl"))
            for x in f.read_text().splitlines()
            if x.strip()
        ),
        key=lambda r: r["index"],
    )
    measured = [r for r in rows if r.get("tau") is not None]
    if not measured:
        return {}
    (work / "lookup-prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokens, steps = sum(r["tokens"] for r in measured), sum(r["draft_steps"] for r in measured)
    return {
        "method": "prompt_lookup",
        "partial": True,
        "prompts": len(measured),
        "shards_done": len(list(work.glob("lookup-[0-9]*.jsonl"))),
        "tau_prompt_mean": round(sum(r["tau"] for r in measured) / len(measured), 4),
        "tau_pooled": round(tokens / steps, 4),
    }


def training_of(work: Path) -> dict:
    """Each run's training as logged, whether or not its checkpoints were measured: step time under the shared load,
    and loss and accuracy on its own batches (mean of the last five logged steps). The losses compare (both weight
    block positions by exp(-(k-1)/gamma)); the accuracies do not: ours is weighted the same way, SpecForge's is not."""
    out = {}
    for f in sorted(work.glob("*-s*.json")):
        m = RUN_FILE.fullmatch(f.stem)
        if not m or (m.group(3) and (work / f"{m.group(1)}-s{m.group(2)}.json").exists()):
            continue
        name, r = f"{m.group(1)}-s{m.group(2)}", json.loads(f.read_text())
        if name.startswith("specforge"):
            text = (work / f"{name}-train.log").read_text() if (work / f"{name}-train.log").exists() else ""
            last = [
                (r["train/loss"], r["train/acc"])
                for _, r in specforge_rows(text)
                if "train/loss" in r and "train/acc" in r
            ][-5:]
        else:
            text = (work / f"{name}.log").read_text() if (work / f"{name}.log").exists() else ""
            last = [
                (float(a), float(b))
                for a, b in re.findall(r"^step \d+/\d+ .*?loss ([0-9.]+) acc ([0-9.]+)", text, re.M)
            ][-5:]
        out[name] = {
            "step_time_ms_median": r.get("step_time_ms_median"),
            "final_loss": round(statistics.fmean(x for x, _ in last), 4) if last else None,
            "final_acc": round(statistics.fmean(y for _, y in last), 4) if last else None,
            "in_run_eval_at_end": r.get("in_run_eval_at_end"),
            "measured": not m.group(3),
        }
    return out


def mean_over_seeds(rows: list[dict], trainer: str, step: int, key: str) -> tuple[float, float, int]:
    vals = [r[key] for r in rows if r["trainer"] == trainer and r["step"] == step]
    if not vals:
        return float("nan"), float("nan"), 0
    return statistics.fmean(vals), statistics.pstdev(vals) if len(vals) > 1 else 0.0, len(vals)


def seed_mean_per_prompt(work: Path, names: list[str], step: int) -> dict[int, float]:
    """Each prompt's tau averaged over the seeds' drafters (prompts every seed measured)."""
    tables = [per_prompt(work / f"tau-drafter-{n}-step{step}.jsonl") for n in names]
    keys = set.intersection(*(set(t) for t in tables)) if tables else set()
    return {k: statistics.fmean(t[k] for t in tables) for k in keys}


def interpolate(curve: list[tuple[float, float]], x: float) -> float | None:
    """tau at GPU seconds x on a (gpu_s, tau) curve, linear between checkpoints; None outside it."""
    curve = sorted(curve)
    for (x0, y0), (x1, y1) in zip(curve, curve[1:], strict=False):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1
    return curve[-1][1] if curve and x == curve[-1][0] else None


def curve(rows: list[dict], trainer: str, key: str = "tau") -> list[tuple[float, float]]:
    """(mean GPU seconds, mean `key` over seeds) at each measured step of one trainer."""
    steps = sorted({r["step"] for r in rows if r["trainer"] == trainer})
    return [
        (
            statistics.fmean(r["gpu_s"] for r in rows if r["trainer"] == trainer and r["step"] == s),
            mean_over_seeds(rows, trainer, s, key)[0],
        )
        for s in steps
    ]


def summarise(work: Path, rows: list[dict]) -> dict:
    """Per trainer at its own final step: tau over seeds; each of ours against SpecForge paired by prompt at their
    common final step and at equal GPU seconds; every trainer against prompt lookup paired by prompt."""
    trainers = sorted({r["trainer"] for r in rows})
    finals = {t: max(r["step"] for r in rows if r["trainer"] == t) for t in trainers}
    out: dict = {"final_step": finals}
    for t in trainers:
        tau, sd, n = mean_over_seeds(rows, t, finals[t], "tau")
        pooled, pooled_sd, _ = mean_over_seeds(rows, t, finals[t], "tau_pooled")
        at = [r for r in rows if r["trainer"] == t and r["step"] == finals[t]]
        ms = [r["step_ms"] for r in at if r["step_ms"]]
        out[t] = {
            "seeds": n,
            "step": finals[t],
            "tau_mean": round(tau, 4),
            "tau_sd": round(sd, 4),
            "tau_pooled_mean": round(pooled, 4),
            "tau_pooled_sd": round(pooled_sd, 4),
            "gpu_s_mean": _round(
                statistics.fmean(r["gpu_s"] for r in at if r["gpu_s"] is not None)
                if any(r["gpu_s"] is not None for r in at)
                else None
            ),
            "step_ms_median": round(statistics.median(ms), 2) if ms else None,
            "decode_s_max": max((r["decode_s"] for r in at if r.get("decode_s")), default=None),
        }
    lookup = lookup_of(work)
    out["lookup"] = {
        "tau_mean": lookup.get("tau_prompt_mean"),
        "tau_pooled": lookup.get("tau_pooled"),
        "prompts": lookup.get("prompts"),
        "partial": lookup.get("partial", False),
    }
    names = {t: sorted({r["name"] for r in rows if r["trainer"] == t}) for t in trainers}
    lookup_per = per_prompt(work / "lookup-prompts.jsonl") if (work / "lookup-prompts.jsonl").exists() else {}
    for t in trainers:
        if lookup.get("tau_pooled") is not None:
            out[t]["minus_lookup_pooled"] = round(out[t]["tau_pooled_mean"] - lookup["tau_pooled"], 4)
        if lookup_per:  # each prompt's tau (mean over seeds) against lookup's on the same prompt
            out[f"paired_{t}_minus_lookup"] = flip(
                paired(lookup_per, seed_mean_per_prompt(work, names[t], finals[t])), t, "lookup"
            )
    if "specforge" in trainers:
        sf_curve, sf_final = curve(rows, "specforge", "tau_pooled"), finals["specforge"]
        for t in trainers:
            if t == "specforge":
                continue
            common = min(finals[t], sf_final)
            a, b = seed_mean_per_prompt(work, names["specforge"], common), seed_mean_per_prompt(work, names[t], common)
            if a and b:  # paired by prompt at the same step, each prompt's tau a mean over seeds
                out[f"paired_{t}_minus_specforge"] = {"step": common, **flip(paired(a, b), t, "specforge")}
            ours_curve = curve(rows, t, "tau_pooled")
            if all(x is not None for c in (ours_curve, sf_curve) for x, _ in c) and sf_curve:
                # equal GPU seconds: this trainer's pooled tau where SpecForge's final step stands, and SpecForge's
                # where this trainer's final step stands (a curve starts at tau 1: no drafting gains nothing)
                sf_s, t_s = sf_curve[-1][0], ours_curve[-1][0]
                out[f"equal_gpu_s_{t}"] = {
                    "specforge_final_gpu_s": round(sf_s, 1),
                    "specforge_tau_pooled": round(sf_curve[-1][1], 4),
                    "tau_pooled_at_specforge_final": _round(interpolate([(0.0, 1.0), *ours_curve], sf_s)),
                    "final_gpu_s": round(t_s, 1),
                    "tau_pooled": round(ours_curve[-1][1], 4),
                    "specforge_tau_pooled_at_final": _round(interpolate([(0.0, 1.0), *sf_curve], t_s)),
                }
    return out


def flip(p: dict, b: str = "ours", a: str = "specforge") -> dict:
    """`paired(a_taus, b_taus)` reports b - a under names of its own: say which is which."""
    return {
        "prompts": p["prompts"],
        "mean": p["b_minus_a"],
        "bootstrap_95": p["bootstrap_95"],
        f"prompts_{b}_higher": p["prompts_b_higher"],
        f"prompts_{a}_higher": p["prompts_a_higher"],
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def plot(record: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), dpi=120, sharey=True)
    rows = record["runs"]
    labels = {
        "ours": "ours, SpecForge's answers",
        "specforge": "SpecForge 0.2.0",
        "ours-full": "ours, all answers",
        "ours-full-b4": "ours, all answers, 4 length buckets",
    }
    for k, trainer in enumerate(sorted({r["trainer"] for r in rows})):
        label, color = labels.get(trainer, trainer), f"C{k}"
        steps = sorted({r["step"] for r in rows if r["trainer"] == trainer})
        for ax, key in zip(axes, ("step", "gpu_s"), strict=True):
            xs, ys, lo, hi = [], [], [], []
            for s in steps:
                pts = [r for r in rows if r["trainer"] == trainer and r["step"] == s]
                xs.append(statistics.fmean(p[key] for p in pts))
                taus = [p["tau"] for p in pts]
                ys.append(statistics.fmean(taus))
                lo.append(min(taus))
                hi.append(max(taus))
            seeds = f"{len(pts)} seed" + ("s" if len(pts) > 1 else "")
            ax.plot(xs, ys, marker="o", color=color, label=f"{label} ({seeds})")
            ax.fill_between(xs, lo, hi, color=color, alpha=0.2)
    lk = record["summary"]["lookup"]
    lookup = lk.get("tau_mean")
    partial = f" ({lk.get('prompts')} prompts only)" if lk.get("partial") else ""
    for ax, xlabel in zip(axes, ("training step", "GPU seconds (step x median step time, GPU shared)"), strict=True):
        if lookup:
            ax.axhline(lookup, color="grey", linestyle="--", label=f"prompt lookup: {lookup:.2f}{partial}")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("tau (mean of per-prompt means)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"target: {record['target'].get('name')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    try:
        return collect(argv)
    except (OSError, ValueError, KeyError, TypeError) as e:  # a pass's file missing, cut short or not its shape
        where = getattr(e, "filename", None) or ""
        print(f"error: {where}{': ' if where else ''}{type(e).__name__}: {e}".splitlines()[0], file=sys.stderr)
        return 2


def collect(argv: list[str] | None) -> int:
    ap = argparse.ArgumentParser(prog="bench/quality/collect_real.py", description=__doc__.splitlines()[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--machine", default="one NVIDIA H200")
    ap.add_argument("--note", action="append", default=[], help="a line the record keeps (what was not measured)")
    args = ap.parse_args(argv)
    target = json.loads((args.work / "target.json").read_text())
    data = json.loads((args.work / "data.json").read_text()) if (args.work / "data.json").exists() else {}
    check = data.get("answer_check", {})
    rows, training = runs_of(args.work), training_of(args.work)
    if not rows and not training:
        print(f"error: {args.work}: no ours-sK.json or specforge-sK.json (nor their .partial.json)", file=sys.stderr)
        return 2
    lookup = lookup_of(args.work)
    record = {
        "date": data.get("date") or target.get("date"),
        "machine": args.machine,
        "target": {
            **target,
            "distinct_4gram": check.get("distinct_4gram_median"),
            "loop_fraction": check.get("loop_fraction"),
            "answers": check.get("answers"),
        },
        "runs": [
            {k: r[k] for k in ("trainer", "seed", "step", "gpu_s", "tau", "tau_pooled", "cut_short")} for r in rows
        ]
        + (
            [
                {
                    "trainer": "lookup",
                    "seed": None,
                    "step": 0,
                    "gpu_s": 0.0,
                    "tau": lookup["tau_prompt_mean"],
                    "tau_pooled": lookup["tau_pooled"],
                    "prompts": lookup.get("prompts"),
                    "cut_short": lookup.get("partial", False),
                }
            ]
            if lookup
            else []
        ),
    }
    record["training"] = training
    record["notes"] = args.note
    record["summary"] = summarise(args.work, rows) if rows else {"final_step": None, "note": "no checkpoint measured"}
    # ours read off its curve at SpecForge's final GPU seconds: the same-work runs first, else a run whose curve
    # reaches that far (named)
    eqs = [
        (k.removeprefix("equal_gpu_s_"), v)
        for k, v in sorted(record["summary"].items(), key=lambda kv: kv[0] != "equal_gpu_s_ours")
        if k.startswith("equal_gpu_s_")
    ]
    hit = next(((t, v) for t, v in eqs if v["tau_pooled_at_specforge_final"] is not None), None)
    record["ours_tau_pooled_at_sf_gpu_s"] = hit[1]["tau_pooled_at_specforge_final"] if hit else None
    record["ours_tau_pooled_at_sf_gpu_s_from"] = hit[0] if hit else None
    record["regeneration"] = data.get("engines")
    record["data"] = {k: data.get(k) for k in ("records", "empty_answers", "answer_chars_median", "regen_sha256")}
    features = args.work / "features.json"
    record["specforge_features"] = json.loads(features.read_text()) if features.exists() else None
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    if args.plot and rows:
        plot({**record, "runs": rows}, args.plot)
    print(json.dumps(record["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
