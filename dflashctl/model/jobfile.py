"""Job files (`jobs/*.yaml`): what to run, where, on which GPUs, and how to watch it. Typed like the host config.

A job runs either the bundled trainer (`trainer:`, its config inline or a path relative to the job file) or any
command line (`command:`), so that any torchrun script can be babysat. Every error names the file and the dotted key
and exits with status 2, before anything touches a remote.
"""

from __future__ import annotations

import difflib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from dflashctl.config import (
    SAFE_NAME,
    SbatchOptions,
    SlurmTime,
    format_validation_error,
    known_hosts,
    load_yaml,
    misspelt_host,
    unknown_host_message,
)
from dflashctl.errors import ConfigError
from dflashctl.judge.facts import DEFAULT_RESTART_ON, NEVER_RESTART, RESTARTABLE, Thresholds

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # fullmatch
SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
MAX_GPUS = 1024
JUDGED = Thresholds()  # the judge's defaults: a job file's `watch` thresholds default to them, written once


class NotifyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    webhook: str | None = Field(None, description="URL that gets a JSON POST on every state change that matters")
    format: Literal["json", "slack", "discord", "ntfy"] = Field("json", description="body shape for the webhook")
    bell: bool = Field(True, description="ring the terminal bell on failures")
    timeout_s: float = Field(10.0, gt=0, le=120)
    retries: StrictInt = Field(3, ge=0, le=10)

    @field_validator("webhook")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        """Checked here, so that a bad URL is a load error, never a crash (printing it) at the first notification.
        The messages never repeat the URL: its path is usually the secret."""
        if value is None:
            return value
        if any(ord(c) < 33 or ord(c) == 127 for c in value):
            raise ValueError("the URL holds whitespace or control characters")
        if not value.isascii():
            raise ValueError("the URL holds non-ASCII characters: percent-encode them")
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("expected an http:// or https:// URL with a host")
        try:
            port = parts.port  # raises on a port that is not a number from 0 to 65535
        except ValueError:
            port = 0
        if port == 0:  # `:0` parses, but nothing listens there: every notice would fail, found only at the first
            raise ValueError("the URL's port is not a number from 1 to 65535")
        return value  # user:password@ is accepted: the sender moves it into an Authorization header


class WatchConfig(BaseModel):
    """How `watch` polls and judges the job, and what it does about failures."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    interval_s: float = Field(60.0, gt=0, le=86400, description="seconds between polls")
    stall_after_s: float = Field(
        JUDGED.stall_after_s, gt=0, le=604800, description="no step progress this long while alive: STALLED"
    )
    startup_budget_s: float | None = Field(
        None, gt=0, le=604800, description="time allowed before the first step; default: from the trainer's buckets"
    )
    heartbeat_max_age_s: float = Field(
        JUDGED.heartbeat_max_age_s, gt=0, le=86400, description="an older heartbeat (frozen): STALLED"
    )
    throughput_floor: float | None = Field(
        JUDGED.throughput_floor, ge=0, description="tokens/s under this for `slow_polls`: STALLED"
    )
    throughput_drop: float = Field(
        JUDGED.throughput_drop, gt=0, lt=1, description="under this fraction of its rolling median: STALLED"
    )
    slow_polls: StrictInt = Field(JUDGED.slow_polls, ge=1, le=1000, description="consecutive slow polls before STALLED")
    restart_on: list[StrictStr] = Field(
        default_factory=lambda: list(DEFAULT_RESTART_ON),
        description="the failures a restart is for (the state table's `restart`)",
    )
    max_restarts: StrictInt = Field(3, ge=0, le=100)
    backoff_s: float = Field(30.0, ge=0, le=86400, description="wait before the first restart; doubles each time")
    supervise: bool = Field(
        True,
        strict=True,
        description="a supervisor beside the job on the remote judges and "
        "restarts it with no laptop attached (single-host tmux jobs)",
    )
    notify: NotifyConfig = Field(default_factory=NotifyConfig)

    @field_validator("restart_on")
    @classmethod
    def _restartable(cls, value: list[str]) -> list[str]:
        """Each a state the table says a restart may cure (judge/facts.py, `restart`); why not, otherwise."""
        bad = [s for s in value if s in NEVER_RESTART]
        if bad:
            raise ValueError(f"{', '.join(bad)} cannot be restarted: the cause would repeat")
        for s in value:
            if s not in RESTARTABLE:
                near = difflib.get_close_matches(s.upper(), RESTARTABLE, n=1)
                hint = f" (did you mean {near[0]}?)" if near else ""
                raise ValueError(f"{s!r} is not a failure a restart is for{hint}; one of {', '.join(RESTARTABLE)}")
        return value


class NodeSpec(BaseModel):
    """One node of a job over several hosts (`hosts:`): its host, and optionally its own GPUs and environment."""

    model_config = ConfigDict(extra="forbid", defer_build=True)  # built at its first job file: never by `ls`

    host: str = Field(..., description="a host name from dflashctl.yaml / hosts.yaml")
    gpus: list[StrictInt] | StrictInt | None = Field(None, description="this node's GPUs (default: the job's `gpus`)")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment for this node only")
    reach: str | None = Field(
        None,
        description="how the head's supervisor reaches this node by ssh: a destination "
        "as the head sees it (host, user@host, an alias of the head's ssh config); default: "
        "this node's HostName, port and user as resolved here; `none`: never from the head",
    )
    reach_ssh_config: str | None = Field(None, description="an ssh config file on the head for that ssh (`ssh -F`)")

    @field_validator("reach")
    @classmethod
    def _reach(cls, value: str | None) -> str | None:
        from dflashctl.config import _destination_ok

        if value is not None and value != "none" and not _destination_ok(value):
            raise ValueError("expected an ssh destination `host` or `user@host` with no shell characters, or `none`")
        return value

    @field_validator("reach_ssh_config")
    @classmethod
    def _reach_config(cls, value: str | None) -> str | None:
        if value is not None and (not value.startswith("/") or any(c in value for c in "\0\n")):
            raise ValueError("expected an absolute path on the head")
        return value

    @field_validator("host")
    @classmethod
    def _host(cls, value: str) -> str:
        if not SAFE_NAME.fullmatch(value):
            raise ValueError("expected a host name of [A-Za-z0-9._-]")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        for k, v in value.items():
            if not ENV_NAME.fullmatch(k) or "\0" in v:
                raise ValueError(f"{k!r}: not a valid environment variable")
        return value


class SlurmJob(BaseModel):
    """What a job asks of a Slurm cluster beyond the host's defaults."""

    model_config = ConfigDict(extra="forbid", defer_build=True)  # built at its first job file: never by `ls`

    nodes: StrictInt = Field(1, ge=1, le=1024, description="sbatch --nodes: one torchrun per node (srun)")
    time: SlurmTime = Field(None, description="wall time per submission (sbatch --time), over the host's")
    extra: SbatchOptions = Field(default_factory=list, description="more sbatch options, after the host's")


class JobConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, defer_build=True)  # see NodeSpec

    name: str = Field(..., description="job name, [A-Za-z0-9._-]; the job id is name + UTC timestamp")
    host: str | list[str] = Field(
        "local",
        description="a host name from dflashctl.yaml / hosts.yaml, or `local`; a "
        "list runs one job over several hosts (the first is the rendezvous head)",
    )
    hosts: list[NodeSpec] | None = Field(None, description="several hosts, each with its own gpus/env (not with host)")
    rdzv_port: StrictInt | None = Field(
        None,
        ge=1024,
        le=65535,
        description="the head's rendezvous port (multi-node); default: one derived from the job name, 29500-29899",
    )
    gpus: list[StrictInt] | StrictInt | None = Field(None, description="GPU indices, or a count (0..N-1); none = CPU")
    trainer: dict[str, Any] | str | None = Field(None, description="the bundled trainer's config, inline or a path")
    command: str | None = Field(None, description="any command line, run in the deployed code directory")
    setup: str | None = Field(
        None,
        description="a command run once per release of the code on each host, before the "
        "job (`pip install -r requirements.txt`), in the job's environment and release; its "
        "output in the run dir's setup.log; a failure is SETUP_FAILED, never restarted",
    )
    setup_timeout_s: float = Field(
        3600.0, gt=0, le=7 * 86400, description="a setup still running after this long is stopped: SETUP_FAILED"
    )
    nproc_per_node: StrictInt | None = Field(
        None, ge=1, le=64, description="processes (torchrun); default: one per GPU"
    )
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables")
    secret_env: list[str] = Field(
        default_factory=list, description="env names shown as *** (besides names holding TOKEN, KEY, SECRET, PASSWORD)"
    )
    inductor_cache: Literal["clear", "keep"] = Field("clear", description="the job's own TORCHINDUCTOR_CACHE_DIR")
    kill_grace_s: float = Field(40.0, ge=0, le=3600, description="SIGTERM to SIGKILL (torchrun needs ~30 s)")
    watch: WatchConfig = Field(default_factory=WatchConfig)
    slurm: SlurmJob | None = Field(None, description="nodes, wall time and sbatch options on a Slurm host")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not SAFE_NAME.fullmatch(value) or len(value) > 64:
            raise ValueError("may hold only [A-Za-z0-9._-] (at most 64), starting with a letter or digit")
        return value

    @field_validator("host")
    @classmethod
    def _host(cls, value: str | list[str]) -> str | list[str]:
        names = value if isinstance(value, list) else [value]
        if not names or not all(SAFE_NAME.fullmatch(n) for n in names):
            raise ValueError("expected a host name of [A-Za-z0-9._-], or a non-empty list of them")
        return value

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, value: list[int] | int | None) -> list[int] | int | None:
        if isinstance(value, int) and not 0 <= value <= MAX_GPUS:
            raise ValueError(f"a GPU count must be from 0 to {MAX_GPUS}")
        if isinstance(value, list) and (
            any(not 0 <= i < MAX_GPUS for i in value) or len(set(value)) != len(value) or len(value) > MAX_GPUS
        ):
            raise ValueError(f"GPU indices must be distinct, from 0 to {MAX_GPUS - 1}")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        for k, v in value.items():
            if not ENV_NAME.fullmatch(k):
                raise ValueError(f"{k!r} is not a valid environment variable name")
            if "\0" in v:
                raise ValueError(f"{k}: value holds a NUL byte")
        return value

    @field_validator("command", "setup")
    @classmethod
    def _command(cls, value: str | None) -> str | None:
        if value is not None and (not value.strip() or "\0" in value):
            raise ValueError("must be a non-empty command line")
        return value

    @model_validator(mode="after")
    def _one_of(self) -> JobConfig:
        if (self.trainer is None) == (self.command is None):
            raise ValueError("set exactly one of `trainer` and `command`")
        if self.hosts is not None and "host" in self.model_fields_set:
            raise ValueError("set `host` or `hosts`, not both")
        names = [n.host for n in self.nodes]
        if len(set(names)) != len(names):
            raise ValueError(f"a host appears twice among the nodes: {names}")
        if len(names) > 64:
            raise ValueError("at most 64 nodes")
        return self

    @property
    def nodes(self) -> list[NodeSpec]:
        """The job's nodes in order (the first is the rendezvous head); a single-host job has one."""
        if self.hosts is not None:
            return self.hosts
        names = self.host if isinstance(self.host, list) else [self.host]
        return [NodeSpec(host=n) for n in names]

    @property
    def multi_node(self) -> bool:
        return len(self.nodes) > 1

    def node_gpus(self, node: NodeSpec) -> list[int]:
        gpus = node.gpus if node.gpus is not None else self.gpus
        if gpus is None:
            return []
        return list(range(gpus)) if isinstance(gpus, int) else list(gpus)

    def startup_budget(self, trainer_cfg: dict | None) -> float:
        """The job's own budget, else for the trainer a base plus a preflight allowance per shape bucket (measured
        cold: about 10 s per bucket on an H200 with the mask built from anchors; 120 s leaves room for slow
        hosts and 8 ranks compiling at once), else an hour."""
        if self.watch.startup_budget_s is not None:
            return self.watch.startup_budget_s
        if trainer_cfg is not None:
            buckets = (trainer_cfg.get("data") or {}).get("seq_buckets") or [1024, 2048, 3072]  # the trainer's default
            return 300.0 + 120.0 * len(buckets)
        return 3600.0

    @property
    def gpu_indices(self) -> list[int]:
        if self.gpus is None:
            return []
        return list(range(self.gpus)) if isinstance(self.gpus, int) else list(self.gpus)

    @property
    def nproc(self) -> int:
        return self.nproc_per_node or max(1, len(self.gpu_indices))


def _check_trainer_config(data: dict, source: str, project_root: Path) -> None:
    """Validate the trainer config with the trainer's own rules, in a separate process (dflashctl never imports the
    trainer); a problem becomes a ConfigError naming the job file and `trainer.<key>`."""
    import yaml

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(data, f)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "trainer.config", f.name],
            cwd=project_root,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        Path(f.name).unlink(missing_ok=True)
    if proc.returncode == 0 or "No module named trainer" in proc.stderr:
        return  # valid, or no trainer here to judge it (the remote's will)
    try:
        problem = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise ConfigError(source, "trainer", f"could not be checked: {proc.stderr.strip()[-200:]}") from None
    key = f"trainer.{problem['key']}" if problem.get("key") else "trainer"
    raise ConfigError(source, key, problem["message"])


def _check_host_names(job: JobConfig, source: str, project_root: Path) -> None:
    """A node's host that is a typo of a host of ours (`lcoal`) is named with the nearest one here, in the job file,
    before anything tries it as an ssh destination."""
    names = [n.host for n in job.nodes]
    if all(n == "local" for n in names):
        return
    named = known_hosts(project_root)
    for i, name in enumerate(names):
        near = misspelt_host(name, named)
        if near:
            key = f"hosts.{i}.host" if job.hosts is not None else ("host" if isinstance(job.host, str) else f"host.{i}")
            raise ConfigError(source, key, unknown_host_message(name, near, command_line=False))


def load_job(path: Path, project_root: Path) -> tuple[JobConfig, dict | None]:
    """Parse and validate a job file; returns the job and the trainer config (a mapping) when it has one."""
    data = load_yaml(path)
    source = str(path)
    if not isinstance(data, dict):
        raise ConfigError(source, None, "expected a mapping (name, host, trainer or command, ...)")
    try:
        job = JobConfig.model_validate(data)
    except ValidationError as e:
        raise format_validation_error(source, e, model=JobConfig) from None
    _check_host_names(job, source, project_root)
    trainer_cfg = None
    if isinstance(job.trainer, str):
        tpath = (path.parent / job.trainer).resolve()
        loaded = load_yaml(tpath)
        if not isinstance(loaded, dict):
            raise ConfigError(str(tpath), None, "expected a mapping")
        trainer_cfg = loaded
    elif job.trainer is not None:
        trainer_cfg = job.trainer
    if trainer_cfg is not None:
        _check_trainer_config(trainer_cfg, source, project_root)
    return job, trainer_cfg


def node_tag(job_id: str, rank: int) -> str:
    """DFLASHCTL_JOB_ID of a node's processes: the job id on the head, `<id>.node<i>` on node i, so that two nodes
    sharing one machine never take each other's processes for their own."""
    return job_id if rank == 0 else f"{job_id}.node{rank}"


def is_secret(name: str, extra: list[str] | tuple[str, ...] = ()) -> bool:
    return bool(SECRET_NAME.search(name)) or name in extra


def redact_env(env: dict[str, str], extra: list[str] | tuple[str, ...] = ()) -> dict[str, str]:
    """The environment as shown to people: values of secret-looking names are ***."""
    return {k: ("***" if is_secret(k, extra) else v) for k, v in env.items()}


def redact_job_snapshot(snapshot: dict, extra: list[str] | tuple[str, ...] = ()) -> dict:
    """A job file's snapshot (job.json's `job`) as shown or handed out: env values of secret-looking names and of its
    `secret_env` as ***, on every node too, and the webhook as `scheme://host/***`. Changes `snapshot` in place."""
    names = [*(snapshot.get("secret_env") or []), *extra]
    snapshot["env"] = redact_env(snapshot.get("env") or {}, names)
    for node in snapshot.get("hosts") or []:
        node["env"] = redact_env(node.get("env") or {}, names)
    hook = (snapshot.get("watch") or {}).get("notify") or {}
    if hook.get("webhook"):
        hook["webhook"] = redact_url(hook["webhook"])
    return snapshot


def redact_url(url: str) -> str:
    """A webhook URL as every output shows it: `scheme://host/***` (its path is the credential)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or '?'}/***"
