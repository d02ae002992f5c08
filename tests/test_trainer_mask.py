"""Anchors, block layout and mask semantics on cases written out by hand."""

from __future__ import annotations

import math

import torch

from trainer.mask import anchor_generator, build_blocks, dense_mask, sample_anchors


def test_mask_small_case_by_hand():
    # S = 6 context positions, 2 anchors at 2 and 4, block size 2; Q = 4 rows, KV = 6 + 4 = 10 columns.
    anchors = torch.tensor([[2, 4]])
    valid = torch.tensor([[True, True]])
    m = dense_mask(anchors, valid, seq_len=6, block_size=2)[0, 0].int()
    expected = torch.tensor(
        [
            # ctx 0 1 2 3 4 5 | blk0 | blk1
            [1, 1, 0, 0, 0, 0, 1, 1, 0, 0],  # block 0 row 0: context before 2, own block
            [1, 1, 0, 0, 0, 0, 1, 1, 0, 0],  # block 0 row 1
            [1, 1, 1, 1, 0, 0, 0, 0, 1, 1],  # block 1 row 0: context before 4, own block
            [1, 1, 1, 1, 0, 0, 0, 0, 1, 1],
        ]
    )
    assert torch.equal(m, expected)


def test_padding_blocks_see_only_themselves_and_nobody_sees_them():
    anchors = torch.tensor([[3, 0]])
    valid = torch.tensor([[True, False]])
    m = dense_mask(anchors, valid, seq_len=5, block_size=2)[0, 0]
    assert m[2:, :5].sum() == 0 and m[2:, 7:].all()  # padding rows: no context, own block only
    assert m[:2, 7:].sum() == 0  # the real block cannot see the padding block


def test_block_inputs_labels_and_weights():
    ids = torch.arange(100, 110)  # tokens 100..109
    loss_mask = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 1, 0])  # last token is not a response token
    batch = build_blocks(
        [(ids, loss_mask)], seq_len=12, num_anchors=3, block_size=4, mask_token_id=7, gamma=7.0,
        anchors=[torch.tensor([3, 7])],
    )  # fmt: skip
    assert batch.block_ids[0].tolist() == [103, 7, 7, 7, 107, 7, 7, 7, 7, 7, 7, 7]
    assert batch.block_pos[0, :8].tolist() == [3, 4, 5, 6, 7, 8, 9, 10]
    # block at 3: labels at 4, 5, 6 (k = 1..3); block at 7: 8 is a response token, 9 is not, 10 is past the end
    assert batch.labels[0, :8].tolist() == [0, 104, 105, 106, 0, 108, 0, 0]
    w = batch.weights[0]
    assert w[0] == 0 and math.isclose(w[1], 1.0) and math.isclose(w[2], math.exp(-1 / 7), rel_tol=1e-6) and w[6] == 0
    assert batch.anchor_valid[0].tolist() == [True, True, False] and w[8:].sum() == 0


def test_anchors_reproducible_and_among_response_positions():
    lm = torch.zeros(200, dtype=torch.long)
    lm[50:150] = 1
    a1 = sample_anchors(lm, 200, 16, anchor_generator(1, 0, 5))
    a2 = sample_anchors(lm, 200, 16, anchor_generator(1, 0, 5))
    a3 = sample_anchors(lm, 200, 16, anchor_generator(1, 1, 5))
    assert torch.equal(a1, a2) and not torch.equal(a1, a3)
    assert ((a1 >= 50) & (a1 < 150)).all() and torch.equal(a1, a1.sort().values) and a1.unique().numel() == 16
