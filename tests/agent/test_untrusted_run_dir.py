"""The run dir is untrusted input: the job can write every file in it. Every reader is thrown every kind of garbage
at every name we read (a FIFO, a symlink, a directory, deep JSON, a huge file, non-UTF-8, wrong types, `{}`): the
probe answers, the decider decides, the supervisor takes its turn, all within a bound, and what was set aside is
named in the evidence. Real files, real FIFOs, the real probe and supervisor code; hypothesis picks the mixes."""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflashctl.agent import files, outbox, snapshot
from dflashctl.agent.supervise import Supervisor
from dflashctl.judge.decider import Decider, Look
from dflashctl.judge.facts import Thresholds
from dflashctl.judge.policy import Policy
from dflashctl.judge.report import Judge

# every file of a run dir a look, a decision or a delivery reads
NAMES = [
    "restart_cause.json",
    "verdict.json",
    "supervisor.json",
    "supervisor.beat",
    "supervisor.final",
    "progress.json",
    "stop_request",
    "stop_result",
    "wrapper.pid",
    "exit_code",
    "restarts",
    "heartbeat",
    "metrics.jsonl",
    "train.log",
    "job.json",
    "supervise.json",
    ".redact.json",
    "job.env",
    "run.sh",
    "events.jsonl",
    "gpu.jsonl",
    "outbox",
    "outbox/a0-CRASHED.json",
    "outbox/.lock",
    "progress.json.lock",
    "slurm_job",
    "agent.pyz",
]
KINDS = ["fifo", "symlink", "dangling", "directory", "deep", "huge", "binary", "types", "empty_object", "empty"]


def plant(run: Path, name: str, kind: str) -> None:
    path = run / name
    if not path.parent.is_dir() or path.parent.is_symlink():  # its folder is garbage already (planted before it)
        return
    if path.is_dir() and not path.is_symlink():
        for child in path.iterdir():
            child.unlink() if not child.is_dir() else None
        if kind != "directory":
            try:
                path.rmdir()
            except OSError:
                return
    elif path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":
        path.symlink_to("/dev/zero")
    elif kind == "dangling":
        path.symlink_to(run / "nowhere" / "x")
    elif kind == "directory":
        path.mkdir(exist_ok=True)
    elif kind == "deep":
        path.write_text("[" * 60000 + "]" * 60000)
    elif kind == "huge":
        with open(path, "wb") as f:  # sparse: 2 GiB that takes no disk
            f.truncate(2 << 30)
    elif kind == "binary":
        path.write_bytes(b"\xff\xfe\x00\x9c garbage \x00" * 100)
    elif kind == "types":
        path.write_text(
            json.dumps(
                {
                    "pid": "x",
                    "start": [],
                    "beat": {},
                    "time": "noon",
                    "mono": None,
                    "state": 7,
                    "restarts": "many",
                    "attempt": True,
                    "evidence": "one",
                    "message": [],
                    "gave_up": 3,
                    "notify": "x",
                    "watch": [],
                    "secret_names": {},
                }
            )
        )
    elif kind == "empty_object":
        path.write_text("{}")
    else:
        path.write_text("")


def base_run(root: Path) -> Path:
    run = root / "run"
    run.mkdir()
    spec = {
        "session": "dflashctl-nosuch",
        "job_id": "garbage-job",
        "host": "box",
        "grace_s": 1,
        "args": [],
        "is_trainer": False,
        "gpus": [],
        "watch": {"interval_s": 1, "restart_on": [], "max_restarts": 0},
        "notify": {"webhook": "http://127.0.0.1:9/x", "retries": 0, "timeout_s": 1},
    }
    (run / "supervise.json").write_text(json.dumps(spec))
    (run / "train.log").write_text("step 1\nTraceback (most recent call last):\nRuntimeError: boom\n")
    (run / "exit_code").write_text("1\n")
    (run / "job.json").write_text(json.dumps({"id": "garbage-job", "secret_names": ["HF_TOKEN"]}))
    (run / "job.env").write_bytes(b"HF_TOKEN=hf_secretvalue\0")
    outbox.put(
        str(run),
        {
            "id": "a0-CRASHED",
            "job": "garbage-job",
            "host": "box",
            "state": "CRASHED",
            "reason": "r",
            "evidence": [],
            "advice": None,
            "restarts": 0,
            "time": 1.0,
        },
    )
    return run


def bounded(fn, seconds: float = 30.0):
    """fn() in a thread: its answer, or the test fails when it does not come back in time (a hang)."""
    box: dict = {}

    def work() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - reported below, with its type
            box["error"] = e

    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn} did not come back in {seconds} s (blocked on a file?)"
    if "error" in box:
        raise box["error"]
    return box["value"]


def decide(snap: dict):
    judge = Judge("garbage-job", "box", Thresholds(), is_trainer=False)
    d = Decider([judge], ["box"], Policy((), 0, 0.0), "watch", "garbage-job", "box")
    return d.take([Look(snap)], time.monotonic())


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(NAMES), st.sampled_from(KINDS), min_size=1, max_size=4))
def test_every_reader_survives_every_garbage_at_every_name(planted):
    with tempfile.TemporaryDirectory() as tmp:
        run = base_run(Path(tmp))
        for name, kind in sorted(planted.items()):
            plant(run, name, kind)
        req = {
            "run_dir": str(run),
            "session": "dflashctl-nosuch",
            "job_id": "garbage-job",
            "gpus": False,
            "claim_notices": True,
            "figures": True,
            "put_notices": [
                {
                    "id": "a1-X",
                    "job": "garbage-job",
                    "host": "box",
                    "state": "X",
                    "reason": "",
                    "evidence": [],
                    "restarts": 0,
                    "time": 1.0,
                }
            ],
        }
        snap = bounded(lambda: snapshot.snapshot(req))
        assert isinstance(snap, dict) and snap["run_dir_exists"]
        json.dumps(snap)  # what goes back over the wire is JSON
        turn = bounded(lambda: decide(snap))
        assert turn.report.state and turn.report.evidence
        for line in snap.get("set_aside") or []:
            assert any(line in e for e in turn.report.evidence) or len(snap["set_aside"]) > 5, line
        bounded(lambda: outbox.listing(str(run)))
        bounded(lambda: files.tail_lines(str(run / "train.log"), 10, 1 << 20))
        spec = (
            json.loads((Path(tmp) / "run" / "supervise.json").read_text())
            if planted.get("supervise.json") is None
            else None
        )
        if spec is not None:  # the supervisor reads its spec once, at its start; a turn after that reads the rest
            sup = Supervisor(str(run), spec)
            ended = bounded(lambda: sup.turn())
            assert ended is None or isinstance(ended, str)


def test_a_fifo_where_the_restart_cause_goes_is_named_and_blocks_nothing(tmp_path):
    """The issue's case: a FIFO at restart_cause.json blocked the supervisor before its first heartbeat and hung
    `status`. Now the look comes back and its evidence names it."""
    run = base_run(tmp_path)
    os.mkfifo(run / "restart_cause.json")
    snap = bounded(lambda: snapshot.snapshot({"run_dir": str(run), "gpus": False}), 10)
    assert "restart_cause.json: a FIFO, not a regular file" in snap["set_aside"]
    turn = decide(snap)
    assert any("restart_cause.json: a FIFO" in e for e in turn.report.evidence), turn.report.evidence


def test_deep_json_and_empty_notices_do_not_stop_the_supervisors_turn(tmp_path):
    """60,000 nested `[` in restart_cause.json and two `{}` outbox files: the supervisor takes its turn, pages the
    crash into its outbox and records its verdict."""
    run = base_run(tmp_path)
    (run / "restart_cause.json").write_text("[" * 60000)
    (run / "outbox" / "b0-EMPTY.json").write_text("{}")
    (run / "outbox" / "b1-EMPTY.json").write_text("{}")
    spec = json.loads((run / "supervise.json").read_text())
    sup = Supervisor(str(run), spec)
    ended = bounded(sup.turn, 30)
    assert ended == "CRASHED: CRASHED is not in the job's restart_on", ended
    verdict = json.loads((run / "verdict.json").read_text())
    assert verdict["state"] == "CRASHED" and verdict["gave_up"]
    assert (run / "outbox" / "a0-CRASHED.json").exists()
