"""Slurm on the login node: submit a run dir's batch script, read a job's state, cancel it and see it end.

Part of the remote agent (stdlib only, Python 3.8+). A run dir of a Slurm job holds `sbatch.sh` (written at launch)
and `slurm_job`, the id of its newest submission (a restart resubmits and rewrites it); nodes that failed are kept in
`slurm_exclude`, so that every later submission avoids them.

A job's state comes from `scontrol show job` (the controller's memory: pending, running, and ended jobs for
MinJobAge, 300 s by default), else from `sacct` (the accounting database, where the cluster has one).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time

from .common import open_regular, read_json, read_regular, write_atomic

JOB_FILE, EXCLUDE_FILE, SCRIPT = "slurm_job", "slurm_exclude", "sbatch.sh"
FINAL = (
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "PREEMPTED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "REVOKED",
    "SPECIAL_EXIT",
)
JOB_ID = re.compile(r"[0-9]+(_[0-9]+)?")  # fullmatch; an array task's id is JOB_TASK


def _run(
    argv: list[str], timeout: float = 30.0, cwd: str | None = None, stdin: str | None = None
) -> tuple[int, str, str]:
    try:
        p = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
            input=stdin,
            stdin=None if stdin is not None else subprocess.DEVNULL,
        )
        return p.returncode, p.stdout, p.stderr
    except FileNotFoundError:
        return 127, "", f"{argv[0]}: not found"
    except subprocess.TimeoutExpired:
        return 124, "", f"{argv[0]}: no answer in {timeout:g} s"


def missing_tools(names: tuple[str, ...] = ("sbatch", "scontrol", "scancel")) -> list[str]:
    return [n for n in names if shutil.which(n) is None]


def current_job(run_dir: str) -> str | None:
    """The id of the run dir's newest submission, or None (never submitted, or the file is not an id)."""
    try:
        data = read_regular(os.path.join(run_dir, JOB_FILE), 256)
    except OSError:
        return None
    text = data.decode(errors="replace").strip() if data is not None else ""
    return text if JOB_ID.fullmatch(text) else None


def excluded(run_dir: str) -> list[str]:
    nodes = read_json(os.path.join(run_dir, EXCLUDE_FILE))
    return [n for n in nodes if isinstance(n, str)] if isinstance(nodes, list) else []


KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=")  # a field's name: `JobId`, `AllocNode:Sid`, `CPUs/Task`


def scontrol_fields(text: str) -> dict[str, str]:
    """`scontrol show job -o`'s Key=Value fields. A value runs to the next field's name, not to the next space:
    Slurm prints paths (WorkDir, Command, StdOut) as they are, spaces and quotes included."""
    line = (text.strip().splitlines() or [""])[0]
    keys = list(KEY.finditer(line))
    fields = {}
    for i, m in enumerate(keys):  # (zip's strict= is Python 3.10's: the agent runs on 3.8)
        end = keys[i + 1].start() if i + 1 < len(keys) else len(line)
        fields.setdefault(m.group(1), line[m.end() : end].strip())
    return fields


def parse_scontrol(text: str) -> dict:
    """`scontrol show job -o ID`: one line of Key=Value fields."""
    fields = scontrol_fields(text)
    return {
        "state": fields.get("JobState", ""),
        "reason": fields.get("Reason", "None").replace("_", " "),  # the one-line form writes its spaces as `_`
        "exit": fields.get("ExitCode"),
        "nodes": fields.get("NodeList"),
        "start": fields.get("StartTime"),
        "time_limit": fields.get("TimeLimit"),
        "name": fields.get("JobName"),
        "uid": _uid(fields.get("UserId")),
        "workdir": fields.get("WorkDir"),
    }


def _uid(user_id: str | None) -> int | None:
    """`UserId=alice(1000)` -> 1000."""
    m = re.search(r"\((\d+)\)", user_id or "")
    return int(m[1]) if m else None


def parse_sacct(text: str) -> dict | None:
    """`sacct -n -P -X -o State,Reason,ExitCode,NodeList,Start,Timelimit,JobName,UID,WorkDir`: the allocation's line;
    its state may read
    `CANCELLED by 1000`."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return None
    parts = (lines[0].split("|") + [""] * 9)[:9]
    return {
        "state": parts[0].split()[0] if parts[0] else "",
        "reason": parts[1] or "None",
        "exit": parts[2],
        "nodes": parts[3],
        "start": parts[4],
        "time_limit": parts[5],
        "name": parts[6] or None,
        "uid": int(parts[7]) if parts[7].isdigit() else None,
        "workdir": parts[8] or None,
    }


def _epoch(stamp: str | None) -> float | None:
    """Slurm's local-time `2026-12-01T19:09:44` as seconds since the epoch (this machine's clock and zone)."""
    try:
        return time.mktime(time.strptime(stamp or "", "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def query(job_id: str) -> dict:
    """The job's state. `known` False when the controller says the id is not a job of its (and the accounting, where
    there is one, does not know it either); None when the controller did not answer: nothing is known then, and
    the job may well be running."""
    rc, out, err = _run(["scontrol", "show", "job", "-o", job_id])
    info = parse_scontrol(out) if rc == 0 and out.strip() else None
    source = "scontrol"
    if info is None or not info["state"]:
        rc2, out2, _ = _run(
            [
                "sacct",
                "-n",
                "-P",
                "-X",
                "-j",
                job_id,
                "-o",
                "State,Reason,ExitCode,NodeList,Start,Timelimit,JobName,UID,WorkDir",
            ]
        )
        info = parse_sacct(out2) if rc2 == 0 else None
        source = "sacct"
    if not info or not info["state"]:
        why = (err.strip().splitlines() or ["unknown job id"])[-1][:200]
        return {"id": job_id, "known": False if rc == 0 or "Invalid job id" in err else None, "why": why}
    code = None
    if info.get("exit") and ":" in info["exit"]:
        status, _, signal_no = info["exit"].partition(":")
        if status.isdigit() and signal_no.isdigit():
            code = int(status) if int(signal_no) == 0 else 128 + int(signal_no)
    state = info["state"].rstrip("+")
    return {
        **info,
        "id": job_id,
        "known": True,
        "state": state,
        "final": state in FINAL,
        "exit_code": code,
        "started": _epoch(info.get("start")) if state not in ("PENDING",) else None,
        "source": source,
    }


def stranger(run_dir: str, q: dict) -> str | None:
    """Why the job Slurm knows under the run dir's id is not the one dflashctl submitted (an id reused after the
    controller lost its state, or wrapped): its name, user or work dir differ. None: it is ours, or Slurm did not
    say (an older Slurm, a field left out): only what Slurm says is compared."""
    meta = read_json(os.path.join(run_dir, "job.json"))
    name = meta.get("id") if isinstance(meta, dict) else None
    found = []
    if q.get("name") and name and q["name"] != name:
        found.append(f"name {q['name']!r}, not {name!r}")
    if q.get("uid") is not None and q["uid"] != os.getuid():
        found.append(f"user {q['uid']}, not {os.getuid()}")
    if q.get("workdir") and os.path.realpath(q["workdir"]) != os.path.realpath(run_dir):
        found.append(f"work dir {q['workdir']}, not {run_dir}")
    return f"slurm job {q.get('id')} is not the one submitted from this run dir: " + "; ".join(found) if found else None


def session_info(run_dir: str, lines: int) -> dict:
    """The run's Slurm job in the shape of a tmux pane (exists, dead, exit status, created, last output lines), with
    the scheduler's own word under `slurm`: what the judge reads for PENDING and for Slurm's ends."""
    job = current_job(run_dir)
    if job is None:
        return {"exists": False, "slurm": None}
    q = query(job)
    if q["known"] is None:  # the controller did not answer: the job is not gone, its state is not known now
        return {"exists": True, "pane_dead": False, "slurm": {"id": job, "state": "NO_ANSWER", "reason": q["why"]}}
    if not q["known"]:
        return {"exists": False, "slurm": {"id": job, "state": "UNKNOWN", "reason": q["why"]}}
    foreign = stranger(run_dir, q)
    if foreign:  # never trusted: the job of ours under that id is gone
        return {"exists": False, "slurm": {"id": job, "state": "FOREIGN", "reason": foreign}}
    info = {
        "exists": True,
        "pane_pid": None,
        "pane_dead": q["final"],
        "exit_status": q["exit_code"],
        "created": q["started"],
        "slurm": {k: q.get(k) for k in ("id", "state", "reason", "nodes", "exit", "time_limit", "source")},
    }
    if lines > 0:  # what Slurm itself wrote (time limit, cancellation, node failure): the batch output
        try:
            fd = open_regular(os.path.join(run_dir, f"slurm-{job}.out"))
            if fd is None:
                raise FileNotFoundError(job)
            with os.fdopen(fd, "rb") as f:
                f.seek(max(0, os.fstat(fd).st_size - 16384))
                text = f.read().decode(errors="replace")
            info["lines"] = text.rstrip("\n").splitlines()[-lines:]
        except OSError:
            info["lines"] = []
    return info


def submit(run_dir: str, args: list[str]) -> tuple[str | None, str]:
    """sbatch the run dir's script (its working dir: the run dir) with the job's arguments; records the new id.
    Returns (id, "") or (None, sbatch's error)."""
    argv = ["sbatch", "--parsable"]
    nodes = excluded(run_dir)
    if nodes:
        argv.append("--exclude=" + ",".join(nodes))
    rc, out, err = _run([*argv, os.path.join(run_dir, SCRIPT), *args], timeout=60, cwd=run_dir)
    job = out.strip().split(";")[0] if rc == 0 else ""
    if not JOB_ID.fullmatch(job):
        return None, (err.strip().splitlines() or [f"sbatch exit status {rc}, no job id"])[-1][:300]
    write_atomic(os.path.join(run_dir, JOB_FILE), f"{job}\n".encode())
    return job, ""


def test_only(script: str, cwd: str) -> str:
    """`sbatch --test-only` with the script on stdin: the scheduler's word on the partition, account, time and
    resources, submitting nothing. Returns the problem, or "" when sbatch would take the job."""
    rc, out, err = _run(["sbatch", "--test-only"], timeout=60, cwd=cwd, stdin=script)
    if rc == 0:
        return ""
    lines = [ln for ln in (err or out).strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else f"sbatch exit status {rc}")[:300]


def exclude_failed_nodes(run_dir: str, q: dict) -> None:
    """A job that ended NODE_FAIL: its nodes join the run's exclusions, so no resubmission lands on them again."""
    if q.get("state") not in ("NODE_FAIL", "BOOT_FAIL") or not q.get("nodes"):
        return
    rc, out, _ = _run(["scontrol", "show", "hostnames", q["nodes"]])
    nodes = out.split() if rc == 0 else [q["nodes"]]
    merged = sorted(set(excluded(run_dir)) | set(nodes))
    write_atomic(os.path.join(run_dir, EXCLUDE_FILE), json.dumps(merged).encode())


def listed(job_id: str) -> bool:
    """squeue still lists the job: pending, running, or COMPLETING (a final state is set at once, while its
    processes on the nodes are still being killed); an ended job is not listed."""
    rc, out, _ = _run(["squeue", "-h", "-j", job_id, "-o", "%T"])
    return rc == 0 and bool(out.strip())


def cancel(job_id: str, wait_s: float, run_dir: str | None = None) -> dict:
    """scancel (Slurm signals every step, waits KillWait, then SIGKILLs), then wait for a final state and for squeue
    to stop listing the job (no process of it left on its nodes). Returns the last query; `final` False when the
    job had not ended within `wait_s`. A job under that id that is not the run dir's submission is never cancelled:
    ours is gone (`known` False, `foreign` says why)."""
    q = query(job_id)
    foreign = stranger(run_dir, q) if run_dir and q.get("known") else None
    if foreign:
        return {"id": job_id, "known": False, "why": foreign, "foreign": foreign}
    if q.get("known") is not False and not q.get("final"):
        rc, _, err = _run(["scancel", job_id])
        if rc != 0:  # the controller did not take it (down, or the job ended meanwhile): said, never waited on
            q = query(job_id)
            return q if q.get("final") or q.get("known") is False else {**q, "cancel_error": err.strip()[-200:]}
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            q = query(job_id)
            if q.get("known") is False or (q.get("final") and not listed(job_id)):
                break
            time.sleep(0.5)
        else:
            q = {**q, "final": False, "state": f"{q.get('state')} (still listed by squeue)"} if q.get("final") else q
    return q
