"""The run dir's outbox: every notice of a job as a delivery, sent a bounded number of times in all whoever sends it,
and its delivery log. Part of the agent (stdlib only): the job's supervisor sends from beside the job, in a thread of
its own; what it cannot send (no outbound HTTP on the GPU host, a webhook down) waits for the next `watch`, `status`
or `ls --refresh` on the laptop, which claims it through its probe, sends it within its budget and says how it went.

One notice, one file: `RUN/outbox/<id>.json` holds the message (judge/notice.py, its id made from the event, so that
every decider that saw the event makes the same one: a second `put` of an id is a no-op) and its delivery: status
(pending, sending, sent, unconfirmed, failed), POSTs made, the claim, when it may be tried again, and a log of every
try (when, by whom, the answer, how long it took). Every change is made under the outbox's lock. A claim counts as a
POST before the request leaves (a sender that dies mid-request has spent it), and expires (`hold_s`); a request
whose body was sent but got no answer in time is `unconfirmed`, never repeated (a slow receiver would get it twice).
A 3xx is a failure, its location named; 4xx but 429 is final; 429, 5xx and no connection are tried again with
backoff until `max_posts`. The job can write this dir too: an outbox that is not a directory, a file that is not a
notice, is set aside and named, never fatal.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import threading
import time

from ..judge.notice import Message, body
from ..judge.redact import redact_url
from .common import (
    append_jsonl,
    locked,
    read_json,
    set_aside,
    start_time,
    write_atomic,
)

OUTBOX = "outbox"
LOCK = ".lock"
MAX_POSTS_CAP = 11  # whatever a notice file claims, never more POSTs than this
DEFAULT_POSTS = 4
RETRY_S = 10.0  # the first retry waits this long, each next one three times as long
FILES_MAX = 500  # notices read at most per listing (the job could fill the dir)
NAME = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]{0,119})\.json$")
FINAL = ("sent", "unconfirmed", "failed")


# ---------------------------------------------------------------------------------------------- the store


def _dir(run_dir: str, create: bool = False) -> str | None:
    """The outbox, when it is a real directory (a link or a file the job put there is set aside: None)."""
    d = os.path.join(run_dir, OUTBOX)
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        if not create:
            return None
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(d)
    import stat

    if not stat.S_ISDIR(st.st_mode):
        set_aside(d, "not a directory: no notice can be kept")
        return None
    return d


def _read(d: str, nid: str) -> dict | None:
    """A notice file as a delivery record, every field checked; None (set aside) for anything else."""
    raw = read_json(os.path.join(d, f"{nid}.json"), 256 << 10)
    msg = Message.of(raw.get("message")) if isinstance(raw, dict) else None
    if msg is None:
        return None
    posts, most = raw.get("posts"), raw.get("max_posts")
    status = raw.get("status") if raw.get("status") in ("pending", "sending", *FINAL) else "pending"
    claim = raw.get("claim") if isinstance(raw.get("claim"), dict) else None
    log = [e for e in raw.get("log") or [] if isinstance(e, dict)][-20:] if isinstance(raw.get("log"), list) else []
    return {
        "message": msg.to_dict(),
        "status": status,
        "posts": posts if type(posts) is int and posts >= 0 else 0,
        "max_posts": min(most, MAX_POSTS_CAP) if type(most) is int and most > 0 else DEFAULT_POSTS,
        "claim": claim,
        "next_at": _num(raw.get("next_at")),
        "created": _num(raw.get("created")),
        "url": raw.get("url") if isinstance(raw.get("url"), str) else None,
        "log": log,
    }


def _num(v) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v else 0.0


def _write(d: str, nid: str, rec: dict) -> None:
    write_atomic(os.path.join(d, f"{nid}.json"), json.dumps(rec, separators=(",", ":")).encode())


def _ids(d: str) -> list[str]:
    try:
        names = sorted(os.listdir(d))
    except OSError:
        return []
    return [m.group(1) for m in map(NAME.match, names[: FILES_MAX * 2]) if m][:FILES_MAX]


def put(run_dir: str, message: dict, max_posts: int = DEFAULT_POSTS, now: float | None = None) -> bool:
    """One notice into the outbox (0600 in a 0700 dir), once: False when a notice of its id is there already (made
    by another decider that saw the same event) or the message is not a notice."""
    msg = Message.of(message)
    if msg is None or not msg.id:
        return False
    d = _dir(run_dir, create=True)
    if d is None:
        return False
    with locked(os.path.join(d, LOCK), timeout=10.0):
        path = os.path.join(d, f"{msg.id}.json")
        if os.path.lexists(path):
            return False
        rec = {
            "message": msg.to_dict(),
            "status": "pending",
            "posts": 0,
            "max_posts": max(1, min(int(max_posts), MAX_POSTS_CAP)),
            "claim": None,
            "next_at": 0.0,
            "created": round(time.time() if now is None else now, 3),
            "log": [],
        }
        _write(d, msg.id, rec)
    return True


def _claimer_gone(claim: dict, now: float) -> bool:
    """A claim whose claimer is gone: a process of this machine by its pid and start time, any claim by its hold."""
    until = claim.get("until")
    if not isinstance(until, (int, float)) or isinstance(until, bool) or now > until:
        return True
    who = claim.get("by")
    if isinstance(who, str) and who.startswith("p"):
        pid, _, start = who[1:].partition("_")
        return not pid.isdigit() or str(start_time(int(pid))) != start
    return not isinstance(who, str)


def claim(
    run_dir: str, who: str, hold_s: float, limit: int = 8, now: float | None = None, another_route: bool = False
) -> list[tuple[str, dict]]:
    """Notices ready to send (pending, their retry time come, POSTs left), oldest first, at most `limit`, claimed
    for `who` for `hold_s` seconds: (id, message) each. The claim counts as one POST. A claim whose claimer is gone
    goes back to pending (its POST spent); a file that is not a notice is set aside (renamed `.bad`).
    `another_route`: the laptop, which may reach a webhook the GPU host cannot: it need not wait out the backoff
    the supervisor's own tries keep (the POSTs stay bounded)."""
    d = _dir(run_dir)
    if d is None:
        return []
    now = time.time() if now is None else now
    got = []
    with locked(os.path.join(d, LOCK), timeout=10.0):
        for nid in _ids(d):
            rec = _read(d, nid)
            if rec is None:  # not a notice: set aside, never sent, never read again
                set_aside(os.path.join(d, f"{nid}.json"), "not a notice (set aside as .bad)")
                with contextlib.suppress(OSError):
                    os.rename(os.path.join(d, f"{nid}.json"), os.path.join(d, f"{nid}.bad"))
                continue
            if rec["status"] == "sending" and _claimer_gone(rec["claim"] or {}, now):
                rec["status"] = "pending" if rec["posts"] < rec["max_posts"] else "failed"
                rec["log"].append(
                    {
                        "time": round(now, 3),
                        "by": str((rec["claim"] or {}).get("by")),
                        "result": "no word from its sender (gone, or past its deadline)",
                    }
                )
                rec["claim"], rec["next_at"] = None, now
                _write(d, nid, rec)
            if len(got) >= limit or rec["status"] != "pending" or (rec["next_at"] > now and not another_route):
                continue
            if rec["posts"] >= rec["max_posts"]:
                rec["status"] = "failed"
                _write(d, nid, rec)
                continue
            rec["status"], rec["posts"] = "sending", rec["posts"] + 1
            rec["claim"] = {"by": who, "until": round(now + hold_s, 3)}
            _write(d, nid, rec)
            got.append((nid, rec["message"]))
    return got


def settle(run_dir: str, nid: str, who: str, result: dict, by: str, now: float | None = None) -> str | None:
    """What came of a claimed notice's POST (`result`: post_once's): sent, unconfirmed, failed for good, or pending
    again after a backoff. Said in the delivery log and in events.jsonl. Returns its new status (None: not ours)."""
    d = _dir(run_dir)
    if d is None or not isinstance(nid, str) or not NAME.match(f"{nid}.json"):
        return None
    now = time.time() if now is None else now
    line = str(result.get("result") or "")[:300]
    with locked(os.path.join(d, LOCK), timeout=10.0):
        rec = _read(d, nid)
        if rec is None or rec["status"] != "sending" or (rec["claim"] or {}).get("by") != who:
            return None  # released as stale meanwhile, or someone else's
        if result.get("ok"):
            rec["status"] = "sent"
        elif result.get("unconfirmed"):
            rec["status"] = "unconfirmed"
        elif result.get("final") or rec["posts"] >= rec["max_posts"]:
            rec["status"] = "failed"
        else:
            rec["status"], rec["next_at"] = "pending", round(now + RETRY_S * 3 ** (rec["posts"] - 1), 3)
        rec["claim"] = None
        rec["log"] = [
            *rec["log"],
            {"time": round(now, 3), "by": by, "result": line, "code": result.get("code"), "ms": result.get("ms")},
        ][-20:]
        if isinstance(result.get("url"), str):
            rec["url"] = result["url"]
        _write(d, nid, rec)
        status = rec["status"]
    with contextlib.suppress(OSError):
        append_jsonl(
            os.path.join(run_dir, "events.jsonl"),
            [
                {
                    "time": round(now, 3),
                    "by": by,
                    "decision": "notify" if status in ("sent", "unconfirmed") else "notify_failed",
                    "id": nid,
                    "state": rec["message"].get("state"),
                    "status": status,
                    "result": line,
                }
            ],
        )
    return status


def listing(run_dir: str) -> list[dict]:
    """Every notice and its delivery, oldest first (for `dflashctl notices` and the counts `status` says)."""
    d = _dir(run_dir)
    if d is None:
        return []
    out = []
    for nid in _ids(d):
        rec = _read(d, nid)
        if rec is not None:
            out.append(
                {
                    "id": nid,
                    **{k: rec[k] for k in ("status", "posts", "max_posts", "created", "url", "log")},
                    "state": rec["message"]["state"],
                    "action": rec["message"]["action"],
                    "reason": rec["message"]["reason"],
                }
            )
    return out


def counts(run_dir: str) -> dict:
    """How many notices wait (pending or being sent), failed, went out."""
    c = {"waiting": 0, "failed": 0, "sent": 0, "unconfirmed": 0}
    for n in listing(run_dir):
        c["waiting" if n["status"] in ("pending", "sending") else n["status"]] += 1
    return c


# ---------------------------------------------------------------------------------------------- one POST


def _target(url: str) -> tuple[str, str, int, str, dict]:
    """(scheme, host, port, path with query, headers): credentials in the URL become an Authorization header and
    leave the URL."""
    from urllib.parse import unquote, urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("not an http(s) URL with a host")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    headers = {}
    if parts.username is not None or parts.password is not None:
        pair = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}".encode()
        headers["Authorization"] = "Basic " + base64.b64encode(pair).decode()
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return parts.scheme, parts.hostname, port, path, headers


def _connection(scheme: str, host: str, port: int, path: str, timeout: float):
    """An http.client connection (through the environment's proxy, as urllib would take it) and the request path."""
    import http.client
    import urllib.request

    proxy = None if urllib.request.proxy_bypass(host) else urllib.request.getproxies().get(scheme)
    cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
    if not proxy:
        return cls(host, port, timeout=timeout), path
    from urllib.parse import urlsplit

    p = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    if scheme == "https":  # a CONNECT tunnel through the proxy
        conn = cls(p.hostname, p.port or 8080, timeout=timeout)
        conn.set_tunnel(host, port)
        return conn, path
    return http.client.HTTPConnection(p.hostname, p.port or 8080, timeout=timeout), f"http://{host}:{port}{path}"


def post_once(url: str, message: dict, fmt: str = "json", timeout_s: float = 10.0) -> dict:
    """One POST of one notice, no redirect followed, within `timeout_s` as a whole (a receiver that drips its answer
    is cut at the deadline: the connection is closed from here). Returns {ok, unconfirmed, final, code, ms, result,
    url}; `result` names the URL as `scheme://host:port/***` only."""
    shown = redact_url(url)
    t0 = time.monotonic()
    out: dict = {"ok": False, "unconfirmed": False, "final": False, "code": None, "url": shown}
    try:
        msg = Message.of(message)
        if msg is None:
            raise ValueError("not a notice")
        data, headers = body(msg, fmt)
        scheme, host, port, path, auth = _target(url)
    except (ValueError, UnicodeError) as e:
        return {**out, "final": True, "ms": 0, "result": f"not sent to {shown}: {e}"}
    box: dict = {}

    def work() -> None:
        box["stage"] = "connect"
        try:
            conn, target = _connection(scheme, host, port, path, timeout_s)
            box["conn"] = conn
            conn.connect()
            box["stage"] = "send"
            conn.request("POST", target, body=data, headers={**headers, **auth, "User-Agent": "dflashctl"})
            box["stage"] = "answer"
            resp = conn.getresponse()
            resp.read(1 << 16)
            box["code"], box["location"] = resp.status, resp.getheader("Location")
        except Exception as e:  # every failure is a delivery's answer, never the caller's crash
            box["error"] = e
        finally:
            with contextlib.suppress(Exception):
                box["conn"].close()

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    worker.join(timeout_s)
    out["ms"] = int((time.monotonic() - t0) * 1000)
    if worker.is_alive():  # past the deadline: cut it; whether the body arrived is unknown past the send
        with contextlib.suppress(Exception):
            box["conn"].close()
        sent = box.get("stage") == "answer"
        return {
            **out,
            "unconfirmed": sent,
            "result": f"no answer from {shown} in {timeout_s:g} s"
            + (" after the request was sent (unconfirmed, not repeated)" if sent else ""),
        }
    if "error" in box:
        err, stage = box["error"], box.get("stage")
        what = type(getattr(err, "reason", err)).__name__
        if stage == "answer":  # the body went out; the answer did not come
            return {
                **out,
                "unconfirmed": True,
                "result": f"no answer from {shown} after the request was sent ({what}): unconfirmed, not repeated",
            }
        return {**out, "result": f"not delivered to {shown}: {what} at {stage}"}
    code = box["code"]
    out["code"] = code
    if 200 <= code < 300:
        return {**out, "ok": True, "result": f"delivered to {shown} ({code})"}
    if 300 <= code < 400:
        where = redact_url(box["location"]) if box.get("location") else "nowhere"
        return {
            **out,
            "final": True,
            "result": f"not delivered: {shown} redirected ({code}) to {where}; redirects are not followed",
        }
    return {**out, "final": 400 <= code < 500 and code != 429, "result": f"not delivered to {shown}: HTTP {code}"}


# ---------------------------------------------------------------------------------------------- senders


def me() -> str:
    pid = os.getpid()
    return f"p{pid}_{start_time(pid)}"


def posts_of(notify: dict) -> int:
    """POSTs a notice may take in all (the job file's `retries` + 1)."""
    retries = notify.get("retries") if isinstance(notify, dict) else None
    return (retries if type(retries) is int and retries >= 0 else DEFAULT_POSTS - 1) + 1


class Sender:
    """The supervisor's sending, in a thread of its own: a decision or a look never waits on a webhook. `poke`
    after a put; `flush` at the end sends what is ready within a budget."""

    def __init__(self, run_dir: str, notify: dict) -> None:
        self.run, self.url = run_dir, str(notify.get("webhook") or "")
        self.fmt = str(notify.get("format") or "json")
        t = notify.get("timeout_s")
        self.timeout = float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t <= 120 else 10.0
        self.who = me()
        self.wake = threading.Event()
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="dflashctl-sender", daemon=True)

    def start(self) -> None:
        if self.url:
            self.thread.start()

    def poke(self) -> None:
        self.wake.set()

    def send_ready(self) -> int:
        sent = 0
        for nid, msg in claim(self.run, self.who, self.timeout + 5.0):
            settle(self.run, nid, self.who, post_once(self.url, msg, self.fmt, self.timeout), "supervisor")
            sent += 1
        return sent

    def _loop(self) -> None:
        while not self.stopping:
            try:
                self.send_ready()
            except Exception:  # a store the job broke: said by the next look (set aside), never the sender's end
                pass
            self.wake.wait(5.0)
            self.wake.clear()

    def flush(self, budget_s: float, beat=lambda: None) -> None:
        """The job ended: what is ready goes out now, within `budget_s` (`beat` between sends: the supervisor is
        still answering); what is not waits for the laptop."""
        self.stopping = True
        self.wake.set()
        deadline = time.monotonic() + budget_s
        if self.thread.is_alive():
            self.thread.join(budget_s)
        while self.url and time.monotonic() + self.timeout <= deadline:
            beat()
            try:
                if not self.send_ready():
                    return
            except Exception:
                return


def deliver_all(run_dir: str, notify: dict, by: str = "supervisor") -> int:
    """Send every ready notice now (a one-shot sender); how many were tried."""
    s = Sender(run_dir, notify)
    return s.send_ready() if s.url else 0


# ---------------------------------------------------------------------------------------------- the laptop's side


def laptop_claim(run_dir: str, req: dict) -> dict:
    """A local `watch`/`status` puts the notices its decider made, then claims what is ready for it to send (at most
    `limit`, held `hold_s`): {notices: [{id, message}], claimer, counts}."""
    put_ok = 0
    for m in req.get("put_notices") or []:
        with contextlib.suppress(OSError):
            put_ok += bool(put(run_dir, m, int(req.get("max_posts") or DEFAULT_POSTS)))
    who = f"l{int(time.time())}-{os.urandom(3).hex()}"
    got = []
    if req.get("claim_notices"):
        with contextlib.suppress(OSError):
            got = claim(run_dir, who, float(req.get("hold_s") or 15.0), int(req.get("limit") or 8), another_route=True)
    return {
        "notices": [{"id": n, "message": m} for n, m in got],
        "claimer": who,
        "put": put_ok,
        "counts": counts(run_dir),
    }


def laptop_settle(req: dict) -> dict:
    """What the laptop says of the notices it claimed: each settled as post_once answered (or unknown: its budget
    ran out first; then the claim's hold ends it)."""
    run_dir, who = req.get("run_dir"), req.get("claimer")
    done = 0
    for item in req.get("settled") or []:
        if not isinstance(run_dir, str) or not isinstance(who, str) or not isinstance(item, dict):
            continue
        result = item.get("result") if isinstance(item.get("result"), dict) else {}
        with contextlib.suppress(OSError):
            done += settle(run_dir, str(item.get("id")), who, result, "local") is not None
    return {"settled": done, "counts": counts(run_dir) if isinstance(run_dir, str) else {}}
