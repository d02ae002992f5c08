"""Prompt sets for measuring tau, in the formats people already have on disk, rendered through the chat template.

One JSON object per line, recognised by its key:
    {"question": ...}               GSM8K
    {"prompt": ...}                 HumanEval (the prompt is the user's message)
    {"turns": [..., ...]}           MT-Bench: each turn is answered in order, the answers kept in the history
    {"messages": [{"role", "content"}, ...]}   chat: the history up to its last user message
A record may also carry "system". The set's name is the file's stem (gsm8k.jsonl -> "gsm8k").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from trainer.errors import ConfigError

FORMATS = '"question" (GSM8K), "prompt" (HumanEval), "turns" (MT-Bench) or "messages" (chat)'


@dataclass
class Conversation:
    turns: list[str]  # user messages answered in order
    history: list[dict] = field(default_factory=list)  # messages before the first of `turns` (system, earlier turns)


def _text(value: object, key: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{key} must be a non-empty string")
    return value


def parse_record(rec: object) -> Conversation:
    if not isinstance(rec, dict):
        raise ValueError(f"expected an object with {FORMATS}")
    history = [{"role": "system", "content": _text(rec["system"], "system")}] if rec.get("system") else []
    if "turns" in rec:
        turns = rec["turns"]
        if not isinstance(turns, list) or not turns:
            raise ValueError("turns must be a non-empty list of strings")
        return Conversation([_text(t, "turns[]") for t in turns], history)
    if "question" in rec:
        return Conversation([_text(rec["question"], "question")], history)
    if "messages" in rec:
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m for m in msgs):
            raise ValueError("messages must be a list of {role, content}")
        last = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=None)
        if last is None:
            raise ValueError("messages has no user message")
        return Conversation([_text(msgs[last].get("content"), "content")], history + list(msgs[:last]))
    if "prompt" in rec:
        return Conversation([_text(rec["prompt"], "prompt")], history)
    raise ValueError(f"expected one of {FORMATS}")


def read_prompts(path: str | Path, source_key: str = "--prompts") -> tuple[str, list[Conversation]]:
    """(set name, conversations); a bad line is a one-line error naming the file and line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(str(path), source_key, f"cannot read: {getattr(e, 'strerror', None) or e}") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(parse_record(json.loads(line)))
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{path}:{n}", None, str(e).splitlines()[0] or "malformed record") from None
    if not out:
        raise ConfigError(str(path), source_key, "no prompts in the file")
    return path.stem, out


def render(tok, messages: list[dict], thinking: bool | None = None) -> list[int]:
    """Token ids of `messages` followed by the assistant header, through the tokenizer's chat template.

    `thinking` sets the template's `enable_thinking` (Qwen3's switch); None leaves the template's default.
    """
    if getattr(tok, "chat_template", None):
        extra = {} if thinking is None else {"enable_thinking": thinking}
        enc = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **extra)
        return list(enc["input_ids"] if hasattr(enc, "keys") else enc)
    return tok.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: ")
