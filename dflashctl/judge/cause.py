"""A restart's cause in its one shape: the failed state the restart ends, the reason and evidence that showed it, and
who decided. The decider writes it into the run dir before the restart count moves; every watcher reads it back. The
job can write into its run dir too, so this one normaliser runs on both ends and no reader checks a field itself."""

from __future__ import annotations

EVIDENCE_LINES = 5  # a cause keeps this many lines of its evidence


def bounded(raw: object, attempt: int) -> dict:
    """`raw` as restart `attempt`'s cause, every field typed and bounded; `after` is None when no state was given."""
    raw = raw if isinstance(raw, dict) else {}
    after, by, evidence = raw.get("after"), raw.get("by"), raw.get("evidence")
    lines = evidence[:EVIDENCE_LINES] if isinstance(evidence, list) else []
    return {
        "attempt": attempt,
        "after": after[:40] if isinstance(after, str) and after else None,
        "reason": str(raw.get("reason") or "")[:400],
        "by": by[:80] if isinstance(by, str) and by else None,
        "evidence": [str(e)[:400] for e in lines],
    }


def recorded(raw: object, attempt: int | None) -> dict | None:
    """The cause recorded for restart `attempt`, bounded, when `raw` is that restart's and names the state it ends;
    None for another attempt's cause, none, or garbage (a cause nobody can trust is said as unknown)."""
    if not isinstance(raw, dict) or type(raw.get("attempt")) is not int or raw["attempt"] != attempt:
        return None
    cause = bounded(raw, attempt)
    return cause if cause["after"] is not None else None
