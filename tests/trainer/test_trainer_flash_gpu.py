"""flex_attention's FLASH backend (FlashAttention-4) against its Triton backend on the trainer's own mask: output and
gradients. Needs a Hopper GPU with flash-attn-4 installed; skipped elsewhere (the CPU suite never runs it)."""

from __future__ import annotations

import pytest
import torch

from trainer.model.flash_kernel import flash_unsupported

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or flash_unsupported(torch.device("cuda")) is not None,
    reason="FLASH needs a Hopper GPU with flash-attn-4",
)


def _case(seed: int):
    from trainer.model.mask import block_mask_from_anchors, build_blocks

    S, A, bs, H, G, D = 1024, 64, 16, 8, 2, 128
    g = torch.Generator().manual_seed(seed)
    L = S - 100
    anc = torch.randperm(L - 1, generator=g)[: A - 5].sort().values  # five padding blocks
    b = build_blocks([(torch.randint(0, 1000, (L,), generator=g), torch.ones(L))], S, A, bs, 5, 7.0, [anc])
    anchors, valid = b.anchors.cuda(), b.anchor_valid.cuda()
    q = torch.randn(1, H, A * bs, D, generator=g).cuda().bfloat16()
    k = torch.randn(1, G, S + A * bs, D, generator=g).cuda().bfloat16()
    v = torch.randn(1, G, S + A * bs, D, generator=g).cuda().bfloat16()
    return block_mask_from_anchors(anchors, valid, S, bs), q, k, v, torch.randn(1, H, A * bs, D, generator=g).cuda()


def _run(backend, mask, q, k, v, grad):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = backend(q, k, v, mask)
    out.float().backward(grad)
    return [t.float() for t in (out.detach(), q.grad, k.grad, v.grad)]


@pytest.mark.parametrize("expand_kv", [False, True])
def test_flash_matches_triton_output_and_gradients_on_the_trainers_mask(expand_kv):
    from trainer.model.attention import FlexBackend

    torch._dynamo.config.recompile_limit = 64
    mask, q, k, v, grad = _case(seed=11)
    want = _run(FlexBackend("triton", True), mask, q, k, v, grad)
    got = _run(FlexBackend("flash", expand_kv), mask, q, k, v, grad)
    for name, a, b in zip("oqkv", got, want, strict=True):
        assert torch.isfinite(a).all(), name
        err = ((a - b).norm() / b.norm()).item()
        assert err < 1e-2, f"{name}: relative error {err:.2e} against Triton"


def test_flash_run_eagerly_is_refused_by_the_guard():
    from trainer.errors import DenseFallbackError
    from trainer.model.attention import _guarded_flex

    mask, q, k, v, _ = _case(seed=12)
    with pytest.raises(DenseFallbackError):
        _guarded_flex(q, k, v, mask, True)
