"""Slurm without a cluster: what the scheduler's recorded answers parse to, how the judge ranks Slurm's ends against
what the log shows, the batch script a launch submits, and the config errors caught before anything runs remotely.

The `scontrol` lines in tests/fixtures/slurm/ were recorded from the suite's one-machine Slurm 22.05 cluster.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from dflashctl.agent import slurm
from dflashctl.config import HostConfig
from dflashctl.judge.assess import History, Thresholds, assess
from dflashctl.model.jobfile import JobConfig
from dflashctl.remote import session
from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "slurm"
NCCL_TAIL = [
    "[rank1]:[E1201 10:00:00.000000000 ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective operation "
    "timeout: WorkNCCL(SeqNum=120, OpType=ALLREDUCE) ran for 600000 milliseconds before timing out.",
]
SIGTERM_TAIL = [
    "Traceback (most recent call last):",
    '  File "/code/trainer/train.py", line 40, in <module>',
    "torch.distributed.elastic.multiprocessing.api.SignalException: Process 4242 got signal: 15",
    "slurmstepd: error: *** JOB 7 ON vm CANCELLED AT 2026-12-01T19:30:00 DUE TO TIME LIMIT ***",
]


def recorded(name: str) -> dict:
    return slurm.parse_scontrol((FIXTURES / name).read_text())


def history(state: str, lines: list[str] | None = None, exit_code: int | None = None, **extra) -> History:
    h = History(started_at=100.0, now=200.0, last_step=40, log_tail=lines or [], exit_code=exit_code)
    h.scheduler = {"id": "7", "state": state, "reason": "None", "nodes": "vm", **extra}
    h.session_exists, h.pane_dead = True, state not in ("PENDING", "RUNNING")
    return h


TH = Thresholds(600.0, 3600.0, 120.0, None, 0.3, 3)


def test_recorded_scontrol_answers_parse_to_state_reason_and_exit():
    pending = recorded("scontrol-pending-drained.txt")
    assert pending["state"] == "PENDING" and pending["reason"].startswith("Nodes required for job are DOWN, DRAINED")
    failed = recorded("scontrol-failed.txt")
    assert (failed["state"], failed["reason"], failed["exit"], failed["nodes"]) == (
        "FAILED",
        "NonZeroExitCode",
        "3:0",
        "vm",
    )
    running = recorded("scontrol-running.txt")
    assert running["state"] == "RUNNING" and running["start"].startswith("2026-")


def test_sacct_lines_parse_with_a_cancelling_user_and_a_signal():
    """sacct -P's `State` reads `CANCELLED by UID`; an ExitCode of 0:15 is a SIGTERM (128 + 15)."""
    got = slurm.parse_sacct("CANCELLED by 1000|None|0:15|gpu[01-02]|2026-12-01T10:00:00|01:00:00\n")
    assert got["state"] == "CANCELLED" and got["nodes"] == "gpu[01-02]" and got["time_limit"] == "01:00:00"
    assert slurm.parse_sacct("") is None


@pytest.mark.parametrize(
    ("state", "lines", "verdict", "words"),
    [
        ("TIMEOUT", SIGTERM_TAIL, "TIMEOUT", "out of wall time"),  # not CRASHED on the SIGTERM traceback
        ("DEADLINE", [], "TIMEOUT", "out of wall time"),
        ("NODE_FAIL", NCCL_TAIL, "NODE_FAIL", "excludes"),  # the root cause over the other ranks' NCCL timeouts
        ("BOOT_FAIL", [], "NODE_FAIL", "node failed"),
        ("PREEMPTED", SIGTERM_TAIL, "PREEMPTED", "preempted"),
        ("OUT_OF_MEMORY", ["Killed"], "HOST_OOM", "OUT_OF_MEMORY"),
        ("CANCELLED", SIGTERM_TAIL, "CANCELLED", "outside dflashctl"),
    ],
)
def test_slurms_own_ends_outrank_the_log(state, lines, verdict, words):
    v = assess(history(state, lines, time_limit="00:01:00"), TH)
    assert v.state == verdict and words in v.reason, v
    assert v.evidence[0].startswith(f"slurm job 7 {state}")


def test_failed_and_completed_are_judged_from_the_exit_code_and_the_log():
    crash = ["Traceback (most recent call last):", "RuntimeError: injected fault at step 15"]
    assert assess(history("FAILED", crash, exit_code=1), TH).state == "CRASHED"
    assert assess(history("FAILED", [], exit_code=2), TH).state == "CONFIG_ERROR"  # the trainer's exit 2
    done = history("COMPLETED", [], exit_code=0)
    done.finished = True
    assert assess(done, TH).state == "FINISHED"
    killed = history("FAILED", [], exit_code=None)  # the batch script itself was killed: Slurm's exit status
    killed.pane_status = 137
    assert assess(killed, TH).state == "HOST_OOM"


@pytest.mark.parametrize("state", ["RUNNING", "COMPLETING"])
def test_a_command_ended_while_slurm_still_says_it_runs_waits_for_slurms_word(state):
    """A preemption with GraceTime, the time limit or a scancel signal the job before Slurm's state says why, and a
    probe can read the scheduler just before the exit: the SIGTERM's exit 143 is not CRASHED (nor restarted as one)
    while Slurm has not spoken; its next word settles it. A command that ended by itself long ago is judged."""
    h = history(state, SIGTERM_TAIL[:3], exit_code=143)
    h.pane_dead, h.exit_time = False, h.now - 2
    v = assess(h, TH)
    assert v.state == "RUNNING" and "waiting for Slurm's word" in v.reason, v
    assert v.evidence == ["exit_code 143 written 2 s ago", f"slurm job 7 still {state}"]
    h.scheduler["state"] = "PREEMPTED"
    assert assess(h, TH).state == "PREEMPTED"
    h.scheduler["state"], h.exit_time = state, h.now - 31  # Slurm never said otherwise: the files judge
    assert assess(h, TH).state == "CRASHED"


def test_the_probe_asks_slurm_again_once_it_has_read_an_exit(tmp_path, monkeypatch):
    """The probe reads the scheduler, then the run dir: a preemption between the two shows a RUNNING job with an
    exit code. Slurm sets PREEMPTED before the signal that ends the command, so the probe asks again after reading
    the exit, and the snapshot carries the scheduler's word on the end (recorded answers: RUNNING, then PREEMPTED)."""
    from dflashctl.agent import snapshot

    bin_dir, run = tmp_path / "bin", tmp_path / "run"
    bin_dir.mkdir(), run.mkdir()
    (run / "slurm_job").write_text("1\n")
    (run / "exit_code").write_text("143\n")
    answers = [FIXTURES / "scontrol-running.txt", FIXTURES / "scontrol-preempted.txt"]
    here = f"sed 's#WorkDir=[^ ]*#WorkDir={run}#'"  # recorded elsewhere: the job's work dir is this run dir
    (bin_dir / "scontrol").write_text(  # the first call answers RUNNING, every later one PREEMPTED
        f"#!/bin/sh\nif [ -e {tmp_path}/asked ]; then {here} {answers[1]}\n"
        f"else touch {tmp_path}/asked; {here} {answers[0]}; fi\n"
    )
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    snap = snapshot.snapshot({"run_dir": str(run), "scheduler": "slurm", "gpus": False, "capture_lines": 0})
    assert snap["exit_code"] == 143 and snap["session"]["slurm"]["state"] == "PREEMPTED"
    assert snap["session"]["pane_dead"] and snap["session"]["exit_status"] == 143


def test_pending_names_slurms_reason_and_a_gone_job_is_lost():
    h = history("PENDING", reason="Priority")
    v = assess(h, TH)
    assert v.state == "PENDING" and v.reason == "pending in Slurm's queue: Priority"
    assert v.evidence == ["slurm job 7 PENDING on vm (Priority)"]
    gone = history("UNKNOWN")
    gone.session_exists = False
    v = assess(gone, TH)
    assert v.state == "LOST" and "Slurm job is gone" in v.reason


def test_a_stop_request_outranks_slurms_cancelled():
    """Our own kill's CANCELLED is the kill's: STOPPING, then KILLED, never CANCELLED or a restart."""
    h = history("CANCELLED")
    h.stop_request = {"time": 150.0}
    assert assess(h, TH).state == "STOPPING"
    h.stop_result = {"result": "KILLED", "gpu_check": "slurm job 7: CANCELLED"}
    assert assess(h, TH).state == "KILLED"


def cluster_host(**slurm_cfg) -> HostConfig:
    return HostConfig.model_validate(
        {"name": "cluster", "slurm": {"login": "login-node", **slurm_cfg}, "workdir": "/shared/me"}
    )


def test_the_batch_script_asks_for_nodes_gpus_and_the_hosts_options():
    cluster = cluster_host(partition="gpu", account="lab", time="24:00:00", extra=["--qos=high"])
    job = JobConfig.model_validate(
        {
            "name": "big",
            "host": "cluster",
            "gpus": 8,
            "trainer": {},
            "env": {"HF_TOKEN": "hf_secret"},
            "slurm": {"nodes": 4, "time": "2:00:00", "extra": ["--exclusive"]},
        }
    )
    files = session.run_files(
        job, "big-1", "python3", {"steps": 10}, "abc", cluster=cluster.slurm, run_dir="/w/runs/big-1"
    )
    assert "run.sh" not in files and "tmux.conf" not in files and json.loads(files["job.json"])["scheduler"] == "slurm"
    script = files["sbatch.sh"]
    header = [ln for ln in script.splitlines() if ln.startswith("#SBATCH")]
    assert header == [
        "#SBATCH --job-name=big-1",
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --output=slurm-%j.out",
        "#SBATCH --open-mode=append",
        "#SBATCH --no-requeue",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --cpus-per-task=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=lab",
        "#SBATCH --time=2:00:00",
        "#SBATCH --qos=high",
        "#SBATCH --exclusive",
    ]
    assert "CUDA_VISIBLE_DEVICES" not in script  # Slurm gives each node its GPUs
    assert "scontrol show hostnames" in script and "srun --nodes" in script
    assert '--nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID"' in files["command.sh"]
    assert "--nproc-per-node 8" in files["command.sh"]
    # the secret is in job.env (0600 in the run dir), never in the script Slurm copies into its spool; shown: ***
    assert "hf_secret" not in script and 'load_env "$RUN/job.env"' in script and "hf_secret" in files["job.env"]
    shown = session.run_files(
        job, "big-1", "python3", {"steps": 10}, "abc", redact=True, cluster=cluster.slurm, run_dir="/w/runs/big-1"
    )
    assert "hf_secret" not in shown["job.env"] and "HF_TOKEN='***'" in shown["job.env"]


@pytest.mark.parametrize(
    ("hosts", "job", "key"),
    [
        (
            "hosts:\n  cluster: {slurm: {login: testbox, time: soon}}\n",
            "host: cluster\ncommand: 'true'\n",
            "hosts.cluster.slurm.time",
        ),
        (
            "hosts:\n  cluster: {slurm: {login: testbox, extra: ['-p gpu']}}\n",
            "host: cluster\ncommand: 'true'\n",
            "hosts.cluster.slurm.extra",
        ),
        ("hosts:\n  box: {ssh: testbox}\n", "host: box\ncommand: 'true'\nslurm: {nodes: 2}\n", "slurm"),
        (
            "hosts:\n  cluster: {slurm: {login: testbox}}\n  box: {ssh: testbox}\n",
            "host: [cluster, box]\ncommand: 'true'\n",
            "hosts",
        ),
        (
            "hosts:\n  cluster: {slurm: {login: testbox}}\n",
            "host: cluster\ncommand: 'true'\nslurm: {nodes: 0}\n",
            "slurm.nodes",
        ),
        (
            "hosts:\n  cluster: {slurm: {login: testbox}}\n",
            "host: cluster\ncommand: 'true'\nslurm: {nodes: true}\n",
            "slurm.nodes",
        ),  # a bool is not a count
        (
            "hosts:\n  cluster: {slurm: {login: testbox, partition: low}}\n",
            "host: cluster\ncommand: 'true'\nslurm: {extra: ['--comment=x --partition=high']}\n",
            "slurm.extra",
        ),
        (
            "hosts:\n  cluster: {slurm: {login: testbox, partition: low}}\n",
            "host: cluster\ncommand: 'true'\nslurm: {extra: ['--partition=high']}\n",
            "--partition is set by the host",
        ),
        (
            "hosts:\n  cluster: {slurm: {login: 'bad host!'}}\n",
            "host: cluster\ncommand: 'true'\n",
            "hosts.cluster.slurm.login",
        ),  # the key the file has, not `ssh`
        ("hosts:\n  cluster: {slurm: {login: testbox}}\n", "host: cluster\ncommand: 'true'\ngpus: true\n", "gpus"),
    ],
)
def test_bad_slurm_settings_are_one_line_errors_with_exit_2_before_any_remote_call(tmp_path, hosts, job, key):
    hosts_file = tmp_path / "hosts.yaml"
    hosts_file.write_text(hosts)
    job_file = tmp_path / "j.yaml"
    job_file.write_text("name: j\n" + job)
    env = {"DFLASHCTL_HOSTS": str(hosts_file), "HOME": str(tmp_path), "DFLASHCTL_STATE_DIR": str(tmp_path / "s")}
    res = run_cli("launch", str(job_file), cwd=ROOT, env=env)
    assert res.code == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert key in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "s" / "jobs.json").exists() or "j-" not in (tmp_path / "s" / "jobs.json").read_text()


def test_the_agent_refuses_a_slurm_launch_without_the_schedulers_commands(tmp_path, monkeypatch):
    """A login node without sbatch: refused as a config problem of `host.slurm`, nothing created."""
    from dflashctl.agent import starting

    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch, scontrol, scancel here
    req = {
        "action": "launch",
        "workdir": str(tmp_path / "wd"),
        "job_id": "j-1",
        "name": "j",
        "session": "j-1",
        "gpus": [],
        "release": "abc",
        "python": sys.executable,
        "scheduler": "slurm",
        "needs": {},
    }
    ans = starting.launch(req, b"{}")
    assert ans["config"] and ans["key"] == "host.slurm" and "sbatch is not on the login node's PATH" in ans["refused"]
    assert not (tmp_path / "wd").exists()


def test_tunnel_to_a_slurm_job_is_refused_in_one_line(tmp_path, monkeypatch):
    """Its ports are on a compute node behind the login node: said, exit 2, no ssh started."""
    from dflashctl.jobs import registry
    from dflashctl.model.record import JobRecord

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(tmp_path / "s"))
    registry.record(
        JobRecord(
            id="j-20261201T100000Z-aaaa",
            name="j",
            project=str(ROOT),
            job_file="/j.yaml",
            host_name="cluster",
            host=cluster_host(),
            release="abc",
            command="true",
            run_dir="/shared/me/runs/j",
            session="j",
            launched_at=1.0,
            state="RUNNING",
            slurm_job="7",
        )
    )
    res = run_cli("tunnel", "j-20261201T100000Z-aaaa", "6006", cwd=ROOT)
    assert res.code == 2 and "Slurm cluster" in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_a_reused_id_is_foreign_and_never_cancelled(tmp_path, monkeypatch):
    """Recorded `scontrol show job` of a job that is not the run dir's (another name, another work dir): the probe
    reports it FOREIGN, the judge says LOST, and cancel never runs scancel on it."""
    from dflashctl.agent import slurm, snapshot

    bin_dir, run = tmp_path / "bin", tmp_path / "run"
    bin_dir.mkdir(), run.mkdir()
    (run / "slurm_job").write_text("3\n")
    (run / "job.json").write_text(json.dumps({"id": "mine-20261204T000000Z-abcd"}))
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\ncat {FIXTURES / 'scontrol-running.txt'}\n")
    (bin_dir / "scancel").write_text(f"#!/bin/sh\ntouch {tmp_path}/scancelled\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    snap = snapshot.snapshot({"run_dir": str(run), "scheduler": "slurm", "gpus": False, "capture_lines": 0})
    said = snap["session"]["slurm"]
    assert said["state"] == "FOREIGN" and "name 'j.sh'" in said["reason"] and "work dir /tmp/rec" in said["reason"]
    h = History(started_at=0.0, now=10.0, session_exists=False, scheduler=said)
    v = assess(h, TH)
    assert v.state == "LOST" and "another job" in v.reason
    q = slurm.cancel("3", 5, str(run))
    assert q["known"] is False and "foreign" in q and not (tmp_path / "scancelled").exists()
