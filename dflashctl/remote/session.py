"""tmux on the remote: the run directory, the wrapper a job runs under, and the one remote call that does each thing.

Jobs live on a dedicated tmux server (`tmux -L dflashctl`; $DFLASHCTL_TMUX_SOCKET names another, which the tests
use so as never to touch real jobs), one session per job, `remain-on-exit on` so that a dead pane keeps its exit
status, and a large history. The pane runs the agent's launcher (`agent.pyz launch`, a child subreaper) which runs
`run.sh`: it exports the job's environment from `job.env` (including DFLASHCTL_JOB_ID, which tags every process of
the job), runs `command.sh` in the job's release of the code, tees all output into `train.log` and writes `exit_code`
when the command ends. The run dir is 0700 and its files 0600: job.env holds the job's environment, secrets included,
NUL-separated (`KEY=VALUE\0`: any value, a newline in it too, survives), written once at launch; the wrapper, `exec`
and `shell` all read that one file, so they see the very same environment.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import shlex
from dataclasses import dataclass

from dflashctl.agent import gpus
from dflashctl.config import SAFE_NAME, HostConfig, SlurmHost
from dflashctl.errors import ConfigError, ProbeFailedError
from dflashctl.judge.redact import redact_url
from dflashctl.model.jobfile import JobConfig, is_secret, node_tag, redact_env, redact_job_snapshot
from dflashctl.remote.agent_bundle import AGENT, boot_argv, note_noise, split_answer
from dflashctl.remote.deploy_record import AgentPython, remembered_python
from dflashctl.remote.transport import Runner, container_prefix

SOCKET_ENV = "DFLASHCTL_TMUX_SOCKET"
TMUX_CONF = "set -g history-limit 100000\nset -g remain-on-exit on\n"
MAX_REQUEST_BYTES = 100_000  # one argv string: the kernel's limit is 128 KiB

# GPU readings on the container's host, then the probe inside the container, in one command: "$@" is the
# container exec + python + request.
HOST_GPU_SCRIPT = (
    "g=$(nvidia-smi --query-gpu=" + ",".join(gpus.GPU_FIELDS) + " --format=csv,noheader,nounits 2>/dev/null)\n"
    "a=$(nvidia-smi --query-compute-apps=" + ",".join(gpus.APP_FIELDS) + " --format=csv,noheader,nounits 2>/dev/null)\n"
    'exec "$@" "$g" "$a"\n'
)


def tmux_socket() -> str:
    """The tmux server jobs are started on: `dflashctl`, or $DFLASHCTL_TMUX_SOCKET."""
    name = os.environ.get(SOCKET_ENV, "dflashctl")
    if not SAFE_NAME.fullmatch(name):
        raise ConfigError("environment", SOCKET_ENV, "may hold only [A-Za-z0-9._-]")
    return name


def session_name(job_id: str) -> str:
    """tmux forbids '.' and ':' in session names."""
    return job_id.replace(".", "_").replace(":", "_")


@dataclass(frozen=True)
class NodePlace:
    """Where one node of a multi-node job stands: its rank among the nodes and the head's rendezvous address."""

    rank: int
    count: int
    head_addr: str
    port: int
    gpus: tuple[int, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


def node_session(job_id: str, node: NodePlace | None) -> str:
    """The tmux session of a job's node: node 0 (or a single host) the job's own name, node i `-node<i>` after it
    (two nodes may share one machine and its tmux server)."""
    base = session_name(job_id)
    return base if node is None or node.rank == 0 else f"{base}-node{node.rank}"


def trainer_command(job: JobConfig, python: str, node: NodePlace | None = None, slurm: bool = False) -> str:
    """The bundled trainer under torchrun (several processes or nodes) or alone; "$@" carries --resume on a restart.

    Over several nodes, torchrun's static rendezvous with `--node-rank`: global rank 0 is on the head, so the head's
    run dir holds metrics.jsonl, the heartbeat and the export (c10d's rendezvous orders nodes by address and pid,
    not by node rank). Under Slurm, each node's srun task starts one torchrun, its node rank Slurm's SLURM_NODEID and
    the head the allocation's first node (sbatch.sh exports MASTER_ADDR and MASTER_PORT)."""
    q = shlex.quote(python)
    args = '-m trainer.train --config "$RUN/trainer.yaml" --run-dir "$RUN" "$@"'
    if slurm and job.slurm is not None and job.slurm.nodes > 1:
        return (
            f'{q} -m torch.distributed.run --nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" '
            f'--nproc-per-node {job.nproc} --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" {args}'
        )
    if node is not None:
        head = f"--master-addr {shlex.quote(node.head_addr)} --master-port {node.port}"
        return (
            f"{q} -m torch.distributed.run --nnodes {node.count} --node-rank {node.rank} --nproc-per-node "
            f"{job.nproc} {head} {args}"
        )
    if job.nproc > 1:
        return f"{q} -m torch.distributed.run --standalone --nproc-per-node {job.nproc} {args}"
    return f"{q} {args}"


def job_env(job: JobConfig, job_id: str, node: NodePlace | None = None, slurm: bool = False) -> dict[str, str]:
    gpus = list(node.gpus) if node is not None else job.gpu_indices
    # Slurm gives each node its GPUs (and sets CUDA_VISIBLE_DEVICES) itself
    asked = not slurm and (job.gpus is not None or (node is not None and bool(node.gpus)))
    place = {}
    if node is not None:  # a `command:` job over several nodes starts its own torchrun from these
        place = {
            "NNODES": str(node.count),
            "NODE_RANK": str(node.rank),
            "MASTER_ADDR": node.head_addr,
            "MASTER_PORT": str(node.port),
        }
    tag = node_tag(job_id, node.rank if node is not None else 0)
    return {
        "DFLASHCTL_JOB_ID": tag,
        "PYTHONUNBUFFERED": "1",
        **({"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))} if asked else {}),
        **place,
        **job.env,
        **dict(node.env if node is not None else ()),
    }


ENV_FILE = "job.env"
# a bash function that exports every KEY=VALUE of the NUL-separated file named by its $1 (a value may hold newlines,
# quotes, `$(`: `export "$kv"` never evaluates it); it fails when the file cannot be read
LOAD_ENV = 'load_env() { while IFS= read -r -d "" kv; do export "$kv" || return 1; done < "$1"; }'
ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def run_env(job: JobConfig, job_id: str, run_dir: str, node: NodePlace | None = None, slurm: bool = False) -> dict:
    """The job's whole environment as its processes see it: where it runs (RUN, DFLASHCTL_RUN_DIR), its caches, and
    job_env's variables."""
    cache = "inductor-cache" if job.inductor_cache == "clear" else "../../inductor-cache"
    where = {
        "RUN": run_dir,
        "DFLASHCTL_RUN_DIR": run_dir,
        "TORCHINDUCTOR_CACHE_DIR": posixpath.normpath(f"{run_dir}/{cache}"),
        "DFLASHCTL_KERNEL_CACHE": posixpath.normpath(f"{run_dir}/../../kernel-cache"),
    }
    return {**where, **job_env(job, job_id, node, slurm)}


def render_env_file(env: dict[str, str], job: JobConfig, redact: bool = False) -> str:
    """job.env: `KEY=VALUE\0` per variable. A name that is not a shell name, or a NUL in a value (no environment can
    hold one), is refused here, before anything is written remotely. With `redact` (a dry run's display), one
    `KEY=VALUE` line each with the secrets as ***."""
    for k, v in env.items():
        if not ENV_KEY.fullmatch(k):
            raise ConfigError("env", k, "not a valid environment variable name")
        if "\0" in v:
            raise ConfigError("env", k, "holds a NUL byte, which no environment can carry")
    if redact:
        shown = redact_env(env, job.secret_env)
        return "# NUL-separated KEY=VALUE records on the remote; shown here one a line\n" + "".join(
            f"{k}={shlex.quote(v)}\n" for k, v in shown.items()
        )
    return "".join(f"{k}={v}\0" for k, v in env.items())


# run.sh's setup step (a job file's `setup:`): the agent runs setup.sh once per release (agent/setup.py); a failure
# ends the attempt with the setup's exit status before the command starts
SETUP_STEP = """if [ -f "$RUN/setup.sh" ]; then
  "${DFLASHCTL_AGENT_PYTHON:-python3}" -I -S "$RUN/agent.pyz" launch --setup "$RUN" 2>&1 | tee -a "$RUN/train.log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then
    printf '%s\\n' "$rc" > "$RUN/exit_code.tmp" && mv -f "$RUN/exit_code.tmp" "$RUN/exit_code"; exit "$rc"
  fi
fi
"""


def render_wrapper(job: JobConfig, job_id: str, release: str) -> str:
    """run.sh: the job's environment from job.env (never pasted into this script), the release, the setup step where
    the job file has one, the log, the end."""
    setup = SETUP_STEP if job.setup else ""
    return f"""#!/usr/bin/env bash
# Written by `dflashctl launch` for job {job_id}: runs command.sh in release {release} of the code with the
# environment of job.env, copies its output into train.log, records its exit status in exit_code.
RUN="$(cd "$(dirname "$0")" && pwd)"
{LOAD_ENV}
if ! load_env "$RUN/{ENV_FILE}"; then
  echo "[dflashctl] $RUN/{ENV_FILE} cannot be read: the job's environment is missing" >> "$RUN/train.log"
  echo 1 > "$RUN/exit_code"; exit 1
fi
rm -f "$RUN/exit_code"
stamp() {{ date -u +%Y-%m-%dT%H:%M:%SZ; }}
if ! cd "$RUN/../../releases/{release}" 2>/dev/null; then
  echo "[dflashctl] $(stamp) release {release} is not deployed next to $RUN (run dflashctl deploy)" >> "$RUN/train.log"
  echo 1 > "$RUN/exit_code"; exit 1
fi
{setup}echo "[dflashctl] $(stamp) start $*" >> "$RUN/train.log"
bash --noprofile --norc "$RUN/command.sh" "$@" 2>&1 | tee -a "$RUN/train.log"
rc=${{PIPESTATUS[0]}}
echo "[dflashctl] $(stamp) exit $rc" >> "$RUN/train.log"
printf '%s\\n' "$rc" > "$RUN/exit_code.tmp" && mv -f "$RUN/exit_code.tmp" "$RUN/exit_code"
exit "$rc"
"""


def sbatch_options(job: JobConfig, job_id: str, cluster: SlurmHost) -> list[str]:
    """The `#SBATCH` options: one task per node (each starts its own torchrun), the job's GPUs per node, the host's
    partition, account and time, the job's time over the host's, then the host's and the job's extra options.

    `--no-requeue`: Slurm would otherwise requeue a batch job after a node failure and rerun it from the start, past
    dflashctl's rules; so the job ends NODE_FAIL (or PREEMPTED) and the watcher resubmits it with --resume, the
    failed node excluded, within max_restarts and never after a kill. An extra `--requeue` gives that back to Slurm."""
    spec = job.slurm
    opts = [
        f"--job-name={job_id}",
        f"--nodes={spec.nodes if spec else 1}",
        "--ntasks-per-node=1",
        "--output=slurm-%j.out",
        "--open-mode=append",
        "--no-requeue",
    ]
    if job.gpu_indices:
        opts.append(f"--gpus-per-node={len(job.gpu_indices)}")
    if job.nproc > 1 or job.gpu_indices:
        opts.append(f"--cpus-per-task={max(1, job.nproc)}")
    opts += [f"--partition={cluster.partition}"] if cluster.partition else []
    opts += [f"--account={cluster.account}"] if cluster.account else []
    wall = (spec.time if spec else None) or cluster.time
    opts += [f"--time={wall}"] if wall else []
    return [*opts, *cluster.extra, *(spec.extra if spec else [])]


def render_sbatch(job: JobConfig, job_id: str, release: str, cluster: SlurmHost) -> str:
    """The batch script of a Slurm job: run.sh's work (job.env, the release, train.log, exit_code) with the command
    started on every node by one srun. Submitted from the run dir, which is its working dir: sbatch runs
    a copy of the script, never this file, so the run dir is found as SLURM_SUBMIT_DIR. The rendezvous is at the
    allocation's first node (`scontrol show hostnames`), at the address Slurm itself reaches it by (its NodeAddr,
    which is its name unless the cluster says otherwise)."""
    port = f"{job.rdzv_port}" if job.rdzv_port else "$((29500 + SLURM_JOB_ID % 400))"
    header = "\n".join(f"#SBATCH {opt}" for opt in sbatch_options(job, job_id, cluster))
    return f"""#!/usr/bin/env bash
{header}
# Written by `dflashctl launch` for job {job_id}: runs command.sh in release {release} of the code on every node of
# the allocation (one srun task per node), appends its output to train.log, records its exit status in exit_code.
RUN="${{SLURM_SUBMIT_DIR:?submit this script with sbatch from its run dir}}"
{LOAD_ENV}
if ! load_env "$RUN/{ENV_FILE}"; then
  echo "[dflashctl] $RUN/{ENV_FILE} cannot be read: the job's environment is missing" >> "$RUN/train.log"
  echo 1 > "$RUN/exit_code"; exit 1
fi
rm -f "$RUN/exit_code"
stamp() {{ date -u +%Y-%m-%dT%H:%M:%SZ; }}
if ! cd "$RUN/../../releases/{release}" 2>/dev/null; then
  echo "[dflashctl] $(stamp) release {release} is not deployed next to $RUN (run dflashctl deploy)" >> "$RUN/train.log"
  echo 1 > "$RUN/exit_code"; exit 1
fi
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
head_addr=$(scontrol show node "$head_node" -o 2>/dev/null | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
export MASTER_ADDR="${{head_addr:-$head_node}}" MASTER_PORT={port} NNODES="$SLURM_JOB_NUM_NODES"
echo "[dflashctl] $(stamp) start slurm job $SLURM_JOB_ID on $SLURM_JOB_NODELIST $*" >> "$RUN/train.log"
srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --kill-on-bad-exit=1 bash --noprofile --norc -c \
  'export NODE_RANK="$SLURM_NODEID"; exec bash --noprofile --norc "$RUN/command.sh" "$@"' srun-task "$@" \
  >> "$RUN/train.log" 2>&1
rc=$?
echo "[dflashctl] $(stamp) exit $rc" >> "$RUN/train.log"
printf '%s\\n' "$rc" > "$RUN/exit_code.tmp" && mv -f "$RUN/exit_code.tmp" "$RUN/exit_code"
exit "$rc"
"""


def run_files(
    job: JobConfig,
    job_id: str,
    python: str,
    trainer_cfg: dict | None,
    release: str,
    redact: bool = False,
    node: NodePlace | None = None,
    cluster: SlurmHost | None = None,
    project: str | None = None,
    run_dir: str | None = None,
    members: list[dict] | None = None,
    overridden: dict | None = None,
) -> dict[str, str]:
    """The files of a run dir, as written at launch; restarts reuse them (the job file is snapshotted here, with what
    `launch`'s options overrode: `overridden`, secrets as ***). A Slurm job has `sbatch.sh` where a tmux job has
    `run.sh` and `tmux.conf`; both have job.env, written for `run_dir`: the environment that run.sh or sbatch.sh,
    `exec` and `shell` all read (without `run_dir`, none is written). A job file's `setup:` is `setup.sh`."""
    scheduled = cluster is not None
    command = trainer_command(job, python, node, scheduled) if job.trainer is not None else job.command
    snapshot = redact_job_snapshot(job.model_dump(mode="json"))  # the secrets' values live in job.env alone
    secrets = sorted(k for k in job_env(job, job_id, node, slurm=scheduled) if is_secret(k, job.secret_env))
    gpus = list(node.gpus) if node is not None else job.gpu_indices
    if scheduled:
        where = {"scheduler": "slurm"}
    else:
        where = {"node_rank": node.rank, "nodes": node.count, "head": f"{node.head_addr}:{node.port}"} if node else {}
    files = {
        "command.sh": f"# the job's command ({job.name})\n{command}\n",
        "job.json": json.dumps(
            {
                "id": job_id,
                "name": job.name,
                "session": node_session(job_id, node),
                "release": release,
                "gpus": gpus,
                **where,
                "secret_names": secrets,
                **({"project": project} if project else {}),
                **({"overridden": overridden} if overridden else {}),
                "job": snapshot,
            },
            indent=1,
        ),
    }
    if job.setup is not None and not scheduled:
        # the same header for every job: the setup's record of success is keyed by this file's hash
        files["setup.sh"] = f"# the job file's setup: run once per release of the code on this host\n{job.setup}\n"
    if scheduled:
        files["sbatch.sh"] = render_sbatch(job, job_id, release, cluster)
    else:
        files["run.sh"] = render_wrapper(job, job_id, release)
        files["tmux.conf"] = TMUX_CONF
    if run_dir is not None:
        files[ENV_FILE] = render_env_file(run_env(job, job_id, run_dir, node, scheduled), job, redact)
    if (node is None or node.rank == 0) and job.watch.supervise:  # a job over several hosts: on the head
        spec = supervise_spec(job, job_id, gpus, scheduled, members)
        if redact and spec["notify"].get("webhook"):  # a dry run shows it: the webhook's path is the credential
            spec["notify"]["webhook"] = redact_url(spec["notify"]["webhook"])
        files["supervise.json"] = json.dumps(spec, indent=1)
    if trainer_cfg is not None:
        if node is not None:  # no shared file system assumed: every node keeps checkpoints to resume from
            ckpt = dict(trainer_cfg.get("checkpoint") or {})
            trainer_cfg = {**trainer_cfg, "checkpoint": {**ckpt, "per_node": True}}
        import yaml  # only a trainer job writes YAML: the status and watch paths never import it

        files["trainer.yaml"] = yaml.safe_dump(trainer_cfg, sort_keys=False)
    return files


def project_key(root) -> str:
    """Which clone a job was launched from (this machine and the project's path): the same job name launched from
    another clone on the same host is another job, not a second copy of this one."""
    import hashlib
    import socket

    return hashlib.sha256(f"{socket.gethostname()}\0{os.path.abspath(root)}".encode()).hexdigest()[:16]


def supervise_spec(
    job: JobConfig, job_id: str, gpus: list[int], scheduled: bool = False, members: list[dict] | None = None
) -> dict:
    """What the job's supervisor (agent/supervise.py) needs: where the job runs, how to restart it, its policy. A
    Slurm job's supervisor runs on the login node (the batch script's processes end with the allocation: they could
    not resubmit it). A job over several hosts: the head's, with `members` (member_spec) it probes and restarts."""
    many = {"members": members} if members else {}
    return {
        "session": node_session(job_id, None),
        "job_id": node_tag(job_id, 0),
        "tmux_socket": tmux_socket(),
        "host": job.nodes[0].host,
        **many,
        **({"scheduler": "slurm"} if scheduled else {}),
        "grace_s": job.kill_grace_s,
        "args": ["--resume"] if job.trainer is not None else [],
        "is_trainer": job.trainer is not None,
        "gpus": gpus,
        "watch": job.watch.model_dump(mode="json", exclude={"notify"}),
        "notify": job.watch.notify.model_dump(mode="json"),
    }  # 0600: the supervisor pages the user


# the head's ssh to a member: never a prompt (BatchMode), never a host key taken on trust, a dead link seen in 30 s
HEAD_SSH = [
    "ssh",
    "-o",
    "BatchMode=yes",
    "-o",
    "StrictHostKeyChecking=yes",
    "-o",
    "ServerAliveInterval=15",
    "-o",
    "ServerAliveCountMax=2",
]


def member_spec(job_id: str, place: NodePlace, host: HostConfig, node, head: HostConfig, run_dir: str) -> dict:
    """How the head's supervisor reaches node `place` (`node`: its job-file entry, NodeSpec): its run dir, session,
    tag, Python, container prefix, and `reach`, the argv that runs a command there from the head (null: it cannot,
    with `why_not`). By default the node's HostName, port and user as this machine resolves them: the head's own
    ssh config, keys and known_hosts must allow it; `reach:` names the destination as the head sees it."""
    spec = {
        "node": place.rank,
        "host": host.name,
        "run_dir": run_dir,
        "session": node_session(job_id, place),
        "job_id": node_tag(job_id, place.rank),
        "python": host.python,
        "tmux_socket": tmux_socket(),
        "prefix": container_prefix(host),
        "gpus": list(place.gpus),
    }
    ssh = [
        *HEAD_SSH,
        "-o",
        f"ConnectTimeout={max(1, round(host.connect_timeout))}",
        *(["-F", node.reach_ssh_config] if node.reach_ssh_config else []),
    ]
    if node.reach == "none":
        return {**spec, "reach": None, "why_not": "`reach: none` in the job file: not probed from the head"}
    if node.reach:
        return {**spec, "reach": [*ssh, "--", node.reach]}
    if host.is_local:
        ok = head.is_local  # the same machine as the head; a remote head cannot know where `local` is
        return {**spec, "reach": [] if ok else None, "why_not": "a `local` node is not reachable from a remote head"}
    from dflashctl.remote.ssh import resolve_ssh_target

    t = resolve_ssh_target(host)
    return {**spec, "reach": [*ssh, "-p", str(t.port), "-l", t.user, "--", t.hostname]}


def call_agent(runner: Runner, request: dict, payload: bytes = b"", timeout: float = 60, on_host: bool = False) -> dict:
    """One remote command: the probe (inside the container) runs one action, with host-side GPU readings when the
    host is configured so; with `on_host`, the probe runs on the container's host itself (its python3). A host that
    answers but whose probe fails raises ProbeFailedError with its stderr."""
    host: HostConfig = runner.host
    req = json.dumps(request, separators=(",", ":"))
    if len(req) > MAX_REQUEST_BYTES:
        raise ConfigError("request", None, f"too large for one remote command ({len(req)} bytes)")
    stdin = AGENT + payload

    def run(python: str):
        inner = boot_argv(python, "probe", req)
        if on_host:
            return runner.run(inner, stdin=stdin, on_host=True, timeout=timeout)
        if host.container and host.gpu_query == "host" and request.get("gpus", True):
            script = ["bash", "--noprofile", "--norc", "-c", HOST_GPU_SCRIPT, "dflashctl"]
            return runner.run([*script, *container_prefix(host), *inner], stdin=stdin, on_host=True, timeout=timeout)
        return runner.run(inner, stdin=stdin, timeout=timeout)

    # inside the container, the interpreter the deploy's agent reported, as the deploy does: a shim costs every poll
    res = run("python3") if on_host else AgentPython(host.python, remembered_python(host)).run(run)
    out, noise = split_answer(res.stdout)
    try:
        answer = json.loads(out)
        note_noise(host.name, noise)
        if not isinstance(answer, dict):
            raise ValueError
        return answer
    except ValueError:
        detail = (res.err or res.out).strip()[-400:] or f"exit status {res.returncode}, no output"
        raise ProbeFailedError(f"probe on {host.name} failed (exit {res.returncode}): {detail}") from None


def fetch_chunk(runner: Runner, run_dir: str, path: str, offset: int, length: int, timeout: float = 300) -> bytes:
    """Raw bytes [offset, offset + length) of a file of a run dir (pull), read by the agent inside the container."""
    req = json.dumps({"action": "chunk", "run_dir": run_dir, "path": path, "offset": offset, "length": length})
    res = runner.run(boot_argv(runner.host.python, "probe", req), stdin=AGENT, timeout=timeout)
    if res.returncode != 0:
        detail = res.err.strip()[-400:] or f"exit status {res.returncode}"
        raise ProbeFailedError(f"reading {path} on {runner.host.name} failed: {detail}")
    return res.stdout


def probe_request(job, log_offset: int = 0, metrics_offset: int = 0, capture_lines: int = 40) -> dict:
    return {
        "run_dir": job.run_dir,
        "session": job.session,
        "job_id": job.tag,
        "log_offset": log_offset,
        "metrics_offset": metrics_offset,
        "capture_lines": capture_lines,
        "tmux_socket": job.tmux_socket,
        **scheduler_of(job),
    }


def scheduler_of(job) -> dict:
    """What every agent request about a job carries when a scheduler, not tmux, runs it. The login node's GPUs are
    not the job's: they are never read for it (the trainer records its own in gpu.jsonl on the compute nodes)."""
    return {"scheduler": "slurm", "gpus": False} if job.host.slurm is not None else {}
