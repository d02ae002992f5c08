"""Issue 61: logs read through any launcher. Every row of the launchers' table strips its own real sample; the
stamps and colours each launcher adds go too; a rank is taken from a prefix that names one (SkyPilot's `rank=`, Ray's
pid through Ray Train's own worker list, a learned `rankN | `); a prefix no row knows is learned from the log itself,
and only where it names few streams (never a step counter, a log level, an exception's name)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflashctl.judge.diagnosis import diagnose_lines
from dflashctl.judge.logs import Log, strip_prefix
from dflashctl.judge.prefixes import LAUNCHERS, learn_prefix
from dflashctl.logfile import read_log

CORPUS = Path(__file__).resolve().parents[1] / "logs"


@pytest.mark.parametrize("launcher", LAUNCHERS, ids=lambda la: la.name)
def test_every_launcher_in_the_table_strips_its_own_real_sample(launcher):
    m = launcher.pattern.match(launcher.sample)
    assert m and m.end() < len(launcher.sample), launcher.sample
    stream, text = strip_prefix(launcher.sample)
    assert stream and text and text in launcher.sample


C, E = "\x1b[2m\x1b[36m", "\x1b[0m"


@pytest.mark.parametrize(
    "line, stream, text",
    [
        # Ray: the worker's prefix, coloured; the deduplication note at the end goes too
        (
            f"{C}(RayTrainWorker pid=1942, ip=100.97.252.234){E} [Worker:0] [INFO] done",
            "pid1942@100.97.252.234",
            "[Worker:0] [INFO] done",
        ),
        (
            f"{C}(RayTrainWorker pid=5522){E} step 3 loss nan \x1b[32m[repeated 3x across cluster] (Ray deduplicates logs "  # noqa: E501 - the line as the tool prints it
            f"by default. Set RAY_DEDUP_LOGS=0 to disable log deduplication, or see https://docs.ray.io/.)\x1b[0m",
            "pid5522",
            "step 3 loss nan",
        ),
        (
            "(raylet) [2026-12-05 07:31:07,882 E 47811 47811] (raylet) node_manager.cc:3069: 1 Workers (tasks / actors) "  # noqa: E501 - the line as the tool prints it
            "killed due to memory pressure (OOM)",
            "raylet",
            "node_manager.cc:3069: 1 Workers (tasks / actors) killed due to memory pressure (OOM)",
        ),
        # SkyPilot: multi-node (both orders of ip and pid), single node, setup; its own logger's stamp
        ("\x1b[36m(head, rank=0, pid=3808)\x1b[0m [1,0]<stdout>:# nThread 1", "rank0", "# nThread 1"),
        ("(worker1, rank=1, ip=10.100.10.12, pid=2769) step 1", "rank1", "step 1"),
        (
            "(worker1, rank=1, pid=2769, ip=10.100.10.12) [rank11]: Traceback (most recent call last):",
            "rank11",
            "Traceback (most recent call last):",
        ),
        ("(task, pid=7431) Running on public URL", "pid7431", "Running on public URL"),
        ("(setup pid=2383) Running setup.", "pid2383", "Running setup."),
        (
            "I 12-07 03:52:17 controller.py:281] Cluster is preempted or failed (status: STOPPED). Recovering...",
            None,
            "Cluster is preempted or failed (status: STOPPED). Recovering...",
        ),
        # kubectl logs --prefix --timestamps (RFC 3339, nanoseconds): a frame keeps its indentation
        (
            "[pod/llama-ft-worker-1/pytorch] 2026-12-04T10:12:40.118203913Z [rank3]: KeyError: 'x'",
            "rank3",
            "KeyError: 'x'",
        ),
        (
            '[pod/llama-ft-worker-1/pytorch] 2026-12-04T10:12:40.118203913Z   File "x.py", line 3',
            "pod/llama-ft-worker-1/pytorch",
            '  File "x.py", line 3',
        ),
        # torchx: `{role}/{replica} ` (green on a terminal), then torchrun's `[{role}{local_rank}]:` with an empty role
        (
            "\x1b[32mtrain/0\x1b[0m [1]:Traceback (most recent call last):",
            "rank1",
            "Traceback (most recent call last):",
        ),
        ('train/0 [1]:[rank1]:   File "x.py", line 3', "rank1", '  File "x.py", line 3'),
        ("train/0 W1204 09:58:14.101000 51877 torch/distributed/run.py:793] *****", "train/0", "*****"),
        (
            'train/0   File "/opt/venv/bin/torchrun", line 8, in <module>',
            "train/0",
            '  File "/opt/venv/bin/torchrun", line 8, in <module>',
        ),  # the agent's own traceback, no tee prefix
        # moreutils ts: its default, -s / -i, %.S, %s; syslog and journalctl share the default's shape
        ("Dec 04 10:12:40 step 3 loss 2.0", None, "step 3 loss 2.0"),
        ('Dec  4 10:12:40.123456   File "x.py", line 3', None, '  File "x.py", line 3'),
        ("00:03:12 step 3 loss 2.0", None, "step 3 loss 2.0"),
        (
            "2026-12-07 09:14:02.118203 [default1]:[rank1]: torch.OutOfMemoryError: CUDA",
            "rank1",
            "torch.OutOfMemoryError: CUDA",
        ),
        ("1796641200 step 3 loss 2.0", None, "step 3 loss 2.0"),
        # Lightning's rank prefix, dmesg -T, PowerShell's ErrorRecord of a native command's stderr
        (
            "[rank: 1] Monitored metric train_loss = tensor(nan) is not finite.",
            "rank1",
            "Monitored metric train_loss = tensor(nan) is not finite.",
        ),
        (
            "[Thu Dec  4 10:12:40 2026] Out of memory: Killed process 7102 (python3)",
            None,
            "Out of memory: Killed process 7102 (python3)",
        ),
        ("python.exe : Traceback (most recent call last):", None, "Traceback (most recent call last):"),
    ],
)
def test_each_launchers_prefix_stamps_and_colours_are_read(line, stream, text):
    assert strip_prefix(line) == (stream, text)


def test_a_process_rank_outranks_the_node_rank_that_skypilot_names():
    assert strip_prefix("(head, rank=0, pid=3808) [rank3]: x") == ("rank3", "x")
    assert strip_prefix("(worker2, rank=2, pid=3808, ip=10.0.0.3) step 1") == ("rank2", "step 1")


def test_ray_workers_are_named_by_the_rank_ray_train_gave_their_pid():
    lines = [
        "(RayTrainWorker pid=48213) Setting up process group for: env:// [rank=0, world_size=2]",
        "(TorchTrainer pid=48102) Started distributed worker processes: ",
        "(TorchTrainer pid=48102) - (node_id=f67b5f, ip=10.0.11.2, pid=48213) world_rank=0, local_rank=0, node_rank=0",
        "(TorchTrainer pid=48102) - (node_id=f67b5f, ip=10.0.11.2, pid=48214) world_rank=1, local_rank=1, node_rank=0",
        "(RayTrainWorker pid=48214) Traceback (most recent call last):",
        '(RayTrainWorker pid=48214)   File "/home/ray/proj/train_ray.py", line 88, in train_loop_per_worker',
        "(RayTrainWorker pid=48214) ValueError: bad shard",
    ]
    log = Log.of(lines)
    assert log.streams[0] == "rank0" and log.streams[-1] == "rank1"
    assert diagnose_lines(lines).reason == "ValueError on rank1"


@pytest.mark.parametrize(
    "name, words",
    [
        ("CRASHED/torchx-fsdp2-four-ranks-crash.log", "RuntimeError on rank2"),  # torchrun's root cause, under torchx
        ("CRASHED/ray-train-worker-exception-ansi.log", "RuntimeError on rank2"),  # the wrapper's pid, Ray Train's map
        ("HOST_OOM/ray-memory-monitor-task-killed.log", "killed rank3"),  # the pid Ray's memory monitor names
        ("OOM/skypilot-two-nodes-cuda-oom.log", "on rank11"),  # torchrun's rank inside SkyPilot's worker1
        ("DIVERGED/skypilot-megatron-rerun-nan-grad-norm.log", "on rank9"),
        ("RECOMPILE_LIMIT/torchx-fail-on-recompile-limit-hit.log", "on rank1"),
        ("CRASHED/docker-compose-learned-prefix.log", "on trainer-1"),  # a learned prefix names its stream
        ("HOST_OOM/journalctl-earlyoom-sigterm.log", '"python3" (pid 5123)'),
    ],
)
def test_the_rank_or_stream_a_prefix_names_is_in_the_verdict(name, words):
    v = diagnose_lines(read_log(CORPUS / name))
    assert words in v.reason, v


def _compose(n: int = 12) -> list[str]:
    lines = ["Attaching to evaluator-1, trainer-1"]
    for k in range(n):
        lines.append(f"trainer-1    | step {k} loss 2.{k}")
        lines.append(f"evaluator-1  | waiting for checkpoint step-{k}")
    return lines


def test_an_unknown_launchers_prefix_is_learned_as_the_common_leading_span():
    learned = learn_prefix(_compose())
    assert learned is not None
    assert strip_prefix("trainer-1    | step 3 loss 2.3", learned) == ("trainer-1", "step 3 loss 2.3")
    assert strip_prefix('evaluator-1  |   File "x.py", line 3', learned) == ("evaluator-1", '  File "x.py", line 3')
    tb = [
        "trainer-1    | Traceback (most recent call last):",
        'trainer-1    |   File "t.py", line 3, in <module>',
        "evaluator-1  | waiting",
        "trainer-1    | KeyError: 'x'",
    ]
    v = diagnose_lines(_compose() + tb)
    assert v.state == "CRASHED" and v.reason == "KeyError on trainer-1" and 'File "t.py", line 3' in v.evidence[1]


@pytest.mark.parametrize(
    "lines, learned",
    [
        ([f"rank{i % 4} | step {i} loss 2.0" for i in range(20)], "rank1"),  # names a rank: the rank
        ([f"[worker {i % 3}] step {i} loss 2.0" for i in range(20)], "worker 1"),
        ([f"0|drafter  | step {i} loss 2.0" for i in range(20)], None),  # pm2: the same words on every line
        ([f"Dec 07 16:0{i % 10}:51 gpu-box python3[4421]: step {i}" for i in range(20)], None),  # syslog's ident
        (
            [f"Dec 07 16:0{i % 10}:51 gpu-box python3[{4421 + i % 2}]: step {i}" for i in range(20)],
            "gpu-box python3 4422",
        ),
    ],
)
def test_a_learned_prefix_names_its_stream_where_it_varies(lines, learned):
    got = learn_prefix(lines)
    assert got is not None
    assert strip_prefix(lines[1], got)[0] == learned


@pytest.mark.parametrize(
    "lines",
    [
        [f"step {i} | loss 2.{i} | lr 1e-4" for i in range(40)],  # a counter on every line
        [f"{{'loss': 2.{i}, 'grad_norm': 0.3, 'epoch': 0.{i}}}" for i in range(30)],  # HF Trainer's dicts
        [f"{lvl}: message {i}" for i in range(10) for lvl in ("INFO", "WARNING")],  # log levels
        [f"Epoch {i // 10}: 100%|##########| 9/9 [00:01<00:00]" for i in range(30)],  # progress bars
        [f"RuntimeError: boom {i}" for i in range(30)],  # an exception's name
        ["step 1 loss 2.0", "step 2 loss 1.9"],  # too few lines to learn from
    ],
)
def test_text_is_never_taken_for_a_prefix(lines):
    assert learn_prefix(lines) is None


def test_a_learned_prefix_reads_the_finish_behind_it():
    lines = [f"trainer-1  | step {i}/2000 loss 1.7" for i in range(1990, 2000)] + [
        "trainer-1  | finished: 2000 steps from step 0",
        "trainer-1 exited with code 0",
    ]
    v = diagnose_lines(lines)
    assert v.state == "FINISHED" and v.evidence == ["finished: 2000 steps from step 0"]
