"""Anchors, block inputs, labels and the attention mask: one definition for both attention backends.

Layout of one attention call (per sequence b of a batch of B, bucket length S, A anchors, block size bs):

    queries  Q_LEN  = A * bs          block j occupies query rows [j*bs, (j+1)*bs)
    keys     KV_LEN = S + A * bs      [0, S): target context positions; [S + j*bs, S + (j+1)*bs): block j's tokens

Block j's queries see the context strictly before its anchor and every token of their own block; nothing of other
blocks. Padding blocks (fewer anchors than A) see only their own block, and nothing sees them; their loss weight is 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BlockBatch:
    """Everything the drafter and the loss need for one batch, padded to a bucket."""

    input_ids: torch.Tensor  # [B, S] target tokens (padded with 0 past each length)
    anchors: torch.Tensor  # [B, A] anchor positions (0 for padding blocks)
    anchor_valid: torch.Tensor  # [B, A] bool: a real anchor, not padding
    block_ids: torch.Tensor  # [B, A*bs] the anchor's token, then mask tokens
    block_pos: torch.Tensor  # [B, A*bs] position of each block token: anchor + k
    labels: torch.Tensor  # [B, A*bs] token at anchor + k (k >= 1), 0 where unused
    weights: torch.Tensor  # [B, A*bs] float: exp(-(k-1)/gamma) * response mask at anchor + k, 0 where unused
    block_size: int
    # [N] flat positions (b * A*bs + q) whose weight is > 0, found on the host when the batch is built: the loss
    # gathers its rows by these, and a boolean mask on the device would make the host wait for the GPU to find them
    label_index: torch.Tensor | None = None

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def to(self, device: torch.device) -> BlockBatch:
        moved = {k: (to_device(v, device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return BlockBatch(**moved)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor onto `device` without making the host wait. From pageable memory a copy to a GPU returns only
    once it is done, and it is queued behind everything already on the stream: at a step's first copy the host would
    wait for the previous step's update, and the GPU would then wait for the host to issue the new step (on an H200,
    the target forward's idle went from 5.1 to 3.3 ms a step). From pinned memory the copy is queued like a kernel. The
    tensor must not change until the copy is done: batches are built fresh each step and never written after."""
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def sample_anchors(loss_mask: torch.Tensor, length: int, num_anchors: int, generator: torch.Generator) -> torch.Tensor:
    """Sorted anchor positions among response positions p with p + 1 < length (so block position 1 has a label)."""
    candidates = torch.nonzero(loss_mask[: max(length - 1, 0)].bool(), as_tuple=False).flatten()
    if candidates.numel() <= num_anchors:
        return candidates
    pick = torch.randperm(candidates.numel(), generator=generator)[:num_anchors]
    return candidates[pick].sort().values


def anchor_generator(seed: int, epoch: int, sample_index: int) -> torch.Generator:
    """Reproducible anchors: the same seed, epoch and sample always give the same blocks, on every rank."""
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + epoch) * 1_000_033 + sample_index)
    return g


def build_blocks(
    sequences: list[tuple[torch.Tensor, torch.Tensor]],
    seq_len: int,
    num_anchors: int,
    block_size: int,
    mask_token_id: int,
    gamma: float,
    anchors: list[torch.Tensor],
) -> BlockBatch:
    """Pad sequences to seq_len and lay out their blocks. `sequences` holds (input_ids [L], loss_mask [L])."""
    B, A, bs = len(sequences), num_anchors, block_size
    input_ids = torch.zeros(B, seq_len, dtype=torch.long)
    resp = torch.zeros(B, seq_len, dtype=torch.bool)
    anchor_pos = torch.zeros(B, A, dtype=torch.long)
    valid = torch.zeros(B, A, dtype=torch.bool)
    lengths = torch.zeros(B, dtype=torch.long)
    for b, ((ids, lm), anc) in enumerate(zip(sequences, anchors, strict=True)):
        L = ids.numel()
        assert seq_len >= L, f"sequence of {L} tokens does not fit bucket {seq_len}"
        input_ids[b, :L] = ids
        resp[b, :L] = lm.bool()
        lengths[b] = L
        n = min(anc.numel(), A)
        anchor_pos[b, :n] = anc[:n]
        valid[b, :n] = True

    k = torch.arange(bs)  # [bs]
    pos = anchor_pos[:, :, None] + k[None, None, :]  # [B, A, bs]
    in_seq = (pos < lengths[:, None, None]) & valid[:, :, None]  # [B, A, bs]
    safe = pos.clamp(max=seq_len - 1)
    tokens_at = torch.gather(input_ids, 1, safe.flatten(1)).view(B, A, bs)  # [B, A, bs]
    resp_at = torch.gather(resp, 1, safe.flatten(1)).view(B, A, bs)  # [B, A, bs]

    block_ids = torch.full((B, A, bs), mask_token_id, dtype=torch.long)
    block_ids[:, :, 0] = torch.where(valid, tokens_at[:, :, 0], mask_token_id)  # padding blocks: mask tokens only
    decay = torch.exp(-(k.float() - 1).clamp(min=0) / gamma)  # [bs]
    decay[0] = 0.0  # block position 0 is the anchor itself: given, not predicted
    weights = decay[None, None, :] * (in_seq & resp_at).float()  # [B, A, bs]
    labels = torch.where(weights > 0, tokens_at, torch.zeros_like(tokens_at))
    return BlockBatch(
        input_ids=input_ids,
        anchors=anchor_pos,
        anchor_valid=valid,
        block_ids=block_ids.view(B, A * bs),  # [B, A*bs]: block j's tokens at [j*bs, (j+1)*bs)
        block_pos=pos.view(B, A * bs),  # [B, A*bs]
        labels=labels.view(B, A * bs),  # [B, A*bs]
        label_index=torch.nonzero(weights.flatten() > 0).flatten(),  # [N] positions in the flat [B*A*bs]
        weights=weights.view(B, A * bs),  # [B, A*bs]
        block_size=bs,
    )


def make_mask_mod(anchors: torch.Tensor, anchor_valid: torch.Tensor, seq_len: int, block_size: int):
    """The mask as a flex `mask_mod(b, h, q_idx, kv_idx) -> bool`.

    Written with tensor ops only, so the same function serves flex (scalar indices under vmap) and the dense reference
    (broadcast index tensors). It reads one int32 tensor, each block's context limit (its anchor, 0 for a padding
    block): FlashAttention-4's mask code loads integer tensors, and one lookup a block is all it needs.
    """
    limit = torch.where(anchor_valid, anchors, 0).to(torch.int32)  # [B, A]: context keys below it are seen

    def mask_mod(b, h, q_idx, kv_idx):
        blk = q_idx // block_size
        is_ctx = kv_idx < seq_len
        sees_ctx = is_ctx & (kv_idx < limit[b, blk])
        own_block = (~is_ctx) & ((kv_idx - seq_len) // block_size == blk)
        return sees_ctx | own_block

    return mask_mod


TILE = 128  # flex_attention's block size: the mask is described per 128 x 128 tile


def tile_maps(
    anchors: torch.Tensor, anchor_valid: torch.Tensor, seq_len: int, block_size: int, tile: int = TILE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which (query tile, kv tile) pairs hold allowed entries, from the anchors alone: (partial, full), each
    [B, Qt, KVt] bool. A full tile is allowed everywhere (flex skips the mask there); a partial tile needs the
    mask_mod; every other tile is empty. No Q x KV evaluation and nothing to compile: a few small tensor ops.

    A query tile of `tile` rows holds `tile / block_size` blocks (padded blocks count as invalid). Its context tiles
    are full below its smallest anchor when all its blocks are valid, partial up to its largest anchor; its own
    blocks' keys ([seq_len + q0, seq_len + q1)) are partial tiles (block-diagonal)."""
    B, A = anchors.shape
    q_len, kv_len = A * block_size, seq_len + A * block_size
    per = max(1, tile // block_size)  # blocks per query tile (block_size divides the tile: checked by the config)
    q_tiles, kv_tiles = -(-q_len // tile), -(-kv_len // tile)
    pad = q_tiles * per - A
    anc = torch.nn.functional.pad(anchors, (0, pad)).view(B, q_tiles, per)  # [B, Qt, per]
    val = torch.nn.functional.pad(anchor_valid, (0, pad)).view(B, q_tiles, per)  # [B, Qt, per]
    big = torch.iinfo(anc.dtype).max
    lo = torch.where(val, anc, big).amin(-1)  # [B, Qt] smallest valid anchor
    hi = torch.where(val, anc, -1).amax(-1)  # [B, Qt] largest valid anchor (-1: none)
    all_valid = val.all(-1)  # [B, Qt]
    start = torch.arange(kv_tiles, device=anchors.device) * tile  # [KVt] first kv index of each tile
    end = start + tile  # one past the last
    is_ctx_tile = start < seq_len  # [KVt]
    ctx_full = (end <= seq_len)[None, None, :] & all_valid[..., None] & (end[None, None, :] <= lo[..., None])
    ctx_partial = is_ctx_tile[None, None, :] & (start[None, None, :] < hi[..., None]) & ~ctx_full  # [B, Qt, KVt]
    q0 = torch.arange(q_tiles, device=anchors.device) * tile  # [Qt] first query row of each tile
    q1 = torch.clamp(q0 + tile, max=q_len)  # one past its last row
    own = (start[None, :] < seq_len + q1[:, None]) & (end[None, :] > seq_len + q0[:, None])  # [Qt, KVt]
    partial = ctx_partial | own[None]  # [B, Qt, KVt]
    return partial & ~ctx_full, ctx_full


def _as_blocks(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, Qt, KVt] bool -> (num [B, 1, Qt] int32, indices [B, 1, Qt, KVt] int32, the set tiles first, ascending)."""
    num = tiles.sum(-1, dtype=torch.int32)
    order = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num[:, None], order[:, None]  # [B, 1, Qt], [B, 1, Qt, KVt]: one head row, shared by every head


def block_mask_from_anchors(anchors: torch.Tensor, anchor_valid: torch.Tensor, seq_len: int, block_size: int):
    """The flex BlockMask of the DFlash layout, built from the tile maps with the public `BlockMask.from_kv_blocks`
    and the shared `mask_mod` for partial tiles. Exact (tests compare it with the dense mask tile by tile)."""
    from torch.nn.attention.flex_attention import BlockMask

    partial, full = tile_maps(anchors, anchor_valid, seq_len, block_size)
    kv_num, kv_idx = _as_blocks(partial)
    full_num, full_idx = _as_blocks(full)
    B, A = anchors.shape
    lengths = (A * block_size, seq_len + A * block_size)
    mod = make_mask_mod(anchors, anchor_valid, seq_len, block_size)
    try:
        return BlockMask.from_kv_blocks(
            kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=TILE, mask_mod=mod, seq_lengths=lengths
        )
    except TypeError:  # torch releases before seq_lengths: the lengths are the tiles' (the buckets are multiples)
        return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=TILE, mask_mod=mod)


def dense_mask(anchors: torch.Tensor, anchor_valid: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """The same mask materialised: [B, 1, Q_LEN, KV_LEN] bool. For the dense reference and tests only."""
    B, A = anchors.shape
    q_len, kv_len = A * block_size, seq_len + A * block_size
    dev = anchors.device
    b = torch.arange(B, device=dev).view(B, 1, 1, 1)  # [B, 1, 1, 1]
    q = torch.arange(q_len, device=dev).view(1, 1, q_len, 1)  # [1, 1, Q, 1]
    kv = torch.arange(kv_len, device=dev).view(1, 1, 1, kv_len)  # [1, 1, 1, KV]
    return make_mask_mod(anchors, anchor_valid, seq_len, block_size)(b, None, q, kv)  # [B, 1, Q, KV]


def dense_score_gib(batch: int, heads: int, q_len: int, kv_len: int) -> float:
    """Size of one fp32 attention score matrix: what an eager (dense) attention allocates at least."""
    return batch * heads * q_len * kv_len * 4 / 2**30


def bucket_for(length: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds `length`, or None when it is longer than the largest."""
    for b in buckets:
        if length <= b:
            return b
    return None
