"""`gc` as an attacker and a careless user would run it: garbage numbers, a disk mounted inside an old run dir,
another project's runs, a dry run that must change nothing. A real sshd, real tmux, a real tmpfs."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from dflashctl.agent import collect
from tests.conftest import TEST_TMUX_SOCKET, run_cli, tmpfs
from tests.e2e.test_kill_watch_launch_under_faults import job_file, proj, run_dir_of  # noqa: F401 (proj: the fixture)
from tests.e2e.test_launch import cli_json, wait_until

OLD = time.time() - 30 * 86400


def fake_run(runs: Path, name: str, project: str, ended: bool = True) -> Path:
    """A run dir as a launch leaves it once its job ended a month ago (job.json, exit_code, a log, a checkpoint)."""
    run = runs / name
    (run / "checkpoints").mkdir(parents=True)
    (run / "job.json").write_text(json.dumps({"id": name, "session": name, "project": project}))
    (run / "checkpoints" / "step-1.pt").write_bytes(b"x" * 4096)
    (run / "train.log").write_text("[dflashctl] exit 0\n")
    if ended:
        (run / "exit_code").write_text("0\n")
    age(run)
    return run


def age(run: Path) -> None:
    for f in [run, *run.rglob("*")]:
        os.utime(f, (OLD, OLD), follow_symlinks=False)


@pytest.fixture
def ended(proj):  # noqa: F811
    """One real job that ran and ended (its pane dead, kept by remain-on-exit), aged a month: (id, run dir, project
    key)."""
    job_id = cli_json("launch", job_file(proj, "ended", "exit 0", "watch: {restart_on: [], supervise: false}\n"))["id"]
    run = run_dir_of(job_id)
    wait_until(lambda: (run / "exit_code").exists())
    age(run)
    return job_id, run, json.loads((run / "job.json").read_text())["project"]


@pytest.mark.parametrize("bad", ["nan", "inf", "-1", "-inf"])
def test_gc_refuses_a_number_that_is_not_finite_and_positive_and_touches_nothing(ended, bad):
    _, run, _ = ended
    res = run_cli("gc", "box", f"--older-than={bad}", "--yes")
    lines = res.stderr.strip().splitlines()
    assert res.code == 2 and len(lines) == 1 and "--older-than" in lines[0], res.stderr
    assert run.exists() and (run / "exit_code").exists()


def test_the_agent_refuses_garbage_numbers_itself(tmp_path):
    """The CLI checks; the agent checks again (JSON carries NaN, and another client may send it)."""
    run = fake_run(tmp_path / "runs", "j1", "p")
    for bad in (float("nan"), float("inf"), -1.0, "x", None):
        ans = collect.collect({"workdir": str(tmp_path), "older_than_s": bad, "project": "p"})
        assert ans["refused"].startswith("older_than_s") and ans["removed"] == [], (bad, ans)
    assert run.exists()


def test_a_disk_mounted_inside_an_old_run_dir_is_never_touched_and_is_named(ended):
    """A checkpoint volume mounted inside an old run dir: gc keeps that run dir whole and names the mount; the run
    dir beside it goes. Its removed job ids come back for the local registry."""
    job_id, run, project = ended
    held = fake_run(run.parent, "held-20250101-000000-aaaa", project)
    volume = held / "checkpoints" / "volume"
    with tmpfs(volume, "1m"):
        (volume / "precious.pt").write_bytes(b"weights")
        age(held)
        done = cli_json("gc", "box", "--older-than", "1", "--yes")
        assert (volume / "precious.pt").read_bytes() == b"weights"
        assert (held / "job.json").exists() and (held / "checkpoints" / "step-1.pt").exists()
        why = {k["id"]: k["why"] for k in done["kept"]}
        assert why[held.name].startswith("holds a mount point") and str(volume) in why[held.name], why
        assert done["removed_ids"] == [job_id] and not run.exists()
        res = run_cli("gc", "box", "--older-than", "1", "--yes")  # said in words too
        assert res.code == 0 and f"{held.name}: holds a mount point: {volume}" in res.stderr, res.stderr
    assert (held / "checkpoints" / "step-1.pt").exists()


def test_removal_stops_at_another_file_system_found_while_walking(tmp_path):
    """Past the mount table (a mount made after gc read it), the walk compares devices at every directory: the whole
    tree is looked at before anything goes, so nothing of the run dir is removed."""
    run = fake_run(tmp_path / "runs", "j1", "p")
    before = sorted(str(p) for p in run.rglob("*"))
    with tmpfs(run / "checkpoints" / "vol", "1m") as vol:
        (vol / "keep").write_text("k")
        with pytest.raises(collect.CrossesMount):
            collect.tree(str(run), remove=True)
        assert (vol / "keep").read_text() == "k"
    assert sorted(str(p) for p in run.rglob("*")) == sorted([*before, str(run / "checkpoints" / "vol")])


def test_a_link_inside_a_run_dir_is_removed_not_followed(tmp_path, ended):
    _, run, _ = ended
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "mine.txt").write_text("mine")
    (run / "link").symlink_to(outside)
    (run / "filelink").symlink_to(outside / "mine.txt")
    age(run)
    done = cli_json("gc", "box", "--older-than", "1", "--yes")
    assert done["removed_ids"] and not run.exists() and (outside / "mine.txt").read_text() == "mine"


def test_gc_takes_this_projects_runs_unless_all_projects_and_lists_them_first(ended):
    job_id, run, project = ended
    other = fake_run(run.parent, "other-20250101-000000-bbbb", "someone-elses-project")
    res = run_cli("gc", "box", "--older-than", "1")  # no terminal, no --yes: refused, nothing removed
    assert res.code == 2 and "--yes" in res.stderr and run.exists()
    dry = cli_json("gc", "box", "--older-than", "1", "--dry-run")
    assert [r["id"] for r in dry["removed"]] == [job_id] and dry["removed_ids"] == [] and run.exists()
    assert {k["id"]: k["why"] for k in dry["kept"]}[other.name].startswith("another project's")
    listed = run_cli("gc", "box", "--older-than", "1", "--dry-run")
    assert f"would remove {run}" in listed.stdout and other.name not in listed.stdout, listed.stdout
    done = cli_json("gc", "box", "--older-than", "1", "--yes")
    assert done["removed_ids"] == [job_id] and other.exists()
    every = cli_json("gc", "box", "--older-than", "1", "--yes", "--all-projects")
    assert every["removed_ids"] == [other.name] and not other.exists()


def test_a_dry_run_changes_nothing_not_even_a_dead_pane(ended):
    """The ended job's pane is dead and kept (remain-on-exit): a real gc closes it, a dry run leaves it."""
    job_id, run, _ = ended
    session = json.loads((run / "job.json").read_text())["session"]

    def has_session() -> bool:
        return (
            subprocess.run(
                ["tmux", "-L", TEST_TMUX_SOCKET, "has-session", "-t", f"={session}"], capture_output=True
            ).returncode
            == 0
        )

    assert has_session()
    before = sorted((p.name, p.stat().st_mtime_ns) for p in run.rglob("*"))
    cli_json("gc", "box", "--older-than", "1", "--dry-run")
    assert has_session() and sorted((p.name, p.stat().st_mtime_ns) for p in run.rglob("*")) == before
    cli_json("gc", "box", "--older-than", "1", "--yes")
    assert not has_session() and not run.exists()


def test_at_a_terminal_gc_lists_each_run_dir_before_asking(ended):
    """The prompt says which run dirs, not only how many: each is listed with its size; `n` keeps them all."""
    import pty
    import sys

    job_id, run, _ = ended

    def answer(text: bytes) -> subprocess.CompletedProcess:
        master, slave = pty.openpty()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "dflashctl", "gc", "box", "--older-than", "1"],
                stdin=slave,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            os.write(master, text)
            out, err = proc.communicate(timeout=120)
        finally:
            os.close(master)
            os.close(slave)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out.decode(), err.decode())

    no = answer(b"n\n")
    assert no.returncode == 1 and f"{run}  " in no.stderr and "remove the 1 run dir listed above" in no.stdout, no
    assert run.exists()
    yes = answer(b"y\n")
    assert yes.returncode == 0 and f"removed {run}" in yes.stdout and not run.exists(), yes
