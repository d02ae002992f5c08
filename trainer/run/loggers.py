"""Optional curves in the tools people already use: TensorBoard event files and W&B, from rank 0 only.

Both are extras, off by default. A config asking for one that is not installed is a config error (exit 2) before
anything is loaded, never a crash later; a logger that fails while training is dropped with one line, and training
goes on (metrics.jsonl stays the record).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from trainer.config import TrainConfig
from trainer.errors import ConfigError

STEP_SCALARS = ("loss", "acc", "tokens_per_s", "lr", "grad_norm", "peak_mem_gib")


def check_available(cfg: TrainConfig, source: str) -> None:
    m = cfg.metrics
    if m.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(source, "metrics.tensorboard", "needs the tensorboard package (pip install tensorboard)")
    if m.wandb is not None and importlib.util.find_spec("wandb") is None:
        raise ConfigError(source, "metrics.wandb", "needs the wandb package (pip install wandb)")


def scalars(record: dict) -> tuple[int | None, dict[str, float]]:
    """(step, {tag: value}) of a metrics record worth a curve."""
    if "event" not in record:
        values = {f"train/{k}": record[k] for k in STEP_SCALARS if isinstance(record.get(k), (int, float))}
        return record.get("step"), values
    if record["event"] == "eval":
        name = record.get("prompt_set") or "holdout"
        values = {
            f"eval/{name}/{k}": record[k] for k in ("tau", "tau_pooled") if isinstance(record.get(k), (int, float))
        }
        return record.get("step"), values
    return None, {}


class TensorBoardSink:
    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"), flush_secs=10)

    def record(self, record: dict) -> None:
        step, values = scalars(record)
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step, walltime=record.get("time"))
        if record.get("event") == "finished":
            self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, run_dir: Path, cfg: TrainConfig, config_dict: dict) -> None:
        import wandb

        w = cfg.metrics.wandb
        self.run = wandb.init(
            project=w.project,
            entity=w.entity,
            name=w.name or Path(run_dir).name,
            mode=w.mode,
            dir=str(run_dir),
            config=config_dict,
            resume="allow",
        )

    def record(self, record: dict) -> None:
        step, values = scalars(record)
        if values:
            self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class Guarded:
    """A sink whose first failure drops it (with one line): curves are a convenience, training is the job."""

    def __init__(self, sink, name: str, say) -> None:
        self.sink, self.name, self.say = sink, name, say

    def record(self, record: dict) -> None:
        if self.sink is None:
            return
        try:
            self.sink.record(record)
        except Exception as e:
            self.say(f"{self.name} logging stopped: {type(e).__name__}: {e}")
            self.sink = None

    def close(self) -> None:
        if self.sink is not None:
            try:
                self.sink.close()
            except Exception:
                pass


def open_sinks(cfg: TrainConfig, run_dir: Path, config_dict: dict, say) -> list[Guarded]:
    sinks = []
    if cfg.metrics.tensorboard:
        sinks.append(Guarded(TensorBoardSink(run_dir), "tensorboard", say))
    if cfg.metrics.wandb is not None:
        sinks.append(Guarded(WandbSink(run_dir, cfg, config_dict), "wandb", say))
    return sinks
