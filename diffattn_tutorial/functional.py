"""Differential attention as plain functions: the public formulas of the notebooks.

Layout (the reference implementations' own, and the README's): queries and keys carry **2H heads**, the two maps of
differential head ``i`` adjacent (heads ``2i`` and ``2i+1``); values carry ``Hkv`` heads of width ``2d``.

>>> q = torch.randn(1, 4, 5, 8); k = torch.randn(1, 4, 5, 8); v = torch.randn(1, 2, 5, 16)
>>> diff_attention(q, k, v, torch.tensor(0.5)).shape
torch.Size([1, 2, 5, 16])

:func:`diff_attention` validates a call, chooses a backend (:mod:`diffattn_tutorial.backend_table` declares them,
:mod:`diffattn_tutorial.backends` chooses), and runs it. Its contract, the same for every backend: fully masked
query rows give **zero** (and zero gradients), never NaN; an additive mask entry ``<= torch.finfo(dtype).min``
counts as masked, like ``-inf``; an empty problem gives an empty output and ``Nk = 0`` gives zeros; a NaN or an
infinity in q, k or v makes exactly the output rows that read it NaN, and a key the mask hides never influences
the output; a learned additive mask gets its gradient. Also here: lambda and its re-parameterisations, RMSNorm,
the maps for plots (:func:`diff_attention_maps`), plain softmax attention and DIFF V2.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from diffattn_tutorial import backends
from diffattn_tutorial.backend_table import PLAIN_BACKENDS, REFERENCE, Backend, Call, Needs
from diffattn_tutorial.backends import (  # noqa: F401 (the functional API names them too)
    BACKENDS,
    FORWARD_ONLY,
    SDPA_FORMULATIONS,
    backend_status,
    resolve_backend,
)
from diffattn_tutorial.constants import LOG2E  # noqa: F401 (the functional API names it too)
from diffattn_tutorial.formulations import dual_maps, expand_kv_groups, sdpa, softmax_dtype
from diffattn_tutorial.validation import (  # noqa: F401 (causal_mask, check_diff_inputs: the functional API)
    LambdaLike,
    causal_mask,
    check_causal,
    check_diff_inputs,
    check_lambda,
    check_mask,
    check_plain,
    check_scale,
    check_scale_dropout,
    check_tensor,
    combine_masks,
    fix_fully_masked,
    may_hold_nonfinite,
    rows_reading_nonfinite,
    under_torch_func,
    zero_nonfinite,
)

Tensor = torch.Tensor


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


def rms_norm_scaled_(x: Tensor, weight: Optional[Tensor], eps: float, scale: float) -> Tensor:
    """``rms_norm(x, weight, eps) * scale`` written into ``x`` (float32, nothing needing its gradient): the same
    operations in the same order, so the same bits, without a temporary the size of ``x`` per step (a layer's
    inference calls it on the attention's fresh output)."""
    r = x.square().mean(-1, keepdim=True).add_(eps).rsqrt_()
    x.mul_(r)
    if weight is not None:
        x.mul_(weight)
    return x.mul_(scale)


class _RMSNormScaled(torch.autograd.Function):
    """``rms_norm(x, weight, eps) * scale`` for float32 ``x`` (and weight): the forward as :func:`rms_norm_scaled_`
    (the same bits as the formula), the backward written out. With ``r = rsqrt(mean(x^2) + eps)`` per row,
    ``xh = x r`` and ``a = g weight scale``::

        dx = r (a - xh mean(a xh))        dweight = scale * (sum over rows of g xh)

    Autograd's own backward of the formula makes about a dozen temporaries of ``x``'s size, and on a CPU each fresh
    one can cost more in page faults than its arithmetic; this one makes three and works in them in place. Under
    ``create_graph=True`` it recomputes ``r`` from ``x`` with differentiable operations, out of place, so second
    derivatives are exact too."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Optional[Tensor], eps: float, scale: float) -> Tensor:
        out = x.clone()  # keeps x's layout (the kernel's)
        r = out.square().mean(-1, keepdim=True).add_(eps).rsqrt_()  # (..., 1), as rms_norm_scaled_
        ctx.save_for_backward(x, weight, r)
        ctx.eps, ctx.scale = eps, scale
        out.mul_(r)
        if weight is not None:
            out.mul_(weight)
        return out.mul_(scale)

    @staticmethod
    def backward(ctx, g: Tensor):
        x, weight, r = ctx.saved_tensors
        ws = weight * ctx.scale if weight is not None else ctx.scale
        dims = tuple(range(g.ndim - 1))  # every dim but the last: the rows (none for a 1-D x: sum(()) sums all)
        rows_sum = (lambda t: t.sum(dims)) if dims else (lambda t: t)
        if torch.is_grad_enabled():  # create_graph: differentiable, out of place
            r = torch.rsqrt(x.square().mean(-1, keepdim=True) + ctx.eps)
            xh, a = x * r, g * ws
            dx = (a - xh * (a * xh).mean(-1, keepdim=True)) * r
            return dx, rows_sum(g * xh) * ctx.scale if ctx.needs_input_grad[1] else None, None, None
        xh, a = x * r, g * ws
        m = (a * xh).mean(-1, keepdim=True)  # (..., 1)
        dx = a.addcmul_(xh, m, value=-1).mul_(r)
        dw = rows_sum(xh.mul_(g)).mul_(ctx.scale) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None


def rms_norm_scaled(x: Tensor, weight: Optional[Tensor], eps: float, scale: float) -> Tensor:
    """``rms_norm(x, weight, eps) * scale`` with its gradients: the same forward bits, and for float32 (the
    layers' sub-norm in training) a backward in fewer passes (:class:`_RMSNormScaled`; not under ``torch.func``
    transforms, which take the formula's own operations)."""
    if x.dtype != torch.float32 or (weight is not None and weight.dtype != torch.float32) \
            or under_torch_func():  # torch.func transforms: the formula's own operations
        return rms_norm(x, weight, eps) * scale
    if weight is not None and weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm weight must have shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    return _RMSNormScaled.apply(x, weight, eps, scale)


# --------------------------------------------------------------------------------------------
# differential attention: prepare the call, run a backend
# --------------------------------------------------------------------------------------------


def diff_attention(q: Tensor, k: Tensor, v: Tensor, lam: LambdaLike, *, causal: bool = False,
                   attn_mask: Optional[Tensor] = None, scale: Optional[float] = None, dropout_p: float = 0.0,
                   backend: str = "auto") -> Tensor:
    """Differential attention: ``softmax(q1 k1^T s) v - lam * softmax(q2 k2^T s) v``.

    A second derivative (``create_graph=True`` and a gradient of the gradients, as a gradient penalty takes) needs
    ``backend="naive"``: the fused kernels, the CPU's and SDPA's, have no derivative of their backward.

    Args:
        q: ``(B, 2H, Nq, d)``, the two maps of differential head ``i`` at heads ``2i`` and ``2i+1``.
        k: ``(B, 2Hkv, Nk, d)``, the two key maps of KV group ``g`` at ``2g`` and ``2g+1``.
        v: ``(B, Hkv, Nk, 2d)``. Differential head ``i`` uses KV group ``i // (H // Hkv)`` for both maps.
        lam: a number, a 0-dim tensor, or a tensor broadcastable to ``(B, H, Nq, 1)`` (per head/token).
        causal: causal mask aligned bottom-right (query ``i`` sees keys ``j <= i + Nk - Nq``).
        attn_mask: bool (True = may attend) or additive float, broadcastable to ``(B, H, Nq, Nk)``;
            combined with ``causal``. Fully masked rows give zeros. An additive mask that requires grad
            (a learned bias) gets its gradient (backends that cannot give it refuse it by name).
        scale: softmax scale, default ``1/sqrt(d)``.
        dropout_p: dropout on the attention maps (training only; the backends that take it are in
            ``backend_status``).
        backend: one of ``BACKENDS`` or ``"auto"``.

    Returns:
        ``(B, H, Nq, 2d)`` in the dtype of ``q``.
    """
    b, call = _prepare(q, k, v, lam, causal, attn_mask, scale, dropout_p, backend)
    if b.nan_contract:  # the kernel scans as it reads and recomputes on the device only where it must
        return _run(b, call)
    if b.run_scanning is not None and call.q.device.type == "cpu" and not torch.compiler.is_compiling():
        out = _run(b, call, scanning=True)  # None where q, k or v holds a NaN or an infinity
        if out is not None:
            return out
    elif not may_hold_nonfinite(call.q, call.k, call.v):
        return _run(b, call)
    seen = _mask_with_causal(call) if b.raw_mask else call.mask
    nan_rows = rows_reading_nonfinite(call.q, call.k, call.v, seen, call.is_causal)
    if call.is_causal or seen is not None:  # hidden keys must stay harmless, whatever they hold
        call = call._replace(k=zero_nonfinite(call.k), v=zero_nonfinite(call.v))
    q = call.q  # its non-finite entries zeroed below: a fully masked row reads nothing, its gradient stays zero too
    out = _run(b, call._replace(q=zero_nonfinite(q))).masked_fill(nan_rows, float("nan"))
    return out + _nan_gradient_for_nonfinite(q, nan_rows) if q.requires_grad else out


def _nan_gradient_for_nonfinite(q: Tensor, nan_rows: Tensor) -> Tensor:
    """``(B, H, Nq, 1)``: NaN in the rows of a non-finite query entry that read it (``nan_rows``: the output already
    holds them as NaN; a fully masked row reads nothing and stays zero), 0 elsewhere, with a NaN gradient to exactly
    those entries of ``q``: the masked fill alone would give them a finite gradient, and a training step would go on
    with a NaN it cannot see."""
    bad = ~torch.isfinite(q) & nan_rows.repeat_interleave(2, dim=1)  # (B, 2H, Nq, d): both maps of a row that reads
    poison = torch.where(bad, q, 0.0) * torch.where(bad, float("nan"), 0.0)  # (B, 2H, Nq, d)
    B, H2, Nq, _ = q.shape
    return poison.sum(-1).view(B, H2 // 2, 2, Nq).sum(2).unsqueeze(-1)  # pairs 2i, 2i+1 -> head i


def _prepare(q: Tensor, k: Tensor, v: Tensor, lam: LambdaLike, causal: bool, attn_mask: Optional[Tensor],
             scale: Optional[float], dropout_p: float, backend: str) -> tuple[Backend, Call]:
    """Validate the inputs, choose the backend (refusing, naming the fix, what a named one cannot take) and build
    its :class:`~diffattn_tutorial.backend_table.Call`. Empty problems go to the reference backend."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, one of {('auto',) + BACKENDS}")
    causal = check_causal(causal)
    lam_t, mask, (B, H, Hkv, Nq, Nk, d) = check_diff_inputs(q, k, v, lam, attn_mask)
    check_scale_dropout(scale, dropout_p)
    needs = Needs(dtype=q.dtype, grad=_needs_grad(q, k, v, lam_t), mask_grad=_needs_grad(mask),
                  dropout=dropout_p > 0, compiling=torch.compiler.is_compiling(),
                  transforms=under_torch_func(), queries=Nq, head_dim=d)
    name = backends.resolve(backend, q.device, needs)
    b = backends.get_backend(REFERENCE if Nk == 0 or q.numel() == 0 else name)  # nothing to compute: zeros
    is_causal = causal and b.applies_causal(Nq, Nk, mask is not None)
    scale = d ** -0.5 if scale is None else float(scale)
    if needs.grad and not b.second_derivative and b.name not in _REFUSES_ITSELF and not (needs.compiling or
                                                                                      needs.transforms):
        q, k, v = _FirstDerivativeOnly.apply(_no_second_derivative(b.name, backend), q, k, v)
    call = Call(q, k, v, lam_t, mask, causal, None, is_causal, scale, dropout_p)
    return b, call if b.raw_mask else call._replace(mask=_mask_with_causal(call))


_REFUSES_ITSELF = frozenset({"cpu_fused"})
"""Backends without a second derivative whose backward refuses one by name itself (no guard, no cost per call)."""


def _no_second_derivative(name: str, asked: str) -> str:
    chosen = "" if asked == name else f" (backend={asked!r} chose it)"
    return (f"backend {name!r}{chosen} has no second derivative (a gradient of its gradients, as a gradient penalty "
            f"takes): its fused kernel's backward has none; use diff_attention(..., backend='naive') there")


class _FirstDerivativeOnly(torch.autograd.Function):
    """q, k, v as they are; where their gradients are built as a graph (``create_graph=True``), the gradients pass
    through :class:`_Refused`, so that differentiating them again names the fix before it reaches a fused kernel's
    backward, which has no derivative (PyTorch's own message names an internal operator)."""

    @staticmethod
    def forward(ctx, message: str, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        ctx.message = message
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, *grads: Optional[Tensor]) -> tuple:
        if torch.is_grad_enabled():  # create_graph
            grads = tuple(None if g is None else _Refused.apply(ctx.message, g) for g in grads)
        return (None, *grads)


class _Refused(torch.autograd.Function):
    """The identity, whose derivative raises ``message``."""

    @staticmethod
    def forward(ctx, message: str, g: Tensor) -> Tensor:
        ctx.message = message
        return g.view_as(g)

    @staticmethod
    def backward(ctx, _: Tensor):
        raise RuntimeError(ctx.message)


def _mask_with_causal(call: Call) -> Optional[Tensor]:
    """The caller's mask combined with the causal one; None where there is neither, or where the backend applies
    ``causal`` itself and there is no other mask."""
    if call.is_causal and call.attn_mask is None:
        return None
    return combine_masks(call.attn_mask, call.causal, call.q.shape[2], call.k.shape[2], call.q.device)


def _run(b: Backend, call: Call, scanning: bool = False) -> Optional[Tensor]:
    """Backend ``b`` on a prepared call; fully masked rows come back as zeros. ``scanning``: by its
    ``run_scanning``, None where an input is not finite."""
    run = b.run_scanning if scanning else b.run
    if b.raw_mask:  # its own causal masking and zero rows
        out = run(call)
        return None if scanning and out is None else backends.checked_output(b, call, out)
    mask, valid = fix_fully_masked(call.mask)
    out = run(call._replace(mask=mask))
    if scanning and out is None:
        return None
    out = backends.checked_output(b, call, out)
    return out if valid is None else out.masked_fill(~valid, 0.0)


def _needs_grad(*tensors: Optional[Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def diff_attention_maps(q: Tensor, k: Tensor, lam: LambdaLike, *, causal: bool = False,
                        attn_mask: Optional[Tensor] = None, scale: Optional[float] = None) -> tuple[Tensor, Tensor, Tensor]:
    """The maps behind :func:`diff_attention`, for plots and metrics: ``(A1, A2, A1 - lam * A2)``.

    q ``(B, 2H, Nq, d)``, k ``(B, 2Hkv, Nk, d)``; each map is ``(B, H, Nq, Nk)``. Fully masked rows are 0.
    """
    check_tensor("q", q, 4, "(B, 2H, Nq, d)")
    check_tensor("k", k, 4, "(B, 2Hkv, Nk, d)")
    causal = check_causal(causal)
    check_scale(scale)
    B, H2, Nq, d = q.shape
    v_dummy = q.new_empty(B, k.shape[1] // 2, k.shape[2], 2 * d)  # reuse the full validation
    lam_t, mask, _ = check_diff_inputs(q, k, v_dummy, lam, attn_mask)
    scale = d ** -0.5 if scale is None else float(scale)
    full, valid = fix_fully_masked(combine_masks(mask, causal, Nq, k.shape[2], q.device))
    maps = dual_maps(q, expand_kv_groups(k, v_dummy, H2 // 2)[0], full, scale)
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
        attn = torch.softmax(scores, dim=-1, dtype=softmax_dtype(q)).to(q.dtype)
        if dropout_p > 0:
            attn = F.dropout(attn, p=dropout_p)
        return attn @ v
    return sdpa(q, k, v, mask, is_causal, scale, dropout_p)


def _plain_backend(backend: str) -> str:
    return "sdpa" if backends.check_name(backend, PLAIN_BACKENDS) == "auto" else backend


def softmax_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, attn_mask: Optional[Tensor] = None,
                      scale: Optional[float] = None, dropout_p: float = 0.0, backend: str = "auto") -> Tensor:
    """Plain scaled dot-product attention ``softmax(q k^T s) v`` with GQA.

    q ``(B, Hq, Nq, d)``, k ``(B, Hkv, Nk, d)``, v ``(B, Hkv, Nk, dv)``; query head ``j`` uses KV head
    ``j // (Hq // Hkv)``. Same mask conventions as :func:`diff_attention`; backends ``"naive"``,
    ``"sdpa"``, ``"auto"``. Returns ``(B, Hq, Nq, dv)``.
    """
    mask, (B, Hq, Nq, Nk, d) = check_plain(q, k, v, attn_mask, "softmax_attention")
    causal = check_causal(causal)
    check_scale_dropout(scale, dropout_p)
    scale = d ** -0.5 if scale is None else float(scale)
    backend = _plain_backend(backend)
    is_causal = causal and mask is None and Nq == Nk and backend == "sdpa"
    full, valid = fix_fully_masked(None if is_causal else combine_masks(mask, causal, Nq, Nk, q.device))
    out = _plain(q, k, v, full, is_causal, scale, dropout_p, backend)
    return out if valid is None else out.masked_fill(~valid, 0.0)


def diff_attention_v2(q: Tensor, k: Tensor, v: Tensor, lam: LambdaLike, *, causal: bool = False,
                      attn_mask: Optional[Tensor] = None, scale: Optional[float] = None, backend: str = "auto") -> Tensor:
    """DIFF V2: one ordinary attention call over 2H query heads, then ``heads 0::2 - lam * heads 1::2``.

    q ``(B, 2H, Nq, d)``, k and v ``(B, Hkv, Nk, d)``; lam (already ``sigmoid``-ed) broadcastable to
    ``(B, H, Nq, 1)``. Both heads of a pair must sit in one GQA group (``H % Hkv == 0``). Returns
    ``(B, H, Nq, d)``; ``attn_mask`` broadcasts to ``(B, H, Nq, Nk)`` and applies to both heads of a pair.
    """
    check_tensor("q", q, 4, "(B, 2H, Nq, d)")
    causal = check_causal(causal)
    check_scale(scale)
    if q.shape[1] % 2:
        raise ValueError(f"q has {q.shape[1]} heads, an odd number: DIFF V2 needs 2H query heads (pairs 2i, 2i+1)")
    H = q.shape[1] // 2
    mask_h = None
    if attn_mask is not None:  # validate against H heads, then repeat for the 2H query heads
        check_tensor("k", k, 4, "(B, Hkv, Nk, d)")
        mask_h = check_mask(attn_mask, (q.shape[0], H, q.shape[2], k.shape[2]), q)
        if mask_h.shape[1] != 1:
            mask_h = mask_h.repeat_interleave(2, dim=1)
    _, (B, Hq, Nq, Nk, d) = check_plain(q, k, v, mask_h, "diff_attention_v2")
    if H % k.shape[1]:
        raise ValueError(f"H = {H} is not a multiple of Hkv = {k.shape[1]}: the two query heads of a pair would "
                         f"fall in different GQA groups; choose num_kv_heads dividing num_heads")
    lam_t = check_lambda(lam, (B, H, Nq, 1), q)
    out = softmax_attention(q, k, v, causal=causal, attn_mask=mask_h, scale=scale, backend=backend)
    return out[:, 0::2] - lam_t * out[:, 1::2]
