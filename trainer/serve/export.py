"""A checkpoint of a run as a drafter in the public DFlash format (model/dflash_format.py), ready to serve.

    python -m trainer.export --run-dir RUN [--step N] --out DIR [--dtype bfloat16|float16|float32]

The run's own config (its start record) gives the shapes and the mask token; `--out` must be new, empty or an earlier
export (never the run dir or anything else); non-finite weights are refused.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trainer.errors import ConfigError, NonFiniteWeightsError
from trainer.model.export_dir import DTYPE_NAMES, check_out


def export_run(run_dir: Path, out: Path, step: int | None = None, dtype: str = "bfloat16") -> Path:
    """Export a checkpoint of a run (`step`, or the newest intact one) with the run's own config."""
    from trainer.config import from_dict
    from trainer.model.dflash_format import draft_config, write_export
    from trainer.model.drafter import drafter_dims
    from trainer.model.target import RANDOM_PRESETS, default_layer_ids
    from trainer.run import checkpoint
    from trainer.run.build import resolve_mask_token, soft_tokenizer

    run_dir = Path(run_dir)
    src = str(run_dir / "metrics.jsonl")
    try:
        starts = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"start"' in x]
        start = next(r for r in reversed(starts) if r.get("event") == "start")
        cfg = from_dict(start["config"], src)
    except (OSError, ValueError, StopIteration):
        raise ConfigError(src, None, "no start record with the run's config: not a run dir of this trainer") from None
    ckpts = run_dir / "checkpoints"
    if step is None:
        path, loaded, _ = checkpoint.load_newest_intact(ckpts)
        if loaded is None:
            raise ConfigError(str(ckpts), None, "no intact checkpoint to export")
        weights = loaded.weights
    else:
        path = ckpts / f"step-{step:08d}"
        if checkpoint.problem(path) is not None:
            raise ConfigError(str(path), "--step", f"checkpoint {step} is missing or damaged")
        weights = checkpoint.load(path).weights
    from transformers import AutoConfig

    if cfg.target.random_preset:
        tc = AutoConfig.for_model(**RANDOM_PRESETS[cfg.target.random_preset]())
    else:
        tc = AutoConfig.from_pretrained(cfg.target.path, local_files_only=True)
    n = cfg.drafter.num_layers
    layer_ids = sorted(cfg.target.layer_ids or default_layer_ids(int(tc.num_hidden_layers), n))
    d = cfg.drafter
    overrides = d.shape_overrides()
    dims = drafter_dims(tc, n, len(layer_ids), overrides)
    mask_id = start.get("mask_token_id")  # what the run trained with; older runs: resolved again
    if not isinstance(mask_id, int):
        mask_id = resolve_mask_token(cfg, tc, soft_tokenizer(cfg), src)
    config = draft_config(dims, d.block_size, layer_ids, mask_id, tc)
    return write_export(out, weights, config, dtype, run_dir)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.export", description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest intact one)")
    ap.add_argument("--out", required=True, help="a new or empty folder, or an earlier export to replace")
    ap.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default="bfloat16")
    args = ap.parse_args(argv)
    try:
        check_out(Path(args.out), Path(args.run_dir))  # before anything loads, torch included
        out = export_run(Path(args.run_dir), Path(args.out), args.step, args.dtype)
    except (ConfigError, NonFiniteWeightsError) as e:
        print(f"export refused: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"export failed: {args.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"exported {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
