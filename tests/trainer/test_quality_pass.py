"""Every step of the real-target pass (bench/quality/run_pass.sh) at tiny size on the CPU, through run_quality.py as
the pass calls it: the target, its answers by both engines, the feature dump and its subset, ours on the subset and
on every answer with tau measured per checkpoint, prompt lookup in shards, and the record. SpecForge's own training
needs a GPU; its inputs and conversion are tested in test_quality_bench.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "quality"))

import collect_real  # noqa: E402
import run_quality  # noqa: E402

from tests.trainer.test_quality_bench import tiny_target_argv  # noqa: E402

SOURCE = '''
def area{n}(w, h):
    """The area of a w by h box, in square units, for box number {n}."""
    total = w * h
    if total < 0:
        raise ValueError("negative")
    return total
'''


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A pass's WORK after target, data, features, two runs of ours and lookup, at tiny size."""
    src = tmp_path_factory.mktemp("src")
    for n in range(30):
        (src / f"mod{n:02d}.py").write_text(SOURCE.format(n=n) * 2)
    work = tmp_path_factory.mktemp("work")
    target = tiny_target_argv(src, heldout_prompts=4)

    def q(*args: str) -> None:
        argv = [
            "--work",
            str(work),
            "--scale",
            "tiny",
            "--set",
            f"target={json.dumps(target)}",
            "--set",
            "regen_baseline=4",
            "--set",
            "sf_samples=8",
            *args,
        ]
        assert run_quality.main(argv) == 0

    q("--phase", "target")
    q("--phase", "data")
    q("--phase", "features")
    q("--phase", "ours", "--set", "data=sub", "--set", "tag=-s0")
    q("--phase", "ours", "--set", "data=full", "--set", "tag=-full-s0", "--set", "steps=4", "--set", "eval_every=2")
    q("--phase", "lookup")
    return work


def test_answers_come_from_the_static_engine_after_a_baseline_by_generate(work):
    data = json.loads((work / "data.json").read_text())
    assert data["engines"]["hf"]["engine"] == "hf" and data["engines"]["hf"]["prompts"] == 4
    static = data["engines"]["static"]
    assert static["engine"] == "static" and static["prompts"] == data["records"] == 20 and static["tokens"] > 0
    # the same prompts answered by both engines: the same answers (the static engine is exact, float32 on the CPU)
    base = [json.loads(x) for x in (work / "regen-baseline.jsonl").read_text().splitlines()]
    full = [json.loads(x) for x in (work / "regen.jsonl").read_text().splitlines()]
    assert base == full[:4]
    assert len(data["regen_sha256"]) == 64


def test_features_are_dumped_for_the_subset_ours_trains_on(work):
    feats = json.loads((work / "features.json").read_text())
    sub = (work / "regen-sub.jsonl").read_text().splitlines()
    assert feats["answers"] == len(sub) == 8 and 0 < feats["files"] <= 8 and feats["bytes"] > 0
    assert sub == (work / "regen.jsonl").read_text().splitlines()[:8]
    assert json.loads((work / "ours-s0.json").read_text())["config"]["data"]["path"].endswith("regen-sub.jsonl")
    assert json.loads((work / "ours-full-s0.json").read_text())["config"]["data"]["path"].endswith("regen.jsonl")


def test_every_checkpoint_is_measured_on_every_prompt(work):
    for name, steps in (("ours-s0", [3, 6]), ("ours-full-s0", [2, 4])):
        curve = json.loads((work / f"{name}.json").read_text())["tau_vs_step"]
        assert [p["step"] for p in curve] == steps
        assert all(p["prompts"] == 3 and p["tau"] >= 1.0 and p["decode_s"] > 0 for p in curve)
        for p in curve:
            rows = (work / f"tau-drafter-{name}-step{p['step']}.jsonl").read_text().splitlines()
            assert len(rows) == 3


def test_lookup_shards_add_up_to_every_prompt(work):
    lookup = json.loads((work / "lookup.json").read_text())
    rows = [json.loads(x) for x in (work / "lookup-prompts.jsonl").read_text().splitlines()]
    assert lookup["shards"] == 2 and [r["index"] for r in rows] == [0, 1, 2]
    measured = [r for r in rows if r["tau"] is not None]
    assert lookup["prompts"] == len(measured)
    if measured:
        assert lookup["tau_pooled"] == round(
            sum(r["tokens"] for r in measured) / sum(r["draft_steps"] for r in measured), 4
        )


def test_the_record_has_every_run_and_the_keys_the_issue_asks_for(work, tmp_path):
    out = tmp_path / "quality-real.json"
    assert (
        collect_real.main([str(work), "--out", str(out), "--plot", str(tmp_path / "p.png"), "--machine", "one CPU"])
        == 0
    )
    rec = json.loads(out.read_text())
    assert rec["machine"] == "one CPU" and rec["target"]["answers"] == 20
    runs = [r for r in rec["runs"] if r["trainer"] != "lookup"]
    want = {("ours", 0, 3), ("ours", 0, 6), ("ours-full", 0, 2), ("ours-full", 0, 4)}
    assert {(r["trainer"], r["seed"], r["step"]) for r in runs} == want
    assert all(r["gpu_s"] is not None and r["tau_pooled"] >= 1.0 for r in runs)
    assert rec["regeneration"]["static"]["tokens"] > 0 and rec["specforge_features"]["answers"] == 8
    assert "ours_tau_pooled_at_sf_gpu_s" in rec  # None here: no SpecForge run on a CPU
    assert rec["summary"]["ours-full"]["step"] == 4
