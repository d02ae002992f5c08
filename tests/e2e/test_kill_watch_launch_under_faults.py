"""Never wrong, never harmful: kill, watch, launch and the records under concurrency and faults, against the suite's
real sshd and tmux. Each test is a case of docs/reliability.md."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dflashctl.agent import common, procs
from tests.conftest import kill_marked, run_cli
from tests.e2e.test_launch import alive, cli_json, status_json, wait_until, write_project


def job_file(p: Path, name: str, command: str, extra: str = "") -> str:
    """A job file outside the project's tree (so writing it does not make the deployed code stale)."""
    path = p.parent / "jobfiles" / f"{name}.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(f"name: {name}\nhost: box\nkill_grace_s: 2\ncommand: {json.dumps(command)}\n{extra}")
    return str(path)


def run_dir_of(job_id: str) -> Path:
    return Path(status_json(job_id)["run_dir"])


def starts(run_dir: Path) -> int:
    lines = (run_dir / "train.log").read_text().splitlines()
    return sum(1 for ln in lines if ln.startswith("[dflashctl] ") and ln.split()[2:3] == ["start"])


@pytest.fixture
def proj(client, tmp_path):
    p = write_project(client, tmp_path)
    assert run_cli("deploy", "box").code == 0
    return p


def test_kill_during_watch_is_not_undone_by_the_watcher(proj):
    """A watcher with restart_on CRASHED sees exit 143 after a kill: it must say KILLED and never restart."""
    f = job_file(proj, "victim", "sleep 300", "watch: {interval_s: 0.5, backoff_s: 0, restart_on: [CRASHED]}\n")
    job_id = cli_json("launch", f)["id"]
    watcher = subprocess.Popen(
        [sys.executable, "-m", "dflashctl", "watch", job_id, "--json"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    first = watcher.stdout.readline()  # the watch has had its first look
    killed = cli_json("kill", job_id)
    out, _ = watcher.communicate(timeout=60)
    seen = [json.loads(line)["state"] for line in (first + out).splitlines()]
    assert killed["result"] == "KILLED" and watcher.returncode == 20, seen
    assert "CRASHED" not in seen and seen[-1] == "KILLED"
    run = run_dir_of(job_id)
    assert starts(run) == 1 and not (run / "restarts").exists()
    assert status_json(job_id)["state"] == "KILLED"


def test_two_watchers_restart_once_per_failure_and_keep_max_restarts(proj):
    """Two watchers on one crashing job, max_restarts 1: exactly one restart in all (two starts)."""
    f = job_file(proj, "crashy", "sleep 1; exit 1", "watch: {interval_s: 0.3, backoff_s: 0, max_restarts: 1}\n")
    job_id = cli_json("launch", f)["id"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "dflashctl", "watch", job_id, "--json"], stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    codes = [p.wait(timeout=120) for p in procs]
    run = run_dir_of(job_id)
    assert starts(run) == 2, (run / "train.log").read_text()
    assert (run / "restarts").read_text().strip() == "1"
    assert codes == [10, 10]  # both end on CRASHED once the budget is spent


def test_restart_never_follows_a_stop_request(proj):
    """The restart action itself refuses after a kill, whoever calls it (a watcher that saw CRASHED before the kill)."""
    from dflashctl.jobs import control, registry
    from dflashctl.remote.connect import open_runner

    job_id = cli_json("launch", job_file(proj, "stopme", "sleep 300"))["id"]
    assert cli_json("kill", job_id)["result"] == "KILLED"
    job = registry.get(job_id)
    with open_runner(job.host) as runner:
        outcome = control.restart(runner, job, attempt=0)
    assert not outcome.restarted and "stop was requested" in outcome.why
    assert starts(Path(job.run_dir)) == 1


def test_escaped_descendants_are_killed_and_decoys_survive(proj):
    """setsid -f, env -i, a double fork: all stay in the job's tree (the launcher is a child subreaper)."""
    decoy = subprocess.Popen(["bash", "-c", "python3 -c 'import time; time.sleep(600)'"])
    cmd = "setsid -f env -i sleep 611; (sleep 612 &); setsid sleep 613 & echo up; sleep 614"
    try:
        job_id = cli_json("launch", job_file(proj, "escapes", cmd))["id"]
        wait_until(lambda: "up" in run_cli("logs", job_id).stdout)
        time.sleep(0.5)
        killed = cli_json("kill", job_id)
        cmds = {p["cmd"] for p in killed["found"]}
        assert {"sleep 611", "sleep 612", "sleep 613", "sleep 614"} <= cmds, cmds
        assert killed["result"] == "KILLED" and not [p["pid"] for p in killed["found"] if alive(p["pid"])]
        assert alive(decoy.pid)
    finally:
        decoy.kill()


def test_a_dead_pane_contributes_no_process(proj):
    """remain-on-exit keeps a dead pane's old pid: it must never be signalled (it may be someone else's now)."""
    job_id = cli_json("launch", job_file(proj, "quick", "exit 3"))["id"]  # CRASHED: a kill is still allowed
    run = run_dir_of(job_id)
    wait_until(lambda: (run / "exit_code").exists())
    pane_pid = json.loads((run / "wrapper.pid").read_text())["pid"]
    assert procs.launcher_of(str(run), {"exists": True, "pane_dead": True, "pane_pid": pane_pid}) is None
    decoy = subprocess.Popen(["sleep", "600"])
    try:  # a process named by a pid but a different start time is not that process
        wrong = {"pid": decoy.pid, "start": common.start_time(decoy.pid) - 1}
        assert procs.job_processes(procs.proc_table(), wrong, None) == []
        res = run_cli("kill", job_id, "--json")  # it had ended by itself: its verdict and exit code stand
        killed = json.loads(res.stdout)
        assert res.code == 10 and killed["verdict"]["state"] == "CRASHED"
        assert killed["term"] == [] and killed["kill"] == [] and alive(decoy.pid)
    finally:
        decoy.kill()


def test_failed_kill_is_kill_failed_and_a_retry_targets_the_same_job(proj):
    """Something outside the job keeps starting processes tagged with its id: the kill cannot verify, says
    KILL_FAILED (exit 1, JSON report too), and `kill` without an id retries that job, not a newer healthy one."""
    victim = cli_json("launch", job_file(proj, "stubborn", "sleep 300"))["id"]
    respawn = f"while true; do DFLASHCTL_JOB_ID={victim} sleep 1000 & sleep 0.05; done"
    spawner = subprocess.Popen(["bash", "-c", respawn], start_new_session=True)
    try:
        time.sleep(0.5)
        res = run_cli("kill", victim, "--json")
        report = json.loads(res.stdout)
        assert res.code == 1 and report["result"] == "KILL_FAILED" and report["remaining"]
        assert status_json(victim)["state"] == "KILL_FAILED"
        healthy = cli_json("launch", job_file(proj, "healthy", "sleep 300"))["id"]
        human = run_cli("kill")
        assert human.code == 1 and victim in human.stderr and "KILL_FAILED" in human.stderr
        assert status_json(healthy)["alive"]
    finally:
        os.killpg(spawner.pid, signal.SIGKILL)
        kill_marked(f"DFLASHCTL_JOB_ID={victim}")  # the respawned sleeps carry the victim's tag
    assert cli_json("kill")["result"] == "KILLED"  # the retry reaches the same job, now cleanly
    assert status_json(victim)["state"] == "KILLED"
    assert cli_json("kill", healthy)["result"] == "KILLED"


def test_gpu_lock_holds_against_simultaneous_launches(proj, sshd):
    """Two launches for GPU 0 at the same moment: exactly one starts, five times over."""
    apps = sshd.dir / "nvidia-apps.csv"
    recorded = apps.read_text()
    apps.write_text("")
    try:
        for i in range(5):
            files = [job_file(proj, f"race{i}{side}", "sleep 300", "gpus: [0]\n") for side in "ab"]
            results: list = [None, None]

            def go(k: int, files=files, results=results) -> None:
                results[k] = run_cli("launch", files[k], "--json")

            threads = [threading.Thread(target=go, args=(k,)) for k in (0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            codes = sorted(r.code for r in results)
            assert codes == [0, 2], [r.stderr for r in results]
            loser = next(r for r in results if r.code == 2)
            assert "GPU 0 held by job race" in loser.stderr
            winner = json.loads(next(r for r in results if r.code == 0).stdout)["id"]
            assert cli_json("kill", winner)["result"] == "KILLED"
    finally:
        apps.write_text(recorded)


def test_same_name_alive_is_refused_unless_forced(proj):
    f = job_file(proj, "twin", "sleep 300")
    first = cli_json("launch", f)["id"]
    res = run_cli("launch", f)
    assert res.code == 2 and f"job {first} of the same name is alive" in res.stderr
    assert f"`dflashctl watch {first}` follows it, `dflashctl kill {first}` stops it" in res.stderr  # what to do
    assert len(res.stderr.strip().splitlines()) == 1
    second = cli_json("launch", f, "--force")["id"]
    assert second != first
    # another clone of the project on the same host: its job of the same name is another job, not refused
    import shutil

    clone = proj.parent / "clone"
    shutil.copytree(proj, clone)
    assert run_cli("deploy", "box", cwd=clone).code == 0
    res = run_cli("launch", f, "--json", cwd=clone)
    assert res.code == 0, res.stderr
    third = json.loads(res.stdout)["id"]
    for j in (first, second, third):
        assert cli_json("kill", j)["result"] == "KILLED"


def test_restart_uses_the_release_and_job_file_it_launched_with(proj):
    """A deploy and an edited job file while a job runs: its restart still runs its own code and its own command."""
    (proj / "marker.txt").write_text("v1\n")
    f = job_file(
        proj, "pinned", "cat marker.txt; sleep 2; exit 1", "watch: {interval_s: 0.3, backoff_s: 0, max_restarts: 1}\n"
    )
    assert run_cli("deploy", "box").code == 0
    job_id = cli_json("launch", f)["id"]
    (proj / "marker.txt").write_text("v2\n")
    assert run_cli("deploy", "box").code == 0
    job_file(proj, "pinned", "echo EDITED; exit 1")
    code = run_cli("watch", job_id, "--json", timeout=120).code
    log = (run_dir_of(job_id) / "train.log").read_text()
    assert code == 10 and log.count("v1") == 2 and "v2" not in log and "EDITED" not in log, log


def test_remote_files_are_private_and_secrets_never_shown(proj):
    f = job_file(
        proj,
        "secretive",
        "sleep 300",
        "env: {HF_TOKEN: hf_abc123, MY_THING: s3cr3t, PLAIN: ok}\nsecret_env: [MY_THING]\n",
    )
    dry = run_cli("launch", f, "--dry-run")
    dry_json = run_cli("launch", f, "--dry-run", "--json")
    for out in (dry.stdout, dry_json.stdout):
        assert "hf_abc123" not in out and "s3cr3t" not in out and "***" in out and "PLAIN=ok" in out
    job_id = cli_json("launch", f)["id"]
    run = run_dir_of(job_id)
    assert run.stat().st_mode & 0o777 == 0o700 and run.parent.stat().st_mode & 0o777 == 0o700
    for name in ("run.sh", "job.env", "command.sh", "job.json", "agent.pyz"):
        assert (run / name).stat().st_mode & 0o777 == 0o600, name
    assert b"HF_TOKEN=hf_abc123\0" in (run / "job.env").read_bytes()  # the job itself gets the value
    wait_until(lambda: (run / "verdict.json").exists())  # its supervisor and a status write their files too

    def holding(secret: str) -> list[str]:
        return sorted(
            str(f.relative_to(run)) for f in run.rglob("*") if f.is_file() and secret.encode() in f.read_bytes()
        )

    status_json(job_id)
    assert holding("hf_abc123") == ["job.env"] and holding("s3cr3t") == ["job.env"]  # one file at rest: 0600
    assert cli_json("kill", job_id)["result"] == "KILLED"
    assert holding("hf_abc123") == [] and holding("s3cr3t") == []  # ended for good: removed
    assert b"HF_TOKEN=***\0" in (run / "job.env").read_bytes() and b"PLAIN=ok\0" in (run / "job.env").read_bytes()


@pytest.mark.parametrize(
    "url, expect",
    [
        ("http://example.com/a\x07b", "control characters"),
        ("http://example.com/caf\u00e9/secretpath", "non-ASCII"),
        ("http://example.com:port/secretpath", "port"),
        ("ftp://example.com/secretpath", "http:// or https://"),
    ],
)
def test_bad_webhook_urls_are_load_errors_that_never_print_the_url(proj, url, expect):
    f = job_file(proj, "hook", "sleep 1", f"watch: {{notify: {{webhook: {json.dumps(url)}}}}}\n")
    res = run_cli("launch", f)
    assert res.code == 2 and expect in res.stderr and "secretpath" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_records_are_private_atomic_and_a_corrupt_file_is_never_overwritten(proj, tmp_path):
    from dflashctl.jobs import registry

    job_id = cli_json("launch", job_file(proj, "rec", "sleep 300"))["id"]
    status_json(job_id)  # a second write: the first file becomes the last good copy
    d = registry.state_dir()
    assert (d / "jobs.json.bak").stat().st_mode & 0o777 == 0o600
    assert d.stat().st_mode & 0o777 == 0o700 and (d / "jobs.json").stat().st_mode & 0o777 == 0o600
    good = (d / "jobs.json").read_bytes()
    (d / "jobs.json").write_bytes(good[: len(good) // 2])  # truncated, as by a full disk or a crash elsewhere
    broken = (d / "jobs.json").read_bytes()
    for args in (("ls",), ("status", job_id), ("launch", job_file(proj, "rec2", "sleep 1")), ("kill",)):
        res = run_cli(*args)
        lines = res.stderr.strip().splitlines()
        assert res.code == 2 and len(lines) == 1 and "jobs.json" in lines[0] and "cp " in lines[0], (args, lines)
        assert (d / "jobs.json").read_bytes() == broken  # nothing written over it
    assert "rec2" not in run_cli("ls").stderr
    os.replace(d / "jobs.json.bak", d / "jobs.json")  # the way out the message names
    assert cli_json("kill", job_id)["result"] == "KILLED"


def test_probe_failure_is_its_own_state_not_unreachable(client, tmp_path):
    (client.project / "dflashctl.yaml").write_text(
        f"hosts:\n  box: {{ssh: testbox, python: {sys.executable}, workdir: {tmp_path}/wd}}\n"
        f"  badpy: {{ssh: testbox, python: /nonexistent/python3, workdir: {tmp_path}/wd}}\n"
    )
    (client.project / "j.yaml").write_text("name: pf\nhost: box\ncommand: sleep 300\n")
    assert run_cli("deploy", "box").code == 0
    job_id = cli_json("launch", "j.yaml")["id"]
    from dflashctl.jobs import registry

    rec = registry.get(job_id)
    registry.update(job_id, host=rec.host.model_copy(update={"python": "/nonexistent/python3"}).model_dump())
    res = run_cli("watch", job_id, "--json", "--until-done", timeout=60)
    last = json.loads(res.stdout.splitlines()[-1])
    assert res.code == 19 and last["state"] == "PROBE_FAILED" and "/nonexistent/python3" in last["evidence"][0]
    registry.update(job_id, host=rec.host.model_dump())
    assert cli_json("kill", job_id)["result"] == "KILLED"


def test_logs_reads_a_bounded_tail_and_neutralises_escapes(proj):
    job_id = cli_json("launch", job_file(proj, "noisy", "printf 'a\\033]0;pwned\\007b\\033[2J\\n'; sleep 300"))["id"]
    run = run_dir_of(job_id)
    wait_until(lambda: "pwned" in (run / "train.log").read_text())
    shown = run_cli("logs", job_id, "-n", "3").stdout
    assert "\x1b" not in shown and "\\x1b]0;pwned\\x07b\\x1b[2J" in shown
    assert "\x1b]0;pwned" in run_cli("logs", job_id, "-n", "3", "--raw").stdout
    with open(run / "train.log", "ab") as f:  # 40 MiB without a newline
        f.write(b"x" * (40 << 20))
    res = run_cli("logs", job_id, "-n", "5")
    assert res.code == 0 and len(res.stdout) <= (4 << 20) + 100
    assert cli_json("kill", job_id)["result"] == "KILLED"


def test_command_ending_in_a_backslash_runs(proj):
    job_id = cli_json("launch", job_file(proj, "bs", "echo ends-with-backslash \\"))["id"]
    run = run_dir_of(job_id)
    wait_until(lambda: (run / "exit_code").exists())
    assert (run / "exit_code").read_text().strip() == "0" and "ends-with-backslash" in (run / "train.log").read_text()


def test_kill_with_host_gpu_query_checks_after_the_kill_through_nspid(client, tmp_path, sshd):
    """gpu_query: host: nvidia-smi runs on the container's host after the kill; a pid listed there that is no job
    process (or no longer exists) is not a holder, and the report says which check it made."""
    remote = tmp_path / "remote"
    (client.project / "dflashctl.yaml").write_text(
        f"hosts:\n  boxpct: {{ssh: testbox, container: 'pct:7', python: {sys.executable}, workdir: {remote}, "
        "gpu_query: host}\n"
    )
    (client.project / "j.yaml").write_text("name: hg\nhost: boxpct\ncommand: sleep 300\nkill_grace_s: 2\n")
    assert run_cli("deploy", "boxpct").code == 0
    job_id = cli_json("launch", "j.yaml")["id"]
    killed = cli_json("kill", job_id)
    assert killed["result"] == "KILLED" and "after the kill" in killed["gpu_check"] and "NSpid" in killed["gpu_check"]
    assert killed["gpu_holders"] == []


def test_launch_checks_what_the_job_needs_before_starting_it(proj, tmp_path):
    """No tmux on the host, no torch for a trainer job, GPUs asked of a host without any: one line naming the job
    file and key, exit 2, no run dir created."""
    no_tmux = tmp_path / "py-without-tmux"
    no_tmux.write_text(f'#!/bin/sh\nPATH=/nonexistent exec {sys.executable} "$@"\n')
    no_tmux.chmod(0o755)
    remote = proj.parent / "remote" / "plain"
    hosts = proj.parent / "more-hosts.yaml"
    hosts.write_text(
        f"hosts:\n  notmux: {{ssh: testbox, python: {no_tmux}, workdir: {remote}}}\n"
        f"  notorch: {{ssh: testbox, python: python3, workdir: {remote}}}\n"
        f"  here: {{python: {sys.executable}, workdir: {remote}}}\n"
    )
    env = {"DFLASHCTL_HOSTS": str(hosts)}
    trainer = "trainer: {steps: 1, target: {random_preset: tiny-qwen3}, attention: {backend: dense}, device: cpu}\n"
    cases = [
        ("name: t1\nhost: notmux\ncommand: sleep 1\n", "host: tmux is not installed", env),
        (f"name: t2\nhost: notorch\n{trainer}", "host.python: python3 cannot import torch", env),
        # this machine itself: no GPU, no nvidia-smi on the test's PATH
        (
            "name: t3\nhost: here\ngpus: [0]\ncommand: sleep 1\n",
            "gpus: GPUs [0] asked for, but this host shows none",
            env,
        ),
    ]
    runs = remote / "runs"
    before = set(os.listdir(runs)) if runs.exists() else set()
    for i, (body, expect, extra_env) in enumerate(cases):
        f = proj.parent / "jobfiles" / f"need{i}.yaml"
        f.parent.mkdir(exist_ok=True)
        f.write_text(body)
        res = run_cli("launch", str(f), env=extra_env)
        lines = res.stderr.strip().splitlines()
        assert res.code == 2 and len(lines) == 1 and f"{f}: {expect}" in lines[0], lines
    assert (set(os.listdir(runs)) if runs.exists() else set()) == before


def test_a_command_job_that_hangs_is_stalled_and_one_that_works_is_not(proj):
    """Without metrics, progress is the log's growth, CPU time and GPU activity: `sleep` shows none of them."""
    watch = "watch: {interval_s: 0.5, stall_after_s: 3, restart_on: []}\n"
    hung = cli_json("launch", job_file(proj, "hung", "echo begin; sleep 300", watch))["id"]
    busy = cli_json("launch", job_file(proj, "ticking", "while true; do echo tick; sleep 0.3; done", watch))["id"]
    try:
        for job_id, want in ((hung, "STALLED"), (busy, "RUNNING")):
            proc = subprocess.Popen(
                [sys.executable, "-m", "dflashctl", "watch", job_id, "--json"], stdout=subprocess.PIPE, text=True
            )
            seen, start = [], time.monotonic()
            for line in proc.stdout:
                seen.append(json.loads(line))
                if seen[-1]["state"] == "STALLED" or time.monotonic() - start > 7:
                    break
            proc.terminate()
            proc.wait(10)
            assert seen[-1]["state"] == want, (job_id, [r["state"] for r in seen])
    finally:
        for job_id in (hung, busy):
            run_cli("kill", job_id)


def test_watch_into_a_pipe_prints_a_line_per_poll(proj):
    job_id = cli_json("launch", job_file(proj, "piped", "sleep 300"))["id"]
    try:
        res = run_cli("watch", job_id, "--once")  # stdout is a pipe here, as with `| tee` or nohup
        lines = res.stdout.strip().splitlines()
        assert res.code == 0 and len(lines) == 1 and f"{job_id} RUNNING: alive" in lines[0], res.stdout
    finally:
        run_cli("kill", job_id)


def test_a_bare_kill_asks_before_stopping_the_newest_live_job(proj):
    job_id = cli_json("launch", job_file(proj, "asked", "sleep 300"))["id"]
    res = run_cli("kill")  # no terminal to ask on, no --yes: nothing is stopped
    assert res.code == 2 and f"dflashctl kill {job_id}" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert status_json(job_id)["state"] == "RUNNING"
    assert cli_json("kill", "--yes")["id"] == job_id


def test_gc_removes_only_ended_old_run_dirs_and_asks_first(proj):
    """Three jobs: one alive, one ended long ago, one ended just now. gc with --older-than 1 removes only the old
    one, after --dry-run listed it and a run without --yes (no terminal) refused; the live job runs on."""
    live = cli_json("launch", job_file(proj, "keepme", "sleep 300"))["id"]
    old = cli_json("launch", job_file(proj, "oldone", "exit 0", "watch: {restart_on: []}\n"))["id"]
    new = cli_json("launch", job_file(proj, "newone", "exit 0", "watch: {restart_on: []}\n"))["id"]
    old_run, new_run = run_dir_of(old), run_dir_of(new)
    wait_until(lambda: (old_run / "exit_code").exists() and (new_run / "exit_code").exists())
    for r in (old_run, new_run):  # their supervisors see the end and stop
        wait_until(
            lambda r=r: (
                (r / "supervisor.json").exists() and json.loads((r / "supervisor.json").read_text()).get("ended")
            )
        )
    day_ago = time.time() - 2 * 86400
    for f in [old_run, *old_run.iterdir()]:
        os.utime(f, (day_ago, day_ago), follow_symlinks=False)
    dry = cli_json("gc", "box", "--older-than", "1", "--dry-run")
    assert [r["id"] for r in dry["removed"]] == [old] and old_run.exists()
    why = {k["id"]: k["why"] for k in dry["kept"]}
    assert why[live] == "alive" and why[new].startswith("ended 0.0 days ago")
    res = run_cli("gc", "box", "--older-than", "1")
    assert res.code == 2 and "--yes" in res.stderr and old_run.exists()
    done = cli_json("gc", "box", "--older-than", "1", "--yes")
    assert [r["id"] for r in done["removed"]] == [old] and not old_run.exists() and new_run.exists()
    assert status_json(live)["state"] == "RUNNING"
    assert cli_json("kill", live)["result"] == "KILLED"


def test_exec_runs_with_the_jobs_environment_in_its_release_and_shell_opens_there(proj):
    job_id = cli_json("launch", job_file(proj, "envy", "sleep 300", "env: {DRAFT_NOTE: from-the-job}\n"))["id"]
    res = run_cli("exec", job_id, "--", "sh", "-c", 'echo "$DRAFT_NOTE"; pwd; ls marker.txt 2>/dev/null; exit 4')
    lines = res.stdout.splitlines()
    assert res.code == 4 and lines[0] == "from-the-job" and "/releases/" in lines[1], res
    got = json.loads(run_cli("exec", "--host", "box", "--json", "--", "pwd").stdout)
    assert got["exit"] == 0 and got["cwd"].endswith("/code") and "/releases/" in got["stdout"]  # code: the current
    argv = run_cli("shell", job_id, "--dry-run").stdout
    assert argv.startswith("ssh -t") and "/releases/" in argv and "job.env" in argv and "--rcfile" in argv
    res = run_cli("exec", job_id)
    assert res.code == 2 and len(res.stderr.strip().splitlines()) == 1
    assert cli_json("kill", job_id)["result"] == "KILLED"
