"""Stopping and restarting a job: each one remote action, decided on the remote under the run dir's lock.

`kill` and `watch` both use these, so the rules live in one place: a kill records a stop request before it signals
anything; a restart never follows a stop request, happens once per failed attempt however many watchers saw it, and
never beyond `max_restarts` (the count is a file in the run dir).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from dflashctl.config import HostConfig
from dflashctl.model.record import JobRecord
from dflashctl.remote import session
from dflashctl.remote.transport import Runner


@dataclass
class KillReport:
    id: str
    host: str
    result: str  # KILLED (verified) or KILL_FAILED
    found: list[dict]
    term: list[int]
    kill: list[int]
    remaining: list[int]
    gpu_holders: list[dict]
    gpu_check: str  # which GPU check was made, and when
    session_closed: bool
    ended_before: int | None = None  # the job's exit status, where it had ended before the kill
    verdict: dict | None = None  # then its own verdict, kept: {state, reason, evidence}
    notices: dict | None = None  # the run dir's outbox after the kill's own notice: waiting, failed, sent
    dequeued: bool = False  # it was queued (launch --queue): taken out of the queue, it never started

    @property
    def clean(self) -> bool:
        return self.result == "KILLED"

    def to_dict(self) -> dict:
        return {**asdict(self), "clean": self.clean}


def stop(runner: Runner, job: JobRecord, grace_s: float | None = None) -> KillReport:
    """Stop request, SIGTERM, grace, SIGKILL, verify; with `gpu_query: host`, the GPUs are then read on the host and
    their pids mapped into the container's namespace (NSpid), after the kill."""
    grace = job.kill_grace_s if grace_s is None else grace_s
    host = runner.host
    on_host = bool(host.container and host.gpu_query == "host")
    req = {
        "action": "reap",
        "run_dir": job.run_dir,
        "session": job.session,
        "job_id": job.tag,
        "grace_s": grace,
        "tmux_socket": job.tmux_socket,
        "gpus": not on_host,
        **session.scheduler_of(job),
    }
    ans = session.call_agent(runner, req, timeout=grace + 120)
    holders, check = ans["gpu_holders"], ans["gpu_check"]
    if job.scheduler == "slurm":
        said = ans.get("slurm") or {}
        check = f"slurm job {said.get('id')}: {said.get('state') or 'unknown'} ({said.get('source') or 'no record'})"
    if on_host:
        every = set(ans["every"])
        seen = session.call_agent(runner, {"action": "gpu_holders"}, on_host=True)  # pids in every namespace
        holders = [a for a in seen["apps"] if not a.get("gone") and (a.get("nspid") or [a["pid"]])[-1] in every]
        check = f"{seen['source']} on the container's host after the kill, pids mapped through NSpid"
        if holders and ans["result"] == "KILLED":
            ans["result"] = "KILL_FAILED"
            report = {**ans, "gpu_holders": holders, "gpu_check": check}
            session.call_agent(
                runner, {"action": "stop_result", "run_dir": job.run_dir, "report": report, "gpus": False}
            )
    ended = ans.get("ended_before")
    return KillReport(
        id=job.id,
        host=host.name,
        result=ans["result"],
        found=ans["found"],
        term=ans["term"],
        kill=ans["kill"],
        remaining=ans["remaining"],
        gpu_holders=holders,
        gpu_check=check,
        session_closed=ans["session_closed"],
        ended_before=ended if isinstance(ended, int) else None,
        dequeued=ans.get("dequeued") is True,
    )


@dataclass
class RestartOutcome:
    restarted: bool
    restarts: int  # the run dir's count after this call
    why: str = ""
    pane_pid: int | None = None
    slurm_job: str | None = None  # a Slurm job's new submission
    raced: bool = False  # another decider restarted this attempt first (typed by the remote: never read from `why`)
    stopped: bool = False  # refused because a stop was requested (the kill's own notice says it)


def restart(
    runner: Runner, job: JobRecord, attempt: int, min_free_gib: float | None = None, cause: dict | None = None
) -> RestartOutcome:
    """Restart the attempt numbered `attempt` (0 for the first launch) with --resume for the trainer, unless the
    remote says no (stop requested, someone else restarted it, budget spent, less than `min_free_gib` free at the
    run dir: a job that filled its disk is not restarted into the same full disk). `cause` (the failed state, its
    reason and evidence) is kept in the run dir for whoever sees the restart without having seen the failure."""
    req = {
        "action": "restart",
        "run_dir": job.run_dir,
        "session": job.session,
        "job_id": job.tag,
        "tmux_socket": job.tmux_socket,
        "attempt": attempt,
        "max_restarts": job.watch.max_restarts,
        "grace_s": job.kill_grace_s,
        "python": runner.host.python,
        "args": ["--resume"] if job.is_trainer else [],
        "gpus": False,
        "min_free_gib": min_free_gib,
        "cause": {**(cause or {}), "by": "watch"},
        **session.scheduler_of(job),
    }
    ans = session.call_agent(runner, req, timeout=job.kill_grace_s + 150)
    return RestartOutcome(
        restarted=bool(ans.get("restarted")),
        restarts=int(ans.get("restarts", attempt)),
        why=ans.get("why", ""),
        pane_pid=ans.get("pane_pid"),
        slurm_job=ans.get("slurm_job"),
        raced=ans.get("raced") is True,
        stopped=ans.get("stopped") is True,
    )


def each_member(job: JobRecord, open_runner: Callable[[HostConfig], Runner], fn: Callable[[Runner, JobRecord], object]):
    """fn(runner, member record) for every node of the job, all at once; results in node order."""
    members = job.member_records()

    def one(rec: JobRecord):
        with open_runner(rec.host) as runner:
            return fn(runner, rec)

    if len(members) == 1:
        return [one(members[0])]
    with ThreadPoolExecutor(max_workers=min(16, len(members))) as pool:
        return list(pool.map(one, members))


def stop_all(job: JobRecord, open_runner: Callable[[HostConfig], Runner], grace_s: float | None = None) -> KillReport:
    """Stop every node of a job and verify each: KILLED only when every node says so."""
    reports = each_member(job, open_runner, lambda r, rec: stop(r, rec, grace_s))
    if len(reports) == 1:
        return reports[0]
    tag = lambda rep, items: [{**x, "node": rep.host} if isinstance(x, dict) else x for x in items]  # noqa: E731
    ended = [r.ended_before for r in reports]
    return KillReport(
        id=job.id,
        host=",".join(r.host for r in reports),
        result="KILLED" if all(r.clean for r in reports) else "KILL_FAILED",
        found=[x for r in reports for x in tag(r, r.found)],
        term=[p for r in reports for p in r.term],
        kill=[p for r in reports for p in r.kill],
        remaining=[p for r in reports for p in r.remaining],
        gpu_holders=[x for r in reports for x in tag(r, r.gpu_holders)],
        gpu_check="; ".join(f"{r.host}: {r.gpu_check}" for r in reports),
        session_closed=all(r.session_closed for r in reports),
        ended_before=ended[0] if all(e is not None for e in ended) else None,
        dequeued=all(r.dequeued for r in reports),
    )


def restart_all(
    job: JobRecord,
    open_runner: Callable[[HostConfig], Runner],
    attempt: int,
    min_free_gib: float | None = None,
    cause: dict | None = None,
) -> RestartOutcome:
    """Restart every node of a job (each stopped, then started with --resume, under its run dir's lock), head
    first. The outcome is the head's; a node that refuses is named."""
    outcomes = []
    for rec in job.member_records():
        with open_runner(rec.host) as runner:
            outcomes.append(restart(runner, rec, attempt, min_free_gib, cause))
    head = outcomes[0]
    refused = [
        f"{rec.host_name}: {o.why}" for rec, o in zip(job.member_records(), outcomes, strict=True) if not o.restarted
    ]
    if refused and head.restarted:
        return RestartOutcome(
            False,
            head.restarts,
            "; ".join(refused),
            head.pane_pid,
            raced=head.raced,
            stopped=any(o.stopped for o in outcomes),
        )
    return head
