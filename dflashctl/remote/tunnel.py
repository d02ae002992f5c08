"""`dflashctl tunnel`: a port of the job's machine on localhost, so TensorBoard or a profiler opens in a browser.

The system's ssh does the forwarding (`ssh -N -L`), so the user's own config, agent and known_hosts apply, as for
`attach`. A job in a container is reached at the container's address, asked of its host (`pct exec CT -- hostname
-I`, `docker inspect`): the forward goes from the host to the container. `--tensorboard` starts TensorBoard on the
remote first, in a window of the job's tmux session (or a session of its own once the job's has ended).
"""

from __future__ import annotations

import ipaddress
import shlex
from collections.abc import Callable

from dflashctl.errors import RemoteCommandError
from dflashctl.jobs.registry import JobRecord
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
        res = runner.run(["docker", "inspect", "-f", DOCKER_ADDRESS, str(host.container_id)], on_host=True,
                         timeout=30)  # fmt: skip
    address = first_address(res.check(f"finding the address of container {host.container}").out)
    if address is None:
        raise RemoteCommandError(f"container {host.container} on {host.name} has no IPv4 address")
    return address


def ssh_argv(job: JobRecord, local_port: int, address: str, port: int) -> list[str]:
    from dflashctl.remote.ssh import client_options

    host = job.host
    return ["ssh", *client_options(host), "-N", "-o", "ExitOnForwardFailure=yes", "-o", "ServerAliveInterval=30",
            "-L", f"127.0.0.1:{local_port}:{address}:{port}",
            *(["-p", str(host.port)] if host.port else []), *(["-l", host.user] if host.user else []),
            *(["-i", host.identity_file] if host.identity_file else []), host.ssh or ""]  # fmt: skip


def start_tensorboard(job: JobRecord, runner: Runner, port: int) -> str:
    """TensorBoard on the job's run dir, in a window of its tmux session; returns where it runs."""
    bind = "0.0.0.0" if job.host.container else "127.0.0.1"  # a container is reached from its host
    tb = [job.host.python, "-m", "tensorboard.main", "--logdir", f"{job.run_dir}/tensorboard", "--port", str(port),
          "--host", bind]  # fmt: skip
    tmux = ["tmux", "-L", job.tmux_socket]
    script = (
        'if "${@:1:3}" has-session -t "=$4" 2>/dev/null; then "${@:1:3}" new-window -d -t "=$4:" -n tensorboard "$5";'
        ' else "${@:1:3}" new-session -d -s "$4-tb" "$5"; fi'
    )
    res = runner.run(["bash", "--noprofile", "--norc", "-c", script, "dflashctl", *tmux, job.session,
                      shlex.join(tb)], timeout=30)  # fmt: skip
    res.check("starting tensorboard")
    return shlex.join(tb)


def forward(job: JobRecord, port: int, local_port: int, tensorboard: bool, dry_run: bool, accept_new: bool,
            say: Callable[[str], None], show: Callable[[str], None]) -> int:  # fmt: skip
    """Resolve where the port lives, optionally start TensorBoard there, then hold the forward until Ctrl-C (exit
    0) or ssh's own end (its exit status). `dry_run` shows the ssh command and starts nothing."""
    import subprocess

    from dflashctl.remote.connect import open_runner

    with open_runner(job.host, accept_new) as runner:
        address = remote_address(job, runner)
        if tensorboard and not dry_run:
            say(f"started on {job.host_name}: {start_tensorboard(job, runner, port)}")
    if job.host.is_local:
        show(f"the job runs on this machine: http://{address}:{port}/")
        return 0
    argv = ssh_argv(job, local_port, address, port)
    if dry_run:
        show(shlex.join(argv))
        return 0
    say(f"http://127.0.0.1:{local_port}/ → {address}:{port} on {job.host_name} (Ctrl-C to stop)")
    proc = subprocess.Popen(argv)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait()
        return 0
