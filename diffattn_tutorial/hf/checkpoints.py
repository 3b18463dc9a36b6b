"""Load Hugging Face checkpoints of the Llama family into :class:`~diffattn_tutorial.training.model.TinyLM`.

The loaded model's logits equal transformers' to float tolerance (the tests and notebook 14: rtol 1e-4), not bit
for bit.

:func:`from_hf` takes a transformers model object (``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
``MistralForCausalLM``), a folder holding ``config.json`` and ``*.safetensors`` (read offline, without transformers),
or a ``state_dict`` with its config. What each family needs of TinyLM:

* **Llama** (``model_type="llama"``): RoPE type ``"default"`` or ``"llama3"`` (Llama 3.1/3.2's frequency scaling,
  :func:`~diffattn_tutorial.layers.rope.llama3_inv_freq`; SmolLM2's configuration is a plain Llama), tied or
  untied head, GQA. ``attention_bias`` (biases on all four projections) and ``mlp_bias`` are refused by name.
* **Qwen2** (``"qwen2"``, Qwen2 and 2.5): biases on q/k/v, none on the output (``LMConfig(qkv_bias=True)``).
* **Mistral** (``"mistral"``): a Llama with a sliding window. The window leaves the function unchanged when it never
  binds, i.e. when ``sliding_window >= max_len`` (the longest sequence the model will see); otherwise it is refused
  by name, and ``max_len=sliding_window`` loads the model for sequences that short. Qwen2's ``use_sliding_window``
  likewise.

The mapping is term by term: Llama's half-split RoPE rows become TinyLM's interleaved ones (q and k weights and
biases reordered per head, the same scores); a tied head is copied. Other families (Gemma, Phi, ...) and config
options that change the function and are not implemented (another RoPE type, activation, head width,
``partial_rotary_factor``) are refused by name; the golden data in ``diffattn_tutorial/golden/hf/`` were recorded by
transformers' own models (``tools/make_hf_golden.py``). Saving back: :mod:`diffattn_tutorial.hf.export`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional, Union

import torch

from diffattn_tutorial.layers.rope import LLAMA3_KEYS
from diffattn_tutorial.training.hf_weights import CheckpointError, load_weights

Tensor = torch.Tensor

FAMILIES: tuple[str, ...] = ("llama", "qwen2", "mistral")
"""The ``model_type`` values :func:`from_hf` loads."""

ROPE_TYPES: tuple[str, ...] = ("default", "llama3")
"""The RoPE types (``rope_parameters["rope_type"]``) TinyLM computes exactly."""

_DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": None, "head_dim": None, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1,
    "sliding_window": None, "use_sliding_window": False, "layer_types": None}
_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "mistral": 4096 * 32}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")

# ---------------------------------------------------------------- safetensors files (the maintained package)
def read_safetensors(path: Union[str, os.PathLike]) -> dict[str, Tensor]:
    """The tensors of one ``.safetensors`` file (``safetensors.torch.load_file``), a named error for a file that
    is not one."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except SafetensorError as e:
        raise CheckpointError(f"{path} is not a safetensors file ({e}); save weights with "
                              f"model.save_pretrained(folder) or safetensors.torch.save_file") from None


def write_safetensors(tensors: Mapping[str, Tensor], path: Union[str, os.PathLike]) -> None:
    """Write ``tensors`` as one ``.safetensors`` file (``safetensors.torch.save_file``; each tensor its own bytes,
    on the CPU, contiguous, as transformers' ``save_pretrained`` writes them)."""
    from safetensors.torch import save_file

    save_file({k: t.detach().cpu().contiguous() for k, t in tensors.items()}, str(path), metadata={"format": "pt"})


def read_folder(folder: Union[str, os.PathLike]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """``(config, state_dict)`` of a checkpoint folder: ``config.json`` and its ``*.safetensors`` (one file, or the
    shards a ``model.safetensors.index.json`` lists), read offline; a missing part refused by name."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is no folder; pass a folder with config.json and *.safetensors (a model's "
                                f"name is not downloaded here: fetch it with huggingface_hub.snapshot_download)")
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder} has no config.json: pass the folder save_pretrained wrote")
    config = _read_json(folder / "config.json")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map' (name -> shard file): write it again with "
                                  f"save_pretrained, or remove it to read every *.safetensors in the folder")
        files = sorted({folder / f for f in weight_map.values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".gguf"))
        hint = f" (it has {', '.join(other)}: save it again with save_pretrained, which writes safetensors)" \
            if other else ""
        raise CheckpointError(f"{folder} has no weights: no *.safetensors file{hint}")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{folder}: the index lists shard(s) {missing} that are not there")
    state_dict: dict[str, Tensor] = {}
    seen: dict[str, str] = {}
    for f in files:
        tensors = read_safetensors(f)
        twice = sorted(set(tensors) & set(seen))
        if twice:  # a stale file or an overlapping shard: which copy counts is not ours to guess
            raise CheckpointError(f"{folder}: {twice[0]} (and {len(twice) - 1} more) is in both {seen[twice[0]]} "
                                  f"and {f.name}: keep one checkpoint's files in the folder")
        seen.update(dict.fromkeys(tensors, f.name))
        state_dict.update(tensors)
    return config, state_dict


def _read_json(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON file as a dict, or an error naming the file."""
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}): write it again with save_pretrained") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a {type(data).__name__}, not a JSON object: write it again with "
                              f"save_pretrained")
    return data


# ---------------------------------------------------------------- config
def _config_dict(config: Any) -> dict[str, Any]:
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    if isinstance(config, Mapping):
        return dict(config)
    raise TypeError(f"config must be a transformers config (model.config), its dict, or a folder's config.json, "
                    f"got {type(config).__name__} {config!r}")


def _rope(c: dict[str, Any]) -> tuple[float, Optional[dict[str, float]]]:
    """``(rope_theta, llama3 scaling or None)`` from transformers 5's ``rope_parameters`` or 4's
    ``rope_theta``/``rope_scaling``; another RoPE type or a partial rotary factor refused by name."""
    params = dict(c.get("rope_parameters") or {})
    scaling = dict(c.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", c.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(f"RoPE type {rope_type!r} is not implemented (TinyLM has {ROPE_TYPES}): this model "
                              f"cannot be loaded exactly")
    partial = merged.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise CheckpointError(f"partial_rotary_factor={partial} is not implemented (TinyLM rotates whole heads)")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise CheckpointError(f"rope_theta must be a number > 0, got {theta!r}")
    if rope_type == "default":
        return float(theta), None
    return float(theta), {k: merged[k] for k in LLAMA3_KEYS if k in merged}


def _window(c: dict[str, Any], family: str) -> Optional[int]:
    """The sliding window that applies to some layer (None: none)."""
    if family == "mistral":
        return c.get("sliding_window")
    if family == "qwen2" and c.get("use_sliding_window"):
        return c.get("sliding_window")
    if any(t == "sliding_attention" for t in c.get("layer_types") or ()):
        return c.get("sliding_window")
    return None


def hf_lm_config(config: Any, *, max_len: Optional[int] = None):
    """The :class:`~diffattn_tutorial.training.model.LMConfig` computing what a Llama, Qwen2 or Mistral config's
    model computes (``config``: ``model.config``, its dict or a folder's ``config.json``); ``max_len`` (default
    ``max_position_embeddings``) the longest sequence the model will see. Refused by name: another family, a
    missing size, and every option that changes the function and is not implemented (see the module doc)."""
    from diffattn_tutorial.training.model import LMConfig

    c = _config_dict(config)
    family = c.get("model_type")
    if family not in FAMILIES:
        raise CheckpointError(f"model_type {family!r} is not supported: from_hf loads {FAMILIES} (Gemma scales its "
                              f"embeddings and norms as 1 + w, Phi has a partial rotary and a dense block: "
                              f"neither is a TinyLM)")
    c = {**_DEFAULTS, "max_position_embeddings": _MAX_POSITIONS[family], **c}
    for k in _REQUIRED:
        if isinstance(c.get(k), bool) or not isinstance(c.get(k), int) or c[k] < 1:
            raise CheckpointError(f"the {family} config needs {k!r} as a whole number >= 1, got {c.get(k)!r}")
    theta, scaling = _rope(c)
    heads, width = c["num_attention_heads"], c["hidden_size"] // c["num_attention_heads"]
    max_len = c["max_position_embeddings"] if max_len is None else max_len
    window = _window(c, family)
    if c["num_key_value_heads"] is not None and (isinstance(c["num_key_value_heads"], bool)
                                                 or not isinstance(c["num_key_value_heads"], int)
                                                 or c["num_key_value_heads"] < 1):
        raise CheckpointError(f"num_key_value_heads must be a whole number >= 1 or None, got "
                              f"{c['num_key_value_heads']!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise CheckpointError(f"sliding_window must be a whole number >= 1 or None, got {window!r}")
    problems = [what for what, bad in [
        (f"hidden_act={c['hidden_act']!r} (SwiGLU uses 'silu')", c["hidden_act"] != "silu"),
        ("attention_bias=True (a bias on o_proj too)", family == "llama" and c["attention_bias"]),
        ("mlp_bias=True", c["mlp_bias"]), (f"pretraining_tp={c['pretraining_tp']}", c["pretraining_tp"] != 1),
        (f"head_dim={c['head_dim']} other than hidden_size // num_attention_heads = {width}",
         c["head_dim"] not in (None, width) or c["hidden_size"] % heads),
        (f"sliding_window={window} shorter than max_len={max_len}, where it binds (pass max_len={window} to load "
         f"it for sequences that short)", window is not None and window < max_len)] if bad]
    if problems:
        raise CheckpointError(f"this {family} model has {'; '.join(problems)}: TinyLM does not implement it, so it "
                              f"cannot be loaded exactly")
    return LMConfig(vocab_size=c["vocab_size"], attention="baseline", d_model=c["hidden_size"],
                    n_layers=c["num_hidden_layers"], n_heads=heads, n_kv_heads=c["num_key_value_heads"] or heads,
                    ffn_hidden=c["intermediate_size"], max_len=max_len, rope_base=theta,
                    norm_eps=float(c["rms_norm_eps"]), qkv_bias=family == "qwen2", rope_scaling=scaling)


# ---------------------------------------------------------------- weights
def from_hf(source: Any, *, config: Any = None, max_len: Optional[int] = None):
    """A baseline :class:`~diffattn_tutorial.training.model.TinyLM` computing what a Llama, Qwen2 or Mistral
    checkpoint computes (see the module doc), float32 whatever the checkpoint's dtype.

    ``source``: a transformers model (``LlamaForCausalLM``, ... : its ``state_dict()`` and ``config``), a folder
    (``config.json`` and ``*.safetensors``, read offline), or a ``state_dict`` (then ``config`` is required).
    ``max_len``: the longest sequence the model will see (default the config's ``max_position_embeddings``).
    """
    from diffattn_tutorial.training.model import TinyLM

    if isinstance(source, (str, os.PathLike)):
        folder_config, state_dict = read_folder(source)
        config = folder_config if config is None else config
    elif isinstance(source, Mapping):
        state_dict = source
        if config is None:
            raise TypeError("from_hf(state_dict) needs config= (model.config, its dict, or config.json's)")
    elif hasattr(source, "state_dict") and hasattr(source, "config"):
        state_dict, config = source.state_dict(), source.config if config is None else config
    else:
        raise TypeError(f"source must be a transformers model, a checkpoint folder or a state_dict, got "
                        f"{type(source).__name__}")
    cfg = hf_lm_config(config, max_len=max_len)
    tied = _config_dict(config).get("tie_word_embeddings", False)
    return load_weights(TinyLM(cfg), state_dict, tied=tied)


__all__ = ["FAMILIES", "ROPE_TYPES", "read_safetensors", "write_safetensors", "read_folder", "hf_lm_config", "from_hf"]
