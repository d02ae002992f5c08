"""`status` and `notices`: one look at a job (the supervisor's verdict while it answers, else the Decider's), typed as
`StatusLook`, whose `to_dict()` is the documented schema (docs/cli-json.md); and the job's notices with their
deliveries."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, fields

from dflashctl.errors import DflashError
from dflashctl.jobs import notify, registry
from dflashctl.jobs.find import find_job, picked_how
from dflashctl.jobs.poller import make_watcher
from dflashctl.jobs.registry import JobRecord
from dflashctl.jobs.secrets import redactor
from dflashctl.judge.facts import ADVICE
from dflashctl.judge.report import Report
from dflashctl.remote import session
from dflashctl.remote.connect import open_runner


@dataclass
class StatusLook:
    """One look at a job as `status` shows it: the Report (the one schema of every command) and what only a one-shot
    look knows. `to_dict()` is `status --json` (docs/cli-json.md): every key there, null where the look could not
    say."""

    report: Report
    run_dir: str
    picked: str  # how the command came to this job: given, kill_failed, live or newest
    nodes: list[dict] | None = None  # a job over several hosts: host and state of each node, head first
    alive: bool | None = None  # the pane is alive
    session: str | None = None  # alive, dead, gone, or unknown (the host did not answer)
    run_dir_exists: bool | None = None
    exit_code: int | None = None
    last_event: dict | None = None  # the newest event record of metrics.jsonl
    uptime_s: float | None = None  # since launch, while alive
    processes: int | None = None
    heartbeat_age_s: float | None = None  # the trainer's heartbeat
    mean_tokens_per_s: float | None = None  # the run's figures over its whole metrics.jsonl, as `report` has them
    first_loss: float | None = None
    elapsed_s: float | None = None
    last_state: str | None = None  # UNREACHABLE: the state recorded last, and when
    last_seen: float | None = None
    notices: dict | None = None  # the run dir's outbox after this look sent what it could
    queue: dict | None = None  # in the host's queue (`launch --queue`): ticket, position, waiting_for, since, state
    setup: dict | None = None  # this attempt's `setup:` step: state, command, release, seconds, exit, skipped, by

    def to_dict(self) -> dict:
        return {**self.report.to_dict(), **{f.name: getattr(self, f.name) for f in fields(self) if f.name != "report"}}


def status(spec: str | None, project: str, accept_new: bool = False) -> StatusLook:
    """One look and a verdict: the supervisor's own (its verdict.json) while it answers, else the job's Decider's,
    said so. Without a spec, the same job `kill` would pick (else the newest of the project). Notices the look's
    decider made, and what waits in the outbox, are sent within notify.SEND_BUDGET_S; how many still wait is said."""
    job = find_job(spec, project)
    picked = picked_how(job, spec)
    if job.state == registry.REMOVED:  # gc removed the run dir: no host can say more than the record
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(job.removed_at or 0))
        r = Report(
            job.id,
            job.host_name,
            "REMOVED",
            f"its run dir was removed by {job.removed_by} at {when} (dflashctl gc)",
            [],
            ADVICE["REMOVED"],
            restarts=job.restarts,
            max_restarts=job.watch.max_restarts,
            decided_why="the record: gc removed the run dir",
        )
        return StatusLook(r, job.run_dir, picked, session="gone", run_dir_exists=False)
    w = make_watcher(job, accept_new, by="status")
    w.look_extra = {"figures": True, "gpus": False, "capture_lines": 5}
    w.claim_in_look = False  # one `notices` call after the verdict puts and claims, within the send budget
    try:
        looks = w.looks()
        if not looks[0].reachable:  # the same word `watch --once` says: UNREACHABLE, with the last state seen
            return unreachable_status(job, picked, looks[0].error)
        turn = w.decider.take(looks, time.monotonic())
        notices = w.deliver(turn.notices) if job.watch.notify.webhook and looks[0].snap is not None else {}
    finally:
        for link in w.links:
            link.drop()
    r = turn.report
    snap = looks[0].snap or {}
    pane = snap.get("session") or {}
    alive = bool(pane.get("exists") and not pane.get("pane_dead"))
    if r.state != "UNREACHABLE":  # a silent scheduler concludes nothing: the record keeps its last state
        registry.update(job.id, state=r.state, reason=r.reason, progress=r.progress())
    for rec, link in zip(job.member_records(), w.links, strict=False):  # ended for good, no supervisor: scrubbed
        if notify.needs_scrub(job, r.state, {**snap, "secrets_at_rest": link.secrets_at_rest}):
            with contextlib.suppress(DflashError), open_runner(rec.host, accept_new) as runner:
                session.call_agent(runner, {"action": "scrub", "run_dir": rec.run_dir, "gpus": False})
    events = [m for m in (snap.get("metrics") or {}).get("records", []) if isinstance(m, dict) and "event" in m]
    fig = snap.get("figures") if isinstance(snap.get("figures"), dict) else {}
    if isinstance(fig.get("step"), int):  # one look reads metrics.jsonl in part: its newest step and loss are the
        r.step, r.loss = fig["step"], fig.get("last_loss")  # whole file's, as `report` has them
    return StatusLook(
        r,
        job.run_dir,
        picked,
        nodes=[{"host": n["host"], "state": n["state"]} for n in w.decider.node_states] if job.members else None,
        alive=alive,
        session="alive" if alive else ("dead" if pane.get("exists") else "gone"),
        run_dir_exists=bool(snap.get("run_dir_exists")),
        exit_code=snap.get("exit_code"),
        last_event=events[-1] if events else None,
        uptime_s=round(time.time() - job.launched_at, 1) if alive else None,
        processes=len(snap.get("procs") or []),
        heartbeat_age_s=_heartbeat_age(snap),
        mean_tokens_per_s=fig.get("mean_tokens_per_s"),
        first_loss=fig.get("first_loss"),
        elapsed_s=fig.get("elapsed_s"),
        notices=notices or None,
        queue=_picked(snap.get("queue"), QUEUE_KEYS),
        setup=_picked(snap.get("setup"), SETUP_KEYS),
    )


QUEUE_KEYS = ("ticket", "position", "waiting_for", "since", "state")
SETUP_KEYS = ("state", "command", "release", "seconds", "exit", "timed_out", "skipped", "by")


def _picked(found, keys: tuple[str, ...]) -> dict | None:
    """The keys a look's run-dir file (already bounded and redacted by the agent) documents, or None."""
    return {k: found.get(k) for k in keys} if isinstance(found, dict) else None


def notice_log(spec: str | None, project: str, accept_new: bool = False) -> dict:
    """`dflashctl notices`: every notice of the job and how each delivery went (when, by whom, the answer), with the
    webhook named as `scheme://host:port/***`."""
    from dflashctl.judge.redact import redact_url

    job = find_job(spec, project)
    with open_runner(job.host, accept_new) as runner:
        ans = session.call_agent(runner, {"action": "notice_log", "run_dir": job.run_dir, "gpus": False})
    hook = job.watch.notify.webhook
    notices = ans.get("notices") if isinstance(ans.get("notices"), list) else []
    return {
        "id": job.id,
        "webhook": redact_url(hook) if hook else None,
        "run_dir_exists": ans.get("run_dir_exists"),
        "notices": redactor(job).deep(notices),
    }


def _heartbeat_age(snap: dict) -> float | None:
    """How long the trainer's heartbeat has not changed: the remote's monotonic age of it, else its mtime's age."""
    age = (snap.get("progress") or {}).get("heartbeat_age_s")
    if isinstance(age, (int, float)) and not isinstance(age, bool):
        return age
    return (snap.get("heartbeat") or {}).get("age_s")


def unreachable_status(job: JobRecord, picked: str, why: str) -> StatusLook:
    """`status` of a job whose host does not answer: UNREACHABLE, with the last state recorded and when."""
    seen = job.since if isinstance(job.since, (int, float)) and job.since else None
    when = f", recorded {time.time() - seen:.0f} s ago" if seen else ""
    r = Report(
        job.id,
        job.host_name,
        "UNREACHABLE",
        why,
        [f"last state {job.state}{when}"],
        ADVICE["UNREACHABLE"],
        restarts=job.restarts,
        max_restarts=job.watch.max_restarts,
        decided_why="the host did not answer",
    )
    return StatusLook(r, job.run_dir, picked, session="unknown", last_state=job.state, last_seen=seen)
