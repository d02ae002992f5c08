"""Pure: from what the probes saw so far, decide what state a job is in, with the evidence and what to do next.

No I/O here; the facts and the states are judge/facts.py's. `classify_log` reads any log text (a train.log, a tmux
capture, a SLURM output); `assess` combines it with the
snapshots' facts (pane, exit code, metrics records, heartbeat, throughput history) into a `Verdict`.
"""

from __future__ import annotations

import statistics

from .facts import ADVICE, TERMINAL, History, Thresholds, Verdict
from .logs import (
    CONSEQUENCE,
    SIG,
    START_ERRORS,
    Finding,
    Log,
    classify_log,
    gpu_fault,
    this_attempt,
)
from .progress import PHASES as LOG_PHASES
from .progress import STEPPING

STOP_RESULT_GRACE_S = 120.0  # after grace_s, how long a kill may take to record its result before it is presumed dead
EARLY_S = 300.0  # a command job (no step records) counts as "before its first step" for this long
SIGKILL_CODES = (-9, 137)
PEER_LOST = SIG["peer_lost"].pattern  # a rank that died because a peer did


def _verdict(state: str, reason: str, evidence: list[str], h: History, advice: str | None = None) -> Verdict:
    ev = [str(e) for e in evidence]
    if h.history_error and state not in TERMINAL:
        ev.append(f"warning: the progress history cannot be written ({h.history_error}): judged from one look")
    return Verdict(state, reason, ev, advice or ADVICE.get(state), h.last_step)


FATAL_STATE = {"dense_fallback": "DENSE_FALLBACK", "config": "CONFIG_ERROR", "diverged": "DIVERGED"}
EXIT_STATE = {
    3: ("DENSE_FALLBACK", "dense fallback refused"),
    2: ("CONFIG_ERROR", "config error"),
    4: ("DIVERGED", "the loss diverged"),
}  # the bundled trainer's exit statuses


def _find(h: History, lines: list[str]) -> Finding | None:
    return classify_log(lines, h.gpu_total_gib, h.disk_free_gib, h.checkpoint_gib)


def _gpu_named(h: History, rank: str | None) -> str:
    """The failed GPU as the readings and the job's GPU list name it: index, UUID, node."""
    bad = [g for g in h.gpus if isinstance(g.get("ecc_uncorrected"), int) and g["ecc_uncorrected"] > 0]
    gpu = bad[0] if bad else None
    if gpu is None and rank and h.job_gpus:
        index = h.job_gpus[int(rank[4:]) % len(h.job_gpus)]
        gpu = next((g for g in h.gpus if g.get("index") == index), {"index": index})
    if gpu is None:
        return ""
    uuid = f" ({gpu['uuid']})" if gpu.get("uuid") else ""
    ecc = f", {gpu['ecc_uncorrected']} uncorrectable ECC errors" if gpu.get("ecc_uncorrected") else ""
    node = f" on {h.node}" if h.node else ""
    return f"GPU {gpu.get('index')}{uuid}{node}{ecc}"


def _refine(h: History, found: Finding) -> Finding:
    """What the snapshots add to a log finding: the failed GPU's name, the cgroup's or kernel's word on an OOM kill."""
    if found.state == "GPU_FAULT":
        named = _gpu_named(h, found.rank)
        if named:
            return Finding(found.state, f"{found.reason}; {named}", [named, *found.evidence], found.rank)
    if found.state == "HOST_OOM" and "confirmed" not in found.reason and (h.oom_kills or h.kernel_oom):
        how = f"{h.oom_kills} OOM kill(s) in the job's cgroup" if h.oom_kills else h.kernel_oom[-1]
        reason = found.reason.split(":")[0] + f": confirmed, {how}"
        return Finding(found.state, reason, [*h.kernel_oom[-1:], *found.evidence], found.rank)
    return found


def _hardware_readings(h: History) -> Finding | None:
    """A job GPU that NVML or nvidia-smi reports with uncorrectable ECC errors (launch refuses such GPUs, so the
    errors arose while the job ran)."""
    named = _gpu_named(h, None)
    if named and "uncorrectable" in named:
        return Finding("GPU_FAULT", f"GPU hardware error: {named}", [named])
    xid = gpu_fault(Log.of(h.kernel_xid), None)  # the host's kernel log, where it was readable
    return Finding(xid.state, f"{xid.reason} (the host's kernel log)", xid.evidence) if xid else None


def _crash_record(h: History, found: Finding | None) -> Finding | None:
    """The trainer's own `fatal` crash record names a rank's exception where the log shows only a wrapper's summary
    (torchrun's ChildFailedError) or nothing: the rank's error is the root cause."""
    message = str((h.fatal or {}).get("message") or "")
    if (h.fatal or {}).get("kind") != "crash" or not message:
        return found
    if found is None or (found.state == "CRASHED" and CONSEQUENCE.search(found.reason + " ".join(found.evidence[:1]))):
        rank = (h.fatal or {}).get("rank")
        where = f" on rank{rank}" if isinstance(rank, int) else ""
        return Finding("CRASHED", f"{message.split(':')[0]}{where}", [message, *(found.evidence if found else [])])
    return found


def _strings(value, n: int, width: int = 300) -> list[str]:
    """At most `n` strings of a list read from the run dir (the job can write it), each cut to `width`."""
    return [str(x)[:width] for x in value[:n] if isinstance(x, str)] if isinstance(value, list) else []


def _queued(h: History) -> Verdict:
    """The job waits on its host for its GPUs (its ticket, agent/queue.py): its place and what holds them."""
    q = h.queue or {}
    waiting = _strings(q.get("waiting_for"), 5)
    gpus = ",".join(str(g) for g in q.get("gpus") or [] if type(g) is int) if isinstance(q.get("gpus"), list) else ""
    since = q.get("since")
    ago = f" for {max(0.0, h.now - since):.0f} s" if type(since) in (int, float) and h.now else ""
    if q.get("state") == "starting":
        return _verdict("STARTING", f"leaving the queue: GPU {gpus} free", [f"queued{ago}, now starting"], h)
    place = q.get("position")
    where = f"place {place} in the host's queue" if type(place) is int else "in the host's queue"
    held = waiting[0] if waiting else "its GPUs"
    return _verdict(
        "QUEUED",
        f"{where}, waiting for {held}",
        [f"queued{ago} (ticket {q.get('ticket')}) for GPU {gpus}", *waiting],
        h,
    )


def _setup_said(h: History) -> str | None:
    state = (h.setup or {}).get("state")
    return state if isinstance(state, str) else None


def _setup_seconds(h: History) -> float:
    """How long this attempt's setup step took (done or still running): not part of the command's startup."""
    secs = (h.setup or {}).get("seconds")
    return float(secs) if type(secs) in (int, float) and secs > 0 else 0.0


def _setup(h: History) -> Verdict:
    """A live attempt inside its setup step: waiting for another launch's setup of the release, or running it."""
    s = h.setup or {}
    command = str(s.get("command") or "")[:200]
    limit = s.get("timeout_s")
    bound = f" (limit {limit:.0f} s)" if type(limit) in (int, float) else ""
    if s.get("state") == "waiting":
        why = f"setup: waiting for another launch's setup of release {str(s.get('release'))[:40]}"
    else:
        why = f"setup: running for {_setup_seconds(h):.0f} s{bound}"
    return _verdict("STARTING", why, [f"setup: {command}", *_strings(s.get("tail"), 3)], h)


def _setup_failed(h: History) -> Verdict:
    s = h.setup or {}
    code = s.get("exit")
    how = "timed out" if s.get("timed_out") is True else f"exit {code}"
    secs = _setup_seconds(h)
    ev = [f"setup `{str(s.get('command') or '')[:200]}`: {how} after {secs:.0f} s", *_strings(s.get("tail"), 12)]
    return _verdict("SETUP_FAILED", f"the job's setup failed ({how}): its command never started", ev, h)


def _ended(h: History, lines: list[str]) -> Verdict:
    if _setup_said(h) == "failed":
        return _setup_failed(h)
    code = h.exit_code if h.exit_code is not None else h.pane_status
    if h.fatal and h.fatal.get("kind") in FATAL_STATE:
        found = _find(h, lines)
        ev = [h.fatal.get("message", "")] + (found.evidence if found and found.state != "CRASHED" else [])
        return _verdict(FATAL_STATE[h.fatal["kind"]], f"fatal record: {h.fatal['kind']} (exit {code})", ev, h)
    if code == 0 and (h.finished or not h.is_trainer):
        at = f" at step {h.last_step}" if h.last_step is not None else ""
        return _verdict("FINISHED", f"exit 0{at}", [f"exit_code 0{at.replace(' at', ',')}"], h)
    found = _find(h, lines)
    if found is None or found.state in ("NCCL_TIMEOUT", "NCCL_ERROR", "CRASHED", "STALLED"):
        found = _hardware_readings(h) or found
    found = _crash_record(h, found)
    if found and found.early and h.last_step is not None:  # it trained first: an ordinary crash
        found = Finding("CRASHED", found.reason.split(":")[1].split(";")[0].strip(), found.evidence, found.rank)
    early = h.last_step is None and (h.is_trainer or attempt_age(h) < EARLY_S)
    if found and found.state == "CRASHED" and early and START_ERRORS.match(found.evidence[0]):
        reason = f"failed before its first step: {found.evidence[0].split(':')[0]} (exit {code}); a restart repeats it"
        return _verdict("CONFIG_ERROR", reason, found.evidence, h)
    if found is None and code in SIGKILL_CODES:
        found = _refine(
            h,
            Finding(
                "HOST_OOM",
                f"killed by SIGKILL (exit {code}) with no stop request: likely the kernel's OOM killer (host RAM)",
                [f"exit_code {code}"],
            ),
        )
        return _verdict(found.state, found.reason, found.evidence, h)
    if found:
        found = _refine(h, found)
        return _verdict(found.state, f"{found.reason} (exit {code})", found.evidence, h, found.advice)
    if h.is_trainer and code in EXIT_STATE:
        state, why = EXIT_STATE[code]
        return _verdict(state, f"exit status {code} ({why})", [f"exit_code {code}"], h)
    tail = [ln for ln in lines if ln.strip()][-3:]
    return _verdict("CRASHED", f"exit status {code}", [f"exit_code {code}", *tail], h)


def _slow(h: History, th: Thresholds) -> str | None:
    tps = h.tokens_per_s
    if len(tps) < th.slow_polls:
        return None
    recent = tps[-th.slow_polls :]
    if th.throughput_floor is not None and all(t < th.throughput_floor for t in recent):
        return f"tokens/s {recent[-1]:,.0f} under the floor {th.throughput_floor:,.0f} for {th.slow_polls} polls"
    earlier = tps[: -th.slow_polls]
    if len(earlier) >= th.slow_polls:
        median = statistics.median(earlier[-20:])
        if all(t < th.throughput_drop * median for t in recent):
            return f"tokens/s {recent[-1]:,.0f} under {th.throughput_drop:.0%} of its median {median:,.0f}"
    return None


def _restarting_evidence(h: History) -> list[str]:
    """What a look inside a restart can say: the lock, and the cause its decider recorded (the failure it ends)."""
    said = ["the run dir's restart lock is held: the old attempt is being stopped and the next one started"]
    cause = h.restarting_after  # bounded by judge/cause.py
    if cause is not None:
        by = f" ({cause['by']})" if cause["by"] else ""
        said += [f"restarting after {cause['after']}{by}: {cause['reason']}"[:400], *cause["evidence"][:3]]
    return said


def assess(h: History, th: Thresholds) -> Verdict:
    """The job's state now. Failure evidence in the logs outranks progress numbers; progress alone proves RUNNING."""
    if not h.reachable:
        v = _verdict("UNREACHABLE", "the host did not answer", [f"last state {h.last_state or 'not seen yet'}"], h)
        return v
    if h.probe_error is not None:
        return _verdict("PROBE_FAILED", "the host answered but the probe failed there", [h.probe_error], h)
    lines = this_attempt(h.log_tail + [ln for ln in h.pane_lines if ln not in h.log_tail[-200:]])
    if h.stop_request is not None:
        if _ended_before_the_stop(h):  # a kill of a job that had already ended keeps the job's own verdict
            v = _ended(h, lines)
            v.evidence.append("`dflashctl kill` came after the job had ended: its verdict is kept")
            return v
        return _stopped(h)
    if h.restarting:  # the old attempt stopped, the new one not yet started: neither LOST nor the old one's end
        return _verdict("STARTING", "a restart is in progress", _restarting_evidence(h), h)
    if h.queue is not None and h.session_exists and not h.pane_dead and h.exit_code is None and h.run_dir_exists:
        return _queued(h)
    if h.scheduler is not None:
        scheduled = _scheduled(h) or _settling(h)
        if scheduled is not None:
            return scheduled
    if h.exit_code is not None or (h.session_exists and h.pane_dead):
        return _ended(h, lines)
    if not h.session_exists:
        what = "run dir" if not h.run_dir_exists else ("Slurm job" if h.scheduler is not None else "tmux session")
        return _verdict("LOST", f"the {what} is gone and no exit status was written", [f"{what} missing"], h)
    if not h.run_dir_exists:
        return _verdict("LOST", "the run dir is gone", ["run dir missing"], h)
    if _setup_said(h) in ("waiting", "running"):  # its own timeout bounds it: no stall rule before the command
        return _setup(h)
    if h.fatal and h.fatal.get("kind") in FATAL_STATE:  # alive, but the trainer already said why it stops
        st = FATAL_STATE[h.fatal["kind"]]
        return _verdict(st, f"fatal record: {h.fatal['kind']}", [h.fatal.get("message", "")], h)
    found = _find(h, lines)
    if found and found.state in ("DENSE_FALLBACK", "NCCL_TIMEOUT", "RECOMPILE_LIMIT", "GPU_FAULT", "DIVERGED"):
        found = _refine(h, found)
        if found.state == "GPU_FAULT":  # a fault line that progress has outlived is a warning, until it stops
            v = _alive(h, th)
            if v.state in ("RUNNING", "STARTING"):
                v.evidence.append(f"warning: {found.reason}; the job still makes progress")
                return v
        return _verdict(found.state, found.reason, found.evidence, h, found.advice)
    return _alive(h, th)


def attempt_age(h: History) -> float:
    """How long the attempt's command has run: the remote's monotonic age of the attempt, else its wall stamps'
    difference, less its setup step (a `pip install` is not the command's startup)."""
    age = h.attempt_age_s if h.attempt_age_s is not None else h.now - h.started_at
    return max(0.0, age - _setup_seconds(h))


def _command(h: History, th: Thresholds) -> Verdict:
    """A command job (no metrics.jsonl): by the step its log prints while that step moves (a progress bar, `step N
    loss X` lines: judge/progress.py), else by any sign of progress (its log, CPU time, GPUs): during an evaluation,
    before the first step or after its bar finished, the step stands still by design."""
    if h.phase == STEPPING and h.last_step is not None:
        seen = h.step_changed_at if h.step_changed_at is not None else (h.activity_at or h.started_at or h.now)
        idle = max(0.0, h.now - seen)
        if idle > th.stall_after_s:
            ev = [f"no new step in its log for {idle:.0f} s (limit {th.stall_after_s:.0f})", f"last step {h.last_step}"]
            return _verdict("STALLED", "no step progress (its log)", ev, h)
        loss = "" if h.loss is None else f", loss {h.loss:.4f}" if abs(h.loss) >= 1e-3 else f", loss {h.loss:.3g}"
        return _verdict("RUNNING", f"step {h.last_step}{loss} (its log)", [f"step {h.last_step} {idle:.0f} s ago"], h)
    quiet = h.now - (h.activity_at if h.activity_at is not None else h.now)
    if quiet > th.stall_after_s:
        ev = [
            f"no sign of progress for {quiet:.0f} s (limit {th.stall_after_s:.0f}): log unchanged, CPU time "
            "flat, GPUs idle or pinned at 100% with frozen memory"
        ]
        if h.last_step is not None:
            ev.append(f"last step {h.last_step}: {h.phase}")
        return _verdict("STALLED", "no progress (log, CPU, GPUs)", ev, h)
    seen = f"{h.activity} {quiet:.0f} s ago" if h.activity else "just started"
    if h.last_step is not None:
        return _verdict("RUNNING", f"alive, {seen}; step {h.last_step}, {h.phase}", [f"last progress: {seen}"], h)
    return _verdict("RUNNING", f"alive, {seen} (no metrics.jsonl)", [f"last progress: {seen}"], h)


def _alive(h: History, th: Thresholds) -> Verdict:
    """A live job with no failure in sight: STARTING, RUNNING or STALLED, from its progress."""
    if h.heartbeat_age_s is not None and h.heartbeat_age_s > th.heartbeat_max_age_s:
        step = f"step {h.last_step}" if h.last_step is not None else "before the first step"
        ev = [f"heartbeat {h.heartbeat_age_s:.0f} s old (limit {th.heartbeat_max_age_s:.0f})", step]
        return _verdict("STALLED", "the trainer's heartbeat stopped (process frozen or stopped)", ev, h)
    if not h.is_trainer and (h.last_step is None or h.phase in LOG_PHASES):  # any command: no step records
        return _command(h, th)
    if h.last_step is None:
        waited = attempt_age(h)
        if waited > th.startup_budget_s:
            ev = [f"{waited:.0f} s since start, budget {th.startup_budget_s:.0f} s", f"phase {h.phase}"]
            return _verdict("STALLED", "no first step within the startup budget", ev, h)
        phase = h.phase or "waiting for the first heartbeat"
        return _verdict("STARTING", f"{phase} ({waited:.0f} s since start)", [f"phase {phase}"], h)
    seen = h.step_changed_at if h.step_changed_at is not None else (h.last_step_time or h.started_at or h.now)
    idle = max(0.0, h.now - seen)
    if idle > th.stall_after_s:
        ev = [f"no new step for {idle:.0f} s (limit {th.stall_after_s:.0f})", f"last step {h.last_step}"]
        return _verdict("STALLED", "no step progress", ev, h)
    slow = _slow(h, th)
    if slow:
        return _verdict("STALLED", "throughput collapsed", [slow], h)
    tps = f"{h.tokens_per_s[-1]:,.0f} tok/s" if h.tokens_per_s else "tok/s unknown"
    loss = f", loss {h.loss:.4f}" if h.loss is not None else ""
    ev = [f"step {h.last_step} {idle:.0f} s ago"]
    if h.malformed:
        ev.append(f"{h.malformed} malformed metrics lines skipped")
    if h.nonfinite_steps:
        ev.append(f"{h.nonfinite_steps} non-finite steps in a row skipped (no update)")
    return _verdict("RUNNING", f"step {h.last_step}, {tps}{loss}", ev, h)


# Slurm's ends that name their cause themselves: they outrank what the log shows (the SIGTERM traceback of a job out of
# time, the other nodes' NCCL timeouts after a node failed). FAILED and COMPLETED leave the cause to the log.
SLURM_END_STATE = {
    "TIMEOUT": "TIMEOUT",
    "DEADLINE": "TIMEOUT",
    "PREEMPTED": "PREEMPTED",
    "NODE_FAIL": "NODE_FAIL",
    "BOOT_FAIL": "NODE_FAIL",
    "OUT_OF_MEMORY": "HOST_OOM",
    "CANCELLED": "CANCELLED",
}
SLURM_QUEUED = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SUSPENDED")


def _scheduled(h: History) -> Verdict | None:
    """What Slurm's word on the job settles by itself: queued (PENDING, with Slurm's reason), or one of its own ends.
    None: the job runs or ended by itself, and the usual rules judge it from its files."""
    s = h.scheduler or {}
    state, reason, job = str(s.get("state") or ""), str(s.get("reason") or "None"), s.get("id")
    nodes = f" on {s['nodes']}" if s.get("nodes") and s.get("nodes") != "(null)" else ""
    said = f"slurm job {job} {state}{nodes}" + (f" ({reason})" if reason != "None" else "")
    at = [f"last step {h.last_step}"] if h.last_step is not None else []
    if state == "FOREIGN":  # the id now names someone else's job: ours is gone, and that one is never touched
        return _verdict("LOST", "the Slurm id now names another job: this job's submission is gone", [reason], h)
    if state == "NO_ANSWER":  # like a host that does not answer: nothing is concluded, the last state is kept
        ev = [f"slurm job {job}: {reason}", f"last state {h.last_state or 'not seen yet'}"]
        return _verdict("UNREACHABLE", "Slurm's controller did not answer on the login node", ev, h)
    if state in SLURM_QUEUED:
        why = reason if reason != "None" else "waiting to be scheduled"
        return _verdict("PENDING", f"{state.lower()} in Slurm's queue: {why}", [said], h)
    verdict = SLURM_END_STATE.get(state)
    if verdict is None:
        return None
    if verdict == "TIMEOUT":
        limit = f" ({s['time_limit']})" if s.get("time_limit") else ""
        return _verdict("TIMEOUT", f"out of wall time{limit}", [said, *at], h)
    if verdict == "NODE_FAIL":
        return _verdict("NODE_FAIL", f"a node failed{nodes}: the restart excludes it", [said, *at], h)
    if verdict == "HOST_OOM":
        return _verdict("HOST_OOM", "Slurm: OUT_OF_MEMORY (the job's memory limit on its nodes)", [said, *at], h)
    if verdict == "PREEMPTED":
        return _verdict("PREEMPTED", "preempted by the scheduler", [said, *at], h)
    return _verdict("CANCELLED", "cancelled outside dflashctl (scancel, or an administrator)", [said, *at], h)


SLURM_ACTIVE = ("RUNNING", "COMPLETING", "CONFIGURING", "SIGNALING", "STAGE_OUT", "RESIZING")
SLURM_SETTLE_S = 30.0  # after the command's end, how long Slurm may take to say its own end of the job


def _settling(h: History) -> Verdict | None:
    """The command ended (exit_code written) while Slurm still says the job runs: a preemption, the time limit or a
    scancel signal the job before its state says so (GraceTime, KillWait), and a probe may read the scheduler just
    before the exit. Slurm's own word names the cause within seconds; until then nothing is concluded (a preempted
    job is not CRASHED). Past SLURM_SETTLE_S the files judge, as for a job that ended by itself."""
    state = str((h.scheduler or {}).get("state") or "")
    if h.exit_code is None or state not in SLURM_ACTIVE:
        return None
    ended = h.exit_time if h.exit_time is not None else h.now
    ago = h.exit_age_s if h.exit_age_s is not None else max(0.0, h.now - ended)  # the remote's monotonic age first
    if ago > SLURM_SETTLE_S:
        return None
    ev = [
        f"exit_code {h.exit_code} written {ago:.0f} s ago",
        f"slurm job {(h.scheduler or {}).get('id')} still {state}",
    ]
    return _verdict("RUNNING", f"the command ended (exit {h.exit_code}); waiting for Slurm's word on the job", ev, h)


def _ended_before_the_stop(h: History) -> bool:
    """The job's exit status was written before the stop request (both on the remote's clock)."""
    asked = (h.stop_request or {}).get("time")
    if h.exit_code is None or h.exit_time is None or not isinstance(asked, (int, float)) or isinstance(asked, bool):
        return False
    return h.exit_time < asked


def _stopped(h: History) -> Verdict:
    """A job the user stopped: KILLED once its kill verified that nothing is left, KILL_FAILED naming what survived,
    STOPPING while the kill runs. Never a failure to restart from: the exit status of a killed job is the kill's."""
    res = h.stop_result
    if res and res.get("result") == "KILLED":
        return _verdict("KILLED", "stopped by `dflashctl kill` and verified", [f"check: {res.get('gpu_check')}"], h)
    if res:
        ev = [
            f"survivors: pids {res.get('remaining')}",
            f"GPU holders: {res.get('gpu_holders')}",
            f"session closed: {res.get('session_closed')}",
        ]
        return _verdict("KILL_FAILED", "`dflashctl kill` could not verify that the job is gone", ev, h)
    asked = h.stop_request.get("time") if h.stop_request else None
    ago = h.stop_age_s if h.stop_age_s is not None else (h.now - asked if isinstance(asked, (int, float)) else None)
    if ago is not None and ago > h.kill_grace_s + STOP_RESULT_GRACE_S:  # the remote's monotonic age first
        ev = [f"stop requested {ago:.0f} s ago, no result recorded"]
        return _verdict("KILL_FAILED", "a kill was requested but never finished", ev, h)
    return _verdict("STOPPING", "a stop was requested (`dflashctl kill`)", [f"stop request at {asked}"], h)
