"""Where this machine keeps its record of the last deploy to a host and workdir, the one fact a status check reads
from it (the interpreter the agent ran under), and the policy every agent call follows with that interpreter. Kept
apart from `sync` so that status and watch read it without importing the deploy's machinery."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dflashctl.config import HostConfig

if TYPE_CHECKING:
    from dflashctl.remote.transport import Result


def record_path(host: HostConfig, workdir: str) -> Path:
    """The record's file in the state dir, keyed by the whole host config and the workdir."""
    from dflashctl.model.record import state_dir

    key = hashlib.sha256(f"{host.model_dump_json()}\0{workdir}".encode("utf-8", "surrogateescape")).hexdigest()
    return state_dir() / "last-deploy" / f"{key[:24]}.json"


def remembered_python(host: HostConfig) -> str | None:
    """The interpreter the release agent reported at this machine's last deploy to the host's workdir, or None (no
    deploy from here, an unreadable record)."""
    try:
        python = json.loads(record_path(host, host.workdir).read_bytes()).get("python")
    except (OSError, ValueError, AttributeError):
        return None
    return python if isinstance(python, str) else None


class AgentPython:
    """The interpreter for the agent: the one it reported last time when known (and absolute), else the host's
    `python`. A `python3` that is a version manager's shim (pyenv, asdf) costs a shell script and a lookup, a tenth
    of a second, on every call; the agent needs only some Python 3.8+, so the real interpreter behind the shim serves
    it. One that is gone (exit 126/127) is dropped and the host's `python` runs the call again."""

    def __init__(self, configured: str, remembered: str | None) -> None:
        self.configured = configured
        self.python = remembered if remembered and remembered.startswith("/") else configured
        self.resolved: str | None = None

    def run(self, attempt: Callable[[str], Result]) -> Result:
        """`attempt(python)` under the current interpreter; once more under the configured one if that could not
        start."""
        while True:
            python = self.python
            res = attempt(python)
            if res.returncode not in (126, 127) or python == self.configured:
                return res
            self.python = self.configured

    def ran(self, reported: object) -> None:
        self.resolved = reported if isinstance(reported, str) and reported.startswith("/") else None
