"""Chat data with a real tokenizer and template, `regenerate`, and tau measured by real speculative decoding."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import run_trainer_cli
from trainer.config import from_dict
from trainer.data.dataset import make_dataset, parse_record
from trainer.data.tiny import build_tokenizer
from trainer.run import eval as spec
from trainer.run.build import build
from trainer.run.training import train

ROOT = Path(__file__).resolve().parents[2]


def test_loss_mask_covers_assistant_turns_only():
    tok = build_tokenizer()
    msgs = [
        {"role": "system", "content": "say what is next ."},
        {"role": "user", "content": "please count after one ."},
        {"role": "assistant", "content": "two three four ."},
        {"role": "user", "content": "next ?"},
        {"role": "assistant", "content": "five six ."},
    ]
    ids, mask = parse_record({"messages": msgs}, tok)
    assert ids.numel() == mask.numel()
    trained = tok.decode(ids[mask.bool()].tolist())
    assert trained.split() == ["two", "three", "four", ".", "<|im_end|>", "five", "six", ".", "<|im_end|>"]
    ids2, mask2 = parse_record({"prompt": "please count after one .", "response": "two three ."}, tok)
    assert tok.decode(ids2[mask2.bool()].tolist()).split() == ["two", "three", ".", "<|im_end|>"]


def test_dataset_drops_samples_too_short_for_a_block_and_truncates_long_ones(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [
        {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]},
        {"input_ids": [5, 6], "loss_mask": [0, 0]},
        {"input_ids": list(range(300)), "loss_mask": [1] * 300},
        {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = from_dict(
        {
            "target": {"random_preset": "tiny-qwen3"},
            "drafter": {"block_size": 8},
            "data": {"path": str(path), "anchors_per_seq": 16, "seq_buckets": [128], "holdout": 1},
        }
    )
    ds = make_dataset(cfg.data, 256, 8, 0)
    assert (len(ds.samples) + len(ds.heldout), ds.dropped_too_short, ds.truncated) == (3, 1, 1)
    long = next(s for s in ds.samples + ds.heldout if s[0].numel() == 128)  # cut to the largest bucket
    assert long[0].tolist() == list(range(128)) and long[1].tolist() == [1] * 128


def test_chat_training_from_a_target_directory(tmp_path, tiny_dir):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"""
target: {{path: {tiny_dir / "target"}, dtype: float32}}
drafter: {{num_layers: 1, block_size: 8}}
attention: {{backend: dense}}
data: {{path: {tiny_dir / "chat.jsonl"}, anchors_per_seq: 16, seq_buckets: [128], holdout: 2}}
device: cpu
steps: 2
eval: {{prompts: 2, max_new_tokens: 8, prompt_file: {tmp_path / "gsm8k.jsonl"}}}
""")
    lines = ['{"question": "please count after two ."}', '{"question": "' + "count " * 200 + '"}']
    (tmp_path / "gsm8k.jsonl").write_text("\n".join(lines) + "\n")
    proc = run_trainer_cli(cfg)
    assert proc.returncode == 0, proc.stderr
    assert "data: 22 samples, 2 held out" in proc.stdout and "step 2/2" in proc.stdout
    # tau on the named prompt set, through the chat template; the prompt too long for the bucket skipped, not cut
    assert "eval step 2 on gsm8k: tau" in proc.stdout and "over 1 prompts" in proc.stdout
    assert "1 prompts skipped as too long" in proc.stdout


def regenerate(tmp_path, tiny_dir, inp: Path, out: Path, *extra: str) -> list[str]:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"target: {{path: {tiny_dir / 'target'}, dtype: float32}}\ndevice: cpu\n")
    return [
        sys.executable,
        "-m",
        "trainer.regenerate",
        "--config",
        str(cfg),
        "--input",
        str(inp),
        "--output",
        str(out),
        "--max-new-tokens",
        "6",
        "--quiet",
        *extra,
    ]


def multi_turn(first_answer: str) -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": "please count after two ."},
                {"role": "assistant", "content": first_answer},
                {"role": "user", "content": "then count after five ."},
                {"role": "assistant", "content": "six seven"},
            ]
        },
        {"prompt": "list colours after red ?", "response": "green"},
    ]


def regenerate_here(cmd: list[str], capsys) -> tuple[int, str]:
    """`python -m trainer.regenerate ARGS` in this process (its model load costs a second, not a new interpreter)."""
    from trainer.data import regenerate as regen

    code = regen.main(cmd[cmd.index("trainer.regenerate") + 1 :])
    out, err = capsys.readouterr()
    return code, out + err


def test_regenerate_rewrites_every_assistant_turn_on_the_rewritten_history(tmp_path, tiny_dir, capsys):
    """Two datasets that differ only in the first answer come out identical: the second turn was conditioned on the
    regenerated first answer, not on the dataset's own."""
    outs = []
    for name, answer in (("a", "three four"), ("b", "nine nine nine red")):
        inp, out = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.out.jsonl"
        inp.write_text("".join(json.dumps(r) + "\n" for r in multi_turn(answer)))
        code, said = regenerate_here(regenerate(tmp_path, tiny_dir, inp, out, "--batch-size", "2"), capsys)
        assert code == 0 and "wrote 2 records (3 turns)" in said and not out.with_name(out.name + ".partial").exists()
        outs.append([json.loads(x) for x in out.read_text().splitlines()])
    a, b = outs
    assert a == b
    msgs = a[0]["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]
    assert msgs[0]["content"] == "please count after two ." and msgs[2]["content"] == "then count after five ."
    assert msgs[1]["content"] != "three four" or msgs[3]["content"] != "six seven"
    assert set(a[1]) == {"prompt", "response"}


def test_regenerate_resumes_after_a_kill_and_equals_an_uninterrupted_run(tmp_path, tiny_dir, capsys):
    whole, inp = tmp_path / "whole.jsonl", tmp_path / "in.jsonl"
    inp.write_text("".join((tiny_dir / "chat.jsonl").read_text().splitlines(keepends=True)[:8]))
    cmd = regenerate(tmp_path, tiny_dir, inp, whole, "--batch-size", "1")
    assert regenerate_here(cmd, capsys)[0] == 0
    out = tmp_path / "resumed.jsonl"
    partial = out.with_name(out.name + ".partial")
    cmd[cmd.index(str(whole))] = str(out)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not partial.exists() or len(partial.read_text().splitlines()) < 4):
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    assert not out.exists(), "the output appears only whole"
    done = len(partial.read_text().splitlines()) - 1
    with open(partial, "a") as f:
        f.write('{"record": 7, "tu')  # a line cut by the kill
    code, said = regenerate_here(cmd, capsys)
    assert code == 0, said
    assert 3 <= done <= 8 and out.read_text() == whole.read_text() and not partial.exists()
    # a partial file of other settings is refused, not mixed in
    partial.write_text(json.dumps({"input_sha256": "x"}) + "\n")
    code, said = regenerate_here(cmd, capsys)
    assert code == 2 and f"{partial}: left by a run with other input" in said
    # while one regenerate writes the output, a second says so in one line
    partial.unlink()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (partial.exists() and partial.read_text().count("\n") >= 2):
            time.sleep(0.02)
        code, said = regenerate_here(cmd, capsys)
        assert code == 2 and "another regenerate is writing this output" in said and "Traceback" not in said
    finally:
        proc.kill()
        proc.wait()
    header = json.loads(partial.read_text().splitlines()[0])
    assert header["dtype"] == "float32" and header["device"] == "cpu" and header["target_files"]
    # resumed on the same target path in bf16: other settings, refused, nothing mixed in
    cfg = Path(cmd[cmd.index("--config") + 1])
    cfg.write_text(cfg.read_text().replace("float32", "bfloat16"))
    code, said = regenerate_here(cmd, capsys)
    assert code == 2 and "left by a run with other input or settings" in said and out.read_text() == whole.read_text()


def test_bad_records_name_file_and_line(tmp_path, tiny_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"text": "no"}\n')
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"target: {{path: {tiny_dir / 'target'}}}\ndrafter: {{block_size: 8}}\nattention: {{backend: dense}}\n"
        f"data: {{path: {bad}, anchors_per_seq: 16, seq_buckets: [128]}}\ndevice: cpu\n"
    )
    proc = run_trainer_cli(cfg)
    assert proc.returncode == 2 and f"{bad}:2" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


TAU_CONFIG = {
    "target": {"random_preset": "tiny-qwen3", "dtype": "float32", "init_std": 0.02},
    "drafter": {"num_layers": 2, "block_size": 8},
    "attention": {"backend": "dense"},
    "data": {"anchors_per_seq": 32, "seq_buckets": [128], "holdout": 8, "batch_size": 4},
    "optim": {"lr": 3e-3},
    "device": "cpu",
    "log_every": 1000,
    "eval": {"prompts": 8, "max_new_tokens": 48},
}


def greedy_oracle(parts, _drafter, _context, seqs: list[list[int]]) -> torch.Tensor:
    """A drafter that proposes the target's own greedy continuation of every row (spec.draft_blocks' contract)."""
    rows = []
    for seq in seqs:
        out = torch.tensor(seq)
        for _ in range(parts.cfg.drafter.block_size - 1):
            out = torch.cat([out, parts.target.logits(out[None])[0, -1].argmax()[None]])
        rows.append(out[len(seq) :])
    return torch.stack(rows)


def test_a_drafter_that_copies_the_target_reaches_tau_equal_block_size(monkeypatch):
    parts = build(from_dict({**TAU_CONFIG, "steps": 1}), for_training=False)

    monkeypatch.setattr(spec, "draft_blocks", greedy_oracle)  # the target's own continuation: all accepted
    # 1 token from the target alone, then five whole blocks of 8: no step capped by max_new_tokens
    r = spec.measure_tau(parts, parts.drafter, [torch.tensor([3, 1, 4, 1])], max_new_tokens=41)
    assert r.steps == 5 and r.tau == 8.0 and r.tau_prompt_mean == 8.0


@pytest.mark.slow
def test_training_on_target_greedy_continuations_raises_tau(tmp_path):
    """tau of a drafter trained on the target's own greedy text vs the same drafter untrained (lr 0)."""
    rng = random.Random(0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"input_ids": [rng.randrange(16) for _ in range(4)] + [0], "loss_mask": [0] * 4 + [1]}) + "\n"
            for _ in range(400)
        )
    )
    data = tmp_path / "regen.jsonl"
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(json.dumps({**TAU_CONFIG, "data": {**TAU_CONFIG["data"], "path": str(data)}}))
    cmd = [
        sys.executable,
        "-m",
        "trainer.regenerate",
        "--config",
        str(cfg_path),
        "--input",
        str(prompts),
        "--output",
        str(data),
        "--max-new-tokens",
        "80",
        "--batch-size",
        "100",
    ]
    subprocess.run(cmd, capture_output=True, timeout=300, cwd=ROOT, check=True)
    base = {**TAU_CONFIG, "data": {**TAU_CONFIG["data"], "path": str(data)}}
    untrained = train(from_dict({**base, "steps": 1, "optim": {"lr": 0.0}}), log=lambda s: None).taus[-1]
    trained = train(from_dict({**base, "steps": 150}), log=lambda s: None).taus[-1]
    print(f"tau untrained {untrained:.3f}, trained {trained:.3f}")
    assert untrained < 1.2 and trained > untrained + 0.3


def test_tau_keeps_whole_prompts_and_stops_at_an_eos_inside_a_block(monkeypatch):
    """B1: a prompt is never cut (a chat prompt would lose its assistant header): too long is skipped.
    B2: an EOS accepted in the middle of a block ends the generation there; nothing after it counts; the last step
    is capped at max_new_tokens."""
    ids = torch.arange(100) % 200
    mask = torch.zeros(100, dtype=torch.long)
    mask[49:] = 1  # a 49-token prompt
    assert spec.prompt_of((ids, mask), 120).tolist() == ids[:49].tolist()
    assert spec.prompt_of((ids, mask), 32) is None

    parts = build(from_dict({**TAU_CONFIG, "steps": 1}), for_training=False)

    prompt = torch.tensor([3, 1, 4, 1, 5])
    greedy = prompt.clone()
    for _ in range(30):
        greedy = torch.cat([greedy, parts.target.logits(greedy[None])[0, -1].argmax()[None]])
    plain = greedy[prompt.numel() :].tolist()
    monkeypatch.setattr(spec, "draft_blocks", greedy_oracle)
    stop = plain[6]  # a token the target produces inside the first drafted block
    monkeypatch.setattr(spec, "eos_ids", lambda _parts: {stop})
    out, gained = spec.speculative_decode(parts, parts.drafter, prompt, max_new_tokens=40)
    first = plain.index(stop)
    assert out == plain[: first + 1] and sum(gained) == len(out) - 1  # the first token is the target's alone
    monkeypatch.setattr(spec, "eos_ids", lambda _parts: set())
    out, gained = spec.speculative_decode(parts, parts.drafter, prompt, max_new_tokens=12)
    assert out == plain[:12] and sum(gained) == 11
