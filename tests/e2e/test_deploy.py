"""deploy end to end through the real CLI: over the sshd, over sshd + fake pct, and to `local`."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def make_project(root: Path) -> None:
    (root / "pkg").mkdir()
    (root / "pkg" / "a.py").write_text("A = 1\n")
    (root / "pkg" / "b.py").write_text("B = 2\n")
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "run.sh").chmod(0o755)
    (root / "odd name $(x) 'q'.txt").write_text("odd\n")
    (root / ".gitignore").write_text("secret.env\n*.log\n")
    (root / "secret.env").write_text("TOKEN=1\n")
    (root / "train.log").write_text("noise\n")
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run(["git", "-C", str(root), "add", "pkg", "run.sh", ".gitignore"], check=True)
    (root / "untracked.py").write_text("U = 3\n")  # untracked, not ignored: travels


def remote_tree(code: Path) -> dict[str, str]:
    return {
        p.relative_to(code).as_posix(): p.read_text()
        for p in sorted(code.rglob("*"))
        if p.is_file() and p.name != ".dflashctl-manifest.json"
    }


@pytest.fixture(params=["ssh", "ssh+pct", "local"])
def target(request, client, sshd, tmp_path):
    """(host argument, workdir argument, where the code lands on disk)."""
    if request.param == "ssh":
        return "testbox", str(tmp_path / "remote"), tmp_path / "remote" / "code"
    if request.param == "ssh+pct":
        client.write_hosts("hosts:\n  box:\n    ssh: testbox\n    container: pct:201\n    workdir: wd\n")
        return "box", "wd", sshd.pct_root / "ct201" / "wd" / "code"
    return "local", str(tmp_path / "local-remote"), tmp_path / "local-remote" / "code"


def deploy(cli, host, workdir, *extra):
    res = cli("deploy", host, "--workdir", workdir, "--json", *extra)
    assert res.code == 0, res.stderr
    return json.loads(res.stdout)


def test_deploy_cycle(cli, client, target):
    host, workdir, code = target
    root = client.project
    make_project(root)

    dry = deploy(cli, host, workdir, "--dry-run")
    assert dry["dry_run"] and dry["files_sent"] == 6 and not code.exists()

    first = deploy(cli, host, workdir)
    expected = {".gitignore", "pkg/a.py", "pkg/b.py", "run.sh", "untracked.py", "odd name $(x) 'q'.txt"}
    assert set(remote_tree(code)) == expected
    assert first["files_sent"] == 6 and first["bytes_sent"] > 0 and first["version"] == dry["version"]
    assert (code / "run.sh").stat().st_mode & 0o111, "the executable bit travels"

    again = deploy(cli, host, workdir)
    assert (again["files_sent"], again["files_deleted"], again["bytes_sent"]) == (0, 0, 0)
    assert again["remote_commands"] == 1 and again["version"] == first["version"]

    (root / "pkg" / "a.py").write_text("A = 10\n")
    one = deploy(cli, host, workdir)
    assert one["sent"] == ["pkg/a.py"] and remote_tree(code)["pkg/a.py"] == "A = 10\n"
    assert one["version"] != first["version"]

    (root / "pkg" / "b.py").unlink()
    (root / "secret.env").write_text("TOKEN=2\n")  # ignored: never sent
    before = remote_tree(code)
    dry = deploy(cli, host, workdir, "--dry-run")
    assert dry["deleted"] == ["pkg/b.py"] and dry["sent"] == [] and remote_tree(code) == before
    gone = deploy(cli, host, workdir)
    assert gone["deleted"] == ["pkg/b.py"] and "pkg/b.py" not in remote_tree(code)
    assert "secret.env" not in remote_tree(code) and "train.log" not in remote_tree(code)


def test_deploy_outside_git_skips_junk(cli, client, tmp_path):
    root = client.project
    (root / "m.py").write_text("x = 1\n")
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"\0")
    (root / ".venv" / "bin").mkdir(parents=True)
    (root / ".venv" / "bin" / "python").write_text("")
    report = deploy(cli, "local", str(tmp_path / "wd"))
    assert report["sent"] == ["m.py"]


def test_deploy_human_output(cli, client, tmp_path):
    (client.project / "m.py").write_text("x = 1\n")
    res = cli("deploy", "local", "--workdir", str(tmp_path / "wd"))
    assert res.code == 0
    assert "local: sent 1 files" in res.stdout and "release " in res.stdout


def test_a_deploy_after_this_machines_last_one_is_one_remote_command_and_survives_a_lost_base(cli, client, tmp_path):
    """The second deploy sends the changes against the release this machine last deployed, in one command. If that
    release is gone from the remote (collected, deleted by hand), the deploy asks the agent for its current release
    and still lands the exact tree; a garbled record of the last deploy is ignored, never trusted: one command, in
    which the agent tells its current release and only what differs travels."""
    import os
    import shutil

    from dflashctl.model.record import state_dir

    root, wd = client.project, tmp_path / "wd"
    make_project(root)
    first = deploy(cli, "local", str(wd))
    (root / "pkg" / "a.py").write_text("A = 10\n")
    one = deploy(cli, "local", str(wd))
    assert one["remote_commands"] == 1 and one["sent"] == ["pkg/a.py"]
    assert remote_tree(wd / "code")["pkg/a.py"] == "A = 10\n" and one["version"] != first["version"]
    records = list((state_dir() / "last-deploy").iterdir())
    assert len(records) == 1 and records[0].stat().st_mode & 0o777 == 0o600

    shutil.rmtree(wd / "releases" / one["version"])  # the base of the next deploy, gone; `code` dangles
    (root / "pkg" / "b.py").write_text("B = 20\n")
    lost = deploy(cli, "local", str(wd))
    tree = remote_tree(wd / "code")
    assert tree["pkg/a.py"] == "A = 10\n" and tree["pkg/b.py"] == "B = 20\n" and "untracked.py" in tree
    assert lost["remote_commands"] == 2  # the one that found no base; the plan step with the tar on one channel

    records[0].write_text('{"workdir": 1, "files": [')
    (root / "pkg" / "b.py").write_text("B = 30\n")
    garbled = deploy(cli, "local", str(wd))
    assert garbled["remote_commands"] == 1 and remote_tree(wd / "code")["pkg/b.py"] == "B = 30\n"
    assert garbled["sent"] == ["pkg/b.py"]  # the agent told its current release: only the change travelled
    assert os.readlink(wd / "code") == f"releases/{garbled['version']}"


def test_the_release_agent_runs_under_the_interpreter_behind_a_shim_and_falls_back_when_gone(cli, client, tmp_path):
    """A `python3` that is a version manager's shim runs once; later deploys start the interpreter the agent
    reported (no shim on every call). When that interpreter is gone, the deploy still lands through the shim and
    records the interpreter anew."""
    import sys

    from dflashctl.model.record import state_dir

    shim, calls = tmp_path / "shim" / "python3", tmp_path / "shim-calls"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\necho "$$" >> {calls}\nexec {sys.executable} "$@"\n')
    shim.chmod(0o755)
    wd = tmp_path / "wd"
    client.write_hosts(f"hosts:\n  shimmed:\n    python: {shim}\n    workdir: {wd}\n")
    root = client.project
    make_project(root)
    deploy(cli, "shimmed", str(wd))
    assert len(calls.read_text().split()) == 1
    (record,) = (state_dir() / "last-deploy").iterdir()
    remembered = json.loads(record.read_text())["python"]
    assert remembered.startswith("/") and remembered != str(shim)

    (root / "pkg" / "a.py").write_text("A = 10\n")
    deploy(cli, "shimmed", str(wd))
    assert len(calls.read_text().split()) == 1  # the remembered interpreter, not the shim
    assert remote_tree(wd / "code")["pkg/a.py"] == "A = 10\n"
    other = deploy(cli, "shimmed", str(tmp_path / "wd-other"))  # a workdir with no record, on a known host
    assert other["files_sent"] == 6 and len(calls.read_text().split()) == 1
    (host_record,) = (state_dir() / "agent-python").iterdir()
    assert host_record.stat().st_mode & 0o777 == 0o600 and json.loads(host_record.read_text()) == {"python": remembered}

    body = json.loads(record.read_text())
    record.write_text(json.dumps({**body, "python": str(tmp_path / "gone" / "python3")}))
    (root / "pkg" / "a.py").write_text("A = 11\n")
    again = deploy(cli, "shimmed", str(wd))
    assert again["sent"] == ["pkg/a.py"] and remote_tree(wd / "code")["pkg/a.py"] == "A = 11\n"
    assert len(calls.read_text().split()) == 2  # the vanished one failed to start: the shim ran it
    assert json.loads(record.read_text())["python"] == remembered
    host_record.write_text(json.dumps({"python": str(tmp_path / "gone" / "python3")}))
    third = deploy(cli, "shimmed", str(tmp_path / "wd-third"))
    assert third["files_sent"] == 6 and len(calls.read_text().split()) == 3
    assert json.loads(host_record.read_text()) == {"python": remembered}  # the host's interpreter, found again


def test_a_deploy_with_no_record_is_one_command_even_when_nothing_changed_and_expands_the_home(cli, client, tmp_path):
    """With no record of the host (a new machine, a cleared state dir), one command: the agent tells its current
    release, then only what differs travels, or nothing when the tree is already current. A workdir under `~` is the
    remote user's home, as a shell would read it."""
    import shutil

    from dflashctl.model.record import state_dir

    root = client.project
    make_project(root)
    first = deploy(cli, "local", "~/wd-home")
    code = client.home / "wd-home" / "code"
    assert first["remote_commands"] == 1 and first["files_sent"] == 6 and first["code_dir"] == f"{code}"
    assert remote_tree(code)["pkg/a.py"] == "A = 1\n" and not (root / "~").exists()

    shutil.rmtree(state_dir())
    same = deploy(cli, "local", "~/wd-home")
    assert (same["remote_commands"], same["files_sent"], same["bytes_sent"]) == (1, 0, 0)
    assert os.readlink(code) == f"releases/{first['version']}"

    shutil.rmtree(state_dir())
    (root / "pkg" / "b.py").write_text("B = 5\n")
    changed = deploy(cli, "local", "~/wd-home")
    assert changed["remote_commands"] == 1 and changed["sent"] == ["pkg/b.py"]
    assert remote_tree(code)["pkg/b.py"] == "B = 5\n" and remote_tree(code)["pkg/a.py"] == "A = 1\n"


def test_an_agent_that_never_starts_fails_the_deploy_at_once_and_changes_nothing(cli, client, tmp_path):
    """The plan step's stdin waits for the agent to tell its current release: an interpreter that does not exist
    ends the command, and the wait with it. One line, exit 1, nothing staged."""
    wd = tmp_path / "wd"
    client.write_hosts(f"hosts:\n  broken:\n    python: {tmp_path / 'no' / 'python3'}\n    workdir: {wd}\n")
    make_project(client.project)
    res = cli("deploy", "broken", "--workdir", str(wd))
    assert res.code == 1 and "deploy to broken failed" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not (wd / "code").exists()
