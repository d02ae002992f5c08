"""The run dir's outbox: the notices a job's supervisor pages the user with, each sent exactly once whoever sends it.

A decision that pages (judge/notice.pages) becomes one file, `RUN/outbox/<id>.pending`, holding the message (made
from the snapshot's redacted evidence: no secret in it). Whoever sends it first claims it by renaming it to
`<id>.<claimer>.claim` (a rename succeeds once: a second sender finds no file), posts it, and renames the claim to
`<id>.sent`, or back to `.pending` when the post failed. The supervisor sends at once (stdlib urllib: the remote
needs outbound HTTP); what it cannot send waits, and the next `watch`, `status` or `ls --refresh` on the laptop
claims it through its snapshot and sends it. A claim whose claimer died (its pid and start time gone; a laptop's
claim older than LOCAL_CLAIM_S) goes back to pending. Every send is appended to `events.jsonl`. Part of the agent.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

from .common import append_jsonl, read_json, start_time, write_atomic

OUTBOX = "outbox"
LOCAL_CLAIM_S = 600.0  # a laptop that claimed a notice and vanished: after this long another sender takes it


def notice_module():
    """judge/notice.py: inside the zipapp it ships in the agent's package; from the source tree it is dflashctl's."""
    try:
        from .judge import notice
    except ImportError:
        from ..judge import notice
    return notice


def redact_url(url: str) -> str:
    from .common import redact_module

    return redact_module().redact_url(url)


def _dir(run_dir: str) -> str:
    return os.path.join(run_dir, OUTBOX)


def put(run_dir: str, message: dict) -> str:
    """One notice into the outbox (0600 in a 0700 dir); returns its id."""
    d = _dir(run_dir)
    with contextlib.suppress(FileExistsError):
        os.mkdir(d, 0o700)
    nid = f"{time.time_ns():020d}-{os.urandom(3).hex()}"
    write_atomic(os.path.join(d, f"{nid}.pending"), json.dumps({**message, "id": nid}).encode())
    return nid


def _listing(run_dir: str) -> list[str]:
    try:
        return sorted(os.listdir(_dir(run_dir)))
    except OSError:
        return []


def release_stale(run_dir: str, now: float | None = None) -> None:
    """Claims whose claimer is gone go back to pending: a supervisor's by its pid and start time, a laptop's by age."""
    now = time.time() if now is None else now
    for name in _listing(run_dir):
        if not name.endswith(".claim"):
            continue
        nid, who = name.split(".", 2)[:2]
        dead = False
        if who.startswith("p"):  # p<pid>_<start>: a process on this machine
            pid, _, start = who[1:].partition("_")
            dead = not pid.isdigit() or str(start_time(int(pid))) != start
        else:  # l<stamp>: a laptop's claim
            with contextlib.suppress(ValueError):
                dead = now - float(who[1:]) > LOCAL_CLAIM_S
        if dead:
            with contextlib.suppress(OSError):
                os.rename(os.path.join(_dir(run_dir), name), os.path.join(_dir(run_dir), f"{nid}.pending"))


def claim(run_dir: str, who: str) -> list[tuple[str, dict]]:
    """Every pending notice, claimed for `who` (oldest first): (claim file name, message)."""
    release_stale(run_dir)
    got = []
    for name in _listing(run_dir):
        if not name.endswith(".pending"):
            continue
        nid = name[: -len(".pending")]
        claimed = f"{nid}.{who}.claim"
        try:
            os.rename(os.path.join(_dir(run_dir), name), os.path.join(_dir(run_dir), claimed))
        except OSError:  # another sender took it first
            continue
        msg = read_json(os.path.join(_dir(run_dir), claimed))
        if isinstance(msg, dict):
            got.append((claimed, msg))
        else:  # garbage (a torn or hand-made file): set aside, never sent, never claimed again
            with contextlib.suppress(OSError):
                os.rename(os.path.join(_dir(run_dir), claimed), os.path.join(_dir(run_dir), f"{nid}.bad"))
    return got


def settle(run_dir: str, claimed: str, result: str, sent: bool, by: str) -> None:
    """A claimed notice sent (kept as `.sent`) or not (pending again); the send said in events.jsonl."""
    nid = claimed.split(".", 1)[0]
    after = os.path.join(_dir(run_dir), f"{nid}.{'sent' if sent else 'pending'}")
    try:
        os.rename(os.path.join(_dir(run_dir), claimed), after)
    except OSError:  # not ours to settle (gone, or released as stale meanwhile)
        return
    msg = read_json(after)
    state = msg.get("state") if isinstance(msg, dict) else None
    with contextlib.suppress(OSError):
        append_jsonl(os.path.join(run_dir, "events.jsonl"), [{"time": round(time.time(), 3), "by": by,
                     "decision": "notify" if sent else "notify_failed", "id": nid, "state": state,
                     "result": result}])  # fmt: skip


def post(url: str, message: dict, fmt: str = "json", timeout_s: float = 10.0, retries: int = 3) -> tuple[bool, str]:
    """Send one message with retries and backoff: (sent, a line that never holds the URL's path)."""
    import urllib.error  # with http.client and ssl: only a job that notifies pays for them
    import urllib.request

    data, headers = notice_module().body(notice_module().Message.of(message), fmt)
    delay, last = 1.0, ""
    for attempt in range(retries + 1):
        try:
            req = urllib.request.Request(url, data=data, headers=headers, method="POST")
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return True, f"notified {redact_url(url)} ({resp.status})"
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code}"
            if 400 <= e.code < 500 and e.code != 429:
                break  # the request itself is wrong: retrying will not help
        except (urllib.error.URLError, OSError) as e:
            last = type(getattr(e, "reason", e)).__name__
        except Exception as e:  # a URL the stdlib rejects late (ValueError, UnicodeError): never stop the watch
            last = type(e).__name__
            break
        if attempt < retries:
            time.sleep(delay)
            delay *= 2
    return False, f"notification to {redact_url(url)} failed: {last}"


def claim_for_laptop(run_dir: str) -> list[dict]:
    """A local `watch`/`status` asked for what waits: every pending notice, claimed in the laptop's name; it sends
    them and says how each went (`settle_for_laptop`)."""
    return [{"claim": c, "message": m} for c, m in claim(run_dir, f"l{int(time.time())}")]


def settle_for_laptop(req: dict) -> dict:
    """What the laptop says of the notices it claimed: each sent (kept) or not (pending again)."""
    run_dir = req.get("run_dir")
    done = 0
    for item in req.get("settled") or []:
        name = item.get("claim") if isinstance(item, dict) else None
        if not isinstance(run_dir, str) or not isinstance(name, str) or "/" in name or not name.endswith(".claim"):
            continue
        settle(run_dir, name, str(item.get("result") or ""), bool(item.get("sent")), "local")
        done += 1
    return {"settled": done}


def me() -> str:
    pid = os.getpid()
    return f"p{pid}_{start_time(pid)}"


def deliver(run_dir: str, notify: dict, by: str = "supervisor") -> list[str]:
    """Send every pending notice of the run dir through the job's webhook (`notify`: the job file's watch.notify);
    returns the lines said. Nothing is claimed without a webhook to send to."""
    url = notify.get("webhook") if isinstance(notify, dict) else None
    if not isinstance(url, str) or not url:
        return []
    said = []
    for claimed, msg in claim(run_dir, me()):
        sent, line = post(url, msg, str(notify.get("format") or "json"), float(notify.get("timeout_s") or 10.0),
                          int(notify.get("retries") if notify.get("retries") is not None else 3))  # fmt: skip
        settle(run_dir, claimed, line, sent, by)
        said.append(line)
    return said


def record(run_dir: str, event: dict, spec: dict, restarts: int, host: str = "") -> str | None:
    """The supervisor's decision, paged where it pages (judge/notice.pages): one notice into the outbox, then every
    pending one sent. Returns the notice's id, or None when the decision pages nobody or the job has no webhook."""
    notice = notice_module()
    watch = spec.get("watch") if isinstance(spec.get("watch"), dict) else {}
    notify = spec.get("notify") if isinstance(spec.get("notify"), dict) else {}
    if not notify.get("webhook"):
        return None
    restart_on = [s for s in watch.get("restart_on") or [] if isinstance(s, str)]
    most = int(watch.get("max_restarts") or 0)
    state = notice.pages(event, restart_on, most, restarts)
    if state is None:
        return None
    job = str(spec.get("job_id") or os.path.basename(run_dir))
    if event.get("decision") == "restart":
        reason = f"after {event.get('after')}: {event.get('reason')}"
    elif event.get("decision") == "no_restart":
        reason = f"not restarted: {event.get('why')}"
    else:
        reason = str(event.get("reason") or "")
    msg = notice.Message(job=job, host=host or os.uname().nodename, state=state, reason=reason,
                         evidence=[str(e) for e in event.get("evidence") or []][:5], advice=event.get("advice"),
                         restarts=restarts, time=round(time.time(), 3),
                         failure=state not in ("RESTARTED", "FINISHED", "KILLED"),
                         restarts_left=max(0, most - restarts), look=f"dflashctl status {job}")  # fmt: skip
    nid = put(run_dir, msg.to_dict())
    deliver(run_dir, notify)
    return nid
