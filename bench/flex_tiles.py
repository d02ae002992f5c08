"""The drafter's flex_attention at the paper shape under several kernel options: which tiles and flags run fastest.

    python bench/flex_tiles.py --out results.json

Shape: seq 3072, 512 anchors, block 16 (Q 8192, KV 11264), 32 query heads, 8 KV heads, head dim 128, bf16; the
mask from the anchors exactly as the trainer builds it. Each option set is compiled afresh (fwd+bwd), checked
against the default options' output and gradients, then timed (median of `triton.testing.do_bench`, forward alone
and forward+backward). Options are passed as flex_attention's `kernel_options` (`fwd_`/`bwd_` prefixes pick one
direction; USE_TMA uses Hopper's bulk tensor copies; ROWS_GUARANTEED_SAFE holds because every query sees its own
block).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OPTIONS = {
    "default": {},
    "rows_safe": {"ROWS_GUARANTEED_SAFE": True},
    "tma": {"USE_TMA": True},
    "tma_rows_safe": {"USE_TMA": True, "ROWS_GUARANTEED_SAFE": True},
    "fwd_128x128_s2": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_stages": 2, "fwd_num_warps": 8},
    "bwd_s2_w8": {"bwd_num_stages": 2, "bwd_num_warps": 8},
    "bwd_64x64_s3_w4": {
        "bwd_BLOCK_M1": 64,
        "bwd_BLOCK_N1": 64,
        "bwd_BLOCK_M2": 64,
        "bwd_BLOCK_N2": 64,
        "bwd_num_stages": 3,
        "bwd_num_warps": 4,
    },
    "bwd_32_128_s3_w4": {
        "bwd_BLOCK_M1": 32,
        "bwd_BLOCK_N1": 128,
        "bwd_BLOCK_M2": 128,
        "bwd_BLOCK_N2": 32,
        "bwd_num_stages": 3,
        "bwd_num_warps": 4,
    },
    "bwd_64_128_s2_w8": {
        "bwd_BLOCK_M1": 64,
        "bwd_BLOCK_N1": 128,
        "bwd_BLOCK_M2": 128,
        "bwd_BLOCK_N2": 64,
        "bwd_num_stages": 2,
        "bwd_num_warps": 8,
    },
    "bwd_64_128_s3_w8": {
        "bwd_BLOCK_M1": 64,
        "bwd_BLOCK_N1": 128,
        "bwd_BLOCK_M2": 128,
        "bwd_BLOCK_N2": 64,
        "bwd_num_stages": 3,
        "bwd_num_warps": 8,
    },
    "bwd_32_64_s4_w4": {
        "bwd_BLOCK_M1": 32,
        "bwd_BLOCK_N1": 64,
        "bwd_BLOCK_M2": 64,
        "bwd_BLOCK_N2": 32,
        "bwd_num_stages": 4,
        "bwd_num_warps": 4,
    },
    # keys and values repeated to every query head before the call (no GQA inside the kernel): the backward's dK/dV
    # programs become one a query head instead of one a KV head looping over its 4 query heads; autograd sums them
    "expand_kv": {"expand_kv": True},
    "expand_kv_bwd_s2_w8": {"expand_kv": True, "bwd_num_stages": 2, "bwd_num_warps": 8},
}


def _expanded(call, groups: int, q, k, v):
    """`call` with keys and values repeated to every query head."""
    return call(q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", nargs="*", default=None, help="option sets to run (default: all)")
    args = ap.parse_args()
    import torch
    from torch.nn.attention.flex_attention import flex_attention
    from triton.testing import do_bench

    from trainer.model.mask import anchor_generator, block_mask_from_anchors, sample_anchors

    dev = torch.device("cuda")
    S, A, bs, H, G, D = 3072, 512, 16, 32, 8, 128
    resp = torch.ones(S, dtype=torch.long)
    anchors = sample_anchors(resp, S, A, anchor_generator(0, 0, 0)).reshape(1, A).to(dev)
    valid = torch.ones_like(anchors, dtype=torch.bool)
    mask = block_mask_from_anchors(anchors, valid, S, bs)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, H, A * bs, D, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, G, S + A * bs, D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, G, S + A * bs, D, device=dev, dtype=torch.bfloat16, generator=g)
    dout = torch.randn_like(q)
    rows, ref = [], None
    for name, opts in OPTIONS.items():
        if args.only and name not in args.only:
            continue
        torch._dynamo.reset()  # each option set is a new compile of the same code, not a recompile against a limit
        kernel = {key: val for key, val in opts.items() if key != "expand_kv"}
        call = partial(
            flex_attention, block_mask=mask, enable_gqa=not opts.get("expand_kv"), kernel_options=kernel or None
        )
        if opts.get("expand_kv"):
            call = partial(_expanded, call, H // G)
        fn = torch.compile(call, dynamic=False, fullgraph=True)
        qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        try:
            t0 = time.perf_counter()
            out = fn(qg, kg, vg)
            out.backward(dout)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
        except Exception as e:  # an option this torch does not take: say so, keep the rest
            rows.append({"name": name, "options": opts, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            print(f"{name}: {rows[-1]['error']}", flush=True)
            continue
        got = [out.detach().clone(), qg.grad.clone(), kg.grad.clone(), vg.grad.clone()]  # timing adds to .grad
        if ref is None:
            ref = got
        err = [float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(got, ref, strict=True)]

        def fwd(fn=fn):
            fn(q, k, v)

        def fwd_bwd(fn=fn, qg=qg, kg=kg, vg=vg):
            fn(qg, kg, vg).backward(dout)

        row = {
            "name": name,
            "options": opts,
            "compile_s": round(compile_s, 1),
            "fwd_ms": round(do_bench(fwd, warmup=50, rep=300, return_mode="median"), 3),
            "fwd_bwd_ms": round(do_bench(fwd_bwd, warmup=50, rep=500, return_mode="median"), 3),
            "rel_err_out_dq_dk_dv_vs_default": [round(x, 5) for x in err],
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
        "shape": f"Q {A * bs} KV {S + A * bs} H {H} G {G} D {D} bf16, anchors from the trainer",
        "rows": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    print("\n| options | compile s | fwd ms | fwd+bwd ms | rel. err vs default |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        if "error" in r:
            print(f"| {r['name']} | error | | | {r['error'][:60]} |")
        else:
            print(
                f"| {r['name']} | {r['compile_s']} | {r['fwd_ms']} | {r['fwd_bwd_ms']} | "
                f"{max(r['rel_err_out_dq_dk_dv_vs_default']):.1e} |"
            )


if __name__ == "__main__":
    main()
