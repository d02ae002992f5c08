"""One look at a job (`snapshot`, what every poll asks), and the run dir's progress history it keeps: when each sign of
progress last changed, on this machine's monotonic clock (its wall stamps are only shown); the host's memory and
GPU-driver reports. Part of the remote agent.

A test may shift this process's wall clock (DFLASHCTL_TEST_WALL_SHIFT_FILE, `wall_clock_hook`): a real clock step
needs privileges a test machine cannot spend. Only the shown stamps may move with it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import time

from . import queue, supervision
from .common import (
    RESTART_CAUSE,
    RESTART_LOCK,
    RESTARTS,
    STOP_REQUEST,
    STOP_RESULT,
    WRAPPER_PID,
    append_jsonl,
    drain_set_aside,
    job_redactor,
    lock_held,
    locked,
    read_int,
    read_json,
    start_time,
    write_atomic,
)
from .files import checkpoint_dirs, read_heartbeat, read_metrics, read_new, run_figures
from .gpus import read_gpus
from .procs import _run, job_processes, launcher_of, list_sessions, proc_table, slurm_agent, tmux_session


def append_gpu_sample(run_dir: str, gpu: dict, indices: list[int]) -> None:
    """A `command:` job has no trainer to record its GPUs: each poll appends what it read to RUN/gpu.jsonl."""
    wanted = set(indices)
    keep = ("index", "util_pct", "mem_used_mib", "mem_total_mib", "power_w", "temp_c", "sm_mhz", "throttle")
    gpus = [{k: g.get(k) for k in keep} for g in gpu.get("gpus", []) if not wanted or g.get("index") in wanted]
    if not gpus:
        return
    line = {"time": round(time.time(), 3), "source": f"probe:{gpu.get('source')}", "gpus": gpus}
    append_jsonl(os.path.join(run_dir, "gpu.jsonl"), [line])


def snapshot(req: dict) -> dict:
    now, mono = time.time(), time.monotonic()
    run_dir = req.get("run_dir")
    snap: dict = {"time": now, "run_dir": run_dir, "run_dir_exists": bool(run_dir and os.path.isdir(run_dir))}
    # the restart count first: a restart between this read and the reads below leaves an older count beside the new
    # attempt's files (harmless: a restart for an attempt already restarted is refused), never the new count beside
    # the old attempt's dead pane or exit status (which a watcher took for the new attempt's failure)
    snap["restarts"] = (read_int(os.path.join(run_dir, RESTARTS)) or 0) if run_dir else 0
    restarting = bool(run_dir) and lock_held(os.path.join(run_dir, RESTART_LOCK))
    cause = read_json(os.path.join(run_dir, RESTART_CAUSE), 64 << 10) if run_dir else None
    # written before the old attempt is stopped: the last restart's cause, or the one in progress (attempt count + 1)
    snap["restart_cause"] = cause if isinstance(cause, dict) else None
    lines = int(req.get("capture_lines", 40))
    scheduled = req.get("scheduler") == "slurm" and bool(run_dir)
    # a Slurm job's "pane" is its submission: alive, ended (with its exit status) or unknown to the scheduler
    if scheduled:
        snap["session"] = slurm_agent().session_info(run_dir, lines)
    else:
        snap["session"] = tmux_session(req.get("session"), lines)
    table = proc_table()
    root = None if scheduled else launcher_of(run_dir, snap["session"])  # Slurm's nodes: the tag on this machine
    snap["procs"] = job_processes(table, root, req.get("job_id"))
    if run_dir and req.get("append_events") and snap["run_dir_exists"]:
        try:  # a full disk loses the events, never the snapshot
            append_jsonl(os.path.join(run_dir, "events.jsonl"), req["append_events"])
        except OSError as e:
            snap["events_error"] = e.strerror or str(e)
    if run_dir:
        snap["log"] = read_new(
            os.path.join(run_dir, "train.log"), int(req.get("log_offset", 0)), int(req.get("max_log_bytes", 65536))
        )
        snap["metrics"] = read_metrics(
            os.path.join(run_dir, "metrics.jsonl"),
            int(req.get("metrics_offset", 0)),
            int(req.get("max_metrics_bytes", 1 << 20)),
        )
        snap["heartbeat"] = read_heartbeat(run_dir, now)
        snap["exit_code"] = read_int(os.path.join(run_dir, "exit_code"))
        if scheduled and snap["exit_code"] is not None and not snap["session"].get("pane_dead"):
            # asked again after the exit was read: a preemption or a time limit sets Slurm's state before the
            # signal that ends the command, so this answer names the cause where the first one was too early
            snap["session"] = slurm_agent().session_info(run_dir, lines)
        try:  # when it ended, on this clock: over several nodes, which one failed first
            snap["exit_time"] = os.path.getmtime(os.path.join(run_dir, "exit_code"))
        except OSError:
            snap["exit_time"] = None
        stop = read_json(os.path.join(run_dir, STOP_REQUEST))
        present = os.path.exists(os.path.join(run_dir, STOP_REQUEST))
        snap["stop_request"] = (stop if isinstance(stop, dict) else {"time": None}) if present else None
        result = read_json(os.path.join(run_dir, STOP_RESULT))
        snap["stop_result"] = result if isinstance(result, dict) else None
        # before the command starts: its place in the host's queue (agent/queue.py), this attempt's setup step
        snap["queue"], snap["setup"] = queue.entry(run_dir), read_json(os.path.join(run_dir, "setup.json"), 1 << 16)
        try:
            st = os.statvfs(run_dir)
            snap["disk_free_gib"] = round(st.f_bavail * st.f_frsize / 2**30, 2)
        except OSError:
            snap["disk_free_gib"] = None
        snap["checkpoint_gib"] = checkpoint_gib(run_dir) if snap["run_dir_exists"] else None
    if req.get("gpus", True):
        snap["gpu"] = read_gpus(req)
        if req.get("record_gpu") and snap["run_dir_exists"]:
            with contextlib.suppress(OSError):  # a full disk loses a sample, never the snapshot
                append_gpu_sample(run_dir, snap["gpu"], list(req.get("job_gpus") or []))
    if run_dir and snap["run_dir_exists"]:
        snap["supervisor"] = supervision.state(run_dir)
        snap["progress"] = update_progress(
            run_dir, now, snap, list(req.get("job_gpus") or []), int(req.get("metrics_offset", 0)), mono
        )
        snap["host_oom"] = host_oom(run_dir, snap)
    if req.get("figures") and run_dir and snap["run_dir_exists"]:  # `status`: the run's numbers, as `report` has them
        snap["figures"] = run_figures(run_dir)
    if req.get("sessions"):
        snap["sessions"] = list_sessions()
    if (req.get("claim_notices") or req.get("put_notices")) and run_dir and snap["run_dir_exists"]:
        from .outbox import laptop_claim  # the laptop's notices put, and what waits (the supervisor could not send)

        snap["notices"] = laptop_claim(run_dir, req)
    if run_dir:  # a restart during this look (the old pane gone, the new not yet there) is no LOST: said here
        again = read_int(os.path.join(run_dir, RESTARTS)) or 0
        snap["restarting"] = restarting or lock_held(os.path.join(run_dir, RESTART_LOCK)) or again != snap["restarts"]
    snap["set_aside"] = drain_set_aside()  # the run dir's files that were not ours: named in the look's evidence
    return redacted(run_dir, snap)


JOB_TEXT = (
    "session",
    "procs",
    "metrics",
    "heartbeat",
    "stop_request",
    "stop_result",
    "figures",
    "host_oom",
    "restart_cause",
    "notices",
    "supervisor",
    "setup",
)


def redacted(run_dir: str | None, snap: dict) -> dict:
    """The snapshot with the job's secrets masked in all the job's own text (its log, its pane, its records, its
    command lines): the one intake of job text, so every verdict, event, record and notice made from it is clean."""
    redact = job_redactor(run_dir) if run_dir and snap.get("run_dir_exists") else None
    if not redact:
        return snap
    snap["secrets_at_rest"] = bool(redact.plain)  # the plain values are still in the run dir
    if isinstance(snap.get("log"), dict) and isinstance(snap["log"].get("text"), str):
        snap["log"] = {**snap["log"], "text": redact.chunk(snap["log"]["text"])}  # read from an offset: cut edges
    for key in JOB_TEXT:
        if key in snap:
            snap[key] = redact.deep(snap[key])
    return snap


def checkpoint_gib(run_dir: str) -> float | None:
    """The size of the newest complete checkpoint: what the next one will need on the disk."""
    found = checkpoint_dirs(run_dir)
    if not found:
        return None
    total = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(os.path.join(run_dir, found[-1])):
            if entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
    return round(total / 2**30, 3)


# ---------------------------------------------------------------------------------------------- progress history

PROGRESS = "progress.json"
CPU_MOVED_S = 0.2  # CPU seconds a poll must see the job use to count as progress
CPU_SAMPLE_S = 0.3  # a first look's CPU sample
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
BOOT_ID = "/proc/sys/kernel/random/boot_id"
SIGNS = ("heartbeat", "log_size", "cpu_s", "gpu", "step", "exit", "stop")  # each a sign's last change, or first


def wall_clock_hook() -> None:
    """Tests only: shift this process's wall clock by the seconds written in the file DFLASHCTL_TEST_WALL_SHIFT_FILE
    names (read at every call, so a test can step it while the process runs). Monotonic time is never touched."""
    path = os.environ.get("DFLASHCTL_TEST_WALL_SHIFT_FILE")
    if not path or getattr(time.time, "shifted", False):
        return
    real = time.time

    def shifted() -> float:
        try:
            with open(path) as f:
                return real() + float(f.read().strip() or 0)
        except (OSError, ValueError):
            return real()

    shifted.shifted = True  # type: ignore[attr-defined]
    time.time = shifted


def boot_id() -> str | None:
    """This boot's id: a monotonic stamp is comparable with this machine's monotonic now only within one boot."""
    try:
        with open(BOOT_ID) as f:
            return f.read().strip() or None
    except OSError:
        return None


def launcher_mono(wrapper, mono_now: float) -> float | None:
    """When the attempt's launcher started, on the monotonic clock: its start time in /proc (clock ticks since boot)
    against /proc/uptime, both free of the wall clock; only while it runs (the pid and start time still name it, so
    it is this boot's). Uptime counts a suspend that monotonic time does not: an attempt reads older, never younger."""
    if (
        not isinstance(wrapper, dict)
        or not isinstance(wrapper.get("pid"), int)
        or not isinstance(wrapper.get("start"), int)
        or start_time(wrapper["pid"]) != wrapper["start"]
    ):
        return None
    try:
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    age = uptime - wrapper["start"] / CLK_TCK
    return mono_now - age if age >= 0 else None


def _mono_of(entry, boot: str | None, mono_now: float, key: str = "mono") -> float | None:
    """A monotonic stamp kept in the history, if it can be compared with now: taken in this boot, not after now."""
    if not isinstance(entry, dict) or entry.get("boot") != boot:
        return None
    m = entry.get(key)
    return float(m) if isinstance(m, (int, float)) and not isinstance(m, bool) and m <= mono_now + 1 else None


def _clamp(t, lo: float, hi: float) -> float:
    """A time a file or a record claims, believed only inside [lo, hi] (a skewed clock, a touched file)."""
    return hi if not isinstance(t, (int, float)) or isinstance(t, bool) or t > hi else max(float(t), lo)


def _cpu_moving(procs: list[dict], launcher, wait_s: float = CPU_SAMPLE_S) -> bool:
    """Whether the job's processes use CPU right now: their CPU time read twice, `wait_s` apart. What one look can
    measure where there is no history to compare with (a first look, a history that cannot be written)."""
    pids = [p["pid"] for p in procs if p["pid"] != launcher]
    if not pids:
        return False

    def total() -> float:
        t = 0.0
        for pid in pids:
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                t += (int(fields[11]) + int(fields[12])) / CLK_TCK
        return t

    before = total()
    time.sleep(wait_s)
    return total() > before + 0.02


def update_progress(
    run_dir: str, now: float, snap: dict, job_gpus: list[int], metrics_from: int = -1, mono: float | None = None
) -> dict:
    """When each sign of progress last changed, kept in RUN/progress.json and updated by every probe (the supervisor,
    status, watch, a second watcher, a cron job): the heartbeat's content, the log's size, the job's CPU time, its
    GPUs' activity, the newest step, the exit status and a stop request. Each change is kept twice: on the wall
    clock (shown) and on this machine's monotonic clock with the boot id (measured): a clock stepped by hours moves
    no age a probe reports (`*_age_s`, monotonic now minus the stamp). A change first seen now happened after the
    previous look and no later than now: a claimed time (mtime, a record's `time`) is believed only inside that
    window, on both clocks, so neither a future stamp, a stepped clock nor a first-time reader can make an old sign
    look fresh or a fresh one old. A stamp of another boot is converted from its wall stamp, clamped, once. A first
    look measures what one look can (the CPU used over a short sample, mtimes up to now, the launcher's age from
    /proc). A history that cannot be written is said (`history_error`), and the one-look measures stand. One attempt
    (launcher pid and start) per history."""
    mono = time.monotonic() if mono is None else mono
    boot = boot_id()
    path = os.path.join(run_dir, PROGRESS)
    wrapper = read_json(os.path.join(run_dir, WRAPPER_PID))
    attempt = [wrapper.get("pid"), wrapper.get("start")] if isinstance(wrapper, dict) else None
    try:
        attempt_start = os.path.getmtime(os.path.join(run_dir, WRAPPER_PID))
    except OSError:
        attempt_start = snap["session"].get("created")
    if not isinstance(attempt_start, (int, float)):  # no launcher record, no session: the history's own, else now
        stored = read_json(path)
        stored = stored.get("attempt_start") if isinstance(stored, dict) and stored.get("attempt") == attempt else None
        attempt_start = stored if isinstance(stored, (int, float)) and not isinstance(stored, bool) else now
    attempt_start = min(float(attempt_start), now)
    launcher = wrapper.get("pid") if isinstance(wrapper, dict) else None
    hb = snap.get("heartbeat")
    gpus = [g for g in (snap.get("gpu") or {}).get("gpus", []) if not job_gpus or g.get("index") in job_gpus]
    utils = [g.get("util_pct") for g in gpus if isinstance(g.get("util_pct"), (int, float))]
    mem = [g.get("mem_used_mib") for g in gpus]
    try:
        log_mtime = os.path.getmtime(os.path.join(run_dir, "train.log"))
    except OSError:
        log_mtime = None
    error = None
    with contextlib.ExitStack() as held:
        try:  # a lock that cannot be taken (a symlink, a read-only dir) leaves one look, said as `history_error`
            held.enter_context(locked(path + ".lock", timeout=5.0))
        except (OSError, TimeoutError) as e:
            error = f"{type(e).__name__}: {getattr(e, 'strerror', None) or e}"
        prev = read_json(path)
        prev = _believable(prev, attempt, attempt_start, now) if isinstance(prev, dict) else {}
        seen = prev.get("seen_at")
        lo = float(seen) if isinstance(seen, (int, float)) else attempt_start
        clock = prev.get("clock")
        seen_mono = _mono_of(clock, boot, mono, "seen")
        attempt_mono = launcher_mono(wrapper, mono)
        if attempt_mono is None:
            attempt_mono = _mono_of(clock, boot, mono, "attempt")
        if attempt_mono is None:  # converted once from the wall clock, clamped: a stepped clock moves it no more
            attempt_mono = mono - max(0.0, now - attempt_start)
        attempt_mono = min(attempt_mono, mono)
        if seen_mono is not None:
            seen_mono = max(seen_mono, attempt_mono)
        # the signs the previous look noted whenever present: one of them absent then appeared since (an older
        # agent's history did not note them all: there, a sign first seen may be as old as the attempt)
        tracked = clock.get("notes") if isinstance(clock, dict) and isinstance(clock.get("notes"), list) else []
        cur = dict(
            prev,
            attempt=attempt,
            attempt_start=attempt_start,
            seen_at=now,
            clock={"boot": boot, "seen": round(mono, 3), "attempt": round(attempt_mono, 3), "notes": list(SIGNS)},
        )

        def placed(changed_at: float, bound: float | None) -> dict:
            """A change's two stamps: the wall one as claimed (clamped), the monotonic one no earlier than `bound`
            (the previous look, or the attempt's start): the wall's age is believed only up to that."""
            lower = attempt_mono if bound is None else bound
            age = min(max(0.0, now - changed_at), max(0.0, mono - lower))
            return {"changed_at": changed_at, "mono": round(mono - age, 3), "boot": boot}

        def note(key: str, value, claimed, moved=None) -> None:
            old = prev.get(key)
            changed = (
                moved(old["value"])
                if moved and isinstance(old, dict)
                else (not isinstance(old, dict) or old.get("value") != value)
            )
            if changed:
                since, bound = (attempt_start, None) if old is None and key not in tracked else (lo, seen_mono)
                cur[key] = {"value": value, **placed(_clamp(claimed, since, now), bound)}

        if isinstance(hb, dict):
            claim = hb.get("mtime") if not hb.get("future") else hb.get("time")
            note("heartbeat", [hb.get("mtime"), hb.get("time"), hb.get("step"), hb.get("phase")], claim)
        size = int((snap.get("log") or {}).get("size") or 0)
        if size or "log_size" in prev:
            note("log_size", size, log_mtime)
        cpu = round(sum(p.get("cpu_s") or 0 for p in snap.get("procs", []) if p["pid"] != launcher), 2)
        note("cpu_s", cpu, now, moved=lambda old: cpu > old + CPU_MOVED_S or cpu < old)
        if not isinstance(prev.get("cpu_s"), dict):  # a first look: CPU used so far proves no time; a sample does
            moving = _cpu_moving(snap.get("procs", []), launcher) if cpu > CPU_MOVED_S else False
            cur["cpu_s"] = {"value": cpu, **placed(now if moving else attempt_start, None)}
        if snap.get("gpu") is not None:  # `status` reads no GPUs: the history keeps what others saw
            old_gpu = prev.get("gpu") if isinstance(prev.get("gpu"), dict) else {}
            old_mem = old_gpu.get("value")
            busy = any(5 < u < 99 for u in utils) or bool(utils and max(utils) >= 99 and old_mem not in (None, mem))
            cur["gpu"] = {"value": mem, **placed(now, None)} if busy else {**old_gpu, "value": mem}
            cur["gpu"].setdefault("changed_at", None)
        step_of(
            run_dir,
            prev,
            cur,
            snap.get("metrics") if metrics_from == prev.get("metrics_offset", 0) else None,
            attempt_start,
        )
        if cur.get("step_value") != prev.get("step_value"):
            since, bound = (attempt_start, None) if "step" not in prev else (lo, seen_mono)
            cur["step"] = {"value": cur.get("step_value"), **placed(_clamp(cur.get("step_time"), since, now), bound)}
        if isinstance(snap.get("exit_code"), int):
            note("exit", snap["exit_code"], snap.get("exit_time"))
        if isinstance(snap.get("stop_request"), dict):  # `dflashctl kill`'s request: how long its kill has taken
            asked = snap["stop_request"].get("time")
            note("stop", asked, asked)
        for key in SIGNS:  # a stamp kept from another boot, or before the attempt: from its wall stamp, clamped
            entry = cur.get(key)
            if isinstance(entry, dict) and isinstance(entry.get("changed_at"), (int, float)):
                m = _mono_of(entry, boot, mono)
                if m is None:
                    cur[key] = {**entry, **placed(float(entry["changed_at"]), None)}
                elif m < attempt_mono:
                    cur[key] = {**entry, "mono": round(attempt_mono, 3)}
        if error is None:
            try:
                write_atomic(path, json.dumps(cur, separators=(",", ":")).encode())
            except OSError as e:
                error = f"{type(e).__name__}: {e.strerror or e}"

    def age(key: str) -> float | None:
        m = _mono_of(cur.get(key), boot, mono)
        return round(max(0.0, mono - m), 2) if m is not None else None

    signs = {name: age(key) for name, key in (("log grew", "log_size"), ("CPU time", "cpu_s"), ("GPU busy", "gpu"))}
    known = {k: v for k, v in signs.items() if v is not None}
    last = min(known, key=known.get) if known else None
    last_key = {"log grew": "log_size", "CPU time": "cpu_s", "GPU busy": "gpu"}.get(last or "")
    return {
        "attempt_start": cur.get("attempt_start"),
        "heartbeat_changed_at": (cur.get("heartbeat") or {}).get("changed_at"),
        "activity_at": (cur.get(last_key) or {}).get("changed_at") if last_key else cur.get("attempt_start"),
        "activity": last or "",
        "step": (cur.get("step") or {}).get("value"),
        "step_changed_at": (cur.get("step") or {}).get("changed_at"),
        "nonfinite_steps": cur.get("nonfinite_steps", 0),
        # ages on this machine's monotonic clock: what a reader measures with (the stamps above are only shown)
        "attempt_age_s": round(max(0.0, mono - attempt_mono), 2),
        "heartbeat_age_s": age("heartbeat"),
        "activity_age_s": known[last] if last else round(max(0.0, mono - attempt_mono), 2),
        "step_age_s": age("step"),
        "exit_age_s": age("exit"),
        "stop_age_s": age("stop"),
        **({"history_error": error} if error else {}),
    }


def _believable(prev: dict, attempt, attempt_start: float, now: float) -> dict:
    """The stored history of this attempt, with every wall stamp it cannot prove taken back to the attempt's start:
    a stamp after now (a skewed or forged file, a clock stepped back) or before the attempt proves nothing about
    when a sign moved. The monotonic stamps beside them are judged apart (`_mono_of`): a wall step leaves them."""
    if prev.get("attempt") != attempt:
        return {}
    out = dict(prev)
    seen = prev.get("seen_at")
    if not isinstance(seen, (int, float)) or isinstance(seen, bool) or not attempt_start - 1 <= seen <= now + 1:
        out.pop("seen_at", None)
    for key in SIGNS:
        entry = prev.get(key)
        if not isinstance(entry, dict):
            out.pop(key, None)
            continue
        t = entry.get("changed_at")
        number = isinstance(t, (int, float)) and not isinstance(t, bool)
        if t is not None and not (number and attempt_start - 1 <= t <= now + 1):
            out[key] = {**entry, "changed_at": attempt_start}
    return out


def step_of(run_dir: str, prev: dict, cur: dict, read: dict | None = None, attempt_start: float = 0.0) -> None:
    """The newest step record of metrics.jsonl, read on from where the history last stopped; `read` is this probe's
    own read of the file when it started at that same offset (a long watch: the file is not read twice a poll). On
    the attempt's first read, a record from before the attempt started is an earlier attempt's: a restarted job has
    not stepped until its own. Later reads go on from where this attempt's history stopped, so every record there is
    this attempt's whatever its stamp says (a clock stepped back under a young attempt dates its new steps before
    the attempt's start)."""
    first = "metrics_offset" not in prev
    got = read or read_metrics(os.path.join(run_dir, "metrics.jsonl"), int(prev.get("metrics_offset") or 0), 1 << 20)
    cur["metrics_offset"] = got["offset"]
    for rec in got["records"]:
        step = rec.get("step")
        t = rec.get("time")
        if first and isinstance(t, (int, float)) and t < attempt_start - 1:
            continue
        if "event" not in rec and type(step) is int:
            cur["step_value"], cur["step_time"] = step, rec.get("time")
            n = rec.get("nonfinite_steps")
            cur["nonfinite_steps"] = n if type(n) is int else 0


# ---------------------------------------------------------------------------------------------- host memory


def oom_kill_count(path) -> int | None:
    """`oom_kill` of the file the launcher named (cgroup v2 memory.events or v1 memory.oom_control), or None."""
    if not isinstance(path, str) or not path.startswith("/sys/fs/cgroup/"):
        return None
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        return None
    return None


KERNEL_OOM_LINE = re.compile(
    r"^\[\s*(\d+\.\d+)\]\s*(.*(?:Out of memory: Killed process|oom-kill:|Memory cgroup out of "
    r"memory).*)$"
)
KERNEL_XID_LINE = re.compile(r"^\[\s*(\d+\.\d+)\]\s*(.*NVRM: Xid .*)$")  # the GPU driver's error reports


def host_oom(run_dir: str, snap: dict) -> dict:
    """After the job ended: the OOM kills its cgroup counted since the attempt started (the launcher recorded the
    count then), and the kernel log's OOM-killer and GPU driver (Xid) lines since then, where this host lets us read
    them."""
    if snap.get("exit_code") in (None, 0):
        return {}
    wrapper = read_json(os.path.join(run_dir, WRAPPER_PID))
    out: dict = {}
    if isinstance(wrapper, dict) and isinstance(wrapper.get("oom_kill"), int):
        now_count = oom_kill_count(wrapper.get("oom_file"))
        if now_count is not None:
            out["oom_kills"] = now_count - wrapper["oom_kill"]
    start = (snap.get("progress") or {}).get("attempt_start") or 0
    rc, text = _run(["dmesg"], timeout=3)
    if rc == 0:
        try:
            with open("/proc/uptime") as f:
                boot = time.time() - float(f.read().split()[0])
        except (OSError, ValueError):
            boot = None
        recent = text.splitlines()[-2000:]
        for key, pattern in (("kernel_oom", KERNEL_OOM_LINE), ("kernel_xid", KERNEL_XID_LINE)):
            lines = [
                m[2]
                for ln in recent
                if (m := pattern.match(ln)) and boot is not None and boot + float(m[1]) >= start - 1
            ]
            out[key] = lines[-5:]
    return out
