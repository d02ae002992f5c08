"""judge/progress.py: the progress any script prints, read from real output (pure, no I/O in the code under test).

The fixture logs in tests/fixtures/progress/ are real output, captured through a pipe as the job's wrapper captures
it: a Hugging Face Trainer run (transformers 5.25.0: a tiny GPT-2 for 40 steps, an evaluation every 20), a PyTorch
Lightning run with its tqdm bar (lightning 2.6.6, two epochs, validation after each) and with its Rich bar, and tqdm
4.70.1's bars (default, `s/it`, no total, a postfix, a `samples` unit, nested loops). step-lines.log is printed with
nanoGPT's, torchtitan's (colours and logger prefix included), Megatron-LM's and this project's trainer's own format
strings. Site-package paths in two Lightning warnings were rewritten; nothing else was touched."""

from __future__ import annotations

import ast
import math
import random
from pathlib import Path

import pytest

from dflashctl.judge import progress
from dflashctl.judge.progress import (
    ASIDE,
    BEFORE,
    BETWEEN,
    EVALUATING,
    STEPPING,
    Reader,
    read_segment,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "progress"
ROOT = Path(__file__).resolve().parents[2]


def fixture(name: str) -> str:
    """A fixture as the probe reads a log: bytes decoded, `\r` kept (no newline translation)."""
    return (FIXTURES / name).read_bytes().decode("utf-8", errors="replace")


def fed(text: str, sizes=None) -> Reader:
    """A Reader fed `text` whole, or in pieces of the given sizes (cycled)."""
    r = Reader()
    if sizes is None:
        r.feed(text)
        return r
    i, k = 0, 0
    while i < len(text):
        n = sizes[k % len(sizes)]
        r.feed(text[i : i + n])
        i, k = i + n, k + 1
    return r


def summary(r: Reader) -> tuple:
    p = r.progress
    eta = None if p.eta_s is None else round(p.eta_s, 3)
    return p.step, p.total, p.epoch, p.loss, p.rate, p.unit, eta, p.phase


# ---------------------------------------------------------------------------------------------- real logs, whole


def test_a_hugging_face_trainer_run_gives_its_step_loss_rate_and_end():
    r = fed(fixture("transformers-5.25.0-trainer.log"))
    # 40 of 40 steps; the loss of the newest logged dict (strings in transformers 5); the evaluation after the last
    # step (a bar of 4 with no description) never took the counter over
    assert summary(r) == (40, 40, 0, 3.901, 17.19, "it/s", 0.0, BETWEEN)  # the bar's close: its mean


def test_a_lightning_run_gives_its_epoch_batch_and_postfix_loss():
    r = fed(fixture("lightning-2.6.6-tqdm.log"))
    assert summary(r)[:6] == (30, 30, 1, 1.92e-08, r.progress.rate, "it/s")
    assert r.progress.phase == BETWEEN and r.progress.rate > 0


def test_step_lines_of_nanogpt_torchtitan_megatron_and_the_trainer():
    r = fed(fixture("step-lines.log"))
    assert summary(r) == (40, 1000, 0, 2.1234, 12345.0, "tok/s", None, STEPPING)  # the trainer's, last


def test_lightnings_rich_bar_writes_nothing_readable_until_its_end():
    """Lightning picks its Rich bar where `rich` is installed; into a file it renders once, at the end, with its
    own columns: there is no progress in the log to read while it runs."""
    r = fed(fixture("lightning-2.6.6-rich.log"))
    assert r.progress.step is None


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*.log")))
def test_every_way_of_cutting_a_real_log_into_reads_gives_the_same_progress(name):
    """A read ends anywhere (inside a bar, a dict, a colour code, a `\\r\\n`): the progress is the same."""
    text = fixture(name)
    whole = summary(fed(text))
    for seed in range(12):
        rng = random.Random(seed)
        assert summary(fed(text, [rng.randint(1, 300) for _ in range(50)])) == whole, seed
    assert summary(fed(text, [1])) == whole  # one character a read


def test_midway_through_a_hugging_face_run_the_step_moves_and_the_time_left_is_the_bars():
    text = fixture("transformers-5.25.0-trainer.log")
    cut = text.index("| 16/40 [")
    r = fed(text[: text.index("\r", cut)])
    p = r.progress
    assert (p.step, p.total, p.unit, p.phase) == (16, 40, "it/s", STEPPING)
    assert p.loss == 3.902 and p.epoch == 0  # the dict of step 15
    assert p.eta_s == 1.0  # the bar's own `<00:01`


def test_during_a_hugging_face_evaluation_the_step_stands_by_design():
    text = fixture("transformers-5.25.0-trainer.log")
    at = text.index("{'eval_loss'")
    r = fed(text[:at])  # the evaluation's bar is drawn (position 1, no description): another bar, not the counter
    assert r.progress.step == 20 and r.progress.phase == ASIDE
    r.feed(text[at : text.index("\n", at) + 1])
    assert r.progress.phase == EVALUATING and r.progress.step == 20
    r.feed(text[text.index("\n", at) + 1 : text.index("| 22/40 [")])  # the bar redrawn at 20, the eval's 4/4
    assert r.progress.phase in (EVALUATING, ASIDE) and r.progress.step == 20
    r.feed(text[text.index("| 22/40 [") : text.index("| 22/40 [") + 40])
    assert r.progress.step == 22 and r.progress.phase == STEPPING


def test_lightning_validation_and_a_new_epoch_stand_until_the_batch_moves():
    text = fixture("lightning-2.6.6-tqdm.log")
    r = fed(text[: text.index("Validation DataLoader 0:  50%")])
    assert r.progress.phase == EVALUATING and r.progress.epoch == 0
    second = text.index("Epoch 1:   0%")
    r = fed(text[: text.index("\r", second)])
    assert r.progress.epoch == 1 and r.progress.step == 0 and r.progress.phase == BEFORE
    r.feed(text[text.index("\r", second) : text.index("\r", text.index("Epoch 1:  ", second + 20))])
    assert r.progress.phase == STEPPING and r.progress.step > 0


# ---------------------------------------------------------------------------------------------- each format


@pytest.mark.parametrize(
    ("segment", "expected"),
    [
        ("  5%|▌         | 50/1000 [00:10<03:10,  4.99it/s]", (50, 1000, None, 4.99, "it/s", 190.0)),
        ("train:  33%|███▎      | 1/3 [00:01<00:02,  1.20s/it]", (1, 3, None, 1.2, "s/it", 2.0)),
        ("25it [00:00, 48.70it/s]", (25, None, None, 48.7, "it/s", None)),
        (" 50%|█████     | 320/640 [00:00<00:00, 1580.41samples/s]", (320, 640, None, 1580.41, "samples/s", 0.0)),
        ("Training:  20%|██        | 4/20 [00:00<00:00, 32.88it/s, loss=2.2]", (4, 20, 2.2, 32.88, "it/s", 0.0)),
        (
            "Epoch 0:  45%|████▌     | 450/1000 [00:30<00:36, 15.00it/s, v_num=0, train_loss=0.512]",
            (450, 1000, 0.512, 15.0, "it/s", 36.0),
        ),
        ("Epoch 0: | 50/? [00:10<?, 4.99it/s, train_loss=1e-5]", (50, None, 1e-5, 4.99, "it/s", None)),
        ("desc:  45% 450/1000 [00:30<00:36, 15.00it/s]", (450, 1000, None, 15.0, "it/s", 36.0)),  # ncols=0
        ("  3%|▎         | 3/100 [00:03<01:37,  1.2kit/s]", (3, 100, None, 1.2, "kit/s", 97.0)),
        ("iter 100: loss 2.3456, time 12.34ms, mfu 35.20%", (100, None, 2.3456, 12.34, "ms/step", None)),
        ("step 100: train loss 2.3456, val loss 2.4567", (100, None, 2.3456, None, None, None)),
        (
            "[rank0]:[titan] 2025-06-01 12:00:10,123 - root - INFO - step: 10  loss:  9.12340  grad_norm:  1.2345  "
            "memory: 12.34GiB(15.62%)  tps: 1,234  tflops: 56.78  mfu: 12.34%",
            (10, None, 9.1234, 1234.0, "tokens/s/GPU", None),
        ),
        (
            " iteration      100/  500000 | elapsed time per iteration (ms): 1234.5 | lm loss: 8.123456E+00 | "
            "loss scale: 1.0 | grad norm: 1.234 |",
            (100, 500000, 8.123456, 1234.5, "ms/step", None),
        ),
        (
            "step 20/1000 epoch 0 loss 2.3456 acc 0.123 lr 2.00e-03 grad_norm 1.234 12,345 tok/s peak 1.2 GiB",
            (20, 1000, 2.3456, 12345.0, "tok/s", None),
        ),
        ("Step 7 | loss=0.25 | 812.5 samples/sec", (7, None, 0.25, 812.5, "samples/sec", None)),
        ("global_step=7, train_loss=0.25, 3.5 it/s", (7, None, 0.25, 3.5, "it/s", None)),
    ],
)
def test_one_report_each_format(segment, expected):
    """Step, total, loss, throughput as printed (its unit too), and the time left as the bar prints it."""
    got = read_segment(segment, whole=True)
    assert got is not None and got.kind == "train", got
    assert (got.step, got.total, got.loss, got.rate, got.unit, got.left_s) == expected


def test_the_time_left_is_the_bars_own_else_the_steps_left_at_the_stated_pace():
    r = Reader()
    r.feed("\r  5%|▌         | 50/1000 [00:10<03:10,  4.99it/s]")
    assert r.progress.eta_s == 190.0  # as tqdm printed it
    r.feed("\r  5%|▌         | 51/1000 [00:10<?,  4.99it/s]")
    assert r.progress.eta_s == pytest.approx(949 / 4.99)
    r.feed("\r iteration      100/  500000 | elapsed time per iteration (ms): 1234.5 | lm loss: 8.1E+00 |\n")
    assert r.progress.eta_s == pytest.approx(499900 * 1.2345)  # Megatron: ms a step, steps left
    r.feed("step 20/1000 loss 2.3456 12,345 tok/s\n")
    assert r.progress.eta_s is None  # tokens a second say nothing of steps: the judge's own pace does


@pytest.mark.parametrize(
    "segment",
    [
        "{'loss': '3.899', 'grad_norm': '0.9076', 'learning_rate': '4.5e-05', 'epoch': '0.1'}",  # transformers 5
        "{'loss': 3.899, 'grad_norm': 0.9076, 'learning_rate': 4.5e-05, 'epoch': 0.1}",  # transformers 4
    ],
)
def test_a_hugging_face_dict_gives_the_loss_and_the_epoch_not_a_step(segment):
    got = read_segment(segment, whole=True)
    assert (got.kind, got.step, got.loss, got.epoch) == ("train", None, 3.899, 0)


@pytest.mark.parametrize(
    ("segment", "kind"),
    [
        (
            "{'eval_loss': '3.897', 'eval_runtime': '0.0175', 'eval_samples_per_second': '456.7', 'epoch': '0.4'}",
            "eval",
        ),
        ("Validation DataLoader 0:  50%|█████     | 2/4 [00:00<00:00, 1234.89it/s]", "eval"),
        ("Sanity Checking DataLoader 0:  50%|█████     | 1/2 [00:00<00:00, 62.49it/s]", "eval"),
        ("Evaluating step 10/100 loss 2.0", "eval"),
        ("Map: 100%|██████████| 1000/1000 [00:00<00:00, 12345.67 examples/s]", "aside"),
        ("Loading checkpoint shards: 100%|██████████| 4/4 [00:03<00:00,  1.20it/s]", "aside"),
        ("Generating train split: 1000 examples [00:00, 12345.67examples/s]", "aside"),
    ],
)
def test_evaluation_and_data_preparation_are_not_the_training_counter(segment, kind):
    assert read_segment(segment, whole=True).kind == kind


@pytest.mark.parametrize(
    "segment",
    [
        "{'train_runtime': '2.328', 'train_samples_per_second': '68.74', 'train_loss': '3.902', 'epoch': '0.8'}",
        "model.safetensors:  45%|████▌     | 2.25G/5.00G [00:30<00:36, 75.0MB/s]",  # unit-scaled bytes
        "Downloading: 100%|██████████| 1234567/1234567 [00:01<00:00, 1234567.00B/s]",
        "1234567B [00:01, 1234567.00B/s]",
        "Step 1: load the data",  # a stage, not a step
        "saved the checkpoint at step 500",
        "warmup_steps: 100, max_steps: 1000, loss_type: ForCausalLMLoss",
        "timestep 5 loss 0.1",
        "preflight: buckets [128], seconds {'128': 0.057}",
        "step 99999999999999999999 loss 1.0",  # no count is that large
        " 50%|█████     | 900/450 [00:30<00:36, 15.00it/s]",  # past its total
        "step 1.5 loss 2.0",
        "",
        "\x00\x01\x02 ]]] [[[ 12/ [ <<",
    ],
)
def test_what_is_no_progress_report(segment):
    assert read_segment(segment, whole=True) is None or read_segment(segment, whole=True).step is None


def test_a_validation_loss_is_never_the_loss():
    for line in ("step 5 val loss 2.0 loss 1.5", "step 5 val_loss=2.0 train_loss=1.5", "step 5 eval_loss 2 loss 1.5"):
        assert read_segment(line, whole=True).loss == 1.5, line
    assert read_segment("step 5 val loss 2.0 | 3 it/s", whole=True).loss is None


# ---------------------------------------------------------------------------------------------- as an attacker would


@pytest.mark.parametrize("value", ["nan", "NaN", "nan.0", "inf", "-inf", "inf.0", "1e400"])
def test_a_non_finite_loss_is_read_as_non_finite(value):
    got = read_segment(f"Epoch 0:  45%|████▌     | 450/1000 [00:30<00:36, 15.00it/s, train_loss={value}]", True)
    assert got.step == 450 and not math.isfinite(got.loss)
    got = read_segment(f"step 3 loss {value}", True)
    assert got.step == 3 and not math.isfinite(got.loss)


def test_the_last_redraw_on_a_line_wins_and_blank_redraws_do_not():
    r = Reader()
    chunk = r.feed(
        "\r 10%|█         | 1/10 [00:01<00:09,  1.00it/s]\r 20%|██        | 2/10 [00:02<00:08,  1.00it/s]"
        "\r                                   \r"
    )
    assert r.progress.step == 2 and chunk.lines == [] and chunk.open.startswith(" 20%")
    chunk = r.feed("\n")
    assert chunk.lines == [" 20%|██        | 2/10 [00:02<00:08,  1.00it/s]"] and chunk.open is None


def test_a_line_split_across_reads_is_read_once_whole():
    line = "step 1234 loss 2.5000, 3.00 it/s\n"
    for cut in range(1, len(line)):
        r = Reader()
        first = r.feed(line[:cut])
        assert r.progress.step is None, cut  # `step 12` is not read before its line ends
        assert first.lines == []
        second = r.feed(line[cut:])
        assert second.lines == [line.strip("\n")] and r.progress.step == 1234 and r.progress.loss == 2.5, cut


def test_a_bar_cut_before_its_closing_bracket_is_not_read():
    r = Reader()
    r.feed("\r 45%|████▌     | 450/1000 [00:30<00:36, 15.00it/s]\r 46%|████▌     | 460/10")
    assert r.progress.step == 450
    r.feed("00 [00:31<00:35, 15.00it/s]")
    assert r.progress.step == 460


def test_bytes_skipped_between_reads_leave_the_fragment_unread():
    r = Reader()
    r.feed("\r 45%|████▌     | 450/1000 [00:30<00:36, 15.00it/s]")
    # the probe skipped the middle (more than its read limit was written): this read starts inside a bar
    r.feed("0/1000 [00:31<00:35, 15.00it/s]\r 47%|████▋     | 470/1000 [00:32<00:34, 15.00it/s]", cut=True)
    assert r.progress.step == 470
    r = Reader()
    r.feed("9/1000 [00:31<00:35, 15.00it/s]\n", cut=True)  # only the fragment: nothing read
    assert r.progress.step is None


def test_colours_are_no_part_of_the_text():
    r = Reader()
    chunk = r.feed("\x1b[31mstep: 10  \x1b[32mloss:  9.12340  \x1b[34mtps: 1,234\x1b[39m\n\x1b]0;title\x07done\n")
    assert chunk.lines == ["step: 10  loss:  9.12340  tps: 1,234", "done"]
    assert (r.progress.step, r.progress.loss, r.progress.rate) == (10, 9.1234, 1234.0)


def test_windows_line_ends_are_line_ends_even_split():
    r = Reader()
    assert r.feed("step 1 loss 2.0, 1.0 it/s\r").lines == []
    assert r.feed("\nstep 2 loss 1.9, 1.0 it/s\r\n").lines == ["step 1 loss 2.0, 1.0 it/s", "step 2 loss 1.9, 1.0 it/s"]
    assert r.progress.step == 2


def test_a_step_that_goes_back_is_the_newest_and_still_moves():
    r = Reader()
    r.feed("step 500 loss 1.0, 2 it/s\nstep 501 loss 1.0, 2 it/s\nresuming from the checkpoint of step 100\n")
    r.feed("step 101 loss 1.2, 2 it/s\n")
    assert r.progress.step == 101 and r.progress.phase == STEPPING


def test_a_restart_in_the_log_begins_anew():
    r = Reader()
    r.feed("step 500 loss 1.0, 2 it/s\n[dflashctl] job-1 start attempt 2\n")
    assert r.progress.step is None and r.progress.loss is None and r.progress.phase is None
    r.feed("step 10 loss 3.0, 2 it/s\n")
    assert r.progress.step == 10


def test_a_line_with_no_end_is_bounded():
    r = Reader()
    chunk = r.feed("x" * (progress.CARRY_MAX + 10))
    assert chunk.lines and r.partial == "" and chunk.open is None
    r.feed("y" * 100)
    assert len(r.partial) == 100


def test_garbage_never_raises_and_never_makes_a_step():
    rng = random.Random(7)
    alphabet = "0123456789/[]<>:,.%|=' \r\n\x1b{}abcdefitslosepoch?-+eE█▌"
    r = Reader()
    for _ in range(300):
        r.feed("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 200))), cut=rng.random() < 0.1)
    p = r.progress
    assert p.step is None or (isinstance(p.step, int) and 0 <= p.step < progress.COUNT_MAX)
    assert p.rate is None or math.isfinite(p.rate)
    assert p.eta_s is None or (math.isfinite(p.eta_s) and p.eta_s >= 0)


def test_huge_counts_and_rates_stay_finite():
    r = Reader()
    r.feed("\r 50%|█████     | 1000000000000000/1000000000000000 [00:30<00:36, 1e308it/s]\n")
    assert r.progress.step is None  # no count reaches 10**15
    r.feed("\r 50%|█████     | 5/10 [999999999:59:59<99999:00:00, 0.00it/s]\n")
    p = r.progress
    assert p.step == 5 and (p.eta_s is None or math.isfinite(p.eta_s))
    r.feed("\r 50%|█████     | 6/999999999999999 [00:01<?, 1e-300it/s]\n")  # the steps left at a vanishing rate
    assert r.progress.step == 6 and r.progress.eta_s is None


def test_the_rates_kept_for_the_trend_are_bounded():
    r = Reader()
    for i in range(progress.RATES_KEPT + 20):
        r.feed(f"step {i + 1} loss 1.0, {i + 1}.0 it/s\n")
        r.keep_rate()
    assert len(r.rates) == progress.RATES_KEPT and r.rates[-1] == progress.RATES_KEPT + 20


def test_the_module_is_python_3_8_syntax():
    """It ships to the remote inside the agent (the supervisor judges there, on the remote's own Python)."""
    for name in ("progress.py", "fold.py", "assess.py"):
        ast.parse((ROOT / "dflashctl" / "judge" / name).read_text(), feature_version=(3, 8))
