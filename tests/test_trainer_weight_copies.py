"""The drafter's bf16 weight copies (trainer/model/weight_copies.py): the same losses and gradients bit for bit as
autocast's own casts, rewritten by every optimizer step and every load, and never in a checkpoint."""

from __future__ import annotations

import copy

import torch

from trainer.model.attention import DenseBackend
from trainer.model.drafter import Drafter, DrafterDims
from trainer.model.weight_copies import attach
from trainer.run.update import make_adamw


class _Optim:
    lr, betas, weight_decay = 1e-2, (0.9, 0.999), 0.0


def _inputs(d: DrafterDims, seed: int):
    from trainer.model.mask import build_blocks

    g = torch.Generator().manual_seed(seed)
    S, A, bs = 128, 8, 16
    ids = torch.randint(0, 50, (S,), generator=g)
    batch = build_blocks([(ids, torch.ones(S))], S, A, bs, 1, 7.0, [torch.arange(5, 120, 15)[:A]])
    hidden = torch.randn(1, S, d.num_target_layers * d.hidden, generator=g)
    emb = torch.randn(1, A * bs, d.hidden, generator=g)
    backend = DenseBackend(max_gib=1.0)
    mask = backend.build_mask(batch.anchors, batch.anchor_valid, S, bs, d.num_heads)
    return hidden, emb, batch.block_pos, mask, backend


def _loss(model: Drafter, inputs, compiled: bool = False) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(*inputs, compiled=compiled).float().square().mean()


def _pair():
    torch.manual_seed(0)
    d = DrafterDims(64, 128, 4, 2, 16, 2, 2)
    plain = Drafter(d)
    with_copies = copy.deepcopy(plain)
    return d, plain, with_copies, attach(with_copies)


def test_copies_give_the_same_loss_and_gradients_bit_for_bit_and_follow_every_step():
    d, plain, fast, layers = _pair()
    assert len(layers) == 1 + d.num_layers * 7  # fc, then q, k, v, o, gate, up, down in each layer
    opts = [make_adamw(plain.parameters(), _Optim), make_adamw(fast.parameters(), _Optim, layers)]
    for step in range(3):
        inputs = _inputs(d, seed=step)
        losses = [_loss(m, inputs) for m in (plain, fast)]
        assert torch.equal(losses[0], losses[1]), step
        for m in (plain, fast):
            m.zero_grad(set_to_none=True)
        for loss in losses:
            loss.backward()
        for (name, a), b in zip(plain.named_parameters(), fast.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad), (step, name)
            assert a.grad.dtype == torch.float32
        for opt in opts:
            opt.step()
        for m in layers:  # rewritten right after the update
            assert torch.equal(m.weight_copy, m.weight.detach().to(torch.bfloat16))
    for a, b in zip(plain.parameters(), fast.parameters(), strict=True):
        assert torch.equal(a, b)


def test_copies_follow_a_load_and_stay_out_of_the_state_dict():
    d, plain, fast, layers = _pair()
    assert set(fast.state_dict()) == set(plain.state_dict())  # a checkpoint is the same file as before
    other = Drafter(d)  # different weights, as a resumed checkpoint has
    fast.load_state_dict(other.state_dict())
    for m in layers:
        assert torch.equal(m.weight_copy, m.weight.detach().to(torch.bfloat16))
    inputs = _inputs(d, seed=5)
    assert torch.equal(_loss(fast, inputs), _loss(other, inputs))


def test_without_autocast_the_fp32_weights_are_used():
    d, plain, fast, _ = _pair()
    inputs = _inputs(d, seed=2)
    assert torch.equal(plain(*inputs).float(), fast(*inputs).float())


def test_compiled_layers_read_the_copies_without_recompiling_after_a_step():
    from torch._dynamo.utils import counters

    d, plain, fast, layers = _pair()
    for m in (plain, fast):
        m.compile_layers(backend="aot_eager")
    opt = make_adamw(fast.parameters(), _Optim, layers)
    inputs = _inputs(d, seed=1)
    graphs = []
    for _ in range(3):
        losses = [_loss(m, inputs, compiled=True) for m in (plain, fast)]
        assert torch.equal(losses[0], losses[1])
        fast.zero_grad(set_to_none=True)
        losses[1].backward()
        opt.step()
        plain.load_state_dict(fast.state_dict())
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[1] == graphs[2]  # the copies rewritten in place: no recompile after a step
