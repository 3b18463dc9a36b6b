"""The exact formulations of differential attention that the pure-PyTorch backends run.

Layout (the reference implementations' own): q ``(B, 2H, Nq, d)`` with the two maps of differential head ``i`` at
heads ``2i`` and ``2i+1``, k ``(B, 2Hkv, Nk, d)``, v ``(B, Hkv, Nk, 2d)``; head ``i`` reads KV group
``i // (H // Hkv)``. Every function here takes validated inputs and one combined mask (bool, True = may attend, or
additive float; no fully masked row) and returns ``(B, H, Nq, 2d)`` in q's dtype:

* :func:`naive`: both maps explicitly, ``(A1 - lam A2) V`` (the teaching version, and the reference);
* :func:`chunked`: the same arithmetic over query chunks, bounded memory;
* the SDPA formulations, each a few ``scaled_dot_product_attention`` calls: :func:`sdpa_wide` (timm, unilm
  ``flashdiff_1``), :func:`sdpa_split` (unilm ``flashdiff_2``), :func:`sdpa_stacked` (vasqu), :func:`sdpa_padded`
  (the project's own: q and k zero-padded to width 2d).

The softmax runs in float32 for 16-bit inputs, as the references do. Which of them a call runs is the backend
table's business (:mod:`diffattn_tutorial.backend_table`); masks, NaN rows and refusals are
:func:`diffattn_tutorial.functional.diff_attention`'s.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
from torch.nn.attention import SDPBackend, sdpa_kernel

from diffattn_tutorial.validation import combine_masks, fix_fully_masked, forward_ad_active, under_torch_func

Tensor = torch.Tensor


def split_pairs(t: Tensor) -> tuple[Tensor, Tensor]:
    """``(B, 2n, N, d) -> (B, n, N, d), (B, n, N, d)``: heads ``0::2`` (map 1) and ``1::2`` (map 2)."""
    return t[:, 0::2], t[:, 1::2]


def softmax_dtype(q: Tensor) -> torch.dtype:
    """Softmax runs in float32 for half/bfloat16 inputs (as the references do), else in q's dtype."""
    return torch.promote_types(q.dtype, torch.float32)


def expand_kv_groups(k: Tensor, v: Tensor, heads: int) -> tuple[Tensor, Tensor]:
    """GQA made explicit: ``k (B, 2Hkv, Nk, d) -> (B, 2H, Nk, d)`` and ``v (B, Hkv, Nk, 2d) -> (B, H, Nk, 2d)``.

    Differential head ``i`` reads KV group ``i // (H // Hkv)`` for both maps, so the key heads of a group
    (``2g``, ``2g+1``) are repeated as a pair. ``heads`` is H; with ``H == Hkv`` the inputs come back as they are.
    """
    rep = heads // v.shape[1]
    if rep == 1:
        return k, v
    k = rearrange(k, "b (g two) n d -> b g two n d", two=2).repeat_interleave(rep, dim=1).flatten(1, 2)
    return k, v.repeat_interleave(rep, dim=1)


def dual_maps(q: Tensor, k: Tensor, mask: Optional[Tensor], scale: float) -> Tensor:
    """Both softmax maps of every differential head, ``(B, H, 2, Nq, Nk)``, softmax in float32 or wider.

    ``k`` has one key head per query head, ``(B, 2H, Nk, d)`` (see :func:`expand_kv_groups`).
    """
    scores = ((q * scale) @ k.transpose(-1, -2)).unflatten(1, (-1, 2))  # (B, H, 2, Nq, Nk)
    if mask is not None:
        m = mask.unsqueeze(2)  # the same mask for both maps of a head
        scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m
    return torch.softmax(scores, dim=-1, dtype=softmax_dtype(q)).to(q.dtype)


def naive(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, mask: Optional[Tensor], scale: float,
           dropout_p: float) -> Tensor:
    """Explicit maps: ``(softmax(q1 k1^T s) - lam softmax(q2 k2^T s)) v``."""
    k, v = expand_kv_groups(k, v, q.shape[1] // 2)
    attn = dual_maps(q, k, mask, scale)
    if dropout_p > 0:
        attn = F.dropout(attn, p=dropout_p)
    diff_map = attn[:, :, 0] - lam * attn[:, :, 1]  # (B, H, Nq, Nk): weights can be negative
    return diff_map @ v


def naive_reference(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, *, causal: bool = False,
                    attn_mask: Optional[Tensor] = None, scale: Optional[float] = None) -> Tensor:
    """:func:`naive` on finite, validated inputs with ``diff_attention``'s mask handling (``attn_mask`` 4-D or None,
    combined with the bottom-right ``causal`` mask; fully masked rows zero): the reference a fused kernel checks
    itself against before it is used."""
    nq, nk, d = q.shape[2], k.shape[2], q.shape[3]
    mask, valid = fix_fully_masked(combine_masks(attn_mask, causal, nq, nk, q.device))
    out = naive(q, k, v, lam, mask, d ** -0.5 if scale is None else scale, 0.0)
    return out if valid is None else out.masked_fill(~valid, 0.0)


def chunked(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, mask: Optional[Tensor], scale: float,
             dropout_p: float, *, causal: bool = False, chunk: Optional[int] = None) -> Tensor:
    """The naive arithmetic over query chunks small enough to stay in cache: exact, bounded memory.

    At most ``B * 2H * chunk * Nk`` scores live at once (by default about ``2**21``: 8 MiB in float32). With
    ``causal`` (the mask already holds the bottom-right causal mask) a chunk of rows ``[s, e)`` only
    computes scores for the keys it can see, ``j < e + Nk - Nq``, skipping the masked upper triangle.
    """
    B, H2, nq, _ = q.shape
    H, nk = H2 // 2, k.shape[2]
    if chunk is None:
        chunk = max(16, (1 << 21) // max(1, B * H2 * nk))
    k, v = expand_kv_groups(k, v, H)
    qs, kt = q * scale, k.transpose(-1, -2)  # (B, 2H, Nq, d), (B, 2H, d, Nk)
    outs = []
    for s in range(0, nq, chunk):
        e = min(nq, s + chunk)
        kmax = max(1, min(nk, e + nk - nq)) if causal else nk
        scores = (qs[:, :, s:e] @ kt[..., :kmax]).unflatten(1, (H, 2))  # (B, H, 2, c, kmax)
        if mask is not None:
            m = mask[:, :, s:e] if mask.shape[2] == nq else mask
            m = (m[..., :kmax] if m.shape[-1] == nk else m).unsqueeze(2)  # one mask for both maps
            if under_torch_func():  # vmap over the mask alone: a batched mask, unbatched scores (not in place)
                scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m
            else:
                scores = scores.masked_fill_(~m, float("-inf")) if m.dtype == torch.bool else scores.add_(m)
        attn = torch.softmax(scores, dim=-1, dtype=softmax_dtype(q)).to(q.dtype)
        if dropout_p > 0:
            attn = F.dropout(attn, p=dropout_p)
        lm = lam[:, :, s:e] if lam.ndim == 4 and lam.shape[2] == nq else lam
        diff_map = torch.addcmul(attn[:, :, 0], lm, attn[:, :, 1], value=-1.0)  # A1 - lam * A2
        outs.append(diff_map @ v[:, :, :kmax])
    return torch.cat(outs, dim=2) if outs else q.new_zeros(B, H, 0, v.shape[-1])


def _math_sdpa_only() -> bool:
    """Whether a forward-mode derivative is being taken (``torch.func.jvp``, ``jacfwd``, ``hessian``,
    ``torch.autograd.forward_ad``), or a second one by nested ``torch.func`` transforms (``grad(grad(f))``,
    ``jacrev(jacrev(f))``): SDPA's fused kernels (flash on a CPU) have no forward-mode derivative and no derivative of
    their backward; its math one (PyTorch ops) has both."""
    if torch.compiler.is_compiling():
        return False
    if forward_ad_active():
        return True
    if torch._C._functorch.maybe_current_level() is None:  # no torch.func transform
        return False
    keys = [i.key() for i in retrieve_all_functorch_interpreters()]
    return keys.count(torch._C._functorch.TransformType.Grad) >= 2


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], is_causal: bool, scale: float,
         dropout_p: float) -> Tensor:
    """One ``scaled_dot_product_attention`` call; KV heads shared by ``q.shape[1] // k.shape[1]`` queries (SDPA's
    math kernel where a forward-mode or nested derivative is taken)."""
    gqa = q.shape[1] != k.shape[1]
    with sdpa_kernel(SDPBackend.MATH) if _math_sdpa_only() else contextlib.nullcontext():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                              scale=scale, enable_gqa=gqa)


def sdpa_wide(q, k, v, lam, mask, is_causal, scale, dropout_p):
    """Two SDPA calls with V of width 2d (timm, unilm flashdiff_1)."""
    (q1, q2), (k1, k2) = split_pairs(q), split_pairs(k)
    o1 = sdpa(q1, k1, v, mask, is_causal, scale, dropout_p)
    o2 = sdpa(q2, k2, v, mask, is_causal, scale, dropout_p)
    return o1 - lam * o2


def sdpa_split(q, k, v, lam, mask, is_causal, scale, dropout_p):
    """Four SDPA calls with V split in halves: every call has equal q/k/v head dims (unilm flashdiff_2)."""
    (q1, q2), (k1, k2) = split_pairs(q), split_pairs(k)
    va, vb = v.chunk(2, dim=-1)
    o1 = torch.cat([sdpa(q1, k1, va, mask, is_causal, scale, 0.0), sdpa(q1, k1, vb, mask, is_causal, scale, 0.0)], -1)
    o2 = torch.cat([sdpa(q2, k2, va, mask, is_causal, scale, 0.0), sdpa(q2, k2, vb, mask, is_causal, scale, 0.0)], -1)
    return o1 - lam * o2


def sdpa_stacked(q, k, v, lam, mask, is_causal, scale, dropout_p):
    """One SDPA call over 4H stacked heads ``[q1|va, q1|vb, q2|va, q2|vb]`` of equal head dims."""
    (q1, q2), (k1, k2) = split_pairs(q), split_pairs(k)
    va, vb = v.chunk(2, dim=-1)
    qs = torch.cat([q1, q1, q2, q2], dim=1)  # block c of H heads pairs with block c of Hkv KV heads
    ks = torch.cat([k1, k1, k2, k2], dim=1)
    vs = torch.cat([va, vb, va, vb], dim=1)
    if mask is not None and mask.shape[1] != 1:
        mask = mask.repeat(1, 4, 1, 1)
    o11, o12, o21, o22 = sdpa(qs, ks, vs, mask, is_causal, scale, 0.0).chunk(4, dim=1)
    return torch.cat([o11, o12], -1) - lam * torch.cat([o21, o22], -1)


def sdpa_padded(q, k, v, lam, mask, is_causal, scale, dropout_p):
    """Two SDPA calls with q and k zero-padded to width 2d: ``[q, 0] . [k, 0] = q . k``, so the scores are
    unchanged, while every head dim is 2d and V stays whole. Each call reaches the fused kernels (as
    ``sdpa_split``'s four do) at half the calls, with no V split and no concatenation."""
    d = q.shape[-1]
    (q1, q2), (k1, k2) = split_pairs(q), split_pairs(k)
    o1 = sdpa(F.pad(q1, (0, d)), F.pad(k1, (0, d)), v, mask, is_causal, scale, 0.0)
    o2 = sdpa(F.pad(q2, (0, d)), F.pad(k2, (0, d)), v, mask, is_causal, scale, 0.0)
    if o1.requires_grad or lam.requires_grad or under_torch_func():  # vmap: a batched lam, an unbatched o2
        return o1 - lam * o2
    return o1.sub_(o2.mul_(lam))  # inference: the first output holds the result, no third buffer
