"""Acceptance length tau, measured by real speculative decoding: the drafter proposes a block, the target verifies.

One drafting step at position p (the newest token, already the target's): the drafter sees the target's hidden states
of positions < p and the block [token p, mask, ..., mask], and proposes tokens p+1 .. p+bs-1. The target runs on the
sequence plus the proposal; drafted tokens are accepted while they equal the target's greedy choice, then the target's
own next token (the bonus) is appended. tau = tokens gained per target step, bonus included (DFlash's count), so a
drafter that always agrees with the target reaches the block size.

Many prompts are decoded at once (speculative_decode_batch): the target keeps a cache (trainer.model.kv_cache) and
runs only each row's new block a step; acceptance is per row, and a row that ends leaves the batch. The result per
prompt is that of decoding it alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from trainer.model.kv_cache import PositionCache
from trainer.model.mask import bucket_for, dense_score_gib
from trainer.model.target import end_token_ids
from trainer.run.build import Parts, autocast

FLEX_ROWS = 64  # the drafter's rows under flex come in multiples of this: one compiled shape per bucket


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
    """Every id that ends generation (trainer.model.target.end_token_ids)."""
    return end_token_ids(parts.target.model)


@torch.no_grad()
def draft_blocks(parts: Parts, drafter: torch.nn.Module, context: torch.Tensor, seqs: list[list[int]]) -> torch.Tensor:
    """The drafter's proposals [B, bs-1] for the tokens after each row's last (`seqs`: the rows' tokens so far).
    `context` [B, W, n*C]: the target's chosen layers' outputs by position, valid below each row's last token (the
    drafter sees the context strictly before its anchor: nothing at or past it is read)."""
    bs, dev = parts.cfg.drafter.block_size, parts.device
    backend, heads, A = parts.eval_backend, parts.drafter.d.num_heads, eval_anchors(bs)
    S = bucket_for(max(len(s) for s in seqs), parts.cfg.data.seq_buckets)
    last = torch.tensor([s[-1] for s in seqs], device=dev)
    anchor = torch.tensor([len(s) - 1 for s in seqs], device=dev)
    out = []
    step = draft_rows(backend, heads, seq_len=S, anchors=A, block_size=bs, rows=len(seqs))
    for lo in range(0, len(seqs), step):
        rows = torch.arange(lo, min(lo + step, len(seqs)), device=dev)
        if getattr(backend, "name", "") != "dense":  # flex compiles per shape: rows padded to a multiple of 64 (a
            # repeated row), so the in-run eval compiles one graph per bucket as rows leave, as it did at batch 1
            rows = torch.cat([rows, rows[-1:].expand(-rows.numel() % FLEX_ROWS)])
        anchors, valid, block_ids, block_pos = block_inputs(last[rows], anchor[rows], A, bs, parts.mask_token_id)
        mask = backend.build_mask(anchors, valid, S, bs, heads)
        ctx = context[rows, :S]  # [b, S, n*C]; the bucket may pass the buffer's end: padded (never read)
        ctx = torch.nn.functional.pad(ctx, (0, 0, 0, S - ctx.shape[1]))
        with autocast(parts):
            hidden = drafter(ctx, parts.target.embed(block_ids), block_pos, mask, backend)  # [b, Q, C]
        head = parts.target.lm_head
        out.append(head(hidden[:, 1:bs].to(head.weight.dtype)).argmax(-1)[: min(step, len(seqs) - lo)])
    return torch.cat(out)  # [B, bs-1]


def block_inputs(last: torch.Tensor, anchor: torch.Tensor, num_anchors: int, block_size: int, mask_token_id: int):
    """build_blocks' layout for one real block a row (the rest padding), built on the device from the rows' last
    tokens and their positions: (anchors [B, A], anchor_valid [B, A], block_ids [B, A*bs], block_pos [B, A*bs])."""
    B, A, bs, dev = last.shape[0], num_anchors, block_size, last.device
    anchors = torch.zeros(B, A, dtype=torch.long, device=dev)
    anchors[:, 0] = anchor
    valid = torch.zeros(B, A, dtype=torch.bool, device=dev)
    valid[:, 0] = True
    block_ids = torch.full((B, A * bs), mask_token_id, dtype=torch.long, device=dev)
    block_ids[:, 0] = last
    block_pos = (anchors[:, :, None] + torch.arange(bs, device=dev)).view(B, A * bs)  # [B, A*bs]
    return anchors, valid, block_ids, block_pos


def draft_rows(backend, heads: int, seq_len: int, anchors: int, block_size: int, rows: int) -> int:
    """Rows per drafter call: all of them, unless the dense reference's score cap allows fewer."""
    cap = getattr(backend, "max_gib", None)
    if cap is None:
        return rows
    q = anchors * block_size
    return max(1, min(rows, int(cap / dense_score_gib(1, heads, q, seq_len + q))))


DECODE_BATCH = 64  # prompts decoded at once by default: the cache of a 0.5B target at 1K tokens is ~0.8 GB


@torch.no_grad()
def speculative_decode_batch(
    parts: Parts,
    drafter: torch.nn.Module,
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    batch_size: int = DECODE_BATCH,
) -> list[tuple[list[int], list[int]]]:
    """Greedy speculative decoding of many prompts, `batch_size` at a time, grouped by length: per prompt, in order,
    (generated tokens, tokens gained per drafting step), exactly as each decoded alone."""
    results: list[tuple[list[int], list[int]]] = [([], []) for _ in prompts]
    order = sorted((i for i, p in enumerate(prompts) if p.numel()), key=lambda i: prompts[i].numel())
    for lo in range(0, len(order), batch_size):
        chunk = order[lo : lo + batch_size]
        for i, result in zip(
            chunk, decode_chunk(parts, drafter, [prompts[i] for i in chunk], max_new_tokens), strict=True
        ):
            results[i] = result
    return results


def decode_chunk(
    parts: Parts, drafter: torch.nn.Module, prompts: list[torch.Tensor], max_new_tokens: int
) -> list[tuple[list[int], list[int]]]:
    """One batch of non-empty prompts. The target keeps a cache (slot = position) and runs only each row's new block
    a step, right-padded: row i's tokens sit at its own positions, so nothing another row holds reaches it."""
    bs, dev, target = parts.cfg.drafter.block_size, parts.device, parts.target
    limit = parts.cfg.data.seq_buckets[-1]
    eos = eos_ids(parts)
    lens = [p.numel() for p in prompts]
    P = max(lens)
    width = max(P, min(P + max_new_tokens + bs, limit))  # past every position a row writes
    cache = PositionCache(width)
    ids = torch.zeros(len(prompts), P, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : p.numel()] = p
    ends = torch.tensor(lens, device=dev) - 1  # host-to-device copies first: each waits for the GPU to be idle
    positions = torch.arange(P, device=dev).expand(len(prompts), P)
    layers, final = target.forward_cached(ids.to(dev), positions, P, cache)  # the prompts, right-padded
    context = layers.new_zeros(len(prompts), width, layers.shape[-1])  # [B, W, n*C] the drafter's context
    context[:, :P] = layers
    # the first token after the prompt comes from the target alone: drafting starts from a token the target chose
    first = target.lm_head(final[torch.arange(len(prompts), device=dev), ends]).argmax(-1).tolist()
    seqs = [p.tolist() + [t] for p, t in zip(prompts, first, strict=True)]
    gained: list[list[int]] = [[] for _ in prompts]

    def going(b: int) -> bool:
        return len(seqs[b]) - lens[b] < max_new_tokens and len(seqs[b]) + bs <= limit and seqs[b][-1] not in eos

    rows = list(range(len(prompts)))  # the prompt of each row of the cache and the context
    while going_rows := [b for b in rows if going(b)]:
        if going_rows != rows:  # finished rows leave the batch
            keep = torch.tensor([rows.index(b) for b in going_rows], device=dev)
            cache.keep(keep)
            context = context.index_select(0, keep)
            rows = going_rows
        # the step's host-to-device copies come first, while the GPU is idle (a copy from pageable memory waits for
        # what is queued before it: after the drafter, the host would stall instead of queueing the target)
        last = torch.tensor([seqs[b][-1] for b in rows], device=dev)
        start = torch.tensor([len(seqs[b]) - 1 for b in rows], device=dev)
        drafts = draft_blocks(parts, drafter, context, [seqs[b] for b in rows])  # [B, bs-1]
        positions = start[:, None] + torch.arange(bs, device=dev)  # [B, bs]: the last token, then the drafts
        width_now = max(len(seqs[b]) for b in rows) - 1 + bs
        layers, final = target.forward_cached(torch.cat([last[:, None], drafts], 1), positions, width_now, cache)
        context.scatter_(1, positions[:, :, None].expand_as(layers), layers)  # rejected ones: overwritten later
        preds = target.lm_head(final).argmax(-1)  # [B, bs]: the target's token after each position
        for b, d, t in zip(rows, drafts.tolist(), preds.tolist(), strict=True):  # .tolist(): the step's one sync
            n = 0
            while n < len(d) and d[n] == t[n]:
                n += 1
            new = (d[:n] + [t[n]])[: max_new_tokens - (len(seqs[b]) - lens[b])]  # the last step: capped
            end = next((i for i, tok in enumerate(new) if tok in eos), None)
            if end is not None:  # an EOS accepted inside the block ends the generation there: nothing after counts
                new = new[: end + 1]
            seqs[b] += new
            gained[b].append(len(new))
    return [(s[n:], g) for s, n, g in zip(seqs, lens, gained, strict=True)]


def speculative_decode(
    parts: Parts, drafter: torch.nn.Module, prompt: torch.Tensor, max_new_tokens: int
) -> tuple[list[int], list[int]]:
    """Greedy speculative decoding of one prompt: (generated tokens, tokens gained per drafting step)."""
    return speculative_decode_batch(parts, drafter, [prompt], max_new_tokens, 1)[0]


EVAL_CACHE_GIB = 4.0  # the in-run eval's cache and drafter context at most: it runs beside training's memory


def rows_within(parts: Parts, tokens: int, gib: float) -> int:
    """How many rows of `tokens` positions the target's cache and the drafter's context hold within `gib`."""
    c, target = parts.target.config, parts.target
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_token = 2 * c.num_hidden_layers * kv_heads * head_dim + len(target.layer_ids) * c.hidden_size
    return max(1, int(gib * 2**30 / (per_token * target.embed.weight.element_size() * tokens)))


def measure_tau(
    parts: Parts,
    drafter: torch.nn.Module,
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    batch_size: int | None = None,
) -> TauResult:
    """tau over `prompts`, decoded `batch_size` at a time (default: DECODE_BATCH, fewer where the cache of the
    longest would pass EVAL_CACHE_GIB)."""
    if batch_size is None:
        longest = max((p.numel() for p in prompts), default=0) + max_new_tokens + parts.cfg.drafter.block_size
        batch_size = min(DECODE_BATCH, rows_within(parts, longest, EVAL_CACHE_GIB))
    was_training = drafter.training
    drafter.eval()
    try:
        decoded = speculative_decode_batch(parts, drafter, prompts, max_new_tokens, batch_size)
    finally:
        drafter.train(was_training)
    gains = [g for _, g in decoded]
    per_prompt = [sum(g) / len(g) for g in gains if g]
    return TauResult(sum(map(sum, gains)), sum(map(len, gains)), len(prompts), per_prompt)
