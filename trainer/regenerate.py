"""`python -m trainer.regenerate`: the entry point of trainer.data.regenerate (the trainer is grouped by layer)."""

import sys

from trainer.data.regenerate import main

if __name__ == "__main__":
    sys.exit(main())
