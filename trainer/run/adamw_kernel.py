"""AdamW's update in one Triton kernel a parameter, at the GPU's memory bandwidth.

The update reads every fp32 weight, gradient and both moments and writes back weight and moments: 28 bytes a
parameter, 29 GB a step for the paper-shape drafter (1.05 B parameters), and no arithmetic to speak of. torch's fused
AdamW moves them at about 2.9 TB/s on an H200 (10.0 ms a step); a plain elementwise kernel, one launch a parameter
with wide blocks, gets closer to the memory's rate. Everything else is torch's AdamW: the same state (`step`,
`exp_avg`, `exp_avg_sq`, so checkpoints load either way), the same hyperparameters and schedule, and the same two
hooks the trainer uses, `grad_scale` (the gradient clip, trainer/run/update.py) and `found_inf` (a non-finite step
skipped on the device). Where the kernel cannot run (no Triton, or a CPU without Triton's interpreter) `step` is
torch's own.

The arithmetic is torch's fused kernel's, in fp32: g = grad / grad_scale; p -= lr * wd * p; m = b1 m + (1 - b1) g;
v = b2 v + (1 - b2) g^2; p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
"""

from __future__ import annotations

import os

import torch

try:  # as trainer/model/ce_kernel.py: CUDA builds of torch bring Triton; the tests run its interpreter
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

BLOCK = 4096  # elements a program: 16 per thread with 8 warps, in 128-bit loads


if triton is not None:

    @triton.jit
    def _adamw(p_ptr, g_ptr, m_ptr, v_ptr, step_ptr, scale_ptr, inf_ptr, n, lr, beta1, beta2, eps, wd,
               HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        if HAS_INF:  # a non-finite step: nothing is read or written
            n = tl.where(tl.load(inf_ptr) == 0, n, 0)
        live = offs < n
        step = tl.load(step_ptr).to(tl.float32)
        bc1 = 1.0 - tl.exp(step * tl.log(beta1))
        bc2_sqrt = tl.sqrt(1.0 - tl.exp(step * tl.log(beta2)))
        g = tl.load(g_ptr + offs, mask=live, other=0.0).to(tl.float32)
        if HAS_SCALE:
            g = g / tl.load(scale_ptr).to(tl.float32)
        p = tl.load(p_ptr + offs, mask=live, other=0.0)
        m = tl.load(m_ptr + offs, mask=live, other=0.0)
        v = tl.load(v_ptr + offs, mask=live, other=0.0)
        p = p - lr * wd * p
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        p = p - (lr / bc1) * m / (tl.sqrt(v) / bc2_sqrt + eps)
        tl.store(p_ptr + offs, p, mask=live)
        tl.store(m_ptr + offs, m, mask=live)
        tl.store(v_ptr + offs, v, mask=live)


def available(device: torch.device) -> bool:
    """The kernel can run here: Triton is importable, and the device is CUDA or the interpreter is on (CPU)."""
    if triton is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


class TritonAdamW(torch.optim.AdamW):
    """torch's AdamW with its update in the kernel above (fp32 parameters, no amsgrad or maximize), else torch's.

    Built as a fused AdamW (`fused=True` where torch allows it), so the trainer's `grad_scale` clip and `found_inf`
    skip apply, and its state is a fused AdamW's: a checkpoint of one loads into the other."""

    def _kernel_fits(self, group: dict) -> bool:
        params = [p for p in group["params"] if p.grad is not None]
        return (
            bool(params)
            and not group["amsgrad"]
            and not group["maximize"]
            and not isinstance(group["lr"], torch.Tensor)
            and all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 and available(p.device) for p in params)
            and all(p.is_contiguous() and p.grad.is_contiguous() for p in params)
        )

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None or not all(self._kernel_fits(g) for g in self.param_groups):
            return super().step(closure)
        scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            steps = []
            for p in params:
                state = self.state[p]
                if not state:  # as torch's fused AdamW lays its state out
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                elif state["step"].device != p.device:  # a checkpoint of a non-fused AdamW keeps it on the CPU
                    state["step"] = state["step"].to(p.device, torch.float32)
                steps.append(state["step"])
            torch._foreach_add_(steps, 1)
            beta1, beta2 = group["betas"]
            for p, step in zip(params, steps, strict=True):
                state = self.state[p]
                n = p.numel()
                _adamw[(triton.cdiv(n, BLOCK),)](
                    p, p.grad, state["exp_avg"], state["exp_avg_sq"], step,
                    scale if scale is not None else step, found_inf if found_inf is not None else step,
                    n, float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                    float(group["weight_decay"]), HAS_SCALE=scale is not None, HAS_INF=found_inf is not None,
                    BLOCK=BLOCK, num_warps=8,
                )  # fmt: skip
            if found_inf is not None:  # a skipped step does not count, as in torch's fused AdamW
                torch._foreach_sub_(steps, [found_inf] * len(steps))
        return None
