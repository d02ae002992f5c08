"""`dflashctl launch JOB.yaml`: start the job file's job on its host and record it."""

from __future__ import annotations

from pathlib import Path

import typer

from dflashctl.cli.app import AcceptNewOpt, Flag, JsonOpt, Named, app


@app.command()
def launch(
    job_file: Path = typer.Argument(..., metavar="JOB.yaml", help="A job file (jobs/*.yaml).", click_type=Named()),
    deploy_first: bool = Flag("--deploy", help="Deploy the local tree to the job's host first."),
    force: bool = Flag("--force", help="Launch even on GPUs held by another job or process."),
    dry_run: bool = Flag("--dry-run", help="Print the remote commands and files; change nothing."),
    as_json: bool = JsonOpt,
    accept_new: bool = AcceptNewOpt,
) -> None:
    """Start the job file's job in its own tmux session on its host (on a Slurm host: submit it with sbatch) and record
    it locally."""
    from dflashctl.config import find_project_root
    from dflashctl.jobs.launch import launch as launch_job
    from dflashctl.show import results
    from dflashctl.show.render import byte_progress, print_json

    root_dir = find_project_root()
    with byte_progress("deploy", not as_json) as progress:
        report = launch_job(Path(job_file), root_dir, deploy_first=deploy_first, force=force, dry_run=dry_run,
                            accept_new=accept_new, progress=progress)  # fmt: skip
    if as_json:
        print_json(report.to_dict())
        return
    results.launched(report)
