"""health.py: recorded log tails and snapshot sequences in, verdicts out (pure, no I/O)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflashctl.judge.assess import History, Thresholds, assess, classify_log

LOGS = Path(__file__).resolve().parents[1] / "logs"  # the corpus: one folder per state


def log(name: str) -> str:
    return next(LOGS.glob(f"*/{name}")).read_text()


@pytest.mark.parametrize(
    "name, state, must_contain",
    [
        ("dense-fallback.log", "DENSE_FALLBACK", "flex guard"),
        ("oom-dense-fallback.log", "DENSE_FALLBACK", "sdpa_dense"),
        ("oom-plain.log", "OOM", "Tried to allocate 2.32 GiB"),
        ("recompile-limit.log", "RECOMPILE_LIMIT", "last reason: 0/1: tensor 'x' size mismatch"),
        ("nccl-timeout.log", "NCCL_TIMEOUT", "Watchdog caught collective operation timeout"),
        ("trainer-crash.log", "CRASHED", "RuntimeError: injected fault at step 3"),
        ("config-error.log", "CONFIG_ERROR", "optim.learning_rate: unknown key"),
        ("torchrun-two-ranks-crash.log", "CRASHED", "KeyError: \"'input_ids' missing in record 41 (rank 0)\""),
    ],
)
def test_recorded_logs_classify(name, state, must_contain):
    found = classify_log(log(name))
    assert found is not None and found.state == state, found
    assert any(must_contain in line for line in found.evidence), found.evidence


def test_interleaved_ranks_give_the_root_cause_rank_and_its_frames():
    found = classify_log(log("torchrun-interleaved.log"))
    assert found.state == "CRASHED" and found.reason == "KeyError on rank0"  # torchrun's Root Cause names rank 0
    assert found.evidence[0] == "KeyError: \"'input_ids' missing in record 41 (rank 0)\""
    assert any("in parse_record" in f for f in found.evidence[1:])
    assert not any("ChildFailedError" in e for e in found.evidence)


def test_an_ordinary_oom_is_not_a_dense_fallback_even_a_huge_one_without_flex_in_sight():
    assert classify_log(log("oom-plain.log")).state == "OOM"
    huge = log("oom-plain.log").replace("Tried to allocate 2.32 GiB", "Tried to allocate 96.00 GiB")
    found = classify_log(huge)  # more than half the GPU in one allocation, but nothing of attention in the log
    assert found.state == "OOM" and "asked for 96.00 GiB of a 139.80 GiB GPU" in found.reason
    assert classify_log(log("oom-plain.log"), gpu_total_gib=4.0).state == "OOM"
    # the same huge allocation with flex_attention's frame names in the (cut) log: the dense fallback
    flexy = huge.replace("torch/_tensor.py", "torch/_higher_order_ops/flex_attention.py")
    assert classify_log(flexy).state == "DENSE_FALLBACK"


def test_clean_log_has_no_finding():
    assert classify_log("step 1/10 loss 3.2\nstep 2/10 loss 3.1\n") is None


TH = Thresholds(stall_after_s=60, startup_budget_s=300, heartbeat_max_age_s=30, throughput_drop=0.3, slow_polls=3)


def running(**kw) -> History:
    base = dict(
        started_at=0.0,
        now=100.0,
        last_step=50,
        last_step_time=95.0,
        tokens_per_s=[1000.0] * 5,
        heartbeat_age_s=2.0,
        loss=2.5,
        phase="train",
    )
    return History(**{**base, **kw})


@pytest.mark.parametrize(
    "history, state, reason_part",
    [
        (running(), "RUNNING", "step 50"),
        (running(last_step=None, last_step_time=None, tokens_per_s=[], phase="preflight"), "STARTING", "preflight"),
        (running(last_step=None, last_step_time=None, tokens_per_s=[], now=400.0), "STALLED", "startup budget"),
        (running(now=200.0), "STALLED", "no step progress"),
        (running(heartbeat_age_s=45.0), "STALLED", "heartbeat"),
        (running(tokens_per_s=[1000.0] * 5 + [100.0] * 3), "STALLED", "throughput collapsed"),
        (running(exit_code=0, finished=True), "FINISHED", "exit 0"),
        (running(exit_code=0, finished=False), "CRASHED", "exit status 0"),  # the trainer never wrote `finished`
        (running(exit_code=0, is_trainer=False), "FINISHED", "exit 0"),
        (running(exit_code=3, fatal={"kind": "dense_fallback", "message": "flex guard: ..."}), "DENSE_FALLBACK", ""),
        (running(exit_code=2, fatal={"kind": "config", "message": "x: steps: bad"}), "CONFIG_ERROR", "config"),
        (running(exit_code=1, log_tail=log("trainer-crash.log").splitlines()), "CRASHED", "RuntimeError"),
        (running(pane_dead=True, pane_status=137), "HOST_OOM", "SIGKILL (exit 137)"),
        (running(session_exists=False), "LOST", "tmux session"),
        (running(session_exists=False, run_dir_exists=False), "LOST", "run dir"),
        (running(log_tail=log("nccl-timeout.log").splitlines()), "NCCL_TIMEOUT", "NCCL"),
        (running(log_tail=log("recompile-limit.log").splitlines()), "RECOMPILE_LIMIT", "recompile"),
        (running(reachable=False, last_state="RUNNING"), "UNREACHABLE", "did not answer"),
    ],
)
def test_snapshot_histories(history, state, reason_part):
    v = assess(history, TH)
    assert v.state == state, v
    assert reason_part in v.reason, v.reason
    assert v.evidence, "a verdict always carries evidence"
    if state not in ("RUNNING", "STARTING", "FINISHED"):
        assert v.advice


def test_gpu_utilisation_alone_never_proves_progress():
    # a hung collective shows 100% utilisation; the verdict only looks at steps, heartbeat and throughput
    h = running(now=500.0, last_step_time=100.0)
    assert assess(h, TH).state == "STALLED"


def test_a_recompile_limit_then_eager_flex_then_oom_names_the_terminal_failure_and_its_cause():
    found = classify_log(log("recompile-eager-oom.log"))
    assert found.state == "DENSE_FALLBACK" and "caused by the recompile limit" in found.reason
    assert any("hit config.recompile_limit" in e for e in found.evidence)
    assert any("flex_attention called without torch.compile" in e for e in found.evidence)
    assert any("Tried to allocate 46.00 GiB" in e for e in found.evidence)


def test_an_oom_on_one_rank_is_the_cause_of_the_others_nccl_timeouts():
    found = classify_log(log("nccl-after-oom.log"))
    assert found.state == "OOM" and found.reason == (
        "CUDA out of memory on rank1: asked for 2.32 GiB of a 139.80 GiB GPU (then NCCL timeouts on rank0, rank3)"
    )
    assert "Tried to allocate 2.32 GiB" in found.evidence[0] and "Watchdog" in found.evidence[-1]


def test_a_crash_before_the_first_step_that_would_repeat_is_not_restarted():
    lines = [
        "Traceback (most recent call last):",
        '  File "/x/train.py", line 1, in <module>',
        "    import torch",
        "ModuleNotFoundError: No module named 'torch'",
    ]
    h = History(started_at=0.0, now=10.0, exit_code=1, log_tail=lines)
    v = assess(h, Thresholds())
    assert v.state == "CONFIG_ERROR" and "before its first step" in v.reason
    assert "No module named 'torch'" in v.evidence[0]
    h = History(started_at=0.0, now=10.0, exit_code=1, log_tail=lines, last_step=50)
    assert assess(h, Thresholds()).state == "CRASHED"  # after steps it is an ordinary crash


def test_a_gpu_fault_line_that_progress_outlived_is_a_warning_until_the_job_stops():
    lines = [
        "[rank1]: torch.AcceleratorError: CUDA error: uncorrectable ECC error encountered (retried)",
        "step 500 loss 2.1",
        "step 510 loss 2.0",
    ]
    h = History(
        started_at=0.0,
        now=1000.0,
        last_step=510,
        step_changed_at=995.0,
        heartbeat_age_s=2.0,
        log_tail=lines,
        tokens_per_s=[1000.0],
    )
    v = assess(h, TH)
    assert v.state == "RUNNING" and any("warning: GPU hardware error" in e for e in v.evidence)
    h.step_changed_at = 100.0  # no step for 900 s: now the fault is the verdict
    assert assess(h, TH).state == "GPU_FAULT"
    h.exit_code, h.step_changed_at = 1, 995.0  # it ended: the fault is the root cause
    assert assess(h, TH).state == "GPU_FAULT"


def test_a_restarted_job_is_starting_until_it_passes_its_resumed_step():
    from collections import deque

    from dflashctl.judge.fold import Job, fold

    old = [{"time": 100.0 + i, "step": i, "loss": 2.0, "tokens_per_s": 900.0} for i in range(1, 6)]
    snap = {
        "time": 500.0,
        "run_dir_exists": True,
        "session": {"exists": True, "created": 400.0},
        "metrics": {"offset": 10, "records": old},
        "heartbeat": {"phase": "load", "time": 499.0},
        "progress": {"attempt_start": 400.0, "heartbeat_changed_at": 499.0},
    }
    h = History(started_at=0.0)
    fold(h, snap, Job(), deque())
    v = assess(h, TH)
    assert v.state == "STARTING" and h.last_step is None, v
    snap = {**snap, "time": 520.0, "metrics": {"offset": 20, "records": [{"time": 515.0, "step": 6, "loss": 1.9}]}}
    fold(h, snap, Job(), deque())
    assert assess(h, TH).state == "RUNNING" and h.last_step == 6


def test_stamps_a_reader_cannot_prove_are_no_evidence():
    from collections import deque

    from dflashctl.judge.fold import Job, fold

    far = 10**9
    snap = {
        "time": 2000.0,
        "run_dir_exists": True,
        "session": {"exists": True, "created": 1000.0},
        "metrics": {"offset": 0, "records": []},
        "heartbeat": {"phase": "train", "time": 1999.0},
        "progress": {
            "attempt_start": 1000.0,
            "heartbeat_changed_at": far,
            "step": 40,
            "step_changed_at": far,
            "activity_at": far,
        },
    }
    h = History(started_at=0.0)
    fold(h, snap, Job(), deque())
    assert h.heartbeat_age_s == 1000.0 and h.step_changed_at == 1000.0 and h.activity_at == 1000.0
    assert assess(h, TH).state == "STALLED"
