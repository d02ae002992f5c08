"""Anchors, block layout and mask semantics on cases written out by hand."""

from __future__ import annotations

import math

import torch

from trainer.model.mask import anchor_generator, build_blocks, dense_mask, sample_anchors


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
        [(ids, loss_mask)],
        seq_len=12,
        num_anchors=3,
        block_size=4,
        mask_token_id=7,
        gamma=7.0,
        anchors=[torch.tensor([3, 7])],
    )
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


def _check_tiles(anchors, valid, seq_len, bs):
    """The tile maps against the dense mask: no allowed tile missed, full tiles all allowed, empty tiles empty."""
    from trainer.model.mask import TILE, tile_maps

    partial, full = tile_maps(anchors, valid, seq_len, bs)
    dense = dense_mask(anchors, valid, seq_len, bs)[:, 0]  # [B, Q, KV]
    B, Q, KV = dense.shape
    qt, kt = -(-Q // TILE), -(-KV // TILE)
    padded = torch.zeros(B, qt * TILE, kt * TILE, dtype=torch.bool)
    padded[:, :Q, :KV] = dense
    tiles = padded.view(B, qt, TILE, kt, TILE)
    any_allowed = tiles.any(dim=(2, 4))  # [B, Qt, KVt]
    inside = torch.zeros(B, qt * TILE, kt * TILE, dtype=torch.bool)
    inside[:, :Q, :KV] = True
    all_allowed = (tiles | ~inside.view(B, qt, TILE, kt, TILE)).all(dim=(2, 4))
    assert not (partial & full).any()
    assert torch.equal(any_allowed & ~(partial | full), torch.zeros_like(any_allowed)), "an allowed tile was missed"
    assert bool((~full | all_allowed).all()), "a full tile is not allowed everywhere"
    assert not ((partial | full) & ~any_allowed).any(), "an empty tile is marked"


def test_tile_maps_are_exact_for_random_unsorted_and_padding_anchors():
    g = torch.Generator().manual_seed(0)
    for bs in (8, 16, 32):
        for seq_len in (128, 256, 384, 1024):
            A = 128 * 2 // bs  # two query tiles
            for trial in range(3):
                lengths = [seq_len, max(3, seq_len // 3), 5, seq_len - 1]
                anchors = torch.zeros(len(lengths), A, dtype=torch.long)
                valid = torch.zeros(len(lengths), A, dtype=torch.bool)
                for b, length in enumerate(lengths):
                    n = int(torch.randint(0, A + 1, (1,), generator=g)) if trial else A
                    pos = torch.randint(0, max(1, length - 1), (n,), generator=g)
                    if trial == 2:
                        pos = pos.sort(descending=True).values  # unsorted on purpose
                    anchors[b, :n], valid[b, :n] = pos, True
                _check_tiles(anchors, valid, seq_len, bs)


def test_every_allowed_entry_lies_in_a_tile_the_block_mask_lists():
    from trainer.model.mask import block_mask_from_anchors

    anchors = torch.tensor([[5, 200, 130, 0] * 4, [300, 17, 0, 0] * 4])  # 16 blocks of 8: one query tile
    valid = torch.tensor([[True] * 16, [True, True, False, False] * 4])
    bm = block_mask_from_anchors(anchors, valid, 384, 8)
    dense = dense_mask(anchors, valid, 384, 8)[:, 0]
    assert bm.shape[-2:] == (128, 384 + 128)
    assert torch.equal(
        bm.to_dense()[:, 0].bool().repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :128, :512] | ~dense,
        torch.ones_like(dense),
    )
