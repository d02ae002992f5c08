"""`python -m trainer.train`: config errors are one line with file and key, exit status 2, most before torch.

A tiny run that finishes is test_trainer_run's (a random target, its stdout and run dir) and test_trainer_data_eval's
(a target directory, no run dir): not trained again here."""

from __future__ import annotations

import pytest

from tests.conftest import TESTS, run_trainer_cli

BASE = """
target: {random_preset: tiny-qwen3, dtype: float32}
drafter: {num_layers: 1, block_size: 8}
data: {anchors_per_seq: 16, seq_buckets: [128], synthetic_samples: 4}
device: cpu
steps: 2
"""


def run_trainer(tmp_path, text: str):
    cfg = tmp_path / "train.yaml"
    cfg.write_text(text)
    return run_trainer_cli(cfg), str(cfg)


@pytest.mark.parametrize(
    "extra, key",
    [
        ("attention: {backend: dense}\noptim: {learning_rate: 1}\n", "optim.learning_rate: unknown key"),
        ("attention: {backend: flex}\n", "attention.backend: flex has no backward on the CPU"),
        ("attention: {backend: dense, dense_max_gib: 0.0001}\n", "attention.dense_max_gib"),
        ("attention: {backend: sparse}\n", "attention.backend: expected one of flex, dense"),
        ("attention: {backend: dense, flex_backend: fa3}\n", "attention.flex_backend: expected one of auto, triton"),
        ("attention: {backend: dense, flex_backend: flash}\n", "attention.flex_backend: flash (FlashAttention-4)"),
        ("attention: {backend: dense}\nsteps: many\n", "steps: expected int"),
        ("attention: {backend: dense}\ndata: {seq_buckets: [100]}\n", "data.seq_buckets[0]"),
        ("attention: {backend: dense}\ngrad_reduce_dtype: bfloat16\n", "grad_reduce_dtype: a bfloat16 gradient"),
    ],
)
def test_config_errors_are_one_line_exit_2(tmp_path, extra, key):
    proc, path = run_trainer(tmp_path, BASE + extra)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert path in lines[0] and key in lines[0]


def test_malformed_yaml(tmp_path):
    proc, path = run_trainer(tmp_path, "target: [unclosed\n")
    assert proc.returncode == 2 and f"{path}:" in proc.stderr and "malformed YAML" in proc.stderr


@pytest.mark.parametrize(
    "extra, key",
    [
        ("optim: {learning_rate: 1}\n", "optim.learning_rate: unknown key"),
        ("attention: {backend: flex}\n", "attention.backend: flex has no backward on the CPU"),  # device: cpu, said
        (
            "attention: {backend: dense, flex_backend: flash}\n",
            "attention.flex_backend: flash (FlashAttention-4) needs",
        ),
        ("attention: {backend: dense}\ngrad_reduce_dtype: bfloat16\n", "grad_reduce_dtype: a bfloat16 gradient"),
    ],
)
def test_a_bad_config_is_refused_before_torch_is_imported(tmp_path, extra, key):
    """`python -m trainer.config` promises validation without torch; the trainer refuses a bad file the same way, so
    a typo costs a fraction of a second, not torch's import (seconds on a loaded login node). So is what the CPU the
    file names cannot train with."""
    import subprocess
    import sys

    cfg = tmp_path / "train.yaml"
    cfg.write_text(BASE + extra)
    code = (
        "import sys; from trainer.train import main; rc = main(['--config', sys.argv[1]]); "
        "print(rc, 'torch' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(cfg)], capture_output=True, text=True, timeout=60, cwd=TESTS.parent
    )
    assert proc.stdout.split() == ["2", "False"], proc.stderr
    assert key in proc.stderr


def test_the_dense_cap_is_checked_from_the_targets_config_before_its_weights_load(tmp_path):
    """A run whose dense score matrix is over `attention.dense_max_gib` is refused from the target's config.json
    alone: here the target folder has no weights at all, and the refusal is still the cap's, not a missing file."""
    from trainer.config import from_dict
    from trainer.data.tiny import write_tiny_target
    from trainer.errors import ConfigError
    from trainer.run.build import build

    full, bare = tmp_path / "full", tmp_path / "bare"
    write_tiny_target(full)
    bare.mkdir()
    (bare / "config.json").write_text((full / "config.json").read_text())  # the config, no weights, no tokenizer
    cfg = from_dict(
        {
            "target": {"path": str(bare), "dtype": "float32"},
            "drafter": {"num_layers": 1, "block_size": 8},
            "attention": {"backend": "dense", "dense_max_gib": 1e-6},
            "device": "cpu",
            "data": {"anchors_per_seq": 16, "seq_buckets": [128]},
            "steps": 1,
        },
        "t.yaml",
    )
    with pytest.raises(ConfigError, match="attention.dense_max_gib: the dense reference would allocate"):
        build(cfg, "t.yaml")
