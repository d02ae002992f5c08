"""The compile helper's process (`python -m trainer.run.compile_ahead`, started by trainer/run/compile_helper.py):
the first shape bucket compiled through hollow models into the run's caches, its progress in the state file."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def _write_state(path: Path, token: str, **fields) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps({"pid": os.getpid(), "token": token, "time": time.time(), **fields}))
    os.replace(tmp, path)


def _room(cfg, device, source: str) -> str | None:
    """Why local rank 0's GPU has no room for the helper beside the trainer, or None: the trainer's planned peak
    (trainer/run/memory_plan.py) and the helper's own (one target layer, the drafter with its gradients, the first
    bucket's activations) must fit in what is free now. A helper must never be why the trainer runs out."""
    import dataclasses

    import torch

    from trainer.model.drafter import drafter_dims
    from trainer.model.target import target_config
    from trainer.run.memory_plan import GiB, per_rank_bytes, target_shapes

    if device.type != "cuda":
        return None
    hf = target_config(cfg.target, source)
    dims = drafter_dims(hf, cfg.drafter.num_layers, len(cfg.target.layer_ids or range(cfg.drafter.num_layers)),
                        cfg.drafter.shape_overrides())  # fmt: skip
    shapes = target_shapes(hf, dims, dims.num_target_layers, 4 if cfg.target.dtype == "float32" else 2)
    queries = cfg.data.anchors_per_seq * cfg.drafter.block_size
    trainer = per_rank_bytes(shapes, "replicate", 1, max(cfg.data.seq_buckets), queries, cfg.data.batch_size)["total"]
    helper = per_rank_bytes(dataclasses.replace(shapes, layers=1), "replicate", 1, min(cfg.data.seq_buckets), queries,
                            cfg.data.batch_size)["total"]  # fmt: skip
    free, _ = torch.cuda.mem_get_info(device)
    if trainer + helper > free:
        return (f"the trainer's planned {trainer / GiB:.1f} GiB and the helper's {helper / GiB:.1f} GiB do not fit in "
                f"the {free / GiB:.1f} GiB free")  # fmt: skip
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.run.compile_helper")
    ap.add_argument("--config", required=True)
    ap.add_argument("--state", required=True)
    ap.add_argument("--token", required=True)
    args = ap.parse_args(argv)
    path, token = Path(args.state), args.token
    _write_state(path, token, state="starting")
    start = time.monotonic()
    try:
        from trainer.config import load_config

        cfg = load_config(args.config)
        first = min(cfg.data.seq_buckets)
        cfg.data.seq_buckets = [first]
        import torch

        from trainer.model.compile_policy import start_compile_workers
        from trainer.model.target import resolve_device
        from trainer.run.eval import eval_anchors
        from trainer.run.loop import build, preflight

        device = torch.device("cpu")
        if resolve_device(cfg.device).type == "cuda":  # local rank 0's device, as the trainer picks it
            device = torch.device("cuda", int(cfg.device.split(":")[1]) if ":" in cfg.device else 0)
            torch.cuda.set_device(device)
            start_compile_workers()  # now: they import torch while this process checks the room and builds
        if device.type == "cpu" and cfg.compile_helper != "on":
            _write_state(path, token, state="skipped", reason="no GPU")
            return 0
        full = _room(cfg, device, args.config)
        if full:
            _write_state(path, token, state="skipped", reason=full)
            return 0
        phases = {"imported": round(time.monotonic() - start, 2)}
        _write_state(path, token, state="compiling", bucket=first, phases=phases)
        parts = build(cfg, args.config, device=device, hollow=True)
        phases["built"] = round(time.monotonic() - start, 2)
        do_eval = cfg.eval.every > 0 or cfg.eval.at_end
        preflight(parts, backward=True, freeze=False,
                  eval_anchors=eval_anchors(cfg.drafter.block_size) if do_eval else None)  # fmt: skip
        _write_state(path, token, state="done", bucket=first, seconds=round(time.monotonic() - start, 2),
                     phases=phases)  # fmt: skip
        return 0
    except BaseException as e:  # noqa: BLE001 - told in the state file; the trainer compiles for itself
        first_line = (str(e).strip().splitlines() or [""])[0][:300]
        _write_state(path, token, state="failed", error=f"{type(e).__name__}: {first_line}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
