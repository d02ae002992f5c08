"""`launch`'s options through the real CLI against the suite's sshd: `--env/--gpus/--name/--host` override the job file
(recorded in the run dir's snapshot, so a restart runs them; secrets masked in the dry run and in `status`; shell
characters carried as written), a bad value is one line naming the option with nothing run remotely, and a launch
from an edited tree deploys it first (every node of a job over several hosts), unless --no-sync."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.e2e.test_kill_watch_launch_under_faults import job_file, proj  # noqa: F401 - the fixture
from tests.e2e.test_launch import WORKER, cli_json, remote_tree, status_json, wait_until
from tests.e2e.test_launch_queue import free_gpu  # noqa: F401 - the fixture

NASTY = "$(touch PWNED); `touch PWNED2`; a'b\"c | rm -rf ~ &"


def test_overrides_reach_the_job_its_snapshot_and_its_restart_with_secrets_masked(proj, tmp_path, free_gpu):  # noqa: F811
    f = job_file(
        proj,
        "base",
        'echo "X=[$X] A=[$A] tok=$HF_TOKEN gpus=[$CUDA_VISIBLE_DEVICES]"; sleep 1; exit 1',
        "env: {A: from-file}\nwatch: {interval_s: 0.3, backoff_s: 0, max_restarts: 1}\n",
    )
    opts = ["--env", f"X={NASTY}", "--env", "HF_TOKEN=hf_cli_secret_42", "--name", "renamed", "--gpus", "0,"]
    before = remote_tree(tmp_path / "remote")
    dry = run_cli("launch", f, *opts, "--dry-run")
    dry_json = run_cli("launch", f, *opts, "--dry-run", "--json")
    assert dry.code == 0 and dry_json.code == 0, dry.stderr + dry_json.stderr
    shown = json.loads(dry_json.stdout)
    for out in (dry.stdout + dry.stderr, shown["files"]["job.env"]):
        assert "hf_cli_secret_42" not in out and "HF_TOKEN='***'" in out, out
    assert "hf_cli_secret_42" not in dry_json.stdout
    assert shown["id"].startswith("renamed-") and shown["gpus"] == [0]
    assert shown["overridden"] == {"name": "renamed", "gpus": [0], "env": {"X": NASTY, "HF_TOKEN": "***"}}
    snapshot = json.loads(shown["files"]["job.json"])
    assert snapshot["job"]["env"] == {"A": "from-file", "X": NASTY, "HF_TOKEN": "***"}
    assert snapshot["job"]["gpus"] == [0] and snapshot["overridden"] == shown["overridden"]
    assert "--name over the job file: renamed" in dry.stderr and "--env over the job file:" in dry.stderr
    assert remote_tree(tmp_path / "remote") == before and cli_json("ls") == {"jobs": []}  # a dry run changes nothing
    rep = cli_json("launch", f, *opts)
    job_id = rep["id"]
    assert job_id.startswith("renamed-") and rep["overridden"]["env"]["HF_TOKEN"] == "***"
    res = run_cli("watch", job_id, "--json", timeout=120)  # crashes, is restarted once, crashes again
    assert res.code == 10, res.stdout[-2000:]
    run = Path(rep["run_dir"])
    log = (run / "train.log").read_text()
    line = f"X=[{NASTY}] A=[from-file] tok=hf_cli_secret_42 gpus=[0]"
    assert log.count(line) == 2, log  # both attempts ran with the overrides, the value as written
    assert not list(tmp_path.rglob("PWNED*")), "a shell character in --env ran as a command"
    meta = json.loads((run / "job.json").read_text())
    assert meta["name"] == "renamed" and meta["overridden"]["env"]["HF_TOKEN"] == "***"
    assert "hf_cli_secret_42" not in (run / "job.json").read_text()
    st = run_cli("status", job_id, "--json")
    assert "hf_cli_secret_42" not in st.stdout and "tok=***" in st.stdout, st.stdout  # masked in the evidence
    assert "hf_cli_secret_42" not in run_cli("status", job_id).stdout


@pytest.mark.parametrize(
    "args, expect",
    [
        (("--env", "NOEQUALS"), "--env: expected KEY=VALUE"),
        (("--env", "1BAD=x"), "--env: '1BAD' is not an environment variable name"),
        (("--env", "A B=x"), "--env: 'A B' is not an environment variable name"),
        (("--env", "$(reboot)=x"), "--env: '$(reboot)' is not an environment variable name"),
        (("--gpus", "two"), "--gpus: 'two': expected a count"),
        (("--gpus", "0,0"), "--gpus: GPU indices must be distinct"),
        (("--gpus", "-3"), "--gpus: a GPU count must be from 0 to"),
        (("--name", "x;rm -rf ~"), "--name: may hold only"),
        (("--name", "$(reboot)"), "--name: may hold only"),
        (("--host", "boxx"), "--host: no host `boxx` in dflashctl.yaml, hosts.yaml or ~/.ssh/config: did you mean"),
        (("--host", "box;reboot"), "--host: expected a host name"),
        (("--no-sync", "--deploy"), "--no-sync: --deploy deploys"),
    ],
)
def test_bad_overrides_are_one_line_naming_the_option_and_run_nothing(proj, tmp_path, args, expect):  # noqa: F811
    f = job_file(proj, "victim", "sleep 300")
    before = remote_tree(tmp_path / "remote")
    res = run_cli("launch", f, *args)
    assert res.code == 2 and expect in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert remote_tree(tmp_path / "remote") == before and cli_json("ls") == {"jobs": []}


def test_launch_deploys_an_edited_tree_first_and_no_sync_refuses_it(proj, tmp_path):  # noqa: F811
    f = job_file(proj, "fresh", "cat marker.txt; sleep 300")
    (proj / "marker.txt").write_text("edited-1\n")
    before = remote_tree(tmp_path / "remote")
    res = run_cli("launch", f, "--no-sync")
    assert res.code == 2 and "deployed code is" in res.stderr and "--no-sync" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and remote_tree(tmp_path / "remote") == before
    dry = run_cli("launch", f, "--dry-run", "--json")
    shown = json.loads(dry.stdout)
    assert shown["deployed"][0]["dry_run"] and shown["deployed"][0]["sent"] == ["marker.txt"], shown["deployed"]
    assert remote_tree(tmp_path / "remote") == before
    res = run_cli("launch", f)
    assert res.code == 0, res.stderr
    assert "box: deployed code differed from the local tree: sent 1 files" in res.stderr and "marker.txt" in res.stderr
    job_id = res.stdout.split()[1]
    rel = status_json(job_id)["run_dir"]
    wait_until(lambda: "edited-1" in (Path(rel) / "train.log").read_text(), 30)
    assert cli_json("kill", job_id)["result"] == "KILLED"
    (proj / "marker.txt").write_text("edited-2\n")
    rep = cli_json("launch", f, "--deploy")  # the older flag: the same as the default now
    assert rep["deployed"][0]["sent"] == ["marker.txt"] and rep["release"] == rep["deployed"][0]["version"]
    wait_until(lambda: "edited-2" in (Path(rep["run_dir"]) / "train.log").read_text(), 30)
    assert cli_json("kill", rep["id"])["result"] == "KILLED"
    rep = cli_json("launch", f)  # nothing changed since: nothing sent
    assert rep["deployed"] == [] and cli_json("kill", rep["id"])["result"] == "KILLED"


def test_a_job_over_two_hosts_syncs_every_node(proj, tmp_path):  # noqa: F811
    (proj / "worker.py").write_text(WORKER + "\n# edited\n")
    f = job_file(proj, "pair", "echo node $NODE_RANK; sleep 300", "host: [box, boxpct]\n").replace("\nhost: box", "")
    path = Path(f)
    path.write_text(path.read_text().replace("host: box\n", "", 1))
    rep = cli_json("launch", str(path))
    assert sorted(d["host"] for d in rep["deployed"]) == ["box", "boxpct"], rep["deployed"]
    assert all(d["sent"] == ["worker.py"] for d in rep["deployed"] if d["host"] == "box")
    assert len({d["version"] for d in rep["deployed"]}) == 1 and rep["release"] == rep["deployed"][0]["version"]
    wait_until(lambda: all(n["state"] == "RUNNING" for n in status_json(rep["id"])["nodes"]), 60)
    assert cli_json("kill", rep["id"])["result"] == "KILLED"
