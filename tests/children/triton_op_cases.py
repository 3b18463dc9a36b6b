"""The Triton kernels as registered torch operators, the checks of ``tests/test_triton_op.py``, each in a process of
its own (Triton's CPU interpreter may crash). ``python -m children.triton_op_cases CASE`` with ``TRITON_INTERPRET=1``
and ``DIFFATTN_TRITON_POISON=1`` in the environment (set before triton is imported), CASE one of ``opcheck``,
``compile_export``, ``no_alias``; each prints ``OK`` when it holds."""

import sys

import torch
from torch.library import opcheck

from diffattn_tutorial.functional import diff_attention
from diffattn_tutorial.kernels.triton import flash_diff as fd


def inputs(nq=9, nk=11, d=8, group=1, lam_kind="scalar", dtype=torch.float32, grad=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    H, Hkv = group, 1
    q = torch.randn(1, 2 * H, nq, d, generator=g).to(dtype)
    k = torch.randn(1, 2 * Hkv, nk, d, generator=g).to(dtype)
    v = torch.randn(1, Hkv, nk, 2 * d, generator=g).to(dtype)
    lam = torch.rand(1, H, nq, 1, generator=g).to(dtype) if lam_kind == "token" else torch.tensor(0.3, dtype=dtype)
    return [t.requires_grad_(grad) for t in (q, k, v, lam)]


def check_opcheck() -> None:
    """Schema, fake implementation, AOT dispatch and autograd of the forward operator over its plans and inputs;
    schema, fake and AOT dispatch of the backward operator."""
    scale = 8 ** -0.5
    q, k, v, lam = inputs()
    qt, kt, vt, lt = inputs(group=2, lam_kind="token", seed=1)
    bool_mask = torch.rand(1, 1, 9, 11, generator=torch.Generator().manual_seed(2)) > 0.3
    cases = [(q, k, v, lam, None, True, scale, [], "fused", True),
             (qt, kt, vt, lt, bool_mask, False, scale, [], "fused", True),
             (q, k, v, lam, torch.randn(1, 1, 9, 11), False, scale, [16, 32], "split", True),
             (q.detach(), k.detach(), v.detach(), lam.detach(), None, True, scale, [], "split_kv", False)]
    for args in cases:
        result = opcheck(fd.triton_forward, args)
        assert set(result.values()) == {"SUCCESS"}, result
    out, o2, lse, flag = fd.triton_forward(*cases[0])
    dout = torch.randn_like(out)
    for needs in ([True, True, True], [False, True, False], [True, False, False]):
        bwd = (dout, *(t.detach() for t in (q, k, v, lam)), None, out.detach(), o2.detach(), lse.detach(), flag,
               True, scale, [], "fused", needs)
        opcheck(fd.triton_backward, bwd, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def compile_export() -> None:
    """One graph whose only diffattn node is the forward operator; compiled forward and gradients equal eager's
    (dynamo alone and ``aot_eager``); ``torch.export`` records the operator once and gives eager's output."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    mask = torch.rand(9, 11, generator=torch.Generator().manual_seed(3)) > 0.2

    def f(q, k, v, lam):
        return diff_attention(q, k, v, lam, causal=True, attn_mask=mask, backend="triton")

    def run(fn, args):
        out = fn(*args)
        return (out, *torch.autograd.grad(out, args, torch.ones_like(out)))

    args = inputs(lam_kind="token", group=2)
    eager = run(f, args)
    for backend in (counting, "aot_eager"):
        torch._dynamo.reset()
        compiled = run(torch.compile(f, fullgraph=True, backend=backend), args)
        assert all(torch.equal(a, b) for a, b in zip(compiled, eager)), backend
    (graph,) = graphs
    ops = [n.target for n in graph.graph.nodes if n.op == "call_function" and "diffattn" in str(n.target)]
    assert ops == [torch.ops.diffattn.triton_forward.default], ops
    with torch.no_grad():  # inference: the forward keeps no o2
        torch._dynamo.reset()
        assert torch.equal(torch.compile(f, fullgraph=True, backend="eager")(*args), eager[0])

    class Attention(torch.nn.Module):
        def forward(self, q, k, v, lam):
            return f(q, k, v, lam)

    plain = [t.detach() for t in args]
    exported = torch.export.export(Attention(), tuple(plain))
    ops = [n.target for n in exported.graph.nodes if "diffattn" in str(n.target)]
    assert ops == [torch.ops.diffattn.triton_forward.default], ops
    assert torch.equal(exported.module()(*plain), eager[0])


def no_alias() -> None:
    """Without a gradient o2 is empty, never ``out`` itself; with one its own float32 buffer. ``capture_launches``
    records the forward's and the backward's launches through the operators."""
    q, k, v, lam = inputs(grad=False)
    out, o2, lse, _ = fd.triton_forward(q, k, v, lam, None, False, 0.3, [], "fused", False)
    assert o2.numel() == 0 and out.shape == (1, 1, 9, 16) and lse.shape == (1, 1, 2, 9)
    out, o2, lse, _ = fd.triton_forward(q, k, v, lam, None, False, 0.3, [], "split", True)
    assert o2.shape == out.shape and o2.dtype == torch.float32
    assert o2.untyped_storage().data_ptr() != out.untyped_storage().data_ptr()
    q, k, v, lam = inputs()
    with fd.capture_launches(80) as launches:
        out = fd.triton_diff_attention(q, k, v, lam)
        out.backward(torch.zeros_like(out))
    names = [launch.name for launch in launches]
    assert names[0] == "_diff_attn_fwd" and "_diff_attn_bwd_preprocess" in names and "_diff_attn_bwd_dq" in names, names
    assert q.grad.shape == q.shape and lam.grad.shape == lam.shape


CASES = {"opcheck": check_opcheck, "compile_export": compile_export, "no_alias": no_alias}

if __name__ == "__main__":
    CASES[sys.argv[1]]()
    print("OK")
