"""Where this machine keeps its record of the last deploy to a host and workdir, the one fact a status check reads
from it (the interpreter the agent ran under, kept for the whole host too), and the policy every agent call follows
with that interpreter. Kept apart from `sync` so that status and watch read it without importing the deploy's
machinery."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dflashctl.config import HostConfig

if TYPE_CHECKING:
    from dflashctl.remote.transport import Result


def _key(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:24]


def record_path(host: HostConfig, workdir: str) -> Path:
    """The record's file in the state dir, keyed by the whole host config and the workdir."""
    from dflashctl.model.record import state_dir

    return state_dir() / "last-deploy" / f"{_key(host.model_dump_json() + chr(0) + workdir)}.json"


def host_python_path(host: HostConfig) -> Path:
    """Where the agent's interpreter on a host is kept for every workdir there: keyed by the host config without its
    workdir, so a first deploy to a new workdir on a known host skips the shim too."""
    from dflashctl.model.record import state_dir

    return state_dir() / "agent-python" / f"{_key(host.model_dump_json(exclude={'workdir'}))}.json"


def write_private_json(path: Path, body) -> None:
    """A state-dir file (0600 in a 0700 dir), replaced whole by a rename; a failure to write it is ignored (what
    these files hold is a shortcut, rebuilt when missing)."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(body, separators=(",", ":")))  # the C encoder: json.dump streams in Python
        os.replace(tmp, path)
    except OSError:
        pass


def _python_in(path: Path) -> str | None:
    try:
        python = json.loads(path.read_bytes()).get("python")
    except (OSError, ValueError, AttributeError):
        return None
    return python if isinstance(python, str) else None


def host_python(host: HostConfig) -> str | None:
    """The interpreter the release agent reported at this machine's last deploy to any workdir on the host, or None."""
    return _python_in(host_python_path(host))


def remembered_python(host: HostConfig) -> str | None:
    """The interpreter the release agent reported at this machine's last deploy to the host's workdir, else to any
    workdir on the host; None when there is neither (no deploy from here, unreadable records)."""
    return _python_in(record_path(host, host.workdir)) or host_python(host)


def remember_python(host: HostConfig, python: str | None) -> None:
    """Keep the interpreter the agent reported for every workdir on the host (an absolute path only)."""
    if python and python.startswith("/"):
        write_private_json(host_python_path(host), {"python": python})


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
