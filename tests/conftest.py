"""Shared fixtures: a real OpenSSH server on a loopback port, a client home that trusts it, and the CLI."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
# This process keeps its share of the cores for its own torch work (all of them alone, one each for two test workers
# on two cores: oversubscribed OpenMP threads spin against each other, and a tiny model gains nothing from a second
# thread); the processes the tests start (torchrun's ranks, trainer runs, remote jobs) get one thread each, so that
# two ranks on a 2-core machine do not oversubscribe it.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, _WORKERS)))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Jobs the tests start live on a tmux server of their own: a test that kills "the" server must never reach the
# developer's real jobs on the default `dflashctl` socket.
TEST_TMUX_SOCKET = f"dflashctl-test-{os.getpid()}"
os.environ["DFLASHCTL_TMUX_SOCKET"] = TEST_TMUX_SOCKET
FAKES = TESTS / "fakes"
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                if s.recv(4).startswith(b"SSH"):
                    return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"sshd did not come up on port {port}")


@dataclass
class SshServer:
    """A running sshd: its port, host public key, the user key that logs in, and the dirs it serves."""

    port: int
    dir: Path
    host_pubkey: str  # "ssh-ed25519 AAAA..."
    user_key: Path
    pct_root: Path
    proc: subprocess.Popen | None = None
    config: Path | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [SSHD, "-D", "-e", "-f", str(self.config)], stdout=subprocess.DEVNULL, stderr=open(self.dir / "log", "ab")
        )
        wait_for_port(self.port)

    def stop(self, drop_sessions: bool = False) -> None:
        """Stop listening; with `drop_sessions`, also end the sessions this server has open (like a reboot), and
        no other sshd's: the machine may be running other tests' servers, or the user's own."""
        if self.proc:
            sessions = _descendants(self.proc.pid) if drop_sessions else []
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None
            for pid in sessions:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _descendants(pid: int) -> list[int]:
    """Every process below pid (from /proc), found before its parent goes (they are then reparented)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)


def start_sshd(d: Path, extra_env: dict[str, str] | None = None) -> SshServer:
    """Generate keys and a config under d and start sshd on a free loopback port (used by tests and bench/); its
    sessions get `extra_env` too (a login node's SLURM_CONF)."""
    _keygen(d / "host_key")
    _keygen(d / "user_key")
    pct_root = d / "containers"
    pct_root.mkdir()
    # The remote's PATH puts the fake pct and nvidia-smi first; sshd sets it from authorized_keys.
    apps = d / "nvidia-apps.csv"  # what the fake nvidia-smi reports as GPU processes; tests rewrite it
    apps.write_text((TESTS / "fixtures" / "nvidia-smi" / "h200-query-compute-apps.csv").read_text())
    gpus = d / "nvidia-gpus.csv"  # what it reports as the GPUs' readings; tests rewrite it (an ECC error)
    gpus.write_text((TESTS / "fixtures" / "nvidia-smi" / "h200-query-gpu-loaded.csv").read_text())
    env = [
        f"PATH={FAKES}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        f"FAKE_PCT_ROOT={pct_root}",
        f"FAKE_NVIDIA_SMI_APPS={apps}",
        f"FAKE_NVIDIA_SMI_GPUS={gpus}",
        *(f"{k}={v}" for k, v in (extra_env or {}).items()),
    ]
    env_opts = ",".join(f'environment="{kv}"' for kv in env)
    (d / "authorized_keys").write_text(f"{env_opts} {(d / 'user_key.pub').read_text()}")
    os.chmod(d / "authorized_keys", 0o600)
    port = free_port()
    config = d / "sshd_config"
    settings = [
        f"Port {port}",
        "ListenAddress 127.0.0.1",
        f"HostKey {d / 'host_key'}",
        f"AuthorizedKeysFile {d / 'authorized_keys'}",
        f"PidFile {d / 'sshd.pid'}",
        "PermitRootLogin yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "StrictModes no",
        "PermitUserEnvironment yes",
        "MaxSessions 50",
        "MaxStartups 50",
        "LogLevel ERROR",
    ]
    config.write_text("\n".join(settings) + "\n")
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)
    host_pubkey = " ".join((d / "host_key.pub").read_text().split()[:2])
    server = SshServer(port, d, host_pubkey, d / "user_key", pct_root, config=config)
    server.start()
    return server


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A tmpfs of `size` mounted at `path` for the block (a disk that fills for real); the test skips where this
    machine cannot mount one."""
    path.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture(scope="session", autouse=True)
def _close_test_tmux_server():
    """Whatever test jobs are left (a failed test, a killed run) go with the tests' own tmux server."""
    yield
    subprocess.run(["tmux", "-L", TEST_TMUX_SOCKET, "kill-server"], capture_output=True, check=False)


@pytest.fixture(scope="session")
def sshd(tmp_path_factory) -> SshServer:
    if not Path(SSHD).exists():
        pytest.fail("sshd is not installed: `make test` installs openssh-server")
    server = start_sshd(tmp_path_factory.mktemp("sshd"))
    yield server
    server.stop()


@dataclass
class Client:
    """A client side: HOME with ~/.ssh/config (alias `testbox`), known_hosts, and a hosts.yaml."""

    home: Path
    known_hosts: Path
    hosts_file: Path
    project: Path

    def write_hosts(self, text: str) -> None:
        self.hosts_file.write_text(text)


@pytest.fixture
def client(tmp_path, monkeypatch, sshd) -> Client:
    home = tmp_path / "home"
    ssh_dir = home / ".ssh"
    ssh_dir.mkdir(parents=True)
    known = ssh_dir / "known_hosts"
    known.write_text(f"[127.0.0.1]:{sshd.port} {sshd.host_pubkey}\n")
    (ssh_dir / "config").write_text(
        f"Host testbox\n  HostName 127.0.0.1\n  Port {sshd.port}\n  User root\n  IdentityFile {sshd.user_key}\n"
    )
    hosts = home / ".config" / "dflashctl" / "hosts.yaml"
    hosts.parent.mkdir(parents=True)
    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("DFLASHCTL_HOSTS", raising=False)
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    monkeypatch.chdir(project)
    return Client(home, known, hosts, project)


def run_two_ranks(script: Path, *args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --standalone --nproc-per-node 2 SCRIPT ARGS...`: two real ranks on gloo, one
    thread each (two cores), their output captured."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), *args],
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_trainer_cli(
    config: Path, *args: str, env: dict | None = None, unset: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """`python -m trainer.train --config CONFIG ARGS...` from the project root, as a user runs it: this environment
    with `env` added and the variables in `unset` left out."""
    base = {k: v for k, v in os.environ.items() if k not in unset}
    return subprocess.run(
        [sys.executable, "-m", "trainer.train", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=TESTS.parent,
        env={**base, **(env or {})},
    )


@dataclass
class CliResult:
    code: int
    stdout: str
    stderr: str


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 120) -> CliResult:
    """Run the real `dflashctl` entry point in a fresh interpreter, as a user would."""
    proc = subprocess.run(
        [sys.executable, "-m", "dflashctl", *args],
        cwd=cwd,
        env={**os.environ, **(env or {}), "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny target directory (weights, tokenizer with a chat template and a mask token) and a chat dataset."""
    import json

    from trainer.data.tiny import chat_samples, write_tiny_target

    out = tmp_path_factory.mktemp("tiny")
    write_tiny_target(out / "target")
    with open(out / "chat.jsonl", "w") as f:
        for rec in chat_samples(24, seed=1):
            f.write(json.dumps(rec) + "\n")
    return out


def _leftovers(marks: tuple[str, ...]) -> list[str]:
    """Processes (other than this one) whose command line or environment names this session's temp dir or tmux
    socket: started by a test and still alive."""
    me = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            cmd = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ")
            env = Path(f"/proc/{name}/environ").read_bytes()
            state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and any(m.encode() in cmd or m.encode() in env for m in marks):
            found.append(f"{name}: {cmd.decode(errors='replace')[:160]}")
    return found


# The modules that take longest (`make test` prints the slowest tests), run first: `make test` runs the suite on two
# workers, one module at a time each (`--dist loadfile`, so module fixtures are built once), and a long module
# started last would leave one worker idle while the other finishes it.
# the Slurm tests first: much of their time is spent waiting on the scheduler (a wall time, a queue), which the other
# worker fills with CPU work
RUN_FIRST = (
    "test_slurm",
    "test_watch",
    "test_multinode",
    "test_trainer_data_eval",
    "test_trainer_run",
    "test_launch",
    "test_kill_watch_launch_under_faults",
    "test_trainer_flex",
    "test_failure_states_e2e",
    "test_trainer_export",
    "test_trainer_parallel",
    "test_transport",
    "test_pull",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(RUN_FIRST)}
    order = {id(item): n for n, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(item.path.stem, len(RUN_FIRST)), order[id(item)]))


def kill_marked(mark: str) -> None:
    """SIGKILL every process whose command line or environment holds `mark` (a job's tag): never by name, which would
    reach other tests' processes or the user's."""
    for line in _leftovers((mark,)):
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)


def pytest_sessionfinish(session, exitstatus):
    """The suite leaves no process behind: whatever a test started and did not stop fails the run (and is killed)."""
    try:  # under xdist each worker checks its own temp dir and tmux socket
        base = str(session.config._tmp_path_factory.getbasetemp())
    except Exception:
        return
    marks = (base, TEST_TMUX_SOCKET)
    subprocess.run(["tmux", "-L", TEST_TMUX_SOCKET, "kill-server"], capture_output=True, check=False)
    deadline = time.monotonic() + 30  # only while something is left: a loaded machine's supervisor takes seconds
    left = _leftovers(marks)
    while left and time.monotonic() < deadline:  # a process told to stop may take a moment
        time.sleep(0.2)
        left = _leftovers(marks)
    if left:
        for line in left:
            with contextlib.suppress(OSError):
                os.kill(int(line.split(":")[0]), signal.SIGKILL)
        sys.stderr.write("\nprocesses left running by the tests (killed now):\n  " + "\n  ".join(left) + "\n")
        session.exitstatus = 1
