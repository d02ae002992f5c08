"""The watch loop: a poll at each interval (jobs/poller.py), the one restart policy (judge/policy.next_move), the
notify policy, and what it says.

The supervisor beside the job decides; a watch reads. Where a live supervisor answers (its heartbeat moves), the
watch shows its decisions and never restarts by itself; where none does (`supervise: false`, a supervisor dead,
frozen, or one that gave up), the watch decides with the same `next_move` and says so. Every interval and backoff
is measured on this process's monotonic clock; wall stamps are only shown.

Every decision (state change, restart, notification) is appended to the local registry's events and to the run's
`events.jsonl` (carried by the next probe call, so that a poll stays one remote command).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from dflashctl.jobs import registry
from dflashctl.jobs import verdict as verdicts
from dflashctl.jobs.notify import Message, post, redact
from dflashctl.jobs.poller import (  # noqa: F401 - the poller's names, as callers of watch know them
    CONSEQUENCES,
    ELSEWHERE,
    PEER_GRACE_S,
    NodesWatcher,
    PollRecord,
    Watcher,
    make_watcher,
    sparkline,
)
from dflashctl.judge import policy
from dflashctl.judge.facts import ADVICE, EXIT_BY_STATE, FAILURES, TERMINAL  # noqa: F401 - EXIT_BY_STATE re-exported
from dflashctl.judge.report import HERE, Report


@dataclass
class WatchOptions:
    interval_s: float
    once: bool = False
    until_done: bool = False
    max_unreachable_s: float = 600.0
    notify: bool = True


def run(
    w: Watcher, opts: WatchOptions, emit: Callable[[Watcher, Report, PollRecord], None],
    wait: Callable[[float, Watcher], None] = lambda s, w: time.sleep(s), say: Callable[[str], None] = lambda s: None,
) -> Report:  # fmt: skip
    """Poll until the job reaches a final state (or once); apply the restart policy where this watch decides, and
    the notify policy. Returns the last report. Ctrl-C (KeyboardInterrupt) propagates to the caller: it stops the
    watching, never the job."""
    unreachable_since: float | None = None  # time.monotonic()
    failed_at: float | None = None  # time.monotonic() when this failure was first seen
    backoff = opts.interval_s
    decider = None
    while True:
        r = w.poll()
        while w.sent:  # notices the supervisor could not send, sent by this poll
            say(w.sent.pop(0))
        if r.state != w.state:
            previous, w.state = w.state, r.state
            if r.state != "UNREACHABLE":
                registry.update(w.job.id, state=r.state, reason=r.reason, since=time.time(), restarts=w.restarts)
            w.log_event({"decision": "state", "state": r.state, "previous": previous, "reason": r.reason,
                         "evidence": r.evidence[:5]})  # fmt: skip
            recovered = previous in (*FAILURES, "UNREACHABLE")
            if opts.notify and (r.state not in ("RUNNING", "STARTING", "STOPPING") or recovered):
                notify(w, r, say)
        if r.state != "UNREACHABLE" and r.decided_by != decider:
            decider = r.decided_by
            if decider == HERE and r.supervisor is not None and r.state not in TERMINAL:  # taking over: said once
                say(r.decided_why)
                w.log_event({"decision": "warning", "warning": r.decided_why})
        _warn_disk(w, r, opts, say)
        emit(w, r, w.record(r))
        if r.state == "UNREACHABLE":
            unreachable_since = unreachable_since if unreachable_since is not None else time.monotonic()
            if opts.once or (not opts.until_done and time.monotonic() - unreachable_since > opts.max_unreachable_s):
                return r
            wait(backoff, w)
            backoff = min(backoff * 2, 300.0)
            continue
        unreachable_since, backoff = None, opts.interval_s
        if opts.once:
            return r
        now = time.monotonic()
        failing = r.state in w.cfg.restart_on and not r.stop_requested
        failed_at = (now if failed_at is None else failed_at) if failing else None
        move = policy.next_move(r, w.restarts, verdicts.policy(w.cfg), failed_at, now)
        if move.kind == policy.GIVE_UP and move.refused and r.decided_by != HERE and not r.gave_up:
            # the supervisor decides, and has not given up: a restart of it may be under way (a job over several
            # hosts is restarted node by node), so its own word comes next; this watch ends on that word, not its own
            wait(opts.interval_s, w)
            continue
        if move.kind == policy.GIVE_UP:
            if move.refused and r.decided_by == HERE:
                say(f"not restarted: {move.why}")
                w.log_event({"decision": "no_restart", "after": r.state, "why": move.why})
            elif move.refused:  # the supervisor's decision, shown
                say(f"not restarted: {r.decided_why}")
            if w.unsaid:  # the refused restart's reason, in a last record of the same verdict (`--json` sees it)
                emit(w, r, w.record(r))
            return r
        if move.kind == policy.RESTART and r.decided_by == HERE:
            if not restart(w, r, say):
                if w.unsaid:
                    emit(w, r, w.record(r))
                return r
            failed_at = None
            continue
        # WAIT, or a restart that is the supervisor's to make: look again within one interval
        if move.wait_s is not None and r.decided_by == HERE and move.wait_s > 0:
            say(f"{r.state}: restarting in {move.wait_s:.0f} s (restart {w.restarts + 1} of {w.cfg.max_restarts})")
        wait(opts.interval_s if move.wait_s is None else min(opts.interval_s, max(move.wait_s, 0.05)), w)


def _warn_disk(w: Watcher, r: Report, opts: WatchOptions, say: Callable[[str], None]) -> None:
    warned = w.warnings()
    if warned and not w.disk_warned and r.state not in TERMINAL:
        w.disk_warned = True
        say(f"warning: {warned[0]}")
        w.log_event({"decision": "warning", "warning": warned[0]})
        if opts.notify and w.cfg.notify.webhook:
            n = w.cfg.notify
            msg = Message(w.job.id, w.job.host_name, "DISK_LOW", warned[0], [], ADVICE["DISK_FULL"], w.restarts,
                          time.time())  # fmt: skip
            say(post(n.webhook, msg, n.format, n.timeout_s, n.retries, job=w.job))
    elif not warned:
        w.disk_warned = False


def restart(w: Watcher, r: Report, say: Callable[[str], None]) -> bool:
    """One remote restart decided under the run dir's lock (control.restart). False when the remote refused it (a
    stop request, the budget spent, the disk still full); True when the job is running again, restarted by us or,
    raced, by another decider."""
    outcome = w.restart_remote(w.restarts, r.restart_cause())
    if not outcome.restarted and not outcome.raced:
        say(f"not restarted: {outcome.why}")
        w.log_event({"decision": "no_restart", "after": r.state, "why": outcome.why})
        return False
    w.restarts = outcome.restarts
    w.job = w.job.model_copy(update={"restarts": w.restarts, "pane_pid": outcome.pane_pid or w.job.pane_pid})
    registry.update(w.job.id, pane_pid=w.job.pane_pid, restarts=w.restarts, state="STARTING",
                    **({"slurm_job": outcome.slurm_job} if outcome.slurm_job else {}))  # fmt: skip
    by = "watch" if outcome.restarted else ELSEWHERE
    if outcome.raced:
        say(outcome.why)
    w.log_event({"decision": "restart", "attempt": w.restarts, "by": by, **r.restart_cause()})
    w.reset_after_restart()
    w.state = "STARTING"
    if outcome.restarted and w.cfg.notify.webhook:
        msg = Message(w.job.id, w.job.host_name, "RESTARTED", f"after {r.state}: {r.reason}", r.evidence[:3],
                      None, w.restarts, time.time(), False, max(0, w.cfg.max_restarts - w.restarts),
                      f"dflashctl status {w.job.id}")  # fmt: skip
        say(post(w.cfg.notify.webhook, msg, w.cfg.notify.format, w.cfg.notify.timeout_s, w.cfg.notify.retries,
                 job=w.job))
    return True


def notify(w: Watcher, v: Report, say: Callable[[str], None]) -> None:
    n = w.cfg.notify
    if n.bell and v.state in FAILURES:
        say("\a")
    if n.webhook and not paged_by_supervisor(v):
        msg = Message(w.job.id, w.job.host_name, v.state, v.reason, v.evidence, v.advice, w.restarts, time.time(),
                      v.state in FAILURES, max(0, w.cfg.max_restarts - w.restarts), f"dflashctl status {w.job.id}")
        line = post(n.webhook, msg, n.format, n.timeout_s, n.retries, job=w.job)
        w.log_event({"decision": "notify", "state": v.state, "result": line})
        say(line)
    elif n.webhook:  # said where the user looks: who pages, never the URL's path
        say(f"{v.state}: the job's supervisor pages {redact(n.webhook)}")


def paged_by_supervisor(r: Report) -> bool:
    """The job's supervisor pages the user itself (agent/outbox.py; what it could not send, this watch's polls
    send): a watch adds no notice of its own while one answers or ended with its job (a frozen one pages nothing:
    then this watch does)."""
    sup = r.supervisor
    if not isinstance(sup, dict):
        return False
    ended = str(sup.get("ended") or "")
    return bool(sup.get("answering")) or bool(ended and not ended.startswith("failed"))
