"""Attention backends for the drafter: compiled flex_attention behind a guard, and a dense masked reference.

Both take q_BHQD [B, H, Q, D] and k_BGKD / v_BGKD [B, G, KV, D] (G = key/value heads, H % G == 0) and one mask
definition (trainer.model.mask.make_mask_mod).

The guard: eager flex_attention materialises the full score matrix (the "dense fallback": 72 GiB at seq 3072 with
512 anchors, 288 GiB at ~49K tokens). The flex call sits in a small compiled function whose first statement raises
DenseFallbackError when it is not being traced by Dynamo. Under compilation the check folds away; if the function ever
runs eagerly (compile disabled, recompile limit hit, frame skipped) it raises before allocating anything.
"""

from __future__ import annotations

import os

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from trainer.errors import ConfigError, DenseFallbackError
from trainer.model.mask import block_mask_from_anchors, dense_mask, dense_score_gib


def _likely_cause(limit_hit: bool = False) -> str:
    if not limit_hit and (os.environ.get("TORCH_COMPILE_DISABLE") or torch._dynamo.config.disable):
        return "torch.compile is disabled (TORCH_COMPILE_DISABLE is set)"
    return (
        "Dynamo hit its recompile limit or skipped the frame (a shape outside the preflight buckets, or too many "
        "distinct shapes); check the recompile events in metrics.jsonl"
    )


def _fallback_message(B: int, H: int, Q: int, KV: int, limit_hit: bool = False) -> str:
    gib = dense_score_gib(B, H, Q, KV)
    return (
        f"flex guard: flex_attention was about to run eagerly; the dense fallback would allocate {gib:.2f} GiB for one "
        f"fp32 score matrix (B={B} x H={H} x Q={Q} x KV={KV} x 4 bytes). Cause: {_likely_cause(limit_hit)}. "
        "Refusing to run."
    )


# flex_attention's `kernel_options` (tile sizes, USE_TMA...) for every call; empty: Inductor's defaults for the GPU.
# Read when a shape is compiled, so set it before the preflight (bench/flex_tiles.py measures the choices).
KERNEL_OPTIONS: dict[str, int | bool] = {}


def _kernel_options(flash: bool) -> dict | None:
    """FLASH takes no Triton tile options: BACKEND alone."""
    return {"BACKEND": "FLASH"} if flash else (dict(KERNEL_OPTIONS) or None)


def _guarded_flex(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask, flash: bool = False
) -> torch.Tensor:
    if not torch.compiler.is_compiling():
        B, H, Q, _ = q.shape
        raise DenseFallbackError(_fallback_message(B, H, Q, k.shape[2]))
    return flex_attention(
        q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1], kernel_options=_kernel_options(flash)
    )


def _mask_shape(batch: int, anchors: int, seq_len: int, block_size: int) -> tuple[int, int, int]:
    """(B, Q_LEN, KV_LEN) of the attention a mask is built for (layout in trainer.model.mask)."""
    return batch, anchors * block_size, seq_len + anchors * block_size


# Compiled once, at module level. dynamic=False: shapes are bucketed, and the preflight compiles every bucket.
_compiled_flex = torch.compile(_guarded_flex, dynamic=False, fullgraph=True)
# With fullgraph=True, recent torch raises this at the recompile limit instead of running the frame eagerly (older
# torch runs it eagerly, and the guard raises). Either way the user sees DenseFallbackError.
_LIMIT_HIT = getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", ())


def guarded_flex(q, k, v, block_mask, flash: bool = False):
    try:
        return _compiled_flex(q, k, v, block_mask, flash)
    except _LIMIT_HIT as e:
        B, H, Q, _ = q.shape
        raise DenseFallbackError(_fallback_message(B, H, Q, k.shape[2], limit_hit=True)) from e


class FlexBackend:
    """Compiled, guarded flex_attention with a block-sparse mask built from the anchors (no compile, nothing
    quadratic: trainer.model.mask.block_mask_from_anchors). `kernel`: `triton` (Inductor's template) or `flash`
    (FlashAttention-4's CuTe DSL kernels, trainer.model.flash_kernel); the same mask and the same guard for both.
    `expand_kv`: repeat keys and values to every query head in training (below)."""

    name = "flex"

    def __init__(self, kernel: str = "triton", expand_kv: bool = True) -> None:
        self.kernel = kernel
        self.flash = kernel == "flash"
        self.expand_kv = expand_kv
        if self.flash:
            from trainer.model.flash_kernel import patch_torch

            patch_torch()

    def build_mask(self, anchors, anchor_valid, seq_len: int, block_size: int, num_heads: int) -> BlockMask:
        return block_mask_from_anchors(anchors, anchor_valid, seq_len, block_size)

    def __call__(self, q_BHQD, k_BGKD, v_BGKD, mask: BlockMask) -> torch.Tensor:
        if self.expand_kv and torch.is_grad_enabled() and q_BHQD.requires_grad and q_BHQD.shape[1] != k_BGKD.shape[1]:
            # training: keys and values repeated to every query head. The backward's dK/dV then runs one program a
            # query head instead of one a KV head looping over its group: 2.82 against 3.28 ms forward and backward
            # a layer at the paper shape on an H200 (bench/flex_tiles.py `expand_kv`); autograd sums the copies
            # back. FLASH gains too: 2.27 against 2.36 ms on an H100 (bench/flash_check.py). Evaluation (no grad)
            # keeps the grouped call.
            groups = q_BHQD.shape[1] // k_BGKD.shape[1]
            k_BGKD, v_BGKD = k_BGKD.repeat_interleave(groups, dim=1), v_BGKD.repeat_interleave(groups, dim=1)
        if torch.compiler.is_compiling():  # inside a compiled drafter layer: traced into its graph, the guard folded
            return _guarded_flex(q_BHQD, k_BGKD, v_BGKD, mask, self.flash)
        return guarded_flex(q_BHQD, k_BGKD, v_BGKD, mask, self.flash)


class DenseBackend:
    """The masked reference: explicit softmax over a materialised mask. Refused above a size cap."""

    name = "dense"

    def __init__(self, max_gib: float, source: str = "<config>") -> None:
        self.max_gib = max_gib
        self.source = source

    def check_size(self, batch: int, num_heads: int, seq_len: int, anchors: int, block_size: int) -> None:
        """Refuse a score matrix above the cap: at each mask, and for the largest bucket before the target loads
        (trainer/run/build.py), so that a run that cannot fit says so before minutes of loading."""
        B, q_len, kv_len = _mask_shape(batch, anchors, seq_len, block_size)
        gib = dense_score_gib(B, num_heads, q_len, kv_len)
        if gib > self.max_gib:
            raise ConfigError(
                self.source,
                "attention.dense_max_gib",
                f"the dense reference would allocate {gib:.2f} GiB per score matrix at seq {seq_len} with "
                f"{anchors} anchors, above the cap of {self.max_gib:g} GiB; use backend: flex on a GPU",
            )

    def build_mask(self, anchors, anchor_valid, seq_len: int, block_size: int, num_heads: int) -> torch.Tensor:
        self.check_size(anchors.shape[0], num_heads, seq_len, anchors.shape[1], block_size)
        return dense_mask(anchors, anchor_valid, seq_len, block_size)  # [B, 1, Q, KV]

    def __call__(self, q_BHQD, k_BGKD, v_BGKD, mask: torch.Tensor) -> torch.Tensor:
        H, G = q_BHQD.shape[1], k_BGKD.shape[1]
        k_BHKD = k_BGKD.repeat_interleave(H // G, dim=1)  # [B, H, KV, D]
        v_BHKD = v_BGKD.repeat_interleave(H // G, dim=1)  # [B, H, KV, D]
        scale = q_BHQD.shape[-1] ** -0.5
        scores = (q_BHQD.float() @ k_BHKD.float().transpose(-1, -2)) * scale  # [B, H, Q, KV]
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # every row sees at least its own block: no NaN
        return (probs @ v_BHKD.float()).to(q_BHQD.dtype)  # [B, H, Q, D]


def make_backend(name: str, dense_max_gib: float, source: str = "<config>", kernel: str = "triton"):
    return FlexBackend(kernel) if name == "flex" else DenseBackend(dense_max_gib, source)
