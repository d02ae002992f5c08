"""The files other tools read while the trainer runs: `metrics.jsonl` and `heartbeat` (docs/metrics.md).

`metrics.jsonl` holds one JSON object per line: step records and event records. Rank 0 writes step records; any rank
may append a `fatal` record (small appends to an O_APPEND file do not interleave). The heartbeat is rewritten every few
seconds by a thread of rank 0 with the current step and phase; a stopped or frozen process stops it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

STEP_FIELDS = {
    "time": float,
    "step": int,
    "epoch": int,
    "tokens_per_s": float,
    "loss": float,
    "acc": float,
    "lr": float,
    "grad_norm": float,
    "peak_mem_gib": float,
}
EVENT_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "start": {"world_size": int, "resumed_from": (int, type(None)), "config": dict},
    "data": {"samples": int, "dropped_too_short": int, "dropped_too_long": int, "truncated": int, "holdout": int},
    "preflight": {"buckets": list, "seconds": dict, "peak_mem_gib": dict, "attention": dict},
    "preflight_progress": {"rank": int, "bucket": int, "of": int, "seq_len": int, "part": str, "elapsed_s": float},
    "recompile": {"step": int, "graphs": int},
    "checkpoint": {"path": str, "step": int},
    "checkpoint_fallback": {"skipped": list, "using": (str, type(None))},
    "checkpoint_skipped": {"step": int, "nonfinite_steps": int},
    "export": {"path": str, "step": int},
    "eval": {"step": int, "tau": float, "prompts": int, "draft_steps": int},
    "fatal": {"kind": str, "message": str},
    "finished": {"step": int},
}
FATAL_KINDS = ("dense_fallback", "config", "crash", "diverged")


def validate_record(rec: dict) -> list[str]:
    """Problems with one metrics record against the contract ([] when it conforms)."""
    problems = []
    if not isinstance(rec.get("time"), (int, float)):
        problems.append("missing numeric `time`")
    if "event" in rec:
        fields = EVENT_FIELDS.get(rec["event"])
        if fields is None:
            return problems + [f"unknown event {rec['event']!r}"]
    else:
        fields = STEP_FIELDS
    for name, tp in fields.items():
        if name not in rec:
            problems.append(f"missing `{name}`")
        elif name in ("loss", "grad_norm") and rec[name] is None and rec.get("skipped") is True:
            continue  # a skipped non-finite step: NaN is not JSON, null stands for it
        elif tp is float and not isinstance(rec[name], (int, float)):
            problems.append(f"`{name}` is not a number")
        elif tp is not float and not isinstance(rec[name], tp):
            problems.append(f"`{name}` has type {type(rec[name]).__name__}")
    if rec.get("event") == "fatal" and rec.get("kind") not in FATAL_KINDS:
        problems.append(f"fatal kind {rec.get('kind')!r} not one of {FATAL_KINDS}")
    return problems


class MetricsWriter:
    """Appends records to `<run_dir>/metrics.jsonl`; only the main rank writes unless `always` is set."""

    def __init__(self, run_dir: Path, is_main: bool, sinks: list | None = None) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.is_main = is_main
        self.sinks = sinks or []  # TensorBoard, W&B (trainer.run.loggers): the main rank's records, after the line

    def write(self, record: dict, always: bool = False) -> None:
        if not (self.is_main or always):
            return
        line = json.dumps({"time": round(time.time(), 3), **record}, separators=(",", ":")) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
        if self.is_main:
            for sink in self.sinks:
                sink.record(record)

    def event(self, name: str, always: bool = False, **fields) -> None:
        self.write({"event": name, **fields}, always=always)


class Heartbeat:
    """A daemon thread rewriting `<run_dir>/heartbeat` every `interval` s: {"time", "step", "phase", "pid"}."""

    def __init__(self, run_dir: Path, interval: float, on_beat=None) -> None:
        self.path = Path(run_dir) / "heartbeat"
        self.interval = interval
        self.on_beat = on_beat  # called after each beat in the thread (the GPU history); its failures are ignored
        self.step = 0
        self.phase = "starting"
        self.detail: dict | None = None  # what the phase is doing (the preflight's bucket, part, estimate)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self.beat()
        self._thread.start()
        return self

    def beat(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        body = {"time": time.time(), "step": self.step, "phase": self.phase, "pid": os.getpid()}
        if self.detail is not None:
            body["detail"] = self.detail
        tmp.write_text(json.dumps(body))
        os.replace(tmp, self.path)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.beat()
            except OSError:
                pass  # a full disk or a removed run dir must not kill training; the watcher sees the age grow
            if self.on_beat is not None:
                try:
                    self.on_beat()
                except Exception:  # a GPU reading that fails must never stop the heartbeat
                    pass

    def stop(self) -> None:
        """The last beat carries the last step and phase (a run shorter than one interval, or a loaded host, would
        otherwise leave an older one); written after the thread ended, so no two writers share the temp file."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=max(5.0, 2 * self.interval))
        try:
            self.beat()
        except OSError:
            pass  # a full disk or a removed run dir: the last periodic beat stays
