"""The step breakdown the speed benchmark reports: the trainer's own step with its stages marked, adding up to the
step; marking changes nothing the step computes; kernels sorted by what they compute. Times here are the CPU's and
are not asserted as speeds, nor whether they add up on a busy machine (the benchmark checks that): that the parts
make the whole is checked on a clock that ticks once a look."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import step_breakdown  # noqa: E402

from trainer.config import from_dict  # noqa: E402
from trainer.run.build import build, dummy_batch, forward_loss  # noqa: E402

TINY = {
    "target": {"random_preset": "tiny-qwen3", "dtype": "float32"},
    "drafter": {"num_layers": 1, "block_size": 8},
    "attention": {"backend": "dense"},
    "device": "cpu",
    "steps": 1,
    "data": {"anchors_per_seq": 16, "seq_buckets": [128], "batch_size": 2, "synthetic_samples": 4},
}


def test_marked_stages_come_in_stream_order_and_add_up_to_the_step():
    parts = build(from_dict(TINY))
    opt = torch.optim.AdamW(parts.drafter.parameters(), lr=1e-4)
    batch = dummy_batch(parts, 128)
    rep = step_breakdown.breakdown(
        parts,
        opt,
        lambda i: batch,
        steps=5,
        warmup=1,
        flops={"target_fwd": 1e9, "drafter_fwd": 2e9, "drafter_bwd": 4e9, "lm_head_loss": 3e9},
        ceiling_tflops=1.0,
    )
    assert list(rep["stages_ms"]) == step_breakdown.STAGES
    assert all(v > 0 for v in rep["stages_ms"].values())
    # whether they add up on this clock is the benchmark's check (a loaded machine's steps vary): here its form
    assert isinstance(rep["adds_up"], bool) and rep["adds_up"] == (rep["adds_up_within"] <= 0.05)
    assert rep["between_steps_ms"] >= 0 and rep["wall_step_ms"] > 0 and rep["mean_step_ms"] > 0
    assert rep["stage_tflop"]["lm_head_loss_fwd"] == 0.003  # the fused loss computes its gradient in its forward
    assert rep["mfu"] > 0 and set(rep["stage_fraction_of_ceiling"]) == set(rep["stage_tflop"])


def test_the_stages_and_the_gaps_make_the_whole_step_on_a_clock_that_ticks_once_a_look(monkeypatch):
    """A clock that moves 1 ms each time it is read: every mark is one tick, so a step of seven stages and the gap
    to the next is 8 ms, and the wall time (8 looks a step and one at the end: 49 ticks over the 5 steps and the
    closing one) within 5 % of it. A stage left out of the sum, or counted twice, is 1 ms in 8 off: the check fails."""
    ticks = iter(range(10**6))
    monkeypatch.setattr(step_breakdown, "time", type("Clock", (), {"perf_counter": lambda: next(ticks) / 1e3}))
    parts = build(from_dict(TINY))
    opt = torch.optim.AdamW(parts.drafter.parameters(), lr=1e-4)
    batch = dummy_batch(parts, 128)
    rep = step_breakdown.breakdown(parts, opt, lambda i: batch, steps=5, warmup=1)
    assert rep["stages_ms"] == {k: 1.0 for k in step_breakdown.STAGES} and rep["between_steps_ms"] == 1.0
    assert rep["mean_step_ms"] == rep["step_ms"] == 8.0 and rep["wall_step_ms"] == round(49 / 6, 3)
    assert rep["adds_up"] and rep["adds_up_within"] == round((49 / 6 - 8) / (49 / 6), 4)


def test_marking_a_step_changes_neither_its_loss_nor_its_gradients():
    results = []
    for marked in (False, True):
        torch.manual_seed(0)
        parts = build(from_dict(TINY))
        batch = dummy_batch(parts, 128)
        seen: list[str] = []
        loss_sum, w_sum, _ = forward_loss(parts, batch, mark=seen.append if marked else None)
        (loss_sum / w_sum).backward()
        results.append((float(loss_sum.detach()), [p.grad.clone() for p in parts.drafter.parameters()], seen))
    (l0, g0, _), (l1, g1, seen) = results
    assert l0 == l1 and all(torch.equal(a, b) for a, b in zip(g0, g1, strict=True))
    assert seen == ["target_fwd", "embed_and_mask", "drafter_fwd", "lm_head_loss_fwd", "lm_head_loss_bwd"]


def test_kernels_are_sorted_by_what_their_names_say_they_compute():
    cases = {
        "triton_tem_fused_flex_attention_0": "attention",
        "flash_fwd_kernel": "attention",
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT": "matmul",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "matmul",
        "triton_red_fused__to_copy_mean_pow_rsqrt_0": "norm",
        "triton_poi_fused_add_cat_mul_neg_slice_1": "rope",
        "multi_tensor_apply_kernel<FusedAdamMathFunctor>": "optimizer",
        "triton_poi_fused_add_mul_silu_2": "elementwise",
    }
    assert {n: step_breakdown.kernel_class(n) for n in cases} == cases


def test_device_work_is_read_from_the_chrome_trace_in_start_order():
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1.0, "dur": 9.0},
            {"ph": "X", "cat": "kernel", "name": "gemm_b", "ts": 30.0, "dur": 4.0},
            {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 5.0, "dur": 1.0},
            {"ph": "X", "cat": "kernel", "name": "gemm_a", "ts": 10.0, "dur": 5.0},
            {"ph": "i", "cat": "kernel", "name": "instant", "ts": 11.0},
            "garbage",
            {"ph": "X", "cat": "kernel", "name": "no_start"},
        ]
    }
    assert step_breakdown.trace_kernels(trace) == [
        ("Memcpy HtoD", 5.0, 1.0),
        ("gemm_a", 10.0, 5.0),
        ("gemm_b", 30.0, 4.0),
    ]
    assert step_breakdown.trace_kernels({}) == []


def test_a_profile_is_cut_into_the_stages_by_the_marks_separators():
    sep = "void at::cuda::(anonymous namespace)::spin_kernel(long)"
    marks = ["start", "target_fwd", "optimizer"] * 2  # two steps of two stages
    kernels = []
    for step in range(2):  # per step: separators at 0, 10, 20 (+100 a step), each 1 us long
        base = 100.0 * step
        kernels += [(sep, base, 1.0), (sep, base + 10, 1.0), (sep, base + 20, 1.0)]
        kernels += [
            ("nvjet_gemm", base + 2, 4.0),
            ("triton_red_fused_rsqrt_0", base + 6, 2.0),
            ("multi_tensor_apply_kernel<FusedAdam>", base + 12, 6.0),
        ]
    kernels += [("late_copy_kernel", 250.0, 2.0)]  # after the last mark
    table = step_breakdown.stage_table(sorted(kernels, key=lambda k: k[1]), marks, steps=2)
    assert table["target_fwd"] == {
        "span_ms": 0.009,
        "busy_ms": 0.006,
        "idle_ms": 0.003,
        "classes": {"matmul": 0.004, "norm": 0.002},
    }
    assert table["optimizer"]["classes"] == {"optimizer": 0.006} and table["optimizer"]["idle_ms"] == 0.003
    # from the first step's last separator (ends at 21) to the second's start (100), over two steps
    between = table["between_steps"]
    assert between["span_ms"] == pytest.approx(0.0395, abs=1e-3) and between["busy_ms"] == 0.001
    assert between["idle_ms"] == pytest.approx(0.0385, abs=1e-3) and between["classes"] == {"copy": 0.001}
    assert step_breakdown.stage_table(kernels, marks[:-1], steps=2) is None  # a lost separator: no guess
    gaps = step_breakdown.largest_gaps(sorted(kernels, key=lambda k: k[1]), marks, n=2)
    assert gaps[0] == {"ms": 0.129, "stage": "between_steps", "after": sep[:70], "before": "late_copy_kernel"}
    assert gaps[1] == {"ms": 0.079, "stage": "between_steps", "after": sep[:70], "before": sep[:70]}  # 21 -> 100


def test_the_current_record_has_every_key_and_says_where_it_came_from(tmp_path):
    import h200_perf

    raw = {
        "date": "2026-12-02",
        "mfu": 0.7,
        "step_ms": 205.4,
        "preflight_bucket_s": {"3072": 14.3},
        "memory_by_step": {"5": {"peak_gib": 37.2}, "20": {"peak_gib": 37.3}},
        "split_ms": {"x": 1},
    }
    cold = tmp_path / "cold.json"  # bench/cold_preflight.py's report: one failed run is left out
    cold.write_text(
        json.dumps(
            {
                "buckets": [1024, 3072],
                "share": "triton",
                "runs": [
                    {"exit": 0, "preflight_s": [18.4, 11.6]},
                    {"exit": 1, "preflight_s": [0, 0]},
                    {"exit": 0, "preflight_s": [14.7, 6.4]},
                ],
            }
        )
    )
    rec = h200_perf.record_of(raw, "raw.json", 60.5, h200_perf.cold_reports(str(cold)))
    assert list(rec) == [*h200_perf.RECORD_KEYS, "source"]
    assert rec["peak_gib"] == 37.3 and rec["preflight_bucket_s"] == {"3072": 14.3} and rec["source"] == "raw.json"
    assert rec["cold_preflight_s"] == {"share_triton": [{"1024": 18.4, "3072": 11.6}, {"1024": 14.7, "3072": 6.4}]}
    assert rec["breakdown"] is None and rec["launch_to_running_cold_s"] == 60.5 and "split_ms" not in rec
    assert h200_perf.cold_reports(None) is None
    current = json.loads((ROOT / "bench" / "results" / "h200.json").read_text())
    assert list(current) == [*h200_perf.RECORD_KEYS, "source"]  # the file the README quotes is in this form
    assert (ROOT / current["source"]).is_file()
