"""A rank ends flushed, with its own exit code, and skips the interpreter's teardown, where a gloo worker thread can
abort a finished run (trainer/run/process_exit.py says how). A process alone exits as usual."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import run_two_ranks

ROOT = Path(__file__).resolve().parents[2]

WORKER = """
import atexit, sys
sys.path.insert(0, sys.argv[1])
import torch
from trainer.run.distributed import all_reduce_sum, init_world, shutdown
from trainer.run.process_exit import end_process

world = init_world("cpu")
atexit.register(lambda: print(f"rank {world.rank} teardown ran", flush=True))
total = all_reduce_sum(torch.ones(4), world)
print(f"rank {world.rank} sum {int(total[0])}")  # not flushed: stdout is a pipe, so this sits in a buffer
shutdown(world)
end_process(3)
"""


def test_a_rank_ends_flushed_with_its_code_and_without_the_teardown(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    proc = run_two_ranks(script, str(ROOT), cwd=tmp_path, timeout=300)
    assert "rank 0 sum 2" in proc.stdout and "rank 1 sum 2" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "teardown ran" not in proc.stdout
    assert proc.returncode != 0 and "exitcode  : 3" in proc.stderr, proc.stderr[-2000:]  # torchrun's report per rank
    assert "exitcode  : -" not in proc.stderr, proc.stderr[-2000:]  # no rank ended by a signal


def test_a_process_alone_exits_as_usual():
    code = (
        f"import atexit, sys; sys.path.insert(0, {str(ROOT)!r}); from trainer.run.process_exit import end_process;"
        " atexit.register(lambda: print('teardown ran')); end_process(5)"
    )
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    for world_size in (None, "1", "garbage"):
        extra = {"WORLD_SIZE": world_size} if world_size else {}
        proc = subprocess.run(
            [sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True, timeout=60
        )
        assert (proc.returncode, proc.stdout) == (5, "teardown ran\n"), (world_size, proc.stderr)
