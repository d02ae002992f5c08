"""A job file or host name with a mistake gets one line that points at the fix: the file (and line), the key, the
nearest known key or host (`comand` -> `command`, `lcoal` -> `local`), `command: |` where YAML broke on `: `, a
webhook nothing could answer. Exit status 2, and nothing runs: through the real CLI on the `local` host."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflashctl.config import resolve_host
from dflashctl.errors import ConfigError
from dflashctl.model.jobfile import load_job
from tests.conftest import run_cli


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    home, project = tmp_path / "home", tmp_path / "project"
    (home / ".ssh").mkdir(parents=True)
    project.mkdir()
    (project / "dflashctl.yaml").write_text("hosts:\n  gpubox: {ssh: gpubox.invalid, connect_timeout: 1}\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(tmp_path / "state"))
    for var in ("DFLASHCTL_HOSTS", "XDG_CONFIG_HOME", "XDG_STATE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(project)
    return project


MARK = "touch ran-it"
BAD = [  # (the job file after `name: j`, what its one line must say)
    (f"host: local\ncomand: {MARK}\n", "j.yaml: comand: unknown key (did you mean `command`?)"),
    (
        f"host: local\ncommand: {MARK}\nwatch: {{notfy: {{bell: false}}}}\n",
        "j.yaml: watch.notfy: unknown key (did you mean `notify`?)",
    ),
    (
        f"hosts:\n  - host: local\n    gpuz: 1\ncommand: {MARK}\n",
        "j.yaml: hosts.0.gpuz: unknown key (did you mean `gpus`?)",
    ),
    (f"host: local\ncommand: {MARK}\nxyzzy: 1\n", "j.yaml: xyzzy: unknown key"),
    (
        f"host: lcoal\ncommand: {MARK}\n",
        "j.yaml: host: no host `lcoal` in dflashctl.yaml, hosts.yaml or ~/.ssh/config: did you mean `local`?",
    ),
    (
        f"host: gpubx\ncommand: {MARK}\n",
        "j.yaml: host: no host `gpubx` in dflashctl.yaml, hosts.yaml or ~/.ssh/config: did you mean `gpubox`?",
    ),
    (
        f"hosts:\n  - host: local\n  - host: gpubxo\ncommand: {MARK}\n",
        "j.yaml: hosts.1.host: no host `gpubxo` in dflashctl.yaml, hosts.yaml or ~/.ssh/config: did you mean `gpubox`?",
    ),
    (
        f"host: local\ncommand: {MARK} --note why: because\n",
        "j.yaml:3: command: malformed YAML: mapping values are "
        "not allowed here; the value of `command` holds `: `: write it as a block, `command: |`",
    ),
    (f"host: local\ncommand:\n  {MARK}\n  --note why: because\n", "j.yaml:5: command: malformed YAML"),
    (f"host: local\ncommand: {MARK}\nenv: {{A: x: y}}\n", "j.yaml:4: env: malformed YAML"),
    (
        f"host: local\ncommand: {MARK}\nwatch: {{notify: {{webhook: 'http://127.0.0.1:0/x'}}}}\n",
        "j.yaml: watch.notify.webhook: the URL's port is not a number from 1 to 65535",
    ),
    (
        f"host: local\ncommand: {MARK}\nwatch: {{notify: {{webhook: 'ftp://h/x'}}}}\n",
        "j.yaml: watch.notify.webhook: expected an http:// or https:// URL with a host",
    ),
    (
        f"host: local\ncommand: {MARK}\nwatch: {{notify: {{webhook: 'https:///x'}}}}\n",
        "j.yaml: watch.notify.webhook: expected an http:// or https:// URL with a host",
    ),
    (
        f"host: local\ncommand: {MARK}\nwatch: {{notify: {{webhook: 'http://h:65536/x'}}}}\n",
        "j.yaml: watch.notify.webhook: the URL's port",
    ),
]


@pytest.mark.parametrize("body, says", BAD)
def test_a_bad_job_file_is_one_line_that_points_at_the_fix_and_runs_nothing(project, tmp_path, body, says):
    job = tmp_path / "j.yaml"
    job.write_text("name: j\n" + body)
    for command in (["launch", str(job)], ["doctor", str(job)]):
        res = run_cli(*command)
        lines = res.stderr.strip().splitlines()
        assert res.code == 2 and len(lines) == 1 and res.stdout == "", res
        assert says in lines[0] and "Traceback" not in res.stderr, lines
        assert "webhook" not in says or "127.0.0.1" not in lines[0], "the URL (a secret) is repeated"
    assert "did you mean" in says or "did you mean" not in lines[0], lines  # no guess where nothing is near
    assert not (project / "ran-it").exists() and not (tmp_path / "home" / "dflashctl").exists()
    assert not (tmp_path / "state" / "jobs.json").exists()


def test_a_webhook_with_credentials_and_real_ports_is_accepted(project, tmp_path):
    """The sender moves user:password into an Authorization header: the check lets it through."""
    job = tmp_path / "j.yaml"
    for hook in ("http://user:pa%40ss@hooks.example/x", "https://hooks.example:65535/x", "http://[::1]:8080/x"):
        job.write_text(f"name: j\ncommand: 'true'\nwatch: {{notify: {{webhook: '{hook}'}}}}\n")
        assert load_job(job, project)[0].watch.notify.webhook == hook


@pytest.mark.parametrize(
    "typed, near",
    [("lcoal", "local"), ("Local", "local"), ("locl", "local"), ("gpubx", "gpubox"), ("gpu-box", "gpubox")],
)
def test_a_misspelt_host_on_the_command_line_is_pointed_at_the_nearest(project, typed, near):
    res = run_cli("deploy", typed)
    lines = res.stderr.strip().splitlines()
    assert res.code == 2 and len(lines) == 1 and res.stdout == "", res
    assert f"command line: host: no host `{typed}`" in lines[0] and f"did you mean `{near}`?" in lines[0], lines
    assert f"ssh://{typed}" in lines[0]  # the way to mean a new host of that name
    assert not (project.parent / "home" / "dflashctl").exists()


def test_a_real_destination_near_a_host_name_is_taken_as_written(project):
    """Not typos: a longer name (`localhost`), an address, user@ or ssh://, an alias of ~/.ssh/config."""
    (project.parent / "home" / ".ssh" / "config").write_text("Host gpubx\n  HostName 127.0.0.1\nHost lab-*\n")
    for spec, ssh in [
        ("localhost", "localhost"),
        ("10.0.0.1", "10.0.0.1"),
        ("root@lcoal", "root@lcoal"),
        ("ssh://lcoal", "lcoal"),
        ("gpubx", "gpubx"),
        ("lab-gpubox", "lab-gpubox"),
    ]:
        assert resolve_host(spec, project).ssh == ssh, spec
    with pytest.raises(ConfigError, match="did you mean `gpubox`"):
        resolve_host("gpubxo", project)
