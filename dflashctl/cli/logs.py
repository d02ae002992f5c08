"""`dflashctl logs [JOB]`: the end of a job's train.log, followed in a terminal."""

from __future__ import annotations

import sys

import typer

from dflashctl.cli.app import AcceptNewOpt, Flag, JobArg, app, between, project
from dflashctl.errors import EXIT_FAILED


@app.command()
def logs(
    job: str | None = JobArg,
    lines: int = typer.Option(50, "-n", "--lines", metavar="N", help="How many of the last lines to print."),
    follow: bool | None = typer.Option(
        None,
        "--follow/--no-follow",
        "-f",
        show_default=False,
        help="Keep printing new lines until the job ends (the default in a terminal, "
        "as `sky logs` does; piped or with --json: the last lines only).",
    ),
    as_json: bool = Flag("--json", help='One {"id", "text"} object per chunk of the log.'),
    raw: bool = Flag("--raw", help="Pass terminal escape sequences through (default: shown, inert)."),
    node: str | None = typer.Option(
        None, "--node", metavar="NODE", help="A multi-node job's node (host name or number; default the head)."
    ),
    accept_new: bool = AcceptNewOpt,
) -> None:
    """Print the end of a job's train.log (everything the job printed)."""
    between("--lines", lines, 1, 1_000_000)
    if follow is None:
        follow = sys.stdout.isatty() and not as_json
    from dflashctl.jobs.find import find_job
    from dflashctl.jobs.logs import logs as read_logs
    from dflashctl.show.render import neutralise, out, print_json

    root_dir = project()
    if as_json:
        job_id = find_job(job, root_dir).id
        emit = lambda s: print_json({"id": job_id, "text": s})  # noqa: E731
    elif raw:
        emit = lambda s: (sys.stdout.write(s + "\n"), sys.stdout.flush())  # noqa: E731
    else:
        emit = lambda s: out.print(neutralise(s), markup=False)  # noqa: E731
    res = read_logs(job, root_dir, lines, follow, emit, accept_new=accept_new, node=node)
    if follow and res["exit_code"] not in (None, 0):
        raise typer.Exit(EXIT_FAILED)
