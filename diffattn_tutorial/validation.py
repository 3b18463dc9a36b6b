"""Masks and the checks every public function runs on its inputs: shapes, dtypes, devices, lambda, masks.

Errors name the argument and the fix. A mask is bool (True = may attend) or additive float, broadcastable to
``(B, H, Nq, Nk)``; ``causal`` is aligned bottom-right (query ``i`` sees keys ``j <= i + Nk - Nq``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any, Optional, Union

import torch

Tensor = torch.Tensor
LambdaLike = Union[Tensor, float]


# --------------------------------------------------------------------------------------------
# masks
# --------------------------------------------------------------------------------------------


def causal_mask(nq: int, nk: int, device: Optional[torch.device] = None) -> Tensor:
    """Bool ``(nq, nk)`` causal mask, True = may attend, aligned **bottom-right**.

    Query ``i`` sees keys ``j <= i + (nk - nq)``: with a KV cache the newest query is the last key.
    (SDPA's ``is_causal=True`` aligns top-left, which differs when ``nq != nk``.)
    """
    i = torch.arange(nq, device=device)[:, None]
    j = torch.arange(nk, device=device)[None, :]
    return j <= i + (nk - nq)


def combine_masks(
    attn_mask: Optional[Tensor], causal: bool, nq: int, nk: int, device: torch.device
) -> Optional[Tensor]:
    """One 4-D mask (bool or additive float) from ``attn_mask`` and ``causal``; None if neither."""
    if causal:
        cm = causal_mask(nq, nk, device)[None, None]
        if attn_mask is None:
            return cm
        if attn_mask.dtype == torch.bool:
            return attn_mask & cm
        return attn_mask.masked_fill(~cm, float("-inf"))
    return attn_mask


def fix_fully_masked(mask: Optional[Tensor]) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """Make fully masked rows harmless: they attend everywhere, and are zeroed after attention.

    Returns ``(mask, valid)`` where ``valid`` is a bool ``(..., Nq, 1)`` tensor (None if every row
    has at least one key it may attend to). In an additive mask, ``-inf`` and entries ``<= finfo(dtype).min``
    (how Hugging Face models fill theirs) both mean masked, so a row of them is fully masked in every backend. A NaN
    entry is not masked: a row of NaN reads a NaN (a NaN row, as the fused kernels give it), not a masked row.
    """
    if mask is None:
        return None, None
    if mask.dtype == torch.bool:
        valid = mask.any(-1, keepdim=True)
    else:
        valid = ~(mask <= torch.finfo(mask.dtype).min).all(-1, keepdim=True)  # a NaN row is not masked: NaN out
    may_branch = not (torch.compiler.is_compiling() or under_torch_func())  # compiled, vmapped: always fix
    if may_branch and bool(valid.all()):
        return mask, None
    if mask.dtype == torch.bool:
        return mask | ~valid, valid
    return torch.where(valid, mask, torch.zeros((), dtype=mask.dtype, device=mask.device)), valid


def rows_reading_nonfinite(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], causal: bool) -> Tensor:
    """Bool ``(B, H, Nq, 1)``: the output rows that read a NaN or an infinity, through their own query (either
    map) or a key position they may attend to (in either key map or the value of their KV group there).

    ``mask`` is a 4-D bool/additive mask or None; ``causal`` adds the bottom-right causal mask (used only
    with ``mask=None``: a combined mask already holds it). O(N d), plus O(Nq Nk) where a mask is given.
    """
    q_nan = ~torch.isfinite(q).all(-1)  # (B, 2H, Nq)
    rows = q_nan[:, 0::2] | q_nan[:, 1::2]  # (B, H, Nq)
    H, nq, nk = rows.shape[1], q.shape[2], k.shape[2]
    k_nan = ~torch.isfinite(k).all(-1)  # (B, 2Hkv, Nk)
    key_nan = k_nan[:, 0::2] | k_nan[:, 1::2] | ~torch.isfinite(v).all(-1)  # (B, Hkv, Nk)
    key_nan = key_nan.repeat_interleave(H // v.shape[1], dim=1)  # (B, H, Nk)
    if mask is not None:
        visible = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min
        reads_key = (visible & key_nan.unsqueeze(2)).any(-1, keepdim=True)
        return (rows.unsqueeze(-1) & visible.any(-1, keepdim=True)) | reads_key  # a fully masked row reads nothing
    if causal:  # row i sees keys j <= i + Nk - Nq: it reads a NaN key iff the first one is among them
        first = torch.where(key_nan.any(-1), key_nan.int().argmax(-1), nk)  # (B, H)
        i = torch.arange(nq, device=q.device)
        sees = i + (nk - nq) >= 0  # Nq > Nk: the first rows see no key, are fully masked and read nothing
        return ((rows & sees) | (first.unsqueeze(-1) <= i + (nk - nq))).unsqueeze(-1)
    return (rows | key_nan.any(-1, keepdim=True)).unsqueeze(-1)


def under_torch_func() -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vmap``, ``jacrev``, ``jvp``, ...) is running, or a forward-mode
    derivative is being taken without one (a ``torch.autograd.forward_ad.dual_level``): the transforms' tensors have
    no memory of their own to hand a kernel, under ``vmap`` no branch may depend on their values, and a kernel handed
    a dual tensor's memory would drop its tangent. Asked of the transforms' stack, not of the tensors at hand (under
    ``grad`` even a fresh tensor is the transform's). While ``torch.compile`` traces, answered eagerly and kept as a
    constant (``backend_table.constant_under_compile``'s mark, set here below the backend table): a transform it
    traces is on that stack then too."""
    return torch._C._functorch.peek_interpreter_stack() is not None or forward_ad_active()


under_torch_func._dynamo_marked_constant = True


def forward_ad_active() -> bool:
    """Whether a forward-mode derivative may be taken (``torch.func.jvp``, ``jacfwd``, ``hessian``, or a
    ``torch.autograd.forward_ad.dual_level``): PyTorch opens a dual level for each."""
    return torch.autograd.forward_ad._current_level >= 0


def may_hold_nonfinite(*tensors: Tensor) -> bool:
    """False when every entry of ``tensors`` is finite: on a CPU one summing pass each (a NaN or an infinity
    anywhere makes the total non-finite; a sum that merely overflows only sends the call down the careful
    path). On other devices always True, so that no call waits for the device to answer, and under
    ``torch.compile`` and ``torch.func`` transforms (a ``.item()`` would break the graph or the ``vmap``)."""
    if tensors[0].device.type != "cpu" or torch.compiler.is_compiling() or under_torch_func():
        return True
    with torch.no_grad():
        return not bool(torch.isfinite(sum(t.sum(dtype=torch.float32) for t in tensors)))


def zero_nonfinite(t: Tensor) -> Tensor:
    """``t`` with NaN and infinite entries zeroed. Applied to k and v where a mask hides keys, so that a hidden
    one cannot reach a row through ``-inf + NaN``, ``inf - inf`` or ``0 * inf`` (the rows that do read it get
    NaN from :func:`rows_reading_nonfinite`)."""
    return torch.where(torch.isfinite(t), t, torch.zeros((), dtype=t.dtype, device=t.device))


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------


def check_tensor(name: str, t: object, ndim: int, layout: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {layout}, got {type(t).__name__}")
    if t.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}; convert with {name}.float()")
    return t


def check_same(q: Tensor, **others: Tensor) -> None:
    for name, t in others.items():
        if t.dtype != q.dtype:
            raise TypeError(f"q and {name} must share one dtype, got q {q.dtype} and {name} {t.dtype}; "
                            f"cast with {name}.to(q.dtype)")
        if t.device != q.device:
            raise ValueError(f"q and {name} must be on one device, got q on {q.device} and {name} on "
                             f"{t.device}; move with {name}.to(q.device)")


def broadcasts_to(t: Tensor, target: tuple[int, ...]) -> bool:
    """Whether ``t`` (of at most ``len(target)`` dims) broadcasts to exactly ``target``."""
    if t.ndim > len(target):
        return False
    return all(n == 1 or n == m for n, m in zip(reversed(t.shape), reversed(target)))  # aligned from the right


def check_mask(attn_mask: Optional[Tensor], target: tuple[int, int, int, int], q: Tensor) -> Optional[Tensor]:
    """Validate ``attn_mask`` against ``target = (B, H, Nq, Nk)``; return it as a 4-D view, or, for a float mask of
    another dtype than q's, a 4-D copy in q's dtype with its entries ``<= finfo(its dtype).min`` as ``-inf``."""
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, Tensor):
        raise TypeError(f"attn_mask must be a bool or float tensor, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise TypeError(f"attn_mask must be bool (True = may attend) or an additive float mask, got "
                        f"{attn_mask.dtype}; for a 0/1 mask use attn_mask.bool()")
    if attn_mask.device != q.device:
        raise ValueError(f"attn_mask is on {attn_mask.device} but q is on {q.device}; move it with "
                         f"attn_mask.to(q.device)")
    if not (attn_mask.ndim >= 1 and broadcasts_to(attn_mask, target)):
        raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                         f"(B, H, Nq, Nk) = {target}; give it shape (Nq, Nk), (B, 1, Nq, Nk) or "
                         f"(B, H, Nq, Nk) (padding masks: (B, 1, 1, Nk))")
    attn_mask = attn_mask.reshape((1,) * (4 - attn_mask.ndim) + tuple(attn_mask.shape))
    if attn_mask.is_floating_point() and attn_mask.dtype != q.dtype:
        low = attn_mask <= torch.finfo(attn_mask.dtype).min  # masked in its own dtype (a float16 model's fill value)
        attn_mask = attn_mask.to(q.dtype).masked_fill(low, float("-inf"))  # stays masked in q's
    return attn_mask


def check_lambda(lam: LambdaLike, target: tuple[int, int, int, int], q: Tensor) -> Tensor:
    """Validate ``lam`` (number, 0-dim tensor, or broadcastable to ``(B, H, Nq, 1)``); return a tensor."""
    if isinstance(lam, numbers.Real) and not isinstance(lam, bool):  # numpy's numbers too; np.bool_ is none
        return torch.tensor(float(lam), dtype=q.dtype, device=q.device)
    if not isinstance(lam, Tensor):
        raise TypeError(f"lam must be a float or a tensor, got {type(lam).__name__}")
    if not lam.is_floating_point():
        raise TypeError(f"lam must be a floating-point tensor, got {lam.dtype}; use lam.float()")
    if lam.ndim > 0 and lam.device != q.device:
        raise ValueError(f"lam is on {lam.device} but q is on {q.device}; move it with lam.to(q.device)")
    if not broadcasts_to(lam, target):
        raise ValueError(f"lam of shape {tuple(lam.shape)} does not broadcast to (B, H, Nq, 1) = {target}: "
                         f"use a scalar, one value per head (H, 1, 1), or one per token and head (B, H, Nq, 1)")
    if lam.ndim > 0:
        lam = lam.reshape((1,) * (4 - lam.ndim) + tuple(lam.shape))
    return lam.to(device=q.device, dtype=q.dtype)


def check_scale(scale: object, name: str = "scale") -> Optional[float]:
    """``scale`` as a float, or None: a finite positive number (a bool, ``inf`` or NaN would give 1.0 or NaN maps
    without a word). Every function that takes a softmax scale checks it here."""
    if scale is None:
        return None
    if isinstance(scale, (bool, torch.SymBool)) or type(scale).__name__ == "bool_" \
            or not isinstance(scale, (numbers.Real, torch.SymFloat, torch.SymInt)):
        raise TypeError(f"{name} must be a positive finite number or None (1/sqrt(d)), got {scale!r}")
    if isinstance(scale, numbers.Real) and not (_finite(scale) and scale > 0):
        raise ValueError(f"{name} must be a positive finite number or None (1/sqrt(d)), got {scale!r}")
    return scale


def _finite(x: numbers.Real) -> bool:
    """``math.isfinite`` that says False for an int too large for a float (it raises OverflowError there)."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def check_scale_dropout(scale: object, dropout_p: float) -> None:
    check_scale(scale)
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (numbers.Real, torch.SymFloat)):
        raise TypeError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if not (0.0 <= dropout_p < 1.0):
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")


def check_causal(causal: object) -> bool:
    """``causal`` as a bool (a traced one as it is): a bool, numpy's or 0/1. ``causal="no"`` would be truthy and run
    causal attention without a word. Every function and layer that takes ``causal`` checks it here."""
    if isinstance(causal, torch.SymBool):
        return causal
    numpy_bool = type(causal).__module__ == "numpy" and type(causal).__name__ in ("bool", "bool_")
    if isinstance(causal, bool) or numpy_bool or (isinstance(causal, int) and causal in (0, 1)):
        return bool(causal)
    raise TypeError(f"causal must be True or False, got {causal!r}")


def check_qkv(q: Tensor, k: Tensor, v: Tensor, q_layout: str, k_layout: str, v_layout: str) -> None:
    """q, k, v are 4-D tensors of one device and dtype family, with one batch size (the layouts name their dims)."""
    check_tensor("q", q, 4, q_layout)
    check_tensor("k", k, 4, k_layout)
    check_tensor("v", v, 4, v_layout)
    check_same(q, k=k, v=v)
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise ValueError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")


def check_diff_inputs(
    q: Tensor, k: Tensor, v: Tensor, lam: LambdaLike, attn_mask: Optional[Tensor] = None
) -> tuple[Tensor, Optional[Tensor], tuple[int, int, int, int, int, int]]:
    """Validate the inputs of :func:`~diffattn_tutorial.functional.diff_attention`.

    Returns ``(lam, attn_mask, (B, H, Hkv, Nq, Nk, d))`` with ``lam`` a tensor and ``attn_mask`` a 4-D view.
    Raises ``ValueError``/``TypeError`` naming the argument and the fix.
    """
    check_qkv(q, k, v, "(B, 2H, Nq, d)", "(B, 2Hkv, Nk, d)", "(B, Hkv, Nk, 2d)")
    B, H2, Nq, d = q.shape
    if H2 % 2:
        raise ValueError(f"q has {H2} heads, an odd number: differential attention needs 2H query heads, "
                         f"the two maps of head i at 2i and 2i+1 (did you pass baseline q with H heads?)")
    if k.shape[1] % 2:
        raise ValueError(f"k has {k.shape[1]} heads, an odd number: it needs 2Hkv key heads, two per KV group")
    if k.shape[3] != d:
        raise ValueError(f"q and k head dims differ: q {d}, k {k.shape[3]}")
    if d == 0:
        raise ValueError("q and k have head dim d = 0: give them at least one feature, q (B, 2H, Nq, d) and "
                         "k (B, 2Hkv, Nk, d) with d >= 1")
    if k.shape[1] == 0:
        raise ValueError("k has no heads (Hkv = 0): pass at least one KV group, k (B, 2Hkv, Nk, d) and "
                         "v (B, Hkv, Nk, 2d) with Hkv >= 1")
    if v.shape[1] * 2 != k.shape[1]:
        raise ValueError(f"v has {v.shape[1]} heads and k {k.shape[1]}: v must carry Hkv = {k.shape[1] // 2} "
                         f"heads of width 2d (one value head per pair of key heads)")
    if v.shape[3] != 2 * d:
        raise ValueError(f"v head dim must be 2d = {2 * d} (twice the q/k head dim), got {v.shape[3]}")
    if v.shape[2] != k.shape[2]:
        raise ValueError(f"k and v sequence lengths differ: k {k.shape[2]}, v {v.shape[2]}")
    H, Hkv, Nk = H2 // 2, v.shape[1], k.shape[2]
    if H % Hkv:
        raise ValueError(f"H = {H} differential heads is not a multiple of Hkv = {Hkv} KV groups: "
                         f"choose num_kv_heads dividing num_heads")
    lam_t = check_lambda(lam, (B, H, Nq, 1), q)
    mask = check_mask(attn_mask, (B, H, Nq, Nk), q)
    return lam_t, mask, (B, H, Hkv, Nq, Nk, d)


def check_plain(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], what: str) -> tuple:
    """The checks of :func:`~diffattn_tutorial.functional.softmax_attention` and ``diff_attention_v2`` (``what``
    names the caller): returns the 4-D mask and ``(B, Hq, Nq, Nk, d)``."""
    check_qkv(q, k, v, "(B, Hq, Nq, d)", "(B, Hkv, Nk, d)", "(B, Hkv, Nk, dv)")
    B, Hq, Nq, d = q.shape
    if k.shape[3] != d:
        raise ValueError(f"q and k head dims differ: q {d}, k {k.shape[3]}")
    if d == 0:
        raise ValueError("q and k have head dim d = 0: give them at least one feature (d >= 1)")
    if k.shape[1] == 0:
        raise ValueError("k and v have no heads (Hkv = 0): pass at least one KV head")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must share heads and length")
    if Hq % k.shape[1]:
        raise ValueError(f"{what}: {Hq} query heads is not a multiple of {k.shape[1]} KV heads; "
                         f"choose num_kv_heads dividing the query heads")
    mask = check_mask(attn_mask, (B, Hq, Nq, k.shape[2]), q)
    return mask, (B, Hq, Nq, k.shape[2], d)


def check_state_dict(state_dict: Any, loader: str) -> Mapping[str, Tensor]:
    """``state_dict`` when it is a mapping of names to tensors; else a ``TypeError`` saying what to pass (a path,
    a model or numpy arrays are not loaded here)."""
    how = ("pass a state dict of tensors, e.g. torch.load(path, weights_only=True) or "
           "safetensors.torch.load_file(path)")
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"{loader}(): got a {type(state_dict).__name__} ({str(state_dict)[:60]!r}), not a state dict; "
                        f"{how}")
    bad = [(k, v) for k, v in state_dict.items() if not isinstance(v, torch.Tensor)]
    if bad:
        k, v = bad[0]
        kind = f"{type(v).__module__}.{type(v).__name__}".removeprefix("builtins.")
        raise TypeError(f"{loader}(): {k!r} is a {kind}, not a tensor; {how} (numpy arrays: "
                        f"{{k: torch.from_numpy(v) for k, v in sd.items()}})")
    for k, v in state_dict.items():
        _check_state_entry(loader, k, v)
    return state_dict


def _check_state_entry(loader: str, k: Any, v: Tensor) -> None:
    """Refuse an entry that loading would turn into other numbers or no numbers without a word: a key that is not
    a name, a bool, integer or complex tensor (cast to 0/1, whole numbers, or its real part), a sparse one, or a meta
    tensor (no data)."""
    if not isinstance(k, str):
        raise TypeError(f"{loader}(): key {k!r} is not a string: a state dict maps parameter names to tensors")
    if v.layout != torch.strided:
        raise TypeError(f"{loader}(): {k!r} is a {v.layout} tensor; pass dense tensors ({{k: v.to_dense()}})")
    if v.is_meta:
        raise TypeError(f"{loader}(): {k!r} is a meta tensor (a shape without data); load the checkpoint's data "
                        f"(torch.load(path, weights_only=True), not a model built on the meta device)")
    if not v.is_floating_point():
        raise TypeError(f"{loader}(): {k!r} is {v.dtype}, but every weight here is floating-point: loading would "
                        f"cast it (a quantized or wrong checkpoint?); pass float32, float16 or bfloat16 weights")


def check_not_meta(module: torch.nn.Module, loader: str) -> None:
    """Refuse a module built on the meta device (a ``torch.device("meta")`` context around the loader): loading
    into it copies nothing, and it would come back with no weights."""
    if any(p.is_meta for p in module.parameters()):
        raise ValueError(f"{loader} built its module on the meta device (a torch.device('meta') context?): loading "
                         f"into it keeps no weights; call it outside that context")


__all__ = ["LambdaLike", "causal_mask", "combine_masks", "fix_fully_masked", "rows_reading_nonfinite",
           "under_torch_func", "forward_ad_active", "may_hold_nonfinite", "zero_nonfinite", "check_tensor",
           "check_same", "broadcasts_to", "check_mask", "check_lambda", "check_scale", "check_scale_dropout",
           "check_causal", "check_qkv", "check_diff_inputs", "check_plain", "check_state_dict", "check_not_meta"]
