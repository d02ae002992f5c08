"""Typed errors. The CLI's one handler turns each into a one-line message and its exit code.

Exit codes (documented in the README):
    0  success
    1  a remote command or the job failed
    2  bad input: config, job file, host spec, host key, unreachable host; nothing ran remotely
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


class DflashError(Exception):
    """Base class: a message for the user and the exit code that goes with it."""

    exit_code: int = EXIT_FAILED


class ConfigError(DflashError):
    """A config or job file is malformed or holds a bad value. Always names the file and the key."""

    exit_code = EXIT_USAGE

    def __init__(self, source: str, key: str | None, message: str) -> None:
        self.source, self.key = source, key
        where = f"{source}: {key}" if key else source
        super().__init__(f"{where}: {message}")


class HostKeyError(DflashError):
    """The remote host key is unknown (and not accepted) or has changed."""

    exit_code = EXIT_USAGE


class UnreachableError(DflashError):
    """The host did not answer within the connect timeout, or refused us."""

    exit_code = EXIT_USAGE


class RemoteCommandError(DflashError):
    """A remote command exited non-zero where success was required."""

    exit_code = EXIT_FAILED


class RefusedError(DflashError):
    """Refused before anything ran: a launch that would collide (stale code, GPUs in use), a pull or report of
    something the run does not have."""

    exit_code = EXIT_USAGE


class NoSuchJobError(DflashError):
    """No job in the registry matches what was asked for."""

    exit_code = EXIT_USAGE


class ProbeFailedError(RemoteCommandError):
    """The host answered, but the probe failed there (a bad `python:`, a missing file): not an unreachable host."""


class RecordsCorruptError(DflashError):
    """The local job records cannot be read; nothing is written over them."""

    exit_code = EXIT_USAGE


class NothingToDoError(DflashError):
    """The request is already satisfied (kill of a finished job): a message, exit 0, nothing changed."""

    exit_code = EXIT_OK
