"""Load and export the reference implementations' weights, exactly, both ways.

Config keys are the reference constructors' own names (the ``config`` dict in each golden file):

* unilm ``MultiheadDiffAttn(embed_dim, depth, num_heads, num_kv_heads=None)`` (+ ``subln_affine``)
* timm ``DiffAttention(dim, num_heads, qkv_bias, qk_norm, proj_bias, depth, dual_lambda, ...)``
* unilm V2 ``MultiheadFlashDiffV2(use_diff_v2, d_model, num_heads, num_kv_heads, head_dim)``
* Hugging Face ``DiffLlamaAttention`` (``DiffLlamaConfig``: ``hidden_size``, ``num_attention_heads``,
  ``num_key_value_heads``, ``head_dim``, ``rms_norm_eps``, ``attention_bias``; ``layer_idx``)

>>> layer = from_unilm(state_dict, embed_dim=64, num_heads=4, depth=2)   # doctest: +SKIP
>>> to_unilm(layer).keys() == state_dict.keys()                          # doctest: +SKIP
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from diffattn_tutorial.functional import lambda_init_fn
from diffattn_tutorial.modules import DiffAttnV2, MultiheadDiffAttn
from diffattn_tutorial.rope import interleaved_to_half_split

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
        ("head_dim other than embed_dim // (2 * num_heads)", module.q_proj.out_features != module.embed_dim),
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
        ("head_dim other than dim // (2 * num_heads)", module.q_proj.out_features != module.embed_dim),
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


# --------------------------------------------------------------------------------------------
# Hugging Face transformers DiffLlama
# --------------------------------------------------------------------------------------------

_DIFFLLAMA_NAMES = {"out_proj": "o_proj"}
"""This library's parameter prefixes -> DiffLlama's (the others match)."""


def _diffllama_order(maps: int) -> Tensor:
    """Map order that turns DiffLlama's halves pairing into this library's adjacent one.

    DiffLlama pairs map ``i`` with map ``i + maps/2`` (``torch.chunk(..., 2, dim=heads)``); this library wants
    the two maps of a pair at ``2i`` and ``2i + 1``: ``[0, maps/2, 1, maps/2 + 1, ...]``.
    """
    half = maps // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten()


def _permute_maps(t: Tensor, order: Tensor, width: int) -> Tensor:
    """Reorder the ``width``-row blocks (one per map) of a projection weight ``(maps*width, in)`` or bias."""
    return t.unflatten(0, (-1, width))[order].flatten(0, 1)


def from_diffllama(state_dict: StateDict, *, layer_idx: int, hidden_size: int, num_attention_heads: int,
                   num_key_value_heads: Optional[int] = None, head_dim: Optional[int] = None,
                   rms_norm_eps: float = 1e-5, attention_bias: bool = False,
                   **module_kwargs) -> MultiheadDiffAttn:
    """A :class:`MultiheadDiffAttn` from Hugging Face ``DiffLlamaAttention`` weights, exactly.

    Config keys are ``DiffLlamaConfig``'s, with its defaults; ``layer_idx`` is 0-based as in transformers.
    DiffLlama counts single maps: ``num_attention_heads`` H gives ``H/2`` differential heads and
    ``num_key_value_heads`` Hkv gives ``Hkv/2`` KV pairs (both even). Its map ``i`` pairs with map ``i + H/2``;
    the rows of ``q_proj``, ``k_proj`` and ``v_proj`` are reordered into this library's adjacent pairs, so
    the layer computes the same function. Its forward takes ``rope=(cos, sin)`` of shape
    ``(N, head_dim/2)``: DiffLlama's ``position_embeddings`` ``(B, N, head_dim)`` are ``cat(f, f)``, pass
    ``(cos[0, :, :head_dim // 2], sin[0, :, :head_dim // 2])`` or ``rope_cos_sin(N, head_dim, base=rope_theta)``;
    RoPE is applied in DiffLlama's half-split layout. DiffLlama's eager additive mask ``(B, 1, N, N)`` (0 or
    ``finfo.min``, causal merged in) can be passed as ``attn_mask`` as it is. The sub-norm is DiffLlama's ``groupnorm``
    (RMSNorm over ``2 * head_dim``, eps ``rms_norm_eps``, no weight). Extra keyword arguments go to the module
    (e.g. ``backend``).

    Pass one attention layer's weights (``q_proj.weight``, ..., ``lambda_k2``): from a whole model's
    state_dict take the keys under ``model.layers.{layer_idx}.self_attn.``.
    """
    num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
    head_dim = hidden_size // num_attention_heads if head_dim is None else head_dim
    H, Hkv = num_attention_heads, num_key_value_heads
    if H <= 0 or Hkv <= 0 or H % 2 or Hkv % 2 or H % Hkv:
        raise ValueError(f"DiffLlama needs even num_attention_heads={H} and num_key_value_heads={Hkv}, the first a "
                         f"multiple of the second (both count single maps: H/2 differential heads, Hkv/2 KV pairs)")
    prefixed = sorted(k for k in state_dict if k.endswith("q_proj.weight") and k != "q_proj.weight")
    if prefixed and "q_proj.weight" not in state_dict:
        prefix = prefixed[0][: -len("q_proj.weight")]
        raise ValueError(f"state_dict keys start with {prefix!r}: pass one attention layer's weights, e.g. "
                         f"{{k.removeprefix({prefix!r}): v for k, v in sd.items() if k.startswith({prefix!r})}}")
    layer = MultiheadDiffAttn(hidden_size, H // 2, depth=layer_idx, num_kv_heads=Hkv // 2, head_dim=head_dim,
                              subln_affine=False, subln_eps=rms_norm_eps, qkv_bias=attention_bias,
                              out_bias=attention_bias, rope_interleaved=False, **module_kwargs)
    sd = _detached(state_dict)
    q_order, kv_order = _diffllama_order(H), _diffllama_order(Hkv)
    out: dict[str, Tensor] = {}
    for name, t in sd.items():
        proj, _, suffix = name.partition(".")
        if proj in ("q_proj", "k_proj", "v_proj") and suffix in ("weight", "bias") \
                and t.shape[0] == (H if proj == "q_proj" else Hkv) * head_dim:
            t = _permute_maps(t, q_order if proj == "q_proj" else kv_order, head_dim)
        out["out_proj." + suffix if proj == "o_proj" else name] = t
    _load(layer, out, "DiffLlama", _DIFFLLAMA_NAMES)
    return layer


def to_diffllama(module: MultiheadDiffAttn) -> dict[str, Tensor]:
    """``DiffLlamaAttention``'s state_dict (its names and map order) for a layer DiffLlama can express.

    DiffLlama has one paper lambda with ``lambda_init(layer_idx)`` (``layer_idx`` = the module's ``depth``),
    a sub-norm without weight, equal biases on all four projections or none, and no qk-norm. A layer built
    with interleaved (GPT-J) RoPE is exported with the rows of each q/k map permuted so that DiffLlama's
    half-split RoPE computes the same attention (for RoPE over the full head width).
    """
    if not isinstance(module, MultiheadDiffAttn):
        raise TypeError(f"to_diffllama expects a MultiheadDiffAttn, got {type(module).__name__}")
    has_bias = [p.bias is not None for p in (module.q_proj, module.k_proj, module.v_proj, module.out_proj)]
    problems = [what for what, bad in [
        ("lambda_mode='dual'", module.lambda_mode != "paper"),
        (f"lambda_init={module.lambda_init} other than lambda_init(layer_idx={module.depth})",
         module.lambda_mode == "paper" and module.lambda_init != lambda_init_fn(module.depth)),
        ("qk_norm", module.q_norm is not None), ("subln=False", module.subln is None),
        ("a sub-norm with an affine weight (DiffLlama's groupnorm has none)",
         module.subln is not None and module.subln.weight is not None),
        ("biases on some projections only", len(set(has_bias)) > 1),
        ("cross-attention kdim", module.kdim != module.embed_dim)] if bad]
    if problems:
        raise ValueError(f"DiffLlamaAttention has no {', '.join(problems)}: this layer cannot be exported")
    d = module.head_dim
    q_back = torch.argsort(_diffllama_order(2 * module.num_heads))
    kv_back = torch.argsort(_diffllama_order(2 * module.num_kv_heads))
    sd = _detached(module.state_dict())
    out = {name: sd.pop(name) for name in _LAMBDA_VECS}  # DiffLlama's order: lambdas, then q, k, v, o
    for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
        for suffix in ("weight", "bias"):
            name = f"{proj}.{suffix}"
            if name not in sd:
                continue
            t = sd.pop(name)
            if proj in ("q_proj", "k_proj") and module.rope_interleaved:
                t = interleaved_to_half_split(t, d)
            if proj != "out_proj":
                t = _permute_maps(t, q_back if proj == "q_proj" else kv_back, d)
            out[f"{_DIFFLLAMA_NAMES.get(proj, proj)}.{suffix}"] = t
    if sd:
        raise ValueError(f"cannot map {sorted(sd)} to DiffLlama names")
    return out
