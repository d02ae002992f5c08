"""`dflashctl launch JOB.yaml`: start the job file's job on its host and record it."""

from __future__ import annotations

from pathlib import Path

import typer

from dflashctl.cli.app import AcceptNewOpt, Flag, JsonOpt, Named, app


@app.command()
def launch(
    job_file: Path = typer.Argument(..., metavar="JOB.yaml", help="A job file (jobs/*.yaml).", click_type=Named()),
    env: list[str] = typer.Option(
        [],
        "--env",
        "-e",
        metavar="KEY=VALUE",
        help="Set an environment variable of the job over the job file's (repeatable).",
    ),
    gpus: str | None = typer.Option(
        None,
        "--gpus",
        metavar="GPUS",
        help="The job's GPUs over the job file's: a count (2) or indices (0,1; one: 3,).",
    ),
    name: str | None = typer.Option(None, "--name", metavar="NAME", help="The job's name over the job file's."),
    host: str | None = typer.Option(
        None, "--host", metavar="HOST", help="The job's host over the job file's (a list: host-a,host-b)."
    ),
    queue: bool = Flag(
        "--queue",
        help="GPUs held by another job: wait on the host for them (QUEUED) and start when "
        "they free, instead of refusing.",
    ),
    no_sync: bool = Flag(
        "--no-sync",
        help="Run the host's deployed release; refuse when it is not the local tree "
        "(default: deploy the local tree first where it differs).",
    ),
    deploy_first: bool = Flag("--deploy", hidden=True, help="Deploy the local tree first (the default now)."),
    force: bool = Flag("--force", help="Launch even on GPUs held by another job or process."),
    dry_run: bool = Flag("--dry-run", help="Print the remote commands and files; change nothing."),
    as_json: bool = JsonOpt,
    accept_new: bool = AcceptNewOpt,
) -> None:
    """Start the job file's job in its own tmux session on its host (on a Slurm host: submit it with sbatch) and record
    it locally. Where the host's deployed code is not the local tree, deploy it first (only changed files, atomic,
    verified; `--no-sync` refuses instead)."""
    from dflashctl.config import find_project_root
    from dflashctl.errors import ConfigError
    from dflashctl.jobs.launch import launch as launch_job
    from dflashctl.jobs.overrides import Overrides
    from dflashctl.show import results
    from dflashctl.show.render import byte_progress, print_json

    if deploy_first and no_sync:
        raise ConfigError("--no-sync", None, "--deploy deploys the local tree first; --no-sync never does: not both")
    root_dir = find_project_root()
    options = Overrides(env=tuple(env), gpus=gpus, name=name, host=host)
    with byte_progress("deploy", not as_json) as progress:
        report = launch_job(
            Path(job_file),
            root_dir,
            sync=not no_sync,
            force=force,
            dry_run=dry_run,
            accept_new=accept_new,
            progress=progress,
            overrides=options,
            queue=queue,
        )
    if as_json:
        print_json(report.to_dict())
        return
    results.launched(report)
