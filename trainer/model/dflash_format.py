"""The public DFlash draft-model format, both ways: what an export holds and how a drafter is read back.

`config.json` (Qwen3 fields, `architectures: ["DFlashDraftModel"]`, `block_size`, `num_target_layers`, `dflash_config
{block_size, target_layer_ids, mask_token_id}`) and `model.safetensors` with `fc`, `hidden_norm`, `norm` and per layer
`input_layernorm`, `post_attention_layernorm`, `self_attn.{q,k,v,o}_proj`, `self_attn.{q,k}_norm`,
`mlp.{gate,up,down}_proj`; no embedding and no LM head (both are the target's). vLLM (`method: dflash`), SGLang
(`DFlashDraftModel`) and llama.cpp's converter read it. Training writes one at its end (run/training.py),
`drafter.init_from` reads one (run/build.py), `python -m trainer.export` makes one of a checkpoint (serve/export.py):
this module is what all three share, below them.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from trainer.errors import ConfigError, NonFiniteWeightsError
from trainer.model.export_dir import DTYPE_NAMES, check_out

# trainer name -> public name: whole prefixes, then parts inside a layer's names
PREFIXES = {"ctx_norm.": "hidden_norm.", "final_norm.": "norm."}
INFIXES = {
    ".input_norm.": ".input_layernorm.",
    ".post_attn_norm.": ".post_attention_layernorm.",
    ".attn.": ".self_attn.",
}
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


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
        "dflash_config": {
            "block_size": block_size,
            "target_layer_ids": list(layer_ids),
            "mask_token_id": int(mask_token_id),
        },
    }


def write_export(
    out: Path, state: dict[str, torch.Tensor], config: dict, dtype: str = "bfloat16", run_dir: Path | None = None
) -> Path:
    """Write config.json and model.safetensors into `out` atomically (a temporary sibling, then renames). `out` must
    pass `check_out`; weights with NaN or inf are refused (NonFiniteWeightsError) and nothing is written."""
    out = check_out(out, run_dir)
    bad = nonfinite(state)
    if bad:
        raise NonFiniteWeightsError(f"{len(bad)} drafter tensors are non-finite ({bad[0]}, ...): no export written")
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    old = out.with_name(f".{out.name}.old{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        tensors = {k: v.detach().to("cpu", DTYPES[dtype]).contiguous() for k, v in sorted(to_public(state).items())}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype}, indent=2, sort_keys=True) + "\n")
        if out.exists():  # an earlier export (check_out said so): moved aside, replaced, then removed
            os.replace(out, old)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not out.exists():
            os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)
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
    keys = [
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "block_size",
    ]
    for key in keys:
        if config.get(key) != expected.get(key):
            raise ConfigError(
                source,
                "drafter.init_from",
                f"{key} is {config.get(key)} in the export, this run builds {expected.get(key)}",
            )
    got = (config.get("dflash_config") or {}).get("target_layer_ids")
    want = expected["dflash_config"]["target_layer_ids"]
    if got != want:
        raise ConfigError(source, "drafter.init_from", f"target_layer_ids {got} in the export, this run uses {want}")


def nonfinite(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors holding NaN or inf (one reduction per tensor; no copy)."""
    return [k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
