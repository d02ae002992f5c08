"""Drawing runs: a matplotlib figure (PNG, or SVG inside an HTML page) and a terminal version (plotext) in 80 columns.

Several runs overlay on the same axes, one colour each. Step panels mark resumes (dashed, at the step resumed from);
time panels shade each preflight and mark restarts and bad verdicts.
"""

from __future__ import annotations

import html
import io
import math
from pathlib import Path

from dflashctl.show.report import RunSeries, smooth

STEP_PANELS = [
    ("loss", "loss"),
    ("acc", "accuracy"),
    ("tokens_per_s", "tokens/s"),
    ("tau", "tau"),
    ("lr", "lr"),
    ("grad_norm", "grad norm"),
]
TIME_PANELS = [("util", "GPU util %"), ("mem_gib", "GPU memory GiB"), ("power_w", "GPU power W")]


def _pairs(xs, ys):
    pts = [(x, y) for x, y in zip(xs, ys, strict=False) if y is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def figure(runs: list[RunSeries]):
    """A 3 x 3 figure: six panels by step, three by time (minutes). matplotlib is imported here (an extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(3, 3, figsize=(15, 11), constrained_layout=True)
    flat = list(axes.flat)
    has_gpu = any(run.gpu for run in runs)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        c = colours[i % len(colours)]
        for ax, (key, title) in zip(flat[:6], STEP_PANELS, strict=True):
            ax.set_title(title)
            ax.set_xlabel("step")
            if key == "tau":
                for name in sorted({e[2] for e in run.evals}):
                    pts = [(e[0], e[1]) for e in run.evals if e[2] == name]
                    ax.plot(*zip(*pts, strict=True), marker="o", color=c, label=f"{run.job} ({name})")
            else:
                xs, ys = _pairs(run.steps, getattr(run, key))
                if key == "loss":
                    ax.plot(xs, ys, color=c, alpha=0.3, linewidth=0.8, label=f"{run.job} raw")
                    ax.plot(xs, smooth(ys), color=c, label=f"{run.job} smoothed")
                else:
                    ax.plot(xs, ys, color=c, label=run.job)
            for m in run.markers:
                if m.kind == "restart" and m.step is not None:
                    ax.axvline(m.step, color=c, linestyle="--", linewidth=1, label=m.label)
        for ax, (key, title) in zip(flat[6:], TIME_PANELS, strict=True):
            ax.set_title(title)
            ax.set_xlabel("minutes")
            if not has_gpu:  # a CPU run: say so, rather than empty panels shaded as preflight
                ax.text(
                    0.5,
                    0.5,
                    "no GPU history\n(a CPU run, or no NVML where it ran)",
                    ha="center",
                    va="center",
                    transform=ax.transAxes,
                    alpha=0.6,
                )
                continue
            for index, g in sorted(run.gpu.items()):
                xs, ys = _pairs([t / 60 for t in g["time"]], g[key])
                ax.plot(xs, ys, color=c, alpha=0.5 + 0.5 / (1 + index), linewidth=1, label=f"{run.job} gpu{index}")
            for a, b in run.preflight:
                ax.axvspan(a / 60, b / 60, color=c, alpha=0.12, label=f"{run.job} preflight")
            for m in run.markers:
                style = "--" if m.kind == "restart" else ":"
                ax.axvline(
                    m.time / 60, color="red" if m.kind == "verdict" else c, linestyle=style, linewidth=1, label=m.label
                )
    for i, ax in enumerate(flat):  # overlaid runs of other lengths: labels never collide; a step is whole
        ax.xaxis.set_major_locator(MaxNLocator(nbins=6, integer=i < len(STEP_PANELS)))
        handles, labels = ax.get_legend_handles_labels()
        if handles:
            seen = dict(zip(labels, handles, strict=True))  # one entry per label
            ax.legend(seen.values(), seen.keys(), fontsize=7, loc="best")
        ax.grid(alpha=0.3)
    fig.suptitle(" vs ".join(r.job for r in runs))
    return fig


def write_png(runs: list[RunSeries], path: Path) -> None:
    from dflashctl.safe_write import write_bytes

    fig = figure(runs)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    _close(fig)
    write_bytes(path, buf.getvalue(), "--out")


def write_html(runs: list[RunSeries], summaries: list[dict], path: Path) -> None:
    """One self-contained page: the summary table and the same figure as inline SVG."""
    fig = figure(runs)
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    _close(fig)
    keys = list(summaries[0]) if summaries else []
    head = "".join(f"<th>{html.escape(k)}</th>" for k in keys)
    rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(s.get(k)))}</td>" for k in keys) + "</tr>" for s in summaries
    )
    svg = buf.getvalue()
    svg = svg[svg.find("<svg") :]
    title = html.escape(" vs ".join(r.job for r in runs))
    style = "body{font-family:sans-serif}td,th{padding:2px 8px;border-bottom:1px solid #ddd}"
    page = f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title><style>{style}</style></head>"
    from dflashctl.safe_write import write_bytes

    body = page + f"<body><h1>{title}</h1><table><tr>{head}</tr>{rows}</table>{svg}</body></html>"
    write_bytes(path, body.encode("utf-8"), "--out")


def _close(fig) -> None:
    import matplotlib.pyplot as plt

    plt.close(fig)


def step_ticks(lo: float, hi: float, most: int = 5) -> list[int]:
    """Whole steps, 1-2-5 apart, at most `most` of them, for a step axis: plotext's own fall between steps (`249.5`)."""
    lo, hi = math.floor(lo), math.ceil(hi)
    for power in range(20):
        for m in (1, 2, 5):
            gap = m * 10**power
            first = -(-lo // gap) * gap
            if first > hi or (hi - first) // gap + 1 <= most:
                return list(range(first, hi + 1, gap)) or [lo]
    return [lo, hi]


def terminal(runs: list[RunSeries], width: int = 80) -> str:
    """Loss, tokens/s and GPU utilisation as text charts no wider than `width` columns."""
    import plotext as plt

    out = []
    panels = [("loss", "loss by step"), ("tokens_per_s", "tokens/s by step"), ("util", "GPU util % by minute")]
    for key, title in panels:
        plt.clear_figure()
        plt.theme("clear")
        plt.plotsize(width, 14)
        plt.title(title)
        drawn = False
        steps: list[int] = []
        for run in runs:
            if key == "util":
                for index, g in sorted(run.gpu.items()):
                    xs, ys = _pairs([t / 60 for t in g["time"]], g["util"])
                    if xs:
                        plt.plot(xs, ys, label=f"{run.job} gpu{index}", marker="braille")
                        drawn = True
            else:
                xs, ys = _pairs(run.steps, getattr(run, key))
                if xs:
                    plt.plot(xs, ys, label=run.job, marker="braille")
                    drawn = True
                    steps += [min(xs), max(xs)]
                    for m in run.markers:
                        if m.kind == "restart" and m.step is not None:
                            plt.vline(m.step)
        if steps:
            ticks = step_ticks(min(steps), max(steps))
            plt.xticks(ticks, [str(t) for t in ticks])
        if drawn:
            out.append(plt.build())
        else:
            out.append(f"{title}: no data" + (" (no GPU history: a CPU run)" if key == "util" else ""))
    return "\n".join(out)
