"""The target's keys and values while decoding many rows of different lengths at once: slot t holds position t.

Hugging Face's caches append every new token at one shared index, so rows that accept different numbers of drafted
tokens would leave holes to mask and a cache that grows by a whole block every step. Here each row writes its tokens
at their own positions (a scatter), so a row's rejected drafts are simply overwritten by the next step, and a plain
causal mask by position (key slot <= query position) is exact: every slot below a row's query positions holds that
row's accepted token there. Duck-typed to the one method HF attention calls (`update`), which keeps it working across
transformers releases (4.x passes `cache_kwargs` positionally, 5.x `kwargs=` by name).
"""

from __future__ import annotations

import torch


class PositionCache:
    """Per layer, keys and values [B, G, capacity, D] (G: the KV heads this rank holds), written at `positions`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.positions: torch.Tensor | None = None  # [B, q]: where the tokens of the coming forward go
        self.width = 0  # keys returned to attention: one past the largest position written so far this forward

    def prepare(self, positions: torch.Tensor, width: int) -> None:
        """Set before each forward: its tokens' positions [B, q], and `width` > every position in it (host-known)."""
        assert width <= self.capacity, f"position {width - 1} past the cache's {self.capacity} slots"
        self.positions, self.width = positions, width

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key/value [B, G, q, D] of the new tokens -> every slot's [B, G, width, D] (HF's Cache.update contract)."""
        if layer_idx not in self.keys:
            B, G, _, D = key.shape
            self.keys[layer_idx] = key.new_zeros(B, G, self.capacity, D)
            self.values[layer_idx] = value.new_zeros(B, G, self.capacity, D)
        index = self.positions[:, None, :, None].expand_as(key)  # [B, G, q, D]
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k.scatter_(2, index, key)
        v.scatter_(2, index, value)
        return k[:, :, : self.width], v[:, :, : self.width]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.width

    def keep(self, rows: torch.Tensor) -> None:
        """Only these rows go on (finished rows leave the batch and cost nothing after)."""
        for store in (self.keys, self.values):
            for i, t in store.items():
                store[i] = t.index_select(0, rows)


def causal_by_position(positions: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask [B, 1, q, width]: a query at position p sees key slots 0..p (0 there, the dtype's min
    elsewhere; additive so that both HF's eager and SDPA attention take it as it is)."""
    slots = torch.arange(width, device=positions.device)
    allowed = slots[None, None, :] <= positions[:, :, None]  # [B, q, width]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=positions.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]
