"""Pure: the one table of what a log line means (`SIGNATURES`), read by the classifier in logs.py.

Each row names a kind of line: the pattern, the state it points to, its rank (lower outranks higher: a GPU's hardware
error over the other ranks' NCCL timeouts, a rank's own exception over torchrun's ChildFailedError summary), its role
and what to do where the state's own advice says too little. The role is explicit: a ROOT line is a failure in its own
right; a CASCADE line follows from another failure (a collective timing out because a peer died, a launcher reporting
that a child exited, Ray saying a worker is gone) and decides only where nothing else does. Every wording below is
what the tool prints; tests/logs/ holds a real-shaped log for each row.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from .facts import ADVICE  # the advice lives in the one state table

ROOT, CASCADE = "root", "cascade"

# A SIGKILL that no kernel log confirms: the OOM killer is the usual sender, but not the only one
SIGKILL_ADVICE = (
    "a process was killed by signal 9 (SIGKILL): confirm the OOM killer on that host (`dmesg -T | grep "
    "-i -e oom -e 'killed process'`, `journalctl -k`); if it was, lower host RAM per rank (fewer "
    "dataloader workers, smaller prefetch) or use fewer ranks per host. If the kernel log shows no OOM "
    "kill, something else sent it (a scheduler's memory limit, a user, a watchdog): find it first."
)
DENSE_ATTENTION_ADVICE = (
    "attention materialised the full score matrix (eager attention or SDPA's math kernel): use "
    "a fused kernel (compiled flex_attention, SDPA flash/memory-efficient with bf16/fp16 inputs "
    "and a supported mask) or shorter sequences. Not restarted: it would repeat."
)
RAY_OOM_ADVICE = (
    "Ray's memory monitor killed a worker when the node's RAM passed RAY_memory_usage_threshold: lower "
    "host RAM per worker (fewer dataloader workers, no host copies of the target), give each worker more "
    "CPUs (fewer per node), or raise the threshold when starting Ray."
)
K8S_OOM_ADVICE = (
    "the container passed its memory limit and the kernel killed it (OOMKilled, exit 137): raise the "
    "pod's resources.limits.memory or lower host RAM per rank (fewer dataloader workers, smaller "
    "prefetch)."
)
USERSPACE_OOM_ADVICE = (
    "a userspace OOM daemon (systemd-oomd, earlyoom) killed the job under memory pressure before "
    "the kernel had to: lower host RAM per rank, or run the job in its own unit/slice with a "
    "MemoryMax so that the daemon leaves it alone; `journalctl -u systemd-oomd -u earlyoom` says "
    "what it saw."
)
CLOUD_PREEMPT_ADVICE = (
    "the cloud took the machine back (a spot or preemptible VM reclaimed) or the cluster evicted "
    "the job: a restart resumes from the newest checkpoint on another node (a SkyPilot managed job "
    "recovers by itself: `sky jobs queue`); checkpoint more often, or use on-demand capacity if it "
    "keeps happening."
)
EVICTED_ADVICE = (
    "Kubernetes evicted the pod (node pressure, a node drain or shutdown, or a pod of higher priority): "
    "a restart resumes from the newest checkpoint; for a memory-pressure eviction set the container's "
    "memory request equal to its limit (Guaranteed QoS) so that the kubelet evicts others first."
)


@dataclass(frozen=True)
class Signature:
    """A kind of line: what it points to, how near the root cause it is (lower outranks higher), what to do."""

    name: str
    state: str
    pattern: re.Pattern[str]
    rank: int
    advice: str | None = None
    unless: re.Pattern[str] | None = None  # a line that also matches this is not one (noise with the same words)
    role: str = ROOT  # ROOT: a failure in its own right; CASCADE: follows from another failure
    needles: tuple[str, ...] = ()  # lower-cased words one of which every match holds: found first, by plain search

    @property
    def what_to_do(self) -> str | None:
        return self.advice or ADVICE.get(self.state)


def _sig(
    name: str,
    state: str,
    rank: int,
    pattern: str,
    flags: int = 0,
    advice: str | None = None,
    unless: str | None = None,
    role: str = ROOT,
) -> Signature:
    return Signature(
        name, state, re.compile(pattern, flags), rank, advice, re.compile(unless) if unless else None, role
    )


# Ranks: hardware 10, the trainer's own stops 20-25, memory 30-41, the scheduler's and the cloud's ends 44-46, start
# errors 50, a rank's own exception 60, consequences of another rank's failure 70 and over (the CASCADE rows).
# fmt: off
SIGNATURES: tuple[Signature, ...] = (
    _sig("gpu_hardware", "GPU_FAULT", 10,
         r"(uncorrectable ECC error|ECC_UNCORRECTABLE|ECCUncorrectable|fallen off the bus|GPU is lost|GPU_IS_LOST|"
         r"uncorrectable NVLink error|row remapp\w* failure|double bit ECC|Unable to determine the device handle for "
         r"GPU)", re.I),
    _sig("xid", "GPU_FAULT", 10, r"NVRM: Xid \((?:PCI:)?([0-9a-fA-F:.]+)\): (\d+)"),
    _sig("dense_guard", "DENSE_FALLBACK", 15, r"DenseFallbackError"),
    _sig("diverged_stop", "DIVERGED", 20, r"^(?:\S+\.)?DivergedError\b|NonFiniteWeightsError"),
    _sig("nan_error", "DIVERGED", 21,
         r"(returned nan values|Loss is (?:NaN|nan|inf)|loss is not finite|non-finite loss|Detected (?:NaN|nan|inf) "
         r"in|grad norm is (?:nan|inf))", re.I),
    # Frameworks' own NaN checks: Megatron-LM's (and Accelerate's Megatron plugin's) assertions and its rerun state
    # machine, DeepSpeed's fp16 loss scaler at its floor, Lightning's finite checks, torch's clip_grad_norm_
    _sig("framework_nan", "DIVERGED", 21,
         r"(found (?:NaN|Inf) in local (?:grad norm|forward loss calculation)|Unexpected result (?:nan|inf|-inf) "
         r"\(message=|Current loss scale already at minimum - cannot decrease scale anymore|Monitored metric \S+ = "
         r"(?:tensor\()?-?(?:nan|inf)\b.{0,40}? is not finite|Detected nan and/or inf values in|The loss returned in "
         r"`training_step` is (?:nan|inf)|for gradients from `parameters` is non-finite)"),
    _sig("enospc", "DISK_FULL", 25,
         r"(No space left on device|\[Errno 28\]|ENOSPC|StorageFull|Disk quota exceeded|\[Errno 122\]|EDQUOT)"),
    _sig("write_failed", "DISK_FULL", 26,
         r"(PytorchStreamWriter failed writing file|file write failed|unexpected pos \d+ vs \d+|Error while "
         r"serializing)"),
    _sig("cuda_oom", "OOM", 30,
         r"(CUDA out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED|CUDA error: out of memory|HIP out of "
         r"memory)", unless=r"ray\.exceptions\.OutOfMemoryError|RayTaskError\(OutOfMemoryError\)|running low on "
         r"memory"),  # Ray's OutOfMemoryError is its memory monitor (host RAM), not the GPU's
    _sig("recompile_raised", "RECOMPILE_LIMIT", 34,
         r"((?:FailOnRecompileLimitHit|FailOnCacheLimitHit): .*|Detected recompile when torch\.compile stance is "
         r"'fail_on_recompile')"),  # the exception's line, not the `raise` line of a frame's source
    _sig("recompile_limit", "RECOMPILE_LIMIT", 35, r"torch\._dynamo hit config\.(recompile_limit|cache_size_limit)"),
    _sig("eager_flex", "DENSE_FALLBACK", 36, r"flex_attention called without torch\.compile"),
    _sig("sdpa_unfused", "DENSE_FALLBACK", 37,
         r"((?:Flash attention|Memory efficient|Flash Attention|cuDNN attention) kernel not used because|Both fused "
         r"kernels require|No available kernel\. Aborting)", advice=DENSE_ATTENTION_ADVICE),
    # Memory monitors that kill before (or instead of) the kernel: the kill is the root, what follows its cascade
    _sig("ray_memory_monitor", "HOST_OOM", 38,
         r"(killed due to the node running low on memory|Workers? \(tasks / actors\) killed due to memory pressure "
         r"\(OOM\))", advice=RAY_OOM_ADVICE),
    _sig("k8s_oom_killed", "HOST_OOM", 38, r"\bOOMKilled\b", advice=K8S_OOM_ADVICE),
    _sig("systemd_oomd", "HOST_OOM", 38,
         r"(Killed \S+ due to (?:memory pressure for \S+ being|swap used \(\d+\) / total)|systemd-oomd killed \d+ "
         r"process\(es\)|Failed with result 'oom-kill')", advice=USERSPACE_OOM_ADVICE),
    _sig("earlyoom", "HOST_OOM", 38,
         r"(low memory! at or below SIG(?:TERM|KILL) limits|sending SIG(?:TERM|KILL) to process \d+ (?:uid \d+ )?\")",
         advice=USERSPACE_OOM_ADVICE),
    _sig("dataloader_killed", "HOST_OOM", 40,
         r"DataLoader worker \(pid\(?s?\)? ?[\d, ]+\)? is killed by signal: Killed"),
    _sig("kernel_oom", "HOST_OOM", 40,
         r"(Out of memory: Killed process \d+|oom-kill:|Memory cgroup out of memory|oom_reaper|Detected \d+ "
         r"oom[_-]kill events?|task \d+: Out Of Memory|A process of this unit has been killed by the OOM killer)"),
    _sig("sigkill", "HOST_OOM", 41,
         r"(exitcode\s*:\s*-9\b|\(exitcode: -9\)|Signal 9 \(SIGKILL\)|Signals\.SIGKILL|"
         r"^(?:.*:\s*)?(?:line \d+:\s*)?\d+\s+Killed\b|^Killed$|exit(?:ed)? (?:with )?(?:exit )?(?:code|status) 137\b|"
         r"task \d+: Killed$|return code = -9\b|terminated with code -9\b|exited on signal 9\b|"
         r"terminated with signal SIGKILL|EXIT STRING: Killed \(signal 9\))"),
    # The cloud or the cluster taking the machine back: SkyPilot's controller and `sky jobs logs`, GCE's audit log and
    # operations, AWS's spot interruption notice (IMDS, EventBridge, the node termination handler), Kubernetes
    _sig("skypilot_preempted", "PREEMPTED", 44,
         r"((?:The (?:job )?)?[Cc]luster is preempted(?: or failed)?\b|=== Recovering\.\.\. ===)",
         advice=CLOUD_PREEMPT_ADVICE),  # "or failed" since SkyPilot 0.6; its spot controller's older words too
    _sig("gce_preempted", "PREEMPTED", 44, r"(Instance was preempted\.|compute\.instances\.preempted)",
         advice=CLOUD_PREEMPT_ADVICE, unless=r"--filter|operationType="),  # the query asking for it is not one
    _sig("aws_spot_interruption", "PREEMPTED", 44,
         r"(Spot ITN received|EC2 Spot Instance Interruption Warning|\{\s*\"action\"\s*:\s*\"(?:terminate|stop|"
         r"hibernate)\"\s*,\s*\"time\"|instance-terminated-(?:by-price|no-capacity|capacity-oversubscribed|"
         r"launch-group-constraint)|marked-for-(?:termination|stop))",
         advice=CLOUD_PREEMPT_ADVICE),  # a spot request's status codes too
    _sig("k8s_evicted", "PREEMPTED", 44,
         r"(The node was low on resource: [\w-]+|Pod was terminated in response to imminent node shutdown|preempting "
         r"to accommodate a higher priority|Preempted by \S+ on node \S+|\bEvictionByEvictionAPI\b|"
         r"\bTerminationByKubelet\b|Reason:\s+Evicted\b|\b\d+/\d+\s+Evicted\s+\d+|The node had condition: \[\w+\]|"
         r"^evicting pod \S+|^pod/\S+ evicted$)", advice=EVICTED_ADVICE),  # `kubectl drain`'s own lines last
    _sig("slurm_time_limit", "TIMEOUT", 45, r"CANCELLED AT \S+ DUE TO TIME LIMIT|DUE TO TIME LIMIT \*\*\*"),
    _sig("slurm_preempted", "PREEMPTED", 45, r"CANCELLED AT \S+ DUE TO PREEMPTION|DUE TO PREEMPTION \*\*\*"),
    _sig("slurm_node_fail", "NODE_FAIL", 45,
         r"DUE TO NODE FAILURE|srun: error: Node failure on|NODE_FAIL|slurmstepd: error: \*\*\* .*NODE FAILURE"),
    _sig("slurm_cancelled", "CANCELLED", 46,
         r"\*\*\* (?:JOB|STEP) [\d.]+ (?:ON \S+ )?CANCELLED AT \S+ \*\*\*$|"
         r"CANCELLED AT \S+ DUE TO JOB REQUEUE|CANCELLED AT \S+ DUE TO (?:DEPENDENCY|SIGNAL)"),
    _sig("config_error", "CONFIG_ERROR", 50, r"^config error: "),
    _sig("setup_error", "CONFIG_ERROR", 51,
         r"(no kernel image is available for execution|No CUDA GPUs are available|Found no NVIDIA driver|CUDA driver "
         r"version is insufficient)"),
    _sig("cuda_error", "CRASHED", 55, r"(CUDA error: (?!out of memory)[^.\n]+|CUDA_ERROR_\w+|cudaError\w+)"),
    _sig("fatal_signal", "CRASHED", 56,
         r"(Segmentation fault|Fatal Python error: \w+|Signal (?:11|6) \(SIG(?:SEGV|ABRT)\)|"
         r"exitcode\s*:\s*-(?:6|11)\b|terminate called after throwing an instance of '[^']+'|Aborted \(core dumped\)|"
         r"return code = -(?:6|11)\b|terminated with code -(?:6|11)\b|exited on signal (?:6|11)\b|"
         r"terminated with signal SIG(?:SEGV|ABRT)|Signals\.SIG(?:SEGV|ABRT))"),
    _sig("traceback", "CRASHED", 60, r"^Traceback \(most recent call last\)"),
    _sig("srun_task_exit", "CRASHED", 70, r"srun: error: (\S+): tasks? ([\d,-]+): Exited with exit code (\d+)",
         role=CASCADE),
    _sig("launcher_exit", "CRASHED", 71,
         r"(exits with return code = -?\d+|Child process with PID \d+ terminated with code -?\d+|"
         r"process rank \d+ with PID \d+ on node \S+ exited on signal \d+|ssh exited with exit code \d+|"
         r"CalledProcessError: Command .* (?:died with <Signals|returned non-zero exit status)|"
         r"Process name:\s*\[\[\d+,\d+\],\d+\]|process \d+ terminated with (?:exit code|signal) \w+|"
         r"Job \d+ failed with return code list:.{0,12}\[[-\d, ]+\])", role=CASCADE),
    _sig("nccl_network", "NCCL_ERROR", 78,
         r"(ncclSystemError|unhandled system error|ncclRemoteError|remote process exited or there was a network error|"
         r"Connection reset by peer|"
         r"NCCL WARN .*(?:Connection (?:reset|closed|refused)|[Ss]ocket\w* ?:|NET/\w+ ?:|Net ?:|Call to \w+ .*failed|"
         r"IBV_WC_\w+|Got completion from peer|[Nn]etwork is unreachable|No route to host|connection abort))",
         unless=r"wandb|https?:|urllib3|requests\.|huggingface|Retrying"),  # a download retried, not the ranks' links
    _sig("nccl_timeout", "NCCL_TIMEOUT", 80,
         r"(Watchdog caught collective operation timeout|NCCL watchdog|ProcessGroupNCCL.*[Tt]imeout|Some NCCL "
         r"operations have failed or timed out|DistBackendError.*[Tt]imeout|ProcessGroupNCCL watchdog hang|watchdog "
         r"got stuck)", role=CASCADE),
    # Ray's word that a worker or an actor is gone, and Ray Train's summary: what killed it is said elsewhere
    _sig("ray_worker_died", "CRASHED", 82,
         r"(A worker died or was killed while executing a task by an unexpected system error|The actor died "
         r"unexpectedly before finishing this task|TrainingFailedError: The Ray Train run failed)", role=CASCADE),
    _sig("peer_lost", "NCCL_TIMEOUT", 85,
         r"(Connection (?:reset|closed) by peer|remote process exited|Check the logs of the remote worker|"
         r"ncclRemoteError|Broken pipe|NCCL communicator was aborted)", re.I, role=CASCADE),
)
# fmt: on

# Words one of which every match holds, lower-cased: a signature's pattern runs only on the lines that plain
# searches find these in (a regex over every line costs 10x; tests/test_diagnose_table.py checks they are sound)
# fmt: off
NEEDLES: dict[str, tuple[str, ...]] = {
    "gpu_hardware": ("ecc", "fallen off the bus", "gpu is lost", "gpu_is_lost", "nvlink", "row remapp",
        "device handle for gpu"),
    "xid": ("nvrm: xid",),
    "dense_guard": ("densefallbackerror",),
    "diverged_stop": ("divergederror", "nonfiniteweightserror"),
    "nan_error": ("nan", "inf", "not finite", "non-finite"),
    "framework_nan": ("found nan", "found inf", "unexpected result", "loss scale already at minimum", "is not finite",
        "detected nan and/or inf", "training_step", "non-finite"),
    "enospc": ("no space left", "errno 28", "enospc", "storagefull", "disk quota exceeded", "errno 122", "edquot"),
    "write_failed": ("pytorchstreamwriter failed", "file write failed", "unexpected pos", "error while serializing"),
    "cuda_oom": ("out of memory", "outofmemoryerror", "cublas_status_alloc_failed"),
    "recompile_raised": ("failonrecompilelimithit", "failoncachelimithit", "fail_on_recompile"),
    "recompile_limit": ("hit config.",),
    "eager_flex": ("called without torch.compile",),
    "sdpa_unfused": ("kernel not used because", "both fused kernels require", "no available kernel"),
    "ray_memory_monitor": ("running low on memory", "killed due to memory pressure"),
    "k8s_oom_killed": ("oomkilled",),
    "systemd_oomd": ("due to memory pressure for", "due to swap used", "systemd-oomd killed", "oom-kill'"),
    "earlyoom": ("low memory!", "sending sig"),
    "dataloader_killed": ("is killed by signal",),
    "kernel_oom": ("oom", "out of memory"),
    "sigkill": ("-9", "sigkill", "killed", "137", "signal 9"),
    "skypilot_preempted": ("cluster is preempted", "=== recovering... ==="),
    "gce_preempted": ("instance was preempted", "compute.instances.preempted"),
    "aws_spot_interruption": ("spot itn received", "spot instance interruption warning", '"action"',
        "instance-terminated-", "marked-for-"),
    "k8s_evicted": ("low on resource", "imminent node shutdown", "accommodate a higher priority", "preempted by",
        "evictionbyevictionapi", "terminationbykubelet", "evicted", "the node had condition", "evicting pod"),
    "slurm_time_limit": ("due to time limit",),
    "slurm_preempted": ("due to preemption",),
    "slurm_node_fail": ("node failure", "node_fail"),
    "slurm_cancelled": ("cancelled at",),
    "config_error": ("config error: ",),
    "setup_error": ("no kernel image", "no cuda gpus", "no nvidia driver", "driver version is insufficient"),
    "cuda_error": ("cuda error", "cuda_error_", "cudaerror"),
    "fatal_signal": ("segmentation fault", "fatal python error", "sigsegv", "sigabrt", "exitcode", "terminate called",
        "aborted (core dumped)", "code = -", "code -", "on signal"),
    "traceback": ("traceback (most recent call last)",),
    "srun_task_exit": ("exited with exit code",),
    "launcher_exit": ("return code", "terminated with code", "exited on signal", "ssh exited", "calledprocesserror",
        "process name:", "terminated with exit code", "terminated with signal"),
    "nccl_network": ("ncclsystemerror", "unhandled system error", "ncclremoteerror", "remote process exited",
        "connection reset by peer", "nccl warn"),
    "nccl_timeout": ("watchdog", "processgroupnccl", "timed out", "distbackenderror"),
    "ray_worker_died": ("a worker died or was killed", "the actor died unexpectedly", "trainingfailederror"),
    "peer_lost": ("connection reset", "connection closed", "remote process exited",
        "check the logs of the remote worker", "ncclremoteerror", "broken pipe", "communicator was aborted"),
}
# fmt: on
SIGNATURES = tuple(replace(s, needles=NEEDLES[s.name]) for s in SIGNATURES)
SIG = {s.name: s for s in SIGNATURES}
CASCADE_SIGS = tuple(s for s in SIGNATURES if s.role == CASCADE)
# Who ran the check, for the reason: the first whose wording matches names the framework
FRAMEWORK_NAN = (
    (re.compile(r"found (?:NaN|Inf) in local|Unexpected result"), "Megatron's NaN check"),
    (re.compile(r"Current loss scale already at minimum"), "DeepSpeed's fp16 loss scaler (at its minimum scale)"),
    (re.compile(r"Monitored metric|Detected nan and/or inf|training_step"), "Lightning's finite check"),
    (re.compile(r"non-finite"), "torch's clip_grad_norm_ (error_if_nonfinite)"),
)
# Who killed, and why it says it did
MEMORY_MONITORS = {
    "ray_memory_monitor": ("Ray's memory monitor", "the node ran low on memory"),
    "k8s_oom_killed": ("Kubernetes", "OOMKilled: the container passed its memory limit"),
    "systemd_oomd": ("systemd-oomd", "memory pressure on its slice"),
    "earlyoom": ("earlyoom", "the host ran low on memory"),
}
SCHEDULER_ENDS = (
    "slurm_time_limit",
    "slurm_preempted",
    "slurm_node_fail",
    "slurm_cancelled",
    "skypilot_preempted",
    "gce_preempted",
    "aws_spot_interruption",
    "k8s_evicted",
)
END_REASON = {
    "slurm_time_limit": "Slurm cancelled the job: out of wall time",
    "slurm_preempted": "Slurm preempted the job",
    "slurm_node_fail": "Slurm ended the job: a node failed",
    "slurm_cancelled": "the Slurm job was cancelled (scancel, or an administrator)",
    "skypilot_preempted": "SkyPilot: the job's cluster was preempted or failed under it",
    "gce_preempted": "Compute Engine preempted the VM (spot/preemptible)",
    "aws_spot_interruption": "AWS is reclaiming the spot instance (interruption notice)",
    "k8s_evicted": "Kubernetes evicted the pod",
}
