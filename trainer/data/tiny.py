"""A tiny target with a real tokenizer and chat template, and a tiny chat dataset, made here (nothing downloaded).

For the demo and the tests: `python -m trainer.tiny --out DIR` writes `DIR/target/` (a random tiny Qwen3 that
`AutoModelForCausalLM.from_pretrained` loads, with a word-level tokenizer and a chat template) and `DIR/chat.jsonl`.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SPECIALS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
MASK = "<|mask|>"  # the drafter's mask token: the last id, never in a conversation
ROLES = ["system", "user", "assistant"]
WORDS = (  # noqa: SIM905
    "the a one two three four five six seven eight nine ten red green blue cat dog bird fish tree river stone "
    "runs jumps sees eats finds makes counts and then after before is are what how why please tell me about list "
    "numbers colours animals count say repeat next , . ? !"
).split()
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def build_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIALS + ROLES + WORDS + [MASK])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<|im_end|>",
        bos_token=None,
        mask_token=MASK,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def chat_samples(n: int, seed: int) -> list[dict]:
    """Conversations with a learnable answer: counting on from a number, naming the next colours, and so on."""
    rng = random.Random(seed)
    numbers = WORDS[WORDS.index("one") : WORDS.index("ten") + 1]
    colours = ["red", "green", "blue"]
    out = []
    for _ in range(n):
        start = rng.randrange(len(numbers))
        if rng.random() < 0.5:
            question = f"please count after {numbers[start]} ."
            answer = " ".join(numbers[(start + k) % len(numbers)] for k in range(1, 13)) + " ."
        else:
            question = f"list colours after {colours[start % 3]} ?"
            answer = " ".join(colours[(start + k) % 3] for k in range(1, 13)) + " ."
        msgs = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        if rng.random() < 0.3:
            msgs.insert(0, {"role": "system", "content": "say what is next ."})
        out.append({"messages": msgs})
    return out


def write_tiny_target(out: Path, seed: int = 0) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = build_tokenizer()
    config = AutoConfig.for_model(
        model_type="qwen3",
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        initializer_range=0.3,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.tiny", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory to write target/ and chat.jsonl into")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = Path(args.out)
    write_tiny_target(out / "target", args.seed)
    with open(out / "chat.jsonl", "w") as f:
        for rec in chat_samples(args.samples, args.seed):
            f.write(json.dumps(rec) + "\n")
    print(f"wrote {out / 'target'} and {out / 'chat.jsonl'} ({args.samples} conversations)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
