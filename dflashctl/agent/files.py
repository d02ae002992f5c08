"""A run dir's files, read boundedly: new log bytes and metrics records from an offset, the heartbeat, a file's tail,
what `report` draws, and what `pull` may bring back. Part of the remote agent (stdlib only)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import time

from .common import RESTARTS, SetAside, open_regular, read_int, read_json, read_regular, set_aside

HEARTBEAT_FUTURE_S = 5.0  # a heartbeat mtime further ahead than this on our own clock is not believed


def read_new(path: str, offset: int, limit: int) -> dict:
    """Bytes of `path` from `offset` (at most `limit`; the newest part when there is more). A regular file only
    (the job writes this dir: a FIFO, a link or a directory there is set aside, never blocked on or followed)."""
    missing = {"exists": False, "offset": offset, "size": 0, "text": "", "skipped": 0}
    try:
        fd = open_regular(path)
    except OSError as e:
        set_aside(path, str(e) if isinstance(e, SetAside) else e.strerror or type(e).__name__)
        return missing
    if fd is None:
        return missing
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        offset = max(0, offset)
        if size < offset:  # truncated or replaced: start again
            offset = 0
        start = max(offset, size - limit)
        f.seek(start)
        data = f.read(size - start)
    return {
        "exists": True,
        "offset": start + len(data),
        "size": size,
        "text": data.decode(errors="replace"),
        "skipped": start - offset,
    }


def read_metrics(path: str, offset: int, limit: int) -> dict:
    """New complete lines of metrics.jsonl as records. A line that is not a JSON object is skipped and counted."""
    got = read_new(path, offset, limit)
    text = got.pop("text")
    end = got["offset"]
    cut = text.rfind("\n") + 1  # a line being written is left for the next poll
    end -= len(text[cut:].encode(errors="replace"))
    records, malformed = [], 0
    for line in text[:cut].splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if isinstance(rec, dict):
            records.append(rec)
        else:
            malformed += 1
    got.update(offset=end, records=records, malformed=malformed)
    return got


def read_heartbeat(run_dir: str, now: float) -> dict | None:
    """The heartbeat's content (a JSON object; anything else counts as malformed) and its age on this clock."""
    path = os.path.join(run_dir, "heartbeat")
    try:
        mtime = os.path.getmtime(path)
    except OSError:
        return None
    body = read_json(path)
    hb = dict(body) if isinstance(body, dict) else {"malformed": True}
    for key in ("time", "step"):
        if key in hb and (isinstance(hb[key], bool) or not isinstance(hb[key], (int, float))):
            hb.pop(key)
            hb["malformed"] = True
    if not isinstance(hb.get("phase"), (str, type(None))):
        hb.pop("phase")
    future = mtime > now + HEARTBEAT_FUTURE_S
    hb.update(mtime=mtime, age_s=None if future else round(max(0.0, now - mtime), 2), future=future)
    return hb


def tail_lines(path: str, lines: int, limit: int) -> dict:
    """The last `lines` lines of a regular file, reading at most `limit` bytes from its end."""
    try:
        fd = open_regular(path)
        if fd is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory")
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(fd).st_size
            f.seek(max(0, size - limit))
            data = f.read(limit)
    except OSError as e:
        return {"exists": False, "error": str(e) if isinstance(e, SetAside) else e.strerror or str(e), "text": ""}
    chunk = data.splitlines()[-lines:] if lines > 0 else []
    return {"exists": True, "size": size, "truncated": size > limit, "text": b"\n".join(chunk).decode(errors="replace")}


def thin(items: list, max_points: int) -> list:
    """Every k-th item (the last always kept) so that at most about `max_points` remain."""
    if max_points <= 0 or len(items) <= max_points:
        return items
    k = -(-len(items) // max_points)
    return items[::k] + ([items[-1]] if (len(items) - 1) % k else [])


def _number(v) -> float | None:
    """A finite number, or None (a string, a bool, NaN, inf, an int too large for a float)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if f == f and abs(f) != float("inf") else None


def figures(records: list[dict]) -> dict:
    """A run's numbers, one definition for `status`, `report` and `watch`'s last line: the step records' mean
    tokens/s, the first and last loss, the newest step, and the time from the first record to the last."""
    steps = [r for r in records if "event" not in r and type(r.get("step")) is int and _number(r.get("time"))]
    tps = [t for r in steps if (t := _number(r.get("tokens_per_s"))) is not None]
    losses = [x for r in steps if (x := _number(r.get("loss"))) is not None]
    valid = steps + [r for r in records if isinstance(r.get("event"), str)]  # a malformed record's time says nothing
    times = [t for r in valid if (t := _number(r.get("time"))) is not None]
    return {
        "step": steps[-1]["step"] if steps else None,
        "mean_tokens_per_s": round(sum(tps) / len(tps), 1) if tps else None,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "elapsed_s": round(max(times) - min(times), 1) if len(times) > 1 else None,
    }


def run_figures(run_dir: str, limit: int = 64 << 20) -> dict:
    return figures(read_metrics(os.path.join(run_dir, "metrics.jsonl"), 0, limit)["records"])


def history(req: dict) -> dict:
    """Everything `report` draws, in one call: the run's metrics, GPU history and watch decisions (each file read up
    to `max_bytes` from its end), step records and GPU samples thinned to `max_points`; events all kept."""
    run = req["run_dir"]
    limit, points = int(req.get("max_bytes", 64 << 20)), int(req.get("max_points", 4000))
    out: dict = {"run_dir": run, "run_dir_exists": os.path.isdir(run), "time": time.time()}
    for name in ("metrics.jsonl", "gpu.jsonl", "events.jsonl"):
        got = read_metrics(os.path.join(run, name), 0, limit)
        key = name.split(".")[0]
        if key == "metrics":
            out["figures"] = figures(got["records"])
            steps = [r for r in got["records"] if "event" not in r and type(r.get("step")) is int]
            rest = [r for r in got["records"] if "event" in r or type(r.get("step")) is not int]
            out[key] = thin(steps, points) + rest
            out["step_records"] = len(steps)
        else:
            out[key] = thin(got["records"], points) if key == "gpu" else got["records"]
        out[f"{key}_malformed"] = got["malformed"]
        out[f"{key}_skipped_bytes"] = got["skipped"]
    out["heartbeat"] = read_heartbeat(run, out["time"]) if out["run_dir_exists"] else None
    out["exit_code"] = read_int(os.path.join(run, "exit_code"))
    out["restarts"] = read_int(os.path.join(run, RESTARTS)) or 0
    return out


def sha256_prefix(path: str, size: int) -> str:
    """sha256 of the first `size` bytes: a file still being appended to is named as it was when listed."""
    h, left = hashlib.sha256(), size
    with open(path, "rb") as f:
        while left > 0:
            block = f.read(min(left, 8 << 20))
            if not block:
                break
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def checkpoint_dirs(run: str) -> list[str]:
    """Complete checkpoints (step-NNNNNNNN, no .tmp), oldest first."""
    root = os.path.join(run, "checkpoints")
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return sorted(
        os.path.join("checkpoints", n)
        for n in names  # a link (maybe out of the run dir) is no checkpoint
        if len(n) == 13
        and n.startswith("step-")
        and n[5:].isdigit()
        and not os.path.islink(os.path.join(root, n))
        and os.path.isdir(os.path.join(root, n))
    )


def pull_files(req: dict) -> dict:
    """What `pull` asked for, as files relative to the run dir with size and sha256. Default: the export when it
    exists, else the newest checkpoint. Symlinks and anything resolving outside the run dir are left out."""
    run = os.path.realpath(req["run_dir"])
    if not os.path.isdir(run):
        return {"error": "the run dir is gone"}
    dirs, singles, chose = [], [], []
    ckpts = checkpoint_dirs(run)
    want_export, ckpt, metrics = req.get("export"), req.get("checkpoint"), req.get("metrics")
    if not (want_export or ckpt or metrics):
        want_export = os.path.isfile(os.path.join(run, "export", "config.json"))
        ckpt = None if want_export else "latest"
    if want_export:
        if not os.path.isdir(os.path.join(run, "export")):
            return {"error": "the run has no export yet (it is written at the end of training)"}
        dirs.append("export")
        chose.append("export")
    if ckpt is not None:
        if not ckpts:
            return {"error": "the run has no complete checkpoint"}
        name = ckpts[-1] if ckpt == "latest" else os.path.join("checkpoints", f"step-{int(ckpt):08d}")
        if name not in ckpts:
            return {"error": f"no checkpoint {ckpt}: there are {', '.join(c[-8:].lstrip('0') or '0' for c in ckpts)}"}
        dirs.append(name)
        chose.append(name)
    if metrics:
        singles += ["metrics.jsonl", "gpu.jsonl", "events.jsonl", "train.log", "job.json"]
        chose.append("metrics")
    rels = [r for r in singles if os.path.isfile(os.path.join(run, r))]
    for d in dirs:
        for root, subdirs, names in os.walk(os.path.join(run, d)):
            subdirs[:] = sorted(x for x in subdirs if not os.path.islink(os.path.join(root, x)))
            rels += [os.path.relpath(os.path.join(root, n), run) for n in sorted(names)]
    files = []
    for rel in rels:
        path = os.path.join(run, rel)
        real = os.path.realpath(path)
        if os.path.islink(path) or not real.startswith(run + os.sep) or not os.path.isfile(real):
            continue
        size = os.path.getsize(real)
        files.append({"path": rel, "size": size, "sha256": sha256_prefix(real, size)})
    return {"files": files, "chose": chose}


def read_chunk(req: dict) -> bytes:
    """Bytes [offset, offset + length) of a file under the run dir (never outside it)."""
    run = os.path.realpath(req["run_dir"])
    real = os.path.realpath(os.path.join(run, req["path"]))
    if not real.startswith(run + os.sep):
        return b""
    try:
        return read_regular(real, int(req["length"]), int(req["offset"])) or b""
    except OSError:
        return b""
