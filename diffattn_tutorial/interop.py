"""Load and export the reference implementations' weights, exactly, both ways.

Config keys are the reference constructors' own names (the ``config`` dict in each golden file):

* unilm ``MultiheadDiffAttn(embed_dim, depth, num_heads, num_kv_heads=None)`` (+ ``subln_affine``)
* timm ``DiffAttention(dim, num_heads, qkv_bias, qk_norm, proj_bias, depth, dual_lambda, ...)``
* unilm V2 ``MultiheadFlashDiffV2(use_diff_v2, d_model, num_heads, num_kv_heads, head_dim)``
* Hugging Face ``DiffLlamaAttention`` (``DiffLlamaConfig``: ``hidden_size``, ``num_attention_heads``,
  ``num_key_value_heads``, ``head_dim``, ``rms_norm_eps``, ``attention_bias``, ``attention_dropout``;
  ``layer_idx``), or a whole config as transformers gives it (``config=model.config``,
  ``**model.config.to_dict()``)
* Hugging Face ``LlamaForCausalLM``, a whole model into the course's ``TinyLM`` (:func:`from_llama`; ``LlamaConfig``
  keys, ``config=model.config``)

This library's layers keep their reference's names, so two spellings of one thing live side by side:
:class:`MultiheadDiffAttn` (V1) has ``embed_dim`` and ``out_proj`` as unilm V1, :class:`DiffAttnV2` has ``d_model``
and ``o_proj`` as unilm V2 (both loaded one to one); timm's ``dim``, fused ``qkv`` and ``proj`` and DiffLlama's
``hidden_size`` and ``o_proj`` are mapped onto V1's names here.

A key none of these loaders knows is refused with the valid names (a misspelled key must not fall back to a
default); errors about weights name the checkpoint's own keys (timm's fused ``qkv.weight`` with its rows).

>>> layer = from_unilm(state_dict, embed_dim=64, num_heads=4, depth=2)   # doctest: +SKIP
>>> to_unilm(layer).keys() == state_dict.keys()                          # doctest: +SKIP
"""

from __future__ import annotations

import difflib
import inspect
import math
from typing import Any, Callable, Mapping, Optional

import torch

from diffattn_tutorial.functional import lambda_init_fn
from diffattn_tutorial.layers.attention import DiffAttnV2, MultiheadDiffAttn
from diffattn_tutorial.layers.rope import half_split_to_interleaved, interleaved_to_half_split
from diffattn_tutorial.validation import check_not_meta, check_state_dict

Tensor = torch.Tensor
StateDict = Mapping[str, Tensor]
_LAMBDA_VECS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


_TIMM_NAMES = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "out_proj": "proj", "subln": "sub_norm"}
"""This library's parameter prefixes -> timm ``DiffAttention``'s, for error messages that name the checkpoint."""


def _source_name(name: str, names: Mapping[str, str]) -> str:
    prefix, _, rest = name.partition(".")
    return f"{names[prefix]}.{rest}" if prefix in names else name


def _load(module: torch.nn.Module, sd: dict[str, Tensor], source: str, names: Mapping[str, str] = {},
          shape_names: Mapping[str, str] = {}) -> None:
    """Load ``sd`` into ``module`` strictly; errors name the checkpoint's own keys (``names`` maps this
    library's prefixes to the checkpoint's; ``shape_names`` names a part of a checkpoint tensor, such as
    ``"qkv.weight rows 0:64 (q)"``, in shape errors) and say which config to check."""
    check_not_meta(module, source)
    own = module.state_dict()
    missing = sorted({_source_name(k, names) for k in own if k not in sd})
    unexpected = sorted({_source_name(k, names) for k in sd if k not in own})
    if missing or unexpected:
        raise ValueError(f"{source} state_dict does not match this config: missing {missing}, unexpected "
                         f"{unexpected}; check the config (e.g. subln_affine, qk_norm, dual_lambda, biases) "
                         f"against the checkpoint")
    wrong = [f"{shape_names.get(k, _source_name(k, names))}: checkpoint {tuple(sd[k].shape)}, this config "
             f"{tuple(v.shape)}" for k, v in own.items() if sd[k].shape != v.shape]
    if wrong:
        raise ValueError(f"{source} state_dict has other shapes than this config: {'; '.join(wrong)}; check the "
                         f"sizes in the config (embed_dim / dim / d_model, num_heads, num_kv_heads, head_dim)")
    module.load_state_dict(sd, strict=True)


def _module_options(cls: type, taken: tuple[str, ...]) -> list[str]:
    """The keyword arguments of ``cls`` a caller may pass through a ``from_*`` loader (``taken``: those the
    loader sets itself)."""
    params = inspect.signature(cls.__init__).parameters
    return [n for n, p in params.items() if p.kind == p.KEYWORD_ONLY and n not in taken]


def _check_options(loader: Callable, module_kwargs: Mapping[str, Any], cls: type, taken: tuple[str, ...]) -> None:
    """Refuse keyword arguments that are neither the reference's config keys nor module options, naming the
    valid keys (and the closest one: a misspelled key must not be dropped silently)."""
    options = _module_options(cls, taken)
    unknown = [k for k in module_kwargs if k not in options]
    if not unknown:
        return
    params = inspect.signature(loader).parameters
    config = [n for n, p in params.items() if p.kind == p.KEYWORD_ONLY]
    hints = [f"{k!r} (did you mean {close[0]!r}?)" if close else repr(k)
             for k in unknown for close in [difflib.get_close_matches(k, config + options, n=1)]]
    raise TypeError(f"{loader.__name__}() got unknown config key(s) {', '.join(hints)}; its config keys are "
                    f"{', '.join(config)}, and the module options {', '.join(options)}")


def _detached(sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in sd.items()}


def _check_exportable(module: object, cls: type, exporter: str) -> None:
    """Refuse what ``exporter`` cannot export: another class than ``cls``, or a converted layer still in its
    negative-branch warm-up (``layers.convert``): no reference has the factor ``lambda_mix`` on its lambda, so its
    export would compute another function."""
    if not isinstance(module, cls):
        raise TypeError(f"{exporter} expects a {cls.__name__}, got {type(module).__name__}")
    if getattr(module, "lambda_mix", None) is not None:
        raise ValueError(f"this {type(module).__name__} is in its negative-branch warm-up (lambda_mix = "
                         f"{float(module.lambda_mix):g}); export it after diffattn_tutorial.layers.convert."
                         f"finish_warmup(model), which needs lambda_mix = 1")


def from_unilm(state_dict: StateDict, *, embed_dim: int, num_heads: int, depth: int,
               num_kv_heads: Optional[int] = None, subln_affine: bool = True, **module_kwargs) -> MultiheadDiffAttn:
    """A :class:`MultiheadDiffAttn` from unilm ``multihead_diffattn.py`` / ``multihead_flashdiff_*.py`` weights.

    Names match one to one (``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``, ``lambda_*``, ``subln``).
    Extra keyword arguments go to the module (e.g. ``backend``).
    """
    state_dict = check_state_dict(state_dict, "from_unilm")
    _check_options(from_unilm, module_kwargs, MultiheadDiffAttn, ("depth", "num_kv_heads", "subln_affine"))
    layer = MultiheadDiffAttn(embed_dim, num_heads, depth=depth, num_kv_heads=num_kv_heads,
                              subln_affine=subln_affine, **module_kwargs)
    _load(layer, _detached(state_dict), "unilm")
    return layer


def to_unilm(module: MultiheadDiffAttn) -> dict[str, Tensor]:
    """unilm's state_dict for a layer that unilm can express (no biases, no qk-norm, paper lambda with its
    ``lambda_init(depth)``); a half-split (NeoX) RoPE layer's q/k rows are reordered to unilm's interleaved layout."""
    _check_exportable(module, MultiheadDiffAttn, "to_unilm")
    problems = [what for what, bad in [
        ("head_dim other than embed_dim // (2 * num_heads)", module.q_proj.out_features != module.embed_dim),
        ("projection biases", module.q_proj.bias is not None or module.out_proj.bias is not None),
        ("qk_norm", module.q_norm is not None), ("lambda_mode='dual'", module.lambda_mode != "paper"),
        ("subln=False", module.subln is None), ("cross-attention kdim", module.kdim != module.embed_dim),
        _lambda_init_override(module)] if bad]
    if problems:
        raise ValueError(f"unilm's MultiheadDiffAttn has no {', '.join(problems)}: this layer cannot be exported")
    return _interleaved_rope_rows(module, _detached(module.state_dict()))


def _lambda_init_override(module: MultiheadDiffAttn) -> tuple[str, bool]:
    """A problem entry for exporters whose reference computes ``lambda_init`` from the depth and has no place for
    another value (unilm's and timm's ``MultiheadDiffAttn`` / ``DiffAttention``)."""
    return (f"lambda_init={module.lambda_init:g} other than lambda_init(depth={module.depth}) (the reference computes "
            f"it from the depth and stores no other)", module.lambda_init != lambda_init_fn(module.depth))


def _interleaved_rope_rows(module: torch.nn.Module, sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """``sd`` with the q/k rows of a half-split (NeoX) RoPE layer reordered to the references' interleaved (GPT-J)
    layout, so the reference rotates the same pairs of dims (for RoPE over the whole head width, as the course's
    tables give it); a layer with interleaved RoPE as it is."""
    if module.rope_interleaved:
        return sd
    for name in ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias"):
        if name in sd:
            sd[name] = half_split_to_interleaved(sd[name], module.head_dim)
    return sd


def from_timm(state_dict: StateDict, *, dim: int, num_heads: int = 8, depth: int = 0, dual_lambda: bool = False,
              qk_norm: bool = False, qkv_bias: bool = False, proj_bias: bool = True, scale_norm: bool = False,
              attn_drop: float = 0.0, **module_kwargs) -> MultiheadDiffAttn:
    """A :class:`MultiheadDiffAttn` from timm ``DiffAttention`` weights (fused ``qkv`` split in three).

    timm's ``q_norm``/``k_norm`` are ``RmsNorm(head_dim)`` with eps 1e-6 and its ``sub_norm`` is affine.
    """
    state_dict = check_state_dict(state_dict, "from_timm")
    if scale_norm:
        raise ValueError("timm's scale_norm=True (a norm before proj) is not supported; load with scale_norm=False")
    taken = ("depth", "lambda_mode", "qk_norm", "qk_norm_eps", "subln_affine", "qkv_bias", "out_bias", "dropout")
    _check_options(from_timm, module_kwargs, MultiheadDiffAttn, taken)
    layer = MultiheadDiffAttn(dim, num_heads, depth=depth, lambda_mode="dual" if dual_lambda else "paper",
                              qk_norm=qk_norm, qk_norm_eps=1e-6, subln_affine=True, qkv_bias=qkv_bias,
                              out_bias=proj_bias, dropout=attn_drop, **module_kwargs)
    sd = _detached(state_dict)
    out: dict[str, Tensor] = {}
    shape_names: dict[str, str] = {}
    for suffix in ("weight", "bias"):
        if f"qkv.{suffix}" in sd:
            parts = _split_timm_qkv(sd.pop(f"qkv.{suffix}"), suffix, layer, dim, num_heads)
            for (p, (rows, t)) in zip("qkv", parts.items()):
                out[f"{p}_proj.{suffix}"] = t
                shape_names[f"{p}_proj.{suffix}"] = f"qkv.{suffix} rows {rows} ({p})"
        if f"proj.{suffix}" in sd:
            out[f"out_proj.{suffix}"] = sd.pop(f"proj.{suffix}")
    if "sub_norm.weight" in sd:
        out["subln.weight"] = sd.pop("sub_norm.weight")
    out.update(sd)  # lambda_*, q_norm.weight, k_norm.weight keep their names
    _load(layer, out, "timm", _TIMM_NAMES, shape_names)
    return layer


def _split_timm_qkv(t: Tensor, suffix: str, layer: MultiheadDiffAttn, dim: int, num_heads: int) -> dict[str, Tensor]:
    """timm's fused ``qkv.weight`` ``(3 * dim, dim)`` (or ``qkv.bias``) as ``{"0:dim": q, "dim:2dim": k, ...}``,
    the row ranges keyed as the checkpoint holds them; a row count other than this config's names the key, its
    rows and the config to check (``torch.chunk`` would split it unevenly without a word)."""
    widths = [layer.q_proj.out_features, layer.k_proj.out_features, layer.v_proj.out_features]
    if t.shape[0] != sum(widths):
        have = t.shape[0] // 3 if t.shape[0] % 3 == 0 else None
        split = (f"rows 0:{have} (q), {have}:{2 * have} (k), {2 * have}:{3 * have} (v) for dim={have}"
                 if have else "not three equal parts")
        raise ValueError(f"timm state_dict qkv.{suffix} has {t.shape[0]} rows ({split}); this config "
                         f"(dim={dim}, num_heads={num_heads}) needs {sum(widths)}: rows 0:{widths[0]} (q), "
                         f"{widths[0]}:{widths[0] + widths[1]} (k), {widths[0] + widths[1]}:{sum(widths)} (v); "
                         f"check dim against the checkpoint")
    bounds = [0, widths[0], widths[0] + widths[1], sum(widths)]
    return {f"{a}:{b}": t[a:b] for a, b in zip(bounds, bounds[1:])}


def to_timm(module: MultiheadDiffAttn) -> dict[str, Tensor]:
    """timm ``DiffAttention``'s state_dict for a compatible layer (MHA self-attention, affine sub-norm, lambda_init
    from the depth); a half-split (NeoX) RoPE layer's q/k rows are reordered to the interleaved layout."""
    _check_exportable(module, MultiheadDiffAttn, "to_timm")
    problems = [what for what, bad in [
        ("GQA (num_kv_heads < num_heads)", module.num_kv_heads != module.num_heads),
        ("head_dim other than dim // (2 * num_heads)", module.q_proj.out_features != module.embed_dim),
        ("cross-attention kdim", module.kdim != module.embed_dim),
        ("a sub-norm without affine weight", module.subln is None or module.subln.weight is None),
        _lambda_init_override(module)] if bad]
    if problems:
        raise ValueError(f"timm's DiffAttention has no {', '.join(problems)}: this layer cannot be exported")
    sd = _interleaved_rope_rows(module, _detached(module.state_dict()))
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
    state_dict = check_state_dict(state_dict, "from_unilm_v2")
    if not use_diff_v2:
        raise ValueError("use_diff_v2=False is unilm's baseline layer: load it into "
                         "diffattn_tutorial.layers.attention.MultiheadAttention instead")
    _check_options(from_unilm_v2, module_kwargs, DiffAttnV2, ("num_kv_heads", "head_dim"))
    layer = DiffAttnV2(d_model, num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, **module_kwargs)
    _load(layer, _detached(state_dict), "unilm V2")
    return layer


def to_unilm_v2(module: DiffAttnV2) -> dict[str, Tensor]:
    """unilm ``MultiheadFlashDiffV2``'s state_dict for a :class:`DiffAttnV2`; a half-split (NeoX) RoPE layer's q/k
    rows are reordered to unilm's interleaved layout."""
    _check_exportable(module, DiffAttnV2, "to_unilm_v2")
    return _interleaved_rope_rows(module, _detached(module.state_dict()))


# --------------------------------------------------------------------------------------------
# Hugging Face transformers DiffLlama
# --------------------------------------------------------------------------------------------

_DIFFLLAMA_NAMES = {"out_proj": "o_proj"}
"""This library's parameter prefixes -> DiffLlama's (the others match)."""


def diffllama_order(maps: int) -> Tensor:
    """Map order that turns DiffLlama's halves pairing into this library's adjacent one.

    DiffLlama pairs map ``i`` with map ``i + maps/2`` (``torch.chunk(..., 2, dim=heads)``); this library wants
    the two maps of a pair at ``2i`` and ``2i + 1``: ``[0, maps/2, 1, maps/2 + 1, ...]``.
    """
    half = maps // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten()


def permute_maps(t: Tensor, order: Tensor, width: int) -> Tensor:
    """Reorder the ``width``-row blocks (one per map) of a projection weight ``(maps*width, in)`` or bias."""
    return t.unflatten(0, (-1, width))[order].flatten(0, 1)


_DIFFLLAMA_LAYER_KEYS: dict[str, Any] = {
    "hidden_size": None, "num_attention_heads": None, "num_key_value_heads": None, "head_dim": None,
    "rms_norm_eps": 1e-5, "attention_bias": False, "attention_dropout": 0.0}
"""The ``DiffLlamaConfig`` keys that shape one attention layer, with transformers' defaults (None: required, or
derived as transformers derives it)."""

_DIFFLLAMA_MODEL_KEYS = frozenset({
    "vocab_size", "intermediate_size", "num_hidden_layers", "hidden_act", "max_position_embeddings",
    "initializer_range", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings",
    "rope_theta", "rope_scaling", "rope_parameters", "lambda_std_dev", "model_type", "transformers_version",
    "architectures", "torch_dtype", "_name_or_path"})
"""``DiffLlamaConfig`` keys that concern the whole model, not one attention layer: accepted and ignored
(``rope_*`` and ``max_position_embeddings`` set the RoPE tables the forward takes, ``lambda_std_dev`` only the
initialisation)."""

_DIFFLLAMA_TAKEN = ("depth", "num_kv_heads", "head_dim", "subln_affine", "subln_eps", "qkv_bias", "out_bias",
                    "rope_interleaved", "dropout")
"""The :class:`MultiheadDiffAttn` options :func:`from_diffllama` sets itself."""


def _check_number(key: str, value: Any, what: str, ok: Callable[[float], bool]) -> None:
    """Refuse a config value that is not a real number (a string, a bool) or that ``ok`` refuses (NaN fails every
    comparison), naming the key: it would fail later inside the layer or give NaN."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise ValueError(f"{key} must be {what}, got {value!r}")


def diffllama_layer_config(config: Any = None, **kwargs) -> dict[str, Any]:
    """The attention-layer keys of a DiffLlama config, with transformers' defaults filled in.

    ``config``: a ``DiffLlamaConfig`` (anything with ``to_dict()``) or its dict; ``kwargs``: config keys given
    one by one (``**config.to_dict()`` works too). Keys that concern the whole model are ignored; once the keys
    come from a whole transformers config (``config=`` or a ``model_type`` key), so are transformers' generic
    ones (``id2label``, ``return_dict``, ...). A key given loose that DiffLlamaConfig does not have is refused
    with the valid names (a misspelled ``num_key_value_head`` must not fall back to the default). Module
    options (``backend``, ``device``, ``dtype`` as a ``torch.dtype``) are left out here: see
    :func:`from_diffllama`.
    """
    whole = {}
    if config is not None:
        if hasattr(config, "to_dict"):
            whole = dict(config.to_dict())
        elif isinstance(config, Mapping):
            whole = dict(config)
        else:
            raise TypeError(f"config must be a DiffLlamaConfig (or anything with to_dict()) or its dict, got "
                            f"{type(config).__name__}")
    clash = [k for k in kwargs if k in whole and whole[k] != kwargs[k] and k in _DIFFLLAMA_LAYER_KEYS]
    if clash:
        raise ValueError(f"from_diffllama: {', '.join(f'{k}={kwargs[k]!r} contradicts config.{k}={whole[k]!r}' for k in clash)}; "
                         f"give each key once")
    model_type = kwargs.get("model_type", whole.get("model_type"))
    if model_type not in (None, "diffllama"):
        raise ValueError(f"this is a {model_type!r} config, not DiffLlama's (model_type 'diffllama'): "
                         f"from_diffllama loads DiffLlamaAttention weights only")
    from_transformers = config is not None or "model_type" in kwargs
    unknown = [k for k in kwargs if k not in _DIFFLLAMA_LAYER_KEYS and k not in _DIFFLLAMA_MODEL_KEYS]
    if unknown and not from_transformers:
        valid = list(_DIFFLLAMA_LAYER_KEYS)
        hints = [f"{k!r} (did you mean {close[0]!r}?)" if close else repr(k)
                 for k in unknown for close in [difflib.get_close_matches(k, valid, n=1)]]
        raise TypeError(f"from_diffllama() got unknown config key(s) {', '.join(hints)}; DiffLlamaConfig's keys for "
                        f"one attention layer are {', '.join(valid)} (pass a whole config as config=model.config)")
    merged = {**whole, **kwargs}
    out = {k: merged.get(k, default) for k, default in _DIFFLLAMA_LAYER_KEYS.items()}
    for k in ("rms_norm_eps", "attention_bias", "attention_dropout"):
        out[k] = _DIFFLLAMA_LAYER_KEYS[k] if out[k] is None else out[k]
    if out["hidden_size"] is None or out["num_attention_heads"] is None:
        raise TypeError("from_diffllama needs hidden_size and num_attention_heads (DiffLlamaConfig's keys), or "
                        "config=model.config")
    _check_number("rms_norm_eps", out["rms_norm_eps"], "a number > 0 (DiffLlama's default 1e-5)",
                  lambda v: 0 < v < math.inf)
    _check_number("attention_dropout", out["attention_dropout"], "a probability in [0, 1)", lambda v: 0 <= v < 1)
    if out["num_key_value_heads"] is None:
        out["num_key_value_heads"] = out["num_attention_heads"]
    if out["head_dim"] is None:
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    return out


def from_diffllama(state_dict: StateDict, *, layer_idx: int, config: Any = None, **kwargs) -> MultiheadDiffAttn:
    """A :class:`MultiheadDiffAttn` from Hugging Face ``DiffLlamaAttention`` weights, exactly.

    The config comes as transformers gives it: ``config=model.config`` (a ``DiffLlamaConfig``, or its
    ``to_dict()``), ``**model.config.to_dict()``, or the layer's keys one by one (``hidden_size``,
    ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``rms_norm_eps``, ``attention_bias``,
    ``attention_dropout``), with DiffLlamaConfig's defaults; keys that concern the whole model are ignored
    (:func:`diffllama_layer_config`). ``layer_idx`` is 0-based as in transformers.
    DiffLlama counts single maps: ``num_attention_heads`` H gives ``H/2`` differential heads and
    ``num_key_value_heads`` Hkv gives ``Hkv/2`` KV pairs (both even). Its map ``i`` pairs with map ``i + H/2``;
    the rows of ``q_proj``, ``k_proj`` and ``v_proj`` are reordered into this library's adjacent pairs, so
    the layer computes the same function. Its forward takes ``rope=(cos, sin)`` of shape
    ``(N, head_dim/2)``: DiffLlama's ``position_embeddings`` ``(B, N, head_dim)`` are ``cat(f, f)``, pass
    ``(cos[0, :, :head_dim // 2], sin[0, :, :head_dim // 2])`` or ``rope_cos_sin(N, head_dim, base=rope_theta)``;
    RoPE is applied in DiffLlama's half-split layout. DiffLlama's eager additive mask ``(B, 1, N, N)`` (0 or
    ``finfo.min``, causal merged in) can be passed as ``attn_mask`` as it is. The sub-norm is DiffLlama's ``groupnorm``
    (RMSNorm over ``2 * head_dim``, eps ``rms_norm_eps``, no weight); ``attention_dropout`` drops attention
    weights in training, as DiffLlama's eager path does. Other keyword arguments are module options
    (``backend``, ``device``, a ``torch.dtype`` as ``dtype``; a config's own ``dtype`` string is ignored).

    Pass one attention layer's weights (``q_proj.weight``, ..., ``lambda_k2``): from a whole model's
    state_dict take the keys under ``model.layers.{layer_idx}.self_attn.``.
    """
    state_dict = check_state_dict(state_dict, "from_diffllama")
    options = _module_options(MultiheadDiffAttn, _DIFFLLAMA_TAKEN)
    module_kwargs = {k: kwargs.pop(k) for k in list(kwargs)
                     if k in options and not (k == "dtype" and isinstance(kwargs[k], str))}
    kwargs.pop("dtype", None)  # transformers' own dtype string ("float32"): the state_dict's tensors carry theirs
    cfg = diffllama_layer_config(config, **kwargs)
    hidden_size, head_dim = cfg["hidden_size"], cfg["head_dim"]
    H, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    if H <= 0 or Hkv <= 0 or H % 2 or Hkv % 2 or H % Hkv:
        raise ValueError(f"DiffLlama needs even num_attention_heads={H} and num_key_value_heads={Hkv}, the first a "
                         f"multiple of the second (both count single maps: H/2 differential heads, Hkv/2 KV pairs)")
    prefixed = sorted(k for k in state_dict if k.endswith("q_proj.weight") and k != "q_proj.weight")
    if prefixed and "q_proj.weight" not in state_dict:
        prefix = prefixed[0][: -len("q_proj.weight")]
        raise ValueError(f"state_dict keys start with {prefix!r}: pass one attention layer's weights, e.g. "
                         f"{{k.removeprefix({prefix!r}): v for k, v in sd.items() if k.startswith({prefix!r})}}")
    layer = MultiheadDiffAttn(hidden_size, H // 2, depth=layer_idx, num_kv_heads=Hkv // 2, head_dim=head_dim,
                              subln_affine=False, subln_eps=cfg["rms_norm_eps"], qkv_bias=cfg["attention_bias"],
                              out_bias=cfg["attention_bias"], rope_interleaved=False,
                              dropout=cfg["attention_dropout"], **module_kwargs)
    sd = _detached(state_dict)
    q_order, kv_order = diffllama_order(H), diffllama_order(Hkv)
    out: dict[str, Tensor] = {}
    for name, t in sd.items():
        proj, _, suffix = name.partition(".")
        if proj in ("q_proj", "k_proj", "v_proj") and suffix in ("weight", "bias") \
                and t.shape[0] == (H if proj == "q_proj" else Hkv) * head_dim:
            t = permute_maps(t, q_order if proj == "q_proj" else kv_order, head_dim)
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
    _check_exportable(module, MultiheadDiffAttn, "to_diffllama")
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
    q_back = torch.argsort(diffllama_order(2 * module.num_heads))
    kv_back = torch.argsort(diffllama_order(2 * module.num_kv_heads))
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
                t = permute_maps(t, q_back if proj == "q_proj" else kv_back, d)
            out[f"{_DIFFLLAMA_NAMES.get(proj, proj)}.{suffix}"] = t
    if sd:
        raise ValueError(f"cannot map {sorted(sd)} to DiffLlama names")
    return out


# --------------------------------------------------------------------------------------------
# Hugging Face transformers Llama (a whole model, into the course's TinyLM)
# --------------------------------------------------------------------------------------------

_LLAMA_LM_KEYS: dict[str, Any] = {
    "vocab_size": None, "hidden_size": None, "intermediate_size": None, "num_hidden_layers": None,
    "num_attention_heads": None, "num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_parameters": None, "rope_scaling": None,
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
    "pretraining_tp": 1}
"""The ``LlamaConfig`` keys that shape a ``LlamaForCausalLM``'s function, with transformers' defaults (None:
required, or derived as transformers derives it). Other keys of a whole config (token ids, dtype, ...) are ignored."""

def llama_lm_config(config: Any = None, **kwargs) -> dict[str, Any]:
    """The keys of a ``LlamaConfig`` (an object with ``to_dict()``, its dict, or keys given loose) that shape the
    model's function, with transformers' defaults filled in; refuses the Llama features TinyLM does not have
    (RoPE scaling, biases, another activation, a head width other than ``hidden_size // num_attention_heads``), a
    ``config`` that is no config (a model's name: load it with ``transformers.AutoConfig``) and a ``rope_theta`` or
    ``rms_norm_eps`` that is not a number > 0."""
    if not (config is None or hasattr(config, "to_dict") or isinstance(config, Mapping)):
        raise TypeError(f"config must be a LlamaConfig (model.config), its dict or None, got {type(config).__name__} "
                        f"{config!r}; for a model's name use transformers.AutoConfig.from_pretrained(name)")
    whole = dict(config.to_dict()) if hasattr(config, "to_dict") else dict(config or {})
    merged = {**whole, **kwargs}
    if merged.get("model_type", "llama") != "llama":
        raise ValueError(f"this is a {merged['model_type']!r} config, not Llama's: from_llama loads LlamaForCausalLM")
    cfg = {k: merged.get(k, default) for k, default in _LLAMA_LM_KEYS.items()}
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if cfg[k] is None:
            raise TypeError(f"from_llama needs the LlamaConfig key {k!r} (or config=model.config)")
        if isinstance(cfg[k], bool) or not isinstance(cfg[k], int) or cfg[k] < 1:
            raise ValueError(f"{k} must be a whole number >= 1, got {cfg[k]!r}")
    rope = dict(cfg.pop("rope_parameters") or {})  # transformers >= 5 keeps theta and the type here
    scaling = cfg.pop("rope_scaling") or {}
    cfg["rope_theta"] = rope.get("rope_theta", cfg["rope_theta"])
    rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    cfg["num_key_value_heads"] = cfg["num_attention_heads"] if cfg["num_key_value_heads"] is None \
        else cfg["num_key_value_heads"]
    if isinstance(cfg["num_key_value_heads"], bool) or not isinstance(cfg["num_key_value_heads"], int) \
            or cfg["num_key_value_heads"] < 1:
        raise ValueError(f"num_key_value_heads must be a whole number >= 1, got {cfg['num_key_value_heads']!r}")
    width = cfg["hidden_size"] // cfg["num_attention_heads"]
    problems = [what for what, bad in [
        (f"RoPE type {rope_type!r} (only 'default' here; diffattn_tutorial.hf.from_hf loads 'llama3')",
         rope_type != "default"),
        (f"hidden_act={cfg['hidden_act']!r} (SwiGLU uses 'silu')", cfg["hidden_act"] != "silu"),
        ("attention_bias=True", cfg["attention_bias"]), ("mlp_bias=True", cfg["mlp_bias"]),
        (f"pretraining_tp={cfg['pretraining_tp']}", cfg["pretraining_tp"] != 1),
        (f"head_dim={cfg['head_dim']} other than hidden_size // num_attention_heads = {width}",
         cfg["head_dim"] not in (None, width))] if bad]
    if problems:
        raise ValueError(f"TinyLM has no {', '.join(problems)}: this Llama cannot be loaded exactly")
    for k in ("rope_theta", "rms_norm_eps"):  # named as the caller named them (LMConfig checks them again)
        if isinstance(cfg[k], bool) or not (isinstance(cfg[k], (int, float)) and 0 < cfg[k] < math.inf):
            raise ValueError(f"{k} must be a number > 0, got {cfg[k]!r}")
    cfg["head_dim"] = width
    return cfg


_LLAMA_MODEL_KEYS = frozenset({
    "initializer_range", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "attention_dropout",
    "model_type", "transformers_version", "architectures", "torch_dtype", "dtype", "_name_or_path"})
"""``LlamaConfig`` keys that do not change the function (ids, initialisation, dropout 0 at inference): accepted."""


def _check_llama_keys(kwargs: Mapping[str, Any]) -> None:
    """Refuse a key given loose that ``LlamaConfig`` does not have, naming the closest one (a misspelled
    ``rope_thta`` must not fall back to the default); a whole config spread as keys (``**config.to_dict()``, which
    has ``model_type``) brings transformers' generic keys too, and is taken as it comes."""
    if "model_type" in kwargs:
        return
    valid = list(_LLAMA_LM_KEYS)
    unknown = [k for k in kwargs if k not in _LLAMA_LM_KEYS and k not in _LLAMA_MODEL_KEYS]
    if unknown:
        hints = [f"{k!r} (did you mean {close[0]!r}?)" if close else repr(k)
                 for k in unknown for close in [difflib.get_close_matches(k, valid, n=1)]]
        raise TypeError(f"from_llama() got unknown config key(s) {', '.join(hints)}; LlamaConfig's keys that shape the "
                        f"model are {', '.join(valid)} (or pass config=model.config)")


def from_llama(state_dict: StateDict, *, config: Any = None, **kwargs):
    """A baseline :class:`~diffattn_tutorial.training.model.TinyLM` computing what Hugging Face's
    ``LlamaForCausalLM`` computes, from its ``state_dict`` (``'model.embed_tokens.weight'``,
    ``model.layers.{i}.self_attn.q_proj.weight``, ..., ``lm_head.weight``) and config (``config=model.config``,
    its dict, or ``LlamaConfig`` keys loose; see :func:`llama_lm_config`).

    The architectures match term by term (RMSNorm, SwiGLU, RoPE, no biases, GQA), but for two layouts: Llama
    rotates dims ``j`` and ``j + d/2`` of a head (half-split RoPE), TinyLM dims ``2j`` and ``2j + 1``, so the
    rows of every q and k projection are reordered per head (the scores ``q.k`` are sums over the same pairs);
    and TinyLM's head is a parameter of its own, so a checkpoint with ``tie_word_embeddings`` gets a copy of the
    embedding there (the same function; fine-tuning then moves them apart). The model is float32 whatever the
    checkpoint's dtype (float16 and bfloat16 weights convert exactly); ``.to(dtype)`` with the checkpoint's
    dtype gives its precision back.
    """
    from diffattn_tutorial.training.hf_weights import load_weights
    from diffattn_tutorial.training.model import LMConfig, TinyLM

    check_state_dict(state_dict, "from_llama")
    _check_llama_keys(kwargs)
    cfg = llama_lm_config(config, **kwargs)
    lm = LMConfig(vocab_size=cfg["vocab_size"], attention="baseline", d_model=cfg["hidden_size"],
                  n_layers=cfg["num_hidden_layers"], n_heads=cfg["num_attention_heads"],
                  n_kv_heads=cfg["num_key_value_heads"], ffn_hidden=cfg["intermediate_size"],
                  max_len=cfg["max_position_embeddings"], rope_base=float(cfg["rope_theta"]),
                  norm_eps=float(cfg["rms_norm_eps"]))
    return load_weights(TinyLM(lm), state_dict, tied=cfg["tie_word_embeddings"], loader="from_llama")
