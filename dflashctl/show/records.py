"""`ls` as a person or a script reads it: one row per job record (as last seen), and its JSON."""

from __future__ import annotations

import time

from dflashctl.model.record import REMOVED, JobRecord
from dflashctl.show.render import ago
from dflashctl.show.view import progress_line

COLUMNS = ("id", "host", "state", "progress", "seen", "launched", "gpus", "run dir")
TITLE = "jobs (states as last seen: `dflashctl ls --refresh` asks again)"


def state_cell(j: JobRecord, now: float) -> str:
    """A queued Slurm job says why it waits (Slurm's reason), a job in a host's queue its place and what holds its
    GPUs; a removed one, who removed it and when."""
    if j.state == REMOVED and j.removed_at:
        return f"REMOVED {ago(now - j.removed_at)} by {j.removed_by}"
    if j.state == "QUEUED" and j.reason:
        return f"QUEUED: {j.reason}"
    return f"PENDING: {j.reason.split(': ', 1)[-1]}" if j.state == "PENDING" and j.reason else j.state


def rows(jobs: list[JobRecord], now: float | None = None) -> list[tuple[str, ...]]:
    now = time.time() if now is None else now
    return [
        (
            j.id,
            j.host_name,
            state_cell(j, now),
            progress_line(j.progress),
            ago(now - j.checked_at) if j.checked_at else "-",
            time.strftime("%Y-%m-%d %H:%M", time.localtime(j.launched_at)),
            ",".join(map(str, j.gpus)) or "-",
            j.run_dir,
        )
        for j in jobs
    ]


def as_json(j: JobRecord) -> dict:
    """One record in `ls --json` (docs/cli-json.md)."""
    return {
        "id": j.id,
        "host": j.host_name,
        "state": j.state,
        "reason": j.reason,
        "checked_at": j.checked_at,
        "launched_at": j.launched_at,
        "run_dir": j.run_dir,
        "gpus": j.gpus,
        "slurm_job": j.slurm_job,
        "removed_at": j.removed_at,
        "removed_by": j.removed_by,
        "progress": j.progress,
    }
