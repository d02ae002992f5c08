"""launch, status, logs, ls, kill through the real CLI: on `local`, over a real sshd, into a (fake) pct container."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parents[2]

WORKER = """
import os, signal, subprocess, sys, time
# a torchrun worker that also starts a child which ignores SIGTERM (it must still die, by SIGKILL)
IGNORE_TERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('stubborn', flush=True); "
child = subprocess.Popen([sys.executable, "-c", IGNORE_TERM + "time.sleep(600)"])
print(f"worker {os.environ.get('RANK')} sid {os.getsid(0)} pid {os.getpid()}", flush=True)
time.sleep(600)
"""


def write_project(client, tmp_path: Path) -> Path:
    """A project with hosts for the loopback sshd (plain and inside pct 7) and a few job files."""
    p = client.project
    remote = tmp_path / "remote"
    (p / "dflashctl.yaml").write_text(
        "hosts:\n"
        f"  box: {{ssh: testbox, python: {sys.executable}, workdir: {remote}/plain}}\n"
        f"  boxpct: {{ssh: testbox, container: 'pct:7', python: {sys.executable}, workdir: {remote}/pct}}\n"
    )
    jobs = p / "jobs"
    jobs.mkdir()
    for host in ("local", "box", "boxpct"):
        (jobs / f"echo-{host}.yaml").write_text(
            f'name: echo-{host}\nhost: {host}\ncommand: echo hello-from-job; echo "in $PWD"; sleep 300\n'
            "kill_grace_s: 5\n"
        )
    (p / "worker.py").write_text(WORKER)
    (jobs / "torchrun.yaml").write_text(
        f"name: tr\nhost: box\ncommand: {sys.executable} -m torch.distributed.run --standalone --nproc-per-node 2 "
        "worker.py\nkill_grace_s: 3\n"
    )
    return p


def cli_json(*args: str) -> dict | list:
    res = run_cli(*args, "--json")
    assert res.code == 0, res.stderr
    return json.loads(res.stdout)


def status_json(job_id: str, cwd: Path | None = None) -> dict:
    """`status --json`: its exit code is the state's, as for `watch --once`."""
    from dflashctl.judge.facts import EXIT_BY_STATE

    res = run_cli("status", job_id, "--json", cwd=cwd)
    st = json.loads(res.stdout)
    assert res.code == EXIT_BY_STATE[st["state"]], (res.code, st)
    return st


def wait_until(fn, timeout: float = 60.0):
    """Polls `fn` until it is true. A look that costs more than the 0.3 s between looks (a CLI start, an ssh call,
    the agent) waits as long again: a poll keeps at most half a core busy, and on a 2-core machine the job it waits
    on, and the other worker's tests, keep the rest."""
    deadline = time.monotonic() + timeout
    while True:
        t0 = time.monotonic()
        value = fn()
        if value:
            return value
        assert time.monotonic() < deadline, "timed out"
        time.sleep(min(2.0, max(0.3, time.monotonic() - t0)))


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("host", ["local", "box", "boxpct"])
def test_command_job_lifecycle(client, tmp_path, host):
    write_project(client, tmp_path)
    assert run_cli("deploy", host).code == 0
    launched = cli_json("launch", f"jobs/echo-{host}.yaml")
    job_id = launched["id"]
    assert job_id.startswith(f"echo-{host}-") and launched["pane_pid"] > 0
    agent_call, tmux = launched["remote_commands"]  # what ran, not `[]`: the agent's call, then the job's session
    assert " -I -S -c " in agent_call and " probe " in agent_call
    assert host != "boxpct" or agent_call.startswith("pct exec 7 --")
    assert "new-session" in tmux and f"{launched['run_dir']}/agent.pyz launch" in tmux and " -I -S " in tmux
    wait_until(lambda: "hello-from-job" in run_cli("logs", job_id, "-n", "5").stdout)
    st = status_json(job_id)
    assert st["alive"] and st["session"] == "alive" and st["exit_code"] is None and st["processes"] >= 2
    assert st["state"] == "RUNNING"  # a command job: alive is all that can be told
    logs = run_cli("logs", job_id, "-n", "5").stdout
    assert logs.index("hello-from-job") < logs.index("in ")
    assert f"/releases/{launched['release']}" in logs  # ran in the release it launched from
    as_json = json.loads(run_cli("logs", job_id, "-n", "5", "--json").stdout)
    assert as_json["id"] == job_id and "hello-from-job" in as_json["text"]
    assert [j["id"] for j in cli_json("ls")["jobs"]] == [job_id]
    killed = cli_json("kill", job_id)
    assert killed["clean"] and killed["term"] and killed["session_closed"]
    st = status_json(job_id)
    assert not st["alive"] and st["session"] == "gone" and st["run_dir_exists"] and st["state"] == "KILLED"
    assert st["exit_code"] is not None  # the wrapper recorded how the command ended


def test_kill_is_complete_and_precise(client, tmp_path):
    write_project(client, tmp_path)
    assert run_cli("deploy", "box").code == 0
    decoy = subprocess.Popen(["python3", "-c", "import time; time.sleep(600)"])  # same name, not ours
    try:
        job_id = cli_json("launch", "jobs/torchrun.yaml")["id"]
        log = wait_until(lambda: (r := run_cli("logs", job_id, "-n", "50").stdout).count("stubborn") == 2 and r, 120)
        # two workers write to one log: a line of one may run into the other's ("... pid 7495worker 0 sid ...")
        sids = {int(sid) for sid in re.findall(r"worker \d+ sid (\d+) pid", log)}
        assert len(sids) == 2, log  # each worker in its own session, as torchrun starts them
        killed = cli_json("kill", job_id)
        pids = [p["pid"] for p in killed["found"]]
        assert killed["clean"] and killed["kill"], killed  # the SIGTERM-ignoring children needed SIGKILL
        assert not [p for p in pids if alive(p)]
        assert alive(decoy.pid)
    finally:
        decoy.send_signal(signal.SIGKILL)
        decoy.wait()


def test_gpu_lock_refuses_held_gpus_and_force_overrides(client, tmp_path, sshd):
    p = write_project(client, tmp_path)
    apps = sshd.dir / "nvidia-apps.csv"
    recorded = apps.read_text()
    for name in ("a", "b"):
        (p / "jobs" / f"gpu-{name}.yaml").write_text(f"name: gpu-{name}\nhost: box\ngpus: [0]\ncommand: sleep 300\n")
    (p / "jobs" / "gpu-far.yaml").write_text("name: far\nhost: box\ngpus: [3]\ncommand: sleep 300\n")
    assert run_cli("deploy", "box").code == 0
    try:
        res = run_cli("launch", "jobs/gpu-a.yaml")  # the recorded H200 output has python3 pid 854 on GPU 0
        assert res.code == 2 and "unknown process pid 854" in res.stderr and "--force" in res.stderr
        forced = run_cli("launch", "jobs/gpu-a.yaml", "--force")
        assert forced.code == 0 and "--force overrides" in forced.stderr
        apps.write_text("")
        res = run_cli("launch", "jobs/gpu-b.yaml")
        assert res.code == 2 and "held by job gpu-a-" in res.stderr
        assert run_cli("launch", "jobs/gpu-b.yaml", "--force").code == 0
        res = run_cli("launch", "jobs/gpu-far.yaml")
        assert res.code == 2 and "jobs/gpu-far.yaml: gpus: index 3 out of range" in res.stderr
    finally:
        apps.write_text(recorded)
        for name in ("gpu-a", "gpu-b"):
            run_cli("kill", name, "--grace", "1")


def remote_tree(root: Path) -> dict[str, float]:
    return {str(f): f.stat().st_mtime for f in root.rglob("*")} if root.exists() else {}


def test_stale_deploy_is_refused_and_dry_run_changes_nothing(client, tmp_path):
    p = write_project(client, tmp_path)
    assert run_cli("deploy", "box").code == 0
    before = remote_tree(tmp_path / "remote")
    dry = run_cli("launch", "jobs/echo-box.yaml", "--dry-run")
    assert dry.code == 0 and "run.sh" in dry.stdout and "hello-from-job" in dry.stdout and "remote:" in dry.stdout
    assert remote_tree(tmp_path / "remote") == before
    assert cli_json("ls") == {"jobs": []}
    (p / "worker.py").write_text(WORKER + "\n# changed\n")
    res = run_cli("launch", "jobs/echo-box.yaml", "--no-sync")
    assert res.code == 2 and "deployed code is" in res.stderr and "--no-sync" in res.stderr
    assert remote_tree(tmp_path / "remote") == before
    ok = cli_json("launch", "jobs/echo-box.yaml")  # deploys the edited tree first (tests/test_launch_options.py)
    assert ok["deployed"][0]["sent"] == ["worker.py"] and cli_json("kill", ok["id"])["clean"]


@pytest.mark.parametrize(
    "body, expect",
    [
        ("name: j\nhost: box\ncommand: echo hi\ncolour: red\n", "colour: unknown key"),
        ("name: j\nhost: box\ncommand: echo hi\ntrainer: {steps: 1}\n", "exactly one of `trainer` and `command`"),
        ("name: 'j;rm -rf ~'\nhost: box\ncommand: echo hi\n", "name: may hold only"),
        ("name: 'j$(reboot)'\nhost: box\ncommand: echo hi\n", "name: may hold only"),
        ("name: j\nhost: box\ncommand: echo hi\nenv: {'A B': x}\n", "env: "),
        ("name: j\nhost: box\ngpus: two\ncommand: echo hi\n", "gpus"),
        ("name: j\nhost: box\ncommand: echo hi\nwatch: {restart_on: [DENSE_FALLBACK]}\n", "watch.restart_on"),
        ("name: j\nhost: box\ntrainer: {steps: 0, target: {random_preset: tiny-qwen3}}\n", "trainer.steps"),
        ("name: j\nhost: [box\n", "malformed YAML"),
    ],
)
def test_bad_job_files_are_one_line_exit_2_and_touch_nothing(client, tmp_path, body, expect):
    write_project(client, tmp_path)
    (client.project / "dflashctl.yaml").write_text("hosts:\n  box: {ssh: 'root@192.0.2.1', connect_timeout: 30}\n")
    (client.project / "bad.yaml").write_text(body)
    res = run_cli("launch", "bad.yaml", cwd=client.project)
    assert res.code == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "bad.yaml" in lines[0] and expect in lines[0], lines
    assert "192.0.2.1" not in res.stderr  # judged before any connection was tried (that host never answers)


@pytest.mark.slow
@pytest.mark.parametrize("host", ["boxpct"])
def test_demo_trainer_job(client, tmp_path, monkeypatch, host):
    """The bundled trainer (two ranks under torchrun, gloo) launched inside pct over ssh (plain ssh: test_multinode,
    whose nodes are plain ssh hosts; `local`: `make demo`, and the local-host command jobs above)."""
    remote = tmp_path / "remote"
    hosts = (
        f"hosts:\n  box: {{ssh: testbox, python: {sys.executable}, workdir: {remote}}}\n"
        f"  boxpct: {{ssh: testbox, container: 'pct:7', python: {sys.executable}, workdir: {remote}/pct}}\n"
    )
    (tmp_path / "hosts.yaml").write_text(hosts)
    monkeypatch.setenv("DFLASHCTL_HOSTS", str(tmp_path / "hosts.yaml"))
    job = tmp_path / "demo.yaml"
    text = (ROOT / "jobs" / "tiny-cpu.yaml").read_text().replace("host: local", f"host: {host}")
    job.write_text(text.replace("steps: 1000", "steps: 40").replace("synthetic_samples: 256", "synthetic_samples: 32"))
    assert run_cli("deploy", host, cwd=ROOT).code == 0
    job_id = cli_json_in(ROOT, "launch", str(job))["id"]
    follow = run_cli("logs", job_id, "-f", cwd=ROOT, timeout=600)
    assert follow.code == 0 and "finished: 40 steps" in follow.stdout and "tau" in follow.stdout
    st = status_json(job_id, ROOT)
    assert st["exit_code"] == 0 and st["step"] == 40 and st["last_event"]["event"] == "finished"
    assert st["state"] == "FINISHED" and st["tau"] is not None and st["tau_set"] == "holdout"
    assert os.path.exists(f"{st['run_dir']}/checkpoints")


def cli_json_in(cwd: Path, *args: str):
    res = run_cli(*args, "--json", cwd=cwd)
    assert res.code == 0, res.stderr
    return json.loads(res.stdout)


def test_status_polls_skip_a_version_managers_shim_and_fall_back_when_its_target_is_gone(client, tmp_path):
    """A host whose `python` is a shim (pyenv, asdf: a script, a tenth of a second a call): once a deploy has
    recorded the interpreter the agent ran under, status asks it directly (the workdir's record, else the host's);
    when that one is gone or neither record can be read, the shim answers and status says the same."""
    from dflashctl.model.record import state_dir

    shim, calls = tmp_path / "shim" / "python3", tmp_path / "shim-calls"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\necho "$$" >> {calls}\nexec {sys.executable} "$@"\n')
    shim.chmod(0o755)
    p = client.project
    (p / "dflashctl.yaml").write_text(f"hosts:\n  shimmed: {{ssh: testbox, python: {shim}, workdir: {tmp_path}/wd}}\n")
    (p / "job.yaml").write_text("name: shimmed\nhost: shimmed\ncommand: sleep 300\nkill_grace_s: 2\n")
    assert run_cli("deploy", "shimmed").code == 0
    job_id = cli_json("launch", "job.yaml")["id"]
    (record,) = (state_dir() / "last-deploy").iterdir()
    assert json.loads(record.read_text())["python"] != str(shim)
    wait_until(lambda: status_json(job_id)["state"] == "RUNNING")  # the pane's launcher, started by the shim, is up
    before = len(calls.read_text().split())
    assert status_json(job_id)["state"] == "RUNNING"
    assert len(calls.read_text().split()) == before  # the recorded interpreter, not the shim
    record.write_text(json.dumps({**json.loads(record.read_text()), "python": str(tmp_path / "gone" / "python3")}))
    assert status_json(job_id)["state"] == "RUNNING"
    assert len(calls.read_text().split()) == before + 1  # the vanished one could not start: the shim answered
    record.write_text('{"python": ["/usr/bin/python3"], "files"')  # garbled (a crash elsewhere): not used
    assert status_json(job_id)["state"] == "RUNNING"
    assert len(calls.read_text().split()) == before + 1  # the host's interpreter, kept for all its workdirs
    (host_record,) = (state_dir() / "agent-python").iterdir()
    host_record.write_text('{"python": ')
    assert status_json(job_id)["state"] == "RUNNING"
    assert len(calls.read_text().split()) == before + 2  # neither record readable: the shim
    assert cli_json("kill", job_id)["clean"]
