"""A Slurm job whose work dir holds a quote (and a space) runs, writes its output and is judged as it ran, never
LOST: the identity check (name, user, work dir) reads the work dir the way Slurm prints it (`scontrol show job -o`
prints a path with its spaces and quotes as they are). The suite's one-machine Slurm, its sshd as the login node."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from dflashctl.agent import slurm
from tests.conftest import run_cli
from tests.e2e.test_slurm import ROOT, cluster, login, wait_for, write_job  # noqa: F401 - the module's cluster fixtures


@pytest.fixture(params=["it's", "it's shared"])
def quoted_site(request, tmp_path, monkeypatch, login, cluster):  # noqa: F811
    """A client whose host `cluster` has its workdir under a folder named with a quote (and a space)."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "known_hosts").write_text(f"[127.0.0.1]:{login.port} {login.host_pubkey}\n")
    (home / ".ssh" / "config").write_text(
        f"Host login\n  HostName 127.0.0.1\n  Port {login.port}\n  User root\n  IdentityFile {login.user_key}\n"
    )
    workdir = tmp_path / request.param
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(
        "hosts:\n  cluster:\n    slurm: {login: login, partition: debug, time: '10:00'}\n"
        f"    python: {sys.executable}\n    workdir: {json.dumps(str(workdir))}\n"
    )
    for key, value in {
        "HOME": str(home),
        "DFLASHCTL_HOSTS": str(hosts),
        "DFLASHCTL_STATE_DIR": str(tmp_path / "state"),
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    monkeypatch.chdir(ROOT)
    res = run_cli("deploy", "cluster", cwd=ROOT)
    assert res.code == 0, res.stderr
    cluster.resume_if_drained()
    return tmp_path


def test_a_job_whose_work_dir_holds_a_quote_and_a_space_is_judged_as_it_ran(quoted_site, cluster):  # noqa: F811
    res = run_cli("launch", str(write_job(quoted_site, "quoted", command="echo ran here; sleep 1")), "--json", cwd=ROOT)
    assert res.code == 0, res.stderr
    job_id = json.loads(res.stdout)["id"]

    def state() -> str:
        return json.loads(run_cli("status", job_id, "--json", cwd=ROOT).stdout)["state"]

    wait_for(lambda: state() == "FINISHED", 120, "the job to finish")
    run = Path(json.loads(run_cli("status", job_id, "--json", cwd=ROOT).stdout)["run_dir"])
    assert "'" in str(run) and "ran here" in (run / "train.log").read_text()


def test_scontrols_one_line_form_is_read_with_spaces_and_quotes_in_its_paths():
    line = (
        "JobId=7 JobName=quoted-1 UserId=root(0) JobState=COMPLETED Reason=None ExitCode=0:0 "
        "Command=/w/it's here/runs/q\"1/sbatch.sh WorkDir=/w/it's here/runs/q\"1 "
        "StdErr=/w/it's here/runs/q\"1/slurm-7.out StdIn=/dev/null Power= "
    )
    info = slurm.parse_scontrol(line)
    assert info["workdir"] == "/w/it's here/runs/q\"1" and info["name"] == "quoted-1" and info["state"] == "COMPLETED"
    assert info["uid"] == 0 and info["exit"] == "0:0"
