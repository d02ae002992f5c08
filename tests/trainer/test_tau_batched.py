"""Batched speculative decoding (trainer.run.eval.speculative_decode_batch, bench_tau --batch-size) gives exactly the
answer of decoding each prompt alone the way it was done before batching: the target re-run over the whole sequence
every step, no cache, the drafter's context from a fresh forward. Real torch on the CPU, float32, tiny models."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import run_two_ranks
from trainer.config import from_dict
from trainer.model.mask import bucket_for, build_blocks
from trainer.run import eval as spec
from trainer.run.build import build, drafter_output
from trainer.serve import bench_tau

BS, MAX_NEW = 8, 30
CONFIG = {
    "target": {"random_preset": "tiny-qwen3", "dtype": "float32"},
    "drafter": {"num_layers": 2, "block_size": BS},
    "attention": {"backend": "dense"},
    "data": {"seq_buckets": [128]},
    "device": "cpu",
}


@pytest.fixture(scope="module")
def parts():
    return build(from_dict(CONFIG), for_training=False)


@pytest.fixture(scope="module")
def prompts():
    """Different lengths; the 100-token one reaches the 128-token length limit before MAX_NEW."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 200, (n,), generator=g) for n in (5, 17, 40, 9, 100, 1, 23)]


# --- the reference: the batch-1 loop as it was before batching (no cache; full logits every step) -----------------


def reference_draft(parts, drafter, seq: torch.Tensor) -> list[int]:
    bs, p = parts.cfg.drafter.block_size, seq.numel() - 1
    S = bucket_for(seq.numel(), parts.cfg.data.seq_buckets)
    batch = build_blocks(
        [(seq, torch.ones_like(seq))],
        S,
        spec.eval_anchors(bs),
        bs,
        parts.mask_token_id,
        parts.cfg.optim.gamma,
        [torch.tensor([p])],
    )
    out = drafter_output(parts, drafter, batch, parts.eval_backend)
    return parts.target.lm_head(out[0, 1:bs]).argmax(-1).tolist()


def reference_decode(parts, prompt: torch.Tensor, max_new: int, eos: set[int], draft) -> tuple[list[int], list[int]]:
    bs, limit = parts.cfg.drafter.block_size, parts.cfg.data.seq_buckets[-1]
    seq = torch.cat([prompt, parts.target.logits(prompt[None])[0, -1].argmax()[None]])
    gained: list[int] = []
    while seq.numel() - prompt.numel() < max_new and seq.numel() + bs <= limit and int(seq[-1]) not in eos:
        drafts = draft(seq)
        p = seq.numel() - 1
        preds = parts.target.logits(torch.cat([seq, seq.new_tensor(drafts)])[None])[0, p : p + bs].argmax(-1).tolist()
        n = 0
        while n < len(drafts) and drafts[n] == preds[n]:
            n += 1
        new = (drafts[:n] + [preds[n]])[: max_new - (seq.numel() - prompt.numel())]
        end = next((i for i, t in enumerate(new) if t in eos), None)
        if end is not None:
            new = new[: end + 1]
        seq = torch.cat([seq, seq.new_tensor(new)])
        gained.append(len(new))
        if end is not None:
            break
    return seq[prompt.numel() :].tolist(), gained


def greedy(parts, prompt: torch.Tensor, n: int) -> list[int]:
    seq = prompt
    for _ in range(n):
        seq = torch.cat([seq, parts.target.logits(seq[None])[0, -1].argmax()[None]])
    return seq.tolist()


def half_right_drafter(parts, prompts):
    """Proposes the target's greedy continuation with one token spoiled at a place that moves with the length, so
    acceptance runs from 0 to the whole block and differs row by row: (per-row function, batched draft_blocks)."""
    fulls = [greedy(parts, p, MAX_NEW + BS) for p in prompts]

    def row(seq: list[int]) -> list[int]:
        full = next(f for f in fulls if f[: len(seq)] == seq)
        d = (full[len(seq) : len(seq) + BS - 1] + [0] * BS)[: BS - 1]
        k = (len(seq) * 5) % BS
        if k < BS - 1:
            d[k] = (d[k] + 1) % 200
        return d

    return row, lambda _parts, _drafter, _context, seqs: torch.tensor([row(s) for s in seqs])


def test_batched_equals_one_at_a_time_with_eos_max_new_and_length_limit(parts, prompts, monkeypatch):
    row, batched = half_right_drafter(parts, prompts)
    tails = [greedy(parts, p, MAX_NEW)[p.numel() :] for p in prompts[:2]]
    stop = next(t for t in tails[1][3:] if t not in tails[0])  # ends the second prompt early, never the first
    eos = {stop}
    ref = [reference_decode(parts, p, MAX_NEW, eos, lambda s: row(s.tolist())) for p in prompts]
    assert ref[1][0][-1] == stop and len(ref[1][0]) < MAX_NEW  # an EOS, early
    assert len(ref[0][0]) == MAX_NEW  # max_new_tokens, the last step capped
    assert len(ref[4][0]) < MAX_NEW and ref[4][0][-1] != stop  # the length limit
    assert any(g > 1 for _, gs in ref for g in gs) and any(g == 1 for _, gs in ref for g in gs)
    monkeypatch.setattr(spec, "eos_ids", lambda _parts: eos)
    monkeypatch.setattr(spec, "draft_blocks", batched)
    for batch_size in (1, 2, 3, len(prompts) + 5):
        assert spec.speculative_decode_batch(parts, parts.drafter, prompts, MAX_NEW, batch_size) == ref, batch_size
    assert spec.speculative_decode(parts, parts.drafter, prompts[1], MAX_NEW) == ref[1]
    r = spec.measure_tau(parts, parts.drafter, prompts, MAX_NEW, batch_size=2)
    gains = [g for _, g in ref]
    assert (r.accepted, r.steps) == (sum(map(sum, gains)), sum(map(len, gains)))
    assert r.tau_prompt_mean == pytest.approx(sum(sum(g) / len(g) for g in gains if g) / sum(1 for g in gains if g))


def test_the_real_drafter_drafts_from_the_cache_what_it_drafts_from_a_fresh_forward(parts, prompts, monkeypatch):
    """Every row's proposal at every step, from the batched context, equals the proposal the drafter makes from a
    fresh target forward over that row alone; the decoded tokens and gains equal the reference's."""
    real = spec.draft_blocks
    seen = []

    def checked(parts_, drafter, context, seqs):
        out = real(parts_, drafter, context, seqs)
        seen.extend((out[i].tolist(), reference_draft(parts_, drafter, torch.tensor(s))) for i, s in enumerate(seqs))
        return out

    monkeypatch.setattr(spec, "draft_blocks", checked)
    few, max_new = [prompts[0], prompts[2], prompts[5]], 12  # three lengths, two batches: each step is two forwards
    ref = [
        reference_decode(parts, p, max_new, spec.eos_ids(parts), lambda s: reference_draft(parts, parts.drafter, s))
        for p in few
    ]
    assert spec.speculative_decode_batch(parts, parts.drafter, few, max_new, 2) == ref
    assert len(seen) == sum(len(g) for _, g in ref) and all(got == want for got, want in seen)


def test_an_empty_prompt_and_no_prompts(parts):
    assert spec.speculative_decode_batch(parts, parts.drafter, [], MAX_NEW, 4) == []
    assert spec.speculative_decode_batch(parts, parts.drafter, [torch.tensor([], dtype=torch.long)], MAX_NEW, 4) == [
        ([], [])
    ]


def test_the_in_run_evals_batch_is_bounded_by_its_memory_budget(parts):
    """Per position: keys and values of every layer (2 x 6 layers x 2 KV heads x 16) plus the drafter's context
    (2 layers x 64), float32: 2,048 bytes; 100 positions a row."""
    assert len(parts.target.layer_ids) == 2
    assert spec.rows_within(parts, 100, 3 * 204_800 / 2**30) == 3
    assert spec.rows_within(parts, 100, 1e-9) == 1  # never none


# --- bench_tau --batch-size ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def drafter_dir(tiny_dir, tmp_path_factory):
    from trainer.model.dflash_format import draft_config, write_export
    from trainer.model.drafter import drafter_dims

    cfg = from_dict(
        {
            "target": {"path": str(tiny_dir / "target"), "dtype": "float32"},
            "drafter": {"num_layers": 2, "block_size": BS},
            "attention": {"backend": "dense"},
            "data": {"seq_buckets": [128]},
            "device": "cpu",
        }
    )
    p = build(cfg, for_training=False)
    dims = drafter_dims(p.target.config, 2, len(p.target.layer_ids), {})
    config = draft_config(dims, BS, p.target.layer_ids, p.mask_token_id, p.target.config)
    return write_export(tmp_path_factory.mktemp("drafter") / "export", p.drafter.state_dict(), config, "float32")


def test_bench_tau_gives_the_same_answer_at_every_batch_size(capsys, tiny_dir, drafter_dir, tmp_path):
    mt = tmp_path / "mt_bench.jsonl"
    mt.write_text(
        "".join(
            json.dumps({"question_id": i, "turns": turns}) + "\n"
            for i, turns in enumerate(
                [
                    ["please count after five .", "then count after nine ."],
                    ["list colours after red ?"],
                    ["tell me about numbers .", "and more ?", "one last thing ."],
                    ["count after one ."],
                ]
            )
        )
    )
    runs = []
    for batch_size in (1, 2, 64):
        out = tmp_path / f"per_prompt_{batch_size}.jsonl"
        code = bench_tau.main(
            [
                "--target",
                str(tiny_dir / "target"),
                "--drafter",
                str(drafter_dir),
                "--prompts",
                str(mt),
                "--max-new-tokens",
                "12",
                "--dtype",
                "float32",
                "--device",
                "cpu",
                "--quiet",
                "--json",
                "--out",
                str(out),
                "--batch-size",
                str(batch_size),
            ]
        )
        printed = capsys.readouterr().out
        assert code == 0
        (summary,) = json.loads(printed)["sets"]
        summary.pop("seconds")
        runs.append((summary, out.read_text()))
    assert runs[0] == runs[1] == runs[2]
    assert [json.loads(x)["turns"] for x in runs[0][1].splitlines()] == [2, 1, 3, 1]
    # the batch of one is the conversation decoded alone, turn by turn
    from trainer.data.dataset import load_tokenizer
    from trainer.data.prompts import read_prompts

    tok = load_tokenizer(str(tiny_dir / "target"), "--target")
    limit = bench_tau.length_limit([40], 3, 12, BS)
    p = bench_tau.build_parts(str(tiny_dir / "target"), str(drafter_dir), limit, "cpu", "float32")
    _, convs = read_prompts(str(mt))
    alone = [bench_tau.decode_conversation(p, tok, c, 12, False, limit) for c in convs]
    together = bench_tau.decode_conversations(p, tok, convs, 12, False, limit, batch_size=3)
    assert alone == together and all(x is not None for x in alone)


@pytest.mark.parametrize("value", ["0", "-3"])
def test_a_batch_size_below_one_is_one_line_exit_2(capsys, tiny_dir, drafter_dir, tmp_path, value):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question": "count after two ."}) + "\n")
    code = bench_tau.main(
        [
            "--target",
            str(tiny_dir / "target"),
            "--drafter",
            str(drafter_dir),
            "--prompts",
            str(prompts),
            "--batch-size",
            value,
            "--device",
            "cpu",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "--batch-size" in err


# --- a sharded target: every rank decodes the same prompts in lockstep ------------------------------------------

WORKER = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from trainer.config import from_dict, parse_parallel
from trainer.model.parallel import make_layout
from trainer.run.distributed import init_world, shutdown
from trainer.run.eval import speculative_decode_batch
from trainer.run.build import build
from trainer.run.process_exit import end_process

world = init_world("cpu")
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, 200, (n,), generator=g) for n in (5, 30, 12)]
for mode in ("replicate", "tensor", "fsdp"):
    parallel = {"tensor": 2} if mode == "tensor" else mode
    cfg = from_dict({**json_cfg, "target": {**json_cfg["target"], "parallel": parallel}})
    parts = build(cfg, device=world.device, layout=make_layout(*parse_parallel(parallel), world), for_training=False)
    torch.save(speculative_decode_batch(parts, parts.drafter, prompts, 20, 2), f"{sys.argv[1]}/{mode}-{world.rank}.pt")
shutdown(world)
end_process(0)
"""


def test_a_sharded_target_decodes_the_same_batches_on_every_rank(tmp_path):
    """Tensor-parallel (DTensor, local KV heads in the cache) and FSDP2 targets, two ranks on gloo: every rank's
    batched answer equals the replicated target's."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = tmp_path / "worker.py"
    script.write_text(f"json_cfg = {json.dumps(CONFIG)}\n" + WORKER)
    proc = run_two_ranks(script, str(tmp_path), str(root), cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = torch.load(tmp_path / "replicate-0.pt")
    assert any(len(g) for _, g in want)
    for name in ("replicate-1", "tensor-0", "tensor-1", "fsdp-0", "fsdp-1"):
        assert torch.load(tmp_path / f"{name}.pt") == want, name
