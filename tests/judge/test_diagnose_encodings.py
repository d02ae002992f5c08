"""Issue 61: logs read in any encoding, and what an attacker (or a broken disk) can put in a file. A BOM selects UTF-8,
UTF-16 or UTF-32; UTF-16 without one is found; runs of NUL bytes are holes, skipped and named in the evidence; a file
that is mostly text is text; a binary one, an empty one and one that is only NULs stay exit 2, each with its one
line of reason; huge lines, redraws and garbage are read in bounded time and memory."""

from __future__ import annotations

import codecs
import gzip
import os
import random
import subprocess
import sys
import time
import tracemalloc

import pytest

from dflashctl.judge.decode import hole_of, looks_binary, sniff_codec
from dflashctl.judge.diagnosis import diagnose_lines
from dflashctl.judge.facts import EXIT_BY_STATE
from dflashctl.logfile import LogFileError, lines_of, read_log

CRASH = [
    "step 1 loss 2.31",
    "step 2 loss 2.30",
    "Traceback (most recent call last):",
    '  File "/srv/train.py", line 7, in <module>',
    "KeyError: 'shard'",
]
OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB"


def _text(lines: list[str], newline: str = "\n") -> str:
    return newline.join(lines) + newline


@pytest.mark.parametrize(
    "codec, bom",
    [
        ("utf-16-le", codecs.BOM_UTF16_LE),  # PowerShell 5's Tee-Object and Out-File
        ("utf-16-be", codecs.BOM_UTF16_BE),
        ("utf-32-le", codecs.BOM_UTF32_LE),
        ("utf-32-be", codecs.BOM_UTF32_BE),
        ("utf-8", codecs.BOM_UTF8),
        ("utf-16-le", b""),  # no BOM: every other byte NUL
        ("utf-16-be", b""),
    ],
)
def test_a_bom_or_the_shape_of_utf16_selects_the_encoding(tmp_path, codec, bom):
    data = bom + _text(CRASH, "\r\n").encode(codec)
    (tmp_path / "train.log").write_bytes(data)
    for lines in (read_log(tmp_path / "train.log"), lines_of(data), lines_of(gzip.compress(data))):
        assert lines == CRASH, lines
    v = diagnose_lines(read_log(tmp_path / "train.log"))
    assert v.state == "CRASHED" and v.reason == "KeyError"


def test_a_utf16_file_of_odd_length_reads_its_last_byte_as_a_replacement(tmp_path):
    data = codecs.BOM_UTF16_LE + _text([*CRASH[:2], OOM]).encode("utf-16-le") + b"\x41"  # cut mid-character
    (tmp_path / "odd.log").write_bytes(data)
    lines = read_log(tmp_path / "odd.log")
    assert lines[:3] == [*CRASH[:2], OOM] and lines[-1] == "\ufffd"
    assert diagnose_lines(lines).state == "OOM"


def test_utf16_appended_to_a_utf8_log_is_read_as_text():
    """PowerShell's `Tee-Object -Append` writes UTF-16 after what a UTF-8 writer wrote."""
    data = _text(CRASH[:2]).encode() + codecs.BOM_UTF16_LE + _text(CRASH[2:], "\r\n").encode("utf-16-le")
    lines = lines_of(data)
    assert [ln for ln in lines if ln] == CRASH, lines
    assert diagnose_lines(lines).reason == "KeyError"


def test_a_leading_hole_is_skipped_and_named(tmp_path):
    """logrotate's copytruncate: the writer goes on at its old offset, the file begins with NULs (sparse)."""
    path = tmp_path / "train.log"
    with path.open("wb") as f:
        f.truncate(2 << 30)  # a 2 GiB hole, not written: the file system keeps it sparse
        f.seek(2 << 30)
        f.write(_text(CRASH).encode())
    started = time.monotonic()
    tracemalloc.start()
    lines = read_log(path)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert time.monotonic() - started < 30 and peak < 64 << 20
    assert hole_of(lines[0]) == (0, 2 << 30) and lines[1:] == CRASH
    v = diagnose_lines(lines)
    assert v.state == "CRASHED" and "a hole of 2,147,483,648 NUL bytes at byte 0" in v.evidence[-1]


def test_a_hole_inside_a_line_splits_it_and_every_hole_is_counted():
    data = b"step 1 loss 2.3\nstep 2 lo" + b"\0" * 4096 + b"step 9 loss 2.1\n" + b"\0" * 10 + _text(CRASH).encode()
    lines = lines_of(data)
    assert lines[:2] == ["step 1 loss 2.3", "step 2 lo"] and hole_of(lines[2]) == (25, 4096)
    v = diagnose_lines(lines)
    assert v.state == "CRASHED" and "2 holes of NUL bytes (4,106 bytes; the first at byte 25)" in v.evidence[-1]


def test_nul_blocks_at_the_end_are_no_last_line(tmp_path):
    """A crash after the file grew but before its data reached the disk leaves NUL blocks at the end."""
    path = tmp_path / "train.log"
    path.write_bytes(_text(["step 1 loss 2.3", "step 2 loss 2.2"]).encode() + b"\0" * 65536)
    v = diagnose_lines(read_log(path))
    assert v.state == "INCOMPLETE" and v.evidence[-2] == "last line: step 2 loss 2.2"
    assert "a hole of 65,536 NUL bytes at byte 32" in v.evidence[-1]


def test_holes_in_a_big_log_are_read_around(tmp_path):
    """Past the whole-file size the reader keeps a head, the middle's needles and a tail: holes in each are named."""
    step = "step {}/2000000 loss 2.3011 lr 5.97e-04 62,140 tok/s\n"
    path = tmp_path / "train.log"
    with path.open("wb") as f:
        f.write(b"\0" * 1000)
        i = 0
        while f.tell() < 24 << 20:
            i += 1
            f.write(step.format(i).encode())
            if i == 200_000:
                f.write(b"\0" * 300 + _text(CRASH[2:]).encode())
        f.write(b"\0" * 700 + _text(["step 9 loss 2.0"]).encode())
    lines = read_log(path)
    holes = [hole_of(ln) for ln in lines if hole_of(ln)]
    assert holes[0] == (0, 1000) and holes[-1][1] == 700 and len(holes) >= 2
    assert diagnose_lines(lines).state == "CRASHED"


@pytest.mark.parametrize(
    "data, words",
    [
        (b"\0" * 100_000, "only NUL bytes"),
        (b"\0" * 10 + b"\n \n\0\0", "only NUL bytes"),
        (b"", "is empty"),
        (b"PK\x03\x04" + bytes(range(256)) * 40, "binary"),  # an archive
        (b"\x89PNG\r\n\x1a\n" + random.Random(1).randbytes(20_000), "binary"),
        (b"\x08\x00\x00\x00\x00\x00\x00\x00{}\x00\x00" * 100, "binary"),  # a safetensors header, NULs everywhere
        (gzip.compress(b"\0" * 50_000, mtime=0), "only NUL bytes"),  # mtime 0: the same bytes (and test id) every run
    ],
)
def test_what_is_not_a_text_log_is_refused_with_its_reason(tmp_path, data, words):
    with pytest.raises(LogFileError, match=words):
        lines_of(data)
    (tmp_path / "f.log").write_bytes(data)
    with pytest.raises(LogFileError, match=words):
        read_log(tmp_path / "f.log")


def test_a_file_that_is_mostly_text_is_text_and_a_mostly_binary_one_is_not():
    rng = random.Random(7)
    text = _text([f"step {i} loss 2.{i % 10}" for i in range(400)]).encode()
    garbage = bytes(rng.randrange(128, 256) for _ in range(len(text) // 5))  # a fifth of undecodable bytes
    mixed = bytearray(text)
    for k, b in enumerate(garbage):
        mixed[(k * 5 + 3) % len(mixed)] = b
    assert not looks_binary(bytes(mixed[:8192]))
    assert diagnose_lines(lines_of(bytes(mixed) + _text(CRASH).encode())).state == "CRASHED"
    assert looks_binary(rng.randbytes(8192))


def test_sniffing_names_the_codec():
    assert sniff_codec(codecs.BOM_UTF32_LE + "x".encode("utf-32-le")) == "utf-32"  # UTF-32 LE starts as UTF-16 LE's BOM
    assert sniff_codec("step 1 loss 2\n".encode("utf-16-le")) == "utf-16-le"
    assert sniff_codec(b"step 1 loss 2\n") == "utf-8"
    assert sniff_codec(b"\0" * 100) == "utf-8"  # a hole is no encoding


def test_a_huge_line_and_endless_redraws_are_read_in_bounded_time_and_memory(tmp_path):
    path = tmp_path / "train.log"
    with path.open("wb") as f:
        f.write(b"step 1 loss 2.3\n")
        f.write(b"x" * (30 << 20))  # 30 MB without a newline: a binary blob printed as text, a runaway print
        f.write(b"\n" + b"\r" * (1 << 20) + b"step 2 loss 2.2\n")
        f.write(_text(CRASH[2:]).encode())
    started = time.monotonic()
    tracemalloc.start()
    lines = read_log(path)
    v = diagnose_lines(lines)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert time.monotonic() - started < 30 and peak < 160 << 20
    assert v.state == "CRASHED" and v.reason == "KeyError"


def test_random_garbage_between_lines_never_raises():
    rng = random.Random(61)
    for _ in range(30):
        lines = []
        for _ in range(rng.randrange(1, 60)):
            kind = rng.random()
            if kind < 0.3:
                lines.append(rng.randbytes(rng.randrange(0, 200)).decode("latin-1"))
            elif kind < 0.6:
                lines.append(rng.choice(CRASH + [OOM, "(RayTrainWorker pid=1) x", "[pod/a/b] 2026-01-01T00:00:00Z y"]))
            else:
                lines.append("".join(rng.choice("[]():|/ \t\r\x1b01234abcXYZ=,.-") for _ in range(rng.randrange(80))))
        v = diagnose_lines(lines)
        assert v.state in EXIT_BY_STATE and v.evidence


def _cli(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "dflashctl", "diagnose", *args], input=stdin, capture_output=True, timeout=120, env=env
    )


def test_the_cli_reads_utf16_and_holes_and_refuses_a_nul_only_file_in_one_line(tmp_path):
    utf16 = tmp_path / "powershell.log"
    utf16.write_bytes(codecs.BOM_UTF16_LE + _text([*CRASH[:2], OOM], "\r\n").encode("utf-16-le"))
    r = _cli("--json", str(utf16))
    assert r.returncode == EXIT_BY_STATE["OOM"], r
    r = _cli("--json", "-", stdin=b"\0" * 4096 + _text(CRASH).encode())
    assert r.returncode == EXIT_BY_STATE["CRASHED"] and b"a hole of 4,096 NUL bytes" in r.stdout, r
    nul = tmp_path / "zeros.log"
    nul.write_bytes(b"\0" * 8192)
    r = _cli(str(nul))
    assert r.returncode == 2 and b"only NUL bytes" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r


def test_a_big_hole_on_a_stream_is_named_and_the_text_right_after_it_kept():
    """gzip'd or on stdin the reader goes forward: 40 MB of NULs, no newline, then the text the writer went on with."""
    data = b"\0" * (40 << 20) + _text(CRASH).encode()
    tracemalloc.start()
    lines = lines_of(data)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 128 << 20
    assert hole_of(lines[0]) == (0, 40 << 20) and lines[1:] == CRASH
