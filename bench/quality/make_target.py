"""Make a real target here, reproducibly: a Qwen3-shaped code model trained on the Python sources this machine has.

    python bench/quality/make_target.py --out DIR [--size small|tiny] [--steps N] [--seed S]

A drafter can only be judged against a target worth drafting for, and nothing may be downloaded, so the target is
trained on code every machine with Python holds: the standard library and the pure-Python sources of a few installed
packages (torch, transformers, numpy). A byte-level BPE tokenizer is trained on the same files, with Qwen's ChatML
template. Whole files are held out (by a seeded hash of their path), never functions of a training file.

The chat half of the mixture teaches the target to answer a HumanEval-style request: the user message is a function's
signature and docstring, the answer its body. So the prompts a drafter is measured on (`prompts/heldout.jsonl`,
`{"prompt": ...}` records from held-out files) get plausible code back, and `prompts/train.jsonl` (from training files)
is what `python -m trainer.regenerate` answers with the target's own words.

Writes:
    DIR/target/            an HF directory AutoModelForCausalLM / AutoTokenizer load (weights, tokenizer, template)
    DIR/prompts/train.jsonl, DIR/prompts/heldout.jsonl
    DIR/target.json        what was made: corpus, sizes, steps, held-out loss (nats/token), seconds, versions
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import json
import math
import random
import sys
import sysconfig
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
# Qwen's ChatML template (Qwen2.5's, without the default system prompt): what `apply_chat_template` renders
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SIZES = {  # Qwen3 shapes: "small" is the benchmark's target, "mini" a CPU rehearsal, "tiny" the tests'
    "small": {
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "intermediate_size": 1536,
        "vocab_size": 8192,
    },
    "mini": {
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 384,
        "vocab_size": 2048,
    },
    "tiny": {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "intermediate_size": 64,
        "vocab_size": 512,
    },
}
QWEN_SPLIT = (  # Qwen2/Qwen3's pre-tokenizer pattern
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DEFAULT_PACKAGES = ("torch", "transformers", "numpy")


@dataclass
class Function:
    prompt: str  # signature and docstring, as written (dedented)
    body: str  # the code after the docstring


def default_roots(packages: tuple[str, ...] = DEFAULT_PACKAGES) -> list[Path]:
    """The standard library and each installed package's directory (found without importing it)."""
    roots = [Path(sysconfig.get_paths()["stdlib"])]
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            roots.append(Path(next(iter(spec.submodule_search_locations))))
    return roots


def corpus_files(roots: list[Path], max_mb: float) -> list[tuple[str, str]]:
    """(name, text) of every .py file under the roots, sorted, duplicates (same bytes) once, up to max_mb in all.

    site-packages sits inside the stdlib's tree on some layouts: it is skipped there, read only as its own root."""
    seen, out, total = set(), [], 0
    budget = int(max_mb * 1e6)
    skip = {str(r) for r in roots[1:]} | {str(Path(sysconfig.get_paths()["purelib"]))}
    for root in roots:
        nested = tuple(s + "/" for s in skip if s != str(root) and s.startswith(str(root)))
        for path in sorted(root.rglob("*.py")):
            if nested and str(path).startswith(nested):
                continue
            try:
                data = path.read_bytes()
            except OSError:
                continue
            if not 200 <= len(data) <= 200_000:
                continue
            digest = hashlib.sha1(data).digest()
            if digest in seen:
                continue
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                continue
            seen.add(digest)
            out.append((f"{root.name}/{path.relative_to(root)}", text))
            total += len(data)
            if total >= budget:
                return out
    return out


def is_heldout(name: str, seed: int, percent: float) -> bool:
    """Whole files are held out, chosen by a seeded hash of their name: the same split on every run."""
    h = int.from_bytes(hashlib.sha1(f"{seed}:{name}".encode()).digest()[:4], "big")
    return h % 10_000 < percent * 100


def functions(text: str) -> list[Function]:
    """Functions with a docstring and a body of 2 to 40 lines: the signature+docstring is the prompt."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return []
    lines = text.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or ast.get_docstring(node) is None:
            continue
        doc = node.body[0]
        if len(node.body) < 2 or node.decorator_list or doc.end_lineno is None or node.end_lineno is None:
            continue
        head = lines[node.lineno - 1 : doc.end_lineno]
        body = lines[doc.end_lineno : node.end_lineno]
        if not 2 <= len(body) <= 40 or len("\n".join(head)) > 1500:
            continue
        src = textwrap.dedent("\n".join(head + body)).split("\n")  # dedent keeps the line count
        out.append(Function("\n".join(src[: len(head)]) + "\n", "\n".join(src[len(head) :]) + "\n"))
    return out


def chat_text(fn: Function) -> str:
    """A function as one ChatML exchange: asked for by its signature and docstring, answered with its body."""
    return f"<|im_start|>user\n{fn.prompt}<|im_end|>\n<|im_start|>assistant\n{fn.body}<|im_end|>\n"


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE on the training files, ChatML specials and a mask token for the drafter, Qwen's template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Qwen's split: a newline run is its own piece, apart from the indentation after it. GPT-2's byte-level split
    # glues "\n" to the spaces that follow, so the template's "assistant\n" would end in a token the target never saw
    # before an indented line, and it would answer most requests with an immediate <|im_end|>.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        mask_token="<|mask|>",
        bos_token=None,
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def token_stream(tok, docs: list[str]) -> list[int]:
    """Every document's ids, each followed by <|endoftext|>, in the order given."""
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    out: list[int] = []
    for ids in tok(docs, add_special_tokens=False)["input_ids"]:
        out.extend(ids)
        out.append(eot)
    return out


def windows(stream: list[int], seq: int):
    import torch

    n = len(stream) // seq
    return torch.tensor(stream[: n * seq], dtype=torch.long).view(n, seq)


def build_model(shape: dict, seed: int, tok):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    shape = {**shape, "vocab_size": len(tok)}  # a small corpus gives BPE fewer merges than asked for
    cfg = Qwen3Config(
        **shape,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    cfg._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(cfg)


def mean_loss(model, data, batch: int, device: str, dtype) -> float:
    """Mean next-token loss in nats over every position of `data` ([n, seq] windows)."""
    import torch

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad(), torch.autocast(device_type=device.split(":")[0], dtype=dtype, enabled=dtype != torch.float32):
        for i in range(0, len(data), batch):
            x = data[i : i + batch].to(device)
            logits = model(input_ids=x).logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
            )
            total += loss.item()
            count += x[:, 1:].numel()
    model.train()
    return total / max(count, 1)


def train(model, data, steps: int, batch: int, lr: float, seed: int, device: str, dtype, log) -> list[dict]:
    """AdamW, linear warmup then cosine to 10%, bf16 autocast: a plain language-model run, seeded."""
    import torch

    model.to(device).train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=device.startswith("cuda")
    )
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    )
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(data), generator=gen)
    history, pos = [], 0
    for step in range(1, steps + 1):
        if pos + batch > len(order):
            order, pos = torch.randperm(len(data), generator=gen), 0
        x = data[order[pos : pos + batch]].to(device, non_blocking=True)
        pos += batch
        with torch.autocast(device_type=device.split(":")[0], dtype=dtype, enabled=dtype != torch.float32):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % max(1, steps // 20) == 0 or step == steps:
            history.append({"step": step, "loss": round(loss.item(), 4), "lr": sched.get_last_lr()[0]})
            log(f"step {step}/{steps} loss {history[-1]['loss']:.4f}")
    return history


def write_prompts(path: Path, fns: list[Function], limit: int, seed: int, with_response: bool) -> int:
    rng = random.Random(seed)
    fns = list(fns)
    rng.shuffle(fns)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for fn in fns[:limit]:
            rec = {"prompt": fn.prompt, "response": fn.body} if with_response else {"prompt": fn.prompt}
            f.write(json.dumps(rec) + "\n")
    return min(limit, len(fns))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/quality/make_target.py", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--roots", nargs="*", type=Path, default=None, help="source trees (default: stdlib + packages)")
    ap.add_argument("--max-mb", type=float, default=160.0, help="corpus size cap, MB of source")
    ap.add_argument("--heldout-percent", type=float, default=2.0)
    ap.add_argument("--steps", type=int, default=2500)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-prompts", type=int, default=4000)
    ap.add_argument("--heldout-prompts", type=int, default=200)
    ap.add_argument("--eval-tokens", type=int, default=2_000_000, help="held-out tokens the loss is measured on")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args(argv)

    import torch

    t0 = time.time()
    log = lambda s: print(f"[make_target {time.time() - t0:6.1f}s] {s}", file=sys.stderr, flush=True)  # noqa: E731
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(device == "cpu")

    roots = args.roots or default_roots()
    files = corpus_files(roots, args.max_mb)
    train_files = [(n, t) for n, t in files if not is_heldout(n, args.seed, args.heldout_percent)]
    held_files = [(n, t) for n, t in files if is_heldout(n, args.seed, args.heldout_percent)]
    if not train_files or not held_files:
        print(
            f"error: {len(files)} source files under {[str(r) for r in roots]}: too few to hold any out",
            file=sys.stderr,
        )
        return 2
    train_fns = [fn for _, t in train_files for fn in functions(t)]
    held_fns = [fn for _, t in held_files for fn in functions(t)]
    log(
        f"{len(files)} files ({sum(len(t) for _, t in files) / 1e6:.1f} MB): {len(train_files)} train, "
        f"{len(held_files)} held out; {len(train_fns)} / {len(held_fns)} documented functions"
    )

    shape = SIZES[args.size]
    tok = train_tokenizer([t for _, t in train_files], shape["vocab_size"])
    docs = [t for _, t in train_files] + [chat_text(fn) for fn in train_fns]
    random.Random(args.seed).shuffle(docs)
    data = windows(token_stream(tok, docs), args.seq)
    held = windows(token_stream(tok, [t for _, t in held_files]), args.seq)[: max(1, args.eval_tokens // args.seq)]
    log(f"tokenizer {len(tok)} ids; {data.numel() / 1e6:.1f} M training tokens, {held.numel() / 1e6:.2f} M held out")

    model = build_model(shape, args.seed, tok)
    params = sum(p.numel() for p in model.parameters())
    t_train = time.time()
    history = train(model, data, args.steps, args.batch, args.lr, args.seed, device, dtype, log)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    train_s = time.time() - t_train
    held_loss = mean_loss(model, held, args.batch, device, dtype)
    log(f"held-out loss {held_loss:.4f} nats/token ({params / 1e6:.1f} M parameters, {train_s:.0f} s of training)")

    out = args.out
    (out / "target").mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16 if device.startswith("cuda") else torch.float32).save_pretrained(out / "target")
    tok.save_pretrained(out / "target")
    n_train = write_prompts(out / "prompts" / "train.jsonl", train_fns, args.train_prompts, args.seed, True)
    n_held = write_prompts(out / "prompts" / "heldout.jsonl", held_fns, args.heldout_prompts, args.seed, False)
    import tokenizers
    import transformers

    report = {
        "seed": args.seed,
        "size": args.size,
        "shape": shape,
        "parameters": params,
        "device": device,
        "roots": [str(r) for r in roots],
        "files": len(files),
        "train_files": len(train_files),
        "heldout_files": len(held_files),
        "corpus_mb": round(sum(len(t) for _, t in files) / 1e6, 2),
        "train_tokens": data.numel(),
        "tokens_seen": args.steps * args.batch * args.seq,
        "steps": args.steps,
        "batch": args.batch,
        "seq": args.seq,
        "lr": args.lr,
        "train_loss_history": history,
        "heldout_loss_nats_per_token": round(held_loss, 4),
        "heldout_eval_tokens": held.numel(),
        "train_prompts": n_train,
        "heldout_prompts": n_held,
        "train_seconds": round(train_s, 1),
        "total_seconds": round(time.time() - t0, 1),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "python": sys.version.split()[0],
        },
    }
    (out / "target.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report[k] for k in ("parameters", "heldout_loss_nats_per_token", "train_seconds")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
