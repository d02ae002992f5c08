"""`dflashctl exec`, `shell` and `attach`: run a command, open a shell, or watch the pane where a job runs."""

from __future__ import annotations

import sys

import typer

from dflashctl.cli.app import AcceptNewOpt, Flag, JobArg, JsonOpt, Named, app, complete_jobs, project


@app.command("exec")
def exec_(
    target: str = typer.Argument(
        ...,
        metavar="JOB",
        click_type=Named(),
        help="A job (its host, release and environment), or with --host a host.",
        autocompletion=complete_jobs,
    ),
    command: list[str] | None = typer.Argument(
        None, metavar="-- COMMAND...", show_default=False, click_type=Named(), help="What to run, after `--`."
    ),
    on_host: bool = Flag("--host", help="JOB names a host: run in its deployed code."),
    timeout: float | None = typer.Option(
        None,
        "--timeout",
        metavar="S",
        help="End the command and all it started (setsid'd ones too) after S seconds; exit 124.",
    ),
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
    target: str = typer.Argument(
        ..., metavar="JOB", click_type=Named(), help="A job, or with --host a host.", autocompletion=complete_jobs
    ),
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

    from dflashctl.jobs import execute
    from dflashctl.jobs.find import find_job

    record = find_job(job, project())
    prefix = execute.view_prefix()
    argv = execute.attach_argv(record, write, prefix)
    if dry_run:
        print(shlex.join(argv))
        return
    hint = execute.view_hint(prefix) if record.scheduler == "tmux" else None
    if hint:
        sys.stderr.write(f"dflashctl: {hint}\n")
    os.execvp(argv[0], argv)
