"""Runs ON the remote beside a job: `python3 -S agent.pyz supervise RUN_DIR`. The driver of the job's one decider.

Started by the job's launcher (agent/launcher.py) in a session of its own, outside the job's process tree, so that
a restart, which stops the old attempt's tree, does not stop it; one per run dir (an flock on the run dir itself:
removing a file cannot let a second one in; the launcher of every restarted attempt tries again, and the one
already running keeps the watch). It decides nothing itself: on its own monotonic clock it takes the snapshot a poll
takes (which keeps the run dir's progress history), and for a job over several hosts one of every other node
(agent/members.py), hands them to the pure Decider (judge/decider.py, shipped inside the agent's zipapp: the same
one a watch on the laptop drives), and does what the turn says: writes the verdict to `verdict.json` and a
heartbeat to `supervisor.beat` every sample (a frozen process cannot: readers then take over), records the turn's
events in `events.jsonl` (`"by": "supervisor"`), puts its notices into the run dir's outbox (agent/outbox.py, sent by
a thread of its own: no decision waits on a webhook), and runs the restart the turn asks for under the run dir's
lock (so it, any number of local watchers and a cron job restart a failed attempt once, never after a kill, never
past `max_restarts`). When the decider gives up, that is recorded in `verdict.json` (`gave_up`) and in its last
word (`supervisor.final`): every reader says so and restarts nothing. It ends when the job ends for good, when it
cannot reach every node of a job that needs a decision (a watch then decides), or when its run dir is gone.

The job can write every file of its run dir: the files read here go through agent/common.py's readers (regular
files only, bounded, set aside and named when they are not ours), and a turn that fails anyway is said in the run
dir and retried at the next sample, never the end of the watch.

A test may shift this process's wall clock (DFLASHCTL_TEST_WALL_SHIFT_FILE, read by `_test_wall_clock`): a real
clock step needs privileges a test machine cannot spend. Only the shown stamps may move with it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import sys
import time
import traceback

from ..judge import decider, facts, report
from . import members, outbox
from .common import (
    RESTARTS,
    STOP_REQUEST,
    WRAPPER_PID,
    append_jsonl,
    read_int,
    read_json,
    scrub_secrets,
    start_time,
    write_atomic,
)
from .procs import TMUX, close_when_dead
from .snapshot import snapshot
from .snapshot import wall_clock_hook as _test_wall_clock
from .starting import restart_action, restart_room_gib
from .supervision import BEAT, SPEC, STATE, VERDICT, reserve_final, write_final

MIN_INTERVAL_S, MAX_INTERVAL_S = 1.0, 60.0
FLUSH_S = 30.0  # at the end, what is ready is sent for at most this long; the rest waits for the laptop
TURN_FAILURES_MAX = 20  # turns in a row that raised: then it ends, said (a bug, not the job's doing)


class Supervisor:
    def __init__(self, run_dir: str, spec: dict) -> None:
        self.d = decider
        self.run, self.spec = run_dir, spec
        from .pack import own_archive

        self.agent = own_archive()  # what it was started from: the copy its restarts run is checked against it
        watch = spec.get("watch") if isinstance(spec.get("watch"), dict) else {}
        self.interval = min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, _float(watch.get("interval_s"), 60.0)))
        self.scheduled = spec.get("scheduler") == "slurm"
        # a Slurm job's supervisor runs on the login node: its GPUs are not the job's
        self.where = {"scheduler": "slurm", "gpus": False} if self.scheduled else {}
        self.grace = _float(spec.get("grace_s"), 40.0)
        restarts = read_int(os.path.join(run_dir, RESTARTS)) or 0
        thresholds = facts.Thresholds.of(watch)
        self.job_id = str(spec.get("job_id") or os.path.basename(run_dir))
        self.head_host = str(spec.get("host") or "head")
        policy = decider.Policy.of(watch)
        # a job over several hosts: this supervisor runs on the head and probes the other nodes (agent/members.py)
        self.members = members.members_of(spec) if spec.get("members") else []
        gpus = [g for g in spec.get("gpus") or [] if type(g) is int]
        judges = [
            report.Judge(
                self.job_id,
                self.head_host,
                thresholds,
                is_trainer=bool(spec.get("is_trainer")),
                kill_grace_s=self.grace,
                gpus=gpus,
                scheduled=self.scheduled,
                max_restarts=policy.max_restarts,
                restarts=restarts,
            )
        ]
        judges += [
            report.Judge(
                m.job_id,
                m.host,
                thresholds,
                is_trainer=False,
                kill_grace_s=self.grace,
                gpus=m.gpus,
                max_restarts=policy.max_restarts,
                restarts=restarts,
            )
            for m in self.members
        ]
        self.decider = decider.Decider(
            judges,
            [self.head_host, *(m.host for m in self.members)],
            policy,
            report.SUPERVISOR,
            self.job_id,
            self.head_host,
        )
        notify = spec.get("notify") if isinstance(spec.get("notify"), dict) else {}
        self.posts = outbox.posts_of(notify)
        self.sender = outbox.Sender(run_dir, notify)
        self.stopping = False
        self.beats = 0
        self.gave_up: str | None = None
        self.unreached_said: tuple = ()
        self.seen: tuple = ()

    @property
    def h(self):
        return self.decider.head.h

    def request(self) -> dict:
        return {
            "run_dir": self.run,
            "session": self.spec.get("session"),
            "job_id": self.spec.get("job_id"),
            **self.decider.request(0),
            "record_gpu": not self.spec.get("is_trainer") and not self.scheduled,
            **self.where,
        }

    def beat(self) -> None:
        """The heartbeat: a counter rewritten every sample, with this machine's monotonic time (readers on this
        machine compare it with their own monotonic now; readers elsewhere watch the counter on their own clock)."""
        self.beats += 1
        body = {
            "beat": self.beats,
            "mono": round(time.monotonic(), 3),
            "time": round(time.time(), 3),
            "pid": os.getpid(),
        }
        with contextlib.suppress(OSError):
            write_atomic(os.path.join(self.run, BEAT), json.dumps(body, separators=(",", ":")).encode())

    def looks(self) -> list | None:
        """The head's snapshot and every other node's (one ssh call each, all at once); None: the run dir is gone."""
        snap = snapshot(self.request())
        self.beat()
        if not snap.get("run_dir_exists"):
            return None
        looks = [self.d.Look(snap)]
        if self.members:
            got = members.look_all(self.members, [self.decider.request(i + 1) for i in range(len(self.members))])
            self.beat()  # alive after the ssh calls too (one may take up to members.PROBE_TIMEOUT_S)
            looks += [self.d.Look(s, ok, why) for s, ok, why in got]
        return looks

    def record(self, turn) -> None:
        """What a turn decided, where every asker reads it: its events, its notices (the sender is woken)."""
        stamp = round(time.time(), 3)
        events = [{"time": stamp, "by": "supervisor", **e} for e in turn.events]
        unreached = tuple(self.decider.unreached)
        if unreached != self.unreached_said:
            self.unreached_said = unreached
            events.append(
                {
                    "time": stamp,
                    "by": "supervisor",
                    "decision": "warning",
                    "warning": "cannot reach " + "; ".join(unreached) + ": a watch on the laptop decides"
                    if unreached
                    else "every node is reached again",
                }
            )
        if events:
            with contextlib.suppress(OSError):  # a full disk loses an event, never the watch
                append_jsonl(os.path.join(self.run, "events.jsonl"), events)
        if not self.sender.url:  # no webhook: nothing to deliver, the events say it all
            return
        for msg in turn.notices:
            with contextlib.suppress(OSError):  # unsent, it waits; unwritable, it is lost, said by the laptop's look
                outbox.put(self.run, msg.to_dict(), self.posts)
        if turn.notices:
            self.sender.poke()

    def said(self, r) -> dict:
        """The supervisor's word on this attempt, as verdict.json and the final record both carry it."""
        return {
            "time": r.time,
            "state": r.state,
            "reason": r.reason,
            "evidence": r.evidence[:12],
            "advice": r.advice,
            "step": r.step,
            "restarts": self.decider.restarts,
            "attempt_start": self.h.started_at,
            "by": "supervisor",
        }

    def write_verdict(self, r, gave_up: str | None = None) -> None:
        multi = {"nodes": self.decider.node_states, "unreached": self.decider.unreached} if self.members else {}
        body = {**self.said(r), "pid": os.getpid(), **({"gave_up": gave_up} if gave_up else {}), **multi}
        with contextlib.suppress(OSError):
            write_atomic(os.path.join(self.run, VERDICT), json.dumps(body, separators=(",", ":")).encode())

    def give_up(self, r, why: str) -> str:
        """Recorded where every asker reads it (verdict.json's `gave_up`): nobody restarts this attempt after."""
        self.gave_up = why
        self.write_verdict(r, why)
        ended = f"{r.state}: {why}"
        with contextlib.suppress(OSError):  # in place, into space taken at the start: it holds on a full disk
            write_final(self.run, {**self.said(r), "gave_up": why, "ended": ended})
        return ended

    def restart(self, ask: dict):
        """The turn's restart, on the head and then every other node: the decider's Outcome."""
        cause = ask["cause"]
        need = restart_room_gib(str(cause.get("after")), self.h.checkpoint_gib)
        ans = restart_action(
            {
                "run_dir": self.run,
                "session": self.spec.get("session"),
                "job_id": self.spec.get("job_id"),
                "attempt": ask["attempt"],
                "max_restarts": self.decider.policy.max_restarts,
                "grace_s": self.grace,
                "python": sys.executable,
                "args": list(self.spec.get("args") or []),
                "min_free_gib": need,
                "cause": cause,
                **self.where,
            },
            self.agent,
        )
        count = ans.get("restarts") if type(ans.get("restarts")) is int else ask["attempt"]
        extra = {"agent_replaced": True} if ans.get("agent_replaced") else {}
        if ans.get("restarted") and self.members:  # then every other node, from its own checkpoint
            refused = self.restart_members(ask["attempt"], need, cause)
            if refused:
                self.decider.restarts = count
                return self.d.Outcome(False, count, why=f"restarted on {self.head_host} but not on {refused}")
        return self.d.Outcome(
            bool(ans.get("restarted")),
            count,
            bool(ans.get("raced")),
            str(ans.get("why") or ""),
            bool(ans.get("stopped")),
            extra,
        )

    def restart_members(self, attempt: int, need, cause: dict) -> str:
        """The restart action on every other node (its run dir's lock, its own count), once the head's is done:
        the head's new torchrun waits at the rendezvous for them. '' when each restarted (or another decider had
        restarted it); else which refused, and why."""
        req = {
            "action": "restart",
            "attempt": attempt,
            "max_restarts": self.decider.policy.max_restarts,
            "grace_s": self.grace,
            "args": list(self.spec.get("args") or []),
            "min_free_gib": need,
            "gpus": False,
            "cause": cause,
        }
        refused = []
        for m, ans, why in members.act_all(self.members, req, self.grace + 150):
            if ans is None or not (ans.get("restarted") or ans.get("raced")):
                refused.append(f"{m.host}: {why or (ans or {}).get('why')}")
        return "; ".join(refused)

    def end_members(self) -> None:
        """The job ended for good: on every other node it reaches, the secrets leave the run dir and the tmux
        session is closed once its pane is dead (agent/members.end_member, run there)."""
        wait = self.grace + 30  # a node's own end after its peer's
        for m, ans, why in members.act_all(
            self.members, {"action": "end_member", "gpus": False, "wait_s": wait}, wait + 60
        ):
            said = {k: (ans or {}).get(k) for k in ("scrubbed", "session_closed", "why")}
            with contextlib.suppress(OSError):
                append_jsonl(
                    os.path.join(self.run, "events.jsonl"),
                    [
                        {
                            "time": round(time.time(), 3),
                            "by": "supervisor",
                            "decision": "node_end",
                            "node": m.host,
                            **({"why": why} if why else said),
                        }
                    ],
                )

    def turn(self) -> str | None:
        """One sample: look, decide, act. None: go on; else why the watch ends."""
        self.seen = self.facts()
        looks = self.looks()
        if looks is None:
            return "the run dir is gone"
        turn = self.decider.take(looks, time.monotonic())
        self.write_verdict(turn.report)
        self.record(turn)
        move = turn.move
        if move.kind == self.d.RESTART:
            after = self.decider.restarted(self.restart(turn.restart))
            self.record(after)
            return self.give_up(after.report, after.gave_up) if after.gave_up else None
        if move.kind == self.d.HAND_OVER:
            return move.why
        if move.kind == self.d.GIVE_UP:
            return self.give_up(turn.report, turn.gave_up) if turn.gave_up else move.why
        wait = self.interval if move.wait_s is None else min(self.interval, move.wait_s)
        deadline = time.monotonic() + wait
        while not self.stopping and time.monotonic() < deadline and not self.news():
            time.sleep(min(0.2, wait))
        return None

    def run_forever(self) -> str:
        self.sender.start()
        failures = 0
        while not self.stopping:
            try:
                ended = self.turn()
                failures = 0
            except Exception as e:  # a bug, or a file nothing foresaw: said, and the next sample tries again
                failures += 1
                self.said_failure(e)
                if failures >= TURN_FAILURES_MAX:
                    raise
                time.sleep(min(self.interval, 1.0 * failures))
                continue
            if ended is not None:
                return ended
        return "told to stop (SIGTERM)"

    def said_failure(self, e: Exception) -> None:
        line = f"a turn failed: {type(e).__name__}: {e}"[:300]
        sys.stderr.write(traceback.format_exc()[-4000:])
        event = {"time": round(time.time(), 3), "by": "supervisor", "decision": "warning", "warning": line}
        with contextlib.suppress(OSError):
            append_jsonl(os.path.join(self.run, "events.jsonl"), [event])

    def facts(self) -> tuple:
        """What ends or stops an attempt, or starts its job, read cheaply (a few stats): the run dir, a stop request,
        an exit status, the launcher alive, the setup step's file (its end starts the job)."""
        run = self.run
        me = read_json(os.path.join(run, WRAPPER_PID)) if not self.scheduled else None
        launcher = (
            (start_time(me["pid"]) == me.get("start"))
            if isinstance(me, dict) and isinstance(me.get("pid"), int)
            else None
        )
        try:
            setup = os.stat(os.path.join(run, "setup.json")).st_mtime_ns
        except OSError:
            setup = None
        return (
            os.path.isdir(run),
            os.path.exists(os.path.join(run, STOP_REQUEST)),
            os.path.exists(os.path.join(run, "exit_code")),
            launcher,
            setup,
        )

    def news(self) -> bool:
        """One of `facts` changed since the last look: the next look is taken now, not at the end of the interval
        (a kill, an exit, a tmux server gone are judged within a fraction of a second)."""
        now = self.facts()
        if now != self.seen:
            self.seen = now
            return True
        return False


def _float(v, default: float) -> float:
    """A number from the spec (the job could have written it): finite and positive, else the default."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")
    return float(v) if ok else default


def lock_run_dir(run_dir: str) -> int | None:
    """An exclusive flock on the run dir itself (an fd of the directory, held for the supervisor's life): no file
    to remove, so no second supervisor. None: another holds it."""
    fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def main() -> int:
    run_dir = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else ""
    spec = read_json(os.path.join(run_dir, SPEC))
    if not isinstance(spec, dict):
        sys.stderr.write(f"dflashctl supervise: no {SPEC} in {run_dir!r}\n")
        return 2
    if spec.get("tmux_socket"):
        TMUX[2] = str(spec["tmux_socket"])
    _test_wall_clock()
    try:
        fd = lock_run_dir(run_dir)
    except OSError as e:
        sys.stderr.write(f"dflashctl supervise: cannot lock the run dir {run_dir}: {e.strerror}\n")
        return 1
    if fd is None:
        return 0  # one supervisor per run dir: the one already running keeps the watch
    with contextlib.suppress(OSError):
        reserve_final(run_dir)
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
        sup.sender.flush(FLUSH_S if not sup.stopping else 5.0, sup.beat)  # the last notices, before the secrets go
        if not sup.stopping and os.path.isdir(run_dir):  # the job ended for good: its secrets are not kept at rest
            with contextlib.suppress(OSError):
                scrub_secrets(run_dir)
            # nor its dead pane (train.log has all it showed): no tmux server is left behind; but only once the
            # exit status is in the run dir (on a full disk it is not: then the pane's is the only record of it)
            if not sup.scheduled and sup.h.exit_code is not None and spec.get("session"):
                close_when_dead(str(spec["session"]))
            if sup.members:  # and the other nodes', where it reaches them
                sup.end_members()
    except Exception as e:  # said where every asker sees it: the local side then judges by itself
        ended = f"failed: {type(e).__name__}: {e}"[:300]
        raise
    finally:
        with contextlib.suppress(OSError):
            if os.path.isdir(run_dir):
                write_atomic(
                    os.path.join(run_dir, STATE),
                    json.dumps({**record, "ended": ended, "ended_at": time.time()}).encode(),
                )
    return 0
