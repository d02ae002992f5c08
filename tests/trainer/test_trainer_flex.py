"""Compiled flex_attention on the CPU (forward): equal to the dense reference, zero recompiles after preflight,
and the guard that refuses to run eagerly. Compiles once per shape for the whole module."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from trainer.config import from_dict
from trainer.data.dataset import make_dataset
from trainer.model.attention import DenseBackend, FlexBackend
from trainer.model.compile_policy import graphs_compiled, unfreeze_compiles
from trainer.model.mask import sample_anchors
from trainer.run.build import build, forward_loss, make_batch, preflight

pytestmark = pytest.mark.slow


def random_case(seq_len: int, anchors: int, block: int, B: int = 2, H: int = 4, G: int = 2, D: int = 16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_len, kv_len = anchors * block, seq_len + anchors * block
    q = torch.randn(B, H, q_len, D, generator=g)
    k = torch.randn(B, G, kv_len, D, generator=g)
    v = torch.randn(B, G, kv_len, D, generator=g)
    lm = torch.ones(seq_len, dtype=torch.long)
    anc = torch.zeros(B, anchors, dtype=torch.long)
    valid = torch.zeros(B, anchors, dtype=torch.bool)
    for b in range(B):
        a = sample_anchors(lm, seq_len - 7 * b, anchors - 3 * b, g)  # second sequence: shorter, padding blocks
        anc[b, : a.numel()] = a
        valid[b, : a.numel()] = True
    return q, k, v, anc, valid


@pytest.mark.parametrize("seq_len, anchors, block", [(128, 8, 16), (256, 16, 8)])
def test_flex_equals_dense_reference(seq_len, anchors, block):
    q, k, v, anc, valid = random_case(seq_len, anchors, block)
    flex, dense = FlexBackend(), DenseBackend(max_gib=1.0)
    out_flex = flex(q, k, v, flex.build_mask(anc, valid, seq_len, block, q.shape[1]))
    out_dense = dense(q, k, v, dense.build_mask(anc, valid, seq_len, block, q.shape[1]))
    assert out_flex.shape == out_dense.shape == q.shape
    assert (out_flex - out_dense).abs().max().item() < 1e-5


def test_training_calls_repeat_keys_and_values_to_every_query_head_as_grouped_attention_maps_them(monkeypatch):
    """In training the flex call gets keys and values repeated to every query head (a faster backward on the GPU).
    Query head h reads key head h // (H / G) either way: the repeated call equals the grouped one and the dense
    reference (the CPU has no flex backward, so the training call's flex is stood in for by the dense reference)."""
    from trainer.model import attention

    q, k, v, anc, valid = random_case(128, 8, 16)  # H = 4 query heads, G = 2 key/value heads
    flex, dense = FlexBackend(), DenseBackend(max_gib=1.0)
    mask = flex.build_mask(anc, valid, 128, 16, q.shape[1])
    grouped = flex(q, k, v, mask)  # no grad: the grouped call
    repeated = flex(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), mask)
    reference = dense(q, k, v, dense.build_mask(anc, valid, 128, 16, q.shape[1]))
    assert (grouped - repeated).abs().max().item() < 1e-5 and (grouped - reference).abs().max().item() < 1e-5
    seen = []

    def stand_in(q_, k_, v_, _mask, _flash=False):
        seen.append((k_.shape[1], v_.shape[1]))
        return dense(q_, k_, v_, dense.build_mask(anc, valid, 128, 16, q_.shape[1]))

    monkeypatch.setattr(attention, "guarded_flex", stand_in)
    qg, kg = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    out = flex(qg, kg, v, mask)
    assert seen == [(4, 4)] and (out.detach() - reference).abs().max().item() < 1e-5
    out.square().sum().backward()  # the copies' gradients are summed back onto the grouped keys
    kd = k.clone().requires_grad_(True)
    dense(q, kd, v, dense.build_mask(anc, valid, 128, 16, 4)).square().sum().backward()
    assert torch.allclose(kg.grad, kd.grad, atol=1e-5)
    with torch.no_grad():
        flex(qg, kg, v, mask)
    assert seen[1] == (2, 2)  # evaluation keeps the grouped call


def test_zero_recompiles_after_preflight():
    """With the target's layers compiled too (regional compilation, as on CUDA): their output equals eager, and
    after the preflight no shape of real data compiles anything."""
    cfg = from_dict(
        {
            "target": {"random_preset": "tiny-qwen3", "dtype": "float32", "compile": "on"},
            "drafter": {"num_layers": 1, "block_size": 8},
            "attention": {"backend": "flex"},
            "data": {"anchors_per_seq": 16, "seq_buckets": [128, 256], "batch_size": 1, "synthetic_samples": 12},
            "device": "cpu",
        }
    )
    parts = build(cfg, for_training=False)  # the CPU has no flex backward: evaluation path
    try:
        report = preflight(parts, backward=False)
        assert report.frozen and report.buckets == [128, 256]
        baseline = graphs_compiled()
        ds = make_dataset(cfg.data, 256, 8, 0)
        lengths = set()
        with torch.no_grad():
            for i, (ids, _) in enumerate(ds.samples):
                bucket = 128 if ids.numel() <= 128 else 256
                lengths.add(ids.numel())
                loss_sum, w_sum, _ = forward_loss(parts, make_batch(parts, ds, bucket, [i], epoch=0))
                assert torch.isfinite(loss_sum) and w_sum > 0
        assert len(lengths) >= 4  # really varied lengths
        assert graphs_compiled() - baseline == 0
        ids = make_batch(parts, ds, 128, [0], epoch=0).input_ids
        eager, compiled = parts.target.hidden_states(ids), parts.target.hidden_states(ids, compiled=True)
        assert (eager - compiled).abs().max().item() < 1e-4
        assert graphs_compiled() - baseline == 0
    finally:
        unfreeze_compiles()


GUARD_SCRIPT = textwrap.dedent(
    """
    import resource, sys, torch
    from trainer.model.attention import FlexBackend
    from trainer.model.compile_policy import apply_compile_policy
    from trainer.errors import DenseFallbackError
    mode = sys.argv[1]
    flex = FlexBackend()

    def call(seq_len, anchors, heads=4):
        B, G, D, block = 1, 2, 16, 16
        q = torch.randn(B, heads, anchors * block, D)
        k = torch.randn(B, G, seq_len + anchors * block, D)
        anc = torch.arange(anchors).view(1, -1) * 2
        valid = torch.ones(1, anchors, dtype=torch.bool)
        return flex(q, k, k, flex.build_mask(anc, valid, seq_len, block, heads))

    if mode == "limit":
        apply_compile_policy(1)
        call(128, 8)  # compiles
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        call(8192, 512)  # Q = 8192, KV = 16384: the dense fallback would take 2 GiB
    except DenseFallbackError as e:
        grew_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        print("RAISED", round(grew_mib), e)
        sys.exit(0)
    print("NO ERROR")
    sys.exit(1)
    """
)


@pytest.mark.parametrize("mode", ["disabled", "limit"])
def test_guard_refuses_eager_flex(mode, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TORCH_COMPILE_DISABLE"}
    if mode == "disabled":
        env["TORCH_COMPILE_DISABLE"] = "1"
    proc = subprocess.run([sys.executable, "-c", GUARD_SCRIPT, mode], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _, grew_mib, message = proc.stdout.strip().split(" ", 2)
    assert "2.00 GiB" in message
    assert ("disabled" in message) if mode == "disabled" else ("recompile limit" in message)
    assert int(grew_mib) < 256  # nothing near the 2 GiB score matrix was allocated


def test_compiled_drafter_layers_still_refuse_to_run_flex_eagerly():
    """The drafter's compiled layers trace the flex call into their own graph; with compilation off they run eagerly,
    and the flex call inside must still raise rather than materialise the dense scores."""
    import torch._dynamo

    from trainer.errors import DenseFallbackError
    from trainer.model.drafter import Drafter, DrafterDims
    from trainer.run.parallelize import compile_layers

    dims = DrafterDims(
        hidden=32, intermediate=64, num_heads=4, num_kv_heads=2, head_dim=8, num_layers=2, num_target_layers=2
    )
    drafter = Drafter(dims)
    compile_layers(drafter.layers)
    flex = FlexBackend()
    S, A, bs = 4096, 256, 16  # Q = 4096, KV = 8192: the dense scores would be 0.5 GiB
    anc = (torch.arange(A) * 8 + 1).view(1, -1)
    mask = flex.build_mask(anc, torch.ones(1, A, dtype=torch.bool), S, bs, dims.num_heads)
    args = (torch.randn(1, S, 2 * 32), torch.randn(1, A * bs, 32), torch.arange(A * bs).view(1, -1), mask, flex)
    # with grad: the compiled layers' path (under no_grad the layers run eagerly by design)
    with torch._dynamo.config.patch(disable=True), pytest.raises(DenseFallbackError, match="disabled"):
        drafter(*args)


def test_flex_backend_choice_falls_back_to_triton_where_flash_cannot_run_and_refuses_flash_asked_for():
    import pytest

    from trainer.errors import ConfigError
    from trainer.model.flash_kernel import flash_unsupported, patch_torch, resolve

    cpu = torch.device("cpu")
    assert "CUDA" in flash_unsupported(cpu)
    assert resolve("auto", cpu) == ("triton", flash_unsupported(cpu))
    assert resolve("triton", cpu) == ("triton", "asked for")
    with pytest.raises(ConfigError) as e:
        resolve("flash", cpu, "job.yaml")
    assert e.value.source == "job.yaml" and e.value.key == "attention.flex_backend"
    if not torch.__version__.startswith("2.11."):  # the CuteDSL patch is for torch 2.11 alone: nothing touched here
        assert patch_torch() == []
    from trainer.model.attention import FlexBackend, _kernel_options

    assert _kernel_options(True) == {"BACKEND": "FLASH"}  # FLASH takes no Triton tile options
    assert FlexBackend("flash").flash and FlexBackend("flash").expand_kv
