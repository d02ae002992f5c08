"""The watch loop: a turn of the job's Decider at each interval (jobs/poller.py looks, judge/decider.py decides), the
restart it asks for when this watch decides, and what it says.

The supervisor beside the job decides; a watch reads. Where a live supervisor answers (its heartbeat moves), the
decider follows its word and this watch never restarts or pages by itself; where none does (`supervise: false`, a
supervisor dead, frozen, or one that cannot reach a node), the same decider decides here and says so. Every interval
and backoff is measured on this process's monotonic clock; wall stamps are only shown.

Every decision is appended to the local registry's events and to the run's `events.jsonl` (carried by the next
probe call, so that a poll stays one remote command); its notices go to the run dir's outbox and out from there.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from dflashctl.jobs import notify, registry
from dflashctl.jobs.poller import (  # noqa: F401 - the poller's names, as callers of watch know them
    CONSEQUENCES,
    ELSEWHERE,
    PEER_GRACE_S,
    PollRecord,
    Watcher,
    make_watcher,
    seen_restarted,
    sparkline,
)
from dflashctl.judge import policy
from dflashctl.judge.decider import HAND_OVER, QUIET
from dflashctl.judge.facts import EXIT_BY_STATE, FAILURES, TERMINAL  # noqa: F401 - EXIT_BY_STATE re-exported
from dflashctl.judge.notice import Message
from dflashctl.judge.report import HERE, SUPERVISOR, Report


@dataclass
class WatchOptions:
    interval_s: float
    once: bool = False
    until_done: bool = False
    max_unreachable_s: float = 600.0
    notify: bool = True


def run(
    w: Watcher,
    opts: WatchOptions,
    emit: Callable[[Watcher, Report, PollRecord], None],
    wait: Callable[[float, Watcher], None] = lambda s, w: time.sleep(s),
    say: Callable[[str], None] = lambda s: None,
) -> Report:
    """Poll until the job reaches a final state (or once); restart where this watch decides. Returns the last
    report. Ctrl-C (KeyboardInterrupt) propagates to the caller: it stops the watching, never the job."""
    unreachable_since: float | None = None  # time.monotonic()
    backoff = opts.interval_s
    decider = None
    while True:
        turn = w.turn()
        r = turn.report
        while w.sent:  # what this watch's sends came to
            say(w.sent.pop(0))
        if r.state != w.state:
            previous, w.state = w.state, r.state
            if r.state != "UNREACHABLE":
                registry.update(
                    w.job.id,
                    state=r.state,
                    reason=r.reason,
                    since=time.time(),
                    restarts=w.restarts,
                    progress=r.progress(),
                )
            if opts.notify and w.cfg.notify.bell and r.state in FAILURES:
                say("\a")
            if r.state == "UNREACHABLE" and previous is not None and opts.notify:
                page_unreachable(w, r, say)
            elif r.decided_by == SUPERVISOR and w.cfg.notify.webhook and r.state not in QUIET:  # said, not sent
                say(f"{r.state}: the job's supervisor pages {notify.redact(w.cfg.notify.webhook)}")
        if r.state != "UNREACHABLE" and r.decided_by != decider:
            decider = r.decided_by
            if decider == HERE and r.supervisor is not None and r.state not in TERMINAL:  # taking over: said once
                say(r.decided_why)
                w.log_event({"decision": "warning", "warning": r.decided_why})
        for line in turn.says:
            say(line)
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
        move = turn.move
        if move.kind in (policy.GIVE_UP, HAND_OVER):
            if w.unsaid:  # the refused restart's reason, in a last record of the same verdict (`--json` sees it)
                emit(w, r, w.record(r))
            return r
        if move.kind == policy.RESTART:
            after = w.decider.restarted(w.restart_remote(turn.restart))
            w.absorb(after)
            for line in after.says:
                say(line)
            if after.gave_up is not None:
                if w.unsaid:
                    emit(w, after.report, w.record(after.report))
                return after.report
            w.state = "STARTING"
            continue
        # WAIT, or a restart that is the supervisor's to make: look again within one interval
        wait(opts.interval_s if move.wait_s is None else min(opts.interval_s, max(move.wait_s, 0.05)), w)


def page_unreachable(w: Watcher, r: Report, say: Callable[[str], None]) -> None:
    """The host stopped answering: only this laptop can know, so only it pages (no outbox there to keep it)."""
    if not w.cfg.notify.webhook:
        return
    msg = Message(
        job=w.job.id,
        host=w.job.host_name,
        state="UNREACHABLE",
        reason=r.reason,
        evidence=list(r.evidence[:5]),
        advice=r.advice,
        restarts=w.restarts,
        time=time.time(),
        look=f"dflashctl status {w.job.id}",
        id=f"unreachable-{int(time.time())}",
        action="the job's last known state is kept",
    )
    line = notify.post_direct(w.job, msg)
    w.log_event({"decision": "notify", "state": "UNREACHABLE", "result": line})
    say(line)
