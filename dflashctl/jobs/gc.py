"""`gc`: the run dirs of jobs that ended long enough ago, listed (a plan to confirm) or removed, never a live one's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from dflashctl.config import resolve_host
from dflashctl.errors import ConfigError
from dflashctl.jobs import registry
from dflashctl.jobs.find import check_number
from dflashctl.remote import session
from dflashctl.remote.connect import open_runner
from dflashctl.remote.sync import read_remote_state


def gc(
    spec: str,
    root: Path,
    older_than_days: float,
    dry_run: bool,
    accept_new: bool = False,
    all_projects: bool = False,
    only: list[str] | None = None,
) -> dict:
    """Remove HOST's run dirs of this project's jobs (every project's with `all_projects`) that ended over
    `older_than_days` ago (never a live job's, never one whose supervisor runs, never one holding a mount): one remote
    action under the workdir's launch lock. `dry_run` lists them and changes nothing; `only` limits the removal to the
    run dirs a user was shown and confirmed. The result's `removed_ids`
    are the job ids whose run dirs are gone, for the local registry to mark."""
    check_number("--older-than", older_than_days)
    host = resolve_host(spec, root)
    with open_runner(host, accept_new) as runner:
        abs_wd, _, _ = read_remote_state(runner, host.workdir)
        ans = session.call_agent(
            runner,
            {
                "action": "gc",
                "workdir": abs_wd,
                "older_than_s": older_than_days * 86400,
                "dry_run": dry_run,
                "gpus": False,
                "project": None if all_projects else session.project_key(root),
                **({"only": list(only)} if only is not None else {}),
                "tmux_socket": session.tmux_socket(),
            },
            timeout=600,
        )
    if ans.get("refused"):
        raise ConfigError("gc", None, f"the agent on {host.name} refused: {ans['refused']}")
    ids = [] if ans.get("dry_run") else [r["id"] for r in ans.get("removed", [])]
    if ids:  # their records say REMOVED, by whom and when: never LOST later
        registry.mark_removed(host.name, ids, remover())
    return {"host": host.name, "workdir": abs_wd, **ans, "removed_ids": ids}


def remover() -> str:
    """Who ran a `gc`: user@machine."""
    import getpass
    import socket

    return f"{getpass.getuser()}@{socket.gethostname()}"


def collect(
    spec: str,
    root: Path,
    older_than_days: float,
    *,
    dry_run: bool,
    yes: bool,
    accept_new: bool = False,
    all_projects: bool = False,
    confirm: Callable[[dict], bool] | None = None,
) -> tuple[dict, bool] | None:
    """`gc` as a person runs it: plan first (a dry run), show the plan and ask (`confirm`; None: nobody can be asked,
    so --yes is needed), then remove exactly what was confirmed. Returns (the result, whether nothing was removed by
    design: a dry run, or an empty plan); None when the person said no."""
    check_number("--older-than", older_than_days)
    plan = None
    if not dry_run and not yes:
        plan = gc(spec, root, older_than_days, True, accept_new, all_projects)
        if not plan["removed"]:
            dry_run = True  # nothing to remove: said, nothing asked
        elif confirm is None:
            raise ConfigError(
                "gc", None, f"{len(plan['removed'])} run dirs would be removed: pass --yes (or --dry-run to list them)"
            )
        elif not confirm(plan):
            return None
    confirmed = [r["id"] for r in plan["removed"]] if plan else None
    return gc(spec, root, older_than_days, dry_run, accept_new, all_projects, only=confirmed), dry_run
