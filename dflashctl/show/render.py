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


def fit_table(title: str, cols: tuple[str, ...], rows: list[tuple[str, ...]], wide: bool = False, keep_min: int = 3):
    """A table that fits the terminal as `docker ps` does: the rightmost columns are dropped (never fewer than
    `keep_min`) until it fits, and no cell wraps. Returns the table and the columns left out."""
    from rich.table import Table

    keep = len(cols)
    if not wide:
        widths = [max([len(c)] + [len(r[i]) for r in rows]) + 3 for i, c in enumerate(cols)]
        while keep > keep_min and sum(widths[:keep]) > out.width:
            keep -= 1
    table = Table(title=title, title_justify="left")
    for col in cols[:keep]:
        table.add_column(col, no_wrap=True, overflow="ellipsis")
    for r in rows:
        table.add_row(*r[:keep])
    return table, cols[keep:]


def show_table(title: str, cols: tuple[str, ...], rows: list[tuple[str, ...]], wide: bool = False) -> None:
    """Rows for people on a terminal (fitted, the columns left out said on stderr), or one tab-separated line per row
    with every column for a pipe or a file."""
    if not out.is_terminal:
        for r in rows:
            sys.stdout.write("\t".join(r) + "\n")
        return
    table, dropped = fit_table(title, cols, rows, wide)
    out.print(table)
    if dropped:
        err.print(f"({', '.join(dropped)} left out at {out.width} columns: --wide shows them)")


def show_lines(lines: list[str], to_err: bool = False) -> None:
    """Sentences of a result, as they are (no markup read into job text)."""
    console = err if to_err else out
    for line in lines:
        console.print(line, markup=False, highlight=False)


def ago(seconds: float) -> str:
    s = int(max(0, seconds))
    return f"{s}s ago" if s < 60 else (f"{s // 60}m ago" if s < 3600 else f"{s // 3600}h ago")
