"""A queue on a busy host (`launch --queue`): a launch whose GPUs another job holds waits on the host for them,
first come first served, with no laptop attached. Part of the remote agent (stdlib only).

The launch writes the run dir and its `queue.json` (a ticket taken under the host-wide launch lock) and starts the
job's tmux session as any launch does; the pane's launcher finds the ticket and waits (agent/waiter.py): about
once a second it takes the host lock and asks what still stands between it and its GPUs (`starting.claims`: a
running job of ours holding one, a job queued before it that wants one, a process that is none of ours on one).
When nothing does, still under the lock, its ticket says `starting` (from then on every other launch counts its
GPUs as held) and the pane is respawned as the job's own launcher: a fresh process, so the job's attempt (its
startup budget, its progress history) begins when it leaves the queue, not when it joined. That launcher removes
the ticket once the job runs.

A stop request (`dflashctl kill`) is read under the same lock before a ticket leaves the queue: a killed job never
starts. The session's end (kill, a reboot) ends the waiter with it (SIGHUP), and a ticket whose session is gone is
no one's claim (only live sessions count).
"""

from __future__ import annotations

import contextlib
import json
import os
import time

from .common import STOP_REQUEST, WRAPPER_PID, append_text, read_int, read_json, write_atomic

QUEUE = "queue.json"  # in the run dir while the job waits for its GPUs (and, state `starting`, until it runs)
TICKETS = ".queue-tickets"  # in the workdir: the last ticket handed out, under the host lock
LAUNCH_LOCK = ".launch.lock"  # in the workdir: every launch's check-then-start, and every waiter's look
POLL_S = 1.0  # how often a waiter looks at who holds its GPUs
STOP_POLL_S = 0.2  # how often it looks for a stop request between those looks


def entry(run_dir: str) -> dict | None:
    """The run dir's ticket, or None: not queued, not a ticket of ours, or a job whose launcher has started (its
    `wrapper.pid`): the job can write its run dir, and a running job that wrote itself a ticket still holds its GPUs."""
    if os.path.lexists(os.path.join(run_dir, WRAPPER_PID)):
        return None
    q = read_json(os.path.join(run_dir, QUEUE), limit=1 << 16)
    if not isinstance(q, dict) or type(q.get("ticket")) is not int:
        return None
    gpus = q.get("gpus")
    if not isinstance(gpus, list) or not all(type(g) is int for g in gpus) or not isinstance(q.get("session"), str):
        return None
    return q


def waiting(q: dict | None) -> bool:
    """A ticket still in the queue (not yet leaving it: `starting` holds its GPUs as a running job does)."""
    return q is not None and q.get("state") != "starting"


def next_ticket(wd: str) -> int:
    """The next ticket of this host's queue (the caller holds the host lock)."""
    path = os.path.join(wd, TICKETS)
    n = (read_int(path) or 0) + 1
    write_atomic(path, f"{n}\n".encode())
    return n


def enqueue(run_dir: str, wd: str, req: dict, why: list[str], ahead: int) -> dict:
    """Put a just-made run dir in the queue (under the host lock): its ticket, what it waits for, its place."""
    body = {
        "ticket": next_ticket(wd),
        "state": "waiting",
        "since": round(time.time(), 3),
        "gpus": sorted(req["gpus"]),
        "waiting_for": why[:8],
        "position": ahead + 1,
        "job_id": req["job_id"],
        "name": req["name"],
        "session": req["session"],
        "tmux_socket": req.get("tmux_socket") or "dflashctl",
        "project": req.get("project"),
    }
    write_atomic(os.path.join(run_dir, QUEUE), json.dumps(body).encode())
    return body


def place(live: list[dict], ticket: int) -> int:
    """How many live jobs of this host queued before `ticket` (whatever GPUs they want): its place is this + 1."""
    n = 0
    for other in live:
        q = entry(other["run_dir"])
        if waiting(q) and q["ticket"] < ticket and not os.path.exists(os.path.join(other["run_dir"], STOP_REQUEST)):
            n += 1
    return n


def say(run_dir: str, line: str) -> None:
    """A line of ours in the job's train.log and its pane (what `logs` and `attach` show of the queue)."""
    text = f"[dflashctl] {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {line}\n"
    with contextlib.suppress(OSError, ValueError):
        print(text, end="", flush=True)
    with contextlib.suppress(OSError):
        append_text(os.path.join(run_dir, "train.log"), text)


def dequeue(run_dir: str) -> bool:
    """Take a job out of the queue (a kill): its ticket removed, so that no look counts it. True when it was queued."""
    q = entry(run_dir)
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(run_dir, QUEUE))
    return waiting(q)


def started(run_dir: str) -> None:
    """The job's launcher runs its command: the ticket has done its work."""
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(run_dir, QUEUE))
