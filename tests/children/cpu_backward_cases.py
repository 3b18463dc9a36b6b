"""The CPU kernel's backward, the cases of ``tests/test_cpu_backward.py`` that run in a child process (the kernel
reads raw pointers: a crash fails one test, not pytest). ``python -m children.cpu_backward_cases CASE``, CASE one of
``groups``, ``empty``, ``default_dtype``; each prints ``<CASE> OK`` when it holds."""

import sys

import torch

from diffattn_tutorial.functional import diff_attention
from diffattn_tutorial.kernels.cpu import cpu_fused
from diffattn_tutorial.kernels.cpu.cpu_fused import fused_diff_attention
from diffattn_tutorial.measure.cpu_threads import threads

# (B, H, Hkv, Nq, Nk, d, causal): one head pair's 9 blocks of 48 query rows in 8 groups (blocks 0 and 8 share
# one), each with partial sums of dk and dv; GQA adds two heads' partial sums per key; Nq != Nk shifts the causal
# diagonal. The last case's partial sums (600 keys x 4 x 256 floats) over 1100 rows take the taller blocks of rows
# (BACKWARD_ROWS_LONG).
GROUP_CASES = ((1, 1, 1, 400, 430, 64, True), (1, 2, 1, 400, 300, 64, False), (2, 2, 1, 150, 170, 64, True),
               (1, 1, 1, 1100, 600, 256, True))


def groups() -> None:
    """Many row blocks per head: the partial sums of every group of row blocks (and of every head of a GQA group)
    add up to naive's gradients, with the same bits on 1 and 3 threads, the forward's maps kept and recomputed."""
    g = torch.Generator().manual_seed(3)
    # first a larger call: the block of buffers each call reuses holds its numbers (nothing may be read unwritten)
    big = [torch.randn(2, 4, 500, 64), torch.randn(2, 4, 500, 64), torch.randn(2, 2, 500, 128), torch.tensor(0.5)]
    big = [t.requires_grad_() for t in big[:3]] + big[3:]
    diff_attention(*big, backend="cpu_fused").sum().backward()
    kept_bytes = cpu_fused.MAPS_KEPT_BYTES
    for kept in (kept_bytes, 0):
        for B, H, Hkv, Nq, Nk, d, causal in GROUP_CASES:
            cpu_fused.MAPS_KEPT_BYTES = kept
            ins = [torch.randn(B, 2 * H, Nq, d, generator=g), torch.randn(B, 2 * Hkv, Nk, d, generator=g),
                   torch.randn(B, Hkv, Nk, 2 * d, generator=g), torch.rand(B, H, Nq, 1, generator=g)]
            grad_out = torch.randn(B, H, Nq, 2 * d, generator=g)

            def grads(backend, dtype, ins=ins, grad_out=grad_out, causal=causal):
                leaves = [t.to(dtype).requires_grad_() for t in ins]
                out = diff_attention(*leaves, causal=causal, backend=backend)
                return torch.autograd.grad(out, leaves, grad_out.to(dtype))

            expected = grads("naive", torch.float64)
            with threads(1):
                one = grads("cpu_fused", torch.float32)
            with threads(3):
                three = grads("cpu_fused", torch.float32)
            for name, a, b, e in zip(("dq", "dk", "dv", "dlam"), one, three, expected):
                assert torch.equal(a, b), f"{name} depends on the thread count ({B, H, Hkv, Nq, Nk, d, causal, kept})"
                torch.testing.assert_close(a.double(), e, rtol=1e-4, atol=1e-5 * max(1.0, e.abs().max().item()))


def empty() -> None:
    """B = 0 through the operators: empty gradients, not a crash."""
    q = torch.randn(0, 4, 8, 32, requires_grad=True)
    k, v, lam = torch.randn(0, 4, 8, 32), torch.randn(0, 2, 8, 64), torch.tensor(0.5, requires_grad=True)
    fused_diff_attention(q, k, v, lam, scale=32 ** -0.5).sum().backward()
    dq, dk, dv, dlam = torch.ops.diffattn.cpu_fused_backward(torch.randn(0, 2, 8, 64), q.detach(), k, v,
                                                              lam.detach(), None, True, 0.1)
    assert q.grad.shape == q.shape and lam.grad == 0 and dk.shape == k.shape and dlam.shape == (0, 2, 8)


def default_dtype() -> None:
    """The kernel's float32 buffers (kept maps, dlam, a bool mask's additive copy) do not follow torch's default
    dtype: the output and gradients are the same bits under a float16, bfloat16 or float64 default."""
    g = torch.Generator().manual_seed(0)
    ins = [torch.randn(1, 4, 40, 32, generator=g), torch.randn(1, 4, 50, 32, generator=g),
           torch.randn(1, 2, 50, 64, generator=g), torch.rand(1, 2, 40, 1, generator=g)]
    mask = torch.rand(1, 1, 40, 50, generator=g) < 0.8

    def grads():
        leaves = [t.clone().requires_grad_() for t in ins]
        out = diff_attention(*leaves, attn_mask=mask, backend="cpu_fused")
        return [out.detach()] + list(torch.autograd.grad(out, leaves, torch.ones_like(out)))

    expected = grads()
    for default in (torch.float16, torch.bfloat16, torch.float64):
        torch.set_default_dtype(default)
        for a, b in zip(grads(), expected):
            assert a.dtype == torch.float32 and torch.equal(a, b), default
        torch.set_default_dtype(torch.float32)


CASES = {"groups": groups, "empty": empty, "default_dtype": default_dtype}

if __name__ == "__main__":
    CASES[sys.argv[1]]()
    print(f"{sys.argv[1].replace('_', ' ').upper()} OK")
