"""Looking at a job from the laptop: one probe per node per poll (all nodes at once), handed to the job's Decider
(judge/decider.py, the same one the supervisor beside the job drives), and the poll record `watch --json` prints.
`watch` runs the loop around it (jobs/watch.py); `status` takes one turn of it for a job over several hosts.

This is I/O only: connections, the probe's request, the events carried to the run dir, the notices put into its
outbox and sent within a budget. What the state is and what to do about it is the Decider's.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from dflashctl.agent.starting import restart_room_gib  # a restart needs what a launch needs
from dflashctl.errors import ProbeFailedError
from dflashctl.jobs import control, notify, registry
from dflashctl.jobs import verdict as verdicts
from dflashctl.judge.decider import ELSEWHERE, Decider, Look, Outcome, Turn, seen_restarted  # noqa: F401
from dflashctl.judge.nodes import CONSEQUENCES, PEER_GRACE_S  # noqa: F401 - as callers of watch know them
from dflashctl.judge.report import Judge, Report
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
    notices: dict = field(default_factory=dict)  # the run dir's outbox: waiting, failed, sent, unconfirmed

    def to_dict(self) -> dict:
        return {
            **self.report.to_dict(),
            "remote_commands": self.remote_commands,
            "warnings": self.warnings,
            "events": self.events,
            "notices": self.notices,
        }


def sparkline(values: list[float], width: int = 30) -> str:
    vals = values[-width:]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    span = (hi - lo) or 1.0
    return "".join(SPARK[min(7, int((v - lo) / span * 7.999))] for v in vals)


@dataclass
class Link:
    """One node's connection: opened at the first poll, dropped when the host stops answering."""

    job: JobRecord
    open: Callable[[], Runner]
    runner: Runner | None = None
    remote_commands: int = 0
    secrets_at_rest: bool = False  # the last snapshot found the job's secrets still in its run dir

    def connect(self) -> Runner:
        if self.runner is None:
            self.runner = self.open()
        return self.runner

    def drop(self) -> None:
        if self.runner is not None:
            try:
                self.runner.close()
            except Exception:
                pass
        self.runner = None


@dataclass
class Watcher:
    """A watched job: one Link per node (head first) and the job's Decider, driven by `watch` (or once, by
    `status`). `others` are the records of the nodes after the head (a job over several hosts)."""

    job: JobRecord
    cfg: WatchConfig
    open: Callable[[], Runner]
    others: list[JobRecord] = field(default_factory=list)
    accept_new: bool = False
    by: str = "watch"
    decider: Decider = None  # type: ignore[assignment] - made in __post_init__
    links: list[Link] = field(default_factory=list)
    state: str | None = None
    pending_events: list[dict] = field(default_factory=list)  # carried to the run dir's events.jsonl by the next poll
    unsaid: list[dict] = field(default_factory=list)  # decisions not yet carried by a poll record
    said: deque = field(default_factory=lambda: deque(maxlen=5))  # the newest decisions, for the live view
    notes: list[str] = field(default_factory=list)
    sent: list[str] = field(default_factory=list)  # what this watch's sends came to, to be said
    notices: dict = field(default_factory=dict)  # the outbox's counts at the last poll
    gpus: list[dict] = field(default_factory=list)
    remote_commands: int = 0
    look_extra: dict = field(default_factory=dict)  # what every probe of the head adds (`status`: its figures)
    claim_in_look: bool = True  # the head's probe claims what waits in the outbox and this watch sends it

    def __post_init__(self) -> None:
        nodes = [self.job, *self.others]
        opens = [self.open] + [(lambda h=o.host: open_runner(h, self.accept_new)) for o in self.others]
        self.links = [Link(rec, op) for rec, op in zip(nodes, opens, strict=True)]
        if self.decider is None:
            judges = [verdicts.judge_for(self.job)] + [verdicts.judge_for(o, is_trainer=False) for o in self.others]
            self.decider = Decider(
                judges,
                [n.host_name for n in nodes],
                verdicts.policy(self.cfg),
                self.by,
                self.job.id,
                self.job.host_name,
            )

    # what the live view and the tests read, kept by the head's Judge
    @property
    def judge(self) -> Judge:
        return self.decider.head

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

    @property
    def restarts(self) -> int:
        return self.decider.restarts

    @property
    def node_states(self) -> list[str]:
        return [n["state"] for n in self.decider.node_states]

    def eta_s(self) -> float | None:
        return self.judge.eta_s()

    def _look(self, i: int) -> Look:
        """One remote command for node `i` (the head's carries this watch's events and claims what waits to be
        sent); the notices it claimed are sent here, within the budget, and settled in one more call."""
        link, rec = self.links[i], self.links[i].job
        req = {**session.probe_request(rec, capture_lines=40), **self.decider.request(i)}
        if i == 0:
            if self.pending_events:
                req["append_events"] = self.pending_events
            if self.claim_in_look:
                req.update(notify.claim_request(self.job))
            req.update(self.look_extra)
        if not rec.is_trainer or i > 0:  # no trainer records the GPUs of a `command:` job: each poll does
            req["record_gpu"] = True
        try:
            runner = link.connect()
            before = runner.commands_run
            snap = session.call_agent(runner, req)
            if i == 0:
                lines, after = notify.deliver_claimed(runner, self.job, snap, session.call_agent)
                self.sent += lines
                self.notices = after or notify.waiting(snap) or self.notices
            link.remote_commands = runner.commands_run - before
        except ProbeFailedError as e:  # the host answered: not UNREACHABLE
            return Look(None, True, str(e))
        except Exception as e:  # DflashError, OSError, EOFError and paramiko's own SSHException family alike
            link.drop()
            self.notes.append(f"unreachable: {type(e).__name__}: {str(e)[:120]}")
            return Look(None, False, str(e))
        if i == 0:
            self.pending_events = []
        link.secrets_at_rest = bool(snap.get("secrets_at_rest"))
        return Look(snap)

    def looks(self) -> list[Look]:
        if len(self.links) == 1:
            return [self._look(0)]
        with ThreadPoolExecutor(max_workers=len(self.links)) as pool:
            return list(pool.map(self._look, range(len(self.links))))

    def turn(self) -> Turn:
        """One poll: every node looked at once, the decider's turn taken, its events recorded and its notices
        delivered (put into the run dir's outbox and sent within the budget)."""
        looks = self.looks()
        self.remote_commands = sum(link.remote_commands for link in self.links)
        turn = self.decider.take(looks, time.monotonic())
        many = len(self.links) > 1
        self.gpus = [
            {**g, "node": n.job.host_name} if many else g
            for n, j in zip(self.links, self.decider.judges, strict=True)
            for g in j.gpus
        ]
        self.absorb(turn)
        return turn

    def absorb(self, turn: Turn) -> None:
        for event in turn.events:
            self.log_event(event)
        if turn.notices and looks_answered(turn):
            self.deliver(turn.notices)

    def deliver(self, notices: list) -> dict:
        """This decider's notices into the run dir's outbox and what is ready sent now, within the budget: the
        outbox's counts after (waiting, failed, sent, unconfirmed), {} when the host did not take them."""
        runner = self.links[0].runner
        if runner is None or not self.job.watch.notify.webhook:
            return {}
        try:
            ans = session.call_agent(
                runner,
                {
                    "action": "notices",
                    "run_dir": self.job.run_dir,
                    "gpus": False,
                    **notify.claim_request(self.job, notices),
                },
            )
            lines, after = notify.deliver_claimed(runner, self.job, {"notices": ans}, session.call_agent)
        except Exception as e:  # the host stopped answering between the look and the notices
            self.notes.append(f"notices not put: {type(e).__name__}: {str(e)[:120]}")
            return {}
        self.sent += lines
        self.notices = after or (ans.get("counts") if isinstance(ans.get("counts"), dict) else self.notices)
        return self.notices

    def poll(self) -> Report:
        return self.turn().report

    def restart_remote(self, ask: dict) -> Outcome:
        """The decider's restart request, run under the run dir's lock on every node (the head first)."""
        cause = ask["cause"]
        need = restart_room_gib(str(cause.get("after")), self.history.checkpoint_gib)
        if self.others:
            out = control.restart_all(self.job, lambda h: open_runner(h, self.accept_new), ask["attempt"], need, cause)
        else:
            out = control.restart(self.links[0].connect(), self.job, ask["attempt"], need, cause)
        if out.restarted:
            self.job = self.job.model_copy(
                update={"restarts": out.restarts, "pane_pid": out.pane_pid or self.job.pane_pid}
            )
            registry.update(
                self.job.id,
                pane_pid=self.job.pane_pid,
                restarts=out.restarts,
                state="STARTING",
                **({"slurm_job": out.slurm_job} if out.slurm_job else {}),
            )
        return Outcome(out.restarted, out.restarts, out.raced, out.why, out.stopped)

    def warnings(self) -> list[str]:
        return [e["warning"] for e in self.said if e.get("decision") == "warning" and "disk low" in e["warning"]]

    def record(self, r: Report) -> PollRecord:
        events, self.unsaid = self.unsaid, []
        r.gpus = self.gpus
        return PollRecord(r, self.remote_commands, self.warnings(), events, dict(self.notices))

    def log_event(self, event: dict) -> None:
        registry.append_event(self.job.id, event)
        stamped = {"time": round(time.time(), 3), **event}  # a wall stamp: shown only
        self.pending_events.append(stamped)
        if event.get("decision") != "state":  # state changes are the records themselves
            self.unsaid.append(stamped)
            self.said.append(stamped)


def looks_answered(turn: Turn) -> bool:
    return turn.report.state != "UNREACHABLE"


def make_watcher(job: JobRecord, accept_new: bool = False, by: str = "watch") -> Watcher:
    """The watcher of a job: one node, or every node of a job over several hosts (only the head writes metrics and
    the heartbeat: the others are judged as `command:` jobs are)."""
    if not job.members:
        return Watcher(job, job.watch, lambda: open_runner(job.host, accept_new), accept_new=accept_new, by=by)
    recs = job.member_records()
    w = Watcher(
        recs[0], job.watch, lambda: open_runner(recs[0].host, accept_new), others=recs[1:], accept_new=accept_new, by=by
    )
    w.job = job  # the record keeps its members (restarts reach every node)
    return w
