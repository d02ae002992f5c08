"""`dflashctl watch [JOB]`: a verdict per poll, the live view in a terminal, a line per poll in a pipe, JSON."""

from __future__ import annotations

import time

import typer

from dflashctl.cli.app import AcceptNewOpt, Flag, JobArg, app, project
from dflashctl.errors import EXIT_FAILED
from dflashctl.judge.facts import exit_codes_help

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
    interval: float | None = typer.Option(
        None, "--interval", metavar="S", help="Seconds between polls (default: the job's, 60)."
    ),
    once: bool = Flag("--once", help="Poll once, print the verdict, exit with its code."),
    until_done: bool = Flag("--until-done", help="Never give up while the host is unreachable."),
    as_json: bool = Flag("--json", help="One verdict object per poll on stdout, nothing else."),
    accept_new: bool = AcceptNewOpt,
) -> None:
    """Follow a job: a verdict per poll (state, reason, evidence), restarts and notifications by its policy."""
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C (or kill -INT) ends it, even if started ignoring
    from dflashctl.jobs import watch as watching
    from dflashctl.jobs.find import find_job
    from dflashctl.judge.facts import EXIT_BY_STATE
    from dflashctl.show import view
    from dflashctl.show.render import err, out, print_json

    job_rec = find_job(job, project())
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
