"""`python -m trainer.regenerate`: rewrite a dataset's responses with the target model itself.

The DFlash recipe trains the drafter on the target's own outputs, so that it learns the distribution it will have
to predict at inference. Every assistant turn of a conversation is rewritten, in order, each conditioned on the
history as already rewritten (the loss covers every assistant turn, so none may stay the dataset's own). A
{"prompt", "response"} record gets a new response; an {"input_ids", "loss_mask"} record new tokens after its prompt.

Work is batched by turn round (every conversation's first assistant turn, then every second one, ...) with similar
lengths sharing a batch. Greedy decoding runs on `static_decode` (a static KV cache and CUDA graphs of the decode
step, each row stopping at its own end token); sampling runs on `model.generate`. Finished turns are appended to
OUTPUT.partial as they come, so an interrupted run started again with the same arguments continues where it stopped;
OUTPUT appears, whole, only at the end.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trainer.data.prompts import render
from trainer.errors import EXIT_CONFIG, ConfigError


@dataclass
class Item:
    """One record and the turns it needs: `turns` indexes its assistant messages (or [0] for prompt/ids records)."""

    rec: dict
    kind: str  # "messages" | "prompt" | "ids"
    turns: list[int]
    new: dict[int, object] = field(default_factory=dict)  # turn -> new text (or token ids for "ids")


def parse(rec: object, tok) -> Item:
    if not isinstance(rec, dict):
        raise ValueError('expected {"messages"}, {"prompt", "response"} or {"input_ids", "loss_mask"}')
    if "input_ids" in rec:
        return Item(rec, "ids", [0])
    if tok is None:
        raise ValueError("text records need a tokenizer (data.tokenizer or target.path)")
    if "messages" in rec:
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m for m in msgs):
            raise ValueError("messages must be a list of {role, content}")
        turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant" and i > 0]
        return Item(rec, "messages", turns or [len(msgs)])  # no assistant turn yet: answer the conversation
    if "prompt" in rec:
        return Item(rec, "prompt", [0])
    raise ValueError('expected {"messages"}, {"prompt", "response"} or {"input_ids", "loss_mask"}')


def history(item: Item, turn: int) -> list[dict]:
    """The messages before assistant message `turn`, with earlier assistant turns already rewritten."""
    if item.kind == "prompt":
        return [{"role": "user", "content": item.rec["prompt"]}]
    msgs = []
    for i, m in enumerate(item.rec["messages"][:turn]):
        msgs.append({**m, "content": item.new[i]} if i in item.new else m)
    return msgs


def prompt_ids(item: Item, turn: int, tok, thinking: bool) -> list[int]:
    if item.kind == "ids":
        ids, mask = item.rec["input_ids"], item.rec.get("loss_mask") or []
        first = next((i for i, m in enumerate(mask) if m), len(ids))
        return list(ids[: max(first, 1)])
    return render(tok, history(item, turn), thinking)


def rebuild(item: Item, prompt_of_ids: list[int] | None) -> dict:
    rec = item.rec
    if item.kind == "ids":
        new = item.new[0]
        return {"input_ids": prompt_of_ids + new, "loss_mask": [0] * len(prompt_of_ids) + [1] * len(new)}
    if item.kind == "prompt":
        return {**rec, "response": item.new[0]}
    msgs = [dict(m) for m in rec["messages"]]
    for i, text in item.new.items():
        if i < len(msgs):
            msgs[i]["content"] = text
        else:
            msgs.append({"role": "assistant", "content": text})
    return {**rec, "messages": msgs}


@torch.no_grad()
def generate(model, prompts: list[list[int]], max_new_tokens: int, temperature: float, top_p: float, pad: int, ends):
    """Left-padded batched generation; returns the new tokens of each prompt, cut at the first end token."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        attn[i, width - len(p) :] = 1
    kwargs = dict(do_sample=temperature > 0, max_new_tokens=max_new_tokens, pad_token_id=pad)
    if temperature > 0:
        kwargs.update(temperature=temperature, top_p=top_p)
    out = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device), **kwargs)[:, width:].tolist()
    return [row[: next((i + 1 for i, t in enumerate(row) if t in ends), len(row))] for row in out]


class Progress:
    """OUTPUT.partial: a header naming the input and the settings, then one line per finished turn (flushed and
    fsynced per batch). A partial file of other settings is refused, never mixed in."""

    def __init__(self, output: Path, key: dict) -> None:
        self.path = output.with_name(output.name + ".partial")
        self.key = key
        self.done: dict[tuple[int, int], object] = {}
        self.lock = os.open(output.with_name(output.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:  # one regenerate per output: a second one would append the same turns twice
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.lock)
            raise ConfigError(
                str(output), None, "another regenerate is writing this output: wait for it or choose another --output"
            ) from None
        try:
            self._open(key)
        except BaseException:
            os.close(self.lock)
            raise

    def _open(self, key: dict) -> None:
        if self.path.exists():
            lines = self.path.read_text(errors="replace").splitlines()
            try:
                header = json.loads(lines[0]) if lines else None
            except ValueError:
                header = None
            if header != key:
                raise ConfigError(
                    str(self.path), None, "left by a run with other input or settings; delete it to start over"
                )
            for line in lines[1:]:
                try:
                    r = json.loads(line)
                    self.done[(r["record"], r["turn"])] = r["new"]
                except (ValueError, KeyError, TypeError):
                    break  # a line cut by the interruption: that turn is done again
        self.f = open(self.path, "a")  # noqa: SIM115
        os.chmod(self.path, 0o600)
        if not self.done and self.path.stat().st_size == 0:
            self.f.write(json.dumps(key) + "\n")

    def add(self, rows: list[tuple[int, int, object]]) -> None:
        for record, turn, new in rows:
            self.done[(record, turn)] = new
            self.f.write(json.dumps({"record": record, "turn": turn, "new": new}) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())

    def finish(self) -> None:
        self.f.close()
        self.path.unlink()
        self.release()

    def release(self) -> None:
        """Let another regenerate write this output (also after an error)."""
        if self.lock >= 0:
            os.close(self.lock)
            self.lock = -1


def target_identity(path: str | None) -> str | None:
    """Which target files these are: sha256 over every file's name, size and mtime, and config.json's bytes (the
    weights are not read: a changed file changes its size or mtime)."""
    if not path or not Path(path).is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(Path(path).iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
            if f.name == "config.json":
                h.update(f.read_bytes())
    return h.hexdigest()


def engine_of(args) -> str:
    """`static` (greedy on the static decoder) unless sampling asks for `model.generate`."""
    if args.engine == "auto":
        return "static" if args.temperature == 0 else "hf"
    return args.engine


def _generate_all(args, cfg, tok, items: list, progress: Progress, output: Path, thinking: bool) -> dict:
    """Every turn not yet in the partial file, round by round, then OUTPUT written whole; the decoding's counts."""
    import time

    from tqdm import tqdm

    from trainer.data.static_decode import StaticDecoder
    from trainer.model.target import build_model, end_token_ids, resolve_device

    model = build_model(cfg.target, resolve_device(cfg.device), args.config).eval()
    torch.manual_seed(args.seed)
    pad = getattr(model.config, "pad_token_id", None) or 0
    ends = end_token_ids(model)
    for (r, t), new in progress.done.items():
        items[r].new[t] = new
    total = sum(len(it.turns) for it in items)
    bar = tqdm(total=total, initial=len(progress.done), unit="turn", file=sys.stderr, disable=args.quiet)
    engine, decoder, tokens, seconds, decoded = engine_of(args), None, 0, 0.0, 0
    for round_ in range(max(len(it.turns) for it in items)):  # turn k of every record needs turn k-1 rewritten
        todo = [
            (r, it.turns[round_])
            for r, it in enumerate(items)
            if round_ < len(it.turns) and it.turns[round_] not in it.new
        ]
        prompts = {rt: prompt_ids(items[rt[0]], rt[1], tok, thinking) for rt in todo}
        todo.sort(key=lambda rt: len(prompts[rt]))  # similar lengths share a batch
        longest = max((len(p) for p in prompts.values()), default=0)
        if engine == "static" and todo and (decoder is None or longest + args.max_new_tokens > decoder.capacity):
            decoder = None  # the old cache goes before the new one is allocated
            decoder = StaticDecoder(model, min(args.batch_size, len(todo)), longest, args.max_new_tokens, ends, pad)
        for start in range(0, len(todo), args.batch_size):
            chunk = todo[start : start + args.batch_size]
            t0 = time.perf_counter()
            if decoder is not None:
                outs = decoder.generate([prompts[rt] for rt in chunk])
            else:
                outs = generate(
                    model, [prompts[rt] for rt in chunk], args.max_new_tokens, args.temperature, args.top_p, pad, ends
                )
            seconds += time.perf_counter() - t0  # the lists above are on the host: the GPU work is done
            tokens, decoded = tokens + sum(len(o) for o in outs), decoded + len(chunk)
            rows = []
            for (r, t), out in zip(chunk, outs, strict=True):
                new = out if items[r].kind == "ids" else tok.decode(out, skip_special_tokens=True)
                items[r].new[t] = new
                rows.append((r, t, new))
            progress.add(rows)
            bar.update(len(chunk))
    bar.close()
    tmp = output.with_name(output.name + ".tmp")
    with open(tmp, "w") as f:
        for it in items:
            f.write(json.dumps(rebuild(it, prompt_ids(it, 0, tok, thinking) if it.kind == "ids" else None)) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, output)
    progress.finish()
    return {
        "engine": engine,
        "batch_size": args.batch_size,
        "turns": decoded,
        "tokens": tokens,
        "decode_s": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1) if seconds else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.regenerate", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="trainer config: its target (and data.tokenizer) are used")
    ap.add_argument("--input", required=True, help="JSONL to read")
    ap.add_argument("--output", required=True, help="JSONL to write (whole, at the end)")
    ap.add_argument("--max-new-tokens", type=int, default=4096)
    ap.add_argument(
        "--thinking",
        choices=["on", "off"],
        default="off",
        help="the chat template's enable_thinking (the public Qwen3-8B drafter is non-thinking)",
    )
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument(
        "--engine",
        choices=["auto", "static", "hf"],
        default="auto",
        help="static: greedy on a static KV cache with CUDA graphs (auto when --temperature 0); hf: "
        "model.generate (sampling)",
    )
    ap.add_argument("--stats", default=None, help="also write the decoding's counts (tokens, seconds) as JSON here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    if args.max_new_tokens < 1 or args.batch_size < 1:
        print("config error: --max-new-tokens and --batch-size must be at least 1", file=sys.stderr)
        return EXIT_CONFIG
    if args.engine == "static" and args.temperature > 0:
        print("config error: --engine static decodes greedily: use --temperature 0 or --engine hf", file=sys.stderr)
        return EXIT_CONFIG
    output, thinking = Path(args.output), args.thinking == "on"
    try:
        from trainer.config import load_config
        from trainer.data.dataset import load_tokenizer

        cfg = load_config(args.config)
        tok = load_tokenizer(cfg.data.tokenizer or cfg.target.path, args.config)
        raw = Path(args.input).read_bytes()
        items = []
        for n, line in enumerate(raw.decode("utf-8").splitlines(), 1):
            if line.strip():
                try:
                    items.append(parse(json.loads(line), tok))
                except (ValueError, KeyError, TypeError, AttributeError) as e:
                    raise ConfigError(f"{args.input}:{n}", None, str(e) or "malformed record") from None
        from trainer.model.target import resolve_device

        key = {
            "input_sha256": hashlib.sha256(raw).hexdigest(),
            "max_new_tokens": args.max_new_tokens,
            "thinking": args.thinking,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "seed": args.seed,
            "batch_size": args.batch_size,
            "engine": engine_of(args),
            "target": cfg.target.path or cfg.target.random_preset,
            "target_files": target_identity(cfg.target.path),
            "dtype": cfg.target.dtype,
            "device": resolve_device(cfg.device).type,
        }  # every setting that changes what is generated
        progress = Progress(output, key)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except (OSError, UnicodeDecodeError) as e:
        print(f"config error: {args.input}: cannot read: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        stats = _generate_all(args, cfg, tok, items, progress, output, thinking)
    finally:
        progress.release()
    if args.stats:
        Path(args.stats).write_text(json.dumps(stats) + "\n")
    print(f"wrote {len(items)} records ({sum(len(it.turns) for it in items)} turns) to {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
