"""Checks for ``exercises/10_diff_v2.ipynb``: DIFF V2's attention (one softmax-attention call over 2H query
heads, then heads ``2i`` minus ``sigmoid(lambda)`` times heads ``2i+1``, per token), the GQA group of each
query head of a pair, and the whole ``DiffAttnV2`` forward. References: ``functional.diff_attention_v2``,
``functional.softmax_attention`` (its GQA assignment of query heads to KV heads) and ``layers.attention.DiffAttnV2``.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
from einops import rearrange

from diffattn_tutorial.checks._core import call, close, exercise_check, expect, expect_grads, fail, passed, randn
from diffattn_tutorial.checks._helpers import seeded
from diffattn_tutorial.functional import diff_attention_v2, rms_norm, softmax_attention
from diffattn_tutorial.layers.attention import DiffAttnV2

__all__ = ["check_diff_v2", "check_pair_groups", "check_forward_v2"]

Tensor = torch.Tensor


def _lam(logits: Tensor) -> Tensor:
    """``(B, N, H)`` lambda logits -> the per-token, per-head ``sigmoid`` as ``(B, H, N, 1)``."""
    return rearrange(torch.sigmoid(logits), "b n h -> b h n 1")


# (B, H, Hkv, Nq, Nk, d, causal): MHA and GQA, causal with a KV cache (Nq < Nk), batch > 1
_V2_CASES = [(2, 2, 2, 5, 5, 4, False), (1, 4, 2, 6, 6, 8, True), (2, 3, 1, 3, 7, 4, True), (1, 4, 4, 4, 9, 4, False)]


def _v2_implementations() -> dict:
    return {diff_attention_v2: "the library's diff_attention_v2", DiffAttnV2.forward: "a DiffAttnV2 layer"}


@exercise_check(task=1, name="diff_v2", refuses=_v2_implementations)
def check_diff_v2(fn: Callable) -> None:
    """``fn(q, k, v, lam_logits, *, causal=False)``: q ``(B, 2H, Nq, d)``, k and v ``(B, Hkv, Nk, d)``, lam_logits
    ``(B, Nq, H)`` (the output of ``lambda_proj``, before the sigmoid) -> ``(B, H, Nq, d)``."""
    what = "diff_v2"
    for i, (B, H, Hkv, nq, nk, d, causal) in enumerate(_V2_CASES):
        q, k = randn(B, 2 * H, nq, d, seed=1000 + i) * 1.5, randn(B, Hkv, nk, d, seed=1010 + i) * 1.5
        v, logits = randn(B, Hkv, nk, d, seed=1020 + i), randn(B, nq, H, seed=1030 + i) * 2
        lam = _lam(logits)
        label = f"{what} (H={H}, Hkv={Hkv}, Nq={nq}, Nk={nk}{', causal' if causal else ''})"
        expected = diff_attention_v2(q, k, v, lam, causal=causal, backend="naive")
        got = call(fn, q, k, v, logits, causal=causal, what=label)
        if isinstance(got, Tensor) and got.shape == (B, 2 * H, nq, d):
            fail(f"{label} returned 2H = {2 * H} heads: each pair of query heads (2i, 2i+1) becomes one output "
                 f"head, the first minus lambda times the second")
        if isinstance(got, Tensor) and got.shape == (B, H, nq, 2 * d):
            fail(f"{label} returned width 2d: DIFF V2's values have width d, like a baseline's (only the query "
                 f"heads double)")

        def lib(lam_=lam, q_=q, causal_=causal, **kw):
            return diff_attention_v2(q_, k, v, lam_, causal=causal_, backend="naive", **kw)

        def candidates() -> dict:
            out = softmax_attention(q, k, v, causal=causal, backend="naive")
            blocked = rearrange(q, "b (two h) n d -> b (h two) n d", two=2)
            wrong = {
                "lambda is used without its sigmoid: lambda_proj gives logits, and DIFF V2's lambda is their "
                "sigmoid, between 0 and 1": lib(lam_=rearrange(logits, "b n h -> b h n 1")),
                "lambda's axes are mixed up: the logits are (B, N, H), one per token and head; as a factor for the "
                "(B, H, N, d) heads they must move to (B, H, N, 1), not be reshaped in place":
                    lib(lam_=torch.sigmoid(logits).reshape(B, H, nq, 1)),
                "one lambda per head instead of per token: DIFF V2's lambda is computed from each token":
                    lib(lam_=lam.mean(2, keepdim=True)),
                "lambda is ignored: the second head of each pair is scaled by lambda before it is subtracted":
                    lib(lam_=torch.ones_like(lam)),
                "the sign is flipped: the second head of each pair is subtracted": lib(lam_=-lam),
                "subtracted in the wrong order: head 2i minus lambda times head 2i+1":
                    out[:, 1::2] - lam * out[:, 0::2],
                "paired the heads blocked (i with i + H): the pairs are adjacent query heads, 2i and 2i+1":
                    lib(q_=blocked),
                "paired query head i with head i + H (the first half of the heads minus the second half): a pair "
                "is two adjacent query heads, 2i and 2i+1, inside one GQA group; a blocked pair reads two different "
                "KV groups, so what its maps share does not cancel (notebook 10, section 3)":
                    out[:, :H] - lam * out[:, H:],
                "a V1 sub-norm is applied: DIFF V2 has no per-head normalisation (it destabilised late "
                "pre-training)": rms_norm(lib(), None, 1e-5),
                "the two heads are combined before attention: DIFF V2 runs one ordinary attention over all 2H query "
                "heads, then combines the outputs of each pair": softmax_attention(
                    q[:, 0::2] - lam * q[:, 1::2], k, v, causal=causal, backend="naive") if H % Hkv == 0 else None,
            }
            if causal:
                wrong["the causal mask is missing: every query head attends only to itself and the past"] = \
                    lib(causal_=False)
                if nq != nk:
                    top_left = torch.ones(nq, nk, dtype=torch.bool).tril()
                    wrong["the causal mask is aligned top-left: with a KV cache (Nq < Nk) the queries are the last Nq "
                          "positions, so query i sees keys up to i + Nk - Nq"] = \
                        lib(causal_=False, attn_mask=top_left)
            if Hkv != 1 and Hkv != H:
                tiled_k, tiled_v = k.repeat(1, 2 * H // Hkv, 1, 1), v.repeat(1, 2 * H // Hkv, 1, 1)
                o = softmax_attention(q, tiled_k, tiled_v, causal=causal, backend="naive")
                wrong["GQA grouping wrong: the KV heads are tiled (the whole list repeated), so query head j reads KV "
                      "head j % Hkv; consecutive query heads share a KV head, so a pair always shares one"] = \
                    o[:, 0::2] - lam * o[:, 1::2]
            return {h: w for h, w in wrong.items() if w is not None}

        expect(got, expected, what=label, wrong=candidates(),
               default_hint="One attention call over the 2H query heads (GQA as usual), then each pair: head 2i "
                            "minus sigmoid(lambda) times head 2i+1.")
    B, H, Hkv, nq, nk, d, causal = _V2_CASES[1]
    expect_grads(lambda q, k, v, lg: fn(q, k, v, lg, causal=True),
                 lambda q, k, v, lg: diff_attention_v2(q, k, v, _lam(lg), causal=True, backend="naive"),
                 {"q": randn(B, 2 * H, nq, d, seed=1040), "k": randn(B, Hkv, nk, d, seed=1041),
                  "v": randn(B, Hkv, nk, d, seed=1042), "lam_logits": randn(B, nq, H, seed=1043)}, what=what,
                 missing_hints={"lam_logits": "lambda must be computed from the logits with torch operations, so "
                                              "that lambda_proj learns."})
    passed("one attention call over 2H query heads, then head 2i - sigmoid(lambda) * head 2i+1 per token, "
           "gradients included.")


# --------------------------------------------------------------------------------------------
# TASK 2: which KV group each query head of a pair reads
# --------------------------------------------------------------------------------------------

_GROUP_CASES = [(4, 2), (2, 2), (6, 3), (5, 1), (3, 2), (6, 4), (4, 4), (8, 2)]


def _library_groups(num_heads: int, num_kv_heads: int) -> Tensor:
    """The KV group of each of the 2H query heads, read off the library's GQA: with uniform attention and the
    values of KV group g all equal to g, query head j outputs the number of the group it reads."""
    q = torch.zeros(1, 2 * num_heads, 1, 1, dtype=torch.float64)
    k = torch.zeros(1, num_kv_heads, 1, 1, dtype=torch.float64)
    v = torch.arange(num_kv_heads, dtype=torch.float64).view(1, num_kv_heads, 1, 1)
    out = softmax_attention(q, k, v, backend="naive")
    return out.flatten().round().long().view(num_heads, 2)


@exercise_check(task=2, name="pair_groups")
def check_pair_groups(fn: Callable) -> None:
    """``fn(num_heads, num_kv_heads)`` -> a long tensor ``(H, 2)``: row i holds the KV groups of query heads 2i and
    2i+1 under the standard GQA assignment (2H query heads over Hkv groups, consecutive query heads together)."""
    what = "pair_groups"
    for H, Hkv in _GROUP_CASES:
        label = f"{what}({H}, {Hkv})"
        got = call(fn, H, Hkv, what=label)
        expected = _library_groups(H, Hkv)
        if isinstance(got, Tensor) and got.shape == (2 * H,):
            fail(f"{label} returned one group per query head, shape ({2 * H},): return one row per pair, (H, 2)")
        if isinstance(got, Tensor) and got.is_floating_point():
            if close(got, expected.double()):
                fail(f"{label} returned floats: group numbers are whole numbers (integer division), a long tensor")
        rep = 2 * H // Hkv
        j = torch.arange(2 * H)
        wrong = {
            "the query heads are tiled over the groups (query head j reads group j % Hkv): GQA gives consecutive "
            "query heads to one group, 2H / Hkv of them per group": (j % Hkv).view(H, 2),
            "you grouped the H output heads (head i -> group i // (H / Hkv)) and gave both query heads the group of "
            "their pair: the GQA split is over the 2H query heads, 2H / Hkv per group, and a pair can straddle "
            "two groups when H is no multiple of Hkv": (torch.arange(H) // max(1, H // Hkv)).repeat_interleave(2).view(H, 2),
            "the pairs are shifted by one: differential head i uses query heads 2i and 2i+1":
                (((j + 1) % (2 * H)) // rep).view(H, 2),
            "the pairs are blocked (head i with head i + H): DIFF V2 pairs adjacent query heads 2i and 2i+1":
                (rearrange(j // rep, "(two h) -> h two", two=2)),
        }
        if isinstance(got, Tensor) and not got.is_floating_point() and got.dtype != torch.bool:
            got = got.to(torch.float64)
        expect(got, expected.to(torch.float64), what=label,
               wrong={h: w.to(torch.float64) for h, w in wrong.items()},
               default_hint="GQA splits the 2H query heads into Hkv runs of consecutive heads, 2H / Hkv per run, "
                            "one run per KV group; pair i is query heads 2i and 2i+1.")
    passed("query head j reads group j // (2H / Hkv): a pair (2i, 2i+1) shares a group exactly when H is a multiple "
           "of Hkv.")


# --------------------------------------------------------------------------------------------
# TASK 3: the whole DiffAttnV2 forward
# --------------------------------------------------------------------------------------------

_LAYERS = [(32, 2, 2, 2, 5), (48, 4, 2, 1, 7), (32, 4, 1, 2, 6)]  # d_model, H, Hkv, B, N


def _layer(i: int, C: int, H: int, Hkv: int) -> DiffAttnV2:
    with seeded(1100 + i):
        layer = DiffAttnV2(C, H, num_kv_heads=Hkv, dtype=torch.float64)
        with torch.no_grad():
            layer.lambda_proj.weight.mul_(4.0)  # lambdas spread over (0, 1), so a missing sigmoid shows
    return layer


def _variant(layer: DiffAttnV2, x: Tensor, *, sigmoid=True, subln=False, causal=True, merge="right",
             out_proj=True, pairs="interleaved") -> Tensor:
    B, N, _ = x.shape
    H, Hkv = layer.num_heads, layer.num_kv_heads
    q = rearrange(layer.q_proj(x), "b n (h d) -> b h n d", h=2 * H)
    k = rearrange(layer.k_proj(x), "b n (h d) -> b h n d", h=Hkv)
    v = rearrange(layer.v_proj(x), "b n (h d) -> b h n d", h=Hkv)
    if pairs == "blocked":
        q = rearrange(q, "b (two h) n d -> b (h two) n d", two=2)
    raw = layer.lambda_proj(x)
    lam = rearrange(torch.sigmoid(raw) if sigmoid else raw, "b n h -> b h n 1")
    o = diff_attention_v2(q, k, v, lam, causal=causal, backend="naive")
    if subln:
        o = rms_norm(o, None, 1e-5)
    o = rearrange(o, "b h n d -> b n (h d)") if merge == "right" else o.reshape(B, N, -1)
    return layer.o_proj(o) if out_proj else o


_FORWARD_HINTS = {
    "lambda is used without its sigmoid: lambda_proj gives logits; DIFF V2's lambda is their sigmoid":
        {"sigmoid": False},
    "a V1 sub-norm is applied: DIFF V2 normalises nothing per head": {"subln": True},
    "no causal mask: each token may attend only itself and the past": {"causal": False},
    "heads merged in the wrong order: a reshape of (B, H, N, d) to (B, N, H * d) mixes tokens unless the heads and "
    "tokens axes change places first": {"merge": "no_transpose"},
    "the output projection is missing: the merged heads go through the layer's o_proj": {"out_proj": False},
    "paired the query heads blocked (i with i + H): the pairs are adjacent query heads, 2i and 2i+1":
        {"pairs": "blocked"},
}


@exercise_check(task=3, name="forward_v2", refuses=lambda: {DiffAttnV2.forward: "the layer's own forward "
                                                            "(layer(x) or layer.forward)"})
def check_forward_v2(fn: Callable) -> None:
    """``fn(x, layer)``: x ``(B, N, C)``, ``layer`` a :class:`DiffAttnV2` -> ``(B, N, C)``, equal to
    ``layer(x, causal=True)``."""
    what = "forward_v2"
    for i, (C, H, Hkv, B, N) in enumerate(_LAYERS):
        layer = _layer(i, C, H, Hkv)
        x = randn(B, N, C, seed=1110 + i)
        label = f"{what} (H={H}, Hkv={Hkv})"
        with torch.no_grad():
            expected = layer(x, causal=True)
            got = call(fn, x, copy.deepcopy(layer), what=label)
            wrong = {hint: _variant(layer, x, **knobs) for hint, knobs in _FORWARD_HINTS.items()}
        expect(got, expected, what=label, wrong=wrong,
               default_hint="Compare your steps with the layer's: q to 2H heads, k and v to Hkv heads, lambda per "
                            "token from lambda_proj, one causal attention call, pairs combined, heads merged, o_proj.")
    C, H, Hkv, B, N = _LAYERS[1]
    layer = _layer(1, C, H, Hkv)
    expect_grads(lambda x: fn(x, layer), lambda x: layer(x, causal=True), {"x": randn(B, N, C, seed=1120)},
                 what=what)
    passed("your forward equals DiffAttnV2(x, causal=True): 2H query heads, one attention call, per-token lambda, "
           "no sub-norm.")
