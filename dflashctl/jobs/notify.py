"""Notices from the laptop, as deliveries: what a local decider made is put into the run dir's outbox (one notice per
id, whoever else made it), and what waits there (the supervisor could not send it) is claimed by the probe, sent from
here within a total budget, and settled in the outbox's delivery log (agent/outbox.py). A notice is POSTed a bounded
number of times in all, whoever sends it.

The webhook URL usually carries a secret (Slack and Discord put it in the path, ntfy topics are guessable names):
it is never printed; results name it as `scheme://host:port/***`. A message is redacted with the job file's secrets
before it leaves (the remote's snapshot already masked them: this is the second lock on the door).
"""

from __future__ import annotations

import threading
import time

from dflashctl.agent import outbox
from dflashctl.jobs.secrets import redactor
from dflashctl.judge.notice import Message, body  # noqa: F401 - the bodies' home; callers know them here
from dflashctl.judge.redact import redact_url as redact  # one redaction for every output  # noqa: F401
from dflashctl.model.record import JobRecord

SEND_BUDGET_S = 1.5  # what sending adds to a `status` or a watch's poll, whatever the webhook does
CLAIM_LIMIT = 8  # notices one command claims at most (the rest wait for the next)


def claim_request(job: JobRecord, put: list[Message] | None = None) -> dict:
    """What a probe request adds to put this decider's notices and claim what waits: only a job with a webhook."""
    n = job.watch.notify
    if not n.webhook:
        return {}
    clean = redactor(job)
    return {
        "claim_notices": True,
        "put_notices": [clean.deep(m.to_dict()) for m in put or []],
        "max_posts": n.retries + 1,
        "hold_s": SEND_BUDGET_S + 10.0,
        "limit": CLAIM_LIMIT,
    }


def send(job: JobRecord, claimed: list[dict], budget_s: float = SEND_BUDGET_S) -> list[dict]:
    """POST every claimed notice at once, each within what is left of `budget_s`: (id, post_once's result) each.
    The probe answered first; nothing here holds up a look for longer than the budget."""
    n = job.watch.notify
    clean = redactor(job)
    items = [c for c in claimed if isinstance(c, dict) and isinstance(c.get("message"), dict)]
    results: list[dict] = [{} for _ in items]
    timeout = max(0.2, min(n.timeout_s, budget_s))

    def one(i: int) -> None:
        results[i] = outbox.post_once(n.webhook or "", clean.deep(items[i]["message"]), n.format, timeout)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(items))]
    for t in threads:
        t.start()
    end = time.monotonic() + budget_s + 0.5
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    late = {
        "result": f"no answer from {redact(n.webhook or '')} within this command's {budget_s:g} s",
        "unconfirmed": True,
    }
    return [{"id": item.get("id"), "result": res or late} for item, res in zip(items, results, strict=True)]


def deliver_claimed(runner, job: JobRecord, answer: dict, call, budget_s: float = SEND_BUDGET_S) -> tuple[list, dict]:
    """Send what a probe claimed (`answer`: its `notices`), then tell the remote how each went, in one more call: a
    sent one is never sent again, a failed one waits for the next sender (until its POSTs are spent). Returns the
    lines to say and the outbox's counts after ({} when nothing was claimed)."""
    got = answer.get("notices") if isinstance(answer, dict) else None
    claimed = got.get("notices") if isinstance(got, dict) else None
    if not claimed or not job.watch.notify.webhook:
        return [], {}
    settled = send(job, claimed, budget_s)
    ans = call(
        runner,
        {
            "action": "notices_settled",
            "run_dir": job.run_dir,
            "claimer": got.get("claimer"),
            "settled": settled,
            "gpus": False,
        },
    )
    counts = ans.get("counts") if isinstance(ans, dict) and isinstance(ans.get("counts"), dict) else {}
    return [str(s["result"].get("result") or "") for s in settled], counts


def waiting(answer: dict) -> dict:
    """The outbox's counts a probe or a settle brought back ({} when none)."""
    got = answer.get("notices") if isinstance(answer, dict) else None
    counts = got.get("counts") if isinstance(got, dict) else None
    return counts if isinstance(counts, dict) else {}


def post_direct(job: JobRecord, msg: Message, budget_s: float = SEND_BUDGET_S) -> str:
    """A notice only the laptop can know (its host does not answer): one POST from here, no outbox to keep it."""
    n = job.watch.notify
    if not n.webhook:
        return ""
    res = outbox.post_once(n.webhook, redactor(job).deep(msg.to_dict()), n.format, min(n.timeout_s, budget_s))
    return str(res.get("result") or "")


def needs_scrub(job: JobRecord, state: str, snap: dict) -> bool:
    """No supervisor keeps this job (`supervise: false`, or one that is gone) and a local look judged it ended for
    good: no restart follows (a final state outside `restart_on`, or the restart budget spent), while its secrets
    are still at rest in the run dir. Then the caller has the remote scrub them (the `scrub` action), once."""
    from dflashctl.judge.facts import TERMINAL

    sup = snap.get("supervisor")
    if not snap.get("secrets_at_rest") or (isinstance(sup, dict) and sup.get("alive")) or state not in TERMINAL:
        return False
    restarts = snap.get("restarts") if isinstance(snap.get("restarts"), int) else job.restarts
    return state == "FINISHED" or state not in job.watch.restart_on or restarts >= job.watch.max_restarts
