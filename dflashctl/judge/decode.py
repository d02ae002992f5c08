"""Pure: bytes of a log made text. A BOM selects UTF-8, UTF-16 or UTF-32 (and UTF-16 written without one, as every
other byte NUL, is found too); runs of NUL bytes are holes, skipped and named; a file that is mostly text is text.

A log gets NUL bytes in a few real ways: logrotate's `copytruncate` empties the file while the job keeps writing at
its old offset, so the file starts with a hole of NULs as long as what was copied away (sparse on disk); a crash after
the file grew but before its data was written leaves NUL blocks; a program that writes UTF-16 (PowerShell's
`Tee-Object`, `Out-File`) puts a NUL beside every ASCII character, sometimes appended to a UTF-8 log. The first two
are holes: the text on either side is read, and the hole is put where it was as a line of its own (`hole_line`) that
the classifier skips and `diagnose` names. The third is text.
"""

from __future__ import annotations

import codecs
import re

BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)  # UTF-32 LE first: it starts as UTF-16 LE's
NUL_RUN = re.compile(rb"\x00+")
NOT_NUL = re.compile(rb"[^\x00]+")
# ASCII written as UTF-16 (a NUL beside every character), four characters or more, with its BOM where one starts it
WIDE = re.compile(rb"(?:\xff\xfe)?\x00?(?:[\x01-\x7f]\x00){4,}|(?:\xfe\xff)?(?:\x00[\x01-\x7f]){4,}\x00?")
WIDE_HINT = re.compile(rb"[\x01-\x7f]\x00[\x01-\x7f]\x00|\x00[\x01-\x7f]\x00[\x01-\x7f]")
CONTROL = re.compile("[\x00-\x07\x0e-\x1a\x1c-\x1f\x7f\ufffd]")  # not text: control characters, undecodable bytes
BINARY_SHARE = 1 / 3  # more than this share of a window not text (NUL holes aside) and it is not a text log
SCATTERED = 512  # a NUL run every this many bytes or more often (and more than 8): structured binary, not a hole
HOLE = "\0"  # the first character of a hole line; never the first of a decoded line (their NULs are gone)


def sniff_codec(head: bytes) -> str:
    """The codec a file's first bytes ask for: its BOM's, UTF-16 where every other byte is NUL, else UTF-8."""
    for bom, codec in BOMS:
        if head.startswith(bom):
            return codec
    sample = head[:4096]
    if len(sample) >= 16 and head[:16].count(0) >= 6:  # it starts as UTF-16, not a hole, not UTF-16 appended later
        odd, even = sample[1::2].count(0), sample[0::2].count(0)
        half = len(sample) // 2
        if odd > 0.4 * half and even < 0.05 * half:
            return "utf-16-le"
        if even > 0.4 * half and odd < 0.05 * half:
            return "utf-16-be"
    return "utf-8"


def looks_binary(window: bytes) -> bool:
    """A window of a file that is not a text log: NULs scattered through it (a checkpoint, an archive), or mostly
    bytes that are neither text nor UTF-8. NUL holes and UTF-16 text are text."""
    if b"\0" in window:
        window = narrow(window)
        runs = len(NUL_RUN.findall(window))
        if runs > 8 and runs * SCATTERED > len(window):
            return True
        window = window.replace(b"\0", b"")
    if not window:
        return False  # nothing but a hole: the reader decides what that is
    text = window.decode("utf-8", errors="replace")
    return len(CONTROL.findall(text)) > BINARY_SHARE * len(text)


def narrow(data: bytes) -> bytes:
    """ASCII written as UTF-16 inside other bytes, made one byte a character (its NULs and BOM dropped)."""
    if b"\0" not in data or not WIDE_HINT.search(data):
        return data
    return WIDE.sub(lambda m: m.group().replace(b"\0", b"").replace(b"\xff\xfe", b"").replace(b"\xfe\xff", b""), data)


def holes_in(data: bytes) -> list[tuple[int, int]]:
    """(start, end) of each NUL run in `data` that is a hole: not the NULs of UTF-16 text."""
    if b"\0" not in data:
        return []
    if data.count(b"\0") == len(data):
        return [(0, len(data))]
    wide = [m.span() for m in WIDE.finditer(data)] if WIDE_HINT.search(data) else []
    runs, k = [], 0
    for m in NUL_RUN.finditer(data):
        while k < len(wide) and wide[k][1] <= m.start():
            k += 1
        if k < len(wide) and wide[k][0] <= m.start() and m.end() <= wide[k][1]:
            continue
        runs.append(m.span())
    return runs


def line_pieces(raw: bytes, offset: int) -> list[tuple[int, str]]:
    """One line's bytes (no newline) at `offset` as (offset, text) pieces: the text on each side of a hole apart,
    UTF-16 text narrowed, a BOM dropped, the line ending's `\\r` gone."""
    if b"\xef\xbb\xbf" in raw:
        raw = raw.replace(b"\xef\xbb\xbf", b"")
    if b"\0" not in raw:
        return [(offset, raw.decode("utf-8", errors="replace").rstrip("\r"))]
    raw = narrow(raw)
    pieces = [
        (offset + m.start(), m.group().decode("utf-8", errors="replace").rstrip("\r")) for m in NOT_NUL.finditer(raw)
    ]
    return [(at, text) for at, text in pieces if text.strip()]


def hole_line(start: int, size: int) -> str:
    """The line that stands where a hole was: never a log's own (no decoded line starts with NUL)."""
    return f"{HOLE}hole {size} {start}"


def hole_of(line: str) -> tuple[int, int] | None:
    """(start, size) of a hole line, or None."""
    if not line.startswith(HOLE + "hole "):
        return None
    size, start = line[6:].split()
    return int(start), int(size)


def hole_note(lines: list[str]) -> str | None:
    """What the evidence says of the holes a log had, or None."""
    holes = [h for ln in lines if ln[:1] == HOLE and (h := hole_of(ln))]
    if not holes:
        return None
    total = sum(size for _, size in holes)
    where = (
        f"{len(holes)} holes of NUL bytes ({total:,} bytes; the first at byte {holes[0][0]:,})"
        if len(holes) > 1
        else f"a hole of {total:,} NUL bytes at byte {holes[0][0]:,}"
    )
    return (
        f"read around {where}, skipped: a log truncated under its writer (logrotate's copytruncate) or not "
        "flushed before a crash leaves them"
    )
