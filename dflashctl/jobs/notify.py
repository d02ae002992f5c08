"""Notifications: a JSON POST to a webhook (plain, Slack, Discord or ntfy bodies) and the terminal bell.

The webhook URL usually carries a secret (Slack and Discord put it in the path, ntfy topics are guessable names):
it is never printed; messages name it by scheme and host only.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from dflashctl.judge.facts import FAILURES
from dflashctl.model.jobfile import redact_url as redact  # one redaction for every output


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

    @property
    def title(self) -> str:
        return f"{self.job}: {self.state}"

    def text(self) -> str:
        lines = [f"{self.job} on {self.host} is {self.state}: {self.reason}"]
        lines += [f"  {e}" for e in self.evidence[:5]]
        if self.advice:
            lines.append(f"next: {self.advice}")
        return "\n".join(lines)


def body(msg: Message, fmt: str) -> tuple[bytes, dict[str, str]]:
    """The request body and headers for one of the supported webhook flavours."""
    if fmt == "slack":
        return json.dumps({"text": msg.text()}).encode(), {"Content-Type": "application/json"}
    if fmt == "discord":
        return json.dumps({"content": msg.text()[:1990]}).encode(), {"Content-Type": "application/json"}
    if fmt == "ntfy":  # ntfy publishes the body as the message; title and priority travel as headers
        high = msg.state in FAILURES
        headers = {
            "Title": msg.title,
            "Priority": "high" if high else "default",
            "Tags": "warning" if high else "white_check_mark",
            "Content-Type": "text/plain; charset=utf-8",
        }
        return msg.text().encode(), headers
    payload = {k: getattr(msg, k) for k in ("job", "host", "state", "reason", "evidence", "advice", "restarts", "time")}
    return json.dumps(payload).encode(), {"Content-Type": "application/json"}


def post(url: str, msg: Message, fmt: str = "json", timeout_s: float = 10.0, retries: int = 3) -> str:
    """Send with retries and backoff; returns a line for the user that never holds the URL's path."""
    import urllib.error  # with http.client, ssl and email: only a job that notifies pays for them
    import urllib.request

    data, headers = body(msg, fmt)
    delay, last = 1.0, ""
    for attempt in range(retries + 1):
        try:
            req = urllib.request.Request(url, data=data, headers=headers, method="POST")
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return f"notified {redact(url)} ({resp.status})"
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code}"
            if 400 <= e.code < 500 and e.code != 429:
                break  # the request itself is wrong: retrying will not help
        except (urllib.error.URLError, OSError) as e:
            last = type(getattr(e, "reason", e)).__name__
        except Exception as e:  # a URL the stdlib rejects late (ValueError, UnicodeError): never stop watch
            last = type(e).__name__
            break
        if attempt < retries:
            time.sleep(delay)
            delay *= 2
    return f"notification to {redact(url)} failed: {last}"
