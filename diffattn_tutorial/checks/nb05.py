"""Checks for ``exercises/05_subnorm.ipynb``: RMSNorm, over the last dim or over groups of consecutive features, and
the per-head sub-norm on the heads merged into one feature axis. Reference: ``functional.rms_norm``."""

from __future__ import annotations

from typing import Callable

import torch
from einops import rearrange

from diffattn_tutorial.checks._core import call, exercise_check, expect, expect_grads, fail, passed, randn
from diffattn_tutorial.functional import lambda_init_fn, rms_norm

__all__ = ["check_rms_norm", "check_subln"]


def _rms_norms() -> dict:
    """The library's and PyTorch's RMSNorm: what Task 1 builds (Task 2 may use an RMSNorm, not the scaled sub-norm)."""
    from diffattn_tutorial.functional import rms_norm_scaled, rms_norm_scaled_
    from diffattn_tutorial.layers.attention import RMSNorm
    return {rms_norm: "the library's rms_norm", rms_norm_scaled: "the library's rms_norm_scaled",
            rms_norm_scaled_: "the library's rms_norm_scaled_", RMSNorm.forward: "the library's RMSNorm layer",
            torch.nn.functional.rms_norm: "PyTorch's torch.nn.functional.rms_norm",
            torch.rms_norm: "PyTorch's torch.rms_norm", torch.nn.RMSNorm.forward: "PyTorch's torch.nn.RMSNorm"}


def _scaled_sub_norms() -> dict:
    """The library's sub-norm with its (1 - lambda_init) factor: what Task 2 builds (an RMSNorm is its building
    block, Task 1's answer, and stays allowed)."""
    from diffattn_tutorial.functional import rms_norm_scaled, rms_norm_scaled_
    from diffattn_tutorial.layers.attention import MultiheadDiffAttn
    return {rms_norm_scaled: "the library's rms_norm_scaled", rms_norm_scaled_: "the library's rms_norm_scaled_",
            MultiheadDiffAttn._subln_scaled: "the layer's own sub-norm (MultiheadDiffAttn._subln_scaled)"}


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


def _grouped(x: torch.Tensor, w, eps: float, group, *, strided: bool = False) -> torch.Tensor:
    """RMSNorm of every run of ``group`` consecutive features on its own (``strided``: every group-th feature, the
    mistake), then the weight over all D features."""
    if group is None:
        return rms_norm(x, w, eps)
    D = x.shape[-1]
    if strided:
        parts = rearrange(x, "... (g n) -> ... n g", g=group)
        out = rearrange(rms_norm(parts, None, eps), "... n g -> ... (g n)")
    else:
        out = rms_norm(x.unflatten(-1, (D // group, group)), None, eps).flatten(-2)
    return out if w is None else out * w


def _unchanged(x: torch.Tensor, before: torch.Tensor, *, what: str) -> None:
    """Fail if the learner's function wrote into its input (the caller's activations would be lost)."""
    if not torch.equal(x, before):
        fail(f"{what} changed its input x in place (an in-place op such as mul_, div_ or x *= ...): return a new "
             f"tensor and leave x as it was")


@exercise_check(task=1, name="rms_norm", refuses=_rms_norms)
def check_rms_norm(fn: Callable) -> None:
    """``fn(x, weight=None, eps=1e-5, group=None)``: x ``(..., D)``, weight ``(D,)`` or None -> RMSNorm over the
    last dim (``group=None``) or over every run of ``group`` consecutive features on its own, same shape as x."""
    what = "rms_norm"
    cases = [((2, 3, 5, 8), True, 1e-5, 1.0, None), ((4, 12), False, 1e-5, 2.0, 4), ((3, 6), True, 0.5, 0.3, None),
             ((1, 5, 10), False, 0.1, 0.2, None), ((2, 3, 12), True, 1e-5, 1.0, 3), ((2, 8), True, 0.1, 0.5, 8)]
    for i, (shape, has_w, eps, mag, group) in enumerate(cases):
        x = randn(*shape, seed=500 + i) * mag + 0.3 * mag  # a non-zero mean, so LayerNorm differs
        if group is not None:  # groups of different sizes, so a norm over the whole dim differs
            x = x * (1 + torch.arange(shape[-1] // group, dtype=x.dtype).repeat_interleave(group))
        w = _weight(shape[-1], seed=510 + i) if has_w else None
        expected = _grouped(x, w, eps, group)
        label = what if group is None else f"{what}(..., group={group}) on {shape[-1]} features"
        x_before = x.clone()
        got = call(fn, x, weight=w, eps=eps, group=group, what=label)
        _unchanged(x, x_before, what=what)
        if group is None:
            wrong = _rms_wrong(x, w, eps)
        else:
            wrong = {
                "group is ignored: with group=g every run of g consecutive features is normalised on its own (its "
                "own mean square)": rms_norm(x, w, eps),
                "the groups are strided (every D/g-th feature): a group is g consecutive features, x[..., :g], "
                "x[..., g:2g], ...": _grouped(x, w, eps, group, strided=True),
                "g is the size of each group, not the number of groups: runs of g consecutive features, D/g runs":
                    _grouped(x, w, eps, shape[-1] // group),
                **{f"{h} (in each group)": c.flatten(-2) * (1.0 if w is None else w)
                   for h, c in _rms_wrong(x.unflatten(-1, (-1, group)), None, eps).items() if "axis" not in h},
            }
        if eps != 1e-5:
            wrong["the eps argument is ignored (a fixed 1e-5): use the eps the caller passes"] = \
                _grouped(x, w, 1e-5, group)
        expect(got, expected, what=label, wrong=wrong)
    x = randn(3, 16, seed=505) * 3e-3  # a mean square near 1e-5, so the default eps shows
    got = call(fn, x, what=f"{what} with the default weight, eps and group")
    expect(got, rms_norm(x, None, 1e-5), what=f"{what}(x) with the default weight=None, eps=1e-5 and group=None",
           wrong=_rms_wrong(x, None, 1e-5),
           default_hint="Is the default eps 1e-5, as in the docstring? With inputs this small its value matters.")
    x, w = randn(2, 3, 8, seed=520) + 0.2, randn(8, seed=521).abs() + 0.5
    expect_grads(lambda x, w: fn(x, weight=w, eps=1e-5, group=4), lambda x, w: _grouped(x, w, 1e-5, 4),
                 {"x": x, "weight": w}, what=what)
    passed("RMSNorm over the last dim or over each run of `group` features, gradients included.")


@exercise_check(task=2, name="subln", refuses=_scaled_sub_norms)
def check_subln(fn: Callable) -> None:
    """``fn(x, num_heads, lambda_init, weight=None, eps=1e-5)``: the heads merged, x ``(B, N, H * 2d)``, weight
    ``(2d,)`` shared by every head -> the sub-norm scaled for ``lambda_init``, same shape."""
    what = "subln"
    for i, (B, H, N, d2, depth, has_w) in enumerate([(2, 3, 5, 8, 0, True), (1, 4, 7, 6, 5, False),
                                                      (3, 2, 1, 16, 11, True)]):
        li = lambda_init_fn(depth)
        o = randn(B, H, N, d2, seed=530 + i) * (1 + torch.arange(H, dtype=torch.float64).view(1, H, 1, 1))
        x = rearrange(o, "b h n e -> b n (h e)")  # the merged layout the output projection takes
        w = _weight(d2, seed=540 + i) if has_w else None
        w_ = 1.0 if w is None else w
        label = f"{what}(x, num_heads={H}, ...)"

        def merged(t):  # (B, H, N, 2d) -> (B, N, H * 2d)
            return rearrange(t, "b h n e -> b n (h e)")

        expected = merged(rms_norm(o, w, 1e-5) * (1 - li))
        got = call(fn, x, H, li, weight=w, what=label)
        halves = rearrange(o, "b h n (two d) -> b h n two d", two=2)
        per_half = rearrange(rms_norm(halves, None, 1e-5), "b h n two d -> b h n (two d)") * w_ * (1 - li)
        strided = rearrange(rms_norm(rearrange(x, "b n (e h) -> b n h e", h=H), None, 1e-5), "b n h e -> b n (e h)")
        wrong = {
            "missing (1 - lambda_init): the normalised heads are scaled by (1 - lambda_init) after the norm "
            "(a factor applied before an RMSNorm is normalised away)": merged(rms_norm(o, w, 1e-5)),
            "multiplied by lambda_init: the factor is (1 - lambda_init)": merged(rms_norm(o, w, 1e-5) * li),
            "multiplied by (1 + lambda_init): the factor is (1 - lambda_init)": merged(rms_norm(o, w, 1e-5) * (1 + li)),
            "normalised all heads of a token together (one norm over H * 2d): the sub-norm is per head, over each "
            "head's 2d features": rms_norm(x, None, 1e-5) * (1.0 if w is None else w.repeat(H)) * (1 - li),
            "normalised each half (d) separately: a head's output has width 2d and is normalised as a whole":
                merged(per_half),
            "split the heads the wrong way: in (B, N, H * 2d) head h is the features h*2d .. (h+1)*2d - 1, not every "
            "H-th feature": strided * (1.0 if w is None else w.repeat(H)) * (1 - li),
            "grouped the features in runs of num_heads: each head is one group of 2d consecutive features, so the "
            "group size is 2d = x.shape[-1] // num_heads": _grouped(x, None, 1e-5, H) * (1.0 if w is None else
                                                                                w.repeat(H)) * (1 - li),
            "normalised over the tokens: each head is normalised over its own 2d features, token by token":
                merged(o * torch.rsqrt(o.pow(2).mean(-2, keepdim=True) + 1e-5) * w_ * (1 - li)),
            "forgot the weight: the sub-norm scales each feature by its weight, then by (1 - lambda_init)":
                merged(rms_norm(o, None, 1e-5) * (1 - li)),
        }
        if w is not None:
            wrong["the weight is spread wrongly over the heads: every head uses the same 2d weights, so over the "
                  "merged features they repeat head after head (w, w, ...), not entry by entry"] = \
                merged(rms_norm(o, None, 1e-5)) * w.repeat_interleave(H) * (1 - li)
            wrong["the weight lost its sign: a learned weight can be negative; scale by it as it is"] = \
                merged(rms_norm(o, w.abs(), 1e-5) * (1 - li))
            wrong["split the heads the wrong way: in (B, N, H * 2d) head h is the features h*2d .. (h+1)*2d - 1 "
                  "(consecutive, '(h e)'), not every H-th feature ('(e h)')"] = \
                strided * w.repeat_interleave(H) * (1 - li)  # "(e h)" read and written back, weight per head
        expect(got, expected, what=label, wrong=wrong)
    x = randn(2, 3, 8, seed=545) * 3e-3  # a mean square near 1e-5, so the default eps shows
    got = call(fn, x, 2, 0.2, what=f"{what} with the default weight and eps")
    expect(got, rms_norm(x.unflatten(-1, (2, -1)), None, 1e-5).flatten(-2) * 0.8,
           what=f"{what}(x, 2, 0.2) with the default weight=None and eps=1e-5",
           default_hint="Is the default eps 1e-5, as in the docstring? With inputs this small its value matters.")
    o, w = randn(2, 3, 4, 8, seed=550), randn(8, seed=551).abs() + 0.5
    li = lambda_init_fn(2)
    expect_grads(lambda x, w: fn(x, 3, li, weight=w),
                 lambda x, w: rms_norm(x.unflatten(-1, (3, -1)), w, 1e-5).flatten(-2) * (1 - li),
                 {"x": rearrange(o, "b h n e -> b n (h e)"), "weight": w}, what=what)
    passed("each head's 2d features normalised on their own in the merged layout, the shared weight, then "
           "the fixed factor.")
