"""flex_attention's FLASH backend (FlashAttention-4) against its Triton backend on the trainer's own mask: the same
output and gradients, and the time of one drafter layer's attention forward and backward at the paper shape.

    python bench/flash_check.py [--out FILE]

Each variant goes through the trainer's FlexBackend (the guard, the compiled call, keys and values repeated or
grouped) with the mask the trainer builds (trainer.mask.block_mask_from_anchors). Errors are relative norms against
a float64 dense reference on the same inputs; a variant that fails to compile is reported with its error text.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def inputs(S: int, A: int, bs: int, H: int, G: int, D: int, seed: int):
    import torch

    from trainer.model.mask import build_blocks

    g = torch.Generator().manual_seed(seed)
    L = S - int(torch.randint(0, S // 4, (1,), generator=g))  # a sequence shorter than its bucket
    anc = torch.randperm(L - 1, generator=g)[: A - 3].sort().values  # a few padding blocks too
    batch = build_blocks([(torch.randint(0, 1000, (L,), generator=g), torch.ones(L))], S, A, bs, 5, 7.0, [anc])
    q = torch.randn(1, H, A * bs, D, generator=g).cuda().bfloat16()
    k = torch.randn(1, G, S + A * bs, D, generator=g).cuda().bfloat16()
    v = torch.randn(1, G, S + A * bs, D, generator=g).cuda().bfloat16()
    return batch.anchors.cuda(), batch.anchor_valid.cuda(), q, k, v


def run(backend, mask, q, k, v, grad_out):
    import torch

    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = backend(q, k, v, mask)
    out.backward(grad_out)
    torch.cuda.synchronize()
    return out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()


def reference(anchors, valid, S, bs, q, k, v, grad_out):
    import torch

    from trainer.model.mask import dense_mask

    m = dense_mask(anchors, valid, S, bs)
    q, k, v = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = (q @ kk.transpose(-1, -2)) * q.shape[-1] ** -0.5
    out = torch.softmax(s.masked_fill(~m, float("-inf")), -1) @ vv
    out.backward(grad_out.double())
    return out.detach(), q.grad, k.grad, v.grad


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def main() -> None:
    import torch
    import triton.testing

    from trainer.model.attention import FlexBackend
    from trainer.model.flash_kernel import flash_unsupported, patch_torch
    from trainer.model.mask import block_mask_from_anchors

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch._dynamo.config.recompile_limit = 64  # every variant and shape compiles its own graph
    rep: dict = {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
        "flash_unsupported": flash_unsupported(torch.device("cuda")),
        "patches": patch_torch(),
    }
    try:
        import flash_attn

        rep["flash_attn"] = getattr(flash_attn, "__version__", "?")
    except Exception as e:  # report, go on with Triton
        rep["flash_attn"] = f"{type(e).__name__}: {e}"
    variants = {
        "triton_expand": FlexBackend("triton", True),
        "triton_grouped": FlexBackend("triton", False),
        "flash_grouped": FlexBackend("flash", False),
        "flash_expand": FlexBackend("flash", True),
    }
    # correctness on a small shape (a float64 dense reference fits), then timing at the paper shape
    for tag, (S, A) in (("check", (1024, 64)), ("paper", (3072, 512))):
        bs, H, G, D = 16, 32, 8, 128
        anchors, valid, q, k, v = inputs(S, A, bs, H, G, D, seed=3 if tag == "check" else 4)
        mask = block_mask_from_anchors(anchors, valid, S, bs)
        grad_out = torch.randn_like(q)
        ref = reference(anchors, valid, S, bs, q, k, v, grad_out) if tag == "check" else None
        results = {}
        for name, backend in variants.items():
            row: dict = {}
            try:
                got = run(backend, mask, q, k, v, grad_out)
                row["finite"] = all(bool(torch.isfinite(t).all()) for t in got)
                if ref is not None:
                    row["err_vs_fp64"] = {n: round(rel(a, b), 5) for n, a, b in zip("oqkv", got, ref, strict=True)}
                if name != "triton_expand" and "triton_expand" in results:
                    base = results["triton_expand"]
                    row["err_vs_triton"] = {n: round(rel(a, b), 5) for n, a, b in zip("oqkv", got, base, strict=True)}
                results[name] = got
                if tag == "paper":
                    qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))

                    def fwd(b=backend, qq=qq, kk=kk, vv=vv, m=mask):
                        with torch.no_grad():
                            return b(qq, kk, vv, m)

                    def fwd_bwd(b=backend, qq=qq, kk=kk, vv=vv, m=mask, go=grad_out):
                        b(qq, kk, vv, m).backward(go)

                    row["fwd_ms"] = round(triton.testing.do_bench(fwd, warmup=50, rep=300, return_mode="median"), 4)
                    row["fwd_bwd_ms"] = round(
                        triton.testing.do_bench(fwd_bwd, warmup=50, rep=300, return_mode="median"), 4
                    )
            except Exception as e:  # the error text is the finding
                row["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
                row["trace"] = traceback.format_exc()[-3000:]
            rep.setdefault(tag, {})[name] = row
            print(tag, name, json.dumps({k: v for k, v in row.items() if k != "trace"})[:1200], flush=True)
        del results
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(rep, indent=1))
    print("\n| variant | check: max err vs fp64 (o,q,k,v) | vs Triton | paper fwd ms | fwd+bwd ms |")
    print("|---|---|---|---|---|")
    for name in variants:
        c, p = rep["check"].get(name, {}), rep["paper"].get(name, {})
        e = c.get("err_vs_fp64")
        t = c.get("err_vs_triton")
        print(
            f"| {name} | {max(e.values()) if e else c.get('error', '')[:80]} | {max(t.values()) if t else ''} | "
            f"{p.get('fwd_ms', p.get('error', '')[:60])} | {p.get('fwd_bwd_ms', '')} |"
        )


if __name__ == "__main__":
    main()
