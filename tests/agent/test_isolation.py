"""The agent trusts nothing around its interpreter: modules planted on the remote's PYTHONPATH and in the login
directory are never imported (by the boot line, the launcher or the supervisor); a banner its `python:` prints is
skipped and named once; `doctor` runs the agent as deploy does; the clock is measured against the round trip's
midpoint. A real sshd, real tmux, planted files on the remote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflashctl.remote.agent_bundle import AGENT, boot_argv, split_answer
from dflashctl.remote.doctor import clock_offset, rate_clock
from tests.conftest import run_cli
from tests.e2e.test_bad_input_and_faults import oldest_python
from tests.e2e.test_launch import cli_json, status_json, wait_until, write_project

PLANTED = ("zipfile", "signal", "hashlib", "json")


def plant(where: Path, marks: Path) -> None:
    """Modules that the agent imports (from the standard library), each of which leaves a file if imported."""
    where.mkdir(parents=True, exist_ok=True)
    for name in PLANTED:
        (where / f"{name}.py").write_text(f"open({str(marks / name)!r}, 'w').close()\nraise SystemExit('{name}')\n")


def wrapper(path: Path, body: str) -> str:
    path.write_text(f'#!/bin/sh\n{body}\nexec {sys.executable} "$@"\n')
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("py", ["this", "3.8"])
def test_the_boot_line_imports_nothing_from_pythonpath_or_the_working_directory(tmp_path, py):
    python = sys.executable if py == "this" else oldest_python()
    if python is None:
        pytest.skip("no python3.8 on this machine")
    marks, login, path = tmp_path / "marks", tmp_path / "login", tmp_path / "pythonpath"
    marks.mkdir()
    plant(login, marks)
    plant(path, marks)
    argv = boot_argv(python, "probe", json.dumps({"action": "tail", "path": "/proc/version", "lines": 1}))
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(path)}
    res = subprocess.run(argv, input=AGENT, capture_output=True, cwd=login, env=env)
    assert res.returncode == 0 and json.loads(res.stdout)["exists"], res.stderr.decode()[-2000:]
    assert sorted(p.name for p in marks.iterdir()) == []
    unsafe = subprocess.run([python, "-S", "-c", "import zipfile"], cwd=login, env=env, capture_output=True)
    assert unsafe.returncode != 0 and (marks / "zipfile").exists()  # the plant is live without -I


@pytest.fixture
def planted(client, tmp_path):
    """A host `plantbox` whose interpreter runs with a PYTHONPATH of planted modules and from a login directory that
    holds them too (its `python:` sets both, as a login profile would), deployed."""
    proj = write_project(client, tmp_path)
    marks, login, path = tmp_path / "marks", tmp_path / "login", tmp_path / "pythonpath"
    marks.mkdir()
    plant(login, marks)
    plant(path, marks)
    py = wrapper(tmp_path / "python-planted", f"export PYTHONPATH={path}\ncd {login}")
    cfg = proj / "dflashctl.yaml"
    cfg.write_text(cfg.read_text() + f"  plantbox: {{ssh: testbox, python: {py}, workdir: {tmp_path}/remote/pl}}\n")
    res = run_cli("deploy", "plantbox")
    assert res.code == 0, res.stderr
    return proj, marks, path


def test_deploy_launch_supervisor_status_and_kill_import_nothing_planted(planted):
    proj, marks, path = planted
    f = proj.parent / "planted.yaml"
    f.write_text("name: planted\nhost: plantbox\nkill_grace_s: 2\ncommand: 'echo \"PP=$PYTHONPATH\"; sleep 300'\n")
    job_id = cli_json("launch", str(f))["id"]
    run = Path(status_json(job_id)["run_dir"])
    wait_until(lambda: (run / "verdict.json").exists(), timeout=60)  # the supervisor is up and has judged
    wait_until(lambda: f"PP={path}" in (run / "train.log").read_text())  # the job keeps its environment
    assert status_json(job_id)["state"] in ("RUNNING", "STARTING")
    assert cli_json("kill", job_id)["result"] == "KILLED"
    assert sorted(p.name for p in marks.iterdir()) == []


def test_a_banner_before_the_agents_answer_is_skipped_and_named_once(client, tmp_path):
    proj = write_project(client, tmp_path)
    py = wrapper(tmp_path / "python-chatty", 'echo "Welcome to the cluster, $USER"; echo')
    cfg = proj / "dflashctl.yaml"
    cfg.write_text(cfg.read_text() + f"  chatty: {{ssh: testbox, python: {py}, workdir: {tmp_path}/remote/ch}}\n")
    doc = run_cli("doctor", "chatty", "--json")  # first: a deploy remembers the interpreter behind the wrapper
    checks = {c["name"]: c for c in json.loads(doc.stdout)["checks"]}
    assert doc.code == 0 and checks["agent"]["status"] == "warn" and "Welcome" in checks["agent"]["detail"], checks
    res = run_cli("deploy", "chatty")
    assert res.code == 0, res.stderr
    warned = [ln for ln in res.stderr.splitlines() if "warning" in ln]
    assert len(warned) == 1 and "Welcome to the cluster" in warned[0], res.stderr


def test_doctor_fails_where_deploy_fails(client, tmp_path):
    """A `python:` that answers `-c` (the facts) but loses its stdin (the agent arrives on stdin): the old doctor
    said ok and deploy failed; now both fail."""
    proj = write_project(client, tmp_path)
    py = tmp_path / "python-deaf"
    py.write_text(f'#!/bin/sh\nexec {sys.executable} "$@" </dev/null\n')
    py.chmod(0o755)
    cfg = proj / "dflashctl.yaml"
    cfg.write_text(cfg.read_text() + f"  deaf: {{ssh: testbox, python: {py}, workdir: {tmp_path}/remote/d}}\n")
    assert run_cli("deploy", "deaf").code != 0
    doc = run_cli("doctor", "deaf", "--json")
    checks = {c["name"]: c for c in json.loads(doc.stdout)["checks"]}
    assert doc.code == 1 and checks["python"]["status"] == "ok" and checks["agent"]["status"] == "fail", checks


def test_split_answer_keeps_the_answer_and_gives_back_the_noise():
    assert split_answer(b'{"a":1}') == (b'{"a":1}', b"")
    assert split_answer(b'hello\n\n{"a":1}') == (b'{"a":1}', b"hello\n\n")
    assert split_answer(b"hello\nnot json") == (b"hello\nnot json", b"")


def test_the_clock_is_rated_against_the_round_trips_midpoint():
    """+2 s against a 10 ms round trip is a real offset: not ok. A remote read at the midpoint is no offset, however
    long the round trip; an offset within the limit but not beyond doubt (the round trip's half) is not ok either."""
    offset, half = clock_offset(1002.005, 1000.0, 1000.01)
    assert abs(offset - 2.0) < 1e-6 and rate_clock(offset, half).status == "warn"
    assert rate_clock(*clock_offset(1002.0, 1000.0, 1004.0)).status == "warn"  # 0 +- 2 s: not known to be ok
    assert rate_clock(*clock_offset(1000.05, 1000.0, 1000.1)).status == "ok"
    assert "\u00b1" in rate_clock(0.0, 0.01).detail


def test_doctor_on_loopback_measures_no_offset_behind_a_slow_interpreter(client, tmp_path):
    """The facts script imports torch (seconds): the clock is read in a round trip of its own, so a slow Python no
    longer reads as an offset (it read +2 s on loopback)."""
    proj = write_project(client, tmp_path)
    py = wrapper(tmp_path / "python-slow", "sleep 3")
    cfg = proj / "dflashctl.yaml"
    cfg.write_text(cfg.read_text() + f"  slow: {{ssh: testbox, python: {py}, workdir: {tmp_path}/remote/s}}\n")
    doc = run_cli("doctor", "slow", "--json")
    clock = {c["name"]: c for c in json.loads(doc.stdout)["checks"]}["clock"]
    offset = float(clock["detail"].split()[1])
    assert clock["status"] == "ok" and abs(offset) < 0.5, clock
