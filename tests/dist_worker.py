"""A torchrun worker for the two-rank test: train from a config, then save this rank's drafter parameters."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.config import load_config  # noqa: E402
from trainer.run.distributed import init_world, shutdown  # noqa: E402
from trainer.run.process_exit import end_process  # noqa: E402
from trainer.run.training import train  # noqa: E402

if __name__ == "__main__":
    cfg_path, run_dir = sys.argv[1], Path(sys.argv[2])
    cfg = load_config(cfg_path)
    world = init_world(cfg.device)
    result = train(cfg, cfg_path, run_dir, log=print, world=world)
    state = {k: v.detach().clone() for k, v in result.parts.drafter.state_dict().items()}
    torch.save(state, run_dir / f"params-rank{world.rank}.pt")
    shutdown(world)
    end_process(0)
