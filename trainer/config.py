"""The trainer's configuration: typed dataclasses, loadable from YAML, unknown keys rejected with file and key."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from trainer.errors import ConfigError


@dataclass
class TargetConfig:
    path: str | None = None  # local directory of a Hugging Face causal LM (config.json + weights)
    random_preset: str | None = None  # instead of path: a named random-weight target ("qwen3-8b", "tiny-qwen3")
    layer_ids: list[int] | None = None  # target layers whose outputs feed the drafter; None = spread (DESIGN 5)
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    init_std: float | None = None  # random presets only: weight init std (None = the preset's)
    # compile the decoder layers the drafter needs (one graph per bucket serves every layer): on an H200 the
    # Qwen3-8B target forward at seq 3072 goes from 95 to 70 ms for about 7 s of compile per bucket (paid back in
    # under 300 steps). auto = on for CUDA, off on the CPU (where Inductor's compile costs more than it saves).
    compile: Literal["auto", "on", "off"] = "auto"
    # where the frozen target lives (trainer/model/parallel.py): replicate (every rank, the default), {tensor: N} (each
    # layer split over N ranks), fsdp (layers sharded over all ranks); the drafter stays data-parallel
    parallel: Any = "replicate"
    memory_gib: float | None = None  # per-rank budget for the memory plan; None = the GPU's memory (CPU: unplanned)


@dataclass
class DrafterConfig:
    num_layers: int = 5  # drafter decoder layers (paper: 5)
    hidden_size: int | None = None  # None = the target's
    intermediate_size: int | None = None  # MLP width; None = the target's
    num_heads: int | None = None  # query heads; None = the target's
    num_kv_heads: int | None = None  # key/value heads; None = the target's
    head_dim: int | None = None  # None = the target's
    block_size: int = 16  # tokens per drafted block: the anchor token then block_size - 1 mask tokens
    # token that fills blocks; None = the tokenizer's mask token, else the family's published id (Qwen3: 151669)
    mask_token_id: int | None = None
    activation_checkpointing: bool = False  # recompute each drafter layer in backward (use_reentrant=False)
    init_from: str | None = None  # a drafter in the public DFlash format (config.json, model.safetensors) to start from
    # linear weights drawn from N(0, init_std) (Hugging Face's convention, initializer_range 0.02) instead of torch's
    # default uniform(+-1/sqrt(fan_in)); None keeps torch's. Ignored with init_from.
    init_std: float | None = None
    # compile each layer's forward and backward (norms, RoPE, projections, flex attention, MLP: one graph per bucket
    # serves every layer) instead of the flex call alone; auto = on for training on CUDA with flex, off on the CPU
    compile: Literal["auto", "on", "off"] = "auto"

    def shape_overrides(self) -> dict:
        """The widths that differ from the target's when set (model.drafter_dims takes them)."""
        return {k: getattr(self, k) for k in ("intermediate_size", "num_heads", "num_kv_heads", "head_dim")}


@dataclass
class AttentionConfig:
    backend: Literal["flex", "dense"] = "flex"  # flex: compiled and guarded (CUDA); dense: masked reference
    dense_max_gib: float = 4.0  # dense refuses when one fp32 score matrix would exceed this many GiB
    # the kernel flex compiles to: triton (Inductor's template), flash (FlashAttention-4: flash-attn-4 on a Hopper GPU),
    # auto = flash where it can run, else triton; the choice and why are in the preflight record
    flex_backend: Literal["auto", "triton", "flash"] = "auto"
    recompile_limit: int = 8  # Dynamo's per-function limit; hitting it is an error, never an eager fallback


@dataclass
class DataConfig:
    path: str | None = None  # JSONL of chats, prompt/response or token ids (see data.py); None = synthetic
    tokenizer: str | None = None  # tokenizer directory for text records; None = the target's path
    holdout: int = 8  # samples kept out of training, used as evaluation prompts
    anchors_per_seq: int = 512  # blocks sampled per sequence (paper: 512), resampled every epoch
    seq_buckets: list[int] = field(default_factory=lambda: [1024, 2048, 3072])  # padded lengths, multiples of 128
    batch_size: int = 1  # sequences per step per process
    synthetic_samples: int = 64  # with no path: random sequences made from the seed
    synthetic: Literal["successor", "target_greedy"] = "successor"  # toy rule, or the target's own greedy text


@dataclass
class OptimConfig:
    lr: float = 6e-4  # peak AdamW learning rate (paper)
    weight_decay: float = 0.0
    # AdamW's (beta1, beta2): torch's and SpecForge's default. Side by side on a real target (bench/results/
    # quality-h200-pass3.json), 0.999 drafted better than 0.95 at every checkpoint (+0.10 tau at 1,200 steps)
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_ratio: float = 0.04  # fraction of steps of linear warmup before the cosine decay
    min_lr_ratio: float = 0.0  # cosine decays to lr * min_lr_ratio
    grad_clip: float = 1.0  # max global grad norm
    gamma: float = 7.0  # loss weight exp(-(k - 1) / gamma) at block position k (paper: 7 for block 16)
    chunked_loss: bool = False  # LM head + CE in chunks, logits never stored: less memory, a little slower (bench)
    # LM head + CE: fused = one Triton kernel over bf16 logits (loss, argmax, gradient; trainer/model/ce_kernel.py),
    # plain = fp32 logits through F.cross_entropy; auto = fused where Triton runs (CUDA), else plain (chunked_loss wins)
    loss_kernel: Literal["auto", "fused", "plain"] = "auto"
    # a step whose loss or grad norm is NaN/inf is skipped (no update); this many in a row stop the run (exit 4)
    max_nonfinite_steps: int = 10


@dataclass
class CheckpointConfig:
    every: int = 0  # steps between checkpoints; 0 = only at the end
    keep: int = 2  # newest complete checkpoints kept
    # every node's local rank 0 writes a copy into its own run dir (nodes without a shared file system: each can
    # resume); dflashctl sets it for jobs over several hosts
    per_node: bool = False


@dataclass
class EvalConfig:
    every: int = 0  # steps between acceptance-length evaluations; 0 = only at the end
    at_end: bool = True
    prompts: int = 8  # held-out prompts decoded per evaluation (shared out across ranks)
    max_new_tokens: int = 64
    # prompts longer than this are skipped and counted, never cut (a cut chat prompt loses its assistant header and
    # tau would measure text the drafter never trained on); None = the largest bucket less one block
    prompt_tokens: int | None = None
    backend: Literal["flex", "dense"] | None = None  # attention for decoding; None = the training backend
    # a prompt file (GSM8K, HumanEval, MT-Bench or chat JSONL, see trainer/data/prompts.py) instead of the held-out
    # samples; its stem names the set in the eval event and in watch/status. First turns only, through the template.
    prompt_file: str | None = None
    thinking: bool = False  # the chat template's enable_thinking for prompt_file


@dataclass
class WandbConfig:
    project: str = "dflash"
    mode: Literal["offline", "online"] = "offline"  # offline: recorded in the run dir; `wandb sync` uploads later
    entity: str | None = None
    name: str | None = None  # None = the run dir's name


@dataclass
class MetricsConfig:
    gpu_history: bool = True  # RUN/gpu.jsonl from NVML every heartbeat (nothing without NVML)
    tensorboard: bool = False  # event files in RUN/tensorboard (needs the tensorboard package)
    wandb: WandbConfig | None = None  # log to Weights & Biases (needs the wandb package)


@dataclass
class TrainConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    steps: int = 100  # optimiser steps in the run
    grad_accum: int = 1  # micro-batches per optimiser step (per process)
    grad_reduce_dtype: Literal["float32", "bfloat16"] = "float32"  # dtype of the gradient all-reduce across ranks
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    heartbeat_s: float = 5.0  # seconds between heartbeat writes (rank 0)
    seed: int = 0
    device: str = "auto"  # "auto" = cuda if available else cpu
    log_every: int = 1  # steps between progress lines


def parse_parallel(value: object, source: str = "<config>") -> tuple[str, int]:
    """("replicate", 1) | ("tensor", N) | ("fsdp", 1) from `replicate`, `fsdp`, `{tensor: N}` or `tensor:N`."""
    if value in ("replicate", "fsdp"):
        return str(value), 1
    n = None
    if isinstance(value, dict) and set(value) == {"tensor"}:
        n = value["tensor"]
    elif isinstance(value, str) and value.startswith("tensor:") and value[7:].isdigit():
        n = int(value[7:])
    if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 64:
        return ("replicate", 1) if n == 1 else ("tensor", n)
    raise ConfigError(
        source, "target.parallel", f"expected replicate, fsdp or {{tensor: N}} (N from 1 to 64), got {value!r}"
    )


def _check_type(value: Any, tp: Any, source: str, key: str) -> Any:
    """Validate (and lightly coerce) one value against a dataclass field type; raise ConfigError naming the key."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(source, key, f"expected a mapping, got {type(value).__name__}")
        return _build(tp, value, source, key + ".")
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _check_type(value, a, source, key)
            except ConfigError:
                pass
        raise ConfigError(source, key, f"expected {tp}, got {value!r}")
    if origin is Literal:
        if isinstance(value, bool) and {"on", "off"} <= set(typing.get_args(tp)):  # YAML 1.1 reads on/off as bools
            return "on" if value else "off"
        if value not in typing.get_args(tp):
            raise ConfigError(source, key, f"expected one of {', '.join(map(str, typing.get_args(tp)))}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(source, key, f"expected a list, got {type(value).__name__}")
        (inner,) = typing.get_args(tp)
        return [_check_type(v, inner, source, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        inner = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(inner):
            raise ConfigError(source, key, f"expected a list of {len(inner)} values")
        return tuple(
            _check_type(v, t, source, f"{key}[{i}]") for i, (v, t) in enumerate(zip(value, inner, strict=True))
        )
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp is bool and isinstance(value, bool):
        return value
    if tp is str and isinstance(value, str):
        return value
    raise ConfigError(source, key, f"expected {getattr(tp, '__name__', tp)}, got {value!r}")


def _build(cls: type, data: dict, source: str, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in data:
        if k not in names:
            raise ConfigError(source, f"{prefix}{k}", "unknown key")
    kwargs = {k: _check_type(v, hints[k], source, f"{prefix}{k}") for k, v in data.items()}
    return cls(**kwargs)


def check_device_supports(cfg: TrainConfig, device_type: str, source: str) -> None:
    """What a device type cannot train with. flex_attention has no backward on the CPU (torch 2.13: "FlexAttention
    does not support backward on CPU"), and gloo has no bfloat16 all-reduce worth having."""
    if device_type != "cpu":
        return
    if cfg.grad_reduce_dtype == "bfloat16":
        raise ConfigError(source, "grad_reduce_dtype", "a bfloat16 gradient all-reduce needs NCCL (CUDA); use float32")
    if cfg.attention.backend == "flex":
        raise ConfigError(
            source,
            "attention.backend",
            "flex has no backward on the CPU in this torch; train "
            "with backend: dense on the CPU (flex is for CUDA; evaluation on the CPU may still use it)",
        )
    if cfg.attention.flex_backend == "flash":
        raise ConfigError(
            source,
            "attention.flex_backend",
            "flash (FlashAttention-4) needs a Hopper GPU; use auto or triton on the CPU",
        )


def validate(cfg: TrainConfig, source: str) -> TrainConfig:
    """Cross-field checks that the types alone cannot express."""
    mode, _ = parse_parallel(cfg.target.parallel, source)
    if mode != "replicate" and cfg.target.compile == "on":
        raise ConfigError(source, "target.compile", "on is for a replicated target (leave it auto with parallel)")
    if cfg.drafter.init_std is not None and not 0 < cfg.drafter.init_std < 1:
        raise ConfigError(source, "drafter.init_std", "must be a standard deviation between 0 and 1 (e.g. 0.02)")
    if cfg.target.memory_gib is not None and not cfg.target.memory_gib > 0:
        raise ConfigError(source, "target.memory_gib", "must be a positive number of GiB")
    d = cfg.drafter
    if d.block_size < 2 or 128 % d.block_size:
        raise ConfigError(
            source, "drafter.block_size", "must divide 128 (2, 4, 8, 16, 32, 64 or 128): a flex tile holds whole blocks"
        )
    if d.num_layers < 1:
        raise ConfigError(source, "drafter.num_layers", "must be at least 1")
    if cfg.data.anchors_per_seq < 1:
        raise ConfigError(source, "data.anchors_per_seq", "must be at least 1")
    if not cfg.data.seq_buckets or sorted(set(cfg.data.seq_buckets)) != cfg.data.seq_buckets:
        raise ConfigError(source, "data.seq_buckets", "must be a non-empty, strictly increasing list")
    for i, b in enumerate(cfg.data.seq_buckets):
        if b % 128:
            raise ConfigError(source, f"data.seq_buckets[{i}]", f"{b} is not a multiple of 128 (flex block size)")
    if (cfg.data.anchors_per_seq * d.block_size) % 128:
        raise ConfigError(
            source, "data.anchors_per_seq", "anchors_per_seq x block_size must be a multiple of 128 (flex block size)"
        )
    if (cfg.target.path is None) == (cfg.target.random_preset is None):
        raise ConfigError(source, "target", "set exactly one of `path` and `random_preset`")
    if cfg.steps < 1:
        raise ConfigError(source, "steps", "must be at least 1")
    if cfg.optim.max_nonfinite_steps < 1:
        raise ConfigError(source, "optim.max_nonfinite_steps", "must be at least 1")
    for key, value in (("grad_accum", cfg.grad_accum), ("checkpoint.keep", cfg.checkpoint.keep)):
        if value < 1:
            raise ConfigError(source, key, "must be at least 1")
    pt = cfg.eval.prompt_tokens
    if pt is not None and (pt < 1 or pt + d.block_size > cfg.data.seq_buckets[-1]):
        raise ConfigError(source, "eval.prompt_tokens", "prompt plus one block must fit the largest bucket")
    if cfg.device not in ("auto", "cpu", "cuda") and not cfg.device.startswith("cuda:"):
        raise ConfigError(source, "device", "expected auto, cpu, cuda or cuda:N")
    return cfg


def from_dict(data: dict, source: str = "<config>") -> TrainConfig:
    if not isinstance(data, dict):
        raise ConfigError(source, None, "expected a mapping at the top level")
    return validate(_build(TrainConfig, data, source), source)


def load_config(path: str | Path) -> TrainConfig:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(str(path), None, f"cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(where, None, f"malformed YAML: {getattr(e, 'problem', e)}") from None
    return from_dict(data or {}, str(path))


def to_dict(cfg: TrainConfig) -> dict:
    return dataclasses.asdict(cfg)


def main(argv: list[str] | None = None) -> int:
    """`python -m trainer.config FILE`: validate a config without loading torch; the problem as one JSON line."""
    import json
    import sys

    args = sys.argv[1:] if argv is None else argv
    try:
        load_config(args[0])
    except ConfigError as e:
        print(json.dumps({"source": e.source, "key": e.key, "message": e.message}))
        return 2
    print(json.dumps({"ok": True}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
