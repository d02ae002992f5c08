"""The corpus of real-shaped logs (tests/logs/<STATE>/): every state has at least two, and each is judged as its folder
says. A log alone goes through `diagnose` (the file reader, the prefixes, the newest attempt); a log with a `.json`
beside it holds what a watcher would also know (pane, exit code, stop request, Slurm's word) and goes through
`assess`. Then the behaviours of issue 40 one by one: prefixes, root causes, Slurm's ends, no false all-clear, big
files read in bounded memory."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from dflashctl.judge.assess import assess
from dflashctl.judge.decode import sniff_codec
from dflashctl.judge.diagnosis import diagnose_lines, diagnose_text
from dflashctl.judge.facts import EXIT_BY_STATE, RECORD_ONLY, History, Thresholds
from dflashctl.judge.logs import SIG, SIGNATURES, classify_log, strip_prefix
from dflashctl.logfile import LogFileError, read_log

CORPUS = Path(__file__).resolve().parents[1] / "logs"
LOGS = sorted([*CORPUS.glob("*/*.log"), *CORPUS.glob("*/*.log.gz")])  # rotated logs are gzip'd


def text_of(path: Path) -> str:
    """A corpus log's whole text: gunzipped, decoded as its BOM says (a PowerShell log is UTF-16), holes removed."""
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    codec = sniff_codec(data[:8192])
    return data.decode(codec if codec != "utf-8" else "utf-8-sig", errors="replace").replace("\0", "")


def test_every_state_has_at_least_two_logs():
    have = {state: len(list((CORPUS / state).glob("*.log"))) for state in EXIT_BY_STATE if state not in RECORD_ONLY}
    assert {s: n for s, n in have.items() if n < 2} == {}
    assert {p.parent.name for p in LOGS} <= set(EXIT_BY_STATE), "a folder that names no state"


@pytest.mark.parametrize("path", LOGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_the_corpus_is_judged_as_its_folder_says(path):
    facts = path.with_suffix(".json")
    if facts.exists():
        spec = json.loads(facts.read_text())
        lines = path.read_text().splitlines()
        v = assess(History(**spec["history"], log_tail=lines), Thresholds(**spec.get("thresholds", {})))
    else:
        v = diagnose_lines(read_log(path))
    assert v.state == path.parent.name, (v.state, v.reason, v.evidence)
    assert v.evidence, "a verdict always carries its evidence"
    if v.state not in ("FINISHED", "RUNNING", "STARTING", "PENDING", "STOPPING", "KILLED"):
        assert v.advice, "a failure says what to do next"


def test_every_signature_is_seen_in_the_corpus():
    """The table is data the corpus exercises: a signature no log shows is untested."""
    text = [strip_prefix(ln)[1] for p in LOGS for ln in text_of(p).splitlines()]
    unseen = [s.name for s in SIGNATURES if not any(s.pattern.search(ln) for ln in text)]
    assert unseen == []


@pytest.mark.parametrize(
    "line, stream, text",
    [
        ("5: Traceback (most recent call last):", "rank5", "Traceback (most recent call last):"),
        (" 12: RuntimeError: boom", "rank12", "RuntimeError: boom"),
        ("[rank3]: KeyError: 'x'", "rank3", "KeyError: 'x'"),
        ("[default1]:[rank1]: ValueError: bad", "rank1", "ValueError: bad"),
        (
            "[rank0]:[E1203 02:14:10.311872 51220 ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog",
            "rank0",
            "[Rank 0] Watchdog",
        ),
        ("2026-12-03T04:00:12.123Z 0: step 3 loss 2.0", "rank0", "step 3 loss 2.0"),
        ("[2026-12-03 04:00:12,123] torch.OutOfMemoryError: CUDA", None, "torch.OutOfMemoryError: CUDA"),
        ("W1130 18:02:18.582000 5019 torch/x.py:1028] Sending process 5025", None, "Sending process 5025"),
        ("step 3 loss 2.0", None, "step 3 loss 2.0"),
        ("[1,3]<stderr>:Traceback (most recent call last):", "rank3", "Traceback (most recent call last):"),
        ("Fri Aug 11 12:31:45 2023[1,0]<stdout>:step 1 loss 2", "rank0", "step 1 loss 2"),
        ("worker-1: [2026-12-04 10:12:41,990] [ERROR] x", "worker-1", "[ERROR] x"),
        ("localhost: Traceback (most recent call last):", "localhost", "Traceback (most recent call last):"),
        ("torch.OutOfMemoryError: CUDA out of memory.", None, "torch.OutOfMemoryError: CUDA out of memory."),
        ("srun: error: Node failure on gpu-b", None, "srun: error: Node failure on gpu-b"),
        ("py4j.protocol.Py4JJavaError: An error", None, "py4j.protocol.Py4JJavaError: An error"),
        ("boto3.exceptions.S3UploadFailedError: x", None, "boto3.exceptions.S3UploadFailedError: x"),
        ("step_1: loss 2.0", None, "step_1: loss 2.0"),
        (
            "Epoch 2:  44%|####4     | 8801/20000 [2:41:10<3:25:02,  0.91it/s]Traceback (most recent call last):",
            None,
            "Traceback (most recent call last):",
        ),
        (
            "  5%|5         | 50/1000 [00:10<03:10]\r 6%|6         | 60/1000 [00:12<03:08]\r{'train_runtime': 1.0}",
            None,
            "{'train_runtime': 1.0}",
        ),
        ('  File "x.py", line 1, in <module>', None, '  File "x.py", line 1, in <module>'),
    ],
)
def test_prefixes_are_stripped_in_one_step(line, stream, text):
    assert strip_prefix(line) == (stream, text)


def test_a_cuda_error_on_one_rank_outranks_the_timeouts_it_caused():
    v = diagnose_text((CORPUS / "CRASHED" / "srun-label-cuda-error-then-timeouts.log").read_text())
    assert v.state == "CRASHED" and "rank3" in v.reason
    assert "illegal memory access" in v.evidence[0]
    assert not any("Watchdog" in e for e in v.evidence)


def test_without_a_traceback_the_first_cuda_error_is_the_cause():
    lines = [
        "[rank2]:[E1203 02:14:09 51220 ProcessGroupNCCL.cpp:1595] [PG 0 Rank 2] Process group watchdog thread "
        "terminated with exception: CUDA error: an illegal memory access was encountered",
        "[rank0]:[E1203 02:24:10 51220 ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation "
        "timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE) ran for 600051 milliseconds before timing out.",
    ]
    v = diagnose_lines(lines)
    assert v.state == "CRASHED" and "illegal memory access was encountered on rank2" in v.reason


def test_under_torchrun_the_ranks_own_error_wins_over_childfailederror():
    """A real recording: the bundled trainer under torchrun, 2 ranks, TRAINER_FAULT=crash@3 (unprefixed output)."""
    v = diagnose_text((CORPUS / "CRASHED" / "torchrun-trainer-crash-unprefixed.log").read_text())
    assert v.state == "CRASHED" and v.reason.startswith("RuntimeError")
    assert v.evidence[0] == "RuntimeError: injected fault at step 3 (TRAINER_FAULT)"
    assert not any("ChildFailedError" in e or "torch/distributed/run.py" in e for e in v.evidence)


def test_the_watchers_verdict_on_a_torchrun_crash_names_the_ranks_error():
    lines = (CORPUS / "CRASHED" / "torchrun-trainer-crash-unprefixed.log").read_text().splitlines()
    fatal = {"event": "fatal", "kind": "crash", "message": "RuntimeError: injected fault at step 3 (TRAINER_FAULT)"}
    for tail in (lines, lines[-25:]):  # the whole log, and a tail that only holds torchrun's summary
        v = assess(
            History(started_at=0.0, now=60.0, exit_code=1, last_step=2, log_tail=tail, fatal=fatal), Thresholds()
        )
        assert v.state == "CRASHED" and "RuntimeError" in v.reason, v
        assert any("injected fault at step 3" in e for e in v.evidence)


@pytest.mark.parametrize(
    "end, state",
    [
        ("slurmstepd: error: *** JOB 9 ON n1 CANCELLED AT 2026-12-03T04:00:12 DUE TO TIME LIMIT ***", "TIMEOUT"),
        ("slurmstepd: error: *** STEP 9.0 ON n1 CANCELLED AT 2026-12-03T04:00:12 DUE TO PREEMPTION ***", "PREEMPTED"),
        (
            "slurmstepd: error: *** JOB 9 ON n1 CANCELLED AT 2026-12-03T04:00:12 DUE TO NODE FAILURE, SEE SLURMCTLD LOG "  # noqa: E501 - the line as the tool prints it
            "FOR DETAILS ***",
            "NODE_FAIL",
        ),
        ("srun: error: Node failure on n2", "NODE_FAIL"),
        ("slurmstepd: error: *** JOB 9 ON n1 CANCELLED AT 2026-12-03T04:00:12 ***", "CANCELLED"),
    ],
)
def test_slurms_own_ends_outrank_the_sigterm_tracebacks_after_them(end, state):
    sigterm = [
        "0: Traceback (most recent call last):",
        '0:   File "/opt/venv/bin/torchrun", line 8, in <module>',
        "0: torch.distributed.elastic.multiprocessing.api.SignalException: Process 9 got signal: 15",
        "srun: error: n1: task 0: Exited with exit code 1",
    ]
    v = diagnose_lines(["0: step 1 loss 2.0", end, *sigterm])
    assert v.state == state and end in v.evidence


def test_a_rank_that_failed_before_the_time_limit_is_the_cause():
    lines = [
        "1: Traceback (most recent call last):",
        '1:   File "t.py", line 3, in <module>',
        "1: ValueError: bad shard",
        "slurmstepd: error: *** JOB 9 ON n1 CANCELLED AT 2026-12-03T04:00:12 DUE TO TIME LIMIT ***",
    ]
    v = diagnose_lines(lines)
    assert v.state == "CRASHED" and v.reason == "ValueError on rank1"


def test_srun_task_exit_alone_is_a_crash_of_that_task():
    v = diagnose_lines(["0: step 1 loss 2.0", "srun: error: n1: task 3: Exited with exit code 2"])
    assert v.state == "CRASHED" and "task 3" in v.reason


def test_dense_attention_under_any_name_with_its_allocation():
    v = diagnose_text((CORPUS / "DENSE_FALLBACK" / "sdpa-math-oom.log").read_text())
    assert v.state == "DENSE_FALLBACK" and "SDPA's math kernel" in v.reason and "96.00 GiB" in v.reason
    assert "fused kernel" in v.advice and "flex_attention ran" not in v.advice
    v = diagnose_text((CORPUS / "DENSE_FALLBACK" / "eager-attention-oom.log").read_text())
    assert v.state == "DENSE_FALLBACK" and "eager attention" in v.reason and "32.00 GiB" in v.reason
    # SDPA's fused kernels running out of memory on a small allocation is an ordinary OOM
    small = (CORPUS / "DENSE_FALLBACK" / "sdpa-math-oom.log").read_text().splitlines()
    small = [ln.replace("96.00 GiB", "0.50 GiB") for ln in small if "kernel not used" not in ln]
    assert diagnose_lines(small).state == "OOM"


def test_the_newest_attempt_decides():
    v = diagnose_text((CORPUS / "FINISHED" / "second-attempt-finishes.log").read_text())
    assert v.state == "FINISHED"
    flipped = [
        "[dflashctl] 2026-12-03T10:00:00Z start ",
        "finished: 3 steps from step 0",
        "[dflashctl] 2026-12-03T10:01:00Z exit 0",
        "[dflashctl] 2026-12-03T10:02:00Z start --resume",
        "Traceback (most recent call last):",
        '  File "t.py", line 1, in <module>',
        "KeyError: 'x'",
    ]
    assert diagnose_lines(flipped).state == "CRASHED"


@pytest.mark.parametrize(
    "lines",
    [
        ["step 1 loss 3.0", "step 2 loss 2.9"],  # cut off
        ["0: preflight: compiling bucket 1024"],  # prefixed, still starting
        ["hello"],
    ],
)
def test_no_failure_and_no_normal_end_is_not_a_success(lines):
    v = diagnose_lines(lines)
    assert v.state == "INCOMPLETE" and EXIT_BY_STATE[v.state] != 0
    assert "last line" in v.evidence[-1]


def test_an_exit_line_without_a_signature_still_decides():
    assert diagnose_lines(["step 1 loss 2", "[dflashctl] 2026-12-03T10:01:00Z exit 7"]).state == "CRASHED"
    assert diagnose_lines(["step 1 loss 2", "[dflashctl] 2026-12-03T10:01:00Z exit 137"]).state == "HOST_OOM"


def test_a_log_on_stdin_is_refused_as_a_file_would_be():
    from dflashctl.logfile import lines_of

    assert lines_of(b"step 1 loss 2\r\nstep 2 loss 1.9\n") == ["step 1 loss 2", "step 2 loss 1.9"]
    for data, words in (
        (b"", "empty"),
        (b" \n\n", "empty"),
        (b"PK\x03\x04" + bytes(range(256)) * 40, "binary"),
        (b"step 1 loss 2\n" * 1000 + bytes(range(1, 256)) * 40, "binary"),
    ):
        with pytest.raises(LogFileError, match=words):
            lines_of(data)


def test_empty_binary_and_missing_files_are_refused(tmp_path):
    (tmp_path / "empty.log").write_bytes(b"")
    (tmp_path / "ckpt.pt").write_bytes(b"PK\x03\x04" + bytes(range(256)) * 40)
    for name, words in (("empty.log", "empty"), ("ckpt.pt", "binary"), ("absent.log", "cannot read")):
        with pytest.raises(LogFileError, match=words):
            read_log(tmp_path / name)


def _big_log(path: Path, mb: int, tail: list[str], middle: list[str] = ()) -> None:
    step = "step {}/2000000 epoch 0 loss 2.3011 acc 0.512 lr 5.97e-04 grad_norm 0.402 62,140 tok/s peak 58.1 GiB\n"
    with path.open("w") as f:
        f.write("[dflashctl] 2026-12-01T00:00:00Z start \n")
        i = 0
        while f.tell() < mb << 20:
            i += 1
            f.write(step.format(i))
            if i == 100_000:
                f.write("".join(ln + "\n" for ln in middle))
        f.write("".join(ln + "\n" for ln in tail))


def test_a_big_log_is_read_in_bounded_memory_and_judged_as_a_whole(tmp_path):
    """60 MB: the middle's recompile-limit warning and the tail's OOM through flex make the chain (DENSE_FALLBACK),
    and the reader keeps a bounded slice of the file in memory, whatever its size."""
    middle = [
        "W1130 18:02:10.258000 4976 torch/_dynamo/convert_frame.py:1358] [0/2] torch._dynamo hit "
        "config.recompile_limit (2)",
        "W1130 18:02:10.258000 4976 torch/_dynamo/convert_frame.py:1358] [0/2]"
        "    function: 'flex' (/home/user/proj/trainer/model/attention.py:40)",
    ]
    tail = [
        "Traceback (most recent call last):",
        '  File "/opt/venv/lib/torch/_tensor.py", line 631, in backward',
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 46.00 GiB. GPU 0 has a total capacity of "
        "139.80 GiB of which 1.05 GiB is free.",
    ]
    path = tmp_path / "train.log"
    _big_log(path, 60, tail, middle)
    tracemalloc.start()
    lines = read_log(path)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 64 << 20, f"peak {peak / 2**20:.0f} MiB"
    assert len(lines) < 40_000
    found = classify_log(lines)
    assert found.state == "DENSE_FALLBACK" and "recompile limit" in found.reason


def test_a_big_logs_newest_attempt_is_found_from_the_tail(tmp_path):
    path = tmp_path / "train.log"
    _big_log(
        path,
        20,
        [
            "[dflashctl] 2026-12-01T05:00:00Z start --resume",
            "step 5 loss 2.0",
            "finished: 5 steps from step 0",
            "[dflashctl] 2026-12-01T05:01:00Z exit 0",
        ],
        ["Traceback (most recent call last):", '  File "t.py", line 1, in <module>', "KeyError: 'x'"],
    )
    lines = read_log(path)
    assert lines[0].startswith("[dflashctl] 2026-12-01T05:00:00Z start") and len(lines) == 4
    assert diagnose_lines(lines).state == "FINISHED"


def test_the_cli_reads_files_and_stdin_and_refuses_what_is_not_a_log(tmp_path):
    from tests.conftest import run_cli

    r = run_cli("diagnose", "--json", str(CORPUS / "TIMEOUT" / "slurm-time-limit-sigterm.log"))
    out = json.loads(r.stdout)
    assert r.code == EXIT_BY_STATE["TIMEOUT"] == out["exit"] and out["state"] == "TIMEOUT"
    assert set(out) == {"state", "reason", "evidence", "advice", "exit"}
    r = run_cli("diagnose", str(CORPUS / "INCOMPLETE" / "cut-off-mid-run.log"))
    assert r.code == EXIT_BY_STATE["INCOMPLETE"] and "INCOMPLETE" in r.stdout
    (tmp_path / "empty.log").write_text("")
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}\x00\x00" * 100)
    for name, words in (("empty.log", "is empty"), ("model.safetensors", "binary"), ("nope.log", "cannot read")):
        r = run_cli("diagnose", str(tmp_path / name))
        assert r.code == 2 and words in r.stderr and name in r.stderr, r
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


# Issue 51: the watchdog's last words are an echo, other launchers' exits are read, a caught error is no failure


def _lines(state: str, name: str) -> list[str]:
    return text_of(CORPUS / state / name).splitlines()


@pytest.mark.parametrize("name", ["watchdog-abort-torchrun.log", "watchdog-abort-deepspeed.log"])
def test_the_watchdogs_abort_is_the_consequence_of_the_timeout_and_alone_a_crash(name):
    lines = _lines("NCCL_TIMEOUT", name)
    v = diagnose_lines(lines)
    assert v.state == "NCCL_TIMEOUT" and "consequence" in v.reason, v
    assert "Watchdog caught collective operation timeout" in v.evidence[0]
    # with no collective cause in the log, the same abort is the rank's own crash (`fatal_signal` stays)
    alone = [ln for ln in lines if not SIG["nccl_timeout"].pattern.search(strip_prefix(ln)[1])]
    v = diagnose_lines(alone)
    assert v.state == "CRASHED" and "DistBackendError" in v.reason, v


def test_a_ranks_own_abort_outranks_the_timeouts_it_caused():
    """A rank that threw something else (std::bad_alloc) is the root cause; the others' watchdogs time out after."""
    lines = [
        "[rank2]:terminate called after throwing an instance of 'std::bad_alloc'",
        "[rank2]:  what():  std::bad_alloc",
        *_lines("NCCL_TIMEOUT", "watchdog-abort-torchrun.log"),
    ]
    v = diagnose_lines(lines)
    assert v.state == "CRASHED" and "std::bad_alloc" in v.reason and "rank2" in v.reason, v


def test_a_node_failure_outranks_the_watchdogs_aborts_before_its_line():
    v = diagnose_lines(_lines("NODE_FAIL", "node-failure-watchdog-abort.log"))
    assert v.state == "NODE_FAIL" and any("NODE FAILURE" in e or "Node failure" in e for e in v.evidence)


@pytest.mark.parametrize(
    "line",
    [
        "[2026-12-04 08:03:11,502] [ERROR] [launch.py:325:sigkill_handler] ['/usr/bin/python3', '-u', 'train.py', "
        "'--local_rank=1'] exits with return code = -9",
        "INFO: [rank: 1] Child process with PID 9487 terminated with code -9. Forcefully terminating all other "
        "processes to avoid zombies 🧟",
        "mpirun noticed that process rank 2 with PID 0 on node gpu-c exited on signal 9 (Killed).",
        "prterun noticed that process rank 2 with PID 0 on node gpu-c exited on signal 9 (Killed).",
        "pdsh@worker-0: worker-1: ssh exited with exit code 137",
        "subprocess.CalledProcessError: Command '['/usr/bin/python3', 'train.py']' died with <Signals.SIGKILL: 9>.",
        "torch.multiprocessing.spawn.ProcessExitedException: process 1 terminated with signal SIGKILL",
    ],
)
def test_every_launchers_kill_reads_as_torchruns_exitcode_minus_9(line):
    v = diagnose_lines(["step 10 loss 2.0", line])
    assert v.state == "HOST_OOM" and "likely" in v.reason, v
    assert "signal 9" in v.advice and "dmesg" in v.advice  # unconfirmed: how to confirm, and what else sends it
    kernel = "[Thu Dec  4 10:12:40 2026] Out of memory: Killed process 7102 (python3) total-vm:412388212kB"
    v = diagnose_lines(["step 10 loss 2.0", kernel, line])
    assert v.state == "HOST_OOM" and "confirmed by the kernel log" in v.reason
    assert kernel.split("] ")[1] in v.evidence[0]


@pytest.mark.parametrize(
    "line, words",
    [
        ("[ERROR] [launch.py:325:sigkill_handler] ['python3', 'train.py'] exits with return code = -11", "-11"),
        (
            "mpirun noticed that process rank 1 with PID 31002 on node gpu-a exited on signal 11 (Segmentation fault).",
            "signal 11",
        ),
        (
            "[rank: 1] Child process with PID 9487 terminated with code 1. Forcefully terminating all other processes",
            "rank1 exited with code 1",
        ),
        (
            "[ERROR] [launch.py:325:sigkill_handler] ['python3', 'train.py'] exits with return code = 2",
            "exited with code 2",
        ),
        ("pdsh@worker-0: worker-1: ssh exited with exit code 1", "worker-1 exited with code 1"),
    ],
)
def test_a_launchers_other_exits_are_crashes_named_by_the_launcher(line, words):
    v = diagnose_lines(["step 10 loss 2.0", line, "Killed"])  # the launcher's own clean-up kill is no OOM
    assert v.state == "CRASHED" and words in v.reason, v


def test_lightnings_clean_up_kill_after_an_abort_is_not_a_host_oom():
    v = diagnose_lines(_lines("NCCL_TIMEOUT", "lightning-watchdog-hang.log"))
    assert v.state == "NCCL_TIMEOUT", v


@pytest.mark.parametrize(
    "name",
    [
        "hf-trainer-eval-oom-retried.log",
        "lightning-max-steps-after-skipped-oom.log",
        "trainer-finished-after-retried-checkpoint.log",
    ],
)
def test_a_failure_the_run_outlived_is_a_warning_not_the_verdict(name):
    lines = _lines("FINISHED", name)
    v = diagnose_lines(lines)
    assert v.state == "FINISHED" and any(e.startswith("warning: the run outlived a failure") for e in v.evidence), v
    # a failure after the finish line, or a non-zero exit status, and the run did not end normally
    failing = [*lines, "Traceback (most recent call last):", '  File "t.py", line 1, in <module>', "KeyError: 'x'"]
    assert diagnose_lines(failing).state not in ("FINISHED", "INCOMPLETE")
    assert diagnose_lines([*lines, "[dflashctl] 2026-12-04T03:10:02Z exit 1"]).state not in ("FINISHED", "INCOMPLETE")


@pytest.mark.parametrize("name", ["socket-reset-torchrun.log", "ib-completion-error-srun.log"])
def test_a_broken_network_is_nccl_error_below_a_ranks_own_failure(name):
    lines = _lines("NCCL_ERROR", name)
    v = diagnose_lines(lines)
    assert v.state == "NCCL_ERROR" and EXIT_BY_STATE["NCCL_ERROR"] == 31 and "broke" in v.reason, v
    assert "interconnect" in v.advice
    oom = [
        "[rank1]:torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total "
        "capacity of 79.19 GiB of which 1.00 GiB is free."
    ]
    assert diagnose_lines([*oom, *lines]).state == "OOM"  # the peer that died first is the cause


@pytest.mark.parametrize(
    "noise",
    [
        "wandb: Network error (ConnectionError), entering retry loop. ('Connection aborted.', ConnectionResetError("
        "104, 'Connection reset by peer'))",
        "WARNING:huggingface_hub.utils._http:Retrying in 1s [Retry 1/5]: Connection reset by peer",
    ],
)
def test_a_reset_connection_outside_the_collectives_is_not_a_network_failure_between_ranks(noise):
    assert diagnose_lines(["step 1 loss 2.0", noise, "step 2 loss 1.9"]).state == "INCOMPLETE"


@pytest.mark.parametrize(
    "name, rank, frame",
    [
        ("cut-mid-traceback-torchrun.log", "rank2", 'shards.py", line 97'),
        ("cut-mid-traceback-srun.log", "rank1", 'attention.py", line 118'),
    ],
)
def test_a_log_cut_mid_traceback_names_the_rank_and_the_last_frame(name, rank, frame):
    v = diagnose_lines(_lines("INCOMPLETE", name))
    assert v.state == "INCOMPLETE" and "inside a traceback" in v.reason
    said = next(e for e in v.evidence if e.startswith("a traceback cut short"))
    assert f"on {rank}" in said and frame in said, v.evidence


def test_a_gzipped_log_is_read_as_the_same_log_in_bounded_memory(tmp_path):
    tail = [
        "[2026-12-04 08:03:11,502] [ERROR] [launch.py:325:sigkill_handler] ['python3', 'train.py'] exits with "
        "return code = -9"
    ]
    path = tmp_path / "train.log"
    _big_log(path, 20, tail, ["Traceback (most recent call last):", '  File "t.py", line 1, in f', "KeyError: 'x'"])
    packed = tmp_path / "train.log.1.gz"
    with gzip.open(packed, "wb", compresslevel=1) as f:
        f.write(path.read_bytes())
    tracemalloc.start()
    lines = read_log(packed)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 64 << 20, f"peak {peak / 2**20:.0f} MiB"
    assert lines == read_log(path) and "KeyError: 'x'" in lines
    assert diagnose_lines(lines).state == "HOST_OOM"


def test_gzip_on_stdin_and_broken_gzip_files(tmp_path):
    from tests.conftest import run_cli

    packed = CORPUS / "NCCL_ERROR" / "mpirun-socket-closed.log.gz"
    r = subprocess.run(
        [sys.executable, "-m", "dflashctl", "diagnose", "--json", "-"],
        input=packed.read_bytes(),
        capture_output=True,
        timeout=120,
    )
    assert r.returncode == 31 and json.loads(r.stdout)["state"] == "NCCL_ERROR", r
    (tmp_path / "cut.log.gz").write_bytes(packed.read_bytes()[:200])  # a rotation copied halfway
    (tmp_path / "fake.log.gz").write_bytes(b"\x1f\x8b" + b"not gzip at all" * 50)
    (tmp_path / "zip-of-binary.gz").write_bytes(gzip.compress(bytes(range(256)) * 100))
    for name, words in (("cut.log.gz", "gzip"), ("fake.log.gz", "gzip"), ("zip-of-binary.gz", "binary")):
        r = run_cli("diagnose", str(tmp_path / name))
        assert r.code == 2 and words in r.stderr and name in r.stderr, r
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_an_exception_python_ignored_at_exit_does_not_undo_a_finish():
    lines = [
        *_lines("FINISHED", "hf-trainer-eval-oom-retried.log"),
        "Exception ignored in: <function _MultiProcessingDataLoaderIter.__del__ at 0x7f3a1b642520>",
        "Traceback (most recent call last):",
        '  File "/opt/venv/lib/python3.12/site-packages/torch/utils/data/dataloader.py", line 1618, in __del__',
        "    self._shutdown_workers()",
        "AttributeError: '_MultiProcessingDataLoaderIter' object has no attribute '_workers_status'",
    ]
    assert diagnose_lines(lines).state == "FINISHED"
    assert diagnose_lines([ln for ln in lines if not ln.startswith("Exception ignored")]).state != "FINISHED"


def test_a_divergence_that_lasts_to_the_finish_line_is_not_outlived():
    lines = [
        *_lines("DIVERGED", "hf-trainer-nan-tail.log"),
        "{'train_runtime': 812.1, 'train_samples_per_second': 9.8, 'train_loss': nan, 'epoch': 1.0}",
    ]
    assert diagnose_lines(lines).state == "DIVERGED"


def test_a_lost_peer_the_watchdog_aborted_on_is_a_broken_link_and_a_plain_abort_stays_a_crash():
    aborted = [
        "[rank0]: step 5 loss 2",
        "[rank1]:[E1204 10:02:44.1 7 ProcessGroupNCCL.cpp:1595] [PG ID 0 PG GUID "
        "0(default_pg) Rank 1] NCCL communicator was aborted on rank 1.",
        "[rank1]:terminate called after throwing an instance of 'c10::DistBackendError'",
        "[rank1]:  what():  [PG ID 0 PG GUID 0(default_pg) Rank 1] NCCL communicator was aborted on rank 1.",
        "  exitcode  : -6 (pid: 60228)",
    ]
    assert diagnose_lines(aborted).state == "NCCL_ERROR"
    # a broken pipe and an abort with no collective layer in sight: the process's own crash, as before
    assert (
        diagnose_lines(["step 1 loss 2", "BrokenPipeError: [Errno 32] Broken pipe", "Aborted (core dumped)"]).state
        == "CRASHED"
    )
