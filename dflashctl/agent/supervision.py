"""The supervisor's files in a run dir, how it is started, and what a probe reports of it (kept apart from
agent/supervise.py, which imports the probe to take its snapshots: the launcher and the probe import this)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

from .common import open_regular, read_json, read_regular, start_time

SPEC, STATE, VERDICT, BEAT = "supervise.json", "supervisor.json", "verdict.json", "supervisor.beat"
FINAL, FINAL_SIZE = "supervisor.final", 8192  # its last word, written in place into space taken at its start


def reserve_final(run_dir: str) -> None:
    """Take the space of the supervisor's last word now (blank): on a full disk a new file cannot be written, but
    bytes already allocated can be overwritten. A new supervisor (a new attempt) blanks the previous one's. Anything
    but a regular file there (the job's doing) raises (SetAside, an OSError)."""
    fd = open_regular(os.path.join(run_dir, FINAL), os.O_WRONLY | os.O_CREAT)
    if fd is None:
        raise FileNotFoundError(run_dir)
    try:
        os.pwrite(fd, b" " * FINAL_SIZE, 0)
    finally:
        os.close(fd)


def write_final(run_dir: str, body: dict) -> None:
    """The supervisor's last word (gave up, with the verdict), over the reserved bytes: no new block needed."""
    body = dict(body)
    data = json.dumps(body, separators=(",", ":")).encode()
    while len(data) > FINAL_SIZE and body.get("evidence"):
        body["evidence"] = body["evidence"][:-1]
        data = json.dumps(body, separators=(",", ":")).encode()
    fd = open_regular(os.path.join(run_dir, FINAL), os.O_WRONLY)
    if fd is None:
        raise FileNotFoundError(run_dir)
    try:
        os.pwrite(fd, data[:FINAL_SIZE].ljust(FINAL_SIZE), 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def final(run_dir: str) -> dict | None:
    try:
        text = (read_regular(os.path.join(run_dir, FINAL), FINAL_SIZE + 1) or b"").strip()
    except OSError:
        return None
    if not text or len(text) > FINAL_SIZE or text.count(b"[") + text.count(b"{") > 8:  # ours nests 2 deep
        return None
    try:
        body = json.loads(text)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


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
        err = os.open(
            os.path.join(run_dir, "supervisor.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600
        )
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.dup2(err, 2)
        env = {k: v for k, v in os.environ.items() if k not in ("DFLASHCTL_JOB_ID", "TMUX", "TMUX_PANE")}
        # -I: no PYTHONPATH, no user site, no working directory on the path (a planted signal.py is never imported)
        os.execve(sys.executable, [sys.executable, "-I", "-S", agent, "supervise", run_dir], env)
    finally:
        os._exit(127)


def heartbeat(run_dir: str) -> dict | None:
    """The supervisor's heartbeat as this machine sees it: its counter, and its age on this machine's monotonic clock
    (the supervisor's stamp and this reader's now, one clock: no wall clock in it). None: none written yet."""
    beat = read_json(os.path.join(run_dir, BEAT))
    if not isinstance(beat, dict) or not isinstance(beat.get("beat"), int):
        return None
    mono = beat.get("mono")
    now = time.monotonic()
    age = now - mono if isinstance(mono, (int, float)) and not isinstance(mono, bool) and mono <= now + 1 else None
    return {"beat": beat["beat"], "age_s": round(max(0.0, age), 2) if age is not None else None}


def state(run_dir: str) -> dict | None:
    """What a probe reports of the supervisor: whether one is expected, alive (pid and start time), its heartbeat,
    its verdict."""
    if not os.path.isfile(os.path.join(run_dir, SPEC)):
        return None
    me = read_json(os.path.join(run_dir, STATE))
    me = me if isinstance(me, dict) else {}
    pid, start = me.get("pid"), me.get("start")
    alive = isinstance(pid, int) and start is not None and start_time(pid) == start and not me.get("ended")
    verdict = read_json(os.path.join(run_dir, VERDICT))
    last = final(run_dir)  # its last word, where it could write nothing else (a full disk)
    if last is not None and last.get("gave_up"):
        verdict = last
        me["ended"] = me.get("ended") or last.get("ended")
        alive = False  # it is ending, or has
    return {
        "alive": bool(alive),
        "pid": pid,
        "interval_s": me.get("interval_s"),
        "ended": me.get("ended"),
        "heartbeat": heartbeat(run_dir),
        "verdict": verdict if isinstance(verdict, dict) else None,
    }
