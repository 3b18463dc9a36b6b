"""Differential attention as plain functions: every formula the notebooks derive has its home here.

Layout (the reference implementations' own, and the README's): queries and keys carry **2H heads**, the two maps of
differential head ``i`` adjacent (heads ``2i`` and ``2i+1``); values carry ``Hkv`` heads of width ``2d``.

>>> q = torch.randn(1, 4, 5, 8); k = torch.randn(1, 4, 5, 8); v = torch.randn(1, 2, 5, 16)
>>> diff_attention(q, k, v, torch.tensor(0.5)).shape
torch.Size([1, 2, 5, 16])

Backends (all exact, they differ in speed and memory) are declared once, at the end of the backends section
below, in the registry of :mod:`diffattn_tutorial.backends` (what each is, devices, dtypes, backward, dropout,
how ``"auto"`` ranks it): ``naive`` (explicit maps, the teaching version), ``chunked``, the SDPA formulations
``sdpa_wide``, ``sdpa_split``, ``sdpa_stacked``, ``sdpa_padded``, and the fused kernels ``triton`` and
``cpu_fused``; ``"sdpa"`` and ``"auto"`` are resolved per call (:func:`~diffattn_tutorial.backends.describe_auto`,
:func:`~diffattn_tutorial.backends.backend_table`).

Fully masked query rows (every key masked by ``causal`` and/or ``attn_mask``) have no softmax; every
backend defines their output as **zero** (and their gradients as zero), never NaN. In an additive mask,
entries ``<= torch.finfo(dtype).min`` (the Hugging Face convention) count as masked, like ``-inf``; any other
finite entry, however large, gives the naive formula's answer. An empty problem (``Nq = 0``, ``B = 0`` or
``H = 0``) gives an empty output; ``Nk = 0`` (no keys at all) gives zeros, as fully masked rows do.
A NaN or an infinity in q, k or v makes exactly the output rows that read it NaN (the rows of its query, the
rows that may attend to its key position) in every backend, and no other row: a key the mask hides never
influences the output, whatever it holds.
An additive mask that requires grad (a learned bias) gets its gradient: ``"auto"`` then picks a backend with
autograd, and the forward-only ones refuse it by name.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange

from diffattn_tutorial import backends
from diffattn_tutorial.backends import Backend, Call, Needs
from diffattn_tutorial.constants import LOG2E  # noqa: F401 (the functional API names it too)
from diffattn_tutorial.validation import (  # noqa: F401 (causal_mask, check_diff_inputs: the functional API)
    LambdaLike,
    _check_lambda,
    _check_mask,
    _check_plain,
    _check_same,
    _check_scale_dropout,
    _check_tensor,
    _combine_masks,
    _fix_fully_masked,
    _may_hold_nonfinite,
    _rows_reading_nonfinite,
    _zero_nonfinite,
    causal_mask,
    check_diff_inputs,
)

Tensor = torch.Tensor

BACKENDS = backends.BACKENDS
"""Every backend name ``diff_attention`` accepts, besides ``"auto"`` (a view of :mod:`diffattn_tutorial.backends`'
registry, where each backend is declared once: the library's own at the end of this module)."""

SDPA_FORMULATIONS = backends.SDPA_FORMULATIONS
"""The SDPA formulations of the reference implementations, which notebook 08 compares, selectable by name
(``"sdpa_padded"``, the CPU's ``"auto"``, has a section of its own there)."""

FORWARD_ONLY = backends.FORWARD_ONLY
"""Backends without autograd, for inference (``"auto"`` picks them only where no gradient is needed)."""

resolve_backend = backends.resolve_backend
backend_status = backends.backend_status



# --------------------------------------------------------------------------------------------
# lambda and its re-parameterisation
# --------------------------------------------------------------------------------------------


def lambda_init_fn(depth: int) -> float:
    """The paper's lambda_init for a layer: ``0.8 - 0.6 * exp(-0.3 * depth)``.

    ``depth`` is the **0-based** layer index (the paper's ``l - 1``), as in unilm and timm.
    """
    if isinstance(depth, bool) or not isinstance(depth, int):
        raise TypeError(f"depth must be an int (the 0-based layer index), got {type(depth).__name__}")
    if depth < 0:
        raise ValueError(f"depth must be >= 0 (the 0-based layer index), got {depth}")
    return 0.8 - 0.6 * math.exp(-0.3 * depth)


def reparam_lambda(
    lambda_q1: Tensor, lambda_k1: Tensor, lambda_q2: Tensor, lambda_k2: Tensor, lambda_init: float
) -> Tensor:
    """The paper's lambda: ``exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init``.

    The four vectors have shape ``(d,)`` (or ``(..., d)`` for one lambda per leading index);
    returns a float32 (or wider) tensor of the leading shape (a 0-dim tensor for ``(d,)`` vectors).
    """
    vecs = {"lambda_q1": lambda_q1, "lambda_k1": lambda_k1, "lambda_q2": lambda_q2, "lambda_k2": lambda_k2}
    shapes = {name: tuple(t.shape) for name, t in vecs.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"the four lambda vectors must share one shape (d,), got {shapes}")
    wide = torch.promote_types(lambda_q1.dtype, torch.float32)  # float32 (or wider), as the references
    lambda_1 = torch.exp(torch.sum(lambda_q1 * lambda_k1, dim=-1).to(wide))
    lambda_2 = torch.exp(torch.sum(lambda_q2 * lambda_k2, dim=-1).to(wide))
    return lambda_1 - lambda_2 + lambda_init


def dual_lambda(lambda_a: Tensor, lambda_b: Tensor, lambda_init: float) -> Tensor:
    """timm's dual-scalar lambda: ``exp(a) - exp(b) + lambda_init`` (a, b zero-initialised scalars)."""
    return torch.exp(lambda_a) - torch.exp(lambda_b) + lambda_init


def rms_norm(x: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-5) -> Tensor:
    """RMSNorm over the last dim, computed in float32 and cast back (as unilm's ``RMSNorm``).

    ``x`` is ``(..., D)``, ``weight`` is ``(D,)`` or None (no affine).
    """
    if weight is not None and weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm weight must have shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    xf = x.float()
    out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)
    return out * weight if weight is not None else out


# --------------------------------------------------------------------------------------------
# backends
# --------------------------------------------------------------------------------------------


def _split_pairs(t: Tensor) -> tuple[Tensor, Tensor]:
    """``(B, 2n, N, d) -> (B, n, N, d), (B, n, N, d)``: heads ``0::2`` (map 1) and ``1::2`` (map 2)."""
    return t[:, 0::2], t[:, 1::2]


def _softmax_dtype(q: Tensor) -> torch.dtype:
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


def _dual_maps(q: Tensor, k: Tensor, mask: Optional[Tensor], scale: float) -> Tensor:
    """Both softmax maps of every differential head, ``(B, H, 2, Nq, Nk)``, softmax in float32 or wider.

    ``k`` has one key head per query head, ``(B, 2H, Nk, d)`` (see :func:`expand_kv_groups`).
    """
    scores = ((q * scale) @ k.transpose(-1, -2)).unflatten(1, (-1, 2))  # (B, H, 2, Nq, Nk)
    if mask is not None:
        m = mask.unsqueeze(2)  # the same mask for both maps of a head
        scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m
    return torch.softmax(scores, dim=-1, dtype=_softmax_dtype(q)).to(q.dtype)


def _naive(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, mask: Optional[Tensor], scale: float,
           dropout_p: float) -> Tensor:
    """Explicit maps: ``(softmax(q1 k1^T s) - lam softmax(q2 k2^T s)) v``."""
    k, v = expand_kv_groups(k, v, q.shape[1] // 2)
    attn = _dual_maps(q, k, mask, scale)
    if dropout_p > 0:
        attn = F.dropout(attn, p=dropout_p)
    diff_map = attn[:, :, 0] - lam * attn[:, :, 1]  # (B, H, Nq, Nk): weights can be negative
    return diff_map @ v


def _chunked(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, mask: Optional[Tensor], scale: float,
             dropout_p: float, *, causal: bool = False, chunk: Optional[int] = None) -> Tensor:
    """The naive arithmetic over query chunks small enough to stay in cache: exact, bounded memory.

    At most ``B * 2H * chunk * Nk`` scores live at once (about 4 MiB in float32 by default). With
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
            scores = scores.masked_fill_(~m, float("-inf")) if m.dtype == torch.bool else scores.add_(m)
        attn = torch.softmax(scores, dim=-1, dtype=_softmax_dtype(q)).to(q.dtype)
        if dropout_p > 0:
            attn = F.dropout(attn, p=dropout_p)
        lm = lam[:, :, s:e] if lam.ndim == 4 and lam.shape[2] == nq else lam
        diff_map = torch.addcmul(attn[:, :, 0], lm, attn[:, :, 1], value=-1.0)  # A1 - lam * A2
        outs.append(diff_map @ v[:, :, :kmax])
    return torch.cat(outs, dim=2) if outs else q.new_zeros(B, H, 0, v.shape[-1])


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], is_causal: bool, scale: float,
          dropout_p: float) -> Tensor:
    """One ``scaled_dot_product_attention`` call; KV heads shared by ``q.shape[1] // k.shape[1]`` queries."""
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                          scale=scale, enable_gqa=gqa)


def _sdpa_wide(q, k, v, lam, mask, is_causal, scale, dropout_p):
    """Two SDPA calls with V of width 2d (timm, unilm flashdiff_1)."""
    (q1, q2), (k1, k2) = _split_pairs(q), _split_pairs(k)
    o1 = _sdpa(q1, k1, v, mask, is_causal, scale, dropout_p)
    o2 = _sdpa(q2, k2, v, mask, is_causal, scale, dropout_p)
    return o1 - lam * o2


def _sdpa_split(q, k, v, lam, mask, is_causal, scale, dropout_p):
    """Four SDPA calls with V split in halves: every call has equal q/k/v head dims (unilm flashdiff_2)."""
    (q1, q2), (k1, k2) = _split_pairs(q), _split_pairs(k)
    va, vb = v.chunk(2, dim=-1)
    o1 = torch.cat([_sdpa(q1, k1, va, mask, is_causal, scale, 0.0), _sdpa(q1, k1, vb, mask, is_causal, scale, 0.0)], -1)
    o2 = torch.cat([_sdpa(q2, k2, va, mask, is_causal, scale, 0.0), _sdpa(q2, k2, vb, mask, is_causal, scale, 0.0)], -1)
    return o1 - lam * o2


def _sdpa_stacked(q, k, v, lam, mask, is_causal, scale, dropout_p):
    """One SDPA call over 4H stacked heads ``[q1|va, q1|vb, q2|va, q2|vb]`` of equal head dims."""
    (q1, q2), (k1, k2) = _split_pairs(q), _split_pairs(k)
    va, vb = v.chunk(2, dim=-1)
    qs = torch.cat([q1, q1, q2, q2], dim=1)  # block c of H heads pairs with block c of Hkv KV heads
    ks = torch.cat([k1, k1, k2, k2], dim=1)
    vs = torch.cat([va, vb, va, vb], dim=1)
    if mask is not None and mask.shape[1] != 1:
        mask = mask.repeat(1, 4, 1, 1)
    o11, o12, o21, o22 = _sdpa(qs, ks, vs, mask, is_causal, scale, 0.0).chunk(4, dim=1)
    return torch.cat([o11, o12], -1) - lam * torch.cat([o21, o22], -1)


def _sdpa_padded(q, k, v, lam, mask, is_causal, scale, dropout_p):
    """Two SDPA calls with q and k zero-padded to width 2d: ``[q, 0] . [k, 0] = q . k``, so the scores are
    unchanged, while every head dim is 2d and V stays whole. Each call reaches the fused kernels (as
    ``sdpa_split``'s four do) at half the calls, with no V split and no concatenation."""
    d = q.shape[-1]
    (q1, q2), (k1, k2) = _split_pairs(q), _split_pairs(k)
    o1 = _sdpa(F.pad(q1, (0, d)), F.pad(k1, (0, d)), v, mask, is_causal, scale, 0.0)
    o2 = _sdpa(F.pad(q2, (0, d)), F.pad(k2, (0, d)), v, mask, is_causal, scale, 0.0)
    if o1.requires_grad or lam.requires_grad:
        return o1 - lam * o2
    return o1.sub_(o2.mul_(lam))  # inference: the first output holds the result, no third buffer


@backends.constant_under_compile  # asked while torch.compile traces a call: answered eagerly, once
def _triton_available() -> tuple[bool, str]:
    """Whether the Triton kernels can run here (:func:`diffattn_tutorial.kernels.triton.flash_diff.triton_available`)."""
    try:
        from diffattn_tutorial.kernels.triton.flash_diff import triton_available
    except ImportError as e:  # triton not installed (e.g. macOS)
        return False, f"triton is not importable ({e})"
    return triton_available()


def _needs_grad(*tensors: Optional[Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _run_naive(c: Call) -> Tensor:
    return _naive(c.q, c.k, c.v, c.lam, c.mask, c.scale, c.dropout_p)


def _run_chunked(c: Call) -> Tensor:
    return _chunked(c.q, c.k, c.v, c.lam, c.mask, c.scale, c.dropout_p, causal=c.causal)


def _on_sdpa(formulation):
    """A backend's ``run`` from an SDPA formulation ``f(q, k, v, lam, mask, is_causal, scale, dropout_p)``."""
    def run(c: Call) -> Tensor:
        return formulation(c.q, c.k, c.v, c.lam, c.mask, c.is_causal, c.scale, c.dropout_p)

    return run


def _run_triton(c: Call) -> Tensor:
    from diffattn_tutorial.kernels.triton.flash_diff import triton_diff_attention

    return triton_diff_attention(c.q, c.k, c.v, c.lam, causal=c.causal, attn_mask=c.mask, scale=c.scale)


def _sdpa_status(device: torch.device) -> tuple[bool, str]:
    return True, "torch.nn.functional.scaled_dot_product_attention"


def _triton_status(device: torch.device) -> tuple[bool, str]:
    ok, why = _triton_available()
    if ok and device.type == "cpu":
        why = "Triton interpreter (TRITON_INTERPRET=1): exact but slow, for learning and tests"
    return ok, why


_HALF = (torch.float32, torch.float16, torch.bfloat16)

DECODE_QUERIES = 1
"""On a CPU ``"auto"`` runs ``naive`` for calls with at most this many query rows: decoding one token, where the
fused kernel's per-call cost in the keys (it transposes all of K) and SDPA's padding are not repaid;
``benchmarks/bench_cpu_queries.py`` measures it (one query row over 4096 keys: ``naive`` several times faster)."""

# The library's backends, each declared once; "auto" ranks (lower first): on a CPU the fused kernel for what it
# takes, then sdpa_padded, then sdpa_wide (dropout); elsewhere sdpa_split, then sdpa_wide (dropout).
for _backend in (
    Backend("naive", "explicit maps `(A1 - lambda A2) V`: the teaching version", _run_naive,
            origin="unilm multihead_diffattn", auto_rank={"cpu": -1}, auto_max_queries=DECODE_QUERIES),
    Backend("sdpa_wide", "two SDPA calls with V of width 2d (timm, unilm `flashdiff_1`)", _on_sdpa(_sdpa_wide),
            family="sdpa", origin="timm, unilm multihead_flashdiff_1", causal="sdpa", status=_sdpa_status,
            sdpa_rank=1, auto_rank={"cpu": 2, backends.OTHER_DEVICES: 1}),
    Backend("sdpa_split", "four SDPA calls with V split in halves, equal head dims (unilm `flashdiff_2`): reaches "
            "fused kernels", _on_sdpa(_sdpa_split), dropout=False, family="sdpa",
            origin="unilm multihead_flashdiff_2", causal="sdpa", status=_sdpa_status, sdpa_rank=0,
            auto_rank={backends.OTHER_DEVICES: 0}),
    Backend("sdpa_stacked", "one SDPA call over 4H stacked heads (vasqu `multihead-sdpadiff`)",
            _on_sdpa(_sdpa_stacked), dropout=False, family="sdpa", origin="vasqu multihead-sdpadiff",
            causal="sdpa", status=_sdpa_status),
    Backend("sdpa_padded", "two SDPA calls with q and k zero-padded to width 2d (q.k unchanged), V whole: both reach "
            "the fused CPU kernel", _on_sdpa(_sdpa_padded), dropout=False, family="sdpa", causal="sdpa",
            status=_sdpa_status, auto_rank={"cpu": 1}),
    Backend("chunked", "the same arithmetic over cache-sized query chunks; causal chunks skip invisible keys",
            _run_chunked),
    Backend("triton", "the fused differential flash-attention kernel (`kernels/triton/flash_diff`), forward and backward; on a "
            "CPU only in Triton's interpreter, slowly", _run_triton, status=_triton_status, devices=("cuda", "cpu"),
            dtypes=_HALF, dropout=False, mask_grad=False, family="kernel",
            requires="Triton; on a CPU, TRITON_INTERPRET=1", causal="own", raw_mask=True),
):
    backends.register_backend(_backend)
del _backend


def diff_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lam: LambdaLike,
    *,
    causal: bool = False,
    attn_mask: Optional[Tensor] = None,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
) -> Tensor:
    """Differential attention: ``softmax(q1 k1^T s) v - lam * softmax(q2 k2^T s) v``.

    Args:
        q: ``(B, 2H, Nq, d)``, the two maps of differential head ``i`` at heads ``2i`` and ``2i+1``.
        k: ``(B, 2Hkv, Nk, d)``, the two key maps of KV group ``g`` at ``2g`` and ``2g+1``.
        v: ``(B, Hkv, Nk, 2d)``. Differential head ``i`` uses KV group ``i // (H // Hkv)`` for both maps.
        lam: a number, a 0-dim tensor, or a tensor broadcastable to ``(B, H, Nq, 1)`` (per head/token).
        causal: causal mask aligned bottom-right (query ``i`` sees keys ``j <= i + Nk - Nq``).
        attn_mask: bool (True = may attend) or additive float, broadcastable to ``(B, H, Nq, Nk)``;
            combined with ``causal``. Fully masked rows give zeros. An additive mask that requires grad
            (a learned bias) gets its gradient (``cpu_fused`` and ``triton`` refuse it by name).
        scale: softmax scale, default ``1/sqrt(d)``.
        dropout_p: dropout on the attention maps (training only; ``naive``/``chunked``/``sdpa_wide``).
            ``cpu_fused`` is float32-or-narrower (it computes in float32).
        backend: one of ``BACKENDS`` or ``"auto"``.

    Returns:
        ``(B, H, Nq, 2d)`` in the dtype of ``q``.
    """
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, one of {('auto',) + BACKENDS}")
    lam_t, mask, (B, H, Hkv, Nq, Nk, d) = check_diff_inputs(q, k, v, lam, attn_mask)
    _check_scale_dropout(scale, dropout_p)
    scale = d ** -0.5 if scale is None else float(scale)
    needs = Needs(dtype=q.dtype, grad=_needs_grad(q, k, v, lam_t), mask_grad=_needs_grad(mask),
                  dropout=dropout_p > 0, compiling=torch.compiler.is_compiling(), queries=Nq, head_dim=d)
    name = backends.resolve(backend, q.device, needs)
    if backend not in backends.ALIASES:  # asked for by name: refuse what it cannot do, naming the fix
        backends.check_call(name, q.device, needs)
    if Nk == 0 or q.numel() == 0:  # nothing to compute: an empty output, or zeros (no key to attend to)
        name = backends.REFERENCE
    b = backends.get_backend(name)
    is_causal = causal and b.applies_causal(Nq, Nk, mask is not None)
    full = None if is_causal and mask is None else _combine_masks(mask, causal, Nq, Nk, q.device)
    if not _may_hold_nonfinite(q, k, v):
        return _run_backend(b, q, k, v, lam_t, mask, full, causal, is_causal, scale, dropout_p)
    nan_rows = _rows_reading_nonfinite(q, k, v, full, is_causal)
    if is_causal or full is not None:  # hidden keys must stay harmless, whatever they hold
        k, v = _zero_nonfinite(k), _zero_nonfinite(v)
    out = _run_backend(b, q, k, v, lam_t, mask, full, causal, is_causal, scale, dropout_p)
    return out.masked_fill(nan_rows, float("nan"))  # the fused CPU kernels turn a NaN query row into numbers


def _run_backend(b: Backend, q: Tensor, k: Tensor, v: Tensor, lam: Tensor, mask: Optional[Tensor],
                 full: Optional[Tensor], causal: bool, is_causal: bool, scale: float, dropout_p: float) -> Tensor:
    """Backend ``b`` on validated inputs: ``mask`` the caller's 4-D mask, ``full`` it combined with ``causal``
    (None where the backend applies ``is_causal`` itself). Fully masked rows come back as zeros."""
    if b.raw_mask:  # its own causal masking and zero rows
        return b.run(Call(q, k, v, lam, mask, causal, is_causal, scale, dropout_p))
    full, valid = _fix_fully_masked(full)
    out = b.run(Call(q, k, v, lam, full, causal, is_causal, scale, dropout_p))
    return out if valid is None else out.masked_fill(~valid, 0.0)


def diff_attention_maps(
    q: Tensor,
    k: Tensor,
    lam: LambdaLike,
    *,
    causal: bool = False,
    attn_mask: Optional[Tensor] = None,
    scale: Optional[float] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The maps behind :func:`diff_attention`, for plots and metrics: ``(A1, A2, A1 - lam * A2)``.

    q ``(B, 2H, Nq, d)``, k ``(B, 2Hkv, Nk, d)``; each map is ``(B, H, Nq, Nk)``. Fully masked rows are 0.
    """
    _check_tensor("q", q, 4, "(B, 2H, Nq, d)")
    _check_tensor("k", k, 4, "(B, 2Hkv, Nk, d)")
    B, H2, Nq, d = q.shape
    v_dummy = q.new_empty(B, k.shape[1] // 2, k.shape[2], 2 * d)  # reuse the full validation
    lam_t, mask, _ = check_diff_inputs(q, k, v_dummy, lam, attn_mask)
    scale = d ** -0.5 if scale is None else float(scale)
    full, valid = _fix_fully_masked(_combine_masks(mask, causal, Nq, k.shape[2], q.device))
    maps = _dual_maps(q, expand_kv_groups(k, v_dummy, H2 // 2)[0], full, scale)
    if valid is not None:
        maps = maps.masked_fill(~valid.unsqueeze(2), 0.0)
    a1, a2 = maps[:, :, 0], maps[:, :, 1]
    return a1, a2, a1 - lam_t * a2


# --------------------------------------------------------------------------------------------
# plain softmax attention (baseline) and DIFF V2
# --------------------------------------------------------------------------------------------


def _plain(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], is_causal: bool, scale: float,
           dropout_p: float, backend: str) -> Tensor:
    if backend == "naive":
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = (q * scale) @ k.transpose(-1, -2)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        attn = torch.softmax(scores, dim=-1, dtype=_softmax_dtype(q)).to(q.dtype)
        if dropout_p > 0:
            attn = F.dropout(attn, p=dropout_p)
        return attn @ v
    return _sdpa(q, k, v, mask, is_causal, scale, dropout_p)


def _plain_backend(backend: str) -> str:
    if backend not in ("auto", "naive", "sdpa"):
        raise ValueError(f"unknown backend {backend!r} for plain attention; choose 'auto', 'naive' or 'sdpa'")
    return "sdpa" if backend == "auto" else backend


def softmax_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    attn_mask: Optional[Tensor] = None,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
) -> Tensor:
    """Plain scaled dot-product attention ``softmax(q k^T s) v`` with GQA.

    q ``(B, Hq, Nq, d)``, k ``(B, Hkv, Nk, d)``, v ``(B, Hkv, Nk, dv)``; query head ``j`` uses KV head
    ``j // (Hq // Hkv)``. Same mask conventions as :func:`diff_attention`; backends ``"naive"``,
    ``"sdpa"``, ``"auto"``. Returns ``(B, Hq, Nq, dv)``.
    """
    mask, (B, Hq, Nq, Nk, d) = _check_plain(q, k, v, attn_mask, "softmax_attention")
    _check_scale_dropout(scale, dropout_p)
    scale = d ** -0.5 if scale is None else float(scale)
    backend = _plain_backend(backend)
    is_causal = causal and mask is None and Nq == Nk and backend == "sdpa"
    full, valid = _fix_fully_masked(None if is_causal else _combine_masks(mask, causal, Nq, Nk, q.device))
    out = _plain(q, k, v, full, is_causal, scale, dropout_p, backend)
    return out if valid is None else out.masked_fill(~valid, 0.0)


def diff_attention_v2(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lam: LambdaLike,
    *,
    causal: bool = False,
    attn_mask: Optional[Tensor] = None,
    scale: Optional[float] = None,
    backend: str = "auto",
) -> Tensor:
    """DIFF V2: one ordinary attention call over 2H query heads, then ``heads 0::2 - lam * heads 1::2``.

    q ``(B, 2H, Nq, d)``, k and v ``(B, Hkv, Nk, d)``; lam (already ``sigmoid``-ed) broadcastable to
    ``(B, H, Nq, 1)``. Both heads of a pair must sit in one GQA group (``H % Hkv == 0``). Returns
    ``(B, H, Nq, d)``; ``attn_mask`` broadcasts to ``(B, H, Nq, Nk)`` and applies to both heads of a pair.
    """
    _check_tensor("q", q, 4, "(B, 2H, Nq, d)")
    if q.shape[1] % 2:
        raise ValueError(f"q has {q.shape[1]} heads, an odd number: DIFF V2 needs 2H query heads (pairs 2i, 2i+1)")
    H = q.shape[1] // 2
    mask_h = None
    if attn_mask is not None:  # validate against H heads, then repeat for the 2H query heads
        _check_tensor("k", k, 4, "(B, Hkv, Nk, d)")
        mask_h = _check_mask(attn_mask, (q.shape[0], H, q.shape[2], k.shape[2]), q)
        if mask_h.shape[1] != 1:
            mask_h = mask_h.repeat_interleave(2, dim=1)
    _, (B, Hq, Nq, Nk, d) = _check_plain(q, k, v, mask_h, "diff_attention_v2")
    if H % k.shape[1]:
        raise ValueError(f"H = {H} is not a multiple of Hkv = {k.shape[1]}: the two query heads of a pair would "
                         f"fall in different GQA groups; choose num_kv_heads dividing num_heads")
    lam_t = _check_lambda(lam, (B, H, Nq, 1), q)
    out = softmax_attention(q, k, v, causal=causal, attn_mask=mask_h, scale=scale, backend=backend)
    return out[:, 0::2] - lam_t * out[:, 1::2]
