"""`launch`'s options that override the job file: `--env K=V` (repeatable), `--gpus`, `--name`, `--host` (as
`sky launch --env`, `--gpus` and `-c`). Each value is checked here (a bad one is one line naming the option, exit 2,
before anything runs remotely), then the job file's model is validated again with the options applied, so an
override obeys the job file's own rules. The overridden job is the one the run dir snapshots (job.json's `job`,
with `overridden` beside it): a restart runs it, never the job file as it is now."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from dflashctl.config import known_hosts, misspelt_host, unknown_host_message
from dflashctl.errors import ConfigError
from dflashctl.model.jobfile import ENV_NAME, JobConfig, is_secret

OPTION = {"env": "--env", "gpus": "--gpus", "name": "--name", "host": "--host"}  # job file key -> its option


@dataclass(frozen=True)
class Overrides:
    """What the command line set, as typed."""

    env: tuple[str, ...] = ()
    gpus: str | None = None
    name: str | None = None
    host: str | None = None


def parse_env(items: tuple[str, ...]) -> dict[str, str]:
    """`KEY=VALUE` each (the value may hold anything but a NUL: job.env carries it as written, never through a
    shell); a later one of the same key wins, as in a shell."""
    env: dict[str, str] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError("--env", None, f"expected KEY=VALUE, got {key[:60]!r}")
        if not ENV_NAME.fullmatch(key):
            raise ConfigError(
                "--env", None, f"{key[:60]!r} is not an environment variable name ([A-Za-z_][A-Za-z0-9_]*)"
            )
        if "\0" in value:
            raise ConfigError("--env", None, f"{key}: the value holds a NUL byte")
        env[key] = value
    return env


def parse_gpus(text: str) -> int | list[int]:
    """As the job file's `gpus:`: a count (`--gpus 2`: GPUs 0 and 1; `--gpus 0`: none) or indices (`--gpus 2,3`; a
    single index with a comma, `--gpus 3,`)."""
    raw = text.strip()
    try:
        if "," not in raw:
            return int(raw)
        return [int(part) for part in raw.split(",") if part.strip() != ""]
    except ValueError:
        raise ConfigError(
            "--gpus", None, f"{text[:60]!r}: expected a count (2) or GPU indices (0,1; one index: 3,)"
        ) from None


def apply(job: JobConfig, o: Overrides, project_root: Path) -> tuple[JobConfig, dict]:
    """The job with the options applied and validated as a job file is, and what was set (secret values as ***)."""
    data = job.model_dump(mode="json", exclude_unset=True)
    shown: dict = {}
    if o.name is not None:
        data["name"] = shown["name"] = o.name
    if o.host is not None:
        if job.hosts is not None:
            raise ConfigError(
                "--host",
                None,
                "the job file names its nodes under `hosts:` (each with its own gpus and env): change them there",
            )
        names = [n.strip() for n in o.host.split(",")]
        named = known_hosts(project_root)
        for n in names:
            near = misspelt_host(n, named)
            if near:
                raise ConfigError("--host", None, unknown_host_message(n, near, command_line=False))
        data["host"] = shown["host"] = names[0] if len(names) == 1 else names
    if o.gpus is not None:
        data["gpus"] = shown["gpus"] = parse_gpus(o.gpus)
        for node in data.get("hosts") or []:
            node.pop("gpus", None)  # every node takes the GPUs asked for on the command line
    if o.env:
        env = parse_env(o.env)
        data["env"] = {**(data.get("env") or {}), **env}
        for node in data.get("hosts") or []:  # a node's own value of the key would win over the command line's
            node["env"] = {k: v for k, v in (node.get("env") or {}).items() if k not in env}
        secret = data.get("secret_env") or []
        shown["env"] = {k: "***" if is_secret(k, secret) else v for k, v in env.items()}
    if not shown:
        return job, {}
    try:
        return JobConfig.model_validate(data), shown
    except ValidationError as e:
        err = e.errors()[0]
        where = str(err["loc"][0]) if err.get("loc") else ""
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        raise ConfigError(OPTION.get(where, "launch"), None, msg) from None
