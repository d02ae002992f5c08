"""`dflashctl doctor HOST|JOB.yaml`: can HOST (or every node of a job) run jobs."""

from __future__ import annotations

import typer

from dflashctl.cli.app import AcceptNewOpt, HostArg, JsonOpt, app
from dflashctl.errors import EXIT_FAILED


@app.command()
def doctor(host: str = HostArg, as_json: bool = JsonOpt, accept_new: bool = AcceptNewOpt) -> None:
    """Check that HOST can run jobs: ssh, container, Python, torch, GPUs, tmux, rsync, disk, clock.

    A Slurm host: the login node, the scheduler's commands, the partition and account, and one short srun that a
    compute node sees the workdir and imports torch.

    Given a job file over several hosts, check every node, then that each reaches the head's rendezvous port and
    that all run the same torch and NCCL."""
    from dflashctl.config import find_project_root
    from dflashctl.jobs.doctor import doctor_reports
    from dflashctl.show import results
    from dflashctl.show.render import print_json

    reports = doctor_reports(host, find_project_root(), accept_new)
    if as_json:
        # one schema: every report under `reports`, the first one's `host` and `checks` also at the top
        first = reports[0].to_dict()
        print_json(
            {
                "ok": all(r.ok for r in reports),
                "host": first["host"],
                "checks": first["checks"],
                "reports": [r.to_dict() for r in reports],
            }
        )
    else:
        results.doctor_tables(reports)
    if not all(r.ok for r in reports):
        raise typer.Exit(EXIT_FAILED)
