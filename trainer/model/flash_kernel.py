"""Which flex_attention kernel the drafter's flex call compiles to: Inductor's Triton template, or FlashAttention-4's
CuTe DSL kernels (`kernel_options={"BACKEND": "FLASH"}`), and the torch patch the latter needs on torch 2.11.

FLASH runs where the `flash-attn-4` package is importable, the torch has flex's FLASH lowering, and the GPU is a
Hopper (compute capability 9.x). On Hopper FA4 tiles a head dimension of 128 by 128 queries and 128 keys forward
(64 x 128 backward, two of them to a mask tile), so the mask's 128 x 128 tiles (trainer.model.mask.TILE) fit it as they
are. Blackwell's kernels want 256-row query tiles, which this trainer's masks do not have: `auto` picks Triton there,
and `flash` is refused with that reason.

torch 2.11's CuteDSL code generator has no `index_expr`, and its `minimum`/`maximum` raise NotImplementedError;
a mask_mod that looks a tensor up (`limit[b, q_idx // block]`) can lower to them (SpecForge patches the same three
for its DFlash mask; which of them this mask needs was not isolated). `patch_torch()` fills them in on 2.11 only
(torch >= 2.13 has them); what it patched is named in the preflight record.
"""

from __future__ import annotations

import importlib.util

import torch

from trainer.errors import ConfigError

_patched: list[str] = []


def flash_unsupported(device: torch.device) -> str | None:
    """Why FLASH cannot run on `device`, or None when it can."""
    if device.type != "cuda":
        return f"FLASH needs a CUDA GPU, not {device.type}"
    try:
        if importlib.util.find_spec("flash_attn.cute") is None:
            return "flash-attn-4 is not installed (pip install flash-attn-4)"
    except (ImportError, ValueError) as e:
        return f"flash-attn-4 cannot be imported: {e}"
    if importlib.util.find_spec("torch._inductor.kernel.flex.flex_flash_attention") is None:
        return f"torch {torch.__version__} has no flex FLASH lowering"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return (
            f"compute capability {major}.{minor}: FLASH is built here for Hopper (9.x) only; Blackwell's kernels "
            "need 256-row query tiles"
        )
    return None


def resolve(choice: str, device: torch.device, source: str = "<config>") -> tuple[str, str]:
    """(`triton` or `flash`, why) for `attention.flex_backend`. `flash` asked for where it cannot run: ConfigError."""
    if choice == "triton":
        return "triton", "asked for"
    why_not = flash_unsupported(device)
    if choice == "flash":
        if why_not:
            raise ConfigError(source, "attention.flex_backend", f"flash cannot run here: {why_not}; use auto or triton")
        return "flash", "asked for"
    return ("triton", why_not) if why_not else ("flash", "flash-attn-4 installed, Hopper GPU")


def _torch_minor() -> tuple[int, int]:
    major, minor = torch.__version__.split("+", 1)[0].split(".")[:2]
    return int(major), int(minor)


def patch_torch() -> list[str]:
    """Give torch 2.11's CuteDSL op overrides the operations the mask lowers to (a no-op elsewhere, and when done
    already). Returns the names patched."""
    if _patched or _torch_minor() != (2, 11):
        return list(_patched)
    from torch._inductor.codegen.cutedsl import cutedsl_op_overrides as mod
    from torch._inductor.utils import get_bounds_index_expr
    from torch._inductor.virtualized import V

    ops = mod.CuteDSLOpOverrides

    def minimum(a, b):  # 2.11 raises NotImplementedError for both
        return ops.where(ops.lt(a, b), a, b)

    def maximum(a, b):
        return ops.where(ops.gt(a, b), a, b)

    def index_expr(expr, dtype):  # 2.11 has none: an index as a scalar value, as the Triton generator makes it
        import sympy

        if isinstance(expr, (int, sympy.Integer)):
            return ops.constant(int(expr), dtype)
        var = V.kernel.cse.generate(
            V.kernel.body,
            V.kernel.kexpr(V.kernel.rename_indexing(expr)),
            bounds=get_bounds_index_expr(expr),
            dtype=dtype,
        )
        var.is_scalar_expr = True
        var.index_expr = V.graph.sizevars.simplify(expr)
        return var

    for name, fn in (("minimum", minimum), ("maximum", maximum), ("index_expr", index_expr)):
        setattr(ops, name, staticmethod(fn))
        _patched.append(f"CuteDSLOpOverrides.{name}")
    return list(_patched)
