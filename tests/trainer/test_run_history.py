"""What a run leaves to be looked at later: the GPU history (NVML, from the heartbeat thread) and the optional
TensorBoard event files."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from trainer.run.gpu_history import GpuHistory
from trainer.run.metrics import Heartbeat

FAKE_NVML = Path(__file__).parents[1] / "fakes" / "nvml"


@pytest.fixture
def fake_nvml(monkeypatch):
    monkeypatch.syspath_prepend(str(FAKE_NVML))
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    yield
    sys.modules.pop("pynvml", None)


def until(done, timeout: float = 60.0) -> None:
    """Wait on state (beats counted), not on a time a loaded machine may not keep."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_gpu_history_records_the_visible_gpus_every_heartbeat(tmp_path, fake_nvml, monkeypatch):
    monkeypatch.setenv("FAKE_NVML_GPUS", "4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    hist = GpuHistory(tmp_path)
    assert hist.active and hist.indices == [2, 3]
    taken: list[int] = []
    hb = Heartbeat(tmp_path, 0.05, lambda: (hist.sample(), taken.append(1))).start()
    until(lambda: len(taken) >= 3)  # three beats, however slow this machine is
    hb.stop()
    hist.close()
    lines = [json.loads(x) for x in (tmp_path / "gpu.jsonl").read_text().splitlines()]
    assert len(lines) >= 3 and all(x["source"] == "trainer" for x in lines)
    g = lines[0]["gpus"]
    assert [x["index"] for x in g] == [2, 3]  # NVML's index, the one job files name
    # the recorded H200 reading, field by field; what the recording lacks is None, not invented
    assert g[0] | {"index": 0} == {
        "index": 0,
        "util_pct": 2,
        "mem_used_mib": 21363,
        "mem_total_mib": 143771,
        "power_w": 104.2,
        "temp_c": 37,
        "sm_mhz": 1980,
        "mem_mhz": None,
        "throttle": "0x0000000000000000",
    }
    assert sorted(x["time"] for x in lines) == [x["time"] for x in lines]


def test_gpu_history_follows_uuids_and_stops_at_a_bad_entry(tmp_path, fake_nvml, monkeypatch):
    import pynvml

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{pynvml._UUIDS[1]},GPU-nope,0")
    assert GpuHistory(tmp_path).indices == [1]  # CUDA ignores everything after an invalid entry too


def test_no_nvml_no_history_and_no_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not importable
    hist = GpuHistory(tmp_path)
    hist.sample()
    assert not hist.active and not (tmp_path / "gpu.jsonl").exists()


def test_a_failing_gpu_reading_never_stops_the_heartbeat(tmp_path):
    calls = []

    def broken():
        calls.append(1)
        raise RuntimeError("NVML_ERROR_GPU_IS_LOST")

    hb = Heartbeat(tmp_path, 0.05, broken).start()
    first = json.loads((tmp_path / "heartbeat").read_text())["time"]
    until(lambda: len(calls) >= 3 and json.loads((tmp_path / "heartbeat").read_text())["time"] > first)
    hb.stop()


def test_tensorboard_event_files_hold_the_step_curves(tmp_path):
    """A 3-step run with `metrics: {tensorboard: true}`, read back with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.trainer.test_trainer_export import CONFIG
    from trainer.config import from_dict
    from trainer.run.training import train

    cfg = from_dict({**CONFIG, "eval": {"at_end": True, "prompts": 2, "max_new_tokens": 8}})
    train(cfg, run_dir=tmp_path / "run", log=lambda s: None)
    files = list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 1
    acc = EventAccumulator(str(files[0].parent))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/acc", "train/tokens_per_s", "train/lr", "train/grad_norm"} <= tags
    assert {"eval/holdout/tau", "eval/holdout/tau_pooled"} <= tags
    losses = [e.value for e in acc.Scalars("train/loss")]
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3]
    assert losses == pytest.approx([r["loss"] for r in recs if "event" not in r], rel=1e-6)


def test_a_logger_asked_for_and_not_installed_is_a_config_error(tmp_path, monkeypatch):
    from tests.trainer.test_trainer_export import CONFIG
    from trainer.config import from_dict
    from trainer.errors import ConfigError
    from trainer.run.training import train

    real = __import__("importlib.util").util.find_spec
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    cfg = from_dict({**CONFIG, "metrics": {"wandb": {"project": "p"}}}, "train.yaml")
    with pytest.raises(ConfigError, match=r"^train.yaml: metrics.wandb: needs the wandb package"):
        train(cfg, "train.yaml", run_dir=tmp_path / "run", log=lambda s: None)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
