"""Pure: the prefixes launchers and loggers put before a process's own line, and the one step that removes them.

`LAUNCHERS` is the table: each launcher's prefix, what it names (a process rank, or a node, pod or worker) and a real
sample line. `strip_prefix` removes every prefix the table knows, in any nesting, with the timestamps loggers add and
the ANSI colours terminals get; what a progress bar drew before the text goes too. A launcher the table does not know
is learned from the log itself (`learn_prefix`): the leading span most lines share, read as a shape (words, numbers,
stamps, brackets), kept only where it names few streams (ranks, pods, hosts), never where it counts steps. Where a
prefix names a rank, the rank is taken from it; Ray's worker prefixes name a pid, mapped to the rank Ray Train printed
for it (`ray_ranks`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

RANK, NODE = "rank", "node"  # a process rank (torchrun, srun, mpirun) outranks a node, pod or worker name
# Which rank prefix wins where several name one: the global rank a process prints itself (torch's `[rankN]:`, mpirun's
# tag, Lightning's) over a launcher's task label (srun) over a node's local rank (torchrun --tee's `[0]:`, under torchx
# or SkyPilot on each node)
GLOBAL_FIRST = {"torchrun": 0, "mpirun_tag": 0, "lightning": 0, "srun_label": 1, "torchrun_tee": 2}


DIGITS, UPPER, LOWER = "0123456789", "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz"
FIRST_OF = {"srun_label": " " + DIGITS, "torchx": UPPER + LOWER + "_", "pdsh": LOWER}  # the rest start with [ or (


@dataclass(frozen=True)
class Launcher:
    """One launcher's prefix: its pattern (group `id` is the rank or name it gives), what the id is, a real sample,
    and the characters a line with this prefix can start with (a cheap test before the pattern)."""

    name: str
    kind: str
    pattern: re.Pattern[str]
    sample: str
    first: str


def _launcher(name: str, kind: str, pattern: str, sample: str) -> Launcher:
    first = pattern[2] if pattern[1:3] in ("\\[", "\\(") else FIRST_OF[name]
    return Launcher(name, kind, re.compile(pattern), sample, first)


# fmt: off
LAUNCHERS: tuple[Launcher, ...] = (
    _launcher("torchrun", RANK, r"^\[rank(?P<id>\d+)\]:\s?", "[rank3]: KeyError: 'x'"),
    # torchrun --tee: `[{role}{local_rank}]:`, role `default`, or empty as torchx's dist.ddp passes (`--role ''`)
    _launcher("torchrun_tee", RANK, r"^\[(?:[A-Za-z_][\w-]*?)?(?P<id>\d+)\]:",  # no space: the line follows
              "[default1]:[rank1]: ValueError: bad"),
    _launcher("srun_label", RANK, r"^ {0,3}(?P<id>\d{1,5}): ", "5: Traceback (most recent call last):"),
    _launcher("lightning", RANK, r"^\[rank: (?P<id>\d+)\] ",
              "[rank: 1] Monitored metric train_loss = tensor(nan) is not finite."),
    _launcher("mpirun_tag", RANK, r"^\[\d+,(?P<id>\d+)\]<std(?:out|err)>:\s?", "[1,3]<stderr>:Traceback"),
    # SkyPilot's multi-node run: `(head, rank=0, pid=N)`, `(worker1, rank=1, pid=N, ip=A)` (the Go runner: ip first)
    _launcher("skypilot", NODE, r"^\((?:head|worker\d+), rank=(?P<id>\d+)(?:, (?:pid=\d+|ip=[\w.:-]+))*\) ?",
              "(worker1, rank=1, pid=15406, ip=10.164.0.57) ***** train metrics *****"),
    # Ray's worker and task prefix, `(RayTrainWorker pid=N, ip=A)`; SkyPilot's single node `(task, pid=N)` and
    # `(setup pid=N)` share its shape
    _launcher("ray", NODE, r"^\((?:(?P<actor>[A-Za-z_][\w.-]*),? )?pid=(?P<id>\d+)(?:, ip=(?P<ip>[\w.:-]+))?\) ?",
              "(RayTrainWorker pid=1193, ip=10.244.4.193) Setting up process group for: env:// [rank=0, world_size=2]"),
    _launcher("raylet", NODE, r"^\((?P<id>raylet|autoscaler[^)]*|gcs_server)(?:, ip=[\w.:-]+)?\) ?",
              "(raylet) node_manager.cc:3069: 1 Workers (tasks / actors) killed due to memory pressure (OOM)"),
    _launcher("kubectl", NODE, r"^\[(?P<id>(?:pod/[^/\]\s]+/[^\]\s]*|node/[^\]\s]+))\] ",
              "[pod/llama-ft-worker-0/pytorch] 2026-12-04T10:12:40.118203913Z step 3 loss 2.0"),
    # torchx's log lines: `{role}/{replica} ` (green on a terminal)
    _launcher("torchx", NODE, r"^(?P<id>[A-Za-z_][\w-]*/\d+) (?=.)", "train/0 [0]:step 3 loss 2.0"),
    # pdsh's `host: ` (DeepSpeed's multi-node runner): a lower-case host name with a digit or a hyphen in it, or
    # localhost; never a Python exception's name (`torch.OutOfMemoryError: `), an identifier (`step_1: `) or a tool's
    # (`srun: `)
    _launcher("pdsh", NODE, r"^(?P<id>(?=[a-z0-9.-]*[\d-])[a-z][a-z0-9-]*(?:\.[a-z0-9-]+)*|localhost): (?=\S)",
              "worker-1: [2026-12-04 10:12:41,990] [ERROR] x"),
)
# fmt: on
STAMP_PREFIXES = (
    re.compile(r"^\[\d{4}-\d{2}-\d{2} [\d:,]+ [DIWEF] \d+ \d+\] (?:\(\w+\) )?"),  # Ray's C++ components (raylet)
    re.compile(r"^\[?[EWIFD]\d{4} [\d:.]+(?: +\d+)? \S+\]\s?"),  # glog (torch's C++ and Python logs)
    # ISO 8601 / RFC 3339 (kubectl --timestamps, Python's logging, Ray's): one space or tab after it, so that a
    # traceback's indentation stays
    re.compile(r"^\[?\d{4}-\d{2}-\d{2}[T _]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?\]?(?: [|-])?[ \t]"),
    re.compile(r"^\[?\d{2}:\d{2}:\d{2}(?:[.,]\d+)?\]?[ \t]"),  # also moreutils `ts -s` / `ts -i`
    re.compile(r"^[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d{2}:\d{2}:\d{2} \d{4}\s?"),  # mpirun --timestamp-output
    re.compile(r"^[A-Z][a-z]{2} [ \d]\d \d{2}:\d{2}:\d{2}(?:\.\d+)? "),  # moreutils `ts` (and syslog, journalctl)
    re.compile(r"^\d{10}(?:\.\d{1,9})? (?=\S)"),  # `ts %s` / `ts %.s`: seconds since the epoch
    re.compile(r"^[DIWEC] \d{2}-\d{2} \d{2}:\d{2}:\d{2}(?:\.\d+)? [\w.-]+:\d+\] "),  # SkyPilot's own logger
    re.compile(r"^\[(?:[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d{2}:\d{2}:\d{2} \d{4}|\s*\d+\.\d{6})\] ?"),  # dmesg
    re.compile(r"^[\w.-]+\.exe : (?=\S)"),  # Windows PowerShell's ErrorRecord of a native command's stderr line
)
# What each stamp can start with, in STAMP_PREFIXES' order: a line is tried only against those its first character fits
STAMP_FIRST = (
    "[",
    "[EWIFD",
    "[" + DIGITS,
    "[" + DIGITS,
    UPPER,
    UPPER,
    DIGITS,
    "DIWEC",
    "[",
    UPPER + LOWER + DIGITS + "_.-",
)
BY_FIRST = {
    chr(c): (
        tuple(la for la in LAUNCHERS if chr(c) in la.first),
        tuple(p for p, f in zip(STAMP_PREFIXES, STAMP_FIRST) if chr(c) in f),  # noqa: B905 (3.8: no strict=)
    )
    for c in range(128)
}
NONE_FIRST: tuple[tuple, tuple] = ((), ())
# A tqdm progress bar that the next message was written onto (`Epoch 2: 100%|####| 9/9 [00:01<00:00]Traceback ...`)
PROGRESS_BAR = re.compile(r"^[^|\r]{0,80}?(?:\d{1,3}%\|[^|]*\|[^\[\]]*|\d+it ?)\[[^\]]*\]\s*(?=\S)")
ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
RAY_DEDUP = re.compile(r"\s*\[repeated \d+x across cluster\](?: \(Ray deduplicates logs by default\..*)?$")
HOLE = "\0"  # a line the reader put where NUL bytes were (decode.py): no prefix, its own stream


@dataclass(frozen=True)
class Learned:
    """Prefixes learned from one log: one pattern per shape its lines share."""

    patterns: tuple[re.Pattern[str], ...]

    def match(self, line: str) -> re.Match[str] | None:
        for p in self.patterns:
            m = p.match(line)
            if m:
                return m
        return None


def strip_prefix(line: str, learned: Learned | None = None) -> tuple[str | None, str]:
    """(the stream a launcher named, the process's own text): every launcher and timestamp prefix removed (a process
    rank outranks a node's name), ANSI colours, Ray's deduplication note, and what a progress bar drew before the text
    on the same line (`\r` redraws, a bar the message was written onto)."""
    if "\x1b" in line:
        line = ANSI.sub("", line)
    if "[repeated " in line:
        line = RAY_DEDUP.sub("", line)
    rank, node, level = None, None, 9
    for _ in range(8):
        launchers, stamps = BY_FIRST.get(line[:1], NONE_FIRST)
        m, launcher = _launcher_match(line, launchers, rank or node)
        if m:
            if launcher.kind == RANK:
                better = rank is None or GLOBAL_FIRST.get(launcher.name, 1) < level
                rank, level = (f"rank{int(m['id'])}", GLOBAL_FIRST.get(launcher.name, 1)) if better else (rank, level)
            else:
                node = node or _node_name(m, launcher)
            line = line[m.end() :]
            continue
        stamp = next((s for p in stamps if (s := p.match(line))), None)
        if stamp:
            line = line[stamp.end() :]
            continue
        if "\r" in line:
            shown = [seg for seg in line.split("\r") if seg.strip()]
            line = shown[-1] if shown else ""
            continue
        bar = ("%|" in line or "it [" in line) and len(line) < 4096 and PROGRESS_BAR.match(line)
        if bar:
            line = line[bar.end() :]
            continue
        got = learned.match(line) if learned else None
        if got and got.end():
            node = node or _learned_name(got)
            line = line[got.end() :]
            continue
        break
    return rank or node, line


def _launcher_match(
    line: str, launchers: tuple[Launcher, ...], named: str | None
) -> tuple[re.Match[str] | None, Launcher]:
    """The first launcher prefix at the start of the line; pdsh's host only where nothing was named yet."""
    for launcher in launchers:
        if launcher.name == "pdsh" and (named or ": " not in line[:80]):
            continue
        m = launcher.pattern.match(line)
        if m:
            return m, launcher
    return None, LAUNCHERS[0]


def _node_name(m: re.Match[str], launcher: Launcher) -> str:
    """A node-level prefix's name: SkyPilot's rank as `rankN`, Ray's pid (with its node's address), else its text."""
    if launcher.name == "skypilot":  # the node's rank: one process per node unless a rank prefix follows
        return f"rank{int(m['id'])}"
    if launcher.name == "ray":
        return f"pid{m['id']}@{m['ip']}" if m["ip"] else f"pid{m['id']}"
    return m["id"]


# Ray Train's own word on which worker is which rank: the worker's `Setting up process group for: env:// [rank=0, ...`
# under its prefix, and the trainer's `- (node_id=..., ip=A, pid=P) world_rank=0, ...` list
RAY_GROUP = re.compile(r"^Setting up process group for: \S+ \[rank=(\d+), world_size=\d+\]")
RAY_WORLD = re.compile(r"^- \((?:node_id=\w+, )?ip=([\w.:-]+), pid=(\d+)\) world_rank=(\d+)")


def ray_ranks(plain: list[str], streams: list[str | None]) -> dict[str, str]:
    """Ray worker streams (`pid123`, `pid123@10.0.0.2`) -> the rank Ray Train printed for that worker."""
    found: dict[str, str] = {}
    for text, stream in zip(plain, streams):  # noqa: B905 (3.8: no strict=)
        if text.startswith("Setting up process group") and stream and (m := RAY_GROUP.match(text)):
            found[stream] = f"rank{m[1]}"
        elif text.startswith("- (") and (m := RAY_WORLD.match(text)):
            found[f"pid{m[2]}@{m[1]}"] = found[f"pid{m[2]}"] = f"rank{m[3]}"
    return found


# Learning a prefix: a line's leading span up to the first closing mark followed by a space, as tokens; dates and
# times are free (they change on every line), words name the stream where they vary
DATE = r"\d{1,4}[-/.]\d{1,2}[-/.]\d{1,4}(?:[T ]\d{1,2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?"
TIME = r"\d{1,2}:\d{2}:\d{2}(?:[.,]\d+)?"
WORD = r"[A-Za-z0-9_.@+-]+"
TOKEN = re.compile(f"(?P<D>{DATE})|(?P<T>{TIME})|(?P<W>{WORD})|(?P<S>[ \\t]+)|(?P<P>[^\\sA-Za-z0-9_.@+-])")
FREE = {"D": DATE, "T": TIME}
CLOSERS = "])>}|:"
SAMPLE, MIN_LINES, COVERAGE, MAX_SHAPES = 300, 8, 0.6, 4
# Words a launcher's prefix never holds: a log level, a counter of progress, an exception's name
NOT_A_PREFIX = re.compile(
    r"(?i)^(?:info|warn(?:ing)?|error|debug|critical|fatal|notice|trace|loss|step|steps|iter|"
    r"iteration|epoch|train|eval|val|batch|\w*(?:error|exception|warning))$"
)
RANK_IN = re.compile(r"(?i)\brank\s*[=:#_ -]?\s*(\d+)\b|\brank(\d+)\b")


def learn_prefix(lines: list[str]) -> Learned | None:
    """The prefixes an unknown launcher put before most lines: the shapes of the leading spans that the table's prefixes
    leave, where one shape (or a few) covers most lines and names few streams. None when the lines share none."""
    nonblank = [ln for ln in lines if ln.strip()]
    sample = nonblank if len(nonblank) <= 2 * SAMPLE else nonblank[:SAMPLE] + nonblank[-SAMPLE:]
    if len(sample) < MIN_LINES:
        return None
    shapes: dict[tuple, list[list[tuple[str, str]]]] = {}
    for ln in sample:
        span = _span(strip_prefix(ln)[1])
        if span:
            shapes.setdefault(tuple(k if k != "P" else v for k, v in span), []).append(span)
    ranked = sorted(shapes.values(), key=len, reverse=True)[:MAX_SHAPES]
    kept = [spans for spans in ranked if len(spans) >= max(3, len(sample) // 10) and _streams_few(spans)]
    if sum(len(s) for s in kept) < COVERAGE * len(sample):
        return None
    patterns = tuple(p for spans in kept if (p := _pattern(spans)))
    return Learned(patterns) if patterns else None


def _span(text: str) -> list[tuple[str, str]] | None:
    """The tokens of a line's leading span through its first closing mark followed by a space, or None."""
    if not text or text[0] in " \t" or len(text) < 3:
        return None
    out: list[tuple[str, str]] = []
    for m in TOKEN.finditer(text, 0, 80):
        kind, value = m.lastgroup or "P", m.group()
        out.append((kind, value))
        if kind == "P" and value in CLOSERS and text[m.end() : m.end() + 1] in (" ", "\t"):
            return out + [("S", text[m.end()])] if len(out) <= 12 else None
        if len(out) > 12:
            return None
    return None


def _streams_few(spans: list[list[tuple[str, str]]]) -> bool:
    """A launcher names few streams (ranks, pods, hosts) over many lines; a counter names a new value on each line.
    A shape whose words are levels, counters or exception names is the text, not a prefix; a shape that names
    nothing must end in a bracket or a bar (`prog[pid]: ` too, never `word: `, which is how text starts)."""
    columns = list(zip(*spans))  # noqa: B905 (3.8: no strict=; one shape, one length)
    words = [col for col in columns if col[0][0] == "W"]
    if any(NOT_A_PREFIX.match(v) for col in words for _, v in col):
        return False
    varying = [col for col in words if len({v for _, v in col}) > 1]
    names = {tuple(col[i][1] for col in varying) for i in range(len(spans))}
    if len(names) > max(8, len(spans) // 4):
        return False
    closer = [v for _, v in spans[0][-3:-1]]  # the closing mark, and the token before it
    return bool(varying) or closer[-1] in "])>}|" or closer[0] in "])>}"  # `name | `, `[name] `, `prog[pid]: `


def _pattern(spans: list[list[tuple[str, str]]]) -> re.Pattern[str] | None:
    """A shape as a regex: its constant words literal, its varying words any word, stamps any stamp, one space after."""
    parts = []
    for i, col in enumerate(zip(*spans)):  # noqa: B905 (3.8: no strict=)
        kind, value = col[0]
        if kind == "W":
            parts.append(re.escape(value) if len({v for _, v in col}) == 1 else f"(?P<v{i}>{WORD})")
        elif kind in FREE:
            parts.append(FREE[kind])
        elif kind == "S":
            parts.append(r"[ \t]+")
        else:
            parts.append(re.escape(value))
    parts[-1] = r"[ \t]"  # the one space after the closing mark: a frame's own indentation stays
    return re.compile("^" + "".join(parts))


def _learned_name(m: re.Match[str]) -> str | None:
    """The stream a learned prefix names: `rankN` where it says rank, else its words where some of them vary from
    line to line (`worker 3`, `trainer-1`); None where it names nothing (the same words on every line)."""
    span = m.group()
    r = RANK_IN.search(span)
    if r:
        return f"rank{int(r[1] or r[2])}"
    if not any(v for k, v in m.groupdict().items() if k[:1] == "v"):
        return None
    return " ".join(t.group() for t in TOKEN.finditer(span) if t.lastgroup == "W")
