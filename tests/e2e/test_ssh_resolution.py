"""ssh resolves like the user's own `ssh`: Include, ProxyCommand, ProxyJump through `ssh -G`; one-line failures."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

from tests.conftest import run_cli


def add_config(client, text: str) -> None:
    cfg = client.home / ".ssh" / "config"
    cfg.write_text(cfg.read_text() + text)


def test_an_included_alias_resolves(client, sshd, tmp_path):
    inc = client.home / ".ssh" / "extra.conf"
    inc.write_text(
        f"Host inc-box\n  HostName 127.0.0.1\n  Port {sshd.port}\n  User root\n  IdentityFile {sshd.user_key}\n"
    )
    cfg = client.home / ".ssh" / "config"
    cfg.write_text(f"Include {inc}\n" + cfg.read_text())
    (client.project / "a.py").write_text("A = 1\n")
    res = run_cli("deploy", "inc-box", "--workdir", str(tmp_path / "wd"), "--json")
    assert res.code == 0, res.stderr
    assert (tmp_path / "wd" / "code" / "a.py").read_text() == "A = 1\n"


def test_proxycommand_and_proxyjump_aliases_go_through_their_hop(client, sshd, tmp_path):
    """The hop is `ssh -W` (ProxyCommand) or a direct-tcpip channel (ProxyJump) through the suite's own sshd, to a
    HostName that only the hop can reach by that name (`localhost`)."""
    known = client.known_hosts
    known.write_text(known.read_text() + f"[localhost]:{sshd.port} {sshd.host_pubkey}\n")
    hop = (
        f"ssh -F /dev/null -i {sshd.user_key} -p {sshd.port} -o UserKnownHostsFile={known} "
        f"-o StrictHostKeyChecking=yes -W %h:%p root@127.0.0.1"
    )
    add_config(
        client,
        f"Host via-cmd\n  HostName localhost\n  Port {sshd.port}\n  User root\n"
        f"  IdentityFile {sshd.user_key}\n  ProxyCommand {hop}\n"
        f"Host via-jump\n  HostName localhost\n  Port {sshd.port}\n  User root\n"
        f"  IdentityFile {sshd.user_key}\n  ProxyJump testbox\n",
    )
    (client.project / "a.py").write_text("A = 1\n")
    for alias in ("via-cmd", "via-jump"):
        res = run_cli("deploy", alias, "--workdir", str(tmp_path / alias), "--json")
        assert res.code == 0, (alias, res.stderr)
        assert json.loads(res.stdout)["files_sent"] == 1


def test_a_mistyped_alias_says_so_in_one_line(client, tmp_path):
    (client.project / "a.py").write_text("A = 1\n")
    res = run_cli("deploy", "tsetbox-typo", "--workdir", str(tmp_path / "wd"))
    lines = res.stderr.strip().splitlines()
    assert res.code == 2 and len(lines) == 1 and "is not a Host in your ssh config" in lines[0], lines


def test_a_port_that_never_answers_is_one_line_exit_2(client, tmp_path):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(5)
    held = []
    threading.Thread(target=lambda: held.extend(silent.accept() for _ in range(3)), daemon=True).start()
    port = silent.getsockname()[1]
    (client.project / "dflashctl.yaml").write_text(
        f"hosts:\n  mute: {{ssh: 'root@127.0.0.1', port: {port}, connect_timeout: 2}}\n"
    )
    (client.project / "a.py").write_text("A = 1\n")
    res = run_cli("deploy", "mute", "--workdir", str(tmp_path / "wd"), timeout=60)
    lines = res.stderr.strip().splitlines()
    assert res.code == 2 and len(lines) == 1 and "no ssh answer within 2 s" in lines[0], lines
    silent.close()


def test_unknown_host_keys_are_shown_as_sha256(client, sshd, tmp_path):
    client.known_hosts.write_text("")
    (client.project / "a.py").write_text("A = 1\n")
    res = run_cli("deploy", "testbox", "--workdir", str(tmp_path / "wd"))
    fp = (
        __import__("subprocess")
        .run(["ssh-keygen", "-l", "-f", str(sshd.dir / "host_key.pub")], capture_output=True, text=True)
        .stdout.split()[1]
    )
    assert res.code == 2 and fp.startswith("SHA256:") and fp in res.stderr


def test_without_an_ssh_client_the_fallback_parser_still_runs_match_exec(tmp_path):
    """paramiko loads without `invoke` (70 ms of every remote command); the fallback parser, used only where no
    OpenSSH client is installed, brings it back, so a `Match exec` line is still evaluated, not an ImportError."""
    import os
    import shutil
    import subprocess
    import sys

    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text('Match exec "true"\n  HostName 10.9.8.7\n  Port 2200\n')
    script = (
        "import sys\n"
        "from dflashctl.config import HostConfig\n"
        "from dflashctl.remote import ssh\n"
        "print('invoke' in sys.modules)\n"
        "t = ssh.resolve_ssh_target(HostConfig(name='m', ssh='matched'))\n"
        "print(t.hostname, t.port, t.source)\n"
    )
    bin_dir = tmp_path / "bin"  # a PATH with a shell for `Match exec`, and no OpenSSH client
    bin_dir.mkdir()
    (bin_dir / "bash").symlink_to(shutil.which("bash"))
    env = {**os.environ, "HOME": str(home), "PATH": str(bin_dir)}
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["False", "10.9.8.7 2200 paramiko"]
