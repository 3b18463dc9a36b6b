"""``diff_attention(..., backend="triton")`` costs nothing beyond the kernels' launches (issue 51, item 1).

On finite inputs the public call runs the kernels and O(1) small operations: no pass over q, k, v or the output of its
own (the NaN contract is met inside the kernels: a scan of the scores and accumulators sets a flag, and a careful
launch that does nothing unless the flag is set recomputes exactly the rows that read a NaN or an infinity), and no
host synchronisation. Proved here under a ``TorchDispatchMode`` that counts every PyTorch operation the call issues
outside the kernels' launches and the bytes each one reads (Triton's interpreter on a CPU: ``tests/conftest.py``
sets ``TRITON_INTERPRET=1``). Before this change the call read q, k and v with ``isfinite`` (three full reads),
copied q with ``torch.where`` and filled the output with ``masked_fill``.
"""

import contextlib

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")

from diffattn_tutorial.backends import get_backend  # noqa: E402
from diffattn_tutorial.functional import diff_attention  # noqa: E402
from diffattn_tutorial.kernels.triton import flash_diff, launch  # noqa: E402


@pytest.fixture(autouse=True)
def _triton_runs_here():
    """Asked when a test runs, not at collection (nothing runs then); the Triton backend's own status only."""
    ok, why = get_backend("triton").status(torch.device("cpu"))
    if not ok:
        pytest.skip(f"Triton does not run here: {why}")


SYNCS = {"aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.equal"}  # a host waits for the device


OPERATORS = {"diffattn.triton_forward": flash_diff.triton_forward._init_fn,
             "diffattn.triton_backward": flash_diff.triton_backward._init_fn}


class OutsideKernels(TorchDispatchMode):
    """Records ``(op, bytes read, largest numel it reads or writes)`` for every operation issued outside a kernel launch (views
    read nothing and are left out). The
    library's own operators (``diffattn::*``) are the kernels' boundary: their inputs are not counted as read, and
    the operations inside their host code are (the mode is entered again there)."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, int, int]] = []
        self.inside = 0  # > 0 while a kernel launch runs (the interpreter's own copies are the kernel's reads)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)
        if name in OPERATORS:  # the operator's host code, seen op by op (calling func again would come back here)
            with self:
                return OPERATORS[name](*args, **kwargs)
        if not self.inside and not func.is_view:  # a view reads nothing
            tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            read = sum(t.numel() * t.element_size() for t in tensors)
            result = func(*args, **kwargs)
            if not str(name).startswith(("aten.empty", "aten.new_empty")):  # an allocation writes nothing
                tensors += [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
            self.ops.append((name, read, max((t.numel() for t in tensors), default=0)))
            return result
        return func(*args, **kwargs)


@contextlib.contextmanager
def counting(monkeypatch):
    """The mode, with every kernel of ``flash_diff.KERNELS`` wrapped so that its launches are marked; yields the
    mode and the list of ``(kernel, q pointer it got)`` per launch."""
    mode, launched = OutsideKernels(), []

    class Marked:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            run = self.kernel[grid]

            def call(*args, **kwargs):
                launched.append((self.name, kwargs.get("Q").data_ptr() if "Q" in kwargs else None,
                                 kwargs.get("CAREFUL", False)))
                mode.inside += 1
                try:
                    return run(*args, **kwargs)
                finally:
                    mode.inside -= 1
            return call

    for name, kernel in flash_diff.KERNELS.items():
        monkeypatch.setitem(flash_diff.KERNELS, name, Marked(name, kernel))
    monkeypatch.delenv(launch.POISON_ENV, raising=False)  # NaN-filled buffers are a test aid, a pass of their own
    with mode:
        yield mode, launched


def make(B=1, H=2, Hkv=1, N=48, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, 2 * H, N, d, generator=g), torch.randn(B, 2 * Hkv, N, d, generator=g),
            torch.randn(B, Hkv, N, 2 * d, generator=g))


def assert_no_pass(mode, q, k, v, out_numel):
    """No operation outside the kernels reads a tensor of q's, k's, v's or the output's size; the ones there are
    read at most 1/8 of q's bytes in all, and none waits for the device."""
    full = min(q.numel(), k.numel(), v.numel(), out_numel)
    big = [(op, n) for op, _, n in mode.ops if n >= full]
    assert not big, f"operations outside the kernels read a full-size tensor: {big}"
    read = sum(b for _, b, _ in mode.ops)
    assert read <= q.numel() * q.element_size() // 8, (read, mode.ops)
    assert not [op for op, _, _ in mode.ops if op in SYNCS], mode.ops
    assert len(mode.ops) <= 12, mode.ops  # O(1): the flag, lambda as a tensor, views


@pytest.mark.parametrize("causal,masked", [(False, False), (True, False), (False, True)])
def test_the_public_forward_adds_no_pass_over_q_k_v_or_the_output(monkeypatch, causal, masked):
    q, k, v = make()
    mask = torch.ones(48, 48, dtype=torch.bool).tril() if masked else None
    with counting(monkeypatch) as (mode, launched):
        out = diff_attention(q, k, v, 0.4, causal=causal, attn_mask=mask, backend="triton")
    print(len(mode.ops), "ops outside the kernels:", mode.ops)
    assert_no_pass(mode, q, k, v, out.numel())
    fwd = [x for x in launched if x[0] == "_diff_attn_fwd"]
    assert fwd and all(ptr == q.data_ptr() for _, ptr, _ in fwd), "the kernel got a copy of q, not q"
    assert [c for _, _, c in fwd] == [False] * (len(fwd) // 2) + [True] * (len(fwd) // 2)  # plain, then careful
    ref = diff_attention(q, k, v, 0.4, causal=causal, attn_mask=mask, backend="naive")
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_training_adds_no_pass_either(monkeypatch):
    """Forward and backward (``torch.autograd.grad``): the gradients' buffers are allocated, never filled or read
    outside the kernels; dlam is summed from the per-row statistics, not from a tensor of the output's size."""
    q, k, v = (t.requires_grad_() for t in make(d=32))
    lam = torch.tensor(0.4, requires_grad=True)
    g = torch.randn(1, 2, 48, 64)
    with counting(monkeypatch) as (mode, _):
        out = diff_attention(q, k, v, lam, causal=True, backend="triton")
        grads = torch.autograd.grad(out, (q, k, v, lam), g)
    print(len(mode.ops), "ops outside the kernels:", mode.ops)
    full = min(q.numel(), k.numel(), v.numel(), out.numel())
    big = [(op, n) for op, _, n in mode.ops if n >= full]
    assert not big, big
    leaves = [t.detach().requires_grad_() for t in (q, k, v, lam)]
    ref = diff_attention(*leaves[:3], leaves[3], causal=True, backend="naive")
    for got, want in zip(grads, torch.autograd.grad(ref, leaves, g)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("plan", ["fused", "split_kv", "split"])
def test_a_nan_input_makes_exactly_its_rows_nan_and_every_gradient_nan(plan):
    """The careful launch: a NaN in q (row 3 of head 0) and an infinity in a key the mask hides; the output is NaN
    in exactly the row that reads a non-finite value and the other rows are the finite answer; a call that read one
    gives NaN gradients (never a finite one that hides it). The same call without them gives finite gradients."""
    q, k, v = make(N=20)
    mask = torch.ones(20, 20, dtype=torch.bool)
    mask[:, 5] = False
    q[0, 0, 3, 5] = float("nan")
    k[0, 1, 5, 0] = v[0, 0, 5, 2] = float("inf")
    qg = q.clone().requires_grad_()
    out = flash_diff.triton_diff_attention(qg, k, v, torch.tensor(0.4), attn_mask=mask, plan=plan)
    expected = torch.zeros(2, 20, dtype=torch.bool)
    expected[0, 3] = True
    assert torch.equal(out[0].isnan().any(-1), expected)
    clean = [t.nan_to_num(0.0, posinf=0.0) for t in (q, k, v)]
    ref = diff_attention(*clean, 0.4, attn_mask=mask, backend="naive")
    keep = ~out.isnan().any(-1, keepdim=True).expand_as(out)
    torch.testing.assert_close(out[keep], ref[keep], rtol=1e-4, atol=1e-5)
    out.nan_to_num(0.0).sum().backward()
    assert qg.grad.isnan().all()
    fine = clean[0].clone().requires_grad_()
    flash_diff.triton_diff_attention(fine, *clean[1:], torch.tensor(0.4), attn_mask=mask, plan=plan).sum().backward()
    assert fine.grad.isfinite().all()
