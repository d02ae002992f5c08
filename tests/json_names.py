"""The field names docs/cli-json.md documents for a command's `--json` (the one report's, plus the command's own)."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "cli-json.md"
REPORT = "The one report"


def _section(title: str) -> set[str]:
    text = DOC.read_text()
    heads = re.finditer(r"^## (.*)$", text, re.M)
    start = next(m.end() for m in heads if m.group(1) == title or (title == REPORT and m.group(1).startswith(title)))
    end = text.find("\n## ", start)
    body = text[start : end if end >= 0 else len(text)]
    names: set[str] = set()
    for row in re.findall(r"^\| (.+?) \|", body, re.M):
        names |= set(re.findall(r"`([a-z_]+)`", row))
    return names


def json_names(command: str) -> set[str]:
    """Every name `command --json` may print."""
    own = _section(f"`{command}`")
    return own | (_section(REPORT) if command in ("status", "watch", "kill") else set())
