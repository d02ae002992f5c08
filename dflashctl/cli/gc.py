"""`dflashctl gc HOST`: remove the run dirs of jobs that ended long ago, never a live one's; asks first."""

from __future__ import annotations

import sys

import typer

from dflashctl.cli.app import AcceptNewOpt, Flag, HostArg, JsonOpt, app


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
    from dflashctl.jobs.gc import collect
    from dflashctl.show import results
    from dflashctl.show.render import print_json

    def confirm(plan: dict) -> bool:
        results.gc_plan(plan)
        n, size = len(plan["removed"]), sum(r["bytes"] for r in plan["removed"]) / 2**30
        return typer.confirm(
            f"remove the {n} run dir{'s' if n != 1 else ''} listed above on {host} ({size:.2f} GiB)?", default=False
        )

    can_ask = not as_json and sys.stdin.isatty()
    done = collect(
        host,
        find_project_root(),
        older_than,
        dry_run=dry_run,
        yes=yes,
        accept_new=accept_new,
        all_projects=all_projects,
        confirm=confirm if can_ask else None,
    )
    if done is None:  # the person said no
        raise typer.Exit(1)
    res, listed_only = done
    if as_json:
        print_json(res)
        return
    results.gc_done(res, listed_only)
