"""`dflashctl pull` over the real ssh transport: default selection, a transfer killed halfway and resumed, a damaged
partial file, what the run does not have, and names the remote must not be trusted with."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflashctl.jobs import registry
from tests.cli.test_cli import record
from tests.conftest import run_cli, tmpfs

JOB = "exp-20261201T100000Z-aaaa"


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def run(client, monkeypatch, tmp_path) -> Path:
    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(client.home / "state"))
    run = tmp_path / "remote" / "run"
    (run / "export").mkdir(parents=True)
    (run / "export" / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
    (run / "export" / "model.safetensors").write_bytes(os.urandom(3 << 20))
    (run / "export" / "leak").symlink_to("/etc/hostname")  # a link out of the run dir is never followed
    for step, mib in ((5, 1), (10, 12)):
        d = run / "checkpoints" / f"step-{step:08d}"
        d.mkdir(parents=True)
        (d / "drafter.safetensors").write_bytes(os.urandom(mib << 20))
        (d / "manifest.json").write_text("{}")
    (run / "checkpoints" / "step-00000015.tmp").mkdir()  # an interrupted save: never chosen
    (run / "metrics.jsonl").write_text('{"time": 1, "step": 1}\n')
    record(client, JOB, state="FINISHED")
    registry.update(JOB, run_dir=str(run))
    return run


def pull(*args: str):
    return run_cli("pull", JOB, "--json", *args, timeout=300)


def test_default_is_the_export_and_a_second_pull_fetches_nothing(run, client):
    res = pull()
    assert res.code == 0, res.stderr
    got = json.loads(res.stdout)
    dest = client.project / "pulled" / JOB
    assert got["chose"] == ["export"] and sorted(f["path"] for f in got["files"]) == [
        "export/config.json",
        "export/model.safetensors",
    ]
    for name in ("config.json", "model.safetensors"):
        assert sha(dest / "export" / name) == sha(run / "export" / name)
    assert not (dest / "export" / "leak").exists() and not list(dest.rglob("*.part"))
    assert oct(dest.stat().st_mode & 0o777) == "0o700"
    again = json.loads(pull().stdout)
    assert again["bytes_fetched"] == 0 and all(f["skipped"] for f in again["files"])


def test_a_killed_transfer_resumes_and_ends_hash_equal(run, client):
    target = client.project / "pulled" / JOB / "checkpoints" / "step-00000010" / "drafter.safetensors"
    part = target.with_name(target.name + ".part")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflashctl", "pull", JOB, "--checkpoint", "latest", "--chunk-mib", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (part.exists() and part.stat().st_size >= 2 << 20):
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not target.exists(), "a partial file never carries the final name"
    have = part.stat().st_size
    assert have < 12 << 20
    res = pull("--checkpoint", "latest", "--chunk-mib", "4")
    assert res.code == 0, res.stderr
    f = next(x for x in json.loads(res.stdout)["files"] if x["path"].endswith("drafter.safetensors"))
    assert f["resumed_from"] == have and f["fetched"] == (12 << 20) - have
    assert sha(target) == sha(run / "checkpoints" / "step-00000010" / "drafter.safetensors") and not part.exists()


def test_a_damaged_partial_file_is_fetched_again(run, client):
    target = client.project / "pulled" / JOB / "export" / "model.safetensors"
    target.parent.mkdir(parents=True)
    target.with_name("model.safetensors.part").write_bytes(b"\0" * 4096)  # not the remote's first bytes
    res = pull("--export")
    assert res.code == 0, res.stderr
    assert sha(target) == sha(run / "export" / "model.safetensors")


@pytest.mark.parametrize(
    "args, expect",
    [
        (["--checkpoint", "7"], "no checkpoint 7: there are 5, 10"),
        (["--checkpoint", "soon"], "--checkpoint"),
        (["--export"], "no export yet"),
    ],
)
def test_what_the_run_lacks_is_one_line_exit_2(run, client, args, expect):
    if args == ["--export"]:
        for f in (run / "export").iterdir():
            f.unlink()
        (run / "export").rmdir()
    res = run_cli("pull", JOB, *args)
    assert res.code == 2 and len(res.stderr.strip().splitlines()) == 1 and expect in res.stderr
    assert not (client.project / "pulled").exists() or not list((client.project / "pulled").rglob("*.part"))


def test_metrics_come_back_as_the_run_dir_has_them(run, client):
    res = pull("--metrics")
    assert res.code == 0, res.stderr
    assert (client.project / "pulled" / JOB / "metrics.jsonl").read_text() == '{"time": 1, "step": 1}\n'


def test_two_pulls_into_one_folder_never_corrupt_a_file(run, client):
    target = client.project / "pulled" / JOB / "checkpoints" / "step-00000010" / "drafter.safetensors"
    part = target.with_name(target.name + ".part")
    first = subprocess.Popen(
        [sys.executable, "-m", "dflashctl", "pull", JOB, "--checkpoint", "latest", "--chunk-mib", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (part.exists() and part.stat().st_size >= 1 << 20):
        time.sleep(0.02)
    second = pull("--checkpoint", "latest")  # while the first one writes
    assert second.code == 2 and "another pull into" in second.stderr and "in progress" in second.stderr
    assert len(second.stderr.strip().splitlines()) == 1 and "Traceback" not in second.stderr
    assert first.wait(120) == 0, first.stderr.read()
    assert sha(target) == sha(run / "checkpoints" / "step-00000010" / "drafter.safetensors")
    assert not part.exists()


def test_a_pulled_job_json_has_its_secrets_redacted(run, client):
    (run / "job.json").write_text(
        json.dumps(
            {
                "id": JOB,
                "job": {
                    "env": {"HF_TOKEN": "hf_SECRETSECRET", "LR": "3e-4", "MY_PRIVATE": "p4ss"},
                    "secret_env": ["MY_PRIVATE"],
                    "watch": {"notify": {"webhook": "https://hooks.slack.com/services/T0/B0/XYZSECRET"}},
                },
            }
        )
    )
    os.chmod(run / "job.json", 0o600)
    res = pull("--metrics")
    assert res.code == 0, res.stderr
    text = (client.project / "pulled" / JOB / "job.json").read_text()
    assert "hf_SECRETSECRET" not in text and "p4ss" not in text and "XYZSECRET" not in text
    job = json.loads(text)["job"]
    assert job["env"] == {"HF_TOKEN": "***", "LR": "3e-4", "MY_PRIVATE": "***"}
    assert job["watch"]["notify"]["webhook"] == "https://hooks.slack.com/***"
    assert oct((client.project / "pulled" / JOB / "job.json").stat().st_mode & 0o777) == "0o600"


def git_state(project: Path) -> dict[str, bytes]:
    """The files of the user's git that a pull must leave as they were."""
    files = [project / ".gitignore", *(project / ".git").glob("info/*"), project / ".git" / "config"]
    return {str(f): f.read_bytes() for f in files if f.is_file()}


def test_what_pull_and_report_write_is_never_deployed_or_stale(run, client):
    from dflashctl.remote.sync import list_files

    subprocess.run(["git", "init", "-q", str(client.project)], check=True)
    (client.project / "train.py").write_text("print('code')\n")
    (client.project / ".gitignore").write_text("*.log\n")
    before, git_before = list_files(client.project), git_state(client.project)
    assert pull().code == 0
    assert git_state(client.project) == git_before  # the user's .gitignore and .git/info/exclude untouched
    assert list_files(client.project) == before == [".gitignore", "train.py"]  # so `launch` finds no stale code
    status = subprocess.run(["git", "status", "--porcelain"], cwd=client.project, capture_output=True, text=True)
    assert status.stdout.split() == ["??", ".gitignore", "??", "train.py"], status.stdout  # the pull is not there
    assert (client.project / "pulled" / JOB / ".gitignore").read_text().splitlines()[-1] == "*"
    # `--to mylib`: only the job's own folder is dflashctl's; the user's new source in mylib is still code
    (client.project / "mylib").mkdir()
    (client.project / "mylib" / "util.py").write_text("x = 1\n")
    assert pull("--to", "mylib").code == 0
    assert list_files(client.project) == [".gitignore", "mylib/util.py", "train.py"]
    assert git_state(client.project) == git_before and not (client.project / ".dflashctl-outputs").exists()


def test_outside_a_git_checkout_the_pull_is_listed_as_dflashctls_output(run, client):
    """No git to ignore it: deploy leaves the pulled run out by dflashctl's own list; `report --out` files too."""
    from dflashctl import outputs
    from dflashctl.remote.sync import list_files

    (client.project / "train.py").write_text("print('code')\n")
    assert pull().code == 0
    (client.project / "r.html").write_text("<html>")  # as `report --out r.html` leaves it
    assert outputs.remember(client.project, client.project / "r.html")
    assert list_files(client.project) == ["train.py"] and not (client.project / ".git").exists()
    assert f"pulled/{JOB}" in (client.project / ".dflashctl-outputs").read_text()


def test_pull_to_a_file_and_into_a_full_disk_are_one_line_errors(run, client, tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    res = run_cli("pull", JOB, "--to", str(a_file))
    assert res.code == 2 and "exists and is not a folder" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    with tmpfs(tmp_path / "full", "1m") as mnt:
        res = run_cli("pull", JOB, "--to", str(mnt))  # a 3 MiB export into 1 MiB
        assert res.code == 1 and "the disk is full at" in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1 and "sha256" not in res.stderr


def test_export_is_pull_export(run, client):
    res = run_cli("export", JOB, "--json", timeout=300)
    assert res.code == 0, res.stderr
    got = json.loads(res.stdout)
    assert got["chose"] == ["export"] and all(f["path"].startswith("export/") for f in got["files"])


def test_a_report_file_in_a_git_checkout_is_never_deployed_and_leaves_the_users_git_alone(client):
    """`report --out r.png` inside a git checkout: dflashctl's list of its own outputs lives in git's folder, so the
    user's .gitignore and .git/info/exclude stay byte-equal and deploy still leaves the file out."""
    from dflashctl import outputs
    from dflashctl.remote.sync import list_files

    subprocess.run(["git", "init", "-q", str(client.project)], check=True)
    (client.project / "train.py").write_text("print('code')\n")
    before = git_state(client.project)
    (client.project / "r.png").write_bytes(b"\x89PNG")
    assert outputs.remember(client.project, client.project / "r.png")
    assert git_state(client.project) == before and not (client.project / ".dflashctl-outputs").exists()
    assert list_files(client.project) == ["train.py"]
    assert "r.png" in (client.project / ".git" / "dflashctl-outputs").read_text()
