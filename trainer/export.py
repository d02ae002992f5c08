"""The trained drafter in the public DFlash draft-model format, and back.

    python -m trainer.export --run-dir RUN [--step N] --out DIR [--dtype bfloat16|float16|float32]

The format is the one published DFlash drafters use and vLLM (`method: dflash`), SGLang (`DFlashDraftModel`) and
llama.cpp's converter read: `config.json` (Qwen3 fields, `architectures: ["DFlashDraftModel"]`, `block_size`,
`num_target_layers`, `dflash_config {block_size, target_layer_ids, mask_token_id}`) and `model.safetensors` with
`fc`, `hidden_norm`, `norm` and per layer `input_layernorm`, `post_attention_layernorm`, `self_attn.{q,k,v,o}_proj`,
`self_attn.{q,k}_norm`, `mlp.{gate,up,down}_proj`. No embedding and no LM head: both are the target's.

Training writes one into `RUN/export/` at its end; `drafter: {init_from: DIR}` starts training from one. The
directory is written under a temporary name and renamed, so a reader never sees half an export.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from trainer.errors import ConfigError

# trainer name -> public name: whole prefixes, then parts inside a layer's names
PREFIXES = {"ctx_norm.": "hidden_norm.", "final_norm.": "norm."}
INFIXES = {".input_norm.": ".input_layernorm.", ".post_attn_norm.": ".post_attention_layernorm.",
           ".attn.": ".self_attn."}  # fmt: skip
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _rename(name: str, prefixes: dict[str, str], infixes: dict[str, str]) -> str:
    for a, b in prefixes.items():
        if name.startswith(a):
            return b + name[len(a) :]
    for a, b in infixes.items():
        if a in name:
            return name.replace(a, b, 1)
    return name


def to_public(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {_rename(k, PREFIXES, INFIXES): v for k, v in state.items()}


def from_public(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    back = lambda d: {b: a for a, b in d.items()}  # noqa: E731
    return {_rename(k, back(PREFIXES), back(INFIXES)): v for k, v in state.items()}


def draft_config(dims, block_size: int, layer_ids: list[int], mask_token_id: int, target_config) -> dict:
    """config.json of the public format, from the drafter's dims and the target's config."""
    tc = target_config
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": dims.hidden,
        "intermediate_size": dims.intermediate,
        "num_hidden_layers": dims.num_layers,
        "num_attention_heads": dims.num_heads,
        "num_key_value_heads": dims.num_kv_heads,
        "head_dim": dims.head_dim,
        "rms_norm_eps": dims.rms_eps,
        "rope_theta": dims.rope_theta,
        "vocab_size": int(tc.vocab_size),
        "max_position_embeddings": int(getattr(tc, "max_position_embeddings", 40960)),
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "block_size": block_size,
        "num_target_layers": int(tc.num_hidden_layers),
        "dflash_config": {"block_size": block_size, "target_layer_ids": list(layer_ids),
                          "mask_token_id": int(mask_token_id)},  # fmt: skip
    }


def write_export(out: Path, state: dict[str, torch.Tensor], config: dict, dtype: str = "bfloat16") -> Path:
    """Write config.json and model.safetensors into `out` atomically (a temporary sibling, then one rename)."""
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {k: v.detach().to("cpu", DTYPES[dtype]).contiguous() for k, v in sorted(to_public(state).items())}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype}, indent=2, sort_keys=True) + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def read_export(path: Path, source: str = "<config>") -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, the weights under the trainer's names) of a drafter in the public format."""
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
        weights = load_file(str(path / "model.safetensors"))
    except (OSError, ValueError) as e:
        raise ConfigError(source, "drafter.init_from", f"{path} is not a DFlash drafter: {e}") from None
    if "DFlashDraftModel" not in (config.get("architectures") or []):
        raise ConfigError(source, "drafter.init_from", f"{path}/config.json: architectures is not DFlashDraftModel")
    return config, from_public(weights)


def check_matches(config: dict, expected: dict, source: str) -> None:
    """A drafter loaded from an export must have the shape the run builds: name the first field that differs."""
    keys = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "block_size"]  # fmt: skip
    for key in keys:
        if config.get(key) != expected.get(key):
            raise ConfigError(source, "drafter.init_from", f"{key} is {config.get(key)} in the export, this run builds "
                              f"{expected.get(key)}")  # fmt: skip
    got = (config.get("dflash_config") or {}).get("target_layer_ids")
    want = expected["dflash_config"]["target_layer_ids"]
    if got != want:
        raise ConfigError(source, "drafter.init_from", f"target_layer_ids {got} in the export, this run uses {want}")


def export_run(run_dir: Path, out: Path, step: int | None = None, dtype: str = "bfloat16") -> Path:
    """Export a checkpoint of a run (`step`, or the newest intact one) with the run's own config."""
    from trainer import checkpoint
    from trainer.config import from_dict
    from trainer.loop import resolve_mask_token, soft_tokenizer
    from trainer.model import drafter_dims
    from trainer.target import RANDOM_PRESETS, default_layer_ids

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
    return write_export(out, weights, config, dtype)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.export", description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest intact one)")
    ap.add_argument("--out", required=True, help="the directory to write (replaced if it exists)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    args = ap.parse_args(argv)
    try:
        out = export_run(Path(args.run_dir), Path(args.out), args.step, args.dtype)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(f"exported {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
