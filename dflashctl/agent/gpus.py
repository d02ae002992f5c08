"""The GPUs of this machine: NVML where importable, else nvidia-smi's CSV (or readings taken on a container's host),
their faults, and their compute processes with pids in every namespace. Part of the remote agent (stdlib only)."""

from __future__ import annotations

import re
import shutil

from .procs import _run

GPU_FIELDS = [
    "index",
    "uuid",
    "name",
    "memory.used",
    "memory.total",
    "utilization.gpu",
    "power.draw",
    "temperature.gpu",
    "clocks.sm",
    "pstate",
    "clocks_event_reasons.active",
    "ecc.errors.uncorrected.volatile.total",
]
GPU_KEYS = [
    "index",
    "uuid",
    "name",
    "mem_used_mib",
    "mem_total_mib",
    "util_pct",
    "power_w",
    "temp_c",
    "sm_mhz",
    "pstate",
    "throttle",
    "ecc_uncorrected",
]
TEXT_KEYS = ("uuid", "name", "pstate", "throttle")
APP_FIELDS = ["pid", "process_name", "used_memory", "gpu_uuid"]


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
            apps.append(
                {
                    "pid": int(values[0]),
                    "name": ",".join(values[1:-2]),
                    "used_mib": _num(values[-2]),
                    "gpu_uuid": values[-1],
                }
            )
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
            gpus.append(
                {
                    "index": i,
                    "uuid": uuid,
                    "name": name.decode() if isinstance(name, bytes) else name,
                    "util_pct": util.gpu if util else None,
                    "mem_used_mib": mem.used // 2**20,
                    "mem_total_mib": mem.total // 2**20,
                    "power_w": power / 1000 if power is not None else None,
                    "temp_c": safe(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
                    "sm_mhz": safe(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM),
                    "pstate": None,
                    "throttle": f"0x{reasons:016x}" if reasons is not None else None,
                    "ecc_uncorrected": ecc,
                    "retired_pending": bool(pending) if pending is not None else None,
                    "remap_pending": bool(remap[2]) if remap else None,
                    "remap_failed": bool(remap[3]) if remap else None,
                }
            )
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
