"""`python -m trainer.bench_tau`: the entry point of trainer.serve.bench_tau (the trainer is grouped by layer)."""

import sys

from trainer.serve.bench_tau import main

if __name__ == "__main__":
    sys.exit(main())
