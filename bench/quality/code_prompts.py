"""Code-instruction prompts for a coder target, made from the functions of pinned Python wheels.

The package registry ships no code-instruction set (the sets people train coders on, Code Alpaca, Evol-Instruct,
Magicoder, live on a model hub this benchmark cannot reach), but its wheels hold tens of thousands of real,
documented functions. Each becomes one request of the kinds a code assistant is asked: write it from its signature
and docstring, explain it, test it, type and document it, refactor it, review it for bugs. Which kind is chosen by a
hash of the function's qualified name, so the set is the same on every machine. The held-out prompts are kept out:
a function named like a HumanEval entry point, or sharing a 12-word run with any held-out prompt or HumanEval's
reference code, is dropped; the counts of what was dropped are returned.
"""

from __future__ import annotations

import ast
import hashlib
import re
import textwrap
import zipfile
from pathlib import Path

ASKS = [  # (kind, template): {name}, {sig}, {summary}, {doc}, {code}, {bare} (the code without its docstring)
    ("write", "Write a Python function `{name}{sig}`.\n\n{doc}"),
    ("write", "Implement `{name}{sig}` in Python: {summary}"),
    ("explain", "Explain what this Python function does, step by step:\n\n```python\n{code}\n```"),
    ("tests", "Write pytest unit tests for this function:\n\n```python\n{code}\n```"),
    ("document", "Add type hints and a docstring to this function:\n\n```python\n{bare}\n```"),
    ("refactor", "Refactor this function to be easier to read, keeping its behaviour:\n\n```python\n{bare}\n```"),
    ("review", "Review this code. Are there bugs or edge cases it misses?\n\n```python\n{code}\n```"),
]
WORDS = re.compile(r"\w+")
RUN = 12  # words in a row shared with a held-out text that drop a prompt


def functions(wheel: Path, max_chars: int) -> list[dict]:
    """Every documented top-level function or method of the wheel's modules, tests excluded, at most `max_chars`
    of source, in the wheel's file order."""
    out = []
    with zipfile.ZipFile(wheel) as z:
        for name in sorted(z.namelist()):
            if not name.endswith(".py") or "/tests/" in name or "/test_" in name or name.startswith("test"):
                continue
            text = z.read(name).decode("utf-8", errors="replace")
            try:
                tree = ast.parse(text)
            except (SyntaxError, ValueError):
                continue
            lines = text.splitlines()
            for node in ast.walk(tree):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                    continue
                doc = ast.get_docstring(node)
                if not doc or len(doc) < 40:
                    continue
                code = textwrap.dedent("\n".join(lines[node.lineno - 1 - len(node.decorator_list) : node.end_lineno]))
                if len(code) > max_chars or len(code.splitlines()) < 4:
                    continue
                out.append(
                    {
                        "module": name[:-3].replace("/", "."),
                        "name": node.name,
                        "code": code,
                        "doc": doc,
                        "sig": signature(node),
                        "bare": without_docstring(code, node),
                    }
                )
    return out


def signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    args = ast.unparse(node.args)
    ret = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    return f"({args}){ret}"


def without_docstring(code: str, node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    first = node.body[0]
    start, end = first.lineno - node.lineno + len(node.decorator_list), first.end_lineno - node.lineno
    lines = code.splitlines()
    rest = lines[:start] + lines[end + 1 :]
    return "\n".join(rest) if len(rest) > start else code


def asks(fn: dict, n: int) -> list[tuple[str, str]]:
    """(kind, prompt) for one function, `n` of them of different templates, picked by a hash of its qualified name."""
    h = int(hashlib.sha256(f"{fn['module']}.{fn['name']}".encode()).hexdigest(), 16)
    picks: list[int] = []
    while len(picks) < min(n, len(ASKS)):
        i = h % len(ASKS)
        h //= len(ASKS)
        while i in picks:
            i = (i + 1) % len(ASKS)
        picks.append(i)
    summary = fn["doc"].strip().split("\n\n")[0].replace("\n", " ")
    doc = textwrap.dedent(fn["doc"]).strip()
    return [
        (
            ASKS[i][0],
            ASKS[i][1].format(
                name=fn["name"], sig=fn["sig"], summary=summary, doc=doc, code=fn["code"], bare=fn["bare"]
            ),
        )
        for i in picks
    ]


def runs(text: str, n: int = RUN) -> set[int]:
    """Hashes of every run of `n` words (lower case): the unit of overlap with the held-out set."""
    words = [w.lower() for w in WORDS.findall(text)]
    return {hash(tuple(words[i : i + n])) for i in range(len(words) - n + 1)}


def held_out_filter(heldout: list[dict]):
    """A predicate: True for a prompt that may train (no held-out name, no 12-word run shared with held-out text)."""
    names = {r["code"].split("def ", 1)[1].split("(", 1)[0].strip() for r in heldout if r.get("code")}
    seen: set[int] = set()
    for r in heldout:
        seen |= runs(r["prompt"]) | runs(r.get("code") or "")

    def ok(prompt: str, name: str | None = None) -> bool:
        return (name is None or name not in names) and not (runs(prompt) & seen)

    return ok


def code_prompts(wheels: list[Path], heldout: list[dict], max_chars: int, per_function: int = 1):
    """`per_function` prompts per function of the wheels (de-duplicated by their whitespace-normalised text),
    held-out overlaps dropped; and the counts."""
    ok, kept, texts = held_out_filter(heldout), [], set()
    counts = {"functions": 0, "duplicates": 0, "held_out_overlap": 0}
    for wheel in wheels:
        for fn in functions(wheel, max_chars):
            counts["functions"] += 1
            for kind, prompt in asks(fn, per_function):
                norm = " ".join(prompt.split())
                if norm in texts:
                    counts["duplicates"] += 1
                    continue
                texts.add(norm)
                if not ok(prompt, fn["name"]):
                    counts["held_out_overlap"] += 1
                    continue
                kept.append({"prompt": prompt, "source": f"code:{wheel.name.split('-')[0].lower()}", "kind": kind})
    return kept, counts
