"""`dflashctl deploy HOST`: the project's files as the current release on HOST, atomically."""

from __future__ import annotations

import typer

from dflashctl.cli.app import AcceptNewOpt, Flag, HostArg, JsonOpt, app


@app.command()
def deploy(
    host: str = HostArg,
    workdir: str | None = typer.Option(
        None, "--workdir", metavar="DIR", help="Remote root; the code goes to DIR/code."
    ),
    dry_run: bool = Flag("--dry-run", help="List what would change; send nothing."),
    as_json: bool = JsonOpt,
    accept_new: bool = AcceptNewOpt,
) -> None:
    """Make the project's files (git-tracked, untracked-not-ignored) the current release on HOST, atomically."""
    from dflashctl.config import find_project_root, resolve_host
    from dflashctl.remote.connect import open_runner
    from dflashctl.remote.sync import deploy as deploy_tree
    from dflashctl.show import results
    from dflashctl.show.render import byte_progress, print_json

    root_dir = find_project_root()
    cfg = resolve_host(host, root_dir, workdir)
    with open_runner(cfg, accept_new) as runner, byte_progress(f"deploy → {cfg.name}", not as_json) as progress:
        report = deploy_tree(runner, root_dir, cfg.workdir, dry_run=dry_run, progress=progress)
    if as_json:
        print_json(report.to_dict())
        return
    results.deployed(report, cfg.name, dry_run)
