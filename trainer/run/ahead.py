"""The next step's target forward, run beside this step's optimizer update.

The target is frozen: its hidden states for a batch depend on the batch alone, never on the drafter's weights, so
they can be computed before the drafter's update has landed. The update itself (the gradient norm, then the fused
AdamW over 1.05 B fp32 weights and both moments for the paper-shape drafter) is bound by memory traffic and leaves
the tensor cores idle, while the target forward is matmul work. On a GPU, `queue` starts the next batch's target
forward on a side stream that waits for everything queued so far on the step's stream (its backward), so the two run
side by side; `take` makes the step's stream wait for it and hands the hidden states over. On the CPU (one stream)
`queue` computes them at once: the same results, in the same order, with nothing overlapped.

Only for a target replicated on every rank: a sharded target's forward holds collectives, which must not run on a
second stream beside the gradient all-reduce.
"""

from __future__ import annotations

import torch

from trainer.model.mask import BlockBatch


class TargetAhead:
    """At most one batch's target forward in flight, keyed by the host batch it was queued for."""

    def __init__(self, parts, priority: int = 0) -> None:
        self.parts = parts
        cuda = parts.device.type == "cuda"
        self.side = torch.cuda.Stream(parts.device, priority=priority) if cuda else None
        self._pending: tuple[BlockBatch, BlockBatch, torch.Tensor] | None = None

    def queue(self, batch: BlockBatch) -> None:
        """Start `batch`'s target forward after everything queued so far on the current stream."""
        on_device = batch.to(self.parts.device)  # on the step's stream: the side stream waits for the copy too
        if self.side is None:
            hidden = self.parts.target.hidden_states(on_device.input_ids, compiled=True)
        else:
            self.side.wait_stream(torch.cuda.current_stream(self.parts.device))
            with torch.cuda.stream(self.side):
                hidden = self.parts.target.hidden_states(on_device.input_ids, compiled=True)
        self._pending = (batch, on_device, hidden)

    def take(self, batch: BlockBatch) -> tuple[BlockBatch, torch.Tensor] | None:
        """The device batch and hidden states queued for `batch` (this very object), or None; either way nothing is
        left pending, so a batch never gets another's hidden states."""
        pending, self._pending = self._pending, None
        if pending is None or pending[0] is not batch:
            return None
        _, on_device, hidden = pending
        if self.side is not None:
            main = torch.cuda.current_stream(self.parts.device)
            main.wait_stream(self.side)
            hidden.record_stream(main)  # made on the side stream, read and freed on this one
        return on_device, hidden

    def drop(self) -> None:
        """Forget what is in flight (a run that stops, or a batch that will not be used)."""
        self._pending = None


def ahead_enabled(cfg, device: torch.device, layout) -> bool:
    """`target.ahead`: auto is on for a replicated target on CUDA (where the overlap pays), off elsewhere."""
    mode = cfg.target.ahead
    if layout is not None and layout.mode != "replicate":
        return False
    return mode == "on" or (mode == "auto" and device.type == "cuda")
