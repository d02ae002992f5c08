"""GPU history where the job runs: `RUN/gpu.jsonl`, one line per heartbeat with every GPU the job can see.

Recorded by the heartbeat thread (rank 0), so the history exists even when nobody was watching. NVML (nvidia-ml-py)
is read directly: no subprocess, a few hundred microseconds a sample. Without NVML nothing is written. One line:
    {"time": t, "source": "trainer", "gpus": [{"index", "util_pct", "mem_used_mib", "mem_total_mib", "power_w",
     "temp_c", "sm_mhz", "mem_mhz", "throttle"}, ...]}
`index` is NVML's (nvidia-smi's) index, the one job files name; `throttle` is the clock-event reasons bitmask in hex.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def visible_indices(nv, env: str | None) -> list[int]:
    """NVML indices of the GPUs named by CUDA_VISIBLE_DEVICES (indices or UUIDs); all of them when unset."""
    count = nv.nvmlDeviceGetCount()
    if env is None:
        return list(range(count))
    out = []
    for item in (x.strip() for x in env.split(",") if x.strip()):
        if item.isdigit():
            if int(item) < count:
                out.append(int(item))
            continue
        try:
            handle = nv.nvmlDeviceGetHandleByUUID(item)
            out.append(int(nv.nvmlDeviceGetIndex(handle)))
        except Exception:
            break  # CUDA stops at the first invalid entry too
    return out


def _safe(fn, *args):
    try:
        return fn(*args)
    except Exception:
        return None


def read_gpu(nv, index: int) -> dict:
    h = nv.nvmlDeviceGetHandleByIndex(index)
    util = _safe(nv.nvmlDeviceGetUtilizationRates, h)
    mem = _safe(nv.nvmlDeviceGetMemoryInfo, h)
    power = _safe(nv.nvmlDeviceGetPowerUsage, h)
    reasons = _safe(nv.nvmlDeviceGetCurrentClocksEventReasons, h)
    return {
        "index": index,
        "util_pct": util.gpu if util is not None else None,
        "mem_used_mib": mem.used // 2**20 if mem is not None else None,
        "mem_total_mib": mem.total // 2**20 if mem is not None else None,
        "power_w": round(power / 1000, 1) if power is not None else None,
        "temp_c": _safe(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
        "sm_mhz": _safe(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM),
        "mem_mhz": _safe(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM),
        "throttle": f"0x{reasons:016x}" if reasons is not None else None,
    }


class GpuHistory:
    """Appends one line per `sample()` to RUN/gpu.jsonl; a no-op when NVML cannot be loaded or initialised."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / "gpu.jsonl"
        self.nv = None
        self.indices: list[int] = []
        try:
            import pynvml as nv

            nv.nvmlInit()
            self.indices = visible_indices(nv, os.environ.get("CUDA_VISIBLE_DEVICES"))
            self.nv = nv
        except Exception:  # no driver, no library: no history, never an error
            self.nv = None

    @property
    def active(self) -> bool:
        return self.nv is not None and bool(self.indices)

    def sample(self) -> None:
        if not self.active:
            return
        gpus = [read_gpu(self.nv, i) for i in self.indices]
        line = {"time": round(time.time(), 3), "source": "trainer", "gpus": gpus}
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(line, separators=(",", ":")) + "\n").encode())
        finally:
            os.close(fd)

    def close(self) -> None:
        if self.nv is not None:
            _safe(self.nv.nvmlShutdown)
            self.nv = None
