"""`status` as a person reads it: the verdict, what the supervisor says, the session, the step, the notices."""

from __future__ import annotations

from dflashctl.jobs.status import StatusLook
from dflashctl.show.render import err, out
from dflashctl.show.view import duration, rate

PICKED = {"kill_failed": "whose kill failed", "live": "the newest alive", "newest": "the newest"}


def step_line(look: StatusLook) -> str | None:
    """`step 450 in 120 s, loss 3.2 → 1.1, 15,000 tok/s (mean), tau 2.1 on holdout, ETA 3m05s`; None before a step."""
    r = look.report
    if not isinstance(r.step, int):
        return None
    if None not in (look.first_loss, r.loss):
        loss = f", loss {look.first_loss:.4f} → {r.loss:.4f}"
    else:
        loss = f", loss {r.loss:.4g}" if r.loss is not None else ""
    if look.mean_tokens_per_s is not None:
        tps = f", {look.mean_tokens_per_s:,.0f} tok/s (mean)"
    else:  # a `command:` job's own throughput, in the unit it printed
        tps = f", {rate(r.throughput, r.throughput_unit)}" if r.throughput is not None else ""
    tau = f", tau {r.tau:.3f} on {r.tau_set}" if r.tau is not None else ""
    took = f" in {look.elapsed_s:.0f} s" if look.elapsed_s is not None else ""
    eta = f", ETA {duration(r.eta_s)}" if r.eta_s is not None else ""
    return f"step {r.step}{took}{loss}{tps}{tau}{eta}"


def render(look: StatusLook, given: bool) -> None:
    r = look.report
    if not given:
        err.print(f"(no job given: {r.id}, {PICKED[look.picked]})")
    out.print(f"[bold]{r.state}[/]: {r.reason}", markup=True)
    if r.state == "UNREACHABLE":
        for line in r.evidence:
            out.print(f"  {line}", markup=False)
        return
    for line in r.evidence:
        if line.startswith(("warning:", "the job's supervisor")):
            out.print(f"  {line}", markup=False)
    if look.nodes:
        out.print("nodes: " + ", ".join(f"{n['host']} {n['state']}" for n in look.nodes), markup=False)
    up = f"up {look.uptime_s:.0f} s" if look.uptime_s is not None else "ended"
    code = f"exit code {look.exit_code}" if look.exit_code is not None else "no exit code yet"
    out.print(
        f"[bold]{r.id}[/] on {r.host}: session {look.session}, {code}, {up}, {look.processes} processes, "
        f"restarts {r.restarts}"
    )
    step = step_line(look)
    if step:
        out.print(step)
    ev = look.last_event
    if ev:
        fields = ", ".join(
            f"{k} {v}"
            for k, v in ev.items()
            if k not in ("event", "time", "config") and isinstance(v, (int, float, str))
        )
        out.print(f"last event: {ev.get('event')}{': ' + fields if fields else ''}", markup=False)
    box = look.notices or {}
    if box.get("waiting") or box.get("failed"):
        out.print(
            f"notices: {box.get('waiting', 0)} waiting, {box.get('failed', 0)} failed to deliver "
            f"(`dflashctl notices {r.id}`)",
            markup=False,
        )
    out.print(f"run dir: {look.run_dir}")
