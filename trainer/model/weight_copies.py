"""bf16 copies of the drafter's linear weights, written after each update, that the forward reads.

Under bf16 autocast every matmul casts its fp32 weight to bf16, every step: the drafter's 1.05 B weights at the paper
shape are read (4 bytes) and written (2 bytes) again each forward. Here each linear layer keeps a bf16 copy that
the optimizer's step refreshes right after the update (one `torch._foreach_copy_` over all of them), and its forward
reads that copy. The copy is the same rounding of the same fp32 weight that autocast's cast would make, and the
gradient goes back to the fp32 weight the way the cast's does (cast to fp32), so losses and gradients are the same
bit for bit. The copies are neither parameters nor buffers: checkpoints, exports, DDP and the optimizer never see
them. Loading weights (resume, init_from) refreshes them through a load_state_dict hook.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _ReadCopy(torch.autograd.Function):
    """Forward: the bf16 copy (a view of it). Backward: the gradient as the fp32 weight's, as autocast's cast does."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        ctx.dtype = weight.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.dtype), None


class Linear(nn.Linear):
    """nn.Linear that, once given a low-precision copy of its weight (`weight_copy`), multiplies by it under
    autocast of that dtype; anywhere else (no copy, no autocast, another dtype) it is nn.Linear."""

    weight_copy: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        copy = self.weight_copy
        if copy is not None and torch.is_autocast_enabled(x.device.type) and (
            torch.get_autocast_dtype(x.device.type) == copy.dtype
        ):
            return F.linear(x, _ReadCopy.apply(self.weight, copy), self.bias)
        return super().forward(x)


def attach(module: nn.Module, dtype: torch.dtype = torch.bfloat16) -> list[Linear]:
    """Give every `Linear` in `module` a copy of its weight in `dtype`, refreshed whenever weights are loaded."""
    layers = [m for m in module.modules() if isinstance(m, Linear)]
    for m in layers:
        m.weight_copy = m.weight.detach().to(dtype)
    module.register_load_state_dict_post_hook(lambda mod, _keys: refresh(layers))
    return layers


@torch.no_grad()
def refresh(layers: list[Linear]) -> None:
    """Write every copy from its weight: one multi-tensor copy (the round-to-nearest cast autocast makes)."""
    if layers:
        torch._foreach_copy_([m.weight_copy for m in layers], [m.weight for m in layers])


def refresh_after_step(opt: torch.optim.Optimizer, layers: list[Linear]) -> None:
    """Refresh the copies after every `opt.step()`, queued right behind the update on the same stream."""
    if layers:
        opt.register_step_post_hook(lambda _opt, _args, _kwargs: refresh(layers))
