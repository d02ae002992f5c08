"""Runs ON the remote, in its own Python, stdlib only (pynvml if importable): one call, one JSON answer about a job.

Invoked as `python3 - REQUEST_JSON [GPU_CSV APPS_CSV]` with this file on stdin (the CSVs when the GPUs are read on a
container's host by the same command). Two actions share the process-tree code: `snapshot` (the default) and `reap`
(stop the job: SIGTERM its processes, wait, SIGKILL what is left, verify, close the tmux session).

For a snapshot, the request The request names the run dir, the tmux session, the
job id (the wrapper exports DFLASHCTL_JOB_ID to every process of the job) and the byte offsets already read. The
snapshot holds: the pane (alive or dead, exit status, last lines), the job's process tree, new train.log bytes
(bounded), new metrics.jsonl records, heartbeat age, exit_code, GPU readings and compute processes, free disk, the
deployed code version, and our tmux sessions. Nothing here imports the rest of dflashctl: the remote has none of it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

TMUX = ["tmux", "-L", "dflashctl"]  # the dedicated server; a request's `tmux_socket` names another
GPU_FIELDS = [
    "index", "uuid", "name", "memory.used", "memory.total", "utilization.gpu", "power.draw", "temperature.gpu",
    "clocks.sm", "pstate", "clocks_event_reasons.active", "ecc.errors.uncorrected.volatile.total",
]  # fmt: skip
GPU_KEYS = ["index", "uuid", "name", "mem_used_mib", "mem_total_mib", "util_pct", "power_w", "temp_c", "sm_mhz",
            "pstate", "throttle", "ecc_uncorrected"]  # fmt: skip
TEXT_KEYS = ("uuid", "name", "pstate", "throttle")
APP_FIELDS = ["pid", "process_name", "used_memory", "gpu_uuid"]


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
        row = dict(zip(GPU_KEYS, values, strict=True))
        gpu = {k: (row[k] if k in TEXT_KEYS else _num(row[k])) for k in GPU_KEYS}
        gpus.append(gpu)
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
    gpus, apps = [], []
    try:
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            uuid = nv.nvmlDeviceGetUUID(h)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            name = nv.nvmlDeviceGetName(h)
            mem = nv.nvmlDeviceGetMemoryInfo(h)

            def safe(fn, *a):
                try:
                    return fn(*a)
                except Exception:
                    return None

            power = safe(nv.nvmlDeviceGetPowerUsage, h)
            ecc = safe(nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)
            reasons = safe(nv.nvmlDeviceGetCurrentClocksEventReasons, h)
            util = safe(nv.nvmlDeviceGetUtilizationRates, h)
            gpus.append({
                "index": i, "uuid": uuid, "name": name.decode() if isinstance(name, bytes) else name,
                "util_pct": util.gpu if util else None, "mem_used_mib": mem.used // 2**20,
                "mem_total_mib": mem.total // 2**20, "power_w": power / 1000 if power is not None else None,
                "temp_c": safe(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
                "sm_mhz": safe(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM),
                "pstate": None, "throttle": f"0x{reasons:016x}" if reasons is not None else None,
                "ecc_uncorrected": ecc,
            })  # fmt: skip
            for p in safe(nv.nvmlDeviceGetComputeRunningProcesses, h) or []:
                used = p.usedGpuMemory // 2**20 if p.usedGpuMemory is not None else None
                apps.append({"pid": p.pid, "name": None, "used_mib": used, "gpu_uuid": uuid})
    finally:
        try:
            nv.nvmlShutdown()
        except Exception:
            pass
    return gpus, apps


def gpus_from_smi() -> tuple[list[dict], list[dict]] | None:
    if not shutil.which("nvidia-smi"):
        return None
    rc, out = _run(["nvidia-smi", f"--query-gpu={','.join(GPU_FIELDS)}", "--format=csv,noheader,nounits"])
    if rc != 0:
        return None
    _, apps = _run(["nvidia-smi", f"--query-compute-apps={','.join(APP_FIELDS)}", "--format=csv,noheader,nounits"])
    return parse_gpu_csv(out), parse_apps_csv(apps)


def read_gpus(req: dict) -> dict:
    if "gpu_csv" in req:  # gathered on the container's host by the same command, before this ran
        return {
            "source": "host",
            "gpus": parse_gpu_csv(req["gpu_csv"]),
            "apps": parse_apps_csv(req.get("apps_csv", "")),
        }
    for source, fn in (("nvml", gpus_from_nvml), ("nvidia-smi", gpus_from_smi)):
        got = fn()
        if got is not None:
            return {"source": source, "gpus": got[0], "apps": got[1]}
    return {"source": "none", "gpus": [], "apps": []}


def proc_table() -> dict[int, dict]:
    """Every process: ppid, state, CPU seconds, RSS, command line (from /proc)."""
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
        except OSError:
            continue
        table[int(name)] = {
            "pid": int(name), "ppid": int(rest[1]), "state": rest[0],
            "cpu_s": round((int(rest[11]) + int(rest[12])) / tick, 2),
            "rss_mib": round(int(rest[21]) * page / 2**20, 1), "cmd": cmd[:200],
        }  # fmt: skip
    return table


def has_job_tag(pid: int, job_id: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"DFLASHCTL_JOB_ID={job_id}".encode() in f.read().split(b"\0")
    except OSError:
        return False


def job_processes(table: dict[int, dict], pane_pid: int | None, job_id: str | None) -> list[dict]:
    """The pane's descendants (torchrun workers sit in new sessions, but stay children) plus any process carrying the
    job's tag in its environment (one whose parent died and was reparented). Never selected by name."""
    children: dict[int, list[int]] = {}
    for p in table.values():
        children.setdefault(p["ppid"], []).append(p["pid"])
    found: set[int] = set()
    stack = [pane_pid] if pane_pid in table else []
    while stack:
        pid = stack.pop()
        if pid not in found:
            found.add(pid)
            stack.extend(children.get(pid, []))
    if job_id:
        me = os.getpid()
        found |= {pid for pid in table if pid != me and pid not in found and has_job_tag(pid, job_id)}
    return [table[p] for p in sorted(found) if p in table]


def tmux_session(session: str | None, lines: int) -> dict:
    if not session:
        return {"exists": False}
    fmt = "#{pane_pid} #{pane_dead} #{pane_dead_status} #{session_created}"
    rc, out = _run([*TMUX, "display-message", "-p", "-t", f"={session}:", fmt])
    if rc != 0 or not out.strip():
        return {"exists": False}
    parts = out.split()
    info = {
        "exists": True,
        "pane_pid": int(parts[0]),
        "pane_dead": parts[1] == "1",
        "exit_status": int(parts[2]) if len(parts) > 3 and parts[2].lstrip("-").isdigit() else None,
        "created": int(parts[-1]) if parts[-1].isdigit() else None,
    }
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
    return {
        "exists": True,
        "offset": size,
        "size": size,
        "text": data.decode(errors="replace"),
        "skipped": start - offset,
    }


def read_metrics(path: str, offset: int, limit: int) -> dict:
    got = read_new(path, offset, limit)
    text = got.pop("text")
    records, end = [], got["offset"]
    if not text.endswith("\n") and "\n" in text:  # a line being written: leave it for the next poll
        cut = text.rindex("\n") + 1
        end -= len(text.encode()) - len(text[:cut].encode())
        text = text[:cut]
    elif not text.endswith("\n"):
        end -= len(text.encode())
        text = ""
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    got["offset"] = end
    got["records"] = records
    return got


def snapshot(req: dict) -> dict:
    now = time.time()
    run_dir = req.get("run_dir")
    snap: dict = {"time": now, "run_dir": run_dir, "run_dir_exists": bool(run_dir and os.path.isdir(run_dir))}
    snap["session"] = tmux_session(req.get("session"), int(req.get("capture_lines", 40)))
    table = proc_table()
    pane_pid = None if snap["session"].get("pane_dead") else snap["session"].get("pane_pid")
    snap["procs"] = job_processes(table, pane_pid, req.get("job_id"))
    if run_dir and req.get("append_events") and snap["run_dir_exists"]:
        with open(os.path.join(run_dir, "events.jsonl"), "a") as f:
            f.write("".join(json.dumps(e, separators=(",", ":")) + "\n" for e in req["append_events"]))
    if run_dir:
        snap["log"] = read_new(os.path.join(run_dir, "train.log"), int(req.get("log_offset", 0)),
                               int(req.get("max_log_bytes", 65536)))  # fmt: skip
        snap["metrics"] = read_metrics(os.path.join(run_dir, "metrics.jsonl"), int(req.get("metrics_offset", 0)),
                                       int(req.get("max_metrics_bytes", 1 << 20)))  # fmt: skip
        try:
            with open(os.path.join(run_dir, "heartbeat")) as f:
                hb = json.loads(f.read() or "{}")
            snap["heartbeat"] = {**hb, "age_s": round(now - os.path.getmtime(os.path.join(run_dir, "heartbeat")), 2)}
        except (OSError, ValueError):
            snap["heartbeat"] = None
        try:
            with open(os.path.join(run_dir, "exit_code")) as f:
                snap["exit_code"] = int(f.read().strip())
        except (OSError, ValueError):
            snap["exit_code"] = None
        try:
            st = os.statvfs(run_dir)
            snap["disk_free_gib"] = round(st.f_bavail * st.f_frsize / 2**30, 2)
        except OSError:
            snap["disk_free_gib"] = None
    if req.get("gpus", True):
        snap["gpu"] = read_gpus(req)
    if req.get("code_manifest"):
        try:
            with open(os.path.expanduser(req["code_manifest"])) as f:
                snap["code_version"] = json.load(f).get("version")
        except (OSError, ValueError):
            snap["code_version"] = None
    if req.get("sessions"):
        rc, out = _run([*TMUX, "list-sessions", "-F", "#{session_name} #{pane_dead}"])
        snap["sessions"] = [
            {"name": ln.split()[0], "dead": ln.split()[-1] == "1"} for ln in out.splitlines() if ln.strip()
        ] if rc == 0 else []  # fmt: skip
    return snap


def alive(pid: int) -> bool:
    """Exists and is not a zombie (a zombie holds no memory and no GPU; its parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return stat[stat.rindex(")") + 2] != "Z"
    except (OSError, ValueError, IndexError):
        return False


def reap(req: dict) -> dict:
    """SIGTERM every process of the job (the pane's own shell last, so that the wrapper can record the exit status),
    wait up to `grace_s`, SIGKILL what remains, then verify that none remain and that no GPU holds one of them."""
    import signal

    session, job_id = req.get("session"), req.get("job_id")
    pane = tmux_session(session, 0)
    pane_pid = pane.get("pane_pid")
    procs = job_processes(proc_table(), pane_pid, job_id)
    pids = [p["pid"] for p in procs if p["pid"] != pane_pid and alive(p["pid"])]
    report: dict = {"found": [{k: p[k] for k in ("pid", "ppid", "cmd")} for p in procs], "term": [], "kill": []}

    def send(sig, targets: list[int], key: str) -> None:
        for pid in targets:
            try:
                os.kill(pid, sig)
                report[key].append(pid)
            except ProcessLookupError:
                pass

    send(signal.SIGTERM, pids, "term")
    for pid in pids:  # a stopped process (SIGSTOP, a debugger) would hold SIGTERM pending forever
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + float(req.get("grace_s", 40))
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    send(signal.SIGKILL, [p for p in pids if alive(p)], "kill")
    end = time.monotonic() + 3  # the wrapper writes exit_code once its command is gone, then exits
    while pane_pid and alive(pane_pid) and time.monotonic() < end:
        time.sleep(0.1)
    if session:
        _run([*TMUX, "kill-session", "-t", f"={session}"])
    end = time.monotonic() + 5
    while time.monotonic() < end:
        left = [p for p in job_processes(proc_table(), None, job_id) if alive(p["pid"])]
        left += [{"pid": p} for p in pids if alive(p) and p not in {q["pid"] for q in left}]
        if not left:
            break
        time.sleep(0.2)
    report["remaining"] = [p["pid"] for p in left] if left else []
    every = {p["pid"] for p in procs}
    gpu = read_gpus(req) if req.get("gpus", True) else {"source": "none", "gpus": [], "apps": []}
    report["gpu_source"] = gpu["source"]
    report["gpu_holders"] = [a for a in gpu["apps"] if a["pid"] in every]
    report["session_closed"] = not tmux_session(session, 0).get("exists") if session else True
    return report


def main() -> int:
    req = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    if req.get("tmux_socket"):
        TMUX[2] = req["tmux_socket"]
    if len(sys.argv) > 3:  # GPU readings taken on the container's host by the same command
        req["gpu_csv"], req["apps_csv"] = sys.argv[2], sys.argv[3]
    answer = reap(req) if req.get("action") == "reap" else snapshot(req)
    sys.stdout.write(json.dumps(answer, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
