"""The fused CPU kernel, the cases of ``tests/test_cpu_kernel.py`` that need a fresh process: a build with other
flags, the kernel's first use, its kept buffers. ``python -m children.cpu_kernel_cases CASE``, CASE one of
``narrow_build``, ``first_use_operator``, ``first_use_under_torch_func``, ``kept_buffers``; each prints what its test
reads (``<case> OK`` or the values it compares)."""

import resource
import sys

import torch
from torch.func import grad, vmap

from diffattn_tutorial.functional import backend_status, diff_attention
from diffattn_tutorial.kernels.cpu import build, cpu_fused
from diffattn_tutorial.measure.cpu_threads import threads


def narrow_build() -> None:
    """The narrow build (``-DDIFFATTN_NARROW``: the tiles of an AVX2 or NEON build, on any CPU) passes its
    self-check and equals naive's float64 answer forward and backward, on both score paths and any thread count."""
    build.NATIVE_FLAGS = (*build.NATIVE_FLAGS, "-DDIFFATTN_NARROW")
    ok, why = cpu_fused.kernel_status()  # its self-check: both forward paths and the backward against float64
    assert ok, why
    assert cpu_fused.vector_floats() == 8
    g = torch.Generator().manual_seed(5)
    for nq, nk, causal in ((3, 200, False), (77, 77, True), (530, 45, False), (600, 600, True)):
        q, k = torch.randn(2, 4, nq, 32, generator=g), torch.randn(2, 2, nk, 32, generator=g)
        v, lam = torch.randn(2, 1, nk, 64, generator=g), torch.rand(2, 2, nq, 1, generator=g)
        ins = [t.clone().requires_grad_() for t in (q, k, v, lam)]
        out = diff_attention(*ins, causal=causal, backend="cpu_fused")
        out.backward(torch.ones_like(out))
        ref = [t.double().requires_grad_() for t in (q, k, v, lam)]
        expected = diff_attention(*ref, causal=causal, backend="naive")
        expected.backward(torch.ones_like(expected))
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=2e-6)
        for a, b in zip(ins, ref):
            torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-4, atol=1e-4)
        with torch.no_grad(), threads(3):
            assert torch.equal(diff_attention(q, k, v, lam, causal=causal, backend="cpu_fused"), out.detach())
    print("narrow build ok")


def small():
    return torch.randn(1, 4, 5, 8), torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 16), torch.tensor(0.5)


def first_use_operator() -> None:
    """The kernel's first use a direct operator call (autograd off for the thread): prints its status and whether
    the output is naive's."""
    q, k, v, lam = small()
    out = torch.ops.diffattn.cpu_fused_forward(q, k, v, lam, None, False, 8 ** -0.5)[0]
    ref = diff_attention(q, k, v, lam, backend="naive")
    print(cpu_fused.kernel_status()[0], bool(torch.allclose(out, ref, atol=1e-5)))


def first_use_under_torch_func() -> None:
    """The kernel's first use its status, asked under ``grad`` and ``vmap``: prints the status seen there and
    whether a later call's output is naive's."""
    seen = []

    def f(x):
        seen.append(backend_status()["cpu_fused"][0])
        return x.sum()

    grad(f)(torch.randn(3))
    vmap(f)(torch.randn(2, 3))
    q, k, v, lam = small()
    out = diff_attention(q, k, v, lam, backend="cpu_fused")
    ref = diff_attention(q, k, v, lam, backend="naive")
    print(*seen, bool(torch.allclose(out, ref, atol=1e-5)))


def kept_buffers() -> None:
    """A call's buffers come from a block kept for the thread's next call (no fresh pages to fault in); a block above
    the limit is freed after its call, and ``release_buffers`` frees it at once."""
    lib = cpu_fused._kernel()
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 8, 1024, 64, generator=g), torch.randn(1, 8, 1024, 64, generator=g)
    v, lam = torch.randn(1, 4, 1024, 128, generator=g), torch.tensor(0.3)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def step():
        diff_attention(q, k, v, lam, causal=True, backend="cpu_fused").sum().backward()

    def faults():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step()
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    step()
    kept = lib.diff_attention_cpu_kept_bytes()
    assert kept >= 12 << 20, kept  # k and v transposed (4 MiB), the partial sums of dk and dv (8 MiB), the scores
    reused = min(faults() for _ in range(3))
    cpu_fused.release_buffers()
    assert lib.diff_attention_cpu_kept_bytes() == 0
    fresh = faults()
    assert fresh - reused > (kept >> 12) // 2, (fresh, reused, kept)  # a fresh block faults its pages in, a kept one not
    assert lib.diff_attention_cpu_keep_at_most(kept - 1) == 64 << 20
    step()
    assert lib.diff_attention_cpu_kept_bytes() == 0  # above the limit: freed after its call
    print("KEPT OK")


CASES = {f.__name__: f for f in (narrow_build, first_use_operator, first_use_under_torch_func, kept_buffers)}

if __name__ == "__main__":
    CASES[sys.argv[1]]()
