"""What `ls` says of the records: which states a record can hold, `ls --refresh` (every unfinished job asked again,
as `sky queue` does: one `status` each, whose verdict the registry keeps), and the one-line errors of its filters.
"""

from __future__ import annotations

import fnmatch
from concurrent.futures import ThreadPoolExecutor

from dflashctl.errors import ConfigError, DflashError
from dflashctl.judge.facts import DONE_FOR_GOOD, RECORDED
from dflashctl.model.record import REMOVED, JobRecord


def record_states() -> list[str]:
    """Every state a job's record can hold (the state table's `recorded`)."""
    return list(RECORDED)


def wanted_states(states: list[str] | None) -> set[str]:
    """`--state` values, case-insensitive; `failed` is every failure state. An unknown one is a one-line error."""
    from dflashctl.judge.facts import FAILURES

    known = record_states()
    wanted: set[str] = set()
    for st in states or []:
        up = st.upper()
        if up == "FAILED":
            wanted |= set(FAILURES)
        elif up in known:
            wanted.add(up)
        else:
            raise ConfigError(
                "--state", None, f"{st!r} is not a state a job can be in (one of {', '.join(known)}, or `failed`)"
            )
    return wanted


def check_host(host: str | None, jobs: list[JobRecord], root) -> None:
    """`--host` names a host of the project's config or of a recorded job, else a one-line error."""
    if host is None:
        return
    known = {j.host_name for j in jobs} | {m.host_name for j in jobs for m in j.members}
    try:
        from dflashctl.config import known_hosts

        known |= set(known_hosts(root))
    except DflashError:  # a broken config names no hosts; the records still do
        pass
    if host not in known:
        raise ConfigError("--host", None, f"no host named {host!r} (known: {', '.join(sorted(known)) or 'none'})")


def filtered(jobs: list[JobRecord], states: list[str] | None, host: str | None, name: str | None) -> list[JobRecord]:
    """`ls` filters: states, a host (a job over several hosts: any of its nodes), a name glob."""
    wanted = wanted_states(states)

    def on(j: JobRecord) -> bool:
        return host is None or j.host_name == host or any(m.host_name == host for m in j.members)

    return [
        j
        for j in jobs
        if (not wanted or j.state in wanted) and on(j) and (name is None or fnmatch.fnmatchcase(j.name, name))
    ]


def forget(spec: str, project: str, force: bool = False, accept_new: bool = False) -> JobRecord:
    """Drop a record (`ls --forget NAME|ID`): the job as every command finds it. A job that may still run or restart
    is refused, asked of its host (a live pane or supervisor, a state that is not final, a failure its policy will
    restart): forgetting it would lose the only record that finds it. `force` forgets it anyway."""
    from dflashctl.jobs import registry
    from dflashctl.jobs.find import find_job

    job = find_job(spec, project)
    if not force and job.state != REMOVED:
        why = still_running(job, project, accept_new)
        if why:
            raise ConfigError(
                "--forget", None, f"{job.id} {why}: `dflashctl kill {job.name}` first (or --force to forget it anyway)"
            )
    return registry.forget(job.id)


def still_running(job: JobRecord, project: str, accept_new: bool = False) -> str | None:
    """Why the job may still run or restart, as its host says now; None when it has ended for good."""
    from dflashctl.jobs.status import status
    from dflashctl.judge.facts import TERMINAL

    look = status(job.id, project, accept_new)
    r = look.report
    if r.state == "UNREACHABLE":
        return f"cannot be asked about: {job.host_name} does not answer"
    if look.alive:
        return f"is still running ({r.state})"
    if (r.supervisor or {}).get("alive"):
        return "has a live supervisor (it may restart the job)"
    if r.state not in TERMINAL:
        return f"is {r.state}"
    w = job.watch
    if r.state in w.restart_on and not r.stop_requested and not r.gave_up and r.restarts < w.max_restarts:
        return f"is {r.state} with a restart pending ({r.restarts} of {w.max_restarts} done)"
    return None


def refresh(jobs: list[JobRecord], project: str, accept_new: bool = False) -> dict[str, str]:
    """Ask the hosts again about every job not done for good (a few at a time): each is one `status`, which records
    the Judge's verdict (and sends the notices its supervisor could not). Returns what could not be asked, by id."""
    from dflashctl.jobs.status import status

    todo = [j for j in jobs if j.state not in DONE_FOR_GOOD]
    failed: dict[str, str] = {}

    def one(job: JobRecord) -> None:
        try:
            status(job.id, project, accept_new)
        except DflashError as e:  # said, and the record keeps its last state
            failed[job.id] = str(e).splitlines()[0][:200]

    with ThreadPoolExecutor(max_workers=min(8, max(1, len(todo)))) as pool:
        list(pool.map(one, todo))
    return failed
