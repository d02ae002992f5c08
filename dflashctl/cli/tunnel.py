"""`dflashctl tunnel JOB PORT`: a port of the job's machine (or container) on localhost."""

from __future__ import annotations

import typer

from dflashctl.cli.app import AcceptNewOpt, Flag, Named, NamedInt, app, between, complete_jobs, project
from dflashctl.errors import EXIT_FAILED


@app.command()
def tunnel(
    job: str = typer.Argument(
        ...,
        metavar="JOB",
        click_type=Named(),
        help="Job id, a prefix of it, or a job name.",
        autocompletion=complete_jobs,
    ),
    port: int = typer.Argument(
        ..., metavar="PORT", click_type=NamedInt(), help="The port on the job's machine (or container)."
    ),
    local_port: int | None = typer.Option(None, "--local-port", metavar="PORT", help="Default: the same port."),
    tensorboard: bool = Flag("--tensorboard", help="Start TensorBoard on the run dir there first (needs it there)."),
    dry_run: bool = Flag("--dry-run", help="Print the ssh command and start nothing."),
    accept_new: bool = AcceptNewOpt,
) -> None:
    """Forward a port of the job's machine to localhost (through pct/docker containers too), until Ctrl-C or the
    job's end."""
    between("PORT", port, 1, 65535)
    between("--local-port", local_port, 1, 65535)
    from dflashctl.jobs.find import find_job
    from dflashctl.remote.tunnel import forward
    from dflashctl.show.render import err, out

    record = find_job(job, project())
    code = forward(
        record,
        port,
        local_port or port,
        tensorboard,
        dry_run,
        accept_new,
        say=lambda s: err.print(s, markup=False),
        show=lambda s: out.print(s, markup=False, highlight=False),
    )
    if code != 0:
        raise typer.Exit(EXIT_FAILED)
