"""How a run is spread over its devices, applied in one function and one order (torchtitan's `parallelize`).

The target and the drafter are written for one device; `parallelize` takes them as built and applies, in order:

    1. target sharding      the decoder layers split by the layout (tensor parallel or FSDP2), then the target placed
                            on the device (trainer/model/parallel.py); a replicated target is already there
    2. checkpointing        each drafter layer wrapped to be recomputed in backward (use_reentrant=False)
    3. compile              the recompile limit in every thread that compiles, then regional compilation: the target's
                            layers (replicated only: sharded layers run eager) and the drafter's (training only)
    4. DDP                  the drafter in DistributedDataParallel over every rank, bf16 on the wire where configured

The order is what makes each step see the right thing: compile wraps the checkpointed layer, so the recompute is
traced into the compiled backward (torchtitan's full activation checkpointing under compile), and DDP wraps last, so
its hooks see the gradients the compiled layers produce. Every wrapper keeps the drafter's state-dict names, so
checkpoints and exports are those of the one-device model.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.nn.parallel import DistributedDataParallel

from trainer.config import TrainConfig
from trainer.model.compile_policy import PolicyInBackward, apply_compile_policy
from trainer.model.drafter import Drafter
from trainer.model.parallel import Layout, shard_and_place
from trainer.model.target import Target
from trainer.run.distributed import World


def parallelize(
    target: Target,
    drafter: Drafter,
    cfg: TrainConfig,
    *,
    layout: Layout,
    device: torch.device,
    world: World | None = None,
    for_training: bool = True,
    source: str = "<config>",
) -> nn.Module:
    """Apply the four steps above to the built target and drafter (in place). Returns the module a training step
    calls: the drafter, or its DDP wrapper when the world has several ranks and the build is for training."""
    if layout.mode != "replicate":
        shard_and_place(target.model, target.layers, layout, device, source)
    if for_training and cfg.drafter.activation_checkpointing:
        apply_checkpointing(drafter.layers)
    apply_compile(target, drafter, cfg, layout=layout, device=device, for_training=for_training)
    if for_training and world is not None and world.distributed:
        return apply_ddp(drafter, grad_reduce_dtype=cfg.grad_reduce_dtype)
    return drafter


def apply_checkpointing(layers: nn.ModuleList) -> None:
    """Each layer recomputed in backward instead of keeping its activations: torch's checkpoint wrapper, non-reentrant
    (DESIGN 5: the reentrant form gives no weight gradients to a layer whose input needs none, as the first layer's
    does not, and does not trace under compile)."""
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def apply_compile(
    target: Target,
    drafter: Drafter,
    cfg: TrainConfig,
    *,
    layout: Layout,
    device: torch.device,
    for_training: bool,
    backend: str = "inductor",
) -> None:
    """The compile policy, in one place. The recompile limit is set in this thread now, and in the autograd thread
    at the start of every backward (Dynamo's config is thread-local: DESIGN 5). `auto` compiles on CUDA only: on the
    CPU Inductor's compile costs more than it saves. The target compiles only where it is replicated (DTensor and
    FSDP hooks keep sharded layers eager); the drafter only for training with flex (`auto`), since decoding and
    evaluation run other shapes through the flex call's own compile."""
    apply_compile_policy(cfg.attention.recompile_limit)
    drafter.register_forward_hook(_policy_in_backward)
    cuda = device.type == "cuda"
    if _wanted(cfg.target.compile, auto=cuda) and layout.mode == "replicate":
        target.compile_layers(backend)
    if for_training and _wanted(cfg.drafter.compile, auto=cuda and cfg.attention.backend == "flex"):
        compile_layers(drafter.layers, backend)


def _wanted(setting: str, auto: bool) -> bool:
    return setting == "on" or (setting == "auto" and auto)


def _policy_in_backward(_module: nn.Module, _args: tuple, output: torch.Tensor) -> torch.Tensor | None:
    """The drafter's output passed through `PolicyInBackward`: last in forward, so first in backward, where it sets
    the recompile limit in the thread that runs the compiled backward graphs."""
    if torch.is_grad_enabled() and output.requires_grad:
        return PolicyInBackward.apply(output)
    return None


def compile_layers(layers: nn.ModuleList, backend: str = "inductor") -> None:
    """Regional compilation: each layer (checkpointed or not) wrapped in a `CompiledLayer`."""
    for i, layer in enumerate(layers):
        layers[i] = CompiledLayer(layer, backend)


def is_compiled(layers: nn.ModuleList) -> bool:
    """Whether `compile_layers` wrapped these layers."""
    return any(isinstance(layer, CompiledLayer) for layer in layers)


class CompiledLayer(nn.Module):
    """A layer whose forward runs through torch.compile where autograd records, and eagerly under no_grad.

    Compiled with dynamic=False and fullgraph: eagerly the norms, RoPE's fp32 passes and the MLP's activation each read
    and write the whole [Q, width] activation; compiled they fuse into the matmuls' neighbours. The layers share one
    code object and take their weights as graph inputs, so one graph per bucket serves all of them, and the flex call
    inside is traced into the same graph (its guard still raises wherever it would run eagerly). With grad (a training
    step: bucketed shapes, every one compiled by the preflight) the compiled forward runs; under no_grad (decoding and
    evaluation: shapes the preflight did not compile for the layers) the layer runs eagerly, its flex call compiled on
    its own. The state dict is the layer's: no prefix of this wrapper's."""

    def __init__(self, layer: nn.Module, backend: str = "inductor") -> None:
        super().__init__()
        self.layer = layer
        # a function, not a module: torch.compile of the module would register the layer a second time
        self.compiled = torch.compile(layer.forward, backend=backend, dynamic=False, fullgraph=True)
        self.register_state_dict_post_hook(_drop_prefix)
        self.register_load_state_dict_pre_hook(_add_prefix)

    def forward(self, *args: object) -> torch.Tensor:
        return self.compiled(*args) if torch.is_grad_enabled() else self.layer(*args)


_INNER = "layer."


def _drop_prefix(_module: nn.Module, state_dict: dict, prefix: str, _metadata: object) -> None:
    for key in [k for k in state_dict if k.startswith(prefix + _INNER)]:
        state_dict[prefix + key[len(prefix + _INNER) :]] = state_dict.pop(key)


def _add_prefix(_module: nn.Module, state_dict: dict, prefix: str, *_rest: object) -> None:
    for key in [k for k in state_dict if k.startswith(prefix)]:
        state_dict[prefix + _INNER + key[len(prefix) :]] = state_dict.pop(key)


def apply_ddp(drafter: Drafter, *, grad_reduce_dtype: str) -> DistributedDataParallel:
    """The drafter data-parallel over every rank. Gradients live in the all-reduce buckets (no copy in and out of
    them); with `bfloat16`, half the bytes go on the wire and the optimiser still sees fp32."""
    model = DistributedDataParallel(drafter, gradient_as_bucket_view=True)
    if grad_reduce_dtype == "bfloat16":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

        model.register_comm_hook(None, bf16_compress_hook)
    return model
