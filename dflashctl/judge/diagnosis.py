"""`diagnose`: the watch classifier applied to a log alone (no snapshots: no pane, no metrics, no clock).

A log says FINISHED only with a normal end (the trainer's finish line, run.sh's `exit 0`); a log with neither a
failure nor a normal end is INCOMPLETE (cut off, still running, or an end no signature knows), never an all-clear.
"""

from __future__ import annotations

from .facts import Verdict
from .logs import ADVICE, classify_log, exit_line, normal_end, this_attempt

SIGKILL_EXITS = (137, -9)


def diagnose_lines(lines: list[str]) -> Verdict:
    """The verdict on the newest attempt of a log (earlier attempts were judged and restarted already)."""
    lines = this_attempt(lines)
    found = classify_log(lines)
    if found:
        return Verdict(found.state, found.reason, found.evidence, found.advice or ADVICE.get(found.state))
    done = normal_end(lines)
    if done:
        return Verdict("FINISHED", "the log ends with a clean finish", [done.strip()])
    code = exit_line(lines)
    if code in SIGKILL_EXITS:
        why = f"killed by SIGKILL (exit {code}) with no error of its own: likely the kernel's OOM killer (host RAM)"
        return Verdict("HOST_OOM", why, [f"exit {code}"], ADVICE["HOST_OOM"])
    if code is not None:
        tail = [ln for ln in lines if ln.strip()][-3:]
        return Verdict("CRASHED", f"exit status {code} with no failure signature", tail, ADVICE["CRASHED"])
    last = next((ln for ln in reversed(lines) if ln.strip()), "")
    ev = [f"{len(lines)} lines read", f"last line: {last.strip()[:200]}"]
    return Verdict("INCOMPLETE", "no failure and no normal end: the log was cut off or the job is still running",
                   ev, ADVICE["INCOMPLETE"])  # fmt: skip


def diagnose_text(text: str) -> Verdict:
    return diagnose_lines(text.splitlines())
