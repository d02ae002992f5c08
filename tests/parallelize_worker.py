"""A torchrun worker for tests/test_trainer_parallelize.py: one run as the drafter is written and one parallelized
(each layer checkpointed, then compiled, the whole in DDP), on two gloo ranks; per rank, how the drafter was wrapped,
the losses and the state-dict names, saved as JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.config import from_dict  # noqa: E402
from trainer.run import parallelize  # noqa: E402
from trainer.run.distributed import init_world, shutdown  # noqa: E402
from trainer.run.process_exit import end_process  # noqa: E402
from trainer.run.training import train  # noqa: E402

BASE = {
    "target": {"random_preset": "tiny-qwen3", "dtype": "float32"},
    "drafter": {"num_layers": 2, "block_size": 8},
    "attention": {"backend": "dense"},
    "data": {"anchors_per_seq": 16, "seq_buckets": [128], "synthetic_samples": 24, "holdout": 0, "batch_size": 1},
    "device": "cpu",
    "steps": 3,
    "eval": {"at_end": False},
}
RUNS = {"plain": {}, "parallel": {"activation_checkpointing": True, "compile": "on"}}


INNER = {  # each wrapper's way to what it wraps, down to the first drafter layer
    "DistributedDataParallel": lambda m: m.module,
    "Drafter": lambda m: m.layers[0],
    "CompiledLayer": lambda m: m.layer,
    "CheckpointWrapper": lambda m: m._checkpoint_wrapped_module,
}


def wrapping(module) -> list[str]:
    """The classes from the module a step calls down to the first drafter layer, outermost first."""
    chain = [type(module).__name__]
    while chain[-1] in INNER:
        module = INNER[chain[-1]](module)
        chain.append(type(module).__name__)
    return chain


if __name__ == "__main__":
    out = Path(sys.argv[1])
    # Inductor's code generation is torch's business and slow on a CPU: the layers go through Dynamo and AOTAutograd
    # (forward, joint backward, the checkpoint's recompute) as on a GPU, then run as traced
    compile_layers = parallelize.compile_layers
    parallelize.compile_layers = lambda layers, backend="inductor": compile_layers(layers, "aot_eager")
    world = init_world("cpu")
    found = {}
    for name, drafter in RUNS.items():
        cfg = from_dict({**BASE, "drafter": {**BASE["drafter"], **drafter}})
        result = train(cfg, log=lambda s: None, world=world)
        parts = result.parts
        found[name] = {
            "wrapping": wrapping(parts.model),
            "losses": result.losses,
            "keys": list(parts.drafter.state_dict()),
            "recompiles": result.recompiles_after_preflight,
        }
    (out / f"rank{world.rank}.json").write_text(json.dumps(found))
    shutdown(world)
    end_process(0)
