"""The failures after the dense fallback: divergence, broken GPUs, host OOM, full disks (issue: no failure stays
silent or misread). Real-shaped logs through the classifier and `diagnose`; histories with the snapshot facts that
confirm or name them."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflashctl.judge.assess import History, Thresholds, assess, classify_log
from dflashctl.judge.diagnosis import diagnose_text

LOGS = Path(__file__).resolve().parents[1] / "logs"  # the corpus: one folder per state


def log(name: str) -> str:
    return next(LOGS.glob(f"*/{name}")).read_text()


@pytest.mark.parametrize(
    "name, state, reason_part, evidence_part",
    [
        ("gpu-ecc-then-nccl.log", "GPU_FAULT", "on rank1: uncorrectable ECC error", "uncorrectable ECC error"),
        ("xid-fallen-off-bus.log", "GPU_FAULT", "fallen off the bus", "Xid (PCI:0000:3b:00): 79"),
        ("host-oom-torchrun.log", "HOST_OOM", "rank1 was killed by SIGKILL", "exitcode  : -9"),
        ("host-oom-shell.log", "HOST_OOM", "killed by SIGKILL: likely", "31337 Killed"),
        ("disk-full-checkpoint.log", "DISK_FULL", "checkpoint write failed", "unexpected pos"),
        ("enospc-write.log", "DISK_FULL", "no space left on device", "Errno 28"),
        ("diverged-nan.log", "DIVERGED", "non-finite in the last 4 loss lines", "last finite: step 20/200"),
        ("generic-huge-oom.log", "OOM", "asked for 298.02 GiB of a 139.80 GiB GPU", "Tried to allocate 298.02 GiB"),
        ("module-not-found.log", "CONFIG_ERROR", "before its first step: ModuleNotFoundError", "flash_attn"),
    ],
)
def test_diagnose_names_the_root_cause(name, state, reason_part, evidence_part):
    v = diagnose_text(log(name))
    assert v.state == state, v
    assert reason_part in v.reason, v.reason
    assert any(evidence_part in e for e in v.evidence), v.evidence
    assert v.advice and "restart resumes" not in v.advice  # none of these is helped by a plain restart


def test_the_false_alarms_are_gone():
    # a generic script's huge allocation is an OOM with its size, not the dense fallback with flex advice
    v = diagnose_text(log("generic-huge-oom.log"))
    assert "flex" not in v.advice and "flex" not in v.reason
    # a missing module before any step never promises that a restart helps
    v = diagnose_text(log("module-not-found.log"))
    assert "Not restarted" in v.advice


@pytest.mark.parametrize(
    "text",
    [
        "step 1 loss 2.0\nstep 2 loss nan\nstep 3 loss 1.9\n",  # one NaN, then finite again: recovered
        "step 1 loss nan\nstep 2 loss nan\n",  # two lines are not yet "repeated"
        "loss function: cross entropy\nloss_scale: 65536\nnan values filtered: 3\n",  # no loss value at all
    ],
)
def test_a_passing_nan_is_not_a_divergence(text):
    found = classify_log(text)
    assert found is None or found.state != "DIVERGED", found


@pytest.mark.parametrize(
    "line",
    [
        "loss nan",
        "loss: NaN",
        "'loss': nan,",
        '"loss": NaN',
        "loss=inf",
        "val_loss=-inf",
        "Loss: Infinity",
        "loss 1e999",
    ],
)
def test_any_scripts_spelling_of_a_non_finite_loss(line):
    text = "\n".join(f"epoch 0 iter {i} {line}" for i in range(3))
    assert classify_log(text).state == "DIVERGED"


def test_the_hardware_error_outranks_the_nccl_timeouts_and_names_the_gpu():
    ecc = log("gpu-ecc-then-nccl.log").splitlines()
    gpus = [{"index": i, "uuid": f"GPU-{i:04d}", "ecc_uncorrected": 0} for i in range(4)]
    h = History(
        started_at=0.0,
        now=900.0,
        exit_code=1,
        last_step=1200,
        log_tail=ecc,
        gpus=gpus,
        job_gpus=[0, 1, 2, 3],
        node="gpu-b",
    )
    v = assess(h, Thresholds())
    assert v.state == "GPU_FAULT"
    assert "GPU 1 (GPU-0001) on gpu-b" in v.reason  # rank 1 runs on the job's second GPU
    # NVML's own count names the GPU even where the log cannot (a job without rank prefixes)
    gpus[2]["ecc_uncorrected"] = 3
    plain = [ln.split("]: ", 1)[-1] for ln in ecc]
    v = assess(History(started_at=0.0, now=900.0, exit_code=1, last_step=1200, log_tail=plain, gpus=gpus), Thresholds())
    assert v.state == "GPU_FAULT" and "GPU 2 (GPU-0002), 3 uncorrectable ECC errors" in v.reason


def test_nvml_readings_alone_turn_a_timeout_into_a_gpu_fault():
    lines = log("nccl-timeout.log").splitlines()
    gpus = [{"index": 0, "uuid": "GPU-a", "ecc_uncorrected": 0}, {"index": 1, "uuid": "GPU-b", "ecc_uncorrected": 2}]
    v = assess(History(started_at=0.0, now=900.0, exit_code=1, last_step=9, log_tail=lines, gpus=gpus), Thresholds())
    assert v.state == "GPU_FAULT" and "GPU 1 (GPU-b)" in v.reason


def test_host_oom_is_confirmed_by_the_cgroup_or_the_kernel_log_and_only_likely_otherwise():
    lines = log("host-oom-torchrun.log").splitlines()
    base = dict(started_at=0.0, now=900.0, exit_code=1, last_step=310, log_tail=lines)
    assert "likely" in assess(History(**base), Thresholds()).reason
    v = assess(History(**base, oom_kills=1), Thresholds())
    assert v.state == "HOST_OOM" and "confirmed, 1 OOM kill(s) in the job's cgroup" in v.reason
    kern = "Out of memory: Killed process 77136 (python3) total-vm:9123456kB, anon-rss:8123456kB"
    v = assess(History(**base, kernel_oom=[kern]), Thresholds())
    assert "confirmed" in v.reason and kern in v.evidence


def test_our_own_kill_is_never_host_oom():
    h = History(
        started_at=0.0,
        now=100.0,
        exit_code=137,
        stop_request={"time": 90.0},
        stop_result={"result": "KILLED", "gpu_check": "none"},
    )
    assert assess(h, Thresholds()).state == "KILLED"


def test_a_failed_write_with_room_to_spare_is_not_a_full_disk():
    lines = log("disk-full-checkpoint.log")
    assert classify_log(lines, disk_free_gib=0.5, checkpoint_gib=10.8).state == "DISK_FULL"
    found = classify_log(lines, disk_free_gib=500.0, checkpoint_gib=10.8)
    assert found.state != "DISK_FULL"


def test_the_trainers_diverged_record_and_exit_status():
    fatal = {"event": "fatal", "kind": "diverged", "message": "loss or grad norm non-finite for 10 steps in a row"}
    v = assess(History(started_at=0.0, now=50.0, exit_code=4, last_step=30, fatal=fatal), Thresholds())
    assert v.state == "DIVERGED" and "fatal record: diverged (exit 4)" in v.reason
    v = assess(History(started_at=0.0, now=50.0, exit_code=4, last_step=30), Thresholds())
    assert v.state == "DIVERGED"


def test_an_earlier_attempts_failure_is_not_judged_again():
    old = log("nccl-timeout.log").splitlines()
    lines = [
        "[dflashctl] 2026-12-01T01:00:00Z start ",
        *old,
        "[dflashctl] 2026-12-01T02:00:00Z start --resume",
        "step 904/20000 epoch 0 loss 2.2 acc 0.5 lr 5e-4 grad_norm 0.4 62,000 tok/s peak 58.1 GiB",
    ]
    h = History(started_at=0.0, now=100.0, last_step=904, last_step_time=99.0, log_tail=lines, heartbeat_age_s=1.0)
    assert assess(h, Thresholds()).state == "RUNNING"


@pytest.mark.parametrize(
    "text, state, reason_part",
    [
        (
            'step 5 loss 2.0\nTraceback (most recent call last):\n  File "x.py", line 1, in <module>\n'
            "RuntimeError: DataLoader worker (pid 12345) is killed by signal: Killed.\n",
            "HOST_OOM",
            "dataloader worker",
        ),
        (
            "NCCL WARN Error while creating shared memory segment /dev/shm/nccl-Ab12 (size 9637888)\n"
            "include/shm.h:28 NCCL WARN Call to posix_fallocate failed : No space left on device\n",
            "DISK_FULL",
            "--shm-size",
        ),
        (
            'step 3 loss 2\nTraceback (most recent call last):\n  File "x.py", line 1, in <module>\n'
            "RuntimeError: CUDA error: out of memory\n",
            "OOM",
            "CUDA out of memory",
        ),
        (
            'step 3 loss 2.1\nTraceback (most recent call last):\n  File "x.py", line 9, in <module>\n'
            "RuntimeError: Function 'MulBackward0' returned nan values in its 0th output.\n",
            "DIVERGED",
            "NaN/inf",
        ),
        (
            'Traceback (most recent call last):\n  File "x.py", line 9, in <module>\n'
            "RuntimeError: CUDA error: no kernel image is available for execution on the device\n",
            "CONFIG_ERROR",
            "restart repeats it",
        ),
        (
            'Traceback (most recent call last):\n  File "x.py", line 9, in <module>\n'
            "OSError: /models/Qwen3-8B does not appear to have a file named config.json.\n",
            "CONFIG_ERROR",
            "before its first step",
        ),
        (
            "{'loss': 2.1, 'epoch': 0.1}\n" + "{'loss': nan, 'grad_norm': nan, 'epoch': 0.2}\n" * 3,
            "DIVERGED",
            "non-finite",
        ),
        ("Unable to determine the device handle for GPU0000:3B:00.0: Unknown Error\n", "GPU_FAULT", "device handle"),
    ],
)
def test_more_real_shapes(text, state, reason_part):
    v = diagnose_text(text)
    assert v.state == state and reason_part in v.reason, v


def test_an_xid_in_the_hosts_kernel_log_makes_a_timeout_a_gpu_fault():
    lines = log("nccl-timeout.log").splitlines()
    xid = ["NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."]
    v = assess(
        History(started_at=0.0, now=900.0, exit_code=1, last_step=9, log_tail=lines, kernel_xid=xid), Thresholds()
    )
    assert v.state == "GPU_FAULT" and "kernel log" in v.reason and "fallen off the bus" in v.reason
    v = assess(
        History(
            started_at=0.0,
            now=900.0,
            exit_code=1,
            last_step=9,
            log_tail=lines,
            kernel_xid=["NVRM: Xid (PCI:0000:3b:00): 13, Graphics Exception"],
        ),
        Thresholds(),
    )
    assert v.state == "NCCL_TIMEOUT"  # Xid 13 is the application's own error, not the GPU's
