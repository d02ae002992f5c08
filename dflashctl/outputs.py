"""What dflashctl itself writes into a project (pulled runs, report files) is never project code.

Each such path is listed, relative to the project's root, in `ROOT/.dflashctl-outputs` (one per line). Deploy leaves
every listed path (and the list) out of the release and out of the staleness check, unless git tracks it: a file
the user committed is theirs. Outside the project nothing is listed: nothing there is deployed anyway.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

LIST_NAME = ".dflashctl-outputs"


def _relative(root: Path, path: Path) -> str | None:
    try:
        rel = Path(os.path.abspath(path)).relative_to(Path(os.path.abspath(root)))
    except ValueError:
        return None
    return None if rel == Path(".") else rel.as_posix()


def listed(root: Path) -> set[str]:
    try:
        text = (root / LIST_NAME).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return set()
    return {ln.strip().strip("/") for ln in text.splitlines() if ln.strip() and not ln.startswith("#")}


def remember(root: Path, path: Path) -> bool:
    """List `path` as dflashctl's own output when it lies inside the project; True when it does."""
    rel = _relative(root, path)
    if rel is None:
        return False
    have = listed(root)
    if rel not in have:
        with open(root / LIST_NAME, "a", encoding="utf-8") as f:
            if not have:
                f.write("# written by dflashctl (pull, report): never deployed\n")
            f.write(rel + "\n")
    return True


def is_output(rel: str, outputs: set[str]) -> bool:
    """`rel` (a project-relative POSIX path) is the list itself, a listed file, or inside a listed folder."""
    if rel == LIST_NAME:
        return True
    if not outputs:  # the common case, asked once per untracked file: no path objects made
        return False
    parts = PurePosixPath(rel).parts
    return any("/".join(parts[:i]) in outputs for i in range(1, len(parts) + 1))
