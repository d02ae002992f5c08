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
        with _append(root / LIST_NAME) as f:
            if not have:
                f.write("# written by dflashctl (pull, report): never deployed\n")
            f.write(rel + "\n")
    _git_exclude(root, [LIST_NAME, rel])
    return True


def _append(path: Path):
    """Append to `path`, never through a symlink planted in its place."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    return os.fdopen(fd, "a", encoding="utf-8")


def _git_exclude(root: Path, rels: list[str]) -> None:
    """In a git checkout, what dflashctl wrote is also listed in `.git/info/exclude` (the checkout's own, never
    committed): `git status` stays clean after a pull or a report, and the user's .gitignore is left alone."""
    info = root / ".git" / "info"
    if not (root / ".git").is_dir():
        return
    try:
        info.mkdir(exist_ok=True)
        path = info / "exclude"
        have = set(path.read_text(encoding="utf-8", errors="replace").splitlines()) if path.is_file() else set()
        new = [f"/{r}" for r in rels if f"/{r}" not in have]
        if new:
            with _append(path) as f:
                f.write("".join(f"{line}\n" for line in new))
    except OSError:
        pass  # a read-only checkout: the list above still keeps deploy from shipping these


def is_output(rel: str, outputs: set[str]) -> bool:
    """`rel` (a project-relative POSIX path) is the list itself, a listed file, or inside a listed folder."""
    if rel == LIST_NAME:
        return True
    if not outputs:  # the common case, asked once per untracked file: no path objects made
        return False
    parts = PurePosixPath(rel).parts
    return any("/".join(parts[:i]) in outputs for i in range(1, len(parts) + 1))
