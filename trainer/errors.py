"""Errors with the exit codes that dflashctl (and any other tool) reads from the process status.

0 finished, 1 crash, 2 config error, 3 dense fallback refused, 4 diverged (non-finite loss or gradients)
"""

from __future__ import annotations

EXIT_FINISHED = 0
EXIT_CRASH = 1
EXIT_CONFIG = 2
EXIT_DENSE_FALLBACK = 3
EXIT_DIVERGED = 4


class ConfigError(Exception):
    """A bad config value; the message names the file and the key."""

    exit_code = EXIT_CONFIG

    def __init__(self, source: str, key: str | None, message: str) -> None:
        self.source, self.key, self.message = source, key, message
        where = f"{source}: {key}" if key else source
        super().__init__(f"{where}: {message}")


class DenseFallbackError(RuntimeError):
    """flex_attention was about to run eagerly, which materialises the full score matrix.

    Raised by the guard before any large allocation. It is never retried: the cause (recompile limit hit, compile
    disabled, a skipped frame) would repeat.
    """

    exit_code = EXIT_DENSE_FALLBACK


class DivergedError(RuntimeError):
    """The loss or the gradient norm stayed non-finite for `optim.max_nonfinite_steps` steps, or weights about to
    be saved are non-finite. `fields` go into the fatal record (first bad step, last finite loss, lr, the newest
    checkpoint from before the divergence). Never retried by default: the same data and lr diverge again."""

    exit_code = EXIT_DIVERGED

    def __init__(self, message: str, **fields) -> None:
        super().__init__(message)
        self.fields = fields


class NonFiniteWeightsError(DivergedError):
    """Weights with NaN or inf were about to be written as a checkpoint or an export: refused, nothing written."""
