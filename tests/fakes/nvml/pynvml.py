"""A stand-in for nvidia-ml-py on machines without a GPU, answering with values recorded on an H200.

The readings come from tests/fixtures/nvidia-smi/h200-query-gpu-loaded.csv (nvidia-smi reads the same NVML fields);
FAKE_NVML_GPUS sets how many identical GPUs exist (default 2). Only the calls dflashctl and the trainer make exist.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
_ROW = (Path(__file__).resolve().parents[2] / "fixtures" / "nvidia-smi" / "h200-query-gpu-loaded.csv").read_text()
_F = [x.strip() for x in _ROW.split(",")]  # index, uuid, name, mem used, mem total, util, power, temp, sm, pstate, ...
_UUIDS = [f"{_F[1][:-2]}{i:02d}" for i in range(int(os.environ.get("FAKE_NVML_GPUS", "2")))]
_STARTED = False


class NVMLError(Exception):
    pass


def nvmlInit():
    global _STARTED
    _STARTED = True


def nvmlShutdown():
    global _STARTED
    _STARTED = False


def _check():
    if not _STARTED:
        raise NVMLError("Uninitialized")


def nvmlDeviceGetCount():
    _check()
    return len(_UUIDS)


def nvmlDeviceGetHandleByIndex(i):
    _check()
    if not 0 <= i < len(_UUIDS):
        raise NVMLError("Invalid Argument")
    if i in _faulty("FAKE_NVML_LOST"):  # NVML's answer for a GPU that fell off the bus
        raise NVMLError("GPU is lost")
    return i


def nvmlDeviceGetHandleByUUID(uuid):
    _check()
    if uuid not in _UUIDS:
        raise NVMLError("Not Found")
    return _UUIDS.index(uuid)


def nvmlDeviceGetIndex(h):
    return h


def nvmlDeviceGetUUID(h):
    return _UUIDS[h]


def nvmlDeviceGetName(h):
    return _F[2]


def nvmlDeviceGetUtilizationRates(h):
    return SimpleNamespace(gpu=int(_F[5]), memory=0)


def nvmlDeviceGetMemoryInfo(h):
    return SimpleNamespace(used=int(_F[3]) * 2**20, total=int(_F[4]) * 2**20, free=(int(_F[4]) - int(_F[3])) * 2**20)


def nvmlDeviceGetPowerUsage(h):
    return int(float(_F[6]) * 1000)  # milliwatts


def nvmlDeviceGetTemperature(h, sensor):
    return int(_F[7])


def nvmlDeviceGetClockInfo(h, kind):
    if kind != NVML_CLOCK_SM:
        raise NVMLError("Not Supported")  # not in the recording: never invented
    return int(_F[8])


def nvmlDeviceGetCurrentClocksEventReasons(h):
    return int(_F[10], 16)


NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0


def _faulty(env: str) -> dict[int, int]:
    """FAKE_NVML_ECC=1:3 gives GPU 1 three uncorrectable errors (the recording itself has 0): index:count,..."""
    out = {}
    for item in os.environ.get(env, "").split(","):
        idx, _, n = item.partition(":")
        if idx.strip().isdigit():
            out[int(idx)] = int(n or 1)
    return out


def nvmlDeviceGetTotalEccErrors(h, error_type, counter):
    if error_type != NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
        raise NVMLError("Not Supported")
    return _faulty("FAKE_NVML_ECC").get(h, int(_F[11]))


def nvmlDeviceGetRetiredPagesPendingStatus(h):
    return 1 if h in _faulty("FAKE_NVML_PENDING") else 0


def nvmlDeviceGetRemappedRows(h):
    raise NVMLError("Not Supported")  # not in the recording: never invented
