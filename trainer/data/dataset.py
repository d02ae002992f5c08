"""Samples and batches: tokenised sequences with a response mask, bucketed by length, reshuffled per epoch.

A sample is (input_ids [L], loss_mask [L]). JSONL records may be
    {"messages": [{"role", "content"}, ...]}     tokenised with the tokenizer's chat template; loss on assistant turns
    {"prompt": "...", "response": "..."}          the same, as one user turn and one assistant turn
    {"input_ids": [...], "loss_mask": [...]}      already tokenised (loss_mask: 1 on response tokens)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.config import DataConfig
from trainer.errors import ConfigError
from trainer.model.mask import bucket_for

Sample = tuple[torch.Tensor, torch.Tensor]
Generate = Callable[[list[list[int]], int], list[list[int]]]


def synthetic_samples(n: int, vocab: int, lengths: list[int], seed: int, alphabet: int = 16) -> list[Sample]:
    """Learnable toy sequences: a fixed random successor function over a small alphabet, from a random start.

    Every sequence follows the same rule (token t+1 = succ(token t)), so a drafter can learn to draft whole blocks
    from the anchor token. The first quarter is the "prompt" (loss_mask 0), the rest the "response".
    """
    g = torch.Generator().manual_seed(seed)
    alphabet = min(alphabet, vocab)
    symbols = torch.randperm(vocab, generator=g)[:alphabet]  # which token ids take part
    succ = torch.randperm(alphabet, generator=g)  # the rule, as a permutation of the alphabet
    out = []
    for i in range(n):
        L = lengths[i % len(lengths)]
        state = torch.empty(L, dtype=torch.long)
        state[0] = int(torch.randint(0, alphabet, (1,), generator=g))
        for t in range(1, L):
            state[t] = succ[state[t - 1]]
        mask = torch.zeros(L, dtype=torch.long)
        mask[L // 4 :] = 1
        out.append((symbols[state], mask))
    return out


def _ids(encoded) -> list[int]:
    """apply_chat_template returns a list in some transformers versions and a BatchEncoding in others."""
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def tokenize_messages(messages: list[dict], tok) -> Sample:
    """Chat-template tokens with loss on assistant turns only (each turn's span found from its templated prefix)."""
    if getattr(tok, "chat_template", None):
        ids = _ids(tok.apply_chat_template(messages, tokenize=True))
        mask = [0] * len(ids)
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            start = len(_ids(tok.apply_chat_template(messages[:i], tokenize=True, add_generation_prompt=True)))
            end = len(_ids(tok.apply_chat_template(messages[: i + 1], tokenize=True)))
            mask[start:end] = [1] * (end - start)
    else:  # no template: "role: content" lines
        ids, mask = [], []
        for m in messages:
            piece = tok.encode(f"{m['role']}: {m['content']}\n", add_special_tokens=False)
            ids += piece
            mask += [int(m.get("role") == "assistant")] * len(piece)
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)


def parse_record(rec: object, tok) -> Sample:
    """One JSONL record in any of the three accepted forms -> (input_ids, loss_mask)."""
    if not isinstance(rec, dict):
        raise ValueError("expected a JSON object")
    if "input_ids" in rec:
        ids, mask = rec["input_ids"], rec.get("loss_mask")
        if not isinstance(ids, list) or not isinstance(mask, list) or len(ids) != len(mask):
            raise ValueError("input_ids and loss_mask must be lists of equal length")
        return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)
    if tok is None:
        raise ValueError("text records need a tokenizer (data.tokenizer or target.path)")
    if "messages" in rec:
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in msgs):
            raise ValueError("messages must be a list of {role, content}")
        return tokenize_messages(msgs, tok)
    if "prompt" in rec and "response" in rec:
        msgs = [{"role": "user", "content": rec["prompt"]}, {"role": "assistant", "content": rec["response"]}]
        return tokenize_messages(msgs, tok)
    raise ValueError('expected {"messages": [...]}, {"prompt", "response"} or {"input_ids", "loss_mask"}')


def load_tokenizer(path: str | None, source: str = "<config>"):
    if path is None:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(source, "data.tokenizer", f"cannot load a tokenizer from {path}: {first}") from None


def read_jsonl(path: str, tok=None, source: str = "<config>") -> list[Sample]:
    samples = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ConfigError(source, "data.path", f"cannot read {path}: {e.strerror}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            samples.append(parse_record(json.loads(line), tok))
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{path}:{n}", None, str(e) or "malformed record") from None
    return samples


@dataclass
class Dataset:
    samples: list[Sample]
    buckets: list[int]
    heldout: list[Sample]
    dropped_too_long: int = 0  # kept for the record's shape: long samples are truncated now, never dropped
    dropped_too_short: int = 0
    truncated: int = 0  # samples longer than the largest bucket, cut to it with their loss mask (as SpecForge does)


def greedy_samples(n: int, lengths: list[int], seed: int, generate: Generate, alphabet: int = 16) -> list[Sample]:
    """Short random prompts continued greedily by the target: what the drafter must learn to predict, in miniature."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, alphabet, (4,), generator=g).tolist() for _ in range(n)]
    out = []
    for i in range(0, n, 64):
        batch = prompts[i : i + 64]
        new = generate(batch, max(lengths) - 4)
        for p, cont in zip(batch, new, strict=True):
            L = min(lengths[len(out) % len(lengths)], len(p) + len(cont))
            ids = torch.tensor((p + cont)[:L], dtype=torch.long)
            mask = torch.zeros(L, dtype=torch.long)
            mask[len(p) :] = 1
            out.append((ids, mask))
    return out


def make_dataset(
    cfg: DataConfig,
    vocab: int,
    block_size: int,
    seed: int,
    tok=None,
    source: str = "<config>",
    generate: Generate | None = None,
) -> Dataset:
    """Read or synthesise samples, truncate what is longer than the largest bucket, drop what cannot make one block,
    hold out `cfg.holdout`.

    `generate(prompts, max_new_tokens) -> continuations` is the target's greedy decoder (for `target_greedy`).
    """
    if cfg.path:
        raw = read_jsonl(cfg.path, tok, source)
    elif cfg.synthetic == "target_greedy" and generate is not None:
        lengths = [max(block_size * 2, int(b * f)) for b in cfg.seq_buckets for f in (0.6, 0.9)]
        raw = greedy_samples(cfg.synthetic_samples + cfg.holdout, lengths, seed, generate)
    else:
        lengths = [max(block_size * 2, int(b * f)) for b in cfg.seq_buckets for f in (0.6, 0.9)]
        raw = synthetic_samples(cfg.synthetic_samples + cfg.holdout, vocab, lengths, seed)
    kept, truncated, too_short = [], 0, 0
    longest = cfg.seq_buckets[-1]
    for ids, mask in raw:
        if bucket_for(ids.numel(), cfg.seq_buckets) is None:
            ids, mask = ids[:longest], mask[:longest]
            truncated += 1
        if int(mask[1:].sum()) < 1 or ids.numel() < 2:
            too_short += 1  # no response position with a label after it: not even one block
        else:
            kept.append((ids, mask))
    holdout = min(cfg.holdout, max(0, len(kept) - 1))
    if not kept[holdout:]:
        raise ConfigError(source, "data", "no usable samples (none has a response position to learn from)")
    return Dataset(kept[holdout:], cfg.seq_buckets, kept[:holdout], 0, too_short, truncated)


def epoch_batches(ds: Dataset, global_batch: int, seed: int, epoch: int) -> list[tuple[int, list[int]]]:
    """(bucket length, sample indices) global batches for one epoch, shuffled from (seed, epoch), one bucket each.

    A global batch holds `batch_size x world size` samples; rank r takes its r-th slice (`shard`), so the data of a
    step does not depend on how many processes share it. Incomplete batches are dropped (every rank needs a full one).
    """
    g = torch.Generator().manual_seed(seed * 7919 + epoch)
    order = torch.randperm(len(ds.samples), generator=g).tolist()
    by_bucket: dict[int, list[int]] = {}
    batches = []
    for i in order:
        b = bucket_for(ds.samples[i][0].numel(), ds.buckets)
        group = by_bucket.setdefault(b, [])
        group.append(i)
        if len(group) == global_batch:
            batches.append((b, group[:]))
            group.clear()
    perm = torch.randperm(len(batches), generator=g).tolist()
    return [batches[j] for j in perm]


def shard(batch: tuple[int, list[int]], rank: int, batch_size: int) -> tuple[int, list[int]]:
    seq_len, idx = batch
    return seq_len, idx[rank * batch_size : (rank + 1) * batch_size]
