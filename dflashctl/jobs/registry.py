"""The local record of jobs launched and events seen: `$XDG_STATE_HOME/dflashctl/` (default ~/.local/state).

`jobs.json` maps job id to its `JobRecord`; `events.jsonl` appends every decision `watch` and `kill` take. Writes are
atomic (temp file, fsync, rename) under an exclusive lock, so two CLIs (a `watch` and a `kill`) never lose each
other's updates, and the previous good file is kept as `jobs.json.bak`. A file that cannot be read is never taken
for an empty one: every command refuses with its name and the way out, and nothing is written over it. The records
hold webhook URLs and host settings: the directory is 0700 and its files 0600.
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

from pydantic import ValidationError

from dflashctl.errors import RecordsCorruptError
from dflashctl.model.record import REMOVED, STATE_ENV, JobRecord, Member, state_dir  # noqa: F401 - their home is model/


@contextmanager
def _locked() -> Iterator[Path]:
    d = state_dir()
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    if d.stat().st_mode & 0o077:
        os.chmod(d, 0o700)
    fd = os.open(d / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield d
    finally:
        os.close(fd)


def _corrupt(path: Path, why: str) -> RecordsCorruptError:
    bak = path.with_name(path.name + ".bak")
    way = (
        f"restore the last good copy with `cp {bak} {path}`"
        if bak.is_file()
        else f"move it away to start a new record (`mv {path} {path}.broken`)"
    )
    return RecordsCorruptError(f"{path}: job records cannot be read ({why}); nothing was changed: {way}")


def _read(d: Path) -> dict[str, dict]:
    path = d / "jobs.json"
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise _corrupt(path, e.strerror or str(e)) from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise _corrupt(path, f"not JSON: {str(e)[:80]}") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise _corrupt(path, "not a mapping of job id to record")
    return data


def _parse(raw: dict[str, dict], d: Path) -> dict[str, JobRecord]:
    try:
        return {k: JobRecord.model_validate(v) for k, v in raw.items()}
    except ValidationError as e:
        first = e.errors()[0]
        raise _corrupt(d / "jobs.json", f"{'.'.join(map(str, first['loc']))}: {first['msg']}") from None


def _write_file(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _write(d: Path, jobs: dict[str, dict]) -> None:
    path = d / "jobs.json"
    if path.is_file():  # the current file was just read as valid: it becomes the last good copy
        _write_file(d / "jobs.json.bak", path.read_bytes())
    _write_file(path, json.dumps(jobs, indent=1, sort_keys=True).encode())
    dfd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def record(job: JobRecord) -> None:
    with _locked() as d:
        jobs = _read(d)
        _parse(jobs, d)
        if job.id in jobs:
            raise RecordsCorruptError(f"{d / 'jobs.json'}: a job {job.id} is already recorded; not overwritten")
        jobs[job.id] = job.model_copy(update={"checked_at": time.time()}).model_dump(mode="json")
        _write(d, jobs)


def update(job_id: str, **fields: Any) -> JobRecord:
    """Fields of one record changed. A REMOVED record keeps its state: its run dir is gone for good, and a later
    look (which finds no run dir) would otherwise relabel it LOST."""
    with _locked() as d:
        jobs = _read(d)
        if job_id not in jobs:
            raise RecordsCorruptError(f"{d / 'jobs.json'}: job {job_id} is not recorded")
        if jobs[job_id].get("state") == REMOVED and "removed_at" not in fields:
            fields = {k: v for k, v in fields.items() if k not in ("state", "reason", "since")}
        if "state" in fields:
            fields = {**fields, "checked_at": time.time()}
        merged = JobRecord.model_validate({**jobs[job_id], **fields})
        jobs[job_id] = merged.model_dump(mode="json")
        _write(d, jobs)
        return merged


def mark_removed(host_name: str, ids: list[str], by: str) -> list[str]:
    """`gc` removed these run dirs on `host_name`: their records (matched by host, and by job id as the run dir's
    name) become REMOVED, with when and who. Returns the ids marked."""
    now = time.time()
    with _locked() as d:
        jobs = _read(d)
        marked = []
        for job_id, rec in jobs.items():
            if rec.get("host_name") == host_name and os.path.basename(str(rec.get("run_dir") or "")) in ids:
                jobs[job_id] = {
                    **rec,
                    "state": REMOVED,
                    "reason": f"run dir removed by {by}",
                    "removed_at": now,
                    "removed_by": by,
                    "checked_at": now,
                }
                marked.append(job_id)
        if marked:
            _write(d, jobs)
        return marked


def forget(job_id: str) -> JobRecord:
    """Drop one record (`ls --forget`); its events stay in events.jsonl. The record dropped is returned."""
    from dflashctl.errors import NoSuchJobError

    with _locked() as d:
        raw = _read(d)
        jobs = _parse(raw, d)
        if job_id not in jobs:
            raise NoSuchJobError(f"no job {job_id!r} is recorded (see `dflashctl ls --all-projects`)")
        del raw[job_id]
        _write(d, raw)
        return jobs[job_id]


def get(job_id: str) -> JobRecord | None:
    with _locked() as d:
        raw = _read(d)
        return _parse(raw, d).get(job_id)


def all_jobs(project: str | None = None) -> list[JobRecord]:
    """Jobs, newest first; only those launched from `project` (its root path) when given."""
    with _locked() as d:
        jobs = list(_parse(_read(d), d).values())
    if project is not None:
        jobs = [j for j in jobs if j.project == project]
    return sorted(jobs, key=lambda j: j.launched_at, reverse=True)


def append_event(job_id: str, event: dict) -> None:
    with _locked() as d:
        line = json.dumps({"time": round(time.time(), 3), "job": job_id, **event}, separators=(",", ":"))
        fd = os.open(d / "events.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a") as f:
            f.write(line + "\n")


def events(job_id: str | None = None) -> list[dict]:
    """Recorded events; a line that is not a JSON object is skipped."""
    path = state_dir() / "events.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if isinstance(e, dict) and (job_id is None or e.get("job") == job_id):
            out.append(e)
    return out
