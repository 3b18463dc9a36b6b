"""Small helpers the notebook checks share (beyond ``_core``): seeded construction, head permutations
and turning a learner's numbers into tensors.

Not a ``nbNN`` module, so ``diffattn_tutorial.checks`` does not re-export anything from here.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from diffattn_tutorial.checks._core import fail

Tensor = torch.Tensor


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run a block under ``torch.manual_seed(seed)`` without disturbing the learner's RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def swap_pairs(t: Tensor) -> Tensor:
    """Exchange heads ``2i`` and ``2i+1`` (dim 1): the two maps of every pair change places."""
    n = t.shape[1]
    perm = torch.arange(n).view(-1, 2).flip(-1).flatten()
    return t[:, perm]


def blocked_as_interleaved(t: Tensor) -> Tensor:
    """Reorder heads so that interleaved pairing of the result is *blocked* pairing of ``t``.

    Blocked pairing takes map 1 from heads ``0..n-1`` and map 2 from heads ``n..2n-1`` (HF DiffLlama);
    the result puts head ``i`` at ``2i`` and head ``n+i`` at ``2i+1``.
    """
    n = t.shape[1] // 2
    perm = torch.stack([torch.arange(n), torch.arange(n) + n], dim=1).flatten()
    return t[:, perm]


def tiled_kv(k: Tensor, v: Tensor, num_heads: int) -> tuple[Tensor, Tensor]:
    """A GQA mistake: the KV groups **tiled** (``repeat``), so differential head ``i`` reads group ``i % Hkv``
    instead of ``i // (H // Hkv)``. k ``(B, 2Hkv, N, d)``, v ``(B, Hkv, N, 2d)`` -> ``(B, 2H, N, d)``,
    ``(B, H, N, 2d)``; each key pair ``(2g, 2g + 1)`` stays together."""
    rep = num_heads // v.shape[1]
    return k.repeat(1, rep, 1, 1), v.repeat(1, rep, 1, 1)


def kv_heads_one_by_one(k: Tensor, v: Tensor, num_heads: int) -> tuple[Tensor, Tensor]:
    """A GQA mistake (unilm's naive file, vasqu's four calls): each of the 2Hkv key heads repeated in place
    on its own, so the two maps of a differential head can read the same key map. Shapes as :func:`tiled_kv`."""
    rep = num_heads // v.shape[1]
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


def as_numbers(values: list, *, what: str) -> Tensor:
    """The learner's scalar results as one float64 tensor (Python numbers, 0-dim tensors or numpy scalars)."""
    out = []
    for v in values:
        if isinstance(v, Tensor):
            if v.numel() != 1:
                fail(f"{what} should return one number, got a tensor of shape {tuple(v.shape)}")
            v = v.item()
        try:
            out.append(float(v))
        except (TypeError, ValueError):
            fail(f"{what} should return a number, got {type(v).__name__}")
    return torch.tensor(out, dtype=torch.float64)




def library_diff_attention() -> dict:
    """``{implementation: what it is}`` for every differential attention the library computes from q, k, v and
    lambda (``functional``'s entry points and ``formulations``' backends): what a task that asks for the dual
    softmax written out refuses (``exercise_check(refuses=...)``)."""
    from diffattn_tutorial import formulations
    from diffattn_tutorial.functional import diff_attention, diff_attention_maps
    backends = (formulations.naive, formulations.naive_reference, formulations.chunked, formulations.dual_maps,
                formulations.sdpa_wide, formulations.sdpa_split, formulations.sdpa_stacked, formulations.sdpa_padded)
    return {diff_attention: "the library's diff_attention", diff_attention_maps: "the library's diff_attention_maps",
            **{f: f"the library's formulations.{f.__name__}" for f in backends}}
