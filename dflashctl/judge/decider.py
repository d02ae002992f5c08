"""Pure: the one decider of a job. Everything the supervisor beside the job and a watch on the laptop decide, decided
once: one look at every node, a restart made elsewhere, how long a failure has lasted, the node combine, the move
(wait, restart, give up), the restart request, the events to record and the notices to send.

    looks (one per node, head first) ──> Decider.take(looks, now) ──> Turn
    Turn = report + move + events + notices + restart request (+ the final word when it gives up)
    Decider.restarted(outcome) ──> Turn (the restart's event and notice, or the refusal and giving up)

The drivers do the I/O around it: `agent/supervise.py` (on the remote: its snapshots, its restart action, its
outbox) and `jobs/watch.py` (on the laptop: its probes, its restart call). A reader that only looks (`status`,
`ls --refresh`) takes one turn and acts on none of its moves. A driver that is not the supervisor acts only when
no supervisor answers (`Report.decided_by == HERE`): otherwise it follows the supervisor's word and makes no
notice of its own. `now` is the driver's monotonic clock; nothing here reads a clock or a file.

Stdlib only: shipped inside the agent for the supervisor (Python 3.8).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .assess import PEER_LOST
from .cause import recorded
from .facts import ADVICE, ENDS, FAILURES, QUIET, TERMINAL
from .nodes import Node, combine
from .notice import Message, notice_id
from .policy import GIVE_UP, RESTART, WAIT, Move, Policy, next_move
from .report import HERE, SUPERVISOR, Judge, Report

HAND_OVER = "hand_over"  # the supervisor cannot reach every node: it stops deciding, a watch on the laptop decides
ELSEWHERE = "elsewhere (the job's supervisor or another watcher)"


@dataclass
class Look:
    """What one node's probe gave: its snapshot, or why none came (`reachable` False: the host did not answer)."""

    snap: dict | None = None
    reachable: bool = True
    error: str = ""


@dataclass
class Outcome:
    """What the remote's restart action answered, typed."""

    restarted: bool
    restarts: int = 0  # the run dir's count after the call
    raced: bool = False  # another decider restarted this attempt first
    why: str = ""
    stopped: bool = False  # refused because a stop was requested: the kill's notice says it
    extra: dict = field(default_factory=dict)  # what the event adds (agent_replaced, ...)


@dataclass
class Turn:
    report: Report
    move: Move
    events: list[dict] = field(default_factory=list)  # decisions to record (no time, no `by`: the driver stamps)
    notices: list[Message] = field(default_factory=list)  # to put into the run dir's outbox, each once
    restart: dict | None = None  # with a RESTART move: {attempt, cause}, what the restart action is asked
    gave_up: str | None = None  # the decider's final word on this attempt: nobody restarts it
    says: list[str] = field(default_factory=list)  # lines for a person watching


def seen_restarted(attempt: int, cause: object) -> dict:
    """The event for a restart this decider did not make: the decider's own cause (the failed state, reason and
    evidence it recorded in the run dir) when it is this attempt's, so a failure that came and went between two
    looks is still named; else the restart alone, its cause unknown here (never this decider's last state)."""
    known = recorded(cause, attempt)
    if known is not None:
        by = f"elsewhere ({known['by']})" if known["by"] else ELSEWHERE
        return {
            "decision": "restart",
            "attempt": attempt,
            "after": known["after"],
            "by": by,
            "reason": known["reason"],
            "evidence": known["evidence"],
        }
    return {
        "decision": "restart",
        "attempt": attempt,
        "after": None,
        "by": ELSEWHERE,
        "reason": "seen restarted; its cause was not recorded",
    }


class Decider:
    """One job's decisions, for whoever drives them (`by`: "supervisor", "watch" or "status")."""

    def __init__(self, judges: list[Judge], names: list[str], policy: Policy, by: str, job: str, host: str) -> None:
        self.judges, self.names, self.policy, self.by = judges, names, policy, by
        self.job, self.host = job, host  # the job's id, the job file's name for its (head) host
        self.restarts = judges[0].restarts
        self.state: str | None = None  # the state of the last turn
        self.failed_at: float | None = None  # when the current failure was first seen (driver's monotonic clock)
        self.bad_since: dict = {}  # node index -> when it was first seen failing (judge/nodes.combine keeps it)
        self.node_states: list[dict] = []  # each node's word at the last turn: host, state, reason
        self.unreached: list[str] = []  # nodes the last turn could not reach, with why
        self.made: set = set()  # notice ids this decider made: never twice
        self.held: tuple | None = None  # (notice id, report) of a failure whose restart is under way
        self.asked: dict | None = None  # the restart request of the last RESTART move
        self.asked_report: Report | None = None  # the look that asked for it
        self.disk_warned = False
        self.looked = False

    @property
    def head(self) -> Judge:
        return self.judges[0]

    def request(self, node: int = 0) -> dict:
        """What the probe of node `node` is asked: from where to read its log and metrics on."""
        j = self.judges[node]
        return {
            "log_offset": j.log_offset,
            "metrics_offset": j.metrics_offset,
            "capture_lines": 40,
            "job_gpus": list(j.job.gpus),
        }

    def take(self, looks: list[Look], now: float) -> Turn:
        events: list[dict] = []
        head = looks[0].snap
        remote = head.get("restarts") if isinstance(head, dict) else None
        if type(remote) is int and remote > self.restarts:  # restarted elsewhere (or before this decider began)
            if self.looked:
                events.append(seen_restarted(remote, head.get("restart_cause")))
            self._new_attempt(remote)
        self.looked = True
        r = self._look(looks, now)
        previous, self.state = self.state, r.state
        if r.state != previous:
            events.append(
                {
                    "decision": "state",
                    "state": r.state,
                    "previous": previous,
                    "reason": r.reason,
                    "evidence": r.evidence[:5],
                    "advice": r.advice,
                }
            )
        acting = self.by == SUPERVISOR or r.decided_by == HERE
        failing = r.state in self.policy.restart_on and not r.stop_requested
        self.failed_at = (now if self.failed_at is None else self.failed_at) if failing else None
        move = self._move(r, now, acting)
        turn = Turn(r, move, events)
        if acting:
            self._notices(turn, previous)
            self._warn_disk(turn)
        if move.kind == RESTART:
            self.asked = {"attempt": self.restarts, "cause": {**r.restart_cause(), "by": self.by}}
            self.asked_report, turn.restart = r, self.asked
        elif move.kind == GIVE_UP and acting and (move.refused or r.state in FAILURES):
            turn.gave_up = move.why
            events.append({"decision": "no_restart", "after": r.state, "why": move.why})
        elif move.kind == GIVE_UP and not acting and r.gave_up:
            turn.says.append(f"not restarted: {r.decided_why}")
        if move.kind == WAIT and move.wait_s and acting and r.state in FAILURES:
            turn.says.append(
                f"{r.state}: restarting in {move.wait_s:.0f} s (restart {self.restarts + 1} of "
                f"{self.policy.max_restarts})"
            )
        return turn

    def restarted(self, outcome: Outcome) -> Turn:
        """The restart action's answer to the last RESTART move: the restart's event and its notice (one with the
        failure it ends), or the refusal, its notice and the final word."""
        nid = self.held[0] if self.held is not None else None
        self.held = None
        cause = (self.asked or {}).get("cause") or {}
        report = self.asked_report
        assert report is not None, "restarted() answers a RESTART move of take()"
        if outcome.restarted or outcome.raced:
            by = self.by if outcome.restarted else ELSEWHERE
            turn = Turn(
                report,
                Move(WAIT),
                [{"decision": "restart", "attempt": outcome.restarts, **cause, "by": by, **outcome.extra}],
            )
            if outcome.raced:
                turn.says.append(outcome.why)
            elif nid is not None and nid not in self.made:
                done = outcome.restarts
                turn.notices.append(
                    self._message(
                        nid,
                        report,
                        f"restarted ({done} of {self.policy.max_restarts})",
                        restarts=done,
                        left=self.policy.max_restarts - done,
                    )
                )
            self._new_attempt(outcome.restarts)
            self.state = "STARTING"
            return turn
        turn = Turn(
            report,
            Move(GIVE_UP, outcome.why, refused=True),
            [{"decision": "no_restart", "after": report.state, "why": outcome.why}],
            gave_up=outcome.why,
        )
        turn.says.append(f"not restarted: {outcome.why}")
        if not outcome.stopped:
            if nid is None or nid in self.made:  # the failure was said (its restart announced): this is news
                nid = notice_id(self.restarts, f"{report.state}-refused")
            turn.notices.append(self._message(nid, report, f"not restarted: {outcome.why}", left=0))
        return turn

    # -------------------------------------------------------------------------------------------- the parts

    def _new_attempt(self, restarts: int) -> None:
        self.restarts = restarts
        for j in self.judges:
            j.restarts = restarts
            j.reset()
        self.bad_since.clear()
        self.failed_at = None
        self.disk_warned = False

    def _look(self, looks: list[Look], now: float) -> Report:
        """Every node's look taken by its own Judge; over several nodes, the job's verdict (judge/nodes.combine),
        then the supervisor's word on it for a driver that is not the supervisor."""
        many = len(self.judges) > 1
        reports = []
        for i, (judge, look) in enumerate(zip(self.judges, looks)):  # noqa: B905 (3.8: no strict=)
            if look.snap is None:
                reports.append(judge.failed_look(look.reachable, look.error))
                continue
            snap = look.snap
            if i > 0 or self.by == SUPERVISOR:  # a member's probe knows no supervisor; the supervisor's is its own
                snap = {k: v for k, v in snap.items() if k != "supervisor"}
            reports.append(judge.take(snap, now, adopt=not many))
        self.unreached = [f"{self.names[i]}: {look.error}" for i, look in enumerate(looks) if not look.reachable]
        r = reports[0]
        if not many:
            return r
        parts = [
            Node(n, rep.verdict, any(PEER_LOST.search(ln) for ln in j.tail), j.h.exit_time)
            for n, rep, j in zip(self.names, reports, self.judges)  # noqa: B905 (3.8: no strict=)
        ]
        v = combine(parts, self.bad_since, now)
        self.node_states = [
            {"host": n, "state": rep.state, "reason": rep.reason[:200]}
            for n, rep in zip(self.names, reports)  # noqa: B905 (3.8: no strict=)
        ]
        r.state, r.reason, r.evidence, r.advice = v.state, v.reason, v.evidence, v.advice
        r.step = v.step if v.step is not None else r.step
        if self.by != SUPERVISOR:
            self.head.adopt(r)
        return self.head.note_state(r)

    def _move(self, r: Report, now: float, acting: bool) -> Move:
        move = next_move(r, self.restarts, self.policy, self.failed_at, now)
        if not acting:  # the supervisor decides: its restart and its word on giving up are its own
            if move.kind == RESTART or (move.kind == GIVE_UP and move.refused and not r.gave_up):
                return Move(WAIT)
            return move
        if self.by == SUPERVISOR and self.unreached:  # not its word alone: it cannot act on what it cannot reach
            if move.kind == GIVE_UP:
                return Move(
                    HAND_OVER,
                    f"{r.state}, with {len(self.unreached)} node(s) not reached from the head: a watch decides",
                )
            if move.kind == RESTART:
                return Move(WAIT)
        return move

    def _left(self, r: Report) -> int:
        """Restarts the policy will really make for this state: none for a state it never restarts."""
        if r.stop_requested or r.state not in self.policy.restart_on:
            return 0
        return max(0, self.policy.max_restarts - self.restarts)

    def _message(
        self,
        nid: str,
        r: Report,
        action: str,
        state: str | None = None,
        restarts: int | None = None,
        left: int | None = None,
    ) -> Message:
        self.made.add(nid)
        state = state or r.state
        return Message(
            job=self.job,
            host=self.host,
            state=state,
            reason=r.reason,
            evidence=list(r.evidence[:5]),
            advice=r.advice,
            restarts=self.restarts if restarts is None else restarts,
            time=float(r.time or 0.0),
            failure=state in FAILURES,
            restarts_left=self._left(r) if left is None else max(0, left),
            look=f"dflashctl status {self.job}",
            id=nid,
            action=action,
        )

    def _notices(self, turn: Turn, previous: str | None) -> None:
        """One notice per event: a failure with what is done about it (a restart under way is said with its
        outcome, by `restarted`), the job's end, a stall that ended by itself."""
        r, move, policy = turn.report, turn.move, self.policy
        if r.state in ENDS:
            nid = notice_id(None, r.state)
            if nid not in self.made:
                turn.notices.append(
                    self._message(nid, r, "" if r.state == "FINISHED" else "stopped by `dflashctl kill`", left=0)
                )
            return
        if r.state in FAILURES and r.state not in QUIET:
            nid = notice_id(self.restarts, r.state)
            if nid in self.made:
                return
            if move.kind == RESTART:
                self.held = (nid, r)
            elif move.kind == WAIT and move.wait_s is not None:
                turn.notices.append(
                    self._message(
                        nid, r, f"restart {self.restarts + 1} of {policy.max_restarts} in {move.wait_s:.0f} s"
                    )
                )
            elif move.kind == GIVE_UP:
                turn.notices.append(self._message(nid, r, f"not restarted: {move.why}", left=0))
            elif move.kind == WAIT and (r.state not in policy.restart_on or r.stop_requested):
                why = "a stop was requested" if r.stop_requested else f"{r.state} is not in the job's restart_on"
                turn.notices.append(self._message(nid, r, f"not restarted: {why}", left=0))
            return
        if previous in FAILURES and previous not in TERMINAL and r.state == "RUNNING":
            failed = notice_id(self.restarts, previous)
            if failed in self.made and f"{failed}-recovered" not in self.made:
                turn.notices.append(self._message(f"{failed}-recovered", r, f"recovered from {previous}", left=0))

    def _warn_disk(self, turn: Turn) -> None:
        """Trouble ahead, said before it is a failure: less free space at the run dir than two checkpoints."""
        h = self.head.h
        low = h.disk_free_gib is not None and bool(h.checkpoint_gib) and h.disk_free_gib < 2 * h.checkpoint_gib
        if not low:
            self.disk_warned = False
            return
        if self.disk_warned or turn.report.state in TERMINAL:
            return
        self.disk_warned = True
        line = (
            f"disk low: {h.disk_free_gib:g} GiB free at the run dir, under two checkpoints "
            f"({2 * h.checkpoint_gib:g} GiB): the next checkpoints may not fit"
        )
        turn.says.append(f"warning: {line}")
        turn.events.append({"decision": "warning", "warning": line})
        nid = notice_id(self.restarts, "DISK_LOW")
        if nid not in self.made:
            low_report = Report(
                turn.report.id, turn.report.host, "DISK_LOW", line, [], ADVICE["DISK_FULL"], time=turn.report.time
            )
            turn.notices.append(self._message(nid, low_report, "warning", state="DISK_LOW", left=0))


def decider_for(judges: list[Judge], names: list[str], watch: dict, by: str, job: str, host: str) -> Decider:
    """A Decider with the job file's restart policy (`watch` as a mapping: what the CLI validated, what the supervisor
    reads from its spec)."""
    return Decider(judges, names, Policy.of(watch), by, job, host)


__all__ = [
    "Decider",
    "ELSEWHERE",
    "GIVE_UP",
    "HAND_OVER",
    "Look",
    "Outcome",
    "RESTART",
    "Turn",
    "WAIT",
    "decider_for",
    "seen_restarted",
]
