"""`python -m trainer.tiny`: the entry point of trainer.data.tiny (the trainer is grouped by layer)."""

import sys

from trainer.data.tiny import main

if __name__ == "__main__":
    sys.exit(main())
