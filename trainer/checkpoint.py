"""Checkpoints that a kill at any moment cannot corrupt: written into `step-NNNNNNNN.tmp/`, then renamed.

Layout of `<run_dir>/checkpoints/step-00000006/`:
    drafter.safetensors   drafter weights (what inference needs)
    state.pt              optimiser, scheduler, data position, RNG states of every rank
A directory without the `.tmp` suffix is complete by construction (rename is atomic); leftovers of an interrupted
write keep the suffix and are ignored, then removed by the next save.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from trainer import faults

NAME = re.compile(r"^step-(\d{8})$")


@dataclass
class Position:
    """Where the data stream stands: the epoch and how many of its global batches were consumed."""

    step: int
    epoch: int
    batch_in_epoch: int


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(
    ckpt_root: Path,
    pos: Position,
    drafter: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    rng_states: list[dict],
    keep: int,
) -> Path:
    """Write a complete checkpoint for `pos.step` and keep only the newest `keep`. Main rank only."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step-{pos.step:08d}"
    tmp = ckpt_root / f"step-{pos.step:08d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    weights = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(weights, str(tmp / "drafter.safetensors"))
    faults.in_checkpoint(pos.step)
    state = {
        "position": pos.__dict__,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": rng_states,
    }
    torch.save(state, tmp / "state.pt")
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(ckpt_root)
    for old in complete(ckpt_root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for leftover in ckpt_root.glob("step-*.tmp"):
        shutil.rmtree(leftover, ignore_errors=True)
    return final


def complete(ckpt_root: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not ckpt_root.is_dir():
        return []
    return sorted(p for p in ckpt_root.iterdir() if p.is_dir() and NAME.match(p.name))


def latest(ckpt_root: Path) -> Path | None:
    found = complete(ckpt_root)
    return found[-1] if found else None


@dataclass
class Loaded:
    position: Position
    weights: dict[str, torch.Tensor]
    optimizer: dict
    scheduler: dict
    rng: list[dict]


def load(path: Path) -> Loaded:
    weights = load_file(str(path / "drafter.safetensors"))
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    return Loaded(Position(**state["position"]), weights, state["optimizer"], state["scheduler"], state["rng"])
