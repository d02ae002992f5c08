"""How fast tau is measured: `trainer.bench_tau` batched against one prompt at a time, on the same files.

    python bench/tau_speed.py --target T --drafter D --prompts humaneval.jsonl --prompts mt_bench.jsonl \
        [--max-new-tokens 256] [--batch-sizes 1,64] [--limit-one N] [--dtype bfloat16]
    python bench/tau_speed.py --random DIR [...]    # no weights at hand: a random Qwen2.5-0.5B-shaped target (the
                                                    # tiny word tokenizer), a random 3-layer drafter, 164 + 80x2 prompts

Prints one JSON object: per batch size, the decoding seconds (loading excluded, from bench_tau's own `seconds`), the
tokens gained, tokens/s and both taus, which must agree across batch sizes. `--limit-one N` decodes only the first N
prompts of each set at batch size 1 (it is the slow one); the batched runs always decode every prompt. A random target
never says EOS: every prompt runs to --max-new-tokens at tau 1, the slowest case. Not run in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.serve import bench_tau  # noqa: E402

QWEN25_05B = dict(
    model_type="qwen2",
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1e6,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
)


def write_random(out: Path, device: str) -> tuple[str, str, list[str]]:
    """A random target of Qwen2.5-0.5B's shape, a random 3-layer drafter export and HumanEval/MT-Bench-sized prompts."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.config import from_dict
    from trainer.data.tiny import WORDS, build_tokenizer
    from trainer.model.dflash_format import draft_config, write_export
    from trainer.run.build import build

    tok = build_tokenizer()
    config = AutoConfig.for_model(**QWEN25_05B, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out / "target")
    tok.save_pretrained(out / "target")
    parts = build(
        from_dict(
            {
                "target": {"path": str(out / "target"), "dtype": "bfloat16"},
                "drafter": {"num_layers": 3, "block_size": 16},
                "attention": {"backend": "dense"},
                "data": {"seq_buckets": [2048]},
                "device": device,
            }
        ),
        for_training=False,
    )
    from trainer.model.drafter import drafter_dims

    dims = drafter_dims(parts.target.config, 3, len(parts.target.layer_ids), {})
    dc = draft_config(dims, 16, parts.target.layer_ids, parts.mask_token_id, parts.target.config)
    drafter = write_export(out / "drafter", parts.drafter.state_dict(), dc, "bfloat16")
    rng = random.Random(0)

    def words(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    he, mt = out / "humaneval.jsonl", out / "mt_bench.jsonl"
    he.write_text("".join(json.dumps({"task_id": f"t/{i}", "prompt": words(60, 400)}) + "\n" for i in range(164)))
    mt.write_text(
        "".join(json.dumps({"question_id": i, "turns": [words(20, 200), words(10, 80)]}) + "\n" for i in range(80))
    )
    return str(out / "target"), str(drafter), [str(he), str(mt)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target")
    ap.add_argument("--drafter")
    ap.add_argument("--prompts", action="append", default=[])
    ap.add_argument("--random", type=Path, default=None, help="write and use a random target, drafter and prompts")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--limit-one", type=int, default=None, help="prompts per set at batch size 1")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    target, drafter, prompts = args.target, args.drafter, args.prompts
    if args.random is not None:
        target, drafter, prompts = write_random(args.random, args.device)
    runs = []
    for batch_size in (int(x) for x in args.batch_sizes.split(",")):
        argv = [
            "--target",
            target,
            "--drafter",
            drafter,
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--dtype",
            args.dtype,
            "--device",
            args.device,
            "--batch-size",
            str(batch_size),
            "--json",
            "--quiet",
        ]
        argv += [x for p in prompts for x in ("--prompts", p)]
        if batch_size == 1 and args.limit_one:
            argv += ["--limit", str(args.limit_one)]
        t0, printed = time.perf_counter(), io.StringIO()
        with contextlib.redirect_stdout(printed):
            code = bench_tau.main(argv)
        if code:
            return code
        sets = json.loads(printed.getvalue())["sets"]
        seconds, tokens, steps = (sum(s[k] for s in sets) for k in ("seconds", "tokens", "draft_steps"))
        runs.append(
            {
                "batch_size": batch_size,
                "prompts": sum(s["prompts"] for s in sets),
                "decode_s": round(seconds, 2),
                "wall_s": round(time.perf_counter() - t0, 2),
                "tokens": tokens,
                "tokens_per_s": round(tokens / seconds, 1),
                "tau_pooled": round(tokens / steps, 4),
                "sets": [
                    {k: s[k] for k in ("prompt_set", "prompts", "tau_pooled", "tau_prompt_mean", "seconds")}
                    for s in sets
                ],
            }
        )
        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)  # each batch size as it ends: a cut run keeps it
    print(json.dumps({"target": target, "drafter": drafter, "max_new_tokens": args.max_new_tokens, "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
