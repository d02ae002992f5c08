"""Finding the job a command means: by id, a unique id prefix or a name, one rule for every command; and the check
of a number given on the command line."""

from __future__ import annotations

import math

from dflashctl.errors import ConfigError, NoSuchJobError
from dflashctl.jobs import registry
from dflashctl.jobs.registry import JobRecord


def check_number(option: str, value: float | None, positive: bool = False) -> None:
    """A number given on the command line is finite and at least 0 (above 0 with `positive`): `nan` compares false
    with everything, so an unchecked one silently turns every limit off."""
    if value is None:
        return
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ConfigError(
            option,
            None,
            f"{value:g}: expected a finite number {'above' if positive else '0 or'} {'0' if positive else 'more'}",
        )


def find_job(spec: str | None, project: str | None, live_only: bool = False) -> JobRecord:
    """The job a command means, one rule for every command: by id, a unique id prefix or a name (newest match).
    Without one: a job whose last kill failed (retrying `kill` reaches the same job, never the next one), else the
    newest job that may be running, else (unless `live_only`) the newest job of the project."""
    everywhere = registry.all_jobs()  # one read of the records serves every lookup below
    jobs = [j for j in everywhere if project is None or j.project == project]
    if spec:
        exact = [j for j in everywhere if j.id == spec]
        named = [j for j in jobs if j.name == spec]
        # a prefix looks in this project first: another project's jobs are offered only when none here matches
        prefixed = [j for j in jobs if j.id.startswith(spec)] or [j for j in everywhere if j.id.startswith(spec)]
        if not exact and not named and len(prefixed) > 1:  # a prefix must name one job, never guess among several
            ids = ", ".join(j.id for j in prefixed[:8])
            raise NoSuchJobError(f"{spec!r} is a prefix of {len(prefixed)} jobs: {ids}; give more of the id")
        jobs = exact or named or prefixed
    else:
        failed = [j for j in jobs if j.state == "KILL_FAILED"]
        alive = [j for j in jobs if j.live]
        jobs = failed or alive or ([] if live_only else jobs)
    if not jobs:
        what = f"matching {spec!r}" if spec else ("alive " if live_only else "") + "in this project"
        elsewhere = "" if spec or not everywhere else "; jobs of other projects: `dflashctl ls --all-projects`"
        raise NoSuchJobError(f"no job {what} (see `dflashctl ls`){elsewhere}")
    return jobs[0]


def picked_how(job: JobRecord, spec: str | None) -> str:
    """How a command came to its job: `given`, `kill_failed`, `live` or `newest` (said to the user)."""
    if spec:
        return "given"
    return "kill_failed" if job.state == "KILL_FAILED" else ("live" if job.live else "newest")
