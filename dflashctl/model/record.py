"""A launched job as the local registry keeps it (`JobRecord`, its nodes as `Member`s) and where local state lives.

Plain pydantic models with no I/O: the transport (remote/) reads them, the registry (jobs/registry.py) stores them.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dflashctl.config import HostConfig
from dflashctl.errors import NoSuchJobError
from dflashctl.judge.facts import ALIVE, RECORD_ONLY
from dflashctl.model.jobfile import WatchConfig, node_tag

STATE_ENV = "DFLASHCTL_STATE_DIR"
REMOVED = RECORD_ONLY[0]  # a record's own state: `gc` removed the run dir; no look at the host can say more


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
    slurm_job: str | None = None  # a Slurm host's job id at launch (a restart resubmits: the run dir has the newest)
    removed_at: float | None = None  # `gc` removed its run dir (state REMOVED): when, and who ran it
    removed_by: str | None = None
    progress: dict | None = None  # the last look's step, loss, throughput (in its unit) and eta_s, for `ls`

    @property
    def scheduler(self) -> str:
        """Who runs the job's processes on the remote: `tmux` (a session per job) or `slurm` (sbatch)."""
        return "slurm" if self.host.slurm is not None else "tmux"

    @model_validator(mode="before")
    @classmethod
    def _from_older_records(cls, data):
        """Records written before releases named the deployed tree `code_version`."""
        if isinstance(data, dict) and "release" not in data and "code_version" in data:
            data = {**data, "release": data["code_version"]}
        return data

    @property
    def live(self) -> bool:
        return self.state in ALIVE

    @property
    def tag(self) -> str:
        """The value of DFLASHCTL_JOB_ID in the environment of this job's (or node's) processes."""
        return self.node_tag or self.id

    def member_records(self) -> list[JobRecord]:
        """One record per node, each as a single-host job would have it (this record alone for a single host)."""
        if not self.members:
            return [self]
        return [
            self.model_copy(
                update={
                    "host_name": m.host_name,
                    "host": m.host,
                    "run_dir": m.run_dir,
                    "session": m.session,
                    "pane_pid": m.pane_pid,
                    "gpus": m.gpus,
                    "members": [],
                    "node_tag": node_tag(self.id, m.node) if m.node else None,
                }
            )
            for m in self.members
        ]

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
