"""Turn a trained baseline attention layer (or a whole :class:`~diffattn_tutorial.training.model.TinyLM`) into a
differential one: DIFF V2 exactly, the paper's V1 as closely as its form allows.

The options follow axolotl's ``diff-transformer`` conversion (``--mirror-weights``, ``--zero-init``,
``--split-heads``, ``--sublayer-norm``, a warm-up of the negative branch), each with what it preserves, with one
difference of layout: axolotl's ``--split-heads`` pairs the baseline's heads by halves (head ``i`` with head
``i + H/2``: its queries and keys are cut with ``chunk(2)`` and its values put side by side the same way), while
``heads="split"`` here pairs adjacent heads (``2i`` with ``2i + 1``), the layout of the course's V1 layers. Both
are a fixed choice of which baseline heads share a differential head; neither keeps the baseline's function.
Two words for "the same function" below: **exact** is bit for bit (``torch.equal``), **equal to float tolerance**
is within rounding (another order of the same operations, or a scale by ``1 / (1 - lambda)``):

* :func:`to_diff_v2` doubles the query heads: query head ``2i`` is the baseline's head ``i``, ``2i + 1`` the
  negative map (``negative="mirror"``: the same query, ``"zero"``: a zero query, whose map is uniform). Keys and
  values are the baseline's, so both heads of a pair stay in head ``i``'s GQA group. ``lambda_proj`` starts at
  zero, so lambda is ``sigmoid(0) = 1/2`` on every token; with a mirrored negative the head outputs
  ``a - a/2 = a/2`` and ``o_proj`` is ``out_proj * 2``: the same function, exact (every step only moves exponents).
* :func:`to_diff_v1` gives the paper's layer. ``heads="split"`` pairs baseline heads ``2i`` and ``2i + 1`` as the
  two maps of differential head ``i`` and copies every weight (the course's parameter-matched ``"diff"``);
  ``"double"`` keeps every baseline head as the positive map and adds a negative one. V1 applies one pair of maps
  to a value of width ``2d`` and divides each head by its RMS (the sub-norm), so a split conversion never keeps
  the baseline's function, and a doubled one keeps it only without the sub-norm: equal to float tolerance with a
  mirrored negative (its ``out_proj`` is divided by ``1 - lambda_init``, and V1 runs its own attention backend),
  exact with a zero negative under the warm-up.
* ``warmup=True`` multiplies lambda by a factor ``lambda_mix``, an optional buffer of the layers (0 at conversion,
  raised to 1 by :func:`set_warmup` during fine-tuning, removed by :func:`finish_warmup`): at 0 the negative branch
  is off and the layer is the baseline.

Q/K/V biases (Qwen2's) go with their rows (a mirrored negative's bias is the positive's, a zero negative's is
zero) and RoPE is applied by the model, whatever its frequencies (Llama 3's scaling included): neither changes
what is exact. An output-projection bias is refused (DIFF V2's ``o_proj`` has none).
:func:`why_not_exact` says, in one sentence, why an option set cannot reproduce the baseline (None if it does);
the tests and notebook 14 assert outputs equal to float tolerance where it returns None (notebook 14 also names
the exact ones) and measure the gap where it does not.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import numbers
from typing import Optional

import torch
import torch.nn as nn

from diffattn_tutorial.layers.attention import DiffAttnV2, MultiheadAttention, MultiheadDiffAttn

Tensor = torch.Tensor

NEGATIVES: tuple[str, ...] = ("mirror", "zero")
"""How the negative map starts: a copy of the positive query (and key, V1), or zeros (a uniform map)."""

V1_HEADS: tuple[str, ...] = ("split", "double")
"""V1 head layouts: baseline heads paired up (H/2 differential heads), or each baseline head doubled (H)."""

OPTIONS: dict[str, tuple[str, ...]] = {"diff_v2": ("negative", "warmup"), "diff": ("heads", "negative", "subln", "warmup")}
"""The options each target takes (:func:`to_diff_v2` and :func:`to_diff_v1`), checked by :func:`conversion_options`."""

V2_LAMBDA_AT_CONVERSION = 0.5
"""``sigmoid(0)``: DIFF V2's lambda on every token once ``lambda_proj`` is zero."""


def conversion_options(attention: str, **options) -> dict:
    """The full option set of a conversion to ``attention`` (``"diff_v2"`` or ``"diff"``), defaults filled in and
    every value checked, the one place that does: an unknown option is a ``TypeError``, a bad value or a
    contradiction (a split V1 with a negative) a ``ValueError`` naming it. An option given as None is unset."""
    if attention not in OPTIONS:
        raise ValueError(f"attention must be 'diff' (V1) or 'diff_v2', got {attention!r}")
    known = {k for names in OPTIONS.values() for k in names}  # another target's option left None is unset
    unknown = sorted(k for k, v in options.items() if k not in OPTIONS[attention] and not (v is None and k in known))
    if unknown:
        raise TypeError(f"unknown option(s) {unknown} for attention={attention!r}: it takes "
                        f"{', '.join(OPTIONS[attention])} (layers.convert)")
    given = {k: v for k, v in options.items() if v is not None}
    out = {"warmup": False, **({"heads": "split", "subln": True} if attention == "diff" else {}), **given}
    for name in ("warmup", "subln"):
        if name in out and not isinstance(out[name], bool):
            raise ValueError(f"{name} must be True or False, got {out[name]!r}")
    if attention == "diff_v2":
        out["negative"] = _check_negative(out.get("negative", "mirror"))
        return out
    if out["heads"] not in V1_HEADS:
        raise ValueError(f"heads must be one of {V1_HEADS}, got {out['heads']!r}")
    if out["heads"] == "double":
        out["negative"] = _check_negative(out.get("negative", "mirror"))
    elif out.setdefault("negative", None) is not None:
        raise ValueError("heads='split' takes the negative maps from the baseline's odd heads: leave negative=None "
                         "(or use heads='double' with negative='mirror' or 'zero')")
    return out


def why_not_exact(attention: str, **options) -> Optional[str]:
    """None when the conversion (``attention`` and the options :func:`to_diff_v2` / :func:`to_diff_v1` take)
    computes the baseline's function at conversion, else the reason in one sentence; options the converters refuse
    are refused here too (:func:`conversion_options`). The answer holds for a baseline with q/k/v biases and for
    any RoPE frequencies (Llama 3's scaling included): biases move with their rows, RoPE is the model's."""
    opt = conversion_options(attention, **options)
    negative, warmup = opt["negative"], opt["warmup"]
    if attention == "diff_v2":
        if negative == "mirror" or warmup:
            return None
        return "a zero negative query gives a uniform map, and lambda = sigmoid(0) = 0.5 subtracts half the mean value"
    if opt["heads"] == "split":
        return ("V1 applies one pair of maps to a value of width 2d; the baseline gives each half of it its own map"
                + (", and the sub-norm divides each head by its RMS" if opt["subln"] else ""))
    if opt["subln"]:
        return "the sub-norm divides each head's output by its RMS per token, which the baseline does not"
    if negative == "zero" and not warmup:
        return "a zero negative query and key give a uniform map, subtracted with weight lambda"
    return None


def _check_baseline(layer: nn.Module) -> MultiheadAttention:
    if not isinstance(layer, MultiheadAttention):
        raise TypeError(f"convert a MultiheadAttention (the baseline layer), got {type(layer).__name__}")
    if layer.kdim != layer.embed_dim:
        raise ValueError(f"a cross-attention baseline (kdim={layer.kdim}, embed_dim={layer.embed_dim}) does not "
                         f"convert: the converted layers take their keys and values from x (self-attention); "
                         f"convert a self-attention layer (kdim=None)")
    if layer.out_proj.bias is not None:
        raise ValueError("the baseline's out_proj has a bias, which the converted layers' output does not have: "
                         "convert a baseline built with bias=False or out_bias=False (projection biases on q/k/v "
                         "alone, Qwen2's, convert)")
    if len({p.bias is None for p in (layer.q_proj, layer.k_proj, layer.v_proj)}) != 1:
        raise ValueError("the baseline has biases on some of q/k/v only; the converted layers take all three or "
                         "none (qkv_bias)")
    return layer


def _qkv_bias(layer: MultiheadAttention) -> bool:
    return layer.q_proj.bias is not None


def _copy_bias(new: nn.Linear, bias: Optional[Tensor]) -> None:
    """Copy ``bias`` (rows laid out as the weight's) into ``new.bias`` when the baseline has one."""
    if bias is not None:
        new.bias.copy_(bias)


def _check_negative(negative: Optional[str]) -> str:
    if negative not in NEGATIVES:
        raise ValueError(f"negative must be one of {NEGATIVES}, got {negative!r}")
    return negative


def _heads(w: Tensor, d: int) -> Tensor:
    """``(heads * d, C) -> (heads, d, C)``: the rows of a projection, one block per head."""
    return w.unflatten(0, (-1, d))


def _pair(positive: Tensor, negative: str, d: int) -> Tensor:
    """Rows ``(heads * d, C)`` -> ``(2 * heads * d, C)`` with head ``2i`` = head ``i`` and ``2i + 1`` its negative."""
    pos = _heads(positive, d)
    neg = pos if negative == "mirror" else torch.zeros_like(pos)
    return torch.stack([pos, neg], dim=1).flatten(0, 2)  # (heads, 2, d, C) -> (2 heads d, C)


def _start_warmup(layer: nn.Module) -> None:
    """Give a converted layer the warm-up factor ``lambda_mix`` = 0 (its optional buffer, None otherwise)."""
    layer.lambda_mix = torch.zeros((), device=layer.q_proj.weight.device)


@torch.no_grad()
def to_diff_v2(layer: MultiheadAttention, *, negative: str = "mirror", warmup: bool = False) -> DiffAttnV2:
    """A :class:`DiffAttnV2` (H output heads, 2H query heads) made from a baseline layer; see the module doc.

    ``o_proj = out_proj / (1 - lambda)`` for a mirrored negative (lambda = 0.5, or 0 under ``warmup``), so the
    conversion is exact; a zero negative is exact under ``warmup`` only. Keys, values and GQA groups are kept.
    DIFF V2 has no attention dropout: a baseline with dropout is refused rather than converted without it.
    """
    base, opt = _check_baseline(layer), conversion_options("diff_v2", negative=negative, warmup=warmup)
    if base.dropout:
        raise ValueError(f"DiffAttnV2 has no attention dropout, so the baseline's dropout={base.dropout} would be "
                         f"dropped: set layer.dropout = 0.0 to convert without it, or convert to V1 (to_diff_v1)")
    d, w = base.head_dim, base.q_proj.weight
    new = DiffAttnV2(base.embed_dim, base.num_heads, num_kv_heads=base.num_kv_heads, head_dim=d, backend=base.backend,
                     rope_interleaved=base.rope_interleaved, qkv_bias=_qkv_bias(base), device=w.device, dtype=w.dtype)
    lam = 0.0 if opt["warmup"] else V2_LAMBDA_AT_CONVERSION
    new.q_proj.weight.copy_(_pair(w, opt["negative"], d))
    new.k_proj.weight.copy_(base.k_proj.weight)
    new.v_proj.weight.copy_(base.v_proj.weight)
    if _qkv_bias(base):  # each bias row goes with its weight row: the negative's is mirrored (or zero) too
        new.q_proj.bias.copy_(_pair(base.q_proj.bias, opt["negative"], d))
        _copy_bias(new.k_proj, base.k_proj.bias)
        _copy_bias(new.v_proj, base.v_proj.bias)
    new.o_proj.weight.copy_(base.out_proj.weight / (1 - lam) if opt["negative"] == "mirror" else base.out_proj.weight)
    new.lambda_proj.weight.zero_()
    if opt["warmup"]:
        _start_warmup(new)
    return new


@torch.no_grad()
def to_diff_v1(layer: MultiheadAttention, *, depth: int, heads: str = "split", negative: Optional[str] = None,
               subln: bool = True, warmup: bool = False) -> MultiheadDiffAttn:
    """The paper's :class:`MultiheadDiffAttn` made from a baseline layer at block ``depth``; see the module doc.

    ``heads="split"``: baseline heads ``2i`` and ``2i + 1`` become maps 1 and 2 of differential head ``i`` and
    every weight is copied as it is (no ``negative``; needs an even head count and no GQA, where one KV group
    would have to feed two keys). ``heads="double"``: map 1 of head ``i`` is baseline head ``i``, map 2 is
    ``negative`` (``"mirror"`` or ``"zero"``, on q and k), its value ``[v, v]`` of width ``2d`` whose second half
    ``out_proj`` starts by ignoring; GQA groups kept. The lambda vectors start as equal pairs
    (``lambda_q2 = lambda_q1``, ``lambda_k2 = lambda_k1``), so lambda is exactly ``lambda_init(depth)``, and
    ``out_proj`` is divided by ``1 - lambda`` for a mirrored negative. ``subln``: the paper's sub-norm. The
    baseline's attention dropout is kept.
    """
    base = _check_baseline(layer)
    opt = conversion_options("diff", heads=heads, negative=negative, subln=subln, warmup=warmup)
    heads, negative = opt["heads"], opt["negative"]
    H, Hkv, d, w = base.num_heads, base.num_kv_heads, base.head_dim, base.q_proj.weight
    if heads == "split" and (H % 2 or Hkv != H):
        raise ValueError(f"heads='split' needs an even head count without GQA (num_heads={H}, num_kv_heads={Hkv}): "
                         f"the two maps of a V1 head read two different keys of one group; use heads='double'")
    n_diff, n_kv = (H // 2, Hkv // 2) if heads == "split" else (H, Hkv)
    new = MultiheadDiffAttn(base.embed_dim, n_diff, depth=depth, num_kv_heads=n_kv, head_dim=d, subln=opt["subln"],
                            dropout=base.dropout, backend=base.backend, rope_interleaved=base.rope_interleaved,
                            qkv_bias=_qkv_bias(base), device=w.device, dtype=w.dtype)
    new.lambda_q2.copy_(new.lambda_q1)
    new.lambda_k2.copy_(new.lambda_k1)
    if opt["warmup"]:
        _start_warmup(new)
    if heads == "split":  # the baseline's layout is already V1's: q/k heads 2i, 2i+1 are the maps of head i
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(new, name).weight.copy_(getattr(base, name).weight)
            _copy_bias(getattr(new, name), getattr(base, name).bias)
        new.out_proj.weight.copy_(base.out_proj.weight)
        return new
    lam = 0.0 if opt["warmup"] else new.lambda_init
    new.q_proj.weight.copy_(_pair(w, negative, d))
    new.k_proj.weight.copy_(_pair(base.k_proj.weight, negative, d))
    v = _heads(base.v_proj.weight, d)
    new.v_proj.weight.copy_(torch.cat([v, v], dim=1).flatten(0, 1))  # (Hkv, 2d, C): value [v, v] per group
    if _qkv_bias(base):  # bias rows follow their weight rows
        new.q_proj.bias.copy_(_pair(base.q_proj.bias, negative, d))
        new.k_proj.bias.copy_(_pair(base.k_proj.bias, negative, d))
        vb = _heads(base.v_proj.bias, d)
        new.v_proj.bias.copy_(torch.cat([vb, vb], dim=1).flatten())
    o = base.out_proj.weight.unflatten(1, (H, d))  # (C, H, d)
    scale = 1 / (1 - lam) if negative == "mirror" else 1.0
    new.out_proj.weight.copy_(torch.cat([o * scale, torch.zeros_like(o)], dim=2).flatten(1))  # (C, H, 2d)
    return new


def convert_layer(layer: MultiheadAttention, attention: str, *, depth: int = 0, **options) -> nn.Module:
    """:func:`to_diff_v2` (``attention="diff_v2"``) or :func:`to_diff_v1` (``"diff"``) with ``options``."""
    opt = conversion_options(attention, **options)
    if attention == "diff_v2":
        return to_diff_v2(layer, **opt)
    return to_diff_v1(layer, depth=depth, **opt)


def _converted_config(cfg, attention: str, heads: Optional[str]):
    """``cfg`` with ``attention`` renamed. A doubled V1 model keeps its baseline's head counts, which ``LMConfig``
    refuses for ``"diff"`` when odd (a ``TinyLM(cfg)`` halves them): its config then says ``"diff"`` without that
    check, and describes the model but cannot rebuild it (see :func:`convert_model`)."""
    if attention != "diff" or heads != "double":
        return dataclasses.replace(cfg, attention=attention)
    new = copy.copy(cfg)
    object.__setattr__(new, "attention", attention)  # LMConfig is frozen; its other fields are the baseline's
    return new


def convert_model(model: nn.Module, attention: str, **options) -> nn.Module:
    """A converted copy of a baseline ``TinyLM`` (any model with ``blocks[i].attn`` and a ``cfg`` dataclass):
    every attention layer through :func:`convert_layer` (``depth`` = block index), ``cfg.attention`` renamed.

    The copy's other weights are copies of the original's: build the optimizer on the converted model (one built
    before keeps stepping the original's parameters, which the copy's gradients never reach). ``heads="double"``
    gives layers of other shapes than ``TinyLM(cfg)`` builds (any head count converts, as with :func:`to_diff_v1`):
    to load a saved copy, convert the same baseline again and ``load_state_dict``.
    """
    opt = conversion_options(attention, **options)
    if getattr(model.cfg, "attention", None) != "baseline":
        raise ValueError(f"convert a baseline model (cfg.attention == 'baseline'), got {model.cfg.attention!r}")
    new = copy.deepcopy(model)
    for depth, block in enumerate(new.blocks):
        block.attn = convert_layer(block.attn, attention, depth=depth, **opt)
    new.cfg = _converted_config(model.cfg, attention, opt.get("heads"))
    return new


def _warmup_named(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, (DiffAttnV2, MultiheadDiffAttn)) and m.lambda_mix is not None]


def warmup_layers(model: nn.Module) -> list[nn.Module]:
    """The layers of ``model`` (or ``model`` itself) in a warm-up: a lambda with the factor ``lambda_mix``."""
    return [m for _, m in _warmup_named(model)]


def set_warmup(model: nn.Module, mix: float) -> None:
    """Set every warm-up layer's ``lambda_mix`` (0: negative branch off, 1: the plain differential layer); a model
    with no warm-up layer is refused (its negative branch is on whatever ``mix`` says)."""
    if isinstance(mix, bool) or not isinstance(mix, numbers.Real) or not 0 <= mix <= 1:
        raise ValueError(f"mix must be a number in [0, 1], got {mix!r}")
    layers = warmup_layers(model)
    if not layers:
        raise ValueError(f"this {type(model).__name__} has no warm-up layer (no lambda_mix), so its negative branch "
                         f"stays on: convert with warmup=True to warm it up")
    for layer in layers:
        layer.lambda_mix.fill_(mix)


@torch.no_grad()
def finish_warmup(model: nn.Module) -> nn.Module:
    """End the warm-up of every warm-up layer of ``model`` (or of ``model``, a layer), its ``lambda_mix`` at 1: the
    factor is removed, the layer and its parameters stay the same objects (an optimizer keeps training them), and
    the function is the same; exports through :mod:`diffattn_tutorial.interop` refuse a layer in warm-up."""
    warm = _warmup_named(model)
    for name, layer in warm:
        if float(layer.lambda_mix) != 1.0:
            raise ValueError(f"{name or type(layer).__name__}: lambda_mix is {float(layer.lambda_mix):g}; finish the "
                             f"warm-up (set_warmup(model, 1.0)) first")
    for _, layer in warm:
        layer.lambda_mix = None
    return model


def warmup_mix(step: int, warmup_steps: int) -> float:
    """Linear warm-up of the negative branch: ``min(1, step / warmup_steps)`` (1 when ``warmup_steps`` is 0), in
    ``[0, 1]``: a ``step`` or ``warmup_steps`` that is not a finite number >= 0 is refused by name."""
    for name, value in (("step", step), ("warmup_steps", warmup_steps)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a number (the fine-tune's step count / its warm-up length), got "
                            f"{type(value).__name__} {value!r}")
        if not 0 <= value < math.inf:
            raise ValueError(f"{name} must be >= 0 and finite (the fine-tune's step count / its warm-up length), "
                             f"got {value!r}")
    return 1.0 if warmup_steps == 0 else min(1.0, step / warmup_steps)


__all__ = ["NEGATIVES", "V1_HEADS", "OPTIONS", "V2_LAMBDA_AT_CONVERSION", "conversion_options", "why_not_exact",
           "to_diff_v2", "to_diff_v1", "convert_layer", "convert_model", "warmup_layers", "set_warmup", "finish_warmup",
           "warmup_mix"]
