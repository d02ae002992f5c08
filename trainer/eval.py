"""Acceptance length tau, measured by real speculative decoding: the drafter proposes a block, the target verifies.

One drafting step at position p (the newest token, already the target's): the drafter sees the target's hidden states
of positions < p and the block [token p, mask, ..., mask], and proposes tokens p+1 .. p+bs-1. The target runs on the
sequence plus the proposal; drafted tokens are accepted while they equal the target's greedy choice, then the target's
own next token (the bonus) is appended. tau = tokens gained per target step, bonus included (DFlash's count), so a
drafter that always agrees with the target reaches the block size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trainer.loop import Parts, drafter_output
from trainer.mask import bucket_for, build_blocks


def eval_anchors(block_size: int) -> int:
    """The fewest blocks whose query length is a multiple of 128 (flex's block): only the first is real."""
    return 128 // math.gcd(128, block_size)


@dataclass
class TauResult:
    accepted: int  # tokens gained over all drafting steps (bonus included)
    steps: int  # drafting steps (= target verification passes)
    prompts: int

    @property
    def tau(self) -> float:
        return self.accepted / self.steps if self.steps else 0.0


def prompt_of(sample: tuple[torch.Tensor, torch.Tensor], max_tokens: int) -> torch.Tensor:
    """The sample's prompt (tokens before the first response token), at most `max_tokens` long."""
    ids, mask = sample
    resp = torch.nonzero(mask, as_tuple=False).flatten()
    n = int(resp[0]) if resp.numel() and int(resp[0]) > 0 else max_tokens
    return ids[: max(1, min(n, max_tokens))]


@torch.no_grad()
def draft_block(parts: Parts, drafter: torch.nn.Module, seq: torch.Tensor) -> list[int]:
    """The drafter's proposal for the bs-1 tokens after seq[-1] ([L] token ids, L within the largest bucket)."""
    cfg = parts.cfg
    bs, p = cfg.drafter.block_size, seq.numel() - 1
    S = bucket_for(seq.numel(), cfg.data.seq_buckets)
    ones = torch.ones_like(seq)
    batch = build_blocks(
        [(seq.cpu(), ones.cpu())], S, eval_anchors(bs), bs, parts.mask_token_id, cfg.optim.gamma, [torch.tensor([p])]
    )
    out = drafter_output(parts, drafter, batch.to(parts.device), parts.eval_backend)  # [1, Q, C]
    head = parts.target.lm_head
    logits = head(out[0, 1:bs].to(head.weight.dtype))  # [bs-1, V]
    return logits.argmax(-1).tolist()


@torch.no_grad()
def speculative_decode(
    parts: Parts, drafter: torch.nn.Module, prompt: torch.Tensor, max_new_tokens: int
) -> tuple[list[int], list[int]]:
    """Greedy speculative decoding of one prompt: (generated tokens, tokens gained per drafting step)."""
    bs = parts.cfg.drafter.block_size
    limit = parts.cfg.data.seq_buckets[-1]
    eos = getattr(parts.target.config, "eos_token_id", None)
    eos = set(eos if isinstance(eos, list) else [eos]) - {None}
    seq = prompt.to(parts.device)
    if seq.numel() == 0:
        return [], []
    # the first token after the prompt comes from the target alone: drafting starts from a token the target chose
    first = int(parts.target.logits(seq[None])[0, -1].argmax())
    seq = torch.cat([seq, seq.new_tensor([first])])
    gained: list[int] = []
    while seq.numel() - prompt.numel() < max_new_tokens and seq.numel() + bs <= limit and int(seq[-1]) not in eos:
        drafts = draft_block(parts, drafter, seq)
        p = seq.numel() - 1
        full = torch.cat([seq, seq.new_tensor(drafts)])
        preds = parts.target.logits(full[None])[0, p : p + bs].argmax(-1).tolist()  # target's token after p+k
        n = 0
        while n < len(drafts) and drafts[n] == preds[n]:
            n += 1
        new = drafts[:n] + [preds[n]]
        seq = torch.cat([seq, seq.new_tensor(new)])
        gained.append(len(new))
    return seq[prompt.numel() :].tolist(), gained


def measure_tau(parts: Parts, drafter: torch.nn.Module, prompts: list[torch.Tensor], max_new_tokens: int) -> TauResult:
    was_training = drafter.training
    drafter.eval()
    accepted = steps = 0
    try:
        for prompt in prompts:
            _, gained = speculative_decode(parts, drafter, prompt, max_new_tokens)
            accepted += sum(gained)
            steps += len(gained)
    finally:
        drafter.train(was_training)
    return TauResult(accepted, steps, len(prompts))
