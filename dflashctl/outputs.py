"""What dflashctl itself writes into a project (pulled runs, report files) is never project code.

Each such path is listed, relative to the project's root, one per line: in a git checkout in `.git/dflashctl-outputs`
(git's own folder, which nothing commits or deploys: the user's .gitignore and .git/info/exclude are never changed),
elsewhere in `ROOT/.dflashctl-outputs`. Deploy leaves every listed path (and the list) out of the release and out of
the staleness check, unless git tracks it: a file the user committed is theirs. Outside the project nothing is
listed: nothing there is deployed anyway.
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


def list_path(root: Path) -> Path:
    """Where the list lives: inside `.git/` in a git checkout, else at the project's root."""
    git = root / ".git"
    return git / LIST_NAME.lstrip(".") if git.is_dir() and not git.is_symlink() else root / LIST_NAME


def listed(root: Path) -> set[str]:
    found: set[str] = set()
    for path in {list_path(root), root / LIST_NAME}:  # a list written before the checkout became one counts too
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        found |= {ln.strip().strip("/") for ln in text.splitlines() if ln.strip() and not ln.startswith("#")}
    return found


def remember(root: Path, path: Path) -> bool:
    """List `path` as dflashctl's own output when it lies inside the project; True when it does."""
    rel = _relative(root, path)
    if rel is None:
        return False
    have = listed(root)
    if rel not in have:
        path = list_path(root)
        fresh = not path.exists()
        with _append(path) as f:
            if fresh:
                f.write("# written by dflashctl (pull, report): never deployed\n")
            f.write(rel + "\n")
    return True


def _append(path: Path):
    """Append to `path`, never through a symlink planted in its place."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    return os.fdopen(fd, "a", encoding="utf-8")


def is_output(rel: str, outputs: set[str]) -> bool:
    """`rel` (a project-relative POSIX path) is the list itself, a listed file, or inside a listed folder."""
    if rel == LIST_NAME:
        return True
    if not outputs:  # the common case, asked once per untracked file: no path objects made
        return False
    parts = PurePosixPath(rel).parts
    return any("/".join(parts[:i]) in outputs for i in range(1, len(parts) + 1))
