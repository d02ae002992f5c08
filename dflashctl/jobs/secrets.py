"""The job file's secrets, as the laptop knows them: what masks job text shown or sent from here (`logs`, `report`,
notifications). The remote masks what its snapshot reads with the values it holds; this is for text that reaches
us by other roads (a log tail, a report's history) and for a job whose run dir has already been scrubbed."""

from __future__ import annotations

from pathlib import Path

from dflashctl.errors import ConfigError
from dflashctl.judge.redact import Redactor, url_secrets
from dflashctl.model.jobfile import is_secret
from dflashctl.model.record import JobRecord


def values_of(data: dict) -> list[str]:
    """Every secret value a job file (as parsed YAML) names: env values of secret-looking names and of
    `secret_env`, the job's and every node's, and the webhook URL's secret parts."""
    extra = [n for n in data.get("secret_env") or [] if isinstance(n, str)]
    envs = [data.get("env"), *[n.get("env") for n in data.get("hosts") or [] if isinstance(n, dict)]]
    found = [
        v
        for env in envs
        if isinstance(env, dict)
        for k, v in env.items()
        if isinstance(k, str) and isinstance(v, str) and is_secret(k, extra)
    ]
    watch = data.get("watch") if isinstance(data.get("watch"), dict) else {}
    hook = (watch.get("notify") or {}).get("webhook") if isinstance(watch.get("notify"), dict) else None
    return found + (url_secrets(hook) if isinstance(hook, str) else [])


def redactor(record: JobRecord) -> Redactor:
    """The record's webhook, and the secrets of its job file as the file is now (a file gone or unreadable gives
    what the record alone knows: the remote masked the rest)."""
    from dflashctl.config import load_yaml

    values = url_secrets(record.watch.notify.webhook or "")
    try:
        data = load_yaml(Path(record.job_file))
    except ConfigError:
        data = None
    return Redactor(values + (values_of(data) if isinstance(data, dict) else []))
