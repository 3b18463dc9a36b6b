"""Issue 48's closing red-team pass over the round's changed entry points (the CPU kernel's boundary, the Triton
public path, conversion's warm-up, the loaders, the training cache, validation's checkers, the registry, the
CLI and decoding): each failure found, reproduced first. Crash-prone cases run in a child process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from diffattn_tutorial import validation
from diffattn_tutorial.functional import diff_attention


def inputs(d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 4, 5, d, generator=g), torch.randn(1, 4, 5, d, generator=g),
            torch.randn(1, 2, 5, 2 * d, generator=g))


def run_child(code: str) -> str:
    """``code`` in a fresh interpreter (the kernel loads there); its stdout. Fails on a nonzero exit."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_cpu_fused_inference_under_a_meta_default_device():
    """The operator's scan flag was made by ``torch.tensor(flag)`` on the default device: under
    ``with torch.device("meta")`` every CPU inference call through the fused kernel failed with "Tensor.item() cannot
    be called on meta tensors"."""
    out = run_child("""
        import torch
        from diffattn_tutorial.functional import diff_attention
        g = torch.Generator().manual_seed(0)
        q, k, v = torch.randn(1, 4, 5, 8, generator=g), torch.randn(1, 4, 5, 8, generator=g), torch.randn(1, 2, 5, 16, generator=g)
        ref = diff_attention(q, k, v, 0.5, backend="naive")
        with torch.device("meta"):
            fused = diff_attention(q, k, v, 0.5, backend="cpu_fused")
            flag = torch.ops.diffattn.cpu_fused_forward(q, k, v, torch.tensor(0.5, device="cpu"), None, False, 0.3,
                                                        scan=True)[2]
        print(fused.device, flag.device, float((fused - ref).abs().max()))
    """).split()
    assert out[:2] == ["cpu", "cpu"] and float(out[2]) < 1e-5
