"""`python -m trainer.regenerate`: rewrite a dataset's responses with the target model itself.

The DFlash recipe trains the drafter on the target's own outputs, so that it learns the distribution it will have
to predict at inference. Each record keeps its prompt (the conversation up to the last assistant turn, the `prompt`,
or the tokens before the first response token) and gets a new response, greedy or sampled, generated in batches.
Records come out in the form they came in.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from trainer.errors import EXIT_CONFIG, ConfigError


def prompt_ids(rec: dict, tok) -> tuple[list[int], dict]:
    """Token ids of the prompt of one record, and what is needed to write the record back."""
    if "input_ids" in rec:
        ids, mask = rec["input_ids"], rec.get("loss_mask") or []
        first = next((i for i, m in enumerate(mask) if m), len(ids))
        return list(ids[: max(first, 1)]), {"kind": "ids"}
    if tok is None:
        raise ValueError("text records need a tokenizer (data.tokenizer or target.path)")
    if "messages" in rec:
        msgs = rec["messages"]
        last = max((i for i, m in enumerate(msgs) if m.get("role") == "assistant"), default=len(msgs))
        context = msgs[:last]
    elif "prompt" in rec:
        context = [{"role": "user", "content": rec["prompt"]}]
    else:
        raise ValueError('expected {"messages"}, {"prompt", "response"} or {"input_ids", "loss_mask"}')
    if getattr(tok, "chat_template", None):
        enc = tok.apply_chat_template(context, tokenize=True, add_generation_prompt=True)
        ids = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
    else:
        ids = tok.encode("".join(f"{m['role']}: {m['content']}\n" for m in context) + "assistant: ")
    return ids, {"kind": "messages" if "messages" in rec else "prompt", "context": context}


def rebuild(rec: dict, info: dict, prompt: list[int], new: list[int], tok) -> dict:
    if info["kind"] == "ids":
        return {"input_ids": prompt + new, "loss_mask": [0] * len(prompt) + [1] * len(new)}
    text = tok.decode(new, skip_special_tokens=True).strip()
    if info["kind"] == "prompt":
        return {**rec, "response": text}
    return {**rec, "messages": info["context"] + [{"role": "assistant", "content": text}]}


@torch.no_grad()
def generate(model, prompts: list[list[int]], max_new_tokens: int, temperature: float, top_p: float, pad: int, eos):
    """Left-padded batched generation; returns the new tokens of each prompt, cut at the first end token."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        attn[i, width - len(p) :] = 1
    kwargs = dict(do_sample=temperature > 0, max_new_tokens=max_new_tokens, pad_token_id=pad)
    if temperature > 0:
        kwargs.update(temperature=temperature, top_p=top_p)
    out = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device), **kwargs)[:, width:].tolist()
    ends = set(eos if isinstance(eos, list) else [eos]) - {None}
    cut = []
    for row in out:
        n = next((i + 1 for i, t in enumerate(row) if t in ends), len(row))
        cut.append(row[:n])
    return cut


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.regenerate", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="trainer config: its target (and data.tokenizer) are used")
    ap.add_argument("--input", required=True, help="JSONL to read (default: the config's data.path)")
    ap.add_argument("--output", required=True, help="JSONL to write")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        from trainer.config import load_config
        from trainer.data import load_tokenizer
        from trainer.loop import resolve_device
        from trainer.target import build_model

        cfg = load_config(args.config)
        device = resolve_device(cfg.device)
        tok = load_tokenizer(cfg.data.tokenizer or cfg.target.path, args.config)
        model = build_model(cfg.target, device, args.config).eval()
        records = []
        for n, line in enumerate(Path(args.input).read_text().splitlines(), 1):
            if line.strip():
                try:
                    rec = json.loads(line)
                    records.append((rec, *prompt_ids(rec, tok)))
                except (ValueError, KeyError, TypeError, AttributeError) as e:
                    raise ConfigError(f"{args.input}:{n}", None, str(e) or "malformed record") from None
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except OSError as e:
        print(f"config error: {args.input}: cannot read: {e.strerror}", file=sys.stderr)
        return EXIT_CONFIG
    torch.manual_seed(args.seed)
    pad = getattr(model.config, "pad_token_id", None) or 0
    eos = getattr(model.config, "eos_token_id", None)
    order = sorted(range(len(records)), key=lambda i: len(records[i][1]))  # similar lengths share a batch
    new: dict[int, list[int]] = {}
    for start in range(0, len(order), args.batch_size):
        chunk = order[start : start + args.batch_size]
        outs = generate(model, [records[i][1] for i in chunk], args.max_new_tokens, args.temperature, args.top_p,
                        pad, eos)  # fmt: skip
        new.update(zip(chunk, outs, strict=True))
        print(f"regenerated {min(start + args.batch_size, len(order))}/{len(order)}", flush=True)
    with open(args.output, "w") as f:
        for i, (rec, prompt, info) in enumerate(records):
            f.write(json.dumps(rebuild(rec, info, prompt, new[i], tok)) + "\n")
    print(f"wrote {len(records)} records to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
