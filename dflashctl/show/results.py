"""The sentences of each command's result, as a person reads them (`--json` prints the result itself): deploy,
launch, kill, gc, pull, and a run's summary under `report`'s curves."""

from __future__ import annotations

from dflashctl.show.render import err, out


def deployed(report, host: str, dry_run: bool) -> None:
    if dry_run:
        for rel in report.sent:
            out.print(f"send    {rel}", markup=False)
        for rel in report.deleted:
            out.print(f"delete  {rel}", markup=False)
    verb = "would send" if dry_run else "sent"
    out.print(
        f"{host}: {verb} {report.files_sent} files ({report.bytes_sent / 1e6:.2f} MB), deleted "
        f"{report.files_deleted}, release {report.version} → {report.code_dir} in {report.seconds:.2f} s",
        markup=False,
    )


def launched(report) -> None:
    for what in report.overrides:
        err.print(f"[yellow]--force overrides:[/] {what}")
    for key, value in report.overridden.items():
        shown = " ".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else value
        err.print(f"--{key} over the job file: {shown}", markup=False)
    verb = "would send" if report.dry_run else "sent"
    for d in report.deployed:  # the host's code was not the local tree: what the launch's deploy sent first
        err.print(
            f"{d['host']}: deployed code differed from the local tree: {verb} {d['files_sent']} files "
            f"({d['bytes_sent'] / 1e6:.2f} MB), deleted {d['files_deleted']}, release {d['version']}"
            + (f": {', '.join(d['sent'][:5])}{' ...' if len(d['sent']) > 5 else ''}" if d["sent"] else ""),
            markup=False,
        )
    q = report.queued
    if report.dry_run:
        out.print(
            f"[bold]would {'queue' if q else 'launch'}[/] {report.id} on {report.host} (release "
            f"{report.release})" + (f": waiting for {'; '.join(q['waiting_for'])}" if q else "")
        )
        for cmd in report.remote_commands:
            out.print(f"remote: {cmd}", markup=False)
        for name, text in report.files.items():
            out.print(f"--- {report.run_dir}/{name}\n{text}", markup=False)
        return
    if q:
        out.print(
            f"queued [bold]{report.id}[/] on {report.host}: place {q['position']} in the host's queue, waiting "
            f"for {'; '.join(q['waiting_for'])}; it starts by itself when they free (`dflashctl kill "
            f"{report.id}` takes it out); run dir {report.run_dir}"
        )
    else:
        out.print(
            f"launched [bold]{report.id}[/] on {report.host}: pane pid {report.pane_pid}, run dir {report.run_dir}"
        )
    out.print(f"next: dflashctl watch {report.id}   (or: dflashctl logs -f {report.id})")


def killed(report) -> None:
    if report.verdict:
        v = report.verdict
        out.print(
            f"{report.id} had already ended (exit {report.ended_before}): {v['state']}: {v['reason']}; its "
            "verdict is kept, and no watcher or supervisor will restart it",
            markup=False,
        )
    elif report.clean and report.dequeued and not report.term:
        out.print(
            f"took {report.id} out of the queue on {report.host}: it never started; nothing of it is left", markup=False
        )
    elif report.clean:
        out.print(
            f"killed {report.id} on {report.host}: SIGTERM to {len(report.term)} processes {report.term}, "
            f"SIGKILL to {len(report.kill)} {report.kill}"
        )
        out.print(f"verified: no process of the job left, no GPU held by it ({report.gpu_check}), session closed")
    else:
        err.print(
            f"dflashctl: error: KILL_FAILED {report.id} on {report.host}: still there after SIGKILL: pids "
            f"{report.remaining}, GPU holders {[a['pid'] for a in report.gpu_holders]} ({report.gpu_check}), "
            f"session closed {report.session_closed}; `dflashctl kill` again retries this job",
            markup=False,
        )


def execs_ended(ended: dict) -> None:
    err.print(
        f"exec'd processes of {ended['id']}: SIGTERM {ended['term']}, SIGKILL {ended['kill']}"
        + (f", still there {ended['left']}" if ended["left"] else ""),
        markup=False,
    )


def gc_plan(plan: dict) -> None:
    for r in plan["removed"]:
        err.print(f"  {plan['workdir']}/runs/{r['id']}  {r['bytes'] / 2**20:,.1f} MiB", markup=False)


def gc_done(res: dict, dry_run: bool) -> None:
    verb = "would remove" if dry_run else "removed"
    for r in res["removed"]:
        out.print(f"{verb} {res['workdir']}/runs/{r['id']}  {r['bytes'] / 2**20:,.1f} MiB", markup=False)
    for k in res["kept"]:
        if k["why"].startswith(("holds a mount point", "not removed")):
            err.print(f"kept {res['workdir']}/runs/{k['id']}: {k['why']}", markup=False)
    total = sum(r["bytes"] for r in res["removed"]) / 2**30
    err.print(f"{verb} {len(res['removed'])} run dirs ({total:.2f} GiB); kept {len(res['kept'])}")


def pulled(report) -> None:
    for f in report.files:
        how = "already here" if f.skipped else (f"resumed at {f.resumed_from:,} B" if f.resumed_from else "fetched")
        out.print(f"{report.to}/{f.path}  {f.size:,} B  {how}", markup=False, highlight=False)
    err.print(
        f"pulled {', '.join(report.chose)} of {report.job} into "
        f"{report.to} ({report.bytes_fetched:,} bytes fetched, every file sha256-verified)"
    )


def run_summary(s: dict) -> str:
    """One run under `report`'s curves: steps, time, loss, throughput, best tau, restarts, GPU-hours."""
    loss = "no step yet" if s["step"] is not None else "no step records"
    if s["loss"] is not None:
        loss = f"loss {s['first_loss']:.4f} → {s['loss']:.4f} (min {s['min_loss']:.4f})"
    if s["nonfinite_steps"]:
        loss += f", NaN/inf from step {s['nonfinite_from_step']} ({s['nonfinite_steps']} steps)"
    if s["malformed_records"]:
        loss += f", {s['malformed_records']} records skipped"
    tau = f", best tau {s['best_tau']:.2f} on {s['best_tau_set']}" if s["best_tau"] is not None else ""
    tps = f", {s['mean_tokens_per_s']:,.0f} tok/s" if s["mean_tokens_per_s"] else ""
    steps = f"{s['step']} steps" if s["step"] is not None else "no steps (a command job)"
    return (
        f"{s['id']}: {steps} in {s['elapsed_s'] or 0:.0f} s, {loss}{tps}{tau}, restarts {s['restarts']}, "
        f"{s['gpu_hours'] or 0:.2f} GPU-hours"
    )


def doctor_tables(reports: list) -> None:
    from rich.table import Table

    style = {"ok": "green", "warn": "yellow", "fail": "red"}
    for report in reports:
        table = Table(title=f"doctor: {report.host}", title_justify="left")
        for col in ("check", "verdict", "detail"):
            table.add_column(col)
        for c in report.checks:
            table.add_row(c.name, f"[{style[c.status]}]{c.status}[/]", c.detail)
        out.print(table)
