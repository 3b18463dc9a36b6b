"""Load and export the reference implementations' weights, exactly, both ways.

Config keys are the reference constructors' own names (the ``config`` dict in each golden file):

* unilm ``MultiheadDiffAttn(embed_dim, depth, num_heads, num_kv_heads=None)`` (+ ``subln_affine``)
* timm ``DiffAttention(dim, num_heads, qkv_bias, qk_norm, proj_bias, depth, dual_lambda, ...)``
* unilm V2 ``MultiheadFlashDiffV2(use_diff_v2, d_model, num_heads, num_kv_heads, head_dim)``

>>> layer = from_unilm(state_dict, embed_dim=64, num_heads=4, depth=2)   # doctest: +SKIP
>>> to_unilm(layer).keys() == state_dict.keys()                          # doctest: +SKIP
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from diffattn_tutorial.modules import DiffAttnV2, MultiheadDiffAttn

Tensor = torch.Tensor
StateDict = Mapping[str, Tensor]
_LAMBDA_VECS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


_TIMM_NAMES = {"q_proj": "qkv (first third)", "k_proj": "qkv (second third)", "v_proj": "qkv (last third)",
               "out_proj": "proj", "subln": "sub_norm"}
"""This library's parameter prefixes -> timm ``DiffAttention``'s, for error messages that name the checkpoint."""


def _source_name(name: str, names: Mapping[str, str]) -> str:
    prefix, _, rest = name.partition(".")
    return f"{names[prefix]}.{rest}" if prefix in names else name


def _load(module: torch.nn.Module, sd: dict[str, Tensor], source: str, names: Mapping[str, str] = {}) -> None:
    """Load ``sd`` into ``module`` strictly; errors name the checkpoint's own keys (``names`` maps this
    library's prefixes to the checkpoint's) and say which config to check."""
    own = module.state_dict()
    missing = sorted(_source_name(k, names) for k in own if k not in sd)
    unexpected = sorted(_source_name(k, names) for k in sd if k not in own)
    if missing or unexpected:
        raise ValueError(f"{source} state_dict does not match this config: missing {missing}, unexpected "
                         f"{unexpected}; check the config (e.g. subln_affine, qk_norm, dual_lambda, biases) "
                         f"against the checkpoint")
    wrong = [f"{_source_name(k, names)}: checkpoint {tuple(sd[k].shape)}, this config {tuple(v.shape)}"
             for k, v in own.items() if sd[k].shape != v.shape]
    if wrong:
        raise ValueError(f"{source} state_dict has other shapes than this config: {'; '.join(wrong)}; check the "
                         f"sizes in the config (embed_dim / dim / d_model, num_heads, num_kv_heads, head_dim)")
    module.load_state_dict(sd, strict=True)


def _detached(sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in sd.items()}


def from_unilm(state_dict: StateDict, *, embed_dim: int, num_heads: int, depth: int,
               num_kv_heads: Optional[int] = None, subln_affine: bool = True, **module_kwargs) -> MultiheadDiffAttn:
    """A :class:`MultiheadDiffAttn` from unilm ``multihead_diffattn.py`` / ``multihead_flashdiff_*.py`` weights.

    Names match one to one (``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``, ``lambda_*``, ``subln``).
    Extra keyword arguments go to the module (e.g. ``backend``).
    """
    layer = MultiheadDiffAttn(embed_dim, num_heads, depth=depth, num_kv_heads=num_kv_heads,
                              subln_affine=subln_affine, **module_kwargs)
    _load(layer, _detached(state_dict), "unilm")
    return layer


def to_unilm(module: MultiheadDiffAttn) -> dict[str, Tensor]:
    """unilm's state_dict for a layer that unilm can express (no biases, no qk-norm, paper lambda)."""
    if not isinstance(module, MultiheadDiffAttn):
        raise TypeError(f"to_unilm expects a MultiheadDiffAttn, got {type(module).__name__}")
    problems = [what for what, bad in [
        ("projection biases", module.q_proj.bias is not None or module.out_proj.bias is not None),
        ("qk_norm", module.q_norm is not None), ("lambda_mode='dual'", module.lambda_mode != "paper"),
        ("subln=False", module.subln is None), ("cross-attention kdim", module.kdim != module.embed_dim)] if bad]
    if problems:
        raise ValueError(f"unilm's MultiheadDiffAttn has no {', '.join(problems)}: this layer cannot be exported")
    return _detached(module.state_dict())


def from_timm(state_dict: StateDict, *, dim: int, num_heads: int = 8, depth: int = 0, dual_lambda: bool = False,
              qk_norm: bool = False, qkv_bias: bool = False, proj_bias: bool = True, scale_norm: bool = False,
              attn_drop: float = 0.0, **module_kwargs) -> MultiheadDiffAttn:
    """A :class:`MultiheadDiffAttn` from timm ``DiffAttention`` weights (fused ``qkv`` split in three).

    timm's ``q_norm``/``k_norm`` are ``RmsNorm(head_dim)`` with eps 1e-6 and its ``sub_norm`` is affine.
    """
    if scale_norm:
        raise ValueError("timm's scale_norm=True (a norm before proj) is not supported; load with scale_norm=False")
    layer = MultiheadDiffAttn(dim, num_heads, depth=depth, lambda_mode="dual" if dual_lambda else "paper",
                              qk_norm=qk_norm, qk_norm_eps=1e-6, subln_affine=True, qkv_bias=qkv_bias,
                              out_bias=proj_bias, dropout=attn_drop, **module_kwargs)
    sd = _detached(state_dict)
    out: dict[str, Tensor] = {}
    for suffix in ("weight", "bias"):
        if f"qkv.{suffix}" in sd:
            q, k, v = sd.pop(f"qkv.{suffix}").chunk(3, dim=0)
            out.update({f"q_proj.{suffix}": q, f"k_proj.{suffix}": k, f"v_proj.{suffix}": v})
        if f"proj.{suffix}" in sd:
            out[f"out_proj.{suffix}"] = sd.pop(f"proj.{suffix}")
    if "sub_norm.weight" in sd:
        out["subln.weight"] = sd.pop("sub_norm.weight")
    out.update(sd)  # lambda_*, q_norm.weight, k_norm.weight keep their names
    _load(layer, out, "timm", _TIMM_NAMES)
    return layer


def to_timm(module: MultiheadDiffAttn) -> dict[str, Tensor]:
    """timm ``DiffAttention``'s state_dict for a compatible layer (MHA self-attention, affine sub-norm)."""
    if not isinstance(module, MultiheadDiffAttn):
        raise TypeError(f"to_timm expects a MultiheadDiffAttn, got {type(module).__name__}")
    problems = [what for what, bad in [
        ("GQA (num_kv_heads < num_heads)", module.num_kv_heads != module.num_heads),
        ("cross-attention kdim", module.kdim != module.embed_dim),
        ("a sub-norm without affine weight", module.subln is None or module.subln.weight is None)] if bad]
    if problems:
        raise ValueError(f"timm's DiffAttention has no {', '.join(problems)}: this layer cannot be exported")
    sd = _detached(module.state_dict())
    out: dict[str, Tensor] = {}
    for name in ("lambda_a", "lambda_b", *_LAMBDA_VECS):
        if name in sd:
            out[name] = sd.pop(name)
    for suffix in ("weight", "bias"):
        if f"q_proj.{suffix}" in sd:
            out[f"qkv.{suffix}"] = torch.cat([sd.pop(f"{p}_proj.{suffix}") for p in "qkv"], dim=0)
    for name in ("q_norm.weight", "k_norm.weight"):
        if name in sd:
            out[name] = sd.pop(name)
    for suffix in ("weight", "bias"):
        if f"out_proj.{suffix}" in sd:
            out[f"proj.{suffix}"] = sd.pop(f"out_proj.{suffix}")
    out["sub_norm.weight"] = sd.pop("subln.weight")
    if sd:
        raise ValueError(f"cannot map {sorted(sd)} to timm names")
    return out


def from_unilm_v2(state_dict: StateDict, *, d_model: int, num_heads: int, num_kv_heads: Optional[int] = None,
                  head_dim: Optional[int] = None, use_diff_v2: bool = True, **module_kwargs) -> DiffAttnV2:
    """A :class:`DiffAttnV2` from unilm ``MultiheadFlashDiffV2`` weights (names match one to one)."""
    if not use_diff_v2:
        raise ValueError("use_diff_v2=False is unilm's baseline layer: load it into "
                         "diffattn_tutorial.modules.MultiheadAttention instead")
    layer = DiffAttnV2(d_model, num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, **module_kwargs)
    _load(layer, _detached(state_dict), "unilm V2")
    return layer


def to_unilm_v2(module: DiffAttnV2) -> dict[str, Tensor]:
    """unilm ``MultiheadFlashDiffV2``'s state_dict for a :class:`DiffAttnV2`."""
    if not isinstance(module, DiffAttnV2):
        raise TypeError(f"to_unilm_v2 expects a DiffAttnV2, got {type(module).__name__}")
    return _detached(module.state_dict())
