"""The LM head's cross-entropy, its argmax and its gradient in one Triton kernel over bf16 logits.

After `logits = h @ W.T` (bf16, cuBLAS), each row is read once for its max and log-sum-exp (online), its target and
its argmax, and once more to write `w * (softmax - onehot)` over the logits in place, in bf16; `grad_h = grad @ W`
follows. So the fp32 passes over each `[rows, vocab]` block of the chunked autograd function (logsumexp, gather,
exp, argmax, the in-place gradient: five fp32 reads or writes of 151,936 columns per row) become two bf16 reads and
one bf16 write, and the two matmuls are most of the time that is left. The logits' precision is that of the plain
path (`lm_head(h)` in bf16, then `.float()`), so the loss equals the reference within bf16 noise.

On a GPU the kernel is compiled by Triton; on a CPU it runs in Triton's interpreter (`TRITON_INTERPRET=1`, which the
tests use), so the same kernel is tested everywhere Triton is installed.
"""

from __future__ import annotations

import os

import torch

try:  # an optional dependency: CUDA builds of torch bring it; the tests install it to run the interpreter
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

CHUNK = 8192  # rows per chunk: 8192 x 151936 bf16 logits = 2.3 GiB at a time, reused for the gradient
BLOCK_V = 4096  # columns per kernel iteration


def available(device: torch.device) -> bool:
    """The kernel can run here: Triton is importable, and the device is CUDA or the interpreter is on (CPU)."""
    if triton is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:

    @triton.jit
    def _ce_rows(
        logits_ptr, stride, labels_ptr, w_ptr, loss_ptr, correct_ptr, V, BLOCK: tl.constexpr, GRAD: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        label = tl.load(labels_ptr + row).to(tl.int64)
        w = tl.load(w_ptr + row).to(tl.float32)
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        best = tl.full((), float("-inf"), tl.float32)
        best_i = tl.zeros((), tl.int64)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            bm = tl.max(x, 0)
            bi = tl.argmax(x, 0).to(tl.int64) + start  # the first maximum of the block, as torch.argmax
            take = bm > best  # strictly: an earlier block's equal maximum keeps its (smaller) index
            best_i = tl.where(take, bi, best_i)
            best = tl.where(take, bm, best)
            new_m = tl.maximum(m, bm)
            s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), 0)
            m = new_m
        lse = m + tl.log(s)
        target = tl.load(base + label).to(tl.float32)
        tl.store(loss_ptr + row, (lse - target) * w)
        tl.store(correct_ptr + row, tl.where(best_i == label, w, 0.0))
        if GRAD:
            for start in range(0, V, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                x = tl.load(base + offs, mask=offs < V, other=0.0).to(tl.float32)
                g = tl.exp(x - lse)
                g = tl.where(offs == label, g - 1.0, g) * w
                tl.store(base + offs, g.to(logits_ptr.dtype.element_ty), mask=offs < V)


def _rows(logits: torch.Tensor, labels: torch.Tensor, w: torch.Tensor, grad: bool) -> tuple[torch.Tensor, ...]:
    n, V = logits.shape
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    correct = torch.empty(n, dtype=torch.float32, device=logits.device)
    _ce_rows[(n,)](
        logits, logits.stride(0), labels, w, loss, correct, V, BLOCK=min(BLOCK_V, triton.next_power_of_2(V)), GRAD=grad
    )
    return loss, correct


class FusedLinearCrossEntropy(torch.autograd.Function):
    """(sum of w * CE, sum of w * correct) through the frozen head; the gradient w.r.t. h is made in the forward
    (the head is frozen: no weight gradient), chunk by chunk, and only it ([N, C]) is kept."""

    @staticmethod
    def forward(ctx, h_NC, weight_VC, labels_N, w_N, chunk: int):
        N = h_NC.shape[0]
        need_grad = ctx.needs_input_grad[0]
        grad_h = torch.empty(h_NC.shape, dtype=weight_VC.dtype, device=h_NC.device) if need_grad else None
        losses, corrects = [], []
        for i in range(0, N, chunk):
            h = h_NC[i : i + chunk].to(weight_VC.dtype)
            logits = h @ weight_VC.t()  # [n, V] in the head's dtype, as the plain path
            loss, correct = _rows(
                logits, labels_N[i : i + chunk].contiguous(), w_N[i : i + chunk].float().contiguous(), need_grad
            )
            losses.append(loss)
            corrects.append(correct)
            if need_grad:
                torch.matmul(logits, weight_VC, out=grad_h[i : i + chunk])  # logits now hold d(loss)/d(logits)
            del logits
        if need_grad:
            ctx.save_for_backward(grad_h)
        ctx.h_dtype = h_NC.dtype
        total, hits = torch.cat(losses).sum(), torch.cat(corrects).sum()
        ctx.mark_non_differentiable(hits)
        return total, hits

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        (grad_h,) = ctx.saved_tensors
        return (grad_h * grad_loss.to(grad_h.dtype)).to(ctx.h_dtype), None, None, None, None


def fused_linear_cross_entropy(
    h_NC: torch.Tensor, weight_VC: torch.Tensor, labels_N: torch.Tensor, w_N: torch.Tensor, chunk: int = CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of w * CE, sum of w * correct) for hidden states h through the frozen head weight, by the fused kernel."""
    return FusedLinearCrossEntropy.apply(h_NC, weight_VC, labels_N, w_N, chunk)
