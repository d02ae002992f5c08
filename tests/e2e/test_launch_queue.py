"""`launch --queue` on a busy host, through the real CLI against the suite's sshd and tmux: a launch whose GPU another
job holds waits on the host (QUEUED in `status` and `ls`), two queued launches at once never take the same GPU and
leave the queue in the order they joined it, and a kill takes a queued job out before anything of it runs."""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path

import pytest

from dflashctl.agent import procs
from tests.conftest import FAKES, TEST_TMUX_SOCKET, run_cli
from tests.e2e.test_kill_watch_launch_under_faults import job_file, proj  # noqa: F401 - the fixture
from tests.e2e.test_launch import cli_json, status_json, wait_until

GPU0 = "gpus: [0]\n"


@pytest.fixture
def free_gpu(sshd):
    """The fake nvidia-smi shows GPU 0 with no process on it: only our own jobs hold it."""
    apps = sshd.dir / "nvidia-apps.csv"
    recorded = apps.read_text()
    apps.write_text("")
    # a queued pane reads the GPUs with the tmux server's environment, set by whichever test started this worker's
    # server (the Slurm tests' login sshd, with GPU processes recorded in its own fake): pointed at this sshd's fake
    env = {"PATH": f"{FAKES}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    env |= {"FAKE_NVIDIA_SMI_APPS": str(apps), "FAKE_NVIDIA_SMI_GPUS": str(sshd.dir / "nvidia-gpus.csv")}
    for k, v in env.items():  # no server yet: the first launch here starts it with this sshd's environment
        subprocess.run(["tmux", "-L", TEST_TMUX_SOCKET, "set-environment", "-g", k, v], capture_output=True)
    yield
    apps.write_text(recorded)


def started(run_dir: Path) -> bool:
    """run.sh began the job's command (its start line): a queued job never has one."""
    log = run_dir / "train.log"
    return log.exists() and any(
        ln.split()[2:3] == ["start"] for ln in log.read_text().splitlines() if ln.startswith("[dflashctl] ")
    )


def tagged(job_id: str) -> list[int]:
    return [p for p in procs.proc_table() if procs.has_job_tag(p, job_id)]


def test_queued_launches_wait_in_order_and_never_share_a_gpu(proj, free_gpu):  # noqa: F811
    holder = cli_json("launch", job_file(proj, "holder", "sleep 300", GPU0))["id"]
    res = run_cli("launch", job_file(proj, "eager", "sleep 300", GPU0))
    assert res.code == 2 and f"GPU 0 held by job {holder}" in res.stderr and "--queue waits" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    files = [job_file(proj, f"q{side}", "echo q-started; sleep 300", GPU0) for side in "ab"]
    dry = json.loads(run_cli("launch", files[0], "--queue", "--dry-run", "--json").stdout)  # says it would wait
    assert dry["queued"]["waiting_for"] == [f"GPU 0 held by job {holder}"] and dry["queued"]["ticket"] is None
    results: list = [None, None]

    def go(k: int) -> None:
        results[k] = run_cli("launch", files[k], "--queue", "--json")

    threads = [threading.Thread(target=go, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.code for r in results] == [0, 0], [r.stderr for r in results]
    queued = sorted((json.loads(r.stdout) for r in results), key=lambda rep: rep["queued"]["ticket"])
    first, second = queued
    assert [q["queued"]["position"] for q in queued] == [1, 2], queued
    assert f"GPU 0 held by job {holder}" in first["queued"]["waiting_for"]
    assert any(f"promised to job {first['id']}" in w for w in second["queued"]["waiting_for"]), second
    for rep in queued:  # its place shows in `status` and `ls`, and nothing of it runs
        st = status_json(rep["id"])
        assert st["state"] == "QUEUED" and st["queue"]["ticket"] == rep["queued"]["ticket"], st
        assert st["reason"].startswith(f"place {rep['queued']['position']} in the host's queue"), st["reason"]
        assert not started(Path(rep["run_dir"]))
    listed = {j["id"]: j for j in cli_json("ls")["jobs"]}
    assert listed[first["id"]]["state"] == "QUEUED" and listed[second["id"]]["state"] == "QUEUED"
    table = run_cli("ls").stdout
    assert "QUEUED: place 1" in table and "QUEUED: place 2" in table, table
    # a plain launch does not jump the queue: the GPU is promised to the first in it
    res = run_cli("launch", job_file(proj, "jumper", "sleep 300", GPU0))
    assert res.code == 2 and "queued before this launch" in res.stderr
    assert cli_json("kill", holder)["result"] == "KILLED"
    one, two = Path(first["run_dir"]), Path(second["run_dir"])
    wait_until(lambda: status_json(first["id"])["state"] == "RUNNING", 60)  # the first in line, and only it
    assert started(one) and "q-started" in (one / "train.log").read_text()
    assert status_json(second["id"])["state"] == "QUEUED" and not started(two)
    assert not (one / "queue.json").exists()
    st = status_json(second["id"])
    assert st["reason"].startswith("place 1") and f"GPU 0 held by job {first['id']}" in st["reason"], st
    assert cli_json("kill", first["id"])["result"] == "KILLED"
    wait_until(lambda: status_json(second["id"])["state"] == "RUNNING", 60)
    assert started(two)
    assert cli_json("kill", second["id"])["result"] == "KILLED"


def test_a_kill_takes_a_queued_job_out_before_anything_of_it_runs(proj, free_gpu):  # noqa: F811
    holder = cli_json("launch", job_file(proj, "holder2", "sleep 300", GPU0))["id"]
    waiting = cli_json("launch", job_file(proj, "waiter", "touch ran-anyway; sleep 300", GPU0), "--queue")
    behind = cli_json("launch", job_file(proj, "behind", "sleep 300", GPU0), "--queue")
    assert waiting["queued"]["position"] == 1 and behind["queued"]["position"] == 2
    killed = cli_json("kill", waiting["id"])
    assert killed["result"] == "KILLED" and killed["remaining"] == [] and killed["session_closed"], killed
    assert killed["dequeued"] is True, killed
    run = Path(waiting["run_dir"])
    assert status_json(waiting["id"])["state"] == "KILLED"
    assert not (run / "queue.json").exists() and not started(run) and not (run / "wrapper.pid").exists()
    assert [j["state"] for j in cli_json("ls")["jobs"] if j["id"] == waiting["id"]] == ["KILLED"]
    # the one behind it moves up, and the kill's job never starts when the GPU frees
    wait_until(lambda: status_json(behind["id"])["reason"].startswith("place 1"), 30)
    assert cli_json("kill", holder)["result"] == "KILLED"
    wait_until(lambda: status_json(behind["id"])["state"] == "RUNNING", 60)
    assert not started(run) and not list(run.parent.parent.glob("releases/*/ran-anyway"))
    assert tagged(waiting["id"]) == []
    assert cli_json("kill", behind["id"])["result"] == "KILLED"


def test_a_running_job_that_writes_itself_a_ticket_still_holds_its_gpu(proj, free_gpu):  # noqa: F811
    """The job can write its run dir: a ticket it forges (first in line, still waiting) neither makes it QUEUED nor
    lets a queued launch behind it take its GPU."""
    forged = json.dumps(
        {"ticket": 0, "state": "waiting", "gpus": [0], "session": "x", "position": 1, "waiting_for": ["nothing"]}
    )
    forger = cli_json("launch", job_file(proj, "forger", f"echo '{forged}' > \"$RUN/queue.json\"; sleep 300", GPU0))
    wait_until(lambda: (Path(forger["run_dir"]) / "queue.json").exists(), 30)
    assert status_json(forger["id"])["state"] == "RUNNING"
    later = cli_json("launch", job_file(proj, "later", "sleep 300", GPU0), "--queue")
    assert later["queued"]["waiting_for"] == [f"GPU 0 held by job {forger['id']}"], later["queued"]
    for _ in range(3):  # its pane looks about once a second: it keeps waiting
        wait_until(lambda: status_json(later["id"])["state"] == "QUEUED", 10)
    assert not started(Path(later["run_dir"]))
    for job in (later, forger):
        assert cli_json("kill", job["id"])["result"] == "KILLED"


@pytest.mark.parametrize(
    "args, expect",
    [
        (("--queue", "--force"), "--queue: --force launches on held GPUs at once"),
        (("--queue", "--host", "box,boxpct"), "--queue: a job over several hosts cannot wait"),
    ],
)
def test_queue_options_that_cannot_hold_are_one_line_exit_2(proj, args, expect):  # noqa: F811
    res = run_cli("launch", job_file(proj, "qbad", "sleep 300", GPU0), *args)
    assert res.code == 2 and expect in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert cli_json("ls") == {"jobs": []}
