"""Inductor's graph cache as the trainer reports it (the preflight record's `compile_cache`), with Inductor for real
(C++ on the CPU): a second run on a kept cache finds every graph and trains the same; on/off keys as YAML reads them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_trainer_cli

CONFIG = """
target: {random_preset: tiny-qwen3, dtype: float32, compile: off}
drafter: {num_layers: 1, block_size: 8, compile: on}
attention: {backend: dense}
data: {anchors_per_seq: 16, seq_buckets: [128], synthetic_samples: 4, holdout: 1}
eval: {at_end: false}
device: cpu
steps: 2
"""


def test_on_and_off_read_as_yaml_booleans_are_accepted(tmp_path):
    from trainer.config import load_config

    path = tmp_path / "t.yaml"
    path.write_text(CONFIG.replace("compile: on", "compile: true"))
    cfg = load_config(str(path))
    assert (cfg.drafter.compile, cfg.target.compile) == ("on", "off")


def run(tmp_path: Path, name: str, cache: Path) -> list[dict]:
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(CONFIG)
    run_dir = tmp_path / name
    proc = run_trainer_cli(cfg, "--run-dir", str(run_dir), env={"TORCHINDUCTOR_CACHE_DIR": str(cache)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_second_run_on_a_kept_cache_finds_every_graph_and_trains_the_same(tmp_path):
    cache = tmp_path / "cache"
    cold, warm = run(tmp_path, "cold", cache), run(tmp_path, "warm", cache)
    pre = [next(r for r in recs if r.get("event") == "preflight") for recs in (cold, warm)]
    assert pre[0]["compile_cache"]["hits"] == 0 and pre[0]["compile_cache"]["misses"] > 0, pre[0]
    assert pre[1]["compile_cache"] == {"hits": pre[0]["compile_cache"]["misses"], "misses": 0}, pre[1]
    losses = [[r["loss"] for r in recs if "event" not in r] for recs in (cold, warm)]
    assert losses[0] == losses[1] and len(losses[0]) == 2
