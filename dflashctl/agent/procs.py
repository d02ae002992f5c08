"""The job's processes on this machine: the process table, a job's tree (its launcher's descendants and its tag),
the tmux server and its sessions. Part of the remote agent (stdlib only)."""

from __future__ import annotations

import os
import subprocess

from .common import WRAPPER_PID, read_json, start_time

TMUX = ["tmux", "-L", "dflashctl"]  # the dedicated server; a request's `tmux_socket` names another


def slurm_agent():
    """agent/slurm.py, imported where a Slurm host needs it: a poll of a tmux job never pays for it."""
    from . import slurm

    return slurm


def _run(argv: list[str], timeout: float = 10.0) -> tuple[int, str]:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout
    except (OSError, subprocess.TimeoutExpired):
        return 127, ""


# ---------------------------------------------------------------------------------------------- processes


def proc_table() -> dict[int, dict]:
    """Every process: ppid, state, start time (clock ticks since boot), CPU seconds, RSS, command line."""
    tick = os.sysconf("SC_CLK_TCK")
    page = os.sysconf("SC_PAGE_SIZE")
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            rest = stat[stat.rindex(")") + 2 :].split()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError):
            continue
        table[int(name)] = {
            "pid": int(name),
            "ppid": int(rest[1]),
            "state": rest[0],
            "start": int(rest[19]),
            "cpu_s": round((int(rest[11]) + int(rest[12])) / tick, 2),
            "rss_mib": round(int(rest[21]) * page / 2**20, 1),
            "cmd": cmd[:200],
        }
    return table


def same_process(p: dict) -> bool:
    """The process named (pid, start) still exists, and it is that process, not a later one with its pid."""
    return start_time(p["pid"]) == p["start"]


def has_job_tag(pid: int, job_id: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"DFLASHCTL_JOB_ID={job_id}".encode() in f.read().split(b"\0")
    except OSError:
        return False


def launcher_of(run_dir: str | None, pane: dict) -> dict | None:
    """The current attempt's launcher (pid, start), only while its pane is alive: a dead pane's pid may have been
    reused by anyone. The launcher records itself in `wrapper.pid`; its start time must match."""
    if not pane.get("exists") or pane.get("pane_dead"):
        return None
    pid = pane.get("pane_pid")
    rec = read_json(os.path.join(run_dir, WRAPPER_PID)) if run_dir else None
    if isinstance(rec, dict) and rec.get("pid") == pid and isinstance(rec.get("start"), int):
        return {"pid": pid, "start": rec["start"], "child": rec.get("child")}
    st = start_time(pid) if isinstance(pid, int) else None  # launcher not yet recorded: the live pane's own pid
    return {"pid": pid, "start": st, "child": None} if st is not None else None


def job_processes(table: dict[int, dict], root: dict | None, job_id: str | None) -> list[dict]:
    """The launcher's descendants plus any process carrying the job's tag. Never selected by name."""
    children: dict[int, list[int]] = {}
    for p in table.values():
        children.setdefault(p["ppid"], []).append(p["pid"])
    found: set[int] = set()
    if root and root["pid"] in table and table[root["pid"]]["start"] == root["start"]:
        stack = [root["pid"]]
        while stack:
            pid = stack.pop()
            if pid not in found:
                found.add(pid)
                stack.extend(children.get(pid, []))
    if job_id:
        me = os.getpid()
        found |= {pid for pid in table if pid != me and pid not in found and has_job_tag(pid, job_id)}
    return [table[p] for p in sorted(found) if table[p]["state"] not in ("Z", "X")]


# ---------------------------------------------------------------------------------------------- files


def tmux_session(session: str | None, lines: int) -> dict:
    if not session:
        return {"exists": False}
    fmt = "#{pane_pid}|#{pane_dead}|#{pane_dead_status}|#{pid}|#{session_created}|#{session_name}"
    rc, out = _run([*TMUX, "display-message", "-p", "-t", f"={session}:", fmt])
    parts = ((out.strip().splitlines() or [""])[0].split("|", 5) + [""] * 6)[:6]  # a field tmux cannot say: empty
    if rc != 0 or parts[5] != session:  # tmux answers for a session that is gone with no session at all
        return {"exists": False}

    def number(text: str) -> int | None:
        return int(text) if text.strip().lstrip("-").isdigit() else None

    info = {
        "exists": True,
        "pane_pid": number(parts[0]),
        "pane_dead": parts[1].strip() == "1",
        "exit_status": number(parts[2]),
        "server_pid": number(parts[3]),
        "created": number(parts[4]),
    }
    if lines > 0:
        _, text = _run([*TMUX, "capture-pane", "-p", "-J", "-t", f"={session}:", "-S", f"-{lines}"])
        info["lines"] = text.rstrip("\n").splitlines()[-lines:]
    return info


def list_sessions() -> list[dict]:
    rc, out = _run([*TMUX, "list-sessions", "-F", "#{session_name} #{pane_dead}"])
    if rc != 0:
        return []
    return [{"name": ln.split()[0], "dead": ln.split()[-1] == "1"} for ln in out.splitlines() if ln.strip()]


def close_session(session: str) -> None:
    """Close a job's tmux session (its pane is dead: the job ended); the server exits with its last session."""
    _run([*TMUX, "kill-session", "-t", f"={session}"])


def close_when_dead(session: str, wait_s: float = 30.0) -> bool:
    """Close a job's session once its pane is dead. The launcher writes `exit_code` a moment before it exits, so a
    caller that saw the exit status waits here (bounded) for the pane to die: closing a live pane would cut the
    launcher's last clean-up. True when the session is gone."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        info = tmux_session(session, 0)
        if not info.get("exists"):
            return True
        if info.get("pane_dead"):
            close_session(session)
            return not tmux_session(session, 0).get("exists")
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
