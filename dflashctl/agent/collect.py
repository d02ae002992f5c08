"""`gc`: remove the run dirs of jobs that ended long enough ago, never a live job's. Part of the remote agent.

A run dir is collected only when all of these hold, read under the workdir's launch lock (so no launch or restart
races it): its job ended (an exit status or a kill's result is written), no tmux session of ours runs it, its
supervisor is not alive, no file in it changed for `older_than_s`, it belongs to the asking project (unless every
project's are asked for), nothing is mounted anywhere inside it, and it is a real directory inside WORKDIR/runs.

Removal never leaves the run dir's file system and never follows a link: every directory is opened relative to its
parent with O_NOFOLLOW and its device compared with the run dir's (`rm -rf --one-file-system`, done by descriptor so
that a directory swapped for a link between the look and the removal is refused, not followed). A dry run changes
nothing: not even the dead tmux sessions of ended jobs are closed.
"""

from __future__ import annotations

import math
import os
import re
import stat
import time

from . import supervision
from .common import STOP_RESULT, locked, read_json
from .starting import our_live_jobs

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class CrossesMount(OSError):
    """A directory inside a run dir is on another file system: the run dir is left alone."""


def mount_points() -> list[str]:
    """Every mount point this process sees (/proc/self/mountinfo, field 5, octal escapes undone): a bind mount of the
    same file system has the same st_dev, so the device check alone would not see it."""
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    unescape = re.compile(rb"\\([0-7]{3})")
    return [
        os.fsdecode(unescape.sub(lambda m: bytes([int(m.group(1), 8) & 0xFF]), line.split(b" ")[4]))
        for line in lines
        if len(line.split(b" ")) > 4
    ]


def mounts_inside(run: str, points: list[str]) -> list[str]:
    real = os.path.realpath(run).rstrip("/") + "/"
    return sorted(p for p in points if p.startswith(real) or p + "/" == real)


def _walk(dir_fd: int, dev: int, path: str, remove: bool) -> int:
    """Bytes of the tree open at `dir_fd` (a directory on device `dev`); with `remove`, its contents removed, deepest
    first. Raises CrossesMount at a directory on another device, before anything below it is touched."""
    total = 0
    with os.scandir(dir_fd) as it:
        entries = list(it)
    for entry in entries:
        st = os.lstat(entry.name, dir_fd=dir_fd)
        if stat.S_ISDIR(st.st_mode):
            if st.st_dev != dev:
                raise CrossesMount(f"{path}/{entry.name} is another file system")
            fd = os.open(entry.name, DIR_FLAGS, dir_fd=dir_fd)
            try:
                if os.fstat(fd).st_dev != dev:  # swapped since the lstat
                    raise CrossesMount(f"{path}/{entry.name} is another file system")
                total += _walk(fd, dev, f"{path}/{entry.name}", remove)
            finally:
                os.close(fd)
            if remove:
                os.rmdir(entry.name, dir_fd=dir_fd)
        else:
            total += st.st_size
            if remove:
                os.unlink(entry.name, dir_fd=dir_fd)
    return total


def tree(run: str, remove: bool = False) -> int:
    """The size of run dir `run` and, with `remove`, the run dir removed: one file system, no link followed. The
    whole tree is looked at first, so a mount anywhere in it leaves all of it; one that appears during the removal
    still stops the walk at its door."""
    fd = os.open(run, DIR_FLAGS)
    try:
        dev = os.fstat(fd).st_dev
        size = _walk(fd, dev, run, False)
        if remove:
            _walk(fd, dev, run, True)
    finally:
        os.close(fd)
    if remove:
        os.rmdir(run)
    return size


def _newest_mtime(run: str) -> float:
    newest = os.lstat(run).st_mtime
    for entry in os.scandir(run):
        try:
            newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
        except OSError:
            continue
    return newest


def refusal(req: dict) -> str | None:
    """What is wrong with a request, said as the CLI says it: the agent checks again what the CLI checked."""
    try:
        older = float(req.get("older_than_s", 7 * 86400))
    except (TypeError, ValueError):
        return "older_than_s: not a number"
    if not math.isfinite(older) or older < 0:
        return f"older_than_s: {older!r}: expected a finite number of seconds, 0 or more"
    project = req.get("project")
    if project is not None and not isinstance(project, str):
        return "project: expected a string or null"
    only = req.get("only")
    if only is not None and not (isinstance(only, list) and all(isinstance(x, str) for x in only)):
        return "only: expected a list of job ids"
    return None


def _why_kept(
    run: str, name: str, live: set, project: str | None, older_than: float, now: float, points: list[str]
) -> str | None:
    if os.path.islink(run) or not os.path.isdir(run):
        return "not a directory of ours"
    if name in live:
        return "alive"
    if project is not None:
        meta = read_json(os.path.join(run, "job.json"))
        owner = meta.get("project") if isinstance(meta, dict) else None
        if owner != project:
            return "another project's (--all-projects to include it)"
    if not (os.path.exists(os.path.join(run, "exit_code")) or os.path.exists(os.path.join(run, STOP_RESULT))):
        return "no end recorded"
    if (supervision.state(run) or {}).get("alive"):
        return "its supervisor is alive"
    age = now - _newest_mtime(run)
    if age < older_than:
        return f"ended {age / 86400:.1f} days ago"
    inside = mounts_inside(run, points)
    if inside:
        return "holds a mount point: " + ", ".join(inside)
    return None


def collect(req: dict) -> dict:
    refused = refusal(req)
    dry = bool(req.get("dry_run"))
    if refused:
        return {"refused": refused, "removed": [], "kept": [], "dry_run": dry}
    wd = req["workdir"]
    runs = os.path.join(wd, "runs")
    older_than = float(req.get("older_than_s", 7 * 86400))
    project, only = req.get("project"), req.get("only")
    now = time.time()
    removed, kept = [], []
    if not os.path.isdir(runs) or os.path.islink(runs):
        return {"removed": [], "kept": [], "dry_run": dry}
    with locked(os.path.join(wd, ".launch.lock")):
        live = {j.get("id") for j in our_live_jobs(wd, close_ended=not dry)}
        points = mount_points()
        for name in sorted(os.listdir(runs)):
            run = os.path.join(runs, name)
            why = _why_kept(run, name, live, project, older_than, now, points)
            if why is None and only is not None and name not in only:
                why = "not among the run dirs listed and confirmed"
            if why is None:
                try:
                    size = tree(run, remove=not dry)
                except OSError as e:
                    why = f"holds a mount point: {e}" if isinstance(e, CrossesMount) else f"not removed: {e}"
            if why:
                kept.append({"id": name, "why": why})
                continue
            removed.append({"id": name, "bytes": size})
    return {"removed": removed, "kept": kept, "dry_run": dry}
