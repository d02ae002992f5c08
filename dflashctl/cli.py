"""The `dflashctl` command line: thin commands that parse, call one library function and render the result.

Exit codes: 0 success; 1 a remote command or check failed; 2 bad input (config, host, host key, unreachable host).
`watch`, `status`, `diagnose` and a `kill` of an ended job exit with the state's code, from the one state table
(judge/facts.py: `dflashctl watch --help` lists them); 130 Ctrl-C.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from dflashctl.show.fast_start import defer_unused_rich

defer_unused_rich()  # before typer: its help module imports rich's Markdown and tracebacks, which this app never draws

import typer  # noqa: E402
from typer._click.types import IntParamType, StringParamType  # noqa: E402 - typer <0.29 vendors click

from dflashctl import __version__  # noqa: E402
from dflashctl.errors import EXIT_FAILED, EXIT_USAGE, DflashError  # noqa: E402
from dflashctl.judge.facts import exit_codes_help  # noqa: E402 - the state table: light, stdlib only

# Everything else is imported inside the command that needs it: `--help` and `ls` must not pay for paramiko.

app = typer.Typer(
    name="dflashctl",
    help="Deploy, launch, watch and kill DFlash drafter training jobs on remote GPU boxes.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)

_state = {"debug": False}


def Flag(*names: str, help: str, **kwargs) -> bool:  # noqa: N802 - reads like typer.Option at the call site
    """A boolean switch whose --help line shows no `<bool>` placeholder."""
    return typer.Option(False, *names, help=help, metavar=" ", show_default=False, **kwargs)

class _Named(StringParamType):
    """An argument shown in --help by its name alone (HOST, JOB), not with `<str>` beside it."""

    def get_metavar(self, param, ctx=None) -> str:
        return ""


class _NamedInt(IntParamType):
    def get_metavar(self, param, ctx=None) -> str:
        return ""


def _between(option: str, value: int | None, lo: int, hi: int) -> None:
    """A number option's bounds, checked here (typer would print them as `[1<=x<=1024]` in --help): one line, exit 2."""
    from dflashctl.errors import ConfigError

    if value is not None and not lo <= value <= hi:
        raise ConfigError(option, None, f"{value} is not between {lo} and {hi}")


def _complete_jobs(incomplete: str) -> list[str]:
    """Shell completion of job ids (from the local registry; nothing remote)."""
    try:
        from dflashctl.jobs import registry

        return [j.id for j in registry.all_jobs() if j.id.startswith(incomplete)]
    except Exception:
        return []


def _complete_hosts(incomplete: str) -> list[str]:
    try:
        from dflashctl.config import known_hosts

        return [h for h in ["local", *known_hosts()] if h.startswith(incomplete)]
    except Exception:
        return []


HostArg = typer.Argument(..., metavar="HOST", show_default=False, click_type=_Named(),
                         help="A host from dflashctl.yaml or hosts.yaml, `local`, user@host or ssh://host:port.",
                         autocompletion=_complete_hosts)  # fmt: skip
JsonOpt = Flag("--json", help="Print one compact JSON object on stdout and nothing else.")
AcceptNewOpt = Flag("--accept-new-host-key", help="Record an unknown host key in known_hosts (like ssh's accept-new)."
)


def _version(value: bool) -> None:
    if value:
        print(f"dflashctl {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    debug: bool = Flag("--debug", help="Show tracebacks for errors."),
    version: bool = Flag("--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """Deploy code into remote containers, launch the DFlash trainer in tmux, watch it, kill it cleanly."""
    _state["debug"] = debug


@app.command()
def deploy(
    host: str = HostArg,
    workdir: str | None = typer.Option(None, "--workdir", metavar="DIR",
                                       help="Remote root; the code goes to DIR/code."),
    dry_run: bool = Flag("--dry-run", help="List what would change; send nothing."),
    as_json: bool = JsonOpt,
    accept_new: bool = AcceptNewOpt,
) -> None:
    """Make the project's files (git-tracked, untracked-not-ignored) the current release on HOST, atomically."""
    from dflashctl.config import find_project_root, resolve_host
    from dflashctl.remote.connect import open_runner
    from dflashctl.remote.sync import deploy as deploy_tree
    from dflashctl.show.render import byte_progress, out, print_json

    root_dir = find_project_root()
    cfg = resolve_host(host, root_dir, workdir)
    with open_runner(cfg, accept_new) as runner, byte_progress(f"deploy → {cfg.name}", not as_json) as progress:
        report = deploy_tree(runner, root_dir, cfg.workdir, dry_run=dry_run, progress=progress)
    if as_json:
        print_json(report.to_dict())
        return
    if dry_run:
        for rel in report.sent:
            out.print(f"send    {rel}")
        for rel in report.deleted:
            out.print(f"delete  {rel}")
    verb = "would send" if dry_run else "sent"
    out.print(
        f"{cfg.name}: {verb} {report.files_sent} files ({report.bytes_sent / 1e6:.2f} MB), "
        f"deleted {report.files_deleted}, release {report.version} → {report.code_dir} in {report.seconds:.2f} s"
    )


@app.command()
def doctor(host: str = HostArg, as_json: bool = JsonOpt, accept_new: bool = AcceptNewOpt) -> None:
    """Check that HOST can run jobs: ssh, container, Python, torch, GPUs, tmux, rsync, disk, clock.

    A Slurm host: the login node, the scheduler's commands, the partition and account, and one short srun that a
    compute node sees the workdir and imports torch.

    Given a job file over several hosts, check every node, then that each reaches the head's rendezvous port and
    that all run the same torch and NCCL."""
    from rich.table import Table

    from dflashctl.config import find_project_root
    from dflashctl.jobs.jobctl import doctor_reports
    from dflashctl.show.render import out, print_json

    reports = doctor_reports(host, find_project_root(), accept_new)
    if as_json:
        # one schema: every report under `reports`, the first one's `host` and `checks` also at the top
        first = reports[0].to_dict()
        print_json({"ok": all(r.ok for r in reports), "host": first["host"], "checks": first["checks"],
                    "reports": [r.to_dict() for r in reports]})  # fmt: skip
    else:
        style = {"ok": "green", "warn": "yellow", "fail": "red"}
        for report in reports:
            table = Table(title=f"doctor: {report.host}", title_justify="left")
            for col in ("check", "verdict", "detail"):
                table.add_column(col)
            for c in report.checks:
                table.add_row(c.name, f"[{style[c.status]}]{c.status}[/]", c.detail)
            out.print(table)
    if not all(r.ok for r in reports):
        raise typer.Exit(EXIT_FAILED)


JobArg = typer.Argument(None, metavar="[JOB]", show_default=False, click_type=_Named(),
                        help="Job id, a prefix of it, or a job name; default: a job whose kill failed, else the newest "
                        "alive, else the newest of this project.",
                        autocompletion=_complete_jobs)  # fmt: skip
ProjectOpt = Flag("--all-projects", help="List jobs launched from any project.")


@app.command()
def launch(
    job_file: Path = typer.Argument(..., metavar="JOB.yaml", help="A job file (jobs/*.yaml).", click_type=_Named()),
    deploy_first: bool = Flag("--deploy", help="Deploy the local tree to the job's host first."),
    force: bool = Flag("--force", help="Launch even on GPUs held by another job or process."),
    dry_run: bool = Flag("--dry-run", help="Print the remote commands and files; change nothing."),
    as_json: bool = JsonOpt,
    accept_new: bool = AcceptNewOpt,
) -> None:
    """Start the job file's job in its own tmux session on its host (on a Slurm host: submit it with sbatch) and record
    it locally."""
    from dflashctl.config import find_project_root
    from dflashctl.jobs import jobctl
    from dflashctl.show.render import byte_progress, err, out, print_json

    root_dir = find_project_root()
    with byte_progress("deploy", not as_json) as progress:
        report = jobctl.launch(Path(job_file), root_dir, deploy_first=deploy_first, force=force, dry_run=dry_run,
                               accept_new=accept_new, progress=progress)  # fmt: skip
    if as_json:
        print_json(report.to_dict())
        return
    for what in report.overrides:
        err.print(f"[yellow]--force overrides:[/] {what}")
    if dry_run:
        out.print(f"[bold]would launch[/] {report.id} on {report.host} (release {report.release})")
        for cmd in report.remote_commands:
            out.print(f"remote: {cmd}", markup=False)
        for name, text in report.files.items():
            out.print(f"--- {report.run_dir}/{name}\n{text}", markup=False)
        return
    out.print(f"launched [bold]{report.id}[/] on {report.host}: pane pid {report.pane_pid}, run dir {report.run_dir}")
    out.print(f"next: dflashctl watch {report.id}   (or: dflashctl logs -f {report.id})")


@app.command()
def kill(
    job: str | None = JobArg,
    grace: float | None = typer.Option(None, "--grace", metavar="S",
                                       help="Seconds between SIGTERM and SIGKILL (job's default 40)."),
    yes: bool = Flag("--yes", "-y", help="With no JOB: stop the newest alive job without asking."),
    with_execs: bool = Flag("--all", help="Also end what `dflashctl exec` started for the job (a kill leaves it)."),
    as_json: bool = JsonOpt,
    accept_new: bool = AcceptNewOpt,
) -> None:
    """Stop a job: SIGTERM, wait, SIGKILL, verify that nothing of it is left.

    With no JOB: a job whose kill failed is retried at once; the newest alive job is stopped only after you confirm
    (or with --yes). A job that had already ended keeps its verdict, and the exit code is that state's."""
    from dflashctl.config import find_project_root
    from dflashctl.jobs import jobctl
    from dflashctl.judge.facts import EXIT_BY_STATE
    from dflashctl.show.render import err, out, print_json

    def confirm(record) -> bool:
        if yes:
            return True
        if not sys.stdin.isatty() or as_json:
            return False
        return typer.confirm(f"stop {record.id} on {record.host_name} (the newest alive job)?", default=False)

    if with_execs and job is None:
        from dflashctl.errors import ConfigError

        raise ConfigError("kill", "--all", "name the job whose exec'd processes to end")
    if with_execs:  # first: the job's own kill may find it already ended
        from dflashctl.jobs import execute

        ended = execute.end_execs(job, str(find_project_root()), accept_new=accept_new)
        err.print(f"exec'd processes of {ended['id']}: SIGTERM {ended['term']}, SIGKILL {ended['kill']}"
                  + (f", still there {ended['left']}" if ended["left"] else ""), markup=False)  # fmt: skip
    report = jobctl.kill(job, str(find_project_root()), grace, accept_new, confirm)
    if as_json:
        print_json(report.to_dict())
    elif report.verdict:
        v = report.verdict
        out.print(f"{report.id} had already ended (exit {report.ended_before}): {v['state']}: {v['reason']}; its "
                  "verdict is kept, and no watcher or supervisor will restart it", markup=False)  # fmt: skip
    elif report.clean:
        out.print(f"killed {report.id} on {report.host}: SIGTERM to {len(report.term)} processes {report.term}, "
                  f"SIGKILL to {len(report.kill)} {report.kill}")  # fmt: skip
        out.print(f"verified: no process of the job left, no GPU held by it ({report.gpu_check}), session closed")
    else:
        err.print(f"dflashctl: error: KILL_FAILED {report.id} on {report.host}: still there after SIGKILL: pids "
                  f"{report.remaining}, GPU holders {[a['pid'] for a in report.gpu_holders]} ({report.gpu_check}), "
                  f"session closed {report.session_closed}; `dflashctl kill` again retries this job", markup=False)
    if not report.clean:
        raise typer.Exit(EXIT_FAILED)
    if report.verdict:
        raise typer.Exit(EXIT_BY_STATE.get(report.verdict["state"], EXIT_FAILED))


@app.command()
def status(job: str | None = JobArg, as_json: bool = JsonOpt, accept_new: bool = AcceptNewOpt) -> None:
    """One look at a job: its state with the reason, the process, the last step.

    Default: a job whose kill failed, else the newest alive, else the newest (every command picks so). Exits with the
    state's code, as `watch --once` does."""
    from dflashctl.config import find_project_root
    from dflashctl.jobs import jobctl
    from dflashctl.judge.facts import EXIT_BY_STATE
    from dflashctl.show.render import err, out, print_json

    st = jobctl.status(job, str(find_project_root()), accept_new)
    code = EXIT_BY_STATE.get(st["state"], EXIT_FAILED)
    if as_json:
        print_json(st)  # the Report's schema (docs/cli-json.md)
        raise typer.Exit(code)
    if job is None:
        how = {"kill_failed": "whose kill failed", "live": "the newest alive", "newest": "the newest"}[st["picked"]]
        err.print(f"(no job given: {st['id']}, {how})")
    out.print(f"[bold]{st['state']}[/]: {st['reason']}", markup=True)
    if st["state"] == "UNREACHABLE":
        for line in st["evidence"]:
            out.print(f"  {line}", markup=False)
        raise typer.Exit(code)
    for line in st["evidence"]:
        if line.startswith(("warning:", "the job's supervisor")):
            out.print(f"  {line}", markup=False)
    if st["nodes"]:
        out.print("nodes: " + ", ".join(f"{n['host']} {n['state']}" for n in st["nodes"]), markup=False)
    up = f"up {st['uptime_s']:.0f} s" if st["uptime_s"] is not None else "ended"
    exit_code = f"exit code {st['exit_code']}" if st["exit_code"] is not None else "no exit code yet"
    out.print(f"[bold]{st['id']}[/] on {st['host']}: session {st['session']}, {exit_code}, {up}, "
              f"{st['processes']} processes, restarts {st['restarts']}")  # fmt: skip
    if isinstance(st["step"], int):
        from dflashctl.show.view import duration, rate

        if None not in (st["first_loss"], st["loss"]):
            loss = f", loss {st['first_loss']:.4f} → {st['loss']:.4f}"
        else:
            loss = f", loss {st['loss']:.4g}" if st["loss"] is not None else ""
        if st["mean_tokens_per_s"] is not None:
            tps = f", {st['mean_tokens_per_s']:,.0f} tok/s (mean)"
        else:  # a `command:` job's own throughput, in the unit it printed
            tps = f", {rate(st['throughput'], st['throughput_unit'])}" if st["throughput"] is not None else ""
        tau = f", tau {st['tau']:.3f} on {st['tau_set']}" if st["tau"] is not None else ""
        took = f" in {st['elapsed_s']:.0f} s" if st["elapsed_s"] is not None else ""
        eta = f", ETA {duration(st['eta_s'])}" if st["eta_s"] is not None else ""
        out.print(f"step {st['step']}{took}{loss}{tps}{tau}{eta}")
    ev = st["last_event"]
    if ev:
        fields = ", ".join(f"{k} {v}" for k, v in ev.items() if k not in ("event", "time", "config") and
                           isinstance(v, (int, float, str)))  # fmt: skip
        out.print(f"last event: {ev.get('event')}{': ' + fields if fields else ''}", markup=False)
    box = st.get("notices") or {}
    if box.get("waiting") or box.get("failed"):
        out.print(f"notices: {box.get('waiting', 0)} waiting, {box.get('failed', 0)} failed to deliver "
                  f"(`dflashctl notices {st['id']}`)", markup=False)  # fmt: skip
    out.print(f"run dir: {st['run_dir']}")
    raise typer.Exit(code)


@app.command()
def notices(job: str | None = JobArg, as_json: bool = JsonOpt, accept_new: bool = AcceptNewOpt) -> None:
    """Every notice of a job and its deliveries: when, by whom (the supervisor, or this laptop), the webhook's answer.

    One notice per event (a failure with what was done about it, the job's end), POSTed a bounded number of times
    whoever sends it; a redirect, a 4xx or POSTs spent is `failed`, a request sent but never answered `unconfirmed`."""
    from dflashctl.config import find_project_root
    from dflashctl.jobs import jobctl
    from dflashctl.show import notices as shown
    from dflashctl.show.render import print_json

    log = jobctl.notice_log(job, str(find_project_root()), accept_new)
    if as_json:
        print_json(log)
        return
    shown.render(log)


@app.command()
def report(
    jobs: list[str] | None = typer.Argument(None, metavar="[JOB]...", show_default=False, click_type=_Named(),
                                        help="Job ids or names (default: as for any command); several overlay",
                                            autocompletion=_complete_jobs),
    out_file: Path | None = typer.Option(None, "--out", "-o", metavar="FILE",
                                         help="Write FILE.png or FILE.html (needs matplotlib)."),
    as_json: bool = JsonOpt,
    accept_new: bool = AcceptNewOpt,
) -> None:
    """Draw a run's curves, running or finished (in the terminal, or --out FILE.png|.html).

    Loss and accuracy, tokens/s, tau with its prompt set, lr and grad norm by step; each GPU's util, memory and power
    by time; the preflight, restarts and verdicts marked. Several jobs overlay."""
    from dflashctl.config import find_project_root
    from dflashctl.errors import ConfigError
    from dflashctl.jobs import jobctl
    from dflashctl.show import report as reporting
    from dflashctl.show.render import err, out, print_json

    suffix = out_file.suffix.lower() if out_file else None
    if suffix not in (None, ".png", ".html"):
        raise ConfigError(str(out_file), "--out", "must end in .png or .html")
    if out_file is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigError(str(out_file), "--out", "drawing a file needs matplotlib: pip install "
                              "'dflashctl[report]'") from None  # fmt: skip
    got = jobctl.histories(list(jobs or []), str(find_project_root()), accept_new)
    runs = [reporting.series(job.id, hist) for job, hist in got]
    summaries = [reporting.summary(r, hist, len(job.gpus)) for r, (job, hist) in zip(runs, got, strict=True)]
    if out_file is not None:
        from dflashctl import outputs
        from dflashctl.show import plots

        reporting.check_out_file(out_file)
        try:
            (plots.write_png if suffix == ".png" else lambda r, p: plots.write_html(r, summaries, p))(runs, out_file)
        except OSError as e:
            raise ConfigError(str(out_file), "--out", f"cannot be written: {e.strerror or e}") from None
        mine = outputs.remember(find_project_root(), out_file)
        err.print(f"wrote {out_file}" + (" (dflashctl's own output: never deployed)" if mine else ""))
    if as_json:
        print_json({"jobs": summaries, "out": str(out_file) if out_file else None})
        return
    if out_file is None:
        from rich.text import Text

        from dflashctl.show import plots

        out.print(Text.from_ansi(plots.terminal(runs, min(80, out.width))))
    for s in summaries:
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
        out.print(f"{s['id']}: {steps} in {s['elapsed_s'] or 0:.0f} s, {loss}{tps}{tau}, restarts "
                  f"{s['restarts']}, {s['gpu_hours'] or 0:.2f} GPU-hours", markup=False, highlight=False)


@app.command()
def pull(
    job: str | None = JobArg,
    export: bool = Flag("--export", help="The drafter in the public DFlash format (RUN/export)."),
    checkpoint: str | None = typer.Option(None, "--checkpoint", metavar="latest|STEP",
                                          help="'latest' or a step number."),
    metrics: bool = Flag("--metrics", help="metrics.jsonl, gpu.jsonl, events.jsonl, train.log, job.json."),
    to: Path = typer.Option(Path("pulled"), "--to", metavar="DIR", help="Directory to pull into (as DIR/JOB-ID/...)."),
    chunk_mib: int = typer.Option(16, "--chunk-mib", metavar="MIB",
                                   help="Transfer size of one remote read, 1 to 1024."),
    as_json: bool = JsonOpt,
    accept_new: bool = AcceptNewOpt,
) -> None:
    """Bring a run's export, checkpoint or metrics back here: resumable, hash-verified.

    Over the job's own transport (through its container too), never a partial file under its final name. Default:
    the export, else the newest checkpoint."""
    from dflashctl.config import find_project_root
    from dflashctl.errors import ConfigError
    from dflashctl.jobs import jobctl
    from dflashctl.remote.pull import pull as pull_files
    from dflashctl.show.render import byte_progress, err, out, print_json

    _between("--chunk-mib", chunk_mib, 1, 1024)
    if checkpoint is not None and checkpoint != "latest" and not checkpoint.isdigit():
        raise ConfigError("--checkpoint", None, f"{checkpoint!r} is neither 'latest' nor a step number")
    select = {k: v for k, v in (("export", export), ("checkpoint", checkpoint), ("metrics", metrics)) if v}
    root = find_project_root()
    record = jobctl.find_job(job, str(root))
    with byte_progress(f"pull {record.id}", enabled=not as_json) as start_bar:
        report = pull_files(record, to, select, chunk_mib << 20, accept_new, start_bar, root)
    if as_json:
        from dataclasses import asdict

        print_json({"id": report.job, **asdict(report), "bytes_fetched": report.bytes_fetched})
        return
    for f in report.files:
        how = "already here" if f.skipped else (f"resumed at {f.resumed_from:,} B" if f.resumed_from else "fetched")
        out.print(f"{report.to}/{f.path}  {f.size:,} B  {how}", markup=False, highlight=False)
    err.print(f"pulled {', '.join(report.chose)} of {report.job} into "
              f"{report.to} ({report.bytes_fetched:,} bytes fetched, every file sha256-verified)")


@app.command("export")
def export_drafter(
    job: str | None = JobArg,
    to: Path = typer.Option(Path("pulled"), "--to", metavar="DIR", help="Directory to pull into (as DIR/JOB-ID/...)."),
    as_json: bool = JsonOpt,
    accept_new: bool = AcceptNewOpt,
) -> None:
    """Bring the trained drafter home in the public DFlash format (what vLLM, SGLang and llama.cpp load).

    The same as `pull --export`: RUN/export, written at the end of training (or by `python -m trainer.export` on the
    host); resumable and sha256-verified."""
    pull(job=job, export=True, checkpoint=None, metrics=False, to=to, chunk_mib=16, as_json=as_json,
         accept_new=accept_new)  # fmt: skip


@app.command()
def gc(
    host: str = HostArg,
    older_than: float = typer.Option(7.0, "--older-than", metavar="DAYS", help="Only jobs that ended this long ago."),
    all_projects: bool = Flag("--all-projects", help="Every project's run dirs on HOST, not only this project's."),
    dry_run: bool = Flag("--dry-run", help="List what would be removed; change nothing."),
    yes: bool = Flag("--yes", "-y", help="Remove without asking."),
    as_json: bool = JsonOpt,
    accept_new: bool = AcceptNewOpt,
) -> None:
    """Remove the run dirs of this project's jobs that ended on HOST (checkpoints, logs, exports), never a live job's.

    A run dir goes only when its job ended (an exit status or a kill's result), no session or supervisor of it runs,
    nothing in it changed for --older-than days and nothing is mounted inside it (that one is named and kept); `pull`
    first what you want to keep. Lists them and asks before removing (--yes skips; --dry-run only lists)."""
    from dflashctl.config import find_project_root
    from dflashctl.errors import ConfigError
    from dflashctl.jobs import jobctl
    from dflashctl.show.render import err, out, print_json

    jobctl.check_number("--older-than", older_than)
    root = find_project_root()
    plan = None
    if not dry_run and not yes:
        plan = jobctl.gc(host, root, older_than, True, accept_new, all_projects)
        if not plan["removed"]:
            dry_run = True  # nothing to remove: said below, nothing asked
        elif as_json or not sys.stdin.isatty():
            raise ConfigError("gc", None, f"{len(plan['removed'])} run dirs would be removed: pass --yes (or "
                              "--dry-run to list them)")  # fmt: skip
        else:
            for r in plan["removed"]:
                err.print(f"  {plan['workdir']}/runs/{r['id']}  {r['bytes'] / 2**20:,.1f} MiB", markup=False)
            n = len(plan["removed"])
            if not typer.confirm(f"remove the {n} run dir{'s' if n != 1 else ''} listed above on {host} ("
                                 f"{sum(r['bytes'] for r in plan['removed']) / 2**30:.2f} GiB)?", default=False):
                raise typer.Exit(1)
    confirmed = [r["id"] for r in plan["removed"]] if plan else None
    res = jobctl.gc(host, root, older_than, dry_run, accept_new, all_projects, only=confirmed)
    if as_json:
        print_json(res)
        return
    verb = "would remove" if dry_run else "removed"
    for r in res["removed"]:
        out.print(f"{verb} {res['workdir']}/runs/{r['id']}  {r['bytes'] / 2**20:,.1f} MiB", markup=False)
    for k in res["kept"]:
        if k["why"].startswith(("holds a mount point", "not removed")):
            err.print(f"kept {res['workdir']}/runs/{k['id']}: {k['why']}", markup=False)
    total = sum(r["bytes"] for r in res["removed"]) / 2**30
    err.print(f"{verb} {len(res['removed'])} run dirs ({total:.2f} GiB); kept {len(res['kept'])}")


@app.command("exec")
def exec_(
    target: str = typer.Argument(..., metavar="JOB", click_type=_Named(),
                                 help="A job (its host, release and environment), or with --host "
                                 "a host.", autocompletion=_complete_jobs),
    command: list[str] | None = typer.Argument(None, metavar="-- COMMAND...", show_default=False, click_type=_Named(),
                                               help="What to run, after `--`."),
    on_host: bool = Flag("--host", help="JOB names a host: run in its deployed code."),
    timeout: float | None = typer.Option(None, "--timeout", metavar="S",
                                         help="End the command and all it started (setsid'd ones too) after S "
                                         "seconds; exit 124."),
    as_json: bool = JsonOpt,
    accept_new: bool = AcceptNewOpt,
) -> None:
    """Run one command where a job runs (inside its container), in its release with its very environment.

    `dflashctl exec JOB -- nvidia-smi`, `dflashctl exec JOB -- 'ls | wc -l'` (one string: run by bash -c),
    `dflashctl exec --host box -- df -h`. A piped stdin is passed through. Exits with the command's status (128+N
    when a signal ended it, 124 when --timeout did). A restart or kill of the job leaves the command alone (`kill
    --all` takes it too). An ended job's secrets were scrubbed from its run dir: they are unset, and stderr says so."""
    from dflashctl.config import find_project_root
    from dflashctl.jobs import execute
    from dflashctl.show.render import print_json

    stdin = None if sys.stdin is None or sys.stdin.isatty() else sys.stdin.buffer
    res = execute.exec_command(target, list(command or []), find_project_root(), on_host, accept_new, timeout, stdin)
    if as_json:
        print_json(res)
    else:
        sys.stdout.write(res["stdout"])
        sys.stderr.write(res["stderr"])
    raise typer.Exit(res["exit"])


@app.command()
def shell(
    target: str = typer.Argument(..., metavar="JOB", click_type=_Named(), help="A job, or with --host a host.",
                                 autocompletion=_complete_jobs),
    on_host: bool = Flag("--host", help="JOB names a host: a shell in its deployed code."),
    dry_run: bool = Flag("--dry-run", help="Print the command instead of running it."),
) -> None:
    """Open a login shell where a job runs (inside its container), in its release with its environment."""
    import os
    import shlex

    from dflashctl.config import find_project_root
    from dflashctl.jobs import execute

    argv = execute.shell_argv(target, find_project_root(), on_host)
    if dry_run:
        print(shlex.join(argv))
        return
    os.execvp(argv[0], argv)


@app.command()
def tunnel(
    job: str = typer.Argument(..., metavar="JOB", click_type=_Named(),
                              help="Job id, a prefix of it, or a job name.",
                         autocompletion=_complete_jobs),
    port: int = typer.Argument(..., metavar="PORT", click_type=_NamedInt(),
                               help="The port on the job's machine (or container)."),
    local_port: int | None = typer.Option(None, "--local-port", metavar="PORT", help="Default: the same port."),
    tensorboard: bool = Flag("--tensorboard", help="Start TensorBoard on the run dir there first (needs it there)."),
    dry_run: bool = Flag("--dry-run", help="Print the ssh command and start nothing."),
    accept_new: bool = AcceptNewOpt,
) -> None:
    """Forward a port of the job's machine to localhost (through pct/docker containers too), until Ctrl-C or the
    job's end."""
    _between("PORT", port, 1, 65535)
    _between("--local-port", local_port, 1, 65535)
    from dflashctl.config import find_project_root
    from dflashctl.jobs import jobctl
    from dflashctl.remote.tunnel import forward
    from dflashctl.show.render import err, out

    record = jobctl.find_job(job, str(find_project_root()))
    code = forward(record, port, local_port or port, tensorboard, dry_run, accept_new,
                   say=lambda s: err.print(s, markup=False), show=lambda s: out.print(s, markup=False, highlight=False))
    if code != 0:
        raise typer.Exit(EXIT_FAILED)


@app.command("ls")
def list_jobs(
    all_projects: bool = ProjectOpt,
    state: list[str] | None = typer.Option(None, "--state", "-s", metavar="STATE",
                                          help="Only jobs in this state (repeat for several; `failed`: any failure)."),
    host: str | None = typer.Option(None, "--host", metavar="HOST", help="Only jobs on this host."),
    name: str | None = typer.Option(None, "--name", metavar="GLOB", help="Only jobs whose name matches (fnmatch)."),
    refresh: bool = Flag("--refresh", "-r", help="Ask the hosts again about every job not done for good (one "
                         "`status` each) before listing, as `sky queue` does."),
    forget: str | None = typer.Option(None, "--forget", metavar="JOB", help="Drop the record of an ended job, by "
                                      "name or id (its run dir is left as it is); lists nothing. The host is asked "
                                      "first: a job that may still run or restart is refused."),
    force: bool = Flag("--force", help="With --forget: forget the record even if the job may still run."),
    as_json: bool = JsonOpt,
    wide: bool = Flag("--wide", help="Every column, however wide the terminal."),
    accept_new: bool = AcceptNewOpt,
) -> None:
    """Jobs launched from this project, newest first: the state the last look gave (`status`, `watch`, or the
    hosts asked again with --refresh); a run dir removed by `gc` is REMOVED, with when and by whom."""
    from dflashctl.config import find_project_root
    from dflashctl.jobs import records, registry
    from dflashctl.show.render import err, out, print_json

    root = find_project_root()
    if forget is not None:
        gone = records.forget(forget, str(root), force, accept_new)
        if as_json:
            print_json({"forgotten": gone.id, "state": gone.state})
        else:
            err.print(f"forgot {gone.id} ({gone.state}); its run dir {gone.run_dir} on {gone.host_name} is untouched")
        return
    project = None if all_projects else str(root)
    jobs = registry.all_jobs(project)
    records.check_host(host, registry.all_jobs(), root)
    records.wanted_states(state)  # a bad --state is said before any host is asked
    if refresh:
        for job_id, why in records.refresh(records.filtered(jobs, None, host, name), str(root), accept_new).items():
            err.print(f"{job_id}: not asked again ({why}): its last state is shown")
        jobs = registry.all_jobs(project)
    listed = records.filtered(jobs, state, host, name)
    if as_json:
        print_json({"jobs": [{"id": j.id, "host": j.host_name, "state": j.state, "reason": j.reason,
                              "checked_at": j.checked_at, "launched_at": j.launched_at, "run_dir": j.run_dir,
                              "gpus": j.gpus, "slurm_job": j.slurm_job, "removed_at": j.removed_at,
                              "removed_by": j.removed_by, "progress": j.progress} for j in listed]})  # fmt: skip
        return
    if not listed:
        if jobs and (state or host or name):
            err.print("no job of this project matches (`dflashctl ls` lists them all)" if not all_projects else
                      "no job matches (`dflashctl ls --all-projects` lists them all)")  # fmt: skip
        elif not all_projects and registry.all_jobs():
            err.print("no jobs launched from this project; `dflashctl ls --all-projects` lists the others")
    jobs = listed
    now = time.time()
    def state(j) -> str:  # a queued Slurm job says why it waits: Slurm's reason; a removed one, who removed it
        if j.state == "REMOVED" and j.removed_at:
            return f"REMOVED {_ago(now - j.removed_at)} by {j.removed_by}"
        return f"PENDING: {j.reason.split(': ', 1)[-1]}" if j.state == "PENDING" and j.reason else j.state

    from dflashctl.show.view import progress_line

    rows = [(j.id, j.host_name, state(j), progress_line(j.progress), _ago(now - j.checked_at) if j.checked_at else "-",
             time.strftime("%Y-%m-%d %H:%M", time.localtime(j.launched_at)), ",".join(map(str, j.gpus)) or "-",
             j.run_dir) for j in jobs]  # fmt: skip
    cols = ("id", "host", "state", "progress", "seen", "launched", "gpus", "run dir")
    if not out.is_terminal:  # a pipe or a file: one plain line per job, tab-separated, every column
        for r in rows:
            sys.stdout.write("\t".join(r) + "\n")
        return
    from rich.table import Table

    keep = len(cols)
    if not wide:  # fit the terminal as `docker ps` does: drop the widest optional columns first, never wrap a cell
        widths = [max([len(c)] + [len(r[i]) for r in rows]) + 3 for i, c in enumerate(cols)]
        while keep > 3 and sum(widths[:keep]) > out.width:
            keep -= 1
    table = Table(title="jobs (states as last seen: `dflashctl ls --refresh` asks again)", title_justify="left")
    for col in cols[:keep]:
        table.add_column(col, no_wrap=True, overflow="ellipsis")
    for r in rows:
        table.add_row(*r[:keep])
    out.print(table)
    if keep < len(cols):
        err.print(f"({', '.join(cols[keep:])} left out at {out.width} columns: --wide shows them)")


@app.command()
def logs(
    job: str | None = JobArg,
    lines: int = typer.Option(50, "-n", "--lines", metavar="N", help="How many of the last lines to print."),
    follow: bool | None = typer.Option(None, "--follow/--no-follow", "-f", show_default=False,
                                       help="Keep printing new lines until the job ends (the default in a terminal, "
                                       "as `sky logs` does; piped or with --json: the last lines only)."),
    as_json: bool = Flag("--json", help='One {"id", "text"} object per chunk of the log.'),
    raw: bool = Flag("--raw", help="Pass terminal escape sequences through (default: shown, inert)."),
    node: str | None = typer.Option(None, "--node", metavar="NODE",
                                    help="A multi-node job's node (host name or number; default "
                                    "the head)."),
    accept_new: bool = AcceptNewOpt,
) -> None:
    """Print the end of a job's train.log (everything the job printed)."""
    _between("--lines", lines, 1, 1_000_000)
    if follow is None:
        follow = sys.stdout.isatty() and not as_json
    from dflashctl.config import find_project_root
    from dflashctl.jobs import jobctl
    from dflashctl.show.render import neutralise, out, print_json

    root_dir = str(find_project_root())
    if as_json:
        job_id = jobctl.find_job(job, root_dir).id
        emit = lambda s: print_json({"id": job_id, "text": s})  # noqa: E731
    elif raw:
        emit = lambda s: (sys.stdout.write(s + "\n"), sys.stdout.flush())  # noqa: E731
    else:
        emit = lambda s: out.print(neutralise(s), markup=False)  # noqa: E731
    res = jobctl.logs(job, root_dir, lines, follow, emit, accept_new=accept_new, node=node)
    if follow and res["exit_code"] not in (None, 0):
        raise typer.Exit(EXIT_FAILED)


WATCH_HELP = (
    "Follow a job: a verdict per poll (state, reason, evidence); restarts and notifications are the job's "
    "supervisor's, or this watch's where no supervisor answers.\n\n"
    "Stops at FINISHED or at a failure nobody will restart. Exit code by that state: "
    f"{exit_codes_help()}; 130 Ctrl-C. UNREACHABLE ends the watch after 10 minutes, unless --until-done. "
    "docs/watch.md lists every state with an example line."
)


@app.command(help=WATCH_HELP)
def watch(
    job: str | None = JobArg,
    interval: float | None = typer.Option(None, "--interval", metavar="S",
                                          help="Seconds between polls (default: the job's, 60)."),
    once: bool = Flag("--once", help="Poll once, print the verdict, exit with its code."),
    until_done: bool = Flag("--until-done", help="Never give up while the host is unreachable."),
    as_json: bool = Flag("--json", help="One verdict object per poll on stdout, nothing else."),
    accept_new: bool = AcceptNewOpt,
) -> None:
    """Follow a job: a verdict per poll (state, reason, evidence), restarts and notifications by its policy."""
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C (or kill -INT) ends it, even if started ignoring
    from dflashctl.config import find_project_root
    from dflashctl.jobs import jobctl
    from dflashctl.jobs import watch as watching
    from dflashctl.judge.facts import EXIT_BY_STATE
    from dflashctl.show import view
    from dflashctl.show.render import err, out, print_json

    job_rec = jobctl.find_job(job, str(find_project_root()))
    w = watching.make_watcher(job_rec, accept_new)
    opts = watching.WatchOptions(interval or w.cfg.interval_s, once=once, until_done=until_done)
    say = (
        (lambda s: err.print(s, markup=False, end="" if s == "\a" else "\n"))
        if not as_json
        else (lambda s: None if s == "\a" else err.print(s, markup=False))
    )
    try:
        if as_json:
            v = watching.run(w, opts, lambda _w, _v, rec: print_json(rec.to_dict()), say=say)
        elif not out.is_terminal:  # piped, tee'd, nohup: one plain line per poll, as it happens
            v = watching.run(w, opts, lambda _w, _v, rec: out.print(view.line(rec), markup=False), say=say)
        else:
            from rich.live import Live

            with Live(console=out, refresh_per_second=2, transient=False) as live:
                state = {"v": None}

                def emit(_w, v, _rec):
                    state["v"] = v
                    live.update(view.render(_w, v))

                def wait(seconds: float, _w) -> None:
                    end = time.monotonic() + seconds
                    while (left := end - time.monotonic()) > 0:
                        live.update(view.render(_w, state["v"], left))
                        time.sleep(min(1.0, left))

                v = watching.run(w, opts, emit, wait, say)
            out.line()
    except KeyboardInterrupt:
        err.print(f"stopped watching {job_rec.id}; the job keeps running")
        raise typer.Exit(130) from None
    raise typer.Exit(EXIT_BY_STATE.get(v.state, EXIT_FAILED))


@app.command()
def attach(
    job: str | None = JobArg,
    write: bool = Flag("--write", help="Attach read-write: your keys reach the job (Ctrl-C too)."),
    dry_run: bool = Flag("--dry-run", help="Print the command that would attach; run nothing."),
) -> None:
    """Open the job's tmux pane in this terminal, over ssh (read-only unless --write; detach with Ctrl-b d, or
    inside tmux with the prefix it names: Ctrl-a d where yours is Ctrl-b).

    A Slurm job: follow its train.log on the login node (Ctrl-C stops following), or with --write attach to its
    running step with sattach."""
    import os
    import shlex

    from dflashctl.config import find_project_root
    from dflashctl.jobs import execute, jobctl

    record = jobctl.find_job(job, str(find_project_root()))
    prefix = execute.view_prefix()
    argv = execute.attach_argv(record, write, prefix)
    if dry_run:
        print(shlex.join(argv))
        return
    hint = execute.view_hint(prefix) if record.scheduler == "tmux" else None
    if hint:
        sys.stderr.write(f"dflashctl: {hint}\n")
    os.execvp(argv[0], argv)


@app.command()
def diagnose(
    log_file: str = typer.Argument(..., metavar="LOG", click_type=_Named(),
                                   help="A log file (train.log, a tmux capture, a SLURM output; gzip'd or not), "
                                        "or - for stdin."),
    as_json: bool = Flag("--json", help="Print {state, reason, evidence, advice, exit} as JSON."),
) -> None:
    """Classify any training log with the same rules `watch` uses, and say what to do next.

    Reads through launcher prefixes (srun --label, torchrun's \\[rankN]:, mpirun's \\[1,N]<stdout>:, pdsh's host:,
    timestamps, progress bars) and judges the newest attempt. A log with no failure and no normal end is INCOMPLETE
    (exit 30), never an all-clear; a failure the run outlived before its normal end is a warning under FINISHED. Big
    logs are read from the tail in bounded memory; gzip'd logs and stdin are streamed in the same bound.
    """
    from dflashctl.judge.diagnosis import diagnose_lines
    from dflashctl.judge.facts import EXIT_BY_STATE
    from dflashctl.show.render import out, print_json

    v = diagnose_lines(_read_stdin() if log_file == "-" else _read_log(log_file))
    code = EXIT_BY_STATE.get(v.state, 0)
    if as_json:
        print_json({"state": v.state, "reason": v.reason, "evidence": v.evidence, "advice": v.advice, "exit": code})
    else:
        out.print(f"[bold]{v.state}[/]: {v.reason}")
        for line in v.evidence:
            out.print(f"  {line}", markup=False)
        if v.advice:
            out.print(f"next: {v.advice}", markup=False)
    raise typer.Exit(code)


def _ago(seconds: float) -> str:
    s = int(max(0, seconds))
    return f"{s}s ago" if s < 60 else (f"{s // 60}m ago" if s < 3600 else f"{s // 3600}h ago")


def _read_log(path: str) -> list[str]:
    from dflashctl.errors import ConfigError
    from dflashctl.logfile import LogFileError, read_log

    try:
        return read_log(path)
    except LogFileError as e:
        raise ConfigError(path, None, str(e)) from None


def _read_stdin() -> list[str]:
    from dflashctl.errors import ConfigError
    from dflashctl.logfile import LogFileError, read_stream

    try:
        return read_stream(sys.stdin.buffer)  # streamed, gzip'd or not: the memory bound of a file
    except LogFileError as e:
        raise ConfigError("-", None, str(e)) from None


def _reflow_help() -> None:
    """Docstrings are wrapped at 120 columns in the source; --help wraps them to the terminal. Each paragraph's
    lines are joined first, so no hard break leaves a ragged line (markdown mode would too, at the cost of
    importing a Markdown parser at every start)."""
    for info in app.registered_commands:
        doc = info.callback.__doc__ if info.callback else None
        if doc:
            paragraphs = [" ".join(ln.strip() for ln in p.strip().splitlines()) for p in doc.strip().split("\n\n")]
            info.callback.__doc__ = "\n\n".join(paragraphs)


_reflow_help()


# The verbs a SkyPilot user types (`sky queue`, `sky cancel`, `sky jobs`, `sky status -a`), answered with ours.
SKYPILOT_VERBS = {"queue": "ls", "jobs": "ls", "cancel": "kill"}


def skypilot_hint(args: list[str]) -> str | None:
    """A usage error that names our verb, where the command given is one of SkyPilot's."""
    words = [a for a in args if not a.startswith("-")]
    if not words:
        return None
    verb = words[0]
    if verb in SKYPILOT_VERBS:
        ours = SKYPILOT_VERBS[verb]
        return f"no command `{verb}` (SkyPilot's): did you mean `dflashctl {ours}`?"
    if verb == "status" and any(a in ("-a", "--all") for a in args):
        return "`status -a` is SkyPilot's: did you mean `dflashctl ls` (`ls --all-projects` for every project)?"
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point: one handler turns every typed error into a one-line message and its exit code. Under --json the
    same error is also printed on stdout as {"error", "exit"}, so a script never parses an empty answer."""
    args = sys.argv[1:] if argv is None else argv
    debug = _state["debug"] or "--debug" in args

    def fail(message: str, code: int) -> int:
        sys.stderr.write(f"dflashctl: error: {message}\n")
        if "--json" in args:
            sys.stdout.write(json.dumps({"error": message, "exit": code}) + "\n")
        return code

    hint = skypilot_hint(args)
    if hint:
        return fail(hint, EXIT_USAGE)
    try:
        rv = app(args=args, prog_name="dflashctl", standalone_mode=False)
        return rv if isinstance(rv, int) else 0
    except DflashError as e:
        if debug:
            raise
        if e.exit_code == 0:  # nothing to do: said, not an error
            sys.stderr.write(f"dflashctl: {e}\n")
            if "--json" in args:
                sys.stdout.write(json.dumps({"message": str(e), "exit": 0}) + "\n")
            return 0
        return fail(str(e), e.exit_code)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        kind = type(e).__name__
        if kind == "Exit":  # typer.Exit / click's, whichever click typer uses
            return int(getattr(e, "exit_code", 0) or 0)
        if kind == "NoArgsIsHelpError":  # a bare `dflashctl`: the help was asked for, in effect
            return 0
        if kind == "Abort":
            sys.stderr.write("aborted\n")
            return 130
        if hasattr(e, "format_message") and isinstance(getattr(e, "exit_code", None), int):
            # usage errors (unknown command or option, missing argument): click's own message, one line
            hint = " (see `dflashctl --help`)" if e.exit_code == EXIT_USAGE else ""
            return fail(e.format_message().replace("\n", " ") + hint, e.exit_code)
        if debug:
            raise
        return fail(f"internal error: {kind}: {e} (run with --debug for the traceback)", EXIT_FAILED)


def run() -> None:
    sys.exit(main())
