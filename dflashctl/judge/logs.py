"""Pure: read any training log through its launcher's prefixes and name the failure it shows.

One table (`SIGNATURES`, signatures.py) says which lines mean what: the pattern, the state it points to, its
root-cause rank and its role (a ROOT failure or the CASCADE that follows one: a GPU's hardware error over the other
ranks' NCCL timeouts, a rank's own exception over torchrun's ChildFailedError summary, a memory monitor's kill over
Ray's word that the worker died) and what to do. The prefixes are removed in one step (`strip_prefix`, prefixes.py):
the launchers' table, timestamps, colours, and a prefix learned from the log itself. `classify_log` is the one
classifier that `diagnose`, `watch`, `status` and the supervisor share; `RULES` apply the table in root-cause order.
No I/O here: `logfile.py` reads.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .facts import ADVICE  # noqa: F401  (re-exported: the advice lives in the one state table)
from .prefixes import learn_prefix, strip_prefix
from .reading import (  # noqa: F401  (re-exported: assess, logfile and progress read these from here)
    ATTEMPT_START,
    CONSEQUENCE,
    FLEX_FRAME,
    RAY_PID,
    START_ERRORS,
    Finding,
    Log,
    collective_abort,
    collective_cause,
    launcher_exit,
    lost_peer_abort,
    own_native,
    root_cause,
    signal_name,
    this_attempt,
    tracebacks,
    tracebacks_of,
)
from .signatures import (  # noqa: F401  (re-exported: `from dflashctl.judge.logs import SIGNATURES, SIG` keeps working)
    END_REASON,
    FRAMEWORK_NAN,
    MEMORY_MONITORS,
    SCHEDULER_ENDS,
    SIG,
    SIGKILL_ADVICE,
    SIGNATURES,
)

DENSE_FRAME = re.compile(
    r"(eager_attention_forward|_scaled_dot_product_attention_math|_attn\(|"
    r"attn_weights = torch\.matmul|scores = torch\.matmul|torch\.matmul\(q(?:uery)?\w*, "
    r"k(?:ey)?\w*\.transpose)"
)
SDPA_FRAME = re.compile(r"scaled_dot_product_attention")
OOM_SIZES = re.compile(r"Tried to allocate ([\d.]+) (MiB|GiB|TiB).*?total capacity of ([\d.]+) (MiB|GiB|TiB)")
UNITS = {"MiB": 1 / 1024, "GiB": 1.0, "TiB": 1024.0}
# A launcher killing the others once one rank failed: the kills after it are its clean-up, not the failure
CLEANUP = re.compile(r"Forcefully terminating all other processes|Killing subprocess \d+")
HARDWARE_XIDS = {48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 121, 140}  # the rest are the application's own
# A line that reports a training loss, and the value it reports ("loss nan", "loss: inf", "'loss': NaN", "loss=-inf")
LOSS_VALUE = re.compile(
    r"(?<![A-Za-z])(?:loss|grad_?norm|grad norm)['\"]?\s*[:=]?\s*['\"]?"
    r"(nan|[-+]?inf(?:inity)?|[-+]?\d[\d.eE+-]*)\b",
    re.I,
)
DIVERGED_LINES = 3  # non-finite loss lines in a row, the newest loss line among them, make a divergence
STEP_LINE = re.compile(r"^\s*(step|iter(ation)?)\s*[:=]?\s*\d+", re.I)
FINISHED_LINE = re.compile(
    r"^(?:finished: \d+ steps|\[dflashctl\] \S+ exit 0$|\{'train_runtime': )|"
    r"`Trainer\.fit` stopped: `max_(?:steps|epochs)=\d+` reached"
)
FINISHED_WORDS = ("finished: ", " exit 0", "train_runtime", "Trainer.fit")  # a cheap test before the prefixes
EXIT_LINE = re.compile(r"^\[dflashctl\] \S+ exit (-?\d+)$")


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


@dataclass
class Context:
    """What a reader knows besides the log (the watcher's snapshots); all optional."""

    gpu_total_gib: float | None = None
    disk_free_gib: float | None = None
    checkpoint_gib: float | None = None


def gpu_fault(log: Log, ctx: Context) -> Finding | None:
    hw = log.hits("gpu_hardware")
    xids = [
        (i, m) for i, ln in enumerate(log.plain) if (m := SIG["xid"].pattern.search(ln)) and int(m[2]) in HARDWARE_XIDS
    ]
    if not hw and not xids:
        return None
    nccl = [log.plain[i] for i in log.hits("nccl_timeout")]
    rank = log.rank_of(hw)
    what = (
        SIG["gpu_hardware"].pattern.search(log.plain[hw[0]])[1] if hw else f"Xid {xids[0][1][2]} (PCI {xids[0][1][1]})"
    )
    where = f" on {rank}" if rank else ""
    after = " (the other ranks' NCCL timeouts follow from it)" if nccl else ""
    ev = [log.plain[i] for i in hw[:2]] + [log.plain[i] for i, _ in xids[:2]] + nccl[:1]
    return Finding("GPU_FAULT", f"GPU hardware error{where}: {what}{after}", ev, rank)


def _dense_guard(log: Log, ctx: Context) -> Finding | None:
    dense = log.hits("dense_guard")
    if not dense:
        return None
    return Finding(
        "DENSE_FALLBACK",
        "the trainer's guard refused a dense flex_attention fallback",
        [log.plain[dense[-1]]],
        log.rank_of(dense),
    )


def _diverged(log: Log, ctx: Context) -> Finding | None:
    """The trainer's own stop, a framework's NaN error, or the newest `DIVERGED_LINES` or more loss lines all NaN/inf
    (any script's log)."""
    stop = log.hits("diverged_stop")
    if stop:
        losses = [ln for ln in log.plain if LOSS_VALUE.search(ln)]
        bad = [ln for ln in losses if not all(_finite_text(m[1]) for m in LOSS_VALUE.finditer(ln))]
        return Finding(
            "DIVERGED",
            "the trainer stopped on a divergence (DivergedError)",
            [log.plain[stop[-1]], *bad[:1]],
            log.rank_of(stop),
        )
    checked = log.hits("framework_nan")
    if checked:
        return _framework_nan(log, checked)
    values = []  # (line, finite) of the newest loss lines, newest first, through the newest finite one
    for i in range(len(log.plain) - 1, -1, -1):
        if found := list(LOSS_VALUE.finditer(log.plain[i])):
            values.append((i, all(_finite_text(m[1]) for m in found)))
            if values[-1][1]:
                break
    values.reverse()
    bad = sum(1 for _, finite in values if not finite)
    if bad < DIVERGED_LINES:
        said = log.hits("nan_error")
        if said:
            return Finding("DIVERGED", "the job stopped on a NaN/inf loss or gradient", [log.plain[said[-1]]])
        return None
    first = values[len(values) - bad][0]
    before = values[len(values) - bad - 1][0] if len(values) > bad else None
    ev = [log.plain[first], log.plain[values[-1][0]]]
    ev.append(f"last finite: {log.plain[before]}" if before is not None else "no finite loss in the log")
    return Finding("DIVERGED", f"the loss is non-finite in the last {bad} loss lines", ev)


def _rank_at(log: Log, i: int) -> str | None:
    """The rank line i came from: its prefix's, or that of the traceback it ends (Ray names a worker's by its pid)."""
    return log.rank_only([i]) or next(
        (tb.stream for tb in tracebacks(log) if tb.at == i and tb.stream[:4] == "rank"), None
    )


def _framework_nan(log: Log, checked: list[int]) -> Finding:
    """A framework's own NaN check stopped the job (Megatron, DeepSpeed's loss scaler, Lightning, clip_grad_norm_):
    the first rank to say so, named by its prefix or by the check's own `Rank N` (Megatron's)."""
    line = log.plain[checked[0]]
    who = next((name for rx, name in FRAMEWORK_NAN if rx.search(line)), "a framework's NaN check")
    said = re.search(r"\bRank (\d+)\b", line)
    rank = _rank_at(log, checked[0]) or (f"rank{said[1]}" if said else None)
    where = f" on {rank}" if rank else ""
    finite = [ln for ln in log.plain[: checked[0]] if LOSS_VALUE.search(ln)][-1:]
    ev = [line, *(f"last loss line before it: {ln.strip()}" for ln in finite)]
    return Finding("DIVERGED", f"{who} stopped the job{where}: the loss or a gradient is NaN/inf", ev, rank)


def _disk_full(log: Log, ctx: Context) -> Finding | None:
    free = f" ({ctx.disk_free_gib:g} GiB free at the run dir)" if ctx.disk_free_gib is not None else ""
    full = log.hits("enospc")
    if full:
        if any("/dev/shm" in ln or "shared memory" in ln.lower() for ln in log.plain):
            return Finding(
                "DISK_FULL",
                "shared memory (/dev/shm) is full: a container needs a larger --shm-size "
                "(NCCL and dataloader workers use it)",
                [log.plain[full[-1]]],
            )
        return Finding("DISK_FULL", f"no space left on device{free}", [log.plain[full[-1]]])
    failed = log.hits("write_failed")
    if not failed:
        return None
    if ctx.disk_free_gib is not None and ctx.checkpoint_gib is not None:
        if ctx.disk_free_gib >= ctx.checkpoint_gib:
            return None  # room for a checkpoint: the write failed for another reason
        why = (
            f"a checkpoint write failed with {ctx.disk_free_gib:g} GiB free, less than a checkpoint "
            f"({ctx.checkpoint_gib:g} GiB)"
        )
        return Finding("DISK_FULL", why, [log.plain[failed[-1]]])
    return Finding("DISK_FULL", f"a checkpoint write failed (likely a full disk){free}", [log.plain[failed[-1]]])


def _memory(log: Log, ctx: Context) -> Finding | None:
    """Out of memory: in a dense attention allocation (flex run eagerly, SDPA's math kernel, eager attention's
    score matrix) it is DENSE_FALLBACK, with its cause where the log shows one (the recompile limit, flex's eager
    warning, SDPA's "kernel not used" warnings); otherwise OOM, on the rank that ran out, before the timeouts."""
    oom = log.hits("cuda_oom")
    if not oom:
        return None
    last = oom[-1]
    tbs = tracebacks(log)
    oom_tbs = [tb for tb in tbs if SIG["cuda_oom"].pattern.search(tb.exception)]
    limit = [i for i in log.hits("recompile_limit") if i < last]
    eager = [i for i in log.hits("eager_flex") if i < last]
    unfused = [i for i in log.hits("sdpa_unfused") if i < last]
    sizes = [s for i in oom if (s := _oom_size(log.plain[i], ctx.gpu_total_gib))]
    huge = any(asked > 0.5 * total for asked, total in sizes)  # half the GPU at once: a score matrix
    inner = [ln for tb in oom_tbs for ln in tb.frames[-4:] + tb.code[-4:]]
    flex_tb = next((tb for tb in oom_tbs if tb.flex), None)
    flex_seen = any(FLEX_FRAME.search(ln) for ln in log.plain)  # the traceback may be cut, the frame names remain
    eager_attn = any(DENSE_FRAME.search(ln) for ln in inner)
    sdpa = any(SDPA_FRAME.search(ln) for ln in inner) and (bool(unfused) or huge)
    size = _oom_size(log.plain[last], ctx.gpu_total_gib)
    asked = f": asked for {size[0]:.2f} GiB of a {size[1]:.2f} GiB GPU" if size else ""
    if flex_tb or limit or eager or (huge and flex_seen):
        cause = "the recompile limit" if limit else ("flex_attention running uncompiled" if eager else None)
        reason = f"out of memory in a dense attention allocation (flex ran eagerly){asked}"
        ev = [log.plain[i[-1]] for i in (limit, eager) if i] + [log.plain[last]]
        ev += flex_tb.frames[-3:] if flex_tb else []
        return Finding("DENSE_FALLBACK", f"{reason}, caused by {cause}" if cause else reason, ev)
    if eager_attn or sdpa:
        path = "SDPA's math kernel" if sdpa and not eager_attn else "eager attention's score matrix"
        ev = [log.plain[i] for i in unfused[-1:]] + [log.plain[last]] + inner[-3:]
        return Finding(
            "DENSE_FALLBACK",
            f"out of memory in dense attention ({path}){asked}",
            ev,
            oom_tbs[0].stream or None,
            advice=SIG["sdpa_unfused"].what_to_do,
        )
    tb = oom_tbs[0] if oom_tbs else None
    where = f" on {tb.stream}" if tb and tb.stream else ""
    nccl = log.hits("nccl_timeout")
    waiting = sorted(
        {log.streams[i] for i in nccl if log.streams[i]},
        key=lambda s: (not s[4:].isdigit(), int(s[4:]) if s[4:].isdigit() else 0, s),
    )
    after = f" (then NCCL timeouts on {', '.join(waiting)})" if waiting else ""
    ev = [log.plain[last]] + (tb.frames[-2:] if tb else []) + [log.plain[i] for i in nccl[:1]]
    return Finding("OOM", f"CUDA out of memory{where}{asked}{after}", ev, tb.stream if tb else None)


def _recompile(log: Log, ctx: Context) -> Finding | None:
    """Dynamo's recompile limit: its warning, or the exception it raises instead (FailOnRecompileLimitHit, with the
    warning silenced or not; the `fail_on_recompile` stance's RuntimeError), with the function, the last reason and
    the guard failures that follow it."""
    raised, rec = log.hits("recompile_raised"), log.hits("recompile_limit")
    if not raised and not rec:
        return None
    if not raised:
        i = rec[-1]
        said = [ln.strip() for ln in log.plain[i + 1 : i + 4] if "function:" in ln or "last reason" in ln]
        ev = [log.plain[i], *said]
        return Finding("RECOMPILE_LIMIT", "Dynamo hit its recompile limit", ev, log.rank_of(rec))
    i = raised[0]
    rank = _rank_at(log, i)
    stance = "fail_on_recompile'" in log.plain[i]
    why = (
        "Dynamo refused to recompile (torch.compile's fail_on_recompile stance): a shape outside the compiled set"
        if stance
        else "Dynamo hit its recompile limit and raised FailOnRecompileLimitHit"
    )
    after = [
        ln.strip()
        for ln in log.plain[i + 1 : i + 6]
        if ln.strip().startswith(("triggered by", "- ", "function:", "last reason"))
    ][:3]
    ev = [log.plain[i], *after, *(log.plain[j] for j in rec[-1:])]
    return Finding("RECOMPILE_LIMIT", f"{why}{f' on {rank}' if rank else ''}", ev, rank)


def _host_oom(log: Log, ctx: Context) -> Finding | None:
    """A rank killed by SIGKILL with no Python error of its own: the kernel's OOM killer, unless the kernel log or the
    cgroup says otherwise (assess confirms with the cgroup's count). A memory monitor's kill (Ray's, Kubernetes',
    systemd-oomd, earlyoom) is its own confirmation."""
    monitored = _memory_monitor(log)
    if monitored:
        return monitored
    loader = log.hits("dataloader_killed")
    if loader:
        return Finding(
            "HOST_OOM",
            "a dataloader worker was killed by SIGKILL: likely the kernel's OOM killer (host "
            "RAM; fewer or lighter workers)",
            [log.plain[loader[-1]]],
        )
    killed, kernel = log.hits("sigkill"), log.hits("kernel_oom")
    root, code = root_cause(log)
    if code is not None and code != -9:
        killed = []  # a launcher named a first failure that was no kill: the kills are its clean-up of the others
    cleanup = next((i for i, ln in enumerate(log.plain) if CLEANUP.search(ln)), None)
    if cleanup is not None and code != -9:
        killed = [i for i in killed if i < cleanup]
    own = [tb for tb in tracebacks(log) if not tb.consequence]
    if not (code == -9 or ((killed or kernel) and not own)):
        return None
    rank = root or log.rank_of(killed)
    where = f" {rank}" if rank else " a process"
    ev = [log.plain[i] for i in kernel[-1:]] + [log.plain[i] for i in killed[-2:]]
    ev = ev or [log.plain[i] for i in (log.hits("launcher_exit") + log.hits("srun_task_exit"))[:1]]  # a launcher's
    if kernel:
        return Finding("HOST_OOM", f"{where.strip()} was killed by SIGKILL: confirmed by the kernel log", ev, rank)
    return Finding(
        "HOST_OOM",
        f"{where.strip()} was killed by SIGKILL: likely the kernel's OOM killer (host RAM)",
        ev,
        rank,
        advice=SIGKILL_ADVICE,
    )


def _memory_monitor(log: Log) -> Finding | None:
    """A memory monitor killed a process (the root: Ray's TrainingFailedError and the survivors' timeouts follow),
    unless a rank had failed by itself before it. Ray's message names the pid it killed: its rank, where Ray Train
    printed one."""
    monitored = sorted((i, name) for name in MEMORY_MONITORS for i in log.hits(name))
    if not monitored:
        return None
    first, name = monitored[0]
    is_monitor = [s.pattern for s in SIGNATURES if s.name in MEMORY_MONITORS]
    if any(
        not tb.consequence and tb.at < first and not any(p.search(tb.exception) for p in is_monitor)
        for tb in tracebacks(log)
    ):
        return None
    target = _killed(log, monitored)
    detail = [ln for ln in log.plain[first + 1 : first + 3] if ln.startswith(("Memory on the node", "sending SIG"))]
    ev = [ln.strip() for ln in (log.plain[first], *detail[:1], *(log.plain[i] for i, _ in monitored[1:2]))]
    who, why = MEMORY_MONITORS[name]
    rank = target if target and target[:4] == "rank" else None
    return Finding(
        "HOST_OOM",
        f"{who} killed {target or 'a process'}: {why} (confirmed by {who})",
        list(dict.fromkeys(ev)),
        rank,
        advice=SIG[name].advice,
    )


KILLED_NAMED = (
    re.compile(r'sending SIG\w+ to process (\d+) (?:uid \d+ )?"([^"]*)"'),  # earlyoom: "python3" (pid N)
    re.compile(r"Killed (\S+) due to memory"),  # systemd-oomd: the unit's cgroup
    re.compile(r"^(\S+)\s+\d+/\d+\s+OOMKilled\b"),
)  # kubectl get pods: the pod


def _killed(log: Log, monitored: list[tuple[int, str]]) -> str | None:
    """What a memory monitor killed, as it names it: a rank (the prefix's, or Ray's pid that Ray Train ranked), a pid,
    a process, a unit, a pod."""
    at = [i for i, _ in monitored]
    pids = ["".join(p) for i in at for ln in log.plain[i : i + 2] for p in RAY_PID.findall(ln)]
    ranked = [log.names[f"pid{p}"] for p in pids if f"pid{p}" in log.names]
    if log.rank_only(at) or ranked:
        return log.rank_only(at) or ranked[0]
    for i in at:
        for rx in KILLED_NAMED:
            m = rx.search(log.plain[i])
            if m:
                return f'"{m[2]}" (pid {m[1]})' if m.lastindex == 2 else m[1].rsplit("/", 1)[-1]
    return f"pid {pids[0]}" if pids else None


def _scheduler_end(log: Log, ctx: Context) -> Finding | None:
    """The scheduler's or the cloud's own end lines (Slurm's ends, a spot or preemptible VM reclaimed, a pod evicted),
    unless a rank had already failed by itself before them (then that is the cause and the job hung until it was
    ended); the SIGTERM tracebacks after them are their consequence. A node failure also outranks the timeouts and
    network errors before its line (the other nodes lost it first); any other end (a step cancelled once a task
    failed) does not."""
    ends = sorted((i, name) for name in SCHEDULER_ENDS for i in log.hits(name))
    if not ends:
        return None
    first, name = ends[0]
    before = [i for i in log.hits("sigkill") + log.hits("kernel_oom") + own_native(log) if i < first]
    if name != "slurm_node_fail":
        before += [i for i in log.hits("nccl_timeout") + log.hits("nccl_network") if i < first]
    if before or any(not tb.consequence and tb.at < first for tb in tracebacks(log)):
        return None
    sig = SIG[name]
    said = _evicted_why(log) if name == "k8s_evicted" else None
    reason = f"{END_REASON[name]} ({said})" if said else END_REASON[name]
    return Finding(sig.state, reason, [log.plain[first], *[log.plain[i] for i, _ in ends[1:2]]], advice=sig.advice)


def _evicted_why(log: Log) -> str:
    """Why Kubernetes evicted the pod, in its words: the kubelet's resource, a node shutdown, a preemptor."""
    said = [SIG["k8s_evicted"].pattern.search(log.plain[i])[1] for i in log.hits("k8s_evicted")]
    return next((w for w in said if not w.startswith("Reason") and "Evicted" not in w), said[0])


def _config(log: Log, ctx: Context) -> Finding | None:
    cfg = log.hits("config_error")
    if cfg:
        return Finding("CONFIG_ERROR", "the trainer rejected its config", [log.plain[cfg[-1]]])
    setup = log.hits("setup_error")
    if setup and not _trained(log):
        what = SIG["setup_error"].pattern.search(log.plain[setup[-1]])[1]
        return Finding(
            "CONFIG_ERROR",
            f"this machine cannot run the job: {what}; a restart repeats it",
            [log.plain[setup[-1]]],
            early=True,
        )
    return None


def _trained(log: Log) -> bool:
    return any(LOSS_VALUE.search(ln) or STEP_LINE.match(ln) for ln in log.plain)


def _crashed(log: Log, ctx: Context) -> Finding | None:
    """A rank's own exception (the root-cause rank torchrun or srun names, else the earliest); then a CUDA error or a
    fatal signal that left no Python traceback (not an abort the collective layer caused); then a launcher's word that
    a rank exited; a wrapper's summary or a peer's error only where nothing else is (NCCL timeouts and network errors
    with no own error are NCCL_TIMEOUT and NCCL_ERROR)."""
    tbs = tracebacks(log)
    own = [tb for tb in tbs if not tb.consequence]
    collective = log.hits("nccl_timeout") or log.hits("nccl_network") or lost_peer_abort(log)
    if not own:
        native = own_native(log)
        if native:
            i = native[0]
            rank = log.streams[i]
            what = SIG["cuda_error"].pattern.search(log.plain[i]) or SIG["fatal_signal"].pattern.search(log.plain[i])
            what = what[1]
            return Finding(
                "CRASHED", f"{what}{f' on {rank}' if rank else ''}", [log.plain[j] for j in native[:2]], rank
            )
        tasks = log.hits("srun_task_exit")
        if tasks and not collective:
            m = SIG["srun_task_exit"].pattern.search(log.plain[tasks[0]])
            return Finding(
                "CRASHED",
                f"task {m[2]} on {m[1]} exited with exit code {m[3]}",
                [log.plain[i] for i in tasks[:2]],
                f"rank{re.split('[,-]', m[2])[0]}",
            )
        exits = [(i, *launcher_exit(log, i)) for i in log.hits("launcher_exit")]
        exits = [(i, who, code) for i, who, code in exits if code and code not in (-9, -15)]
        if exits and not collective_cause(log):
            i, who, code = exits[0]
            how = f"was ended by {signal_name(code)}" if code < 0 else f"exited with code {code}"
            return Finding(
                "CRASHED",
                f"{who or 'a process'} {how} (the launcher's word; no error of its own in the log)",
                [log.plain[i]],
                who,
            )
        died = log.hits("ray_worker_died")
        if died and not collective and not tbs:
            return Finding(
                "CRASHED",
                "Ray says a worker died or the run failed (Ray's word; its cause is not in the log)",
                [log.plain[died[0]]],
                log.rank_only(died),
            )
        if collective or not tbs:
            return None
    tb = (own or tbs)[0]
    where = f" on {tb.stream}" if tb.stream else ""
    ev = [tb.exception, *tb.frames[-3:]]
    if START_ERRORS.match(tb.exception) and not _trained(log):
        name = tb.exception.split(":")[0]
        reason = f"failed before its first step: {name}{where}; a restart repeats it"
        return Finding("CONFIG_ERROR", reason, ev, tb.stream or None, early=True)
    return Finding("CRASHED", f"{tb.exception.split(':')[0]}{where}", ev, tb.stream or None)


def _aborts(log: Log) -> str:
    """What the collective layer's aborts add to a reason: they follow from the cause, they are not the failure."""
    aborts = [i for i in log.hits("fatal_signal") if collective_abort(log, i)]
    if not aborts:
        return ""
    named = ", ".join(sorted({s for s in (log.streams[i] for i in aborts) if s}))
    return f"; the aborts that follow{f' ({named})' if named else ''} are its consequence"


def _network(log: Log, ctx: Context) -> Finding | None:
    """The network between ranks broke (NCCL's system and remote errors, its socket and InfiniBand warnings, a reset
    connection, a peer lost before the watchdog aborted): above the timeouts and aborts it causes, below any rank's
    own failure."""
    net = log.hits("nccl_network") or lost_peer_abort(log)
    if not net:
        return None
    first = net[0]
    where = f" on {log.streams[first]}" if log.streams[first] else ""
    what = SIG["nccl_network"].pattern.search(log.plain[first]) or SIG["peer_lost"].pattern.search(log.plain[first])
    what = what[1].strip()
    ev = list(dict.fromkeys([log.plain[first].strip(), log.plain[net[-1]].strip()]))
    ev += [log.plain[i] for i in log.hits("nccl_timeout")[:1]]
    return Finding(
        "NCCL_ERROR", f"the connection between ranks broke{where}: {what[:120]}{_aborts(log)}", ev, log.streams[first]
    )


def _nccl(log: Log, ctx: Context) -> Finding | None:
    nccl = log.hits("nccl_timeout")
    if not nccl:
        return None
    ev = [log.plain[nccl[0]]] + ([log.plain[nccl[-1]]] if len(nccl) > 1 else [])
    return Finding("NCCL_TIMEOUT", f"an NCCL collective timed out{_aborts(log)}", ev)


# The rules in root-cause order: the first that finds something names the failure
RULES = (
    gpu_fault,
    _dense_guard,
    _diverged,
    _disk_full,
    _memory,
    _recompile,
    _scheduler_end,
    _host_oom,
    _config,
    _crashed,
    _network,
    _nccl,
)


def classify_log(
    text: str | list[str],
    gpu_total_gib: float | None = None,
    disk_free_gib: float | None = None,
    checkpoint_gib: float | None = None,
) -> Finding | None:
    """The most specific failure the log shows, or None. A root cause outranks its consequences (`RULES`' order
    follows the signatures' ranks)."""
    log = Log.of(text)
    ctx = Context(gpu_total_gib, disk_free_gib, checkpoint_gib)
    for rule in RULES:
        found = rule(log, ctx)
        if found:
            return found
    return None


def normal_end_at(lines: list[str]) -> int | None:
    """The index of the newest line that says the log ended normally (the trainer's finish line, run.sh's `exit 0`,
    HF Trainer's `train_runtime`, Lightning's stop at max_steps / max_epochs), or None."""
    maybe = [i for i in range(len(lines) - 1, -1, -1) if any(w in lines[i] for w in FINISHED_WORDS)]
    learned = learn_prefix(lines) if maybe else None
    return next((i for i in maybe if FINISHED_LINE.search(strip_prefix(lines[i], learned)[1].strip())), None)


def cut_traceback(lines: list[str]) -> list[str]:
    """Where the log ends inside a traceback (no exception line yet): the stream and the last frame it reached, as
    evidence; [] when none."""
    log = Log.of(lines)
    cut = [tb for s in dict.fromkeys(log.streams) for tb in tracebacks_of(log, s) if not tb.exception]
    if not cut:
        return []
    tb = max(cut, key=lambda t: t.at)
    where = f" on {tb.stream}" if tb.stream else ""
    code = tb.code[-1:] if len(tb.code) >= len(tb.frames) else []  # the source line under that frame, if shown
    return [f"a traceback cut short{where}; the last frame it reached: {tb.frames[-1]}", *code]


def exit_line(lines: list[str]) -> int | None:
    """The exit status run.sh wrote at the end of the attempt, if the log has it."""
    maybe = [ln for ln in reversed(lines) if "[dflashctl]" in ln]
    learned = learn_prefix(lines) if maybe else None
    for ln in maybe:
        if m := EXIT_LINE.match(strip_prefix(ln, learned)[1].strip()):
            return int(m[1])
    return None
