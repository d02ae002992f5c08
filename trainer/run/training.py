"""A training run: one process per device, data-parallel drafter, files in the run dir, exact resume.

Per optimiser step every rank takes its slice of one global batch per micro-step (`grad_accum` of them), so the data
of a step does not depend on the number of ranks. The loss is normalised by the global sum of loss weights (over
ranks and micro-steps): DDP averages gradients over ranks, so each rank scales its sum by world_size / global weight.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from trainer.config import TrainConfig, parse_parallel, to_dict
from trainer.data.dataset import Dataset, epoch_batches, load_tokenizer, make_dataset, shard
from trainer.errors import ConfigError, DivergedError
from trainer.model.compile_policy import compile_cache_counts, graphs_compiled, unfreeze_compiles
from trainer.model.drafter import Drafter
from trainer.model.mask import to_device
from trainer.model.parallel import Layout, make_layout
from trainer.run import checkpoint, faults
from trainer.run.build import Parts, build, forward_loss, lr_lambda, make_batch, preflight
from trainer.run.distributed import World, all_gather_objects, all_reduce_sum, barrier, init_world
from trainer.run.eval import eval_anchors, measure_tau, prompt_of
from trainer.run.gpu_history import GpuHistory
from trainer.run.loggers import check_available, open_sinks
from trainer.run.metrics import Heartbeat, MetricsWriter
from trainer.run.update import clip_into_update, make_adamw


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
            first_bad_step=self.first_bad,
            last_finite_step=self.last_finite[0] if self.last_finite else None,
            last_finite_loss=self.last_finite[1] if self.last_finite else None,
            lr=self.bad_lr,
            checkpoint=self.last_checkpoint,
            nonfinite_steps=self.streak,
        )


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
    from trainer.data.prompts import read_prompts, render

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
    from trainer.data.regenerate import generate

    model = parts.target.model
    pad = getattr(model.config, "pad_token_id", None) or 0

    def continue_greedily(prompts: list[list[int]], n: int) -> list[list[int]]:  # no end token: each runs n tokens
        return generate(model, prompts, n, temperature=0.0, top_p=1.0, pad=pad, ends=set())

    return continue_greedily


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
        run = Run(
            cfg,
            source=source,
            run_dir=run_dir,
            resume=resume,
            say=say,
            world=world,
            metrics=metrics,
            heartbeat=heartbeat,
        )
        return run.go()
    finally:
        unfreeze_compiles()  # the stance is process-wide: leave the process as it was found
        if heartbeat:
            heartbeat.stop()
        if gpus is not None:
            gpus.close()
        for sink in sinks:
            sink.close()


class Run:
    """One training run, in the recipe's order (`go`): the target, drafter and data; the optimiser; a resume; the
    preflight that compiles every shape; the steps (each skipped when non-finite), with in-run tau and checkpoints;
    the export. Each phase is a method; their state is this object's, declared here in the order `go` makes it."""

    # given
    cfg: TrainConfig
    source: str  # the config file's name, for errors
    run_dir: Path | None
    resume: bool
    say: Callable[[str], None]  # the main rank's log; a no-op on the others
    world: World
    metrics: MetricsWriter | None
    heartbeat: Heartbeat | None
    ckpt_root: Path | None  # RUN/checkpoints
    guard: DivergenceGuard
    # build_model_and_data
    layout: Layout  # where the target lives, and the data-parallel ranks
    parts: Parts  # target, drafter, attention (trainer/run/build.py), as trainer/run/parallelize.py left them
    drafter: Drafter  # the one-device module: checkpoints, export, decoding
    model: nn.Module  # what a step calls: the drafter, or its DistributedDataParallel wrapper
    ds: Dataset
    prompt_set: str  # the eval prompts' name
    prompts: list[torch.Tensor]
    skipped_prompts: int  # too long for the largest bucket
    # make_optimizer
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    global_batch: int  # samples per optimiser step over every rank
    stream: DataStream
    # go, compile_every_shape
    result: TrainResult
    baseline: int  # graphs compiled by the end of the preflight: any later one is a recompile

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        source: str,
        run_dir: Path | None,
        resume: bool,
        say: Callable[[str], None],
        world: World,
        metrics: MetricsWriter | None,
        heartbeat: Heartbeat | None,
    ) -> None:
        self.cfg, self.source, self.run_dir, self.resume, self.say = cfg, source, run_dir, resume, say
        self.world, self.metrics, self.heartbeat = world, metrics, heartbeat
        self.ckpt_root = run_dir / "checkpoints" if run_dir else None
        self.guard = DivergenceGuard(cfg.optim.max_nonfinite_steps, say)

    def event(self, name: str, **fields) -> None:
        if self.metrics:
            self.metrics.event(name, **fields)

    def go(self) -> TrainResult:
        self.build_model_and_data()
        self.make_optimizer()
        start_step = self.resume_from_checkpoint()
        self.result = TrainResult(start_step=start_step, parts=self.parts)
        self.compile_every_shape()
        cfg = self.cfg
        if self.heartbeat:
            self.heartbeat.phase = "train"
        for step in range(start_step + 1, cfg.steps + 1):
            self.train_step(step)
            if cfg.eval.every and step % cfg.eval.every == 0 and step != cfg.steps:
                self.evaluate(step)
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step != cfg.steps:
                self.save(step)
        if cfg.eval.at_end or (cfg.eval.every and cfg.steps % cfg.eval.every == 0):
            self.evaluate(cfg.steps)
        if start_step < cfg.steps:
            self.save(cfg.steps)
        if self.guard.streak:  # ended inside a streak (under the limit): the weights are from before it; say so
            self.say(f"the last {self.guard.streak} steps were non-finite and skipped")
        self.export()
        self.event("finished", step=cfg.steps)
        return self.result

    def build_model_and_data(self) -> None:
        """The frozen target (replicated or sharded), the drafter (checkpointed, compiled and in DDP as configured:
        trainer/run/parallelize.py), the dataset in shape buckets, the eval prompts."""
        cfg, source, say = self.cfg, self.source, self.say
        self.layout = make_layout(*parse_parallel(cfg.target.parallel, source), self.world, source)
        self.parts = build(cfg, source, device=self.world.device, layout=self.layout, world=self.world)
        self.drafter, self.model = self.parts.drafter, self.parts.model
        tok = load_tokenizer(cfg.data.tokenizer or cfg.target.path, source) if cfg.data.path else None
        vocab = int(self.parts.target.config.vocab_size)
        ds = make_dataset(
            cfg.data,
            vocab,
            block_size=cfg.drafter.block_size,
            seed=cfg.seed,
            tok=tok,
            source=source,
            generate=greedy_generator(self.parts),
        )
        self.ds = ds
        limit = cfg.eval.prompt_tokens or cfg.data.seq_buckets[-1] - cfg.drafter.block_size
        self.prompt_set, found = eval_prompts(cfg, ds, limit, source)
        self.prompts = [p for p in found if p is not None]
        self.skipped_prompts = len(found) - len(self.prompts)
        say(
            f"data: {len(ds.samples)} samples, {len(ds.heldout)} held out, dropped {ds.dropped_too_short} too short, "
            f"{ds.truncated} truncated to the largest bucket"
        )
        self.event(
            "data",
            samples=len(ds.samples),
            dropped_too_short=ds.dropped_too_short,
            dropped_too_long=ds.dropped_too_long,
            truncated=ds.truncated,
            holdout=len(ds.heldout),
        )

    def make_optimizer(self) -> None:
        """AdamW over the drafter's weights, warmup then cosine, the data stream."""
        cfg = self.cfg
        self.opt = make_adamw(self.drafter.parameters(), cfg.optim)  # found_inf: the skip on the device
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(cfg))
        self.global_batch = cfg.data.batch_size * self.layout.dp  # the ranks of a tensor group share their batch
        self.stream = DataStream(self.ds, self.global_batch, cfg.seed)

    def resume_from_checkpoint(self) -> int:
        """With --resume: the newest intact, finite checkpoint (older ones when newer are damaged); every rank the
        same step. Returns the step to continue after (0 for a fresh run)."""
        cfg, say, world, ckpt_root = self.cfg, self.say, self.world, self.ckpt_root
        found = checkpoint.load_newest_intact(ckpt_root) if self.resume and ckpt_root else (None, None, [])
        latest, loaded, skipped = found
        if skipped:
            for s in skipped:
                say(f"checkpoint {s['path']} skipped: {s['why']}")
            self.event("checkpoint_fallback", skipped=skipped, using=str(latest) if latest else None)
            if latest is None:  # repeating the run cannot fix the files: not a crash to restart
                raise ConfigError(
                    str(ckpt_root),
                    "--resume",
                    f"no intact checkpoint: {skipped[0]['why']} "
                    f"({len(skipped)} checked); move the run dir's checkpoints/ away to start afresh",
                )
        steps_found = all_gather_objects(loaded.position.step if loaded is not None else None, world)
        if len(set(steps_found)) > 1:  # every rank must continue from the same step, or the ranks train apart
            raise ConfigError(
                str(ckpt_root),
                "--resume",
                f"ranks would resume from different steps {steps_found} "
                "(a node lacks the checkpoint: set checkpoint.per_node, or share the run dir)",
            )
        start_step, resumed_from = 0, None
        if loaded is not None:
            self.drafter.load_state_dict(loaded.weights)
            self.opt.load_state_dict(loaded.optimizer)
            self.sched.load_state_dict(loaded.scheduler)
            pos = loaded.position
            self.stream = DataStream(self.ds, self.global_batch, cfg.seed, pos.epoch, pos.batch_in_epoch)
            start_step = resumed_from = pos.step
            if world.rank < len(loaded.rng):
                checkpoint.set_rng_state(loaded.rng[world.rank])
            self.guard.last_checkpoint = str(latest)
            say(f"resumed from {latest} at step {start_step}")
        self.event(
            "start",
            world_size=world.size,
            resumed_from=resumed_from,
            mask_token_id=self.parts.mask_token_id,
            mesh=self.layout.describe(),
            memory_plan=self.parts.memory_plan,
            config=to_dict(cfg),
        )
        return start_step

    def compile_every_shape(self) -> None:
        """The preflight: every bucket forward and backward (and the decoding shapes), progress in the heartbeat and
        the metrics; then any further compile is an error, and the graphs compiled so far are the baseline."""
        cfg, heartbeat, metrics, world = self.cfg, self.heartbeat, self.metrics, self.world
        do_eval = cfg.eval.every > 0 or cfg.eval.at_end
        if heartbeat:
            heartbeat.phase = "preflight"

        def progress(text: str, detail: dict) -> None:  # a start the user can watch: heartbeat and metrics
            if heartbeat:
                heartbeat.phase, heartbeat.detail = text, detail
            if metrics:
                metrics.write({"event": "preflight_progress", "rank": world.rank, **detail}, always=True)

        report = preflight(
            self.parts,
            backward=True,
            drafter=self.model,
            progress=progress,
            eval_anchors=eval_anchors(cfg.drafter.block_size) if do_eval else None,
        )
        if heartbeat:
            heartbeat.detail = None
        record = report.to_record()
        record["compile_cache"] = compile_cache_counts()  # hits: graphs found compiled on disk (a kept cache)
        record["kernel_cache"] = os.environ.get("TRITON_CACHE_DIR")  # the host's, shared (trainer/run/kernel_cache.py)
        took = ", ".join(f"{k}: {v:.1f} s" for k, v in record["seconds"].items())
        self.say(f"preflight: buckets {report.buckets} compiled ({took})")
        if metrics:  # every rank: preflight time and buckets per rank
            metrics.write({**record, "rank": world.rank}, always=True)
        self.result.preflight = report
        self.baseline = graphs_compiled()

    def _step_update(self, numbers: torch.Tensor) -> list[float]:
        """Queue the update, then bring the step's numbers (loss and correct sums, peaks, weight total, grad norm)
        to the host. The fused AdamW skips the update on the device when the loss or the grad norm is not finite
        (its `found_inf`, as GradScaler uses it), so the host waits for the numbers only and the device runs the
        update while the host prepares the next step; the guard then counts the same skip from the same numbers."""
        self.opt.found_inf = (~(torch.isfinite(numbers[0]) & torch.isfinite(numbers[-1]))).float()
        if numbers.device.type != "cuda":
            self.opt.step()
            return numbers.tolist()
        host = torch.empty(numbers.shape, dtype=numbers.dtype, pin_memory=True)
        host.copy_(numbers, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self.opt.step()  # queued behind the copy: the host does not wait for it
        copied.synchronize()
        return host.tolist()

    def train_step(self, step: int) -> None:
        """One optimiser step over `grad_accum` micro-batches of one global batch; the loss normalised over every
        rank and micro-batch; skipped (no update) when the loss or the grad norm is not finite."""
        cfg, world, parts, layout = self.cfg, self.world, self.parts, self.layout
        guard, result = self.guard, self.result
        cuda = world.device.type == "cuda"
        faults.at_step_start(step, self.run_dir)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        micro = []
        for _ in range(cfg.grad_accum):
            epoch, gb = self.stream.next()
            seq_len, idx = shard(gb, layout.dp_rank, cfg.data.batch_size)
            micro.append(make_batch(parts, self.ds, seq_len, idx, epoch))
        # the weight total is summed from the host's batch and copied to the device (from pinned memory: the copy
        # waits for nothing queued there), where the loss and the all-reduce need it: no host wait before the step
        w_local = to_device(torch.stack([b.weights.sum().double() for b in micro]).sum().reshape(1), world.device)
        w_global = all_reduce_sum(w_local, world)
        scale = world.size / w_global.clamp_min(1e-6)
        sums = torch.zeros(2, dtype=torch.float64, device=world.device)  # [loss sum, correct sum]
        tokens = 0
        for i, batch in enumerate(micro):
            sync = i == len(micro) - 1 or not world.distributed
            ctx = self.model.no_sync() if not sync else contextlib.nullcontext()
            with ctx:
                loss_sum, _, correct = forward_loss(parts, batch, self.model)
                loss_sum = faults.poison_loss(step, loss_sum)
                (loss_sum * scale).backward()
            sums += torch.stack([loss_sum.detach().double(), correct.detach().double()])
            tokens += batch.input_ids.numel()
        grad_norm = clip_into_update(self.opt, self.drafter.parameters(), cfg.optim.grad_clip)  # applied by step()
        peak = torch.cuda.max_memory_allocated(world.device) / 2**30 if cuda else _max_rss_gib()
        peaks = torch.zeros(world.size, dtype=torch.float64, device=world.device)
        peaks[world.rank] = peak
        reduced = all_reduce_sum(torch.cat([sums, peaks]), world)  # one collective, one sync per step
        numbers = torch.cat([reduced, w_global, grad_norm.detach().double().reshape(1)])
        host = self._step_update(numbers)
        loss_v, acc_v = (v / max(host[-2], 1e-6) for v in host[:2])
        gnorm = host[-1]
        finite = guard.check(step, loss_v, gnorm, self.sched.get_last_lr()[0])  # the device's own skip, counted
        self.sched.step()  # a skipped step still counts: the schedule follows the step number
        self.opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        tps = tokens * layout.dp / dt  # target tokens per second, all ranks (a tensor group's batch counted once)
        result.losses.append(loss_v)
        result.accs.append(acc_v)
        result.tokens_per_s.append(tps)
        lr = self.sched.get_last_lr()[0]
        if self.heartbeat:
            self.heartbeat.step = step
        if self.metrics:
            rec = {
                "step": step,
                "epoch": epoch,
                "tokens_per_s": round(tps, 1),
                "loss": _json_number(loss_v, 6),
                "acc": round(acc_v, 6),
                "lr": lr,
                "grad_norm": _json_number(gnorm, 6),
                "peak_mem_gib": round(peak, 3),
                "peak_mem_gib_ranks": [round(x, 3) for x in host[2:-2]],
            }
            if not finite:
                rec.update(skipped=True, nonfinite_steps=guard.streak)
            self.metrics.write(rec)
        if step % cfg.log_every == 0 or step == cfg.steps or not finite:
            skipped = f" (non-finite: skipped, {guard.streak} in a row)" if not finite else ""
            self.say(
                f"step {step}/{cfg.steps} epoch {epoch} loss {loss_v:.4f} acc {acc_v:.3f} lr {lr:.2e} "
                f"grad_norm {gnorm:.3f} {tps:,.0f} tok/s peak {peak:.1f} GiB{skipped}"
            )
        guard.stop_if_diverged()
        recompiled = graphs_compiled() - self.baseline
        if recompiled > result.recompiles_after_preflight:
            if self.metrics:  # every rank reports its own
                self.metrics.event("recompile", always=True, step=step, graphs=recompiled, rank=world.rank)
            result.recompiles_after_preflight = recompiled

    def evaluate(self, step: int) -> None:
        """tau on the eval prompts by speculative decoding, shared out across ranks (in lockstep for a sharded
        target, whose forwards hold collectives); the mean of per-prompt means, pooled beside it."""
        cfg, world, layout = self.cfg, self.world, self.layout
        mine = self.prompts if layout.lockstep_eval else self.prompts[world.rank :: world.size]
        r = measure_tau(self.parts, self.drafter, mine, cfg.eval.max_new_tokens)
        counts = [r.accepted, r.steps, r.prompts, sum(r.per_prompt), len(r.per_prompt)]
        totals = torch.tensor(counts, dtype=torch.float64, device=world.device)
        totals = (totals if layout.lockstep_eval else all_reduce_sum(totals, world)).tolist()
        tau = totals[0] / totals[1] if totals[1] else 0.0
        prompt_mean = totals[3] / totals[4] if totals[4] else 0.0
        self.result.taus.append(prompt_mean)  # the headline: the mean of per-prompt means, as evaluators report
        self.say(
            f"eval step {step} on {self.prompt_set}: tau {prompt_mean:.3f} (mean of per-prompt means; pooled "
            f"{tau:.3f}) over {int(totals[2])} prompts, {int(totals[1])} draft steps, {self.skipped_prompts} "
            "prompts skipped as too long"
        )
        self.event(
            "eval",
            step=step,
            prompt_set=self.prompt_set,
            tau=round(prompt_mean, 4),
            tau_prompt_mean=round(prompt_mean, 4),
            tau_pooled=round(tau, 4),
            prompts=int(totals[2]),
            prompts_skipped=self.skipped_prompts,
            draft_steps=int(totals[1]),
        )

    def save(self, step: int) -> None:
        """A checkpoint (main rank, or every node's first rank with checkpoint.per_node); never inside a run of
        non-finite steps, never with non-finite weights (checkpoint.save refuses them)."""
        cfg, world, guard = self.cfg, self.world, self.guard
        if guard.streak:  # weights are those of before the streak; a checkpoint now would only push out good ones
            self.say(f"checkpoint at step {step} skipped: {guard.streak} non-finite steps in a row")
            self.event("checkpoint_skipped", step=step, nonfinite_steps=guard.streak)
            return
        rngs = all_gather_objects(checkpoint.rng_state(), world)
        writer = world.is_main or (cfg.checkpoint.per_node and world.local_rank == 0)
        if writer and self.ckpt_root:
            pos = checkpoint.Position(step, self.stream.epoch, self.stream.batch_in_epoch)
            path = checkpoint.save(
                self.ckpt_root,
                pos,
                drafter=self.drafter,
                optimizer=self.opt,
                scheduler=self.sched,
                rng_states=rngs,
                keep=cfg.checkpoint.keep,
            )
            guard.last_checkpoint = str(path)
            self.event("checkpoint", path=str(path), step=step)
        barrier(world)

    def export(self) -> None:
        """The drafter in the public DFlash format in RUN/export/, ready to serve (main rank)."""
        if not (self.run_dir and self.world.is_main):
            return
        from trainer.model.dflash_format import draft_config, write_export

        cfg, parts = self.cfg, self.parts
        config = draft_config(
            parts.drafter.d,
            block_size=cfg.drafter.block_size,
            layer_ids=parts.target.layer_ids,
            mask_token_id=parts.mask_token_id,
            target_config=parts.target.config,
        )
        path = write_export(self.run_dir / "export", self.drafter.state_dict(), config, run_dir=self.run_dir)
        self.event("export", path=str(path), step=cfg.steps)
        self.say(f"exported {path}")
