"""Code-instruction prompts made from a wheel's documented functions: every kind of request, the same set on every
run, duplicates and held-out overlaps dropped, mixed with ShareGPT's turns in a seeded order."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "quality"))

import code_prompts  # noqa: E402
import real_target  # noqa: E402

MODULE = '''
def add_totals(rows, key="amount"):
    """Sum the values under key over every row, skipping rows that lack it entirely."""
    total = 0
    for row in rows:
        total += row.get(key, 0)
    return total


def _private(x):
    """A private helper that is long enough to count but is never asked for."""
    y = x + 1
    z = y * 2
    return z


class Table:
    def widest(self, column: str) -> int:
        """The length of the longest printed value in the column, for laying out the table."""
        best = 0
        for value in self.rows[column]:
            best = max(best, len(str(value)))
        return best


def has_close_elements(numbers, threshold):
    """Check if in given list of numbers, are any two numbers closer to each other than given threshold."""
    for a in numbers:
        for b in numbers:
            pass
    return False


def short(x):
    """Too short a body to be a request worth asking: under four lines."""
    return x
'''

HELDOUT = [
    {
        "prompt": "Complete the following Python function.\n\n```python\n"
        "def has_close_elements(numbers, threshold):\n    ```",
        "code": "def has_close_elements(numbers, threshold):\n    return False\n",
    },
    {
        "prompt": "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
        "experiences and must-see attractions."
    },
]


def wheel(tmp_path: Path) -> Path:
    path = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("pkg/core.py", MODULE)
        z.writestr("pkg/tests/test_core.py", MODULE.replace("add_totals", "add_totals_test"))
        z.writestr("pkg/broken.py", "def broken(:\n")
    return path


def test_documented_public_functions_become_requests_and_the_set_is_stable(tmp_path):
    fns = code_prompts.functions(wheel(tmp_path), max_chars=2000)
    assert sorted(f["name"] for f in fns) == ["add_totals", "has_close_elements", "widest"]  # no tests, no privates
    add = next(f for f in fns if f["name"] == "add_totals")
    assert add["sig"] == "(rows, key='amount')" and '"""' not in add["bare"] and '"""' in add["code"]
    asks = code_prompts.asks(add, 3)
    assert len({kind for kind, _ in asks}) >= 2 and len({p for _, p in asks}) == 3
    assert asks == code_prompts.asks(add, 3)  # a hash of the name picks them, not a random draw
    kept, counts = code_prompts.code_prompts([wheel(tmp_path)], HELDOUT, 2000, per_function=2)
    again, _ = code_prompts.code_prompts([wheel(tmp_path)], HELDOUT, 2000, per_function=2)
    assert kept == again and counts["functions"] == 3
    # HumanEval's entry point is never asked for, under any template
    assert counts["held_out_overlap"] == 2 and not any("has_close_elements" in k["prompt"] for k in kept)
    assert len(kept) == 4 and all(k["source"] == "code:pkg" for k in kept)


def test_a_twelve_word_run_shared_with_a_held_out_prompt_drops_a_request():
    ok = code_prompts.held_out_filter(HELDOUT)
    assert not ok("Please: compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural x")
    assert ok("Compose an engaging travel blog post about a recent trip to Iceland, please.")
    assert not ok("anything at all", name="has_close_elements")


def test_the_training_set_mixes_chat_and_code_in_a_seeded_order_without_held_out_text():
    chat = [
        "How do I sort a dict by value?",
        "Compose an engaging travel blog post about a recent trip to Hawaii, "
        "highlighting cultural experiences and must-see attractions. Thanks!",
    ]
    code = [{"prompt": f"Explain f{i}", "source": "code:pkg", "kind": "explain"} for i in range(5)]
    rows, counts = real_target.training_set(chat, code, code_prompts.held_out_filter(HELDOUT), seed=0)
    assert counts == {"sharegpt": 1, "sharegpt_held_out_overlap": 1, "code": 5}
    assert sorted(r["prompt"] for r in rows) == sorted([chat[0]] + [c["prompt"] for c in code])
    assert rows == real_target.training_set(chat, code, code_prompts.held_out_filter(HELDOUT), seed=0)[0]
    assert rows != real_target.training_set(chat, code, code_prompts.held_out_filter(HELDOUT), seed=1)[0]
