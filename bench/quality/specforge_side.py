"""SpecForge's DFlash trainer on the same work as ours: its offline inputs, its run config, and its drafter converted.

    python bench/quality/specforge_side.py dump    --target T --data regen.jsonl --layers 3 --max-len 1024 --out FEAT
    python bench/quality/specforge_side.py config  --target T --features FEAT --layers 3 --block 16 ... --out RUN
    python bench/quality/specforge_side.py convert --checkpoint CKPT --out DRAFTER

SpecForge's target backend is SGLang, except in its offline mode, which reads the target's hidden states from files
(one `torch.save` dict per sample: `input_ids`, `loss_mask`, `hidden_states` = the drafter's target layers side by
side). `dump` writes those from the same target and the same regenerated data our trainer reads, tokenized by our
trainer's own code, so both see identical tokens and loss masks. `convert` writes its saved drafter in the public
DFlash format (`config.json` + `model.safetensors`), so the same `bench_tau` measures both. SpecForge is never a
dependency of the project: the benchmark installs it for itself.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def dump(args) -> int:
    """One feature file per sample, hidden states of the target layers our drafter reads (the same rule as theirs).
    Samples are run `--batch` at a time, right-padded among similar lengths: causal attention keeps a row's real
    positions from seeing its padding, so each row's states are those of its forward alone (within bf16 rounding)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.data.dataset import read_jsonl
    from trainer.model.target import default_layer_ids

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(args.target)
    model = (
        AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
        .to(device)
        .eval()
    )
    layer_ids = default_layer_ids(model.config.num_hidden_layers, args.layers)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    samples = [
        (i, ids[: args.max_len], mask[: args.max_len])
        for i, (ids, mask) in enumerate(read_jsonl(args.data, tok))
        if int(mask[: args.max_len].sum()) >= 2
    ]
    samples.sort(key=lambda s: s[1].numel())  # similar lengths share a batch
    for lo in range(0, len(samples), args.batch):
        chunk = samples[lo : lo + args.batch]
        width = max(ids.numel() for _, ids, _ in chunk)
        ids_BL = torch.zeros(len(chunk), width, dtype=torch.long)
        for b, (_, ids, _) in enumerate(chunk):
            ids_BL[b, : ids.numel()] = ids
        with torch.no_grad():
            hs = model(input_ids=ids_BL.to(device), output_hidden_states=True).hidden_states
        feat_BLF = torch.cat([hs[k + 1] for k in layer_ids], dim=-1).to(torch.bfloat16).cpu()  # [B, L, n*C]
        for b, (i, ids, mask) in enumerate(chunk):
            torch.save(
                {
                    "input_ids": ids.clone(),
                    "loss_mask": mask.clone(),
                    "hidden_states": feat_BLF[b, : ids.numel()].clone(),
                },
                out / f"data_{i:08d}.ckpt",
            )
    print(json.dumps({"features": len(samples), "layer_ids": layer_ids, "out": str(out)}))
    return 0


def config(args) -> int:
    """SpecForge's draft config (the target's shape, our drafter's layers and block) and its offline run YAML."""
    import yaml
    from transformers import AutoConfig, AutoTokenizer

    from trainer.model.drafter import drafter_dims
    from trainer.model.target import default_layer_ids
    from trainer.run.build import resolve_mask_token

    tcfg = AutoConfig.from_pretrained(args.target)
    tok = AutoTokenizer.from_pretrained(args.target)
    # the drafter our trainer builds on this target: its head size and rope base, and the token it fills blocks with
    dims = drafter_dims(tcfg, args.layers, len(default_layer_ids(tcfg.num_hidden_layers, args.layers)), {})
    mask_id = resolve_mask_token(SimpleNamespace(drafter=SimpleNamespace(mask_token_id=None)), tcfg, tok)
    run = Path(args.out)
    run.mkdir(parents=True, exist_ok=True)
    draft = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": tcfg.hidden_size,
        "intermediate_size": tcfg.intermediate_size,
        "num_attention_heads": tcfg.num_attention_heads,
        "num_key_value_heads": tcfg.num_key_value_heads,
        "head_dim": dims.head_dim,
        "num_hidden_layers": args.layers,
        "num_target_layers": tcfg.num_hidden_layers,
        "layer_types": ["full_attention"] * args.layers,
        "max_window_layers": args.layers,
        "max_position_embeddings": tcfg.max_position_embeddings,
        "rms_norm_eps": tcfg.rms_norm_eps,
        "rope_theta": dims.rope_theta,
        "rope_scaling": None,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "vocab_size": tcfg.vocab_size,
        "block_size": args.block,
        "initializer_range": 0.02,
        "dtype": "bfloat16",
        "eos_token_id": tok.eos_token_id,
        "use_cache": True,
        "dflash_config": {
            "mask_token_id": mask_id,
            "target_layer_ids": default_layer_ids(tcfg.num_hidden_layers, args.layers),
        },
    }
    (run / "draft_config.json").write_text(json.dumps(draft, indent=1) + "\n")
    cfg = {
        "model": {
            "target_model_path": str(args.target),
            "draft_model_config": str(run / "draft_config.json"),
            "torch_dtype": "bfloat16",
            "mask_token_id": mask_id,
            "trust_remote_code": False,
        },
        "data": {
            "hidden_states_path": str(args.features),
            "max_length": args.max_len,
            "chat_template": "qwen",
            "cache_dir": str(run / "cache"),
            "dataloader_num_workers": args.workers,
        },
        "training": {
            "strategy": "dflash",
            "num_epochs": 1000,
            "max_steps": args.steps,
            "batch_size": args.batch,
            "learning_rate": args.lr,
            "warmup_ratio": args.warmup_ratio,
            "max_grad_norm": 1.0,
            "attention_backend": args.attention,
            "num_anchors": args.anchors,
            "loss_decay_gamma": args.gamma,
            "save_interval": args.save_interval or args.steps,
            "log_interval": args.log_interval,
            "seed": args.seed,
        },
        "tracking": {"report_to": "tensorboard"},  # its own record; run_quality reads its progress lines
        "run_id": "quality-specforge",
        "output_dir": str(run / "output"),
        "deployment": {"mode": "local_colocated", "trainer": {"nnodes": 1, "nproc_per_node": 1}},
    }
    (run / "run.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    print(json.dumps({"config": str(run / "run.yaml")}))
    return 0


def convert(args) -> int:
    """Their saved drafter -> config.json + model.safetensors in the public DFlash format (our bench_tau's input)."""
    import torch
    from safetensors.torch import load_file, save_file

    ckpt = Path(args.checkpoint)
    found = sorted(ckpt.rglob("*.safetensors")) or sorted(ckpt.rglob("pytorch_model*.bin"))
    if not found:
        print(f"error: {ckpt}: no safetensors or pytorch_model.bin under it", file=sys.stderr)
        return 2
    state: dict = {}
    for f in found:
        state.update(load_file(f) if f.suffix == ".safetensors" else torch.load(f, map_location="cpu"))
    renamed = {}
    for k, v in state.items():
        for prefix in ("module.", "draft_model.", "model."):  # wrappers' prefixes; the public names are bare
            k = k.removeprefix(prefix)
        if k.startswith(("embed_tokens", "lm_head")):
            continue  # the target's, frozen: the public format leaves them out
        renamed[k] = v.to(torch.bfloat16).contiguous()
    cfg_file = next(iter(sorted(ckpt.rglob("config.json"))), None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads(cfg_file.read_text()) if cfg_file else json.loads(Path(args.draft_config).read_text())
    (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    save_file(renamed, str(out / "model.safetensors"))
    print(json.dumps({"tensors": len(renamed), "from": [str(f) for f in found], "out": str(out)}))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/quality/specforge_side.py", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("--target", required=True)
    d.add_argument("--data", required=True)
    d.add_argument("--layers", type=int, required=True, help="drafter layers (sets the target layers read)")
    d.add_argument("--max-len", type=int, default=1024)
    d.add_argument("--batch", type=int, default=32, help="samples per target forward")
    d.add_argument("--out", required=True)
    c = sub.add_parser("config")
    c.add_argument("--target", required=True)
    c.add_argument("--features", required=True)
    c.add_argument("--layers", type=int, required=True)
    c.add_argument("--block", type=int, default=16)
    c.add_argument("--steps", type=int, required=True)
    c.add_argument("--batch", type=int, default=1)
    c.add_argument("--lr", type=float, default=6e-4)
    c.add_argument("--warmup-ratio", type=float, default=0.04)
    c.add_argument("--anchors", type=int, default=512)
    c.add_argument("--gamma", type=float, default=7.0)
    c.add_argument("--max-len", type=int, default=1024)
    c.add_argument("--attention", default="flex_attention")
    c.add_argument("--workers", type=int, default=2)
    c.add_argument("--log-interval", type=int, default=50)
    c.add_argument("--save-interval", type=int, default=0, help="steps between checkpoints (0: at the end only)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--out", required=True)
    v = sub.add_parser("convert")
    v.add_argument("--checkpoint", required=True)
    v.add_argument("--draft-config", default=None, help="config.json to use when the checkpoint holds none")
    v.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    return {"dump": dump, "config": config, "convert": convert}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
