"""The quality benchmark's tau-versus-step curves, both trainers on one yardstick, from its results file.

python bench/quality/plot_quality.py bench/results/quality-h200.json docs/quality-tau-vs-step.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

LABELS = {
    "ours": "dflashctl trainer",
    "specforge": "SpecForge 0.2.0 (offline)",
    "ours-b2": "ours, betas (0.9, 0.999)",
    "ours-i2": "ours, init N(0, 0.02)",
    "ours-mix": "ours, lengths mixed in a batch",
}


def plot(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    # a pass with variants keeps its trainings under "runs"; earlier passes have "ours" and "specforge" at the top
    runs = results.get("runs") or {name: results[name] for name in ("ours", "specforge")}
    for name, run in runs.items():
        curve, ms = run["tau_vs_step"], run.get("step_time_ms_median")
        label = LABELS.get(name, name)
        ax.plot(
            [p["step"] for p in curve],
            [p["tau"] for p in curve],
            marker="o",
            label=f"{label}, {ms:.0f} ms/step" if ms else label,
        )
    lookup = results.get("prompt_lookup", {}).get("tau_prompt_mean")
    if lookup:
        ax.axhline(lookup, color="grey", linestyle="--", label=f"prompt lookup (no drafter): {lookup:.2f}")
    ax.axhline(1.0, color="lightgrey", linewidth=0.8)
    ax.set_xlabel("training step (batch 8, 64 anchors, block 16)")
    ax.set_ylabel("tau (mean of per-prompt means)")
    ax.set_title(results.get("yardstick", "bench_tau"), fontsize=8)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    plot(json.loads(Path(args[0]).read_text()), Path(args[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
