"""Rotary position embeddings (RoPE) in both layouts the references use.

* **interleaved** (GPT-J, unilm's ``apply_rotary_emb(..., interleaved=True)``): dims ``(0, 1), (2, 3), ...``
  are rotated as pairs.
* **half-split** (GPT-NeoX, Llama, HF): dim ``j`` pairs with dim ``j + r/2``.

``cos`` and ``sin`` have shape ``(N, r/2)`` for a rotary dim ``r <= d``; dims past ``r`` pass through.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Union

import torch

Tensor = torch.Tensor


def rope_cos_sin(
    seq_len: int,
    rot_dim: int,
    *,
    base: float = 10000.0,
    offset: int = 0,
    device: Optional[Union[str, torch.device]] = None,
    dtype: torch.dtype = torch.float32,
    scaling: Optional[Mapping[str, Any]] = None,
) -> tuple[Tensor, Tensor]:
    """``(cos, sin)``, each ``(seq_len, rot_dim // 2)``, for positions ``offset .. offset + seq_len - 1``.

    Angle of position ``p`` and frequency ``i``: ``p * base ** (-2i / rot_dim)``. Use ``offset`` for cached
    decoding: the token at position ``t`` gets ``rope_cos_sin(1, r, offset=t)``. ``scaling``: Llama 3.1's
    frequency scaling (:func:`llama3_inv_freq`, its keys as :data:`LLAMA3_KEYS`); None (the default): none.
    """
    if rot_dim <= 0 or rot_dim % 2:
        raise ValueError(f"rot_dim must be a positive even number, got {rot_dim}")
    if seq_len < 0 or offset < 0:
        raise ValueError(f"seq_len and offset must be >= 0, got seq_len={seq_len}, offset={offset}")
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, device=device, dtype=torch.float64) / rot_dim)
    if scaling is not None:
        inv_freq = llama3_inv_freq(inv_freq, **check_llama3_scaling(scaling))
    pos = torch.arange(offset, offset + seq_len, device=device, dtype=torch.float64)
    angles = torch.outer(pos, inv_freq)
    return angles.cos().to(dtype), angles.sin().to(dtype)


LLAMA3_KEYS: tuple[str, ...] = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
"""The keys of Llama 3.1's RoPE scaling (``rope_parameters`` with ``rope_type="llama3"`` in a ``LlamaConfig``)."""


def check_llama3_scaling(scaling: Mapping[str, Any]) -> dict[str, float]:
    """``scaling``'s four :data:`LLAMA3_KEYS` as numbers (other keys, such as ``rope_type`` or ``rope_theta``, are
    the caller's); a missing key, a number <= 0, or ``high_freq_factor <= low_freq_factor`` refused by name."""
    if not isinstance(scaling, Mapping):
        raise TypeError(f"scaling must be a dict with the keys {LLAMA3_KEYS}, got {type(scaling).__name__}")
    missing = [k for k in LLAMA3_KEYS if k not in scaling]
    if missing:
        raise ValueError(f"llama3 RoPE scaling needs the key(s) {missing} (as in a LlamaConfig's rope_parameters)")
    out = {k: scaling[k] for k in LLAMA3_KEYS}
    for k, v in out.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
            raise ValueError(f"llama3 RoPE scaling: {k} must be a number > 0, got {v!r}")
    if out["high_freq_factor"] <= out["low_freq_factor"]:
        raise ValueError(f"llama3 RoPE scaling: high_freq_factor ({out['high_freq_factor']}) must exceed "
                         f"low_freq_factor ({out['low_freq_factor']})")
    return out


def llama3_inv_freq(inv_freq: Tensor, *, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_position_embeddings: float) -> Tensor:
    """Llama 3.1's RoPE frequencies (transformers' ``rope_type="llama3"``): a frequency whose wavelength
    ``2 pi / f`` is shorter than ``original_max_position_embeddings / high_freq_factor`` is kept, one longer than
    ``original / low_freq_factor`` divided by ``factor``, and those between interpolated smoothly."""
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def check_rope(rope: object, seq_len: int, head_dim: int) -> tuple[Tensor, Tensor]:
    """Validate a ``rope=(cos, sin)`` argument for ``seq_len`` tokens and heads of width ``head_dim``."""
    if not (isinstance(rope, (tuple, list)) and len(rope) == 2 and all(isinstance(t, Tensor) for t in rope)):
        raise TypeError("rope must be a tuple (cos, sin) of tensors of shape (N, rot_dim/2); "
                        "build it with diffattn_tutorial.layers.rope.rope_cos_sin(N, rot_dim)")
    cos, sin = rope
    if cos.shape != sin.shape or cos.ndim != 2:
        raise ValueError(f"rope cos and sin must both be (N, rot_dim/2), got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.shape[0] != seq_len:
        raise ValueError(f"rope covers {cos.shape[0]} positions but the input has {seq_len} tokens; for cached "
                         f"decoding pass rope_cos_sin(N, rot_dim, offset=position_of_first_token)")
    if 2 * cos.shape[1] > head_dim:
        raise ValueError(f"rope rotates {2 * cos.shape[1]} dims but the head dim is {head_dim}; use rot_dim <= {head_dim}")
    return cos, sin


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = True) -> Tensor:
    """Rotate ``x`` of shape ``(..., N, d)`` by ``cos``/``sin`` of shape ``(N, r/2)``, ``r <= d``.

    ``interleaved=True`` is the GPT-J layout (unilm); ``False`` is the half-split NeoX/Llama layout.
    """
    half = cos.shape[-1]
    r = 2 * half
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x_rot, x_pass = x[..., :r], x[..., r:]
    if interleaved:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        rot = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    else:
        x1, x2 = x_rot[..., :half], x_rot[..., half:]
        rot = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return torch.cat([rot, x_pass], dim=-1) if x_pass.shape[-1] else rot


def interleaved_to_half_split(w: Tensor, head_dim: int, dim: int = 0) -> Tensor:
    """Permute a projection's output rows so interleaved RoPE on the old equals half-split on the new.

    ``w`` holds heads of width ``head_dim`` along ``dim`` (e.g. ``q_proj.weight``).
    """
    perm_one = torch.cat([torch.arange(0, head_dim, 2, device=w.device), torch.arange(1, head_dim, 2, device=w.device)])
    n_heads = w.shape[dim] // head_dim
    perm = (perm_one[None, :] + head_dim * torch.arange(n_heads, device=w.device)[:, None]).flatten()
    return w.index_select(dim, perm)


def half_split_to_interleaved(w: Tensor, head_dim: int) -> Tensor:
    """The inverse of :func:`interleaved_to_half_split` along rows: a Llama-family q/k projection's rows (or bias),
    half-split RoPE, reordered per head so interleaved RoPE rotates the same pairs (the scores ``q.k`` are sums
    over the same pairs)."""
    one = interleaved_to_half_split(torch.arange(head_dim)[:, None], head_dim)[:, 0]  # (d,) where each row went
    return w.unflatten(0, (-1, head_dim))[:, torch.argsort(one)].flatten(0, 1)  # (H*d, ...) -> (H, d, ...) -> back
