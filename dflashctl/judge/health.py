"""Pure: from what the probes saw so far, decide what state a job is in, with the evidence and what to do next.

No I/O here. `classify_log` reads any log text (a train.log, a tmux capture, a SLURM output); `assess` combines it with
the snapshots' facts (pane, exit code, metrics records, heartbeat, throughput history) into a `Verdict`.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import asdict, dataclass, field

SLURM_ENDS = ("TIMEOUT", "PREEMPTED", "NODE_FAIL", "CANCELLED")  # Slurm's own ends of a job, as states
FAILURES = ("DENSE_FALLBACK", "RECOMPILE_LIMIT", "OOM", "NCCL_TIMEOUT", "CRASHED", "CONFIG_ERROR", "STALLED", "LOST",
            "PROBE_FAILED", "KILL_FAILED", "DIVERGED", "GPU_FAULT", "HOST_OOM", "DISK_FULL", *SLURM_ENDS)  # fmt: skip
TERMINAL = ("FINISHED", "DENSE_FALLBACK", "RECOMPILE_LIMIT", "OOM", "NCCL_TIMEOUT", "CRASHED", "CONFIG_ERROR", "LOST",
            "PROBE_FAILED", "KILLED", "KILL_FAILED", "DIVERGED", "GPU_FAULT", "HOST_OOM", "DISK_FULL",
            *SLURM_ENDS)  # fmt: skip
STOP_RESULT_GRACE_S = 120.0  # after grace_s, how long a kill may take to record its result before it is presumed dead
ADVICE = {
    "DENSE_FALLBACK": "flex_attention ran, or was about to run, without compile: check TORCH_COMPILE_DISABLE, the "
    "recompile limit and the preflight buckets. Not restarted: it would repeat.",
    "RECOMPILE_LIMIT": "shapes vary more than the compiled buckets allow: fix the bucketing or raise "
    "attention.recompile_limit. Not restarted: it would repeat.",
    "OOM": "lower data.batch_size or anchors_per_seq, turn on drafter.activation_checkpointing, or drop the largest "
    "bucket.",
    "NCCL_TIMEOUT": "a rank hung or died inside a collective: read the other ranks' lines and check the GPUs; a "
    "restart with --resume usually helps.",
    "CRASHED": "fix the exception shown; where it was transient, a restart resumes from the newest checkpoint.",
    "CONFIG_ERROR": "fix the config key, module or file named; the job did not start training. Not restarted: it "
    "would repeat.",
    "STALLED": "read `dflashctl logs` and dump the processes (py-spy); a restart resumes from the newest checkpoint.",
    "LOST": "the tmux session or the run dir disappeared (reboot, or killed by someone): relaunch it.",
    "UNREACHABLE": "the host does not answer; the job's last known state is kept until it does.",
    "PROBE_FAILED": "the host answered but the probe failed there: check the host's `python:` setting and its "
    "disk; the error is shown.",
    "KILL_FAILED": "run `dflashctl kill` again on this job: it retries the same job and names what survived.",
    "STOPPING": "a stop was requested (`dflashctl kill`); no watcher restarts this job.",
    "DIVERGED": "the loss or the gradient norm is NaN/inf: lower optim.lr, check the data and the target's dtype; "
    "resume from the checkpoint before the divergence (no non-finite one is kept). Not restarted by default: it "
    "would diverge again.",
    "GPU_FAULT": "a GPU failed in hardware (ECC, Xid, fallen off the bus): relaunch on other GPUs (`gpus:`) and have "
    "the GPU checked (`nvidia-smi -q -d ECC,PAGE_RETIREMENT`). Never restarted onto that GPU.",
    "HOST_OOM": "the host ran out of RAM and the kernel killed a rank: lower host RAM per rank (fewer dataloader "
    "workers, smaller prefetch, no host copies of the target) or use fewer ranks per host.",
    "DISK_FULL": "the run dir's file system is full: free space (old checkpoints, inductor caches) or lower "
    "checkpoint.keep; not restarted while the disk is still full.",
    "PENDING": "the job waits in Slurm's queue for the reason shown (Priority, Resources, ReqNodeNotAvail, ...); "
    "`squeue --start -j ID` estimates when it starts.",
    "TIMEOUT": "the job ran out of its wall time (sbatch --time): a restart resubmits it with --resume from the "
    "newest checkpoint; ask for a longer `time:` to need fewer.",
    "PREEMPTED": "the scheduler took the nodes for a job of higher priority: a restart resubmits with --resume.",
    "NODE_FAIL": "a node of the allocation failed: a restart resubmits with --resume, excluding that node.",
    "CANCELLED": "the Slurm job was cancelled outside dflashctl (scancel, an administrator): relaunch it if that was "
    "not meant. Not restarted: someone stopped it on purpose.",
}

RANK_PREFIX = re.compile(r"^\[rank(\d+)\]:\s?")
TIMESTAMP_PREFIX = re.compile(r"^[EWI]\d{4} [\d:.]+ \d+ \S+\] ")
OOM = re.compile(r"(CUDA out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED|CUDA error: out of memory|"
                 r"HIP out of memory)")  # fmt: skip
OOM_SIZES = re.compile(r"Tried to allocate ([\d.]+) (MiB|GiB|TiB).*?total capacity of ([\d.]+) (MiB|GiB|TiB)")
NCCL = re.compile(
    r"(Watchdog caught collective operation timeout|NCCL watchdog|ProcessGroupNCCL.*[Tt]imeout|"
    r"NCCL communicator was aborted|Some NCCL operations have failed or timed out|DistBackendError.*[Tt]imeout)"
)
RECOMPILE = re.compile(r"torch\._dynamo hit config\.(recompile_limit|cache_size_limit)")
EAGER_FLEX = re.compile(r"flex_attention called without torch\.compile")
DENSE = re.compile(r"DenseFallbackError")
CONFIG = re.compile(r"^config error: ")
FLEX_FRAME = re.compile(r"flex_attention|_guarded_flex|sdpa_dense|math_attention")
UNITS = {"MiB": 1 / 1024, "GiB": 1.0, "TiB": 1024.0}
# Exceptions that, raised before the first step, come back identically on every restart (a missing module or file)
# Exceptions that, raised before the first step, come back identically on every restart (a missing module or file)
START_ERRORS = re.compile(r"^(ModuleNotFoundError|ImportError|FileNotFoundError|SyntaxError|IsADirectoryError|"
                          r"PermissionError|NotADirectoryError|IndentationError|OSError)\b")  # fmt: skip
EARLY_S = 300.0  # a command job (no step records) counts as "before its first step" for this long
# A line that reports a training loss, and the value it reports ("loss nan", "loss: inf", "'loss': NaN", "loss=-inf")
LOSS_VALUE = re.compile(r"(?<![A-Za-z])(?:loss|grad_?norm|grad norm)['\"]?\s*[:=]?\s*['\"]?"
                        r"(nan|[-+]?inf(?:inity)?|[-+]?\d[\d.eE+-]*)\b", re.I)  # fmt: skip
DIVERGED_LINES = 3  # non-finite loss lines in a row, the newest loss line among them, make a divergence
# Hardware: ECC, a GPU gone from the bus or lost, uncorrectable NVLink errors, and the kernel driver's Xid reports
GPU_HW = re.compile(r"(uncorrectable ECC error|ECC_UNCORRECTABLE|ECCUncorrectable|fallen off the bus|GPU is lost|"
                    r"GPU_IS_LOST|uncorrectable NVLink error|row remapp\w* failure|double bit ECC|"
                    r"Unable to determine the device handle for GPU)", re.I)  # fmt: skip
# An error that says the loss or a gradient is NaN/inf (anomaly detection, a framework's own check)
NAN_ERROR = re.compile(r"(returned nan values|Loss is (?:NaN|nan|inf)|loss is not finite|non-finite loss|"
                       r"Detected (?:NaN|nan|inf) in|grad norm is (?:nan|inf))", re.I)  # fmt: skip
# The same failure on every restart: the software or the machine does not fit the job (before any training step)
SETUP_ERRORS = re.compile(r"(no kernel image is available for execution|No CUDA GPUs are available|"
                          r"Found no NVIDIA driver|CUDA driver version is insufficient)")  # fmt: skip
# A dataloader worker killed by the kernel: the classic host OOM, with a Python error of the main process around it
DATALOADER_KILLED = re.compile(r"DataLoader worker \(pid\(?s?\)? ?[\d, ]+\)? is killed by signal: Killed")
XID = re.compile(r"NVRM: Xid \((?:PCI:)?([0-9a-fA-F:.]+)\): (\d+)")
HARDWARE_XIDS = {48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 121, 140}  # the rest are the application's own
ENOSPC = re.compile(r"(No space left on device|\[Errno 28\]|ENOSPC|StorageFull|Disk quota exceeded|\[Errno 122\]|"
                    r"EDQUOT)")  # fmt: skip
WRITE_FAILED = re.compile(r"(PytorchStreamWriter failed writing file|file write failed|unexpected pos \d+ vs \d+|"
                          r"Error while serializing)")  # fmt: skip
# A process killed by SIGKILL: torchrun's summary, Python's subprocess, a shell's job report, the kernel's OOM killer
SIGKILLED = re.compile(r"(exitcode\s*:\s*-9\b|\(exitcode: -9\)|Signal 9 \(SIGKILL\)|Signals\.SIGKILL|"
                       r"^(?:.*:\s*)?(?:line \d+:\s*)?\d+\s+Killed\b|^Killed$|"
                       r"exit(?:ed)? (?:with )?(?:code|status) 137\b)")  # fmt: skip
KERNEL_OOM = re.compile(r"(Out of memory: Killed process \d+|oom-kill:|Memory cgroup out of memory|oom_reaper)")
SIGKILL_CODES = (-9, 137)
STEP_LINE = re.compile(r"^\s*(step|iter(ation)?)\s*[:=]?\s*\d+", re.I)
# A rank that died because a peer did: gloo's and NCCL's words for a connection the other side dropped
PEER_LOST = re.compile(r"Connection (?:reset|closed) by peer|remote process exited|Check the logs of the remote worker|"
                       r"ncclRemoteError|Broken pipe|NCCL communicator was aborted", re.I)  # fmt: skip


@dataclass
class Finding:
    state: str
    reason: str
    evidence: list[str] = field(default_factory=list)
    rank: str | None = None  # the stream ("rank3") the failure came from, where the log says
    early: bool = False  # a start error (missing module or file) with no training progress before it


def _strip(line: str) -> str:
    return TIMESTAMP_PREFIX.sub("", RANK_PREFIX.sub("", line))


def split_ranks(lines: list[str]) -> dict[str, list[str]]:
    """Lines per rank prefix ("[rank3]: ..."); unprefixed lines under ""; interleaved writes come apart again."""
    streams: dict[str, list[str]] = {}
    for line in lines:
        m = RANK_PREFIX.match(line)
        streams.setdefault(f"rank{m[1]}" if m else "", []).append(RANK_PREFIX.sub("", line) if m else line)
    return streams


@dataclass
class Traceback:
    stream: str
    exception: str
    frames: list[str]
    flex: bool  # a frame passes through flex attention


def last_traceback(lines: list[str], stream: str = "") -> Traceback | None:
    start = max((i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last)")), default=None)
    if start is None:
        return None
    frames, exception = [], None
    for ln in lines[start + 1 :]:
        if ln.startswith("  File "):
            frames.append(ln.strip())
        elif ln.startswith(" ") or not ln.strip():
            continue
        else:
            exception = ln.strip()
            break
    if exception is None:
        return None
    return Traceback(stream, exception, frames, any(FLEX_FRAME.search(f) for f in frames))


def root_cause(lines: list[str]) -> tuple[str | None, int | None]:
    """torchrun's summary names the first failing rank and its exit code ("Root Cause ... rank : 3 (local_rank: 3)
    ... exitcode : -9")."""
    for i, ln in enumerate(lines):
        if ln.startswith("Root Cause"):
            rank = code = None
            for nxt in lines[i : i + 10]:
                if rank is None and (m := re.search(r"rank\s*:\s*(\d+)", nxt)):
                    rank = f"rank{m[1]}"
                if code is None and (m := re.search(r"exitcode\s*:\s*(-?\d+)", nxt)):
                    code = int(m[1])
            return rank, code
    return None, None


def root_cause_rank(lines: list[str]) -> str | None:
    return root_cause(lines)[0]


def tracebacks(lines: list[str]) -> list[Traceback]:
    """The last traceback of every stream; launcher-side ones (ChildFailedError) after the ranks' own."""
    found = [tb for name, ls in split_ranks(lines).items() if (tb := last_traceback(ls, name))]
    if any(tb.stream for tb in found):  # per-rank tracebacks exist: the launcher's own is only a summary
        found = [tb for tb in found if tb.stream or "ChildFailedError" not in tb.exception]
    root = root_cause_rank(lines)
    found.sort(key=lambda tb: (tb.stream != root, tb.stream == ""))
    return found


def _oom_size(line: str, gpu_total_gib: float | None) -> tuple[float, float] | None:
    """(GiB asked for, GiB the GPU has) from a CUDA OOM message."""
    m = OOM_SIZES.search(line)
    if not m:
        return None
    total = float(m[3]) * UNITS[m[4]] if gpu_total_gib is None else gpu_total_gib
    return float(m[1]) * UNITS[m[2]], total


def _finite_text(value: str) -> bool:
    try:
        return math.isfinite(float(value))
    except ValueError:
        return True  # not a number we read (a version string): no evidence either way


def _rank_of(lines: list[str], indices: list[int]) -> str | None:
    for i in indices:
        if m := RANK_PREFIX.match(lines[i]):
            return f"rank{m[1]}"
    return None


def _gpu_fault(lines: list[str], plain: list[str], nccl: list[str]) -> Finding | None:
    hw = [i for i, ln in enumerate(plain) if GPU_HW.search(ln)]
    xids = [(i, m) for i, ln in enumerate(plain) if (m := XID.search(ln)) and int(m[2]) in HARDWARE_XIDS]
    if not hw and not xids:
        return None
    rank = _rank_of(lines, hw)
    what = GPU_HW.search(plain[hw[0]])[1] if hw else f"Xid {xids[0][1][2]} (PCI {xids[0][1][1]})"
    where = f" on {rank}" if rank else ""
    after = " (the other ranks' NCCL timeouts follow from it)" if nccl else ""
    ev = [plain[i] for i in hw[:2]] + [plain[i] for i, _ in xids[:2]] + nccl[:1]
    return Finding("GPU_FAULT", f"GPU hardware error{where}: {what}{after}", ev, rank)


def _diverged(plain: list[str]) -> Finding | None:
    """The newest `DIVERGED_LINES` or more loss lines all report a NaN or inf loss or grad norm (any script's log)."""
    values = [(i, all(_finite_text(m[1]) for m in found)) for i, ln in enumerate(plain)
              if (found := list(LOSS_VALUE.finditer(ln)))]  # fmt: skip
    bad = 0
    for _, finite in reversed(values):
        if finite:
            break
        bad += 1
    if bad < DIVERGED_LINES:
        said = [ln for ln in plain if NAN_ERROR.search(ln)]
        return Finding("DIVERGED", "the job stopped on a NaN/inf loss or gradient", said[-1:]) if said else None
    first = values[len(values) - bad][0]
    before = values[len(values) - bad - 1][0] if len(values) > bad else None
    ev = [plain[first], plain[values[-1][0]]]
    ev.append(f"last finite: {plain[before]}" if before is not None else "no finite loss in the log")
    return Finding("DIVERGED", f"the loss is non-finite in the last {bad} loss lines", ev)


def _disk_full(plain: list[str], disk_free_gib: float | None, checkpoint_gib: float | None) -> Finding | None:
    free = f" ({disk_free_gib:g} GiB free at the run dir)" if disk_free_gib is not None else ""
    full = [ln for ln in plain if ENOSPC.search(ln)]
    if full:
        if any("/dev/shm" in ln or "shared memory" in ln.lower() for ln in plain):
            return Finding("DISK_FULL", "shared memory (/dev/shm) is full: a container needs a larger --shm-size "
                           "(NCCL and dataloader workers use it)", full[-1:])  # fmt: skip
        return Finding("DISK_FULL", f"no space left on device{free}", full[-1:])
    failed = [ln for ln in plain if WRITE_FAILED.search(ln)]
    if not failed:
        return None
    if disk_free_gib is not None and checkpoint_gib is not None:
        if disk_free_gib >= checkpoint_gib:
            return None  # room for a checkpoint: the write failed for another reason
        why = (f"a checkpoint write failed with {disk_free_gib:g} GiB free, less than a checkpoint "
               f"({checkpoint_gib:g} GiB)")
        return Finding("DISK_FULL", why, failed[-1:])
    return Finding("DISK_FULL", f"a checkpoint write failed (likely a full disk){free}", failed[-1:])


def _host_oom(lines: list[str], plain: list[str], tbs: list[Traceback]) -> Finding | None:
    """A rank killed by SIGKILL with no Python error of its own: the kernel's OOM killer, unless the kernel log or the
    cgroup says otherwise (assess confirms with the cgroup's count)."""
    loader = [ln for ln in plain if DATALOADER_KILLED.search(ln)]
    if loader:
        return Finding("HOST_OOM", "a dataloader worker was killed by SIGKILL: likely the kernel's OOM killer (host "
                       "RAM; fewer or lighter workers)", loader[-1:])  # fmt: skip
    killed = [i for i, ln in enumerate(plain) if SIGKILLED.search(ln)]
    kernel = [ln for ln in plain if KERNEL_OOM.search(ln)]
    root, code = root_cause(plain)
    own = [tb for tb in tbs if "ChildFailedError" not in tb.exception and not PEER_LOST.search(tb.exception)]
    if not (code == -9 or ((killed or kernel) and not own)):
        return None
    how = "confirmed by the kernel log" if kernel else "likely the kernel's OOM killer (host RAM)"
    rank = root or _rank_of(lines, killed)
    where = f" {rank}" if rank else " a process"
    ev = kernel[-1:] + [plain[i] for i in killed[-2:]]
    return Finding("HOST_OOM", f"{where.strip()} was killed by SIGKILL: {how}", ev, rank)


def classify_log(text: str | list[str], gpu_total_gib: float | None = None, disk_free_gib: float | None = None,
                 checkpoint_gib: float | None = None) -> Finding | None:  # fmt: skip
    """The most specific failure the log shows, or None. A root cause outranks its consequences: a GPU's hardware
    error, then the dense-fallback guard, a divergence, a full disk, out of memory (dense or not), the recompile
    limit, a rank SIGKILLed (host RAM), NCCL timeouts, a config error, a crash (a traceback)."""
    lines = text.splitlines() if isinstance(text, str) else list(text)
    plain = [_strip(ln) for ln in lines]
    tbs = tracebacks(lines)
    nccl = [ln for ln in plain if NCCL.search(ln)]

    hw = _gpu_fault(lines, plain, nccl)
    if hw:
        return hw
    dense = [ln for ln in plain if DENSE.search(ln)]
    if dense:
        return Finding("DENSE_FALLBACK", "the trainer's guard refused a dense flex_attention fallback", dense[-1:])
    for found in (_diverged(plain), _disk_full(plain, disk_free_gib, checkpoint_gib)):
        if found:
            return found
    oom = [ln for ln in plain if OOM.search(ln)]
    rec = [i for i, ln in enumerate(plain) if RECOMPILE.search(ln)]
    if oom:
        last_oom = max(i for i, ln in enumerate(plain) if OOM.search(ln))
        flex_tb = next((tb for tb in tbs if tb.flex and OOM.search(tb.exception)), None)
        # the chain: recompile limit -> flex runs eagerly (warned once per process) -> the dense scores do not fit
        limit = [i for i in rec if i < last_oom]
        eager = [i for i, ln in enumerate(plain[:last_oom]) if EAGER_FLEX.search(ln)]
        sizes = [s for ln in oom if (s := _oom_size(ln, gpu_total_gib))]
        huge = any(asked > 0.5 * total for asked, total in sizes)  # half the GPU at once: a score matrix
        flex_seen = any(FLEX_FRAME.search(ln) for ln in plain)  # the traceback may be cut, the frame names remain
        if flex_tb or limit or eager or (huge and flex_seen):
            cause = "the recompile limit" if limit else ("flex_attention running uncompiled" if eager else None)
            reason = "out of memory in a dense attention allocation (flex ran eagerly)"
            ev = [plain[i[-1]] for i in (limit, eager) if i] + [oom[-1]]
            ev += flex_tb.frames[-3:] if flex_tb else []
            return Finding("DENSE_FALLBACK", f"{reason}, caused by {cause}" if cause else reason, ev)
    if rec:
        i = rec[-1]
        ev = [plain[i]] + [ln.strip() for ln in plain[i + 1 : i + 4] if "function:" in ln or "last reason" in ln]
        return Finding("RECOMPILE_LIMIT", "Dynamo hit its recompile limit", ev)
    if oom:  # an OOM on one rank leaves the others waiting in a collective: the OOM is the cause, named first
        tb = next((tb for tb in tbs if OOM.search(tb.exception)), None)
        where = f" on {tb.stream}" if tb and tb.stream else ""
        waiting = sorted({m[1] for ln in lines if NCCL.search(ln) and (m := RANK_PREFIX.match(ln))})
        after = f" (then NCCL timeouts on rank{', rank'.join(waiting)})" if waiting else ""
        size = _oom_size(oom[-1], gpu_total_gib)
        asked = f": asked for {size[0]:.2f} GiB of a {size[1]:.2f} GiB GPU" if size else ""
        ev = [oom[-1]] + (tb.frames[-2:] if tb else []) + nccl[:1]
        return Finding("OOM", f"CUDA out of memory{where}{asked}{after}", ev, tb.stream if tb else None)
    killed = _host_oom(lines, plain, tbs)
    if killed:
        return killed
    if nccl:
        return Finding("NCCL_TIMEOUT", "an NCCL collective timed out", nccl[:1] + nccl[-1:] if len(nccl) > 1 else nccl)
    cfg = [ln for ln in plain if CONFIG.search(ln)]
    if cfg:
        return Finding("CONFIG_ERROR", "the trainer rejected its config", cfg[-1:])
    setup = [ln for ln in plain if SETUP_ERRORS.search(ln)]
    if setup and not any(LOSS_VALUE.search(ln) or STEP_LINE.match(ln) for ln in plain):
        return Finding("CONFIG_ERROR", f"this machine cannot run the job: {SETUP_ERRORS.search(setup[-1])[1]}; a "
                       "restart repeats it", setup[-1:], early=True)  # fmt: skip
    if tbs:
        tb = tbs[0]
        where = f" on {tb.stream}" if tb.stream else ""
        ev = [tb.exception, *tb.frames[-3:]]
        if START_ERRORS.match(tb.exception) and not any(LOSS_VALUE.search(ln) or STEP_LINE.match(ln) for ln in plain):
            name = tb.exception.split(":")[0]
            reason = f"failed before its first step: {name}{where}; a restart repeats it"
            return Finding("CONFIG_ERROR", reason, ev, tb.stream or None, early=True)
        return Finding("CRASHED", f"{tb.exception.split(':')[0]}{where}", ev, tb.stream or None)
    return None


@dataclass
class Thresholds:
    stall_after_s: float = 600.0
    startup_budget_s: float = 3600.0
    heartbeat_max_age_s: float = 120.0
    throughput_floor: float | None = None
    throughput_drop: float = 0.3
    slow_polls: int = 3


@dataclass
class History:
    """What the watcher has accumulated from the snapshots of one job (the remote's clock throughout)."""

    started_at: float  # launch or last restart, remote clock
    now: float = 0.0  # time of the newest snapshot
    reachable: bool = True
    session_exists: bool = True
    pane_dead: bool = False
    pane_status: int | None = None
    run_dir_exists: bool = True
    exit_code: int | None = None
    is_trainer: bool = True
    last_step: int | None = None
    last_step_time: float | None = None  # `time` of the newest step record
    epoch: int | None = None
    loss: float | None = None
    tokens_per_s: list[float] = field(default_factory=list)  # one per poll that saw new steps
    fatal: dict | None = None
    finished: bool = False
    phase: str | None = None
    heartbeat_age_s: float | None = None
    log_tail: list[str] = field(default_factory=list)
    pane_lines: list[str] = field(default_factory=list)
    gpu_total_gib: float | None = None
    last_state: str | None = None  # kept through UNREACHABLE
    probe_error: str | None = None  # the host answered, the probe failed: its stderr
    stop_request: dict | None = None  # `dflashctl kill` asked for a stop (in the run dir: every watcher sees it)
    stop_result: dict | None = None  # what that kill verified: KILLED, or KILL_FAILED with the survivors
    kill_grace_s: float = 40.0
    activity_at: float | None = None  # remote time of the last sign of progress of a job without metrics
    activity: str = ""  # what that sign was (log grew, CPU time, GPU busy)
    malformed: int = 0  # metrics lines and heartbeats that were not what the contract says, skipped
    step_changed_at: float | None = None  # remote time the newest step was first seen (the run dir's progress history)
    gpus: list[dict] = field(default_factory=list)  # the job's GPU readings (index, uuid, ecc_uncorrected, ...)
    job_gpus: list[int] = field(default_factory=list)  # the GPU indices the job was given, in rank order
    node: str | None = None  # the host name, for a job over several hosts
    disk_free_gib: float | None = None  # free space at the run dir
    checkpoint_gib: float | None = None  # size of the newest checkpoint
    oom_kills: int | None = None  # the kernel's OOM kills in the job's cgroup since launch (None: not readable)
    kernel_oom: list[str] = field(default_factory=list)  # the kernel log's OOM-killer lines since launch, if readable
    kernel_xid: list[str] = field(default_factory=list)  # the kernel log's GPU driver (Xid) lines since launch
    nonfinite_steps: int = 0  # consecutive non-finite steps the trainer skipped
    scheduler: dict | None = None  # a Slurm job's state as the scheduler said it: id, state, reason, nodes, exit
    exit_time: float | None = None  # when exit_code was written, remote clock


@dataclass
class Verdict:
    state: str
    reason: str
    evidence: list[str] = field(default_factory=list)
    advice: str | None = None
    step: int | None = None
    since: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _verdict(state: str, reason: str, evidence: list[str], h: History) -> Verdict:
    return Verdict(state, reason, [str(e) for e in evidence], ADVICE.get(state), h.last_step)


FATAL_STATE = {"dense_fallback": "DENSE_FALLBACK", "config": "CONFIG_ERROR", "diverged": "DIVERGED"}
EXIT_STATE = {3: ("DENSE_FALLBACK", "dense fallback refused"), 2: ("CONFIG_ERROR", "config error"),
              4: ("DIVERGED", "the loss diverged")}  # the bundled trainer's exit statuses  # fmt: skip


def _find(h: History, lines: list[str]) -> Finding | None:
    return classify_log(lines, h.gpu_total_gib, h.disk_free_gib, h.checkpoint_gib)


def _gpu_named(h: History, rank: str | None) -> str:
    """The failed GPU as the readings and the job's GPU list name it: index, UUID, node."""
    bad = [g for g in h.gpus if isinstance(g.get("ecc_uncorrected"), int) and g["ecc_uncorrected"] > 0]
    gpu = bad[0] if bad else None
    if gpu is None and rank and h.job_gpus:
        index = h.job_gpus[int(rank[4:]) % len(h.job_gpus)]
        gpu = next((g for g in h.gpus if g.get("index") == index), {"index": index})
    if gpu is None:
        return ""
    uuid = f" ({gpu['uuid']})" if gpu.get("uuid") else ""
    ecc = f", {gpu['ecc_uncorrected']} uncorrectable ECC errors" if gpu.get("ecc_uncorrected") else ""
    node = f" on {h.node}" if h.node else ""
    return f"GPU {gpu.get('index')}{uuid}{node}{ecc}"


def _refine(h: History, found: Finding) -> Finding:
    """What the snapshots add to a log finding: the failed GPU's name, the cgroup's or kernel's word on an OOM kill."""
    if found.state == "GPU_FAULT":
        named = _gpu_named(h, found.rank)
        if named:
            return Finding(found.state, f"{found.reason}; {named}", [named, *found.evidence], found.rank)
    if found.state == "HOST_OOM" and "confirmed" not in found.reason and (h.oom_kills or h.kernel_oom):
        how = f"{h.oom_kills} OOM kill(s) in the job's cgroup" if h.oom_kills else h.kernel_oom[-1]
        reason = found.reason.split(":")[0] + f": confirmed, {how}"
        return Finding(found.state, reason, [*h.kernel_oom[-1:], *found.evidence], found.rank)
    return found


def _hardware_readings(h: History) -> Finding | None:
    """A job GPU that NVML or nvidia-smi reports with uncorrectable ECC errors (launch refuses such GPUs, so the
    errors arose while the job ran)."""
    named = _gpu_named(h, None)
    if named and "uncorrectable" in named:
        return Finding("GPU_FAULT", f"GPU hardware error: {named}", [named])
    xid = _gpu_fault(h.kernel_xid, h.kernel_xid, [])  # the host's kernel log, where it was readable
    return Finding(xid.state, f"{xid.reason} (the host's kernel log)", xid.evidence) if xid else None


def _ended(h: History, lines: list[str]) -> Verdict:
    code = h.exit_code if h.exit_code is not None else h.pane_status
    if h.fatal and h.fatal.get("kind") in FATAL_STATE:
        found = _find(h, lines)
        ev = [h.fatal.get("message", "")] + (found.evidence if found and found.state != "CRASHED" else [])
        return _verdict(FATAL_STATE[h.fatal["kind"]], f"fatal record: {h.fatal['kind']} (exit {code})", ev, h)
    if code == 0 and (h.finished or not h.is_trainer):
        at = f" at step {h.last_step}" if h.last_step is not None else ""
        return _verdict("FINISHED", f"exit 0{at}", [f"exit_code 0{at.replace(' at', ',')}"], h)
    found = _find(h, lines)
    if found is None or found.state in ("NCCL_TIMEOUT", "CRASHED", "STALLED"):
        found = _hardware_readings(h) or found
    if found and found.early and h.last_step is not None:  # it trained first: an ordinary crash
        found = Finding("CRASHED", found.reason.split(":")[1].split(";")[0].strip(), found.evidence, found.rank)
    early = h.last_step is None and (h.is_trainer or (h.now - h.started_at) < EARLY_S)
    if found and found.state == "CRASHED" and early and START_ERRORS.match(found.evidence[0]):
        reason = f"failed before its first step: {found.evidence[0].split(':')[0]} (exit {code}); a restart repeats it"
        return _verdict("CONFIG_ERROR", reason, found.evidence, h)
    if found is None and code in SIGKILL_CODES:
        found = _refine(h, Finding("HOST_OOM", f"killed by SIGKILL (exit {code}) with no stop request: likely the "
                                   "kernel's OOM killer (host RAM)", [f"exit_code {code}"]))  # fmt: skip
        return _verdict(found.state, found.reason, found.evidence, h)
    if found:
        found = _refine(h, found)
        return _verdict(found.state, f"{found.reason} (exit {code})", found.evidence, h)
    if h.is_trainer and code in EXIT_STATE:
        state, why = EXIT_STATE[code]
        return _verdict(state, f"exit status {code} ({why})", [f"exit_code {code}"], h)
    tail = [ln for ln in lines if ln.strip()][-3:]
    return _verdict("CRASHED", f"exit status {code}", [f"exit_code {code}", *tail], h)


ATTEMPT_START = re.compile(r"^\[dflashctl\] \S+ start\b")  # run.sh's line at the start of every attempt


def this_attempt(lines: list[str]) -> list[str]:
    """The lines of the newest attempt: an earlier attempt's failure was judged (and restarted) already."""
    starts = [i for i, ln in enumerate(lines) if ATTEMPT_START.match(ln)]
    return lines[starts[-1] :] if starts else lines


def _slow(h: History, th: Thresholds) -> str | None:
    tps = h.tokens_per_s
    if len(tps) < th.slow_polls:
        return None
    recent = tps[-th.slow_polls :]
    if th.throughput_floor is not None and all(t < th.throughput_floor for t in recent):
        return f"tokens/s {recent[-1]:,.0f} under the floor {th.throughput_floor:,.0f} for {th.slow_polls} polls"
    earlier = tps[: -th.slow_polls]
    if len(earlier) >= th.slow_polls:
        median = statistics.median(earlier[-20:])
        if all(t < th.throughput_drop * median for t in recent):
            return f"tokens/s {recent[-1]:,.0f} under {th.throughput_drop:.0%} of its median {median:,.0f}"
    return None


def assess(h: History, th: Thresholds) -> Verdict:
    """The job's state now. Failure evidence in the logs outranks progress numbers; progress alone proves RUNNING."""
    if not h.reachable:
        v = _verdict("UNREACHABLE", "the host did not answer", [f"last state {h.last_state or 'not seen yet'}"], h)
        return v
    if h.probe_error is not None:
        return _verdict("PROBE_FAILED", "the host answered but the probe failed there", [h.probe_error], h)
    if h.stop_request is not None:
        return _stopped(h)
    lines = this_attempt(h.log_tail + [ln for ln in h.pane_lines if ln not in h.log_tail[-200:]])
    if h.scheduler is not None:
        scheduled = _scheduled(h) or _settling(h)
        if scheduled is not None:
            return scheduled
    if h.exit_code is not None or (h.session_exists and h.pane_dead):
        return _ended(h, lines)
    if not h.session_exists:
        what = "run dir" if not h.run_dir_exists else ("Slurm job" if h.scheduler is not None else "tmux session")
        return _verdict("LOST", f"the {what} is gone and no exit status was written", [f"{what} missing"], h)
    if not h.run_dir_exists:
        return _verdict("LOST", "the run dir is gone", ["run dir missing"], h)
    if h.fatal and h.fatal.get("kind") in FATAL_STATE:  # alive, but the trainer already said why it stops
        st = FATAL_STATE[h.fatal["kind"]]
        return _verdict(st, f"fatal record: {h.fatal['kind']}", [h.fatal.get("message", "")], h)
    found = _find(h, lines)
    if found and found.state in ("DENSE_FALLBACK", "NCCL_TIMEOUT", "RECOMPILE_LIMIT", "GPU_FAULT", "DIVERGED"):
        found = _refine(h, found)
        return _verdict(found.state, found.reason, found.evidence, h)
    if h.heartbeat_age_s is not None and h.heartbeat_age_s > th.heartbeat_max_age_s:
        step = f"step {h.last_step}" if h.last_step is not None else "before the first step"
        ev = [f"heartbeat {h.heartbeat_age_s:.0f} s old (limit {th.heartbeat_max_age_s:.0f})", step]
        return _verdict("STALLED", "the trainer's heartbeat stopped (process frozen or stopped)", ev, h)
    if h.last_step is None and not h.is_trainer:  # any command: progress from its log, CPU time and GPUs
        quiet = h.now - (h.activity_at if h.activity_at is not None else h.now)
        if quiet > th.stall_after_s:
            ev = [f"no sign of progress for {quiet:.0f} s (limit {th.stall_after_s:.0f}): log unchanged, CPU time "
                  "flat, GPUs idle or pinned at 100% with frozen memory"]  # fmt: skip
            return _verdict("STALLED", "no progress (log, CPU, GPUs)", ev, h)
        seen = f"{h.activity} {quiet:.0f} s ago" if h.activity else "just started"
        return _verdict("RUNNING", f"alive, {seen} (no metrics.jsonl)", [f"last progress: {seen}"], h)
    if h.last_step is None:
        waited = h.now - h.started_at
        if waited > th.startup_budget_s:
            ev = [f"{waited:.0f} s since start, budget {th.startup_budget_s:.0f} s", f"phase {h.phase}"]
            return _verdict("STALLED", "no first step within the startup budget", ev, h)
        phase = h.phase or "waiting for the first heartbeat"
        return _verdict("STARTING", f"{phase} ({waited:.0f} s since start)", [f"phase {phase}"], h)
    seen = h.step_changed_at if h.step_changed_at is not None else (h.last_step_time or h.now)
    idle = max(0.0, h.now - seen)
    if idle > th.stall_after_s:
        ev = [f"no new step for {idle:.0f} s (limit {th.stall_after_s:.0f})", f"last step {h.last_step}"]
        return _verdict("STALLED", "no step progress", ev, h)
    slow = _slow(h, th)
    if slow:
        return _verdict("STALLED", "throughput collapsed", [slow], h)
    tps = f"{h.tokens_per_s[-1]:,.0f} tok/s" if h.tokens_per_s else "tok/s unknown"
    loss = f", loss {h.loss:.4f}" if h.loss is not None else ""
    ev = [f"step {h.last_step} {idle:.0f} s ago"]
    if h.malformed:
        ev.append(f"{h.malformed} malformed metrics lines skipped")
    if h.nonfinite_steps:
        ev.append(f"{h.nonfinite_steps} non-finite steps in a row skipped (no update)")
    return _verdict("RUNNING", f"step {h.last_step}, {tps}{loss}", ev, h)


# Slurm's ends that name their cause themselves: they outrank what the log shows (the SIGTERM traceback of a job out of
# time, the other nodes' NCCL timeouts after a node failed). FAILED and COMPLETED leave the cause to the log.
SLURM_END_STATE = {"TIMEOUT": "TIMEOUT", "DEADLINE": "TIMEOUT", "PREEMPTED": "PREEMPTED", "NODE_FAIL": "NODE_FAIL",
                   "BOOT_FAIL": "NODE_FAIL", "OUT_OF_MEMORY": "HOST_OOM", "CANCELLED": "CANCELLED"}  # fmt: skip
SLURM_QUEUED = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SUSPENDED")


def _scheduled(h: History) -> Verdict | None:
    """What Slurm's word on the job settles by itself: queued (PENDING, with Slurm's reason), or one of its own ends.
    None: the job runs or ended by itself, and the usual rules judge it from its files."""
    s = h.scheduler or {}
    state, reason, job = str(s.get("state") or ""), str(s.get("reason") or "None"), s.get("id")
    nodes = f" on {s['nodes']}" if s.get("nodes") and s.get("nodes") != "(null)" else ""
    said = f"slurm job {job} {state}{nodes}" + (f" ({reason})" if reason != "None" else "")
    at = [f"last step {h.last_step}"] if h.last_step is not None else []
    if state == "NO_ANSWER":  # like a host that does not answer: nothing is concluded, the last state is kept
        ev = [f"slurm job {job}: {reason}", f"last state {h.last_state or 'not seen yet'}"]
        return _verdict("UNREACHABLE", "Slurm's controller did not answer on the login node", ev, h)
    if state in SLURM_QUEUED:
        why = reason if reason != "None" else "waiting to be scheduled"
        return _verdict("PENDING", f"{state.lower()} in Slurm's queue: {why}", [said], h)
    verdict = SLURM_END_STATE.get(state)
    if verdict is None:
        return None
    if verdict == "TIMEOUT":
        limit = f" ({s['time_limit']})" if s.get("time_limit") else ""
        return _verdict("TIMEOUT", f"out of wall time{limit}", [said, *at], h)
    if verdict == "NODE_FAIL":
        return _verdict("NODE_FAIL", f"a node failed{nodes}: the restart excludes it", [said, *at], h)
    if verdict == "HOST_OOM":
        return _verdict("HOST_OOM", "Slurm: OUT_OF_MEMORY (the job's memory limit on its nodes)", [said, *at], h)
    if verdict == "PREEMPTED":
        return _verdict("PREEMPTED", "preempted by the scheduler", [said, *at], h)
    return _verdict("CANCELLED", "cancelled outside dflashctl (scancel, or an administrator)", [said, *at], h)


SLURM_ACTIVE = ("RUNNING", "COMPLETING", "CONFIGURING", "SIGNALING", "STAGE_OUT", "RESIZING")
SLURM_SETTLE_S = 30.0  # after the command's end, how long Slurm may take to say its own end of the job


def _settling(h: History) -> Verdict | None:
    """The command ended (exit_code written) while Slurm still says the job runs: a preemption, the time limit or a
    scancel signal the job before its state says so (GraceTime, KillWait), and a probe may read the scheduler just
    before the exit. Slurm's own word names the cause within seconds; until then nothing is concluded (a preempted
    job is not CRASHED). Past SLURM_SETTLE_S the files judge, as for a job that ended by itself."""
    state = str((h.scheduler or {}).get("state") or "")
    if h.exit_code is None or state not in SLURM_ACTIVE:
        return None
    ended = h.exit_time if h.exit_time is not None else h.now
    if h.now - ended > SLURM_SETTLE_S:
        return None
    ev = [f"exit_code {h.exit_code} written {max(0.0, h.now - ended):.0f} s ago",
          f"slurm job {(h.scheduler or {}).get('id')} still {state}"]  # fmt: skip
    return _verdict("RUNNING", f"the command ended (exit {h.exit_code}); waiting for Slurm's word on the job", ev, h)


def _stopped(h: History) -> Verdict:
    """A job the user stopped: KILLED once its kill verified that nothing is left, KILL_FAILED naming what survived,
    STOPPING while the kill runs. Never a failure to restart from: the exit status of a killed job is the kill's."""
    res = h.stop_result
    if res and res.get("result") == "KILLED":
        return _verdict("KILLED", "stopped by `dflashctl kill` and verified", [f"check: {res.get('gpu_check')}"], h)
    if res:
        ev = [f"survivors: pids {res.get('remaining')}", f"GPU holders: {res.get('gpu_holders')}",
              f"session closed: {res.get('session_closed')}"]  # fmt: skip
        return _verdict("KILL_FAILED", "`dflashctl kill` could not verify that the job is gone", ev, h)
    asked = h.stop_request.get("time") if h.stop_request else None
    if isinstance(asked, (int, float)) and h.now - asked > h.kill_grace_s + STOP_RESULT_GRACE_S:
        ev = [f"stop requested {h.now - asked:.0f} s ago, no result recorded"]
        return _verdict("KILL_FAILED", "a kill was requested but never finished", ev, h)
    return _verdict("STOPPING", "a stop was requested (`dflashctl kill`)", [f"stop request at {asked}"], h)
