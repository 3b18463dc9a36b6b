"""The fused CPU kernel against the naive formula before it is used: a miscompiled kernel is never used.

The check runs in a thread of its own: the first use of the kernel may come from inside an operator call, where
autograd is off for the calling thread whatever ``torch.enable_grad`` says, or from inside a ``torch.func``
transform or ``torch.inference_mode``; grad mode, inference mode and the transforms' stack are per thread, and a
new thread starts with plain tensors and autograd on.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from diffattn_tutorial.kernels.cpu import boundary
from diffattn_tutorial.kernels.cpu.build import KernelUnavailable

Tensor = torch.Tensor


def self_check(lib: ctypes.CDLL) -> None:
    """Raise KernelUnavailable where ``lib`` disagrees with the naive formula (float64) on a small problem with
    every feature (GQA, tails in every dimension, causal, a mask, per-token lambda), forward and backward; run in a
    thread of its own (the module's docstring says why)."""
    result: list = []

    def run() -> None:
        try:
            _check(lib)
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            result.append(e)

    worker = threading.Thread(target=run, name="cpu_fused self-check")
    worker.start()
    worker.join()
    if result:
        raise result[0]


def _check(lib: ctypes.CDLL) -> None:
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 29, 24, generator=g), torch.randn(2, 2, 37, 24, generator=g)
    v, lam = torch.randn(2, 1, 37, 48, generator=g), torch.rand(2, 2, 29, 1, generator=g)
    mask = torch.randn(29, 37, generator=g).expand(2, 2, 29, 37)
    from diffattn_tutorial.formulations import naive_reference  # the reference (a layer above the kernels)

    tall = torch.randn(1, 2, 523, 24, generator=g)  # more rows than ROW_MAJOR_ROWS: k transposed, the score tiles
    for qq, kk, vv, ll, causal, m in ((q, k, v, lam, False, None), (q, k, v, lam, True, None), (q, k, v, lam, False,
                                      mask), (tall, k[:1, :2], v[:1, :1], lam[:1, :1, :1], False, None)):
        out, _ = boundary.forward(lib, qq, kk, vv, ll, m, causal, 24 ** -0.5)
        ref = naive_reference(qq.double(), kk.double(), vv.double(), ll.double(), causal=causal,
                              attn_mask=None if m is None else m.double())
        err = (out.double() - ref).abs().max().item()
        if not err < 1e-4:
            raise KernelUnavailable(f"the compiled kernel disagrees with the naive formula (max error {err:.3g}, "
                                    f"causal={causal}, mask={m is not None}); it is not used")
    for causal, m in ((True, None), (False, mask)):
        grad_out = torch.randn(2, 2, 29, 48, generator=g)
        ins = [t.double().requires_grad_() for t in (q, k, v, lam)]
        ref = naive_reference(*ins, causal=causal, attn_mask=None if m is None else m.double())
        expected = torch.autograd.grad(ref, ins, grad_out.double())
        dq, dk, dv, dlam = boundary.backward(lib, grad_out, q, k, v, lam, m, causal, 24 ** -0.5)
        got = (dq, dk, dv, dlam.unsqueeze(-1))
        err = max((a.double() - b).abs().max().item() for a, b in zip(got, expected))
        if not err < 1e-4:
            raise KernelUnavailable(f"the compiled kernel's gradients disagree with the naive formula's (max error "
                                    f"{err:.3g}, causal={causal}, mask={m is not None}); it is not used")
