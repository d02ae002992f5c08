"""What the benchmarks share: the median timer, a loopback sshd with a client home that trusts it, and the
performance issue's workload (Qwen3-8B-shaped random target, 5-layer drafter, seq 3072, 512 anchors, block 16)."""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QWEN3_8B_WORKLOAD = {
    "target": {"random_preset": "qwen3-8b", "dtype": "bfloat16"},
    "drafter": {"num_layers": 5, "block_size": 16},
    "attention": {"backend": "flex"},
    "data": {"anchors_per_seq": 512, "seq_buckets": [3072], "batch_size": 1, "synthetic_samples": 8, "holdout": 0},
    "eval": {"at_end": False},
}


def timed(fn: Callable[[], object], repeat: int) -> float:
    """Median wall seconds of `repeat` calls."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def loopback_sshd(work: Path):
    """Start sshd under work/sshd and make work/home this process's HOME, with the server's key in known_hosts.

    Returns (server, home). The test helpers are imported here only: importing them points jobs at the tests' own
    tmux server, which the GPU benchmarks must not do."""
    from tests.conftest import start_sshd

    (work / "sshd").mkdir()
    server = start_sshd(work / "sshd")
    home = work / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "known_hosts").write_text(f"[127.0.0.1]:{server.port} {server.host_pubkey}\n")
    os.environ["HOME"] = str(home)
    return server, home
