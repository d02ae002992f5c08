"""Runs ON the remote, in its own Python, stdlib only (pynvml if importable): one call, one JSON answer about a job.

Shipped by `session.call_agent`: `python3 -c BOOT LEN REQUEST_JSON [GPU_CSV APPS_CSV]` with this file's source on
stdin (LEN bytes), followed by the action's payload (the run files of a launch). The CSVs are GPU readings taken on a
container's host by the same command. Actions:

- `snapshot` (default): the pane (alive or dead, exit status, last lines), the job's processes, new train.log bytes
  (bounded), new metrics.jsonl records (malformed ones counted, never fatal), the heartbeat as seen on this clock, the
  stop request and restart count, exit_code, GPU readings, free disk, our tmux sessions. With `record_gpu` (a
  `command:` job) the readings of the job's GPUs are appended to RUN/gpu.jsonl too.
- `launch`: under a host-wide lock, refuse GPUs held by our live jobs or unknown processes and a live job of the
  same name (unless forced), then create the run dir (0700, files 0600) and start the tmux session.
- `restart`: under the run dir's lock, refuse when a stop was requested, when another watcher already restarted this
  attempt, or when `max_restarts` is spent; else stop the old attempt, count the restart and start `--resume`.
- `reap` (kill): record a stop request under the run dir's lock, SIGTERM the job's processes, wait, SIGKILL what is
  left (and anything spawned meanwhile), verify, close the session, record the result in the run dir.
- `gpu_holders`: the GPU processes of this (host) machine with their pids in every pid namespace (`NSpid`).
- `history`: what `report` draws: metrics, GPU history and watch decisions of a run, thinned, in one answer.
- `files`, `chunk` (pull): files to bring back with their sha256; then raw bytes of one of them, a chunk at a time.
- `tail`: the last lines of a file, read from its end (bounded however long its lines are).

On a Slurm host (`"scheduler": "slurm"` in the request) the job's "pane" is its newest submission (agent/slurm.py):
`launch` writes the same run dir and runs `sbatch` instead of tmux, `restart` cancels the old submission, sees it end
and resubmits, `reap` runs `scancel` and waits for a final state, and `snapshot` reports Slurm's word on the job.

A process of the job is a descendant of the job's launcher (a child subreaper, so nothing escapes by double-forking
or `setsid`) or carries the job's tag in its environment; it is named by (pid, start time). A dead pane contributes no
process: its pid may belong to someone else by now. Nothing here imports the rest of dflashctl.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

from . import supervision
from .common import locked, read_int, read_json, scrub_secrets, start_time, write_atomic


def _slurm():
    """agent/slurm.py, imported where a Slurm host needs it: a poll of a tmux job never pays for it."""
    from . import slurm

    return slurm

TMUX = ["tmux", "-L", "dflashctl"]  # the dedicated server; a request's `tmux_socket` names another
GPU_FIELDS = [
    "index", "uuid", "name", "memory.used", "memory.total", "utilization.gpu", "power.draw", "temperature.gpu",
    "clocks.sm", "pstate", "clocks_event_reasons.active", "ecc.errors.uncorrected.volatile.total",
]  # fmt: skip
GPU_KEYS = ["index", "uuid", "name", "mem_used_mib", "mem_total_mib", "util_pct", "power_w", "temp_c", "sm_mhz",
            "pstate", "throttle", "ecc_uncorrected"]  # fmt: skip
TEXT_KEYS = ("uuid", "name", "pstate", "throttle")
APP_FIELDS = ["pid", "process_name", "used_memory", "gpu_uuid"]
AGENT_FILE = "agent.pyz"
STOP_REQUEST, STOP_RESULT, RESTARTS, WRAPPER_PID = "stop_request", "stop_result", "restarts", "wrapper.pid"
HEARTBEAT_FUTURE_S = 5.0  # a heartbeat mtime further ahead than this on our own clock is not believed
VERIFY_S = 5.0  # after SIGKILL, how long the kill keeps finding and killing the job's processes before giving up


def _run(argv: list[str], timeout: float = 10.0) -> tuple[int, str]:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout
    except (OSError, subprocess.TimeoutExpired):
        return 127, ""


def _num(text: str):
    text = text.strip()
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return None if text in ("[N/A]", "N/A", "[Not Supported]", "") else text


def parse_gpu_csv(text: str) -> list[dict]:
    """Rows of `nvidia-smi --query-gpu=<GPU_FIELDS> --format=csv,noheader,nounits`."""
    gpus = []
    for line in text.strip().splitlines():
        values = [v.strip() for v in line.split(",")]
        if len(values) != len(GPU_FIELDS):
            continue
        row = dict(zip(GPU_KEYS, values))  # noqa: B905 (lengths checked above; zip(strict=) is Python 3.10+)
        gpus.append({k: (row[k] if k in TEXT_KEYS else _num(row[k])) for k in GPU_KEYS})
    return gpus


def parse_apps_csv(text: str) -> list[dict]:
    """Rows of `nvidia-smi --query-compute-apps=pid,process_name,used_memory,gpu_uuid --format=csv,noheader,nounits`
    (the name may hold commas: pid first, memory and uuid last)."""
    apps = []
    for line in text.strip().splitlines():
        values = [v.strip() for v in line.split(",")]
        if len(values) >= 4 and values[0].isdigit():
            apps.append({"pid": int(values[0]), "name": ",".join(values[1:-2]), "used_mib": _num(values[-2]),
                         "gpu_uuid": values[-1]})  # fmt: skip
    return apps


def gpus_from_nvml() -> tuple[list[dict], list[dict]] | None:
    try:
        import pynvml as nv  # nvidia-ml-py
    except ImportError:
        return None
    try:
        nv.nvmlInit()
    except Exception:
        return None

    def safe(fn, *a):
        try:
            return fn(*a)
        except Exception:
            return None

    gpus, apps = [], []
    try:
        for i in range(nv.nvmlDeviceGetCount()):
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
            except Exception as e:  # NVML_ERROR_GPU_IS_LOST and the like: the GPU is there and broken
                gpus.append({"index": i, "uuid": None, "name": None, "lost": f"{type(e).__name__}: {e}"[:200]})
                continue
            uuid = nv.nvmlDeviceGetUUID(h)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            name = nv.nvmlDeviceGetName(h)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            power = safe(nv.nvmlDeviceGetPowerUsage, h)
            ecc = safe(nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)
            reasons = safe(nv.nvmlDeviceGetCurrentClocksEventReasons, h)
            util = safe(nv.nvmlDeviceGetUtilizationRates, h)
            pending = safe(nv.nvmlDeviceGetRetiredPagesPendingStatus, h)
            remap = safe(nv.nvmlDeviceGetRemappedRows, h)  # (correctable, uncorrectable, pending, failure)
            gpus.append({
                "index": i, "uuid": uuid, "name": name.decode() if isinstance(name, bytes) else name,
                "util_pct": util.gpu if util else None, "mem_used_mib": mem.used // 2**20,
                "mem_total_mib": mem.total // 2**20, "power_w": power / 1000 if power is not None else None,
                "temp_c": safe(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
                "sm_mhz": safe(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM),
                "pstate": None, "throttle": f"0x{reasons:016x}" if reasons is not None else None,
                "ecc_uncorrected": ecc, "retired_pending": bool(pending) if pending is not None else None,
                "remap_pending": bool(remap[2]) if remap else None, "remap_failed": bool(remap[3]) if remap else None,
            })  # fmt: skip
            for p in safe(nv.nvmlDeviceGetComputeRunningProcesses, h) or []:
                used = p.usedGpuMemory // 2**20 if p.usedGpuMemory is not None else None
                apps.append({"pid": p.pid, "name": None, "used_mib": used, "gpu_uuid": uuid})
    finally:
        safe(nv.nvmlShutdown)
    return gpus, apps


def gpus_from_smi() -> tuple[list[dict], list[dict]] | None:
    if not shutil.which("nvidia-smi"):
        return None
    rc, out = _run(["nvidia-smi", f"--query-gpu={','.join(GPU_FIELDS)}", "--format=csv,noheader,nounits"])
    if rc != 0:
        lost = [ln.strip() for ln in out.splitlines() if LOST_GPU.search(ln)]
        return ([{"index": None, "uuid": None, "name": None, "lost": lost[0][:200]}], []) if lost else None
    _, apps = _run(["nvidia-smi", f"--query-compute-apps={','.join(APP_FIELDS)}", "--format=csv,noheader,nounits"])
    return parse_gpu_csv(out), parse_apps_csv(apps)


LOST_GPU = re.compile(r"GPU is lost|fallen off the bus|Unable to determine the device handle", re.I)


def gpu_faults(gpus: list[dict]) -> dict:
    """Index -> what is wrong with that GPU's hardware: lost, uncorrectable ECC errors, pages or rows waiting to be
    retired or remapped (a reset is due). Index None: nvidia-smi could not say which."""
    faults: dict = {}
    for g in gpus:
        why = []
        if g.get("lost"):
            why.append(f"lost ({g['lost']})")
        if isinstance(g.get("ecc_uncorrected"), int) and g["ecc_uncorrected"] > 0:
            why.append(f"{g['ecc_uncorrected']} uncorrectable ECC errors")
        if g.get("retired_pending"):
            why.append("page retirement pending")
        if g.get("remap_pending") or g.get("remap_failed"):
            why.append("row remapping " + ("failed" if g.get("remap_failed") else "pending"))
        if why:
            faults[g.get("index")] = ", ".join(why)
    return faults


def read_gpus(req: dict) -> dict:
    if "gpu_csv" in req:  # gathered on the container's host by the same command, before this ran
        apps = parse_apps_csv(req.get("apps_csv", ""))
        return {"source": "host", "gpus": parse_gpu_csv(req["gpu_csv"]), "apps": apps}
    for source, fn in (("nvml", gpus_from_nvml), ("nvidia-smi", gpus_from_smi)):
        got = fn()
        if got is not None:
            return {"source": source, "gpus": got[0], "apps": got[1]}
    return {"source": "none", "gpus": [], "apps": []}


# ---------------------------------------------------------------------------------------------- processes


def proc_table() -> dict[int, dict]:
    """Every process: ppid, state, start time (clock ticks since boot), CPU seconds, RSS, command line."""
    tick = os.sysconf("SC_CLK_TCK")
    page = os.sysconf("SC_PAGE_SIZE")
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            rest = stat[stat.rindex(")") + 2 :].split()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError):
            continue
        table[int(name)] = {
            "pid": int(name), "ppid": int(rest[1]), "state": rest[0], "start": int(rest[19]),
            "cpu_s": round((int(rest[11]) + int(rest[12])) / tick, 2),
            "rss_mib": round(int(rest[21]) * page / 2**20, 1), "cmd": cmd[:200],
        }  # fmt: skip
    return table


def same_process(p: dict) -> bool:
    """The process named (pid, start) still exists, and it is that process, not a later one with its pid."""
    return start_time(p["pid"]) == p["start"]


def has_job_tag(pid: int, job_id: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"DFLASHCTL_JOB_ID={job_id}".encode() in f.read().split(b"\0")
    except OSError:
        return False


def launcher_of(run_dir: str | None, pane: dict) -> dict | None:
    """The current attempt's launcher (pid, start), only while its pane is alive: a dead pane's pid may have been
    reused by anyone. The launcher records itself in `wrapper.pid`; its start time must match."""
    if not pane.get("exists") or pane.get("pane_dead"):
        return None
    pid = pane.get("pane_pid")
    rec = read_json(os.path.join(run_dir, WRAPPER_PID)) if run_dir else None
    if isinstance(rec, dict) and rec.get("pid") == pid and isinstance(rec.get("start"), int):
        return {"pid": pid, "start": rec["start"], "child": rec.get("child")}
    st = start_time(pid) if isinstance(pid, int) else None  # launcher not yet recorded: the live pane's own pid
    return {"pid": pid, "start": st, "child": None} if st is not None else None


def job_processes(table: dict[int, dict], root: dict | None, job_id: str | None) -> list[dict]:
    """The launcher's descendants plus any process carrying the job's tag. Never selected by name."""
    children: dict[int, list[int]] = {}
    for p in table.values():
        children.setdefault(p["ppid"], []).append(p["pid"])
    found: set[int] = set()
    if root and root["pid"] in table and table[root["pid"]]["start"] == root["start"]:
        stack = [root["pid"]]
        while stack:
            pid = stack.pop()
            if pid not in found:
                found.add(pid)
                stack.extend(children.get(pid, []))
    if job_id:
        me = os.getpid()
        found |= {pid for pid in table if pid != me and pid not in found and has_job_tag(pid, job_id)}
    return [table[p] for p in sorted(found) if table[p]["state"] not in ("Z", "X")]


# ---------------------------------------------------------------------------------------------- files


def tmux_session(session: str | None, lines: int) -> dict:
    if not session:
        return {"exists": False}
    fmt = "#{pane_pid}|#{pane_dead}|#{pane_dead_status}|#{pid}|#{session_created}|#{session_name}"
    rc, out = _run([*TMUX, "display-message", "-p", "-t", f"={session}:", fmt])
    parts = ((out.strip().splitlines() or [""])[0].split("|", 5) + [""] * 6)[:6]  # a field tmux cannot say: empty
    if rc != 0 or parts[5] != session:  # tmux answers for a session that is gone with no session at all
        return {"exists": False}

    def number(text: str) -> int | None:
        return int(text) if text.strip().lstrip("-").isdigit() else None

    info = {
        "exists": True,
        "pane_pid": number(parts[0]),
        "pane_dead": parts[1].strip() == "1",
        "exit_status": number(parts[2]),
        "server_pid": number(parts[3]),
        "created": number(parts[4]),
    }
    if lines > 0:
        _, text = _run([*TMUX, "capture-pane", "-p", "-J", "-t", f"={session}:", "-S", f"-{lines}"])
        info["lines"] = text.rstrip("\n").splitlines()[-lines:]
    return info


def read_new(path: str, offset: int, limit: int) -> dict:
    """Bytes of `path` from `offset` (at most `limit`; the newest part when there is more)."""
    try:
        size = os.path.getsize(path)
    except OSError:
        return {"exists": False, "offset": offset, "size": 0, "text": "", "skipped": 0}
    if size < offset:  # truncated or replaced: start again
        offset = 0
    start = max(offset, size - limit)
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(size - start)
    return {"exists": True, "offset": start + len(data), "size": size, "text": data.decode(errors="replace"),
            "skipped": start - offset}  # fmt: skip


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
    """The last `lines` lines of a file, reading at most `limit` bytes from its end."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            f.seek(max(0, size - limit))
            data = f.read(limit)
    except OSError as e:
        return {"exists": False, "error": e.strerror or str(e), "text": ""}
    chunk = data.splitlines()[-lines:] if lines > 0 else []
    return {"exists": True, "size": size, "truncated": size > limit, "text": b"\n".join(chunk).decode(errors="replace")}


def thin(items: list, max_points: int) -> list:
    """Every k-th item (the last always kept) so that at most about `max_points` remain."""
    if max_points <= 0 or len(items) <= max_points:
        return items
    k = -(-len(items) // max_points)
    return items[::k] + ([items[-1]] if (len(items) - 1) % k else [])


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
    return sorted(os.path.join("checkpoints", n) for n in names  # a link (maybe out of the run dir) is no checkpoint
                  if len(n) == 13 and n.startswith("step-") and n[5:].isdigit()
                  and not os.path.islink(os.path.join(root, n)) and os.path.isdir(os.path.join(root, n)))  # fmt: skip


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
    with open(real, "rb") as f:
        f.seek(int(req["offset"]))
        return f.read(int(req["length"]))


def append_gpu_sample(run_dir: str, gpu: dict, indices: list[int]) -> None:
    """A `command:` job has no trainer to record its GPUs: each poll appends what it read to RUN/gpu.jsonl."""
    wanted = set(indices)
    keep = ("index", "util_pct", "mem_used_mib", "mem_total_mib", "power_w", "temp_c", "sm_mhz", "throttle")
    gpus = [{k: g.get(k) for k in keep} for g in gpu.get("gpus", []) if not wanted or g.get("index") in wanted]
    if not gpus:
        return
    line = {"time": round(time.time(), 3), "source": f"probe:{gpu.get('source')}", "gpus": gpus}
    fd = os.open(os.path.join(run_dir, "gpu.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "a") as f:
        f.write(json.dumps(line, separators=(",", ":")) + "\n")


def snapshot(req: dict) -> dict:
    now = time.time()
    run_dir = req.get("run_dir")
    snap: dict = {"time": now, "run_dir": run_dir, "run_dir_exists": bool(run_dir and os.path.isdir(run_dir))}
    lines = int(req.get("capture_lines", 40))
    scheduled = req.get("scheduler") == "slurm" and bool(run_dir)
    # a Slurm job's "pane" is its submission: alive, ended (with its exit status) or unknown to the scheduler
    snap["session"] = _slurm().session_info(run_dir, lines) if scheduled else tmux_session(req.get("session"), lines)
    table = proc_table()
    root = None if scheduled else launcher_of(run_dir, snap["session"])  # Slurm's nodes: the tag on this machine
    snap["procs"] = job_processes(table, root, req.get("job_id"))
    if run_dir and req.get("append_events") and snap["run_dir_exists"]:
        try:  # a full disk loses the events, never the snapshot
            fd = os.open(os.path.join(run_dir, "events.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW,
                         0o600)  # fmt: skip
            with os.fdopen(fd, "a") as f:
                f.write("".join(json.dumps(e, separators=(",", ":")) + "\n" for e in req["append_events"]))
        except OSError as e:
            snap["events_error"] = e.strerror or str(e)
    if run_dir:
        snap["log"] = read_new(os.path.join(run_dir, "train.log"), int(req.get("log_offset", 0)),
                               int(req.get("max_log_bytes", 65536)))  # fmt: skip
        snap["metrics"] = read_metrics(os.path.join(run_dir, "metrics.jsonl"), int(req.get("metrics_offset", 0)),
                                       int(req.get("max_metrics_bytes", 1 << 20)))  # fmt: skip
        snap["heartbeat"] = read_heartbeat(run_dir, now)
        snap["exit_code"] = read_int(os.path.join(run_dir, "exit_code"))
        if scheduled and snap["exit_code"] is not None and not snap["session"].get("pane_dead"):
            # asked again after the exit was read: a preemption or a time limit sets Slurm's state before the
            # signal that ends the command, so this answer names the cause where the first one was too early
            snap["session"] = _slurm().session_info(run_dir, lines)
        try:  # when it ended, on this clock: over several nodes, which one failed first
            snap["exit_time"] = os.path.getmtime(os.path.join(run_dir, "exit_code"))
        except OSError:
            snap["exit_time"] = None
        snap["restarts"] = read_int(os.path.join(run_dir, RESTARTS)) or 0
        stop = read_json(os.path.join(run_dir, STOP_REQUEST))
        present = os.path.exists(os.path.join(run_dir, STOP_REQUEST))
        snap["stop_request"] = (stop if isinstance(stop, dict) else {"time": None}) if present else None
        result = read_json(os.path.join(run_dir, STOP_RESULT))
        snap["stop_result"] = result if isinstance(result, dict) else None
        try:
            st = os.statvfs(run_dir)
            snap["disk_free_gib"] = round(st.f_bavail * st.f_frsize / 2**30, 2)
        except OSError:
            snap["disk_free_gib"] = None
        snap["checkpoint_gib"] = checkpoint_gib(run_dir) if snap["run_dir_exists"] else None
    if req.get("gpus", True):
        snap["gpu"] = read_gpus(req)
        if req.get("record_gpu") and snap["run_dir_exists"]:
            with contextlib.suppress(OSError):  # a full disk loses a sample, never the snapshot
                append_gpu_sample(run_dir, snap["gpu"], list(req.get("job_gpus") or []))
    if run_dir and snap["run_dir_exists"]:
        snap["supervisor"] = supervision.state(run_dir)
        snap["progress"] = update_progress(run_dir, now, snap, list(req.get("job_gpus") or []),
                                           int(req.get("metrics_offset", 0)))  # fmt: skip
        snap["host_oom"] = host_oom(run_dir, snap)
    if req.get("sessions"):
        snap["sessions"] = list_sessions()
    return snap


def checkpoint_gib(run_dir: str) -> float | None:
    """The size of the newest complete checkpoint: what the next one will need on the disk."""
    found = checkpoint_dirs(run_dir)
    if not found:
        return None
    total = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(os.path.join(run_dir, found[-1])):
            if entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
    return round(total / 2**30, 3)


# ---------------------------------------------------------------------------------------------- progress history

PROGRESS = "progress.json"
CPU_MOVED_S = 0.2  # CPU seconds a poll must see the job use to count as progress
CPU_SAMPLE_S = 0.3  # a first look's CPU sample
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _clamp(t, lo: float, hi: float) -> float:
    """A time a file or a record claims, believed only inside [lo, hi] (a skewed clock, a touched file)."""
    return hi if not isinstance(t, (int, float)) or isinstance(t, bool) or t > hi else max(float(t), lo)


def _cpu_moving(procs: list[dict], launcher, wait_s: float = CPU_SAMPLE_S) -> bool:
    """Whether the job's processes use CPU right now: their CPU time read twice, `wait_s` apart. What one look can
    measure where there is no history to compare with (a first look, a history that cannot be written)."""
    pids = [p["pid"] for p in procs if p["pid"] != launcher]
    if not pids:
        return False

    def total() -> float:
        t = 0.0
        for pid in pids:
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                t += (int(fields[11]) + int(fields[12])) / CLK_TCK
        return t

    before = total()
    time.sleep(wait_s)
    return total() > before + 0.02


def update_progress(run_dir: str, now: float, snap: dict, job_gpus: list[int], metrics_from: int = -1) -> dict:
    """When each sign of progress last changed, on this clock, kept in RUN/progress.json and updated by every probe
    (the supervisor, status, watch, a second watcher, a cron job): the heartbeat's content, the log's size, the job's
    CPU time, its GPUs' activity and the newest step. A change first seen now happened after the previous look and
    no later than now: a claimed time (mtime, a record's `time`, a stamp read back from the file) is believed only
    inside that window, so neither a future stamp nor a first-time reader can make an old sign look fresh. A first
    look measures what one look can (the CPU used over a short sample, mtimes up to now). A history that cannot be
    written is said (`history_error`), and the one-look measures stand. One attempt (launcher pid and start) per
    history."""
    path = os.path.join(run_dir, PROGRESS)
    wrapper = read_json(os.path.join(run_dir, WRAPPER_PID))
    attempt = [wrapper.get("pid"), wrapper.get("start")] if isinstance(wrapper, dict) else None
    try:
        attempt_start = os.path.getmtime(os.path.join(run_dir, WRAPPER_PID))
    except OSError:
        attempt_start = snap["session"].get("created")
    if not isinstance(attempt_start, (int, float)):  # no launcher record, no session: the history's own, else now
        stored = read_json(path)
        stored = stored.get("attempt_start") if isinstance(stored, dict) and stored.get("attempt") == attempt else None
        attempt_start = stored if isinstance(stored, (int, float)) and not isinstance(stored, bool) else now
    attempt_start = min(float(attempt_start), now)
    launcher = wrapper.get("pid") if isinstance(wrapper, dict) else None
    hb = snap.get("heartbeat")
    gpus = [g for g in (snap.get("gpu") or {}).get("gpus", []) if not job_gpus or g.get("index") in job_gpus]
    utils = [g.get("util_pct") for g in gpus if isinstance(g.get("util_pct"), (int, float))]
    mem = [g.get("mem_used_mib") for g in gpus]
    try:
        log_mtime = os.path.getmtime(os.path.join(run_dir, "train.log"))
    except OSError:
        log_mtime = None
    error = None
    lock = contextlib.nullcontext()
    try:
        lock = locked(path + ".lock", timeout=5.0)
        lock.__enter__()
    except (OSError, TimeoutError) as e:
        error, lock = f"{type(e).__name__}: {getattr(e, 'strerror', None) or e}", contextlib.nullcontext()
    try:
        prev = read_json(path)
        prev = _believable(prev, attempt, attempt_start, now) if isinstance(prev, dict) else {}
        seen = prev.get("seen_at")
        lo = float(seen) if isinstance(seen, (int, float)) else attempt_start
        cur = dict(prev, attempt=attempt, attempt_start=attempt_start, seen_at=now)

        def note(key: str, value, claimed, moved=None) -> None:
            old = prev.get(key)
            changed = moved(old["value"]) if moved and isinstance(old, dict) else (
                not isinstance(old, dict) or old.get("value") != value)
            if changed:
                since = attempt_start if old is None else lo
                cur[key] = {"value": value, "changed_at": _clamp(claimed, since, now)}

        if isinstance(hb, dict):
            claim = hb.get("mtime") if not hb.get("future") else hb.get("time")
            note("heartbeat", [hb.get("mtime"), hb.get("time"), hb.get("step"), hb.get("phase")], claim)
        size = int((snap.get("log") or {}).get("size") or 0)
        if size or "log_size" in prev:
            note("log_size", size, log_mtime)
        cpu = round(sum(p.get("cpu_s") or 0 for p in snap.get("procs", []) if p["pid"] != launcher), 2)
        note("cpu_s", cpu, now, moved=lambda old: cpu > old + CPU_MOVED_S or cpu < old)
        if not isinstance(prev.get("cpu_s"), dict):  # a first look: CPU used so far proves no time; a sample does
            moving = _cpu_moving(snap.get("procs", []), launcher) if cpu > CPU_MOVED_S else False
            cur["cpu_s"] = {"value": cpu, "changed_at": now if moving else attempt_start}
        if snap.get("gpu") is not None:  # `status` reads no GPUs: the history keeps what others saw
            old_mem = (prev.get("gpu") or {}).get("value")
            busy = any(5 < u < 99 for u in utils) or bool(utils and max(utils) >= 99 and old_mem not in (None, mem))
            cur["gpu"] = {"value": mem, "changed_at": now if busy else (prev.get("gpu") or {}).get("changed_at")}
        step_of(run_dir, prev, cur, snap.get("metrics") if metrics_from == prev.get("metrics_offset", 0) else None,
                attempt_start)  # fmt: skip
        if cur.get("step_value") != prev.get("step_value"):
            cur["step"] = {"value": cur.get("step_value"), "changed_at": _clamp(cur.get("step_time"),
                           attempt_start if "step" not in prev else lo, now)}  # fmt: skip
        if error is None:
            try:
                write_atomic(path, json.dumps(cur, separators=(",", ":")).encode())
            except OSError as e:
                error = f"{type(e).__name__}: {e.strerror or e}"
    finally:
        lock.__exit__(None, None, None)
    signs = {name: (cur.get(key) or {}).get("changed_at")
             for name, key in (("log grew", "log_size"), ("CPU time", "cpu_s"), ("GPU busy", "gpu"))}
    known = {k: v for k, v in signs.items() if isinstance(v, (int, float))}
    last = max(known, key=known.get) if known else None
    return {
        "attempt_start": cur.get("attempt_start"),
        "heartbeat_changed_at": (cur.get("heartbeat") or {}).get("changed_at"),
        "activity_at": known[last] if last else cur.get("attempt_start"),
        "activity": last or "",
        "step": (cur.get("step") or {}).get("value"),
        "step_changed_at": (cur.get("step") or {}).get("changed_at"),
        "nonfinite_steps": cur.get("nonfinite_steps", 0),
        **({"history_error": error} if error else {}),
    }


def _believable(prev: dict, attempt, attempt_start: float, now: float) -> dict:
    """The stored history of this attempt, with every stamp it cannot prove taken back to the attempt's start: a
    stamp after now (a skewed or forged file) or before the attempt proves nothing about when a sign moved."""
    if prev.get("attempt") != attempt:
        return {}
    out = dict(prev)
    seen = prev.get("seen_at")
    if not isinstance(seen, (int, float)) or isinstance(seen, bool) or not attempt_start - 1 <= seen <= now + 1:
        out.pop("seen_at", None)
    for key in ("heartbeat", "log_size", "cpu_s", "gpu", "step"):
        entry = prev.get(key)
        if not isinstance(entry, dict):
            out.pop(key, None)
            continue
        t = entry.get("changed_at")
        number = isinstance(t, (int, float)) and not isinstance(t, bool)
        if t is not None and not (number and attempt_start - 1 <= t <= now + 1):
            out[key] = {**entry, "changed_at": attempt_start}
    return out


def step_of(run_dir: str, prev: dict, cur: dict, read: dict | None = None, attempt_start: float = 0.0) -> None:
    """The newest step record of metrics.jsonl, read on from where the history last stopped; `read` is this probe's
    own read of the file when it started at that same offset (a long watch: the file is not read twice a poll). A
    record from before the attempt started is an earlier attempt's: a restarted job has not stepped until its own."""
    got = read or read_metrics(os.path.join(run_dir, "metrics.jsonl"), int(prev.get("metrics_offset") or 0), 1 << 20)
    cur["metrics_offset"] = got["offset"]
    for rec in got["records"]:
        step = rec.get("step")
        t = rec.get("time")
        if isinstance(t, (int, float)) and t < attempt_start - 1:
            continue
        if "event" not in rec and type(step) is int:
            cur["step_value"], cur["step_time"] = step, rec.get("time")
            n = rec.get("nonfinite_steps")
            cur["nonfinite_steps"] = n if type(n) is int else 0


# ---------------------------------------------------------------------------------------------- host memory


def oom_kill_count(path) -> int | None:
    """`oom_kill` of the file the launcher named (cgroup v2 memory.events or v1 memory.oom_control), or None."""
    if not isinstance(path, str) or not path.startswith("/sys/fs/cgroup/"):
        return None
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        return None
    return None


KERNEL_OOM_LINE = re.compile(r"^\[\s*(\d+\.\d+)\]\s*(.*(?:Out of memory: Killed process|oom-kill:|Memory cgroup out of "
                             r"memory).*)$")  # fmt: skip
KERNEL_XID_LINE = re.compile(r"^\[\s*(\d+\.\d+)\]\s*(.*NVRM: Xid .*)$")  # the GPU driver's error reports


def host_oom(run_dir: str, snap: dict) -> dict:
    """After the job ended: the OOM kills its cgroup counted since the attempt started (the launcher recorded the
    count then), and the kernel log's OOM-killer and GPU driver (Xid) lines since then, where this host lets us read
    them."""
    if snap.get("exit_code") in (None, 0):
        return {}
    wrapper = read_json(os.path.join(run_dir, WRAPPER_PID))
    out: dict = {}
    if isinstance(wrapper, dict) and isinstance(wrapper.get("oom_kill"), int):
        now_count = oom_kill_count(wrapper.get("oom_file"))
        if now_count is not None:
            out["oom_kills"] = now_count - wrapper["oom_kill"]
    start = (snap.get("progress") or {}).get("attempt_start") or 0
    rc, text = _run(["dmesg"], timeout=3)
    if rc == 0:
        try:
            with open("/proc/uptime") as f:
                boot = time.time() - float(f.read().split()[0])
        except (OSError, ValueError):
            boot = None
        recent = text.splitlines()[-2000:]
        for key, pattern in (("kernel_oom", KERNEL_OOM_LINE), ("kernel_xid", KERNEL_XID_LINE)):
            lines = [m[2] for ln in recent if (m := pattern.match(ln))
                     and boot is not None and boot + float(m[1]) >= start - 1]  # fmt: skip
            out[key] = lines[-5:]
    return out


def list_sessions() -> list[dict]:
    rc, out = _run([*TMUX, "list-sessions", "-F", "#{session_name} #{pane_dead}"])
    if rc != 0:
        return []
    return [{"name": ln.split()[0], "dead": ln.split()[-1] == "1"} for ln in out.splitlines() if ln.strip()]


# ---------------------------------------------------------------------------------------------- stopping


class Signaller:
    """Signals processes named by (pid, start): through a pidfd where the kernel has them (a pidfd cannot reach a
    later process that reuses the pid), else after checking the start time again."""

    def __init__(self) -> None:
        self.fds: dict[int, int] = {}

    def adopt(self, p: dict) -> bool:
        if p["pid"] in self.fds:
            return True
        opener = getattr(os, "pidfd_open", None)
        if opener is not None:
            try:
                fd = opener(p["pid"])
            except OSError:
                return False
            if start_time(p["pid"]) != p["start"]:  # the pid was reused before we held it
                os.close(fd)
                return False
            self.fds[p["pid"]] = fd
            return True
        return same_process(p)

    def send(self, p: dict, sig: int) -> bool:
        try:
            fd = self.fds.get(p["pid"])
            if fd is not None and hasattr(signal, "pidfd_send_signal"):
                signal.pidfd_send_signal(fd, sig)
            elif same_process(p):
                os.kill(p["pid"], sig)
            else:
                return False
            return True
        except (ProcessLookupError, OSError):
            return False

    def close(self) -> None:
        for fd in self.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()


def stop_processes(run_dir: str | None, session: str | None, job_id: str | None, grace_s: float) -> dict:
    """SIGTERM every process of the job but its wrapper (so that the wrapper records the exit status), wait up to
    `grace_s`, SIGKILL what is left, then keep looking for processes of the job (a dying parent may spawn more) and
    SIGKILL them until none is left or VERIFY_S have passed. Closes the tmux session."""
    pane = tmux_session(session, 0)
    root = launcher_of(run_dir, pane)
    procs = job_processes(proc_table(), root, job_id)
    wrapper = {root["pid"], root.get("child")} if root else set()
    sig = Signaller()
    ident = lambda p: {"pid": p["pid"], "start": p["start"]}  # noqa: E731
    targets = [ident(p) for p in procs if p["pid"] not in wrapper and sig.adopt(ident(p))]
    report: dict = {"found": [{k: p[k] for k in ("pid", "ppid", "start", "cmd")} for p in procs], "term": [],
                    "kill": []}  # fmt: skip
    for p in targets:
        if sig.send(p, signal.SIGTERM):
            report["term"].append(p["pid"])
        sig.send(p, signal.SIGCONT)  # a stopped process (SIGSTOP, a debugger) would hold SIGTERM pending forever
    deadline = time.monotonic() + grace_s
    while any(same_process(p) for p in targets) and time.monotonic() < deadline:
        time.sleep(0.1)
    for p in targets:
        if same_process(p) and sig.send(p, signal.SIGKILL):
            report["kill"].append(p["pid"])
    end = time.monotonic() + 3  # the wrapper writes exit_code once its command is gone, then exits
    while root and same_process(root) and time.monotonic() < end:
        time.sleep(0.05)
    if session:
        _run([*TMUX, "kill-session", "-t", f"={session}"])
    left: list[dict] = []
    quiet = 0  # nothing left is believed after two looks 0.3 s apart: a dying parent may still be forking
    end = time.monotonic() + VERIFY_S
    while time.monotonic() < end:
        known = {p["pid"] for p in targets}
        again = job_processes(proc_table(), root, job_id)
        left = [ident(p) for p in again] + [p for p in targets if same_process(p) and p["pid"] not in
                                             {q["pid"] for q in again}]  # fmt: skip
        quiet = 0 if left else quiet + 1
        if quiet >= 2:
            break
        if not left:
            time.sleep(0.3)
            continue
        for p in left:
            if sig.adopt(p) and sig.send(p, signal.SIGKILL) and p["pid"] not in known:
                report["kill"].append(p["pid"])
                targets.append(p)
        time.sleep(0.2)
    sig.close()
    if quiet < 2:  # gave up: what is there now, looked at afresh (those just SIGKILLed may be gone)
        time.sleep(0.2)
        left = [ident(p) for p in job_processes(proc_table(), root, job_id)] + [p for p in targets if same_process(p)]
    report["remaining"] = sorted({p["pid"] for p in left if same_process(p)})
    report["every"] = sorted({p["pid"] for p in targets} | wrapper - {None})
    report["session_closed"] = not tmux_session(session, 0).get("exists") if session else True
    return report


def reap(req: dict) -> dict:
    """`dflashctl kill`: the stop request first (under the run dir's lock, so that no restart starts after it),
    then stop, verify, and record the result where every watcher sees it."""
    run_dir = req.get("run_dir")
    has_dir = bool(run_dir and os.path.isdir(run_dir))
    # the job had ended by itself (no earlier kill asked for it): its own verdict stands
    asked = has_dir and os.path.exists(os.path.join(run_dir, STOP_REQUEST))
    ended_before = read_int(os.path.join(run_dir, "exit_code")) if has_dir and not asked else None
    if has_dir:
        with locked(os.path.join(run_dir, ".restart.lock")):
            if not os.path.exists(os.path.join(run_dir, STOP_REQUEST)):
                body = {"time": time.time(), "by": req.get("by", "dflashctl kill")}
                write_atomic(os.path.join(run_dir, STOP_REQUEST), json.dumps(body).encode())
        end_supervisor(run_dir)
    grace = float(req.get("grace_s", 40))
    if req.get("scheduler") == "slurm" and has_dir:  # scancel, seen to end; then what is left on this machine
        slurm = _slurm()
        job = slurm.current_job(run_dir)
        q = slurm.cancel(job, grace + 30, run_dir) if job else {"known": False}
        report = stop_processes(run_dir, None, req.get("job_id"), grace)
        report["slurm"] = {"id": job, "state": q.get("state") or ("gone" if q.get("known") is False else "no answer"),
                           "source": q.get("source") or q.get("cancel_error") or q.get("why")}  # fmt: skip
        report["session_closed"] = q.get("known") is False or bool(q.get("final"))
    else:
        report = stop_processes(run_dir, req.get("session"), req.get("job_id"), grace)
    if req.get("gpus", True):
        gpu = read_gpus(req)  # read now, after the kill (a host-side reading is made by a second call)
        report["gpu_check"] = f"{gpu['source']} after the kill" if gpu["source"] != "none" else "none: no GPU tools"
        report["gpu_holders"] = [a for a in gpu["apps"] if a["pid"] in set(report["every"])]
    else:
        report["gpu_check"], report["gpu_holders"] = "host: made by the caller", []
    clean = not report["remaining"] and not report["gpu_holders"] and report["session_closed"]
    report["result"] = "KILLED" if clean else "KILL_FAILED"
    report["ended_before"] = ended_before  # the job had already ended: its own verdict stands
    if has_dir:
        record_stop_result(run_dir, report)
        if clean:  # stopped for good: its secrets are not kept at rest
            with contextlib.suppress(OSError):
                report["scrubbed"] = scrub_secrets(run_dir)
    return report


def end_supervisor(run_dir: str) -> None:
    """The job is being stopped: its supervisor (pid and start time as it recorded them) has nothing left to do."""
    me = read_json(os.path.join(run_dir, supervision.STATE))
    ours = isinstance(me, dict) and isinstance(me.get("pid"), int) and me.get("start") is not None
    if ours and start_time(me["pid"]) == me["start"]:
        with contextlib.suppress(OSError):
            os.kill(me["pid"], signal.SIGTERM)


def record_stop_result(run_dir: str, report: dict) -> None:
    body = {k: report.get(k) for k in ("result", "remaining", "gpu_holders", "gpu_check", "session_closed", "slurm")}
    write_atomic(os.path.join(run_dir, STOP_RESULT), json.dumps({"time": time.time(), **body}).encode())


def gpu_holders(req: dict) -> dict:
    """On the machine that owns the GPUs: each compute process with its pid in every namespace (NSpid, outermost
    first), so that a container's pids can be matched with the host's."""
    gpu = read_gpus(req)
    for app in gpu["apps"]:
        app["nspid"] = None
        try:
            with open(f"/proc/{app['pid']}/status") as f:
                for line in f:
                    if line.startswith("NSpid:"):
                        app["nspid"] = [int(x) for x in line.split()[1:]]
        except (OSError, ValueError):
            app["gone"] = True
    return gpu


# ---------------------------------------------------------------------------------------------- starting


def start_session(run_dir: str, session: str, python: str, args: list[str]) -> int:
    """Start the job's tmux session: the pane runs the launcher (a child subreaper) which runs run.sh."""
    import shlex

    agent = os.path.join(run_dir, AGENT_FILE)
    keeper = [agent, "launch"] if os.path.isfile(agent) else [os.path.join(run_dir, "launcher.py")]  # older run dirs
    cmd = "exec " + shlex.join([python, *keeper, run_dir, *args])
    rc, _ = _run([*TMUX, "-f", os.path.join(run_dir, "tmux.conf"), "new-session", "-d", "-s", session, "-x", "200",
                  "-y", "50", cmd, ";", "set-option", "-w", "-t", f"={session}:", "remain-on-exit", "on"])  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"tmux could not start session {session}")
    info = tmux_session(session, 0)
    return int(info.get("pane_pid") or 0)


def our_live_jobs(workdir: str) -> list[dict]:
    """Jobs of ours whose tmux session is alive on this socket (from their run dirs' job.json), after closing the
    sessions of our jobs that have ended (dead pane, exit_code written): their state is in the run dir, and a dead
    pane only kept a pid that may belong to someone else by now. One look at the sessions and the run dirs."""
    sessions = {s["name"]: s["dead"] for s in list_sessions()}
    jobs = []
    runs = os.path.join(workdir, "runs")
    for name in os.listdir(runs) if sessions and os.path.isdir(runs) else []:
        run = os.path.join(runs, name)
        meta = read_json(os.path.join(run, "job.json"))
        session = meta.get("session") if isinstance(meta, dict) else None
        if session not in sessions:
            continue
        if sessions[session]:
            if os.path.exists(os.path.join(run, "exit_code")):
                _run([*TMUX, "kill-session", "-t", f"={session}"])
        elif not os.path.exists(os.path.join(run, STOP_RESULT)):
            jobs.append({**meta, "run_dir": run})
    return jobs


MIN_FREE_GIB = 1.0  # a launch needs room for logs and a first checkpoint; doctor warns well before this


TORCH_CHECK = "import torch; print(torch.__version__, int(torch.cuda.is_available()), torch.cuda.device_count())"
# where torch would come from, without importing it (50 ms against seconds): the key of a cached TORCH_CHECK
TORCH_WHERE = ("import importlib.util as u, os, sys; s = u.find_spec('torch'); "
               "print(os.path.realpath(sys.executable), sys.version.split()[0], s.origin if s else '', sep='\\n')")
TORCH_CACHE = "torch-check.json"  # beside the agent's copies (~/.cache/dflashctl, 0700), 0600


def _torch_key(python: str) -> str | None:
    """What a successful `import torch` depends on here: the interpreter (real path and version), torch's own files
    (version.py's inode, size and mtime: any reinstall replaces it), the boot, and the NVIDIA driver loaded. None
    when torch is not found (nothing is cached then)."""
    rc, out = _run([python, "-c", TORCH_WHERE], timeout=60)
    lines = out.splitlines()
    if rc != 0 or len(lines) != 3 or not lines[2]:
        return None
    try:
        st = os.stat(os.path.join(os.path.dirname(lines[2]), "version.py"))
    except OSError:
        return None
    parts = [lines[0], lines[1], lines[2], f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"]
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/driver/nvidia/version"):
        try:
            with open(path, "rb") as f:
                parts.append(hashlib.sha256(f.read(4096)).hexdigest()[:16])
        except OSError:
            parts.append("-")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def torch_check(python: str) -> tuple[int, str]:
    """(exit status, "VERSION CUDA_AVAILABLE DEVICES") of importing torch with the job's Python. A launch asks at
    every start, and the import takes seconds (more on a loaded login node): a success is kept under `_torch_key`,
    so the next launch with the same interpreter, torch install, boot and driver reuses it. A failure is never kept
    (the user may fix it); a cache that is garbage, or another user's, is ignored."""
    key = _torch_key(python)
    cache = os.path.join(os.path.dirname(os.path.abspath(sys.argv[0] or ".")), TORCH_CACHE)
    try:  # ours alone: a file of another user, or one others may write, is not believed
        st = os.stat(cache)
        mine = st.st_uid == os.getuid() and not st.st_mode & 0o022
    except OSError:
        mine = False
    known = read_json(cache, limit=1 << 16) if key and mine else None
    known = known if isinstance(known, dict) else {}
    if key and isinstance(known.get(key), str) and len(known[key].split()) == 3:
        return 0, known[key]
    rc, out = _run([python, "-c", TORCH_CHECK], timeout=180)
    if rc == 0 and key and len(out.split()) == 3:
        kept = {k: v for k, v in list(known.items())[-7:] if isinstance(v, str)}  # a few interpreters, not more
        kept[key] = out.strip()
        with contextlib.suppress(OSError):  # a read-only or full home: checked again next time, nothing lost
            write_atomic(cache, json.dumps(kept).encode())
    return rc, out


def preconditions(req: dict, wd: str) -> list[tuple[str, str]]:
    """What the job needs from this host, checked before anything is created: (job file key, problem). A Slurm login
    node needs the scheduler's commands instead of tmux; its Python is not the compute nodes' to judge (`doctor`
    asks a compute node)."""
    problems = []
    scheduled = req.get("scheduler") == "slurm"
    if scheduled:
        problems += [("host.slurm", f"{t} is not on the login node's PATH") for t in _slurm().missing_tools()]
    elif not shutil.which("tmux"):
        problems.append(("host", "tmux is not installed on this host"))
    needs = req.get("needs") or {}
    if needs.get("torch") and not scheduled:
        rc, out = torch_check(req["python"])
        if rc != 0:
            problems.append(("host.python", f"{req['python']} cannot import torch (the trainer needs it)"))
        elif needs.get("cuda") and out.split()[1:2] != ["1"]:
            problems.append(("gpus", f"torch {out.split()[0]} on this host has no CUDA (asked for GPUs)"))
    try:
        st = os.statvfs(wd)
        free = st.f_bavail * st.f_frsize / 2**30
        if free < MIN_FREE_GIB:
            problems.append(("host.workdir", f"only {free:.2f} GiB free in {wd} (at least {MIN_FREE_GIB:g} needed)"))
    except OSError:
        pass
    return problems


def make_run_dir(wd: str, job_id: str, files: dict) -> str | None:
    """The run dir (0700) with the launch's files (0600), this very agent (a tmux pane's launcher runs it) and the
    job's inductor cache; None when it exists already (never reused)."""
    run = os.path.join(wd, "runs", job_id)
    try:
        os.mkdir(run, 0o700)
    except FileExistsError:
        return None
    for name, text in files.items():
        write_atomic(os.path.join(run, name), text.encode("utf-8", "surrogateescape"))
    from .pack import own_archive  # zipfile and pathlib: only a launch copies the agent

    write_atomic(os.path.join(run, AGENT_FILE), own_archive())
    os.mkdir(os.path.join(run, "inductor-cache"), 0o700)
    return run


def launch_slurm(req: dict, payload: bytes) -> dict:
    """A Slurm host: the run dir written as for tmux, then one `sbatch` of its batch script. The scheduler owns the
    GPUs, so there is no GPU check here; sbatch's own refusal (a bad partition, account or time) refuses the launch
    and leaves no run dir. A dry run asks `sbatch --test-only` with the same script."""
    slurm = _slurm()
    wd = req["workdir"]
    missing = preconditions(req, wd if os.path.isdir(wd) else os.path.dirname(wd) or "/")
    if missing:
        return {"refused": [m for _, m in missing], "key": missing[0][0], "config": True}
    files = json.loads(payload or b"{}")
    release = os.path.join(wd, "releases", req["release"])
    if not req.get("skip_release") and not os.path.isfile(os.path.join(release, ".dflashctl-manifest.json")):
        return {"refused": [f"release {req['release']} is not deployed in {wd} (run dflashctl deploy)"]}
    if req.get("check_only"):
        if slurm.SCRIPT in files:
            err = slurm.test_only(files[slurm.SCRIPT], wd if os.path.isdir(wd) else "/")
            if err:
                return {"refused": [f"sbatch --test-only: {err}"], "key": "host.slurm", "config": True}
        return {"ok": True, "overrides": []}
    os.makedirs(os.path.join(wd, "runs"), mode=0o700, exist_ok=True)
    run = make_run_dir(wd, req["job_id"], files)
    if run is None:
        return {"refused": [f"run dir {os.path.join(wd, 'runs', req['job_id'])} already exists"]}
    job, err = slurm.submit(run, [])
    if job is None:
        shutil.rmtree(run, ignore_errors=True)  # made by this call a moment ago: nothing of the job ran
        return {"refused": [f"sbatch refused the job: {err}"], "key": "host.slurm", "config": True}
    from .supervision import spawn

    spawn(run)  # on the login node, where it can resubmit the job after Slurm ended it
    return {"run_dir": run, "pane_pid": None, "slurm_job": job, "overrides": []}


def launch(req: dict, payload: bytes) -> dict:
    """Check and start under one host-wide lock, so that two launches at the same moment cannot both take a GPU."""
    if req.get("scheduler") == "slurm":
        return launch_slurm(req, payload)
    wd = req["workdir"]
    check_only = bool(req.get("check_only"))  # a dry run or a pre-deploy check: every check, nothing written
    if not check_only:
        os.makedirs(os.path.join(wd, "runs"), mode=0o700, exist_ok=True)
        os.chmod(os.path.join(wd, "runs"), 0o700)
    files = json.loads(payload or b"{}")
    missing = preconditions(req, wd if os.path.isdir(wd) else os.path.dirname(wd) or "/")  # outside the lock: slow
    if missing:
        return {"refused": [m for _, m in missing], "key": missing[0][0], "config": True}
    lock = contextlib.nullcontext() if check_only else locked(os.path.join(wd, ".launch.lock"))
    with lock:
        release = os.path.join(wd, "releases", req["release"])
        if not req.get("skip_release") and not os.path.isfile(os.path.join(release, ".dflashctl-manifest.json")):
            return {"refused": [f"release {req['release']} is not deployed in {wd} (run dflashctl deploy)"]}
        refused, overrides = [], []
        live = our_live_jobs(wd)
        wanted = set(req.get("gpus") or [])
        for other in live:
            if other.get("name") == req["name"]:
                (overrides if req.get("force") else refused).append(f"job {other.get('id')} of the same name is alive")
            shared = wanted & set(other.get("gpus") or [])
            if shared:
                what = f"GPU {','.join(map(str, sorted(shared)))} held by job {other.get('id')}"
                (overrides if req.get("force") else refused).append(what)
        if wanted:
            gpu = read_gpus(req)
            index = {g["uuid"]: g["index"] for g in gpu["gpus"]}
            if not gpu["gpus"]:
                return {"refused": [f"GPUs {sorted(wanted)} asked for, but this host shows none (NVML, nvidia-smi)"],
                        "key": "gpus", "config": True}  # fmt: skip
            if gpu["gpus"]:
                bad = sorted(i for i in wanted if i >= len(gpu["gpus"]))
                if bad:
                    return {"refused": [f"index {bad[0]} out of range: this host has {len(gpu['gpus'])} GPUs"],
                            "key": "gpus", "config": True}  # fmt: skip
            for i, why in sorted(gpu_faults(gpu["gpus"]).items(), key=lambda kv: str(kv[0])):
                if i is None or i in wanted:
                    what = f"GPU {i if i is not None else '?'} is faulty: {why}"
                    (overrides if req.get("force") else refused).append(what)
            table = proc_table()
            ours: set[int] = set()
            for other in live:
                root = read_json(os.path.join(other["run_dir"], WRAPPER_PID))
                if isinstance(root, dict) and isinstance(root.get("pid"), int):
                    ours |= {p["pid"] for p in job_processes(table, root, other.get("id"))}
            for app in gpu["apps"]:
                if index.get(app["gpu_uuid"]) in wanted and app["pid"] not in ours:
                    what = (f"GPU {index[app['gpu_uuid']]} has unknown process pid {app['pid']} using "
                            f"{app['used_mib']} MiB")  # fmt: skip
                    (overrides if req.get("force") else refused).append(what)
        if refused:
            return {"refused": refused}
        if req.get("check_only"):  # a multi-node launch asks every node before starting any
            return {"ok": True, "overrides": overrides}
        run = make_run_dir(wd, req["job_id"], files)
        if run is None:
            return {"refused": [f"run dir {os.path.join(wd, 'runs', req['job_id'])} already exists"]}
        pane_pid = start_session(run, req["session"], req["python"], [])
    return {"run_dir": run, "pane_pid": pane_pid, "overrides": overrides}


def _restart_refused(req: dict, run: str, count: int) -> dict | None:
    """The rules every restart keeps, read under the run dir's lock (`count`: its restarts so far): no restart after
    a stop request, one per failed attempt however many watchers saw it, none beyond `max_restarts`, none into a
    disk that is still full."""
    if os.path.exists(os.path.join(run, STOP_REQUEST)):
        return {"restarted": False, "why": "a stop was requested (dflashctl kill)"}
    if count != int(req["attempt"]):
        return {"restarted": False, "why": f"already restarted by another watcher (restart {count})",
                "restarts": count}  # fmt: skip
    if count >= int(req["max_restarts"]):
        return {"restarted": False, "why": f"max_restarts ({req['max_restarts']}) reached", "restarts": count}
    need = req.get("min_free_gib")
    if isinstance(need, (int, float)):
        st = os.statvfs(run)
        free = st.f_bavail * st.f_frsize / 2**30
        if free < need:
            return {"restarted": False, "restarts": count, "why": f"the disk is still full: {free:.2f} GiB free at "
                    f"the run dir, a checkpoint needs {need:.2f} GiB"}  # fmt: skip
    return None


def verify_agent_copy(run: str, agent: bytes | None = None) -> bool:
    """The run dir's `agent.pyz` (which the tmux pane runs as the job's launcher) is the agent doing this restart,
    byte for byte; a copy that differs (edited after launch, or from another dflashctl) is replaced first. True when
    it was replaced."""
    from .pack import own_archive

    want = agent if agent is not None else own_archive()
    path = os.path.join(run, AGENT_FILE)
    try:
        with open(path, "rb") as f:
            if f.read(len(want) + 1) == want:
                return False
    except OSError:
        pass
    write_atomic(path, want)
    return True


def restart(req: dict, agent: bytes | None = None) -> dict:
    """One restart of a job, decided and done under the run dir's lock (which `reap` also takes): never after a stop
    request, at most once per failed attempt however many watchers saw it, never beyond `max_restarts`. A Slurm
    job is resubmitted: the old submission cancelled and seen to end first, a failed node excluded from then on."""
    run = req["run_dir"]
    if not os.path.isdir(run):
        return {"restarted": False, "why": "the run dir is gone"}
    scheduled = req.get("scheduler") == "slurm"
    slurm = _slurm() if scheduled else None
    if not any(os.path.isfile(os.path.join(run, f)) for f in (AGENT_FILE, "launcher.py")):
        return {"restarted": False, "why": "launched by an older dflashctl (no launcher in its run dir): relaunch it"}
    grace = float(req.get("grace_s", 40))
    with locked(os.path.join(run, ".restart.lock"), timeout=grace + 60):
        count = read_int(os.path.join(run, RESTARTS)) or 0
        refused = _restart_refused(req, run, count)
        if refused:
            return refused
        if scheduled:
            old = slurm.current_job(run)
            q = slurm.cancel(old, grace + 30, run) if old else {}
            if q.get("known") is not False and not q.get("final"):
                state = q.get("state") or f"unknown ({q.get('why')})"
                return {"restarted": False, "restarts": count,
                        "why": f"slurm job {old} is still {state} after scancel"}  # fmt: skip
            slurm.exclude_failed_nodes(run, q)
        stopped = stop_processes(run, None if scheduled else req["session"], req["job_id"], grace)
        if stopped["remaining"]:
            return {"restarted": False, "why": f"the old attempt survived SIGKILL: pids {stopped['remaining']}",
                    "restarts": count}  # fmt: skip
        for stale in ("exit_code", WRAPPER_PID):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(run, stale))
        if scheduled:
            job, err = slurm.submit(run, list(req.get("args", [])))
            if job is None:
                return {"restarted": False, "why": f"sbatch refused the resubmission: {err}", "restarts": count}
            write_atomic(os.path.join(run, RESTARTS), f"{count + 1}\n".encode())
            from .supervision import spawn

            spawn(run)  # a supervisor that died meanwhile comes back with the resubmission (one per run dir)
            return {"restarted": True, "restarts": count + 1, "pane_pid": None, "slurm_job": job, "stopped": stopped}
        write_atomic(os.path.join(run, RESTARTS), f"{count + 1}\n".encode())
        replaced = verify_agent_copy(run, agent)  # the pane runs it next: never a copy this agent did not check
        pane_pid = start_session(run, req["session"], req["python"], list(req.get("args", [])))
    return {"restarted": True, "restarts": count + 1, "pane_pid": pane_pid, "stopped": stopped,
            "agent_replaced": replaced}  # fmt: skip


def main() -> int:
    req = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    if not isinstance(req, dict):
        req = {}
    if req.get("tmux_socket"):
        TMUX[2] = req["tmux_socket"]
    if len(sys.argv) > 3:  # GPU readings taken on the container's host by the same command
        req["gpu_csv"], req["apps_csv"] = sys.argv[2], sys.argv[3]
    action = req.get("action", "snapshot")
    payload = sys.stdin.buffer.read() if action == "launch" else b""
    if action == "reap":
        answer = reap(req)
    elif action == "launch":
        answer = launch(req, payload)
    elif action == "restart":
        answer = restart(req)
    elif action == "gpu_holders":
        answer = gpu_holders(req)
    elif action == "stop_result":
        record_stop_result(req["run_dir"], req["report"])
        answer = {"ok": True}
    elif action == "files":
        answer = pull_files(req)
    elif action == "chunk":  # raw bytes, not JSON: the only action that answers so
        sys.stdout.buffer.write(read_chunk(req))
        return 0
    elif action == "history":
        answer = history(req)
    elif action == "tail":
        answer = tail_lines(req["path"], int(req.get("lines", 50)), int(req.get("limit", 1 << 20)))
    else:
        answer = snapshot(req)
    sys.stdout.write(json.dumps(answer, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
