"""`dflashctl status [JOB]` and `dflashctl notices [JOB]`: one look at a job; its notices and their deliveries."""

from __future__ import annotations

import typer

from dflashctl.cli.app import AcceptNewOpt, JobArg, JsonOpt, app, project
from dflashctl.errors import EXIT_FAILED


@app.command()
def status(job: str | None = JobArg, as_json: bool = JsonOpt, accept_new: bool = AcceptNewOpt) -> None:
    """One look at a job: its state with the reason, the process, the last step.

    Default: a job whose kill failed, else the newest alive, else the newest (every command picks so). Exits with the
    state's code, as `watch --once` does."""
    from dflashctl.jobs.status import status as look_at
    from dflashctl.judge.facts import EXIT_BY_STATE
    from dflashctl.show import status as shown
    from dflashctl.show.render import print_json

    look = look_at(job, project(), accept_new)
    if as_json:
        print_json(look.to_dict())  # the Report's schema and status's own (docs/cli-json.md)
    else:
        shown.render(look, given=job is not None)
    raise typer.Exit(EXIT_BY_STATE.get(look.report.state, EXIT_FAILED))


@app.command()
def notices(job: str | None = JobArg, as_json: bool = JsonOpt, accept_new: bool = AcceptNewOpt) -> None:
    """Every notice of a job and its deliveries: when, by whom (the supervisor, or this laptop), the webhook's answer.

    One notice per event (a failure with what was done about it, the job's end), POSTed a bounded number of times
    whoever sends it; a redirect, a 4xx or POSTs spent is `failed`, a request sent but never answered `unconfirmed`."""
    from dflashctl.jobs.status import notice_log
    from dflashctl.show import notices as shown
    from dflashctl.show.render import print_json

    log = notice_log(job, project(), accept_new)
    if as_json:
        print_json(log)
        return
    shown.render(log)
