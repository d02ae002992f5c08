"""The drafter-free reference: prompt lookup's acceptance length on the same prompts, counted as bench_tau does.

    python bench/quality/prompt_lookup.py --target T --prompts heldout.jsonl [--limit N] [--max-new-tokens N]
        [--shard K/N] [--out per_prompt.jsonl]

transformers' `prompt_lookup_num_tokens` drafts by copying the n-gram that followed the last match in the context.
tau is tokens gained per verifying target forward after the prefill (the bonus token included), which is how
`trainer.bench_tau` counts a DFlash drafting step: a drafter that cannot beat this has learnt nothing a string match
does not already give. Greedy, so its text is the target's own greedy text. `--shard K/N` decodes every N-th prompt
from the K-th (several processes share one GPU), and `--out` writes one row per prompt, indexed as bench_tau's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/quality/prompt_lookup.py", description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--shard", default="0/1", help="K/N: every N-th prompt from the K-th")
    ap.add_argument("--out", default=None, help="one line per prompt: index, tokens, draft_steps, tau")
    args = ap.parse_args(argv)
    k, n = (int(x) for x in args.shard.split("/"))

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.data.prompts import read_prompts, render

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(args.target)
    model = (
        AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
        .to(device)
        .eval()
    )
    forwards = [0]
    model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    name, convs = read_prompts(args.prompts)
    per_prompt, tokens, steps, t0, rows = [], 0, 0, time.perf_counter(), []
    for index, conv in enumerate(convs[: args.limit]):
        if index % n != k:
            continue
        ids = torch.tensor(
            [render(tok, conv.history + [{"role": "user", "content": conv.turns[0]}], False)], device=device
        )
        forwards[0] = 0
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
                prompt_lookup_num_tokens=args.lookup_tokens,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        new = out.shape[1] - ids.shape[1]
        gained, verify = new - 1, forwards[0] - 1  # the prefill's forward and its token left out
        rows.append(
            {
                "index": index,
                "tokens": max(gained, 0),
                "draft_steps": max(verify, 0),
                "tau": round(gained / verify, 4) if new > 1 and verify > 0 else None,
            }
        )
        if new > 1 and forwards[0] > 1:
            per_prompt.append(gained / verify)
            tokens, steps = tokens + gained, steps + verify
    result = {
        "method": "prompt_lookup",
        "prompt_set": name,
        "prompts": len(per_prompt),
        "lookup_tokens": args.lookup_tokens,
        "max_new_tokens": args.max_new_tokens,
        "tau_prompt_mean": round(sum(per_prompt) / max(len(per_prompt), 1), 4),
        "tau_pooled": round(tokens / max(steps, 1), 4),
        "seconds": round(time.perf_counter() - t0, 1),
        "shard": args.shard,
    }
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(
        json.dumps(result)
        if args.json
        else f"{name}: prompt lookup tau {result['tau_prompt_mean']} "
        f"(pooled {result['tau_pooled']}) over {result['prompts']} prompts"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
