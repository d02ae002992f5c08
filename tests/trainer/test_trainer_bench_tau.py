"""`python -m trainer.bench_tau`: tau of a drafter in the public format on prompt files in the formats people have
(GSM8K, HumanEval, MT-Bench, chat), through the target's chat template. Small files are written here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.config import from_dict
from trainer.data.prompts import read_prompts, render
from trainer.model.dflash_format import draft_config, write_export
from trainer.run.build import build
from trainer.serve import bench_tau

MAX_NEW = 10


@pytest.fixture(scope="module")
def drafter_dir(tiny_dir, tmp_path_factory):
    """An (untrained) drafter for the tiny target, in the public format."""
    cfg = from_dict(
        {
            "target": {"path": str(tiny_dir / "target"), "dtype": "float32"},
            "drafter": {"num_layers": 2, "block_size": 8},
            "attention": {"backend": "dense"},
            "data": {"seq_buckets": [128]},
            "device": "cpu",
        }
    )
    parts = build(cfg, for_training=False)
    from trainer.model.drafter import drafter_dims

    dims = drafter_dims(parts.target.config, 2, len(parts.target.layer_ids), {})
    config = draft_config(dims, 8, parts.target.layer_ids, parts.mask_token_id, parts.target.config)
    return write_export(tmp_path_factory.mktemp("drafter") / "export", parts.drafter.state_dict(), config, "float32")


@pytest.fixture
def prompt_files(tmp_path):
    files = {
        "gsm8k": [
            {"question": "please count after two .", "answer": "three"},
            {"question": "list colours after red ?", "answer": "green"},
        ],
        "humaneval": [{"task_id": "t/0", "prompt": "tell me about numbers ."}],
        "mt_bench": [{"question_id": 81, "turns": ["please count after five .", "then count after nine ."]}],
        "chat": [
            {
                "messages": [
                    {"role": "system", "content": "say what is next ."},
                    {"role": "user", "content": "count after one ."},
                    {"role": "assistant", "content": "two three"},
                ]
            }
        ],
    }
    paths = {}
    for name, recs in files.items():
        paths[name] = tmp_path / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in recs))
    return paths


def cpu_args(tiny_dir: Path, *more: str) -> list[str]:
    """bench_tau's arguments for the tiny target on the CPU in float32, quiet, the summary as JSON; then `more`."""
    return [
        "--target",
        str(tiny_dir / "target"),
        "--max-new-tokens",
        str(MAX_NEW),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--quiet",
        "--json",
        *more,
    ]


def run(capsys, *argv) -> tuple[int, str, str]:
    code = bench_tau.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_every_format_is_measured_and_both_taus_are_named(capsys, tiny_dir, drafter_dir, prompt_files, tmp_path):
    per_prompt = tmp_path / "per_prompt.jsonl"
    args = cpu_args(tiny_dir, "--drafter", str(drafter_dir), "--out", str(per_prompt))
    for p in prompt_files.values():
        args += ["--prompts", str(p)]
    code, out, _ = run(capsys, *args)
    assert code == 0
    summary = json.loads(out)
    sets = {s["prompt_set"]: s for s in summary["sets"]}
    assert set(sets) == {"gsm8k", "humaneval", "mt_bench", "chat"}
    assert [sets[n]["prompts"] for n in ("gsm8k", "humaneval", "mt_bench", "chat")] == [2, 1, 1, 1]
    for s in sets.values():
        assert 1.0 <= s["tau_prompt_mean"] <= 8 and 1.0 <= s["tau_pooled"] <= 8
        assert s["tau_pooled"] == pytest.approx(s["tokens"] / s["draft_steps"], abs=1e-4)
    assert sets["mt_bench"]["tokens"] <= 2 * MAX_NEW and sets["gsm8k"]["tokens"] <= 2 * MAX_NEW  # the caps hold
    lines = [json.loads(x) for x in per_prompt.read_text().splitlines()]
    assert len(lines) == 5 and {x["prompt_set"] for x in lines} == set(sets)
    assert [x["turns"] for x in lines if x["prompt_set"] == "mt_bench"] == [2]  # each turn answered in order


def test_a_prompt_that_cannot_fit_is_skipped_and_counted_never_cut(capsys, tiny_dir, drafter_dir, tmp_path):
    short, long_ = tmp_path / "mixed.jsonl", "count " * 120
    short.write_text(json.dumps({"question": "count after two ."}) + "\n" + json.dumps({"question": long_}) + "\n")
    tok_limit = bench_tau.length_limit([5], 1, MAX_NEW, 8)  # what a 5-token prompt alone would get
    from trainer.data.dataset import load_tokenizer

    tok = load_tokenizer(str(tiny_dir / "target"))
    _, convs = read_prompts(short)
    parts = bench_tau.build_parts(str(tiny_dir / "target"), str(drafter_dir), tok_limit, "cpu", "float32")
    assert bench_tau.decode_conversation(parts, tok, convs[1], MAX_NEW, False, tok_limit) is None
    gained, turns = bench_tau.decode_conversation(parts, tok, convs[0], MAX_NEW, False, tok_limit)
    assert turns == 1 and gained


@pytest.mark.parametrize(
    "line, where",
    [
        ("{not json", "p.jsonl:2"),
        ('{"answer": "4"}', "p.jsonl:2: expected one of"),
        ('{"turns": []}', "p.jsonl:2"),
        ('{"messages": [{"role": "assistant", "content": "x"}]}', "p.jsonl:2: messages has no user message"),
        ("[1, 2]", "p.jsonl:2: expected an object"),
    ],
)
def test_a_bad_prompt_line_is_one_line_naming_file_and_line_exit_2(capsys, tmp_path, tiny_dir, line, where):
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"question": "count after two ."}) + "\n" + line + "\n")
    code, out, err = run(capsys, "--target", str(tiny_dir / "target"), "--drafter", str(tmp_path), "--prompts", str(p))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and where in err


def test_a_drafter_of_another_shape_or_no_export_is_exit_2(capsys, tmp_path, tiny_dir, prompt_files):
    code, _, err = run(
        capsys,
        "--target",
        str(tiny_dir / "target"),
        "--drafter",
        str(tmp_path / "none"),
        "--prompts",
        str(prompt_files["gsm8k"]),
        "--device",
        "cpu",
    )
    assert code == 2 and len(err.strip().splitlines()) == 1 and "none" in err


def test_thinking_switch_reaches_the_chat_template(tiny_dir):
    from trainer.data.dataset import load_tokenizer

    tok = load_tokenizer(str(tiny_dir / "target"))
    tok.chat_template = tok.chat_template + "{% if enable_thinking is defined and not enable_thinking %}say {% endif %}"
    msgs = [{"role": "user", "content": "count after two ."}]
    on, off = render(tok, msgs, True), render(tok, msgs, False)
    assert off == on + [tok.convert_tokens_to_ids("say")]


def test_one_huge_prompt_is_skipped_and_does_not_set_the_length_limit(capsys, tiny_dir, drafter_dir, tmp_path):
    p = tmp_path / "huge.jsonl"
    lines = [{"question": "count after two ."}, {"question": "count " * 30000}]
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    args = cpu_args(tiny_dir, "--drafter", str(drafter_dir), "--prompts", str(p))
    code, out, _ = run(capsys, *args)
    assert code == 0
    (s,) = json.loads(out)["sets"]
    assert s["prompts"] == 1 and s["skipped"] == 1  # the 30,000-token prompt was never decoded
    code, out, err = run(capsys, *args, "--max-prompt-tokens", "3")  # every prompt skipped: nothing measured
    assert code == 2 and out == "" and "huge: nothing to measure: 2 prompts, 2 skipped" in err
    code, _, err = run(capsys, *args, "--max-prompt-tokens", "0")
    assert code == 2 and "--max-prompt-tokens" in err


def test_the_reference_placement_of_block_size_is_read(capsys, tmp_path, tiny_dir, drafter_dir, prompt_files):
    """z-lab's published configs (and SpecForge's export) put block_size at the top level, not in dflash_config."""
    moved = tmp_path / "reference-layout"
    moved.mkdir()
    config = json.loads((drafter_dir / "config.json").read_text())
    config["dflash_config"].pop("block_size")
    assert config["block_size"] == 8
    (moved / "config.json").write_text(json.dumps(config))
    (moved / "model.safetensors").symlink_to(drafter_dir / "model.safetensors")
    args = cpu_args(tiny_dir, "--prompts", str(prompt_files["gsm8k"]))
    code, out, err = run(capsys, *args, "--drafter", str(moved))
    assert code == 0, err
    assert json.loads(out)["block_size"] == 8
    code, original, _ = run(capsys, *args, "--drafter", str(drafter_dir))
    assert json.loads(out)["sets"] == [
        {**s, "seconds": json.loads(out)["sets"][0]["seconds"]} for s in json.loads(original)["sets"]
    ]


def test_a_prompt_file_with_no_prompt_is_exit_2(capsys, tmp_path, tiny_dir, drafter_dir):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    code, out, err = run(
        capsys,
        "--target",
        str(tiny_dir / "target"),
        "--drafter",
        str(drafter_dir),
        "--prompts",
        str(empty),
        "--device",
        "cpu",
        "--quiet",
    )
    assert code == 2 and out == "" and "empty.jsonl: --prompts: no prompts in the file" in err
