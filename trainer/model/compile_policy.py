"""Compile policy: recompile limits set in every thread that can compile, recompile counting, freezing after preflight.

Dynamo's config is thread-local in recent torch (>= 2.12): a limit set in the main thread is not seen by the autograd
engine's backward thread, which then uses the default. `PolicyInBackward` is an identity in forward whose backward
applies the policy in whichever thread runs it; trainer/run/parallelize.py puts it on the drafter's output, last in
forward, so it runs first in backward.
"""

from __future__ import annotations

import threading

import torch
import torch._dynamo

_applied = threading.local()
_limit = {"value": 8}


def _set_limit(limit: int) -> None:
    cfg = torch._dynamo.config
    if hasattr(cfg, "recompile_limit"):
        cfg.recompile_limit = limit
    else:  # torch < 2.7 names it cache_size_limit
        cfg.cache_size_limit = limit
    if hasattr(cfg, "accumulated_recompile_limit"):
        cfg.accumulated_recompile_limit = max(limit * 8, cfg.accumulated_recompile_limit)


def apply_compile_policy(limit: int | None = None) -> None:
    """Set the recompile limit in the calling thread (cheap to call again)."""
    if limit is not None:
        _limit["value"] = limit
    if getattr(_applied, "limit", None) != _limit["value"]:
        _set_limit(_limit["value"])
        _applied.limit = _limit["value"]


class PolicyInBackward(torch.autograd.Function):
    """Identity; its backward sets the compile policy in the backward thread before any compiled backward runs."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        apply_compile_policy()
        return grad


def start_compile_workers() -> None:
    """Start Inductor's pool of compile workers now. Inductor starts it at the first compile (the preflight's first
    bucket), and until its subprocesses have imported torch it compiles kernels one at a time in this process; started
    before the target loads, their start-up overlaps the load instead."""
    try:
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError:  # older torch: the first compile starts it, as before
        return
    maybe_warm_pool()


def graphs_compiled() -> int:
    """Dynamo graphs compiled so far in this process (a recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_cache_counts() -> dict[str, int]:
    """Inductor's graph cache so far in this process: graphs found compiled on disk (hits) and compiled here (misses).
    A launch with a kept cache (`inductor_cache: keep`) shows its graphs as hits."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return {"hits": int(inductor["fxgraph_cache_hit"]), "misses": int(inductor["fxgraph_cache_miss"])}


def freeze_compiles() -> bool:
    """After preflight: any further recompile raises instead of compiling (or running eagerly). True if supported."""
    if hasattr(torch.compiler, "set_stance"):
        torch.compiler.set_stance("fail_on_recompile")
        return True
    return False


def unfreeze_compiles() -> None:
    if hasattr(torch.compiler, "set_stance"):
        torch.compiler.set_stance("default")
