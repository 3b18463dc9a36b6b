"""Checks for ``exercises/11_diff_attention_in_the_wild.ipynb``: fixing the bugs of public implementations.

1. axonml's ``DifferentialAttention`` (a frozen copy of lambda, an ignored mask), on its per-head halves layout;
2. the Introspective fork's causal mask over concatenated paths, for the queries of every path at once;
3. vasqu's four-call SDPA formulation under GQA (both maps of a head read the same key map);
4. Hugging Face DiffLlama's halves pairing, reordered into this library's adjacent pairs.

References: ``functional.diff_attention`` and ``causal_mask``, ``interop``'s DiffLlama row order.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from einops import rearrange

from diffattn_tutorial.checks._core import call, exercise_check, expect, expect_grads, fail, passed, randn
from diffattn_tutorial.checks._helpers import kv_heads_one_by_one, library_diff_attention, tiled_kv
from diffattn_tutorial.functional import causal_mask, diff_attention, diff_attention_maps, expand_kv_groups
from diffattn_tutorial.interop import diffllama_order, permute_maps
from diffattn_tutorial.layers.rope import interleaved_to_half_split

__all__ = ["check_axonml_fixed", "check_block_causal_mask", "check_four_calls_gqa", "check_diffllama_rows"]

Tensor = torch.Tensor


# --- TASK 1: axonml -------------------------------------------------------------------------------------------

def _halves_to_maps(t: Tensor) -> Tensor:
    """axonml's layout ``(B, H, N, 2d)`` (map 1 = first half of each head) -> this library's ``(B, 2H, N, d)``."""
    return rearrange(t, "b h n (two d) -> b (h two) n d", two=2)


def _axonml_ref(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, attn_mask: Optional[Tensor], *,
                scale: Optional[float] = None, swap: bool = False, mask_maps: str = "both") -> Tensor:
    """Differential attention on axonml's layout; the keywords build the wrong answers."""
    q, k = _halves_to_maps(q), _halves_to_maps(k)
    d = q.shape[-1]
    s = d ** -0.5 if scale is None else scale
    q1, q2, k1, k2 = q[:, 0::2], q[:, 1::2], k[:, 0::2], k[:, 1::2]
    if swap:
        q1, q2, k1, k2 = q2, q1, k2, k1
    s1, s2 = q1 @ k1.transpose(-1, -2) * s, q2 @ k2.transpose(-1, -2) * s
    if attn_mask is not None and mask_maps in ("both", "first"):
        s1 = s1.masked_fill(~attn_mask, float("-inf"))
    if attn_mask is not None and mask_maps in ("both", "second"):
        s2 = s2.masked_fill(~attn_mask, float("-inf"))
    a1, a2 = torch.softmax(s1, -1), torch.softmax(s2, -1)
    if attn_mask is not None and mask_maps == "after":
        a1, a2 = a1 * attn_mask, a2 * attn_mask
    return (a1 - lam * a2) @ v


def _axonml_mask(kind: str, b: int, nq: int, nk: int, lengths: list[int]) -> Optional[Tensor]:
    if kind == "none":
        return None
    m = causal_mask(nq, nk)[None, None].expand(b, 1, nq, nk).clone()
    if kind == "causal+padding":
        m &= (torch.arange(nk)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]
    return m


def _library_diff() -> dict:
    """What tasks 1 and 3 fix by hand: the library's differential attention answers them without finding the bug."""
    return {**library_diff_attention(), diff_attention: "the library's diff_attention",
            diff_attention_maps: "the library's diff_attention_maps"}


# (B, H, N, d, lam, mask): mask kinds "causal", "causal+padding" (right padding: no row fully masked), "none"
_AXON_CASES = [(2, 2, 6, 4, 0.05, "causal"), (2, 3, 7, 8, 0.6, "causal+padding"), (1, 4, 5, 2, -0.3, "causal+padding"),
               (3, 1, 4, 4, 0.8, "none")]


@exercise_check(task=1, name="axonml_fixed", refuses=_library_diff)
def check_axonml_fixed(fn: Callable) -> None:
    """``fn(q, k, v, lam, attn_mask)``: q, k ``(B, H, N, 2d)`` whose first/second halves are maps 1/2, v
    ``(B, H, N, 2d)``, lam a 0-dim tensor, attn_mask bool ``(B, 1, N, N)`` (True = may attend) or None ->
    ``(softmax(q1 k1^T / sqrt d) - lam softmax(q2 k2^T / sqrt d)) v``, masked, with a gradient to lam."""
    what = "axonml_fixed"
    for i, (B, H, N, d, lam_v, kind) in enumerate(_AXON_CASES):
        q, k = randn(B, H, N, 2 * d, seed=1100 + i) * 1.5, randn(B, H, N, 2 * d, seed=1110 + i) * 1.5
        v, lam = randn(B, H, N, 2 * d, seed=1120 + i), torch.tensor(lam_v, dtype=torch.float64)
        mask = _axonml_mask(kind, B, N, N, [N, N - 2, N - 1][:B] if B <= 3 else [N] * B)
        expected = diff_attention(_halves_to_maps(q), _halves_to_maps(k), v, lam, attn_mask=mask, backend="naive")
        got = call(fn, q, k, v, lam, mask, what=what)
        wrong = {}
        if mask is not None:
            wrong.update({
                "the mask is ignored (axonml's bug: its attn_mask argument is never read). Set the scores of "
                "masked keys to -inf before each softmax": _axonml_ref(q, k, v, lam, None),
                "the mask is inverted: True means may attend, so the scores to set to -inf are where the mask is "
                "False (masked_fill(~attn_mask, ...))": _axonml_ref(q, k, v, lam, ~mask),
                "only map 1 is masked: the same mask applies to both softmax maps":
                    _axonml_ref(q, k, v, lam, mask, mask_maps="first"),
                "only map 2 is masked: the same mask applies to both softmax maps":
                    _axonml_ref(q, k, v, lam, mask, mask_maps="second"),
                "the mask zeroes the weights after the softmax, so the rows no longer sum to 1: mask the scores "
                "(-inf) before each softmax": _axonml_ref(q, k, v, lam, mask, mask_maps="after"),
            })
        wrong.update({
            "scaled by 1/sqrt(2d), the full head width: each map has width d (half the head), so the scale is "
            "1/sqrt(d)": _axonml_ref(q, k, v, lam, mask, scale=(2 * d) ** -0.5),
            "the maps are swapped: map 1 is the first half of each head's q and k": _axonml_ref(q, k, v, lam, mask,
                                                                                             swap=True),
            "the second map is added: it is map 1 minus lambda times map 2":
                _axonml_ref(q, k, v, -lam, mask),
        })
        expect(got, expected, what=what, wrong=wrong)
    B, H, N, d, lam_v, kind = _AXON_CASES[1]
    mask = _axonml_mask(kind, B, N, N, [N, N - 2])
    expect_grads(
        fn, lambda q, k, v, lam, m: diff_attention(_halves_to_maps(q), _halves_to_maps(k), v, lam, attn_mask=m,
                                                   backend="naive"),
        {"q": randn(B, H, N, 2 * d, seed=1130), "k": randn(B, H, N, 2 * d, seed=1131),
         "v": randn(B, H, N, 2 * d, seed=1132), "lam": torch.tensor(lam_v, dtype=torch.float64), "attn_mask": mask},
        what=what, missing_hints={"lam": "lambda enters as a constant copy, axonml's bug (lam.item(), float(lam), "
                                         "torch.full_like(..., lam.item())): multiply by the tensor lam itself so "
                                         "that it learns."})
    passed("both maps masked, lambda a live tensor: axonml's layout computes the paper's differential attention.")


# --- TASK 2: the Introspective mask ----------------------------------------------------------------------------

def _paths_mask(n: int, paths: int, *, blocks: str = "earlier", within: str = "causal") -> Tensor:
    """The all-paths mask ``(paths * n, paths * n)`` built from two choices (the right one, or a mistake):
    which key blocks a path reads (``earlier``: its own and earlier paths', ``own``, ``strict``: earlier only,
    ``all``) and what it sees inside a block (``causal``: p <= t, ``strict``: p < t, ``all``)."""
    pj = torch.arange(paths)
    block = {"earlier": pj[None, :] <= pj[:, None], "own": pj[None, :] == pj[:, None],
             "strict": pj[None, :] < pj[:, None], "all": torch.ones(paths, paths, dtype=torch.bool)}[blocks]
    inner = {"causal": causal_mask(n, n), "strict": causal_mask(n, n).tril(-1),
             "all": torch.ones(n, n, dtype=torch.bool)}[within]
    return torch.kron(block.to(torch.int8), inner.to(torch.int8)).bool()


@exercise_check(task=2, name="block_causal_mask")
def check_block_causal_mask(fn: Callable) -> None:
    """``fn(n, paths)`` -> bool ``(paths * n, paths * n)``, True = may attend: the queries and the keys of all
    paths, path by path (row and column ``i * n + t`` are path i at token position t)."""
    what = "block_causal_mask"
    for n, paths in [(6, 3), (4, 1), (5, 2), (1, 3), (3, 4)]:
        got = call(fn, n, paths, what=what)
        if not isinstance(got, Tensor):
            fail(f"{what} should return a torch.Tensor, got {type(got).__name__}")
        if got.dtype != torch.bool:
            fail(f"{what} returned dtype {got.dtype}: return a bool mask, True = may attend")
        if got.shape == (n, paths * n) and paths > 1:
            fail(f"{what}({n}, {paths}) returned shape {(n, paths * n)}: that is one path's queries (the notebook's "
                 f"mask); this mask holds the queries of every path, (paths * n, paths * n)")
        if got.shape != (paths * n, paths * n):
            fail(f"{what}({n}, {paths}) returned shape {tuple(got.shape)}, expected (paths * n, paths * n) = "
                 f"{(paths * n, paths * n)}")
        expected = _paths_mask(n, paths)
        if torch.equal(got, expected):
            continue
        wrong = {
            "every path reads every path's keys: path i reads its own keys and those of the earlier paths, never a "
            "later path's (a later path is computed after it)": _paths_mask(n, paths, blocks="all"),
            "each path reads only its own keys: path i also reads the earlier paths' keys, at the same positions":
                _paths_mask(n, paths, blocks="own"),
            "path i reads only the earlier paths' keys, not its own: a path attends to its own keys too":
                _paths_mask(n, paths, blocks="strict"),
            "one causal mask over all paths * n positions: it lets a later path's query at t see an earlier "
            "path's positions p > t (its future). Causality is per token position, inside every block":
                causal_mask(paths * n, paths * n),
            "each query sees only earlier positions (p < t), not itself: a token may attend to its own position":
                _paths_mask(n, paths, within="strict"),
            "inside a block every position is visible: query t may see position p of a block only when p <= t":
                _paths_mask(n, paths, within="all"),
            "True and False are swapped: True means may attend": ~expected,
        }
        for hint, candidate in wrong.items():
            if candidate.shape == got.shape and torch.equal(got, candidate):
                fail(f"{what} is not right. Likely mistake: {hint}")
        bad = (got != expected).nonzero()[0].tolist()
        fail(f"{what}({n}, {paths}) differs at query {bad[0]} (path {bad[0] // n}, position {bad[0] % n}), key "
             f"{bad[1]} (path {bad[1] // n}, position {bad[1] % n}): compare which paths it may read and which "
             f"positions inside a block")
    passed("every path reads its own and the earlier paths' keys, causal at each token position: no future token "
           "and no later path leaks.")


# --- TASK 3: vasqu's four calls under GQA ----------------------------------------------------------------------

def _naive_rule(q: Tensor, k: Tensor, v: Tensor, lam: Tensor) -> Tensor:
    """vasqu's (and unilm's naive file's) GQA: the 2Hkv interleaved key heads repeated in place."""
    return diff_attention(q, *kv_heads_one_by_one(k, v, q.shape[1] // 2), lam, causal=True, backend="naive")


def _tiled_groups(q: Tensor, k: Tensor, v: Tensor, lam: Tensor) -> Tensor:
    """Groups tiled: differential head i reads group i % Hkv instead of i // (H / Hkv)."""
    return diff_attention(q, *tiled_kv(k, v, q.shape[1] // 2), lam, causal=True, backend="naive")


# (B, H, Hkv, N, d, lam)
_GQA_CASES = [(2, 4, 2, 6, 4, 0.6), (1, 6, 2, 5, 8, 0.3), (2, 4, 1, 7, 4, -0.4), (1, 2, 2, 5, 4, 0.8),
              (2, 8, 4, 3, 2, 0.5)]


@exercise_check(task=3, name="four_calls_gqa", refuses=lambda: {
    **_library_diff(), expand_kv_groups: "the library's expand_kv_groups (the GQA rule this task is about)"})
def check_four_calls_gqa(fn: Callable) -> None:
    """``fn(q, k, v, lam)``: q ``(B, 2H, N, d)``, k ``(B, 2Hkv, N, d)``, v ``(B, Hkv, N, 2d)`` -> causal differential
    attention ``(B, H, N, 2d)`` where head i reads KV group ``i // (H / Hkv)``, map 1 with k1, map 2 with k2."""
    what = "four_calls_gqa"
    for i, (B, H, Hkv, N, d, lam_v) in enumerate(_GQA_CASES):
        q, k = randn(B, 2 * H, N, d, seed=1300 + i), randn(B, 2 * Hkv, N, d, seed=1310 + i)
        v, lam = randn(B, Hkv, N, 2 * d, seed=1320 + i), torch.tensor(lam_v, dtype=torch.float64)
        expected = diff_attention(q, k, v, lam, causal=True, backend="naive")
        got = call(fn, q, k, v, lam, what=what)
        wrong = {}
        if H != Hkv:
            wrong.update({
                "both maps of a head read the same key map: repeating the 2Hkv interleaved key heads in place "
                "(vasqu's repeat_kv, unilm's naive file) puts k1 of a group next to itself. Split the keys into k1 "
                "(heads 0::2) and k2 (heads 1::2) first, then repeat each": _naive_rule(q, k, v, lam),
                "the groups are tiled (repeat): differential head i reads group i // (H / Hkv), so each group is "
                "repeated in place (repeat_interleave)": _tiled_groups(q, k, v, lam),
                "the values are tiled (repeat) while the keys are right: value head i is group i // (H / Hkv) too, "
                "each group repeated in place (repeat_interleave)": diff_attention(
                    q, expand_kv_groups(k, v, H)[0], tiled_kv(k, v, H)[1], lam, causal=True, backend="naive"),
            })
        k1, k2 = k[:, 0::2], k[:, 1::2]
        va, vb = v.chunk(2, dim=-1)

        def keys(first: Tensor, second: Tensor) -> Tensor:
            return rearrange(torch.stack([first, second], 2), "b g two n d -> b (g two) n d")

        wrong.update({
            "k1 and k2 are swapped: map 1 (query heads 0::2) reads the key heads 0::2 (k1), map 2 (1::2) reads "
            "the key heads 1::2 (k2)": diff_attention(q, keys(k2, k1), v, lam, causal=True, backend="naive"),
            "both maps read k1: map 2 reads the key heads 1::2 (k2)":
                diff_attention(q, keys(k1, k1), v, lam, causal=True, backend="naive"),
            "both maps read k2: map 1 reads the key heads 0::2 (k1)":
                diff_attention(q, keys(k2, k2), v, lam, causal=True, backend="naive"),
            "the V halves are swapped: each map's output is [A va | A vb], the first half of V first":
                diff_attention(q, k, torch.cat([vb, va], -1), lam, causal=True, backend="naive"),
            "the causal mask is missing: vasqu's variants are causal (is_causal=True)":
                diff_attention(q, k, v, lam, backend="naive"),
            "the second map is added: it is map 1 minus lambda times map 2":
                diff_attention(q, k, v, -lam, causal=True, backend="naive"),
        })
        expect(got, expected, what=what, wrong=wrong)
    passed("both maps of head i read KV group i // (H / Hkv), map 1 with k1 and map 2 with k2: the flash files' rule.")


# --- TASK 4: DiffLlama rows -------------------------------------------------------------------------------------

@exercise_check(task=4, name="diffllama_rows", refuses=lambda: {
    diffllama_order: "the library's diffllama_order (interop)", permute_maps: "the library's permute_maps (interop)"})
def check_diffllama_rows(fn: Callable) -> None:
    """``fn(w, maps, head_dim)``: DiffLlama rows ``(maps * head_dim, ...)`` with map i paired with i + maps/2 ->
    the same rows in adjacent pairs, map order ``[0, maps/2, 1, maps/2 + 1, ...]``."""
    what = "diffllama_rows"
    for i, (maps, hd, cols) in enumerate([(8, 4, 6), (6, 2, 3), (12, 4, None), (2, 8, 5)]):
        w = randn(maps * hd, *(() if cols is None else (cols,)), seed=1400 + i)
        order = diffllama_order(maps)
        expected = permute_maps(w, order, hd)
        got = call(fn, w.clone(), maps, hd, what=what)
        wrong = {
            "the channels inside each map were permuted (that is interleaved_to_half_split, the RoPE layout "
            "change): pairing reorders whole maps, blocks of head_dim rows": interleaved_to_half_split(w, hd),
            "this is the inverse order (adjacent pairs back to halves, what to_diffllama does): map 2i of the "
            "result is DiffLlama's map i and map 2i + 1 is map i + maps/2": permute_maps(w, torch.argsort(order), hd),
            "the rows are unchanged: DiffLlama's map i pairs with map i + maps/2, which must become adjacent":
                w,
            "single rows (channels) were interleaved, row r with row r + rows/2, so the channels of map i and map "
            "i + maps/2 alternate: pairing reorders whole maps, blocks of head_dim rows, each map's rows kept "
            "together": rearrange(w, "(two r) ... -> (r two) ...", two=2),
        }
        expect(got, expected, what=what, wrong={h: c for h, c in wrong.items() if c.shape == expected.shape
                                                 and not torch.equal(c, expected)})
    passed("map i and map i + maps/2 now sit at 2i and 2i + 1: DiffLlama's weights in the library's layout.")
