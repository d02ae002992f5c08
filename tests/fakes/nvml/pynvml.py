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
