"""Checks for exercises/08_gpu_sdpa.ipynb: the four-call SDPA formulation and its FLOP count.

Each check runs the learner's function on fresh random inputs and compares it with the library
(``functional.diff_attention`` with explicit maps, ``flops.formulation_flops``); on a mismatch it builds
the outputs of plausible wrong answers and names the one that matches.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from diffattn_tutorial.checks._core import call, exercise_check, expect, expect_grads, fail, passed, randn
from diffattn_tutorial.checks._helpers import blocked_as_interleaved, library_diff_attention, tiled_kv
from diffattn_tutorial.functional import diff_attention
from diffattn_tutorial.measure import flops

__all__ = ["check_sdpa_split", "check_sdpa_split_flops"]

Tensor = torch.Tensor

# (B, H, Hkv, Nq, Nk, d, causal, lambda kind): simple cases first, so the first failure names a basic mistake
_CASES = [
    (1, 2, 2, 5, 5, 4, False, "scalar"),
    (2, 3, 3, 7, 7, 8, False, "per_head"),
    (2, 4, 2, 6, 6, 8, False, "scalar"),  # GQA: two differential heads per KV group
    (2, 2, 2, 9, 9, 4, True, "scalar"),  # causal, Nq == Nk
    (1, 4, 1, 3, 10, 8, True, "per_token"),  # causal with a KV cache: Nq < Nk (bottom-right), GQA
    (1, 2, 2, 4, 11, 4, False, "scalar"),  # cross-length, not causal
    (4, 4, 2, 3, 5, 4, False, "per_head"),  # GQA with as many heads as batch elements
    (1, 4, 2, 2, 4, 4, True, "per_token"),  # decoding two tokens from a cache, GQA: Nq == Hkv, H == Nk
]


def _lam(kind: str, b: int, h: int, nq: int, seed: int) -> Tensor:
    if kind == "scalar":
        return torch.tensor(0.37, dtype=torch.float64)
    shape = (1, h, 1, 1) if kind == "per_head" else (b, h, nq, 1)
    lam = 0.2 + 0.5 * torch.rand(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    sign = torch.ones(shape, dtype=torch.float64).flatten()
    sign[1::2] = -1.0  # lambda may be negative: every other head or token
    return lam * sign.view(shape)


def _wrong_answers(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, causal: bool) -> dict[str, Tensor]:
    """Outputs of plausible wrong implementations, keyed by the hint that explains each."""
    d = q.shape[-1]
    h, hkv, nq, nk = q.shape[1] // 2, v.shape[1], q.shape[2], k.shape[2]

    def lib(q=q, k=k, v=v, lam=lam, causal=causal, **kw) -> Tensor:
        return diff_attention(q, k, v, lam, causal=causal, backend="naive", **kw)

    right = lib()
    wrong: dict[str, Tensor] = {}
    if causal and nq != nk:
        top_left = torch.ones(nq, nk, dtype=torch.bool).tril()
        wrong[("SDPA's is_causal aligns the mask top-left (query i sees keys j <= i), but with a KV cache "
               f"(Nq={nq} < Nk={nk}) the queries are the last Nq positions, so the mask must be aligned "
               "bottom-right; the flag only fits when Nq == Nk, otherwise pass the mask yourself.")] = \
            lib(causal=False, attn_mask=top_left)
    if causal:
        wrong["the causal mask is missing: every one of the four SDPA calls must be causal."] = lib(causal=False)
    wrong["lambda is missing: the output is map 1's attention minus lambda times map 2's."] = \
        lib(lam=torch.ones_like(lam))
    wrong["the sign is flipped: map 2's attention is subtracted, not added."] = lib(lam=-lam)
    wrong["lambda lost its sign: lambda can be negative (it is here for some heads or tokens); use it as it is."] = \
        lib(lam=lam.abs())
    wrong["lambda was clamped at 0: lambda can be negative (it is here for some heads or tokens); use it as it is."] = \
        lib(lam=lam.clamp(min=0))
    wrong[("the two V halves come back swapped: the output's first d columns come from the first half of V.")] = \
        torch.cat([right[..., d:], right[..., :d]], dim=-1)
    interleaved_v = torch.cat([v[..., 0::2], v[..., 1::2]], dim=-1)
    wrong[("the V halves are not contiguous: V = [Va | Vb] is its first d columns and its last d columns, "
           "not its even and odd columns.")] = lib(v=interleaved_v)
    blocked_hint = ("the two maps of head i are the adjacent heads 2i and 2i+1 (interleaved), not the first and "
                    "second half of the heads.")
    wrong[blocked_hint] = lib(q=blocked_as_interleaved(q), k=blocked_as_interleaved(k))
    wrong[blocked_hint + " (Here q is split in halves.)"] = lib(q=blocked_as_interleaved(q))
    wrong[blocked_hint + " (Here k is split in halves.)"] = lib(k=blocked_as_interleaved(k))
    if hkv != h:
        kt, vt = tiled_kv(k, v, h)
        wrong[(f"with GQA ({h} heads, {hkv} KV groups) differential head i reads KV group i // {h // hkv} "
               "(consecutive heads share a group); you tiled the groups (the whole list repeated), so head i read "
               "group i % Hkv. SDPA's own GQA support pairs heads the right way.")] = lib(k=kt, v=vt)
    wrong["the softmax scale is 1/sqrt(d) with d the q/k head dim, not 1/sqrt(2d) (V's width)."] = \
        lib(scale=(2 * d) ** -0.5)
    return wrong


@exercise_check(task=1, name="sdpa_split", refuses=library_diff_attention)
def check_sdpa_split(fn: Callable[..., Tensor]) -> None:
    """Check ``fn(q, k, v, lam, *, causal=False)``: four SDPA calls with V halves, equal to explicit maps.

    q ``(B, 2H, Nq, d)``, k ``(B, 2Hkv, Nk, d)``, v ``(B, Hkv, Nk, 2d)``, lam a 0-dim tensor or broadcastable
    to ``(B, H, Nq, 1)``; returns ``(B, H, Nq, 2d)``. Causal masks align bottom-right.
    """
    for i, (b, h, hkv, nq, nk, d, causal, kind) in enumerate(_CASES):
        seed = 800 + 10 * i
        q, k = randn(b, 2 * h, nq, d, seed=seed), randn(b, 2 * hkv, nk, d, seed=seed + 1)
        v, lam = randn(b, hkv, nk, 2 * d, seed=seed + 2), _lam(kind, b, h, nq, seed + 3)
        what = (f"sdpa_split (B={b}, H={h}, Hkv={hkv}, Nq={nq}, Nk={nk}, d={d}, lambda "
                f"{'per ' + kind.split('_')[1] if kind != 'scalar' else 'scalar'}{', causal' if causal else ''})")
        got = call(fn, q, k, v, lam, causal=causal, what=what)
        expected = diff_attention(q, k, v, lam, causal=causal, backend="naive")
        if isinstance(got, Tensor) and got.shape[:-1] == expected.shape[:-1] and got.shape[-1] == d:
            fail(f"{what} returned width d = {d}, expected 2d = {2 * d}: every map multiplies BOTH halves of V; "
                 f"pairing map 1 with one half and map 2 with the other drops half of the output.")
        if isinstance(got, Tensor) and got.shape[:2] == (b, 2 * h):
            fail(f"{what} returned {2 * h} heads, expected H = {h}: the two maps of each pair combine into one "
                 f"differential head.")
        expect(got, expected, what=what, wrong=_wrong_answers(q, k, v, lam, causal),
               default_hint="Compare with the explicit maps (the library's diff_attention with backend='naive') "
                            "on a tiny input.")
    b, h, hkv, nq, nk, d = 2, 4, 2, 5, 5, 4
    q, k = randn(b, 2 * h, nq, d, seed=890), randn(b, 2 * hkv, nk, d, seed=891)
    v, lam = randn(b, hkv, nk, 2 * d, seed=892), torch.tensor(0.6, dtype=torch.float64)
    expect_grads(lambda q, k, v, lam: fn(q, k, v, lam, causal=True),
                 lambda q, k, v, lam: diff_attention(q, k, v, lam, causal=True, backend="naive"),
                 (q, k, v, lam), what="sdpa_split's gradients (GQA, causal)")
    passed(f"sdpa_split equals explicit differential attention on {len(_CASES)} shapes (GQA, causal with "
           f"Nq < Nk, per-head and per-token lambda), gradients included.")


# -------------------------------------------------------------------------------------------------------------


@exercise_check(task=2, name="sdpa_split_flops")
def check_sdpa_split_flops(fn: Callable[..., float]) -> None:
    """Check ``fn(b, h, n, d, causal=False) -> float``: forward FLOPs of the four-call formulation.

    ``h`` differential heads of q/k dim ``d``, self-attention over ``n`` tokens; causal counts half.
    """
    cases = [(1, 8, 1024, 64, False), (2, 3, 100, 16, False), (1, 4, 512, 128, True), (3, 1, 7, 8, True)]
    for b, h, n, d, causal in cases:
        what = f"sdpa_split_flops(b={b}, h={h}, n={n}, d={d}, causal={causal})"
        got = call(fn, b, h, n, d, causal=causal, what=what)
        if isinstance(got, torch.Tensor):
            got = got.item()
        if not isinstance(got, (int, float)) or isinstance(got, bool):
            fail(f"{what} should return a number, got {type(got).__name__}")
        expected = flops.formulation_flops("sdpa_split", b, h, n, d, causal=causal)
        unit = 2 * b * h * n * n * d * (0.5 if causal else 1.0)  # one q.k map of dim d
        if math.isclose(got, expected, rel_tol=1e-9):
            continue
        wrong: dict[str, float] = {}
        if causal:
            wrong["causal attention counts half of the (query, key) pairs."] = 2 * expected
        wrong[("you counted each map once (12 B H N^2 d, the least V1 work); sdpa_split computes every q.k map twice, "
               "once per V half: four calls, each 2 N^2 d (q k^T) + 2 N^2 d (P v of width d) per head.")] = 6 * unit
        wrong[("that is half the answer: sdpa_split makes four calls, not two (map 1 and map 2 each meet both V "
               "halves); or a product (m, k) @ (k, n) was counted as m k n instead of 2 m k n FLOPs (a multiply and "
               "an add); or the P v products were left out.")] = 4 * unit
        wrong["q1 and q2 have H heads each, not 2H: count four calls over H heads."] = 16 * unit
        wrong[("the P v products have width d in sdpa_split (V halves), not 2d: each call costs 2 N^2 d + 2 N^2 d "
               "per head.")] = 12 * unit
        for hint, value in wrong.items():
            if math.isclose(got, value, rel_tol=1e-9):
                fail(f"{what} returned {got:.6g}, expected {expected:.6g}. Likely mistake: {hint}")
        fail(f"{what} returned {got:.6g}, expected {expected:.6g}. Count every product of the four calls: each "
             f"q k^T and each P v, 2 m k n FLOPs for (m, k) @ (k, n), halved when causal.")
    passed("sdpa_split_flops counts 16 B H N^2 d: four calls, every q.k map computed twice (causal: half).")
