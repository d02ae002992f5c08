"""Pure: one probe snapshot folded into a job's `History` (the facts `assess` judges).

The same fold serves every asker: a long `watch`, a one-shot `status`, `ls`, and the supervisor beside the job on the
remote. Every value that comes from the job's files is checked for its type (a malformed one is skipped and
counted), and every time read back is believed only where the reader can prove it: never after the snapshot's
`now`, never before the attempt started (a stamp outside is no evidence of anything).

Ages come first from the remote's own monotonic clock: the progress history reports how long ago each sign changed
(`*_age_s`, measured there), and those ages are placed in the snapshot's frame (`now - age`), so that a wall clock
stepped by hours moves no age, from the first look on. Wall stamps judge only where no such age came (an older
agent, a stamp from another boot), clamped as above; they stay for display.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from .cause import recorded
from .facts import History
from .progress import Chunk, Progress, Reader


def number(value) -> float | None:
    """A metrics value as a number, or None (a string `loss`, a bool, a list: the record is malformed)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def age_of(prog: dict, key: str) -> float | None:
    """An age the remote measured on its monotonic clock, or None (absent, malformed, negative, not finite)."""
    a = number(prog.get(key))
    return a if a is not None and 0 <= a < float("inf") else None


def provable(t, h: History) -> float | None:
    """A time read back, if the reader can prove it: after `now` it proves nothing (None); before the attempt's
    start it is the start."""
    t = number(t)
    if t is None or t > h.now + 1.0:
        return None
    return max(t, h.started_at) if h.started_at else t


@dataclass
class Job:
    """What the fold needs to know of the job itself."""

    gpus: list[int] = field(default_factory=list)  # the GPU indices the job was given, in rank order
    scheduled: bool = False  # a Slurm job: its "pane" is its submission
    log: Reader = field(default_factory=Reader)  # train.log as read so far: the line being written, its progress
    metrics_steps: bool = False  # the job writes step records: its metrics, not its log, give the step

    def log_progress(self, is_trainer: bool) -> Progress:
        """The progress its log shows, where that is the job's (a command with no step records), else none."""
        return self.log.progress if not is_trainer and not self.metrics_steps else Progress()


@dataclass
class Folded:
    """What one snapshot added beyond the History: for the display and the next request."""

    log_offset: int = 0
    metrics_offset: int = 0
    new_tps: list[float] = field(default_factory=list)
    step_times: list[tuple[float | None, int]] = field(default_factory=list)
    tau: float | None = None
    tau_set: str | None = None
    gpus: list[dict] = field(default_factory=list)
    restarts: int | None = None  # the run dir's restart count


def fold(
    h: History,
    snap: dict,
    job: Job,
    tail: deque,
    log_offset: int = 0,
    metrics_offset: int = 0,
    last_state: str | None = None,
) -> Folded:
    """Take one snapshot into `h` (and its log lines into `tail`). `last_state`: the state the asker saw last, kept
    through a silent scheduler."""
    out = Folded(log_offset, metrics_offset)
    restarts = snap.get("restarts")
    out.restarts = restarts if isinstance(restarts, int) and not isinstance(restarts, bool) else None
    h.now = number(snap.get("time")) or h.now
    pane = snap.get("session") or {}
    h.session_exists = bool(pane.get("exists"))
    h.pane_dead = bool(pane.get("pane_dead"))
    h.pane_status = pane.get("exit_status") if isinstance(pane.get("exit_status"), int) else None
    h.pane_lines = [str(x) for x in pane.get("lines", [])] if h.session_exists else []
    h.scheduler = None
    if job.scheduled:
        h.scheduler = pane.get("slurm") or {"state": "UNKNOWN"}  # none: never submitted, nothing known of it
        if h.scheduler.get("state") == "NO_ANSWER" and last_state not in (None, "UNREACHABLE"):
            h.last_state = last_state  # kept through the scheduler's silence, as the host's
    prog = snap.get("progress") if isinstance(snap.get("progress"), dict) else {}
    h.queue = snap.get("queue") if isinstance(snap.get("queue"), dict) else None
    h.setup = snap.get("setup") if isinstance(snap.get("setup"), dict) else None
    if h.queue is not None:
        h.started_at = 0.0  # queued: the attempt starts when the job leaves the queue (its launcher's own start)
    created = number(prog.get("attempt_start")) or number(pane.get("created"))
    if created and not h.started_at and h.queue is None:
        h.started_at = min(created, h.now) if h.now else created
    h.run_dir_exists = bool(snap.get("run_dir_exists"))
    h.exit_code = snap.get("exit_code") if isinstance(snap.get("exit_code"), int) else None
    h.exit_time = provable(snap.get("exit_time"), h)
    h.attempt_age_s, h.exit_age_s = age_of(prog, "attempt_age_s"), age_of(prog, "exit_age_s")
    h.stop_age_s = age_of(prog, "stop_age_s")
    stop, result = snap.get("stop_request"), snap.get("stop_result")
    h.stop_request = stop if isinstance(stop, dict) else None
    h.stop_result = result if isinstance(result, dict) else None
    h.restarting = snap.get("restarting") is True
    h.restarting_after = (
        recorded(snap.get("restart_cause"), out.restarts + 1) if h.restarting and out.restarts is not None else None
    )
    log = snap.get("log") or {}
    out.log_offset = log.get("offset", log_offset) if isinstance(log.get("offset"), int) else log_offset
    read = None
    if log.get("text"):
        skipped = log.get("skipped")
        cut = (isinstance(skipped, int) and skipped > 0) or out.log_offset < log_offset  # skipped, or truncated
        read = _fold_log(tail, job.log, str(log["text"]), cut)
        h.log_tail = list(tail)
    metrics = snap.get("metrics") or {}
    m_off = metrics.get("offset")
    out.metrics_offset = m_off if isinstance(m_off, int) else metrics_offset
    h.malformed += int(number(metrics.get("malformed")) or 0)
    _fold_records(h, metrics.get("records") or [], out)
    if out.new_tps:
        h.tokens_per_s.append(sum(out.new_tps) / len(out.new_tps))
    gpu = snap.get("gpu") or {}
    wanted = set(job.gpus)
    out.gpus = [
        g
        for g in gpu.get("gpus", [])
        if isinstance(g, dict) and (not wanted or g.get("index") in wanted or g.get("lost"))
    ]
    h.gpus, h.job_gpus = out.gpus, list(job.gpus)
    totals = [g["mem_total_mib"] / 1024 for g in out.gpus if number(g.get("mem_total_mib"))]
    h.gpu_total_gib = max(totals) if totals else None
    h.disk_free_gib = number(snap.get("disk_free_gib"))
    h.checkpoint_gib = number(snap.get("checkpoint_gib"))
    oom = snap.get("host_oom") or {}
    h.oom_kills = oom.get("oom_kills") if isinstance(oom.get("oom_kills"), int) else None
    h.kernel_oom = [str(x)[:300] for x in oom.get("kernel_oom") or []][-5:]
    h.kernel_xid = [str(x)[:300] for x in oom.get("kernel_xid") or []][-5:]
    _fold_progress(h, snap, prog)
    job.metrics_steps = job.metrics_steps or bool(out.step_times)
    if not h.is_trainer and not job.metrics_steps:
        _fold_log_progress(h, job.log, read is not None and bool(read.readings), out)
    return out


def _fold_log(tail: deque, reader: Reader, text: str, cut: bool) -> Chunk:
    """New log text into the tail as a terminal shows it: a line continued across reads is one line, tqdm's `\\r`
    redraws leave their last update, colour codes go. The line still being written is the tail's last entry until
    it ends (then replaced by its end)."""
    before = reader.open_shown
    chunk = reader.feed(text, cut)
    if before is not None and not cut and tail and tail[-1] == before:
        tail.pop()
    tail.extend(chunk.lines)
    if chunk.open is not None:
        tail.append(chunk.open)
    return chunk


def _fold_log_progress(h: History, reader: Reader, found: bool, out: Folded) -> None:
    """A command job's progress from its log (judge/progress.py): its step, loss and epoch, and its phase (only a
    moving step is judged by the stall rule). When the step changed is known no better than the newest sign of
    activity (the log's bytes carry no time): the freshest it can be, so that one look never calls a moving job
    stalled; a watcher's own looks measure the rest (report.py)."""
    p = reader.progress
    if p.phase is None and p.loss is None and p.epoch is None:
        return
    before = h.last_step
    h.last_step = p.step
    h.loss = p.loss if p.loss is not None and math.isfinite(p.loss) else None  # NaN is no loss to show (DIVERGED's)
    h.epoch = p.epoch if p.epoch is not None else h.epoch
    h.phase = p.phase
    if p.step is not None and (p.step != before or h.step_changed_at is None):
        h.step_changed_at = h.activity_at if h.activity_at is not None else h.now
        out.step_times.append((h.now, p.step))
    if found:
        reader.keep_rate()


def _fold_records(h: History, records: list, out: Folded) -> None:
    """Step, fatal, finished and eval records. A step record from before the attempt started (a restarted job's
    metrics.jsonl holds its earlier attempts') is history, not progress: the job is STARTING until it passes it."""
    for rec in records:
        if not isinstance(rec, dict):
            h.malformed += 1
            continue
        ev = rec.get("event")
        if ev is None:
            step = rec.get("step")
            if not isinstance(step, int) or isinstance(step, bool):
                h.malformed += 1
                continue
            t = number(rec.get("time"))
            if t is not None and h.started_at and t < h.started_at - 1.0:
                continue
            h.last_step, h.last_step_time = step, provable(t, h) if h.now else t
            h.epoch = rec.get("epoch") if isinstance(rec.get("epoch"), int) else h.epoch
            h.loss = number(rec.get("loss"))
            tps = number(rec.get("tokens_per_s"))
            if tps is not None:
                out.new_tps.append(tps)
            out.step_times.append((h.last_step_time, step))
        elif ev == "fatal":
            t = number(rec.get("time"))
            if t is None or not h.started_at or t >= h.started_at - 1.0:  # an earlier attempt's fatal was judged
                h.fatal = rec
        elif ev == "finished":
            h.finished = True
        elif ev == "eval":
            out.tau = number(rec.get("tau"))
            out.tau_set = str(rec.get("prompt_set") or "holdout")[:64]


def _fold_progress(h: History, snap: dict, prog: dict) -> None:
    """Stall and staleness come from the run dir's progress history (kept by the supervisor and every probe): when
    the heartbeat's content, the log, the CPU time, the GPUs and the newest step last changed, as ages on the
    remote's monotonic clock (else its wall stamps). A stamp the reader cannot prove is no evidence; a history that
    could not be written is said, and the probe's own one-look measures stand in for it."""
    hb = snap.get("heartbeat")
    h.heartbeat_age_s = None
    if isinstance(hb, dict):
        if hb.get("malformed"):
            h.malformed += 1
        h.phase = hb.get("phase") if isinstance(hb.get("phase"), str) else h.phase
        age = age_of(prog, "heartbeat_age_s")
        changed = h.now - age if age is not None else provable(prog.get("heartbeat_changed_at"), h)
        if "heartbeat_changed_at" in prog and changed is None and h.started_at:
            changed = h.started_at  # a stamp after now: the content is known no fresher than the attempt
        stale = h.started_at and isinstance(hb.get("time"), (int, float)) and hb["time"] < h.started_at - 1
        if changed is not None and not stale and not (h.pane_dead or h.exit_code is not None):
            h.heartbeat_age_s = round(max(0.0, h.now - changed), 2)  # a finished job's heartbeat ages by design
    age = age_of(prog, "activity_age_s")
    at = h.now - age if age is not None else provable(prog.get("activity_at"), h)
    h.activity_at = at if at is not None else (h.activity_at or h.started_at or h.now)
    h.activity = str(prog.get("activity") or "")
    step = prog.get("step")
    if isinstance(step, int) and not isinstance(step, bool) and (h.last_step is None or step >= h.last_step):
        age = age_of(prog, "step_age_s")
        h.step_changed_at = h.now - age if age is not None else provable(prog.get("step_changed_at"), h)
        if h.step_changed_at is None and h.started_at:
            h.step_changed_at = h.started_at
        if h.last_step is None:  # a reader that started past the records (offsets): the history knows
            h.last_step = step
    n = prog.get("nonfinite_steps")
    h.nonfinite_steps = n if isinstance(n, int) and not isinstance(n, bool) else 0
    err = prog.get("history_error")
    h.history_error = str(err)[:200] if err else None  # assess says it in the verdict's evidence
