"""Bad input gets one line naming the file and key, exit status 2, and nothing runs remotely."""

from __future__ import annotations

import json

import pytest

from dflashctl.config import parse_destination, resolve_host
from dflashctl.errors import ConfigError


@pytest.mark.parametrize(
    "text, expect",
    [
        ("hosts: [unclosed\n", "malformed YAML"),
        ("hosts:\n  box:\n    ssh: testbox\n    colour: red\n", "hosts.box.colour: unknown key"),
        ("hostz:\n  box: {}\n", "hostz: unknown key (did you mean `hosts`?)"),
        ("hosts:\n  box:\n    ssh: testbox\n    prot: 22\n", "hosts.box.prot: unknown key (did you mean `port`?)"),
        (
            "hosts:\n  box:\n    ssh: testbox\n    slurm: {partion: a}\n",
            "hosts.box.slurm.partion: unknown key (did you mean `partition`?)",
        ),
        ("hosts:\n  box:\n    ssh: testbox\n    port: many\n", "hosts.box.port"),
        ("hosts:\n  box:\n    ssh: testbox\n    container: lxc:200\n", "hosts.box.container"),
        ("hosts:\n  box:\n    ssh: testbox\n    container: 'pct:200; rm -rf /'\n", "hosts.box.container"),
        ("hosts:\n  box:\n    ssh: 'root@h$(reboot)'\n", "hosts.box.ssh"),
        ("hosts:\n  'b;x':\n    ssh: h\n", "hosts.b;x"),
        ("hosts:\n  local:\n    ssh: h\n", "hosts.local"),
        ("hosts: 3\n", "hosts: expected a mapping"),
    ],
)
def test_bad_hosts_file(cli, client, sshd, text, expect):
    client.write_hosts(text)
    marker = sshd.pct_root / "ct200" / "touched"
    res = cli("deploy", "box", "--workdir", "touched")
    assert res.code == 2, res
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr
    assert str(client.hosts_file) in lines[0] and expect in lines[0]
    assert not marker.exists()


def test_project_file_errors_name_it(cli, client):
    (client.project / "dflashctl.yaml").write_text("hosts:\n  box:\n    ssh: a\n    workdir: 5\n")
    res = cli("doctor", "box")
    assert res.code == 2 and "dflashctl.yaml: hosts.box.workdir" in res.stderr


@pytest.mark.parametrize("spec", ["a;b", "root@$(x)", "ssh://h`id`", "user@host:22 -oProxyCommand=x", "r@h|x"])
def test_shell_characters_in_host_spec(cli, client, spec):
    res = cli("doctor", spec)
    assert res.code == 2 and res.stderr.count("\n") == 1 and "command line: host" in res.stderr


def test_debug_shows_traceback(cli, client):
    res = cli("--debug", "doctor", "a;b")
    assert res.code != 0 and "Traceback" in res.stderr


def test_destinations_parse():
    assert parse_destination("ssh://alice@gpu1:2222").model_dump(include={"ssh", "port"}) == {
        "ssh": "alice@gpu1",
        "port": 2222,
    }
    assert parse_destination("ssh://gpu1").ssh == "gpu1"
    assert parse_destination("bob@10.0.0.2").ssh == "bob@10.0.0.2"
    with pytest.raises(ConfigError):
        parse_destination("ssh://gpu1:notaport")


def test_project_overrides_user_and_workdir_option(client):
    client.write_hosts("hosts:\n  box:\n    ssh: user-box\n    workdir: /u\n")
    assert resolve_host("box").ssh == "user-box"
    (client.project / "dflashctl.yaml").write_text("hosts:\n  box:\n    ssh: proj-box\n")
    host = resolve_host("box", workdir="/elsewhere")
    assert (host.ssh, host.workdir, host.name) == ("proj-box", "/elsewhere", "box")
    assert resolve_host("local").is_local


def test_unreachable_host_cli(cli, client):
    from tests.conftest import free_port

    (client.project / "m.py").write_text("x = 1\n")
    client.write_hosts(f"hosts:\n  gone:\n    ssh: root@127.0.0.1\n    port: {free_port()}\n    connect_timeout: 2\n")
    res = cli("deploy", "gone", "--workdir", "/tmp/x", "--json")
    assert res.code == 2 and res.stderr.count("\n") == 1 and "cannot connect" in res.stderr
    assert json.loads(res.stdout) == {"error": res.stderr.strip().removeprefix("dflashctl: error: "), "exit": 2}


def test_unknown_host_key_cli_says_how(cli, client):
    client.known_hosts.write_text("")
    res = cli("doctor", "testbox")
    assert res.code == 2 and "--accept-new-host-key" in res.stderr
    res = cli("doctor", "testbox", "--accept-new-host-key", "--json")
    assert res.code in (0, 1) and '"reachable"' in res.stdout


def test_a_union_key_is_named_as_the_file_has_it(tmp_path):
    """`gpus: true` fails both of gpus' forms (a list, a count): one message for the key, no `list[int]` tags."""
    from dflashctl.model.jobfile import load_job

    job = tmp_path / "j.yaml"
    job.write_text("name: j\ncommand: 'true'\ngpus: true\n")
    with pytest.raises(ConfigError) as got:
        load_job(job, tmp_path)
    assert str(got.value) == f"{job}: gpus: expected a valid list or a valid integer"
