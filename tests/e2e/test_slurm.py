"""Slurm clusters end to end: a real one-machine Slurm (munged, slurmctld, slurmd), the suite's sshd as its login node,
the tiny CPU trainer under sbatch, and dflashctl's launch, status, watch, restarts and kill through the scheduler.

Where the daemons cannot start here, every test of this module skips and says why (tests/slurm_cluster.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import _leftovers, run_cli, start_sshd
from tests.e2e.test_watch import TRAINER, states  # the same tiny trainer and state sequence as the tmux watch tests
from tests.slurm_cluster import ClusterUnavailable, start_cluster

ROOT = Path(__file__).resolve().parents[2]
WATCH = "watch:\n  interval_s: 1\n  backoff_s: 0.5\n  slow_polls: 1000\n"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        c = start_cluster(tmp_path_factory.mktemp("slurm"))
    except ClusterUnavailable as e:
        pytest.skip(f"no Slurm test cluster on this machine: {e}")
    yield c
    c.stop()


@pytest.fixture(scope="module")
def login(tmp_path_factory, cluster):
    """The cluster's login node: an sshd whose sessions know the cluster (SLURM_CONF, as /etc/slurm would)."""
    server = start_sshd(tmp_path_factory.mktemp("login"), extra_env=cluster.env)
    yield server
    server.stop(drop_sessions=True)


def walltime_output(walltime: dict) -> str:
    """The background watch's output, read once, when it has ended (a test that only needs the nodes free waits
    for it too)."""
    if walltime["out"] is None:
        walltime["out"], _ = walltime["proc"].communicate(timeout=400)
    return walltime["out"]


def client_env(d: Path, login) -> dict[str, str]:
    """A client of its own under `d`: a home whose ssh config names the login node `login`, a hosts file whose
    `cluster` is the Slurm cluster behind it (workdir `d/shared`), a registry of its own."""
    home = d / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "known_hosts").write_text(f"[127.0.0.1]:{login.port} {login.host_pubkey}\n")
    (home / ".ssh" / "config").write_text(
        f"Host login\n  HostName 127.0.0.1\n  Port {login.port}\n  User root\n  IdentityFile {login.user_key}\n"
    )
    hosts = d / "hosts.yaml"
    hosts.write_text(
        "hosts:\n  cluster:\n    slurm: {login: login, partition: debug, time: '10:00'}\n"
        f"    python: {sys.executable}\n    workdir: {d / 'shared'}\n"
    )
    return {"HOME": str(home), "DFLASHCTL_HOSTS": str(hosts), "DFLASHCTL_STATE_DIR": str(d / "state")}


@pytest.fixture
def site(tmp_path, monkeypatch, login, cluster):
    """A client whose host `cluster` is the Slurm cluster behind `login`, with this repo deployed to its workdir."""
    for key, value in client_env(tmp_path, login).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    monkeypatch.chdir(ROOT)
    assert run_cli("deploy", "cluster", cwd=ROOT).code == 0
    cluster.resume_if_drained()
    return tmp_path


@pytest.fixture(scope="module", autouse=True)
def walltime(tmp_path_factory, login, cluster):
    """Launched before the module's first test and checked near its end: a job with a 1-minute wall time, watched
    in the background by `watch --until-done`, so that the minute Slurm takes to end it overlaps the other tests.
    It has a client (and registry) of its own; only the node failure test, which would end it too, runs after it."""
    d = tmp_path_factory.mktemp("walltime")
    env = client_env(d, login)
    assert run_cli("deploy", "cluster", cwd=ROOT, env=env).code == 0
    command = 'if [ -s "$RUN/restarts" ]; then echo second attempt done; else echo first; sleep 600; fi'
    res = run_cli(
        "launch",
        str(write_job(d, "walltime", command=command, extra="slurm: {time: '1'}\n")),
        "--json",
        cwd=ROOT,
        env=env,
    )
    assert res.code == 0, res.stderr
    rep = json.loads(res.stdout)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflashctl", "watch", rep["id"], "--until-done", "--json"],
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        text=True,
    )
    yield {"rep": rep, "proc": proc, "out": None}
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def write_job(
    d: Path,
    name: str,
    *,
    steps: int | None = None,
    command: str | None = None,
    env: dict | None = None,
    extra: str = "",
    watch: str = "",
    nproc: int = 1,
) -> Path:
    body = f"name: {name}\nhost: cluster\nkill_grace_s: 5\n" + (f"env: {json.dumps(env)}\n" if env else "")
    if command is not None:
        body += f"command: {json.dumps(command)}\n"
    else:
        body += f"nproc_per_node: {nproc}\ntrainer:" + TRAINER.replace("STEPS", str(steps))
    path = d / f"{name}.yaml"
    path.write_text(body + extra + WATCH + watch)
    return path


def launch(job: Path) -> dict:
    res = run_cli("launch", str(job), "--json", cwd=ROOT)
    assert res.code == 0, res.stderr
    return json.loads(res.stdout)


def status(job_id: str) -> dict:
    res = run_cli("status", job_id, "--json", cwd=ROOT)
    assert res.stdout, res.stderr
    return json.loads(res.stdout)


def watch(job_id: str, *extra: str, timeout: float = 400) -> tuple[int, list[dict]]:
    res = run_cli("watch", job_id, "--json", *extra, cwd=ROOT, timeout=timeout)
    return res.code, [json.loads(line) for line in res.stdout.splitlines()]


def verdicts(records: list[dict], run: Path) -> tuple[list[dict], list[dict]]:
    """Every verdict said of the job and every restart decided, by the watch (its records) and by the job's
    supervisor on the login node (the run dir's events.jsonl): on a loaded machine either can see an end first and
    resubmit it, and the other then never sees that state."""
    path = run / "events.jsonl"
    sup = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    said = [*records, *(e for e in sup if e.get("decision") == "state")]
    restarts = [e for r in records for e in r["events"] if e["decision"] == "restart"]
    return said, restarts + [e for e in sup if e.get("decision") == "restart"]


def slurm_state(cluster, job: str) -> str:
    line = cluster.scontrol("show", "job", "-o", job)
    return next(f.split("=", 1)[1] for f in line.split() if f.startswith("JobState="))


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(1.0)  # each look is a `dflashctl status`: a CLI start, an ssh call, the agent
    raise AssertionError(f"timed out waiting for {what}")


def test_pending_while_drained_then_runs_on_two_nodes_to_finished_in_the_same_run_dir_layout(site, cluster):
    """Drained nodes: PENDING with Slurm's reason (not STARTING), in `status` and `ls`; resumed, the trainer runs on
    both nodes (one srun task each, a torchrun per node, the rendezvous at the first) to FINISHED, with the run dir a
    tmux job would have."""
    cluster.drain("maintenance")
    try:
        rep = launch(write_job(site, "queued", steps=12, extra="slurm: {nodes: 2}\n"))
        assert rep["slurm_job"] and rep["slurm_job"].isdigit()
        st = wait_for(lambda: (s := status(rep["id"]))["state"] == "PENDING" and s, 120, "PENDING")
        assert st["reason"].startswith("pending in Slurm's queue: "), st
        assert any(why in st["reason"] for why in ("ReqNodeNotAvail", "Resources", "DRAINED")), st
        assert any(f"slurm job {rep['slurm_job']} PENDING" in e for e in st["evidence"])
        ls = json.loads(run_cli("ls", "--json", cwd=ROOT).stdout)["jobs"]
        mine = [j for j in ls if j["id"] == rep["id"]]
        assert [(j["state"], j["slurm_job"]) for j in mine] == [("PENDING", rep["slurm_job"])]
        assert mine[0]["reason"] == st["reason"]
        table = run_cli("ls", cwd=ROOT).stdout  # a pipe: tab-separated, the state with Slurm's reason
        assert f"PENDING: {st['reason'].split(': ', 1)[1]}" in table
    finally:
        cluster.resume()
    code, records = watch(rep["id"], "--until-done")
    assert code == 0 and states(records)[-1] == "FINISHED", states(records)
    assert all(r["gpus"] == [] for r in records)  # the login node's GPUs (its nvidia-smi has some) are not the job's
    run = Path(rep["run_dir"])
    assert {"sbatch.sh", "command.sh", "job.json", "trainer.yaml", "metrics.jsonl", "train.log"} <= {
        p.name for p in run.iterdir()
    }
    assert (run / "exit_code").read_text().strip() == "0"
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in steps if "step" in r and "event" not in r) == 12
    assert [r["world_size"] for r in steps if r.get("event") == "start"] == [2]  # one rank on each node
    log = (run / "train.log").read_text()
    assert f"start slurm job {rep['slurm_job']} on n[1-2]" in log and "--nnodes" in (run / "command.sh").read_text()
    assert oct(run.stat().st_mode & 0o777) == "0o700" and oct((run / "sbatch.sh").stat().st_mode & 0o777) == "0o600"
    assert slurm_state(cluster, rep["slurm_job"]) == "COMPLETED"


def test_a_crash_is_resubmitted_with_resume_by_one_of_two_watchers(site, cluster):
    """A crash at step 15: two watchers see it; exactly one resubmits (sbatch once more, --resume), and the run
    continues from its step-10 checkpoint to FINISHED."""
    rep = launch(write_job(site, "crashy", steps=24, env={"TRAINER_FAULT": "crash@15"}, watch="  max_restarts: 1\n"))
    results: list = [None, None]

    def one(i: int) -> None:
        results[i] = watch(rep["id"], "--until-done")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    for code, records in results:
        assert code == 0 and states(records)[-1] == "FINISHED", states(records)
    run = Path(rep["run_dir"])
    watched = [e for _, recs in results for r in recs for e in r["events"] if e["decision"] == "restart"]
    restarts = watched + verdicts([], run)[1]  # the supervisor may have been first: then the watches saw it done
    # a restart made by a decider (the supervisor or one watch) follows the crash; a watch that saw it made
    # elsewhere repeats the decider's recorded cause, even when its polls never saw the crash
    made = [e for e in restarts if not str(e.get("by", "")).startswith("elsewhere")]
    assert made and all(e["after"] == "CRASHED" and e["attempt"] == 1 for e in restarts), restarts
    assert len([e for e in watched if e.get("by") == "watch"]) <= 1  # the others saw it done (or the supervisor did)
    assert (run / "restarts").read_text().strip() == "1"
    starts = [ln for ln in (run / "train.log").read_text().splitlines() if "] " in ln and " start slurm job " in ln]
    assert len(starts) == 2 and re.search(rf"start slurm job {rep['slurm_job']} on n[12] $", starts[0]), starts
    assert starts[1].endswith(" --resume"), starts
    second = (run / "slurm_job").read_text().strip()
    assert second != rep["slurm_job"] and slurm_state(cluster, second) == "COMPLETED"
    starts = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"start"' in x]
    assert [s.get("resumed_from") for s in starts] == [None, 10]


def test_kill_is_scancel_verified_by_the_scheduler(site, cluster):
    rep = launch(write_job(site, "sleeper", command="sleep 300"))
    wait_for(lambda: status(rep["id"])["state"] == "RUNNING", 120, "RUNNING")
    attach = run_cli("attach", rep["id"], "--dry-run", cwd=ROOT).stdout  # no pane: the log, followed read-only
    assert attach.startswith("ssh -t") and f"tail -n 100 -F {rep['run_dir']}/train.log" in attach, attach
    assert "sattach" in run_cli("attach", rep["id"], "--write", "--dry-run", cwd=ROOT).stdout
    res = run_cli("kill", rep["id"], "--json", cwd=ROOT)
    report = json.loads(res.stdout)
    assert res.code == 0 and report["result"] == "KILLED", report
    assert f"slurm job {rep['slurm_job']}: CANCELLED" in report["gpu_check"]
    assert slurm_state(cluster, rep["slurm_job"]) == "CANCELLED"
    squeue = subprocess.run(
        ["squeue", "-h", "-j", rep["slurm_job"]],
        env={**os.environ, **cluster.env},
        capture_output=True,
        text=True,
        check=True,
    )
    assert squeue.stdout.strip() == ""  # not even COMPLETING: nothing of it left on the node
    assert not _leftovers((rep["id"],))  # no process carries the job's tag
    assert status(rep["id"])["state"] == "KILLED"
    code, records = watch(rep["id"], "--once")
    assert records[-1]["state"] == "KILLED" and records[-1]["restarts"] == 0  # never restarted after our kill


def test_cancelled_by_someone_else_is_said_and_not_restarted(site, cluster):
    rep = launch(write_job(site, "cancelled", command="sleep 300"))
    wait_for(lambda: status(rep["id"])["state"] == "RUNNING", 120, "RUNNING")
    subprocess.run(["scancel", rep["slurm_job"]], env={**os.environ, **cluster.env}, check=True)
    wait_for(lambda: slurm_state(cluster, rep["slurm_job"]) == "CANCELLED", 120, "CANCELLED")
    code, records = watch(rep["id"], "--until-done")
    assert code == 29 and records[-1]["state"] == "CANCELLED" and records[-1]["restarts"] == 0
    assert "outside dflashctl" in records[-1]["reason"]


def test_a_reused_slurm_id_is_never_trusted_nor_cancelled(site, cluster, tmp_path):
    """The controller lost its state and the run dir's id now names a stranger's job: LOST with the evidence, and a
    kill cancels nothing of the stranger's."""
    rep = launch(write_job(site, "reused", command="sleep 300"))
    wait_for(lambda: status(rep["id"])["state"] == "RUNNING", 120, "RUNNING")
    env = {**os.environ, **cluster.env}
    other = tmp_path / "elsewhere"
    other.mkdir()
    sub = subprocess.run(
        ["sbatch", "--parsable", "--job-name=stranger", "--wrap", "sleep 300"],
        cwd=other,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    stranger = sub.stdout.strip().split(";")[0]
    run = Path(rep["run_dir"])
    try:
        (run / "slurm_job").write_text(f"{stranger}\n")
        st = status(rep["id"])
        assert st["state"] == "LOST" and "another job" in st["reason"], st
        assert any("name 'stranger'" in e for e in st["evidence"]), st["evidence"]
        run_cli("kill", rep["id"], "--json", cwd=ROOT)
        assert slurm_state(cluster, stranger) in ("PENDING", "RUNNING"), "the stranger's job was cancelled"
    finally:
        subprocess.run(["scancel", stranger, rep["slurm_job"]], env=env, check=False)


def test_dry_run_prints_the_batch_script_and_sbatch_judges_it(site, cluster):
    job = write_job(site, "dry", steps=5, extra="gpus: 0\nslurm: {nodes: 1, extra: ['--comment=drafter']}\n")
    res = run_cli("launch", str(job), "--dry-run", cwd=ROOT)
    assert res.code == 0, res.stderr
    for line in (
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --partition=debug",
        "#SBATCH --time=10:00",
        "#SBATCH --comment=drafter",
        "srun --nodes",
    ):
        assert line in res.stdout, line
    assert "remote: " in res.stdout and "sbatch" in res.stdout
    runs = site / "shared" / "runs"
    assert not runs.exists() or not list(runs.iterdir())  # nothing submitted, nothing written
    # a partition the cluster does not have: sbatch --test-only says so, exit 2, nothing submitted
    hosts = Path(os.environ["DFLASHCTL_HOSTS"])
    hosts.write_text(hosts.read_text().replace("partition: debug", "partition: nosuch"))
    res = run_cli("launch", str(job), "--dry-run", cwd=ROOT)
    assert res.code == 2 and "host.slurm" in res.stderr and "partition" in res.stderr.lower(), res.stderr
    res = run_cli("launch", str(job), cwd=ROOT)
    assert res.code == 2 and "sbatch refused the job" in res.stderr, res.stderr
    assert not runs.exists() or not list(runs.iterdir())  # the refused launch left no run dir


def test_doctor_checks_the_cluster(site, cluster):
    res = run_cli("doctor", "cluster", "--json", cwd=ROOT, timeout=200)
    report = json.loads(res.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert res.code == 0 and report["ok"], report
    for name in ("slurm tools", "partition", "compute node"):
        assert checks[name]["status"] == "ok", checks[name]
    assert "torch" in checks["compute node"]["detail"] and "sees the workdir" in checks["compute node"]["detail"]
    job = write_job(site, "doc", command="true")  # a job file on the cluster: the cluster's checks too
    res = run_cli("doctor", str(job), "--json", cwd=ROOT, timeout=200)
    assert res.code == 0 and "slurm tools" in {c["name"] for c in json.loads(res.stdout)["checks"]}, res.stdout


def test_out_of_wall_time_is_timeout_then_resubmitted(walltime, cluster):
    """A 1-minute wall time (launched by the fixture before the first test): Slurm ends the job TIMEOUT (not CRASHED,
    whatever its log says); the restart resubmits it, and the second submission finishes."""
    rep, records = walltime["rep"], [json.loads(line) for line in walltime_output(walltime).splitlines()]
    seen = states(records)
    assert walltime["proc"].returncode == 0 and seen[-1] == "FINISHED", seen
    said, _ = verdicts(records, Path(rep["run_dir"]))
    timeout = next((r for r in said if r["state"] == "TIMEOUT"), None)
    assert timeout, said
    assert "out of wall time" in timeout["reason"] and f"slurm job {rep['slurm_job']} TIMEOUT" in timeout["evidence"][0]
    assert slurm_state(cluster, rep["slurm_job"]) == "TIMEOUT"
    assert "second attempt done" in (Path(rep["run_dir"]) / "train.log").read_text()


def test_a_node_failure_is_node_fail_and_the_resubmission_excludes_the_node(site, cluster):
    """The job's node goes DOWN under it: NODE_FAIL naming the node (Slurm does not requeue it: --no-requeue); the
    restart resubmits with --exclude of that node, the second submission runs on the other node and finishes."""
    command = 'if [ -s "$RUN/restarts" ]; then echo "resubmitted to $SLURMD_NODENAME"; else sleep 300; fi'
    rep = launch(write_job(site, "nodefail", command=command, watch="  max_restarts: 2\n"))
    wait_for(lambda: status(rep["id"])["state"] == "RUNNING", 120, "RUNNING")
    first = re.search(r"\bNodeList=(\S+)", cluster.scontrol("show", "job", "-o", rep["slurm_job"]))[1]
    other = next(n for n in cluster.nodes if n != first)
    try:
        cluster.scontrol("update", f"NodeName={first}", "State=DOWN", "Reason=tests")
        wait_for(lambda: slurm_state(cluster, rep["slurm_job"]) == "NODE_FAIL", 120, "NODE_FAIL")
        code, records = watch(rep["id"], "--until-done")
    finally:
        cluster.resume_if_drained()
    seen = states(records)
    assert code == 0 and seen[-1] == "FINISHED", seen
    run = Path(rep["run_dir"])
    said, _ = verdicts(records, run)
    failed = next((r for r in said if r["state"] == "NODE_FAIL"), None)
    assert failed and f"on {first}" in failed["reason"] and "excludes" in failed["reason"], said
    assert json.loads((run / "slurm_exclude").read_text()) == [first]
    second = (run / "slurm_job").read_text().strip()
    info = cluster.scontrol("show", "job", "-o", second)
    assert f"ExcNodeList={first}" in info and f"NodeList={other}" in info
    assert slurm_state(cluster, second) == "COMPLETED"
    assert f"resubmitted to {other}" in (run / "train.log").read_text()


def test_preempted_is_resubmitted_and_runs_once_the_nodes_are_free(site, cluster, walltime):
    """A job of a higher-priority partition takes both nodes: ours ends PREEMPTED (not CANCELLED, not CRASHED), is
    resubmitted with --resume, waits PENDING while the other job runs, then finishes."""
    walltime_output(walltime)  # whole nodes are asked for: the wall-time job must be done with its CPU
    command = 'if [ -s "$RUN/restarts" ]; then echo "after the preemption"; else sleep 300; fi'
    rep = launch(write_job(site, "preemptible", command=command, extra="slurm: {nodes: 2, extra: [--exclusive]}\n"))
    wait_for(lambda: status(rep["id"])["state"] == "RUNNING", 120, "RUNNING")
    env = {**os.environ, **cluster.env}
    subprocess.run(
        ["sbatch", "-p", "high", "-N", "2", "--exclusive", "-o", "/dev/null", "--wrap", "sleep 4"],
        env=env,
        check=True,
        capture_output=True,
    )
    code, records = watch(rep["id"], "--until-done")
    seen = states(records)
    assert code == 0 and seen[-1] == "FINISHED", seen
    said, restarts = verdicts(records, Path(rep["run_dir"]))
    assert "PREEMPTED" in [r["state"] for r in said], said
    assert slurm_state(cluster, rep["slurm_job"]) == "PREEMPTED"
    assert any(e["after"] == "PREEMPTED" for e in restarts), restarts
    assert "after the preemption" in (Path(rep["run_dir"]) / "train.log").read_text()


def test_a_silent_controller_keeps_the_state_and_a_kill_meanwhile_fails_honestly(site, cluster):
    """slurmctld stops: `status` says UNREACHABLE with scontrol's error and keeps the recorded RUNNING (never LOST);
    a kill meanwhile cannot be verified: KILL_FAILED. Back, `kill` again reaches the same job: KILLED."""
    rep = launch(write_job(site, "silent", command="sleep 300"))
    wait_for(lambda: status(rep["id"])["state"] == "RUNNING", 120, "RUNNING")
    cluster.stop_controller()
    try:
        t0 = time.monotonic()
        st = status(rep["id"])
        print(f"status with the controller down: {time.monotonic() - t0:.1f} s")
        assert st["state"] == "UNREACHABLE" and "controller did not answer" in st["reason"], st
        assert any("last state RUNNING" in e for e in st["evidence"]), st
        ls = json.loads(run_cli("ls", "--json", cwd=ROOT).stdout)["jobs"]
        assert [j["state"] for j in ls if j["id"] == rep["id"]] == ["RUNNING"]
        res = run_cli("kill", rep["id"], "--grace", "1", "--json", cwd=ROOT)
        assert res.code == 1 and json.loads(res.stdout)["result"] == "KILL_FAILED", res.stdout
        doc = json.loads(run_cli("doctor", "cluster", "--json", cwd=ROOT, timeout=200).stdout)
        checks = {c["name"]: c for c in doc["checks"]}  # the controller is named, not an "unknown partition"
        assert checks["controller"]["status"] == "fail" and "partition" not in checks, checks
    finally:
        cluster.start_controller()
    # the job's step tells a controller that was away of its end on Slurm's own retry (a minute later, on a loaded
    # machine past the kill's wait): the kill verifies what the scheduler says, so it asks once the scheduler knows
    squeue = ["squeue", "-h", "-j", rep["slurm_job"]]
    env = {**os.environ, **cluster.env}
    wait_for(
        lambda: (
            (q := subprocess.run(squeue, env=env, capture_output=True, text=True)).returncode == 0
            and not q.stdout.strip()
        ),
        180,
        "the controller to see the job end",
    )
    res = run_cli("kill", "--json", cwd=ROOT)  # no id: the job whose kill failed
    report = json.loads(res.stdout)
    assert res.code == 0 and report["result"] == "KILLED" and report["id"] == rep["id"], report
    # FAILED rather than CANCELLED here: this login node is also the compute node, so the first kill's SIGTERM to
    # the job's processes on this machine ended it while the controller was away
    assert slurm_state(cluster, rep["slurm_job"]) in ("CANCELLED", "FAILED")


def test_a_kill_while_queued_cancels_the_submission(site, cluster):
    """Killed while PENDING: nothing ran, the submission is CANCELLED, KILLED; the node back, nothing starts."""
    cluster.drain("queued kill")
    try:
        rep = launch(write_job(site, "queuedkill", command="echo should never run"))
        wait_for(lambda: status(rep["id"])["state"] == "PENDING", 120, "PENDING")
        res = run_cli("kill", rep["id"], "--json", cwd=ROOT)
        assert res.code == 0 and json.loads(res.stdout)["result"] == "KILLED", res.stdout
        assert slurm_state(cluster, rep["slurm_job"]) == "CANCELLED"
    finally:
        cluster.resume()
    cluster.wait_idle()
    time.sleep(2)
    log = Path(rep["run_dir"]) / "train.log"
    assert not log.exists() or "should never run" not in log.read_text()
    assert status(rep["id"])["state"] == "KILLED"


def test_with_no_watch_the_login_nodes_supervisor_resubmits_a_crash(site, cluster):
    """No laptop: the job's supervisor on the login node sees the crash through Slurm and resubmits it (once, by
    max_restarts), then ends; the run dir's events say who did it."""
    rep = launch(
        write_job(
            site,
            "alone",
            command='echo "attempt"; sleep 1; exit 3',
            watch="  restart_on: [CRASHED]\n  max_restarts: 1\n",
        )
    )
    run = Path(rep["run_dir"])

    def ended():
        me = run / "supervisor.json"
        return me.exists() and json.loads(me.read_text()).get("ended")

    why = wait_for(ended, 120, "the supervisor's end")
    assert "CRASHED" in why and "max_restarts" in why, why
    assert (run / "restarts").read_text().strip() == "1"
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    (restart,) = [e for e in events if e.get("decision") == "restart"]
    assert restart["by"] == "supervisor" and restart["after"] == "CRASHED"
    assert (run / "slurm_job").read_text().strip() != rep["slurm_job"]  # a second submission
    assert status(rep["id"])["state"] == "CRASHED"
