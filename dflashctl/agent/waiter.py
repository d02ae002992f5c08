"""The queued job's pane (agent/queue.py): it waits for its GPUs under the host-wide launch lock, then respawns
itself as the job's own launcher. Part of the remote agent (stdlib only)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from .common import STOP_REQUEST, LockTimeout, locked, write_atomic
from .procs import TMUX, _run
from .queue import LAUNCH_LOCK, POLL_S, QUEUE, STOP_POLL_S, entry, place, say
from .starting import claims, our_live_jobs, pane_command


def _stop_asked(run_dir: str) -> bool:
    return os.path.exists(os.path.join(run_dir, STOP_REQUEST))


def _look(run_dir: str, q: dict) -> list[str] | None:
    """Under the host lock: what still holds the job's GPUs (the ticket updated when that changed), or None when
    nothing does, and then the ticket says `starting`. A stop request found here: [] (the caller ends)."""
    wd = os.path.dirname(os.path.dirname(os.path.abspath(run_dir)))  # <workdir>/runs/<id>
    with locked(os.path.join(wd, LAUNCH_LOCK), timeout=600.0):
        if _stop_asked(run_dir):
            return []
        live = our_live_jobs(wd)
        req = {"job_id": q["job_id"], "name": q["name"], "gpus": q["gpus"], "project": q.get("project")}
        found, _ = claims(req, wd, live, ticket=q["ticket"])
        why = [what for _, what in found]
        if not why:
            write_atomic(
                os.path.join(run_dir, QUEUE),
                json.dumps({**q, "state": "starting", "waiting_for": [], "left_at": round(time.time(), 3)}).encode(),
            )
            return None
        ahead = place(live, q["ticket"])
        if why != q.get("waiting_for") or ahead + 1 != q.get("position"):
            q.update(waiting_for=why[:8], position=ahead + 1)
            write_atomic(os.path.join(run_dir, QUEUE), json.dumps(q).encode())
        return why


def wait_then_start(run_dir: str) -> bool:
    """The queued job's pane: wait for the GPUs, then respawn the pane as the job's launcher. Returns only when the
    launcher should start the job from this very process (the respawn failed): True; False when it must end
    (a stop request, a ticket that is not ours)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in an attached pane: `dflashctl kill` takes it out
    q = entry(run_dir)
    if q is None:
        say(run_dir, f"queue: {QUEUE} is not a ticket of ours: not started")
        return False
    TMUX[2] = str(q.get("tmux_socket") or "dflashctl")
    said = None
    while True:
        if _stop_asked(run_dir):
            return False
        try:
            why = _look(run_dir, q)
        except LockTimeout:  # a launch or another waiter held the host lock for minutes: still in line, look again
            continue
        if why == []:
            return False
        if why is None:
            break
        if why != said:
            say(run_dir, f"queued (place {q.get('position')}): waiting for {'; '.join(why)}")
            said = why
        deadline = time.monotonic() + POLL_S
        while time.monotonic() < deadline:
            if _stop_asked(run_dir):
                return False
            time.sleep(STOP_POLL_S)
    waited = time.time() - float(q.get("since") or time.time())
    say(run_dir, f"dequeued after {waited:.0f} s: GPU {','.join(map(str, q['gpus']))} free")
    cmd = pane_command(run_dir, sys.executable, [])  # the interpreter this pane already runs
    rc, out = _run([*TMUX, "respawn-pane", "-k", "-t", f"={q['session']}:", cmd])
    if rc == 0:  # tmux ends this process (SIGHUP) as it starts the new one; nothing of ours is left to do
        time.sleep(30)
        return False
    say(run_dir, f"queue: tmux respawn-pane failed ({out.strip()[:200]}): the job starts from the queue's process")
    return True
