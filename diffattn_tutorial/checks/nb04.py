"""Checks for ``exercises/04_lambda_reparameterisation.ipynb``: ``lambda_init(depth)`` (0-based depth) and the
re-parameterised lambda, one per head. References: ``functional.lambda_init_fn`` and ``functional.reparam_lambda``."""

from __future__ import annotations

from typing import Callable

import torch

from diffattn_tutorial.checks._core import call, exercise_check, expect, expect_grads, fail, passed, randn
from diffattn_tutorial.checks._helpers import as_numbers
from diffattn_tutorial.functional import lambda_init_fn, reparam_lambda

__all__ = ["check_lambda_init", "check_reparam_lambda"]

_DEPTHS = list(range(0, 13)) + [23, 47]


@exercise_check(task=1, name="lambda_init", refuses=lambda: {lambda_init_fn: "the library's lambda_init_fn"})
def check_lambda_init(fn: Callable) -> None:
    """``fn(depth)`` -> the paper's lambda_init (a float) for the 0-based layer index ``depth``."""
    what = "lambda_init"
    results = [call(fn, depth, what=f"{what}({depth})") for depth in _DEPTHS]
    if any(isinstance(r, torch.Tensor) for r in results):
        fail(f"{what} returned a tensor: return a Python float (math.exp, not torch.exp), as the docstring says; "
             f"lambda_init is a constant of the layer, not a parameter")
    got = as_numbers(results, what=what)
    expected = torch.tensor([lambda_init_fn(depth) for depth in _DEPTHS], dtype=torch.float64)
    dep = torch.tensor(_DEPTHS, dtype=torch.float64)
    expect(got, expected, what=what, wrong={
        "lambda_init is off by one layer: depth is 0-based (the paper's l - 1), so the first layer gets "
        "0.8 - 0.6 = 0.2; do not subtract 1 again": 0.8 - 0.6 * torch.exp(-0.3 * (dep - 1)),
        "lambda_init is off by one layer: depth is already the 0-based index (the paper's l - 1); do not add 1":
            0.8 - 0.6 * torch.exp(-0.3 * (dep + 1)),
        "the exponent has the wrong sign: exp(-0.3 * depth) decays with depth": 0.8 - 0.6 * torch.exp(0.3 * dep),
        "the constants are swapped: 0.8 - 0.6 * exp(-0.3 * depth)": 0.6 - 0.8 * torch.exp(-0.3 * dep),
        "added instead of subtracted: 0.8 - 0.6 * exp(-0.3 * depth)": 0.8 + 0.6 * torch.exp(-0.3 * dep),
        "used a base-2 exponential: the formula uses the natural exponential, e to the power -0.3 depth":
            0.8 - 0.6 * torch.exp2(-0.3 * dep),
        "returned 1 - lambda_init, the factor the sub-norm's output is scaled by (notebook 05): return lambda_init "
        "itself": 1 - (0.8 - 0.6 * torch.exp(-0.3 * dep)),
    }, atol=1e-9)
    passed(f"lambda_init(0) = {lambda_init_fn(0):.1f}, rising towards 0.8 with depth (0-based).")


def _dot(a, b):
    return (a * b).sum(-1)


@exercise_check(task=2, name="reparam_lambda", refuses=lambda: {reparam_lambda: "the library's reparam_lambda"})
def check_reparam_lambda(fn: Callable) -> None:
    """``fn(lambda_q1, lambda_k1, lambda_q2, lambda_k2, lambda_init)``: four ``(H, d)`` tensors (row h: head h's
    vector) or four ``(d,)`` vectors, and a float -> the re-parameterised lambda of each head, ``(H,)`` (0-dim
    for ``(d,)`` vectors)."""
    what = "reparam_lambda"
    for i, (heads, d, li) in enumerate([(4, 8, 0.2), (3, 5, lambda_init_fn(3)), (None, 16, lambda_init_fn(11)),
                                        (2, 1, 0.5), (6, 6, lambda_init_fn(1))]):
        shape = (d,) if heads is None else (heads, d)
        q1, k1, q2, k2 = (randn(*shape, seed=400 + 10 * i + j) * 0.6 for j in range(4))
        expected = reparam_lambda(q1, k1, q2, k2, li)
        got = call(fn, q1, k1, q2, k2, li, what=f"{what} on {shape} vectors")
        if isinstance(got, (int, float)):
            fail(f"{what} returned a Python number: build lambda with torch operations on the four tensors, so "
                 f"that it stays a tensor and the vectors get gradients")
        if isinstance(got, torch.Tensor) and got.shape == shape and d > 1:
            fail(f"{what} returned shape {tuple(got.shape)}, the vectors' own: each exponential takes a dot product, "
                 f"one number per head, so the elementwise products must be summed over d first")
        if isinstance(got, torch.Tensor) and heads is not None and heads > 1 and got.dim() == 0:
            fail(f"{what} returned one number for {heads} heads: a dot product is over d (the last axis) only; "
                 f"summing over every entry mixes the heads, and each head has its own lambda")
        if isinstance(got, torch.Tensor) and heads is not None and heads > 1 and got.shape == (d,) and d != heads:
            fail(f"{what} returned shape ({d},): the products were summed over the heads; a dot product is over d, "
                 f"the last axis, one lambda per head")
        if isinstance(got, torch.Tensor) and heads is not None and heads > 1 and got.shape == (heads, heads):
            fail(f"{what} returned an (H, H) matrix: every head's query vector met every head's key vector (a "
                 f"matrix product); each head dots its own two vectors, row h with row h")
        wrong = {
            "forgot lambda_init: lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init":
                torch.exp(_dot(q1, k1)) - torch.exp(_dot(q2, k2)),
            "subtracted in the wrong order: exp(lq1 . lk1) - exp(lq2 . lk2)": reparam_lambda(q2, k2, q1, k1, li),
            "forgot the exp: lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init":
                _dot(q1, k1) - _dot(q2, k2) + li,
            "took exp before the sum: it is the exp of the dot product, exp(sum(lq1 * lk1))":
                torch.exp(q1 * k1).sum(-1) - torch.exp(q2 * k2).sum(-1) + li,
            "paired the wrong vectors: each exponential is a query vector dotted with a key vector (lq1 with "
            "lk1, lq2 with lk2), not two query vectors": torch.exp(_dot(q1, q2)) - torch.exp(_dot(k1, k2)) + li,
            "crossed the pairs: lq1 goes with lk1 and lq2 with lk2 (the same index), not lq1 with lk2":
                torch.exp(_dot(q1, k2)) - torch.exp(_dot(q2, k1)) + li,
            "crossed the pairs and the order: lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init, each query "
            "vector with the key vector of the same index": torch.exp(_dot(q2, k1)) - torch.exp(_dot(q1, k2)) + li,
            "took one exp of the difference: lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init, two exps":
                torch.exp(_dot(q1, k1) - _dot(q2, k2)) + li,
            "subtracted lambda_init: it is added": reparam_lambda(q1, k1, q2, k2, -li),
            "added the two exponentials: the second one is subtracted, which is what lets lambda go below "
            "lambda_init": torch.exp(_dot(q1, k1)) + torch.exp(_dot(q2, k2)) + li,
            "used a base-2 exponential: lambda uses the natural exponential": torch.exp2(_dot(q1, k1))
                - torch.exp2(_dot(q2, k2)) + li,
            "averaged the products: a dot product sums the elementwise products": torch.exp((q1 * k1).mean(-1))
                - torch.exp((q2 * k2).mean(-1)) + li,
        }
        if heads is not None and heads > 1:
            wrong["summed over the heads as well: each head's lambda uses its own two dot products, over d"] = \
                (torch.exp(_dot(q1, k1).sum()) - torch.exp(_dot(q2, k2).sum()) + li).expand(heads)
        if d == 1:  # exp-before-sum equals the right answer for one element; skip that hint
            wrong.pop(next(h for h in wrong if h.startswith("took exp before")))
        expect(got, expected, what=what, wrong=wrong)
    vecs = {name: randn(3, 6, seed=450 + j) * 0.6 for j, name in enumerate(["lambda_q1", "lambda_k1", "lambda_q2",
                                                                           "lambda_k2"])}
    expect_grads(lambda *v: fn(*v, 0.35), lambda *v: reparam_lambda(*v, 0.35), vecs, what=what,
                       missing_hints={n: "Build lambda from the tensors with torch operations (a Python float or "
                                         "math function makes a constant copy): lambda learns through these four "
                                         "vectors." for n in vecs})
    li = lambda_init_fn(2)
    init = reparam_lambda(*(randn(64, seed=460 + j) * 0.1 for j in range(4)), li).item()
    passed(f"one lambda per head, a dot product over d for each; at init (N(0, 0.1), d=64, depth 2) it is "
           f"{init:.3f} next to lambda_init {li:.3f}.")
