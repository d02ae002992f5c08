"""A training run: one process per device, data-parallel drafter, files in the run dir, exact resume.

Per optimiser step every rank takes its slice of one global batch per micro-step (`grad_accum` of them), so the data
of a step does not depend on the number of ranks. The loss is normalised by the global sum of loss weights (over
ranks and micro-steps): DDP averages gradients over ranks, so each rank scales its sum by world_size / global weight.
"""

from __future__ import annotations

import contextlib
import math
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from trainer import checkpoint, faults
from trainer.compile_policy import graphs_compiled, unfreeze_compiles
from trainer.config import TrainConfig, parse_parallel, to_dict
from trainer.data import Dataset, epoch_batches, load_tokenizer, make_dataset, shard
from trainer.distributed import World, all_gather_objects, all_reduce_sum, barrier, init_world
from trainer.errors import ConfigError, DivergedError
from trainer.eval import eval_anchors, measure_tau, prompt_of
from trainer.gpu_history import GpuHistory
from trainer.loggers import check_available, open_sinks
from trainer.loop import Parts, build, forward_loss, lr_lambda, make_batch, preflight
from trainer.metrics import Heartbeat, MetricsWriter
from trainer.parallel import make_layout


def _json_number(value: float, digits: int) -> float | None:
    """A finite value rounded; NaN and inf are not JSON: null (the step record says `skipped`)."""
    return round(value, digits) if math.isfinite(value) else None


class DivergenceGuard:
    """Non-finite steps are skipped (no optimizer update) and counted; `limit` in a row stop the run with a
    DivergedError naming the first bad step, the last finite loss, the lr and the newest checkpoint from before.
    Decided from the loss and grad norm the step already brought to the host: no extra sync."""

    def __init__(self, limit: int, say: Callable[[str], None]) -> None:
        self.limit, self.say = limit, say
        self.streak = 0
        self.first_bad: int | None = None
        self.bad_lr: float | None = None
        self.last_finite: tuple[int, float] | None = None
        self.last_checkpoint: str | None = None
        self.total = 0

    def check(self, step: int, loss: float, grad_norm: float, lr: float) -> bool:
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.streak, self.first_bad = 0, None
            self.last_finite = (step, loss)
            return True
        self.streak += 1
        self.total += 1
        if self.first_bad is None:
            self.first_bad, self.bad_lr = step, lr
        return False

    def stop_if_diverged(self) -> None:
        if self.streak < self.limit:
            return
        last = f"step {self.last_finite[0]} loss {self.last_finite[1]:.4f}" if self.last_finite else "none"
        ckpt = self.last_checkpoint or "none"
        raise DivergedError(
            f"loss or grad norm non-finite for {self.streak} steps in a row from step {self.first_bad} (lr "
            f"{self.bad_lr:.3e}); last finite: {last}; newest checkpoint from before: {ckpt}",
            first_bad_step=self.first_bad, last_finite_step=self.last_finite[0] if self.last_finite else None,
            last_finite_loss=self.last_finite[1] if self.last_finite else None, lr=self.bad_lr,
            checkpoint=self.last_checkpoint, nonfinite_steps=self.streak)  # fmt: skip


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    accs: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    taus: list[float] = field(default_factory=list)
    preflight: object = None
    recompiles_after_preflight: int = 0
    start_step: int = 0
    parts: Parts | None = None


class DataStream:
    """Global batches in a reproducible order: epoch e is shuffled from (seed, e); a position can be resumed."""

    def __init__(self, ds: Dataset, global_batch: int, seed: int, epoch: int = 0, batch_in_epoch: int = 0) -> None:
        self.ds, self.global_batch, self.seed = ds, global_batch, seed
        self.epoch, self.batch_in_epoch = epoch, batch_in_epoch
        self.batches = epoch_batches(ds, global_batch, seed, epoch)
        if not self.batches:
            raise ConfigError(
                "<config>", "data.batch_size", f"no bucket has a full global batch ({global_batch} samples)"
            )

    def next(self) -> tuple[int, tuple[int, list[int]]]:
        if self.batch_in_epoch >= len(self.batches):
            self.epoch += 1
            self.batch_in_epoch = 0
            self.batches = epoch_batches(self.ds, self.global_batch, self.seed, self.epoch)
        b = self.batches[self.batch_in_epoch]
        self.batch_in_epoch += 1
        return self.epoch, b


def eval_prompts(cfg: TrainConfig, ds: Dataset, limit: int, source: str) -> tuple[str, list]:
    """(set name, prompts) for tau: the configured prompt file's first turns, else the held-out samples' prompts.
    A prompt over `limit` tokens is None (skipped and counted, never cut)."""
    if cfg.eval.prompt_file is None:
        return "holdout", [prompt_of(s, limit) for s in ds.heldout[: cfg.eval.prompts]]
    from trainer.prompts import read_prompts, render

    tok = load_tokenizer(cfg.data.tokenizer or cfg.target.path, source)
    if tok is None:
        raise ConfigError(source, "eval.prompt_file", "needs a tokenizer (data.tokenizer or target.path)")
    name, convs = read_prompts(cfg.eval.prompt_file, "eval.prompt_file")
    out = []
    for c in convs[: cfg.eval.prompts]:
        ids = render(tok, c.history + [{"role": "user", "content": c.turns[0]}], cfg.eval.thinking)
        out.append(torch.tensor(ids) if len(ids) <= limit else None)
    return name, out


def greedy_generator(parts: Parts) -> Callable[[list[list[int]], int], list[list[int]]]:
    """The target's greedy decoder, for data made of the target's own continuations."""
    from trainer.regenerate import generate

    model = parts.target.model
    pad = getattr(model.config, "pad_token_id", None) or 0
    return lambda prompts, n: generate(model, prompts, n, 0.0, 1.0, pad, set())  # continuations run their full length


def _max_rss_gib() -> float:
    """On the CPU the peak is the process's resident set (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def train(
    cfg: TrainConfig,
    source: str = "<config>",
    run_dir: Path | None = None,
    resume: bool = False,
    log: Callable[[str], None] = print,
    world: World | None = None,
) -> TrainResult:
    world = world or init_world(cfg.device)
    say = log if world.is_main else (lambda s: None)
    run_dir = Path(run_dir) if run_dir else None
    if run_dir:
        run_dir.mkdir(parents=True, exist_ok=True)
    check_available(cfg, source)  # a logger asked for and not installed: exit 2 before anything loads
    main_dir = run_dir if run_dir and world.is_main else None
    sinks = open_sinks(cfg, main_dir, to_dict(cfg), say) if main_dir else []
    metrics = MetricsWriter(run_dir, world.is_main, sinks) if run_dir else None
    gpus = GpuHistory(main_dir) if main_dir and cfg.metrics.gpu_history and world.device.type == "cuda" else None
    on_beat = gpus.sample if gpus is not None and gpus.active else None
    heartbeat = Heartbeat(main_dir, cfg.heartbeat_s, on_beat).start() if main_dir else None
    try:
        return _train(cfg, source, run_dir, resume, say, world, metrics, heartbeat)
    finally:
        unfreeze_compiles()  # the stance is process-wide: leave the process as it was found
        if heartbeat:
            heartbeat.stop()
        if gpus is not None:
            gpus.close()
        for sink in sinks:
            sink.close()


def _train(cfg, source, run_dir, resume, say, world: World, metrics, heartbeat) -> TrainResult:
    def event(name: str, **fields) -> None:
        if metrics:
            metrics.event(name, **fields)

    layout = make_layout(*parse_parallel(cfg.target.parallel, source), world, source)
    parts: Parts = build(cfg, source, device=world.device, layout=layout)
    tok = load_tokenizer(cfg.data.tokenizer or cfg.target.path, source) if cfg.data.path else None
    vocab = int(parts.target.config.vocab_size)
    ds = make_dataset(cfg.data, vocab, cfg.drafter.block_size, cfg.seed, tok, source, greedy_generator(parts))
    limit = cfg.eval.prompt_tokens or cfg.data.seq_buckets[-1] - cfg.drafter.block_size
    prompt_set, found = eval_prompts(cfg, ds, limit, source)
    say(f"data: {len(ds.samples)} samples, {len(ds.heldout)} held out, dropped {ds.dropped_too_short} too short, "
        f"{ds.truncated} truncated to the largest bucket")  # fmt: skip
    event("data", samples=len(ds.samples), dropped_too_short=ds.dropped_too_short,
          dropped_too_long=ds.dropped_too_long, truncated=ds.truncated, holdout=len(ds.heldout))  # fmt: skip

    drafter = parts.drafter
    model = drafter
    if world.distributed:  # gradients live in the all-reduce buckets: no copy in and out of them
        model = DistributedDataParallel(drafter, gradient_as_bucket_view=True)
        if cfg.grad_reduce_dtype == "bfloat16":  # half the bytes on the wire; the optimiser still sees fp32
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

            model.register_comm_hook(None, bf16_compress_hook)
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas,
                            weight_decay=cfg.optim.weight_decay, fused=world.device.type == "cuda")  # fmt: skip
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    global_batch = cfg.data.batch_size * layout.dp  # the ranks of a tensor group share their batch
    stream = DataStream(ds, global_batch, cfg.seed)
    start_step, resumed_from = 0, None
    ckpt_root = run_dir / "checkpoints" if run_dir else None
    latest, loaded, skipped = checkpoint.load_newest_intact(ckpt_root) if resume and ckpt_root else (None, None, [])
    if skipped:
        for s in skipped:
            say(f"checkpoint {s['path']} skipped: {s['why']}")
        event("checkpoint_fallback", skipped=skipped, using=str(latest) if latest else None)
        if latest is None:  # repeating the run cannot fix the files: not a crash to restart
            raise ConfigError(str(ckpt_root), "--resume", f"no intact checkpoint: {skipped[0]['why']} "
                              f"({len(skipped)} checked); move the run dir's checkpoints/ away to start afresh")
    steps_found = all_gather_objects(loaded.position.step if loaded is not None else None, world)
    if len(set(steps_found)) > 1:  # every rank must continue from the same step, or the ranks train apart
        raise ConfigError(str(ckpt_root), "--resume", f"ranks would resume from different steps {steps_found} (a "
                          "node lacks the checkpoint: set checkpoint.per_node, or share the run dir)")  # fmt: skip
    if loaded is not None:
        drafter.load_state_dict(loaded.weights)
        opt.load_state_dict(loaded.optimizer)
        sched.load_state_dict(loaded.scheduler)
        pos = loaded.position
        stream = DataStream(ds, global_batch, cfg.seed, pos.epoch, pos.batch_in_epoch)
        start_step = resumed_from = pos.step
        if world.rank < len(loaded.rng):
            checkpoint.set_rng_state(loaded.rng[world.rank])
        say(f"resumed from {latest} at step {start_step}")
    event("start", world_size=world.size, resumed_from=resumed_from, mask_token_id=parts.mask_token_id,
          mesh=layout.describe(), memory_plan=parts.memory_plan,
          config=to_dict(cfg))

    do_eval = cfg.eval.every > 0 or cfg.eval.at_end
    if heartbeat:
        heartbeat.phase = "preflight"

    def preflight_progress(text: str, detail: dict) -> None:  # a start the user can watch: heartbeat and metrics
        if heartbeat:
            heartbeat.phase, heartbeat.detail = text, detail
        if metrics:
            metrics.write({"event": "preflight_progress", "rank": world.rank, **detail}, always=True)

    report = preflight(parts, backward=True, drafter=model, eval_anchors=eval_anchors(cfg.drafter.block_size)
                       if do_eval else None, progress=preflight_progress)  # fmt: skip
    if heartbeat:
        heartbeat.detail = None
    say(f"preflight: buckets {report.buckets}, seconds {report.to_record()['seconds']}")
    if metrics:  # every rank: preflight time and buckets per rank
        metrics.write({**report.to_record(), "rank": world.rank}, always=True)
    baseline = graphs_compiled()
    result = TrainResult(preflight=report, start_step=start_step, parts=parts)
    prompts = [p for p in found if p is not None]
    skipped_prompts = len(found) - len(prompts)

    def evaluate(step: int) -> None:
        # a sharded target runs collectives in each forward: then every rank decodes every prompt, in step
        mine = prompts if layout.lockstep_eval else prompts[world.rank :: world.size]
        r = measure_tau(parts, drafter, mine, cfg.eval.max_new_tokens)
        totals = torch.tensor([r.accepted, r.steps, r.prompts, sum(r.per_prompt), len(r.per_prompt)],
                              dtype=torch.float64, device=world.device)  # fmt: skip
        totals = (totals if layout.lockstep_eval else all_reduce_sum(totals, world)).tolist()
        tau = totals[0] / totals[1] if totals[1] else 0.0
        prompt_mean = totals[3] / totals[4] if totals[4] else 0.0
        result.taus.append(prompt_mean)  # the headline: the mean of per-prompt means, as published evaluators report
        say(f"eval step {step} on {prompt_set}: tau {prompt_mean:.3f} (mean of per-prompt means; pooled {tau:.3f})"
            f" over {int(totals[2])} prompts, {int(totals[1])} draft steps, {skipped_prompts} prompts skipped as too "
            "long")  # fmt: skip
        event("eval", step=step, prompt_set=prompt_set, tau=round(prompt_mean, 4),
              tau_prompt_mean=round(prompt_mean, 4), tau_pooled=round(tau, 4), prompts=int(totals[2]),
              prompts_skipped=skipped_prompts, draft_steps=int(totals[1]))  # fmt: skip

    guard = DivergenceGuard(cfg.optim.max_nonfinite_steps, say)
    guard.last_checkpoint = str(latest) if loaded is not None else None

    def save(step: int) -> None:
        if guard.streak:  # weights are those of before the streak; a checkpoint now would only push out good ones
            say(f"checkpoint at step {step} skipped: {guard.streak} non-finite steps in a row")
            event("checkpoint_skipped", step=step, nonfinite_steps=guard.streak)
            return
        rngs = all_gather_objects(checkpoint.rng_state(), world)
        writer = world.is_main or (cfg.checkpoint.per_node and world.local_rank == 0)
        if writer and ckpt_root:
            pos = checkpoint.Position(step, stream.epoch, stream.batch_in_epoch)
            path = checkpoint.save(ckpt_root, pos, drafter, opt, sched, rngs, cfg.checkpoint.keep)
            guard.last_checkpoint = str(path)
            event("checkpoint", path=str(path), step=step)
        barrier(world)

    cuda = world.device.type == "cuda"
    if heartbeat:
        heartbeat.phase = "train"
    for step in range(start_step + 1, cfg.steps + 1):
        faults.at_step_start(step, run_dir)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        micro = []
        for _ in range(cfg.grad_accum):
            epoch, gb = stream.next()
            seq_len, idx = shard(gb, layout.dp_rank, cfg.data.batch_size)
            micro.append(make_batch(parts, ds, seq_len, idx, epoch))
        w_local = sum(float(b.weights.sum()) for b in micro)
        w_global = all_reduce_sum(torch.tensor([w_local], dtype=torch.float64, device=world.device), world).item()
        scale = world.size / max(w_global, 1e-6)
        sums = torch.zeros(2, dtype=torch.float64, device=world.device)  # [loss sum, correct sum]
        tokens = 0
        for i, batch in enumerate(micro):
            sync = i == len(micro) - 1 or not world.distributed
            ctx = model.no_sync() if not sync else contextlib.nullcontext()
            with ctx:
                loss_sum, _, correct = forward_loss(parts, batch, model)
                loss_sum = faults.poison_loss(step, loss_sum)
                (loss_sum * scale).backward()
            sums += torch.stack([loss_sum.detach().double(), correct.detach().double()])
            tokens += batch.input_ids.numel()
        grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.optim.grad_clip)
        peak = torch.cuda.max_memory_allocated(world.device) / 2**30 if cuda else _max_rss_gib()
        peaks = torch.zeros(world.size, dtype=torch.float64, device=world.device)
        peaks[world.rank] = peak
        reduced = all_reduce_sum(torch.cat([sums, peaks]), world).tolist()  # one collective, one sync per step
        loss_v, acc_v = (v / max(w_global, 1e-6) for v in reduced[:2])
        gnorm = float(grad_norm)  # computed before the collective: the sync above already waited for it
        finite = guard.check(step, loss_v, gnorm, sched.get_last_lr()[0])  # the same on every rank
        if finite:
            opt.step()
        sched.step()  # a skipped step still counts: the schedule follows the step number
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        tps = tokens * layout.dp / dt  # target tokens per second, all ranks (a tensor group's batch counted once)
        result.losses.append(loss_v)
        result.accs.append(acc_v)
        result.tokens_per_s.append(tps)
        lr = sched.get_last_lr()[0]
        if heartbeat:
            heartbeat.step = step
        if metrics:
            rec = {"step": step, "epoch": epoch, "tokens_per_s": round(tps, 1), "loss": _json_number(loss_v, 6),
                   "acc": round(acc_v, 6), "lr": lr, "grad_norm": _json_number(gnorm, 6),
                   "peak_mem_gib": round(peak, 3), "peak_mem_gib_ranks": [round(x, 3) for x in reduced[2:]]}
            if not finite:
                rec.update(skipped=True, nonfinite_steps=guard.streak)
            metrics.write(rec)
        if step % cfg.log_every == 0 or step == cfg.steps or not finite:
            skipped = f" (non-finite: skipped, {guard.streak} in a row)" if not finite else ""
            say(f"step {step}/{cfg.steps} epoch {epoch} loss {loss_v:.4f} acc {acc_v:.3f} lr {lr:.2e} "
                f"grad_norm {gnorm:.3f} {tps:,.0f} tok/s peak {peak:.1f} GiB{skipped}")  # fmt: skip
        guard.stop_if_diverged()
        recompiled = graphs_compiled() - baseline
        if recompiled > result.recompiles_after_preflight:
            if metrics:  # every rank reports its own
                metrics.event("recompile", always=True, step=step, graphs=recompiled, rank=world.rank)
            result.recompiles_after_preflight = recompiled
        if cfg.eval.every and step % cfg.eval.every == 0 and step != cfg.steps:
            evaluate(step)
        if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step != cfg.steps:
            save(step)
    if cfg.eval.at_end or (cfg.eval.every and cfg.steps % cfg.eval.every == 0):
        evaluate(cfg.steps)
    if start_step < cfg.steps:
        save(cfg.steps)
    if guard.streak:  # ended inside a streak (fewer than the limit): the weights are from before it, but say so
        say(f"the last {guard.streak} steps were non-finite and skipped")
    if run_dir and world.is_main:  # the drafter in the public DFlash format, ready to serve
        from trainer.export import draft_config, write_export

        d = parts.drafter.d
        config = draft_config(d, cfg.drafter.block_size, parts.target.layer_ids, parts.mask_token_id,
                              parts.target.config)  # fmt: skip
        path = write_export(run_dir / "export", drafter.state_dict(), config, run_dir=run_dir)
        event("export", path=str(path), step=cfg.steps)
        say(f"exported {path}")
    event("finished", step=cfg.steps)
    return result
