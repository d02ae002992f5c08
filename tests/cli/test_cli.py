"""The command line as users of Typer/click tools expect: usage errors, --json, ids and prefixes, attach, completion."""

from __future__ import annotations

import json
import os
import time

import pytest

from dflashctl.jobs import registry
from dflashctl.model.record import JobRecord
from tests.conftest import run_cli


@pytest.mark.parametrize(
    "args, expect",
    [
        (["statuss"], "No such command 'statuss'"),
        (["launch"], "Missing argument"),
        (["ls", "--colour"], "No such option"),
    ],
)
def test_usage_errors_are_one_line_exit_2(args, expect):
    res = run_cli(*args)
    lines = res.stderr.strip().splitlines()
    assert res.code == 2 and len(lines) == 1 and expect in lines[0] and "internal error" not in res.stderr, lines


def test_errors_under_json_are_also_an_object_on_stdout(client):
    res = run_cli("status", "nope", "--json")
    assert res.code == 2 and json.loads(res.stdout) == {
        "error": res.stderr.strip().removeprefix("dflashctl: error: "),
        "exit": 2,
    }


def test_help_reads_well():
    res = run_cli("kill", "--help")
    assert res.code == 0 and "--json" in res.stdout
    assert not [ln for ln in res.stdout.splitlines() if "--json" in ln and "<bool>" in ln]


def record(client, job_id: str, state: str = "RUNNING", project: str | None = None) -> None:
    registry.record(
        JobRecord(
            id=job_id,
            name=job_id.rsplit("-", 2)[0],
            project=project or str(client.project),
            job_file="/x.yaml",
            host_name="testbox",
            host={"name": "testbox", "ssh": "testbox"},
            release="r1",
            command="sleep 1",
            run_dir=f"/tmp/runs/{job_id}",
            session=job_id,
            launched_at=time.time(),
            state=state,
        )
    )


def test_ls_json_is_an_object_and_prefixes_must_be_unique(client, monkeypatch):
    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(client.home / "state"))
    record(client, "exp-20261130T100000Z-aaaa")
    record(client, "exp-20261130T100001Z-bbbb")
    listed = json.loads(run_cli("ls", "--json").stdout)
    assert [j["id"] for j in listed["jobs"]] == ["exp-20261130T100001Z-bbbb", "exp-20261130T100000Z-aaaa"]
    assert set(listed["jobs"][0]) >= {"id", "host", "state", "checked_at", "run_dir"}
    res = run_cli("attach", "exp-2026", "--dry-run")
    assert res.code == 2 and "prefix of 2 jobs" in res.stderr and "exp-20261130T100000Z-aaaa" in res.stderr
    res = run_cli("attach", "exp-20261130T100000", "--dry-run")
    assert res.code == 0 and res.stdout.split()[:2] == ["ssh", "-t"]
    # the ssh config every other command reads (here $HOME's, which differs from the passwd home): an alias works
    assert f"-F {client.home / '.ssh' / 'config'}" in res.stdout, res.stdout
    assert "attach -t =exp-20261130T100000Z-aaaa -r" in res.stdout


def test_ls_from_another_project_points_at_all_projects(client, monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(client.home / "state"))
    record(client, "other-20261130T100000Z-cccc", project="/somewhere/else")
    res = run_cli("ls")
    assert res.code == 0 and "--all-projects" in res.stderr
    assert "other-20261130T100000Z-cccc" in run_cli("ls", "--all-projects").stdout


def test_kill_of_a_finished_job_is_a_no_op(client, monkeypatch):
    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(client.home / "state"))
    record(client, "done-20261130T100000Z-dddd", state="FINISHED")
    res = run_cli("kill", "done-20261130T100000Z-dddd", "--json")
    assert res.code == 0 and "already FINISHED" in res.stderr and json.loads(res.stdout)["exit"] == 0
    assert registry.get("done-20261130T100000Z-dddd").state == "FINISHED"


def test_completion_offers_job_ids_and_hosts(client, monkeypatch):
    from dflashctl.cli import complete_hosts as _complete_hosts
    from dflashctl.cli import complete_jobs as _complete_jobs

    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(client.home / "state"))
    record(client, "exp-20261130T100000Z-aaaa")
    client.write_hosts("hosts:\n  gpu-box: {ssh: testbox}\n")
    assert _complete_jobs("exp") == ["exp-20261130T100000Z-aaaa"]
    assert set(_complete_hosts("")) >= {"local", "gpu-box"}


def test_records_of_the_previous_version_still_read(client, monkeypatch):
    """A jobs.json written before releases (`code_version`, no `release`) is read, not refused as corrupt."""
    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(client.home / "state"))
    old = {
        "old-20261129T100000Z": {
            "id": "old-20261129T100000Z",
            "name": "old",
            "project": str(client.project),
            "job_file": "/x.yaml",
            "host_name": "local",
            "host": {"name": "local"},
            "code_version": "abc123",
            "command": "sleep 1",
            "run_dir": "/tmp/r",
            "session": "old-20261129T100000Z",
            "pane_pid": 1,
            "gpus": [],
            "launched_at": 1.0,
            "state": "FINISHED",
            "restarts": 0,
            "kill_grace_s": 40.0,
            "is_trainer": False,
            "overrides": [],
            "watch": {"interval_s": 60.0, "startup_budget_s": 3600.0},
            "tmux_socket": "dflashctl",
            "steps": None,
        }
    }
    (client.home / "state").mkdir(parents=True)
    (client.home / "state" / "jobs.json").write_text(json.dumps(old))
    listed = json.loads(run_cli("ls", "--json").stdout)["jobs"]
    assert [j["id"] for j in listed] == ["old-20261129T100000Z"]
    assert registry.get("old-20261129T100000Z").release == "abc123"


def test_one_rule_for_the_job_you_mean_and_a_crash_is_never_relabelled(client, monkeypatch):
    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(client.home / "state"))
    record(client, "crashy-20261130T100000Z-aaaa", state="CRASHED")
    record(client, "fine-20261130T110000Z-bbbb", state="FINISHED")
    for cmd in (["attach", "--dry-run"], ["report", "--json"]):  # nothing alive: the newest job of all
        res = run_cli(*cmd)
        assert "crashy" not in res.stdout + res.stderr, (cmd, res.stdout, res.stderr)
    res = run_cli("attach", "--dry-run")
    assert "=fine-20261130T110000Z-bbbb" in res.stdout
    res = run_cli("kill")  # nothing alive: nothing killed, said so, exit 0
    assert res.code == 0 and "nothing to kill" in res.stdout + res.stderr
    assert registry.get("crashy-20261130T100000Z-aaaa").state == "CRASHED"
    record(client, "live-20261130T090000Z-cccc", state="RUNNING")  # older, but alive: it comes first
    assert "=live-20261130T090000Z-cccc" in run_cli("attach", "--dry-run").stdout
    record(client, "stuck-20261130T080000Z-dddd", state="KILL_FAILED")  # a failed kill before anything else
    assert "=stuck-20261130T080000Z-dddd" in run_cli("attach", "--dry-run").stdout


def test_ls_fits_80_columns_and_is_one_plain_line_per_job_in_a_pipe(client, monkeypatch, tmp_path):
    import subprocess
    import sys

    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(client.home / "state"))
    for i, state in enumerate(("FINISHED", "CRASHED", "RUNNING")):
        record(client, f"a-rather-long-job-name-20261130T10000{i}Z-aaa{i}", state=state)
    piped = run_cli("ls")
    lines = piped.stdout.splitlines()
    assert piped.code == 0 and len(lines) == 3 and all(len(x.split("\t")) == 8 for x in lines), piped.stdout
    assert lines[0].split("\t")[:3] == ["a-rather-long-job-name-20261130T100002Z-aaa2", "testbox", "RUNNING"]
    sock, done = f"ls-{tmp_path.name}", tmp_path / "done"
    tmux = ["tmux", "-L", sock]
    subprocess.run(
        [
            *tmux,
            "new-session",
            "-d",
            "-x",
            "80",
            "-y",
            "30",
            "-s",
            "l",
            "-c",
            str(client.project),
            "-e",
            f"HOME={client.home}",
            "-e",
            f"DFLASHCTL_STATE_DIR={client.home / 'state'}",
            f"{sys.executable} -m dflashctl ls; echo $? > {done}; sleep 60",
        ],
        check=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        screen = subprocess.run([*tmux, "capture-pane", "-p", "-t", "l"], capture_output=True, text=True).stdout
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
    assert done.read_text().strip() == "0", screen
    assert max(len(x.rstrip()) for x in screen.splitlines()) <= 80, screen
    for word in ("FINISHED", "CRASHED", "RUNNING", "a-rather-long-job-name-20261130T100002Z-aaa2"):
        assert word in screen, screen  # cells whole, never wrapped mid-word
    assert "--wide shows them" in screen


def test_help_starts_without_the_rich_parts_it_never_draws():
    """`--help` and `ls` pay for no Markdown parser and no traceback renderer (fast start: a stand-in, with no file,
    holds their place); code that does ask for them still gets the real classes."""
    import subprocess
    import sys

    never = "('markdown_it', 'rich.traceback', 'pygments')"
    code = (
        "import sys; from dflashctl.cli import main; main(['--help']); "
        f"print(sorted(m for m in {never} if hasattr(sys.modules.get(m), '__file__')), "
        "file=sys.stderr)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "Usage: dflashctl" in proc.stdout and proc.stderr.strip().splitlines()[-1] == "[]", proc.stderr
    code = (
        "import io; import dflashctl.cli; from rich.markdown import Markdown; "
        "from rich.traceback import Traceback; from rich.console import Console; "
        "c = Console(file=io.StringIO(), width=40); m = Markdown('# Title'); c.print(m); "
        "print(type(m).__module__, type(m).__name__, 'Title' in c.file.getvalue(), "
        "Traceback.from_exception.__qualname__)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["rich.markdown", "Markdown", "True", "Traceback.from_exception"], proc.stderr


def test_ls_starts_without_scanning_installed_distributions_for_pydantic_plugins(tmp_path):
    """Pydantic's plugin loader imports importlib.metadata and scans every distribution's entry points; dflashctl's
    models use no plugin, so `ls` loads neither, and validates its records all the same. Where the real loader was
    imported first (a program using dflashctl as a library), it is kept, with its scan skipped."""
    import subprocess
    import sys

    env = {**os.environ, "DFLASHCTL_STATE_DIR": str(tmp_path / "state")}
    code = (
        "import sys; from dflashctl.cli import main\n"
        "try: main(['ls', '--json'])\nexcept SystemExit: pass\n"
        "from dflashctl.config import HostConfig\n"
        "print('importlib.metadata' in sys.modules, HostConfig(python='py3').python, file=sys.stderr)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.stdout.strip() == '{"jobs":[]}' and proc.stderr.split() == ["False", "py3"], proc.stderr
    code = (
        "import sys; from pydantic.plugin import _loader; import dflashctl.config as c\n"
        "print(sys.modules['pydantic.plugin._loader'] is _loader, _loader._plugins, c.HostConfig().python)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.stdout.split() == ["True", "{}", "python3"], proc.stderr
    code = (
        "import dflashctl.config\nfrom pydantic.plugin._loader import PYDANTIC_ENTRY_POINT_GROUP, get_plugins\n"
        "print(PYDANTIC_ENTRY_POINT_GROUP, list(get_plugins()))"
    )  # a name the stand-in lacks: the real loader
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.stdout.split() == ["pydantic", "[]"], proc.stderr


def test_a_prefix_means_this_projects_jobs_first(client, monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(client.home / "state"))
    record(client, "exp-20261130T100000Z-aaaa", project=str(tmp_path / "other-project"))
    record(client, "exp-20261130T100001Z-bbbb")
    res = run_cli("attach", "exp-2026", "--dry-run")  # one match here: the other project's is not offered
    assert res.code == 0 and "=exp-20261130T100001Z-bbbb" in res.stdout, res
    res = run_cli("attach", "exp-20261130T100000", "--dry-run")  # only elsewhere: found there
    assert res.code == 0 and "=exp-20261130T100000Z-aaaa" in res.stdout


def test_ls_filters_by_state_host_and_name(client, monkeypatch):
    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(client.home / "state"))
    record(client, "alpha-20261130T100000Z-aaaa", state="CRASHED")
    record(client, "beta-20261130T100001Z-bbbb", state="RUNNING")
    record(client, "alpine-20261130T100002Z-cccc", state="DIVERGED")

    def ids(*args: str) -> list[str]:
        res = run_cli("ls", "--json", *args)
        assert res.code == 0, res.stderr
        return [j["id"].split("-")[0] for j in json.loads(res.stdout)["jobs"]]

    assert ids("--state", "running") == ["beta"]
    assert ids("--state", "failed") == ["alpine", "alpha"]  # every failure state
    assert ids("--state", "crashed", "--state", "diverged") == ["alpine", "alpha"]
    assert ids("--name", "al*") == ["alpine", "alpha"] and ids("--host", "testbox", "--name", "b*") == ["beta"]
    res = run_cli("ls", "--host", "elsewhere")  # no host of that name: an error, not an empty list
    assert res.code == 2 and "--host" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    res = run_cli("ls", "--state", "sleepy")
    assert res.code == 2 and "--state" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_the_command_reference_is_generated_from_the_cli_and_current():
    from pathlib import Path

    from dflashctl.reference import render

    page = Path(__file__).resolve().parents[2] / "docs" / "commands.md"
    assert page.read_text() == render(), "docs/commands.md is stale: run `make docs`"
    for command in ("deploy", "launch", "watch", "status", "kill", "export", "exec", "shell", "gc", "diagnose"):
        assert f"## `dflashctl {command} " in page.read_text(), command


def test_every_commands_help_reads_well_at_80_columns():
    """No type placeholders (`<str>`, `<int range>`, `[1<=x<=1024]`, `<bool>`), no lower-case `{host}`, and every
    exit code in watch's help."""
    import os
    import subprocess
    import sys

    from dflashctl.reference import render

    commands = [ln.split()[2].strip("`") for ln in render().splitlines() if ln.startswith("## `dflashctl ")]
    assert len(commands) >= 17 and "exec" in commands
    env = {**os.environ, "COLUMNS": "80"}
    for command in commands:
        out = subprocess.run(
            [sys.executable, "-m", "dflashctl", command, "--help"], capture_output=True, text=True, env=env, timeout=60
        ).stdout
        for bad in ("<str>", "<int", "<path>", "<bool>", "<float", "<=x<=", "{host}", "{job"):
            assert bad not in out, (command, bad)
    watch = subprocess.run(
        [sys.executable, "-m", "dflashctl", "watch", "--help"], capture_output=True, text=True, env=env, timeout=60
    ).stdout
    for code in ("22 DIVERGED", "25 DISK_FULL", "29 CANCELLED"):
        assert code in " ".join(watch.split()), code


def test_the_plain_watch_line_says_each_thing_once():
    from dflashctl.jobs.watch import PollRecord
    from dflashctl.judge.report import Report
    from dflashctl.show.view import line

    base = dict(id="j", host="h", time=1.0, since=0.0, epoch=0, loss=2.0)
    running = PollRecord(
        Report(
            **base,
            state="RUNNING",
            reason="step 391, 19,147 tok/s, loss 4.6456",
            evidence=["x"],
            step=391,
            tokens_per_s=19147.0,
        ),
        1,
    )
    text = line(running)
    assert text.count("391") == 1 and text.count("tok/s") == 1, text
    done = PollRecord(
        Report(
            **base,
            state="FINISHED",
            reason="exit 0 at step 1000",
            evidence=["exit_code 0, step 1000"],
            step=1000,
            tokens_per_s=6717.0,
        ),
        1,
    )
    text = line(done)
    assert text.count("1000") == 1 and "tok/s" not in text, text
