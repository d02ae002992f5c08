"""Pure: the facts the judge works on (`History`, `Thresholds`) and what it says (`Verdict`), and the ONE table of
states: name, exit code, whether it is final, whether it is a failure, what to do next, and its colour. Every list
of states elsewhere (the failure set, the final set, the exit codes of `watch`/`status`/`diagnose`/`kill`, their
help text, the live view's colours, the advice in a verdict) is read from this table.

Plain classes and stdlib only: the supervisor runs this on the remote, on Python 3.8.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


class State:
    """One row of the table. `terminal`: the job will not change state by itself (a watch ends there, unless its
    policy restarts it). `failure`: something went wrong (`ls -s failed`, the bell, a notice's priority).
    `restart`: "default" (in every job's `restart_on` unless it says otherwise), "yes" (a job file may list it),
    "never" (refused in `restart_on`: the cause would repeat, or someone stopped it on purpose), or None (not a
    failure a restart is for). `alive`: the job may still be running. `running`: its attempt runs (a step may come).
    `quiet`: pages nobody. `cascade`: what the other nodes show when one failed first. `end`: the job's own end (one
    notice, whatever the attempt). `recorded`: a job's record can hold it (not a log's INCOMPLETE). `record_only`:
    only a record says it (gc removed the run dir), never a look at the host."""

    __slots__ = (
        "name",
        "code",
        "terminal",
        "failure",
        "advice",
        "colour",
        "restart",
        "alive",
        "running",
        "quiet",
        "cascade",
        "end",
        "recorded",
        "record_only",
    )

    def __init__(
        self,
        name: str,
        code: int,
        *,
        terminal: bool = False,
        failure: bool = False,
        advice: str | None = None,
        colour: str = "bold red",
        restart: str | None = None,
        alive: bool = False,
        running: bool = False,
        quiet: bool = False,
        cascade: bool = False,
        end: bool = False,
        recorded: bool = True,
        record_only: bool = False,
    ) -> None:
        self.name, self.code, self.terminal, self.failure = name, code, terminal, failure
        self.advice, self.colour, self.restart = advice, colour, restart
        self.alive, self.running, self.quiet, self.cascade, self.end = alive, running, quiet, cascade, end
        self.recorded, self.record_only = recorded, record_only

    def __repr__(self) -> str:
        return f"State({self.name}, {self.code})"


NOT_RESTARTED = " Not restarted: it would repeat."
STATES = (
    State("STARTING", 0, colour="cyan", alive=True, running=True, quiet=True),
    State("RUNNING", 0, colour="green", alive=True, running=True, quiet=True),
    State(
        "PENDING",
        0,
        colour="cyan",
        alive=True,
        quiet=True,
        advice="the job waits in Slurm's queue for the reason shown (Priority, Resources, ReqNodeNotAvail, ...); "
        "`squeue --start -j ID` estimates when it starts.",
    ),
    State(
        "QUEUED",
        0,
        colour="cyan",
        alive=True,
        quiet=True,
        advice="the job waits on its host for GPUs another job holds (`launch --queue`): it starts by itself when they "
        "free, first come first served, with no laptop attached; `dflashctl kill` takes it out of the queue.",
    ),
    State(
        "STOPPING",
        0,
        colour="cyan",
        alive=True,
        quiet=True,
        advice="a stop was requested (`dflashctl kill`); no watcher restarts this job.",
    ),
    State("FINISHED", 0, terminal=True, colour="bold green", end=True, restart="never"),
    State(
        "CRASHED",
        10,
        terminal=True,
        failure=True,
        restart="default",
        advice="fix the exception shown; where it was transient, a restart resumes from the newest checkpoint.",
    ),
    State(
        "OOM",
        11,
        terminal=True,
        failure=True,
        restart="yes",
        advice="lower data.batch_size or anchors_per_seq, turn on drafter.activation_checkpointing, or drop the "
        "largest bucket.",
    ),
    State(
        "NCCL_TIMEOUT",
        12,
        terminal=True,
        failure=True,
        restart="default",
        cascade=True,
        advice="a rank hung or died inside a collective: read the other ranks' lines and check the GPUs; a restart "
        "with --resume usually helps.",
    ),
    State(
        "STALLED",
        13,
        failure=True,
        colour="yellow",
        restart="default",
        alive=True,
        running=True,
        cascade=True,
        advice="read `dflashctl logs` and dump the processes (py-spy); a restart resumes from the newest checkpoint.",
    ),
    State(
        "DENSE_FALLBACK",
        14,
        terminal=True,
        failure=True,
        restart="never",
        advice="flex_attention ran, or was about to run, without compile: check TORCH_COMPILE_DISABLE, the "
        "recompile limit and the preflight buckets." + NOT_RESTARTED,
    ),
    State(
        "RECOMPILE_LIMIT",
        15,
        terminal=True,
        failure=True,
        restart="never",
        advice="shapes vary more than the compiled buckets allow: fix the bucketing or raise "
        "attention.recompile_limit." + NOT_RESTARTED,
    ),
    State(
        "LOST",
        16,
        terminal=True,
        failure=True,
        restart="yes",
        cascade=True,
        advice="the tmux session or the run dir disappeared (reboot, or killed by someone): relaunch it.",
    ),
    State(
        "CONFIG_ERROR",
        17,
        terminal=True,
        failure=True,
        restart="never",
        advice="fix the config key, module or file named; the job did not start training." + NOT_RESTARTED,
    ),
    State(
        "UNREACHABLE",
        18,
        colour="magenta",
        alive=True,
        quiet=True,
        advice="the host does not answer; the job's last known state is kept until it does.",
    ),
    State(
        "PROBE_FAILED",
        19,
        terminal=True,
        failure=True,
        alive=True,
        advice="the host answered but the probe failed there: check the host's `python:` setting and its disk; "
        "the error is shown.",
    ),
    State("KILLED", 20, terminal=True, colour="yellow", end=True),
    State(
        "KILL_FAILED",
        21,
        terminal=True,
        failure=True,
        end=True,
        advice="run `dflashctl kill` again on this job: it retries the same job and names what survived.",
    ),
    State(
        "DIVERGED",
        22,
        terminal=True,
        failure=True,
        restart="yes",
        advice="the loss or the gradient norm is NaN/inf: lower optim.lr, check the data and the target's dtype; "
        "resume from the checkpoint before the divergence (no non-finite one is kept). Not restarted by default: "
        "it would diverge again.",
    ),
    State(
        "GPU_FAULT",
        23,
        terminal=True,
        failure=True,
        restart="never",
        advice="a GPU failed in hardware (ECC, Xid, fallen off the bus): relaunch on other GPUs (`gpus:`) and have "
        "the GPU checked (`nvidia-smi -q -d ECC,PAGE_RETIREMENT`). Never restarted onto that GPU.",
    ),
    State(
        "HOST_OOM",
        24,
        terminal=True,
        failure=True,
        restart="yes",
        advice="the host ran out of RAM and the kernel killed a rank: lower host RAM per rank (fewer dataloader "
        "workers, smaller prefetch, no host copies of the target) or use fewer ranks per host.",
    ),
    State(
        "DISK_FULL",
        25,
        terminal=True,
        failure=True,
        restart="yes",
        advice="the run dir's file system is full: free space (old checkpoints, inductor caches) or lower "
        "checkpoint.keep; not restarted while the disk is still full.",
    ),
    State(
        "TIMEOUT",
        26,
        terminal=True,
        failure=True,
        restart="default",
        advice="the job ran out of its wall time (sbatch --time): a restart resubmits it with --resume from the "
        "newest checkpoint; ask for a longer `time:` to need fewer.",
    ),
    State(
        "PREEMPTED",
        27,
        terminal=True,
        failure=True,
        restart="default",
        advice="the scheduler took the nodes for a job of higher priority: a restart resubmits with --resume.",
    ),
    State(
        "NODE_FAIL",
        28,
        terminal=True,
        failure=True,
        restart="default",
        advice="a node of the allocation failed: a restart resubmits with --resume, excluding that node.",
    ),
    State(
        "CANCELLED",
        29,
        terminal=True,
        failure=True,
        restart="never",
        advice="the Slurm job was cancelled outside dflashctl (scancel, an administrator): relaunch it if that was "
        "not meant. Not restarted: someone stopped it on purpose.",
    ),
    State(
        "INCOMPLETE",
        30,
        colour="yellow",
        quiet=True,
        recorded=False,
        advice="the log shows no failure and no normal end: it was cut off, the job is still running, or it ended "
        "in a way no signature knows. Read its last lines (`dflashctl logs`), or ask `dflashctl status`.",
    ),
    State(
        "NCCL_ERROR",
        31,
        terminal=True,
        failure=True,
        restart="default",
        cascade=True,
        advice="the connection between ranks broke (a connection reset, an InfiniBand or socket error, a peer "
        "gone): check the interconnect on the hosts named (`ibstat`, NCCL_SOCKET_IFNAME / NCCL_IB_HCA, the "
        "switch), then restart with --resume; if it repeats on one host, leave that host out.",
    ),
    State(
        "REMOVED",
        32,
        terminal=True,
        colour="dim",
        record_only=True,
        advice="`dflashctl gc` removed its run dir: nothing of it is left on the host (`dflashctl ls --forget ID` "
        "drops the record).",
    ),
    State(
        "SETUP_FAILED",
        33,
        terminal=True,
        failure=True,
        restart="never",
        advice="the job file's `setup:` failed or ran past `setup_timeout_s`; its last lines are the evidence, all of "
        "its output is the run dir's setup.log. Fix it and launch again: the job's command never started, and no "
        "success was recorded for this release, so the next launch runs the setup again." + NOT_RESTARTED,
    ),
)


def names(**where) -> tuple:
    """The states whose columns have these values, in table order: `names(alive=True)`, `names(restart="default")`."""
    return tuple(s.name for s in STATES if all(getattr(s, k) == v for k, v in where.items()))


BY_NAME = {s.name: s for s in STATES}
FAILURES = names(failure=True)
TERMINAL = names(terminal=True)
ALIVE = names(alive=True)  # the job may still be running: a record in one of these is not forgotten lightly
RUNNING_STATES = names(running=True)  # its attempt runs: throughput and time left mean something
QUIET = names(quiet=True)  # pages nobody
CASCADE = names(cascade=True)  # what the other nodes show when one failed first (judge/nodes.py)
ENDS = names(end=True)  # the job's end: one notice, whatever the attempt
RESTARTABLE = tuple(s.name for s in STATES if s.restart in ("default", "yes"))  # what `restart_on` may list
DEFAULT_RESTART_ON = names(restart="default")
NEVER_RESTART = names(restart="never")  # refused in `restart_on`, with why
RECORDED = names(recorded=True)  # what a job's record can hold
RECORD_ONLY = names(record_only=True)  # what a job's record says of it (gc); never what a log or a look shows
DONE_FOR_GOOD = tuple(s.name for s in STATES if s.terminal and not s.failure)  # no look at the host changes them
EXIT_BY_STATE = {s.name: s.code for s in STATES}
ADVICE = {s.name: s.advice for s in STATES if s.advice}
COLOURS = {s.name: s.colour for s in STATES}


def exit_code(state: str, unknown: int = 1) -> int:
    """The exit code of `watch`, `status`, `kill` and `diagnose` for a state (`unknown` for a name not here)."""
    s = BY_NAME.get(state)
    return s.code if s is not None else unknown


def exit_codes_help() -> str:
    """The exit codes in words, for help text: `0 FINISHED, RUNNING, ...; 10 CRASHED; ...` (generated, never typed)."""
    by_code: dict = {}
    for s in STATES:
        by_code.setdefault(s.code, []).append(s.name)
    return "; ".join(f"{code} {', '.join(names)}" for code, names in sorted(by_code.items()))


@dataclass
class Thresholds:
    """When a live job counts as stalled: seconds measured on the measurer's clock, and throughput bounds."""

    stall_after_s: float = 600.0  # no new step (or no sign of progress) for this long: STALLED
    startup_budget_s: float = 3600.0  # no first step within this long after the start: STALLED
    heartbeat_max_age_s: float = 120.0  # the trainer's heartbeat unchanged this long: STALLED (process frozen)
    throughput_floor: float | None = None  # tokens/s under this for `slow_polls` polls: STALLED
    throughput_drop: float = 0.3  # tokens/s under this fraction of its median for `slow_polls` polls: STALLED
    slow_polls: int = 3

    @classmethod
    def of(cls, watch: dict) -> Thresholds:
        """From a job file's `watch` as a mapping (what the CLI validated, what the supervisor reads from the run
        dir); a key left out or null keeps its default."""
        d = cls()
        floor = watch.get("throughput_floor")
        return cls(
            float(watch.get("stall_after_s") or d.stall_after_s),
            float(watch.get("startup_budget_s") or d.startup_budget_s),
            float(watch.get("heartbeat_max_age_s") or d.heartbeat_max_age_s),
            float(floor) if isinstance(floor, (int, float)) else None,
            float(watch.get("throughput_drop") or d.throughput_drop),
            int(watch.get("slow_polls") or d.slow_polls),
        )


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
    restarting: bool = False  # a restart held the run dir's lock during the look: its panes and files are between two
    restarting_after: dict | None = None  # that restart's recorded cause (judge/cause.py): after, reason, evidence, by
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
    attempt_age_s: float | None = None  # how long the attempt has run, remote monotonic clock (None: wall stamps)
    exit_age_s: float | None = None  # since exit_code was first seen, remote monotonic clock (None: exit_time's)
    stop_age_s: float | None = None  # since the stop request was first seen, likewise (None: its `time`'s)
    history_error: str | None = None  # the run dir's progress history could not be written: one look judges
    queue: dict | None = None  # the run dir's ticket (queue.json): the job waits on its host for its GPUs
    setup: dict | None = None  # this attempt's setup step (setup.json): waiting, running, done or failed, its tail


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
