"""The `dflashctl` command line: thin commands that parse, call one library function and render the result.

Exit codes: 0 success; 1 a remote command or check failed; 2 bad input (config, host, host key, unreachable host).
"""

from __future__ import annotations

import sys

import click
import typer
from rich.table import Table

from dflashctl import __version__
from dflashctl.config import find_project_root, resolve_host
from dflashctl.doctor import run_doctor
from dflashctl.errors import EXIT_FAILED, DflashError
from dflashctl.render import byte_progress, err, out, print_json
from dflashctl.sync import deploy as deploy_tree
from dflashctl.transport import open_runner

app = typer.Typer(
    name="dflashctl",
    help="Deploy, launch, watch and kill DFlash drafter training jobs on remote GPU boxes.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)

_state = {"debug": False}

HostArg = typer.Argument(..., help="A host from dflashctl.yaml or hosts.yaml, `local`, user@host or ssh://host:port.")
JsonOpt = typer.Option(False, "--json", help="Print one compact JSON object on stdout and nothing else.")
AcceptNewOpt = typer.Option(
    False, "--accept-new-host-key", help="Record an unknown host key in known_hosts (like ssh's accept-new)."
)


def _version(value: bool) -> None:
    if value:
        out.print(f"dflashctl {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """Deploy code into remote containers, launch the DFlash trainer in tmux, watch it, kill it cleanly."""
    _state["debug"] = debug


@app.command()
def deploy(
    host: str = HostArg,
    workdir: str | None = typer.Option(None, "--workdir", help="Remote root; the code goes to WORKDIR/code."),
    dry_run: bool = typer.Option(False, "--dry-run", help="List what would change; send nothing."),
    as_json: bool = JsonOpt,
    accept_new: bool = AcceptNewOpt,
) -> None:
    """Send the project's files (git-tracked and untracked-not-ignored) to HOST; only changed files travel."""
    root_dir = find_project_root()
    cfg = resolve_host(host, root_dir, workdir)
    with open_runner(cfg, accept_new) as runner, byte_progress(f"deploy → {cfg.name}", not as_json) as progress:
        report = deploy_tree(runner, root_dir, cfg.workdir, dry_run=dry_run, progress=progress)
    if as_json:
        print_json(report.to_dict())
        return
    if dry_run:
        for rel in report.sent:
            out.print(f"send    {rel}")
        for rel in report.deleted:
            out.print(f"delete  {rel}")
    verb = "would send" if dry_run else "sent"
    out.print(
        f"{cfg.name}: {verb} {report.files_sent} files ({report.bytes_sent / 1e6:.2f} MB), "
        f"deleted {report.files_deleted}, version {report.version} → {report.code_dir} in {report.seconds:.2f} s"
    )


@app.command()
def doctor(host: str = HostArg, as_json: bool = JsonOpt, accept_new: bool = AcceptNewOpt) -> None:
    """Check that HOST can run jobs: ssh, container, Python, torch, GPUs, tmux, rsync, disk, clock."""
    cfg = resolve_host(host, find_project_root())
    with open_runner(cfg, accept_new) as runner:
        report = run_doctor(runner)
    if as_json:
        print_json(report.to_dict())
    else:
        table = Table(title=f"doctor: {cfg.name}", title_justify="left")
        for col in ("check", "verdict", "detail"):
            table.add_column(col)
        style = {"ok": "green", "warn": "yellow", "fail": "red"}
        for c in report.checks:
            table.add_row(c.name, f"[{style[c.status]}]{c.status}[/]", c.detail)
        out.print(table)
    if not report.ok:
        raise typer.Exit(EXIT_FAILED)


def main(argv: list[str] | None = None) -> int:
    """Entry point: one handler turns every typed error into a one-line message and its exit code."""
    args = sys.argv[1:] if argv is None else argv
    try:
        rv = app(args=args, prog_name="dflashctl", standalone_mode=False)
        return rv if isinstance(rv, int) else 0
    except DflashError as e:
        if _state["debug"] or "--debug" in args:
            raise
        err.print(f"dflashctl: error: {e}", markup=False)
        return e.exit_code
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except click.exceptions.Abort:
        err.print("aborted")
        return 130
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a bug: one line unless --debug
        if _state["debug"] or "--debug" in args:
            raise
        err.print(f"dflashctl: internal error: {type(e).__name__}: {e} (run with --debug for the traceback)")
        return EXIT_FAILED


def run() -> None:
    sys.exit(main())
