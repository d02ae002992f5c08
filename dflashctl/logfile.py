"""Read a log file of any size for the classifier: the newest attempt only, tail first, never the whole file.

A training log can be hundreds of MB. The classifier needs little of it: the newest attempt (found by scanning back
from the end), its first lines, its last lines (the end, the loss tail), and every line some signature could match,
with the traceback that follows it. Those are found a block at a time by a few plain byte searches, so memory
stays bounded whatever the file's size. What cannot be read backwards (a gzip'd log, rotated; a log on stdin, gzip'd
or not; a UTF-16 or UTF-32 log, re-encoded as it is read) is read forward once (`read_stream`), keeping the same
slices in the same bound, with the same checks.

Encodings (judge/decode.py): a BOM selects UTF-8, UTF-16 or UTF-32; runs of NUL bytes are holes, skipped and put
back as a line of their own that `diagnose` names (a hole at the start, as logrotate's copytruncate leaves, is skipped
without being read where the file system knows it is sparse); a file that is mostly text is text, a binary one is
refused.
"""

from __future__ import annotations

import codecs
import errno
import gzip
import io
import os
import zlib
from pathlib import Path
from typing import BinaryIO

from dflashctl.judge.decode import hole_line, holes_in, line_pieces, looks_binary, sniff_codec
from dflashctl.judge.logs import ATTEMPT_START, strip_prefix

BLOCK = 8 << 20
HEAD_BYTES = 256 << 10
TAIL_BYTES = 1 << 20
WHOLE_BYTES = HEAD_BYTES + TAIL_BYTES + BLOCK  # an attempt up to this size is read whole
MAX_KEPT = 40_000  # lines kept from the middle; past that, the oldest are dropped (the newest decide)
MAX_HOLES = 64  # holes named; past that, the file is named by the first ones
TRACEBACK_LINES = 400  # at most this many lines of one traceback
SNIFF = 8192
# What the middle of a long attempt is searched for (its head and tail are kept whole): the starts of tracebacks (a
# rank's own error before the others' timeouts) and the causes a later OOM names (the recompile limit, flex run
# eagerly), the GPU's hardware reports. Plain byte searches: a regex with alternatives costs 10x here.
MIDDLE_NEEDLES = (
    b"Traceback (most recent call last)",
    b"hit config.",
    b"called without torch.compile",
    b"NVRM: Xid",
    b"ECC error",
)
ATTEMPT_NEEDLES = (b"[dflashctl] ", b"will restart worker group")
GZIP_MAGIC = b"\x1f\x8b"
OVERRUN = 64 * 1024  # how far past a block a traceback found in it is followed
BLANK = b"\0 \t\r\n\x0b\x0c"  # what a log that holds nothing holds
WIDE_CODECS = ("utf-16", "utf-16-le", "utf-16-be", "utf-32")  # re-encoded to UTF-8 as they are read


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


def _nul_only(size: int) -> LogFileError:
    return LogFileError(
        f"holds only NUL bytes ({size:,}): a hole, as a log truncated under its writer leaves, and no text"
    )


def lines_of(data: bytes) -> list[str]:
    """A whole log's lines (bytes in memory), refused as a file would be: empty, or binary at its start or its end."""
    return read_stream(io.BytesIO(data))


class _Peeked:
    """A byte stream with its first bytes, read to see what it is, put back in front."""

    def __init__(self, first: bytes, rest: BinaryIO) -> None:
        self.first, self.rest = first, rest

    def read(self, n: int = -1) -> bytes:
        if not self.first:
            return self.rest.read(n)
        out, self.first = self.first, b""
        return out + (self.rest.read(n - len(out)) if n < 0 or n > len(out) else b"")


class _Transcoded:
    """A UTF-16 or UTF-32 byte stream read as UTF-8 (what cannot be decoded, an odd last byte included, becomes U+FFFD):
    the rest of the reader sees one encoding."""

    def __init__(self, raw: BinaryIO, codec: str) -> None:
        self.raw, self.decoder, self.done = raw, codecs.getincrementaldecoder(codec)(errors="replace"), False

    def read(self, n: int = -1) -> bytes:
        while not self.done:
            chunk = self.raw.read(n)
            text = self.decoder.decode(chunk, final=not chunk)
            self.done = not chunk
            if text or self.done:
                return text.encode("utf-8")
        return b""


def read_stream(raw: BinaryIO) -> list[str]:
    """What `read_log` keeps, from a stream read forward once (stdin, a gzip'd file, gzip'd or not, a UTF-16 log):
    the newest attempt whole while it is small, else its first HEAD_BYTES, its last TAIL_BYTES, and the middle's
    needle lines, one block ahead so that a traceback crossing a block is followed. Memory: two blocks and what is
    kept."""
    first = raw.read(2)
    if first != GZIP_MAGIC:
        return _forward(_as_utf8(_Peeked(first, raw)))
    try:
        return _forward(_as_utf8(gzip.GzipFile(fileobj=_Peeked(first, raw), mode="rb")))
    except (EOFError, OSError, zlib.error) as e:  # not gzip after all, corrupt, or cut short
        raise LogFileError(f"is not a readable gzip file ({e})") from None


def _as_utf8(f: BinaryIO) -> BinaryIO:
    """The stream as UTF-8 bytes: re-encoded where its first bytes ask for UTF-16 or UTF-32."""
    head = f.read(SNIFF)
    codec = sniff_codec(head)
    peeked = _Peeked(head, f)
    return _Transcoded(peeked, codec) if codec in WIDE_CODECS else peeked


class _Holes:
    """The NUL runs of the bytes fed to it, in order, those that touch merged: (start, end) offsets."""

    def __init__(self) -> None:
        self.runs: list[list[int]] = []

    def feed(self, data: bytes, base: int) -> None:
        for s, e in holes_in(data):
            if self.runs and self.runs[-1][1] == base + s:
                self.runs[-1][1] = base + e
            elif len(self.runs) < MAX_HOLES:
                self.runs.append([base + s, base + e])

    def put_into(self, kept: dict[int, str]) -> None:
        for s, e in self.runs:
            kept.setdefault(s, hole_line(s, e - s))


def _forward(f: BinaryIO) -> list[str]:
    kept: dict[int, str] = {}
    middle: list[int] = []
    holes = _Holes()
    start = 0  # offset of the newest attempt's first line
    whole: list[bytes] | None = []  # the attempt's bytes while it is small
    whole_len = 0
    pending, pending_at = b"", 0  # complete lines read, not yet searched (they wait for the next block's overrun)
    tail = b""  # the last TAIL_BYTES read
    carry, at, text, sniffed = b"", 0, False, False
    while True:
        chunk = f.read(BLOCK)
        data = carry + chunk
        cut = data.rfind(b"\n") + 1 if chunk else len(data)
        cut += 0 < cut < len(data) and data[cut] == 0  # the NUL of a UTF-16 newline stays with its line
        if chunk and cut == 0 and len(data) > 2 * BLOCK:
            cut = len(data)  # one line longer than two blocks: taken as it is
        block, carry = data[:cut], data[cut:]
        content = block.lstrip(b"\0") if not sniffed else b""
        if not sniffed and (content or not chunk):
            sniffed = True  # the first bytes after a leading hole say what the file is
            if looks_binary(content[:SNIFF]):
                raise LogFileError("is not a text log (binary content)")
        text = text or bool(block.strip(BLANK))
        if pending:
            _search(pending, pending_at, block[:OVERRUN], start, kept, middle)
        if (a := _attempt_start(block)) >= 0:
            start = at + a
            kept.clear()
            middle.clear()
            holes = _Holes()
            whole, whole_len = [], 0
            block_from = a
        else:
            block_from = 0
        holes.feed(block[block_from:], at + block_from)
        if whole is not None:
            whole.append(block[block_from:])
            whole_len += len(block) - block_from
            if whole_len > WHOLE_BYTES:
                whole = None
        pending, pending_at = block, at
        tail = (tail + block)[-TAIL_BYTES:]
        at += len(block)
        if not chunk:
            break
    if not text:
        raise _nul_only(at) if holes.runs else LogFileError("is empty: there is no log to read")
    if looks_binary(tail[-SNIFF:]):
        raise LogFileError("is not a text log (binary content)")
    if whole is not None:
        kept = {}
        _all_lines(b"".join(whole), start, kept)
    else:
        tail_at = at - len(tail)
        if tail_at < start:
            tail, tail_at = tail[start - tail_at :], start
        else:
            nl = _tail_start(tail)
            tail, tail_at = tail[nl:], tail_at + nl
        _all_lines(tail, tail_at, kept)
    holes.put_into(kept)
    return [kept[k] for k in sorted(kept) if k >= start]


def _attempt_start(block: bytes) -> int:
    """Where the last attempt-start line in a block of whole lines begins, or -1."""
    hit = -1
    for needle in ATTEMPT_NEEDLES:
        pos = block.rfind(needle)
        while pos >= 0:
            ls = block.rfind(b"\n", 0, pos) + 1
            le = block.find(b"\n", pos)
            line = block[ls : le if le >= 0 else len(block)].decode("utf-8", errors="replace")
            if ATTEMPT_START.search(strip_prefix(line)[1]):
                hit = max(hit, ls)
                break
            pos = block.rfind(needle, 0, pos)
    return hit


def _search(block: bytes, base: int, overrun: bytes, start: int, kept: dict[int, str], middle: list[int]) -> None:
    """One forward block: its lines within the attempt's first HEAD_BYTES kept whole, the middle's needles kept with
    the traceback after them (into the next block's first bytes)."""
    lo = max(0, start - base)
    head_end = start + HEAD_BYTES - base
    if head_end > lo:
        _all_lines(block[lo : min(len(block), head_end)], base + lo, kept, drop_last=True)
    _search_middle(block + overrun, lo, len(block), base, kept, middle)


def newest_attempt_offset(f, size: int, floor: int = 0) -> int:
    """Where the newest attempt's start line begins, scanning back from the end a block at a time; `floor` (where
    the text begins) if none."""
    end = size
    while end > floor:
        start = max(floor, end - BLOCK)
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
                if ATTEMPT_START.search(strip_prefix(line)[1]) and (ls > 0 or start == floor):
                    hit = max(hit, ls)
                    break
                pos = block.rfind(needle, 0, pos)
        if hit >= 0:
            return start + hit
        end = start
    return floor


def _text_start(f, size: int) -> int:
    """Where the first byte that is not NUL is: past a leading hole (the file system's sparse hole skipped unread,
    where it says where its data starts), `size` when there is none."""
    pos = 0
    try:
        pos = os.lseek(f.fileno(), 0, os.SEEK_DATA)
    except OSError as e:
        pos = size if e.errno == errno.ENXIO else 0  # ENXIO: no data at all
    except (AttributeError, ValueError):  # no SEEK_DATA here, or no file descriptor
        pos = 0
    f.seek(pos)
    step = SNIFF  # a log that starts with text costs one small read; a hole, reads that grow to a block
    while pos < size:
        block = f.read(step)
        step = min(BLOCK, step * 8)
        if not block:
            return size
        rest = block.lstrip(b"\0")
        if rest:
            return pos + len(block) - len(rest)
        pos += len(block)
    return size


def read_log(path: str | Path) -> list[str]:
    """The lines of the newest attempt that the classifier can use, in file order; bounded memory. A gzip'd file
    (found by its magic bytes, whatever its name) is decompressed as it is read, a UTF-16 or UTF-32 one re-encoded;
    a leading hole is skipped and named."""
    path = Path(path)
    size = _check(path)
    with path.open("rb") as f:
        head = f.read(SNIFF)
        if head[:2] == GZIP_MAGIC or sniff_codec(head) in WIDE_CODECS:
            f.seek(0)
            return read_stream(f)
        lead = _text_start(f, size)
        if lead >= size:
            raise _nul_only(size)
        f.seek(lead)
        head = f.read(SNIFF)
        f.seek(max(lead, size - SNIFF))
        if looks_binary(head) or looks_binary(f.read(SNIFF)):
            raise LogFileError("is not a text log (binary content)")
        start = newest_attempt_offset(f, size, lead)
        holes = _Holes()
        if lead:
            holes.runs.append([0, lead])  # the leading hole, skipped unread
        kept: dict[int, str] = {}
        if size - start <= WHOLE_BYTES:
            f.seek(start)
            data = f.read()
            if not data.strip(BLANK):
                raise _nul_only(size) if b"\0" in data or lead else LogFileError("is empty: there is no log to read")
            holes.feed(data, start)
            _all_lines(data, start, kept)
        else:
            _reduced(f, start, size, kept, holes)
        holes.put_into(kept)
        return [kept[k] for k in sorted(kept)]


def _reduced(f, start: int, size: int, kept: dict[int, str], holes: _Holes) -> None:
    """The attempt's head, its middle's needle lines and its tail into `kept` (byte offset -> line: offsets order the
    lines and remove overlaps), its holes into `holes`."""
    f.seek(start)
    head = f.read(HEAD_BYTES)
    holes.feed(head, start)
    _all_lines(head, start, kept, drop_last=True)
    tail_at = size - TAIL_BYTES
    pos = start + HEAD_BYTES
    middle: list[int] = []
    while pos < tail_at:
        f.seek(pos)
        block = f.read(min(BLOCK, tail_at - pos) + OVERRUN)  # overrun: a traceback cut at the block's end
        end = min(BLOCK, tail_at - pos)
        holes.feed(block[:end], pos)
        _search_middle(block, 0, end, pos, kept, middle)
        pos += end
    f.seek(tail_at)
    tail = f.read()
    holes.feed(tail, tail_at)
    first = _tail_start(tail)
    _all_lines(tail[first:], tail_at + first, kept)


def _tail_start(tail: bytes) -> int:
    """Where the tail's first whole line starts: after its first newline (the line before it was cut), or after a
    hole before that newline (the text after a hole starts a line)."""
    nl = tail.find(b"\n")
    nul = tail.rfind(b"\0", 0, nl if nl >= 0 else len(tail))
    return nul + 1 if nul >= 0 else nl + 1


def _search_middle(block: bytes, lo: int, end: int, base: int, kept: dict[int, str], middle: list[int]) -> None:
    """Keep the needle lines that start in block[lo:end] (a traceback through its exception line); past MAX_KEPT
    middle lines, the oldest are dropped (the newest decide)."""
    for needle in MIDDLE_NEEDLES:
        at = block.find(needle, lo, end)
        while at >= 0:
            at = _keep_from(block, at, base, kept, middle, whole=needle.startswith(b"Traceback"))
            at = block.find(needle, at, end)
    if len(middle) > MAX_KEPT * 2:
        middle.sort()
        for off in middle[: len(middle) - MAX_KEPT]:
            kept.pop(off, None)
        del middle[: len(middle) - MAX_KEPT]


def _all_lines(data: bytes, base: int, kept: dict[int, str], drop_last: bool = False) -> None:
    pieces = data.split(b"\n")
    if (drop_last or not pieces[-1]) and len(pieces) > 1:
        pieces = pieces[:-1]  # a line cut at the end of the slice, or the nothing after the last newline
    off = base
    for p in pieces:
        if b"\0" in p or b"\xef\xbb\xbf" in p:
            kept.update(line_pieces(p, off))
        else:
            kept[off] = p.decode("utf-8", errors="replace").rstrip("\r")
        off += len(p) + 1


def _keep_from(block: bytes, at: int, base: int, kept: dict[int, str], middle: list[int], whole: bool) -> int:
    """Keep the line holding `at`; for a traceback, the lines after it through its exception line. Returns where
    the search goes on."""
    ls = block.rfind(b"\n", 0, at) + 1
    for n in range(TRACEBACK_LINES if whole else 1):
        le = block.find(b"\n", ls)
        le = len(block) if le < 0 else le
        pieces = line_pieces(block[ls:le], base + ls)
        kept.update(pieces)
        middle.extend(off for off, _ in pieces)
        line = pieces[-1][1] if pieces else ""
        ls = le + 1
        body = strip_prefix(line)[1]
        if n and body and not body.startswith((" ", "Traceback", "During handling", "The above exception")):
            break  # the exception line ends the traceback
        if ls >= len(block):
            break
    return ls
