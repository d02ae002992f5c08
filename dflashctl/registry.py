"""The local record of jobs launched and events seen: `$XDG_STATE_HOME/dflashctl/` (default ~/.local/state).

`jobs.json` maps job id to its record (host, code version, command, run dir, tmux session, pane pid, state,
restarts); `events.jsonl` appends every decision `watch` takes. Writes are atomic (temp file + rename) under an
exclusive lock, so two CLIs (a `watch` and a `kill`) never lose each other's updates.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

STATE_ENV = "DFLASHCTL_STATE_DIR"


def state_dir() -> Path:
    override = os.environ.get(STATE_ENV)
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "dflashctl"


@contextmanager
def _locked() -> Iterator[Path]:
    d = state_dir()
    d.mkdir(parents=True, exist_ok=True)
    with open(d / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield d
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _read(d: Path) -> dict[str, dict]:
    try:
        return json.loads((d / "jobs.json").read_text())
    except (OSError, ValueError):
        return {}


def _write(d: Path, jobs: dict[str, dict]) -> None:
    tmp = d / "jobs.json.tmp"
    tmp.write_text(json.dumps(jobs, indent=1, sort_keys=True))
    os.replace(tmp, d / "jobs.json")


def record(job: dict[str, Any]) -> None:
    with _locked() as d:
        jobs = _read(d)
        jobs[job["id"]] = job
        _write(d, jobs)


def update(job_id: str, **fields: Any) -> dict:
    with _locked() as d:
        jobs = _read(d)
        jobs[job_id] = {**jobs.get(job_id, {"id": job_id}), **fields}
        _write(d, jobs)
        return jobs[job_id]


def get(job_id: str) -> dict | None:
    with _locked() as d:
        return _read(d).get(job_id)


def all_jobs(project: str | None = None) -> list[dict]:
    """Jobs, newest first; only those launched from `project` (its root path) when given."""
    with _locked() as d:
        jobs = list(_read(d).values())
    if project is not None:
        jobs = [j for j in jobs if j.get("project") == project]
    return sorted(jobs, key=lambda j: j.get("launched_at", 0), reverse=True)


def append_event(job_id: str, event: dict) -> None:
    with _locked() as d:
        line = json.dumps({"time": round(time.time(), 3), "job": job_id, **event}, separators=(",", ":"))
        with open(d / "events.jsonl", "a") as f:
            f.write(line + "\n")


def events(job_id: str | None = None) -> list[dict]:
    path = state_dir() / "events.jsonl"
    if not path.exists():
        return []
    out = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [e for e in out if job_id is None or e.get("job") == job_id]
