"""`dflashctl pull`: bring a run's drafter, checkpoint or metrics back over the job's own transport (through its
container too), in chunks, resumable, hash-verified.

A file arrives as `NAME.part` and takes its name only once its sha256 equals the remote's (computed when listed, over
the size listed, so a metrics file still growing is named as it was), checked again under the final name. An
interrupted pull leaves the `.part`; the next pull continues it from its size. A `.part` that turns out wrong is
fetched again from the start, once. One pull at a time per destination (a lock in it): a second says so and waits
for nothing. A pulled `job.json` has its secrets as `***`. The job's folder is dflashctl's own output, never code:
a `.gitignore` of `*` in it keeps it out of `git status` and of deploy; in a project that is no git checkout it is
listed as such (dflashctl/outputs.py). Nothing of the user's git (.gitignore, .git/info/exclude) is changed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dflashctl import outputs
from dflashctl.errors import DflashError, RefusedError, RemoteCommandError
from dflashctl.model.jobfile import redact_job_snapshot
from dflashctl.model.record import JobRecord
from dflashctl.remote import session
from dflashctl.remote.connect import open_runner


@dataclass
class Pulled:
    path: str  # relative to the run dir
    size: int
    fetched: int = 0  # bytes brought this time
    resumed_from: int = 0  # bytes already there from an interrupted pull
    skipped: bool = False  # already there, hash equal


class DiskFullError(DflashError):
    """The destination's file system is full: what arrived so far stays as NAME.part, resumable."""


@dataclass
class PullReport:
    job: str
    to: str
    chose: list[str]
    files: list[Pulled] = field(default_factory=list)

    @property
    def bytes_fetched(self) -> int:
        return sum(f.fetched for f in self.files)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def safe_local(root: Path, rel: str) -> Path:
    """`root/rel`, refusing a name that would land outside root (the remote's answer is not trusted)."""
    dest = (root / rel).resolve()
    if root.resolve() not in dest.parents:
        raise RemoteCommandError(f"the remote named a file outside the run dir: {rel!r}")
    return dest


def _full(dest: Path, size: int) -> DiskFullError:
    free = shutil.disk_usage(dest.parent).free
    return DiskFullError(
        f"the disk is full at {dest.parent}: {free:,} B free, {size:,} B needed for {dest.name} "
        "(what arrived is kept as .part; pull again once there is room)"
    )


def redacted_job_json(data: bytes) -> bytes:
    """job.json with its secrets as every output shows them (model/jobfile.redact_job_snapshot)."""
    try:
        meta = json.loads(data)
        redact_job_snapshot(meta["job"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return b'{"redacted": "job.json could not be read, so it was not kept"}\n'
    return (json.dumps(meta, indent=1) + "\n").encode()


def fetch_one(runner, job: JobRecord, item: dict, root: Path, chunk: int, tick: Callable[[int], None]) -> Pulled:
    rel, size, want = item["path"], int(item["size"]), item["sha256"]
    dest = safe_local(root, rel)
    dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    got = Pulled(rel, size)
    if rel == "job.json":  # small: fetched whole, verified, then kept with its secrets redacted
        data = session.fetch_chunk(runner, job.run_dir, rel, 0, size)
        if hashlib.sha256(data).hexdigest() != want:
            raise RemoteCommandError(f"{rel}: the sha256 of what arrived differs from the remote's; nothing was kept")
        tmp = dest.with_name(dest.name + ".part")
        tmp.write_bytes(redacted_job_json(data))  # the snapshot names its own secret_env
        os.chmod(tmp, 0o600)
        os.replace(tmp, dest)
        got.fetched = len(data)
        tick(size)
        return got
    if dest.is_file() and dest.stat().st_size == size and sha256_of(dest) == want:
        got.skipped = True
        tick(size)
        return got
    part = dest.with_name(dest.name + ".part")
    for attempt in range(2):
        have = part.stat().st_size if part.exists() else 0
        if have > size:
            part.unlink()
            have = 0
        if attempt == 0:
            got.resumed_from = have
        tick(have)
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            while have < size:
                data = session.fetch_chunk(runner, job.run_dir, rel, have, min(chunk, size - have))
                if not data:
                    raise RemoteCommandError(f"{rel} on {job.host_name} ended at {have} of {size} bytes")
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                have += len(data)
                got.fetched += len(data)
                tick(len(data))
            os.fsync(fd)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise _full(dest, size) from None
            raise
        finally:
            os.close(fd)
        if sha256_of(part) == want:
            os.replace(part, dest)
            if sha256_of(dest) == want:  # under its final name too: nothing else wrote to it meanwhile
                return got
            dest.unlink()
            raise RemoteCommandError(f"{rel}: changed after it was verified (another writer?); nothing was kept")
        part.unlink()  # a stale or damaged partial file: once more from the start
        tick(-size)
    raise RemoteCommandError(f"{rel}: the sha256 of what arrived differs from the remote's twice; nothing was kept")


IGNORE_ALL = "# written by dflashctl pull: this folder is a pulled run, not code (delete this file to commit it)\n*\n"


def keep_out_of_git(root: Path, project: Path) -> None:
    """The pulled run is never the project's code: a `.gitignore` of `*` in the job's own folder (which ignores
    itself too, as pytest's and ruff's caches do) keeps it out of `git status` and of deploy, which lists what git
    does not ignore, without a change to the user's .gitignore or .git/info/exclude. Where the project is no git
    checkout, deploy reads dflashctl's outputs list instead."""
    path = root / ".gitignore"
    if not path.is_symlink() and not path.exists():
        with contextlib.suppress(OSError):  # where it cannot be written, neither can what is pulled
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(IGNORE_ALL)
    if not (project / ".git").exists():
        outputs.remember(project, root)


@contextlib.contextmanager
def one_pull_at_a_time(root: Path):
    """An exclusive lock on ROOT/.pull.lock for the whole pull; a second pull into the same place is refused at once."""
    fd = os.open(root / ".pull.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RefusedError(f"another pull into {root} is in progress: wait for it, or --to elsewhere") from None
        yield
    finally:
        os.close(fd)


def pull(
    job: JobRecord, to: Path, select: dict, chunk: int, accept_new: bool, start_bar, project: Path = Path(".")
) -> PullReport:
    """Pull what `select` names ({"export", "checkpoint", "metrics"}; empty: the export, else the newest checkpoint)
    into `to/<job id>/`, mirroring the run dir's layout."""
    root = to / job.id
    if to.exists() and not to.is_dir():
        raise RefusedError(f"--to {to}: exists and is not a folder")
    for link in (to, root):
        if link.is_symlink():
            raise RefusedError(f"--to {to}: {link} is a symlink: refusing to write through it; give the real path")
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise RefusedError(f"--to {to}: cannot make {root}: {e.strerror or e}") from None
    # only the job's own folder is dflashctl's output: `--to mylib` leaves the user's other files in mylib theirs
    keep_out_of_git(root, project)
    with one_pull_at_a_time(root), open_runner(job.host, accept_new) as runner:
        listing = session.call_agent(
            runner, {"action": "files", "run_dir": job.run_dir, "gpus": False, **select}, timeout=600
        )
        if "error" in listing:
            raise RefusedError(f"{job.id}: {listing['error']}")
        report = PullReport(job.id, str(root), list(listing.get("chose") or []))
        tick = start_bar(sum(int(f["size"]) for f in listing["files"]))
        for item in listing["files"]:
            report.files.append(fetch_one(runner, job, item, root, chunk, tick))
    return report
