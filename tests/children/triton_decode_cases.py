"""The split-K decode kernel in Triton's CPU interpreter, the checks of ``tests/test_triton_decode.py`` that run in a
process of their own (``TRITON_INTERPRET=1`` in the environment, set before triton is imported; a crash of the
interpreter fails a test, not pytest). ``python -m children.triton_decode_cases CASE``:

- ``cases``: reads ``{name: case}`` as JSON on stdin, runs each through the kernel, the PyTorch split-K reference
  and naive, prints ``{name: {"kernel": max error, "reference": max error, "finite", "shape", "dtype"}}``;
- ``operator``: ``diffattn::triton_decode`` passes ``opcheck`` and compiles into one node with eager's output;
- ``map2_past_int32``: map 2's partials 2**31 floats in are addressed in int64 by both kernels.

The last two print ``OK`` when they hold (``operator`` wants ``DIFFATTN_TRITON_POISON=1`` too).
"""

import json
import os
import sys
import tempfile

import torch
from torch.library import opcheck

from diffattn_tutorial.functional import diff_attention
from diffattn_tutorial.kernels.triton import decode as dec
from diffattn_tutorial.kernels.triton.launch import strides


def inputs(c, g):
    B, H, Hkv, Nq, Nk, d = (c[n] for n in ("B", "H", "Hkv", "Nq", "Nk", "d"))
    dtype = getattr(torch, c["dtype"])

    def r(*s):
        return torch.randn(*s, generator=g).to(dtype)

    q, k, v = r(B, 2 * H, Nq, d), r(B, 2 * Hkv, Nk, d), r(B, Hkv, Nk, 2 * d)
    if c["strided"]:  # every other head / key / column of larger buffers
        q = r(B, 4 * H, Nq, d)[:, ::2]
        k = r(B, 2 * Hkv, 2 * Nk, d)[:, :, ::2]
        v = r(B, Hkv, Nk, 4 * d)[..., 1::2]
    lam = {"token": lambda: torch.rand(B, H, Nq, 1, generator=g),
           "head": lambda: 0.2 + torch.rand(H, 1, 1, generator=g),
           "scalar": lambda: torch.tensor(0.37)}[c["lam"]]().to(dtype)
    return q, k, v, lam


def naive(q, k, v, lam, c, lengths):
    Nq, Nk = q.shape[2], k.shape[2]
    keys, queries = torch.arange(Nk), torch.arange(Nq)
    last = lengths[:, None] - 1 + ((queries - (Nq - 1)) if c["causal"] else 0)
    mask = (keys < lengths[:, None, None]) & (keys <= last[:, :, None])
    k0, v0 = (torch.where(mask.any(1)[:, None, :, None], t, 0) for t in (k, v))  # naive reads every key
    return diff_attention(q.double(), k0.double(), v0.double(), lam.double(), attn_mask=mask[:, None],
                          backend="naive")


def cases() -> None:
    results = {}
    for name, c in json.loads(sys.stdin.read()).items():
        q, k, v, lam = inputs(c, torch.Generator().manual_seed(0))
        lengths = torch.tensor(c["lengths"] if isinstance(c["lengths"], list) else [c["lengths"]] * c["B"])
        if c["garbage"]:  # what an unfilled static cache may hold: never read
            for t in (k, v):
                for b, n in enumerate(lengths.tolist()):
                    t[b, :, n:] = float("nan") if b else float("inf")
        kw = dict(lengths=c["lengths"] if isinstance(c["lengths"], int) else lengths, causal=c["causal"])
        out = dec.decode_attention(q, k, v, lam, num_splits=c["splits"], **kw)
        ref = dec.split_k_reference(q, k, v, lam, num_splits=c["splits"] or 3, **kw)
        want = naive(q, k, v, lam, c, lengths)
        results[name] = {"kernel": (out.double() - want).abs().max().item(), "reference":
                         (ref.double() - want).abs().max().item(), "finite": bool(torch.isfinite(out).all()),
                         "shape": list(out.shape), "dtype": str(out.dtype).removeprefix("torch.")}
    print(json.dumps(results))


def operator() -> None:
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, Nk, d = 2, 4, 2, 37, 8
    q, k = torch.randn(B, 2 * H, 1, d, generator=g), torch.randn(B, 2 * Hkv, Nk, d, generator=g)
    v = torch.randn(B, Hkv, Nk, 2 * d, generator=g)
    lam = torch.rand(B, H, 1, 1, generator=g)
    lens = torch.tensor([37, 20], dtype=torch.int32)
    for args in [(q, k, v, lam, lens, True, d ** -0.5, 3, 16),  # per-token lambda, 3 splits
                 (q, k, v, torch.tensor(0.3), torch.tensor([5, 0], dtype=torch.int32), False, 0.5, 1,
                  32)]:  # scalar lambda, an empty sequence, one split
        result = opcheck(dec.triton_decode, args,
                         test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
        assert set(result.values()) == {"SUCCESS"}, result

    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(q, k, v, lam, lens):
        return dec.decode_attention(q, k, v, lam, lengths=lens, num_splits=3)

    with torch.no_grad():
        eager = step(q, k, v, lam, lens)
        compiled = torch.compile(step, fullgraph=True, backend=counting)(q, k, v, lam, lens)
    assert torch.equal(compiled, eager)
    (graph,) = graphs
    ops = [n.target for n in graph.graph.nodes if n.op == "call_function" and "diffattn" in str(n.target)]
    assert ops == [torch.ops.diffattn.triton_decode.default], ops


def map2_past_int32() -> None:
    g = torch.Generator().manual_seed(0)
    Nq, Nk, d, BIG = 16, 40, 16, 2**26  # BIG rows (or splits) x 2 BLOCK_D = 32 floats = 2**31
    q, k = torch.randn(1, 2, Nq, d, generator=g), torch.randn(1, 2, Nk, d, generator=g)
    v = torch.randn(1, 1, Nk, 2 * d, generator=g)
    lam = torch.tensor(0.3).reshape(1, 1, 1, 1).expand(1, 1, Nq, 1)
    lens = torch.full((1,), Nk, dtype=torch.int32)
    consts = dict(GROUP=1, HEAD_DIM=d, BLOCK_D=16, CAUSAL=False, DOT_PRECISION="ieee", UPCAST=False, BLOCK_M=16,
                  BLOCK_N=16)

    def partial(o_part, lse_part, nq):
        dec._decode_partial[(1, 1)](q, k, v, lens, o_part, lse_part, **strides(q, "q", "bhm"),
                                    **strides(k, "k", "bhn"), **strides(v, "v", "bhn"), H=1, Hkv=1, Nq=nq, Nk=Nk,
                                    qk_scale=0.25, keys_per_split=48, **consts)

    def combine(o_part, lse_part, n_splits, grid, out):
        dec._decode_combine[grid](o_part, lse_part, lam, out, n_splits, **strides(lam, "l", "bhm"),
                                  **strides(out, "o", "bhm"), H=1, Nq=Nq, HEAD_DIM=d, BLOCK_D=16, BLOCK_S=1)

    # the true sizes: map 2's partials follow map 1's 16 rows of 32 floats
    o_small, lse_small = torch.full((2, Nq, 1, 32), float("nan")), torch.full((2, Nq, 1), float("nan"))
    partial(o_small, lse_small, Nq)
    out_small = torch.full((1, 1, Nq, 2 * d), float("nan"))
    combine(o_small, lse_small, 1, (Nq,), out_small)
    assert torch.isfinite(out_small).all()
    # told Nq = 2**26 rows (it computes the first 16): map 2's partials start 2**31 floats in. The 8 GiB buffer is
    # a shared map of a sparse file: no memory is reserved for it (a machine that refuses to overcommit 8 GiB of
    # anonymous memory maps it too), and only the pages written take space
    fd, path = tempfile.mkstemp(prefix="partials")  # a file, no folder of its own (mkdtemp's stayed behind)
    os.ftruncate(fd, (2**31 + 512) * 4)
    os.close(fd)
    o_big = torch.from_file(path, shared=True, size=2**31 + 512, dtype=torch.float32)
    os.remove(path)  # the map stays; nothing is left behind, even after a crash
    lse_big = torch.empty(BIG + 16)
    o_big[:512], o_big[2**31:], lse_big[:16], lse_big[BIG:] = (float("nan"),) * 4
    partial(o_big, lse_big, BIG)
    assert torch.equal(o_big[:512], o_small[0].flatten()) and torch.equal(lse_big[:16], lse_small[0].flatten())
    assert torch.equal(o_big[2**31:], o_small[1].flatten()), "map 2's partials are not 2**31 floats in"
    assert torch.equal(lse_big[BIG:], lse_small[1].flatten())
    # the combine told 2**26 splits of its one row (it reads split 0): map 2's partials again 2**31 floats in
    out_big = torch.full((1, 1, Nq, 2 * d), float("nan"))
    combine(o_big, lse_big, BIG, (1,), out_big)
    torch.testing.assert_close(out_big[0, 0, 0], out_small[0, 0, 0], rtol=0, atol=0)


if __name__ == "__main__":
    case = sys.argv[1]
    {"cases": cases, "operator": operator, "map2_past_int32": map2_past_int32}[case]()
    if case != "cases":
        print("OK")
