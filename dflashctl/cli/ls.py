"""`dflashctl ls`: the jobs launched from this project, as last seen; `--refresh` asks the hosts again."""

from __future__ import annotations

import typer

from dflashctl.cli.app import AcceptNewOpt, Flag, JsonOpt, ProjectOpt, app


@app.command("ls")
def list_jobs(
    all_projects: bool = ProjectOpt,
    state: list[str] | None = typer.Option(
        None,
        "--state",
        "-s",
        metavar="STATE",
        help="Only jobs in this state (repeat for several; `failed`: any failure).",
    ),
    host: str | None = typer.Option(None, "--host", metavar="HOST", help="Only jobs on this host."),
    name: str | None = typer.Option(None, "--name", metavar="GLOB", help="Only jobs whose name matches (fnmatch)."),
    refresh: bool = Flag(
        "--refresh",
        "-r",
        help="Ask the hosts again about every job not done for good (one "
        "`status` each) before listing, as `sky queue` does.",
    ),
    forget: str | None = typer.Option(
        None,
        "--forget",
        metavar="JOB",
        help="Drop the record of an ended job, by "
        "name or id (its run dir is left as it is); lists nothing. The host is asked "
        "first: a job that may still run or restart is refused.",
    ),
    force: bool = Flag("--force", help="With --forget: forget the record even if the job may still run."),
    as_json: bool = JsonOpt,
    wide: bool = Flag("--wide", help="Every column, however wide the terminal."),
    accept_new: bool = AcceptNewOpt,
) -> None:
    """Jobs launched from this project, newest first: the state the last look gave (`status`, `watch`, or the
    hosts asked again with --refresh); a run dir removed by `gc` is REMOVED, with when and by whom."""
    from dflashctl.config import find_project_root
    from dflashctl.jobs import records, registry
    from dflashctl.show import records as shown
    from dflashctl.show.render import err, print_json, show_table

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
        print_json({"jobs": [shown.as_json(j) for j in listed]})
        return
    if not listed:
        if jobs and (state or host or name):
            err.print(
                "no job of this project matches (`dflashctl ls` lists them all)"
                if not all_projects
                else "no job matches (`dflashctl ls --all-projects` lists them all)"
            )
        elif not all_projects and registry.all_jobs():
            err.print("no jobs launched from this project; `dflashctl ls --all-projects` lists the others")
    show_table(shown.TITLE, shown.COLUMNS, shown.rows(listed), wide)
