"""transformers' Llama-family weight names and TinyLM's, and loading one into the other with every mismatch named.

One home for the mapping that :func:`~diffattn_tutorial.hf.checkpoints.from_hf` (Llama, Qwen2, Mistral),
:func:`~diffattn_tutorial.interop.from_llama` and :func:`~diffattn_tutorial.hf.export.save_hf` share: the parameter
names of a decoder layer and of the model around it, and the RoPE row order (Llama rotates dims ``j`` and ``j + d/2`` of a head,
TinyLM dims ``2j`` and ``2j + 1``: q and k rows are reordered per head,
:func:`~diffattn_tutorial.layers.rope.half_split_to_interleaved`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from diffattn_tutorial.layers.rope import half_split_to_interleaved
from diffattn_tutorial.validation import check_not_meta, check_state_dict

Tensor = torch.Tensor

BLOCK_NAMES: dict[str, str] = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "mlp_norm.weight",
    "self_attn.q_proj.weight": "attn.q_proj.weight", "self_attn.k_proj.weight": "attn.k_proj.weight",
    "self_attn.v_proj.weight": "attn.v_proj.weight", "self_attn.o_proj.weight": "attn.out_proj.weight",
    "self_attn.q_proj.bias": "attn.q_proj.bias", "self_attn.k_proj.bias": "attn.k_proj.bias",
    "self_attn.v_proj.bias": "attn.v_proj.bias",
    "mlp.gate_proj.weight": "mlp.gate.weight", "mlp.up_proj.weight": "mlp.up.weight",
    "mlp.down_proj.weight": "mlp.down.weight"}
"""A decoder layer's parameter names (under ``model.layers.{i}.``) in the Llama family -> a TinyLM block's."""

TOP_NAMES: dict[str, str] = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
                             "lm_head.weight": "head.weight"}
"""The names around the layers -> TinyLM's."""


class CheckpointError(ValueError):
    """A Hugging Face checkpoint that cannot be loaded or saved exactly; the message names what and the fix."""


def tinylm_state(sd: dict[str, Tensor], n_layers: int, head_dim: int,
                 tied: bool) -> tuple[dict[str, Tensor], dict[str, str]]:
    """transformers' names -> TinyLM's, q/k rows reordered; pops what it maps from ``sd`` (what stays is
    unexpected) and returns the mapped tensors and ours -> theirs."""
    if tied and "lm_head.weight" not in sd and "model.embed_tokens.weight" in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    out, names = {}, {}
    for theirs, ours in TOP_NAMES.items():
        if theirs in sd:
            out[ours], names[ours] = sd.pop(theirs), theirs
    for i in range(n_layers):
        for theirs, ours in BLOCK_NAMES.items():
            key = f"model.layers.{i}.{theirs}"
            if key in sd:
                t = sd.pop(key)
                if theirs.startswith(("self_attn.q_proj", "self_attn.k_proj")) and t.dim() >= 1 \
                        and t.shape[0] % head_dim == 0:  # another shape is named by load_weights
                    t = half_split_to_interleaved(t, head_dim)
                out[f"blocks.{i}.{ours}"], names[f"blocks.{i}.{ours}"] = t, key
    return out, names


def their_name(ours: str) -> str:
    """transformers' name of TinyLM parameter ``ours`` (``blocks.1.attn.k_proj.weight`` ->
    ``model.layers.1.self_attn.k_proj.weight``)."""
    top = {v: k for k, v in TOP_NAMES.items()}
    if ours in top:
        return top[ours]
    _, i, rest = ours.split(".", 2)
    return f"model.layers.{i}.{ {v: k for k, v in BLOCK_NAMES.items()}.get(rest, rest)}"


def load_weights(model, state_dict: Mapping[str, Tensor], *, tied: bool, loader: str = "from_hf"):
    """Load transformers-named weights into a baseline ``model`` (TinyLM), as float32, and return it in eval mode;
    refuses by name, before anything is loaded: an entry that is no floating-point dense tensor, a model built on the
    meta device, and every missing, unexpected or misshapen tensor (by transformers' name)."""
    if not isinstance(tied, bool):  # a config written by hand: "false" would count as True
        raise CheckpointError(f"{loader}(): tie_word_embeddings must be true or false, got {tied!r}")
    check_state_dict(state_dict, loader)
    check_not_meta(model, loader)
    sd = {k: v.detach().to(torch.float32) for k, v in state_dict.items()
          if not k.endswith("rotary_emb.inv_freq")}  # a buffer some older checkpoints carry
    out, names = tinylm_state(sd, model.cfg.n_layers, model.cfg.head_dim, tied)
    own = model.state_dict()
    missing = sorted(their_name(k) for k in own if k not in out)
    unexpected = sorted([*sd, *(names[k] for k in out if k not in own)])  # e.g. q/k/v biases a Llama has not
    if unexpected or missing:
        raise CheckpointError(f"the checkpoint's weights do not match its config: missing {missing}, unexpected "
                              f"{unexpected} (num_hidden_layers, tie_word_embeddings and the family must be the "
                              f"checkpoint's own)")
    wrong = [f"{names[k]}: checkpoint {tuple(out[k].shape)}, config {tuple(v.shape)}"
             for k, v in own.items() if out[k].shape != v.shape]
    if wrong:
        raise CheckpointError(f"the checkpoint's weights have other shapes than its config says: {'; '.join(wrong)}")
    model.load_state_dict(out)
    return model.eval()


__all__ = ["BLOCK_NAMES", "TOP_NAMES", "CheckpointError", "tinylm_state", "their_name", "load_weights"]
