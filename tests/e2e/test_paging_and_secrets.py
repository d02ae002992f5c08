"""The user is paged with nobody watching, and no secret is in anything we write or show (issue 49 parts 4 and 5, issue
50 part 4): the job's supervisor sends its notices itself to a real webhook listener on loopback; what it cannot send
waits in the run dir's outbox and the next `status` sends it, once; a job that prints its token and a multi-line key
leaves them in none of status/watch/kill --json, verdict.json, events.jsonl, the registry, the webhook or `logs`,
and once it has ended for good no line of them is left at rest. Real sshd on loopback, tmux, processes, HTTP."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dflashctl.agent.common import start_time
from tests.conftest import free_port, run_cli
from tests.e2e.test_kill_watch_launch_under_faults import job_file, run_dir_of
from tests.e2e.test_launch import cli_json, status_json, wait_until, write_project
from tests.webhook import HOOK_SECRET, Listener

TOKEN = "hf_Pg7tokenVALUE42"
PEM_LINES = [
    "-----BEGIN PRIVATE KEY-----",
    "MIIEvQIBADANBgkqhkiG9w0BAQEFAASC",
    "q1w2e3r4t5y6u7i8o9p0ZXCVBNMasdf",
    "-----END PRIVATE KEY-----",
]
# what must never appear: the token, every line of the key but its armour (the armour is no secret, yet masked too)
SECRETS = [TOKEN, PEM_LINES[1], PEM_LINES[2], HOOK_SECRET]
# prints the token and the key, then fails at once with the token in its error
CRASH = (
    f'printf \'%s\\n\' "token=$HF_TOKEN" "$PEM_KEY"; {sys.executable} -c '
    '\'import os; raise RuntimeError("bad token=" + os.environ["HF_TOKEN"])\''
)


@pytest.fixture
def proj(client, tmp_path):
    p = write_project(client, tmp_path)
    assert run_cli("deploy", "box").code == 0
    return p


def crash_job(proj: Path, name: str, url: str) -> str:
    pem = "\\n".join(PEM_LINES)
    extra = (
        f'env: {{HF_TOKEN: {TOKEN}, PEM_KEY: "{pem}\\n"}}\n'
        "watch: {interval_s: 0.5, backoff_s: 0, max_restarts: 1, restart_on: [CRASHED], stall_after_s: 600,\n"
        f"        notify: {{webhook: '{url}', format: json, retries: 2, timeout_s: 5}}}}\n"
    )
    return job_file(proj, name, CRASH, extra)


def supervisor_ended(run: Path) -> bool:
    path = run / "supervisor.json"
    return path.exists() and bool(json.loads(path.read_text()).get("ended"))


def leaks(text: str) -> list[str]:
    return [s for s in SECRETS if s in text]


def files_holding(root: Path) -> dict[str, list[str]]:
    found = {}
    for f in root.rglob("*"):
        if f.is_file():
            held = leaks(f.read_bytes().decode(errors="replace"))
            if held:
                found[str(f.relative_to(root))] = held
    return found


def test_the_supervisor_pages_once_with_no_watch_and_no_secret_goes_anywhere(proj, client):
    """HEADLINE: the laptop's watch is SIGKILLed; the job crashes at once, is restarted once by its supervisor and
    crashes again; the listener gets exactly two notices, one per failure and each with what was done about it
    (restarted 1 of 1; not restarted, the budget spent), naming the job, its host as the job file names it,
    restarts left and the command to look, with no secret; a later `status` and `watch` send nothing more. The
    secrets are in no output and no file we wrote, and no line of them is left in run.sh / job.env."""
    hook = Listener()
    try:
        job_id = cli_json("launch", crash_job(proj, "pager", hook.url()))["id"]
        watch = subprocess.Popen(
            [sys.executable, "-m", "dflashctl", "watch", job_id, "--json"], stdout=subprocess.PIPE, text=True
        )
        watch.stdout.readline()
        watch.send_signal(signal.SIGKILL)
        watch.wait()
        run = run_dir_of(job_id)
        wait_until(lambda: supervisor_ended(run), 90)
        assert hook.states() == ["CRASHED", "CRASHED"], hook.hits
        first, crashed = hook.bodies()
        assert first["action"] == "restarted (1 of 1)" and first["id"] == f"{job_id}/a0-CRASHED"
        assert crashed["action"] == "not restarted: max_restarts (1) reached"
        assert crashed["id"] == f"{job_id}/a1-CRASHED"
        assert hook.posts()[1]["path"] == f"/hooks/{HOOK_SECRET}" and crashed["job"] == job_id
        assert hook.keys() == [first["id"], crashed["id"]] and crashed["host"] == "box"
        assert crashed["restarts_left"] == 0 and crashed["look"] == f"dflashctl status {job_id}"
        assert any("RuntimeError" in e for e in crashed["evidence"]), crashed
        assert not leaks(json.dumps(hook.bodies())), hook.hits
        # every output a user or a script reads
        outputs = {}
        for args in (
            ("status", job_id, "--json"),
            ("watch", job_id, "--json", "--once"),
            ("logs", job_id, "-n", "50"),
            ("report", job_id, "--json"),
            ("kill", job_id, "--json"),
            ("ls", "--json"),
        ):
            res = run_cli(*args)
            outputs[args[0]] = res.stdout + res.stderr
        assert "RuntimeError" in outputs["status"] and "***" in outputs["logs"], outputs
        later = run_cli("watch", job_id, "--once")  # a watch begun after the restarts: none of them seen "after None"
        assert "after None" not in later.stdout + later.stderr, later
        assert {k: leaks(v) for k, v in outputs.items() if leaks(v)} == {}
        assert hook.states() == ["CRASHED", "CRASHED"], "a later status/watch sent a notice again"
        # every file we wrote: the run dir but the job's own log (it printed them), the local registry
        held = files_holding(run)
        assert set(held) <= {"train.log"}, held
        # the registry keeps the webhook URL (0600: the laptop sends what waits through it), never a job's secret
        registry = files_holding(client.home / ".local" / "state")
        assert all(held == [HOOK_SECRET] and name.startswith("dflashctl/jobs.json") for name, held in registry.items())
        sent = [
            e for e in map(json.loads, (run / "events.jsonl").read_text().splitlines()) if e.get("decision") == "notify"
        ]
        assert [(e["state"], e["by"], e["status"]) for e in sent] == [("CRASHED", "supervisor", "sent")] * 2
        assert b"HF_TOKEN=***\0" in (run / "job.env").read_bytes()  # the environment's one file at rest
    finally:
        hook.close()


def test_a_notice_the_supervisor_cannot_send_waits_and_the_next_status_sends_it_once(proj):
    """The webhook is down while the job crashes for good (max_restarts 1: two notices): each waits in the run
    dir's outbox after the supervisor's one try; the listener comes up; the next `status` sends each once (said in
    the run dir's events as sent by the laptop) and says none waits; a second `status` and a `watch --once` send
    nothing."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/hooks/{HOOK_SECRET}"
    job_id = cli_json("launch", crash_job(proj, "unheard", url))["id"]
    run = run_dir_of(job_id)
    wait_until(lambda: supervisor_ended(run), 90)
    box = {p.name: json.loads(p.read_text()) for p in (run / "outbox").glob("*.json")}
    assert sorted(box) == ["a0-CRASHED.json", "a1-CRASHED.json"], box
    assert all(n["status"] == "pending" and 1 <= n["posts"] < n["max_posts"] for n in box.values()), box
    hook = Listener(port)
    try:
        st = status_json(job_id)
        assert hook.states() == ["CRASHED", "CRASHED"], hook.hits
        assert st["notices"]["waiting"] == 0 and st["notices"]["sent"] == 2, st["notices"]
        run_cli("status", job_id)
        run_cli("watch", job_id, "--once")
        assert len(hook.posts()) == 2
        assert not leaks(json.dumps(hook.bodies()))
        box = {p.name: json.loads(p.read_text()) for p in (run / "outbox").glob("*.json")}
        assert [n["status"] for n in box.values()] == ["sent", "sent"]
        events = [json.loads(ln) for ln in (run / "events.jsonl").read_text().splitlines()]
        assert sorted(e["id"] for e in events if e.get("decision") == "notify" and e["by"] == "local") == [
            "a0-CRASHED",
            "a1-CRASHED",
        ]
    finally:
        hook.close()


def test_secrets_leave_the_run_dir_whole_at_a_kill_and_without_a_supervisor(proj):
    """A multi-line key at rest: a verified kill scrubs every line of it from job.env (the job's environment at
    rest: run.sh reads it); a job with `supervise: false`
    whose attempt ends with no restart to follow (max_restarts 0) is scrubbed by its launcher at its own end; one
    with restarts left keeps them (a watch may restart it from job.env); one whose failure its restart_on does not
    restart is scrubbed by the next `status`, which judged it."""
    pem = "\\n".join(PEM_LINES)
    env = f'env: {{HF_TOKEN: {TOKEN}, PEM_KEY: "{pem}\\n"}}\n'
    killed = cli_json("launch", job_file(proj, "killed", "sleep 300", env))["id"]
    run = run_dir_of(killed)
    assert PEM_LINES[2] in (run / "job.env").read_text()
    assert run_cli("kill", killed).code == 0
    assert files_holding(run) == {}
    alone = "watch: {supervise: false, max_restarts: 0}\n"
    done = cli_json("launch", job_file(proj, "alone", "exit 4", env + alone))["id"]
    run = run_dir_of(done)
    wait_until(lambda: "PEM_KEY=***\0" in (run / "job.env").read_text(), 60)
    assert (run / "exit_code").read_text().strip() == "4" and not (run / "supervise.json").exists()
    assert files_holding(run) == {}
    hopeful = "watch: {supervise: false, max_restarts: 2, restart_on: [CRASHED]}\n"
    kept = cli_json("launch", job_file(proj, "hopeful", "exit 4", env + hopeful))["id"]
    run = run_dir_of(kept)
    # the launcher has exited (its pane is dead): what it would have scrubbed, it would have by now
    wait_until(lambda: json.loads(run_cli("status", kept, "--json").stdout)["session"] == "dead", 60)
    assert PEM_LINES[2] in (run / "job.env").read_text()
    # one that crashed where its restart_on does not restart: the launcher could not know, the next `status` does
    other = "watch: {supervise: false, max_restarts: 2, restart_on: [OOM]}\n"
    judged = cli_json("launch", job_file(proj, "judged", "exit 4", env + other))["id"]
    run = Path(next(j["run_dir"] for j in cli_json("ls")["jobs"] if j["id"] == judged))  # no status: it would judge
    wait_until(lambda: (run / "exit_code").exists() and (run / "wrapper.pid").exists(), 60)
    launcher = json.loads((run / "wrapper.pid").read_text())["pid"]
    # its launcher has ended, scrubbing nothing (a zombie has ended too: tmux reaps its pane's process at its leisure)
    wait_until(lambda: start_time(launcher) is None, 60)
    assert PEM_LINES[2] in (run / "job.env").read_text()
    st = json.loads(run_cli("status", judged, "--json").stdout)
    assert st["state"] == "CRASHED" and files_holding(run) == {}
