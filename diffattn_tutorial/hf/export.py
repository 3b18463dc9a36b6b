"""Save a :class:`~diffattn_tutorial.training.model.TinyLM` in transformers' format, for
``AutoModelForCausalLM.from_pretrained(folder)`` with transformers alone (offline): the way back from
:mod:`diffattn_tutorial.hf.checkpoints`.

:func:`save_hf` writes, by the model's attention:

* ``"baseline"``: a ``LlamaForCausalLM`` folder (``Qwen2ForCausalLM`` when the model has q/k/v biases), q/k rows
  back in Llama's half-split RoPE layout; RoPE ``"default"`` or ``"llama3"`` as the model's.
* ``"diff"`` (DIFF V1): a ``DiffLlamaForCausalLM`` folder, where DiffLlama's architecture can say what the model
  computes: its sub-norm has no weight and the epsilon of every other RMSNorm (``rms_norm_eps``), so every
  layer's sub-norm weight must be all ones (as at conversion: fine-tune with it frozen) and ``norm_eps`` 1e-5 (the
  layers' ``subln_eps``); lambda is the paper's four vectors with ``lambda_init = 0.8 - 0.6 exp(-0.3 layer_idx)``
  (the library's default, :func:`~diffattn_tutorial.functional.lambda_init_fn`); biases on all four projections
  or none (a Qwen2 model's q/k/v-only biases are refused); no qk-norm, no warm-up in progress.
* ``"diff_v2"`` (DIFF V2, which transformers does not ship): a self-contained folder with its modelling file
  (the file :data:`V2_MODELING_FILE` names), generated from this library's formulas (their source is copied
  in) and loaded with ``trust_remote_code=True``; the weights keep TinyLM's names and layout.

Anything else (a warm-up in progress, a doubled-head V1 model, what DiffLlama cannot express) is refused by name
before anything is written. The folder is written under a temporary name beside it and renamed when complete, so
an interrupted or refused save leaves no half-written folder.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Union

import torch

from diffattn_tutorial import functional
from diffattn_tutorial.hf.checkpoints import write_safetensors
from diffattn_tutorial.layers import rope as rope_mod
from diffattn_tutorial.layers.attention import DiffAttnV2, MultiheadAttention, MultiheadDiffAttn
from diffattn_tutorial.layers.rope import interleaved_to_half_split
from diffattn_tutorial.training.hf_weights import BLOCK_NAMES, TOP_NAMES, CheckpointError

Tensor = torch.Tensor

V2_MODEL_TYPE = "diffattn_v2"
V2_MODELING_FILE = "modeling_diffattn_v2.py"


def _rope_parameters(cfg) -> dict[str, Any]:
    if cfg.rope_scaling is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_base}
    return {"rope_type": "llama3", "rope_theta": cfg.rope_base, **dict(cfg.rope_scaling)}


def _common_config(cfg) -> dict[str, Any]:
    """The keys every exported config shares (transformers' names for TinyLM's sizes)."""
    return {"vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_hidden or 2 * cfg.d_model,
            "num_hidden_layers": cfg.n_layers, "max_position_embeddings": cfg.max_len, "rms_norm_eps": cfg.norm_eps,
            "rope_parameters": _rope_parameters(cfg), "hidden_act": "silu", "tie_word_embeddings": False,
            "torch_dtype": "float32", "initializer_range": 0.02, "use_cache": False}


def _hf_names(model, attn_names) -> dict[str, Tensor]:
    """TinyLM's non-attention tensors under transformers' names; ``attn_names(i, attn)`` gives layer i's attention."""
    theirs = {v: k for k, v in TOP_NAMES.items()}
    sd = {theirs[k]: v for k, v in model.state_dict().items() if k in theirs}
    block = {v: k for k, v in BLOCK_NAMES.items() if not v.startswith("attn.")}
    for i, b in enumerate(model.blocks):
        for ours, t in b.state_dict().items():
            if ours in block:
                sd[f"model.layers.{i}.{block[ours]}"] = t
        sd.update({f"model.layers.{i}.self_attn.{k}": v for k, v in attn_names(i, b.attn).items()})
    return {k: v.detach().float().contiguous().clone() for k, v in sd.items()}


def _baseline_attn(i: int, attn: MultiheadAttention) -> dict[str, Tensor]:
    if attn.out_proj.bias is not None:
        raise CheckpointError(f"layer {i}: an out_proj bias has no place in Llama's or Qwen2's format")
    out = {}
    for ours, theirs in (("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"), ("out_proj", "o_proj")):
        for suffix, t in getattr(attn, ours).state_dict().items():
            if ours in ("q_proj", "k_proj"):
                t = interleaved_to_half_split(t, attn.head_dim)
            out[f"{theirs}.{suffix}"] = t
    return out


def _baseline_folder(model) -> tuple[dict, dict[str, Tensor], dict[str, str]]:
    cfg = model.cfg
    family = "qwen2" if cfg.qkv_bias else "llama"
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[family]
    config = {**_common_config(cfg), "model_type": family, "architectures": [arch],
              "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim}
    if family == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    else:
        config.update(use_sliding_window=False, sliding_window=None)
    return config, _hf_names(model, _baseline_attn), {}


def _diffllama_attn(i: int, attn: MultiheadDiffAttn) -> dict[str, Tensor]:
    from diffattn_tutorial.interop import to_diffllama

    if attn.subln is None:
        raise CheckpointError(f"layer {i} has no sub-norm (subln=False), which DiffLlama always applies; save as "
                              f"DIFF V2 or convert with the sub-norm")
    if attn.subln.weight is None or not torch.equal(attn.subln.weight, torch.ones_like(attn.subln.weight)):
        raise CheckpointError(f"layer {i}: the sub-norm has a weight other than all ones, which DiffLlama's "
                              f"(weightless) groupnorm cannot hold; save as DIFF V2, or fine-tune with "
                              f"subln.weight frozen")
    weight = attn.subln.weight
    attn.subln.weight = None  # all ones: the same function without it, as DiffLlama computes it
    try:
        return to_diffllama(attn)
    except ValueError as e:
        raise CheckpointError(f"layer {i}: {e}") from None
    finally:
        attn.subln.weight = weight


def _diff_folder(model) -> tuple[dict, dict[str, Tensor], dict[str, str]]:
    cfg = model.cfg
    layer = model.blocks[0].attn
    eps = sorted({b.attn.subln.eps for b in model.blocks if b.attn.subln is not None} - {cfg.norm_eps})
    if eps:
        raise CheckpointError(f"DiffLlama's sub-norm uses rms_norm_eps ({cfg.norm_eps}), this model's sub-norm "
                              f"eps {eps[0]}: it cannot be saved as DiffLlama (save as DIFF V2)")
    has_bias = layer.q_proj.bias is not None
    config = {**_common_config(cfg), "model_type": "diffllama", "architectures": ["DiffLlamaForCausalLM"],
              "num_attention_heads": 2 * layer.num_heads, "num_key_value_heads": 2 * layer.num_kv_heads,
              "head_dim": layer.head_dim, "attention_bias": has_bias, "lambda_std_dev": 0.1,
              "attention_dropout": 0.0}
    return config, _hf_names(model, _diffllama_attn), {}


_V2_TEMPLATE = '''
class DiffAttnV2Config(PretrainedConfig):
    model_type = "diffattn_v2"

    def __init__(self, vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=512,
                 rms_norm_eps=1e-5, rope_parameters=None, qkv_bias=False, **kwargs):
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.num_key_value_heads, self.head_dim = num_key_value_heads, head_dim
        self.max_position_embeddings, self.rms_norm_eps, self.qkv_bias = max_position_embeddings, rms_norm_eps, qkv_bias
        self.rope_parameters = rope_parameters or {"rope_type": "default", "rope_theta": 10000.0}
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """DIFF V2: 2H query heads; output head i = head 2i - sigmoid(lambda_proj(x))_i * head 2i+1."""

    def __init__(self, c):
        super().__init__()
        H, Hkv, d, C = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size
        self.H, self.Hkv, self.d = H, Hkv, d
        self.q_proj = nn.Linear(C, 2 * H * d, bias=c.qkv_bias)
        self.k_proj = nn.Linear(C, Hkv * d, bias=c.qkv_bias)
        self.v_proj = nn.Linear(C, Hkv * d, bias=c.qkv_bias)
        self.o_proj = nn.Linear(H * d, C, bias=False)
        self.lambda_proj = nn.Linear(C, H, bias=False)

    def forward(self, x, cos, sin):
        B, N, _ = x.shape
        q = self.q_proj(x).view(B, N, 2 * self.H, self.d).transpose(1, 2)
        k = self.k_proj(x).view(B, N, self.Hkv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(B, N, self.Hkv, self.d).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        group = 2 * self.H // self.Hkv  # query heads per KV head: a pair never straddles two groups
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        causal = torch.ones(N, N, dtype=torch.bool, device=x.device).tril()
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.d)
        out = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v  # (B, 2H, N, d)
        lam = torch.sigmoid(self.lambda_proj(x)).transpose(1, 2)[..., None]  # (B, H, N, 1)
        out = out[:, 0::2] - lam * out[:, 1::2]
        return self.o_proj(out.transpose(1, 2).reshape(B, N, self.H * self.d))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(c.hidden_size, c.rms_norm_eps), Attention(c)
        self.mlp_norm, self.mlp = RMSNorm(c.hidden_size, c.rms_norm_eps), MLP(c)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class DiffAttnV2ForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = DiffAttnV2Config
    base_model_prefix = "diffattn_v2"
    _no_split_modules = ["Block"]

    def __init__(self, config):
        super().__init__(config)
        c = config
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    def get_input_embeddings(self):
        return self.embed

    def rope(self, n, device):
        p = self.config.rope_parameters
        inv_freq = 1.0 / p["rope_theta"] ** (torch.arange(0, self.config.head_dim, 2, dtype=torch.float64)
                                             / self.config.head_dim)
        if p.get("rope_type", "default") == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, **{k: p[k] for k in LLAMA3_KEYS})
        angles = torch.outer(torch.arange(n, dtype=torch.float64), inv_freq)
        return angles.cos().float().to(device), angles.sin().float().to(device)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        return {"input_ids": input_ids, "attention_mask": attention_mask}  # no KV cache: the whole sequence

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs):
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("this DIFF V2 model attends causally over every token: padding (attention_mask with "
                             "zeros) is not implemented; pass unpadded sequences")
        cos, sin = self.rope(input_ids.shape[1], input_ids.device)
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
        return CausalLMOutputWithPast(loss=loss, logits=logits)
'''


def v2_modeling_source() -> str:
    """The modelling file of a saved DIFF V2 folder: this library's RoPE and RMSNorm formulas (their source,
    copied) and a transformers ``PreTrainedModel`` that runs TinyLM's DIFF V2 blocks with them."""
    lib = [inspect.getsource(f) for f in (functional.rms_norm, rope_mod.apply_rope, rope_mod.llama3_inv_freq)]
    header = ('"""DIFF V2 causal LM, generated by diffattn_tutorial.hf.export from the library\'s own formulas: '
              'load with\nAutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)."""\n\n'
              "import math\nfrom typing import Optional\n\nimport torch\nimport torch.nn as nn\n"
              "import torch.nn.functional as F\nfrom transformers import GenerationMixin, PretrainedConfig, "
              "PreTrainedModel\nfrom transformers.modeling_outputs import CausalLMOutputWithPast\n\n"
              f"Tensor = torch.Tensor\nLLAMA3_KEYS = {rope_mod.LLAMA3_KEYS!r}\n\n\n")
    return header + "\n\n".join(lib) + "\n" + _V2_TEMPLATE


def _v2_folder(model) -> tuple[dict, dict[str, Tensor], dict[str, str]]:
    cfg = model.cfg
    config = {**_common_config(cfg), "model_type": V2_MODEL_TYPE, "architectures": ["DiffAttnV2ForCausalLM"],
              "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
              "qkv_bias": cfg.qkv_bias,
              "auto_map": {"AutoConfig": f"{V2_MODELING_FILE[:-3]}.DiffAttnV2Config",
                           "AutoModelForCausalLM": f"{V2_MODELING_FILE[:-3]}.DiffAttnV2ForCausalLM"}}
    sd = {k: v.detach().float().contiguous().clone() for k, v in model.state_dict().items()}
    return config, sd, {V2_MODELING_FILE: v2_modeling_source()}


_WRITERS = {"baseline": (MultiheadAttention, _baseline_folder), "diff": (MultiheadDiffAttn, _diff_folder),
            "diff_v2": (DiffAttnV2, _v2_folder)}


def _check_model(model) -> None:
    from diffattn_tutorial.training.model import TinyLM

    if not isinstance(model, TinyLM):
        raise TypeError(f"save_hf saves a TinyLM, got {type(model).__name__}")
    kind, writer = model.cfg.attention, _WRITERS[model.cfg.attention]
    wrong = [i for i, b in enumerate(model.blocks) if type(b.attn) is not writer[0]]
    if wrong:
        raise CheckpointError(f"layers {wrong} are not {writer[0].__name__} as cfg.attention={kind!r} says")
    warm = [i for i, b in enumerate(model.blocks) if getattr(b.attn, "lambda_mix", None) is not None]
    if warm:
        raise CheckpointError(f"layers {warm} are in a warm-up (lambda_mix), which transformers' format has no "
                              f"place for: finish it first (layers.convert.set_warmup(model, 1.0); finish_warmup)")
    if kind == "diff" and model.blocks[0].attn.num_heads * 2 != model.cfg.n_heads:
        raise CheckpointError("a doubled-head V1 model (heads='double') is not DiffLlama's layout; save the split "
                              "conversion (heads='split') or DIFF V2")


def _check_target(folder: Path, overwrite: object) -> None:
    """``folder`` may be written: new, or with ``overwrite=True`` (a bool: ``"no"`` is truthy) a checkpoint folder
    (``config.json``) or an empty one; a file or a folder of other things is never deleted whole."""
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite must be True or False, got {overwrite!r}")
    if not folder.exists():
        return
    if not overwrite:
        raise FileExistsError(f"{folder} exists: pass overwrite=True to replace it, or another folder")
    if not folder.is_dir() or not ((folder / "config.json").is_file() or not any(folder.iterdir())):
        raise FileExistsError(f"{folder} is not a checkpoint folder (no config.json), and overwrite=True replaces "
                              f"the whole folder: pass a new folder (e.g. {folder / 'checkpoint'}) or remove it yourself")


def save_hf(model, folder: Union[str, os.PathLike], *, overwrite: bool = False) -> Path:
    """Write ``model`` (a TinyLM) as a transformers checkpoint folder (``config.json``, the weights in one safetensors file, and
    for DIFF V2 its modelling file); see the module doc for what each attention kind becomes and what is refused.
    Nothing is written unless all of it can be; an existing ``folder`` is replaced only with ``overwrite=True`` and only if it is a checkpoint folder
    (``config.json``) or empty."""
    _check_model(model)
    folder = Path(folder)
    _check_target(folder, overwrite)
    config, tensors, files = _WRITERS[model.cfg.attention][1](model)  # every refusal happens here, before writing
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".partial", dir=folder.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps({"use_cache": config["model_type"] != V2_MODEL_TYPE}))
        write_safetensors(tensors, tmp / "model.safetensors")
        for name, text in files.items():
            (tmp / name).write_text(text)
        if folder.exists():
            old = folder.with_name(f".{folder.name}.old")
            folder.rename(old)
            tmp.rename(folder)
            shutil.rmtree(old)
        else:
            tmp.rename(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


__all__ = ["V2_MODEL_TYPE", "V2_MODELING_FILE", "v2_modeling_source", "save_hf"]
