"""Stopping a job (`reap`, what `kill` asks): the stop request first, under the run dir's lock, then SIGTERM, grace,
SIGKILL, verification, and the result recorded where every watcher sees it. Part of the remote agent."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

from . import queue, supervision
from .common import RESTART_LOCK, STOP_REQUEST, STOP_RESULT, locked, read_int, scrub_secrets, start_time, write_atomic
from .gpus import read_gpus
from .procs import TMUX, _run, job_processes, launcher_of, proc_table, same_process, slurm_agent, tmux_session

VERIFY_S = 5.0  # after SIGKILL, how long the kill keeps finding and killing the job's processes before giving up


# ---------------------------------------------------------------------------------------------- stopping


class Signaller:
    """Signals processes named by (pid, start): through a pidfd where the kernel has them (a pidfd cannot reach a
    later process that reuses the pid), else after checking the start time again."""

    def __init__(self) -> None:
        self.fds: dict[int, int] = {}

    def adopt(self, p: dict) -> bool:
        if p["pid"] in self.fds:
            return True
        opener = getattr(os, "pidfd_open", None)
        if opener is not None:
            try:
                fd = opener(p["pid"])
            except OSError:
                return False
            if start_time(p["pid"]) != p["start"]:  # the pid was reused before we held it
                os.close(fd)
                return False
            self.fds[p["pid"]] = fd
            return True
        return same_process(p)

    def send(self, p: dict, sig: int) -> bool:
        try:
            fd = self.fds.get(p["pid"])
            if fd is not None and hasattr(signal, "pidfd_send_signal"):
                signal.pidfd_send_signal(fd, sig)
            elif same_process(p):
                os.kill(p["pid"], sig)
            else:
                return False
            return True
        except (ProcessLookupError, OSError):
            return False

    def close(self) -> None:
        for fd in self.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()


def stop_processes(run_dir: str | None, session: str | None, job_id: str | None, grace_s: float) -> dict:
    """SIGTERM every process of the job but its wrapper (so that the wrapper records the exit status), wait up to
    `grace_s`, SIGKILL what is left, then keep looking for processes of the job (a dying parent may spawn more) and
    SIGKILL them until none is left or VERIFY_S have passed. Closes the tmux session."""
    pane = tmux_session(session, 0)
    root = launcher_of(run_dir, pane)
    procs = job_processes(proc_table(), root, job_id)
    wrapper = {root["pid"], root.get("child")} if root else set()
    sig = Signaller()
    ident = lambda p: {"pid": p["pid"], "start": p["start"]}  # noqa: E731
    targets = [ident(p) for p in procs if p["pid"] not in wrapper and sig.adopt(ident(p))]
    report: dict = {
        "found": [{k: p[k] for k in ("pid", "ppid", "start", "cmd")} for p in procs],
        "term": [],
        "kill": [],
    }
    for p in targets:
        if sig.send(p, signal.SIGTERM):
            report["term"].append(p["pid"])
        sig.send(p, signal.SIGCONT)  # a stopped process (SIGSTOP, a debugger) would hold SIGTERM pending forever
    deadline = time.monotonic() + grace_s
    while any(same_process(p) for p in targets) and time.monotonic() < deadline:
        time.sleep(0.1)
    for p in targets:
        if same_process(p) and sig.send(p, signal.SIGKILL):
            report["kill"].append(p["pid"])
    end = time.monotonic() + 3  # the wrapper writes exit_code once its command is gone, then exits
    while root and same_process(root) and time.monotonic() < end:
        time.sleep(0.05)
    if session:
        _run([*TMUX, "kill-session", "-t", f"={session}"])
    left: list[dict] = []
    quiet = 0  # nothing left is believed after two looks 0.3 s apart: a dying parent may still be forking
    end = time.monotonic() + VERIFY_S
    while time.monotonic() < end:
        known = {p["pid"] for p in targets}
        again = job_processes(proc_table(), root, job_id)
        left = [ident(p) for p in again] + [
            p for p in targets if same_process(p) and p["pid"] not in {q["pid"] for q in again}
        ]
        quiet = 0 if left else quiet + 1
        if quiet >= 2:
            break
        if not left:
            time.sleep(0.3)
            continue
        for p in left:
            if sig.adopt(p) and sig.send(p, signal.SIGKILL) and p["pid"] not in known:
                report["kill"].append(p["pid"])
                targets.append(p)
        time.sleep(0.2)
    sig.close()
    if quiet < 2:  # gave up: what is there now, looked at afresh (those just SIGKILLed may be gone)
        time.sleep(0.2)
        left = [ident(p) for p in job_processes(proc_table(), root, job_id)] + [p for p in targets if same_process(p)]
    report["remaining"] = sorted({p["pid"] for p in left if same_process(p)})
    report["every"] = sorted({p["pid"] for p in targets} | wrapper - {None})
    report["session_closed"] = not tmux_session(session, 0).get("exists") if session else True
    return report


def reap(req: dict) -> dict:
    """`dflashctl kill`: the stop request first (under the run dir's lock, so that no restart starts after it),
    then stop, verify, and record the result where every watcher sees it."""
    run_dir = req.get("run_dir")
    has_dir = bool(run_dir and os.path.isdir(run_dir))
    # the job had ended by itself (no earlier kill asked for it): its own verdict stands
    asked = has_dir and os.path.exists(os.path.join(run_dir, STOP_REQUEST))
    ended_before = read_int(os.path.join(run_dir, "exit_code")) if has_dir and not asked else None
    if has_dir:
        with locked(os.path.join(run_dir, RESTART_LOCK)):
            if not os.path.exists(os.path.join(run_dir, STOP_REQUEST)):
                body = {"time": time.time(), "by": req.get("by", "dflashctl kill")}
                write_atomic(os.path.join(run_dir, STOP_REQUEST), json.dumps(body).encode())
        end_supervisor(run_dir)
    grace = float(req.get("grace_s", 40))
    if req.get("scheduler") == "slurm" and has_dir:  # scancel, seen to end; then what is left on this machine
        slurm = slurm_agent()
        job = slurm.current_job(run_dir)
        q = slurm.cancel(job, grace + 30, run_dir) if job else {"known": False}
        report = stop_processes(run_dir, None, req.get("job_id"), grace)
        report["slurm"] = {
            "id": job,
            "state": q.get("state") or ("gone" if q.get("known") is False else "no answer"),
            "source": q.get("source") or q.get("cancel_error") or q.get("why"),
        }
        report["session_closed"] = q.get("known") is False or bool(q.get("final"))
    else:
        report = stop_processes(run_dir, req.get("session"), req.get("job_id"), grace)
    if req.get("gpus", True):
        gpu = read_gpus(req)  # read now, after the kill (a host-side reading is made by a second call)
        report["gpu_check"] = f"{gpu['source']} after the kill" if gpu["source"] != "none" else "none: no GPU tools"
        report["gpu_holders"] = [a for a in gpu["apps"] if a["pid"] in set(report["every"])]
    else:
        report["gpu_check"], report["gpu_holders"] = "host: made by the caller", []
    clean = not report["remaining"] and not report["gpu_holders"] and report["session_closed"]
    report["result"] = "KILLED" if clean else "KILL_FAILED"
    report["ended_before"] = ended_before  # the job had already ended: its own verdict stands
    if has_dir:
        # a queued job leaves the queue: its waiter read the stop request under the host lock and never started it
        report["dequeued"] = queue.dequeue(run_dir)
        record_stop_result(run_dir, report)
        if clean:  # stopped for good: its secrets are not kept at rest
            with contextlib.suppress(OSError):
                report["scrubbed"] = scrub_secrets(run_dir)
    return report


def end_supervisor(run_dir: str) -> None:
    """The job is being stopped: its supervisor (alive by the pid and start time it recorded) has nothing left to
    do."""
    me = supervision.state(run_dir)
    if me and me["alive"]:
        with contextlib.suppress(OSError):
            os.kill(me["pid"], signal.SIGTERM)


def record_stop_result(run_dir: str, report: dict) -> None:
    body = {k: report.get(k) for k in ("result", "remaining", "gpu_holders", "gpu_check", "session_closed", "slurm")}
    write_atomic(os.path.join(run_dir, STOP_RESULT), json.dumps({"time": time.time(), **body}).encode())
