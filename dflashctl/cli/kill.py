"""`dflashctl kill [JOB]`: stop a job and verify that nothing of it is left."""

from __future__ import annotations

import sys

import typer

from dflashctl.cli.app import AcceptNewOpt, Flag, JobArg, JsonOpt, app, project
from dflashctl.errors import EXIT_FAILED


@app.command()
def kill(
    job: str | None = JobArg,
    grace: float | None = typer.Option(
        None, "--grace", metavar="S", help="Seconds between SIGTERM and SIGKILL (job's default 40)."
    ),
    yes: bool = Flag("--yes", "-y", help="With no JOB: stop the newest alive job without asking."),
    with_execs: bool = Flag("--all", help="Also end what `dflashctl exec` started for the job (a kill leaves it)."),
    as_json: bool = JsonOpt,
    accept_new: bool = AcceptNewOpt,
) -> None:
    """Stop a job: SIGTERM, wait, SIGKILL, verify that nothing of it is left.

    With no JOB: a job whose kill failed is retried at once; the newest alive job is stopped only after you confirm
    (or with --yes). A job that had already ended keeps its verdict, and the exit code is that state's."""
    from dflashctl.jobs.kill import kill as kill_job
    from dflashctl.judge.facts import EXIT_BY_STATE
    from dflashctl.show import results
    from dflashctl.show.render import print_json

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

        results.execs_ended(execute.end_execs(job, project(), accept_new=accept_new))
    report = kill_job(job, project(), grace, accept_new, confirm)
    if as_json:
        print_json(report.to_dict())
    else:
        results.killed(report)
    if not report.clean:
        raise typer.Exit(EXIT_FAILED)
    if report.verdict:
        raise typer.Exit(EXIT_BY_STATE.get(report.verdict["state"], EXIT_FAILED))
