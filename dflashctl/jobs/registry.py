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

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dflashctl.config import HostConfig
from dflashctl.errors import NoSuchJobError, RecordsCorruptError
from dflashctl.jobs.jobfile import WatchConfig, node_tag

STATE_ENV = "DFLASHCTL_STATE_DIR"
# states in which a job may still be running (a failure state is an attempt that ended; a restart says STARTING)
ALIVE_STATES = ("STARTING", "RUNNING", "STALLED", "STOPPING", "UNREACHABLE", "PROBE_FAILED")


class Member(BaseModel):
    """One node of a job over several hosts: where its part runs. The record's own host, run dir and session are
    the head's (node 0)."""

    model_config = ConfigDict(extra="ignore")

    node: int
    host_name: str
    host: HostConfig
    run_dir: str
    session: str
    pane_pid: int | None = None
    gpus: list[int] = Field(default_factory=list)


class JobRecord(BaseModel):
    """One launched job, as the registry keeps it. Restarts use the run dir's own files (the job file's snapshot,
    its release of the code), never the job file as it is now."""

    model_config = ConfigDict(extra="ignore")

    id: str
    name: str
    project: str
    job_file: str
    host_name: str
    host: HostConfig
    release: str = Field(description="the deployed release (code version) the job runs")
    command: str
    run_dir: str
    session: str
    pane_pid: int | None = None
    gpus: list[int] = Field(default_factory=list)
    launched_at: float
    state: str = "STARTING"
    reason: str | None = None
    since: float | None = None
    checked_at: float | None = None  # when `state` was last judged from the remote (ls shows its age)
    restarts: int = 0
    kill_grace_s: float = 40.0
    is_trainer: bool = True
    overrides: list[str] = Field(default_factory=list)
    watch: WatchConfig = Field(default_factory=WatchConfig)
    tmux_socket: str = "dflashctl"
    steps: int | None = None
    killed_at: float | None = None
    members: list[Member] = Field(default_factory=list, description="the nodes of a multi-node job, head first")
    node_tag: str | None = None  # a node's process tag when it is not the job id (node i > 0: `<id>.node<i>`)

    @model_validator(mode="before")
    @classmethod
    def _from_older_records(cls, data):
        """Records written before releases named the deployed tree `code_version`."""
        if isinstance(data, dict) and "release" not in data and "code_version" in data:
            data = {**data, "release": data["code_version"]}
        return data

    @property
    def live(self) -> bool:
        return self.state in ALIVE_STATES

    @property
    def tag(self) -> str:
        """The value of DFLASHCTL_JOB_ID in the environment of this job's (or node's) processes."""
        return self.node_tag or self.id

    def member_records(self) -> list[JobRecord]:
        """One record per node, each as a single-host job would have it (this record alone for a single host)."""
        if not self.members:
            return [self]
        return [self.model_copy(update={"host_name": m.host_name, "host": m.host, "run_dir": m.run_dir,
                                        "session": m.session, "pane_pid": m.pane_pid, "gpus": m.gpus,
                                        "members": [], "node_tag": node_tag(self.id, m.node) if m.node else None})
                for m in self.members]  # fmt: skip

    def member(self, node: str) -> JobRecord:
        """The node's record by host name or node number."""
        for i, rec in enumerate(self.member_records()):
            if node in (rec.host_name, str(i)):
                return rec
        names = ", ".join(r.host_name for r in self.member_records())
        raise NoSuchJobError(f"{self.id} has no node {node!r} (its nodes: {names})")


def state_dir() -> Path:
    override = os.environ.get(STATE_ENV)
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "dflashctl"


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
    with _locked() as d:
        jobs = _read(d)
        if job_id not in jobs:
            raise RecordsCorruptError(f"{d / 'jobs.json'}: job {job_id} is not recorded")
        if "state" in fields:
            fields = {**fields, "checked_at": time.time()}
        merged = JobRecord.model_validate({**jobs[job_id], **fields})
        jobs[job_id] = merged.model_dump(mode="json")
        _write(d, jobs)
        return merged


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
