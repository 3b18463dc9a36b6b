"""Checks for ``exercises/05_subnorm.ipynb``: RMSNorm and the per-head sub-norm scaled by ``(1 - lambda_init)``.
Reference: ``functional.rms_norm``."""

from __future__ import annotations

from typing import Callable

import torch
from einops import rearrange

from diffattn_tutorial.checks._core import call, exercise_check, expect, expect_grads, passed, randn
from diffattn_tutorial.functional import lambda_init_fn, rms_norm

__all__ = ["check_rms_norm", "check_subln"]


def _weight(n: int, seed: int) -> torch.Tensor:
    """A per-feature weight as training leaves it: magnitudes around 1, a few entries negative."""
    w = randn(n, seed=seed).abs() + 0.5
    w[1::3] *= -1
    return w


def _rms_wrong(x: torch.Tensor, w, eps: float) -> dict:
    """Outputs of the plausible wrong RMSNorms, for hints."""
    w_ = 1.0 if w is None else w
    ms = x.pow(2).mean(-1, keepdim=True)
    mu, var = x.mean(-1, keepdim=True), x.var(-1, keepdim=True, unbiased=False)
    wrong = {
        "normalised over the wrong axis: RMSNorm averages the squares over the features (the last axis)":
            x * torch.rsqrt(x.pow(2).mean(-2, keepdim=True) + eps) * w_,
        "subtracted the mean: that is LayerNorm; RMSNorm divides by the root mean square only":
            (x - mu) * torch.rsqrt(var + eps) * w_,
        "eps is outside the square root: it is added to the mean square, before the root": x / (ms.sqrt() + eps) * w_,
        "forgot the square root: RMSNorm divides by the root of the mean square": x / (ms + eps) * w_,
        "divided by the L2 norm: RMSNorm divides by the root *mean* square (the sum of squares over D)":
            x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps) * w_,
    }
    if w is not None:
        wrong["forgot the weight: the normalised x is scaled by weight (a learnable per-feature scale)"] = \
            x * torch.rsqrt(ms + eps)
        wrong["the weight lost its sign: a learned weight can be negative; scale by it as it is"] = \
            x * torch.rsqrt(ms + eps) * w.abs()
        wrong["the weight was clamped at 0: a learned weight can be negative; scale by it as it is"] = \
            x * torch.rsqrt(ms + eps) * w.clamp(min=0)
    return wrong


@exercise_check(task=1, name="rms_norm")
def check_rms_norm(fn: Callable) -> None:
    """``fn(x, weight=None, eps=1e-5)`` -> ``x / sqrt(mean(x^2, dim=-1) + eps) * weight``, same shape as x."""
    what = "rms_norm"
    cases = [((2, 3, 5, 8), True, 1e-5, 1.0), ((4, 7), False, 1e-5, 2.0), ((3, 6), True, 0.5, 0.3),
             ((1, 5, 10), False, 0.1, 0.2)]
    for i, (shape, has_w, eps, mag) in enumerate(cases):
        x = randn(*shape, seed=500 + i) * mag + 0.3 * mag  # a non-zero mean, so LayerNorm differs
        w = _weight(shape[-1], seed=510 + i) if has_w else None
        expected = rms_norm(x, w, eps)
        got = call(fn, x, weight=w, eps=eps, what=what)
        expect(got, expected, what=what, wrong=_rms_wrong(x, w, eps))
    x = randn(3, 16, seed=505) * 3e-3  # a mean square near 1e-5, so the default eps shows
    got = call(fn, x, what=f"{what} with the default weight and eps")
    expect(got, rms_norm(x, None, 1e-5), what=f"{what}(x) with the default weight=None and eps=1e-5",
           wrong=_rms_wrong(x, None, 1e-5),
           default_hint="Is the default eps 1e-5, as in the docstring? With inputs this small its value matters.")
    x, w = randn(2, 3, 8, seed=520) + 0.2, randn(8, seed=521).abs() + 0.5
    expect_grads(lambda x, w: fn(x, weight=w, eps=1e-5), lambda x, w: rms_norm(x, w, 1e-5),
                       {"x": x, "weight": w}, what=what)
    passed("x / sqrt(mean(x^2) + eps) * weight over the last dim, gradients included.")


@exercise_check(task=2, name="subln")
def check_subln(fn: Callable) -> None:
    """``fn(heads, lambda_init, weight=None, eps=1e-5)``: heads ``(B, H, N, 2d)`` -> RMSNorm of each head over
    its ``2d`` features, times ``weight``, times ``(1 - lambda_init)``; same shape."""
    what = "subln"
    for i, (B, H, N, d2, depth, has_w) in enumerate([(2, 3, 5, 8, 0, True), (1, 4, 7, 6, 5, False),
                                                      (3, 2, 1, 16, 11, True)]):
        li = lambda_init_fn(depth)
        o = randn(B, H, N, d2, seed=530 + i) * (1 + torch.arange(H, dtype=torch.float64).view(1, H, 1, 1))
        w = _weight(d2, seed=540 + i) if has_w else None
        w_ = 1.0 if w is None else w
        expected = rms_norm(o, w, 1e-5) * (1 - li)
        got = call(fn, o, li, weight=w, what=what)
        halves = rearrange(o, "b h n (two d) -> b h n two d", two=2)
        per_half = rearrange(rms_norm(halves, None, 1e-5), "b h n two d -> b h n (two d)") * w_ * (1 - li)
        joint = rms_norm(rearrange(o, "b h n e -> b n (h e)"), None, 1e-5)
        joint = rearrange(joint, "b n (h e) -> b h n e", h=H) * w_ * (1 - li)
        expect(got, expected, what=what, wrong={
            "missing (1 - lambda_init): the normalised heads are scaled by (1 - lambda_init) after the norm "
            "(a factor applied before an RMSNorm is normalised away)": rms_norm(o, w, 1e-5),
            "multiplied by lambda_init: the factor is (1 - lambda_init)": rms_norm(o, w, 1e-5) * li,
            "multiplied by (1 + lambda_init): the factor is (1 - lambda_init)": rms_norm(o, w, 1e-5) * (1 + li),
            "normalised over the wrong axis: normalise each head over its own 2d features (the last axis)":
                o * torch.rsqrt(o.pow(2).mean(-2, keepdim=True) + 1e-5) * w_ * (1 - li),
            "normalised over the heads axis: normalise each head over its own 2d features, separately for "
            "every head and token": o * torch.rsqrt(o.pow(2).mean(1, keepdim=True) + 1e-5) * w_ * (1 - li),
            "normalised each half (d) separately: a head's output has width 2d and is normalised as a whole":
                per_half,
            "normalised all heads of a token together (one LayerNorm over H * 2d): the sub-norm is per head "
            "(GroupNorm-style), over each head's 2d features": joint,
            "forgot the weight: the sub-norm scales each feature by its weight, then by (1 - lambda_init)":
                rms_norm(o, None, 1e-5) * (1 - li),
            "the weight lost its sign: a learned weight can be negative; scale by it as it is":
                rms_norm(o, None if w is None else w.abs(), 1e-5) * (1 - li),
            "the weight was clamped at 0: a learned weight can be negative; scale by it as it is":
                rms_norm(o, None if w is None else w.clamp(min=0), 1e-5) * (1 - li),
        })
    o, w = randn(2, 3, 4, 8, seed=550), randn(8, seed=551).abs() + 0.5
    li = lambda_init_fn(2)
    expect_grads(lambda o, w: fn(o, li, weight=w), lambda o, w: rms_norm(o, w, 1e-5) * (1 - li),
                       {"heads": o, "weight": w}, what=what)
    passed("per-head RMSNorm over 2d, times weight, times (1 - lambda_init).")
