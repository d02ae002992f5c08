"""What a notification says and which decisions page: the webhook bodies (plain JSON, Slack, Discord, ntfy) and the
rule the job's supervisor pages by. Pure and stdlib only: the supervisor ships it to send from beside the job, and
`watch` and `status` send what it could not with the same bodies.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

QUIET = ("RUNNING", "STARTING", "STOPPING", "PENDING")  # states that page nobody


@dataclass
class Message:
    job: str
    host: str
    state: str
    reason: str
    evidence: list[str]
    advice: str | None
    restarts: int
    time: float
    failure: bool = True  # a failure pages at high priority (ntfy)
    restarts_left: int | None = None
    look: str = ""  # the command to look: `dflashctl status ID`
    id: str = ""  # the notice's id in the run dir's outbox: one notice, sent once whoever sends it
    extra: dict = field(default_factory=dict)

    @property
    def title(self) -> str:
        return f"{self.job}: {self.state}"

    def text(self) -> str:
        lines = [f"{self.job} on {self.host} is {self.state}: {self.reason}"]
        lines += [f"  {e}" for e in self.evidence[:5]]
        if self.restarts_left is not None:
            lines.append(f"restarts: {self.restarts} done, {self.restarts_left} left")
        if self.advice:
            lines.append(f"next: {self.advice}")
        if self.look:
            lines.append(f"look: {self.look}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        keys = ("job", "host", "state", "reason", "evidence", "advice", "restarts", "time", "failure",
                "restarts_left", "look", "id")  # fmt: skip
        return {k: getattr(self, k) for k in keys}

    @classmethod
    def of(cls, data: dict) -> Message:
        """A message read back from an outbox file (what another sender wrote): unknown keys ignored."""
        keys = ("job", "host", "state", "reason", "evidence", "advice", "restarts", "time", "failure",
                "restarts_left", "look", "id")  # fmt: skip
        return cls(**{k: data[k] for k in keys if k in data})


def body(msg: Message, fmt: str) -> tuple[bytes, dict[str, str]]:
    """The request body and headers for one of the supported webhook flavours."""
    if fmt == "slack":
        return json.dumps({"text": msg.text()}).encode(), {"Content-Type": "application/json"}
    if fmt == "discord":
        return json.dumps({"content": msg.text()[:1990]}).encode(), {"Content-Type": "application/json"}
    if fmt == "ntfy":  # ntfy publishes the body as the message; title and priority travel as headers
        headers = {
            "Title": msg.title,
            "Priority": "high" if msg.failure else "default",
            "Tags": "warning" if msg.failure else "white_check_mark",
            "Content-Type": "text/plain; charset=utf-8",
        }
        return msg.text().encode(), headers
    payload = {k: v for k, v in msg.to_dict().items() if k != "failure" and (v or k not in ("id", "look"))}
    return json.dumps(payload).encode(), {"Content-Type": "application/json"}


def pages(event: dict, restart_on: list[str], max_restarts: int, restarts: int) -> str | None:
    """The state a supervisor's decision pages the user with, or None. A failure it will restart pages once, as
    RESTARTED, when the restart is done; a failure nothing will restart pages as itself; a restart refused for a
    reason other than the spent budget (a full disk, a stop) pages as its failure; quiet states page nobody."""
    what = event.get("decision")
    if what == "state":
        state = event.get("state")
        if not isinstance(state, str) or state in QUIET:
            return None
        if state in restart_on and restarts < max_restarts:
            return None  # the restart (or its refusal) says it
        return state
    if what == "restart":
        return "RESTARTED"
    if what == "no_restart" and not str(event.get("why") or "").startswith("max_restarts"):
        return event.get("after") if isinstance(event.get("after"), str) else "NOT_RESTARTED"
    return None
