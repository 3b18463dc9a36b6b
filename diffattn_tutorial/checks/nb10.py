"""Checks for ``exercises/10_diff_v2.ipynb``: DIFF V2's attention written without the library's attention (GQA and
the causal mask by hand), the GQA group of each query head of a pair under two ways of repeating the KV heads, and
a DIFF V2 layer's weights used for cross-attention. References: ``functional.diff_attention_v2``,
``functional.softmax_attention`` (its GQA assignment of query heads to KV heads) and ``layers.attention.DiffAttnV2``.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
from typing import Callable

import torch
import torch.nn.functional as F
from einops import rearrange

from diffattn_tutorial.checks._core import (
    CheckFailed,
    call,
    close,
    exercise_check,
    expect,
    expect_grads,
    fail,
    passed,
    randn,
)
from diffattn_tutorial.checks._helpers import seeded
from diffattn_tutorial.functional import diff_attention_v2, rms_norm, softmax_attention
from diffattn_tutorial.layers.attention import DiffAttnV2

__all__ = ["check_diff_v2", "check_pair_groups", "check_forward_v2"]

Tensor = torch.Tensor


def _lam(logits: Tensor) -> Tensor:
    """``(B, N, H)`` lambda logits -> the per-token, per-head ``sigmoid`` as ``(B, H, N, 1)``."""
    return rearrange(torch.sigmoid(logits), "b n h -> b h n 1")


def _by_hand(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, hidden: Tensor) -> Tensor:
    """DIFF V2 with the standard GQA and ``hidden`` (Nq, Nk) masked to -inf before the softmax: a row with every key
    hidden gives NaN, as a learner's answer with that mask does."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(hidden, float("-inf"))
    o = torch.softmax(s, dim=-1) @ v
    return o[:, 0::2] - lam * o[:, 1::2]


# (B, H, Hkv, Nq, Nk, d, causal): MHA and GQA, causal with a KV cache (Nq < Nk), batch > 1
_V2_CASES = [(2, 2, 2, 5, 5, 4, False), (1, 4, 2, 6, 6, 8, True), (2, 3, 1, 3, 7, 4, True), (1, 4, 4, 4, 9, 4, False)]


def _v2_implementations() -> dict:
    return {diff_attention_v2: "the library's diff_attention_v2", DiffAttnV2.forward: "a DiffAttnV2 layer",
            softmax_attention: "the library's softmax_attention",
            F.scaled_dot_product_attention: "PyTorch's scaled_dot_product_attention"}


@exercise_check(task=1, name="diff_v2", refuses=_v2_implementations)
def check_diff_v2(fn: Callable) -> None:
    """``fn(q, k, v, lam_logits, *, causal=False)``: q ``(B, 2H, Nq, d)``, k and v ``(B, Hkv, Nk, d)``, lam_logits
    ``(B, Nq, H)`` (the output of ``lambda_proj``, before the sigmoid) -> ``(B, H, Nq, d)``, written from tensor
    operations (the library's and PyTorch's attention are refused)."""
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
                "forgot the scale: the scores q . k are divided by sqrt(d), d the head dim": lib(scale=1.0),
                "lambda scales the first head of the pair: it is head 2i minus lambda times head 2i+1":
                    lam * out[:, 0::2] - out[:, 1::2],
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
                wrong["the causal mask hides the query's own position: a token may attend to itself (and the "
                      "past)"] = _by_hand(q, k, v, lam, torch.ones(nq, nk, dtype=torch.bool).triu(nk - nq))
            if Hkv != 1:
                tiled_k, tiled_v = k.repeat(1, 2 * H // Hkv, 1, 1), v.repeat(1, 2 * H // Hkv, 1, 1)
                o = softmax_attention(q, tiled_k, tiled_v, causal=causal, backend="naive")
                wrong["GQA grouping wrong: the KV heads are tiled (the whole list repeated), so query head j reads KV "
                      "head j % Hkv; consecutive query heads share a KV head, so a pair always shares one"] = \
                    o[:, 0::2] - lam * o[:, 1::2]
            return {h: w for h, w in wrong.items() if w is not None}

        expect(got, expected, what=label, wrong=candidates(),
               default_hint="Check each step on its own: which KV head each query head reads, the mask's alignment, "
                            "the scale, and how each pair is combined with its lambda.")
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


def _tiled_groups(num_heads: int, num_kv_heads: int) -> Tensor:
    """The KV group of each query head when the KV heads are tiled (``k.repeat(1, 2H / Hkv, 1, 1)``), read off the
    library's attention on the tiled values (one KV head per query head)."""
    v = torch.arange(num_kv_heads, dtype=torch.float64).repeat(2 * num_heads // num_kv_heads)
    q = torch.zeros(1, 2 * num_heads, 1, 1, dtype=torch.float64)
    out = softmax_attention(q, torch.zeros_like(q), v.view(1, -1, 1, 1), backend="naive")
    return out.flatten().round().long().view(num_heads, 2)


@exercise_check(task=2, name="pair_groups")
def check_pair_groups(fn: Callable) -> None:
    """``fn(num_heads, num_kv_heads, tiled=False)`` -> a long tensor ``(H, 2)``: row i holds the KV groups read by
    query heads 2i and 2i+1 (2H query heads over Hkv KV heads), with the KV heads repeated the standard GQA way or,
    with ``tiled=True``, tiled."""
    what = "pair_groups"
    for tiled in (False, True):
        for H, Hkv in _GROUP_CASES:
            label = f"{what}({H}, {Hkv}{', tiled=True' if tiled else ''})"
            got = call(fn, H, Hkv, tiled=tiled, what=label)
            expected = _tiled_groups(H, Hkv) if tiled else _library_groups(H, Hkv)
            if isinstance(got, Tensor) and got.shape == (2 * H,):
                fail(f"{label} returned one group per query head, shape ({2 * H},): return one row per pair, (H, 2)")
            if isinstance(got, Tensor) and got.is_floating_point():
                if close(got, expected.double()):
                    fail(f"{label} returned floats: group numbers are whole numbers (integer division), a long tensor")
            rep = 2 * H // Hkv
            j = torch.arange(2 * H)
            if tiled:
                wrong = {
                    "with tiled=True this is the standard assignment (consecutive query heads per group): tiling "
                    "repeats the whole list of KV heads, so query head j reads KV head j % Hkv":
                        (j // rep).view(H, 2),
                    "tiled over the wrong count: the list of Hkv KV heads repeats 2H / Hkv times, so query head j "
                    "reads head j modulo Hkv (the number of KV heads), not modulo 2H / Hkv":
                        (j % rep).view(H, 2),
                    "the pairs are blocked (head i with head i + H): DIFF V2 pairs adjacent query heads 2i and 2i+1":
                        rearrange(j % Hkv, "(two h) -> h two", two=2),
                }
            else:
                wrong = {
                    "the query heads are tiled over the groups (query head j reads group j % Hkv): GQA gives "
                    "consecutive query heads to one group, 2H / Hkv of them per group": (j % Hkv).view(H, 2),
                    "you grouped the H output heads (head i -> group i // (H / Hkv)) and gave both query heads the "
                    "group of their pair: the GQA split is over the 2H query heads, 2H / Hkv per group, and a pair "
                    "can straddle two groups when H is no multiple of Hkv":
                        (torch.arange(H) // max(1, H // Hkv)).repeat_interleave(2).view(H, 2),
                    "the pairs are shifted by one: differential head i uses query heads 2i and 2i+1":
                        (((j + 1) % (2 * H)) // rep).view(H, 2),
                    "the pairs are blocked (head i with head i + H): DIFF V2 pairs adjacent query heads 2i and 2i+1":
                        (rearrange(j // rep, "(two h) -> h two", two=2)),
                }
            if isinstance(got, Tensor) and not got.is_floating_point() and got.dtype != torch.bool:
                got = got.to(torch.float64)
            expect(got, expected.to(torch.float64), what=label,
                   wrong={h: w.to(torch.float64) for h, w in wrong.items()},
                   default_hint="Write out which KV head every query head reads for this repetition, then take "
                                "the rows of pairs (2i, 2i+1).")
    passed("the standard repetition keeps a pair in one group exactly when H is a multiple of Hkv; a tiled "
           "repetition splits every pair across two groups (whenever Hkv > 1).")


# --------------------------------------------------------------------------------------------
# TASK 3: a DiffAttnV2 layer's weights, used for cross-attention
# --------------------------------------------------------------------------------------------

_LAYERS = [(32, 2, 2, 2, 5, 5), (48, 4, 2, 1, 7, 4), (32, 4, 1, 2, 3, 6)]  # d_model, H, Hkv, B, Nq, Nk


def _layer(i: int, C: int, H: int, Hkv: int) -> DiffAttnV2:
    with seeded(1100 + i):
        layer = DiffAttnV2(C, H, num_kv_heads=Hkv, dtype=torch.float64)
        with torch.no_grad():
            layer.lambda_proj.weight.mul_(4.0)  # lambdas spread over (0, 1), so a missing sigmoid shows
    return layer


def _variant(layer: DiffAttnV2, x: Tensor, memory: Tensor, *, sigmoid="once", subln=False, causal=False,
             merge="right", out_proj=True, pairs="interleaved", kv_from="memory", lam_from="x") -> Tensor:
    """Cross-attention with the layer's weights, with one mistake at a time (the knobs): the reference when
    every knob is at its default."""
    B, N, _ = x.shape
    H, Hkv = layer.num_heads, layer.num_kv_heads
    src = memory if kv_from == "memory" else x
    q = rearrange(layer.q_proj(x), "b n (h d) -> b h n d", h=2 * H)
    k = rearrange(layer.k_proj(src), "b n (h d) -> b h n d", h=Hkv)
    v = rearrange(layer.v_proj(src), "b n (h d) -> b h n d", h=Hkv)
    if pairs == "blocked":
        q = rearrange(q, "b (two h) n d -> b (h two) n d", two=2)
    raw = layer.lambda_proj(x if lam_from == "x" else memory)
    lam = {"once": torch.sigmoid(raw), "none": raw, "twice": torch.sigmoid(torch.sigmoid(raw))}[sigmoid]
    o = diff_attention_v2(q, k, v, rearrange(lam, "b n h -> b h n 1"), causal=causal, backend="naive")
    if subln:
        o = rms_norm(o, None, 1e-5)
    o = {"right": lambda: rearrange(o, "b h n d -> b n (h d)"), "no_transpose": lambda: o.reshape(B, N, -1),
         "d_h": lambda: rearrange(o, "b h n d -> b n (d h)")}[merge]()
    return layer.o_proj(o) if out_proj else o


_FORWARD_HINTS = {
    "lambda is used without its sigmoid: lambda_proj gives logits; DIFF V2's lambda is their sigmoid":
        {"sigmoid": "none"},
    "the sigmoid is applied twice: diff_v2 takes the logits (lambda_proj's output) and applies the sigmoid itself; "
    "pass it the logits": {"sigmoid": "twice"},
    "a V1 sub-norm is applied: DIFF V2 normalises nothing per head": {"subln": True},
    "a causal mask: a query reads the whole memory (cross-attention has no order between the two sequences)":
        {"causal": True},
    "heads merged in the wrong order: a reshape of (B, H, Nq, d) to (B, Nq, H * d) mixes tokens unless the heads "
    "and tokens axes change places first": {"merge": "no_transpose"},
    "heads merged in the wrong order: o_proj expects the features of head 0, then head 1, ... ((h d)), not the "
    "heads interleaved feature by feature ((d h))": {"merge": "d_h"},
    "the output projection is missing: the merged heads go through the layer's o_proj": {"out_proj": False},
    "paired the query heads blocked (i with i + H): the pairs are adjacent query heads, 2i and 2i+1":
        {"pairs": "blocked"},
    "the keys and values come from x: in cross-attention they are the memory's projections (k_proj(memory), "
    "v_proj(memory))": {"kv_from": "x"},
}
_LAMBDA_FROM_MEMORY = ("lambda is computed from the memory: lambda belongs to each query token, so it is "
                       "lambda_proj(x), one per query and head")


def _task1_verdict(fn: Callable) -> str:
    """The hint of Task 1's check on the learner's own ``diff_v2`` (found where ``fn`` was defined), or "" when it
    passes or cannot be found: a Task 3 failure that comes from Task 1 must say so."""
    diff_v2 = getattr(inspect.unwrap(fn), "__globals__", {}).get("diff_v2")
    if not callable(diff_v2):
        return ""
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            check_diff_v2(diff_v2)
    except CheckFailed as e:
        return str(e)
    except Exception:  # noqa: BLE001 - not attempted, or anything else: Task 1 has its own check cell
        return ""
    return ""


@exercise_check(task=3, name="forward_v2", refuses=lambda: {DiffAttnV2.forward: "the layer's own forward "
                                                            "(layer(x) or layer.forward)"})
def check_forward_v2(fn: Callable) -> None:
    """``fn(x, memory, layer)``: queries x ``(B, Nq, C)``, memory ``(B, Nk, C)``, ``layer`` a :class:`DiffAttnV2`
    -> ``(B, Nq, C)``, DIFF V2 cross-attention with the layer's weights (no mask, no RoPE)."""
    what = "forward_v2"
    for i, (C, H, Hkv, B, nq, nk) in enumerate(_LAYERS):
        layer = _layer(i, C, H, Hkv)
        x, memory = randn(B, nq, C, seed=1110 + i), randn(B, nk, C, seed=1115 + i)
        label = f"{what} (H={H}, Hkv={Hkv}, Nq={nq}, Nk={nk})"
        with torch.no_grad():
            expected = _variant(layer, x, memory)
            got = call(fn, x, memory, copy.deepcopy(layer), what=label)
            wrong = {hint: _variant(layer, x, memory, **knobs) for hint, knobs in _FORWARD_HINTS.items()}
            if nq == nk:
                wrong[_LAMBDA_FROM_MEMORY] = _variant(layer, x, memory, lam_from="memory")
        try:
            expect(got, expected, what=label, wrong=wrong,
                   default_hint="Compare your steps with the layer's: q and lambda from x, k and v from the memory, "
                                "one attention call over the 2H query heads without a mask, pairs combined, heads "
                                "merged, o_proj.")
        except CheckFailed as e:
            task1 = _task1_verdict(fn)
            if task1:
                fail(f"{label} is not right, and your diff_v2 (Task 1), which it calls, fails Task 1's check: fix "
                     f"Task 1 first. Task 1's check says: {task1}")
            raise e
    C, H, Hkv, B, nq, nk = _LAYERS[1]
    layer = _layer(1, C, H, Hkv)
    memory = randn(B, nk, C, seed=1121)
    expect_grads(lambda x, m: fn(x, m, layer), lambda x, m: _variant(layer, x, m),
                 {"x": randn(B, nq, C, seed=1120), "memory": memory}, what=what)
    passed("queries and lambda from x, keys and values from the memory, one attention call over 2H query heads, "
           "no sub-norm: DIFF V2 cross-attention with the layer's weights.")
