"""Measurements the notebooks and experiments make on attention maps and activations."""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def attention_share(attn: Tensor, positions: Tensor) -> Tensor:
    """Share of each query's attention that lands on ``positions``.

    ``attn`` is ``(..., Nq, Nk)`` (rows sum to 1 for softmax maps; differential maps may have negative
    entries, whose share counts with its sign); ``positions`` is a bool mask broadcastable to ``attn``
    (True = counted). Returns ``(..., Nq)``: ``sum_j attn[..., j] * positions[..., j]``.
    """
    if positions.dtype != torch.bool:
        raise TypeError(f"positions must be a bool mask, got {positions.dtype}")
    return (attn * positions.to(attn.dtype)).sum(-1)


def answer_noise_shares(attn: Tensor, answer: Tensor, context: Tensor) -> tuple[Tensor, Tensor]:
    """The paper's Table 3 pair: attention to the answer span, and to the rest of the context (noise).

    ``answer`` and ``context`` are bool masks broadcastable to ``attn`` ``(..., Nq, Nk)``; noise counts the
    context positions outside the answer. Returns ``(to_answer, to_noise)``, each ``(..., Nq)``.
    """
    noise = context & ~answer
    return attention_share(attn, answer), attention_share(attn, noise)


def top1_over_median(x: Tensor) -> Tensor:
    """Activation-outlier ratio (the paper's Table 5): ``max |x| / median |x|`` over all entries."""
    a = x.detach().abs().flatten().float()
    return a.max() / a.median().clamp_min(torch.finfo(a.dtype).tiny)
