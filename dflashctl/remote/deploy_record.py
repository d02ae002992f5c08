"""Where this machine keeps its record of the last deploy to a host and workdir, and the one fact a status check
reads from it: the interpreter the agent ran under. Kept apart from `sync` so that status and watch read it without
importing the deploy's machinery."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from dflashctl.config import HostConfig


def record_path(host: HostConfig, workdir: str) -> Path:
    """The record's file in the state dir, keyed by the whole host config and the workdir."""
    from dflashctl.model.record import state_dir

    key = hashlib.sha256(f"{host.model_dump_json()}\0{workdir}".encode("utf-8", "surrogateescape")).hexdigest()
    return state_dir() / "last-deploy" / f"{key[:24]}.json"


def remembered_python(host: HostConfig) -> str | None:
    """The absolute interpreter the release agent reported at this machine's last deploy to the host's workdir, or
    None (no deploy from here, an unreadable record, a relative name)."""
    try:
        python = json.loads(record_path(host, host.workdir).read_bytes()).get("python")
    except (OSError, ValueError, AttributeError):
        return None
    return python if isinstance(python, str) and python.startswith("/") else None
