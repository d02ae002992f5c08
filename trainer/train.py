"""Entry point: `[torchrun --nproc-per-node N] python -m trainer.train --config FILE [--run-dir DIR] [--resume]`.

Exit codes: 0 finished, 1 crash, 2 config error, 3 dense fallback refused, 4 diverged (NaN/inf loss or weights).
With a run dir, a failure also appends a
`fatal` record to `metrics.jsonl` (docs/metrics.md), so a watcher need not parse the log to know what happened.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import traceback
from pathlib import Path

from trainer.errors import (
    EXIT_CONFIG,
    EXIT_CRASH,
    EXIT_DENSE_FALLBACK,
    EXIT_DIVERGED,
    ConfigError,
    DenseFallbackError,
    DivergedError,
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.train", description="Train a DFlash drafter.")
    ap.add_argument("--config", required=True, help="trainer config (YAML)")
    ap.add_argument("--run-dir", default=None, help="where metrics.jsonl, heartbeat and checkpoints go")
    ap.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in the run dir")
    ap.add_argument("--steps", type=int, default=None, help="override the config's step count")
    args = ap.parse_args(argv)
    run_dir = Path(args.run_dir) if args.run_dir else None
    rank = os.environ.get("RANK", "0")

    def fatal(kind: str, message: str, **fields) -> None:
        if run_dir is None:
            return
        from trainer.run.metrics import MetricsWriter

        MetricsWriter(run_dir, True).event("fatal", always=True, kind=kind, message=message, rank=int(rank), **fields)

    world, finished = None, False
    try:
        if run_dir:
            run_dir.mkdir(parents=True, exist_ok=True)
        from trainer.config import check_device_supports, load_config

        cfg = load_config(args.config)  # before torch is imported: a bad config is refused in a fraction of a second
        if cfg.device == "cpu":  # so is what a CPU cannot train with, where the file says cpu (auto: known later)
            check_device_supports(cfg, "cpu", args.config)
        from trainer.run.distributed import init_world
        from trainer.run.training import train

        if args.steps is not None:
            cfg.steps = args.steps
        world = init_world(cfg.device)
        from trainer.run.kernel_cache import use_host_kernel_cache

        use_host_kernel_cache(world.device)  # before the build starts the compile workers
        log = functools.partial(print, flush=True)  # each line flushed: the pane and the watcher see it at once
        result = train(cfg, args.config, run_dir=run_dir, resume=args.resume, log=log, world=world)
        finished = True
        if world.is_main:
            done = len(result.losses)
            last = f", final loss {result.losses[-1]:.4f}" if result.losses else ""
            print(f"finished: {done} steps from step {result.start_step}{last}", flush=True)
        return 0
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        fatal("config", str(e))
        return EXIT_CONFIG
    except DivergedError as e:
        print(f"DivergedError: {e}", file=sys.stderr, flush=True)
        if rank == "0":
            fatal("diverged", str(e), **e.fields)
        return EXIT_DIVERGED
    except DenseFallbackError as e:
        print(f"DenseFallbackError: {e}", file=sys.stderr, flush=True)
        fatal("dense_fallback", str(e))
        return EXIT_DENSE_FALLBACK
    except Exception as e:  # a crash: the traceback goes to the log, one line to the metrics
        traceback.print_exc()
        sys.stderr.flush()
        fatal("crash", f"{type(e).__name__}: {e}")
        return EXIT_CRASH
    finally:
        if world is not None:
            from trainer.run.distributed import shutdown

            shutdown(world, together=finished)


if __name__ == "__main__":
    from trainer.run.process_exit import end_process

    end_process(main())
