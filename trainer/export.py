"""`python -m trainer.export`: the entry point of trainer.serve.export (the trainer is grouped by layer)."""

import sys

from trainer.serve.export import main

if __name__ == "__main__":
    sys.exit(main())
