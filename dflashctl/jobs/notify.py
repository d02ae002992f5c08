"""Notifications from the laptop: a JSON POST to a webhook (plain, Slack, Discord or ntfy bodies, judge/notice.py)
and the terminal bell; and the notices the job's supervisor could not send, which wait in the run dir's outbox
(agent/outbox.py) until a `watch` or `status` claims them through its snapshot and sends them here, once.

The webhook URL usually carries a secret (Slack and Discord put it in the path, ntfy topics are guessable names):
it is never printed; messages name it by scheme and host only. A message's text is redacted with the job file's
secrets before it leaves (the remote's snapshot already masked them: this is the second lock on the door).
"""

from __future__ import annotations

from dflashctl.agent import outbox
from dflashctl.jobs.secrets import redactor
from dflashctl.judge.notice import Message, body  # noqa: F401 - the bodies' home; callers know them here
from dflashctl.judge.redact import redact_url as redact  # one redaction for every output  # noqa: F401
from dflashctl.model.record import JobRecord


def post(url: str, msg: Message, fmt: str = "json", timeout_s: float = 10.0, retries: int = 3,
         job: JobRecord | None = None) -> str:  # fmt: skip
    """Send with retries and backoff (the agent's own sender); returns a line for the user that never holds the
    URL's path. With `job`, the message is redacted with its job file's secrets first."""
    data = msg.to_dict()
    if job is not None:
        data = redactor(job).deep(data)
    return outbox.post(url, data, fmt, timeout_s, retries)[1]


def claim_request(job: JobRecord) -> dict:
    """What a snapshot request adds to claim the notices waiting in the run dir: only a job with a webhook here."""
    return {"claim_notices": True} if job.watch.notify.webhook else {}


def deliver_claimed(runner, job: JobRecord, snap: dict, call) -> list[str]:
    """Send the notices this snapshot claimed (the supervisor could not), then tell the remote how each went, in
    one more call: a sent one is never sent again, a failed one waits for the next sender."""
    claimed = [n for n in snap.get("notices") or [] if isinstance(n, dict) and isinstance(n.get("message"), dict)]
    n = job.watch.notify
    if not claimed or not n.webhook:
        return []
    said, settled = [], []
    clean = redactor(job)
    for item in claimed:
        # one try, briefly: a webhook that is down must not hold up a `status` or a watch's poll; it waits again
        sent, line = outbox.post(n.webhook, clean.deep(item["message"]), n.format, min(n.timeout_s, 5.0), 0)
        said.append(line)
        settled.append({"claim": item.get("claim"), "sent": sent, "result": line})
    call(runner, {"action": "notices_settled", "run_dir": job.run_dir, "settled": settled, "gpus": False})
    return said


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
