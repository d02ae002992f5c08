"""Pure: a log read through its prefixes (`Log`): each line's stream and text, the tracebacks of each stream, and
the root cause the launchers name (torchrun's summary, the other launchers' exit lines). The rules that name a failure
from it are logs.py's.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field

from .decode import HOLE
from .prefixes import learn_prefix, ray_ranks, strip_prefix
from .signatures import CASCADE_SIGS, SIG

FLEX_FRAME = re.compile(r"flex_attention|_guarded_flex|sdpa_dense|math_attention")

# Exceptions that, raised before the first step, come back identically on every restart (a missing module or file)
START_ERRORS = re.compile(
    r"^(ModuleNotFoundError|ImportError|FileNotFoundError|SyntaxError|IsADirectoryError|"
    r"PermissionError|NotADirectoryError|IndentationError|OSError)\b"
)
# Exceptions that follow from another failure: a wrapper's summary, a signal sent to the survivors, a peer gone
CONSEQUENCE = re.compile(
    r"(ChildFailedError|SignalException|got signal: \d+|KeyboardInterrupt|SystemExit|"
    r"ProcessExitedException|ProcessRaisedException|process \d+ terminated with signal SIGTERM|"
    r"CalledProcessError|TrainingFailedError|RayActorError|ActorDiedError|"
    r"WorkerGroupError)"
)
# Ray's wrapper of a worker's exception (`ray.exceptions.RayTaskError(RuntimeError): ray::...`): the worker's frames and
# its own exception line follow it
RAY_WRAPPER = re.compile(r"^(?:ray\.exceptions\.)?RayTaskError(?:\([\w.]+\))?: (?:\x1b\[\d+m)?ray::")
# Windows PowerShell's ErrorRecord around a native command's first stderr line (`python.exe : Traceback ...`)
POWERSHELL_RECORD = re.compile(r"^(?:At line:\d+ char:\d+$|\+ )")
# Ray Train's WorkerGroupError: each failed worker's traceback, cut to its last lines, under its rank
RAY_SNIPPET = re.compile(r"^\[Rank (\d+) Error Snippet\]:$")
RAY_PID = re.compile(r"\bpid=(\d+)|Worker PID: (\d+)")

# A process ended by SIGABRT: its own crash, unless the collective layer aborted it (below)
ABORT = re.compile(
    r"(exitcode\s*:\s*-6\b|SIGABRT|Aborted \(core dumped\)|^Aborted$|Fatal Python error: Aborted|"
    r"return code = -6\b|terminated with code -6\b|exited on signal 6\b|"
    r"terminate called after throwing)"
)
# ProcessGroupNCCL's watchdog ending its process: the C++ exception it throws, or the what() line under `terminate`
COLLECTIVE_ABORT = re.compile(
    r"instance of 'c10::DistBackendError|what\(\):.*(?:[Ww]atchdog|ProcessGroupNCCL|NCCL|"
    r"collective)"
)
# What ends a rank from outside its own code: a collective timed out, the network broke, a peer or a node was lost
COLLECTIVE_CAUSES = ("nccl_timeout", "nccl_network", "slurm_node_fail")  # and a lost peer, where the watchdog aborted

NEWLINE = re.compile(rb"\n")
SIGNAL_NAMES = {1: "SIGHUP", 2: "SIGINT", 6: "SIGABRT", 7: "SIGBUS", 9: "SIGKILL", 11: "SIGSEGV", 15: "SIGTERM"}

# The start of an attempt: run.sh's line, and torchrun restarting its worker group
ATTEMPT_START = re.compile(r"^\[dflashctl\] \S+ start\b|will restart worker group")


@dataclass
class Finding:
    state: str
    reason: str
    evidence: list[str] = field(default_factory=list)
    rank: str | None = None  # the stream ("rank3") the failure came from, where the log says
    early: bool = False  # a start error (missing module or file) with no training progress before it
    advice: str | None = None  # what to do, where the signature says more than its state's advice

    def __post_init__(self) -> None:
        if self.rank is not None and not re.fullmatch(r"rank\d+", self.rank):
            self.rank = None  # a host's stream (pdsh) names no rank: its name is in the reason


@dataclass
class Log:
    """A log read through its prefixes: the original lines, their text, and the stream of each."""

    raw: list[str]
    plain: list[str]
    streams: list[str | None]
    names: dict[str, str] = field(default_factory=dict)  # Ray's worker pids -> the rank Ray Train gave them
    _hits: dict[str, list[int]] = field(default_factory=dict, repr=False)
    _low: bytes | None = field(default=None, repr=False)  # the text, lower-cased, one line per line
    _newlines: list[int] = field(default_factory=list, repr=False)  # where each line of _low ends
    _tracebacks: list[Traceback] | None = field(default=None, repr=False)

    @classmethod
    def of(cls, text: str | list[str]) -> Log:
        """Each line's stream and text, through the table's prefixes and the ones learned from these lines; a hole
        the reader marked is a stream of its own (it breaks no traceback); Ray's workers are named by their rank."""
        raw = text.splitlines() if isinstance(text, str) else list(text)
        learned = learn_prefix(raw)
        pairs = [(HOLE, ln) if ln[:1] == HOLE else strip_prefix(ln, learned) for ln in raw]
        plain, streams = [p[1] for p in pairs], [p[0] for p in pairs]
        names = ray_ranks(plain, streams) if any(s and s[:3] == "pid" for s in streams) else {}
        if names:
            streams = [names.get(s, names.get(s.split("@")[0], s)) if s and s[:3] == "pid" else s for s in streams]
        return cls(raw, plain, streams, names)

    def hits(self, name: str) -> list[int]:
        """The lines a signature matches (computed once per log): its pattern runs on the lines its needles are in."""
        if name not in self._hits:
            sig = SIG[name]
            pattern, unless, plain = sig.pattern, sig.unless, self.plain
            lines = self._holding(sig.needles) if sig.needles else range(len(plain))
            self._hits[name] = [
                i for i in lines if pattern.search(plain[i]) and not (unless and unless.search(plain[i]))
            ]
        return self._hits[name]

    def _holding(self, needles: tuple[str, ...]) -> list[int] | range:
        """The lines any of these lower-case words is in: a plain search of the whole text per word."""
        if self._low is None:
            text = "\n".join(self.plain)
            self._low = text.encode("utf-8", errors="replace").lower()
            self._newlines = [m.start() for m in NEWLINE.finditer(self._low)]
        if len(self._newlines) != len(self.plain) - 1 and self.plain:
            return range(len(self.plain))  # a line holds a newline of its own: read them all
        found: set[int] = set()
        for needle in needles:
            word = needle.encode()
            at = self._low.find(word)
            while at >= 0:
                line = bisect.bisect_left(self._newlines, at)
                found.add(line)
                at = self._low.find(word, self._newlines[line] + 1) if line < len(self._newlines) else -1
        return sorted(found)

    def rank_of(self, indices: list[int]) -> str | None:
        return next((self.streams[i] for i in indices if self.streams[i]), None)

    def rank_only(self, indices: list[int]) -> str | None:
        """The first rank (`rankN`) these lines came from; a node's, pod's or daemon's name is none."""
        return next((s for i in indices if (s := self.streams[i]) and s[:4] == "rank"), None)


def this_attempt(lines: list[str]) -> list[str]:
    """The lines of the newest attempt: an earlier attempt's failure was judged (and restarted) already."""
    maybe = [i for i, ln in enumerate(lines) if "[dflashctl]" in ln or "worker group" in ln]
    learned = learn_prefix(lines) if maybe else None
    starts = [i for i in maybe if ATTEMPT_START.search(strip_prefix(lines[i], learned)[1])]
    return lines[starts[-1] :] if starts else lines


@dataclass
class Traceback:
    stream: str
    exception: str
    frames: list[str]  # "File ..." lines, innermost last
    code: list[str]  # the source lines shown under the frames
    at: int  # index of the exception line
    flex: bool = False  # a frame passes through flex attention
    ignored: bool = False  # Python printed it under "Exception ignored in: ..." (a __del__ at exit): no failure

    @property
    def consequence(self) -> bool:
        """Raised because something else failed: a wrapper's summary, a signal, a peer gone, a CASCADE line."""
        exc = self.exception
        return bool(
            CONSEQUENCE.search(exc)
            or SIG["nccl_network"].pattern.search(exc)
            or any(s.pattern.search(exc) for s in CASCADE_SIGS)
        )


def tracebacks_of(log: Log, stream: str | None) -> list[Traceback]:
    """A stream's tracebacks; one that the log ends inside (no exception line yet) has an empty `exception`."""
    idx = [i for i, s in enumerate(log.streams) if s == stream]
    found, k = [], 0
    while k < len(idx):
        head = log.plain[idx[k]]
        snippet = RAY_SNIPPET.match(head)
        if not (snippet or head.startswith("Traceback (most recent call last)")):
            k += 1
            continue
        frames, code, exc, wrapped = [], [], None, f"rank{snippet[1]}" if snippet else None
        ignored = k > 0 and log.plain[idx[k - 1]].startswith("Exception ignored in")
        k += 1
        while k < len(idx):
            ln = log.plain[idx[k]]
            if ln.startswith("Traceback (most recent call last)") or RAY_SNIPPET.match(ln):
                break
            if ln.startswith("  File "):
                frames.append(ln.strip())
            elif ln.startswith(" ") or not ln.strip():
                if ln.strip() and not set(ln.strip()) <= set("^~ "):
                    code.append(ln.strip())
            elif ln.startswith(("During handling of", "The above exception")) or POWERSHELL_RECORD.match(ln):
                pass
            elif RAY_WRAPPER.match(ln):  # Ray's wrapper: the worker's own frames and exception follow; its pid's rank
                pid = RAY_PID.search(ln)
                wrapped = log.names.get(f"pid{''.join(pid.groups(''))}", wrapped) if pid else wrapped
            else:
                exc = (ln.strip(), idx[k])
                k += 1
                break
            k += 1
        if exc or (frames and k >= len(idx)):
            named = stream if stream and stream[:4] == "rank" else wrapped or stream
            tb = Traceback(
                named or "", exc[0] if exc else "", frames, code, exc[1] if exc else idx[-1], ignored=ignored
            )
            tb.flex = any(FLEX_FRAME.search(f) for f in frames + code)
            found.append(tb)
    return found


def root_cause(log: Log) -> tuple[str | None, int | None]:
    """torchrun's summary names the first failing rank and its exit code ("Root Cause ... rank : 3 (local_rank: 3)
    ... exitcode : -9"); the other launchers' exit lines (`launcher_exit`) and srun's `task N: Exited with exit code C`
    name theirs. A code below zero is the signal that ended the process."""
    for i, ln in enumerate(log.plain):
        if ln.startswith("Root Cause"):
            rank = code = None
            for nxt in log.plain[i : i + 10]:
                if rank is None and (m := re.search(r"rank\s*:\s*(\d+)", nxt)):
                    rank = f"rank{m[1]}"
                if code is None and (m := re.search(r"exitcode\s*:\s*(-?\d+)", nxt)):
                    code = int(m[1])
            return rank, code
    for i in log.hits("launcher_exit"):
        who, code = launcher_exit(log, i)
        if code is not None:
            return who, code
    for i in log.hits("srun_task_exit"):
        m = SIG["srun_task_exit"].pattern.search(log.plain[i])
        return f"rank{re.split('[,-]', m[2])[0]}", int(m[3])
    return None, None


def launcher_exit(log: Log, i: int) -> tuple[str | None, int | None]:
    """(who, exit code or minus the signal) from one launcher's exit line: DeepSpeed's `exits with return code = -9`
    (its command names the last rank started, not the failed one: no rank), Lightning's `[rank: 1] Child process ...
    terminated with code -9`, Open MPI's `process rank 3 ... exited on signal 9` and its `Process name: [[j,1],3]` /
    `Exit code: 1` pair, pdsh's `pdsh@h: node1: ssh exited with exit code 137` (128 + a signal), accelerate's
    CalledProcessError, torch.multiprocessing's `process 1 terminated with signal SIGKILL` and SkyPilot's `Job 1 failed
    with return code list: [137, 1]` (137: the nodes SkyPilot cleaned up after the one that failed)."""
    ln = log.plain[i]
    if m := re.search(r"exits with return code = (-?\d+)", ln):
        return log.streams[i], int(m[1])
    if m := re.search(r"(?:\[rank: (\d+)\] )?Child process with PID \d+ terminated with code (-?\d+)", ln):
        return (f"rank{m[1]}" if m[1] else log.streams[i]), int(m[2])  # Lightning's `[rank: N] ` may be stripped
    if m := re.search(r"process rank (\d+) with PID \d+ on node \S+ exited on signal (\d+)", ln):
        return f"rank{m[1]}", -int(m[2])
    if m := re.search(r"(?:pdsh@\S+: )?(\S+): ssh exited with exit code (\d+)", ln):
        code = int(m[2])  # a shell's 128 + N, or a Python launcher's sys.exit(-N) (256 - N), is signal N
        return m[1], -(code - 128) if 128 < code < 160 else -(256 - code) if 224 <= code < 255 else code
    if m := re.search(r"died with <Signals\.\w+: (\d+)>|returned non-zero exit status (\d+)", ln):
        return log.streams[i], -int(m[1]) if m[1] else int(m[2])
    if m := re.search(r"process (\d+) terminated with (?:exit code (\d+)|signal (SIG\w+))", ln):
        signals = {name: n for n, name in SIGNAL_NAMES.items()}
        return f"rank{m[1]}", int(m[2]) if m[2] else -signals.get(m[3], 0) or None
    if m := re.search(r"failed with return code list:.{0,12}\[([-\d, ]+)\]", ln):  # SkyPilot: one code per node
        codes = [int(c) for c in m[1].replace(" ", "").split(",") if c]
        code = next((c for c in codes if c not in (0, 137)), 137 if 137 in codes else None)
        return None, -9 if code == 137 else code
    if m := re.search(r"Process name:\s*\[\[\d+,\d+\],(\d+)\]", ln):
        code = next(
            (int(c[1]) for nxt in log.plain[i + 1 : i + 4] if (c := re.search(r"Exit code:\s*(-?\d+)", nxt))), None
        )
        return f"rank{m[1]}", code
    return log.streams[i], None


def signal_name(code: int) -> str:
    return f"signal {-code} ({SIGNAL_NAMES[-code]})" if -code in SIGNAL_NAMES else f"signal {-code}"


def collective_cause(log: Log) -> bool:
    """The log shows what ends a rank from outside its own code: a timed-out collective, a broken network, a lost
    node, or a lost peer that the watchdog then aborted on."""
    return any(log.hits(name) for name in COLLECTIVE_CAUSES) or bool(lost_peer_abort(log))


def collective_abort(log: Log, i: int) -> bool:
    """Line i reports a SIGABRT that the collective layer caused: ProcessGroupNCCL's watchdog throwing its
    DistBackendError (its `terminate called` line, with the `what():` under it), or the bare SIGABRT reports (exit -6,
    `Aborted`) when no other exception was thrown. Only where the log shows a collective cause."""
    ln = log.plain[i]
    if not ABORT.search(ln):
        return False
    if "terminate called" not in ln:
        thrown = [j for j in log.hits("fatal_signal") if "terminate called" in log.plain[j]]
        return not any(not collective_abort(log, j) for j in thrown)  # no other exception ended a rank
    stream = log.streams[i]
    after = [log.plain[j] for j in range(i, min(len(log.plain), i + 40)) if log.streams[j] == stream][:4]
    return any(COLLECTIVE_ABORT.search(a) for a in after)


def own_native(log: Log) -> list[int]:
    """The CUDA errors and fatal signals that are a rank's own failure, in log order: where the log shows a collective
    cause, the aborts it caused (the watchdog's `terminate called ... DistBackendError`, exit -6) are not."""
    native = sorted(set(log.hits("cuda_error") + log.hits("fatal_signal")))
    if not collective_cause(log):
        return native
    return [i for i in native if not collective_abort(log, i)]


def tracebacks(log: Log) -> list[Traceback]:
    """Every stream's tracebacks, root causes first: a rank's own exception before a consequence (torchrun's
    ChildFailedError, a SIGTERM, a peer gone), the root-cause rank torchrun or srun names first, then the earliest.
    A traceback the log ends inside is left out (`cut_traceback`)."""
    if log._tracebacks is None:
        found = [
            tb for s in dict.fromkeys(log.streams) for tb in tracebacks_of(log, s) if tb.exception and not tb.ignored
        ]
        root = root_cause(log)[0]
        found.sort(key=lambda tb: (tb.consequence, tb.stream != root if root else False, tb.at))
        log._tracebacks = found
    return log._tracebacks


def lost_peer_abort(log: Log) -> list[int]:
    """A lost peer (gloo's `Connection closed by peer`, `NCCL communicator was aborted`, ...) where the watchdog then
    threw its DistBackendError: the peer lines, or []."""
    lost = log.hits("peer_lost")
    if not lost:
        return []
    thrown = [i for i in log.hits("fatal_signal") if "terminate called" in log.plain[i] and collective_abort(log, i)]
    return lost if thrown else []
