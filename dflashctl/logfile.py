"""Read a log file of any size for the classifier: the newest attempt only, tail first, never the whole file.

A training log can be hundreds of MB. The classifier needs little of it: the newest attempt (found by scanning back
from the end), its first lines, its last lines (the end, the loss tail), and every line some signature could match,
with the traceback that follows it. Those are found a block at a time by a few plain byte searches, so memory
stays bounded whatever the file's size. A log on stdin is read whole (`lines_of`), with the same checks.
"""

from __future__ import annotations

from pathlib import Path

from dflashctl.judge.logs import ATTEMPT_START, strip_prefix

BLOCK = 8 << 20
HEAD_BYTES = 256 << 10
TAIL_BYTES = 1 << 20
MAX_KEPT = 40_000  # lines kept from the middle; past that, the oldest are dropped (the newest decide)
TRACEBACK_LINES = 400  # at most this many lines of one traceback
SNIFF = 8192
# What the middle of a long attempt is searched for (its head and tail are kept whole): the starts of tracebacks (a
# rank's own error before the others' timeouts) and the causes a later OOM names (the recompile limit, flex run
# eagerly), the GPU's hardware reports. Plain byte searches: a regex with alternatives costs 10x here.
MIDDLE_NEEDLES = (b"Traceback (most recent call last)", b"hit config.", b"called without torch.compile", b"NVRM: Xid",
                  b"ECC error")  # fmt: skip
ATTEMPT_NEEDLES = (b"[dflashctl] ", b"will restart worker group")


class LogFileError(Exception):
    """The file cannot be read as a log: missing, empty, binary."""


def _check(path: Path) -> int:
    try:
        size = path.stat().st_size
        if path.is_dir():
            raise LogFileError("is a directory, not a log file")
    except OSError as e:
        raise LogFileError(f"cannot read: {e.strerror}") from None
    if size == 0:
        raise LogFileError("is empty: there is no log to read")
    return size


def _binary(chunk: bytes) -> bool:
    """NUL bytes, or mostly bytes that are neither text nor UTF-8: an archive, a checkpoint, an image."""
    if b"\0" in chunk:
        return True
    text = chunk.decode("utf-8", errors="replace")
    bad = text.count("\ufffd") + sum(1 for c in text if ord(c) < 32 and c not in "\n\r\t\f\b\x1b")
    return bad > 0.1 * max(1, len(text))


def lines_of(data: bytes) -> list[str]:
    """A whole log's lines (stdin), refused as a file would be: empty, or binary at its start or its end."""
    if not data.strip():
        raise LogFileError("is empty: there is no log to read")
    if _binary(data[:SNIFF]) or _binary(data[-SNIFF:]):
        raise LogFileError("is not a text log (binary content)")
    return data.decode("utf-8", errors="replace").splitlines()


def newest_attempt_offset(f, size: int) -> int:
    """Where the newest attempt's start line begins, scanning back from the end a block at a time; 0 if none."""
    end = size
    while end > 0:
        start = max(0, end - BLOCK)
        f.seek(start)
        block = f.read(min(end - start + 4096, size - start))  # overlap: a line cut at the block's end is whole
        hit = -1
        limit = end - start
        for needle in ATTEMPT_NEEDLES:
            pos = block.rfind(needle, 0, limit + len(needle))
            while pos >= 0:
                ls = block.rfind(b"\n", 0, pos) + 1
                le = block.find(b"\n", pos)
                line = block[ls : le if le >= 0 else len(block)].decode("utf-8", errors="replace")
                if ATTEMPT_START.search(strip_prefix(line)[1]) and (ls > 0 or start == 0):
                    hit = max(hit, ls)
                    break
                pos = block.rfind(needle, 0, pos)
        if hit >= 0:
            return start + hit
        end = start
    return 0


def read_log(path: str | Path) -> list[str]:
    """The lines of the newest attempt that the classifier can use, in file order; bounded memory."""
    path = Path(path)
    size = _check(path)
    with path.open("rb") as f:
        head = f.read(SNIFF)
        f.seek(max(0, size - SNIFF))
        if _binary(head) or _binary(f.read(SNIFF)):
            raise LogFileError("is not a text log (binary content)")
        start = newest_attempt_offset(f, size)
        if size - start <= HEAD_BYTES + TAIL_BYTES + BLOCK:
            f.seek(start)
            return f.read().decode("utf-8", errors="replace").splitlines()
        return _reduced(f, start, size)


def _reduced(f, start: int, size: int) -> list[str]:
    kept: dict[int, str] = {}  # byte offset -> line (offsets order the lines and remove overlaps)
    f.seek(start)
    _all_lines(f.read(HEAD_BYTES), start, kept, drop_last=True)
    tail_at = size - TAIL_BYTES
    pos = start + HEAD_BYTES
    middle: list[int] = []
    while pos < tail_at:
        f.seek(pos)
        block = f.read(min(BLOCK, tail_at - pos) + 64 * 1024)  # overrun: a traceback cut at the block's end
        end = min(BLOCK, tail_at - pos)
        for needle in MIDDLE_NEEDLES:
            at = block.find(needle, 0, end)
            while at >= 0:
                at = _keep_from(block, at, pos, kept, middle, whole=needle.startswith(b"Traceback"))
                at = block.find(needle, at, end)
        pos += end
        if len(middle) > MAX_KEPT * 2:
            middle.sort()
            for off in middle[: len(middle) - MAX_KEPT]:
                kept.pop(off, None)
            del middle[: len(middle) - MAX_KEPT]
    f.seek(tail_at)
    tail = f.read()
    first_nl = tail.find(b"\n") + 1
    _all_lines(tail[first_nl:], tail_at + first_nl, kept)
    return [kept[k] for k in sorted(kept)]


def _all_lines(data: bytes, base: int, kept: dict[int, str], drop_last: bool = False) -> None:
    pieces = data.split(b"\n")
    if drop_last and len(pieces) > 1:
        pieces = pieces[:-1]
    off = base
    for p in pieces:
        kept[off] = p.decode("utf-8", errors="replace").rstrip("\r")
        off += len(p) + 1


def _keep_from(block: bytes, at: int, base: int, kept: dict[int, str], middle: list[int], whole: bool) -> int:
    """Keep the line holding `at`; for a traceback, the lines after it through its exception line. Returns where
    the search goes on."""
    ls = block.rfind(b"\n", 0, at) + 1
    for n in range(TRACEBACK_LINES if whole else 1):
        le = block.find(b"\n", ls)
        le = len(block) if le < 0 else le
        line = block[ls:le].decode("utf-8", errors="replace").rstrip("\r")
        kept[base + ls] = line
        middle.append(base + ls)
        ls = le + 1
        body = strip_prefix(line)[1]
        if n and body and not body.startswith((" ", "Traceback", "During handling", "The above exception")):
            break  # the exception line ends the traceback
        if ls >= len(block):
            break
    return ls
