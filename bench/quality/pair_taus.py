"""Two drafters' per-prompt taus on the same prompts, paired: the mean difference, a bootstrap 95 % interval and how
many prompts each wins, per checkpoint (from the `tau-drafter-NAME-stepK.jsonl` files a quality pass leaves).

    python bench/quality/pair_taus.py WORK --a ours --b specforge --steps 300 600 900 1200
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def per_prompt(path: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["index"]: r["tau"] for r in rows if "tau" in r}


def paired(a: dict[int, float], b: dict[int, float], resamples: int = 10_000, seed: int = 0) -> dict:
    keys = sorted(a.keys() & b.keys())
    diffs = [b[k] - a[k] for k in keys]
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(diffs, k=len(diffs))) / len(diffs) for _ in range(resamples))
    return {
        "prompts": len(keys),
        "b_minus_a": round(sum(diffs) / len(diffs), 4),
        "bootstrap_95": [round(means[int(0.025 * resamples)], 4), round(means[int(0.975 * resamples)], 4)],
        "prompts_b_higher": sum(d > 0 for d in diffs),
        "prompts_a_higher": sum(d < 0 for d in diffs),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("work", type=Path)
    ap.add_argument("--a", default="ours")
    ap.add_argument("--b", default="specforge")
    ap.add_argument("--steps", type=int, nargs="+", default=[300, 600, 900, 1200])
    args = ap.parse_args()
    out = []
    for step in args.steps:
        a = per_prompt(args.work / f"tau-drafter-{args.a}-step{step}.jsonl")
        b = per_prompt(args.work / f"tau-drafter-{args.b}-step{step}.jsonl")
        out.append({"step": step, "a": args.a, "b": args.b, **paired(a, b)})
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
