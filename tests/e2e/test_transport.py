"""Command execution over the real sshd, through the fake pct, and locally: bytes in equal bytes out."""

from __future__ import annotations

import json
import shlex
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflashctl.config import HostConfig, resolve_host
from dflashctl.errors import HostKeyError, UnreachableError
from dflashctl.remote.connect import open_runner
from dflashctl.remote.ssh import SshRunner
from dflashctl.remote.transport import LocalRunner
from tests.conftest import free_port

ECHO_ARGV = [sys.executable, "-c", "import sys, json; sys.stdout.write(json.dumps(sys.argv[1:]))"]
# Arbitrary text a user might put in a value: quotes, $(), backticks, newlines, non-ASCII. NUL cannot be in argv.
ARG_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40)


@pytest.fixture(scope="module")
def runners(sshd, tmp_path_factory):
    """One ssh connection per runner for the whole module, as one CLI run keeps one. Connected eagerly under a
    HOME whose known_hosts trusts the test sshd."""
    home = tmp_path_factory.mktemp("home")
    (home / ".ssh").mkdir()
    (home / ".ssh" / "known_hosts").write_text(f"[127.0.0.1]:{sshd.port} {sshd.host_pubkey}\n")
    base = dict(ssh="root@127.0.0.1", port=sshd.port, identity_file=str(sshd.user_key))
    made = {
        "local": LocalRunner(HostConfig(name="local")),
        "ssh": SshRunner(HostConfig(name="ssh", **base)),
        "ssh+pct": SshRunner(HostConfig(name="ssh+pct", container="pct:200", **base)),
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(home))
        for r in made.values():
            r.check_connection()
    yield made
    for r in made.values():
        r.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(args=st.lists(ARG_TEXT, min_size=1, max_size=4))
@pytest.mark.parametrize("kind", ["local", "ssh", "ssh+pct"])
def test_arguments_arrive_byte_identical(runners, kind, args):
    res = runners[kind].run([*ECHO_ARGV, *args])
    assert res.returncode == 0, res.err
    assert json.loads(res.out) == args


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(args=st.lists(ARG_TEXT, min_size=1, max_size=3))
@pytest.mark.parametrize("kind", ["ssh", "ssh+pct"])
def test_arguments_survive_bash_layer(runners, kind, args):
    """ssh + pct + bash -c: the script is constant and the values travel as $1..$N."""
    res = runners[kind].run_script('exec "$@"', *ECHO_ARGV, *args)
    assert res.returncode == 0, res.err
    assert json.loads(res.out) == args


@pytest.mark.parametrize("kind", ["local", "ssh", "ssh+pct"])
def test_exit_status_and_stdin_survive(runners, kind):
    res = runners[kind].run_script("cat >/dev/null; echo out; echo err >&2; exit 7 | true; exit 42", stdin=b"x" * 10**6)
    assert (res.returncode, res.out, res.err) == (42, "out\n", "err\n")


def test_pct_runs_inside_its_container_directory(runners, sshd):
    res = runners["ssh+pct"].run(["pwd"])
    assert res.out.strip() == str(sshd.pct_root / "ct200")


def test_one_connection_for_many_commands(sshd, client):
    before = SshRunner.connections_opened
    with open_runner(resolve_host("testbox")) as r:
        for _ in range(5):
            r.run(["true"]).check("true")
    assert SshRunner.connections_opened - before == 1


def test_ssh_config_alias_is_honoured(client, sshd):
    with open_runner(resolve_host("testbox")) as r:
        assert r.run(["whoami"]).out.strip() == "root"


def test_unknown_host_key_refused_then_accepted(client, sshd):
    client.known_hosts.write_text("")
    with pytest.raises(HostKeyError, match="accept-new-host-key"), open_runner(resolve_host("testbox")) as r:
        r.check_connection()
    with open_runner(resolve_host("testbox"), accept_new_host_key=True) as r:
        r.check_connection()
    assert sshd.host_pubkey in client.known_hosts.read_text()
    with open_runner(resolve_host("testbox")) as r:  # now known: no flag needed
        r.check_connection()


def test_changed_host_key_always_refused(client, sshd, tmp_path):
    import subprocess

    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
    other = " ".join((tmp_path / "other.pub").read_text().split()[:2])
    client.known_hosts.write_text(f"[127.0.0.1]:{sshd.port} {other}\n")
    for accept in (False, True):
        with pytest.raises(HostKeyError, match="CHANGED"), open_runner(resolve_host("testbox"), accept) as r:
            r.check_connection()


def test_closed_port_is_a_quick_error(client):
    """A refused connection is reported as such at once, not after the connect timeout or retries: with a 60 s
    timeout, the error must come well before it (a loaded machine adds seconds, never a minute)."""
    host = HostConfig(name="closed", ssh="root@127.0.0.1", port=free_port(), connect_timeout=60)
    t0 = time.monotonic()
    with pytest.raises(UnreachableError, match="cannot connect"), open_runner(host) as r:
        r.check_connection()
    assert time.monotonic() - t0 < 60 / 2


def test_silent_host_times_out_within_connect_timeout(client):
    """A port that accepts TCP but never speaks ssh: the handshake must give up at the connect timeout."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        host = HostConfig(name="silent", ssh="root@127.0.0.1", port=s.getsockname()[1], connect_timeout=1.5)
        t0 = time.monotonic()
        with pytest.raises(UnreachableError), open_runner(host) as r:
            r.check_connection()
        assert time.monotonic() - t0 < 1.5 + 5


def test_describe_quotes_once_per_layer():
    r = LocalRunner(HostConfig(name="x", container="pct:200"))
    line = r.describe(["echo", "a b", "$(x)"])
    assert shlex.split(line) == ["pct", "exec", "200", "--", "echo", "a b", "$(x)"]
