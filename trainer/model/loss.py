"""Weighted cross-entropy through the frozen LM head, without keeping the logits.

The plain way (`logits = head(h)`, then `cross_entropy`) keeps bf16 logits and their fp32 copy for backward: for
7,680 labelled positions and a 151,936-token vocabulary that is 7 GB, read and written several times. Here each chunk
of positions computes its logits, its loss and the gradient with respect to its hidden states in one go, and only
that gradient ([N, C], small) is kept. The head is frozen, so no weight gradient is needed.
"""

from __future__ import annotations

import torch

CHUNK = 2048  # positions per chunk: 2048 x 151936 fp32 logits = 1.2 GB at a time


class LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_NC, weight_VC, labels_N, w_N, chunk: int):
        N = h_NC.shape[0]
        loss = torch.zeros((), dtype=torch.float32, device=h_NC.device)
        correct = torch.zeros((), dtype=torch.float32, device=h_NC.device)
        grad_h = torch.empty(h_NC.shape, dtype=h_NC.dtype, device=h_NC.device)
        for i in range(0, N, chunk):
            h = h_NC[i : i + chunk].to(weight_VC.dtype)  # [n, C]
            labels, w = labels_N[i : i + chunk], w_N[i : i + chunk].float()  # [n]
            logits = (h @ weight_VC.t()).float()  # [n, V]
            lse = torch.logsumexp(logits, dim=-1)  # [n]
            target = logits.gather(1, labels[:, None]).squeeze(1)  # [n]
            loss += ((lse - target) * w).sum()
            correct += ((logits.argmax(-1) == labels).float() * w).sum()
            probs = logits.sub_(lse[:, None]).exp_()  # in place: softmax, [n, V]
            probs[torch.arange(labels.numel(), device=labels.device), labels] -= 1.0
            probs.mul_(w[:, None])  # d(loss)/d(logits)
            grad_h[i : i + chunk] = (probs.to(weight_VC.dtype) @ weight_VC).to(grad_h.dtype)  # [n, C]
        ctx.save_for_backward(grad_h)
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        (grad_h,) = ctx.saved_tensors
        return grad_h * grad_loss.to(grad_h.dtype), None, None, None, None


def linear_cross_entropy(
    h_NC: torch.Tensor, weight_VC: torch.Tensor, labels_N: torch.Tensor, w_N: torch.Tensor, chunk: int = CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of w * CE, sum of w * correct) for hidden states h through the frozen head weight."""
    if torch.is_grad_enabled() and h_NC.requires_grad:
        return LinearCrossEntropy.apply(h_NC, weight_VC, labels_N, w_N, chunk)
    loss = torch.zeros((), dtype=torch.float32, device=h_NC.device)
    correct = torch.zeros((), dtype=torch.float32, device=h_NC.device)
    for i in range(0, h_NC.shape[0], chunk):
        logits = (h_NC[i : i + chunk].to(weight_VC.dtype) @ weight_VC.t()).float()
        labels, w = labels_N[i : i + chunk], w_N[i : i + chunk].float()
        loss += ((torch.logsumexp(logits, -1) - logits.gather(1, labels[:, None]).squeeze(1)) * w).sum()
        correct += ((logits.argmax(-1) == labels).float() * w).sum()
    return loss, correct
