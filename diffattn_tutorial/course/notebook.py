"""Small helpers the notebooks share: seeding, device choice and the version/device report."""

from __future__ import annotations

import platform
import random

import torch


def pick_device(prefer_gpu: bool = True) -> torch.device:
    """CUDA when present, else CPU. (MPS is not used: several ops the course needs are not exact there.)"""
    return torch.device("cuda" if prefer_gpu and torch.cuda.is_available() else "cpu")


def seed_everything(seed: int = 0) -> None:
    """Seed Python, and torch on every device, for reproducible notebooks."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # numpy is optional
        pass


def setup(seed: int = 0, *, quiet: bool = False) -> torch.device:
    """Seed everything, print versions and the device, return the device to use.

    Put the call in a cell marked ``# NBVAL_IGNORE_OUTPUT``: versions and devices vary between machines.
    """
    import diffattn_tutorial

    seed_everything(seed)
    device = pick_device()
    if not quiet:
        gpu = torch.cuda.get_device_name(0) if device.type == "cuda" else "none"
        print(f"python {platform.python_version()} | torch {torch.__version__} | "
              f"diffattn_tutorial {diffattn_tutorial.__version__}")
        print(f"device: {device} (GPU: {gpu}; CPU threads: {torch.get_num_threads()})")
    return device


def on_gpu() -> bool:
    """True when a CUDA GPU is present (GPU-only cells check this and skip with a printed reason)."""
    return torch.cuda.is_available()
