"""A torchrun worker for the target-parallel test: for each mode, the target's hidden states on fixed tokens, then
five training steps' losses, saved per rank. Every mode runs in this one process group (one torchrun)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.config import from_dict, parse_parallel  # noqa: E402
from trainer.model.parallel import make_layout  # noqa: E402
from trainer.run.build import build  # noqa: E402
from trainer.run.distributed import init_world, shutdown  # noqa: E402
from trainer.run.process_exit import end_process  # noqa: E402
from trainer.run.training import train  # noqa: E402

BASE = {
    "target": {"random_preset": "tiny-qwen3", "dtype": "float32", "init_std": 0.02},
    "drafter": {"num_layers": 1, "block_size": 8},
    "attention": {"backend": "dense"},
    "data": {"anchors_per_seq": 16, "seq_buckets": [128], "synthetic_samples": 24, "holdout": 0},
    "device": "cpu",
    "steps": 5,
    "eval": {"at_end": False},
}

if __name__ == "__main__":
    out = Path(sys.argv[1])
    world = init_world("cpu")
    for mode in sys.argv[2:]:
        parallel = {"tensor": 2} if mode == "tensor" else mode
        # one global batch of 2 in every mode: two ranks of one sample, or one tensor group of two samples
        batch = 2 if mode == "tensor" else 1
        cfg = from_dict(
            {**BASE, "target": {**BASE["target"], "parallel": parallel}, "data": {**BASE["data"], "batch_size": batch}}
        )
        layout = make_layout(*parse_parallel(parallel), world)
        parts = build(cfg, device=world.device, layout=layout, for_training=False)
        ids = torch.randint(0, 250, (1, 128), generator=torch.Generator().manual_seed(7))
        hidden = parts.target.hidden_states(ids)
        logits = parts.target.logits(ids[:, :32])
        result = train(cfg, log=lambda s: None, world=world, run_dir=out / f"{mode}-run")
        torch.save(
            {"hidden": hidden, "logits": logits, "losses": result.losses, "layout": layout.describe()},
            out / f"{mode}-rank{world.rank}.pt",
        )
    shutdown(world)
    end_process(0)
