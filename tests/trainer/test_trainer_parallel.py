"""The frozen target replicated, tensor-parallel over two ranks (DTensor) and FSDP2-sharded, on the CPU with gloo:
the same hidden states and the same losses; and a target too large for its mode refused by the memory plan before
anything loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import run_two_ranks
from trainer.config import from_dict
from trainer.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("parallel")
    proc = run_two_ranks(ROOT / "tests" / "parallel_worker.py", str(out), "replicate", "tensor", "fsdp", cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def load(runs: Path, mode: str, rank: int) -> dict:
    return torch.load(runs / f"{mode}-rank{rank}.pt", weights_only=False)


@pytest.mark.parametrize("mode", ["tensor", "fsdp"])
def test_sharded_targets_give_the_replicated_hidden_states_and_losses(runs, mode):
    ref = load(runs, "replicate", 0)
    for rank in (0, 1):
        got = load(runs, mode, rank)
        assert torch.allclose(got["hidden"], ref["hidden"], atol=1e-5), (got["hidden"] - ref["hidden"]).abs().max()
        assert torch.allclose(got["logits"], ref["logits"], atol=1e-5)
        assert got["losses"] == pytest.approx(ref["losses"], abs=1e-4) and len(got["losses"]) == 5
    assert load(runs, mode, 0)["layout"] == (
        {"mode": "tensor", "tp": 2, "dp": 1} if mode == "tensor" else {"mode": "fsdp", "tp": 1, "dp": 2}
    )
    start = next(
        json.loads(x) for x in (runs / f"{mode}-run" / "metrics.jsonl").read_text().splitlines() if '"start"' in x
    )
    assert start["mesh"]["mode"] == mode  # the mesh is recorded with the run


def test_the_ranks_of_a_tensor_group_hold_the_same_hidden_states(runs):
    assert torch.equal(load(runs, "tensor", 0)["hidden"], load(runs, "tensor", 1)["hidden"])


LLAMA_70B = {
    "target": {"random_preset": "llama3-70b", "parallel": "replicate", "memory_gib": 139.8},
    "drafter": {"num_layers": 5, "block_size": 16},
    "data": {"anchors_per_seq": 512, "seq_buckets": [3072]},
    "device": "cpu",
}


def test_a_70b_target_replicated_on_one_h200_is_refused_by_the_plan_before_loading():
    from trainer.model.parallel import Layout
    from trainer.run.build import plan_memory

    cfg = from_dict(LLAMA_70B, "70b.yaml")
    with pytest.raises(ConfigError) as e:
        plan_memory(cfg, torch.device("cpu"), Layout("replicate", 1, 1, 0), "70b.yaml")
    msg = str(e.value)
    assert msg.startswith("70b.yaml: target.parallel: replicate needs about ") and "139.8 GiB available" in msg
    assert "target 131." in msg  # 70.6 B parameters in bf16, whole on the rank
    cfg.target.parallel = {"tensor": 8}
    from trainer.run.build import plan_memory as plan  # the same plan fits when split 8 ways over 8 GPUs

    fits = plan(cfg, torch.device("cpu"), Layout("tensor", 8, 1, 0), "70b.yaml")
    assert fits["total"] < 139.8 and fits["target"] < 20


def test_the_refusal_is_exit_2_in_one_line_through_the_trainer(tmp_path):
    cfg = tmp_path / "70b.yaml"
    cfg.write_text(json.dumps({**LLAMA_70B, "attention": {"backend": "dense"}}))
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.train", "--config", str(cfg), "--run-dir", str(tmp_path / "r")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "target.parallel: replicate needs about" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "value, expect",
    [({"tensor": 0}, "N from 1 to 64"), ("tp2", "expected replicate"), ({"tensor": 2, "x": 1}, "expected replicate")],
)
def test_bad_parallel_values_name_the_key(value, expect):
    with pytest.raises(ConfigError, match=f"c.yaml: target.parallel: .*{expect}"):
        from_dict({"target": {"random_preset": "tiny-qwen3", "parallel": value}}, "c.yaml")
