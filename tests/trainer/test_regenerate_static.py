"""The static decoder (trainer.data.static_decode) gives exactly each prompt's greedy continuation by
`model.generate` alone: left padding, per-row positions, grouped-query attention, q/k norms, per-row EOS, a batch
smaller than the decoder's rows. Real torch and transformers models on the CPU, float32, tiny shapes. The CUDA
graph path replays the same `_step`; a CUDA machine runs it too (skipped here)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from trainer.data.static_decode import StaticDecoder

SHAPES = {
    "qwen3": dict(
        model_type="qwen3",
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.3,
    ),
    "qwen2": dict(
        model_type="qwen2",
        vocab_size=97,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=1e6,
        tie_word_embeddings=True,
        initializer_range=0.3,
    ),
}


def tiny(kind: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**SHAPES[kind]), dtype=torch.float32).eval()


def greedy_alone(model, prompt: list[int], n: int, eos: set[int]) -> list[int]:
    """The reference: one prompt, no padding, generate's own loop with its own cache."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=n,
        eos_token_id=sorted(eos) or None,
        pad_token_id=0,
    )[0, len(prompt) :].tolist()
    return out[: next((i + 1 for i, t in enumerate(out) if t in eos), len(out))]


@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_static_decoder_equals_generate_prompt_by_prompt(kind):
    model = tiny(kind)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 97, (n,), generator=g).tolist() for n in (3, 17, 9, 30, 1)]
    plain = [greedy_alone(model, p, 20, set()) for p in prompts]
    # an end token that one row meets early and the others later or never: each row stops on its own
    eos = {plain[1][4]}
    want = [greedy_alone(model, p, 20, eos) for p in prompts]
    assert len({len(w) for w in want}) > 1, "the test needs rows that stop at different steps"
    dec = StaticDecoder(model, rows=8, max_prompt=30, max_new=20, eos=eos, pad=0, graphs=False)
    assert dec.generate(prompts, check_every=4) == want
    # the same decoder again (stale cache from the first batch), another grouping of the prompts
    assert dec.generate(prompts[2:], check_every=3) == want[2:]


def test_static_decoder_refuses_what_does_not_fit():
    dec = StaticDecoder(tiny("qwen3"), rows=2, max_prompt=8, max_new=4, eos={1}, pad=0, graphs=False)
    with pytest.raises(ValueError, match="3 prompts for a decoder of 2 rows"):
        dec.generate([[2], [3], [4]])
    with pytest.raises(ValueError, match="does not fit the cache"):
        dec.generate([[2] * (dec.capacity - 2)])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_replay_the_eager_step():
    model = tiny("qwen3").cuda()
    prompts = [[5, 6, 7], list(range(1, 40)), [9]]
    eager = StaticDecoder(model, rows=4, max_prompt=40, max_new=150, eos={3}, pad=0, graphs=False)
    graphed = StaticDecoder(model, rows=4, max_prompt=40, max_new=150, eos={3}, pad=0, graphs=True)
    assert graphed.generate(prompts) == eager.generate(prompts)


def test_regenerate_cli_static_equals_generate(tmp_path, tiny_dir, capsys):
    """`trainer.regenerate` with the static engine writes the same file as with model.generate, and its counts."""
    from trainer.data import regenerate as regen

    inp = tmp_path / "in.jsonl"
    inp.write_text("".join((tiny_dir / "chat.jsonl").read_text().splitlines(keepends=True)[:6]))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"target: {{path: {tiny_dir / 'target'}, dtype: float32}}\ndevice: cpu\n")
    outs = {}
    for engine in ("hf", "static"):
        out, stats = tmp_path / f"{engine}.jsonl", tmp_path / f"{engine}.stats.json"
        code = regen.main(
            [
                "--config",
                str(cfg),
                "--input",
                str(inp),
                "--output",
                str(out),
                "--max-new-tokens",
                "7",
                "--batch-size",
                "4",
                "--engine",
                engine,
                "--stats",
                str(stats),
                "--quiet",
            ]
        )
        assert code == 0, capsys.readouterr()
        outs[engine] = out.read_text()
        counts = json.loads(stats.read_text())
        assert counts["engine"] == engine and counts["turns"] >= 6 and counts["tokens"] > 0
    assert outs["static"] == outs["hf"]
    code = regen.main(
        [
            "--config",
            str(cfg),
            "--input",
            str(inp),
            "--output",
            str(tmp_path / "x.jsonl"),
            "--engine",
            "static",
            "--temperature",
            "0.7",
        ]
    )
    assert code == 2 and "decodes greedily" in capsys.readouterr().err
