"""Polling a job: one probe per poll, taken by the job's Judge (judge/report.py), for one host or every node of a
job over several (combined by judge/nodes.py); and the poll record `watch --json` prints. `watch` runs the loop
around it; `status` asks it for a job over several hosts.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from dflashctl.agent.probe import restart_room_gib  # a restart needs what a launch needs
from dflashctl.errors import ProbeFailedError
from dflashctl.jobs import control, notify, registry
from dflashctl.jobs import verdict as verdicts
from dflashctl.judge import nodes
from dflashctl.judge.assess import PEER_LOST
from dflashctl.judge.cause import recorded
from dflashctl.judge.nodes import CONSEQUENCES, PEER_GRACE_S  # noqa: F401 - as callers of watch know them
from dflashctl.judge.report import HERE, SUPERVISOR, Judge, Report
from dflashctl.model.jobfile import WatchConfig
from dflashctl.model.record import JobRecord
from dflashctl.remote import session
from dflashctl.remote.connect import open_runner
from dflashctl.remote.transport import Runner

SPARK = "▁▂▃▄▅▆▇█"


@dataclass
class PollRecord:
    """One line of `watch --json`: the Report (the one schema, docs/cli-json.md) and what this watch adds."""

    report: Report
    remote_commands: int = 0
    warnings: list[str] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)  # decisions since the previous record

    def to_dict(self) -> dict:
        return {**self.report.to_dict(), "remote_commands": self.remote_commands, "warnings": self.warnings,
                "events": self.events}  # fmt: skip


def sparkline(values: list[float], width: int = 30) -> str:
    vals = values[-width:]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    span = (hi - lo) or 1.0
    return "".join(SPARK[min(7, int((v - lo) / span * 7.999))] for v in vals)


@dataclass
class Watcher:
    """One host of a watched job: its connection and its Judge (the history, offsets and tail of what it saw)."""

    job: JobRecord
    cfg: WatchConfig
    open: Callable[[], Runner]
    runner: Runner | None = None
    judge: Judge = None  # type: ignore[assignment] - made in __post_init__
    is_trainer: bool | None = None  # None: the job's; False for the other nodes of a job over several hosts
    gpus: list[dict] = field(default_factory=list)
    state: str | None = None
    restarts: int = 0
    pending_events: list[dict] = field(default_factory=list)
    remote_commands: int = 0
    disk_warned: bool = False
    unsaid: list[dict] = field(default_factory=list)  # decisions not yet carried by a poll record
    said: deque = field(default_factory=lambda: deque(maxlen=5))  # the newest decisions, for the live view
    notes: list[str] = field(default_factory=list)
    sent: list[str] = field(default_factory=list)  # notices the supervisor could not send, sent by this watch
    secrets_at_rest: bool = False  # the last snapshot found the job's secrets still in its run dir

    def __post_init__(self) -> None:
        self.restarts = self.job.restarts
        if self.judge is None:
            self.judge = verdicts.judge_for(self.job, self.is_trainer)

    # what the live view reads, kept by the Judge
    @property
    def history(self):
        return self.judge.h

    @property
    def tail(self) -> deque:
        return self.judge.tail

    @property
    def tps_all(self) -> list[float]:
        return self.judge.tps_all

    @property
    def tau(self) -> float | None:
        return self.judge.tau

    @property
    def tau_set(self) -> str | None:
        return self.judge.tau_set

    @property
    def since(self) -> float | None:
        return self.judge.since

    def eta_s(self) -> float | None:
        return self.judge.eta_s()

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

    def poll(self) -> Report:
        """One remote command; the Judge takes the snapshot (on this process's monotonic clock)."""
        req = {**session.probe_request(self.job, self.judge.log_offset, self.judge.metrics_offset, capture_lines=40)}
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
            return self.judge.failed_look(True, str(e))
        except Exception as e:  # DflashError, OSError, EOFError and paramiko's own SSHException family alike
            self._drop()
            self.notes.append(f"unreachable: {type(e).__name__}: {str(e)[:120]}")
            return self.judge.failed_look(False, str(e))
        self.pending_events = []
        self.secrets_at_rest = bool(snap.get("secrets_at_rest"))
        remote_restarts = snap.get("restarts")
        if isinstance(remote_restarts, int) and remote_restarts > self.restarts and self.state is None:
            self.restarts = remote_restarts  # restarted before this watch began: nothing seen restarted here
        elif isinstance(remote_restarts, int) and remote_restarts > self.restarts:  # restarted elsewhere meanwhile
            self.restarts = remote_restarts
            self.log_event(seen_restarted(remote_restarts, snap.get("restart_cause")))
            self.reset_after_restart()
        report = self.judge.take(snap, time.monotonic())
        self.gpus = self.judge.gpus
        return report

    def min_free_gib(self, state: str) -> float | None:
        """A restart after DISK_FULL needs room for a checkpoint (at least MIN_FREE_GIB)."""
        return restart_room_gib(state, self.history.checkpoint_gib)

    def restart_remote(self, attempt: int, cause: dict) -> control.RestartOutcome:
        """Restart `attempt` after the failure `cause` names (Report.restart_cause)."""
        return control.restart(self._connect(), self.job, attempt, self.min_free_gib(cause["after"]), cause)

    def warnings(self) -> list[str]:
        """Trouble ahead, said before it is a failure: less free space at the run dir than two checkpoints."""
        h = self.history
        if h.disk_free_gib is not None and h.checkpoint_gib and h.disk_free_gib < 2 * h.checkpoint_gib:
            return [f"disk low: {h.disk_free_gib:g} GiB free at the run dir, under two checkpoints "
                    f"({2 * h.checkpoint_gib:g} GiB): the next checkpoints may not fit"]  # fmt: skip
        return []

    def record(self, r: Report) -> PollRecord:
        events, self.unsaid = self.unsaid, []
        r.gpus = self.gpus
        return PollRecord(r, self.remote_commands, self.warnings(), events)

    def log_event(self, event: dict) -> None:
        registry.append_event(self.job.id, event)
        stamped = {"time": round(time.time(), 3), **event}  # a wall stamp: shown only
        self.pending_events.append(stamped)
        if event.get("decision") != "state":  # state changes are the records themselves
            self.unsaid.append(stamped)
            self.said.append(stamped)

    def reset_after_restart(self) -> None:
        self.judge.restarts = self.restarts
        self.judge.reset()


ELSEWHERE = "elsewhere (the job's supervisor or another watcher)"


def seen_restarted(attempt: int, cause: object) -> dict:
    """The event for a restart this watch did not do: the decider's own cause (the failed state, reason and
    evidence it recorded in the run dir) when it is this attempt's, so a failure that came and went between two polls
    is still named; else the restart alone, its cause unknown here (never this watch's last state, which was not the
    failure)."""
    known = recorded(cause, attempt)
    if known is not None:
        by = f"elsewhere ({known['by']})" if known["by"] else ELSEWHERE
        return {"decision": "restart", "attempt": attempt, "after": known["after"], "by": by,
                "reason": known["reason"], "evidence": known["evidence"]}  # fmt: skip
    return {"decision": "restart", "attempt": attempt, "after": None, "by": ELSEWHERE,
            "reason": "seen restarted; its cause was not recorded"}


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

    def poll(self) -> Report:
        with ThreadPoolExecutor(max_workers=len(self.nodes)) as pool:
            futures = [pool.submit(Watcher.poll, self)] + [pool.submit(o.poll) for o in self.others]
            reports = [f.result() for f in futures]
        self.remote_commands = sum(n.remote_commands for n in self.nodes)
        self.gpus = [{**g, "node": n.job.host_name} for n in self.nodes for g in n.gpus]
        self.node_states = [r.state for r in reports]
        parts = [nodes.Node(n.job.host_name, r.verdict, any(PEER_LOST.search(ln) for ln in n.tail),
                            n.history.exit_time) for n, r in zip(self.nodes, reports, strict=True)]  # fmt: skip
        v = nodes.combine(parts, self.bad_since, time.monotonic())
        head = reports[0]
        head.state, head.reason, head.evidence, head.advice, head.step = v.state, v.reason, v.evidence, v.advice, \
            v.step if v.step is not None else head.step  # fmt: skip
        self.read_head_supervisor(head)
        return self.judge.note_state(head)

    def read_head_supervisor(self, r: Report) -> None:
        """The head's supervisor probes every node itself: its word is the job's (as a single host's is) while it
        answers and reaches every node. A node it cannot reach is said, and this look decides (`decided_by: here`),
        by the same policy; its evidence line is made again over the combined verdict."""
        sup = self.judge.supervisor
        said = sup.get("verdict") if isinstance(sup, dict) and isinstance(sup.get("verdict"), dict) else None
        if said is None or r.decided_by != SUPERVISOR or said.get("restarts") != self.judge.restarts:
            return
        unreached = [str(u) for u in said.get("unreached") or [] if isinstance(u, str)]
        if unreached and not r.gave_up:
            r.decided_by = HERE
            r.decided_why = f"the job's supervisor cannot reach {'; '.join(unreached)}: decided here"[:400]
            r.evidence.append(r.decided_why)
        elif said.get("state") == r.state:
            r.evidence.append("the job's supervisor agrees")
        elif isinstance(said.get("state"), str):
            r.evidence.append(f"the job's supervisor said {said['state']} at its last sample: {said.get('reason')}")

    def restart_remote(self, attempt: int, cause: dict) -> control.RestartOutcome:
        outcome = control.restart_all(self.job, lambda h: open_runner(h, self.accept_new), attempt,
                                      self.min_free_gib(cause["after"]), cause)  # fmt: skip
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
        o = Watcher(rec, job.watch, lambda h=rec.host: open_runner(h, accept_new), is_trainer=False)  # only
        # the head writes metrics and the heartbeat
        others.append(o)
    w = NodesWatcher(recs[0], job.watch, lambda: open_runner(recs[0].host, accept_new), others=others)
    w.job, w.accept_new = job, accept_new  # the record keeps its members (restarts reach every node)
    return w
