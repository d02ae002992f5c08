"""Where the frozen target lives: replicated on every rank, tensor-parallel over groups of N ranks, or FSDP2-sharded.

`target.parallel`:
    replicate      every rank holds the whole target (the default; right for an 8B target)
    {tensor: N}    each decoder layer split over N ranks with torch.distributed.tensor.parallel (q/k/v and gate/up
                   column-wise, o and down row-wise: one all-reduce after attention and one after the MLP); the
                   layer outputs, hence the hidden states the drafter reads, are the same on every rank of a group
    fsdp           each decoder layer's weights sharded over all ranks with FSDP2 (`fully_shard`), gathered for its
                   forward and freed after: for targets too large even for a tensor-parallel group
The embedding and the LM head stay whole on every rank (the drafter uses both). A 2-D DeviceMesh (dp x tp) makes the
groups: data is sharded over dp. The drafter's gradient all-reduce spans every rank: the ranks of one tensor group
hold the same data and compute the same gradient, and averaging over them keeps every replica bitwise equal without
relying on kernels being deterministic (a ring all-reduce moves the same bytes per rank either way).
The target is built for one device (trainer/model/target.py); `shard_and_place` is the first step of
trainer/run/parallelize.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from trainer.errors import ConfigError

TP_PLAN = {  # a Llama/Qwen decoder layer; HF attention reshapes with -1 heads, so local shards need no changes
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


@dataclass(frozen=True)
class Layout:
    mode: str  # replicate | tensor | fsdp
    tp: int  # ranks per tensor-parallel group (1 unless tensor)
    dp: int  # data-parallel ranks: distinct batches per step
    dp_rank: int
    mesh: object = None  # DeviceMesh (dp, tp) or (dp,)

    @property
    def lockstep_eval(self) -> bool:
        """Sharded targets run collectives in every forward: every rank must decode the same prompts, in step."""
        return self.mode != "replicate"

    def describe(self) -> dict:
        return {"mode": self.mode, "tp": self.tp, "dp": self.dp}


def make_layout(mode: str, tp: int, world, source: str = "<config>") -> Layout:
    if mode == "replicate" or world.size == 1 and mode == "fsdp":
        return Layout("replicate", 1, world.size, world.rank)
    from torch.distributed.device_mesh import init_device_mesh

    device_type = world.device.type
    if mode == "tensor":
        if world.size % tp:
            raise ConfigError(source, "target.parallel", f"tensor: {tp} does not divide the {world.size} ranks")
        mesh = init_device_mesh(device_type, (world.size // tp, tp), mesh_dim_names=("dp", "tp"))
        return Layout("tensor", tp, world.size // tp, mesh.get_local_rank("dp"), mesh)
    mesh = init_device_mesh(device_type, (world.size,), mesh_dim_names=("dp",))
    return Layout("fsdp", 1, world.size, world.rank, mesh)


def check_divisible(config, tp: int, source: str) -> None:
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = int(getattr(config, key))
        if value % tp:
            raise ConfigError(source, "target.parallel", f"tensor: {tp} does not divide the target's {key} ({value})")


def shard_target(model: nn.Module, layers: nn.ModuleList, layout: Layout, source: str = "<config>") -> None:
    """Shard the decoder layers in place (DTensor parameters); embeddings, final norm and LM head stay whole."""
    if layout.mode == "tensor":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        check_divisible(model.config, layout.tp, source)
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        plan = {name: styles[kind]() for name, kind in TP_PLAN.items()}
        for layer in layers:
            parallelize_module(layer, layout.mesh["tp"], plan)
    elif layout.mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in layers:
            fully_shard(layer, mesh=layout.mesh, reshard_after_forward=True)


def shard_and_place(
    model: nn.Module, layers: nn.ModuleList, layout: Layout, device: torch.device, source: str = "<config>"
) -> None:
    """Shard the decoder layers by `layout`, then put the whole model on `device`, frozen. A target built on the CPU
    is moved; a random one built on the meta device (too large to build whole: trainer/model/target.py) gets its
    shards allocated and filled here, from seed 0 as a whole random target is, with the run's random streams left
    where they were."""
    on_meta = any(p.is_meta for p in model.parameters())
    shard_target(model, layers, layout, source)
    if on_meta:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(0)  # the same random target on every rank and every run
            init_meta_target(model, device, float(getattr(model.config, "initializer_range", 0.02)))
    else:
        model.to(device)
    model.requires_grad_(False)  # tensor parallel's new parameters are trainable: frozen again


def init_meta_target(model: nn.Module, device: torch.device, std: float) -> None:
    """A random target too large to build whole on each rank: built on the meta device, sharded, then each rank
    allocates and fills only its shard (speed and memory measurements do not need particular weights)."""
    model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)
        base = getattr(model, "model", model)
        rotary = getattr(base, "rotary_emb", None)
        if rotary is not None:  # its buffers were never computed on the meta device: build it again where it lives
            with torch.device(device):  # transformers 4.x takes a device argument, 5.x follows the default device
                base.rotary_emb = type(rotary)(config=model.config)
