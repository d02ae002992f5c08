"""`dflashctl tunnel`: a port of the job's machine on localhost, so TensorBoard or a profiler opens in a browser.

The system's ssh does the forwarding (`ssh -N -L`), so the user's own config, agent and known_hosts apply, as for
`attach`. A job in a container is reached at the container's address, asked of its host (`pct exec CT -- hostname
-I`, `docker inspect`): the forward goes from the host to the container. `--tensorboard` starts TensorBoard on the
remote first, in a window of the job's tmux session (or a session of its own once the job's has ended).
"""

from __future__ import annotations

import contextlib
import ipaddress
import shlex
import signal
import socket
import time
from collections.abc import Callable

from dflashctl.errors import ConfigError, RefusedError, RemoteCommandError
from dflashctl.model.record import JobRecord
from dflashctl.remote.transport import Runner

DOCKER_ADDRESS = "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}"


def first_address(text: str) -> str | None:
    """The first IPv4 address of `hostname -I` or `docker inspect` output."""
    for word in text.split():
        try:
            if ipaddress.ip_address(word).version == 4:
                return word
        except ValueError:
            continue
    return None


def remote_address(job: JobRecord, runner: Runner | None) -> str:
    """Where the forwarded port lives, as the host sees it: loopback, or the container's address."""
    host = job.host
    if not host.container:
        return "127.0.0.1"
    assert runner is not None
    if host.container_kind == "pct":
        res = runner.run(["pct", "exec", str(host.container_id), "--", "hostname", "-I"], on_host=True, timeout=30)
    else:
        res = runner.run(["docker", "inspect", "-f", DOCKER_ADDRESS, str(host.container_id)], on_host=True, timeout=30)
    address = first_address(res.check(f"finding the address of container {host.container}").out)
    if address is None:
        raise RemoteCommandError(f"container {host.container} on {host.name} has no IPv4 address")
    return address


def ssh_argv(job: JobRecord, local_port: int, address: str, port: int) -> list[str]:
    from dflashctl.remote.ssh import client_options

    host = job.host
    return [
        "ssh",
        *client_options(host),
        "-N",
        "-o",
        "ExitOnForwardFailure=yes",
        "-o",
        "ServerAliveInterval=30",
        "-L",
        f"127.0.0.1:{local_port}:{address}:{port}",
        *(["-p", str(host.port)] if host.port else []),
        *(["-l", host.user] if host.user else []),
        *(["-i", host.identity_file] if host.identity_file else []),
        host.ssh or "",
    ]


def local_port_free(port: int) -> None:
    """Refuse a busy local port before anything is printed or started (ssh would only say so after the fact)."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise ConfigError(
                "--local-port", None, f"127.0.0.1:{port} is already in use here: pick another with --local-port"
            ) from None


WAIT_LISTENING = (  # $1 python, $2 address, $3 port: is something listening there within 30 s?
    'for i in $(seq 60); do "$1" -c "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 1)" '
    '"$2" "$3" 2>/dev/null && exit 0; sleep 0.5; done; exit 1'
)


def start_tensorboard(job: JobRecord, runner: Runner, port: int) -> str:
    """TensorBoard on the job's run dir, in a window of its tmux session (the job must be alive: a job that ended has
    no session to add a window to); verified listening before it is said to run. Returns where it runs."""
    bind = "0.0.0.0" if job.host.container else "127.0.0.1"  # a container is reached from its host
    tb = [
        job.host.python,
        "-m",
        "tensorboard.main",
        "--logdir",
        f"{job.run_dir}/tensorboard",
        "--port",
        str(port),
        "--host",
        bind,
    ]
    tmux = ["tmux", "-L", job.tmux_socket]
    script = (
        'if "${@:1:3}" has-session -t "=$4" 2>/dev/null; then "${@:1:3}" new-window -d -t "=$4:" -n tensorboard "$5";'
        ' else echo "the job\'s tmux session $4 is gone" >&2; exit 3; fi'
    )
    res = runner.run(
        ["bash", "--noprofile", "--norc", "-c", script, "dflashctl", *tmux, job.session, shlex.join(tb)], timeout=30
    )
    res.check("starting tensorboard")
    probe_at = "127.0.0.1"
    up = runner.run(
        ["bash", "--noprofile", "--norc", "-c", WAIT_LISTENING, "dflashctl", job.host.python, probe_at, str(port)],
        timeout=60,
    )
    if up.returncode != 0:
        raise RemoteCommandError(
            f"TensorBoard did not start listening on port {port} on {job.host_name} within "
            "30 s (a busy port? tensorboard not installed there?): see its window in the job's "
            "session (dflashctl attach)"
        )
    return shlex.join(tb)


def event_files_written(job: JobRecord, runner: Runner) -> bool:
    """Whether the job has written any TensorBoard event file under RUN/tensorboard (a board without one is empty)."""
    res = runner.run(
        ["find", f"{job.run_dir}/tensorboard", "-maxdepth", "4", "-name", "events.out.tfevents.*", "-print", "-quit"],
        timeout=30,
    )
    return res.returncode == 0 and bool(res.out.strip())


NO_EVENTS = (
    "warning: {job} has written no TensorBoard event files under {run}/tensorboard: the board stays empty "
    "until it does (a trainer job writes them with `metrics: {{tensorboard: true}}`; a command job must "
    "write them there itself)"
)


def _die_with_parent() -> None:
    """In the ssh child: SIGTERM when dflashctl dies, however it dies (PR_SET_PDEATHSIG), so no forward outlives it."""
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


JOB_CHECK_S = 5.0  # how often a held forward asks whether its job has ended


class JobEnd:
    """Whether the job a forward serves has ended: its exit status or a stop request written, its run dir or its
    tmux session gone (each only if it was there when the forward started). One small probe a check."""

    def __init__(self, job: JobRecord, runner: Runner) -> None:
        from dflashctl.remote import session

        self.job, self.runner, self.session = job, runner, session
        first = self._look()
        self.had_dir = bool(first and first.get("run_dir_exists"))
        self.had_session = bool(first and (first.get("session") or {}).get("exists"))

    def _look(self) -> dict | None:
        req = {
            **self.session.probe_request(self.job, capture_lines=0),
            "gpus": False,
            "max_log_bytes": 0,
            "max_metrics_bytes": 0,
        }
        try:
            return self.session.call_agent(self.runner, req, timeout=30)
        except Exception:  # a check that cannot be made ends nothing: ssh's own end says if the host went
            return None

    def ended(self) -> str | None:
        if not self.had_dir:
            return None
        snap = self._look()
        if snap is None:
            return None
        pane = snap.get("session") or {}
        if not snap.get("run_dir_exists"):
            return "its run dir is gone"
        if snap.get("stop_request") is not None:
            return "it was stopped (dflashctl kill)"
        if snap.get("exit_code") is not None:
            return f"it ended (exit {snap['exit_code']})"
        if self.had_session and (not pane.get("exists") or pane.get("pane_dead")):
            return "its tmux session is gone"
        return None


def forward(
    job: JobRecord,
    port: int,
    local_port: int,
    tensorboard: bool,
    dry_run: bool,
    accept_new: bool,
    say: Callable[[str], None],
    show: Callable[[str], None],
) -> int:
    """Resolve where the port lives, optionally start TensorBoard there, then hold the forward until Ctrl-C (exit
    0) or ssh's own end (its exit status). `dry_run` shows the ssh command and starts nothing."""
    import subprocess

    from dflashctl.remote.connect import open_runner

    if job.host.slurm is not None:  # the port is on a compute node the scheduler chose, behind the login node
        raise RefusedError(
            f"{job.id} runs on a Slurm cluster: its ports are on a compute node, which tunnel does not "
            "reach yet (`ssh -L PORT:NODE:PORT LOGIN`, NODE from `squeue -j ID -o %N`)"
        )
    if not job.live:
        raise RefusedError(
            f"{job.id} is {job.state}, not running: nothing to tunnel to (`dflashctl status` looks again)"
        )
    if not job.host.is_local and not dry_run:
        local_port_free(local_port)
    with open_runner(job.host, accept_new) as runner:
        address = remote_address(job, runner)
        if tensorboard and not dry_run:
            if not event_files_written(job, runner):
                say(NO_EVENTS.format(job=job.id, run=job.run_dir))
            say(f"started on {job.host_name}: {start_tensorboard(job, runner, port)}")
    if job.host.is_local:
        show(f"the job runs on this machine: http://{address}:{port}/")
        return 0
    argv = ssh_argv(job, local_port, address, port)
    if dry_run:
        show(shlex.join(argv))
        return 0
    import tempfile

    errors = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: ssh never blocks on what it says
    proc = subprocess.Popen(argv, preexec_fn=_die_with_parent, stderr=errors, text=True)

    def end_ssh() -> None:  # SIGTERM, then SIGKILL: an ssh started with SIGTERM ignored (inherited) must go too
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def stop(signum, _frame) -> None:  # SIGTERM/SIGHUP to dflashctl: the forward goes with it
        end_ssh()
        raise SystemExit(0)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C ends the forward, even if started ignoring it
    say(f"http://127.0.0.1:{local_port}/ → {address}:{port} on {job.host_name} (Ctrl-C to stop)")
    watcher = open_runner(job.host, accept_new)
    try:
        end = JobEnd(job, watcher)
        if not end.had_dir:
            say(f"(the run dir of {job.id} is not there: the forward will not end with the job)")
        next_check = time.monotonic() + JOB_CHECK_S
        while proc.poll() is None:  # a short sleep, not one blocking wait: Ctrl-C is seen even when the signal
            time.sleep(0.2)  # lands on another thread (paramiko's), which a blocked waitpid would never notice
            if time.monotonic() >= next_check:
                why = end.ended()
                if why:  # a forward to nothing helps nobody: it ends with its job, and says so
                    say(f"{job.id}: {why}: the forward is closed")
                    return 0
                next_check = time.monotonic() + JOB_CHECK_S
        code = proc.returncode
        if code != 0:  # the forward failed (ExitOnForwardFailure) or the connection ended: ssh's own last word
            errors.seek(0)
            detail = errors.read().strip().splitlines()
            raise RemoteCommandError(f"ssh ended the forward (exit {code}): {detail[-1] if detail else 'no message'}")
        return code
    except KeyboardInterrupt:
        return 0
    finally:  # Ctrl-C, an error or ssh's own end: the forward never outlives the command
        end_ssh()
        errors.close()
        with contextlib.suppress(Exception):
            watcher.close()
