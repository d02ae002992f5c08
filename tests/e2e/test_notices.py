"""A voice to trust at 3 a.m. (issue 60), each case with real processes: the suite's loopback sshd, real tmux, the
real supervisor, and a real webhook listener on loopback that can be slow, redirect or never answer. One page per
event whoever sends it; a kill pages; a slow webhook is POSTed once per notice across the supervisor, a watch and
`status`; a redirect is a failed delivery said where the user looks; waiting notices never hold `status` up; a
file the job writes stops no decider; a percent-encoded password reaches no output."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote_plus

import pytest

from dflashctl.agent import outbox
from tests.conftest import run_cli
from tests.e2e.test_kill_watch_launch_under_faults import job_file, run_dir_of
from tests.e2e.test_launch import alive, cli_json, status_json, wait_until, write_project
from tests.webhook import HOOK_SECRET, Listener, closed_port

PASSWORD = "s3cr3t/pa ss+word@db"
FAIL = f"{sys.executable} -c 'raise RuntimeError(\"boom\")'"


@pytest.fixture
def proj(client, tmp_path):
    p = write_project(client, tmp_path)
    assert run_cli("deploy", "box").code == 0
    return p


def hooked(
    url: str, *, restart_on: str = "[]", max_restarts: int = 0, retries: int = 3, timeout_s: float = 5, extra: str = ""
) -> str:
    return (
        f"watch: {{interval_s: 0.5, backoff_s: 0, max_restarts: {max_restarts}, restart_on: {restart_on}, "
        f"stall_after_s: 600,\n        notify: {{webhook: '{url}', format: json, retries: {retries}, "
        f"timeout_s: {timeout_s}}}}}\n{extra}"
    )


def supervisor_ended(run: Path) -> bool:
    path = run / "supervisor.json"
    return path.exists() and bool(json.loads(path.read_text()).get("ended"))


def test_a_crash_outside_restart_on_is_one_page_with_what_is_done(proj):
    hook = Listener()
    try:
        job_id = cli_json("launch", job_file(proj, "once", FAIL, hooked(hook.url(), max_restarts=3)))["id"]
        run = run_dir_of(job_id)
        wait_until(lambda: supervisor_ended(run), 60)
        time.sleep(1.0)
        assert len(hook.posts()) == 1, hook.bodies()
        page = hook.bodies()[0]
        assert page["state"] == "CRASHED" and page["action"] == "not restarted: CRASHED is not in the job's restart_on"
        assert page["restarts_left"] == 0 and page["host"] == "box" and any("boom" in e for e in page["evidence"])
        run_cli("status", job_id)
        run_cli("watch", job_id, "--once")
        assert len(hook.posts()) == 1, "a later look pages nothing more"
    finally:
        hook.close()


def test_a_kill_pages_once_even_when_a_watch_saw_it(proj):
    hook = Listener()
    try:
        job_id = cli_json("launch", job_file(proj, "killme", "sleep 300", hooked(hook.url())))["id"]
        run = run_dir_of(job_id)
        wait_until(lambda: (run / "verdict.json").exists(), 30)
        killed = cli_json("kill", job_id)
        assert killed["result"] == "KILLED" and killed["notices"]["sent"] == 1, killed
        run_cli("watch", job_id, "--once")  # sees KILLED too: the same notice, not a second one
        assert [(b["state"], b["id"]) for b in hook.bodies()] == [("KILLED", f"{job_id}/end-KILLED")]
        assert hook.bodies()[0]["host"] == "box"
    finally:
        hook.close()


def test_a_slow_webhook_gets_one_post_per_notice_from_supervisor_watch_and_status(proj):
    """The listener takes each POST and answers after 25 s; the job's timeout_s is 3. The supervisor's one POST per
    notice is unconfirmed, never repeated; a watch and two `status` calls add none; `status` answers in its probe's
    time plus at most its send budget, and `notices` shows the delivery."""
    hook = Listener(mode="slow", delay_s=25)
    try:
        extra = hooked(hook.url(), restart_on="[CRASHED]", max_restarts=1, timeout_s=3)
        job_id = cli_json("launch", job_file(proj, "slowhook", FAIL, extra))["id"]
        run = run_dir_of(job_id)
        watch = subprocess.Popen(
            [sys.executable, "-m", "dflashctl", "watch", job_id, "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_until(lambda: supervisor_ended(run), 120)
            for _ in range(2):
                t0 = time.monotonic()
                st = status_json(job_id)
                assert time.monotonic() - t0 < 15, "status is not held up by the webhook"
            watch.wait(60)
        finally:
            if watch.poll() is None:
                watch.kill()
                watch.wait()
        keys = hook.keys()
        assert sorted(keys) == sorted({f"{job_id}/a0-CRASHED", f"{job_id}/a1-CRASHED"}), keys
        box = {n["id"]: n for n in outbox.listing(str(run))}
        assert {n["status"] for n in box.values()} == {"unconfirmed"} and all(n["posts"] == 1 for n in box.values())
        assert st["notices"]["unconfirmed"] == 2 and st["notices"]["waiting"] == 0
        shown = run_cli("notices", job_id)
        assert shown.code == 0 and "unconfirmed" in shown.stdout and HOOK_SECRET not in shown.stdout + shown.stderr
    finally:
        hook.close()


def test_a_redirecting_webhook_is_a_failed_delivery_named_and_never_followed(proj):
    hook = Listener(mode="redirect")
    try:
        job_id = cli_json("launch", job_file(proj, "moved", FAIL, hooked(hook.url(), retries=0)))["id"]
        run = run_dir_of(job_id)
        wait_until(lambda: supervisor_ended(run), 60)
        assert [h["method"] for h in hook.hits] == ["POST"], "the redirect was not followed"
        log = cli_json("notices", job_id)
        assert [n["status"] for n in log["notices"]] == ["failed"]
        said = log["notices"][0]["log"][0]["result"]
        assert "redirected (302)" in said and f"127.0.0.1:{hook.port}/***" in said and HOOK_SECRET not in said
        st = status_json(job_id)
        assert st["notices"]["failed"] == 1
        text = run_cli("status", job_id)
        assert "1 failed to deliver" in text.stdout
    finally:
        hook.close()


def test_waiting_notices_and_a_webhook_that_never_answers_do_not_hold_up_status(proj):
    """24 notices wait (the job planted none of them: the decider's own, put as the supervisor would) for a webhook
    host that never answers: `status` answers within its probe's time plus its budget, and says how many wait."""
    hook = Listener(mode="silent")
    try:
        job_id = cli_json("launch", job_file(proj, "backlog", "sleep 300", hooked(hook.url(), timeout_s=20)))["id"]
        run = run_dir_of(job_id)
        for i in range(24):
            outbox.put(
                str(run),
                {
                    "id": f"a0-N{i}",
                    "job": job_id,
                    "host": "box",
                    "state": "STALLED",
                    "reason": "r",
                    "evidence": [],
                    "advice": None,
                    "restarts": 0,
                    "time": time.time(),
                },
                4,
            )
        probe_only = time.monotonic()
        run_cli("exec", job_id, "--", "true")
        one_call = time.monotonic() - probe_only
        t0 = time.monotonic()
        st = status_json(job_id)
        took = time.monotonic() - t0
        assert took < one_call * 3 + 6, (took, one_call)  # a bound on a hang, not a speed
        assert st["notices"]["waiting"] >= 16, st["notices"]
        assert run_cli("kill", job_id).code == 0
    finally:
        hook.close()


def test_files_the_job_writes_into_its_run_dir_stop_no_decider(proj):
    """The job plants a FIFO at restart_cause.json, 60,000 nested `[` in progress.json, two `{}` notices in its
    outbox and a symlink for its heartbeat, then crashes: the supervisor still restarts it by its policy and pages
    each failure, `status` answers and names what it set aside, and `watch --once` agrees."""
    plant = (
        'mkfifo "$DFLASHCTL_RUN_DIR/restart_cause.json" 2>/dev/null; '
        'python3 -c "import sys; sys.stdout.write(\\"[\\" * 60000)" > "$DFLASHCTL_RUN_DIR/progress.json"; '
        'mkdir -p "$DFLASHCTL_RUN_DIR/outbox"; echo "{}" > "$DFLASHCTL_RUN_DIR/outbox/x1.json"; '
        'echo "{}" > "$DFLASHCTL_RUN_DIR/outbox/x2.json"; ln -sf /dev/zero "$DFLASHCTL_RUN_DIR/heartbeat"; '
        f"{FAIL}"
    )
    hook = Listener()
    try:
        job_id = cli_json(
            "launch", job_file(proj, "planter", plant, hooked(hook.url(), restart_on="[CRASHED]", max_restarts=1))
        )["id"]
        run = run_dir_of(job_id)
        wait_until(lambda: supervisor_ended(run), 90)
        assert json.loads((run / "supervisor.json").read_text())["ended"].startswith("CRASHED: max_restarts")
        wait_until(lambda: len(hook.posts()) >= 2, 30)
        assert sorted(b["id"] for b in hook.bodies()) == [f"{job_id}/a0-CRASHED", f"{job_id}/a1-CRASHED"]
        st = status_json(job_id)
        assert st["state"] == "CRASHED"
        once = json.loads(run_cli("watch", job_id, "--once", "--json").stdout)
        assert once["state"] == "CRASHED"
        aside = " ".join(st["evidence"] + once["evidence"])
        # the restart and the progress history replaced their files with ours; the job's heartbeat link is still
        # there, and named
        assert "heartbeat: a symbolic link" in aside, st["evidence"]
    finally:
        hook.close()


def test_a_percent_encoded_password_reaches_no_output_and_dry_run_masks_the_webhook(proj):
    """The job prints its database URL as SQLAlchemy does (the password percent-encoded) and crashes: the page,
    `status --json`, verdict.json and events.jsonl show none of it. `launch --dry-run` shows the webhook as
    scheme://host:port/***."""
    hook = Listener()
    try:
        url = f"postgresql://app:{quote_plus(PASSWORD)}@db:5432/x"
        cmd = f'echo "connecting to {url}"; {sys.executable} -c \'raise RuntimeError("cannot reach {url}")\''
        extra = hooked(hook.url(), extra=f"env: {{DB_PASSWORD: '{PASSWORD}'}}\n")
        path = job_file(proj, "dburl", cmd, extra)
        dry = run_cli("launch", path, "--dry-run")
        assert dry.code == 0 and HOOK_SECRET not in dry.stdout + dry.stderr
        assert f"http://127.0.0.1:{hook.port}/***" in dry.stdout
        job_id = cli_json("launch", path)["id"]
        run = run_dir_of(job_id)
        wait_until(lambda: supervisor_ended(run), 60)
        wait_until(lambda: hook.posts(), 30)
        outputs = {
            "page": json.dumps(hook.bodies()),
            "status": json.dumps(status_json(job_id)),
            "verdict": (run / "verdict.json").read_text(),
            "events": (run / "events.jsonl").read_text(),
        }
        for where, text in outputs.items():
            assert quote_plus(PASSWORD) not in text and PASSWORD not in text, where
        assert "postgresql://app:***@db" in outputs["page"], outputs["page"]
    finally:
        hook.close()


def test_ls_forget_refuses_a_job_whose_restart_is_pending_and_takes_a_name(proj):
    """A job crashed with a restart still owed (no supervisor: `supervise: false`, a watch would restart it):
    `ls --forget NAME` asks the host and refuses, pointing at `kill`; `--force` forgets it."""
    job_id = cli_json(
        "launch", job_file(proj, "owed", FAIL, "watch: {supervise: false, max_restarts: 2, restart_on: [CRASHED]}\n")
    )["id"]
    wait_until(lambda: status_json(job_id)["state"] == "CRASHED", 30)
    res = run_cli("ls", "--forget", "owed")
    assert res.code == 2 and "restart pending" in res.stderr and "dflashctl kill owed" in res.stderr, res.stderr
    assert any(j["id"] == job_id for j in cli_json("ls")["jobs"])
    gone = run_cli("ls", "--forget", "owed", "--force", "--json")
    assert gone.code == 0 and json.loads(gone.stdout)["forgotten"] == job_id
    assert not any(j["id"] == job_id for j in cli_json("ls")["jobs"])


def test_a_frozen_supervisor_and_a_watch_page_the_crash_once(proj):
    """The supervisor is frozen (SIGSTOP) with a watch attached; the job crashes: the watch decides and pages; the
    supervisor, thawed, sees the same event and makes the same notice: one delivery."""
    hook = Listener()
    wait_file = proj.parent / "go"
    cmd = f'while [ ! -e "{wait_file}" ]; do sleep 0.2; done; {FAIL}'
    job_id = cli_json("launch", job_file(proj, "frozen", cmd, hooked(hook.url())))["id"]
    run = run_dir_of(job_id)
    sup = wait_until(
        lambda: (run / "supervisor.json").exists() and json.loads((run / "supervisor.json").read_text()), 30
    )
    os.kill(sup["pid"], signal.SIGSTOP)
    watch = subprocess.Popen(
        [sys.executable, "-m", "dflashctl", "watch", job_id, "--json", "--interval", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(14)  # the supervisor's heartbeat goes stale: the watch decides
        wait_file.write_text("go")
        watch.wait(90)
        assert [b["id"] for b in hook.bodies()] == [f"{job_id}/a0-CRASHED"], hook.bodies()
        os.kill(sup["pid"], signal.SIGCONT)
        wait_until(lambda: not alive(sup["pid"]), 60)
        time.sleep(1.0)
        assert len(hook.posts()) == 1, hook.bodies()
    finally:
        if alive(sup["pid"]):
            os.kill(sup["pid"], signal.SIGCONT)
        if watch.poll() is None:
            watch.kill()
            watch.wait()
        hook.close()


def test_a_webhook_port_that_refuses_is_retried_within_the_bound(proj):
    """Connection refused: the supervisor tries, backs off and leaves the notice pending; its POSTs stay within the
    job's retries + 1 whoever tries after (here `status` calls)."""
    port = closed_port()
    url = f"http://127.0.0.1:{port}/hooks/{HOOK_SECRET}"
    job_id = cli_json("launch", job_file(proj, "refused", FAIL, hooked(url, retries=1)))["id"]
    run = run_dir_of(job_id)
    wait_until(lambda: supervisor_ended(run), 60)
    for _ in range(3):
        status_json(job_id)
    box = outbox.listing(str(run))
    assert len(box) == 1 and box[0]["posts"] <= 2 and box[0]["status"] in ("pending", "failed"), box
    if box[0]["posts"] == 2:
        assert box[0]["status"] == "failed"
