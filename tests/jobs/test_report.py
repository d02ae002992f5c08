"""`dflashctl report`: a run dir with a few hundred records, a crash and a restart, drawn as a PNG (checked through
matplotlib's own objects), as HTML, as a terminal chart inside tmux, and summed up as --json."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflashctl.agent import files
from dflashctl.show import report
from tests.cli.test_cli import record
from tests.conftest import run_cli

T0 = 1_764_000_000.0


def write_run(run: Path, resume_at: int = 150, steps: int = 300) -> dict:
    """Two attempts (the second resumed from `resume_at`), evals on a named prompt set, two ranks' preflight
    records, two GPUs' history, watch's decisions, and garbage lines of every shape."""
    run.mkdir(parents=True)
    lines, t = [], T0
    losses = {}
    for attempt, (first, last) in enumerate([(1, resume_at + 10), (resume_at + 1, steps)]):
        resumed = None if attempt == 0 else resume_at
        lines.append({"time": t, "event": "start", "world_size": 2, "resumed_from": resumed, "config": {}})
        for rank, dt in ((0, 11.0), (1, 12.5)):
            lines.append(
                {
                    "time": t + dt,
                    "event": "preflight",
                    "rank": rank,
                    "buckets": [1024],
                    "seconds": {},
                    "peak_mem_gib": {},
                }
            )
        t += 13
        for step in range(first, last + 1):
            t += 0.5
            losses[step] = 8.0 * math.exp(-step / 80) + 0.5
            lines.append(
                {
                    "time": t,
                    "step": step,
                    "epoch": 0,
                    "loss": losses[step],
                    "acc": 1 - losses[step] / 9,
                    "tokens_per_s": 12000.0 + step,
                    "lr": 6e-4,
                    "grad_norm": 1.5,
                }
            )
            if step % 100 == 0:
                lines.append(
                    {
                        "time": t,
                        "event": "eval",
                        "step": step,
                        "prompt_set": "gsm8k",
                        "tau": 1 + step / 100,
                        "tau_pooled": 1 + step / 100,
                        "prompts": 8,
                        "draft_steps": 40,
                    }
                )
        if attempt == 0:
            crash_at = t + 1
            t += 30
    text = "".join(json.dumps(x) + "\n" for x in lines)
    text += '[1, 2, 3]\n"a string"\n{"step": 7, "loss": 1.0}\n{"time": 6, "step": "8", "loss": NaN}\n'
    (run / "metrics.jsonl").write_text(text)
    gpu = [
        {
            "time": T0 + i * 2.5,
            "source": "trainer",
            "gpus": [
                {"index": i_, "util_pct": 90 + i_, "mem_used_mib": 40000 + 1000 * i_, "power_w": 500.0 + i_}
                for i_ in (0, 1)
            ],
        }
        for i in range(int((t - T0) / 2.5))
    ]
    (run / "gpu.jsonl").write_text("".join(json.dumps(x) + "\n" for x in gpu) + "{cut\n")
    decisions = [
        {"time": crash_at, "decision": "state", "state": "CRASHED", "previous": "RUNNING"},
        {"time": crash_at + 1, "decision": "restart", "after": "CRASHED", "attempt": 1},
        {"time": crash_at + 2, "decision": "state", "state": "RUNNING"},
    ]
    (run / "events.jsonl").write_text("".join(json.dumps(x) + "\n" for x in decisions))
    (run / "restarts").write_text("1\n")
    kept = [losses[s] for s in sorted(losses)]
    return {"losses": kept, "last_time": t, "gpu_samples": len(gpu)}


def test_series_and_summary_from_one_history_answer(tmp_path):
    truth = write_run(tmp_path / "run")
    hist = files.history({"run_dir": str(tmp_path / "run")})
    s = report.series("exp", hist)
    assert len(s.steps) == 310 and s.steps[-1] == 300 and s.malformed == 5  # a list, a string, a cut
    # line, a record without a time and one whose step is a string
    assert [m.step for m in s.markers if m.kind == "restart" and m.step is not None] == [150]
    assert [m.label for m in s.markers if m.kind == "verdict"] == ["CRASHED"]
    assert [e[:1] + e[2:] for e in s.evals] == [(100, "gsm8k"), (200, "gsm8k"), (300, "gsm8k")]
    assert [round(b - a, 1) for a, b in s.preflight] == [12.5, 12.5]  # to the slower rank's record
    assert set(s.gpu) == {0, 1} and len(s.gpu[0]["time"]) == truth["gpu_samples"]
    sm = report.summary(s, hist, gpus_asked=1)
    assert sm["step"] == 300 and sm["restarts"] == 1 and sm["best_tau"] == 4.0 and sm["best_tau_set"] == "gsm8k"
    assert sm["first_loss"] == pytest.approx(8.0 * math.exp(-1 / 80) + 0.5)
    assert sm["loss"] == pytest.approx(8.0 * math.exp(-300 / 80) + 0.5) == pytest.approx(sm["min_loss"])
    assert sm["gpus"] == 2 and sm["gpu_hours"] == pytest.approx(2 * sm["elapsed_s"] / 3600, abs=1e-3)
    assert sm["elapsed_s"] == pytest.approx(truth["last_time"] - T0, abs=0.2)
    # thinning keeps the shape of a long run and its last point
    thin = files.history({"run_dir": str(tmp_path / "run"), "max_points": 50})
    steps = [r["step"] for r in thin["metrics"] if type(r.get("step")) is int]
    assert len(steps) <= 52 and steps[-1] == 300 and thin["step_records"] == 311


def test_the_figure_has_every_panel_and_marks_the_restart(tmp_path):
    from dflashctl.show import plots

    write_run(tmp_path / "a")
    write_run(tmp_path / "b", resume_at=100)
    runs = [report.series(n, files.history({"run_dir": str(tmp_path / n)})) for n in ("a", "b")]
    fig = plots.figure(runs)
    axes = {ax.get_title(): ax for ax in fig.axes}
    assert set(axes) == {
        "loss",
        "accuracy",
        "tokens/s",
        "tau",
        "lr",
        "grad norm",
        "GPU util %",
        "GPU memory GiB",
        "GPU power W",
    }
    loss = axes["loss"]
    labels = [ln.get_label() for ln in loss.get_lines()]
    assert {"a raw", "a smoothed", "b raw", "b smoothed"} <= set(labels)  # two runs overlaid
    resume_lines = [ln for ln in loss.get_lines() if ln.get_label().startswith("resumed from")]
    assert sorted(ln.get_xdata()[0] for ln in resume_lines) == [100, 150]
    raw = next(ln for ln in loss.get_lines() if ln.get_label() == "a raw")
    assert len(raw.get_xdata()) == 310
    tau = [ln for ln in axes["tau"].get_lines() if not ln.get_label().startswith("resumed")]
    assert [ln.get_label() for ln in tau] == ["a (gsm8k)", "b (gsm8k)"] and list(tau[0].get_ydata()) == [2, 3, 4]
    util = axes["GPU util %"]
    assert {"a gpu0", "a gpu1", "b gpu0", "b gpu1"} <= {ln.get_label() for ln in util.get_lines()}
    assert sum(1 for p in util.patches if p.get_label().endswith("preflight")) == 4  # two attempts x two runs
    assert "CRASHED" in {ln.get_label() for ln in util.get_lines()}
    assert util.get_xlabel() == "minutes" and loss.get_xlabel() == "step"
    plots._close(fig)


def test_report_through_the_cli_json_png_html(client, monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(client.home / "state"))
    write_run(tmp_path / "runs" / "one")
    write_run(tmp_path / "runs" / "two", resume_at=80)
    for name in ("one", "two"):
        record(client, f"{name}-20261201T100000Z-aaaa", state="FINISHED")
        from dflashctl.jobs import registry

        registry.update(f"{name}-20261201T100000Z-aaaa", run_dir=str(tmp_path / "runs" / name))
    res = run_cli("report", "one-2026", "two-2026", "--json")
    assert res.code == 0, res.stderr
    got = json.loads(res.stdout)
    assert [j["id"] for j in got["jobs"]] == ["one-20261201T100000Z-aaaa", "two-20261201T100000Z-aaaa"]
    assert set(got["jobs"][0]) >= {
        "step",
        "elapsed_s",
        "first_loss",
        "loss",
        "min_loss",
        "mean_tokens_per_s",
        "best_tau",
        "restarts",
        "gpu_hours",
    }
    # `status` says the same numbers of the same run (one definition, over the whole metrics.jsonl)
    st = json.loads(run_cli("status", "one-20261201T100000Z-aaaa", "--json").stdout)
    one = got["jobs"][0]
    for key in ("mean_tokens_per_s", "elapsed_s", "first_loss", "loss", "step"):
        assert st[key] == one[key] and st[key] is not None, (key, st[key], one[key])
    png = tmp_path / "r.png"
    res = run_cli("report", "one-2026", "--out", str(png))
    assert res.code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(str(png)).shape[:2] == (1100, 1500)
    page = tmp_path / "r.html"
    assert run_cli("report", "one-2026", "two-2026", "--out", str(page)).code == 0
    text = page.read_text()
    assert text.count("<svg") == 1 and "<td>one-20261201T100000Z-aaaa</td>" in text
    res = run_cli("report", "one-2026", "--out", str(tmp_path / "r.txt"))
    assert res.code == 2 and len(res.stderr.strip().splitlines()) == 1
    assert "--out: must end in .png or .html" in res.stderr
    assert not (tmp_path / "r.txt").exists()
    # a symlink at --out: the user's file it points to is never overwritten
    mine = tmp_path / "thesis.png"
    mine.write_bytes(b"my own work")
    link = tmp_path / "latest.png"
    link.symlink_to(mine)
    res = run_cli("report", "one-2026", "--out", str(link))
    assert res.code == 2 and "is a symlink" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert mine.read_bytes() == b"my own work" and link.is_symlink()
    # written whole by rename: no temp file left beside it
    assert run_cli("report", "one-2026", "--out", str(png)).code == 0
    assert not [f for f in tmp_path.iterdir() if ".tmp" in f.name]


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_the_terminal_report_fits_80_columns_inside_tmux(client, monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(client.home / "state"))
    write_run(tmp_path / "runs" / "one")
    record(client, "one-20261201T100000Z-aaaa", state="FINISHED")
    from dflashctl.jobs import registry

    registry.update("one-20261201T100000Z-aaaa", run_dir=str(tmp_path / "runs" / "one"))
    sock, done = f"report-{tmp_path.name}", tmp_path / "done"
    cmd = f"{sys.executable} -m dflashctl report one-2026; echo $? > {done}; sleep 60"
    tmux = ["tmux", "-L", sock]
    subprocess.run(
        [
            *tmux,
            "new-session",
            "-d",
            "-x",
            "80",
            "-y",
            "70",
            "-s",
            "r",
            "-c",
            str(client.project),
            "-e",
            f"HOME={client.home}",
            "-e",
            f"DFLASHCTL_STATE_DIR={client.home / 'state'}",
            cmd,
        ],
        check=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        screen = subprocess.run(
            [*tmux, "capture-pane", "-p", "-t", "r", "-S", "-200"], capture_output=True, text=True, check=True
        ).stdout
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
    assert done.read_text().strip() == "0", screen
    assert "loss by step" in screen and "tokens/s by step" in screen and "GPU util % by minute" in screen
    assert "one-20261201T100000Z-aaaa: 300 steps" in screen and "best tau 4.00 on gsm8k" in screen
    assert max(len(line.rstrip()) for line in screen.splitlines()) <= 80


def test_a_real_h200_run_reads_as_it_ran(tmp_path):
    """The files a 300-step run wrote on an H200 (NVML readings included), summed up and drawn."""
    from dflashctl.show import plots

    fixture = Path(__file__).parents[1] / "fixtures" / "h200-run"
    hist = files.history({"run_dir": str(fixture)})
    s = report.series("h200", hist)
    recs = [json.loads(x) for x in (fixture / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "event" not in r]
    sm = report.summary(s, hist, 1)
    assert sm["step"] == 300 and sm["malformed_records"] == 0 and sm["gpus"] == 1
    assert sm["mean_tokens_per_s"] == pytest.approx(sum(r["tokens_per_s"] for r in steps) / 300, abs=0.1)
    assert sm["first_loss"] == steps[0]["loss"] and sm["loss"] == steps[-1]["loss"]
    assert len(sm["preflight_s"]) == 1 and 5 < sm["preflight_s"][0] < 60
    util = s.gpu[0]["util"]
    assert max(util) == 100 and min(util) == 0 and max(s.gpu[0]["power_w"]) > 600  # busy while training, idle after
    fig = plots.figure([s])
    assert len(next(ax for ax in fig.axes if ax.get_title() == "GPU power W").get_lines()) == 1
    plots._close(fig)


def test_extreme_values_are_skipped_and_counted_and_a_nan_stretch_is_named(tmp_path):
    from dflashctl.show import plots

    run = tmp_path / "x"
    run.mkdir()
    lines = [{"time": T0, "event": "start", "world_size": 1, "resumed_from": None, "config": {}}]
    for step in range(1, 301):
        rec = {"time": T0 + step, "step": step, "loss": 5.0 - step / 100, "lr": 1e-3}
        if step >= 200:
            rec.update(loss=None, grad_norm=None, skipped=True)  # the trainer's non-finite steps
        lines.append(rec)
    text = "".join(json.dumps(x) + "\n" for x in lines)
    text += (
        f'{{"time": {T0 + 301}, "step": 301, "loss": 1e308}}\n{{"time": {T0 + 302}, "step": 302, "loss": '
        f'{10**400}}}\n{{"time": {T0 + 303}, "step": {10**30}, "loss": 1.0}}\n'
        f'{{"time": {T0 + 304}, "step": 303, "loss": NaN}}\n'
    )
    (run / "metrics.jsonl").write_text(text)
    s = report.series("x", files.history({"run_dir": str(run)}))
    summ = report.summary(s, {}, 0)
    assert summ["malformed_records"] == 3  # 1e308, 10**400 and step 10**30 skipped and counted
    assert summ["nonfinite_steps"] == 102 and summ["nonfinite_from_step"] == 200  # 200..300, and the NaN at 303
    assert any("NaN/inf from step 200" in m.label for m in s.markers)
    assert summ["loss"] == pytest.approx(5.0 - 199 / 100)
    plots._close(plots.figure([s]))  # draws
    plots.write_png([s], tmp_path / "x.png")
    assert plots.terminal([s], 80)


def test_a_cpu_run_says_it_has_no_gpu_history_instead_of_empty_shaded_panels(tmp_path):
    from dflashctl.show import plots

    write_run(tmp_path / "cpu")
    (tmp_path / "cpu" / "gpu.jsonl").unlink()
    s = report.series("cpu", files.history({"run_dir": str(tmp_path / "cpu")}))
    fig = plots.figure([s])
    util = next(ax for ax in fig.axes if ax.get_title() == "GPU util %")
    assert not util.patches and any("no GPU history" in t.get_text() for t in util.texts)
    assert all(len(ax.get_xticks()) <= 8 for ax in fig.axes)
    plots._close(fig)
    assert "no GPU history" in plots.terminal([s], 80)
