"""Build the pieces from a config, compute the loss of a batch, preflight every bucket, and train on one device."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from trainer.attention import make_backend
from trainer.compile_policy import apply_compile_policy, freeze_compiles, graphs_compiled
from trainer.config import TrainConfig
from trainer.data import Dataset, epoch_batches, make_dataset
from trainer.errors import ConfigError
from trainer.mask import BlockBatch, anchor_generator, build_blocks, sample_anchors
from trainer.model import Drafter, block_loss, drafter_dims
from trainer.target import Target, load_target


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def check_backend_supports_training(cfg: TrainConfig, device: torch.device, source: str) -> None:
    """flex_attention has no backward on the CPU (torch 2.13: "FlexAttention does not support backward on CPU")."""
    if cfg.attention.backend == "flex" and device.type == "cpu":
        raise ConfigError(
            source,
            "attention.backend",
            "flex has no backward on the CPU in this torch; train with backend: dense on the CPU "
            "(flex is for CUDA; evaluation on the CPU may still use it)",
        )


@dataclass
class Parts:
    cfg: TrainConfig
    device: torch.device
    target: Target
    drafter: Drafter
    backend: object
    mask_token_id: int
    autocast_dtype: torch.dtype | None


def build(cfg: TrainConfig, source: str = "<config>", for_training: bool = True) -> Parts:
    device = resolve_device(cfg.device)
    if for_training:
        check_backend_supports_training(cfg, device, source)
    apply_compile_policy(cfg.attention.recompile_limit)
    target = load_target(cfg.target, cfg.drafter.num_layers, device, source)
    d = cfg.drafter
    if d.hidden_size is not None and d.hidden_size != target.hidden_size:
        raise ConfigError(
            source, "drafter.hidden_size", f"must equal the target's ({target.hidden_size}): embedding is shared"
        )
    overrides = {k: getattr(d, k) for k in ("intermediate_size", "num_heads", "num_kv_heads", "head_dim")}
    dims = drafter_dims(target.config, d.num_layers, len(target.layer_ids), overrides)
    torch.manual_seed(cfg.seed)
    drafter = Drafter(dims, d.activation_checkpointing).to(device)
    tc = target.config
    mask_id = d.mask_token_id
    if mask_id is None:
        mask_id = next((t for t in (getattr(tc, "pad_token_id", None), getattr(tc, "eos_token_id", None)) if t), 0)
        mask_id = mask_id[0] if isinstance(mask_id, list) else mask_id
    backend = make_backend(cfg.attention.backend, cfg.attention.dense_max_gib, source)
    autocast = torch.bfloat16 if device.type == "cuda" else None
    return Parts(cfg, device, target, drafter, backend, int(mask_id), autocast)


def make_batch(parts: Parts, ds: Dataset, seq_len: int, indices: list[int], epoch: int) -> BlockBatch:
    cfg = parts.cfg
    seqs = [ds.samples[i] for i in indices]
    anchors = [
        sample_anchors(lm, ids.numel(), cfg.data.anchors_per_seq, anchor_generator(cfg.seed, epoch, i))
        for i, (ids, lm) in zip(indices, seqs, strict=True)
    ]
    return build_blocks(
        seqs, seq_len, cfg.data.anchors_per_seq, cfg.drafter.block_size, parts.mask_token_id, cfg.optim.gamma, anchors
    )


def dummy_batch(parts: Parts, seq_len: int) -> BlockBatch:
    """A batch with the exact shapes of bucket `seq_len` (every anchor valid), for the preflight."""
    cfg = parts.cfg
    B, A = cfg.data.batch_size, cfg.data.anchors_per_seq
    g = torch.Generator().manual_seed(0)
    vocab = int(parts.target.config.vocab_size)
    seqs = [(torch.randint(0, vocab, (seq_len,), generator=g), torch.ones(seq_len, dtype=torch.long)) for _ in range(B)]
    anchors = [sample_anchors(lm, seq_len, A, g) for _, lm in seqs]
    return build_blocks(seqs, seq_len, A, cfg.drafter.block_size, parts.mask_token_id, cfg.optim.gamma, anchors)


def forward_loss(parts: Parts, batch: BlockBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weighted CE sum, weight sum, weighted correct sum) for one batch on parts.device."""
    b = batch.to(parts.device)
    target, drafter = parts.target, parts.drafter
    hidden = target.hidden_states(b.input_ids)  # [B, S, n*C], no grad
    block_emb = target.embed(b.block_ids)  # [B, Q, C], frozen
    mask = parts.backend.build_mask(b.anchors, b.anchor_valid, b.seq_len, b.block_size, drafter.d.num_heads)
    amp = (
        torch.autocast(parts.device.type, dtype=parts.autocast_dtype)
        if parts.autocast_dtype
        else contextlib.nullcontext()
    )
    with amp:
        out = drafter(hidden, block_emb, b.block_pos, mask, parts.backend)  # [B, Q, C]
        return block_loss(out, target.lm_head, b.labels, b.weights)


@dataclass
class PreflightReport:
    buckets: list[int]
    seconds: dict[int, float]
    peak_mem_gib: dict[int, float]
    backward: bool
    frozen: bool

    def to_record(self) -> dict:
        return {
            "event": "preflight",
            "buckets": self.buckets,
            "seconds": {str(k): round(v, 3) for k, v in self.seconds.items()},
            "peak_mem_gib": {str(k): round(v, 3) for k, v in self.peak_mem_gib.items()},
            "backward": self.backward,
            "frozen": self.frozen,
        }


def preflight(parts: Parts, backward: bool = True, freeze: bool = True) -> PreflightReport:
    """Run every bucket once under the real conditions (grad on, backward, same autocast and checkpointing) so that
    every compiled variant exists before step 1; then make any further recompile an error."""
    buckets = parts.cfg.data.seq_buckets
    seconds, peaks = {}, {}
    cuda = parts.device.type == "cuda"
    for S in buckets:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with torch.set_grad_enabled(backward):
            loss_sum, w_sum, _ = forward_loss(parts, dummy_batch(parts, S))
            if backward:
                (loss_sum / w_sum.clamp(min=1)).backward()
                parts.drafter.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            peaks[S] = torch.cuda.max_memory_allocated() / 2**30
        seconds[S] = time.perf_counter() - t0
    frozen = freeze_compiles() if freeze else False
    return PreflightReport(list(buckets), seconds, peaks, backward, frozen)


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    warmup = max(1, int(cfg.optim.warmup_ratio * cfg.steps))

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, cfg.steps - warmup))
        lo = cfg.optim.min_lr_ratio
        return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    accs: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    preflight: PreflightReport | None = None
    recompiles_after_preflight: int = 0


def train(cfg: TrainConfig, source: str = "<config>", log: Callable[[str], None] = print) -> TrainResult:
    """Single-process training: AdamW, warmup + cosine, grad clip; loss and per-position accuracy each step."""
    parts = build(cfg, source)
    ds = make_dataset(cfg.data, int(parts.target.config.vocab_size), cfg.drafter.block_size, cfg.seed)
    log(f"data: {len(ds.samples)} samples, dropped {ds.dropped_too_long} too long, {ds.dropped_too_short} too short")
    opt = torch.optim.AdamW(
        parts.drafter.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas, weight_decay=cfg.optim.weight_decay
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    result = TrainResult()
    result.preflight = preflight(parts, backward=True)
    log(f"preflight: {result.preflight.to_record()}")
    baseline = graphs_compiled()
    epoch, batches = 0, epoch_batches(ds, cfg.data.batch_size, cfg.seed, 0)
    for step in range(1, cfg.steps + 1):
        try:
            seq_len, idx = next(batches)
        except StopIteration:
            epoch += 1
            batches = epoch_batches(ds, cfg.data.batch_size, cfg.seed, epoch)
            seq_len, idx = next(batches)
        t0 = time.perf_counter()
        batch = make_batch(parts, ds, seq_len, idx, epoch)
        loss_sum, w_sum, correct = forward_loss(parts, batch)
        loss = loss_sum / w_sum.clamp(min=1e-6)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(parts.drafter.parameters(), cfg.optim.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss_v, acc_v = loss.item(), (correct / w_sum.clamp(min=1e-6)).item()  # .item() syncs: once per step
        dt = time.perf_counter() - t0
        tps = batch.input_ids.numel() / dt
        result.losses.append(loss_v)
        result.accs.append(acc_v)
        result.tokens_per_s.append(tps)
        if step % cfg.log_every == 0 or step == cfg.steps:
            log(
                f"step {step}/{cfg.steps} epoch {epoch} loss {loss_v:.4f} acc {acc_v:.3f} "
                f"lr {sched.get_last_lr()[0]:.2e} grad_norm {float(grad_norm):.3f} {tps:,.0f} tok/s"
            )
    result.recompiles_after_preflight = graphs_compiled() - baseline
    return result
