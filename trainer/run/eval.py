"""Acceptance length tau, measured by real speculative decoding: the drafter proposes a block, the target verifies.

One drafting step at position p (the newest token, already the target's): the drafter sees the target's hidden states
of positions < p and the block [token p, mask, ..., mask], and proposes tokens p+1 .. p+bs-1. The target runs on the
sequence plus the proposal; drafted tokens are accepted while they equal the target's greedy choice, then the target's
own next token (the bonus) is appended. tau = tokens gained per target step, bonus included (DFlash's count), so a
drafter that always agrees with the target reaches the block size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from trainer.model.mask import bucket_for, build_blocks
from trainer.model.target import end_token_ids
from trainer.run.loop import Parts, drafter_output


def eval_anchors(block_size: int) -> int:
    """The fewest blocks whose query length is a multiple of 128 (flex's block): only the first is real."""
    return 128 // math.gcd(128, block_size)


@dataclass
class TauResult:
    accepted: int  # tokens gained over all drafting steps (bonus included)
    steps: int  # drafting steps (= target verification passes)
    prompts: int
    per_prompt: list[float] = field(default_factory=list)  # each prompt's own tau (prompts with at least one step)

    @property
    def tau(self) -> float:
        """Pooled: all tokens gained over all drafting steps."""
        return self.accepted / self.steps if self.steps else 0.0

    @property
    def tau_prompt_mean(self) -> float:
        """The mean of per-prompt means, as the published evaluators report it."""
        return sum(self.per_prompt) / len(self.per_prompt) if self.per_prompt else 0.0


NO_PROMPT_TOKENS = 32  # a sample whose response starts at once: its first tokens serve as the prompt


def prompt_of(sample: tuple[torch.Tensor, torch.Tensor], max_tokens: int) -> torch.Tensor | None:
    """The sample's whole prompt (the tokens before its first response token), or None when it is longer than
    `max_tokens`: such a prompt is skipped, never cut."""
    ids, mask = sample
    resp = torch.nonzero(mask, as_tuple=False).flatten()
    if resp.numel() and int(resp[0]) > 0:
        n = int(resp[0])
        return ids[:n] if n <= max_tokens else None
    return ids[: max(1, min(NO_PROMPT_TOKENS, max_tokens, ids.numel()))]


def eos_ids(parts: Parts) -> set[int]:
    """Every id that ends generation (trainer.target.end_token_ids)."""
    return end_token_ids(parts.target.model)


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
    eos = eos_ids(parts)
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
        new = (drafts[:n] + [preds[n]])[: max_new_tokens - (seq.numel() - prompt.numel())]  # the last step: capped
        end = next((i for i, t in enumerate(new) if t in eos), None)
        if end is not None:  # an EOS accepted inside the block ends the generation there: nothing after it counts
            new = new[: end + 1]
        seq = torch.cat([seq, seq.new_tensor(new)])
        gained.append(len(new))
        if end is not None:
            break
    return seq[prompt.numel() :].tolist(), gained


def measure_tau(parts: Parts, drafter: torch.nn.Module, prompts: list[torch.Tensor], max_new_tokens: int) -> TauResult:
    was_training = drafter.training
    drafter.eval()
    accepted = steps = 0
    per_prompt = []
    try:
        for prompt in prompts:
            _, gained = speculative_decode(parts, drafter, prompt, max_new_tokens)
            accepted += sum(gained)
            steps += len(gained)
            if gained:
                per_prompt.append(sum(gained) / len(gained))
    finally:
        drafter.train(was_training)
    return TauResult(accepted, steps, len(prompts), per_prompt)
