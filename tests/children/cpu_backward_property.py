"""The CPU kernel's backward equals the naive formula's in float64, on any thread count: a hypothesis property over
shapes, layouts, masks, GQA and lambda shapes (``tests/test_cpu_backward.py`` runs it in a child process, since the
kernel reads raw pointers). ``python -m children.cpu_backward_property MAX_EXAMPLES`` from ``tests/``; prints
``PROPERTY OK``."""

import sys

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffattn_tutorial.functional import diff_attention
from diffattn_tutorial.kernels.cpu import cpu_fused
from diffattn_tutorial.measure.cpu_threads import threads

KEPT = cpu_fused.MAPS_KEPT_BYTES


def view(t, kind, g):
    """t's values in a non-dense layout: a transposed view, a slice of a wider tensor, or an expanded batch."""
    if kind == "transposed":  # as a fused projection's (B, N, heads, d) output, transposed to (B, heads, N, d)
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if kind == "sliced":
        wide = torch.randn(*t.shape[:-1], t.shape[-1] + 3, generator=g)
        wide[..., 1:-2] = t
        return wide[..., 1:-2]
    return t


@st.composite
def cases(draw):
    Hkv = draw(st.integers(1, 2))
    H, B = Hkv * draw(st.integers(1, 3)), draw(st.integers(1, 2))
    Nq, Nk = draw(st.integers(1, 60)), draw(st.integers(1, 60))
    d = draw(st.sampled_from([8, 20, 32, 64]))
    return dict(B=B, H=H, Hkv=Hkv, Nq=Nq, Nk=Nk, d=d, causal=draw(st.booleans()),
                mask=draw(st.sampled_from(["none", "bool", "additive", "padding", "fully_masked_rows"])),
                lam=draw(st.sampled_from(["scalar", "head", "token"])),
                layout=draw(st.sampled_from(["dense", "transposed", "sliced", "expanded"])),
                maps=draw(st.sampled_from(["kept", "recomputed"])), seed=draw(st.integers(0, 2 ** 16)))


def make(c):
    g = torch.Generator().manual_seed(c["seed"])
    B, H, Hkv, Nq, Nk, d = (c[x] for x in ("B", "H", "Hkv", "Nq", "Nk", "d"))
    q, k = torch.randn(B, 2 * H, Nq, d, generator=g), torch.randn(B, 2 * Hkv, Nk, d, generator=g)
    v = torch.randn(B, Hkv, Nk, 2 * d, generator=g)
    if c["layout"] == "expanded":  # one k and v for the whole batch (stride 0)
        k, v = k[:1].expand_as(k), v[:1].expand_as(v)
    else:
        q, k, v = (view(t, c["layout"], g) for t in (q, k, v))
    lam = {"scalar": torch.tensor(0.4), "head": torch.rand(1, H, 1, 1, generator=g),
           "token": torch.rand(B, H, Nq, 1, generator=g)}[c["lam"]]
    mask = None
    if c["mask"] == "bool":
        mask = torch.rand(Nq, Nk, generator=g) > 0.3
    elif c["mask"] == "additive":
        mask = torch.randn(1, H, Nq, Nk, generator=g)
    elif c["mask"] == "padding":  # (B, 1, 1, Nk): keys beyond each sequence's length hidden
        lengths = torch.randint(1, Nk + 1, (B, 1), generator=g)
        mask = (torch.arange(Nk) < lengths).view(B, 1, 1, Nk)
    elif c["mask"] == "fully_masked_rows":
        mask = torch.rand(B, 1, Nq, Nk, generator=g) > 0.4
        mask[:, :, ::3] = False  # every third row sees no key: zero output, zero gradients
    grad_out = torch.randn(B, H, Nq, 2 * d, generator=g)
    return q, k, v, lam, mask, grad_out


def gradients(q, k, v, lam, mask, grad_out, causal, backend, dtype):
    ins = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, lam)]
    m = mask if mask is None or mask.dtype == torch.bool else mask.to(dtype)
    out = diff_attention(*ins, causal=causal, attn_mask=m, backend=backend)
    return (out.detach(), *torch.autograd.grad(out, ins, grad_out.to(dtype)))


def check(c):
    q, k, v, lam, mask, grad_out = make(c)
    cpu_fused.MAPS_KEPT_BYTES = KEPT if c["maps"] == "kept" else 0  # the backward reads the forward's maps, or not
    expected = gradients(q, k, v, lam, mask, grad_out, c["causal"], "naive", torch.float64)
    with threads(1):
        got = gradients(q, k, v, lam, mask, grad_out, c["causal"], "cpu_fused", torch.float32)
    with threads(3):
        again = gradients(q, k, v, lam, mask, grad_out, c["causal"], "cpu_fused", torch.float32)
    for name, a, b, e in zip(("out", "dq", "dk", "dv", "dlam"), got, again, expected):
        assert a.shape == e.shape and a.dtype == torch.float32, (name, a.shape, e.shape)
        assert torch.equal(a, b), f"{name} depends on the thread count ({c})"
        torch.testing.assert_close(a.double(), e, rtol=1e-4, atol=1e-5 * max(1.0, e.abs().max().item()),
                                   msg=lambda m: f"{name}: {m} ({c})")
    if c["mask"] == "fully_masked_rows":
        assert got[1].unflatten(1, (-1, 2))[:, :, :, ::3].abs().max() == 0, "a fully masked row has a dq"



def main(max_examples: int) -> None:
    settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
             suppress_health_check=list(HealthCheck))(given(cases())(check))()
    print("PROPERTY OK")


if __name__ == "__main__":
    main(int(sys.argv[1]))
