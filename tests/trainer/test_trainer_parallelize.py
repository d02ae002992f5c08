"""trainer/run/parallelize.py: its order (checkpointing wraps each drafter layer, compile wraps that, DDP wraps the
whole), training through the wrappers equal to training the drafter as written, the state-dict names of the
one-device model, and the recompile limit in the thread that runs backward."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
import torch._dynamo

from tests.conftest import run_two_ranks
from trainer.config import from_dict
from trainer.data.dataset import make_dataset
from trainer.model.compile_policy import apply_compile_policy
from trainer.model.drafter import DrafterLayer
from trainer.run.build import build, forward_loss, make_batch
from trainer.run.parallelize import CompiledLayer

ROOT = Path(__file__).resolve().parents[2]
TINY = {
    "target": {"random_preset": "tiny-qwen3", "dtype": "float32"},
    "drafter": {"num_layers": 2, "block_size": 8},
    "attention": {"backend": "dense"},
    "data": {"anchors_per_seq": 16, "seq_buckets": [128], "batch_size": 2, "synthetic_samples": 8},
    "device": "cpu",
    "steps": 1,
}


def tiny(**drafter) -> dict:
    return {**TINY, "drafter": {**TINY["drafter"], **drafter}}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("parallelize")
    proc = run_two_ranks(ROOT / "tests" / "parallelize_worker.py", str(out), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_checkpointing_wraps_each_layer_then_compile_wraps_that_and_ddp_wraps_last(ranks):
    for found in ranks:
        assert found["parallel"]["wrapping"] == [
            "DistributedDataParallel",
            "Drafter",
            "CompiledLayer",
            "CheckpointWrapper",
            "DrafterLayer",
        ]
        assert found["plain"]["wrapping"] == ["DistributedDataParallel", "Drafter", "DrafterLayer"]


def test_two_ranks_train_through_the_wrappers_as_through_the_drafter_as_written(ranks):
    """The same losses, step by step, on both ranks; nothing compiled after the preflight."""
    for found in ranks:
        plain, parallel = found["plain"]["losses"], found["parallel"]["losses"]
        assert len(plain) == len(parallel) == 3
        assert parallel == pytest.approx(plain, rel=1e-5)
        assert found["parallel"]["recompiles"] == 0
    assert ranks[0]["parallel"]["losses"] == ranks[1]["parallel"]["losses"]


def test_the_wrapped_drafter_keeps_the_state_dict_names_of_the_one_device_model(ranks):
    """Checkpoints and exports are written from these names: the wrappers add none of their own."""
    for found in ranks:
        assert found["parallel"]["keys"] == found["plain"]["keys"]
        assert not [k for k in found["parallel"]["keys"] if "_checkpoint_wrapped_module" in k or ".layer." in k]


def test_one_process_calls_the_drafter_itself_and_leaves_it_as_written_by_default():
    parts = build(from_dict(TINY))
    assert parts.model is parts.drafter
    assert all(type(layer) is DrafterLayer for layer in parts.drafter.layers)


def test_a_build_for_decoding_alone_wraps_nothing():
    parts = build(from_dict(tiny(activation_checkpointing=True, compile="on")), for_training=False)
    assert parts.model is parts.drafter
    assert all(type(layer) is DrafterLayer for layer in parts.drafter.layers)


def test_compile_and_checkpointing_are_applied_in_one_process_too_and_state_dicts_load_both_ways():
    parts = build(from_dict(tiny(activation_checkpointing=True, compile="on")))
    layer = parts.drafter.layers[0]
    assert isinstance(layer, CompiledLayer) and type(layer.layer).__name__ == "CheckpointWrapper"
    plain = build(from_dict(TINY)).drafter
    assert list(parts.drafter.state_dict()) == list(plain.state_dict())
    parts.drafter.load_state_dict(plain.state_dict(), strict=True)  # a checkpoint of either loads into the other
    plain.load_state_dict(parts.drafter.state_dict(), strict=True)


def test_the_recompile_limit_reaches_the_thread_that_runs_backward():
    """Dynamo's config is thread-local (torch >= 2.12): a thread that never set the limit sees the default. The
    drafter's output carries the policy into backward, so every compiled backward runs under the configured limit."""
    dynamo = torch._dynamo.config
    before = dynamo.recompile_limit
    cfg = from_dict({**TINY, "attention": {"backend": "dense", "recompile_limit": 3}})
    parts = build(cfg)
    batch = make_batch(parts, make_dataset(cfg.data, 256, 8, 0), 128, [0, 1], 0)
    seen, failed = [], []

    def in_a_fresh_thread() -> None:
        try:
            dynamo.recompile_limit = 8  # as a thread that never applied the policy finds it
            parts.drafter.fc.weight.register_hook(lambda grad: seen.append(dynamo.recompile_limit))
            loss_sum, w_sum, _ = forward_loss(parts, batch)
            (loss_sum / w_sum).backward()  # on the CPU the autograd engine runs it in this thread
        except Exception as e:  # reported below, in the test's thread
            failed.append(e)

    try:
        worker = threading.Thread(target=in_a_fresh_thread)
        worker.start()
        worker.join()
    finally:
        apply_compile_policy(before)  # this thread as it was before the build
    assert not failed and seen == [3]
