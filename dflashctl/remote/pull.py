"""`dflashctl pull`: bring a run's drafter, checkpoint or metrics back over the job's own transport (through its
container too), in chunks, resumable, hash-verified.

A file arrives as `NAME.part` and takes its name only once its sha256 equals the remote's (computed when listed, over
the size listed, so a metrics file still growing is named as it was). An interrupted pull leaves the `.part`; the
next pull continues it from its size. A `.part` that turns out wrong is fetched again from the start, once.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dflashctl.errors import RefusedError, RemoteCommandError
from dflashctl.jobs.registry import JobRecord
from dflashctl.remote import session
from dflashctl.remote.connect import open_runner


@dataclass
class Pulled:
    path: str  # relative to the run dir
    size: int
    fetched: int = 0  # bytes brought this time
    resumed_from: int = 0  # bytes already there from an interrupted pull
    skipped: bool = False  # already there, hash equal


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


def fetch_one(runner, job: JobRecord, item: dict, root: Path, chunk: int, tick: Callable[[int], None]) -> Pulled:
    rel, size, want = item["path"], int(item["size"]), item["sha256"]
    dest = safe_local(root, rel)
    dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    got = Pulled(rel, size)
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
                os.write(fd, data)
                have += len(data)
                got.fetched += len(data)
                tick(len(data))
            os.fsync(fd)
        finally:
            os.close(fd)
        if sha256_of(part) == want:
            os.replace(part, dest)
            return got
        part.unlink()  # a stale or damaged partial file: once more from the start
        tick(-size)
    raise RemoteCommandError(f"{rel}: the sha256 of what arrived differs from the remote's twice; nothing was kept")


def pull(job: JobRecord, to: Path, select: dict, chunk: int, accept_new: bool, start_bar) -> PullReport:
    """Pull what `select` names ({"export", "checkpoint", "metrics"}; empty: the export, else the newest checkpoint)
    into `to/<job id>/`, mirroring the run dir's layout."""
    root = to / job.id
    with open_runner(job.host, accept_new) as runner:
        listing = session.call_agent(runner, {"action": "files", "run_dir": job.run_dir, "gpus": False, **select},
                                     timeout=600)  # fmt: skip
        if "error" in listing:
            raise RefusedError(f"{job.id}: {listing['error']}")
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        report = PullReport(job.id, str(root), list(listing.get("chose") or []))
        tick = start_bar(sum(int(f["size"]) for f in listing["files"]))
        for item in listing["files"]:
            report.files.append(fetch_one(runner, job, item, root, chunk, tick))
    return report
