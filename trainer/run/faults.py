"""Fault injection for testing the tools that watch the trainer: `TRAINER_FAULT=<kind>@<step>`.

kinds: `crash` (raise at the start of the step, once per run dir), `nan` (the loss is NaN from that step on, as a
diverging run's is), `hang` (sleep at the start of the step, so that
a test can SIGKILL a process that is known to be alive), `hang-in-checkpoint` (sleep after the checkpoint's weights
are written but before it is complete). And `pace@<ms>`: sleep that many milliseconds at the start of every step, so
that a test has a live trainer (heartbeat, steps) for a while at almost no CPU cost. Unset in normal use; a malformed
value is ignored.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

ENV = "TRAINER_FAULT"


def _number_for(kind: str) -> int | None:
    """The number after `kind@` in TRAINER_FAULT, or None (another kind, unset, or malformed)."""
    want, _, at = os.environ.get(ENV, "").partition("@")
    return int(at) if want == kind and at.isdigit() else None


def _armed(kind: str, step: int) -> bool:
    return _number_for(kind) == step


def _pace_s() -> float:
    return (_number_for("pace") or 0) / 1000


def at_step_start(step: int, run_dir: Path | None) -> None:
    pace = _pace_s()
    if pace:
        time.sleep(pace)
    if _armed("hang", step):
        time.sleep(3600)
    if _armed("crash", step) and run_dir is not None:
        marker = run_dir / ".fault-injected"
        if not marker.exists():
            marker.write_text(str(step))
            raise RuntimeError(f"injected fault at step {step} ({ENV})")


def in_checkpoint(step: int) -> None:
    if _armed("hang-in-checkpoint", step):
        time.sleep(3600)


def poison_loss(step: int, loss):
    """`nan@N`: from step N on the loss is NaN (and with it every gradient), as in a run that diverges."""
    start = _number_for("nan")
    if start is not None and step >= start:
        return loss * float("nan")
    return loss
