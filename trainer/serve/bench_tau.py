"""`python -m trainer.bench_tau`: the acceptance length of any drafter in the public DFlash format, on your prompts.

    python -m trainer.bench_tau --target TARGET_DIR --drafter DRAFTER_DIR --prompts gsm8k.jsonl [--prompts mt.jsonl]
        [--max-new-tokens 2048] [--thinking off] [--limit N] [--batch-size 64] [--json] [--out per_prompt.jsonl]

The target decodes greedily with the drafter proposing each block (trainer.run.eval's loop: the output equals plain
greedy decoding), through the target's chat template; MT-Bench records answer each turn in order with the generated
answers kept in the history. `--batch-size` prompts are decoded at once (grouped by length; every conversation's
first turn, then every second turn, ...), each with its own acceptance: the tokens and the tau are those of decoding
one prompt at a time (`--batch-size 1`), only faster. tau is reported as the published evaluators do (the mean of
per-prompt means) and pooled (all tokens gained over all drafting steps), both named. Works for a drafter of this
trainer or a published one. Nothing is downloaded: the target and the prompt files are local.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from trainer.data.prompts import Conversation, read_prompts, render
from trainer.errors import EXIT_CONFIG, ConfigError


@dataclass
class SetResult:
    prompt_set: str
    prompts: int  # conversations decoded
    skipped: int  # conversations whose prompt would not fit the length limit (never cut)
    tau_prompt_mean: float  # the mean of per-prompt means (what the published evaluators report)
    tau_pooled: float  # all tokens gained over all drafting steps
    tokens: int
    draft_steps: int
    seconds: float


DEFAULT_BATCH = 64  # prompts decoded at once (trainer.run.eval.speculative_decode_batch): the same answer at any size
DEFAULT_MAX_PROMPT = 4096  # the published evaluators' prompts are far shorter; one huge prompt must not set the pace


def prompt_cap(target: str, max_new_tokens: int, asked: int | None) -> int:
    """The longest prompt decoded: --max-prompt-tokens, else the target's context less the new tokens (capped)."""
    if asked is not None:
        return asked
    try:
        context = int(json.loads((Path(target) / "config.json").read_text()).get("max_position_embeddings") or 0)
    except (OSError, ValueError, TypeError):
        context = 0
    room = context - max_new_tokens if context else DEFAULT_MAX_PROMPT
    return max(1, min(DEFAULT_MAX_PROMPT, room))


def length_limit(prompt_lens: list[int], turns: int, max_new_tokens: int, block_size: int) -> int:
    """Room for the longest first prompt plus every turn's answer and one block, in whole 128-token tiles."""
    need = max(prompt_lens) + turns * (max_new_tokens + 64) + 2 * block_size
    return 128 * math.ceil(need / 128)


def read_draft_config(drafter: str) -> dict:
    """The export's config.json (its weights are loaded once, by the trainer's `drafter.init_from`)."""
    path = Path(drafter) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        why = getattr(e, "strerror", None) or e
        raise ConfigError(str(path), "--drafter", f"not a drafter export: {why}") from None
    if not isinstance(config, dict):
        raise ConfigError(str(path), "--drafter", "not a drafter export: expected a JSON object")
    return config


def build_parts(target: str, drafter: str, limit: int, device: str, dtype: str, config: dict | None = None):
    """A model pair from a target directory and a drafter export; dense attention (a decoding block is 128 queries:
    dense is cheap there and never recompiles for a new length)."""
    from trainer.config import from_dict
    from trainer.run.build import build

    config = config if config is not None else read_draft_config(drafter)
    dc = config.get("dflash_config") or {}
    buckets = sorted({*range(512, limit, 512), limit})
    cfg = from_dict(
        {
            "target": {"path": target, "dtype": dtype, "layer_ids": dc.get("target_layer_ids"), "compile": "off"},
            "drafter": {
                "num_layers": config.get("num_hidden_layers"),
                "block_size": config.get("block_size") or dc.get("block_size"),  # the reference's place first
                "mask_token_id": dc.get("mask_token_id"),
                "intermediate_size": config.get("intermediate_size"),
                "num_heads": config.get("num_attention_heads"),
                "num_kv_heads": config.get("num_key_value_heads"),
                "head_dim": config.get("head_dim"),
                "init_from": drafter,
            },
            "attention": {"backend": "dense", "dense_max_gib": 64.0},
            "data": {"seq_buckets": buckets},
            "device": device,
        },
        f"{drafter}/config.json",
    )
    return build(cfg, f"{drafter}/config.json", for_training=False)


def decode_conversations(
    parts,
    tok,
    convs: list[Conversation],
    max_new_tokens: int,
    thinking: bool,
    limit: int,
    cap: int | None = None,
    batch_size: int = DEFAULT_BATCH,
    progress=None,
) -> list[tuple[list[int], int] | None]:
    """Per conversation: (tokens gained per drafting step over every turn, turns answered), or None when a turn's
    prompt does not fit. Turn k of every conversation is decoded in one batched pass, after turn k-1 of all: each
    turn's prompt holds the answers generated before it."""
    import torch

    from trainer.run.eval import speculative_decode_batch

    msgs = [list(c.history) for c in convs]
    gained: list[list[int] | None] = [[] for _ in convs]
    bs = parts.cfg.drafter.block_size
    for k in range(max((len(c.turns) for c in convs), default=0)):
        rows, prompts = [], []
        for i, conv in enumerate(convs):
            if gained[i] is None or k >= len(conv.turns):
                continue
            msgs[i].append({"role": "user", "content": conv.turns[k]})
            ids = render(tok, msgs[i], thinking)
            if len(ids) + max_new_tokens + bs > limit or (cap is not None and len(ids) > cap):
                gained[i] = None  # skipped whole, never cut: its earlier turns do not count either
                continue
            rows.append(i)
            prompts.append(torch.tensor(ids))
        decoded = speculative_decode_batch(parts, parts.drafter, prompts, max_new_tokens, batch_size)
        for i, (out, steps) in zip(rows, decoded, strict=True):
            gained[i] += steps
            msgs[i].append({"role": "assistant", "content": tok.decode(out, skip_special_tokens=True)})
        if progress:
            progress(len(rows))
    return [(g, len(c.turns)) if g is not None else None for g, c in zip(gained, convs, strict=True)]


def decode_conversation(
    parts, tok, conv: Conversation, max_new_tokens: int, thinking: bool, limit: int, cap: int | None = None
):
    """One conversation alone (decode_conversations' batch of one)."""
    return decode_conversations(parts, tok, [conv], max_new_tokens, thinking, limit, cap, 1)[0]


def bench_set(parts, tok, name: str, convs: list[Conversation], args, limit: int, out_file) -> SetResult:
    from tqdm import tqdm

    t0 = time.perf_counter()
    per_prompt, tokens, steps, skipped = [], 0, 0, 0
    turns = sum(len(c.turns) for c in convs)
    with tqdm(total=turns, desc=name, unit="turn", file=sys.stderr, disable=args.quiet) as bar:
        decoded = decode_conversations(
            parts,
            tok,
            convs,
            args.max_new_tokens,
            args.thinking == "on",
            limit,
            getattr(args, "prompt_cap", None),
            getattr(args, "batch_size", DEFAULT_BATCH),
            bar.update,
        )
    for i, one in enumerate(decoded):
        if one is None:
            skipped += 1
            continue
        gained, turns = one
        tokens, steps = tokens + sum(gained), steps + len(gained)
        if gained:
            per_prompt.append(sum(gained) / len(gained))
        if out_file:
            tau = round(sum(gained) / len(gained), 4) if gained else None
            row = {"prompt_set": name, "index": i, "turns": turns, "tokens": sum(gained), "draft_steps": len(gained)}
            out_file.write(json.dumps({**row, "tau": tau}) + "\n")
    return SetResult(
        name,
        len(convs) - skipped,
        skipped,
        round(sum(per_prompt) / len(per_prompt), 4) if per_prompt else 0.0,
        round(tokens / steps, 4) if steps else 0.0,
        tokens,
        steps,
        round(time.perf_counter() - t0, 2),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.bench_tau", description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="the target's directory (weights, tokenizer, chat template)")
    ap.add_argument("--drafter", required=True, help="a drafter in the public DFlash format (config.json, weights)")
    ap.add_argument("--prompts", required=True, action="append", help="a prompt file; repeat for several sets")
    ap.add_argument("--max-new-tokens", type=int, default=2048)
    ap.add_argument("--thinking", choices=["on", "off"], default="off", help="the chat template's enable_thinking")
    ap.add_argument("--limit", type=int, default=None, help="the first N prompts of each set")
    ap.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="a longer prompt is skipped and counted, never decoded (default: the target's context less "
        f"--max-new-tokens, at most {DEFAULT_MAX_PROMPT})",
    )
    ap.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULT_BATCH,
        help=f"prompts decoded at once, grouped by length (default {DEFAULT_BATCH}; 1: one at a time, the same tau)",
    )
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--out", default=None, help="also write one line per prompt to this JSONL")
    ap.add_argument("--json", action="store_true", help="print the results as one JSON object")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    if (
        args.max_new_tokens < 1
        or args.batch_size < 1
        or (args.limit is not None and args.limit < 1)
        or (args.max_prompt_tokens is not None and args.max_prompt_tokens < 1)
    ):
        print(
            "config error: --max-new-tokens, --batch-size, --limit and --max-prompt-tokens must be at least 1",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    try:
        from trainer.data.dataset import load_tokenizer

        sets = [read_prompts(p) for p in args.prompts]
        sets = [(name, convs[: args.limit]) for name, convs in sets]
        tok = load_tokenizer(args.target, "--target")
        config = read_draft_config(args.drafter)
        bs = int((config.get("dflash_config") or {}).get("block_size") or config.get("block_size") or 16)
        firsts = [
            len(render(tok, c.history + [{"role": "user", "content": c.turns[0]}], args.thinking == "on"))
            for _, convs in sets
            for c in convs
        ]
        cap = args.prompt_cap = prompt_cap(args.target, args.max_new_tokens, args.max_prompt_tokens)
        firsts = [n for n in firsts if n <= cap] or [min(firsts + [cap])]  # the limit fits the prompts decoded
        turns = max(len(c.turns) for _, convs in sets for c in convs)
        limit = length_limit(firsts, turns, args.max_new_tokens, bs)
        parts = build_parts(args.target, args.drafter, limit, args.device, args.dtype, config)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except (OSError, ValueError) as e:
        print(f"config error: {args.drafter}/config.json: {e}", file=sys.stderr)
        return EXIT_CONFIG
    parts.drafter.eval()
    out_file = open(args.out, "w") if args.out else None  # noqa: SIM115
    try:
        results = [bench_set(parts, tok, name, convs, args, limit, out_file) for name, convs in sets]
    finally:
        if out_file:
            out_file.close()
    empty = [r for r in results if r.draft_steps == 0]
    if empty:  # a tau of nothing is no measurement: never printed as 0.000 with exit 0
        for r in empty:
            print(
                f"config error: {r.prompt_set}: nothing to measure: {r.prompts + r.skipped} prompts, {r.skipped} "
                "skipped as too long for --max-prompt-tokens or the target's context, none drafted",
                file=sys.stderr,
            )
        return EXIT_CONFIG
    summary = {
        "drafter": args.drafter,
        "target": args.target,
        "max_new_tokens": args.max_new_tokens,
        "thinking": args.thinking,
        "block_size": parts.cfg.drafter.block_size,
        "sets": [asdict(r) for r in results],
    }
    if args.json:
        print(json.dumps(summary))
    else:
        for r in results:
            print(
                f"{r.prompt_set}: tau {r.tau_prompt_mean:.3f} (mean of per-prompt means), pooled {r.tau_pooled:.3f}"
                f"; {r.prompts} prompts, {r.skipped} skipped as too long, {r.tokens} tokens in {r.draft_steps} "
                f"draft steps, {r.seconds:.1f} s"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
