"""Entry point: `python -m trainer.train --config FILE`.

Exit codes: 0 finished, 1 crash, 2 config error, 3 dense fallback refused.
"""

from __future__ import annotations

import argparse
import sys

from trainer.errors import EXIT_CONFIG, EXIT_DENSE_FALLBACK, ConfigError, DenseFallbackError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.train", description="Train a DFlash drafter.")
    ap.add_argument("--config", required=True, help="trainer config (YAML)")
    ap.add_argument("--steps", type=int, default=None, help="override the config's step count")
    args = ap.parse_args(argv)
    try:
        from trainer.config import load_config
        from trainer.loop import train

        cfg = load_config(args.config)
        if args.steps is not None:
            cfg.steps = args.steps
        result = train(cfg, source=args.config, log=lambda s: print(s, flush=True))
        print(f"finished: {len(result.losses)} steps, final loss {result.losses[-1]:.4f}", flush=True)
        return 0
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    except DenseFallbackError as e:
        print(f"DenseFallbackError: {e}", file=sys.stderr, flush=True)
        return EXIT_DENSE_FALLBACK


if __name__ == "__main__":
    sys.exit(main())
