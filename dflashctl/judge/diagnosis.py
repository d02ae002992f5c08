"""`diagnose`: the watch classifier applied to a log alone (no snapshots: no pane, no metrics, no clock).

A log says FINISHED only with a normal end (the trainer's finish line, run.sh's `exit 0`, HF Trainer's
`train_runtime`, Lightning's stop at its step or epoch limit) and no failure after it: a failure the run outlived
(an OOM a script caught and retried) is a warning in the evidence, never the verdict. A log with neither a failure
nor a normal end is INCOMPLETE (cut off, still running, or an end no signature knows), never an all-clear; a
traceback it ends inside is named, with its rank and the last frame reached. Holes the reader found in the file (runs
of NUL bytes, decode.py) are named in the evidence of every verdict.
"""

from __future__ import annotations

from .decode import HOLE, hole_note
from .facts import Verdict
from .logs import ADVICE, classify_log, cut_traceback, exit_line, normal_end_at, strip_prefix, this_attempt
from .prefixes import ANSI, learn_prefix

SIGKILL_EXITS = (137, -9)


def diagnose_lines(lines: list[str]) -> Verdict:
    """The verdict on the newest attempt of a log (earlier attempts were judged and restarted already), with the
    holes the file had named in its evidence."""
    note = hole_note(lines)
    v = _verdict(this_attempt(lines))
    return Verdict(v.state, v.reason, [*v.evidence, note], v.advice) if note else v


def _verdict(lines: list[str]) -> Verdict:
    finished = _finished(lines)
    if finished:
        return finished
    found = classify_log(lines)
    if found:
        return Verdict(found.state, found.reason, found.evidence, found.advice or ADVICE.get(found.state))
    code = exit_line(lines)
    if code in SIGKILL_EXITS:
        why = f"killed by SIGKILL (exit {code}) with no error of its own: likely the kernel's OOM killer (host RAM)"
        return Verdict("HOST_OOM", why, [f"exit {code}"], ADVICE["HOST_OOM"])
    cut = cut_traceback(lines)
    if code is not None:
        tail = [ANSI.sub("", ln) for ln in lines if ln.strip() and ln[:1] != HOLE][-3:]
        return Verdict("CRASHED", f"exit status {code} with no failure signature", [*cut, *tail], ADVICE["CRASHED"])
    last = ANSI.sub("", next((ln for ln in reversed(lines) if ln.strip() and ln[:1] != HOLE), ""))
    ev = [f"{len(lines)} lines read", *cut, f"last line: {last.strip()[:200]}"]
    why = "the log ends inside a traceback" if cut else "the log was cut off or the job is still running"
    return Verdict("INCOMPLETE", f"no failure and no normal end: {why}", ev, ADVICE["INCOMPLETE"])


def _finished(lines: list[str]) -> Verdict | None:
    """FINISHED when the log ends in a normal finish: no failure after the newest finish line, and no non-zero exit
    status. A failure before it is one the run outlived: a warning; a divergence never is (the newest losses are
    still non-finite)."""
    at = normal_end_at(lines)
    if at is None or classify_log(lines[at + 1 :]) is not None or exit_line(lines) not in (None, 0):
        return None
    ev = [strip_prefix(lines[at], learn_prefix(lines))[1].strip()]
    outlived = classify_log(lines[:at])
    if outlived and outlived.state == "DIVERGED":
        return None  # the loss was still non-finite at the end (HF Trainer finishes on NaN): nothing was outlived
    if outlived:
        ev.append(f"warning: the run outlived a failure before its finish: {outlived.state}: {outlived.reason}")
        ev += [f"  {e}" for e in outlived.evidence[:2]]
    return Verdict("FINISHED", "the log ends with a clean finish", ev)


def diagnose_text(text: str) -> Verdict:
    return diagnose_lines(text.splitlines())
