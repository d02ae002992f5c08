"""The watch loop: a poll at each interval (jobs/poller.py), the restart and notify policies, and what it says.

Every decision (state change, restart, notification) is appended to the local registry's events and to the run's
`events.jsonl` (carried by the next probe call, so that a poll stays one remote command).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from dflashctl.jobs import registry
from dflashctl.jobs.notify import Message, post, redact
from dflashctl.jobs.poller import (  # noqa: F401 - the poller's names, as callers of watch know them
    CONSEQUENCES,
    PEER_GRACE_S,
    NodesWatcher,
    PollRecord,
    Watcher,
    make_watcher,
    sparkline,
)
from dflashctl.judge.health import ADVICE, FAILURES, TERMINAL, Verdict
from dflashctl.judge.states import EXIT_BY_STATE  # noqa: F401 - re-exported for callers of watch


@dataclass
class WatchOptions:
    interval_s: float
    once: bool = False
    until_done: bool = False
    max_unreachable_s: float = 600.0
    notify: bool = True


def run(
    w: Watcher, opts: WatchOptions, emit: Callable[[Watcher, Verdict, PollRecord], None],
    wait: Callable[[float, Watcher], None] = lambda s, w: time.sleep(s), say: Callable[[str], None] = lambda s: None,
) -> Verdict:  # fmt: skip
    """Poll until the job reaches a final state (or once); apply the restart and notify policies. Returns the last
    verdict. Ctrl-C (KeyboardInterrupt) propagates to the caller: it stops the watching, never the job."""
    unreachable_since: float | None = None
    backoff = opts.interval_s
    while True:
        v = w.poll()
        while w.sent:  # notices the supervisor could not send, sent by this poll
            say(w.sent.pop(0))
        changed = v.state != w.state
        if changed:
            w.since = time.time()
            previous, w.state = w.state, v.state
            if v.state != "UNREACHABLE":
                registry.update(w.job.id, state=v.state, reason=v.reason, since=w.since, restarts=w.restarts)
            w.log_event({"decision": "state", "state": v.state, "previous": previous, "reason": v.reason,
                         "evidence": v.evidence[:5]})  # fmt: skip
            recovered = previous in (*FAILURES, "UNREACHABLE")
            if opts.notify and (v.state not in ("RUNNING", "STARTING", "STOPPING") or recovered):
                notify(w, v, say)
        v.since = w.since
        warned = w.warnings()
        if warned and not w.disk_warned and v.state not in TERMINAL:
            w.disk_warned = True
            say(f"warning: {warned[0]}")
            w.log_event({"decision": "warning", "warning": warned[0]})
            if opts.notify and w.cfg.notify.webhook:
                n = w.cfg.notify
                msg = Message(w.job.id, w.job.host_name, "DISK_LOW", warned[0], [], ADVICE["DISK_FULL"], w.restarts,
                              time.time())  # fmt: skip
                say(post(n.webhook, msg, n.format, n.timeout_s, n.retries))
        elif not warned:
            w.disk_warned = False
        emit(w, v, w.record(v))
        if v.state == "UNREACHABLE":
            unreachable_since = unreachable_since or time.time()
            if opts.once or (not opts.until_done and time.time() - unreachable_since > opts.max_unreachable_s):
                return v
            wait(backoff, w)
            backoff = min(backoff * 2, 300.0)
            continue
        unreachable_since, backoff = None, opts.interval_s
        if v.state in w.cfg.restart_on and not opts.once and w.history.stop_request is None:
            if w.restarts < w.cfg.max_restarts and restart(w, v, say, wait):
                continue
            if w.unsaid:  # the refused restart's reason, in a last record of the same verdict (`--json` sees it)
                emit(w, v, w.record(v))
            return v
        if opts.once or v.state in TERMINAL:
            return v
        wait(opts.interval_s, w)


def restart(w: Watcher, v: Verdict, say: Callable[[str], None], wait: Callable[[float, Watcher], None]) -> bool:
    """Backoff, then one remote restart decided under the run dir's lock (control.restart). False when the remote
    refused it (a stop request, the budget spent); True when the job is running again, restarted by us or by
    another watcher."""
    delay = w.cfg.backoff_s * (2**w.restarts)
    say(f"{v.state}: restarting in {delay:.0f} s (restart {w.restarts + 1} of {w.cfg.max_restarts})")
    wait(delay, w)
    outcome = w.restart_remote(w.restarts, v.state)
    if not outcome.restarted and "another watcher" not in outcome.why:
        say(f"not restarted: {outcome.why}")
        w.log_event({"decision": "no_restart", "after": v.state, "why": outcome.why})
        return False
    w.restarts = outcome.restarts
    w.job = w.job.model_copy(update={"restarts": w.restarts, "pane_pid": outcome.pane_pid or w.job.pane_pid})
    registry.update(w.job.id, pane_pid=w.job.pane_pid, restarts=w.restarts, state="STARTING",
                    **({"slurm_job": outcome.slurm_job} if outcome.slurm_job else {}))  # fmt: skip
    if outcome.restarted:
        w.log_event({"decision": "restart", "after": v.state, "attempt": w.restarts, "reason": v.reason,
                     "by": "watch"})  # fmt: skip
    else:
        say(outcome.why)
        w.log_event({"decision": "restart", "after": v.state, "attempt": w.restarts, "reason": v.reason,
                     "by": "elsewhere (the job's supervisor or another watcher)"})  # fmt: skip
    w.reset_after_restart()
    w.state = "STARTING"
    w.since = time.time()
    if outcome.restarted and w.cfg.notify.webhook:
        msg = Message(w.job.id, w.job.host_name, "RESTARTED", f"after {v.state}: {v.reason}", v.evidence[:3],
                      None, w.restarts, time.time())  # fmt: skip
        say(post(w.cfg.notify.webhook, msg, w.cfg.notify.format, w.cfg.notify.timeout_s, w.cfg.notify.retries))
    return True


def notify(w: Watcher, v: Verdict, say: Callable[[str], None]) -> None:
    n = w.cfg.notify
    if n.bell and v.state in FAILURES:
        say("\a")
    if n.webhook and not paged_by_supervisor(w):
        msg = Message(w.job.id, w.job.host_name, v.state, v.reason, v.evidence, v.advice, w.restarts, time.time(),
                      v.state in FAILURES, max(0, w.cfg.max_restarts - w.restarts), f"dflashctl status {w.job.id}")
        line = post(n.webhook, msg, n.format, n.timeout_s, n.retries, job=w.job)
        w.log_event({"decision": "notify", "state": v.state, "result": line})
        say(line)
    elif n.webhook:  # said where the user looks: who pages, never the URL's path
        say(f"{v.state}: the job's supervisor pages {redact(n.webhook)}")


def paged_by_supervisor(w: Watcher) -> bool:
    """The job's supervisor pages the user itself (agent/outbox.py; what it could not send, this watch's polls
    send): a watch adds no notice of its own while one is alive or ended with its job."""
    sup = w.supervisor
    if not isinstance(sup, dict):
        return False
    ended = str(sup.get("ended") or "")
    return bool(sup.get("alive")) or bool(ended and not ended.startswith("failed"))
