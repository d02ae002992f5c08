"""tmux on the remote: the run directory, the wrapper a job runs under, starting it, probing it, stopping it.

Jobs live on a dedicated tmux server (`tmux -L dflashctl`; $DFLASHCTL_TMUX_SOCKET names another, which the tests
use so as never to touch real jobs), one session per job, `remain-on-exit on` so that a dead
pane keeps its exit status, and a large history. The pane runs `run.sh` (the wrapper) from the run dir: it exports
the job's environment (including DFLASHCTL_JOB_ID, which tags every process of the job), tees all output into
`train.log` and writes `exit_code` when the command ends.
"""

from __future__ import annotations

import io
import json
import os
import shlex
import tarfile
import time
from pathlib import Path

import yaml

from dflashctl import probe
from dflashctl.config import SAFE_NAME, HostConfig
from dflashctl.errors import ConfigError, RemoteCommandError
from dflashctl.jobs import JobConfig
from dflashctl.transport import WORKDIR_PRELUDE, Runner, container_prefix

PROBE_SOURCE = Path(probe.__file__).read_bytes()
SOCKET_ENV = "DFLASHCTL_TMUX_SOCKET"
TMUX_CONF = "set -g history-limit 100000\nset -g remain-on-exit on\n"

# $1 workdir, $2 tmux socket, $3 job id, $4 session, $5 fresh|restart, $6 clear|keep; then the wrapper's arguments.
# stdin: a tar of the run dir's files (run.sh, tmux.conf, trainer.yaml). Prints the run dir and the pane pid.
START_SCRIPT = (
    WORKDIR_PRELUDE
    + r"""sock=$1; id=$2; session=$3; mode=$4; cache=$5; shift 5
run="$wd/runs/$id"
if [ "$mode" = fresh ]; then
  if [ -e "$run" ]; then echo "run dir $run already exists" >&2; exit 3; fi
  mkdir -p -- "$run" || exit 1
else
  [ -d "$run" ] || { echo "run dir $run is gone" >&2; exit 3; }
  tmux -L "$sock" kill-session -t "=$session" 2>/dev/null
fi
cd -- "$run" && tar -x --no-same-owner -f - || exit 1
if [ "$cache" = clear ]; then rm -rf -- "$run/inductor-cache"; fi
mkdir -p -- "$run/inductor-cache"
cmd="exec bash $(printf %q "$run/run.sh")"
for a in "$@"; do cmd="$cmd $(printf %q "$a")"; done
tmux -L "$sock" -f "$run/tmux.conf" new-session -d -s "$session" -x 200 -y 50 "$cmd" \; \
  set-option -w -t "=$session:" remain-on-exit on >/dev/null || exit 1
printf '%s\n' "$run"
tmux -L "$sock" display-message -p -t "=$session:" '#{pane_pid}'
"""
)

# GPU readings on the container's host, then the probe inside the container, in one command: "$@" is the
# container exec + python + request.
HOST_GPU_SCRIPT = (
    "g=$(nvidia-smi --query-gpu=" + ",".join(probe.GPU_FIELDS) + " --format=csv,noheader,nounits 2>/dev/null)\n"
    "a=$(nvidia-smi --query-compute-apps="
    + ",".join(probe.APP_FIELDS)
    + " --format=csv,noheader,nounits 2>/dev/null)\n"
    'exec "$@" "$g" "$a"\n'
)


def tmux_socket() -> str:
    """The tmux server jobs are started on: `dflashctl`, or $DFLASHCTL_TMUX_SOCKET."""
    name = os.environ.get(SOCKET_ENV, "dflashctl")
    if not SAFE_NAME.match(name):
        raise ConfigError("environment", SOCKET_ENV, "may hold only [A-Za-z0-9._-]")
    return name


def session_name(job_id: str) -> str:
    """tmux forbids '.' and ':' in session names."""
    return job_id.replace(".", "_").replace(":", "_")


def trainer_command(job: JobConfig, python: str) -> str:
    """The bundled trainer under torchrun (several processes) or alone; "$@" carries --resume on a restart."""
    q = shlex.quote(python)
    args = '-m trainer.train --config "$RUN/trainer.yaml" --run-dir "$RUN" "$@"'
    if job.nproc > 1:
        return f"{q} -m torch.distributed.run --standalone --nproc-per-node {job.nproc} {args}"
    return f"{q} {args}"


def render_wrapper(job: JobConfig, job_id: str, python: str) -> str:
    command = trainer_command(job, python) if job.trainer is not None else job.command
    env = {
        "DFLASHCTL_JOB_ID": job_id,
        "PYTHONUNBUFFERED": "1",
        **({"CUDA_VISIBLE_DEVICES": ",".join(map(str, job.gpu_indices))} if job.gpus is not None else {}),
        **job.env,
    }
    exports = "\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items())
    return f"""#!/usr/bin/env bash
# Written by `dflashctl launch` for job {job_id}: runs the job, copies its output into train.log, records its exit.
RUN="$(cd "$(dirname "$0")" && pwd)"
export DFLASHCTL_RUN_DIR="$RUN" TORCHINDUCTOR_CACHE_DIR="$RUN/inductor-cache"
{exports}
rm -f "$RUN/exit_code"
stamp() {{ date -u +%Y-%m-%dT%H:%M:%SZ; }}
if ! cd "$RUN/../../code" 2>/dev/null; then
  echo "[dflashctl] $(stamp) no deployed code next to $RUN (run dflashctl deploy)" >> "$RUN/train.log"
  echo 1 > "$RUN/exit_code"; exit 1
fi
echo "[dflashctl] $(stamp) start $*" >> "$RUN/train.log"
{{
{command}
}} 2>&1 | tee -a "$RUN/train.log"
rc=${{PIPESTATUS[0]}}
echo "[dflashctl] $(stamp) exit $rc" >> "$RUN/train.log"
printf '%s\\n' "$rc" > "$RUN/exit_code.tmp" && mv -f "$RUN/exit_code.tmp" "$RUN/exit_code"
exit "$rc"
"""


def run_files(job: JobConfig, job_id: str, python: str, trainer_cfg: dict | None) -> dict[str, bytes]:
    files = {"run.sh": render_wrapper(job, job_id, python).encode(), "tmux.conf": TMUX_CONF.encode()}
    if trainer_cfg is not None:
        files["trainer.yaml"] = yaml.safe_dump(trainer_cfg, sort_keys=False).encode()
    return files


def _tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o755 if name.endswith(".sh") else 0o644, int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def start(
    runner: Runner, workdir: str, job_id: str, files: dict[str, bytes], *, fresh: bool, clear_cache: bool,
    wrapper_args: tuple[str, ...] = (), socket: str = "dflashctl",
) -> tuple[str, int]:  # fmt: skip
    """Create (or reuse, on a restart) the run dir, write the files, start the tmux session: (run dir, pane pid)."""
    mode = "fresh" if fresh else "restart"
    cache = "clear" if clear_cache else "keep"
    res = runner.run_script(START_SCRIPT, workdir, socket, job_id, session_name(job_id), mode, cache, *wrapper_args,
                            stdin=_tar(files), timeout=60)  # fmt: skip
    lines = res.out.strip().splitlines()
    if res.returncode != 0 or len(lines) < 2 or not lines[-1].strip().isdigit():
        raise RemoteCommandError(f"starting {job_id} on {runner.host.name} failed: {res.err.strip()[-400:]}")
    return lines[-2].strip(), int(lines[-1])


def start_command_preview(runner: Runner, workdir: str, job_id: str) -> str:
    return runner.describe(["bash", "--noprofile", "--norc", "-c", "<start script>", "dflashctl", workdir,
                            tmux_socket(), job_id, session_name(job_id), "fresh", "clear"])  # fmt: skip


def call_probe(runner: Runner, request: dict, timeout: float = 60) -> dict:
    """One remote command: the probe (inside the container), with host-side GPU readings when configured."""
    host: HostConfig = runner.host
    req = json.dumps(request, separators=(",", ":"))
    inner = [host.python, "-", req]
    if host.container and host.gpu_query == "host" and request.get("gpus", True):
        argv = ["bash", "--noprofile", "--norc", "-c", HOST_GPU_SCRIPT, "dflashctl", *container_prefix(host), *inner]
        res = runner.run(argv, stdin=PROBE_SOURCE, on_host=True, timeout=timeout)
    else:
        res = runner.run(inner, stdin=PROBE_SOURCE, timeout=timeout)
    try:
        return json.loads(res.out)
    except ValueError:
        raise RemoteCommandError(
            f"probe on {host.name} failed (exit {res.returncode}): {(res.err or res.out).strip()[-400:]}"
        ) from None


def probe_request(job: dict, log_offset: int = 0, metrics_offset: int = 0, capture_lines: int = 40) -> dict:
    return {
        "run_dir": job["run_dir"],
        "session": job["session"],
        "job_id": job["id"],
        "log_offset": log_offset,
        "metrics_offset": metrics_offset,
        "capture_lines": capture_lines,
        "tmux_socket": job.get("tmux_socket", "dflashctl"),
    }
