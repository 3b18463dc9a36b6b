"""The flags that select a kernel variant, one convention for the host code and the ``@triton.jit`` kernels.

A launch of a differential-attention kernel computes one map or both: ``MAPS`` (forward), ``DK_MAPS`` (the dK/dV
kernel) and ``DQ_MAPS`` (the dQ kernel) take one of the ``MAPS_*`` values below, a set of maps written as bits
(bit 0 map 1, bit 1 map 2), so ``MAPS_BOTH == MAPS_1 | MAPS_2`` and ``MAPS_NONE`` means no map (a dK/dV launch
that only accumulates dV). ``MASK_KIND`` says what the user's mask holds: none, bool (True = may attend) or
additive (natural-log units). The values are plain ints here, for the host (plans, launch constants, autotune
keys, recorded launches); :mod:`~diffattn_tutorial.kernels.triton.flash_kernels` wraps the same values as
module-level ``tl.constexpr`` under the same names, so a kernel reads ``if MASK_KIND == MASK_BOOL:`` where the
host wrote ``MASK_KIND=MASK_BOOL``.
"""

from __future__ import annotations

MAPS_NONE, MAPS_1, MAPS_2 = 0, 1, 2
MAPS_BOTH = MAPS_1 | MAPS_2
"""Which maps a launch computes: none, map 1, map 2, or both (bits: map 1 is bit 0, map 2 bit 1)."""

MASK_NONE, MASK_BOOL, MASK_ADD = 0, 1, 2
"""What the user's mask holds: no mask, bool (True = may attend), or additive (added to the scores)."""


__all__ = ["MAPS_NONE", "MAPS_1", "MAPS_2", "MAPS_BOTH", "MASK_NONE", "MASK_BOOL", "MASK_ADD"]
