"""Polling a job: one probe per poll, folded into the job's history (judge/fold.py) and judged (jobs/verdict.py),
for one host or every node of a job over several; and the poll record `watch --json` prints. `watch` runs the loop
around it; `status` asks it for a job over several hosts.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pydantic import BaseModel

from dflashctl.agent.probe import restart_room_gib  # a restart needs what a launch needs
from dflashctl.errors import ProbeFailedError
from dflashctl.jobs import control, notify, registry
from dflashctl.jobs import verdict as verdicts
from dflashctl.judge import fold as folding
from dflashctl.judge.health import FAILURES, PEER_LOST, History, Thresholds, Verdict, assess
from dflashctl.model.jobfile import WatchConfig
from dflashctl.model.record import JobRecord
from dflashctl.remote import session
from dflashctl.remote.connect import open_runner
from dflashctl.remote.transport import Runner

SPARK = "▁▂▃▄▅▆▇█"


class PollRecord(BaseModel):
    """One line of `watch --json` (docs/watch.md)."""

    time: float
    id: str  # the job's key, as `ls`, `status` and `logs` name it
    job: str  # the same id under its older name, kept for scripts that read it
    host: str
    state: str
    reason: str
    evidence: list[str]
    advice: str | None
    since: float
    step: int | None
    epoch: int | None
    loss: float | None
    tokens_per_s: float | None
    eta_s: float | None
    restarts: int
    gpus: list[dict]
    remote_commands: int
    warnings: list[str] = []
    events: list[dict] = []  # decisions since the previous record: restart, no_restart (with why), warning, notify


def sparkline(values: list[float], width: int = 30) -> str:
    vals = values[-width:]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    span = (hi - lo) or 1.0
    return "".join(SPARK[min(7, int((v - lo) / span * 7.999))] for v in vals)


@dataclass
class Watcher:
    job: JobRecord
    cfg: WatchConfig
    open: Callable[[], Runner]
    runner: Runner | None = None
    log_offset: int = 0
    metrics_offset: int = 0
    history: History = field(default_factory=lambda: History(started_at=0.0))
    tail: deque = field(default_factory=lambda: deque(maxlen=400))
    tps_all: list[float] = field(default_factory=list)
    step_times: deque = field(default_factory=lambda: deque(maxlen=50))
    gpus: list[dict] = field(default_factory=list)
    state: str | None = None
    since: float = 0.0
    restarts: int = 0
    tau: float | None = None
    tau_set: str | None = None  # the prompt set the tau was measured on (eval.prompt_file's stem, or holdout)
    pending_events: list[dict] = field(default_factory=list)
    remote_commands: int = 0
    disk_warned: bool = False
    unsaid: list[dict] = field(default_factory=list)  # decisions not yet carried by a poll record
    said: deque = field(default_factory=lambda: deque(maxlen=5))  # the newest decisions, for the live view
    notes: list[str] = field(default_factory=list)
    supervisor: dict | None = None  # the supervisor's word on the job, from the newest snapshot
    sent: list[str] = field(default_factory=list)  # notices the supervisor could not send, sent by this watch
    remote_restarts: int | None = None  # the run dir's restart count in the newest snapshot

    def __post_init__(self) -> None:
        self.restarts = self.job.restarts
        self.history.is_trainer = self.job.is_trainer
        self.history.kill_grace_s = self.job.kill_grace_s

    @property
    def thresholds(self) -> Thresholds:
        return verdicts.thresholds(self.cfg)

    def _connect(self) -> Runner:
        if self.runner is None:
            self.runner = self.open()
        return self.runner

    def _drop(self) -> None:
        if self.runner is not None:
            try:
                self.runner.close()
            except Exception:
                pass
        self.runner = None

    def poll(self) -> Verdict:
        """One remote command; fold the snapshot into the history; judge."""
        req = {**session.probe_request(self.job, self.log_offset, self.metrics_offset, capture_lines=40)}
        if self.pending_events:
            req["append_events"] = self.pending_events
        req["job_gpus"] = self.job.gpus
        if not self.job.is_trainer:  # no trainer records the GPUs of a `command:` job: each poll does
            req["record_gpu"] = True
        try:
            runner = self._connect()
            before = runner.commands_run
            snap = session.call_agent(runner, {**req, **notify.claim_request(self.job)})
            self.sent += notify.deliver_claimed(runner, self.job, snap, session.call_agent)
            self.remote_commands = runner.commands_run - before
        except ProbeFailedError as e:  # the host answered: not UNREACHABLE
            self.history.reachable = True
            self.history.probe_error = str(e)
            return assess(self.history, self.thresholds)
        except Exception as e:  # DflashError, OSError, EOFError and paramiko's own SSHException family alike
            self._drop()
            self.history.reachable = False
            self.history.last_state = self.state if self.state != "UNREACHABLE" else self.history.last_state
            self.notes.append(f"unreachable: {type(e).__name__}: {str(e)[:120]}")
            return assess(self.history, self.thresholds)
        self.pending_events = []
        self.history.reachable = True
        self.history.probe_error = None
        self.fold(snap)
        return verdicts.supervised(assess(self.history, self.thresholds), self.history, self.supervisor,
                                   self.remote_restarts)  # fmt: skip

    def min_free_gib(self, state: str) -> float | None:
        """A restart after DISK_FULL needs room for a checkpoint (at least MIN_FREE_GIB)."""
        return restart_room_gib(state, self.history.checkpoint_gib)

    def restart_remote(self, attempt: int, state: str = "") -> control.RestartOutcome:
        return control.restart(self._connect(), self.job, attempt, self.min_free_gib(state))

    def fold(self, snap: dict) -> None:
        """Take one snapshot into the history (judge/fold.py, the same fold `status` and the supervisor use); keep
        what the display needs (throughput, step times, tau, GPUs)."""
        remote_restarts = snap.get("restarts")
        if isinstance(remote_restarts, int) and remote_restarts > self.restarts and self.state is None:
            self.restarts = remote_restarts  # restarted before this watch began: nothing seen restarted here
        elif isinstance(remote_restarts, int) and remote_restarts > self.restarts:  # restarted elsewhere meanwhile
            self.restarts = remote_restarts
            self.log_event({"decision": "restart", "attempt": remote_restarts, "after": self.state,
                            "by": "elsewhere (the job's supervisor or another watcher)", "reason": "seen restarted"})
            self.reset_after_restart()
        job = folding.Job(list(self.job.gpus), self.job.scheduler == "slurm")
        out = folding.fold(self.history, snap, job, self.tail, self.log_offset, self.metrics_offset,
                           self.state or self.job.state)  # fmt: skip
        self.log_offset, self.metrics_offset = out.log_offset, out.metrics_offset
        self.tps_all.extend(out.new_tps)
        self.step_times.extend(out.step_times)
        if out.tau is not None or out.tau_set is not None:
            self.tau, self.tau_set = out.tau, out.tau_set
        self.gpus = out.gpus
        self.supervisor = snap.get("supervisor") if isinstance(snap.get("supervisor"), dict) else None
        self.remote_restarts = out.restarts

    def warnings(self) -> list[str]:
        """Trouble ahead, said before it is a failure: less free space at the run dir than two checkpoints."""
        h = self.history
        if h.disk_free_gib is not None and h.checkpoint_gib and h.disk_free_gib < 2 * h.checkpoint_gib:
            return [f"disk low: {h.disk_free_gib:g} GiB free at the run dir, under two checkpoints "
                    f"({2 * h.checkpoint_gib:g} GiB): the next checkpoints may not fit"]  # fmt: skip
        return []

    def eta_s(self) -> float | None:
        total = self.job.steps
        if not total or len(self.step_times) < 2 or self.history.last_step is None:
            return None
        (t0, s0), (t1, s1) = self.step_times[0], self.step_times[-1]
        if not (t0 and t1 and s1 > s0):
            return None
        return (total - s1) * (t1 - t0) / (s1 - s0)

    def record(self, v: Verdict) -> PollRecord:
        h = self.history
        events, self.unsaid = self.unsaid, []
        return PollRecord(time=time.time(), id=self.job.id, job=self.job.id, host=self.job.host_name, state=v.state,
                          reason=v.reason, evidence=v.evidence, advice=v.advice, since=self.since, step=h.last_step,
                          epoch=h.epoch, loss=h.loss, tokens_per_s=h.tokens_per_s[-1] if h.tokens_per_s else None,
                          eta_s=self.eta_s(), restarts=self.restarts, gpus=self.gpus,
                          remote_commands=self.remote_commands, warnings=self.warnings(),
                          events=events)  # fmt: skip

    def log_event(self, event: dict) -> None:
        registry.append_event(self.job.id, event)
        stamped = {"time": round(time.time(), 3), **event}
        self.pending_events.append(stamped)
        if event.get("decision") != "state":  # state changes are the records themselves
            self.unsaid.append(stamped)
            self.said.append(stamped)

    def reset_after_restart(self) -> None:
        self.history = History(started_at=0.0, is_trainer=self.history.is_trainer, gpu_total_gib=None,
                               kill_grace_s=self.job.kill_grace_s)  # fmt: skip
        self.tail.clear()
        self.step_times.clear()



CONSEQUENCES = ("NCCL_TIMEOUT", "STALLED", "LOST")  # what the other nodes show when one of them failed first
# A node whose failure is only a lost peer ("Connection closed by peer") names no cause: the peer's own verdict is
# awaited this long (its torchrun may take a second or two longer to end) before the lost peer is called the failure.
PEER_GRACE_S = 15.0

@dataclass
class NodesWatcher(Watcher):
    """A job over several hosts. The head (node 0, where rank 0 writes metrics and the heartbeat) is this watcher;
    every other node has a Watcher of its own, judged like a `command:` job (process, log and exit code). One poll is
    one remote call per node, all at once; the job's verdict is the worst node's, named: the first to fail when
    several did (the others' NCCL timeouts are its consequence). An unreachable node is said, and changes nothing
    else."""

    others: list[Watcher] = field(default_factory=list)
    bad_since: dict[int, float] = field(default_factory=dict)
    node_states: list[str] = field(default_factory=list)
    accept_new: bool = False

    @property
    def nodes(self) -> list[Watcher]:
        return [self, *self.others]

    def poll(self) -> Verdict:
        with ThreadPoolExecutor(max_workers=len(self.nodes)) as pool:
            futures = [pool.submit(Watcher.poll, self)] + [pool.submit(o.poll) for o in self.others]
            verdicts = [f.result() for f in futures]
        self.remote_commands = sum(n.remote_commands for n in self.nodes)
        self.gpus = [{**g, "node": n.job.host_name} for n in self.nodes for g in n.gpus]
        return self.combine(verdicts)

    def combine(self, verdicts: list[Verdict]) -> Verdict:
        now = time.time()
        names = [n.job.host_name for n in self.nodes]
        self.node_states = [v.state for v in verdicts]
        for i, v in enumerate(verdicts):
            if v.state in FAILURES:
                self.bad_since.setdefault(i, now)
            else:
                self.bad_since.pop(i, None)
        others = [f"node {names[i]}: {v.state}: {v.reason}" for i, v in enumerate(verdicts)]
        reachable = [(i, v) for i, v in enumerate(verdicts) if v.state != "UNREACHABLE"]
        if not reachable:
            return Verdict("UNREACHABLE", f"no node answers ({', '.join(names)})", others, verdicts[0].advice)
        bad = [(i, v) for i, v in reachable if v.state in FAILURES]
        if bad:
            lost_peer = {i: v.state in CONSEQUENCES or any(PEER_LOST.search(line) for line in self.nodes[i].tail)
                         for i, v in bad}  # fmt: skip

            def first(item):  # a failure of its own over a lost peer, then the first seen, the first ended
                i, _ = item
                ended = self.nodes[i].history.exit_time
                return (lost_peer[i], self.bad_since[i], ended if ended is not None else float("inf"), i)

            if all(lost_peer.values()):
                waiting = [names[i] for i, v in reachable if v.state not in FAILURES and v.state != "FINISHED"]
                seen = min(self.bad_since[i] for i, _ in bad)
                if waiting and now - seen < PEER_GRACE_S:
                    lost = ", ".join(names[i] for i, _ in bad)
                    return Verdict("RUNNING", f"node {lost} lost a peer; waiting for {', '.join(waiting)} to say why",
                                   others, None, verdicts[0].step)  # fmt: skip
            i, v = min(bad, key=first)
            return Verdict(v.state, f"node {names[i]}: {v.reason}", [*v.evidence, *others], v.advice, v.step)
        head = verdicts[0]
        if head.state == "UNREACHABLE":
            head = Verdict("RUNNING", "the head cannot be reached; the other nodes run", others)
        if head.state == "FINISHED":
            running = [names[i] for i, v in reachable if v.state not in ("FINISHED",)]
            if running:
                return Verdict("RUNNING", f"the head finished; waiting for {', '.join(running)}", others, None,
                               head.step)  # fmt: skip
        return Verdict(head.state, head.reason, [*head.evidence, *others[1:]], head.advice, head.step)

    def restart_remote(self, attempt: int, state: str = "") -> control.RestartOutcome:
        outcome = control.restart_all(self.job, lambda h: open_runner(h, self.accept_new), attempt,
                                      self.min_free_gib(state))  # fmt: skip
        if outcome.restarted:
            for o in self.others:
                o.restarts = outcome.restarts
                o.reset_after_restart()
        return outcome


def make_watcher(job: JobRecord, accept_new: bool = False) -> Watcher:
    if not job.members:
        return Watcher(job, job.watch, lambda: open_runner(job.host, accept_new))
    recs = job.member_records()
    others = []
    for rec in recs[1:]:
        o = Watcher(rec, job.watch, lambda h=rec.host: open_runner(h, accept_new))
        o.history.is_trainer = False  # only the head writes metrics and the heartbeat
        others.append(o)
    w = NodesWatcher(recs[0], job.watch, lambda: open_runner(recs[0].host, accept_new), others=others)
    w.job, w.accept_new = job, accept_new  # the record keeps its members (restarts reach every node)
    return w
