"""The compile helper: a second process that compiles the preflight's first bucket while the trainer starts.

A cold first bucket pays for Inductor's and Triton's start and the target's first compile on top of what every bucket
compiles, and nothing in the trainer's own process may compile while a model is being built (Inductor sets
process-wide state, the default dtype among it, while it compiles). So another process does it: started before the
trainer imports torch, it builds the run's models hollow (nothing read from disk, zeroed weights, one target layer's
memory), runs the first bucket forward and backward through the same compiled code, and leaves the graphs and kernels
in the run's Inductor and Triton caches. The trainer's first bucket waits for it (the wait is counted in that
bucket's time) and then finds them there.

Its progress is a small JSON file in the run dir, one per node: {"state": "starting" | "compiling" | "done" |
"skipped" | "failed", "pid", "token", ...}. The token is the trainer's parent's pid (torchrun's agent, the same for
every local rank), so a file left by an earlier run in the same run dir is never taken for this one's. A helper that
dies, fails or is skipped only means the trainer compiles as it would have; its output goes to its own log in the
run dir, never to the trainer's.

This module is the trainer's side, stdlib only (`spawn` runs before the trainer imports torch); the helper itself is
trainer/run/compile_ahead.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

WAIT_LIMIT_S = 600.0  # the longest a trainer waits for a helper that says it is compiling
_spawned: list[subprocess.Popen] = []  # the helper this process started, if any
# torchrun's variables: the helper is no rank of the job (the caches come with the rest of the environment)
_RANK_ENV = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
             "MASTER_ADDR", "MASTER_PORT"}  # fmt: skip


def state_path(run_dir: Path) -> Path:
    return Path(run_dir) / f"compile-helper.{socket.gethostname()}.json"


def _token() -> str:
    return str(os.getppid())


def wanted(cfg) -> bool:
    """Whether this run should have a helper: `compile_helper: on`, or `auto` on a machine with an NVIDIA GPU where
    something is compiled (the drafter or the target) and the target is replicated (a sharded target runs eagerly)."""
    if cfg.compile_helper == "off" or cfg.compile_helper == "auto" and (
        cfg.device == "cpu" or not os.path.exists("/dev/nvidiactl")
    ):
        return False
    from trainer.config import parse_parallel

    try:
        replicated = parse_parallel(cfg.target.parallel)[0] == "replicate"
    except Exception:  # noqa: BLE001 - a bad value is the trainer's to report, with its key
        return False
    return replicated and (cfg.drafter.compile != "off" or cfg.target.compile != "off")


def _die_with_parent() -> None:
    """In the child, before exec: a SIGKILL when the trainer dies, however it dies (Linux; elsewhere nothing)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def spawn(config_path: str, run_dir: Path | None, cfg) -> subprocess.Popen | None:
    """Start the helper for this node (local rank 0 only), or nothing when the run does not want one."""
    if run_dir is None or os.environ.get("LOCAL_RANK", "0") != "0":
        return None
    path = state_path(run_dir)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # an earlier run's (a restart under the same parent has the same token): never this one's
    if not wanted(cfg):
        return None
    log = open(Path(run_dir) / "compile-helper.log", "ab")  # noqa: SIM115 - the child holds it
    env = {k: v for k, v in os.environ.items() if k not in _RANK_ENV and not k.startswith("TORCHELASTIC_")}
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainer.run.compile_ahead", "--config", config_path, "--state", str(path),
             "--token", _token()],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent,
        )  # fmt: skip
    except OSError:
        return None
    finally:
        log.close()
    _spawned.append(proc)
    return proc


def running() -> bool:
    """Whether this process started a helper that is still at work."""
    return bool(_spawned) and _spawned[-1].poll() is None


def stop() -> None:
    """End the helper this process started, if it still runs (the trainer is past its first bucket, or exiting)."""
    while _spawned:
        proc = _spawned.pop()
        if proc.poll() is None:
            proc.kill()
        with contextlib.suppress(Exception):
            proc.wait(timeout=10)


def read_state(run_dir: Path) -> dict | None:
    """This run's helper state, or None (none yet, another run's, unreadable)."""
    try:
        state = json.loads(state_path(run_dir).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) and state.get("token") == _token() else None


def _alive(pid: object) -> bool:
    """A live helper with this pid (its command line names this module: a reused pid is someone else)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        return b"trainer.run.compile_ahead" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def wait_for(run_dir: Path, progress: Callable[[str], None] | None = None, limit_s: float = WAIT_LIMIT_S) -> dict:
    """Until this node's helper has finished with the first bucket (done, skipped or failed), has died, or has taken
    `limit_s`. Returns its last state with `waited_s`; {"state": "none"} at once when there is no helper."""
    start = time.monotonic()
    said = False
    own = _spawned[-1] if _spawned else None
    while True:
        state = read_state(run_dir) or {}
        name = state.get("state")
        waited = round(time.monotonic() - start, 2)
        if name in ("done", "skipped", "failed"):
            return {**state, "waited_s": waited}
        running = own.poll() is None if own is not None else _alive(state.get("pid"))
        if not running:
            return {"state": "none" if own is None and not state else "died", "waited_s": waited}
        if time.monotonic() - start > limit_s:
            stop()
            return {**state, "state": "timeout", "waited_s": waited}
        if progress is not None and not said:
            progress("waiting for the compile helper")
            said = True
        time.sleep(0.05)
