"""The processes `dflashctl exec` started for a job: found by their own tag (DFLASHCTL_EXEC_OF=<job's tag> in their
environment), never by name, and ended only when asked (`kill --all`): a stop or restart of the job, which finds
its processes by DFLASHCTL_JOB_ID, leaves them alone. Part of the remote agent (stdlib only)."""

from __future__ import annotations

import contextlib
import os
import signal
import time

from .common import start_time


def exec_processes(tag: str) -> list[tuple[int, int]]:
    """(pid, start time) of every process whose environment carries DFLASHCTL_EXEC_OF=`tag`, this one excepted."""
    want, me, found = f"DFLASHCTL_EXEC_OF={tag}".encode(), os.getpid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if want not in f.read().split(b"\0"):
                    continue
        except OSError:
            continue
        start = start_time(int(name))
        if start is not None:
            found.append((int(name), start))
    return found


def _signal(procs: list[tuple[int, int]], sig: int) -> list[int]:
    sent = []
    for pid, start in procs:
        if start_time(pid) == start:  # the very process found, not a later one with its pid
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
                sent.append(pid)
    return sent


def end_execs(req: dict) -> dict:
    """SIGTERM the exec'd processes of job tag `job_id`, SIGKILL what is left after `grace_s`: {term, kill, left}."""
    tag = req.get("job_id")
    if not isinstance(tag, str) or not tag:
        return {"refused": "job_id: expected the job's tag"}
    grace = float(req.get("grace_s", 5.0))
    procs = exec_processes(tag)
    term = _signal(procs, signal.SIGTERM)
    deadline = time.monotonic() + max(0.0, min(grace, 120.0))
    while time.monotonic() < deadline and any(start_time(p) == s for p, s in procs):
        time.sleep(0.1)
    kill = _signal(procs, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(start_time(p) == s for p, s in procs):
        time.sleep(0.05)
    return {"term": term, "kill": kill, "left": [p for p, s in procs if start_time(p) == s]}
