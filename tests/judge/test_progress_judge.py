"""A command job's progress through the judge (pure): its log's step, loss, throughput and time left in the Report,
the stall rule on a step that moves (and only then), the log tail as a terminal shows it, and the views that show
them (the live watch, its one-line form, the terminal report's step axis)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from dflashctl.config import LOCAL
from dflashctl.jobs.poller import PollRecord, Watcher
from dflashctl.judge.facts import Thresholds
from dflashctl.judge.report import Judge
from dflashctl.model.record import JobRecord
from dflashctl.show import plots, view

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "progress"
TH = Thresholds(stall_after_s=60.0)


def fixture(name: str) -> str:
    return (FIXTURES / name).read_bytes().decode("utf-8", errors="replace")


class Log:
    """A train.log as the probe hands it out: the bytes since the last read, with their offsets."""

    def __init__(self) -> None:
        self.size = 0

    def snap(self, now: float, text: str = "", activity_age: float = 0.0, skipped: int = 0, **extra) -> dict:
        start = self.size + skipped
        self.size = start + len(text.encode())
        return {
            "time": now,
            "run_dir_exists": True,
            "restarts": 0,
            "session": {"exists": True, "created": 1000.0, "pane_dead": False},
            "progress": {
                "attempt_start": 1000.0,
                "attempt_age_s": now - 1000.0,
                "activity": "log grew",
                "activity_age_s": activity_age,
            },
            "log": {"exists": True, "text": text, "offset": self.size, "size": self.size, "skipped": skipped},
            **extra,
        }


def command_judge(**kw) -> Judge:
    return Judge("job", "local", TH, is_trainer=False, **kw)


def bar(n: int, total: int = 1000, rate: float = 5.0, desc: str = "") -> str:
    left = int((total - n) / rate)
    pct = int(100 * n / total)
    return f"\r{desc}{pct:3d}%|#         | {n}/{total} [00:10<{left // 60:02d}:{left % 60:02d}, {rate:5.2f}it/s]"


# ---------------------------------------------------------------------------------------------- what status says


def test_one_look_at_a_hugging_face_run_says_step_loss_throughput_and_time_left():
    text = fixture("transformers-5.25.0-trainer.log")
    part = text[: text.index("\r", text.index("| 16/40 ["))]
    r = command_judge().take(Log().snap(2000.0, part))
    assert r.state == "RUNNING" and r.reason == "step 16, loss 3.9020 (its log)", r
    assert (r.step, r.loss, r.epoch, r.eta_s) == (16, 3.902, 0, 1.0)
    assert (r.throughput, r.throughput_unit) == (17.91, "it/s") and r.tokens_per_s is None  # never called tokens
    json.dumps(r.to_dict(), allow_nan=False)


def test_one_look_at_step_lines_and_the_jobs_own_total():
    text = "iter 100: loss 2.3456, time 12.34ms, mfu 35.20%\niter 110: loss 2.3000, time 12.34ms, mfu 35.20%\n"
    r = command_judge(total_steps=5000).take(Log().snap(2000.0, text))
    assert r.state == "RUNNING" and (r.step, r.loss) == (110, 2.3)
    assert (r.throughput, r.throughput_unit) == (12.34, "ms/step")
    assert r.eta_s is None  # one look, one step seen: no pace of its own, and no total in the log


def test_a_nan_loss_in_the_log_is_no_loss_in_the_json():
    lightning = "\rEpoch 0:  45%|####5     | 450/1000 [00:30<00:36, 15.00it/s, v_num=0, train_loss=nan.0]"
    r = command_judge().take(Log().snap(2000.0, lightning))
    assert (r.step, r.epoch, r.loss) == (450, 0, None)
    json.dumps(r.to_dict(), allow_nan=False)


def test_a_trainer_job_takes_no_step_from_its_log():
    j = Judge("job", "local", TH, is_trainer=True)
    r = j.take(Log().snap(2000.0, "step 20/1000 epoch 0 loss 2.3456 acc 0.1 lr 2e-3 grad_norm 1.2 12,345 tok/s\n"))
    assert r.step is None and r.throughput is None and r.state == "STARTING"


def test_a_command_that_writes_metrics_keeps_its_metrics_step():
    log = Log()
    s = log.snap(2000.0, "iter 7: loss 9.0, time 10.00ms\n")
    s["metrics"] = {"records": [{"time": 1999.0, "step": 40, "loss": 1.5, "tokens_per_s": 900.0}], "offset": 10}
    r = command_judge().take(s)
    assert (r.step, r.loss, r.throughput, r.throughput_unit) == (40, 1.5, 900.0, "tokens/s")


def test_a_clean_end_says_the_step_it_ended_at():
    log = Log()
    j = command_judge()
    j.take(log.snap(2000.0, bar(999) + bar(1000) + "\n"))
    r = j.take(log.snap(2005.0, "done\n", exit_code=0))
    assert r.state == "FINISHED" and r.reason == "exit 0 at step 1000"


# ---------------------------------------------------------------------------------------------- the stall rule


def test_a_step_that_stops_while_the_log_still_grows_is_stalled_on_the_watchers_own_clock():
    log, j = Log(), command_judge()
    for i, n in enumerate((10, 20, 30)):
        assert j.take(log.snap(2000.0 + 5 * i, bar(n)), mono_now=5.0 * i).state == "RUNNING"
    # stuck at 30: the script keeps printing (its log grows, its CPU spins), its step does not move
    for t in range(20, 60, 10):
        r = j.take(log.snap(2000.0 + t, "\nwaiting for the data loader\n"), mono_now=float(t))
        assert r.state == "RUNNING", (t, r.reason)
    r = j.take(log.snap(2080.0, "waiting for the data loader\n"), mono_now=80.0)
    assert r.state == "STALLED" and r.reason == "no step progress (its log)", r.reason
    assert r.evidence[:2] == ["no new step in its log for 70 s (limit 60)", "last step 30"], r.evidence
    r = j.take(log.snap(2081.0, bar(31)), mono_now=81.0)
    assert r.state == "RUNNING" and r.step == 31  # it moves again


def test_one_look_never_calls_a_moving_job_stalled_and_a_quiet_one_is():
    text = bar(10) + bar(20)
    assert command_judge().take(Log().snap(9000.0, text, activity_age=5.0)).state == "RUNNING"
    r = command_judge().take(Log().snap(9000.0, text, activity_age=300.0))
    assert r.state == "STALLED" and "no new step in its log for 300 s" in r.evidence[0], r.evidence


def test_an_evaluation_longer_than_the_stall_limit_is_no_stall():
    """Hugging Face's evaluation bar (no description, shorter, below the training bar) runs for minutes: the step
    stands by design; the job's other signs judge it. Its training bar redrawn at the same step after the evaluation
    is no step either: the step moves again only when it changes."""
    log, j = Log(), command_judge()
    assert j.take(log.snap(2000.0, bar(499) + bar(500)), mono_now=0.0).state == "RUNNING"
    t = 0.0
    for n in range(0, 11):
        t += 20.0
        eval_bar = f"\n\r{10 * n:3d}%|#         | {n}/10 [00:{n:02d}<00:10,  0.05it/s]\x1b[A"
        r = j.take(log.snap(2000.0 + t, eval_bar), mono_now=t)
        assert r.state == "RUNNING" and r.step == 500, (t, r.reason)
    r = j.take(
        log.snap(2000.0 + t + 10, "\r{'eval_loss': '1.2', 'eval_runtime': '220.0', 'epoch': '0.5'}\n" + bar(500)),
        mono_now=t + 10,
    )
    assert r.state == "RUNNING" and "evaluat" in r.reason, r.reason
    r = j.take(log.snap(2000.0 + t + 20, bar(500)), mono_now=t + 20)  # redrawn, not moved
    assert r.state == "RUNNING", r.reason
    r = j.take(log.snap(2000.0 + t + 30, bar(501)), mono_now=t + 30)
    assert r.state == "RUNNING" and r.step == 501 and r.reason.startswith("step 501")


def test_before_the_first_step_a_long_compile_is_judged_by_its_other_signs():
    log, j = Log(), command_judge()
    assert j.take(log.snap(2000.0, bar(0)), mono_now=0.0).state == "RUNNING"
    r = j.take(log.snap(2300.0, "", activity_age=1.0), mono_now=300.0)  # compiling: CPU busy, bar at 0
    assert r.state == "RUNNING" and r.step is None, r.reason
    r = j.take(log.snap(2400.0, "", activity_age=100.0), mono_now=400.0)
    assert r.state == "STALLED" and "no sign of progress" in r.evidence[0]


def test_a_finished_bar_is_no_step_to_wait_for():
    log, j = Log(), command_judge()
    j.take(log.snap(2000.0, bar(999) + bar(1000) + "\n"), mono_now=0.0)
    r = j.take(log.snap(2300.0, "saving the model\n", activity_age=2.0), mono_now=300.0)
    assert r.state == "RUNNING" and r.step == 1000 and "finished" in r.reason, r.reason


# ---------------------------------------------------------------------------------------------- the log tail


def test_the_tail_shows_the_last_redraw_and_one_line_for_a_line_split_across_reads():
    log, j = Log(), command_judge()
    j.take(log.snap(2000.0, bar(1) + bar(2) + "\r{'loss': '2.5', 'grad_n"), mono_now=0.0)
    assert j.h.loss is None and j.tail[-1] == "{'loss': '2.5', 'grad_n"  # being written
    r = j.take(log.snap(2001.0, "orm': '0.9', 'learning_rate': '5e-05', 'epoch': '0.01'}\n" + bar(3)), mono_now=1.0)
    assert r.loss == 2.5 and r.step == 3
    assert list(j.tail) == [
        "{'loss': '2.5', 'grad_norm': '0.9', 'learning_rate': '5e-05', 'epoch': '0.01'}",
        bar(3)[1:],
    ]


def test_a_new_attempt_reads_on_and_a_restart_line_begins_anew():
    log, j = Log(), command_judge()
    j.take(log.snap(2000.0, "step 500 loss 1.0, 2 it/s\n" + bar(7)), mono_now=0.0)
    j.reset()  # a restart: a new history and tail, the same log read on
    r = j.take(log.snap(2010.0, "\n[dflashctl] job start (restart 1)\nstep 3 loss 2.0, 2 it/s\n"), mono_now=10.0)
    assert r.step == 3 and list(j.tail)[-2:] == ["[dflashctl] job start (restart 1)", "step 3 loss 2.0, 2 it/s"]
    assert len(j.tail) == 3  # and the old attempt's line that was being written, now ended


def test_skipped_bytes_start_afresh_and_read_no_fragment():
    log, j = Log(), command_judge()
    j.take(log.snap(2000.0, bar(5)), mono_now=0.0)
    r = j.take(log.snap(2001.0, "0/1000 [00:31<00:35, 15.00it/s]" + bar(470), skipped=100_000), mono_now=1.0)
    assert r.step == 470


def test_a_step_that_went_back_paces_the_time_left_from_there():
    log, j = Log(), command_judge(total_steps=1000)
    for i, step in enumerate((500, 510, 520, 100, 110, 120)):
        r = j.take(log.snap(2000.0 + 10 * i, f"step {step} loss 1.0, 3 it/s\n"), mono_now=10.0 * i)
    assert r.step == 120
    assert r.eta_s == pytest.approx((1000 - 120) * 20 / 20)  # 10 steps in 10 s since it went back to 100


# ---------------------------------------------------------------------------------------------- the views


def watcher(steps: int | None = None) -> Watcher:
    rec = JobRecord(
        id="job",
        name="job",
        project="p",
        job_file="jobs/j.yaml",
        host_name="local",
        host=LOCAL,
        release="r1",
        command="python train.py",
        run_dir="/nonexistent/run",
        session="s",
        launched_at=1000.0,
        is_trainer=False,
        steps=steps,
    )
    return Watcher(rec, rec.watch, open=lambda: None)


def test_the_live_view_shows_the_logs_step_of_its_total_throughput_in_its_unit_loss_and_eta():
    w = watcher()
    text = fixture("transformers-5.25.0-trainer.log")
    r = w.judge.take(Log().snap(2000.0, text[: text.index("\r", text.index("| 16/40 ["))]), mono_now=0.0)
    console = Console(record=True, width=120)
    console.print(view.render(w, r, next_poll_s=5))
    shown = console.export_text()
    assert "16 / 40" in shown and "it/s" in shown and "17.9" in shown and "tokens/s" not in shown, shown
    assert "3.9020" in shown and "0m01s" in shown
    one = view.line(PollRecord(r))
    assert "17.9 it/s now" in one and "ETA 0m01s" in one and "tok/s" not in one, one


def test_a_tiny_loss_is_shown_with_its_digits_not_as_zero():
    w = watcher()
    text = fixture("lightning-2.6.6-tqdm.log")
    r = w.judge.take(Log().snap(2000.0, text[: text.index("\r", text.index("Epoch 1:  50%"))]), mono_now=0.0)
    assert (r.step, r.epoch, r.loss) == (15, 1, 1.04e-05) and r.reason == "step 15, loss 1.04e-05 (its log)"
    console = Console(record=True, width=120)
    console.print(view.render(w, r))
    shown = console.export_text()
    assert "15 / 30" in shown and "1.04e-05" in shown, shown


def test_the_one_line_form_keeps_the_trainers_tokens():
    w = watcher()
    w.judge.is_trainer = True
    s = Log().snap(2000.0, "")
    s["metrics"] = {"records": [{"time": 1999.0, "step": 40, "loss": 1.5, "tokens_per_s": 12345.0}], "offset": 10}
    r = w.judge.take(s)
    assert (r.throughput, r.throughput_unit) == (12345.0, "tokens/s")
    assert view.rate(r.throughput, r.throughput_unit) == "12,345 tokens/s" and view.rate(None, None) == "-"
    assert view.rate(1.234, "s/it") == "1.23 s/it"
    assert view.duration(None) == view.duration(float("inf")) == view.duration(float("nan")) == "-"
    assert view.duration(3725.0) == "1h02m" and view.duration(185.0) == "3m05s"


@pytest.mark.parametrize(("lo", "hi"), [(1, 995), (0, 2), (5, 5), (100, 139), (0, 122457), (250, 251), (0, 10**15)])
def test_the_step_axis_ticks_are_whole_steps(lo, hi):
    ticks = plots.step_ticks(lo, hi)
    assert ticks and all(isinstance(t, int) and lo <= t <= hi for t in ticks) and len(ticks) <= 5
    assert ticks == sorted(set(ticks))


def test_the_terminal_reports_step_axis_has_no_fractional_step():
    from dflashctl.show.report import RunSeries

    steps = list(range(1, 1001, 7))
    s = RunSeries("x", steps=steps, loss=[5 - i / 300 for i in steps], tokens_per_s=[1000.0] * len(steps))
    text = plots.terminal([s], 80)
    axis = [ln for ln in text.splitlines() if "200" in ln and "400" in ln]
    assert axis and not any("." in tok for ln in axis for tok in ln.split() if tok[:1].isdigit()), axis
    assert "249.5" not in text
