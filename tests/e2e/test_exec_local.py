"""`exec` on the built-in `local` host, as a script uses it: the command's own exit status every time whatever stdin
is, an ended job's scrubbed secrets unset (never the literal ***), a job whose run dir `gc` removed said as such.
Real tmux, the real CLI; processes looked for in the real process table."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.e2e.test_launch import cli_json, wait_until

# Runs the real CLI (`dflashctl.cli.run`, the console script's function) in forked children of one interpreter that
# imported it once, so that each run costs the command, not the imports, and still ends as a real `dflashctl` process
# ends: through the interpreter's exit, where the stdin reader used to abort it (134, "could not acquire lock for
# <_io.BufferedReader name='<stdin>'>", about one run in five here). Two children at a time. Prints
# {"stdin kind": {"status": count}} and the stdout of any run that printed something unexpected.
DRIVER = r"""
import json, os, sys
from dflashctl import cli
import dflashctl.jobs.execute, dflashctl.remote.connect, dflashctl.remote.transport, dflashctl.show.render

job, rounds, out_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
CASES = [  # (stdin, command, its exit status, its stdout)
    ("devnull", ["echo", "hi"], 0, b"hi\n"),
    ("pipe", ["head -c 3; exit 3"], 3, b"abc"),  # reads part of what it is given, then ends
    ("held", ["echo held; exit 5"], 5, b"held\n"),  # a pipe whose writer stays open until the run has ended
    ("unread", ["exit 7"], 7, b""),  # more than a pipe holds, never read
]
seen, odd, running = {}, [], {}


def reap():
    pid, status = os.wait()
    kind, want, w, path = running.pop(pid)
    if w is not None:
        os.close(w)
    code = os.waitstatus_to_exitcode(status)
    got = open(path, "rb").read()
    seen.setdefault(kind, {}).setdefault(str(code), 0)
    seen[kind][str(code)] += 1
    if got != want:
        odd.append([kind, got.decode(errors="replace")])


for i in range(rounds * len(CASES)):
    kind, argv, _, want = CASES[i % len(CASES)]
    r, w = os.pipe()
    path = os.path.join(out_dir, str(i))
    pid = os.fork()
    if pid == 0:
        os.close(w)
        fd = os.open(os.devnull, os.O_RDONLY) if kind == "devnull" else r
        os.dup2(fd, 0)
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), 1)
        os.dup2(os.open(os.path.join(out_dir, "stderr"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), 2)
        sys.argv = ["dflashctl", "exec", job, "--", *argv]
        cli.run()  # SystemExit: the child ends through the interpreter's exit, as the console script does
    os.close(r)
    if kind == "pipe":
        os.write(w, b"abcdef\n")
    elif kind == "unread":
        os.set_blocking(w, False)
        try:
            while True:
                os.write(w, b"x" * 65536)
        except BlockingIOError:
            pass
    if kind != "held":
        os.close(w)
        w = None
    running[pid] = (kind, want, w, path)
    if len(running) == 2:
        reap()
while running:
    reap()
print(json.dumps({"seen": seen, "odd": odd[:5]}))
"""
WANT = {"devnull": "0", "pipe": "3", "held": "5", "unread": "7"}
ROUNDS = 50  # 200 runs: with the old reader about 1 in 5 of the first two kinds and every "held" run aborted


@pytest.fixture
def local(tmp_path, monkeypatch) -> Path:
    """A project deployed to `local`, with this test's own home, records and hosts."""
    home = tmp_path / "home"
    project = tmp_path / "project"
    home.mkdir()
    project.mkdir()
    (project / "dflashctl.yaml").write_text("hosts: {}\n")
    (project / "tool.sh").write_text("echo tool\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(tmp_path / "state"))
    for var in ("DFLASHCTL_HOSTS", "XDG_CONFIG_HOME", "XDG_STATE_HOME", "SSH_AUTH_SOCK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(project)
    assert run_cli("deploy", "local").code == 0
    return project


def launch(project: Path, name: str, command: str, extra: str = "") -> tuple[str, Path]:
    f = project.parent / f"{name}.yaml"  # outside the tree: the deployed code stays current
    f.write_text(f"name: {name}\nhost: local\nkill_grace_s: 1\ncommand: {json.dumps(command)}\n{extra}")
    job = cli_json("launch", str(f))
    return job["id"], Path(job["run_dir"])


def test_exec_exits_with_the_commands_own_status_every_time_whatever_stdin_is(local, tmp_path):
    job_id, _ = launch(local, "idle", "sleep 300", "watch: {supervise: false}\n")
    try:
        out = tmp_path / "runs"
        out.mkdir()
        proc = subprocess.run(
            [sys.executable, "-c", DRIVER, job_id, str(ROUNDS), str(out)], capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr
        res = json.loads(proc.stdout)
        stderr = (out / "stderr").read_text()
        assert res["seen"] == {kind: {code: ROUNDS} for kind, code in WANT.items()}, (res, stderr[-2000:])
        assert res["odd"] == [] and "Fatal Python error" not in stderr, (res["odd"], stderr[-2000:])
        # and a few through the installed entry point itself, a fresh interpreter each, stdin a pipe
        runs = [
            subprocess.Popen(
                [sys.executable, "-m", "dflashctl", "exec", job_id, "--", "cat; exit 9"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            for _ in range(6)
        ]
        done = [p.communicate(b"in\n", timeout=120) for p in runs]
        assert [(p.returncode, o) for p, (o, _) in zip(runs, done, strict=True)] == [(9, b"in\n")] * 6, done
    finally:
        run_cli("kill", job_id)


SECRET = "tok-3f9a$(touch /nonexistent-dir/x)"


def test_an_ended_jobs_scrubbed_secrets_are_unset_and_said(local):
    """The secrets leave the run dir when the job ends (job.env holds MY_API_TOKEN=***): exec unsets them, even one
    this machine's own environment holds, and says so on stderr; an unquoted `$MY_API_TOKEN` globs nothing."""
    env = {"MY_API_TOKEN": SECRET, "COPY_OF_IT": SECRET, "PLAIN": "kept"}
    job_id, run = launch(
        local, "ended", "exit 0", f"env: {json.dumps(env)}\nwatch: {{supervise: false, restart_on: []}}\n"
    )
    wait_until(lambda: b"MY_API_TOKEN=***\0" in (run / "job.env").read_bytes(), timeout=60)
    assert SECRET.encode() not in (run / "job.env").read_bytes()
    res = run_cli(
        "exec",
        job_id,
        "--",
        'echo "${MY_API_TOKEN-unset}|${COPY_OF_IT-unset}|$PLAIN"; echo $MY_API_TOKEN',
        env={"MY_API_TOKEN": "from-this-laptop"},
    )
    assert res.code == 0 and res.stdout == "unset|unset|kept\n\n", res
    note = [ln for ln in res.stderr.splitlines() if "scrubbed" in ln]
    assert len(note) == 1 and "MY_API_TOKEN" in note[0] and "COPY_OF_IT" in note[0] and "PLAIN" not in note[0], res
    assert "***" not in res.stdout and SECRET not in res.stdout + res.stderr
    # a live job's environment is left whole: nothing is unset before the scrub
    live_id, live_run = launch(local, "live", "sleep 300", f"env: {json.dumps(env)}\nwatch: {{supervise: false}}\n")
    try:
        res = run_cli("exec", live_id, "--", 'printf "%s|" "$MY_API_TOKEN" "$PLAIN"')
        assert res.code == 0 and res.stdout == f"{SECRET}|kept|" and "scrubbed" not in res.stderr, res
    finally:
        run_cli("kill", live_id)


def test_a_removed_job_is_said_removed_by_whom_and_when_and_nothing_runs(local, tmp_path):
    job_id, run = launch(local, "gone", "exit 0", "watch: {supervise: false, restart_on: []}\n")
    wait_until(lambda: (run / "exit_code").exists(), timeout=60)
    old = time.time() - 30 * 86400
    for f in [run, *run.rglob("*")]:
        os.utime(f, (old, old), follow_symlinks=False)
    assert cli_json("gc", "local", "--older-than", "1", "--yes")["removed_ids"] == [job_id] and not run.exists()
    marker = tmp_path / "ran"
    for command in (["exec", job_id, "--", "touch", str(marker)], ["shell", job_id, "--dry-run"]):
        res = run_cli(*command)
        lines = res.stderr.strip().splitlines()
        assert res.code == 2 and len(lines) == 1 and res.stdout == "", res
        assert "removed by" in lines[0] and "@" in lines[0] and "dflashctl gc" in lines[0], lines
        assert time.strftime("%Y-%m-%d") in lines[0] and "No such file" not in lines[0], lines
    assert not marker.exists()


def test_a_run_dir_removed_behind_our_back_is_said_so(local, tmp_path):
    """Removed by hand (or a gc from another machine): the record does not know; the remote says what is gone."""
    job_id, run = launch(local, "byhand", "exit 0", "watch: {supervise: false, restart_on: []}\n")
    wait_until(lambda: (run / "exit_code").exists(), timeout=60)
    subprocess.run(["rm", "-rf", str(run)], check=True)
    marker = tmp_path / "ran"
    res = run_cli("exec", job_id, "--", "touch", str(marker))
    assert res.code == 126 and f"run dir {run} is gone" in res.stderr and not marker.exists(), res


def test_attach_inside_tmux_gets_a_prefix_of_its_own_and_detaches_the_view_not_the_users_session(local):
    """Inside the user's tmux (prefix Ctrl-b), Ctrl-b d went to their tmux and detached their own session. The view
    gets Ctrl-a, says so on its status line, and Ctrl-a d detaches it alone; a later attach outside tmux gets
    Ctrl-b back."""
    from tests.conftest import TEST_TMUX_SOCKET

    job_id, _ = launch(local, "viewed", "sleep 300", "watch: {supervise: false}\n")
    outer = ["tmux", "-L", f"dflashctl-outer-{os.getpid()}", "-f", os.devnull]
    session = ["tmux", "-L", TEST_TMUX_SOCKET]
    try:
        subprocess.run(
            [
                *outer,
                "new-session",
                "-d",
                "-s",
                "mine",
                "-x",
                "150",
                "-y",
                "30",
                f"{sys.executable} -m dflashctl attach {job_id}; echo DETACHED:$?; sleep 300",
            ],
            check=True,
        )
        clients = [*session, "list-clients", "-F", "#{session_name}"]
        pane = [*outer, "capture-pane", "-p", "-t", "=mine:"]
        try:
            wait_until(lambda: job_id in subprocess.run(clients, capture_output=True, text=True).stdout, timeout=60)
        except AssertionError:  # say what the user's pane shows: the attach's own words
            shown = subprocess.run(pane, capture_output=True, text=True).stdout
            raise AssertionError(f"no view of {job_id} attached; the user's pane shows:\n{shown}") from None
        shown = [*session, "show-options", "-t", f"={job_id}:"]
        options = subprocess.run(shown, capture_output=True, text=True).stdout
        assert "prefix C-a" in options and "detach: Ctrl-a d" in options, options
        subprocess.run([*outer, "send-keys", "-t", "=mine:", "C-a", "d"], check=True)
        seen = wait_until(
            lambda: "DETACHED:0" in (s := subprocess.run(pane, capture_output=True, text=True).stdout) and s, timeout=60
        )
        assert "detach it with Ctrl-a d" in seen, seen
        assert subprocess.run([*outer, "has-session", "-t", "=mine"]).returncode == 0  # the user's session is still on
        assert job_id not in subprocess.run(clients, capture_output=True, text=True).stdout
        res = run_cli("attach", job_id, "--dry-run", env={"TMUX": ""})
        assert res.code == 0 and f"set-option -t ={job_id}: -u prefix" in res.stdout, res
    finally:
        subprocess.run([*outer, "kill-server"], capture_output=True)
        run_cli("kill", job_id)


def test_attach_from_a_pane_of_our_own_tmux_server_is_not_refused_as_nesting(local):
    """tmux refuses a client whose terminal is one of the server's own panes ("sessions should be nested with care"),
    and compares against every pane it ever kept, dead ones too: a user pane whose tty name a dead pane once had was
    refused at random in loaded suite runs. Here the terminal IS a pane of the job's own server, so tmux's check is
    certain to fire unless the view's client runs without $TMUX; it attaches (read-only), and detaches."""
    from tests.conftest import TEST_TMUX_SOCKET

    job_id, _ = launch(local, "nested", "sleep 300", "watch: {supervise: false}\n")
    ours = ["tmux", "-L", TEST_TMUX_SOCKET]
    host = f"host-{os.getpid()}"
    # the pane is the shared server's: its environment is the server's, not this test's (its home, records, project)
    env = " ".join(
        shlex.quote(f"{k}={os.environ[k]}") for k in ("HOME", "PATH", "DFLASHCTL_STATE_DIR", "DFLASHCTL_TMUX_SOCKET")
    )
    cmd = (
        f"cd {shlex.quote(os.getcwd())} && env -u DFLASHCTL_HOSTS -u XDG_CONFIG_HOME -u XDG_STATE_HOME {env} "
        f"{sys.executable} -m dflashctl attach {job_id}; echo DETACHED:$?; sleep 300"
    )
    try:
        subprocess.run([*ours, "new-session", "-d", "-s", host, "-x", "150", "-y", "30", cmd], check=True)
        clients = [*ours, "list-clients", "-F", "#{session_name}"]
        pane = [*ours, "capture-pane", "-p", "-t", f"={host}:"]
        try:
            wait_until(lambda: job_id in subprocess.run(clients, capture_output=True, text=True).stdout, timeout=60)
        except AssertionError:
            shown = subprocess.run(pane, capture_output=True, text=True).stdout
            raise AssertionError(f"no view attached; the pane shows:\n{shown}") from None
        subprocess.run([*ours, "detach-client", "-s", f"={job_id}"], check=True)
        wait_until(lambda: "DETACHED:0" in subprocess.run(pane, capture_output=True, text=True).stdout, timeout=60)
    finally:
        subprocess.run([*ours, "kill-session", "-t", f"={host}"], capture_output=True)
        run_cli("kill", job_id)
