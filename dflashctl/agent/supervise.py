"""Runs ON the remote beside a job: `python3 -S agent.pyz supervise RUN_DIR`. The job's one decider.

Started by the job's launcher (agent/launcher.py) in a session of its own, outside the job's process tree, so that
a restart, which stops the old attempt's tree, does not stop it; one per run dir (an flock on the run dir itself:
removing a file cannot let a second one in; the launcher of every restarted attempt tries again, and the one
already running keeps the watch). On its own monotonic clock it takes the same snapshot a poll takes (which keeps
the run dir's progress history), asks the same pure Judge as `status` and `watch` (shipped inside the agent's
zipapp), writes the verdict to `verdict.json` and a heartbeat to `supervisor.beat` every sample (a frozen process
cannot: readers then take over), and applies the one restart policy (judge/policy.next_move) through the same
remote restart action under the run dir's lock: so it, any number of local watchers and a cron job restart a
failed attempt once, never after a kill, never past `max_restarts`. When it gives up, that is recorded in
`verdict.json` (`gave_up`) and every reader says so and restarts nothing. Its decisions go to the run dir's
`events.jsonl` with `"by": "supervisor"`, through `Supervisor.event`. It ends when the job ends for good (a final
state, the restart budget spent, a stop request), or when its run dir is gone.

What it is given (`supervise.json`, written at launch): the job's session, tag, tmux socket, restart arguments and
its watch policy; for a job over several hosts (it runs on the head) its `members`: how to reach each other node's
run dir from here by ssh (agent/members.py). It then probes them every sample, judges each with a Judge of its own
and combines them with judge/nodes.py; restarts act on every node (the head first), and at the end every node it
reaches is scrubbed and its dead pane closed. A node it cannot reach is said in `verdict.json` (`unreached`), and it
restarts nothing while one is: a watch on the laptop decides. Stdlib only, like all of the agent.

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

from . import members, outbox, probe
from .common import append_jsonl, read_int, read_json, scrub_secrets, start_time, write_atomic
from .procs import close_when_dead
from .snapshot import wall_clock_hook as _test_wall_clock
from .supervision import BEAT, SPEC, STATE, VERDICT, reserve_final, write_final

MIN_INTERVAL_S, MAX_INTERVAL_S = 1.0, 60.0


def _judge():
    """The pure judge: inside the zipapp it ships in the agent's package; from the source tree it is dflashctl's."""
    try:
        from .judge import facts, policy, report
    except ImportError:
        from ..judge import facts, policy, report
    return facts, policy, report


def _nodes_judge():
    """judge/nodes.py (the node combine) and the lost-peer pattern, from the same place as `_judge`."""
    try:
        from .judge import nodes
        from .judge.assess import PEER_LOST
    except ImportError:
        from ..judge import nodes
        from ..judge.assess import PEER_LOST
    return nodes, PEER_LOST


class Supervisor:
    def __init__(self, run_dir: str, spec: dict) -> None:
        facts, policy, report = _judge()
        self.policy_mod, self.facts_ = policy, facts
        self.run, self.spec = run_dir, spec
        from .pack import own_archive

        self.agent = own_archive()  # what it was started from: the copy its restarts run is checked against it
        watch = spec.get("watch") if isinstance(spec.get("watch"), dict) else {}
        self.interval = min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, float(watch.get("interval_s") or 60.0)))
        self.policy = policy.Policy.of(watch)
        self.scheduled = spec.get("scheduler") == "slurm"
        # a Slurm job's supervisor runs on the login node: its GPUs are not the job's
        self.where = {"scheduler": "slurm", "gpus": False} if self.scheduled else {}
        self.restarts = read_int(os.path.join(run_dir, probe.RESTARTS)) or 0
        self.judge = report.Judge(str(spec.get("job_id") or ""), "", facts.Thresholds.of(watch),
                                  bool(spec.get("is_trainer")), float(spec.get("grace_s") or 40.0),
                                  [g for g in spec.get("gpus") or [] if isinstance(g, int)], self.scheduled,
                                  max_restarts=self.policy.max_restarts, restarts=self.restarts)  # fmt: skip
        self.state: str | None = None
        self.failed_at: float | None = None  # time.monotonic() when this failure was first seen
        self.stopping = False
        self.beats = 0
        self.gave_up: str | None = None
        # a job over several hosts: this supervisor runs on the head and probes the other nodes (agent/members.py)
        thresholds = facts.Thresholds.of(watch)
        self.nodes = members.Nodes(members.members_of(spec), lambda m: report.Judge(
            m.job_id, m.host, thresholds, False, float(spec.get("grace_s") or 40.0), m.gpus,
            max_restarts=self.policy.max_restarts), self.restarts) if spec.get("members") else None  # fmt: skip
        self.head_host = str(spec.get("host") or "head")
        self.unreached_said: tuple = ()

    @property
    def h(self):
        return self.judge.h

    def reset(self) -> None:
        self.judge.reset()
        if self.nodes is not None:
            self.nodes.reset(self.restarts)
        self.failed_at = None

    def request(self) -> dict:
        return {"run_dir": self.run, "session": self.spec.get("session"), "job_id": self.spec.get("job_id"),
                "log_offset": self.judge.log_offset, "metrics_offset": self.judge.metrics_offset,
                "capture_lines": 40, "job_gpus": self.judge.job.gpus,
                "record_gpu": not self.spec.get("is_trainer") and not self.scheduled, **self.where}  # fmt: skip

    def event(self, event: dict) -> None:
        """The one place a decision is recorded (the run dir's events.jsonl, read by every asker)."""
        body = {"time": round(time.time(), 3), "by": "supervisor", **event}
        with contextlib.suppress(OSError):  # a full disk loses an event, never the watch
            append_jsonl(os.path.join(self.run, "events.jsonl"), [body])
        with contextlib.suppress(OSError):  # the user paged from here (agent/outbox.py); unsent, it waits
            outbox.record(self.run, body, self.spec, self.restarts)

    def beat(self) -> None:
        """The heartbeat: a counter rewritten every sample, with this machine's monotonic time (readers on this
        machine compare it with their own monotonic now; readers elsewhere watch the counter on their own clock)."""
        self.beats += 1
        body = {"beat": self.beats, "mono": round(time.monotonic(), 3), "time": round(time.time(), 3),
                "pid": os.getpid()}  # fmt: skip
        with contextlib.suppress(OSError):
            write_atomic(os.path.join(self.run, BEAT), json.dumps(body, separators=(",", ":")).encode())

    def look(self):
        """One snapshot, judged; the verdict written for every asker."""
        self.seen = self.facts()
        snap = probe.snapshot(self.request())
        self.beat()
        if not snap.get("run_dir_exists"):
            return None
        snap.pop("supervisor", None)  # its own word is what it is making now
        remote = snap.get("restarts")
        if isinstance(remote, int) and remote > self.restarts:  # a local watcher restarted it
            self.restarts = remote
            self.reset()
        r = self.judge.take(snap, time.monotonic())
        if self.nodes is not None:
            self.combine_nodes(r)
        self.write_verdict(r)
        if r.state != self.state:
            self.event({"decision": "state", "state": r.state, "previous": self.state, "reason": r.reason,
                        "evidence": r.evidence[:5], "advice": r.advice})  # fmt: skip
            self.state = r.state
        return r

    def combine_nodes(self, r) -> None:
        """Every other node probed from here (one ssh call each, all at once) and judged by its own Judge; the job's
        verdict is judge/nodes.combine's, on this machine's monotonic clock. A node not reached is said (in the
        verdict's `unreached`, and once as an event): then a watch on the laptop decides."""
        nodes_mod, peer_lost = _nodes_judge()
        now = time.monotonic()
        reports = self.nodes.look(now)
        self.beat()  # alive after the ssh calls too (one may take up to members.PROBE_TIMEOUT_S)
        self.nodes.combine(r, self.judge, self.head_host, reports, nodes_mod, peer_lost, now)
        unreached = tuple(self.nodes.unreached)
        if unreached != self.unreached_said:
            self.unreached_said = unreached
            self.event({"decision": "warning", "warning": "cannot reach " + "; ".join(unreached) +
                        ": a watch on the laptop decides" if unreached else "every node is reached again"})

    def write_verdict(self, r, gave_up: str | None = None) -> None:
        multi = {"nodes": self.nodes.states, "unreached": self.nodes.unreached} if self.nodes is not None else {}
        body = {"time": r.time, "state": r.state, "reason": r.reason, "evidence": r.evidence[:12],
                "advice": r.advice, "step": r.step, "restarts": self.restarts, "attempt_start": self.h.started_at,
                "by": "supervisor", "pid": os.getpid(), **({"gave_up": gave_up} if gave_up else {}),
                **multi}  # fmt: skip
        with contextlib.suppress(OSError):
            write_atomic(os.path.join(self.run, VERDICT), json.dumps(body, separators=(",", ":")).encode())

    def give_up(self, r, why: str) -> str:
        """Recorded where every asker reads it (verdict.json's `gave_up`): nobody restarts this attempt after."""
        self.gave_up = why
        self.write_verdict(r, why)
        ended = f"{r.state}: {why}"
        with contextlib.suppress(OSError):  # in place, into space taken at the start: it holds on a full disk
            write_final(self.run, {"time": r.time, "state": r.state, "reason": r.reason, "evidence": r.evidence[:12],
                                   "advice": r.advice, "step": r.step, "restarts": self.restarts,
                                   "attempt_start": self.h.started_at, "by": "supervisor", "gave_up": why,
                                   "ended": ended})  # fmt: skip
        self.event({"decision": "no_restart", "after": r.state, "why": why})
        return ended

    def restart(self, r) -> str | None:
        """One remote restart. None: go on watching; else why the watch ends."""
        need = probe.restart_room_gib(r.state, self.h.checkpoint_gib)
        cause = {**r.restart_cause(), "by": "supervisor"}
        ans = probe.restart_action({"run_dir": self.run, "session": self.spec.get("session"),
                                    "job_id": self.spec.get("job_id"), "attempt": self.restarts,
                                    "max_restarts": self.policy.max_restarts,
                                    "grace_s": float(self.spec.get("grace_s") or 40.0), "python": sys.executable,
                                    "args": list(self.spec.get("args") or []), "min_free_gib": need,
                                    "cause": cause, **self.where},
                                   self.agent)  # fmt: skip
        if ans.get("restarted") and self.nodes is not None:  # then every other node, from its own checkpoint
            refused = self.restart_members(need, cause)
            if refused:
                self.restarts = int(ans["restarts"])
                self.judge.restarts = self.restarts
                return self.give_up(r, f"restarted on {self.head_host} but not on {refused}")
        if ans.get("restarted") or ans.get("raced"):
            self.restarts = int(ans["restarts"])
            self.judge.restarts = self.restarts
            if ans.get("restarted"):
                self.event({"decision": "restart", "attempt": self.restarts, **cause,
                            **({"agent_replaced": True} if ans.get("agent_replaced") else {})})  # fmt: skip
            self.reset()
            self.state = "STARTING"
            return None
        return self.give_up(r, str(ans.get("why")))

    def restart_members(self, need, cause: dict) -> str:
        """The restart action on every other node (its run dir's lock, its own count), once the head's is done:
        the head's new torchrun waits at the rendezvous for them. '' when each restarted (or another decider had
        restarted it); else which refused, and why."""
        req = {"action": "restart", "attempt": self.restarts, "max_restarts": self.policy.max_restarts,
               "grace_s": float(self.spec.get("grace_s") or 40.0), "args": list(self.spec.get("args") or []),
               "min_free_gib": need, "gpus": False, "cause": cause}  # fmt: skip
        refused = []
        for m, ans, why in self.nodes.act(req, float(req["grace_s"]) + 150):
            if ans is None or not (ans.get("restarted") or ans.get("raced")):
                refused.append(f"{m.host}: {why or (ans or {}).get('why')}")
        return "; ".join(refused)

    def end_members(self) -> None:
        """The job ended for good: on every other node it reaches, the secrets leave the run dir and the tmux
        session is closed once its pane is dead (agent/members.end_member, run there)."""
        wait = float(self.spec.get("grace_s") or 40.0) + 30  # a node's own end after its peer's
        for m, ans, why in self.nodes.act({"action": "end_member", "gpus": False, "wait_s": wait}, wait + 60):
            said = {k: (ans or {}).get(k) for k in ("scrubbed", "session_closed", "why")}
            self.event({"decision": "node_end", "node": m.host, **({"why": why} if why else said)})

    def run_forever(self) -> str:
        while not self.stopping:
            r = self.look()
            if r is None:
                return "the run dir is gone"
            now = time.monotonic()
            failing = r.state in self.policy.restart_on
            if failing and self.failed_at is None:
                self.failed_at = now
            elif not failing:
                self.failed_at = None
            move = self.policy_mod.next_move(r, self.restarts, self.policy, self.failed_at, now)
            unreached = self.nodes.unreached if self.nodes is not None else []
            if unreached and move.kind == self.policy_mod.GIVE_UP:  # not its word alone: a watch decides
                return f"{r.state}, with {len(unreached)} node(s) not reached from the head: a watch decides"
            if unreached and move.kind == self.policy_mod.RESTART:  # it cannot restart what it cannot reach
                move = self.policy_mod.Move(self.policy_mod.WAIT)
            if move.kind == self.policy_mod.RESTART:
                why = self.restart(r)
                if why:
                    return why
                continue
            if move.kind == self.policy_mod.GIVE_UP:
                failed = move.refused or r.state in self.facts_.FAILURES  # its final word, for every asker
                return self.give_up(r, move.why) if failed else move.why
            wait = self.interval if move.wait_s is None else min(self.interval, move.wait_s)
            deadline = time.monotonic() + wait
            while not self.stopping and time.monotonic() < deadline and not self.news():
                time.sleep(min(0.2, wait))
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

    def news(self) -> bool:
        """One of `facts` changed since the last look: the next look is taken now, not at the end of the interval
        (a kill, an exit, a tmux server gone are judged within a fraction of a second)."""
        now = self.facts()
        if now != self.seen:
            self.seen = now
            return True
        return False


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
        probe.TMUX[2] = str(spec["tmux_socket"])
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
        if not sup.stopping and os.path.isdir(run_dir):  # the job ended for good: its secrets are not kept at rest
            with contextlib.suppress(OSError):
                scrub_secrets(run_dir)
            # nor its dead pane (train.log has all it showed): no tmux server is left behind; but only once the
            # exit status is in the run dir (on a full disk it is not: then the pane's is the only record of it)
            if not sup.scheduled and sup.h.exit_code is not None and spec.get("session"):
                close_when_dead(str(spec["session"]))
            if sup.nodes is not None:  # and the other nodes', where it reaches them
                sup.end_members()
    except Exception as e:  # said where every asker sees it: the local side then judges by itself
        ended = f"failed: {type(e).__name__}: {e}"[:300]
        raise
    finally:
        with contextlib.suppress(OSError):
            if os.path.isdir(run_dir):
                write_atomic(os.path.join(run_dir, STATE), json.dumps({**record, "ended": ended,
                                                                       "ended_at": time.time()}).encode())  # fmt: skip
    return 0
