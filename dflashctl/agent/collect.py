"""`gc`: remove the run dirs of jobs that ended long enough ago, never a live job's. Part of the remote agent.

A run dir is collected only when all of these hold, read under the workdir's launch lock (so no launch or restart
races it): its job ended (an exit status or a kill's result is written), no tmux session of ours runs it (a dead
pane of an ended job is closed first), its supervisor is not alive, no file in it changed for `older_than_s`, and
it is a real directory inside WORKDIR/runs (a symlink is never followed, never removed through).
"""

from __future__ import annotations

import os
import shutil
import time

from . import supervision
from .common import STOP_RESULT, locked
from .starting import our_live_jobs


def _newest_mtime(run: str) -> float:
    newest = os.lstat(run).st_mtime
    for entry in os.scandir(run):
        try:
            newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
        except OSError:
            continue
    return newest


def _size(run: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(run, followlinks=False):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total


def collect(req: dict) -> dict:
    wd = req["workdir"]
    runs = os.path.join(wd, "runs")
    older_than = float(req.get("older_than_s", 7 * 86400))
    dry = bool(req.get("dry_run"))
    now = time.time()
    removed, kept = [], []
    if not os.path.isdir(runs) or os.path.islink(runs):
        return {"removed": [], "kept": [], "dry_run": dry}
    with locked(os.path.join(wd, ".launch.lock")):
        live = {j.get("id") for j in our_live_jobs(wd)}
        for name in sorted(os.listdir(runs)):
            run = os.path.join(runs, name)
            why = None
            if os.path.islink(run) or not os.path.isdir(run):
                why = "not a directory of ours"
            elif name in live:
                why = "alive"
            elif not (os.path.exists(os.path.join(run, "exit_code")) or os.path.exists(os.path.join(run, STOP_RESULT))):
                why = "no end recorded"
            elif (supervision.state(run) or {}).get("alive"):
                why = "its supervisor is alive"
            else:
                age = now - _newest_mtime(run)
                if age < older_than:
                    why = f"ended {age / 86400:.1f} days ago"
            if why:
                kept.append({"id": name, "why": why})
                continue
            size = _size(run)
            if not dry:
                shutil.rmtree(run)
            removed.append({"id": name, "bytes": size})
    return {"removed": removed, "kept": kept, "dry_run": dry}
