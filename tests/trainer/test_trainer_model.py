"""Target loading through the real Hugging Face path, drafter forward/backward with the dense reference, learning."""

from __future__ import annotations

import pytest
import torch

from trainer.config import TargetConfig, from_dict
from trainer.data.dataset import make_dataset
from trainer.model.target import default_layer_ids, load_target
from trainer.run.build import build, forward_loss, make_batch, preflight
from trainer.run.training import train


def test_default_layer_ids_match_design():
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_load_saved_target_and_capture_hidden_states(tmp_path, family):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        family,
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(tmp_path / "tgt")
    target = load_target(TargetConfig(path=str(tmp_path / "tgt"), dtype="float32"), 2, torch.device("cpu"))
    assert target.layer_ids == [1, 2] and not any(p.requires_grad for p in target.model.parameters())
    ids = torch.randint(0, 128, (2, 10))
    hidden = target.hidden_states(ids)
    assert hidden.shape == (2, 10, 2 * 32)
    full = target.model(input_ids=ids, output_hidden_states=True).hidden_states  # [embeddings, layer 0, ...]
    assert torch.allclose(hidden[..., :32], full[2], atol=1e-5) and torch.allclose(hidden[..., 32:], full[3], atol=1e-5)


def test_bad_target_path_is_config_error(tmp_path):
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError, match="target.path"):
        load_target(TargetConfig(path=str(tmp_path / "nothing"), dtype="float32"), 2, torch.device("cpu"))


TINY = {
    "target": {"random_preset": "tiny-qwen3", "dtype": "float32"},
    "drafter": {"num_layers": 2, "block_size": 8},
    "attention": {"backend": "dense"},
    "data": {"anchors_per_seq": 16, "seq_buckets": [128, 256], "batch_size": 2, "synthetic_samples": 32},
    "optim": {"lr": 1e-2, "warmup_ratio": 0.1},
    "device": "cpu",
}


def test_drafter_forward_backward_dense():
    cfg = from_dict({**TINY, "steps": 1})
    parts = build(cfg)
    ds = make_dataset(cfg.data, 256, 8, 0)
    batch = make_batch(parts, ds, 128, [0, 1], 0)
    loss_sum, w_sum, _ = forward_loss(parts, batch)
    (loss_sum / w_sum).backward()
    grads = [p.grad for p in parts.drafter.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0
    assert not any(p.requires_grad for p in parts.target.model.parameters())


def test_loss_falls_on_a_tiny_fixed_dataset():
    result = train(from_dict({**TINY, "steps": 40, "eval": {"at_end": False}}), log=lambda s: None)  # loss only
    first, last = sum(result.losses[:5]) / 5, sum(result.losses[-5:]) / 5
    assert last < 0.5 * first, (first, last)
    assert sum(result.accs[-5:]) / 5 > 0.2  # chance is 1/16 within the alphabet


def test_activation_checkpointing_gives_the_same_gradients():
    grads = []
    for ckpt in (False, True):
        cfg = from_dict({**TINY, "steps": 1, "drafter": {**TINY["drafter"], "activation_checkpointing": ckpt}})
        parts = build(cfg)
        ds = make_dataset(cfg.data, 256, 8, 0)
        loss_sum, w_sum, _ = forward_loss(parts, make_batch(parts, ds, 128, [0, 1], 0))
        (loss_sum / w_sum).backward()
        grads.append(torch.cat([p.grad.flatten() for p in parts.drafter.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_fused_lm_head_cross_entropy_matches_the_plain_one():
    """Chunked CE through the frozen head (no stored logits): same loss, accuracy and input gradient."""
    from trainer.model.drafter import block_loss

    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(32, 500, bias=False).requires_grad_(False)
    hidden = torch.randn(2, 48, 32, generator=g, requires_grad=True)
    labels = torch.randint(0, 500, (2, 48), generator=g)
    weights = torch.rand(2, 48, generator=g) * (torch.rand(2, 48, generator=g) > 0.3)
    results = []
    for fused in (False, True):
        h = hidden.detach().clone().requires_grad_(True)
        loss, wsum, correct = block_loss(h, head, labels, weights, fused=fused)
        (loss * 0.7).backward()
        results.append((loss.detach(), wsum, correct, h.grad))
    (l0, w0, c0, g0), (l1, w1, c1, g1) = results
    assert torch.allclose(l0, l1, rtol=1e-5) and torch.equal(w0, w1) and torch.equal(c0, c1)
    assert torch.allclose(g0, g1, atol=1e-6)
    with torch.no_grad():  # evaluation path: no gradient kept
        l2, _, c2 = block_loss(hidden, head, labels, weights, fused=True)
    assert torch.allclose(l0, l2, rtol=1e-5) and torch.equal(c0, c2)


def test_the_loss_gathers_its_rows_by_the_index_found_on_the_host_exactly_as_by_the_weights():
    """A batch carries the flat positions with a weight, found when it was built on the host; the loss taken through
    them is the loss taken through the weights on the device (same rows, same order), gradients too."""
    from trainer.model.drafter import block_loss
    from trainer.model.mask import build_blocks, sample_anchors

    g = torch.Generator().manual_seed(3)
    seqs = [(torch.randint(0, 500, (64,), generator=g), (torch.rand(64, generator=g) > 0.4).long()) for _ in range(2)]
    anchors = [sample_anchors(lm, 64, 6, g) for _, lm in seqs]
    b = build_blocks(seqs, 64, 6, 8, 499, 7.0, anchors)
    assert torch.equal(b.label_index, torch.nonzero(b.weights.flatten() > 0).flatten())
    head = torch.nn.Linear(32, 500, bias=False).requires_grad_(False)
    hidden = torch.randn(2, 48, 32, generator=g)
    results = []
    for index in (None, b.label_index):
        h = hidden.clone().requires_grad_(True)
        loss, wsum, correct = block_loss(h, head, b.labels, b.weights, index=index)
        loss.backward()
        results.append((loss.detach(), wsum, correct, h.grad))
    (l0, w0, c0, g0), (l1, w1, c1, g1) = results
    assert torch.equal(l0, l1) and torch.equal(w0, w1) and torch.equal(c0, c1) and torch.equal(g0, g1)
    assert g0.abs().sum() > 0


def test_init_std_draws_every_linear_weight_from_that_normal_and_leaves_the_norms():
    def weights(extra: dict):
        parts = build(from_dict({**TINY, "steps": 1, "drafter": {**TINY["drafter"], **extra}}))
        return parts.drafter

    default, hf = weights({}), weights({"init_std": 0.02})
    for (name, w0), (_, w1) in zip(default.named_parameters(), hf.named_parameters(), strict=True):
        if name.endswith("norm.weight"):
            assert torch.equal(w1, torch.ones_like(w1)), name
        else:  # torch's default is uniform(+-1/sqrt(fan_in)): bounded, std 1/sqrt(3 fan_in)
            assert abs(float(w1.std()) - 0.02) < 0.003, name
            fan_in = w0.shape[1]
            assert float(w0.abs().max()) <= fan_in**-0.5, name
            assert abs(float(w0.std()) - (3 * fan_in) ** -0.5) < 0.2 * (3 * fan_in) ** -0.5, name


def test_init_std_out_of_range_names_its_key():
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError, match="drafter.init_std"):
        from_dict({**TINY, "drafter": {**TINY["drafter"], "init_std": 2.0}})


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "activation-checkpointing"])
def test_compiled_drafter_layers_give_the_eager_gradients_and_compile_nothing_after_preflight(recompute):
    """The training path runs the compiled layers (Dynamo's full graph of each layer, forward and backward; Inductor's
    code generation is torch's, so the CPU test compiles through aot_eager), with the same loss and gradients, also
    when each layer is recomputed in backward."""
    from trainer.model.compile_policy import graphs_compiled, unfreeze_compiles
    from trainer.run.parallelize import compile_layers, is_compiled

    drafter = {**TINY["drafter"], "activation_checkpointing": recompute}
    cfg = from_dict({**TINY, "steps": 1, "data": {**TINY["data"], "seq_buckets": [128]}, "drafter": drafter})
    results = []
    for compiled in (False, True):
        parts = build(cfg)
        assert not is_compiled(parts.drafter.layers)  # auto: off on the CPU
        ds = make_dataset(cfg.data, 128, 8, 0)
        if compiled:
            torch._dynamo.reset()  # graphs another test compiled for the same code would serve this one
            compile_layers(parts.drafter.layers, backend="aot_eager")
            before = graphs_compiled()
            preflight(parts)
            assert graphs_compiled() > before  # the layers were traced
            after = graphs_compiled()
        try:
            loss_sum, w_sum, _ = forward_loss(parts, make_batch(parts, ds, 128, [0, 1], 0))
            (loss_sum / w_sum).backward()
        finally:
            unfreeze_compiles()
        if compiled:
            assert graphs_compiled() == after  # the step ran the preflight's graphs
        results.append((float(loss_sum.detach()), torch.cat([p.grad.flatten() for p in parts.drafter.parameters()])))
    (loss0, grad0), (loss1, grad1) = results
    assert loss0 == pytest.approx(loss1, rel=1e-6)
    assert torch.allclose(grad0, grad1, atol=1e-6)


def _target_graphs_after_each(lengths) -> list[int]:
    """The tiny target's layers compiled through Dynamo (its graphs are what is counted; which backend runs them does
    not matter), run at each length against eager: the graphs compiled so far after each."""
    from trainer.model.compile_policy import graphs_compiled

    cfg = from_dict({**TINY, "target": {**TINY["target"], "dtype": "float32"}})
    target = build(cfg, for_training=False).target
    torch._dynamo.reset()  # graphs another test compiled for the same code would serve this one
    target.compile_layers(backend="eager")
    before, counts = graphs_compiled(), []
    for seq_len in lengths:
        ids = torch.randint(0, int(target.config.vocab_size), (1, seq_len))
        compiled = target.hidden_states(ids, compiled=True)
        assert compiled.shape[1] == seq_len
        assert (compiled - target.hidden_states(ids)).abs().max().item() < 1e-5
        counts.append(graphs_compiled() - before)
    return counts


def test_the_targets_compiled_layers_serve_every_bucket_with_one_graph():
    """The target's layers compile once for all shape buckets (the sequence length is symbolic), and give eager's
    hidden states at each: a later bucket costs the preflight no compile of the target."""
    assert _target_graphs_after_each((128, 256, 384)) == [1, 1, 1]


def test_a_first_length_equal_to_the_hidden_size_costs_one_graph_more_and_no_later_compile():
    """Dynamo gives equal input sizes one symbol: a first length equal to the hidden size is specialised, the next
    length compiles the symbolic graph, and every later length (the hidden size again among them) reuses one of the
    two, with eager's output."""
    from trainer.model.target import tiny_qwen3_config

    hidden = tiny_qwen3_config()["hidden_size"]
    assert _target_graphs_after_each((hidden, 16, 128, hidden, 192, 16)) == [1, 2, 2, 2, 2, 2]
