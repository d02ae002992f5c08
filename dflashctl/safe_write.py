"""Every file dflashctl writes on this machine where a user keeps other things: a new temp file in the same folder,
then one rename. Never through a symlink it did not create (refused: the link's target is someone's file), never
over a folder (refused), never half a file under the final name."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from dflashctl.errors import ConfigError


def check_target(path: Path, key: str) -> None:
    """Refuse (exit 2, one line naming the file and the option) a target that is a symlink or a folder."""
    if path.is_symlink():
        raise ConfigError(
            str(path),
            key,
            "is a symlink: refusing to write through it (its target may be someone's file); give the real path",
        )
    if path.is_dir():
        raise ConfigError(str(path), key, "is a folder: refusing to write over it")


def write_bytes(path: Path, data: bytes, key: str, mode: int = 0o644) -> None:
    """`path` holds `data` whole, or keeps what it held."""
    path = Path(path)
    check_target(path, key)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.{os.urandom(4).hex()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
