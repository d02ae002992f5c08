"""Runs ON the remote beside a job: `python3 -S agent.pyz supervise RUN_DIR`. The job keeps its own watch.

Started by the job's launcher (agent/launcher.py) in a session of its own, outside the job's process tree, so that
a restart, which stops the old attempt's tree, does not stop it; one per run dir (an flock on `.supervisor.lock`:
the launcher of every restarted attempt tries again, and the one already running keeps the watch). On its own clock
it takes the same snapshot a poll takes (which keeps the run dir's progress history), folds and judges it with the
same pure judge as `status` and `watch` (shipped inside the agent's zipapp), writes the verdict to `verdict.json`,
and applies the job file's restart policy itself, through the same remote restart action under the run dir's lock:
so it, any number of local watchers and a cron job restart a failed attempt once, never after a kill, never past
`max_restarts`. Its decisions go to the run dir's `events.jsonl` with `"by": "supervisor"`. It ends when the job
ends for good (a final state, the restart budget spent, a stop request), or when its run dir is gone.

What it is given (`supervise.json`, written at launch): the job's session, tag, tmux socket, restart arguments and
its watch policy. Stdlib only, like all of the agent.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import sys
import time
from collections import deque

from . import probe
from .common import append_jsonl, read_int, read_json, scrub_secrets, start_time, write_atomic
from .procs import close_session
from .supervision import LOCK, SPEC, STATE, VERDICT

MIN_INTERVAL_S, MAX_INTERVAL_S = 1.0, 60.0


def _judge():
    """The pure judge: inside the zipapp it ships in the agent's package; from the source tree it is dflashctl's."""
    try:
        from .judge import fold, health
    except ImportError:
        from ..judge import fold, health
    return fold, health


class Supervisor:
    def __init__(self, run_dir: str, spec: dict) -> None:
        fold, health = _judge()
        self.fold, self.health = fold, health
        self.run, self.spec = run_dir, spec
        from .pack import own_archive

        self.agent = own_archive()  # what it was started from: the copy its restarts run is checked against it
        watch = spec.get("watch") if isinstance(spec.get("watch"), dict) else {}
        self.interval = min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, float(watch.get("interval_s") or 60.0)))
        self.restart_on = [s for s in watch.get("restart_on") or [] if isinstance(s, str)]
        self.max_restarts = int(watch.get("max_restarts") or 0)
        self.backoff_s = float(watch.get("backoff_s") or 0.0)
        self.th = health.Thresholds.of(watch)  # the same thresholds `status` and `watch` judge with
        self.scheduled = spec.get("scheduler") == "slurm"
        # a Slurm job's supervisor runs on the login node: its GPUs are not the job's
        self.where = {"scheduler": "slurm", "gpus": False} if self.scheduled else {}
        self.job = fold.Job([int(g) for g in spec.get("gpus") or [] if isinstance(g, int)], self.scheduled)
        self.restarts = read_int(os.path.join(run_dir, probe.RESTARTS)) or 0
        self.state: str | None = None
        self.failed_at: float | None = None
        self.stopping = False
        self.reset()

    def reset(self) -> None:
        self.h = self.health.History(started_at=0.0, is_trainer=bool(self.spec.get("is_trainer")),
                                     kill_grace_s=float(self.spec.get("grace_s") or 40.0))  # fmt: skip
        self.tail: deque = deque(maxlen=400)
        self.log_offset = self.metrics_offset = 0
        self.failed_at = None

    def request(self) -> dict:
        return {"run_dir": self.run, "session": self.spec.get("session"), "job_id": self.spec.get("job_id"),
                "log_offset": self.log_offset, "metrics_offset": self.metrics_offset, "capture_lines": 40,
                "job_gpus": self.job.gpus, "record_gpu": not self.spec.get("is_trainer") and not self.scheduled,
                **self.where}  # fmt: skip

    def event(self, event: dict) -> None:
        body = {"time": round(time.time(), 3), "by": "supervisor", **event}
        with contextlib.suppress(OSError):  # a full disk loses an event, never the watch
            append_jsonl(os.path.join(self.run, "events.jsonl"), [body])

    def look(self):
        """One snapshot, folded and judged; the verdict written for every asker."""
        self.seen = self.facts()
        snap = probe.snapshot(self.request())
        if not snap.get("run_dir_exists"):
            return None
        remote = snap.get("restarts")
        if isinstance(remote, int) and remote > self.restarts:  # a local watcher restarted it
            self.restarts = remote
            self.reset()
        out = self.fold.fold(self.h, snap, self.job, self.tail, self.log_offset, self.metrics_offset, self.state)
        self.log_offset, self.metrics_offset = out.log_offset, out.metrics_offset
        v = self.health.assess(self.h, self.th)
        body = {"time": snap["time"], "state": v.state, "reason": v.reason, "evidence": v.evidence[:12],
                "advice": v.advice, "step": v.step, "restarts": self.restarts, "attempt_start": self.h.started_at,
                "by": "supervisor", "pid": os.getpid()}  # fmt: skip
        with contextlib.suppress(OSError):
            write_atomic(os.path.join(self.run, VERDICT), json.dumps(body, separators=(",", ":")).encode())
        if v.state != self.state:
            self.event({"decision": "state", "state": v.state, "previous": self.state, "reason": v.reason,
                        "evidence": v.evidence[:5]})  # fmt: skip
            self.state = v.state
        return v

    def restart(self, v) -> str | None:
        """Apply the restart policy to a failed attempt. None: go on watching; else why the watch ends."""
        if self.restarts >= self.max_restarts:
            why = f"max_restarts ({self.max_restarts}) reached"
            self.event({"decision": "no_restart", "after": v.state, "why": why})
            return why
        now = time.time()
        if self.failed_at is None:
            self.failed_at = now
        if now - self.failed_at < self.backoff_s * (2**self.restarts):
            return None
        need = probe.restart_room_gib(v.state, self.h.checkpoint_gib)
        ans = probe.restart({"run_dir": self.run, "session": self.spec.get("session"),
                             "job_id": self.spec.get("job_id"), "attempt": self.restarts,
                             "max_restarts": self.max_restarts, "grace_s": float(self.spec.get("grace_s") or 40.0),
                             "python": sys.executable, "args": list(self.spec.get("args") or []),
                             "min_free_gib": need, **self.where}, self.agent)  # fmt: skip
        if ans.get("restarted"):
            self.restarts = int(ans["restarts"])
            self.event({"decision": "restart", "after": v.state, "attempt": self.restarts, "reason": v.reason,
                        **({"agent_replaced": True} if ans.get("agent_replaced") else {})})  # fmt: skip
            self.reset()
            self.state = "STARTING"
            return None
        if "another watcher" in str(ans.get("why")):
            self.restarts = int(ans.get("restarts") or self.restarts)
            self.reset()
            return None
        self.event({"decision": "no_restart", "after": v.state, "why": ans.get("why")})
        return str(ans.get("why"))

    def run_forever(self) -> str:
        final = self.health.TERMINAL
        while not self.stopping:
            v = self.look()
            if v is None:
                return "the run dir is gone"
            if self.h.stop_request is not None and v.state != "STOPPING":
                return f"stopped: {v.state}"
            if v.state in self.restart_on and self.h.stop_request is None:
                why = self.restart(v)
                if why:
                    return f"{v.state}: {why}"
            elif v.state in final:
                return v.state
            deadline = time.monotonic() + self.interval
            while not self.stopping and time.monotonic() < deadline and not self.news():
                time.sleep(min(0.2, self.interval))
        return "told to stop (SIGTERM)"

    def facts(self) -> tuple:
        """What ends or stops an attempt, read cheaply (a few stats): the run dir, a stop request, an exit status,
        the launcher alive."""
        run = self.run
        me = read_json(os.path.join(run, probe.WRAPPER_PID)) if not self.scheduled else None
        launcher = (start_time(me["pid"]) == me.get("start")) if isinstance(me, dict) and isinstance(me.get("pid"),
                                                                                                 int) else None
        return (os.path.isdir(run), os.path.exists(os.path.join(run, probe.STOP_REQUEST)),
                os.path.exists(os.path.join(run, "exit_code")), launcher)  # fmt: skip

    def launcher_gone(self, timeout: float) -> bool:
        """The exit status is written before the launcher has reaped the job's leftovers and exited (its pane dies
        then): on a loaded host the last look can fall between the two. Wait for the pane's end, not a guess."""
        deadline = time.monotonic() + timeout
        while self.facts()[3]:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def news(self) -> bool:
        """One of `facts` changed since the last look: the next look is taken now, not at the end of the interval
        (a kill, an exit, a tmux server gone are judged within a fraction of a second)."""
        now = self.facts()
        if now != self.seen:
            self.seen = now
            return True
        return False

def main() -> int:
    run_dir = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else ""
    spec = read_json(os.path.join(run_dir, SPEC))
    if not isinstance(spec, dict):
        sys.stderr.write(f"dflashctl supervise: no {SPEC} in {run_dir!r}\n")
        return 2
    if spec.get("tmux_socket"):
        probe.TMUX[2] = str(spec["tmux_socket"])
    try:
        fd = os.open(os.path.join(run_dir, LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0  # one supervisor per run dir: the one already running keeps the watch
    except OSError as e:
        sys.stderr.write(f"dflashctl supervise: cannot lock {LOCK} in {run_dir}: {e.strerror}\n")
        return 1
    me = os.getpid()
    record = {"pid": me, "start": start_time(me), "started_at": time.time()}
    sup = Supervisor(run_dir, spec)
    record["interval_s"] = sup.interval

    def stop(_signum, _frame) -> None:
        sup.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the launcher's session closing is no reason to stop watching
    write_atomic(os.path.join(run_dir, STATE), json.dumps(record).encode())
    ended = "crashed"
    try:
        ended = sup.run_forever()
        if not sup.stopping and os.path.isdir(run_dir):  # the job ended for good: its secrets are not kept at rest
            with contextlib.suppress(OSError):
                scrub_secrets(run_dir)
            # nor its dead pane (train.log has all it showed): no tmux server is left behind; but only once the
            # exit status is in the run dir (on a full disk it is not: then the pane's is the only record of it)
            if not sup.scheduled and sup.h.exit_code is not None and spec.get("session") and (
                    sup.h.pane_dead or sup.launcher_gone(30.0)):  # fmt: skip
                close_session(str(spec["session"]))
    except Exception as e:  # said where every asker sees it: the local side then judges by itself
        ended = f"failed: {type(e).__name__}: {e}"[:300]
        raise
    finally:
        with contextlib.suppress(OSError):
            if os.path.isdir(run_dir):
                write_atomic(os.path.join(run_dir, STATE), json.dumps({**record, "ended": ended,
                                                                       "ended_at": time.time()}).encode())  # fmt: skip
    return 0
