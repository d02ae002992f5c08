"""The supervisor's files in a run dir, how it is started, and what a probe reports of it (kept apart from
agent/supervise.py, which imports the probe to take its snapshots: the launcher and the probe import this)."""

from __future__ import annotations

import contextlib
import os
import sys

from .common import read_json, start_time

SPEC, STATE, VERDICT, LOCK = "supervise.json", "supervisor.json", "verdict.json", ".supervisor.lock"
AGENT_FILE = "agent.pyz"


def spawn(run_dir: str) -> None:
    """Start the supervisor of `run_dir` in a new session, not a child of the caller (a child subreaper would keep it
    in the job's tree): fork, setsid, fork again, exec. Returns at once; never raises."""
    if not os.path.isfile(os.path.join(run_dir, SPEC)):
        return
    agent = os.path.join(run_dir, AGENT_FILE)
    if not os.path.isfile(agent):
        return
    try:
        pid = os.fork()
    except OSError:
        return
    if pid:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        return
    try:  # the child: never returns into the caller's code
        os.setsid()
        if os.fork():
            os._exit(0)
        null = os.open(os.devnull, os.O_RDWR)
        err = os.open(os.path.join(run_dir, "supervisor.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW,
                      0o600)  # fmt: skip
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.dup2(err, 2)
        env = {k: v for k, v in os.environ.items() if k not in ("DFLASHCTL_JOB_ID", "TMUX", "TMUX_PANE")}
        # -I: no PYTHONPATH, no user site, no working directory on the path (a planted signal.py is never imported)
        os.execve(sys.executable, [sys.executable, "-I", "-S", agent, "supervise", run_dir], env)
    finally:
        os._exit(127)


def state(run_dir: str) -> dict | None:
    """What a probe reports of the supervisor: whether one is expected, alive (pid and start time), its verdict."""
    if not os.path.isfile(os.path.join(run_dir, SPEC)):
        return None
    me = read_json(os.path.join(run_dir, STATE))
    me = me if isinstance(me, dict) else {}
    pid, start = me.get("pid"), me.get("start")
    alive = isinstance(pid, int) and start is not None and start_time(pid) == start and not me.get("ended")
    verdict = read_json(os.path.join(run_dir, VERDICT))
    return {"alive": bool(alive), "pid": pid, "interval_s": me.get("interval_s"), "ended": me.get("ended"),
            "verdict": verdict if isinstance(verdict, dict) else None}  # fmt: skip
