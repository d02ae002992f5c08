"""Will it fit? Per-rank memory planned from the configs before anything is loaded, so that a target too large for
the chosen `target.parallel` is refused in seconds with the numbers and a mode that fits, not by an OOM minutes in.

Counted per rank: the target's share (whole, 1/N of each decoder layer for `tensor: N`, 1/world plus one gathered
layer for `fsdp`; embedding, final norm and LM head always whole), the drafter with its gradients and AdamW state
(16 bytes a parameter: fp32 weights, gradients, two moments), and the activations at the largest bucket. The
activation model is calibrated on the Qwen3-8B shape on an H200 (seq 3072, 512 anchors, block 16: 48.8 GiB peak,
17.9 GiB of it activations: about 10 bytes per query and vocabulary entry for the logits and their gradients, 40 per
query, hidden unit and drafter layer), with a 10 % margin and 1.5 GiB for the CUDA context and allocator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.errors import ConfigError

GiB = 2**30
OVERHEAD = 1.5 * GiB
MARGIN = 1.10


@dataclass(frozen=True)
class Shapes:
    layer_params: int  # one decoder layer
    layers: int
    whole_params: int  # embedding, final norm, LM head: never sharded
    drafter_params: int
    hidden: int
    intermediate: int
    vocab: int
    drafter_layers: int
    n_layer_ids: int
    dtype_bytes: int


def target_shapes(hf_config, drafter_dims, n_layer_ids: int, dtype_bytes: int) -> Shapes:
    """Parameter counts from the configs alone: both models built on the meta device (no memory, a second)."""
    from transformers import AutoModelForCausalLM

    from trainer.model.drafter import Drafter

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
        drafter = Drafter(drafter_dims)
    layers = getattr(model, "model", model).layers
    layer_params = sum(p.numel() for p in layers[0].parameters())
    total = sum(p.numel() for p in model.parameters())
    return Shapes(
        layer_params=layer_params,
        layers=len(layers),
        whole_params=total - layer_params * len(layers),
        drafter_params=sum(p.numel() for p in drafter.parameters()),
        hidden=int(hf_config.hidden_size),
        intermediate=int(hf_config.intermediate_size),
        vocab=int(hf_config.vocab_size),
        drafter_layers=drafter_dims.num_layers,
        n_layer_ids=n_layer_ids,
        dtype_bytes=dtype_bytes,
    )


def per_rank_bytes(s: Shapes, mode: str, ways: int, seq: int, queries: int, batch: int) -> dict[str, float]:
    """Bytes per rank by part for `mode` split `ways` ways (tensor: N, fsdp: world size)."""
    layers = s.layer_params * s.layers * s.dtype_bytes
    if mode == "tensor":
        target = layers / ways
    elif mode == "fsdp":
        target = layers / ways + s.layer_params * s.dtype_bytes  # one layer gathered for its forward
    else:
        target = layers
    target += s.whole_params * s.dtype_bytes
    drafter = 16.0 * s.drafter_params
    acts = batch * queries * (10.0 * s.vocab + 40.0 * s.hidden * s.drafter_layers)
    mlp_ways = ways if mode == "tensor" else 1
    acts += batch * seq * (2.0 * s.hidden * (s.n_layer_ids + 2) + 6.0 * s.intermediate / mlp_ways)
    total = MARGIN * (target + drafter + acts) + OVERHEAD
    return {"target": target, "drafter_and_adamw": drafter, "activations": acts, "total": total}


def describe(mode: str, ways: int) -> str:
    return "replicate" if mode == "replicate" else (f"tensor: {ways}" if mode == "tensor" else f"fsdp over {ways}")


def check(
    s: Shapes, mode: str, ways: int, world: int, seq: int, queries: int, batch: int, budget: float, source: str
) -> dict[str, float]:
    """The plan for this run; a ConfigError naming the numbers and the modes that fit when it does not."""
    need = per_rank_bytes(s, mode, ways, seq=seq, queries=queries, batch=batch)
    if need["total"] <= budget:
        return need
    tensor = [("tensor", n) for n in (2, 4, 8) if n != ways or mode != "tensor"]
    options = tensor + [("fsdp", w) for w in (world, 8) if w > 1]
    fits = []
    for m, n in options:
        other = per_rank_bytes(s, m, n, seq=seq, queries=queries, batch=batch)["total"]
        if other <= budget:
            fits.append(f"{describe(m, n)} ({n} GPUs: {other / GiB:.1f} GiB a rank)")
    parts = ", ".join(f"{k.replace('_', ' ')} {v / GiB:.1f}" for k, v in need.items() if k != "total")
    hint = f"would fit: {'; '.join(fits[:3])}" if fits else "no tensor or fsdp split up to 8 GPUs fits either"
    raise ConfigError(
        source,
        "target.parallel",
        f"{describe(mode, ways)} needs about {need['total'] / GiB:.1f} GiB "
        f"a rank ({parts}; with margin and CUDA context), {budget / GiB:.1f} GiB available; {hint}",
    )
