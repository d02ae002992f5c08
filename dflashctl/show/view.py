"""The live view of `watch`: state and reason, progress, throughput sparkline, GPUs, the last log lines, next poll."""

from __future__ import annotations

import math
import time

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from dflashctl.jobs.poller import Watcher, sparkline
from dflashctl.judge.facts import COLOURS, QUIET, RUNNING_STATES  # the one state table
from dflashctl.judge.report import HERE, Report
from dflashctl.show.render import neutralise


def duration(s: float | None) -> str:
    """Seconds as `1h02m` or `3m05s`; `-` when unknown."""
    if s is None or not math.isfinite(s):
        return "-"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _figure(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def rate(value: float | None, unit: str | None) -> str:
    """A throughput in the unit it came in (`12,345 tokens/s`, `4.99 it/s`, `1.23 s/it`): never relabelled."""
    return "-" if value is None else f"{_figure(value)} {unit or 'tokens/s'}"


def throughput(r: Report) -> tuple[float | None, str]:
    """The report's throughput and its unit (a report that names none is the trainer's tokens/s)."""
    if r.throughput is not None:
        return r.throughput, r.throughput_unit or "tokens/s"
    return r.tokens_per_s, "tokens/s"


def progress_line(p: dict | None) -> str:
    """A record's last look as `ls` shows it: `step 450, loss 0.512, 15 it/s, ETA 0m36s`; `-` when it had none."""
    if not isinstance(p, dict) or p.get("step") is None:
        return "-"
    parts = [f"step {p['step']}"]
    if isinstance(p.get("loss"), (int, float)):
        parts.append(f"loss {p['loss']:.4g}")
    if isinstance(p.get("throughput"), (int, float)):
        parts.append(rate(p["throughput"], p.get("throughput_unit")))
    if isinstance(p.get("eta_s"), (int, float)):
        parts.append(f"ETA {duration(p['eta_s'])}")
    return ", ".join(parts)


def line(poll) -> str:
    """One poll as one line, for a watch whose output is not a terminal (a log file, a pipe)."""
    rec = poll.report
    when = time.strftime("%H:%M:%S", time.localtime(rec.time or time.time()))
    parts = [f"{when} {rec.id} {rec.state}: {rec.reason}"]
    if rec.step is not None and f"step {rec.step}" not in rec.reason:  # said once, not three times
        parts.append(f"step {rec.step}")
    live = rec.state in RUNNING_STATES
    value, unit = throughput(rec)
    if live and value is not None and not (unit == "tokens/s" and "tok/s" in rec.reason):
        parts.append(f"{rate(value, unit)} now")  # the newest poll's; the run's mean is `status`'s
    if live and rec.eta_s is not None:
        parts.append(f"ETA {duration(rec.eta_s)}")
    said_already = rec.reason + " ".join(parts)
    if rec.state not in (*QUIET, "FINISHED") and rec.evidence and rec.evidence[0] not in said_already:
        parts.append(f"evidence: {rec.evidence[0]}")
    said = [describe(e) for e in poll.events if e.get("decision") != "notify"]
    return neutralise(" | ".join(parts + said))


def describe(event: dict) -> str:
    """A watch decision in words: `restart 2 after CRASHED`, `not restarted after DISK_FULL: the disk is full`."""
    what = event.get("decision")
    if what == "restart":  # one done elsewhere says by whom, and its first evidence: this watch may not have seen it
        after = f" after {event['after']}" if isinstance(event.get("after"), str) else ""
        text = f"restarted (restart {event.get('attempt')}){after}"
        by, evidence = str(event.get("by") or ""), event.get("evidence")
        if by.startswith("elsewhere"):
            text += f" {by}" + (f": {evidence[0]}" if isinstance(evidence, list) and evidence else "")
        return text
    if what == "no_restart":
        return f"not restarted after {event.get('after')}: {event.get('why')}"
    if what == "warning":
        return f"warning: {event.get('warning')}"
    if what == "notify":
        return f"notified: {event.get('result')}"
    return str(what)


def render(w: Watcher, v: Report, next_poll_s: float | None = None, log_lines: int = 8) -> Panel:
    h = w.history
    colour = COLOURS.get(v.state, "bold red")
    head = Text.assemble((f" {v.state} ", f"reverse {colour}"), "  ", v.reason)
    stats = Table.grid(padding=(0, 2))
    for _ in range(4):
        stats.add_column()
    log = w.judge.job.log  # a command job's log as read (judge/progress.py): its total and its rates
    total = w.job.steps or log.progress.total
    step = f"{h.last_step if h.last_step is not None else '-'}" + (f" / {total}" if total else "")
    stats.add_row("step", step, "epoch", str(h.epoch if h.epoch is not None else "-"))
    value, unit = throughput(v)
    shown = _figure(value) if value is not None else "-"
    stats.add_row(neutralise(unit), shown, "trend", sparkline(w.tps_all if h.tokens_per_s else log.rates))
    loss = "-" if h.loss is None else f"{h.loss:.4f}" if abs(h.loss) >= 1e-3 else f"{h.loss:.3g}"  # 1e-05, not 0.0000
    stats.add_row("loss", loss, "ETA", duration(w.eta_s()))
    tau = f"{w.tau:.2f} on {neutralise(w.tau_set or 'holdout')}" if w.tau else "-"
    stats.add_row("restarts", f"{w.restarts} of {w.cfg.max_restarts}", "tau", tau)
    parts: list = [head, stats]
    if v.decided_by == HERE and v.supervisor is not None:  # the watch took over: said where the user looks
        parts.append(Text(neutralise(v.decided_why), style="bold yellow"))
    if v.state not in QUIET and v.evidence:
        parts.append(Text(neutralise("\n".join(v.evidence[:6])), style=colour))
        if v.advice:
            parts.append(Text(f"next: {v.advice}", style="italic"))
    if w.said:  # restarts, refused restarts, warnings: said where the user looks
        lines = [f"{time.strftime('%H:%M:%S', time.localtime(e['time']))} {describe(e)}" for e in w.said]
        parts.append(Text(neutralise("\n".join(lines)), style="bold"))
    if w.gpus:
        gpus = Table(box=None, padding=(0, 1), header_style="bold")
        for col in ("GPU", "util", "memory", "power", "temp", "SM MHz"):
            gpus.add_column(col, justify="right")
        for g in w.gpus:
            mem = f"{(g.get('mem_used_mib') or 0) / 1024:.1f}/{(g.get('mem_total_mib') or 0) / 1024:.0f} GiB"
            name = f"{neutralise(g['node'])}:{g.get('index')}" if g.get("node") else str(g.get("index"))
            gpus.add_row(
                name,
                f"{g.get('util_pct')}%",
                mem,
                f"{g.get('power_w')} W",
                f"{g.get('temp_c')} C",
                str(g.get("sm_mhz")),
            )
        parts.append(gpus)
    tail = [ln for ln in (h.log_tail or h.pane_lines) if ln.strip()][-log_lines:]
    if tail:
        parts.append(Text(neutralise("\n".join(tail)), style="dim"))
    foot = f"next poll in {next_poll_s:.0f} s" if next_poll_s is not None else ""
    title = f"{w.job.id} on {w.job.host_name}"
    return Panel(Group(*parts), title=title, subtitle=f"{foot}  Ctrl-C stops watching, not the job", title_align="left")
