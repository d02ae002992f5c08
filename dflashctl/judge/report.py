"""Pure: the judge's front door. A `Judge` holds what one asker knows of one job (the history, the log offsets and
tail, its own observations on its own monotonic clock); `take(snapshot, mono_now)` folds the snapshot, assesses it,
applies the supervisor's word and returns a `Report`: the verdict, the figures, and who decided.

`status`, `ls`, `watch`, `kill`, `report` and the supervisor beside the job all ask a Judge; `Report.to_dict()` is
the one JSON schema of their `--json` (docs/cli-json.md): one name per figure.

Time: "how long since" is measured on the asker's own monotonic clock wherever the asker has looked before (a
clock stepped by hours changes no age); a first look takes the ages the remote measured on its own monotonic clock
(fold.py; its wall stamps, clamped, only where it sent none).
The supervisor's liveness is its heartbeat: a counter it rewrites every sample, judged stale by the asker's own
looks (unchanged for longer than STALE_INTERVALS of its intervals) or by the remote's own monotonic age of it.
Stdlib only: shipped inside the agent for the supervisor (Python 3.8).
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field

from .assess import assess
from .cause import EVIDENCE_LINES
from .facts import BY_NAME, FAILURES, TERMINAL, History, Thresholds, Verdict
from .fold import Folded, Job, age_of, fold, number

STALE_INTERVALS = 3.0  # a heartbeat unchanged for this many supervisor intervals (and STALE_SLACK_S) is stale
STALE_SLACK_S = 10.0
FRESH_SLACK_S = 5.0  # a live supervisor's differing word is said for two of its intervals and this much
SUPERVISOR, HERE = "supervisor", "here"
STATE_NAMES = tuple(BY_NAME)


def stale_after_s(interval_s: float) -> float:
    """How long a supervisor's heartbeat may stay unchanged before it counts as not answering."""
    return max(STALE_INTERVALS * interval_s, interval_s + STALE_SLACK_S)


@dataclass
class Report:
    """One look at one job, as every command shows it and `--json` prints it (docs/cli-json.md)."""

    id: str  # the job's key, as `ls`, `status` and `logs` name it
    host: str
    state: str
    reason: str
    evidence: list[str] = field(default_factory=list)
    advice: str | None = None
    time: float | None = None  # the look's wall time on the remote: shown, never subtracted
    since: float | None = None  # when this state was first seen (wall, shown)
    step: int | None = None  # the newest step
    epoch: int | None = None
    loss: float | None = None  # the newest step's loss
    tokens_per_s: float | None = None  # the newest poll's throughput
    tau: float | None = None  # the newest in-run tau
    tau_set: str | None = None  # the prompt set it was measured on
    eta_s: float | None = None  # to the last step at the recent pace
    gpus: list[dict] = field(default_factory=list)  # the job's GPU readings
    restarts: int = 0  # the run dir's restart count
    max_restarts: int = 0
    stop_requested: bool = False  # `dflashctl kill` asked for a stop: nobody restarts it
    decided_by: str = HERE  # "supervisor" (it restarts and notifies) or "here" (this asker does, by the same policy)
    decided_why: str = ""  # why the decider is that one
    gave_up: bool = False  # the supervisor gave up on this attempt (recorded in the run dir): nobody restarts it
    supervisor: dict | None = None  # alive, answering, ended, heartbeat_age_s; null for a job without one
    throughput: float | None = None  # the newest throughput in `throughput_unit`: tokens_per_s, or a command's log's
    throughput_unit: str | None = None  # "tokens/s", or as the log prints it: "it/s", "s/it", "samples/s", ...

    def restart_cause(self) -> dict:
        """Why a restart after this look is done, as its decider records it and its event says it."""
        return {"after": self.state, "reason": self.reason, "evidence": self.evidence[:EVIDENCE_LINES]}

    def to_dict(self) -> dict:
        return asdict(self)

    def progress(self) -> dict:
        """What `ls` keeps of a look: step, loss, throughput in its unit, time left."""
        return {
            "step": self.step,
            "loss": self.loss,
            "throughput": self.throughput,
            "throughput_unit": self.throughput_unit,
            "eta_s": self.eta_s,
        }

    @property
    def verdict(self) -> Verdict:
        return Verdict(self.state, self.reason, list(self.evidence), self.advice, self.step, self.since)


class _Seen:
    """When a value last changed, on the asker's monotonic clock: the first look converts the remote's wall age
    once; every later change is placed between two of the asker's own looks."""

    def __init__(self) -> None:
        self.value: object = None
        self.at: float | None = None

    def age(self, value, wall_age: float | None, now: float, last_look: float | None) -> float | None:
        if self.at is None or last_look is None:
            if wall_age is None:
                return None
            self.value, self.at = value, now - max(0.0, wall_age)
        elif value != self.value:  # changed since our last look: no earlier than it
            self.value = value
            self.at = now - min(max(0.0, wall_age if wall_age is not None else 0.0), now - last_look)
        return max(0.0, now - self.at)


class Judge:
    """What one asker knows of one job, and its one method `take`."""

    def __init__(
        self,
        id: str,
        host: str,
        thresholds: Thresholds,
        *,
        is_trainer: bool = True,
        kill_grace_s: float = 40.0,
        gpus: list | None = None,
        scheduled: bool = False,
        total_steps: int | None = None,
        max_restarts: int = 0,
        restarts: int = 0,
        last_state: str | None = None,
    ) -> None:
        self.id, self.host, self.th = id, host, thresholds
        self.is_trainer, self.kill_grace_s = is_trainer, kill_grace_s
        self.job = Job([int(g) for g in gpus or []], scheduled)
        self.total_steps, self.max_restarts, self.restarts = total_steps, max_restarts, restarts
        self.state: str | None = None  # the state this asker saw last
        self.last_state = last_state  # the state known before this asker's first look (the record's)
        self.since: float | None = None
        self.log_offset = self.metrics_offset = 0
        self.tps_all: list[float] = []
        self.tau: float | None = None
        self.tau_set: str | None = None
        self.gpus: list[dict] = []
        self.supervisor: dict | None = None
        self._beat: _Seen = _Seen()  # the supervisor's heartbeat, as this asker saw it change
        self._said: dict | None = None  # the supervisor's verdict of this attempt, when its word is the report's
        self.reset()

    def reset(self) -> None:
        """A new attempt (a restart): its own history, log tail and observations."""
        self.h = History(started_at=0.0, is_trainer=self.is_trainer, kill_grace_s=self.kill_grace_s)
        self.tail: deque = deque(maxlen=400)
        self.step_times: deque = deque(maxlen=50)
        self.last_look: float | None = None
        self._step, self._hb, self._activity = _Seen(), _Seen(), _Seen()

    def take(self, snap: dict, mono_now: float | None = None, adopt: bool = True) -> Report:
        """Fold one snapshot, assess, apply the supervisor's word. `mono_now`: the asker's monotonic clock (None: a
        one-shot asker, with only the remote's stamps). `adopt`: the supervisor's verdict becomes the report's now
        (a job over several hosts adopts it after the node combine: `adopt`)."""
        out = fold(
            self.h, snap, self.job, self.tail, self.log_offset, self.metrics_offset, self.state or self.last_state
        )
        self.log_offset, self.metrics_offset = out.log_offset, out.metrics_offset
        self._keep(out)
        if out.restarts is not None:
            self.restarts = out.restarts
        if mono_now is not None:
            self._own_clock(snap, mono_now)
        self.supervisor = snap.get("supervisor") if isinstance(snap.get("supervisor"), dict) else None
        report = self._report(assess(self.h, self.th))
        aside = snap.get("set_aside") if isinstance(snap.get("set_aside"), list) else []
        report.evidence += [
            f"set aside (the job can write its run dir; this is not a file of ours): {str(a)[:200]}" for a in aside[:5]
        ]
        self._apply_supervisor(report, mono_now, adopt)
        if mono_now is not None:
            self.last_look = mono_now
        return self.note_state(report)

    def failed_look(self, reachable: bool, why: str) -> Report:
        """A look that got no snapshot: the host did not answer (UNREACHABLE, the last state kept), or it answered
        and the probe failed (PROBE_FAILED)."""
        self.h.reachable = reachable
        self.h.probe_error = None if not reachable else why
        if not reachable:
            known = self.state if self.state != "UNREACHABLE" else None
            self.h.last_state = known or self.h.last_state or self.last_state
        report = self._report(assess(self.h, self.th))
        self.h.reachable, self.h.probe_error = True, None
        return self.note_state(report)

    def _keep(self, out: Folded) -> None:
        self.tps_all.extend(out.new_tps)
        self.step_times.extend(out.step_times)
        if out.tau is not None or out.tau_set is not None:
            self.tau, self.tau_set = out.tau, out.tau_set
        self.gpus = out.gpus

    def _own_clock(self, snap: dict, now: float) -> None:
        """Ages measured on this asker's monotonic clock, written back into the history in the snapshot's frame
        (`h.now - age`), so that assess's arithmetic is the asker's elapsed time whatever the wall clock did. An age
        the remote measured on its own monotonic clock (fold.py) needs none of this: it is kept as it came."""
        h = self.h
        prog = snap.get("progress") if isinstance(snap.get("progress"), dict) else {}
        wall = h.now - h.step_changed_at if h.step_changed_at is not None else None
        measured = age_of(prog, "step_age_s") is not None and prog.get("step") == h.last_step
        age = self._step.age(h.last_step, wall, now, self.last_look) if h.last_step is not None else None
        if age is not None and not measured:
            h.step_changed_at = h.now - age
        hb = snap.get("heartbeat") if isinstance(snap.get("heartbeat"), dict) else {}
        if h.heartbeat_age_s is not None and age_of(prog, "heartbeat_age_s") is None:  # as the history compares it
            key = (hb.get("mtime"), hb.get("time"), hb.get("step"), hb.get("phase"))
            age = self._hb.age(key, h.heartbeat_age_s, now, self.last_look)
            h.heartbeat_age_s = round(age, 2) if age is not None else h.heartbeat_age_s
        if h.activity_at is not None and age_of(prog, "activity_age_s") is None:
            age = self._activity.age(h.activity_at, h.now - h.activity_at, now, self.last_look)
            if age is not None:
                h.activity_at = h.now - age

    def eta_s(self) -> float | None:
        """To the last step at the recent pace: a command job's log's own estimate where its bar or step lines give
        one (judge/progress.py), else the total steps (the job's, or its log's) over the pace of the steps seen
        since the step last went back (a restart from a checkpoint)."""
        log = self.job.log_progress(self.is_trainer)
        if log.eta_s is not None:
            return log.eta_s
        total = self.total_steps or log.total
        seen = list(self.step_times)
        if not total or len(seen) < 2 or self.h.last_step is None:
            return None
        start = len(seen) - 1
        while start > 0 and seen[start - 1][1] <= seen[start][1]:
            start -= 1
        (t0, s0), (t1, s1) = seen[start], seen[-1]
        if not (t0 and t1 and t1 >= t0 and s1 > s0):
            return None
        return max(0.0, (total - s1) * (t1 - t0) / (s1 - s0))

    def _report(self, v: Verdict) -> Report:
        h = self.h
        log = self.job.log_progress(self.is_trainer)
        tps = h.tokens_per_s[-1] if h.tokens_per_s else None
        return Report(
            id=self.id,
            host=self.host,
            state=v.state,
            reason=v.reason,
            evidence=list(v.evidence),
            advice=v.advice,
            time=h.now or None,
            since=self.since,
            step=h.last_step,
            epoch=h.epoch,
            loss=h.loss,
            tokens_per_s=tps,
            tau=self.tau,
            tau_set=self.tau_set,
            eta_s=self.eta_s(),
            gpus=list(self.gpus),
            restarts=self.restarts,
            max_restarts=self.max_restarts,
            stop_requested=h.stop_request is not None,
            throughput=tps if tps is not None else log.rate,
            throughput_unit="tokens/s" if tps is not None else log.unit,
        )

    def note_state(self, report: Report) -> Report:
        if report.state != self.state:
            self.since = report.time
            self.state = report.state
        report.since = self.since
        return report

    def _apply_supervisor(self, r: Report, mono_now: float | None, adopt: bool = True) -> None:
        """Who decides: a live, answering supervisor (it restarts and notifies), or one that ended with the job; its
        final word on this attempt is everyone's. Else this asker, saying why. With `adopt`, the supervisor's word
        (its verdict.json) is the report's (`adopt` later for a job over several hosts, after the node combine)."""
        self._said = None
        sup = self.supervisor
        if sup is None:
            r.decided_by, r.decided_why = HERE, "the job has no supervisor (supervise: false, or launched without one)"
            return
        interval = number(sup.get("interval_s")) or 60.0
        said = sup.get("verdict") if isinstance(sup.get("verdict"), dict) else None
        same = said is not None and isinstance(said.get("state"), str) and self._same_attempt(said)
        beat = sup.get("heartbeat") if isinstance(sup.get("heartbeat"), dict) else {}
        remote_age = number(beat.get("age_s"))  # the remote's monotonic now minus its stamp, one machine's clock
        own_age = (
            self._beat.age(beat.get("beat"), remote_age, mono_now, self.last_look)
            if mono_now is not None and beat.get("beat") is not None
            else None
        )
        ages = [a for a in (remote_age, own_age) if a is not None]
        age = max(ages) if ages else None
        alive = sup.get("alive") is True
        answering = alive and age is not None and age <= stale_after_s(interval)
        ended = sup.get("ended") if isinstance(sup.get("ended"), str) else None
        r.supervisor = {
            "alive": alive,
            "answering": answering,
            "ended": ended,
            "heartbeat_age_s": round(age, 1) if age is not None else None,
        }
        gave_up = said.get("gave_up") if same and isinstance(said.get("gave_up"), str) else None
        with_job = not alive and ended is not None and not ended.startswith(("failed", "told to stop"))
        if same and gave_up:  # its final word on this attempt: everyone's word
            self._said = said
            r.gave_up = True
            r.decided_by, r.decided_why = SUPERVISOR, f"the job's supervisor gave up: {gave_up[:300]}"
        elif same and answering:
            self._said = said
            r.decided_by, r.decided_why = SUPERVISOR, "the job's supervisor is alive and answering"
        elif same and with_job and said["state"] in TERMINAL:
            self._said = said
            r.decided_by, r.decided_why = SUPERVISOR, f"the job's supervisor ended with the job ({ended[:200]})"
        elif answering:  # its word is of another attempt (a restart in between): this look's until it speaks again
            r.decided_by, r.decided_why = SUPERVISOR, "the job's supervisor is alive and answering"
            return
        else:
            r.decided_by = HERE
            if alive:
                seen = f"heartbeat unchanged for {age:.0f} s" if age is not None else "no heartbeat"
                r.decided_why = f"the job's supervisor is not answering ({seen}): decided here"
            else:
                why = f"it ended: {ended[:200]}" if ended else "not running"
                r.decided_why = f"the job's supervisor is gone ({why}): decided here"
            if r.state not in TERMINAL or r.state in FAILURES:
                r.evidence.append(r.decided_why)
            return
        if adopt:
            self.adopt(r)

    def adopt(self, r: Report) -> Report:
        """The supervisor's word (its verdict.json, of this attempt) made the report's: state, reason, evidence,
        advice and step, each checked (the job can write that file too); where it says the state this look says, the
        look's own evidence stays (it is the fresher). For a job over several hosts a supervisor that cannot reach a
        node does not decide: this asker does, saying so."""
        said = self._said
        if said is None or r.decided_by != SUPERVISOR:
            return r
        unreached = [str(u)[:200] for u in said.get("unreached") or [] if isinstance(u, str)]
        if unreached and not r.gave_up:
            r.decided_by = HERE
            r.decided_why = f"the job's supervisor cannot reach {'; '.join(unreached)}: decided here"[:400]
            r.evidence.append(r.decided_why)
            return r
        state = said["state"][:40]
        ago = max(0.0, self.h.now - (number(said.get("time")) or self.h.now))
        silent = (self.h.scheduler or {}).get("state") == "NO_ANSWER"
        if silent and state != r.state:  # the scheduler is silent now, on the supervisor's own login node: its word
            r.decided_by = HERE  # came before that silence, and this look's UNREACHABLE is the fresher fact
            r.decided_why = f"the scheduler did not answer this look: the job's supervisor said {state} {ago:.0f} s ago"
            r.evidence.append(r.decided_why[:400])
            return r
        if state == r.state:  # the same word: this look's evidence is the fresher
            r.evidence.append(f"the job's supervisor agrees ({ago:.0f} s ago)")
            return r
        if state in STATE_NAMES:
            ev = said.get("evidence")
            r.state = state
            r.reason = str(said.get("reason"))[:400] if isinstance(said.get("reason"), str) else r.reason
            r.evidence = [str(e)[:400] for e in ev[:12] if isinstance(e, str)] if isinstance(ev, list) else r.evidence
            r.advice = said["advice"][:400] if isinstance(said.get("advice"), str) else r.advice
            step = said.get("step")
            r.step = step if type(step) is int else r.step
        r.evidence.append(f"{r.decided_why}: its verdict, {ago:.0f} s ago")
        return r

    def _same_attempt(self, said: dict) -> bool:
        """The supervisor's verdict is of the attempt this asker sees: the same restart count, the same start."""
        if said.get("restarts") != self.restarts:
            return False
        start = number(said.get("attempt_start"))
        return start is None or not self.h.started_at or abs(start - self.h.started_at) < 2.0
