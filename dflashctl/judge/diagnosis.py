"""`diagnose`: the watch classifier applied to a log alone (no snapshots: no pane, no metrics, no clock)."""

from __future__ import annotations

import re

from dflashctl.judge.health import ADVICE, Verdict, classify_log

FINISHED = re.compile(r"^(finished: \d+ steps|\[dflashctl\] \S+ exit 0$)")


def diagnose_text(text: str) -> Verdict:
    found = classify_log(text)
    if found:
        return Verdict(found.state, found.reason, found.evidence, ADVICE.get(found.state))
    done = [ln for ln in text.splitlines() if FINISHED.match(ln.strip())]
    if done:
        return Verdict("FINISHED", "the log ends with a clean finish", done[-1:])
    return Verdict("NO_FAILURE_FOUND", "no failure signature in the log", [f"{len(text.splitlines())} lines read"])
