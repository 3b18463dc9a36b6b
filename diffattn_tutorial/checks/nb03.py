"""Checks for ``exercises/03_dual_softmax.ipynb``: splitting Q/K into the two maps of each differential head
(the interleaved layout of unilm and timm) and the dual-softmax output on the *blocked* layout of Hugging Face's
DiffLlama. Reference: ``functional.diff_attention`` (on the heads reordered to its interleaved layout)."""

from __future__ import annotations

from typing import Callable

import torch

from diffattn_tutorial.checks._core import call, exercise_check, expect, expect_grads, fail, passed, randn
from diffattn_tutorial.checks._helpers import blocked_as_interleaved, library_diff_attention, swap_pairs
from diffattn_tutorial.functional import diff_attention

__all__ = ["check_split_pairs", "check_diff_attn"]


def _split_pairs() -> dict:
    from diffattn_tutorial import formulations
    return {formulations.split_pairs: "the library's formulations.split_pairs"}


@exercise_check(task=1, name="split_pairs", refuses=_split_pairs)
def check_split_pairs(fn: Callable) -> None:
    """``fn(t)`` with t ``(B, 2H, N, d)`` in the interleaved layout -> ``(t1, t2)``, each ``(B, H, N, d)``: map 1 and
    map 2 of every differential head."""
    what = "split_pairs"
    for i, (B, H, N, d) in enumerate([(2, 3, 5, 4), (1, 2, 7, 6), (3, 4, 1, 2), (1, 1, 3, 8)]):
        t = randn(B, 2 * H, N, d, seed=300 + i)
        res = call(fn, t, what=what)
        if not isinstance(res, (tuple, list)) or len(res) != 2:
            fail(f"{what} should return a pair (t1, t2), got {type(res).__name__}")
        for name, g in zip(("t1", "t2"), res):
            if not isinstance(g, torch.Tensor):
                fail(f"{what}: {name} should be a torch.Tensor, got {type(g).__name__}")
            if g.shape == (B, 2 * H, N, d // 2):
                fail(f"{what} split the head dim d in halves: the two maps are separate heads (the heads axis), "
                     f"heads 2i and 2i+1; each keeps the full head dim d")
            if g.shape != (B, H, N, d):
                fail(f"{what}: {name} has shape {tuple(g.shape)}, expected (B, H, N, d) = {(B, H, N, d)}")
        got_pair = torch.stack(list(res))
        t1, t2 = t[:, 0::2], t[:, 1::2]
        expect(got_pair, torch.stack([t1, t2]), what=what, wrong={
            "paired heads blocked (i with i + H) instead of interleaved: the two maps of differential head i are "
            "adjacent heads (see Task 1's text)": torch.stack([t[:, :H], t[:, H:]]),
            "the two maps are swapped: map 1 is the even heads (2i), map 2 the odd heads (2i + 1)":
                torch.stack([t2, t1]),
            "paired heads blocked and swapped: the maps of head i are heads 2i (map 1) and 2i + 1 (map 2)":
                torch.stack([t[:, H:], t[:, :H]]),
        })
    passed("map 1 = heads 0::2, map 2 = heads 1::2 (interleaved pairs, as unilm and timm).")


def _manual(q, k, v, lam, *, scale, dim=-1):
    """Explicit dual softmax for the wrong-answer candidates (MHA layout, no mask)."""
    q1, q2, k1, k2 = q[:, 0::2], q[:, 1::2], k[:, 0::2], k[:, 1::2]
    a1 = torch.softmax(q1 @ k1.transpose(-1, -2) * scale, dim=dim)
    a2 = torch.softmax(q2 @ k2.transpose(-1, -2) * scale, dim=dim)
    return (a1 - lam * a2) @ v


def _before_softmax(q, k, v, lam, *, scale):
    q1, q2, k1, k2 = q[:, 0::2], q[:, 1::2], k[:, 0::2], k[:, 1::2]
    s = (q1 @ k1.transpose(-1, -2) - lam * (q2 @ k2.transpose(-1, -2))) * scale
    return torch.softmax(s, dim=-1) @ v


# (B, H, Nq, Nk, d, lam): odd lengths, Nq != Nk, batch > 1, H >= 2 so the pairing shows, and a negative
# lambda (the re-parameterisation of notebook 04 lets lambda take either sign)
_CASES = [(2, 3, 5, 7, 4, 0.6), (1, 2, 9, 9, 8, 0.25), (3, 4, 3, 6, 2, 0.9), (2, 2, 4, 6, 4, -0.3)]


def _reference(q, k, v, lam):
    """The dual softmax on blocked q, k: the library's (interleaved) diff_attention on the heads reordered."""
    return diff_attention(blocked_as_interleaved(q), blocked_as_interleaved(k), v, lam, backend="naive")


@exercise_check(task=2, name="diff_attn", refuses=library_diff_attention)
def check_diff_attn(fn: Callable) -> None:
    """``fn(q, k, v, lam)``: q ``(B, 2H, Nq, d)`` and k ``(B, 2H, Nk, d)`` in the blocked layout, v
    ``(B, H, Nk, 2d)``, lam a 0-dim tensor -> the dual-softmax output, ``(B, H, Nq, 2d)``."""
    what = "diff_attn"
    for i, (B, H, nq, nk, d, lam_v) in enumerate(_CASES):
        q, k = randn(B, 2 * H, nq, d, seed=320 + i) * 1.5, randn(B, 2 * H, nk, d, seed=330 + i) * 1.5
        v, lam = randn(B, H, nk, 2 * d, seed=340 + i), torch.tensor(lam_v, dtype=torch.float64)
        qi, ki = blocked_as_interleaved(q), blocked_as_interleaved(k)  # the same heads, interleaved
        expected = _reference(q, k, v, lam)
        got = call(fn, q, k, v, lam, what=what)
        if isinstance(got, torch.Tensor) and got.shape == (B, H, nq, d):
            fail(f"{what} returned width d: each map multiplies the whole value of width 2d (v is not split "
                 f"between the maps)")
        if isinstance(got, torch.Tensor) and got.shape == (B, 2 * H, nq, 2 * d):
            fail(f"{what} returned 2H heads: subtract the two maps of each pair to get H differential heads")
        expect(got, expected, what=what, wrong={
            "paired the heads interleaved (2i with 2i + 1, Task 1's layout): here q and k are blocked, map 1 of "
            "head i is head i and map 2 is head i + H": diff_attention(q, k, v, lam, backend="naive"),
            "paired the heads interleaved and swapped the maps: in the blocked layout map 1 of head i is head i and "
            "map 2 is head i + H": diff_attention(swap_pairs(q), swap_pairs(k), v, lam, backend="naive"),
            "forgot the scale: divide the scores by sqrt(d) before each softmax": _manual(qi, ki, v, lam, scale=1.0),
            "scaled by the full head dim (2d) instead of d: the scale is 1/sqrt(d), d the q/k head dim "
            "(v is 2d wide, q and k are not)": _manual(qi, ki, v, lam, scale=(2 * d) ** -0.5),
            "scaled by 1/d: the scale is 1/sqrt(d)": _manual(qi, ki, v, lam, scale=1 / d),
            "subtracted in the wrong order: map 1 is the first half of the heads, map 2 the second half":
                diff_attention(swap_pairs(qi), swap_pairs(ki), v, lam, backend="naive"),
            "lambda multiplies both maps: it is A1 - lambda * A2, not lambda * (A1 - A2)":
                lam * diff_attention(qi, ki, v, 1.0, backend="naive"),
            "lambda is ignored: subtract lambda times the second map": diff_attention(qi, ki, v, 1.0, backend="naive"),
            "normalised over the wrong axis: each softmax runs over the keys (the last axis of the scores)":
                _manual(qi, ki, v, lam, scale=d ** -0.5, dim=-2),
            "subtracted the scores before one softmax: take two softmaxes, then subtract the maps":
                _before_softmax(qi, ki, v, lam, scale=d ** -0.5),
            **({"lambda lost its sign: lambda can be negative (notebook 04's re-parameterisation allows it); use it "
                "as it is, no absolute value or clamp": diff_attention(qi, ki, v, lam.abs(), backend="naive"),
                "lambda was clamped at 0: lambda can be negative (notebook 04's re-parameterisation allows it); use "
                "it as it is": diff_attention(qi, ki, v, lam.clamp(min=0), backend="naive")} if lam_v < 0 else {}),
            "added the second map: differential attention subtracts lambda times map 2 from map 1":
                diff_attention(qi, ki, v, -lam, backend="naive"),
            "the second map is missing: the output is map 1 minus lambda times map 2":
                diff_attention(qi, ki, v, 0.0, backend="naive"),
            "the difference is the wrong way round (lambda A2 - A1): it is map 1 minus lambda times map 2":
                -diff_attention(qi, ki, v, lam, backend="naive"),
        })
    B, H, nq, nk, d, lam_v = _CASES[0]
    expect_grads(
        fn, _reference,
        {"q": randn(B, 2 * H, nq, d, seed=350), "k": randn(B, 2 * H, nk, d, seed=351),
         "v": randn(B, H, nk, 2 * d, seed=352), "lam": torch.tensor(lam_v, dtype=torch.float64)},
        what=what, missing_hints={"lam": "Use the tensor lam as it is, not lam.item() or float(lam): a constant "
                                         "copy never learns (a known bug in one public implementation)."})
    passed("the dual softmax on DiffLlama's blocked layout (map 1 = heads :H, map 2 = heads H:), gradients "
           "(lambda's too) included.")
