"""Checks for ``exercises/06_full_module.ipynb``: the bottom-right causal mask, GQA expansion of K/V for
differential heads, and a full multi-head differential attention forward. References:
``functional.causal_mask``, ``functional.diff_attention`` and ``layers.attention.MultiheadDiffAttn``."""

from __future__ import annotations

import copy
from typing import Callable

import torch
from einops import rearrange

from diffattn_tutorial.checks._core import call, close, exercise_check, expect, expect_grads, fail, passed, randn
from diffattn_tutorial.checks._helpers import (
    blocked_as_interleaved,
    kv_heads_one_by_one,
    library_diff_attention,
    seeded,
    swap_pairs,
    tiled_kv,
)
from diffattn_tutorial.functional import causal_mask, diff_attention, expand_kv_groups, lambda_init_fn, rms_norm
from diffattn_tutorial.layers.attention import MultiheadDiffAttn

__all__ = ["check_causal_mask", "check_expand_kv", "check_forward"]

_MASK_CASES = [(5, 5), (1, 1), (3, 7), (1, 6), (4, 4), (2, 9)]


@exercise_check(task=1, name="causal_mask", refuses=lambda: {causal_mask: "the library's causal_mask"})
def check_causal_mask(fn: Callable) -> None:
    """``fn(nq, nk)`` -> bool ``(nq, nk)``, True where query ``i`` may attend key ``j``, aligned bottom-right
    (with a KV cache the queries are the newest tokens)."""
    what = "causal_mask"
    for nq, nk in _MASK_CASES:
        got = call(fn, nq, nk, what=f"{what}({nq}, {nk})")
        if not isinstance(got, torch.Tensor):
            fail(f"{what} should return a torch.Tensor, got {type(got).__name__}")
        if got.dtype != torch.bool:
            fail(f"{what} returned dtype {got.dtype}: return a bool mask, True where a query may attend "
                 f"(a comparison of key and query positions gives one)")
        expected = causal_mask(nq, nk)
        i = torch.arange(nq)[:, None]
        j = torch.arange(nk)[None, :]
        off = nk - nq
        f = lambda m: m.to(torch.float64)  # noqa: E731 - compare bool masks as numbers
        expect(f(got), f(expected), what=f"{what}({nq}, {nk})", wrong={
            "the mask diagonal is wrong: it is strict (j < i) but a query may attend its own key, j <= i "
            "(a strict mask leaves the first query with no key at all)": f(j < i + off),
            "the mask is aligned top-left (j <= i): when nq < nk (decoding with a KV cache) the queries are the "
            "*last* nq positions, so query i sees keys j <= i + (nk - nq) (bottom-right)": f(j <= i),
            "the mask is aligned top-left and strict: a query sees its own key, and with nq < nk the queries are "
            "the last nq positions (bottom-right)": f(j < i),
            "the mask is inverted: True means *may attend* (the past and the present), not masked":
                f(j > i + off),
            "the mask is inverted and its diagonal is wrong: True = may attend, the past and the query's own key":
                f(j >= i + off),
            "the offset has the wrong sign: the nq queries are the *last* nq of nk positions, so query i sees keys "
            "j <= i + (nk - nq)": f(j <= i - off),
            "off by one: the mask lets each query see the next key too (its future); query i sees keys "
            "j <= i + (nk - nq)": f(j <= i + off + 1),
        })
    passed("bool mask, True = may attend, j <= i + (nk - nq): diagonal included, aligned bottom-right.")


_KV_EXPANSIONS = {"right": expand_kv_groups, "tile": tiled_kv, "one_by_one": kv_heads_one_by_one}
"""The library's GQA expansion and the two plausible mistakes, each ``(k, v, H) -> (k, v)``."""


def _expanded(k: torch.Tensor, v: torch.Tensor, heads: int, k_rule: str, v_rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys expanded by ``k_rule`` and values by ``v_rule`` (names of :data:`_KV_EXPANSIONS`)."""
    return _KV_EXPANSIONS[k_rule](k, v, heads)[0], _KV_EXPANSIONS[v_rule](k, v, heads)[1]


_KV_HINTS = {
    ("tile", "right"): "GQA grouping wrong: the keys are tiled (the whole list of groups repeated), so head i "
                       "reads group i % Hkv; differential head i uses KV group i // (H // Hkv), both maps from that "
                       "group, so consecutive heads share a group",
    ("tile", "tile"): "GQA grouping wrong: k and v are tiled (the whole list of groups repeated), so head i reads "
                      "group i % Hkv; differential head i uses KV group i // (H // Hkv): repeat each group in place",
    ("right", "tile"): "GQA grouping wrong for v: v is tiled (the whole list repeated) while the keys are grouped "
                       "right; value head i must be group i // (H // Hkv) too, each group repeated in place",
    ("one_by_one", "right"): "GQA grouping wrong: you repeated the 2Hkv key heads one at a time, so the two maps "
                             "of a head can read the same key map (the pitfall in unilm's naive file); the two "
                             "key maps of a group (2g, 2g + 1) must be repeated together, as a pair",
    ("one_by_one", "tile"): "GQA grouping wrong: the key pairs (2g, 2g + 1) must be repeated together and each "
                            "value head repeated in place, so head i uses group i // (H // Hkv)",
}


_KV_BLOCKED_HINT = ("the key maps are read or written blocked (all k1 maps, then all k2 maps): the two maps of "
                    "group g sit side by side, at 2g and 2g + 1, and so do those of head i in the result")


@exercise_check(task=2, name="expand_kv", refuses=lambda: {expand_kv_groups: "the library's expand_kv_groups"})
def check_expand_kv(fn: Callable) -> None:
    """``fn(k, v, num_heads)``: k ``(B, 2Hkv, N, d)``, v ``(B, Hkv, N, 2d)`` -> ``(k, v)`` of shapes
    ``(B, 2H, N, d)`` and ``(B, H, N, 2d)``, every differential head given its KV group's keys and values."""
    what = "expand_kv"
    for i, (B, H, Hkv, N, d) in enumerate([(2, 4, 2, 5, 4), (1, 6, 2, 7, 2), (2, 3, 1, 3, 4), (1, 2, 2, 4, 4),
                                           (1, 6, 3, 5, 2)]):
        q = randn(B, 2 * H, N, d, seed=600 + i) * 1.5
        k, v = randn(B, 2 * Hkv, N, d, seed=610 + i) * 1.5, randn(B, Hkv, N, 2 * d, seed=620 + i)
        lam = torch.tensor(0.4, dtype=torch.float64)
        res = call(fn, k, v, H, what=what)
        if not isinstance(res, (tuple, list)) or len(res) != 2:
            fail(f"{what} should return a pair (k, v), got {type(res).__name__}")
        ke, ve = res
        for name, t, shape in (("k", ke, (B, 2 * H, N, d)), ("v", ve, (B, H, N, 2 * d))):
            if not isinstance(t, torch.Tensor):
                fail(f"{what}: the returned {name} should be a torch.Tensor, got {type(t).__name__}")
            if name == "v" and t.shape == (B, 2 * H, N, 2 * d):
                fail(f"{what}: v has 2H heads; values have one head per differential head (H), width 2d")
            if t.shape != shape:
                fail(f"{what}: the returned {name} has shape {tuple(t.shape)}, expected {shape} "
                     f"(H = {H} differential heads, Hkv = {Hkv} KV groups)")
        expected = diff_attention(q, k, v, lam, backend="naive")  # the library's own GQA
        got = diff_attention(q, ke.to(q.dtype), ve.to(q.dtype), lam, backend="naive")
        wrong = {hint: diff_attention(q, *_expanded(k, v, H, kn, vn), lam, backend="naive")
                 for (kn, vn), hint in _KV_HINTS.items()}
        if Hkv > 1:  # blocked key maps (all k1, then all k2) read in, or written out
            ke_right, ve_right = expand_kv_groups(k, v, H)
            wrong[_KV_BLOCKED_HINT + " (in k)"] = diff_attention(
                q, *expand_kv_groups(blocked_as_interleaved(k), v, H), lam, backend="naive")
            wrong[_KV_BLOCKED_HINT + " (in the returned k)"] = diff_attention(
                q, rearrange(ke_right, "b (h two) n d -> b (two h) n d", two=2), ve_right, lam, backend="naive")
        expect(got, expected, what=f"{what} (diff_attention with your k and v, H={H}, Hkv={Hkv})", wrong=wrong,
               default_hint="Differential head i uses KV group g = i // (H // Hkv): key heads 2g, 2g + 1 and "
                            "value head g.")
    q, lam = randn(2, 8, 5, 4, seed=630), torch.tensor(0.4, dtype=torch.float64)
    expect_grads(lambda k, v: diff_attention(q, *call(fn, k, v, 4, what=what), lam, backend="naive"),
                       lambda k, v: diff_attention(q, k, v, lam, backend="naive"),
                       {"k": randn(2, 4, 5, 4, seed=631), "v": randn(2, 2, 5, 8, seed=632)}, what=what)
    passed("2Hkv key heads and Hkv value heads expanded so that differential head i reads group i // (H // Hkv).")


# --------------------------------------------------------------------------------------------
# the full forward
# --------------------------------------------------------------------------------------------

# (embed_dim, H, Hkv, depth, B, N): MHA and GQA, several depths, odd lengths, batch > 1
_LAYERS = [(48, 3, 3, 0, 2, 5), (64, 4, 2, 3, 2, 7), (48, 6, 2, 5, 1, 9), (32, 2, 1, 1, 3, 4)]


def _make_layer(i: int, C: int, H: int, Hkv: int, depth: int) -> MultiheadDiffAttn:
    with seeded(650 + i):
        layer = MultiheadDiffAttn(C, H, num_kv_heads=Hkv, depth=depth, dtype=torch.float64)
        with torch.no_grad():
            for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                getattr(layer, name).normal_(0.0, 0.3)  # lambda away from lambda_init
            layer.subln.weight.uniform_(0.5, 1.5)  # a sub-norm weight that matters
    return layer


def _lambda_init_at(depth: int) -> float:
    """``lambda_init_fn(depth)``, extended to ``depth = -1`` (where a learner's off-by-one lands for layer 0): the
    formula's steps between layers shrink by a constant ratio, so the step below layer 0 follows from layers 0-2."""
    if depth >= 0:
        return lambda_init_fn(depth)
    l0, l1, l2 = (lambda_init_fn(i) for i in range(3))
    return l0 - (l1 - l0) ** 2 / (l2 - l1)  # one step down: the step 0 -> 1 divided by the ratio (l2 - l1) / (l1 - l0)


def _variant(layer: MultiheadDiffAttn, x: torch.Tensor, *, scale=None, swap=False, blocked=False, mask="causal",
             gqa=("right", "right"), factor="right", norm="right", depth_shift=0, merge="right", lam_base="right",
             sign=1.0, negate=False) -> torch.Tensor:
    """The layer's forward with one step turned into a plausible mistake (every knob at its default = the layer).

    The right steps are the library's own (the layer's projections, lambda, sub-norm and output projection,
    ``expand_kv_groups``, ``diff_attention``); only the mistaken step is written here.
    """
    B, N, _ = x.shape
    H, Hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    scale = (2 * d) ** -0.5 if scale == "2d" else scale
    q, k, v = layer.project_qkv(x, None, None, None, 2 * H, 2 * Hkv, Hkv)
    lambda_init = _lambda_init_at(layer.depth + depth_shift)
    lam = layer.lambda_full() - layer.lambda_init + lambda_init  # the layer's lambda, re-based on lambda_init
    lam = sign * {"right": lam, "no_init": lam - lambda_init, "init_only": lam * 0 + lambda_init}[lam_base]
    if swap:
        q, k = swap_pairs(q), swap_pairs(k)
    if blocked:
        q, k = blocked_as_interleaved(q), blocked_as_interleaved(k)
    k, v = _expanded(k, v, H, *gqa)
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    kw = {"causal": True} if mask == "causal" else {}
    if mask == "anti":  # masked the past instead of the future: each token sees itself and the future
        kw = {"attn_mask": j >= i}
    if mask in ("strict_fill", "strict_add"):  # a strict mask (j < i) with a large negative number, not -inf
        kw = {"attn_mask": torch.zeros(N, N, dtype=x.dtype).masked_fill(j >= i, -1e9)}
    o = diff_attention(q, k, v, lam, scale=scale, backend="naive", **kw)
    if mask == "strict_fill":  # masked_fill(-1e9): the first row is all -1e9, a uniform average of the values
        o = o.clone()
        o[:, :, 0] = (1 - lam) * v.mean(-2)
    o = _subnorm_variant(layer, -o if negate else o, norm)
    o = o * {"right": 1 - lambda_init, "lambda_init": lambda_init, "none": 1.0, "lambda": 1 - sign * lam,
                "one_plus": 1 + lambda_init}[factor]
    if merge == "no_transpose":
        o = o.reshape(B, N, -1)
    elif merge == "feature_major":
        o = rearrange(o, "b h n e -> b n (e h)")
    else:
        o = rearrange(o, "b h n e -> b n (h e)")
    return layer.out_proj(o)


def _subnorm_variant(layer: MultiheadDiffAttn, o: torch.Tensor, norm: str) -> torch.Tensor:
    """The layer's sub-norm of the heads ``o (B, H, N, 2d)`` (``"right"``), or a plausible mistake."""
    weight, eps, H = layer.subln.weight, layer.subln.eps, o.shape[1]
    if norm == "right":
        return layer.subln(o)
    if norm == "half":  # each d-wide half normalised on its own
        o = rms_norm(rearrange(o, "b h n (two d) -> b h n two d", two=2), None, eps)
        return rearrange(o, "b h n two d -> b h n (two d)") * weight
    if norm == "joint":  # every head of a token normalised together
        return rearrange(rms_norm(rearrange(o, "b h n e -> b n (h e)"), None, eps), "b n (h e) -> b h n e", h=H) * weight
    if norm == "tokens":  # over the tokens instead of the features
        return o * torch.rsqrt(o.pow(2).mean(-2, keepdim=True) + eps) * weight
    return o  # "none"


_FORWARD_HINTS = {
    "forgot the scale: the scores are divided by sqrt(d), d the q/k head dim (layer.head_dim)": {"scale": 1.0},
    "scaled by the full head dim (2d) instead of d: the scale is 1/sqrt(layer.head_dim) (v is 2d wide, "
    "q and k are d)": {"scale": "2d"},
    "subtracted in the wrong order: map 1 (heads 2i) minus lambda times map 2 (heads 2i + 1)": {"swap": True},
    "paired heads blocked (i with i + H) instead of interleaved (2i, 2i + 1)": {"blocked": True},
    "no causal mask: each token may attend only itself and the past": {"mask": "none"},
    "the causal mask diagonal is wrong: a strict mask (j < i) with a large negative fill lets the first token see "
    "everything; a token may attend itself and the past, j <= i": {"mask": "strict_fill"},
    "the causal mask diagonal is wrong: a strict mask (j < i) with a large negative number added lets the first "
    "token see everything; a token may attend itself and the past, j <= i": {"mask": "strict_add"},
    "the causal mask is inverted: it hides the past and shows the future; the keys to hide are the future "
    "ones": {"mask": "anti"},
    "missing (1 - lambda_init), or applied before the sub-norm, which normalises it away: the sub-normed heads "
    "are scaled by (1 - lambda_init)": {"factor": "none"},
    "multiplied by lambda_init: the factor after the sub-norm is (1 - lambda_init)": {"factor": "lambda_init"},
    "(1 - lambda) instead of (1 - lambda_init): the factor after the sub-norm is the fixed (1 - layer.lambda_init), "
    "not the learned lambda": {"factor": "lambda"},
    "lambda without lambda_init: lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init "
    "(exercise 04)": {"lam_base": "no_init"},
    "added lambda A2: the differential map is A1 - lambda A2, map 2 subtracted": {"sign": -1.0},
    "lambda is lambda_init alone: the learned part, exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2), is "
    "missing (build it from the layer's four lambda vectors, exercise 04)": {"lam_base": "init_only"},
    "subtracted the wrong way round: the heads are A1 V - lambda A2 V, not lambda A2 V - A1 V": {"negate": True},
    "multiplied by (1 + lambda_init): the factor after the sub-norm is (1 - lambda_init)": {"factor": "one_plus"},
    "lambda_init off by one layer: layer.depth is 0-based already (the layer holds its lambda_init)":
        {"depth_shift": 1},
    "lambda_init off by one layer: layer.depth is the 0-based index, the paper's l - 1 (the layer holds its "
    "lambda_init)": {"depth_shift": -1},
    "no sub-norm: each head is normalised by the layer's sub-norm (RMSNorm over its 2d features) before the "
    "(1 - lambda_init) factor": {"norm": "none"},
    "sub-norm over the wrong axis: it normalises each head over its 2d features, not over the tokens":
        {"norm": "tokens"},
    "sub-norm over each half (d) separately: a head's output (2d wide) is normalised as a whole": {"norm": "half"},
    "sub-norm over all heads together: it is per head (GroupNorm-style), on the heads before they are merged":
        {"norm": "joint"},
    "heads merged in the wrong order: a reshape of (B, H, N, 2d) to (B, N, H * 2d) mixes tokens unless the "
    "heads and tokens axes change places first": {"merge": "no_transpose"},
    "heads merged in the wrong order: each token's features are head 0's 2d features, then head 1's, and so on":
        {"merge": "feature_major"},
}
_FORWARD_HINTS.update({hint: {"gqa": kv} for kv, hint in _KV_HINTS.items()})


def _nan_hint(got: torch.Tensor) -> None:
    bad = torch.isnan(got).any(-1).any(0)  # (N,) tokens with NaN
    if not bool(bad.any()):
        return
    if bool(bad[0]) and not bool(bad[1:].any()):
        fail("forward returned NaN for the first token: the causal mask diagonal is wrong (strict, j < i), so the "
             "first query has no key left; a token may attend itself")
    if bool(bad[-1]) and not bool(bad[:-1].any()):
        fail("forward returned NaN for the last token: the causal mask is inverted (-inf on the past and the "
             "diagonal, as when a True = may-attend mask is used as the positions to fill); hide the future keys")
    fail("forward returned NaN values (a softmax over a row that is entirely -inf?)")


@exercise_check(task=3, name="forward", refuses=lambda: {
    MultiheadDiffAttn.forward: "the layer's own forward (layer(x) or layer.forward)",
    MultiheadDiffAttn.attention_heads: "the layer's attention_heads",
    **library_diff_attention(),
    diff_attention: "the library's diff_attention (the task asks for the maps written out)"})
def check_forward(fn: Callable) -> None:
    """``fn(x, layer)``: x ``(B, N, C)``, ``layer`` a :class:`MultiheadDiffAttn` -> ``(B, N, C)``, equal to
    ``layer(x, causal=True)`` (causal self-attention, GQA when ``layer.num_kv_heads < layer.num_heads``)."""
    what = "forward"
    for i, (C, H, Hkv, depth, B, N) in enumerate(_LAYERS):
        layer = _make_layer(i, C, H, Hkv, depth)
        x = randn(B, N, C, seed=670 + i)
        with torch.no_grad():
            expected = layer(x, causal=True)
            got = call(fn, x, copy.deepcopy(layer), what=f"{what} (H={H}, Hkv={Hkv}, depth={depth})")
            if isinstance(got, torch.Tensor) and got.shape == expected.shape:
                _nan_hint(got)
            wrong = {hint: _variant(layer, x, **knobs) for hint, knobs in _FORWARD_HINTS.items()}
            expect(got, expected, what=f"{what} (H={H}, Hkv={Hkv}, depth={depth})", wrong=wrong,
                   default_hint="Compare your steps with the layer's: projections, heads (2H for q and k, H for v), "
                                "GQA, lambda, dual softmax, sub-norm, (1 - lambda_init), merge, out_proj.")
    _check_forward_grads(fn)
    passed("your forward equals MultiheadDiffAttn(x, causal=True) with GQA, gradients to x and every parameter "
           "(lambda's four vectors included) too.")


def _check_forward_grads(fn: Callable) -> None:
    what = "forward"
    C, H, Hkv, depth, B, N = _LAYERS[1]
    layer = _make_layer(1, C, H, Hkv, depth)
    la, lb = copy.deepcopy(layer), copy.deepcopy(layer)
    xa = randn(B, N, C, seed=690).requires_grad_(True)
    xb = xa.detach().clone().requires_grad_(True)
    out_b = lb(xb, causal=True)
    g = randn(*out_b.shape, seed=691)
    out_a = call(fn, xa, la, what=what)
    if not isinstance(out_a, torch.Tensor) or not out_a.requires_grad:
        fail(f"{what}: the output does not depend differentiably on x and the weights (a torch.no_grad() or "
             f".detach() somewhere?)")
    (out_a * g).sum().backward()
    (out_b * g).sum().backward()
    params_a = dict(la.named_parameters())
    dead = [n for n, p in params_a.items() if p.grad is None or not bool(p.grad.any())]
    if dead and len(dead) == len(params_a):
        fail(f"{what}: none of the layer's parameters gets a gradient: use the layer's own modules and "
             f"parameters, not copies, .data or .detach()")
    for name, pb in [("x", xb)] + list(lb.named_parameters()):
        pa = xa if name == "x" else params_a[name]
        if pb.grad is None:
            continue
        if pa.grad is None or (not bool(pa.grad.any()) and bool(pb.grad.any())):
            extra = (" lambda must be built from the layer's four lambda vectors with torch operations (a Python "
                     "float is a constant copy)" if name.startswith("lambda") else
                     " use the layer's own parameters (not a copy, .data or .detach())")
            fail(f"{what}: {name} gets no gradient.{extra}")
        if not close(pa.grad, pb.grad, rtol=1e-4, atol=1e-6):
            fail(f"{what}: the gradient with respect to {name} is wrong although the forward matches "
                 f"(a .detach() or an in-place edit somewhere?)")
