"""Output: results on stdout (tables for people, compact JSON for scripts), everything else on stderr."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def neutralise(text: str) -> str:
    """Text from a job's log made safe for a terminal: escape sequences and control characters are shown, not
    obeyed (a log must not move the cursor, retitle the window or hide lines). Newlines and tabs stay."""
    return CONTROL.sub(lambda m: f"\\x{ord(m[0]):02x}", text)


def print_json(obj: object) -> None:
    sys.stdout.write(json.dumps(obj, separators=(",", ":"), default=str) + "\n")
    sys.stdout.flush()


@contextmanager
def byte_progress(label: str, enabled: bool = True) -> Iterator[Callable[[int], Callable[[int], None]]]:
    """A factory: given a total size, returns the tick function for a progress bar on stderr.

    The bar appears only on a terminal and only for transfers worth showing (over 1 MiB).
    """
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn  # only a transfer draws one

    show = enabled and err.is_terminal
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=err,
        transient=True,
        disable=not show,
    ) as bar:

        def start(total: int) -> Callable[[int], None]:
            task = bar.add_task(label, total=total, visible=total > (1 << 20))
            return lambda n: bar.advance(task, n)

        yield start
