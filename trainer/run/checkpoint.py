"""Checkpoints that a kill at any moment cannot corrupt: written into `step-NNNNNNNN.tmp/`, then renamed.

Layout of `<run_dir>/checkpoints/step-00000006/`:
    drafter.safetensors   drafter weights (what inference needs)
    state.pt              optimiser, scheduler, data position, RNG states of every rank
    manifest.json         sha256 and size of the two files above, so a resume can tell an intact checkpoint
A directory without the `.tmp` suffix is complete by construction (rename is atomic); leftovers of an interrupted
write keep the suffix and are ignored, then removed by the next save. What a disk error, a copy or a hand edit did
later is caught at resume: `load_newest_intact` verifies the manifest and loads, falling back to older checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from trainer.errors import NonFiniteWeightsError
from trainer.model.dflash_format import nonfinite
from trainer.run import faults

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
    """Write a complete checkpoint for `pos.step` and keep only the newest `keep`. Main rank only. Weights with NaN or
    inf are refused before anything is written (NonFiniteWeightsError), so every checkpoint kept is finite and the
    rotation can never push out the last good one."""
    bad = nonfinite(drafter.state_dict())
    if bad:
        raise NonFiniteWeightsError(
            f"step {pos.step}: {len(bad)} drafter tensors are non-finite ({bad[0]}, ...); the "
            "checkpoint was not written",
            step=pos.step,
        )
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
    files = {f.name: {"sha256": _sha256(f), "size": f.stat().st_size} for f in sorted(tmp.iterdir())}
    (tmp / "manifest.json").write_text(json.dumps({"step": pos.step, "files": files, "finite": True}))
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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def problem(path: Path) -> str | None:
    """Why the checkpoint at `path` is not intact (a file missing, truncated or changed since it was written), or
    None. Checkpoints written before manifests existed are judged by loading alone."""
    manifest = path / "manifest.json"
    if manifest.is_file():
        try:
            files = json.loads(manifest.read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError):
            return "manifest.json is unreadable"
        for name, meta in files.items():
            f = path / name
            if not f.is_file():
                return f"{name} is missing"
            if f.stat().st_size != meta.get("size") or _sha256(f) != meta.get("sha256"):
                return f"{name} does not match its sha256"
    elif not (path / "drafter.safetensors").is_file() or not (path / "state.pt").is_file():
        return "drafter.safetensors or state.pt is missing"
    return None


def load_newest_intact(ckpt_root: Path) -> tuple[Path | None, Loaded | None, list[dict]]:
    """The newest checkpoint that verifies and loads, with the newer ones skipped and why. (None, None, skipped)
    when there is none: with `skipped` non-empty, every checkpoint was damaged."""
    skipped = []
    for path in reversed(complete(ckpt_root)):
        why = problem(path)
        if why is None:
            try:
                loaded = load(path)
                bad = nonfinite(loaded.weights)
                if not bad:
                    return path, loaded, skipped
                why = f"weights are not finite ({bad[0]}, {len(bad)} tensors): written during a divergence"
            except Exception as e:  # safetensors, pickle and zip errors alike: this one cannot be used
                why = f"cannot be loaded: {type(e).__name__}: {str(e)[:120]}"
        skipped.append({"path": str(path), "why": why})
    return None, None, skipped
