"""The exit code of each state, shared by `watch`, `status` and `diagnose` (kept light: the CLI imports it at once)."""

from __future__ import annotations

EXIT_BY_STATE = {
    "FINISHED": 0, "RUNNING": 0, "STARTING": 0, "STOPPING": 0, "CRASHED": 10, "OOM": 11, "NCCL_TIMEOUT": 12,
    "STALLED": 13, "DENSE_FALLBACK": 14, "RECOMPILE_LIMIT": 15, "LOST": 16, "CONFIG_ERROR": 17, "UNREACHABLE": 18,
    "PROBE_FAILED": 19, "KILLED": 20, "KILL_FAILED": 21, "DIVERGED": 22, "GPU_FAULT": 23, "HOST_OOM": 24,
    "DISK_FULL": 25, "PENDING": 0, "TIMEOUT": 26, "PREEMPTED": 27, "NODE_FAIL": 28, "CANCELLED": 29,
    "INCOMPLETE": 30, "NCCL_ERROR": 31,
}  # fmt: skip
