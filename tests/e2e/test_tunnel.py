"""`dflashctl tunnel` over the real ssh client and server: a port of the job's machine answers on localhost; a job
in a (Proxmox) container is reached at the container's address, asked of its host."""

from __future__ import annotations

import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from dflashctl.jobs import registry
from tests.cli.test_cli import record
from tests.conftest import run_cli

JOB = "tb-20261201T100000Z-aaaa"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fetch(url: str, deadline_s: float = 30) -> bytes:
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.read()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_a_remote_port_answers_on_localhost_until_interrupted(client, monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(client.home / "state"))
    record(client, JOB)
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "hello.txt").write_text("from the job's machine\n")
    port, local = free_port(), free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        cwd=tmp_path / "www",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    tun = subprocess.Popen(
        [sys.executable, "-m", "dflashctl", "tunnel", JOB, str(port), "--local-port", str(local)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        try:
            body = fetch(f"http://127.0.0.1:{local}/hello.txt")
        except OSError:
            tun.kill()
            raise AssertionError(tun.communicate()[1]) from None
        assert body == b"from the job's machine\n"
        tun.send_signal(signal.SIGINT)
        # within a second alone; once in a full suite run it took ~20 s, cause not found (docs/reliability.md)
        assert tun.wait(timeout=45) == 0
        assert f"http://127.0.0.1:{local}/ → 127.0.0.1:{port} on testbox" in tun.stderr.read()
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{local}/hello.txt", timeout=2)
    finally:
        tun.kill()
        server.kill()


def test_a_container_job_is_forwarded_to_the_containers_address(client, monkeypatch):
    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(client.home / "state"))
    record(client, JOB)
    registry.update(JOB, host={"name": "testbox", "ssh": "testbox", "container": "pct:7"})
    res = run_cli("tunnel", JOB, "6006", "--local-port", "16006", "--dry-run")
    assert res.code == 0, res.stderr
    argv = shlex.split(res.stdout.strip())
    forward = argv[argv.index("-L") + 1]
    bind, lport, address, rport = forward.split(":")
    own = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()  # the fake pct's answer
    assert (bind, lport, rport) == ("127.0.0.1", "16006", "6006") and address == own[0] and argv[-1] == "testbox"


def test_tensorboard_starts_in_a_window_of_the_jobs_session_and_opens_locally(client, monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(client.home / "state"))
    record(client, JOB)
    sock = f"tbtest-{tmp_path.name}"[-40:]
    run_dir = tmp_path / "run"
    (run_dir / "tensorboard").mkdir(parents=True)
    registry.update(
        JOB,
        tmux_socket=sock,
        session=JOB,
        run_dir=str(run_dir),
        host={"name": "testbox", "ssh": "testbox", "python": sys.executable},
    )
    subprocess.run(["tmux", "-L", sock, "new-session", "-d", "-s", JOB, "sleep 300"], check=True)
    port, local = free_port(), free_port()
    tun = subprocess.Popen(
        [sys.executable, "-m", "dflashctl", "tunnel", JOB, str(port), "--local-port", str(local), "--tensorboard"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        body = fetch(f"http://127.0.0.1:{local}/", deadline_s=90)
        assert b"tensorboard" in body.lower()
        windows = subprocess.run(
            ["tmux", "-L", sock, "list-windows", "-t", f"={JOB}", "-F", "#{window_name}"],
            capture_output=True,
            text=True,
        ).stdout.split()
        assert "tensorboard" in windows and len(windows) == 2
    finally:
        tun.kill()
        _, err = tun.communicate(timeout=30)
        subprocess.run(["tmux", "-L", sock, "kill-server"], capture_output=True)
    assert "has written no TensorBoard event files" in err, err  # an empty board is said to be empty
    from dflashctl.remote.connect import open_runner
    from dflashctl.remote.tunnel import event_files_written

    job = registry.get(JOB)
    with open_runner(job.host) as runner:
        assert not event_files_written(job, runner)
        (run_dir / "tensorboard" / "events.out.tfevents.1.box").write_bytes(b"")
        assert event_files_written(job, runner)


def _ssh_forwards(port: int) -> list[int]:
    out = subprocess.run(["pgrep", "-f", "--", f"-L 127.0.0.1:{port}:"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_the_forward_dies_with_the_tool_and_a_busy_port_is_one_line(client, monkeypatch):
    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(client.home / "state"))
    record(client, JOB)
    port, local = free_port(), free_port()
    for how in (signal.SIGTERM, signal.SIGKILL):
        tun = subprocess.Popen(
            [sys.executable, "-m", "dflashctl", "tunnel", JOB, str(port), "--local-port", str(local)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 30
        while not _ssh_forwards(local) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _ssh_forwards(local), tun.stderr.read() if tun.poll() is not None else "no ssh forward"
        tun.send_signal(how)
        tun.wait(20)
        deadline = time.monotonic() + 10
        while _ssh_forwards(local) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _ssh_forwards(local), f"ssh outlived dflashctl after {how.name}"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", local))
        busy.listen()
        res = run_cli("tunnel", JOB, str(port), "--local-port", str(local))
    assert res.code == 2 and "already in use" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert "http://" not in res.stdout + res.stderr.split("already")[0]  # nothing said before the refusal


def test_a_job_that_is_not_alive_gets_no_tunnel_and_no_tensorboard(client, monkeypatch):
    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(client.home / "state"))
    record(client, JOB, state="KILLED")
    res = run_cli("tunnel", JOB, "6006", "--tensorboard")
    assert res.code == 2 and "is KILLED, not running" in res.stderr


def test_ctrl_c_ends_even_an_ssh_that_ignores_sigterm(client, monkeypatch, tmp_path):
    """A forward whose ssh inherited SIGTERM ignored (a parent that ignores it) still ends on Ctrl-C, and goes."""
    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(client.home / "state"))
    record(client, JOB)
    port, local = free_port(), free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ignoring = (
        "import signal, os, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); os.execv(sys.argv[1], sys.argv[1:])"
    )
    argv = [sys.executable, "-m", "dflashctl", "tunnel", JOB, str(port), "--local-port", str(local)]
    tun = subprocess.Popen(
        [sys.executable, "-c", ignoring, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        fetch(f"http://127.0.0.1:{local}/")
        tun.send_signal(signal.SIGINT)
        assert tun.wait(timeout=15) == 0
        with pytest.raises(OSError):  # the ssh that ignored SIGTERM was killed: nothing forwards any more
            urllib.request.urlopen(f"http://127.0.0.1:{local}/", timeout=2)
    finally:
        tun.kill()
        server.kill()


def test_the_forward_ends_with_its_job_and_says_so(client, tmp_path):
    """A real job on the loopback host: killed while a tunnel to it is held, the tunnel closes (exit 0) and says why,
    instead of forwarding to nothing."""
    import json

    from tests.e2e.test_launch import write_project

    p = write_project(client, tmp_path)
    assert run_cli("deploy", "box").code == 0
    (p.parent / "jobfiles").mkdir(exist_ok=True)
    job_file = p.parent / "jobfiles" / "served.yaml"
    job_file.write_text("name: served\nhost: box\nkill_grace_s: 2\ncommand: sleep 300\n")
    job_id = json.loads(run_cli("launch", str(job_file), "--json").stdout)["id"]
    port, local = free_port(), free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    tun = subprocess.Popen(
        [sys.executable, "-m", "dflashctl", "tunnel", job_id, str(port), "--local-port", str(local)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        fetch(f"http://127.0.0.1:{local}/")
        assert run_cli("kill", job_id).code == 0
        assert tun.wait(timeout=30) == 0
        said = tun.stderr.read()
        assert f"{job_id}: it was stopped (dflashctl kill): the forward is closed" in said, said
        assert not _ssh_forwards(local)
    finally:
        tun.kill()
        server.kill()
