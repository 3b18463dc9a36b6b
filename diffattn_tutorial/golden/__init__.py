"""Golden cases: the reference implementations' own recorded runs, shipped inside the package.

Each ``NAME.pt`` file was written by running a reference implementation itself (Microsoft unilm's
``multihead_diffattn.py`` / ``multihead_flashdiff_2.py`` / DIFF V2, timm's ``DiffAttention``; the
``diffllama/`` cases by ``tools/make_diffllama_golden.py`` from Hugging Face transformers' ``DiffLlamaAttention``).
A module case holds ``source``, ``variant``, ``config`` (the reference constructor's own keys), ``x``, ``rope``,
``causal``, ``attn_mask``, ``state_dict`` (the reference's parameter names), ``out``, ``g`` (upstream gradient),
``x_grad``, ``lr`` and ``state_dict_after_sgd`` (parameters after one plain SGD step on ``(out * g).sum()``).
The functional case holds ``q``, ``k``, ``v``, ``lam``, ``causal``, ``out`` and ``out_fp64``. The ``llama/`` cases
(``tools/make_llama_golden.py``, Hugging Face ``LlamaForCausalLM``, a whole model) hold ``config``, ``state_dict``,
``input_ids`` and ``logits``; the ``hf/`` cases (``tools/make_hf_golden.py``: transformers' Llama 3, Qwen2 and
Mistral models) also ``prompt`` and ``greedy`` (its ``generate``'s tokens). Tolerance: float32,
``rtol=1e-4, atol=1e-5``.

They are read through :mod:`importlib.resources`, so a notebook finds them wherever the package is installed
(a clone, a wheel, Colab)::

    from diffattn_tutorial import golden
    golden.names()                        # ['diffllama/gqa_bias_padding', ..., 'unilm_v1_mha', 'unilm_v2_mha']
    case = golden.load("unilm_v1_mha")    # a dict of tensors and plain values
"""

from __future__ import annotations

from importlib import resources
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # importlib.resources.abc is Python >= 3.11; the package supports 3.10
    from importlib.abc import Traversable

SUFFIX = ".pt"


def _case_files(folder: Traversable, prefix: str = "") -> dict[str, Traversable]:
    """``{name: file}`` for every ``.pt`` file under ``folder``, names relative to it without the suffix."""
    found: dict[str, Traversable] = {}
    for entry in folder.iterdir():
        if entry.is_dir() and not entry.name.startswith("__"):
            found.update(_case_files(entry, f"{prefix}{entry.name}/"))
        elif entry.is_file() and entry.name.endswith(SUFFIX):
            found[prefix + entry.name[: -len(SUFFIX)]] = entry
    return found


def names(folder: str = "") -> list[str]:
    """Names of the golden cases, sorted, e.g. ``"unilm_v1_mha"`` or ``"diffllama/mha_causal"``.

    Args:
        folder: only the cases in this sub-folder (``"diffllama"``), or ``""`` for every case.
    """
    every = sorted(_case_files(resources.files(__name__)))
    prefix = f"{folder.strip('/')}/" if folder else ""
    chosen = [name for name in every if name.startswith(prefix)]
    if not chosen:
        folders = sorted({name.rsplit("/", 1)[0] for name in every if "/" in name})
        raise ValueError(f"folder must be one of {folders} or '' (every case); got {folder!r}")
    return chosen


def load(name: str) -> dict:
    """The golden case ``name`` (one of :func:`names`), loaded with ``torch.load(..., weights_only=True)``.

    Each call returns fresh tensors, so a caller may change them in place.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str such as 'unilm_v1_mha', got {type(name).__name__}")
    files = _case_files(resources.files(__name__))
    if name not in files:
        raise ValueError(f"name must be one of diffattn_tutorial.golden.names(): {sorted(files)}; got {name!r}")
    with files[name].open("rb") as handle:
        return torch.load(handle, weights_only=True)


__all__ = ["load", "names"]
