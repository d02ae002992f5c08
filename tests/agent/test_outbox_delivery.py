"""Notices as deliveries (agent/outbox.py, judge/notice.py): one POST of one notice against a real listener on
loopback that answers, answers late, drips, redirects or never answers; the outbox's bounded POSTs across senders,
racing processes and senders that die; a webhook's credentials as a header; garbage in the outbox set aside.
Real files, real processes, real HTTP."""

from __future__ import annotations

import base64
import json
import multiprocessing
import os
import time

import pytest

from dflashctl.agent import common, outbox
from dflashctl.judge.notice import Message, body, notice_id
from dflashctl.judge.redact import redact_url
from tests.webhook import HOOK_SECRET, Listener, closed_port

MSG = Message(
    "run-1",
    "gpu8",
    "CRASHED",
    "KeyError on rank0",
    ["KeyError: 'x'", 'File "a.py", line 3'],
    "fix it",
    0,
    1.0,
    True,
    0,
    "dflashctl status run-1",
    "a0-CRASHED",
    "not restarted: CRASHED is not in the job's restart_on",
)


def test_bodies_say_the_failure_and_what_is_done_and_carry_the_delivery_id():
    data, headers = body(MSG, "slack")
    text = json.loads(data)["text"]
    assert text.startswith("run-1 on gpu8: CRASHED, not restarted: CRASHED is not in the job's restart_on")
    assert "restarts: 0 done, 0 left" in text and headers["Idempotency-Key"] == "run-1/a0-CRASHED"
    data, _ = body(MSG, "discord")
    assert "KeyError: 'x'" in json.loads(data)["content"]
    data, headers = body(MSG, "ntfy")
    assert headers["Title"].startswith("run-1: CRASHED, not restarted") and headers["Priority"] == "high"
    data, headers = body(MSG, "json")
    sent = json.loads(data)
    assert sent["id"] == "run-1/a0-CRASHED" == headers["Idempotency-Key"] and sent["state"] == "CRASHED"
    assert sent["action"].startswith("not restarted") and sent["restarts_left"] == 0


@pytest.mark.parametrize(
    "garbage",
    [{}, [], "x", {"job": "j"}, {"job": "j", "state": "S", "time": "noon", "restarts": 0}, {"job": 1, "state": "S"}],
)
def test_a_message_read_back_is_checked_field_by_field(garbage):
    assert Message.of(garbage) is None
    ok = Message.of({**MSG.to_dict(), "evidence": ["a", 3, None], "id": "../../etc/x", "advice": 7})
    assert ok.evidence == ["a"] and ok.id == "" and ok.advice is None


def test_one_post_delivered_redirected_refused_or_failed_says_so_without_the_secret():
    ok, moved, gone, busy = (
        Listener(),
        Listener(mode="redirect"),
        Listener(mode="status", code=404),
        Listener(mode="status", code=503),
    )
    try:
        res = outbox.post_once(ok.url(), MSG.to_dict(), "json", 5)
        assert res["ok"] and res["code"] == 200 and HOOK_SECRET not in json.dumps(res)
        assert res["result"] == f"delivered to http://127.0.0.1:{ok.port}/*** (200)"
        assert ok.posts()[0]["headers"]["Idempotency-Key"] == "run-1/a0-CRASHED"
        res = outbox.post_once(moved.url(), MSG.to_dict(), "json", 5)
        assert not res["ok"] and res["final"] and "redirected (302)" in res["result"]
        assert [h["method"] for h in moved.hits] == ["POST"], "a redirect is never followed"
        assert HOOK_SECRET not in res["result"] and f"127.0.0.1:{moved.port}/***" in res["result"]
        res = outbox.post_once(gone.url(), MSG.to_dict(), "json", 5)
        assert res["final"] and "HTTP 404" in res["result"]
        res = outbox.post_once(busy.url(), MSG.to_dict(), "json", 5)
        assert not res["final"] and not res["unconfirmed"] and "HTTP 503" in res["result"]
        refused = outbox.post_once(f"http://127.0.0.1:{closed_port()}/x/{HOOK_SECRET}", MSG.to_dict(), "json", 2)
        assert not refused["ok"] and not refused["final"] and not refused["unconfirmed"]
        assert "connect" in refused["result"] and HOOK_SECRET not in refused["result"]
        bad = outbox.post_once("ftp://127.0.0.1/x", MSG.to_dict(), "json", 2)
        assert bad["final"] and not bad["ok"]
    finally:
        for listener in (ok, moved, gone, busy):
            listener.close()


def test_credentials_in_the_url_travel_as_a_header_and_never_in_a_result():
    hook = Listener()
    try:
        url = f"http://alice:p%40ss%20w0rd@127.0.0.1:{hook.port}/hooks/{HOOK_SECRET}"
        res = outbox.post_once(url, MSG.to_dict(), "json", 5)
        assert res["ok"] and "alice" not in res["result"] and "w0rd" not in res["result"]
        got = hook.posts()[0]
        assert got["path"] == f"/hooks/{HOOK_SECRET}"
        assert got["headers"]["Authorization"] == "Basic " + base64.b64encode(b"alice:p@ss w0rd").decode()
        assert redact_url(url) == f"http://127.0.0.1:{hook.port}/***"
    finally:
        hook.close()


@pytest.mark.parametrize("mode", ["slow", "drip", "silent"])
def test_a_receiver_that_answers_late_drips_or_never_answers_is_cut_at_the_deadline(mode):
    """The body went out: the notice is unconfirmed (never repeated, a slow receiver would get it twice), and the
    sender is back within its deadline whatever the receiver does (bounded generously: a hang, not a speed)."""
    hook = Listener(mode=mode, delay_s=20)
    try:
        t0 = time.monotonic()
        res = outbox.post_once(hook.url(), MSG.to_dict(), "json", 1.0)
        assert time.monotonic() - t0 < 8, "the deadline holds"
        assert not res["ok"] and res["unconfirmed"] and "not repeated" in res["result"], res
        assert len(hook.posts()) == 1
    finally:
        hook.close()


def put(run, nid: str = "a0-CRASHED", max_posts: int = 3, **kw) -> bool:
    return outbox.put(str(run), {**MSG.to_dict(), "id": nid, **kw}, max_posts)


def record(run, nid: str) -> dict:
    return json.loads((run / "outbox" / f"{nid}.json").read_text())


def test_a_notice_is_kept_once_per_id_and_posted_a_bounded_number_of_times_in_all(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    assert put(run) and not put(run), "the second decider that saw the event makes no second notice"
    assert oct(os.stat(run / "outbox").st_mode & 0o777) == "0o700"
    failing = {"ok": False, "result": "HTTP 503", "code": 503}
    tries = 0
    for who in ("p1_0", outbox.me(), "lsomeone"):  # three senders in turn, each failing
        now = time.time() + 1000 * tries
        for nid, _ in outbox.claim(str(run), who, 30, now=now):
            outbox.settle(str(run), nid, who, failing, "test", now=now)
            tries += 1
    assert tries == 3 and record(run, "a0-CRASHED")["status"] == "failed"
    assert outbox.claim(str(run), "l2", 30, now=time.time() + 1e6) == [], "its POSTs are spent"
    log = record(run, "a0-CRASHED")["log"]
    assert [e["by"] for e in log] == ["test"] * 3 and all("503" in e["result"] for e in log)
    events = [json.loads(ln) for ln in (run / "events.jsonl").read_text().splitlines()]
    assert [e["status"] for e in events] == ["pending", "pending", "failed"]


def test_a_claim_whose_sender_died_counts_its_post_and_goes_back_to_the_next_sender(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    put(run)
    assert [n for n, _ in outbox.claim(str(run), "p1_0", 30)] == ["a0-CRASHED"]  # pid 1 never started at tick 0
    got = outbox.claim(str(run), outbox.me(), 30)
    assert [n for n, _ in got] == ["a0-CRASHED"] and record(run, "a0-CRASHED")["posts"] == 2
    assert "no word from its sender" in record(run, "a0-CRASHED")["log"][0]["result"]
    outbox.settle(str(run), "a0-CRASHED", "p1_0", {"ok": True}, "late")  # not its claim any more: ignored
    assert record(run, "a0-CRASHED")["status"] == "sending"
    assert outbox.settle(str(run), "a0-CRASHED", outbox.me(), {"ok": True, "result": "delivered"}, "test") == "sent"
    assert outbox.counts(str(run)) == {"waiting": 0, "failed": 0, "sent": 1, "unconfirmed": 0}


def _send_all(run: str, out) -> None:
    """One sender: claims what is ready and settles each as sent."""
    who = outbox.me()
    got = outbox.claim(run, who, 30, limit=100)
    for nid, _ in got:
        outbox.settle(run, nid, who, {"ok": True, "result": "delivered"}, "test")
    out.put([n for n, _ in got])


def test_senders_racing_for_the_outbox_send_each_notice_once(tmp_path):
    """Four processes claim and send at once: each notice is sent by exactly one of them, said once."""
    run = tmp_path / "run"
    run.mkdir()
    ids = [notice_id(0, f"S{i}") for i in range(30)]
    for nid in ids:
        put(run, nid)
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_send_all, args=(str(run), q)) for _ in range(4)]
    for p in procs:
        p.start()
    got = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join()
    assert sorted(n for batch in got for n in batch) == sorted(ids)
    sent = [json.loads(ln)["id"] for ln in (run / "events.jsonl").read_text().splitlines()]
    assert sorted(sent) == sorted(ids)
    assert {record(run, n)["status"] for n in ids} == {"sent"} and all(record(run, n)["posts"] == 1 for n in ids)


def test_garbage_in_the_outbox_is_set_aside_and_the_notices_still_go(tmp_path):
    """Files the job wrote where notices live: `{}`, deep JSON, a FIFO, a symlink, a directory; none stops a
    claim, each is named; an outbox that is a symlink keeps no notice at all, and says so."""
    run = tmp_path / "run"
    run.mkdir()
    put(run, "a0-CRASHED")
    box = run / "outbox"
    (box / "a1-EMPTY.json").write_text("{}")
    (box / "a2-DEEP.json").write_text("[" * 60000 + "]" * 60000)
    os.mkfifo(box / "a3-FIFO.json")
    (box / "a4-LINK.json").symlink_to("/dev/zero")
    (box / "a5-DIR.json").mkdir()
    (box / "a6-TYPES.json").write_text(json.dumps({"message": {**MSG.to_dict(), "restarts": "many"}}))
    common.drain_set_aside()
    assert [n for n, _ in outbox.claim(str(run), outbox.me(), 30)] == ["a0-CRASHED"]
    aside = common.drain_set_aside()
    for name in ("a1-EMPTY", "a2-DEEP", "a3-FIFO", "a4-LINK", "a5-DIR", "a6-TYPES"):
        assert any(line.startswith(name) for line in aside), (name, aside)
    assert (box / "a1-EMPTY.bad").exists() and (box / "a3-FIFO.bad").exists()
    other = tmp_path / "other"
    other.mkdir()
    (other / "outbox").symlink_to(tmp_path)
    assert not put(other) and outbox.claim(str(other), outbox.me(), 30) == []
    assert not list(tmp_path.glob("*.json")), "nothing written through the link"


def test_the_sender_thread_sends_what_is_put_and_flushes_at_the_end(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    hook = Listener()
    try:
        sender = outbox.Sender(str(run), {"webhook": hook.url(), "format": "json", "timeout_s": 5})
        sender.start()
        put(run, "a0-CRASHED")
        sender.poke()
        deadline = time.monotonic() + 20
        while not hook.posts() and time.monotonic() < deadline:
            time.sleep(0.05)
        put(run, "end-FINISHED", state="FINISHED", failure=False)
        sender.flush(10)
        assert sorted(hook.keys()) == ["run-1/a0-CRASHED", "run-1/end-FINISHED"]
        assert outbox.counts(str(run))["sent"] == 2
    finally:
        hook.close()
