"""The learning-rate schedule the course's trainers share: a linear warm-up, then a cosine decay to 0.

Used by the toy study's :func:`~diffattn_tutorial.training.study.train_toy_model` (and so the fine-tunes of notebook
14) and by the torchrun loop :func:`diffattn_tutorial.training.loop.train`.
"""

from __future__ import annotations

import math


def lr_factor(step: int, steps: int, warmup: int) -> float:
    """Learning-rate multiplier at 0-based ``step``: linear warm-up over ``warmup`` steps times a cosine from 1 to
    0 over ``steps``."""
    return min(1.0, (step + 1) / max(warmup, 1)) * 0.5 * (1 + math.cos(math.pi * min(step, steps) / steps))


__all__ = ["lr_factor"]
