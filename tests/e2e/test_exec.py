"""`exec` and `shell` are the job's own: its very environment (job.env), its release, their own tag, a timeout that
ends the remote process group, the exit status of a signal, stdin passed through, paths that never become code. A
real sshd and real tmux; processes looked for in the real process table."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.e2e.test_kill_watch_launch_under_faults import job_file, proj, run_dir_of  # noqa: F401 (proj: the fixture)
from tests.e2e.test_launch import cli_json, wait_until

TRICKY = {
    "MULTI": "line one\nline two\n  indented",
    "AFTER": "after-the-newline",
    "QUOTED": 'it\'s "quoted" $(touch /nonexistent-dir/x) `id` $HOME \\ ;|&',
}


def env0(data: bytes) -> dict[str, str]:
    return dict(rec.split("=", 1) for rec in data.decode().split("\0") if rec)


def pids_with(arg: str) -> list[int]:
    """`sleep ARG` processes (a number no one else sleeps), not the shells that hold it among their arguments."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    words = f.read().split(b"\0")
                    if os.path.basename(words[0]) == b"sleep" and arg.encode() in words:
                        found.append(int(name))
            except OSError:
                continue
    return found


def environ_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return env0(f.read())


@pytest.fixture
def job(proj):  # noqa: F811
    """A live job whose command wrote the environment it was given into its run dir."""
    extra = f"env: {json.dumps(TRICKY)}\nwatch: {{restart_on: []}}\n"
    job_id = cli_json("launch", job_file(proj, "envy", 'env -0 > "$RUN/seen.env"; sleep 300', extra))["id"]
    run = run_dir_of(job_id)
    wait_until(lambda: (run / "seen.env").exists() and (run / "seen.env").stat().st_size > 0)
    yield job_id, run
    run_cli("kill", job_id)


def test_exec_sees_the_jobs_environment_exactly(job):
    job_id, run = job
    seen = env0((run / "seen.env").read_bytes())
    res = run_cli("exec", job_id, "--", "env", "-0")
    assert res.code == 0, res.stderr
    got = env0(res.stdout.encode())
    written = env0((run / "job.env").read_bytes())
    assert (run / "job.env").stat().st_mode & 0o777 == 0o600
    for key, value in written.items():
        if key != "DFLASHCTL_JOB_ID":  # the exec's own tag: below
            assert got[key] == seen[key] == value, key
    for key, value in TRICKY.items():
        assert got[key] == value, key
    assert got["DFLASHCTL_RUN_DIR"] == str(run) and got["TORCHINDUCTOR_CACHE_DIR"] == str(run / "inductor-cache")
    assert got["DFLASHCTL_KERNEL_CACHE"] == str(run.parent.parent / "kernel-cache")
    assert got["DFLASHCTL_EXEC_OF"] == job_id and got["DFLASHCTL_JOB_ID"].startswith(f"{job_id}.exec.")
    assert not Path("/nonexistent-dir").exists()


def test_one_string_runs_through_bash_and_several_words_run_as_argv(job):
    job_id, _ = job
    res = run_cli("exec", job_id, "--", "echo a; echo b | tr b c")
    assert res.code == 0 and res.stdout == "a\nc\n", res
    res = run_cli("exec", job_id, "--", "echo", "a; echo b", "$(id)")
    assert res.code == 0 and res.stdout == "a; echo b $(id)\n", res


def test_a_signal_is_128_plus_n_and_stdin_is_passed_through(job):
    job_id, _ = job
    res = run_cli("exec", job_id, "--", "kill -KILL $$")
    assert res.code == 137, res
    res = run_cli("exec", job_id, "--", "kill -TERM $$")
    assert res.code == 143, res
    piped = subprocess.run(
        [sys.executable, "-m", "dflashctl", "exec", job_id, "--", "wc", "-l"],
        input=b"one\ntwo\nthree\n",
        capture_output=True,
        timeout=120,
    )
    assert piped.returncode == 0 and piped.stdout.strip() == b"3", piped


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf", "-inf"])
def test_a_timeout_must_be_finite_and_above_zero(job, bad):
    job_id, _ = job
    res = run_cli("exec", job_id, f"--timeout={bad}", "--", "sleep 4741")
    lines = res.stderr.strip().splitlines()
    assert res.code == 2 and len(lines) == 1 and "--timeout" in lines[0], res.stderr
    assert pids_with("4741") == []


def test_a_timeout_ends_the_remote_process_group(job):
    """`sleep 47` ran on after the old 124; now the timeout ends the command and what it started in its group."""
    job_id, _ = job
    res = run_cli("exec", job_id, "--timeout", "2", "--", "sleep 4742 & sleep 4743; wait")
    assert res.code == 124, res
    wait_until(lambda: pids_with("4742") == [] and pids_with("4743") == [], timeout=30)
    res = run_cli("exec", job_id, "--timeout", "1.5", "--", "sleep", "4744")
    assert res.code == 124 and pids_with("4744") == [], res


def test_a_timeout_ends_what_the_command_left_in_sessions_of_their_own(job):
    """A child that called setsid is in a group of its own: `timeout` alone never reaches it, and one holding the
    output kept the call open (47 s for --timeout 3). Found by the exec's own tag, they end with the call: one that
    ignores SIGTERM and one that holds no output too. Another exec's command, running beside it, is left alone."""
    job_id, _ = job
    other = subprocess.Popen(
        [sys.executable, "-m", "dflashctl", "exec", job_id, "--", "setsid sleep 4753; :"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        wait_until(lambda: pids_with("4753"), timeout=60)
        res = run_cli(
            "exec",
            job_id,
            "--timeout",
            "2",
            "--",
            "setsid sleep 4747 & setsid bash -c "
            "'trap \"\" TERM; sleep 4748; :' & setsid sleep 4750 </dev/null >/dev/null 2>&1 & echo started",
        )
        assert res.code == 124 and res.stdout == "started\n", res
        assert "sessions of their own" in res.stderr, res.stderr
        assert pids_with("4747") == pids_with("4748") == pids_with("4750") == [], "outlived the call"
        assert pids_with("4753") and other.poll() is None, "another exec's command was taken"
    finally:
        for p in pids_with("4753"):
            os.kill(p, signal.SIGKILL)
        other.wait(60)


def test_a_timeout_not_reached_keeps_the_commands_status_and_leaves_nothing(job):
    """What the command left ends by itself before the deadline: the call returns then, with the command's own
    status, and its clock (`sleep S`) is gone with it."""
    job_id, _ = job
    res = run_cli("exec", job_id, "--timeout", "4751", "--", "setsid sleep 1 & exit 4")
    assert res.code == 4 and "sessions of their own" not in res.stderr, res
    assert pids_with("4751.0") == []


def test_an_execd_process_survives_a_kill_of_the_job_and_carries_its_own_tag(job):
    job_id, run = job
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflashctl", "exec", job_id, "--", "sleep", "4745"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        pid = wait_until(lambda: pids_with("4745"), timeout=60)[0]
        env = environ_of(pid)
        assert env["DFLASHCTL_EXEC_OF"] == job_id and env["DFLASHCTL_JOB_ID"] != job_id
        assert cli_json("kill", job_id)["result"] == "KILLED"
        assert pids_with("4745") == [pid], "the job's kill took the exec'd command"
        res = run_cli("kill", job_id, "--all")  # asked for: now it goes
        assert f"SIGTERM [{pid}]" in res.stderr, res.stderr
        proc.wait(60)
        assert pids_with("4745") == [] and proc.returncode == 143, proc.returncode
    finally:
        for p in pids_with("4745"):
            os.kill(p, signal.SIGKILL)
        proc.wait(60)


def test_shell_opens_in_the_jobs_release_with_its_environment(job):
    job_id, run = job
    argv = run_cli("shell", job_id, "--dry-run").stdout.strip()
    res = subprocess.run(
        ["bash", "-c", argv],
        input=b'pwd -P; printf "%s|" "$MULTI" "$AFTER" "$DFLASHCTL_RUN_DIR"\nexit\n',
        capture_output=True,
        timeout=60,
    )
    out = res.stdout.decode()
    assert "/releases/" in out and f"{TRICKY['MULTI']}|{TRICKY['AFTER']}|{run}|" in out, (out, res.stderr)


def test_shell_on_a_host_opens_in_a_workdir_with_a_space_and_runs_no_substitution(proj, tmp_path):  # noqa: F811
    spaced = tmp_path / "remote" / "with space"
    (spaced / "code").mkdir(parents=True)
    marker = tmp_path / "F"
    cfg = proj / "dflashctl.yaml"
    py = sys.executable
    cfg.write_text(
        cfg.read_text() + f"  spaced: {{ssh: testbox, python: {py}, workdir: '{spaced}'}}\n"
        f"  evil: {{ssh: testbox, python: {py}, workdir: '~/w$(touch {marker})'}}\n"
    )
    argv = run_cli("shell", "--host", "spaced", "--dry-run").stdout.strip()
    res = subprocess.run(["bash", "-c", argv], input=b"pwd\nexit\n", capture_output=True, timeout=60)
    assert f"{spaced}/code\n" in res.stdout.decode(), (res.stdout, res.stderr)
    argv = run_cli("shell", "--host", "evil", "--dry-run").stdout.strip()
    res = subprocess.run(["bash", "-c", argv], input=b"pwd\nexit\n", capture_output=True, timeout=60)
    assert "cannot enter that directory" in res.stderr.decode() and not marker.exists(), (res.stdout, res.stderr)


def test_through_a_container_every_layer_quotes_once(proj):  # noqa: F811
    """The same through `pct exec CT --` (the fake pct runs the command inside its own directory): the job's values,
    literal arguments and a shell string each arrive as they were given, and the timeout still ends the group."""
    f = job_file(proj, "boxed", 'env -0 > "$RUN/seen.env"; sleep 300', f"env: {json.dumps(TRICKY)}\n")
    f = Path(f)
    f.write_text(f.read_text().replace("host: box\n", "host: boxpct\n"))
    assert run_cli("deploy", "boxpct").code == 0
    job_id = cli_json("launch", str(f))["id"]
    try:
        got = env0(run_cli("exec", job_id, "--", "env", "-0").stdout.encode())
        assert all(got[k] == v for k, v in TRICKY.items()) and got["DFLASHCTL_EXEC_OF"] == job_id
        res = run_cli("exec", job_id, "--", "printf", "<%s>", "a b", "$(id)", "'q'")
        assert res.code == 0 and res.stdout == "<a b><$(id)><'q'>", res
        res = run_cli("exec", job_id, "--timeout", "1.5", "--", "sleep 4746 & wait")
        assert res.code == 124, res
        wait_until(lambda: pids_with("4746") == [], timeout=30)
    finally:
        run_cli("kill", job_id)
