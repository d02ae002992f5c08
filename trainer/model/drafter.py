"""The DFlash drafter: Qwen3-style layers whose queries come from block tokens and whose keys/values also include
the fused target context.

    target hidden [B, S, n*Ht] --fc--> RMSNorm --> ctx [B, S, C]            (C = hidden size, equal to the target's)
    block tokens  [B, Q]  --target embed (frozen)--> x [B, Q, C]            (Q = anchors * block size)
    every layer:  x += Attn(q from norm(x); k, v from [ctx ; norm(x)])  non-causal, mask from trainer.model.mask
                  x += MLP(norm(x))
    final norm --> target LM head (frozen) at the positions that carry a label
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trainer.model.loss import linear_cross_entropy


@dataclass
class DrafterDims:
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    num_target_layers: int  # how many target layers are concatenated into the context
    rms_eps: float = 1e-6
    rope_theta: float = 1_000_000.0


def rope_cos_sin(pos: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] positions -> cos, sin [B, T, 1, head_dim] (rotate-half convention, as Qwen3/Llama)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float32) / head_dim))
    angles = pos.float()[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat([angles, angles], dim=-1)[:, :, None, :]  # [B, T, 1, D]
    return emb.cos(), emb.sin()


def apply_rope(x_BTHD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x_BTHD.chunk(2, dim=-1)  # [B, T, H, D/2] each
    rotated = torch.cat([-x2, x1], dim=-1)  # [B, T, H, D]
    return (x_BTHD.float() * cos + rotated.float() * sin).to(x_BTHD.dtype)


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm whose fp32 weight is cast to the input's dtype: under bf16 autocast the input is bf16, and
    mismatched dtypes make torch skip its fused kernel for a slower composite one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.eps)


class DrafterAttention(nn.Module):
    def __init__(self, d: DrafterDims) -> None:
        super().__init__()
        self.d = d
        self.q_proj = nn.Linear(d.hidden, d.num_heads * d.head_dim, bias=False)
        self.k_proj = nn.Linear(d.hidden, d.num_kv_heads * d.head_dim, bias=False)
        self.v_proj = nn.Linear(d.hidden, d.num_kv_heads * d.head_dim, bias=False)
        self.o_proj = nn.Linear(d.num_heads * d.head_dim, d.hidden, bias=False)
        self.q_norm = RMSNorm(d.head_dim, eps=d.rms_eps)
        self.k_norm = RMSNorm(d.head_dim, eps=d.rms_eps)

    def forward(self, x_BQC, ctx_BSC, rope_q, rope_ctx, mask, backend) -> torch.Tensor:
        B, Q, _ = x_BQC.shape
        S = ctx_BSC.shape[1]
        H, G, D = self.d.num_heads, self.d.num_kv_heads, self.d.head_dim
        q = self.q_norm(self.q_proj(x_BQC).view(B, Q, H, D))  # [B, Q, H, D]
        q = apply_rope(q, *rope_q)
        kv_in = torch.cat([ctx_BSC, x_BQC], dim=1)  # [B, S+Q, C]: same k/v projections for context and block
        k = self.k_norm(self.k_proj(kv_in).view(B, S + Q, G, D))  # [B, S+Q, G, D]
        v = self.v_proj(kv_in).view(B, S + Q, G, D)  # [B, S+Q, G, D]
        cos = torch.cat([rope_ctx[0], rope_q[0]], dim=1)  # [B, S+Q, 1, D]
        sin = torch.cat([rope_ctx[1], rope_q[1]], dim=1)  # [B, S+Q, 1, D]
        k = apply_rope(k, cos, sin)
        dt = v.dtype  # under autocast the norms may return fp32 while the projections give bf16: one dtype for flex
        # [B, H, Q, D] queries; [B, G, S+Q, D] keys and values
        q_BHQD, k_BGKD, v_BGKD = q.to(dt).transpose(1, 2), k.to(dt).transpose(1, 2), v.transpose(1, 2)
        out_BHQD = backend(q_BHQD, k_BGKD, v_BGKD, mask)  # [B, H, Q, D]
        out = out_BHQD.transpose(1, 2).reshape(B, Q, H * D)  # [B, Q, H*D]
        return self.o_proj(out)  # [B, Q, C]


class DrafterMLP(nn.Module):
    def __init__(self, d: DrafterDims) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d.hidden, d.intermediate, bias=False)
        self.up_proj = nn.Linear(d.hidden, d.intermediate, bias=False)
        self.down_proj = nn.Linear(d.intermediate, d.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, d: DrafterDims) -> None:
        super().__init__()
        self.input_norm = RMSNorm(d.hidden, eps=d.rms_eps)
        self.attn = DrafterAttention(d)
        self.post_attn_norm = RMSNorm(d.hidden, eps=d.rms_eps)
        self.mlp = DrafterMLP(d)

    def forward(self, x, ctx, rope_q, rope_ctx, mask, backend) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), ctx, rope_q, rope_ctx, mask, backend)
        return x + self.mlp(self.post_attn_norm(x))


class Drafter(nn.Module):
    """Trainable part only: the frozen target's embedding and LM head are passed in, never registered here.

    Written for one device: checkpointing, compilation and data parallelism are applied from outside, to `layers` and
    to the whole (trainer/run/parallelize.py)."""

    def __init__(self, d: DrafterDims) -> None:
        super().__init__()
        self.d = d
        self.fc = nn.Linear(d.num_target_layers * d.hidden, d.hidden, bias=False)
        self.ctx_norm = RMSNorm(d.hidden, eps=d.rms_eps)
        self.layers = nn.ModuleList(DrafterLayer(d) for _ in range(d.num_layers))
        self.final_norm = RMSNorm(d.hidden, eps=d.rms_eps)

    @torch.no_grad()
    def init_linear_weights(self, std: float) -> None:
        """Every linear weight from N(0, std), as Hugging Face models initialise (norms stay at one)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=std)

    def forward(
        self,
        target_hidden: torch.Tensor,  # [B, S, n*C]
        block_emb: torch.Tensor,  # [B, Q, C] target embedding of the block tokens
        block_pos: torch.Tensor,  # [B, Q]
        mask,
        backend,
    ) -> torch.Tensor:
        B, S, _ = target_hidden.shape
        ctx = self.ctx_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))  # [B, S, C]
        ctx_pos = torch.arange(S, device=ctx.device).expand(B, S)  # [B, S]
        rope_ctx = rope_cos_sin(ctx_pos, self.d.head_dim, self.d.rope_theta)
        rope_q = rope_cos_sin(block_pos, self.d.head_dim, self.d.rope_theta)
        x = block_emb.to(ctx.dtype)  # [B, Q, C]
        for layer in self.layers:
            x = layer(x, ctx, rope_q, rope_ctx, mask, backend)  # [B, Q, C]
        return self.final_norm(x)  # [B, Q, C]


def drafter_dims(target_config, num_layers: int, num_target_layers: int, overrides: dict) -> DrafterDims:
    """Defaults from the target's config; the hidden size must equal the target's (shared embedding and LM head)."""
    tc = target_config
    rope_theta = getattr(tc, "rope_theta", None)
    if rope_theta is None:
        rope_theta = (getattr(tc, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    heads = overrides.get("num_heads") or tc.num_attention_heads
    return DrafterDims(
        hidden=tc.hidden_size,
        intermediate=overrides.get("intermediate_size") or tc.intermediate_size,
        num_heads=heads,
        num_kv_heads=overrides.get("num_kv_heads") or getattr(tc, "num_key_value_heads", heads),
        head_dim=overrides.get("head_dim") or getattr(tc, "head_dim", None) or tc.hidden_size // heads,
        num_layers=num_layers,
        num_target_layers=num_target_layers,
        rms_eps=getattr(tc, "rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
    )


def block_loss(
    hidden_BQC: torch.Tensor,
    lm_head: nn.Module,
    labels: torch.Tensor,
    weights: torch.Tensor,
    fused: bool = False,
    kernel: str = "plain",
    index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted cross-entropy summed over labelled positions, the weight sum, and weighted correct predictions.

    Only positions with a label go through the LM head (a 151936-wide head on every block position would dominate
    memory). Returns sums, not means, so that callers can normalise over ranks and accumulation steps. `index`: the
    flat positions with a weight, in order (BlockBatch.label_index, found on the host); without it they are found
    here, which makes the host wait for the device.
    """
    if index is None:
        index = torch.nonzero(weights.flatten() > 0).flatten()  # [N]
    index = index.to(hidden_BQC.device)
    h = hidden_BQC.flatten(0, 1).index_select(0, index)  # [N, C]
    lab, w = labels.flatten().index_select(0, index), weights.flatten().index_select(0, index)  # [N]
    if kernel != "plain" and not fused and lm_head.bias is None:
        from trainer.model import ce_kernel

        if kernel == "fused" or ce_kernel.available(h.device):
            with torch.autocast(h.device.type, enabled=False):
                loss, correct = ce_kernel.fused_linear_cross_entropy(h, lm_head.weight, lab, w)
            return loss, w.float().sum(), correct
    if fused and lm_head.bias is None:  # chunked, logits never stored (trainer.model.loss)
        with torch.autocast(h.device.type, enabled=False):
            loss, correct = linear_cross_entropy(h, lm_head.weight, lab, w)
        return loss, w.float().sum(), correct
    logits = lm_head(h.to(lm_head.weight.dtype)).float()  # [N, V]
    ce = F.cross_entropy(logits, lab, reduction="none")  # [N]
    correct = (logits.argmax(-1) == lab).float()
    return (ce * w).sum(), w.sum(), (correct * w).sum()
