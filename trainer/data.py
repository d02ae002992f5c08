"""Samples and batches: tokenised sequences with a response mask, bucketed by length, reshuffled per epoch.

A sample is (input_ids [L], loss_mask [L]). The JSONL format read here is the tokenised one:
    {"input_ids": [...], "loss_mask": [...]}      (loss_mask: 1 on response tokens)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.config import DataConfig
from trainer.errors import ConfigError
from trainer.mask import bucket_for

Sample = tuple[torch.Tensor, torch.Tensor]


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


def read_jsonl(path: str) -> list[Sample]:
    samples = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ConfigError("<config>", "data.path", f"cannot read {path}: {e.strerror}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            ids, mask = rec["input_ids"], rec["loss_mask"]
            if len(ids) != len(mask):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            msg = "expected {input_ids: [...], loss_mask: [...]} of equal length"
            raise ConfigError(f"{path}:{n}", None, msg) from None
        samples.append((torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)))
    return samples


@dataclass
class Dataset:
    samples: list[Sample]
    buckets: list[int]
    dropped_too_long: int = 0
    dropped_too_short: int = 0


def make_dataset(cfg: DataConfig, vocab: int, block_size: int, seed: int) -> Dataset:
    if cfg.path:
        raw = read_jsonl(cfg.path)
    else:
        lengths = [max(block_size * 2, int(b * f)) for b in cfg.seq_buckets for f in (0.6, 0.9)]
        raw = synthetic_samples(cfg.synthetic_samples, vocab, lengths, seed)
    kept, too_long, too_short = [], 0, 0
    for ids, mask in raw:
        if bucket_for(ids.numel(), cfg.seq_buckets) is None:
            too_long += 1
        elif int(mask[1:].sum()) < 1 or ids.numel() < 2:
            too_short += 1  # no response position with a label after it: not even one block
        else:
            kept.append((ids, mask))
    if not kept:
        raise ConfigError("<config>", "data", "no usable samples (all too long for the buckets, or no response)")
    return Dataset(kept, cfg.seq_buckets, too_long, too_short)


def epoch_batches(ds: Dataset, batch_size: int, seed: int, epoch: int) -> Iterator[tuple[int, list[int]]]:
    """(bucket length, sample indices) batches for one epoch: shuffled from (seed, epoch), one bucket per batch."""
    g = torch.Generator().manual_seed(seed * 7919 + epoch)
    order = torch.randperm(len(ds.samples), generator=g).tolist()
    by_bucket: dict[int, list[int]] = {}
    batches = []
    for i in order:
        b = bucket_for(ds.samples[i][0].numel(), ds.buckets)
        group = by_bucket.setdefault(b, [])
        group.append(i)
        if len(group) == batch_size:
            batches.append((b, group[:]))
            group.clear()
    batches += [(b, g_) for b, g_ in by_bucket.items() if g_]  # remainders
    perm = torch.randperm(len(batches), generator=g).tolist()
    for j in perm:
        yield batches[j]
