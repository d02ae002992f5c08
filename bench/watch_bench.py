"""`watch --once` against a bare `ssh host true` on the same loopback sshd, and remote commands per poll.

    .venv/bin/python bench/watch_bench.py [--repeat 10]

Three numbers: `ssh host true` (OpenSSH client, new connection each time), `dflashctl watch JOB --once --json` (the
whole CLI: Python start, registry, ssh handshake, one probe), and one poll of a running watch (connection kept).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import loopback_sshd, timed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="watch-bench-"))
    server, home = loopback_sshd(work)
    hosts = work / "hosts.yaml"
    hosts.write_text(
        f"hosts:\n  bench: {{ssh: root@127.0.0.1, port: {server.port}, identity_file: {server.user_key}, "
        f"python: {sys.executable}, workdir: {work / 'remote'}}}\n"
    )
    project = work / "project"
    project.mkdir()
    (project / "job.yaml").write_text("name: idle\nhost: bench\ncommand: sleep 600\n")
    env = {**os.environ, "HOME": str(home), "DFLASHCTL_HOSTS": str(hosts), "DFLASHCTL_STATE_DIR": str(work / "state")}
    os.environ.update(env)

    def cli(*a: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "dflashctl", *a], cwd=project, env=env, capture_output=True, text=True, check=False
        )

    try:
        assert cli("deploy", "bench").returncode == 0
        job_id = json.loads(cli("launch", "job.yaml", "--json").stdout)["id"]
        known = f"UserKnownHostsFile={home}/.ssh/known_hosts"
        ssh = [
            "ssh",
            "-p",
            str(server.port),
            "-i",
            str(server.user_key),
            "-o",
            known,
            "-o",
            "BatchMode=yes",
            "root@127.0.0.1",
            "true",
        ]
        ssh_s = timed(lambda: subprocess.run(ssh, check=True), args.repeat)
        once_s = timed(lambda: cli("watch", job_id, "--once", "--json"), args.repeat)
        rec = json.loads(cli("watch", job_id, "--once", "--json").stdout)

        from dflashctl.jobs import registry
        from dflashctl.jobs.watch import make_watcher

        w = make_watcher(registry.get(job_id))
        w.poll()
        poll_s = timed(w.poll, args.repeat)
        commands = w.remote_commands
        w._drop()
        cli("kill", job_id, "--grace", "1")
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores; python {platform.python_version()}"
    )
    print(f"median of {args.repeat}; state seen: {rec['state']}")
    print("| what | seconds |\n| --- | --- |")
    print(f"| `ssh host true` (OpenSSH, new connection) | {ssh_s:.3f} |")
    print(f"| `dflashctl watch JOB --once --json` (whole CLI) | {once_s:.3f} |")
    print(f"| one poll inside `watch` (connection kept) | {poll_s:.3f} |")
    print(f"remote commands per poll: {commands} (--once record says {rec['remote_commands']})")


if __name__ == "__main__":
    main()
