"""watch end to end over the real sshd and tmux with the CPU trainer, each fault injected for real."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.conftest import TEST_TMUX_SOCKET, run_cli
from tests.e2e.test_launch import wait_until
from tests.json_names import json_names

ROOT = Path(__file__).resolve().parents[2]
SECRET = "T000SECRET/B111/xyzzy"

TRAINER = """
  target: {random_preset: tiny-qwen3, dtype: float32}
  drafter: {num_layers: 1, block_size: 8}
  attention: {backend: dense}
  data: {anchors_per_seq: 16, seq_buckets: [128], synthetic_samples: 16, holdout: 2}
  device: cpu
  steps: STEPS
  log_every: 5
  heartbeat_s: 0.5
  checkpoint: {every: 10, keep: 2}
  eval: {prompts: 1, max_new_tokens: 8}
"""


class Receiver(ThreadingHTTPServer):
    """A webhook endpoint on loopback that keeps what it is sent."""

    def __init__(self) -> None:
        self.received: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                n = int(self.headers.get("Content-Length", 0))
                outer.received.append({"path": self.path, "body": json.loads(self.rfile.read(n))})
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/hooks/{SECRET}"


def write_job(tmp_path: Path, name: str, steps: int, env: dict | None = None, watch: str = "", trainer_extra: str = ""):
    body = (
        f"name: {name}\nhost: box\nkill_grace_s: 5\n"
        + (f"env: {json.dumps(env)}\n" if env else "")
        + "trainer:"
        + TRAINER.replace("STEPS", str(steps))
        + trainer_extra
        # slow_polls: the throughput rule off. Two test workers share two cores, and a neighbour's CPU-heavy test can
        # cut this job's tokens/s by 4x for seconds: STALLED by design on a real box, a false alarm here
        + "watch:\n  interval_s: 1\n  backoff_s: 0.5\n  slow_polls: 1000\n"
        + watch
    )
    path = tmp_path / f"{name}.yaml"
    path.write_text(body)
    return path


@pytest.fixture
def box(client, tmp_path, monkeypatch):
    """Host `box` on the loopback sshd, this repo deployed to it."""
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(f"hosts:\n  box: {{ssh: testbox, python: {sys.executable}, workdir: {tmp_path / 'remote'}}}\n")
    monkeypatch.setenv("DFLASHCTL_HOSTS", str(hosts))
    monkeypatch.chdir(ROOT)
    assert run_cli("deploy", "box", cwd=ROOT).code == 0
    return tmp_path


def launch(job: Path) -> str:
    res = run_cli("launch", str(job), "--json", cwd=ROOT)
    assert res.code == 0, res.stderr
    return json.loads(res.stdout)["id"]


def watch_json(job_id: str, *extra: str, timeout: float = 400) -> tuple[int, list[dict], str]:
    res = run_cli("watch", job_id, "--json", *extra, cwd=ROOT, timeout=timeout)
    records = [json.loads(line) for line in res.stdout.splitlines()]
    for rec in records:
        assert set(rec) <= json_names("watch"), set(rec) - json_names("watch")  # the documented schema
    return res.code, records, res.stderr


def states(records: list[dict]) -> list[str]:
    out: list[str] = []
    for r in records:
        if not out or out[-1] != r["state"]:
            out.append(r["state"])
    return out


def step_records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines]


def test_clean_run_finishes_with_exit_0_and_notifies_without_leaking_the_secret(box):
    hook = Receiver()
    try:
        job = write_job(box, "clean", 20, watch=f"  notify: {{webhook: '{hook.url}', format: slack}}\n")
        job_id = launch(job)
        code, records, err = watch_json(job_id)
        assert code == 0 and records[-1]["state"] == "FINISHED" and records[-1]["step"] == 20
        assert all(r["remote_commands"] == 1 for r in records[1:])  # one remote command per poll
        assert SECRET not in err and all(SECRET not in json.dumps(r) for r in records)
        assert f"FINISHED: the job's supervisor pages http://127.0.0.1:{hook.server_address[1]}/***" in err
        wait_until(lambda: any(f"{job_id} on box: FINISHED" in m["body"]["text"] for m in hook.received), 60)
        assert all(m["path"] == f"/hooks/{SECRET}" for m in hook.received)
        once = run_cli("watch", job_id, "--once", "--json", cwd=ROOT)
        assert once.code == 0 and json.loads(once.stdout)["state"] == "FINISHED"
    finally:
        hook.shutdown()


def test_crash_is_restarted_and_resumes_from_the_checkpoint(box):
    job = write_job(box, "crashy", 30, env={"TRAINER_FAULT": "crash@15"})
    job_id = launch(job)
    code, records, err = watch_json(job_id)
    seen = states(records)
    assert code == 0 and seen[-1] == "FINISHED", (seen, err)
    said = [e for r in records for e in r["events"]]  # the restart is said in --json, not only counted
    restarts = [e for e in said if e["decision"] == "restart"]
    # whoever restarted it (this watch, or the supervisor between two of its polls), the restart names the crash
    # and its evidence: a poll that never saw CRASHED still says why
    assert [(e["attempt"], e["after"]) for e in restarts] == [(1, "CRASHED")], said
    assert "RuntimeError: injected fault at step 15" in restarts[0]["evidence"][0], restarts
    assert all(r["id"] == job_id and "job" not in r for r in records)
    for crashed in (r for r in records if r["state"] == "CRASHED"):  # seen or not, never a different cause
        assert "RuntimeError: injected fault at step 15" in crashed["evidence"][0]
    assert records[-1]["restarts"] == 1
    run_dir = Path(json.loads(run_cli("status", job_id, "--json", cwd=ROOT).stdout)["run_dir"])
    recs = step_records(run_dir)
    starts = [r for r in recs if r.get("event") == "start"]
    assert [s["resumed_from"] for s in starts] == [None, 10]
    steps = [r["step"] for r in recs if "event" not in r]
    assert steps == list(range(1, 15)) + list(range(11, 31))  # continued from step 10, not from 0
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert any(e["decision"] == "restart" and e["after"] == "CRASHED" for e in events)


def test_a_watch_frozen_across_a_crash_names_the_restart_it_never_saw(box):
    """The watch is frozen (SIGSTOP) before the crash and woken after the supervisor restarted it: no poll of its
    saw CRASHED, and its restart event still says after CRASHED, by the supervisor, with the fault as evidence
    (the cause the decider recorded), never its own last state."""
    job_id = launch(write_job(box, "frozen", 30, env={"TRAINER_FAULT": "crash@25"}))
    watch = subprocess.Popen(
        [sys.executable, "-m", "dflashctl", "watch", job_id, "--json"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = json.loads(watch.stdout.readline())
        watch.send_signal(signal.SIGSTOP)
        run_dir = Path(json.loads(run_cli("status", job_id, "--json", cwd=ROOT).stdout)["run_dir"])
        assert first["state"] in ("STARTING", "RUNNING") and not (run_dir / "exit_code").exists(), first
        wait_until(lambda: (run_dir / "restarts").is_file() and (run_dir / "restarts").read_text().strip() == "1", 300)
    finally:
        watch.send_signal(signal.SIGCONT)
    out, err = watch.communicate(timeout=400)
    records = [first] + [json.loads(x) for x in out.splitlines()]
    assert watch.returncode == 0 and records[-1]["state"] == "FINISHED", (states(records), err[-2000:])
    assert "CRASHED" not in states(records)
    restarts = [e for r in records for e in r["events"] if e["decision"] == "restart"]
    assert [(e["attempt"], e["after"], e["by"]) for e in restarts] == [(1, "CRASHED", "elsewhere (supervisor)")]
    assert "RuntimeError: injected fault at step 25" in restarts[0]["evidence"][0], restarts


def test_dense_fallback_is_reported_with_the_guard_and_never_restarted(box):
    job = write_job(
        box,
        "fallback",
        20,
        env={"TORCH_COMPILE_DISABLE": "1"},
    )
    # decoding with flex on the CPU: its compiled forward exists, so with compile disabled the guard must fire
    job.write_text(job.read_text().replace("eval: {prompts: 1", "eval: {backend: flex, prompts: 1"))
    code, records, _ = watch_json(launch(job))
    assert code == 14 and records[-1]["state"] == "DENSE_FALLBACK" and records[-1]["restarts"] == 0
    assert any("flex guard" in e for e in records[-1]["evidence"])
    assert "Not restarted" in records[-1]["advice"]


def trainer_pid(job_id: str) -> int:
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            env = open(f"/proc/{name}/environ", "rb").read().split(b"\0")
            cmd = open(f"/proc/{name}/cmdline", "rb").read()
        except OSError:
            continue
        if f"DFLASHCTL_JOB_ID={job_id}".encode() in env and b"trainer.train" in cmd and b"bash" not in cmd:
            return int(name)
    raise AssertionError("trainer process not found")


@pytest.mark.slow
def test_sigstop_is_stalled_then_restarted(box):
    job = write_job(
        box,
        "frozen",
        100000,
        env={"TRAINER_FAULT": "pace@100"},  # alive for long, at little CPU
        watch="  stall_after_s: 6\n  heartbeat_max_age_s: 4\n  max_restarts: 1\n",
    )
    job_id = launch(job)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflashctl", "watch", job_id, "--json"], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    seen: list[dict] = []
    try:
        stopped_at = None
        for line in proc.stdout:
            rec = json.loads(line)
            seen.append(rec)
            if rec["state"] == "RUNNING" and stopped_at is None:
                os.kill(trainer_pid(job_id), signal.SIGSTOP)
                stopped_at = time.monotonic()
            if rec["state"] == "STALLED":
                assert time.monotonic() - stopped_at < 6 + 2 * 1 + 3  # stall_after plus two polls (+ poll time)
            if rec["restarts"] == 1 and rec["state"] == "RUNNING":
                break
    finally:
        proc.terminate()
        proc.wait(10)
        run_cli("kill", job_id, "--grace", "1", cwd=ROOT)
    assert seen[-1]["restarts"] == 1, states(seen)
    # the stall is named whether a poll saw STALLED or the supervisor restarted it between two polls (then the polls
    # during its restart say STARTING, "a restart is in progress", and the restart event repeats its cause)
    restarts = [e for r in seen for e in r["events"] if e["decision"] == "restart"]
    assert [(e["attempt"], e["after"]) for e in restarts] == [(1, "STALLED")], restarts
    for why in [restarts[0]["reason"]] + [r["reason"] for r in seen if r["state"] == "STALLED"]:
        assert "heartbeat" in why or "no step progress" in why, seen


@pytest.mark.slow
def test_unreachable_host_then_back_keeps_state_and_does_not_restart(box, sshd):
    job_id = launch(write_job(box, "flaky", 60, env={"TRAINER_FAULT": "pace@250"}))  # 15 s of steps, little CPU
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflashctl", "watch", job_id, "--json"], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    seen: list[dict] = []
    try:
        for line in proc.stdout:
            rec = json.loads(line)
            seen.append(rec)
            if rec["state"] == "RUNNING" and "UNREACHABLE" not in states(seen) and sshd.proc is not None:
                sshd.stop(drop_sessions=True)  # its open sessions too, like a reboot
            if rec["state"] == "UNREACHABLE" and sshd.proc is None:
                time.sleep(2)
                sshd.start()
            if rec["state"] in ("FINISHED", "CRASHED", "LOST"):
                break
    finally:
        if sshd.proc is None:
            sshd.start()
        proc.wait(120)
    seq = states(seen)
    assert "UNREACHABLE" in seq and seq[-1] == "FINISHED", seq
    unreachable = next(r for r in seen if r["state"] == "UNREACHABLE")
    assert "last state RUNNING" in unreachable["evidence"][0]
    assert seen[-1]["restarts"] == 0


def test_killed_tmux_server_is_lost(box):
    job = box / "sleeper.yaml"
    job.write_text("name: sleeper\nhost: box\ncommand: sleep 300\nwatch: {interval_s: 1}\n")
    job_id = launch(job)
    code, records, _ = watch_json(job_id, "--once")
    assert code == 0 and records[-1]["state"] == "RUNNING"
    subprocess.run(["tmux", "-L", TEST_TMUX_SOCKET, "kill-server"], check=False)  # the tests' own server
    code, records, _ = watch_json(job_id, "--once")
    assert code == 16 and records[-1]["state"] == "LOST" and "tmux session" in records[-1]["reason"]
