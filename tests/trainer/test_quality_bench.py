"""The quality benchmark's CPU half, at tiny size: the target it makes, its prompts and split, SpecForge's inputs
written from that target, the conversion of a saved drafter, and prompt lookup. The numbers live in docs/benchmarks.md.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "quality"))

import make_target  # noqa: E402
import prompt_lookup  # noqa: E402
import specforge_side  # noqa: E402

SOURCE = '''
class Box{n}:
    def area(self, w, h):
        """The area of a w by h box, in square units."""
        total = w * h
        if total < 0:
            raise ValueError("negative")
        return total

    def scaled(self, k):
        """This box with every side times k."""
        out = Box{n}()
        out.k = k * {n}
        return out
'''


def tiny_target_argv(src: Path, heldout_prompts: int) -> list[str]:
    """make_target's arguments for a tiny target trained on CPU from the files under `src` (also the real pass's
    target phase at tiny size, tests/trainer/test_quality_pass.py)."""
    return [
        "--size",
        "tiny",
        "--roots",
        str(src),
        "--steps",
        "2",
        "--batch",
        "2",
        "--seq",
        "32",
        "--heldout-percent",
        "20",
        "--eval-tokens",
        "256",
        "--device",
        "cpu",
        "--train-prompts",
        "20",
        "--heldout-prompts",
        str(heldout_prompts),
    ]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A tiny target made twice from the same seed over 40 small files (hermetic: not the stdlib)."""
    src = tmp_path_factory.mktemp("src")
    for n in range(40):
        (src / f"mod{n:02d}.py").write_text(SOURCE.format(n=n) * 3)
    outs = []
    for name in ("a", "b"):
        out = tmp_path_factory.mktemp(name)
        argv = ["--out", str(out), *tiny_target_argv(src, heldout_prompts=5)]
        assert make_target.main(argv) == 0
        outs.append(out)
    return outs


def test_the_target_loads_as_hf_and_reports_its_held_out_loss(made):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = made[0]
    model = AutoModelForCausalLM.from_pretrained(out / "target")
    tok = AutoTokenizer.from_pretrained(out / "target")
    assert model.config.model_type == "qwen3" and model.config.vocab_size == len(tok) <= 512
    assert tok.mask_token == "<|mask|>" and tok.eos_token == "<|im_end|>"
    report = json.loads((out / "target.json").read_text())
    assert 0 < report["heldout_loss_nats_per_token"] < 10 and report["heldout_files"] >= 1
    assert report["train_files"] + report["heldout_files"] == report["files"] == 40


def test_the_same_seed_makes_the_same_target(made):
    digest = [hashlib.sha256((m / "target" / "model.safetensors").read_bytes()).hexdigest() for m in made]
    assert digest[0] == digest[1]
    prompts = [(m / "prompts" / "heldout.jsonl").read_text() for m in made]
    assert prompts[0] == prompts[1]


def test_whole_files_are_held_out_and_prompts_are_humaneval_records(made):
    from trainer.data.prompts import read_prompts

    name, convs = read_prompts(made[0] / "prompts" / "heldout.jsonl")
    assert name == "heldout" and convs
    for conv in convs:
        assert conv.turns[0].startswith("def ") and '"""' in conv.turns[0]
    train = [json.loads(x) for x in (made[0] / "prompts" / "train.jsonl").read_text().splitlines()]
    assert all(set(r) == {"prompt", "response"} and r["response"].startswith("    ") for r in train)
    files = [f"r/mod{n:02d}.py" for n in range(40)]
    held = {f for f in files if make_target.is_heldout(f, 0, 20)}
    assert held and held != set(files)
    assert make_target.is_heldout("r/mod00.py", 0, 20) == make_target.is_heldout("r/mod00.py", 0, 20)


def test_a_function_splits_into_its_request_and_its_body():
    fns = make_target.functions(SOURCE.format(n=7))
    area = next(f for f in fns if "area" in f.prompt)
    assert area.prompt == 'def area(self, w, h):\n    """The area of a w by h box, in square units."""\n'
    assert area.body.startswith("    total = w * h\n") and area.body.endswith("    return total\n")
    assert make_target.functions("def broken(:\n") == []


def test_the_template_prompt_is_a_token_prefix_of_the_answered_chat(made):
    """What the target is asked at inference must tokenize as the start of what it was trained on: a newline glued
    to the indentation after it would make the prompt end in a token it never saw there."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(made[0] / "target")
    for rec in map(json.loads, (made[0] / "prompts" / "train.jsonl").read_text().splitlines()[:10]):
        asked = tok.apply_chat_template(
            [{"role": "user", "content": rec["prompt"]}], tokenize=False, add_generation_prompt=True
        )
        fn = make_target.Function(rec["prompt"], rec["response"])
        assert make_target.chat_text(fn).startswith(asked)
        trained = tok(make_target.chat_text(fn), add_special_tokens=False)["input_ids"]
        prompt_ids = tok(asked, add_special_tokens=False)["input_ids"]
        assert trained[: len(prompt_ids)] == prompt_ids


def test_specforge_features_are_the_target_layers_side_by_side(made, tmp_path):
    from transformers import AutoModelForCausalLM

    from trainer.model.target import default_layer_ids

    out = made[0]
    data = tmp_path / "data.jsonl"
    data.write_text((out / "prompts" / "train.jsonl").read_text())
    feat = tmp_path / "feat"
    argv = [
        "dump",
        "--target",
        str(out / "target"),
        "--data",
        str(data),
        "--layers",
        "1",
        "--max-len",
        "64",
        "--batch",
        "3",
        "--out",
        str(feat),
    ]
    assert specforge_side.main(argv) == 0
    files = sorted(feat.glob("data_*.ckpt"))
    assert len(files) > 3
    model = AutoModelForCausalLM.from_pretrained(out / "target")
    (layer,) = default_layer_ids(model.config.num_hidden_layers, 1)
    lengths = set()
    for f in files[:6]:  # batched with padding, each row equals its forward alone
        sample = torch.load(f)
        assert set(sample) == {"input_ids", "loss_mask", "hidden_states"}
        lengths.add(sample["input_ids"].numel())
        with torch.no_grad():
            hs = model(input_ids=sample["input_ids"][None], output_hidden_states=True).hidden_states
        assert sample["hidden_states"].shape == (sample["input_ids"].numel(), model.config.hidden_size)
        torch.testing.assert_close(sample["hidden_states"].float(), hs[layer + 1][0], atol=2e-2, rtol=2e-2)
        assert sample["loss_mask"].sum() >= 2 and sample["loss_mask"][0] == 0
    assert len(lengths) > 1, "the test needs rows of different lengths in a batch"


def test_specforge_config_matches_our_drafter_and_a_saved_drafter_converts(made, tmp_path):
    from safetensors.torch import load_file, save_file

    out = made[0]
    run = tmp_path / "run"
    argv = [
        "config",
        "--target",
        str(out / "target"),
        "--features",
        str(tmp_path / "feat"),
        "--layers",
        "1",
        "--block",
        "8",
        "--steps",
        "5",
        "--anchors",
        "16",
        "--out",
        str(run),
    ]
    assert specforge_side.main(argv) == 0
    draft = json.loads((run / "draft_config.json").read_text())
    assert draft["block_size"] == 8 and draft["num_hidden_layers"] == 1
    assert draft["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": [1]}
    import yaml

    cfg = yaml.safe_load((run / "run.yaml").read_text())
    assert cfg["training"]["max_steps"] == 5 and cfg["training"]["num_anchors"] == 16
    assert cfg["deployment"]["mode"] == "local_colocated"
    saved = tmp_path / "hf"
    saved.mkdir()
    (saved / "config.json").write_text(json.dumps(draft))
    save_file(
        {
            "model.layers.0.mlp.up_proj.weight": torch.ones(2, 2),
            "fc.weight": torch.ones(2, 3),
            "embed_tokens.weight": torch.ones(4, 2),
        },
        str(saved / "model.safetensors"),
    )
    assert specforge_side.main(["convert", "--checkpoint", str(saved), "--out", str(tmp_path / "conv")]) == 0
    tensors = load_file(str(tmp_path / "conv" / "model.safetensors"))
    assert set(tensors) == {"layers.0.mlp.up_proj.weight", "fc.weight"}
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert specforge_side.main(["convert", "--checkpoint", str(tmp_path / "empty"), "--out", str(tmp_path / "x")]) == 2


def test_prompt_lookup_counts_tokens_per_verifying_forward(made, capsys):
    out = made[0]
    code = prompt_lookup.main(
        [
            "--target",
            str(out / "target"),
            "--prompts",
            str(out / "prompts" / "heldout.jsonl"),
            "--limit",
            "2",
            "--max-new-tokens",
            "6",
            "--json",
        ]
    )
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["method"] == "prompt_lookup" and result["prompt_set"] == "heldout"
    if result["prompts"]:
        assert 1.0 <= result["tau_pooled"] <= 11 and 1.0 <= result["tau_prompt_mean"] <= 11


def test_specforge_step_times_are_read_from_its_own_progress_lines():
    """Its log as SpecForge 0.2.0 writes it (recorded on an H200): the median step time of the second half, the loss."""
    import run_quality

    log = ROOT / "tests" / "fixtures" / "specforge" / "train-0.2.0.log"
    stats = run_quality.specforge_log_stats(log)
    rows = [line for line in log.read_text().splitlines() if line.startswith("step ")]
    late = sorted(
        float(line.split("'train/perf/optimizer_step_time_s': ")[1].split(",")[0])
        for line in rows
        if int(line.split()[1].rstrip(":")) > 600
    )
    assert stats["step_time_ms_median"] == round(1000 * late[len(late) // 2], 2)
    assert 20 < stats["step_time_ms_median"] < 200  # one progress line's 3.35 s compile step is in the first half
    steps = [k for k, _ in stats["loss"]]
    assert steps[0] == 10 and steps == sorted(steps) and all(0 < loss < 10 for _, loss in stats["loss"])


def test_the_curves_plot_from_a_results_file(tmp_path):
    import plot_quality

    results = {
        "yardstick": "40 prompts",
        "prompt_lookup": {"tau_prompt_mean": 3.2},
        "ours": {"tau_vs_step": [{"step": 300, "tau": 1.4}, {"step": 600, "tau": 2.0}], "step_time_ms_median": 34},
        "specforge": {"tau_vs_step": [{"step": 300, "tau": 1.5}], "step_time_ms_median": None},
    }
    source, out = tmp_path / "r.json", tmp_path / "curve.png"
    source.write_text(json.dumps(results))
    assert plot_quality.main([str(source), str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    assert plot_quality.main(["one-argument"]) == 2
    # a pass with variants keeps every training under "runs": each is a curve with its own label
    curve = [{"step": 300, "tau": 1.4}, {"step": 600, "tau": 2.0}]
    runs = {"runs": {name: {"tau_vs_step": curve, "step_time_ms_median": 42} for name in ("ours", "ours-b2", "x")}}
    source.write_text(json.dumps(runs))
    import matplotlib.pyplot as plt

    drawn = []
    real_savefig = plt.Figure.savefig
    plt.Figure.savefig = lambda fig, *a, **k: (
        drawn.extend(t.get_text() for t in fig.axes[0].get_legend().get_texts()),
        real_savefig(fig, *a, **k),
    )
    try:
        assert plot_quality.main([str(source), str(out)]) == 0
    finally:
        plt.Figure.savefig = real_savefig
    assert drawn == ["dflashctl trainer, 42 ms/step", "ours, betas (0.9, 0.999), 42 ms/step", "x, 42 ms/step"]


def test_variant_settings_take_json_or_a_bare_word():
    import run_quality

    sets = run_quality.parse_sets(["tag=-b2", "betas=[0.9,0.999]", "init_std=0.02", 'tag2="-x"'])
    assert sets == {"tag": "-b2", "betas": [0.9, 0.999], "init_std": 0.02, "tag2": "-x"}
    assert run_quality.ours_name(sets) == "ours-b2"


def test_paired_taus_count_wins_and_bracket_the_mean_difference(tmp_path):
    import pair_taus

    a = {i: 2.0 for i in range(20)}
    b = {i: 2.0 + (0.5 if i % 4 else -0.5) for i in range(20)}  # 15 higher by 0.5, 5 lower by 0.5
    r = pair_taus.paired(a, b)
    assert r["prompts"] == 20 and r["prompts_b_higher"] == 15 and r["prompts_a_higher"] == 5
    assert r["b_minus_a"] == pytest.approx(0.25)
    lo, hi = r["bootstrap_95"]
    assert lo < 0.25 < hi and lo > 0  # 15 of 20 ahead: the interval stays above zero
    (tmp_path / "x.jsonl").write_text('{"index": 3, "tau": 1.5}\n\n{"index": 4, "tau": 2.5}\n')
    assert pair_taus.per_prompt(tmp_path / "x.jsonl") == {3: 1.5, 4: 2.5}
