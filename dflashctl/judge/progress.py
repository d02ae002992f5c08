"""Pure: the progress any script prints, read from its log: the step, its total, the loss, the throughput in the
script's own unit and what is left. It is what `status`, `watch` and `ls` know of a `command:` job, which writes no
metrics.jsonl.

What is read (each from the tools' own output):
- tqdm's bar (`desc: 45%|████▌     | 450/1000 [00:30<00:36, 15.00it/s, loss=0.5]`): the default format and
  Lightning's, `s/it` under one a second, `?it/s` before the first rate, the bar-less `ncols=0` form, and the
  total-less `123it [00:01, 99.50it/s]`. A bar of bytes (a download) or of unit-scaled counts (`2.25G/5.00G`) is no
  step counter; nor is data preparation (`Map`, `Loading checkpoint shards`, ...).
- Hugging Face Trainer: its bar counts the global step; the dicts it logs give the loss and the epoch (numbers or,
  in newer versions, strings); an `eval_*` dict is an evaluation.
- PyTorch Lightning: `Epoch 3:  45%|████▌     | 450/1000 [00:30<00:36, 15.00it/s, v_num=0, train_loss=0.512]`: the
  step is the batch within the epoch, as its bar counts it, and the time left is the epoch's. Its validation,
  sanity-check, test and predict bars are evaluation.
- Step lines: nanoGPT's `iter 100: loss 2.3456, time 12.34ms, mfu 35.20%`, torchtitan's coloured `step: 10  loss:
  9.1234 ... tps: 1,234 ...`, Megatron's `iteration 100/ 500000 | ... elapsed time per iteration (ms): 1234.5 | ...
  lm loss: 8.1E+00 |`, the bundled trainer's `step 20/1000 epoch 0 loss 2.3456 ... 12,345 tok/s`, and any `step N`
  / `iter N` beside a loss or a throughput (a step alone, `Step 1: load the data`, is none). `val loss` and
  `eval_loss` are never the loss; the throughput keeps the script's unit (`it/s`, `s/it`, `samples/s`, `tok/s`,
  torchtitan's per-GPU `tps`, a time per step).

A log file keeps what a terminal overwrites: tqdm redraws its bar after a `\\r` (the last update on a line wins),
colours come as ANSI codes, and a read can end inside a line (the rest comes with the next read; a bar is read
only whole, up to its closing `]`, and a line only once it ends). `Reader` keeps that state between reads: the line
being written, which bar counts the steps, and whether the step is moving, so that a stall is judged only on a
step that moves (not during an evaluation, before the first step or after the bar finished).

Stdlib only, Python 3.8: the supervisor runs this on the remote.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .logs import ATTEMPT_START, strip_prefix

ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-Z\\-_])")
CARRY_MAX = 1 << 16  # a line still unended past this many characters is taken as ended (no progress line is this long)
READ_MAX = 4096  # a segment longer than this is not read for progress (no progress report is this long)
COUNT_MAX = 10**15  # a step or total from here up is garbage, not a count
RATES_KEPT = 60  # the newest throughputs kept for the live view's trend

# The phases a command job's log shows (History.phase). Only STEPPING is judged by its step: a step that stops there
# is a stall; in the others the step stands still by design and the job's other signs judge it.
STEPPING = "training (its log's step moves)"
EVALUATING = "evaluating (its log shows an evaluation)"
BEFORE = "before its first step (its log's bar is at 0)"
BETWEEN = "between progress bars (the bar that counts steps finished)"
ASIDE = "another progress bar runs (an evaluation, data, a checkpoint, an inner loop)"
PHASES = (STEPPING, EVALUATING, BEFORE, BETWEEN, ASIDE)

NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan(?:\.0+)?|[-+]?inf(?:inity)?(?:\.0+)?"
WHOLE_NUMBER = re.compile(rf"^(?:{NUMBER})$", re.I)
TIME = r"\d{1,9}(?::\d\d){1,2}"
# tqdm's right part, `N/TOTAL [ELAPSED<LEFT, RATE, POSTFIX]`: whole counts only (a unit-scaled `2.25G` is bytes)
BAR = re.compile(
    rf"(?<![\w.])(?P<n>\d{{1,16}})/(?P<total>\d{{1,16}}|\?)\s?\[(?P<elapsed>{TIME})<(?P<left>{TIME}|\?),"
    r"\s*(?P<rate>[^,\]]*)(?P<post>(?:,[^\]]*)?)\]"
)
# with no total: `N UNIT [ELAPSED, RATE, POSTFIX]`
COUNT = re.compile(
    rf"(?<![\w.])(?P<n>\d{{1,16}}) ?(?P<unit>[A-Za-z][A-Za-z_ ]{{0,19}}) ?\[(?P<elapsed>{TIME}),"
    r"\s*(?P<rate>[^,\]]*)(?P<post>(?:,[^\]]*)?)\]"
)
RATE = re.compile(
    r"^\s*(?P<v>\?|\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)(?P<si>[kMGTPEZY](?=it/))?\s?"
    r"(?P<num>[A-Za-z][A-Za-z_ ]{0,19}?)/(?P<den>[A-Za-z][A-Za-z_ ]{0,19})\s*$"
)
SI = {"k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18, "Z": 1e21, "Y": 1e24}
BYTES = ("b", "ib", "bytes", "byte", "kb", "mb", "gb")
POSTFIX = re.compile(r"([\w/.\-]+)=([^,]*)")
LOSS_KEY = re.compile(r"^(?:train[_/])?loss(?:_step)?$", re.I)
# what a bar's description says it counts
EVAL_WORDS = re.compile(r"valid|eval|sanity|\btest|predict|inferenc", re.I)
ASIDE_WORDS = re.compile(
    r"^\W*(?:load|download|fetch|map\b|filter|generat|token|prepar|process|extract|convert|"
    r"resolv|sav|writ|read|upload|comput|shard|build|cach|index|pack|sort|shuffl|encod|decod)",
    re.I,
)
EPOCH_DESC = re.compile(r"\bepoch\s*(\d{1,9})\b", re.I)
# Hugging Face Trainer's logged dict: `{'loss': 1.234, 'grad_norm': 0.5, 'learning_rate': 4.8e-05, 'epoch': 0.5}`
HF_DICT = re.compile(r"\{'(?:loss|eval_\w+|train_runtime|grad_norm|learning_rate|epoch)'\s*:")
HF_PAIR = re.compile(r"'(\w+)'\s*:\s*'?\s*(" + NUMBER + r")\s*'?\s*(?=[,}])", re.I)
# a step line: `step 10`, `step: 10`, `iter 100:`, `iteration 100/ 500000`, `global_step=7`, `Step 20/1000`
STEP = re.compile(
    r"(?<![\w/.-])(?:global[_ ]step|step|iter(?:ation)?)\b\s*[:=#]?\s*\[?\s*(?P<n>\d{1,16})"
    r"(?:\s*/\s*(?P<total>\d{1,16}))?(?![\d.])",
    re.I,
)
LOSS = re.compile(
    r"(?<![\w/.-])(?<!val )(?<!eval )(?<!test )(?<!valid )(?:train[_ /]|lm )?loss\b['\"]?\s*[:=]?\s*"
    r"['\"]?(?P<v>" + NUMBER + r")(?![\w.])",
    re.I,
)
EVAL_BEFORE = re.compile(r"(?:valid\w*|eval\w*|test\w*)\W{0,3}$", re.I)  # `Evaluating step 10/100`
EPOCH = re.compile(r"(?<![\w/.-])epoch\b['\"]?\s*[:=]?\s*(?P<n>\d{1,9})(?:\s*/\s*\d{1,9})?(?![\d.])", re.I)
# throughput as a step line states it: the unit is the script's own
RATE_WORDS = re.compile(
    r"(?P<v>\d[\d,]*(?:\.\d+)?)\s*(?P<u>tok(?:en)?s?/s(?:ec)?|it/s|steps?/s|samples?/s(?:ec)?|"
    r"examples?/s|img/s|images/s|seq/s|s/it|s/step)(?![\w/])",
    re.I,
)
TPS = re.compile(r"(?<![\w/.-])tps\s*[:=]\s*(?P<v>\d[\d,]*(?:\.\d+)?)", re.I)  # torchtitan: tokens/s per device
MS_PER_ITER = re.compile(
    r"(?<![\w/.-])(?:time|step_time|elapsed time per iteration \(ms\))\s*[:=]?\s*"
    r"(?P<v>\d+(?:\.\d+)?)\s*(?P<ms>ms)?",
    re.I,
)


def number(text: str) -> float | None:
    """A number as a log prints it (`1,234`, `2.000`, `8.1E+00`, Lightning's `nan.0`), or None."""
    t = text.strip().replace(",", "")
    if not WHOLE_NUMBER.match(t):
        return None
    t = t.lower()
    if "nan" in t:
        return math.nan
    if "inf" in t:
        return -math.inf if t.startswith("-") else math.inf
    return float(t)


def count(text: str | None) -> int | None:
    """A whole count below COUNT_MAX, or None."""
    if text is None or not text.isdigit():
        return None
    n = int(text)
    return n if n < COUNT_MAX else None


def seconds(text: str | None) -> float | None:
    """tqdm's `MM:SS` / `H:MM:SS`, or None (`?`)."""
    if not text or not text[0].isdigit():
        return None
    total = 0
    for part in text.split(":"):
        total = total * 60 + int(part)
    return float(total)


@dataclass
class Reading:
    """One report of progress found in the log. `kind`: "train" (the training counter or its loss), "eval" (an
    evaluation's progress or result) or "aside" (another bar: data preparation, a checkpoint, a shorter loop)."""

    kind: str
    step: int | None = None
    total: int | None = None
    epoch: int | None = None
    loss: float | None = None
    rate: float | None = None  # as printed, in `unit`
    unit: str | None = None
    per_s: float | None = None  # steps a second, where the rate counts steps (for the time left)
    left_s: float | None = None  # the bar's own estimate of the time left
    key: str | None = None  # which bar (its description, digits aside, or its total); None for a line
    bar: bool = False


def _rate(text: str) -> tuple[float | None, str | None, float | None] | None:
    """tqdm's rate (`4.99it/s`, `1.23s/it`, `12.3 examples/s`, `1.2kit/s`, `?it/s`): the value and unit as printed,
    and steps a second. None for a rate of bytes (a download, not steps)."""
    m = RATE.match(text)
    if not m:
        return None, None, None
    num, den = m["num"].strip(), m["den"].strip()
    if num.lower() in BYTES or den.lower() in BYTES:
        return None
    unit = f"{m['si'] or ''}{num}/{den}"
    v = None if m["v"] == "?" else float(m["v"])
    if v is None or not math.isfinite(v):
        return None, unit, None
    if den.lower() == "s":  # N things a second: a step each, as the bar counts them
        return v, unit, v * SI.get(m["si"] or "", 1.0)
    return v, unit, (1.0 / v if num.lower() == "s" and v > 0 else None)  # `s/it`: seconds a step


def _desc_kind(desc: str) -> str:
    plain = strip_prefix(desc)[1].strip()
    if EVAL_WORDS.search(plain):
        return "eval"
    return "aside" if ASIDE_WORDS.match(plain) else "train"


def read_bar(text: str) -> Reading | None:
    """A tqdm bar in one segment, or None. Its description says what it counts; its postfix may carry the loss."""
    m = BAR.search(text)
    total = count(m["total"]) if m else None
    if m is None:
        m = COUNT.search(text)
        if m is None or m["unit"].strip().lower() in BYTES:
            return None
    n = count(m["n"])
    rate = _rate(m["rate"])
    if n is None or (total is not None and n > total) or rate is None:
        return None
    desc = re.sub(r"\s*(?:\d{1,3}%)?\s*(?:\|[^|]*\|)?\s*$", "", text[: m.start()]).rstrip(" :")
    own = strip_prefix(desc)[1].strip()
    epoch = EPOCH_DESC.search(own)
    loss = None
    for key, value in POSTFIX.findall(m["post"] or ""):
        if LOSS_KEY.match(key):
            loss = number(value)
    key = re.sub(r"\d+", "#", own.lower()) if own else f"#{total}"
    left = seconds(m.groupdict().get("left"))
    return Reading(
        _desc_kind(own),
        n,
        total,
        int(epoch[1]) if epoch else None,
        loss,
        rate[0],
        rate[1],
        rate[2],
        left,
        key,
        bar=True,
    )


def read_hf_dict(text: str) -> Reading | None:
    """Hugging Face Trainer's logged dict: the loss and the epoch of training, or an evaluation's result."""
    if "{'" not in text or not HF_DICT.search(text):
        return None
    pairs = {k.lower(): number(v) for k, v in HF_PAIR.findall(text)}
    if any(k.startswith("eval_") for k in pairs):
        return Reading("eval")
    if "train_runtime" in pairs:  # the end of training: its mean loss is no newest loss
        return None
    epoch = pairs.get("epoch")
    ep = int(epoch) if epoch is not None and math.isfinite(epoch) and 0 <= epoch < COUNT_MAX else None
    if pairs.get("loss") is None and ep is None:
        return None
    return Reading("train", epoch=ep, loss=pairs.get("loss"))


def _line_rate(text: str) -> tuple[float | None, str | None, float | None]:
    """The throughput a step line states, in its own unit, and steps a second where it says so."""
    r = RATE_WORDS.search(text)
    if r:
        rate, unit = number(r["v"]), r["u"]
        low = unit.lower()
        if rate is None or not math.isfinite(rate):
            return None, unit, None
        if low in ("it/s", "step/s", "steps/s"):
            return rate, unit, rate
        return rate, unit, (1.0 / rate if low in ("s/it", "s/step") and rate > 0 else None)
    t = TPS.search(text)
    if t:
        return number(t["v"]), "tokens/s/GPU", None
    ms = MS_PER_ITER.search(text)
    if ms and (ms["ms"] or "per iteration" in ms[0]):
        rate = number(ms["v"])
        return rate, "ms/step", (1000.0 / rate if rate else None)
    return None, None, None


def read_step_line(text: str) -> Reading | None:
    """A `step N ... loss X` line (nanoGPT, torchtitan, Megatron, the bundled trainer, and their kind): a step
    beside a loss or a throughput. A step alone (`Step 1: load the data`, `saved at step 500`) is no report."""
    m = STEP.search(text)
    if m is None:
        return None
    step = count(m["n"])
    loss = LOSS.search(text)
    rate, unit, per_s = _line_rate(text)
    if step is None or (loss is None and rate is None):
        return None
    total = count(m["total"])
    if total is not None and step > total:
        total = None
    kind = "eval" if EVAL_BEFORE.search(text[: m.start()]) else "train"
    epoch = EPOCH.search(text)
    return Reading(
        kind, step, total, int(epoch["n"]) if epoch else None, number(loss["v"]) if loss else None, rate, unit, per_s
    )


def read_segment(text: str, whole: bool) -> Reading | None:
    """What one segment of a line reports, if anything. A segment still being written (`whole` False) is read only
    for a bar, which is known whole by its closing `]`."""
    if len(text) > READ_MAX or not any(c.isdigit() for c in text):
        return None
    if "[" in text and "]" in text:
        bar = read_bar(text)
        if bar is not None:
            return bar
    if not whole:
        return None
    return read_hf_dict(text) or read_step_line(text)


@dataclass
class Progress:
    """The newest progress a log showed, as the judge and the views use it."""

    step: int | None = None  # the training counter (a bar at 0 is no step yet)
    total: int | None = None  # where it ends, as the log says (a bar's total, `step N/M`)
    epoch: int | None = None
    loss: float | None = None  # the newest training loss, as printed (NaN and inf kept: the caller decides)
    rate: float | None = None  # the newest training throughput, as printed, in `unit`
    unit: str | None = None  # "it/s", "s/it", "samples/s", "tokens/s", "ms/step", ...
    eta_s: float | None = None  # what is left of the counter at its rate (for Lightning: of the epoch)
    phase: str | None = None  # one of PHASES


@dataclass
class Chunk:
    """What one read added: the ended lines (each as a terminal shows it), the line still being written (or None),
    and the progress reports found, in order."""

    lines: list
    open: str | None
    readings: list


class Reader:
    """One log read in pieces, read after read: the line still being written, which bar counts the steps, whether
    the step moves, and the newest progress (`progress`). A restart's start line in the log begins anew."""

    def __init__(self) -> None:
        self.partial = ""  # the text after the last `\r` of the line being written
        self.shown = ""  # that line's newest whole non-blank segment (what a terminal shows)
        self.open_shown: str | None = None  # how the line being written was handed out (the tail's last entry)
        self.progress = Progress()
        self.rates: list = []  # the newest throughputs (one per read that found one), for a trend
        self._main: tuple | None = None  # the bar that counts steps: (key, total)
        self._fresh_rate = False  # a training throughput came since the last `keep_rate`
        self._still_at: int | None = None  # the step when the counter last stood still (an eval, a finished bar)

    def feed(self, text: str, cut: bool = False) -> Chunk:
        """Read the next piece of the log. `cut`: it does not follow the previous one (bytes were skipped, the file
        was truncated): the line being written is dropped and the piece's first segment (its start unseen) is not
        read for progress."""
        if cut:
            self.partial = self.shown = ""
            self.open_shown = None
        text = (self.partial + text).replace("\r\n", "\n")
        rows = text.split("\n")
        lines, readings = [], []
        shown = self.shown
        for i, row in enumerate(rows):
            last_row = i == len(rows) - 1
            segments = row.split("\r")
            for j, raw in enumerate(segments):
                being_written = last_row and j == len(segments) - 1
                clean = ANSI.sub("", raw)
                if not clean.strip():
                    continue
                if not being_written:
                    shown = clean
                if cut and i == 0 and j == 0:
                    continue  # a fragment: its start is in the bytes skipped
                if ("[dflashctl]" in clean or "worker group" in clean) and ATTEMPT_START.search(strip_prefix(clean)[1]):
                    self._restart()
                    readings.clear()
                    continue
                found = read_segment(clean, whole=not being_written)
                if found is not None:
                    readings.append(found)
            if not last_row:
                lines.append(shown)
                shown = ""
        self.partial, self.shown = rows[-1].split("\r")[-1], shown
        if len(self.partial) > CARRY_MAX:  # no end in sight: taken as a line of its own
            lines.append(ANSI.sub("", self.partial))
            self.partial = self.shown = ""
        partial = ANSI.sub("", self.partial)
        self.open_shown = partial if partial.strip() else (self.shown or None)
        for r in readings:
            self._take(r)
        return Chunk(lines, self.open_shown, readings)

    def _restart(self) -> None:
        """A new attempt of the job starts in the log: its own counter, from nothing."""
        self.progress = Progress()
        self._main = self._still_at = None

    def _take(self, r: Reading) -> None:
        """One report into `progress`: the training counter's step, total, rate and time left; the newest training
        loss and epoch; and the phase (the step moves only from the first change after it stood still)."""
        p = self.progress
        if r.kind == "train" and r.bar and not self._counts(r):
            r.kind = "aside"
        if r.epoch is not None and r.kind == "train":
            p.epoch = r.epoch
        if r.loss is not None and r.kind == "train":
            p.loss = r.loss
        if r.kind != "train":
            self._stand(EVALUATING if r.kind == "eval" else ASIDE)
            return
        if r.step is None:  # a loss or an epoch alone (a Hugging Face dict): the counter is the bar's
            return
        if r.bar:
            self._main = (r.key, r.total)
        if r.rate is not None:
            p.rate, p.unit = r.rate, r.unit
            self._fresh_rate = True
        elif r.bar or r.unit is not None:
            p.rate, p.unit = None, r.unit
        p.total = r.total
        left = (r.total - r.step) / r.per_s if r.total is not None and r.per_s else None
        left = r.left_s if r.left_s is not None else left  # the bar's own word first
        p.eta_s = left if left is not None and math.isfinite(left) else None
        if r.bar and r.step == 0:  # nothing done yet (a new epoch's bar: 0 of its batches)
            p.step = None if p.step is None else 0
            self._stand(BEFORE)
            return
        changed = r.step != p.step
        p.step = r.step
        if r.bar and r.total is not None and r.step >= r.total:
            self._stand(BETWEEN)
        elif p.phase == STEPPING or p.phase is None or (changed and r.step != self._still_at):
            p.phase = STEPPING

    def _counts(self, r: Reading) -> bool:
        """Whether a training bar counts the steps: the first, the same bar again (Lightning's next epoch), or a
        longer one (an outer loop's bar gives way to its inner loop's). A shorter bar, finished or not, is another
        bar: Hugging Face's evaluation has no description of its own, and runs after the last step too."""
        main = self._main
        return main is None or r.key == main[0] or (r.total or 0) > (main[1] or 0)

    def _stand(self, phase: str) -> None:
        self._still_at = self.progress.step
        self.progress.phase = phase

    def keep_rate(self) -> None:
        """Note the newest training throughput, once per read that brought one, for the live view's trend."""
        if self._fresh_rate and self.progress.rate is not None:
            self.rates = (self.rates + [self.progress.rate])[-RATES_KEPT:]
        self._fresh_rate = False
