"""The pieces of a run, built from a config (`build`), and what a step does with them: lay out a batch, compute its
loss, preflight every shape.

`build` loads the target and makes the drafter for one device, then hands both to trainer/run/parallelize.py (target
sharding, checkpointing, compile, DDP). The training run around them (processes, data order, checkpoints, metrics) is
trainer/run/training.py.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.config import TrainConfig, check_device_supports
from trainer.data.dataset import Dataset
from trainer.errors import ConfigError
from trainer.model.attention import make_backend
from trainer.model.compile_policy import freeze_compiles, start_compile_workers
from trainer.model.drafter import Drafter, block_loss, drafter_dims
from trainer.model.mask import BlockBatch, anchor_generator, build_blocks, sample_anchors
from trainer.model.target import Target, load_target, resolve_device  # noqa: F401 - resolve_device: its callers
from trainer.run.distributed import World
from trainer.run.parallelize import parallelize


def check_backend_supports_training(cfg: TrainConfig, device: torch.device, source: str) -> None:
    """What the resolved device cannot train with (`device: auto` is known only now; `device: cpu` was refused
    before torch's import by the same check_device_supports)."""
    check_device_supports(cfg, device.type, source)
    if cfg.optim.loss_kernel == "fused":
        from trainer.model import ce_kernel

        if not ce_kernel.available(device):
            raise ConfigError(
                source,
                "optim.loss_kernel",
                f"fused needs Triton on CUDA (or TRITON_INTERPRET=1 on the "
                f"CPU); here: {device.type}, triton {'present' if ce_kernel.triton else 'missing'}",
            )


@dataclass
class Parts:
    """What `build` made: the models as trainer/run/parallelize.py left them, and how they are run."""

    cfg: TrainConfig
    device: torch.device
    target: Target  # frozen; sharded by `layout` where it is not replicated
    drafter: Drafter  # one-device module (layers maybe checkpointed, compiled): decoding, checkpoints, export
    model: torch.nn.Module  # what a training step calls: the drafter, or its DistributedDataParallel wrapper
    backend: object  # the training attention (trainer/model/attention.py)
    eval_backend: object  # the attention decoding uses
    mask_token_id: int
    autocast_dtype: torch.dtype | None
    layout: object = None  # trainer.model.parallel.Layout
    memory_plan: dict | None = None  # GiB per rank by part, as planned before loading
    # the attention backends and the kernel flex compiles to (`attention_kernel` below), for the preflight record
    attention_kernel: dict | None = None


# Mask ids of the published DFlash drafters, by target family: a row the family's vocabulary reserves and never emits.
# z-lab's DFlash drafters for Qwen3 fill blocks with row 151669, past every token the tokenizer defines; Qwen2 and
# Qwen2.5 share that vocabulary (151643 tokens and 22 specials, 151936 rows), so the same row is unused there too
PUBLISHED_MASK_IDS = {"qwen3": 151669, "qwen3_moe": 151669, "qwen2": 151669}


def resolve_mask_token(cfg: TrainConfig, target_config, tokenizer=None, source: str = "<config>") -> int:
    """The token that fills blocks: a dedicated one, never a token the target emits (pad or eos would teach the
    drafter that a real token means "unknown").

    In order: `drafter.mask_token_id`; the tokenizer's mask token; the target config's own `mask_token_id` (the tiny
    preset declares one); the family's published id when the vocabulary has that row; else a config error.
    """
    vocab = int(getattr(target_config, "vocab_size", 0) or 0)
    configured = cfg.drafter.mask_token_id
    if configured is not None:
        if not 0 <= configured < vocab:
            raise ConfigError(source, "drafter.mask_token_id", f"{configured} is outside the vocabulary 0..{vocab - 1}")
        return int(configured)
    for candidate in (getattr(tokenizer, "mask_token_id", None), getattr(target_config, "mask_token_id", None)):
        if isinstance(candidate, int) and 0 <= candidate < vocab:
            return candidate
    family = getattr(target_config, "model_type", None)
    published = PUBLISHED_MASK_IDS.get(family)
    if published is not None and published < vocab:
        return published
    raise ConfigError(
        source,
        "drafter.mask_token_id",
        f"no dedicated mask token: the tokenizer has none and no published DFlash id is known for {family!r} "
        "targets; set it to a reserved token the target never emits",
    )


def soft_tokenizer(cfg: TrainConfig):
    """The tokenizer when one can be read (for its mask token); a target directory without one is not an error."""
    path = cfg.data.tokenizer or cfg.target.path
    if path is None:
        return None
    try:
        from trainer.data.dataset import load_tokenizer

        return load_tokenizer(path)
    except (ConfigError, ImportError):
        return None


def plan_memory(cfg: TrainConfig, device: torch.device, layout, source: str) -> dict | None:
    """Per-rank memory from the configs alone (trainer/run/memory_plan.py), checked against the GPU (or
    `target.memory_gib`) before the target is loaded: a plan that does not fit is a config error naming a mode that
    would. None when there is nothing to check against (the CPU without memory_gib)."""
    from trainer.model.target import DTYPES, default_layer_ids, target_config
    from trainer.run import memory_plan

    if cfg.target.memory_gib is not None:
        budget = cfg.target.memory_gib * memory_plan.GiB
    elif device.type == "cuda":
        budget = float(torch.cuda.get_device_properties(device).total_memory)
    else:
        return None
    hf = target_config(cfg.target, source)
    d = cfg.drafter
    n_ids = len(cfg.target.layer_ids or default_layer_ids(int(hf.num_hidden_layers), d.num_layers))
    overrides = d.shape_overrides()
    dims = drafter_dims(hf, d.num_layers, n_ids, overrides)
    shapes = memory_plan.target_shapes(hf, dims, n_ids, torch.tensor([], dtype=DTYPES[cfg.target.dtype]).element_size())
    mode, ways = layout.mode, (layout.tp if layout.mode == "tensor" else layout.dp)
    world = layout.tp * layout.dp
    queries = cfg.data.anchors_per_seq * d.block_size
    need = memory_plan.check(
        shapes,
        mode=mode,
        ways=ways,
        world=world,
        seq=cfg.data.seq_buckets[-1],
        queries=queries,
        batch=cfg.data.batch_size,
        budget=budget,
        source=source,
    )
    return {k: round(v / memory_plan.GiB, 2) for k, v in need.items()} | {"budget": round(budget / memory_plan.GiB, 2)}


def build(
    cfg: TrainConfig,
    source: str = "<config>",
    *,
    for_training: bool = True,
    device: torch.device | None = None,
    layout=None,
    world: World | None = None,
) -> Parts:
    """Every part of a run, in the order that refuses a bad config before anything loads: the checks, the memory
    plan and the attention, then the target and the drafter for one device, then trainer/run/parallelize.py over
    them (`world`: the ranks DDP spans; none builds no DDP)."""
    from trainer.model.parallel import Layout

    device = device or resolve_device(cfg.device)
    layout = layout or Layout("replicate", 1, 1, 0)
    if for_training:
        check_backend_supports_training(cfg, device, source)
    memory = plan_memory(cfg, device, layout, source) if for_training else None
    kernel = attention_kernel(cfg, device, source)  # `flash` where it cannot run: refused before the target loads
    flex_kernel = kernel["flex_backend"] or "triton"
    backend = make_backend(cfg.attention.backend, cfg.attention.dense_max_gib, source, flex_kernel)
    if for_training and cfg.attention.backend == "dense":  # its cap, from the target's config alone
        from trainer.model.target import target_config

        hf = target_config(cfg.target, source)
        heads = drafter_dims(hf, cfg.drafter.num_layers, 1, cfg.drafter.shape_overrides()).num_heads
        backend.check_size(
            batch=cfg.data.batch_size,
            num_heads=heads,
            seq_len=cfg.data.seq_buckets[-1],
            anchors=cfg.data.anchors_per_seq,
            block_size=cfg.drafter.block_size,
        )
    if for_training and device.type == "cuda":  # the preflight compiles (flex at least): workers start during the load
        start_compile_workers()  # after every refusal above: a config error starts nothing
    sharded = layout.mode != "replicate"  # built here, sharded and placed by parallelize
    target = load_target(cfg.target, cfg.drafter.num_layers, device, source, sharded)
    d = cfg.drafter
    if d.hidden_size is not None and d.hidden_size != target.hidden_size:
        raise ConfigError(
            source, "drafter.hidden_size", f"must equal the target's ({target.hidden_size}): embedding is shared"
        )
    overrides = d.shape_overrides()
    dims = drafter_dims(target.config, d.num_layers, len(target.layer_ids), overrides)
    torch.manual_seed(cfg.seed)
    drafter = Drafter(dims).to(device)
    if d.init_std is not None and not d.init_from:
        drafter.init_linear_weights(d.init_std)
    mask_id = resolve_mask_token(cfg, target.config, soft_tokenizer(cfg), source)
    if d.init_from:  # fine-tune a drafter in the public DFlash format
        from trainer.model.dflash_format import check_matches, draft_config, read_export

        config, weights = read_export(Path(d.init_from), source)
        expected = draft_config(dims, d.block_size, target.layer_ids, mask_id, target.config)
        check_matches(config, expected, source)
        drafter.load_state_dict(weights, strict=True)
    eval_name = cfg.eval.backend or cfg.attention.backend
    same = eval_name == cfg.attention.backend
    eval_backend = backend if same else make_backend(eval_name, cfg.attention.dense_max_gib, source, flex_kernel)
    autocast = torch.bfloat16 if device.type == "cuda" else None
    if kernel["flex_backend"] == "flash":  # before anything compiles (parallelize only wraps: compiles are lazy)
        from trainer.model.flash_kernel import patch_torch

        kernel["patches"] = patch_torch()
    model = parallelize(
        target, drafter, cfg, layout=layout, device=device, world=world, for_training=for_training, source=source
    )
    return Parts(
        cfg=cfg,
        device=device,
        target=target,
        drafter=drafter,
        model=model,
        backend=backend,
        eval_backend=eval_backend,
        mask_token_id=int(mask_id),
        autocast_dtype=autocast,
        layout=layout,
        memory_plan=memory,
        attention_kernel=kernel,
    )


def attention_kernel(cfg: TrainConfig, device: torch.device, source: str) -> dict:
    """The attention the run uses, for the preflight record: the backend, and for flex the kernel it compiles to
    (`attention.flex_backend` resolved for this device, trainer.model.flash_kernel) and why; None without flex."""
    from trainer.model.flash_kernel import resolve

    out = {
        "backend": cfg.attention.backend,
        "eval_backend": cfg.eval.backend or cfg.attention.backend,
        "flex_backend": None,
        "why": None,
        "patches": [],
    }
    if "flex" in (out["backend"], out["eval_backend"]) or cfg.attention.flex_backend == "flash":
        out["flex_backend"], out["why"] = resolve(cfg.attention.flex_backend, device, source)
    return out


def make_batch(parts: Parts, ds: Dataset, seq_len: int, indices: list[int], epoch: int) -> BlockBatch:
    cfg = parts.cfg
    seqs = [ds.samples[i] for i in indices]
    anchors = [
        sample_anchors(lm, ids.numel(), cfg.data.anchors_per_seq, anchor_generator(cfg.seed, epoch, i))
        for i, (ids, lm) in zip(indices, seqs, strict=True)
    ]
    return build_blocks(
        seqs,
        seq_len=seq_len,
        num_anchors=cfg.data.anchors_per_seq,
        block_size=cfg.drafter.block_size,
        mask_token_id=parts.mask_token_id,
        gamma=cfg.optim.gamma,
        anchors=anchors,
    )


def dummy_batch(parts: Parts, seq_len: int, batch: int | None = None, anchors: int | None = None) -> BlockBatch:
    """A batch with the exact shapes of bucket `seq_len` (every anchor valid), for the preflight."""
    cfg = parts.cfg
    B = batch or cfg.data.batch_size
    A = anchors or cfg.data.anchors_per_seq
    g = torch.Generator().manual_seed(0)
    vocab = int(parts.target.config.vocab_size)
    seqs = [(torch.randint(0, vocab, (seq_len,), generator=g), torch.ones(seq_len, dtype=torch.long)) for _ in range(B)]
    anchors = [sample_anchors(lm, seq_len, A, g) for _, lm in seqs]
    return build_blocks(
        seqs,
        seq_len=seq_len,
        num_anchors=A,
        block_size=cfg.drafter.block_size,
        mask_token_id=parts.mask_token_id,
        gamma=cfg.optim.gamma,
        anchors=anchors,
    )


def autocast(parts: Parts):
    """bf16 autocast on CUDA, nothing on the CPU."""
    if parts.autocast_dtype:
        return torch.autocast(parts.device.type, dtype=parts.autocast_dtype)
    return contextlib.nullcontext()


Mark = Callable[[str], None]  # called as each stage of a step ends, in stream order: a benchmark's timeline


def drafter_output(
    parts: Parts, drafter: torch.nn.Module, b: BlockBatch, backend=None, mark: Mark | None = None
) -> torch.Tensor:
    """Target hidden states -> drafter -> [B, Q, C] final hidden states of the block tokens (b on parts.device).

    `drafter` is the module to call: the Drafter itself or its DistributedDataParallel wrapper (its layers run
    compiled where they are and autograd records: trainer/run/parallelize.py); `backend` defaults to the training
    attention. `mark`, when given, is told where each stage ends (`target_fwd`, `embed_and_mask`, `drafter_fwd`).
    """
    backend = backend or parts.backend
    hidden = parts.target.hidden_states(b.input_ids, compiled=True)  # [B, S, n*C], no grad
    if mark:
        mark("target_fwd")
    block_emb = parts.target.embed(b.block_ids)  # [B, Q, C], frozen
    heads = parts.drafter.d.num_heads
    mask = backend.build_mask(b.anchors, b.anchor_valid, b.seq_len, b.block_size, heads)
    if mark:
        mark("embed_and_mask")
    with autocast(parts):
        out = drafter(hidden, block_emb, b.block_pos, mask, backend)  # [B, Q, C]
    if mark:
        mark("drafter_fwd")
        if out.requires_grad:  # the gradient reaching the drafter's output: the LM head and loss backward are done
            out.register_hook(lambda grad: mark("lm_head_loss_bwd"))
    return out


def forward_loss(
    parts: Parts, batch: BlockBatch, drafter: torch.nn.Module | None = None, mark: Mark | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weighted CE sum, weight sum, weighted correct sum) for one batch on parts.device, through `drafter` (default
    `parts.model`, what a training step calls). `mark`: see `drafter_output`; it is also told `lm_head_loss_fwd`, and
    `lm_head_loss_bwd` once backward gets there."""
    b = batch.to(parts.device)
    out = drafter_output(parts, drafter or parts.model, b, mark=mark)
    with autocast(parts):
        result = block_loss(
            out,
            parts.target.lm_head,
            b.labels,
            b.weights,
            fused=parts.cfg.optim.chunked_loss,
            kernel=parts.cfg.optim.loss_kernel,
            index=b.label_index,
        )
    if mark:
        mark("lm_head_loss_fwd")
    return result


@dataclass
class PreflightReport:
    buckets: list[int]
    seconds: dict[int, float]
    peak_mem_gib: dict[int, float]
    backward: bool
    frozen: bool
    attention: dict | None = None  # Parts.attention_kernel: the flex kernel compiled, and why

    def to_record(self) -> dict:
        return {
            "attention": self.attention,
            "event": "preflight",
            "buckets": self.buckets,
            "seconds": {str(k): round(v, 3) for k, v in self.seconds.items()},
            "peak_mem_gib": {str(k): round(v, 3) for k, v in self.peak_mem_gib.items()},
            "backward": self.backward,
            "frozen": self.frozen,
        }


def preflight(
    parts: Parts,
    backward: bool = True,
    freeze: bool = True,
    drafter: torch.nn.Module | None = None,
    eval_anchors: int | None = None,
    progress: Callable[[str, dict], None] | None = None,
) -> PreflightReport:
    """Run every bucket once under the real conditions (grad on, backward, same autocast and checkpointing, through
    `drafter`, default `parts.model`) so that every compiled variant exists before step 1; with `eval_anchors`, also
    the no-grad shapes evaluation uses. Then make any further recompile an error."""
    buckets = parts.cfg.data.seq_buckets
    module = drafter or parts.model
    seconds, peaks = {}, {}
    cuda = parts.device.type == "cuda"
    start = time.perf_counter()

    def say(i: int, S: int, part: str) -> None:  # where the preflight is, with an estimate once a bucket is done
        if progress is None:
            return
        done = list(seconds.values())
        left = sum(done) / len(done) * (len(buckets) - len(done)) if done else None
        detail = {
            "bucket": i + 1,
            "of": len(buckets),
            "seq_len": S,
            "part": part,
            "elapsed_s": round(time.perf_counter() - start, 1),
            "left_s": round(left, 1) if left is not None else None,
        }
        eta = f", about {left:.0f} s left" if left is not None else ""
        progress(f"preflight bucket {i + 1}/{len(buckets)} (seq {S}): {part}, {detail['elapsed_s']:.0f} s{eta}", detail)

    for i, S in enumerate(buckets):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        say(i, S, "forward")
        with torch.set_grad_enabled(backward):
            loss_sum, w_sum, _ = forward_loss(parts, dummy_batch(parts, S), module)
            if backward:
                say(i, S, "backward")
                (loss_sum / w_sum.clamp(min=1)).backward()
                parts.drafter.zero_grad(set_to_none=True)
        if eval_anchors:
            say(i, S, "decoding shapes")
            with torch.no_grad():
                eval_batch = dummy_batch(parts, S, 1, eval_anchors).to(parts.device)
                drafter_output(parts, parts.drafter, eval_batch, parts.eval_backend)
        if cuda:
            torch.cuda.synchronize()
            peaks[S] = torch.cuda.max_memory_allocated() / 2**30
        seconds[S] = time.perf_counter() - t0
    frozen = freeze_compiles() if freeze else False
    return PreflightReport(
        buckets=list(buckets),
        seconds=seconds,
        peak_mem_gib=peaks,
        backward=backward,
        frozen=frozen,
        attention=parts.attention_kernel,
    )


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    warmup = max(1, int(cfg.optim.warmup_ratio * cfg.steps))

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, cfg.steps - warmup))
        lo = cfg.optim.min_lr_ratio
        return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn
