"""FLOP and byte accounting for attention layers: the one home of the formulas notebooks 08, 09 and 13 and the
tiny LM's ``attention_costs`` use.

Conventions (those of the FlashAttention papers): a product ``(m, k) @ (k, n)`` costs ``2 m k n`` FLOPs; softmax,
scaling, masking and the ``o1 - lam * o2`` combination are not counted (``O(N^2)`` or ``O(N d)``). One attention
call with ``Hq`` query heads, q/k dim ``dk`` and value width ``dv`` costs ``2 B Hq Nq Nk (dk + dv)`` forward; causal
keeps the visible fraction of (query, key) pairs (half for ``Nq == Nk``); the backward is
:data:`BACKWARD_FACTOR` times the forward. With ``H`` differential heads of q/k dim ``d`` (forward, ``Nq = Nk = N``):

* DIFF V1 (k ``2Hkv x d``, v ``Hkv x 2d``): ``12 B H N^2 d``, 1.5x its same-width baseline (``2H`` heads of dim
  ``d``: ``8 B H N^2 d``), as any kernel that never stores a map must do (:func:`formulation_flops` per backend);
* DIFF V2 (``2H`` query heads, k and v ``Hkv x d``): ``8 B H N^2 d``, 2x its baseline (``H`` heads), but its KV
  cache is the baseline's, read once per decoded token, and decoding is bound by those bytes.

>>> diff_v1_attention_flops(1, 8, 1024, 64) / baseline_attention_flops(1, 16, 1024, 64)
1.5
>>> kv_cache_bytes_per_token("diff_v1", kv_heads=8, d=64) == kv_cache_bytes_per_token("baseline", kv_heads=16, d=64)
True
"""

from __future__ import annotations

from typing import Literal, Optional

Pass = Literal["fwd", "bwd", "fwd_bwd"]
"""Which pass to count: forward, backward, or both."""

LayerKind = Literal["baseline", "diff_v1", "diff_v2"]

BACKWARD_FACTOR: float = 2.5
"""Backward FLOPs of attention as a multiple of its forward FLOPs (FlashAttention convention)."""

# How many FLOPs each diff_attention backend really performs, in units of one q.k map of dim d
# (2 B H Nq Nk d FLOPs). A "P v" product of width 2d counts 2 units, one of width d counts 1.
_FORMULATION_UNITS: dict[str, int] = {
    "naive": 4,  # two q.k maps (2) + ONE P v of width 2d on the combined map A1 - lam A2 (2)
    "chunked": 4,  # the same arithmetic, query block by query block
    "sdpa_wide": 6,  # two calls: (q.k + P v of width 2d) x 2
    "triton": 6,  # a fused kernel: two q.k maps + two running P v accumulators of width 2d
    "sdpa_split": 8,  # four calls: (q.k + P v of width d) x 4, every q.k computed twice
    "sdpa_stacked": 8,  # one call over 4H stacked heads: the same work as sdpa_split
    "sdpa_padded": 8,  # two calls with q, k zero-padded to 2d: (q.k of width 2d + P v of width 2d) x 2
}
FORMULATIONS: tuple[str, ...] = tuple(_FORMULATION_UNITS)
"""Backend names :func:`formulation_flops` knows (``diff_attention``'s concrete backends)."""

_DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}


def dtype_bytes(dtype: object) -> int:
    """Bytes per element of a dtype given as ``torch.bfloat16``, ``"bfloat16"`` or an int (returned as is)."""
    if isinstance(dtype, int) and not isinstance(dtype, bool):
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name.startswith("float8"):
        name = "float8"
    if name not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; give bytes per element as an int or one of {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[name]


def pass_factor(pass_: Pass = "fwd") -> float:
    """FLOPs of ``pass_`` as a multiple of the forward: 1, ``BACKWARD_FACTOR`` or ``1 + BACKWARD_FACTOR``."""
    factors = {"fwd": 1.0, "bwd": BACKWARD_FACTOR, "fwd_bwd": 1.0 + BACKWARD_FACTOR}
    if pass_ not in factors:
        raise ValueError(f"pass_ must be one of {sorted(factors)}, got {pass_!r}")
    return factors[pass_]


def visible_fraction(nq: int, nk: int, causal: bool) -> float:
    """The fraction of (query, key) pairs attention works on: 1, or for causal attention 1/2 when
    ``nq == nk`` (the usual convention) and the exact bottom-right visible fraction otherwise."""
    if nq <= 0 or nk <= 0:
        raise ValueError(f"sequence lengths must be positive, got nq={nq}, nk={nk}")
    if not causal:
        return 1.0
    if nq == nk:
        return 0.5
    # query i (0-based) sees keys j <= i + nk - nq, i.e. min(nk, max(0, i + nk - nq + 1)) keys
    offset = nk - nq + 1
    visible = sum(min(nk, max(0, i + offset)) for i in range(nq))
    return visible / (nq * nk)


def attention_call_flops(b: int, q_heads: int, nq: int, nk: int, qk_dim: int, v_dim: int, *,
                         causal: bool = False, pass_: Pass = "fwd") -> float:
    """FLOPs of one softmax-attention call: ``2 * b * q_heads * nq * nk * (qk_dim + v_dim)`` forward.

    ``q_heads`` counts query heads (with GQA the key/value heads do not change the FLOPs).
    """
    dense = 2.0 * b * q_heads * nq * nk * (qk_dim + v_dim)
    return dense * visible_fraction(nq, nk, causal) * pass_factor(pass_)


def baseline_attention_flops(b: int, heads: int, n: int, head_dim: int, *, nk: Optional[int] = None,
                             causal: bool = False, pass_: Pass = "fwd") -> float:
    """A standard attention layer with ``heads`` query heads of dim ``head_dim``: ``4 B heads N^2 head_dim``.

    Same width as DIFF V1 with ``H`` heads of q/k dim ``d``: ``heads=2H, head_dim=d``. Same width as
    DIFF V2: ``heads=H, head_dim=d``. ``nk`` defaults to ``n`` (self-attention).
    """
    return attention_call_flops(b, heads, n, n if nk is None else nk, head_dim, head_dim, causal=causal, pass_=pass_)


def diff_v1_attention_flops(b: int, heads: int, n: int, d: int, *, nk: Optional[int] = None,
                            causal: bool = False, pass_: Pass = "fwd") -> float:
    """DIFF V1 with ``heads`` (H) differential heads of q/k dim ``d`` and value width ``2d``: ``12 B H N^2 d``.

    Two ``q.k`` maps of dim ``d`` and two ``P v`` products of width ``2d`` per head: what any kernel that
    never stores a map does (``sdpa_wide``, a fused flash kernel with one accumulator per map). Explicit maps
    can combine ``A1 - lam A2`` first and multiply V once (``8 B H N^2 d``, but ``O(N^2)`` memory); the
    equal-dim SDPA formulations compute each map twice (``16 B H N^2 d``). See :func:`formulation_flops`.
    """
    return formulation_flops("sdpa_wide", b, heads, n, d, nk=nk, causal=causal, pass_=pass_)


def diff_v2_attention_flops(b: int, heads: int, n: int, d: int, *, nk: Optional[int] = None,
                            causal: bool = False, pass_: Pass = "fwd") -> float:
    """DIFF V2 with ``heads`` (H) output heads of dim ``d``: one call over ``2H`` query heads, ``8 B H N^2 d``.

    (The ``o1 - lam * o2`` combination is ``O(N d)`` and not counted.)
    """
    return attention_call_flops(b, 2 * heads, n, n if nk is None else nk, d, d, causal=causal, pass_=pass_)


def formulation_flops(name: str, b: int, heads: int, n: int, d: int, *, nk: Optional[int] = None,
                      causal: bool = False, pass_: Pass = "fwd") -> float:
    """FLOPs a ``diff_attention`` backend actually performs for H = ``heads`` differential heads.

    ``naive``/``chunked``: ``8 B H N^2 d`` (the explicit maps are combined, ``(A1 - lam A2) V``: one ``P v``
    product of width ``2d``; the price is the ``O(N^2)`` maps in memory). ``sdpa_wide``/``triton``:
    ``12 B H N^2 d`` (two ``P v`` products, one per map: softmax normalisation is per map, so a kernel that
    never stores a map keeps one accumulator per map). ``sdpa_split``/``sdpa_stacked``: ``16 B H N^2 d``,
    every ``q.k`` map computed twice, once per V half: the price of the equal head dims flash kernels need.

    These are the FLOPs of the arithmetic; the math kernel and explicit maps do the full square work even
    when causal (the count here halves it, as a flash kernel that skips masked tiles does).
    """
    if name not in _FORMULATION_UNITS:
        raise ValueError(f"unknown formulation {name!r}; choose one of {FORMULATIONS}")
    nk = n if nk is None else nk
    one_map = 2.0 * b * heads * n * nk * d
    return _FORMULATION_UNITS[name] * one_map * visible_fraction(n, nk, causal) * pass_factor(pass_)


def kv_cache_bytes_per_token(kind: LayerKind, kv_heads: int, d: int, *, layers: int = 1,
                             dtype: object = 2) -> int:
    """Bytes the KV cache grows by per token (``dtype``: bytes per element or a dtype; default 2, bf16).

    ``baseline``: K and V of ``kv_heads`` heads of dim ``d`` each. ``diff_v1``: ``kv_heads`` (Hkv) KV
    groups, K with ``2 Hkv`` heads of dim ``d`` and V with ``Hkv`` heads of width ``2d``, as many bytes as
    a baseline with ``2 Hkv`` KV heads of dim ``d`` (the same model width). ``diff_v2``: K and V of
    ``Hkv`` heads of dim ``d``, exactly the baseline's.
    """
    per_layer = {"baseline": 2 * kv_heads * d, "diff_v1": 2 * kv_heads * d + kv_heads * 2 * d,
                 "diff_v2": 2 * kv_heads * d}
    if kind not in per_layer:
        raise ValueError(f"kind must be one of {sorted(per_layer)}, got {kind!r}")
    return per_layer[kind] * layers * dtype_bytes(dtype)


def decode_kv_bytes_read(name: str, kv_heads: int, d: int, nk: int, *, b: int = 1, dtype: object = 2) -> int:
    """KV-cache bytes one decoding step reads (one new query per sequence, ``nk`` cached tokens, one layer).

    Decoding is bound by these bytes, not by FLOPs. ``name``: ``baseline`` (``kv_heads`` heads of dim
    ``d``), ``diff_v2`` (one call: the cache read once, like the baseline), or a DIFF V1 formulation:
    ``naive``/``chunked``/``triton`` read the V1 cache once, ``sdpa_wide`` reads V twice (each call reads
    its ``k_i`` and all of V), ``sdpa_split``/``sdpa_stacked`` read every K and V half twice.
    """
    once_v1 = kv_cache_bytes_per_token("diff_v1", kv_heads, d, dtype=1)  # 4 Hkv d elements
    k_elems = 2 * kv_heads * d  # k1 and k2
    v_elems = kv_heads * 2 * d  # both halves of V
    elems = {
        "baseline": kv_cache_bytes_per_token("baseline", kv_heads, d, dtype=1),
        "diff_v2": kv_cache_bytes_per_token("diff_v2", kv_heads, d, dtype=1),
        "naive": once_v1, "chunked": once_v1, "triton": once_v1,
        "sdpa_wide": k_elems + 2 * v_elems,
        "sdpa_split": 2 * (k_elems + v_elems), "sdpa_stacked": 2 * (k_elems + v_elems),
    }
    if name not in elems:
        raise ValueError(f"unknown name {name!r}; choose one of {sorted(elems)}")
    return elems[name] * nk * b * dtype_bytes(dtype)


def attention_map_bytes(b: int, heads: int, nq: int, nk: int, *, dtype: object = 4) -> int:
    """Bytes of ``heads`` explicit ``(nq, nk)`` attention maps: what non-fused attention materialises
    (fused/flash kernels keep only ``O(nq)`` row statistics per head instead)."""
    return b * heads * nq * nk * dtype_bytes(dtype)


__all__ = [
    "BACKWARD_FACTOR", "FORMULATIONS", "Pass", "LayerKind", "dtype_bytes", "pass_factor", "visible_fraction",
    "attention_call_flops", "baseline_attention_flops", "diff_v1_attention_flops", "diff_v2_attention_flops",
    "formulation_flops", "kv_cache_bytes_per_token", "decode_kv_bytes_read", "attention_map_bytes",
]
