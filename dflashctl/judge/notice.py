"""Pure: what a notice says, its stable id, and its webhook body (plain JSON, Slack, Discord, ntfy).

One notice per event: a failure and what is done about it are one notice ("CRASHED, restart 1 of 3 in 60 s",
"CRASHED, not restarted: CRASHED is not in restart_on"); a job's end (FINISHED, KILLED) is one notice. Its id is
made from the event itself (the job, the attempt, the state), never from a clock or a random number, so every
decider that sees the same event (the supervisor beside the job, a watch that took over, a `status`) makes the same
id: the run dir's outbox keeps one notice per id, and the receiver gets the id as an idempotency key.

Stdlib only: the supervisor ships it inside the agent. A message read back from the run dir (which the job can
write) goes through `Message.of`, which checks every field and returns None for anything else.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

EVIDENCE_LINES = 5
TEXT_MAX = 400  # one field of a message read back is cut here
ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,119}$")  # a notice id is a file name in the outbox


@dataclass
class Message:
    job: str  # the job's id, as every command names it
    host: str  # the job file's name for the host (`local`, `gpu`), never the remote's own hostname
    state: str
    reason: str
    evidence: list[str]
    advice: str | None
    restarts: int  # restarts done
    time: float  # the wall time of the look that saw the event (shown only)
    failure: bool = True  # a failure pages at high priority (ntfy)
    restarts_left: int = 0  # what the policy will really do for this state: 0 when it never restarts it
    look: str = ""  # the command to look: `dflashctl status ID`
    id: str = ""  # the notice's id (`a0-CRASHED`), the same whoever makes it
    action: str = ""  # what is done about it: `restart 1 of 3 in 60 s`, `not restarted: ...`, `finished`

    @property
    def delivery_id(self) -> str:
        """What the receiver may drop a repeat by (the Idempotency-Key header, the body's `id`)."""
        return f"{self.job}/{self.id}" if self.id else ""

    @property
    def headline(self) -> str:
        return f"{self.state}, {self.action}" if self.action else self.state

    @property
    def title(self) -> str:
        return f"{self.job}: {self.headline}"

    def text(self) -> str:
        lines = [f"{self.job} on {self.host}: {self.headline}", self.reason]
        lines += [f"  {e}" for e in self.evidence[:EVIDENCE_LINES]]
        lines.append(f"restarts: {self.restarts} done, {self.restarts_left} left")
        if self.advice:
            lines.append(f"next: {self.advice}")
        if self.look:
            lines.append(f"look: {self.look}")
        return "\n".join(line for line in lines if line)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in FIELDS}

    @classmethod
    def of(cls, data: object) -> Message | None:
        """A message read back (an outbox file the job could have written): every field checked and bounded; None
        when a required one is missing or of the wrong type."""
        if not isinstance(data, dict):
            return None
        text = {k: data.get(k) for k in ("job", "host", "state", "reason")}
        if not all(isinstance(v, str) and v for v in (text["job"], text["state"])):
            return None
        if not all(isinstance(v, str) for v in text.values()):
            return None
        when, done, left = data.get("time"), data.get("restarts"), data.get("restarts_left", 0)
        if not _number(when) or type(done) is not int or type(left) is not int:
            return None
        evidence = data.get("evidence") if isinstance(data.get("evidence"), list) else []
        nid = data.get("id") if isinstance(data.get("id"), str) and ID_RE.match(data["id"]) else ""
        advice = data.get("advice") if isinstance(data.get("advice"), str) else None
        return cls(
            job=text["job"][:TEXT_MAX],
            host=text["host"][:TEXT_MAX],
            state=text["state"][:40],
            reason=text["reason"][:TEXT_MAX],
            evidence=[str(e)[:TEXT_MAX] for e in evidence[:EVIDENCE_LINES] if isinstance(e, str)],
            advice=advice[:TEXT_MAX] if advice else None,
            restarts=max(0, done),
            time=float(when),
            failure=data.get("failure") is not False,
            restarts_left=max(0, left),
            look=_str(data.get("look")),
            id=nid,
            action=_str(data.get("action")),
        )


FIELDS = (
    "id",
    "job",
    "host",
    "state",
    "action",
    "reason",
    "evidence",
    "advice",
    "restarts",
    "restarts_left",
    "time",
    "failure",
    "look",
)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


def _str(v) -> str:
    return v[:TEXT_MAX] if isinstance(v, str) else ""


def notice_id(attempt: int | None, what: str) -> str:
    """`a<attempt>-<WHAT>` for an event of one attempt (its failure, a restart refused, a recovery), `end-<STATE>`
    for the job's end (attempt None)."""
    return f"a{attempt}-{what}" if attempt is not None else f"end-{what}"


def body(msg: Message, fmt: str) -> tuple[bytes, dict[str, str]]:
    """The request body and headers for one of the supported webhook flavours; every flavour carries the delivery
    id as `Idempotency-Key` (Stripe's name for it), and the plain JSON body has it as `id`."""
    key = {"Idempotency-Key": msg.delivery_id} if msg.delivery_id else {}
    if fmt == "slack":
        return json.dumps({"text": msg.text()}).encode(), {"Content-Type": "application/json", **key}
    if fmt == "discord":
        return json.dumps({"content": msg.text()[:1990]}).encode(), {"Content-Type": "application/json", **key}
    if fmt == "ntfy":  # ntfy publishes the body as the message; title and priority travel as headers
        headers = {
            "Title": msg.title,
            "Priority": "high" if msg.failure else "default",
            "Tags": "warning" if msg.failure else "white_check_mark",
            "Content-Type": "text/plain; charset=utf-8",
            **key,
        }
        return msg.text().encode(), headers
    payload = {k: v for k, v in msg.to_dict().items() if k != "failure" and (v or k not in ("id", "look", "action"))}
    if msg.delivery_id:
        payload["id"] = msg.delivery_id
    return json.dumps(payload).encode(), {"Content-Type": "application/json", **key}
