"""The split-K decode kernel (flash-decoding, ``diffattn_tutorial.kernels.triton.decode``) equals ``naive``.

The kernels run in Triton's CPU interpreter in a **subprocess** (``TRITON_INTERPRET=1`` set before triton is
imported there; a crash in the interpreter fails these tests instead of killing pytest), once for all cases,
each case a test of its own. The cases cover MHA, GQA and MQA, one to more splits than key tiles, cache lengths
that are not a multiple of the tile (and differ per sequence, as in a batch of static caches), a few query tokens
with and without the causal mask (a query that sees no key gives zeros), every lambda form, padded head dims,
16-bit inputs, non-finite garbage past the valid length (never read), strided views, and an empty cache. The
PyTorch version of the same algorithm (``split_k_reference``) and the refusals are checked in this process. The
registered operator ``diffattn::triton_decode`` passes ``torch.library.opcheck`` and compiles
(``torch.compile(fullgraph=True)``) into one node with eager's output, in an interpreter subprocess too.
"""

import json
import os

import pytest
import torch
from forked import run_module

pytest.importorskip("triton")

from diffattn_tutorial.functional import diff_attention  # noqa: E402
from diffattn_tutorial.kernels.triton.decode import MAX_ROWS_X_DIM, decode_attention, split_k_reference  # noqa: E402

BASE = dict(B=2, H=2, Hkv=2, Nq=1, Nk=37, d=16, splits=None, lengths=[37, 20], causal=True, lam="token",
            dtype="float32", garbage=False, strided=False)
CASES = {
    "mha_one_split": dict(splits=1),
    "mha_three_splits": dict(splits=3),
    "gqa_four_splits": dict(H=4, Hkv=2, splits=4, lengths=[37, 5]),
    "mqa_more_splits_than_tiles": dict(H=4, Hkv=1, splits=8, lengths=[33, 1]),
    "three_queries_causal": dict(H=4, Hkv=2, Nq=3, splits=2, lengths=[37, 2]),  # seq 2: query 0 sees no key
    "three_queries_not_causal": dict(Nq=3, causal=False, splits=2, lengths=[30, 17]),
    "head_dim_24_padded": dict(d=24, splits=2),
    "head_dim_8": dict(d=8, H=4, Hkv=1, splits=3),
    "lambda_scalar": dict(lam="scalar", splits=2),
    "lambda_per_head": dict(lam="head", H=4, Hkv=2, splits=2),
    "length_as_int": dict(lengths=29, splits=2),
    "empty_cache": dict(lengths=[0, 0], splits=2),
    "garbage_past_length": dict(garbage=True, H=4, Hkv=2, splits=3, lengths=[21, 36]),
    "strided_views": dict(strided=True, H=4, Hkv=2, splits=2),
    "float16": dict(dtype="float16", H=4, Hkv=2, splits=3),
    "bfloat16": dict(dtype="bfloat16", H=4, Hkv=2, splits=3),
    "long_cache": dict(Nk=161, lengths=[161, 100], H=4, Hkv=2),  # the default split count
}
TOLERANCE = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 2e-2}


@pytest.fixture(scope="module")
def interpreted():
    """Every case through the kernel in one interpreter subprocess: ``{case: errors}``."""
    cases = {name: {**BASE, **c} for name, c in CASES.items()}
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = run_module("children.triton_decode_cases", ["cases"], input=json.dumps(cases), env=env, timeout=600)
    assert run.returncode == 0, f"the interpreter run failed (exit {run.returncode}):\n{run.stderr[-3000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES)  # all cases in one interpreter run: a few seconds
def test_decode_kernel_equals_naive(interpreted, case):
    c = {**BASE, **CASES[case]}
    got = interpreted[case]
    assert got["finite"], "NaN or inf in the output (a read past the valid length, or an empty split's weight)"
    assert got["shape"] == [c["B"], c["H"], c["Nq"], 2 * c["d"]] and got["dtype"] == c["dtype"]
    assert got["kernel"] <= TOLERANCE[c["dtype"]], got
    assert got["reference"] <= TOLERANCE[c["dtype"]], got


def make(B=2, H=4, Hkv=2, Nq=2, Nk=45, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype)  # noqa: E731
    return r(B, 2 * H, Nq, d), r(B, 2 * Hkv, Nk, d), r(B, Hkv, Nk, 2 * d), torch.rand(B, H, Nq, 1, generator=g,
                                                                                      dtype=dtype)


@pytest.mark.parametrize("splits", [1, 2, 5, 50])
def test_split_k_reference_equals_naive_in_float64(splits):
    q, k, v, lam = make()
    for length in (45, 31, 1):  # the whole cache, part of it, one key: the last query sees exactly these
        ref = diff_attention(q, k[:, :, :length], v[:, :, :length], lam, causal=True, backend="naive")
        got = split_k_reference(q, k, v, lam, lengths=length, num_splits=splits)
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(split_k_reference(q, k, v, lam, lengths=0, num_splits=splits), torch.zeros_like(ref))


def test_refusals_name_the_fix():
    q, k, v, lam = make(dtype=torch.float32)
    with pytest.raises(ValueError, match="backend='naive'"):
        decode_attention(*make())
    with pytest.raises(ValueError, match="num_splits must be a whole number >= 1"):
        decode_attention(q, k, v, lam, num_splits=0)
    with pytest.raises(ValueError, match="between 0 and the cache size"):
        decode_attention(q, k, v, lam, lengths=46)
    with pytest.raises(ValueError, match=r"shape \(B,\)"):
        decode_attention(q, k, v, lam, lengths=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="power of two"):
        decode_attention(q, k, v, lam, block_n=24)
    rows = MAX_ROWS_X_DIM // 16  # at head dim 8 (padded to 16), one KV group: rows = heads x 2 queries
    with pytest.raises(ValueError, match="backend='triton'"):
        decode_attention(torch.zeros(1, rows + 2, 2, 8), k[:1, :2], v[:1, :1], 0.5)
    with pytest.raises(ValueError, match="v must carry Hkv"):  # the library's own input checks
        decode_attention(q, k, v[:, :1], lam)



def test_the_operator_passes_opcheck_and_compiles_to_one_node():
    """``diffattn::triton_decode``: schema, fake implementation and AOT dispatch (``opcheck``) for a per-token and a
    scalar lambda, 3 splits and 1; a function calling :func:`decode_attention` under ``torch.compile(fullgraph=True)``
    (a graph break raises) holds the operator as its one diffattn node and gives eager's output bit for bit."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "DIFFATTN_TRITON_POISON": "1"}
    run = run_module("children.triton_decode_cases", ["operator"], env=env, timeout=600)
    assert run.returncode == 0 and "OK" in run.stdout, (run.stdout + run.stderr)[-4000:]


def test_inputs_that_require_grad_are_refused():
    q, k, v, lam = make(dtype=torch.float32)
    with pytest.raises(ValueError, match="no gradient.*torch.no_grad"):
        decode_attention(q.requires_grad_(), k, v, lam)
    with pytest.raises(ValueError, match="no gradient"):
        decode_attention(q.detach(), k, v, lam.requires_grad_())



def test_map2_partials_past_2_31_floats_are_addressed_in_int64():
    """The partial buffers hold map 1's ``B*H*Nq*splits`` rows of ``2 BLOCK_D`` floats, then map 2's. From
    ``B*H*Nq*splits*2*BLOCK_D >= 2**31`` (d = 128: ``B*H*Nq*splits >= 2**23``, e.g. B = 256, H = 32, Nq = 16,
    num_splits = 64 over a 4096-key cache; with the default split count B*H*Nq >= 2**23) map 2's offset passes
    int32. Computed from ``tl.num_programs`` in int32 it wrapped negative: the partial kernel wrote before its
    buffer and the combine read there (an illegal address on a GPU, a segfault here). Both kernels run at a
    2**31 offset set by their scalars (Nq, n_splits) with one program each: a few pages of an 8 GiB virtual
    buffer are written."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = run_module("children.triton_decode_cases", ["map2_past_int32"], env=env, timeout=300)
    assert run.returncode == 0 and "OK" in run.stdout, (run.returncode, (run.stdout + run.stderr)[-3000:])


def test_rows_too_far_apart_for_int32_tile_offsets_are_refused():
    """The partial kernel steps key rows inside a tile in int32 (``offs_n * stride_kn``, ``offs_n * stride_vn``,
    ``query * stride_qm``), as the flash kernels do, but nothing checked it: a cache view whose rows are
    ``2**31 / block_n`` elements apart (a seq-first ``(Nk, B, 2Hkv, d)`` buffer permuted, at large B) read wrapped
    addresses. The operator refuses it, in its fake implementation too, as ``diffattn::triton_forward`` does.
    Meta tensors: strides, no data."""
    meta = dict(device="meta")
    q, v, lam = torch.empty(1, 2, 1, 16, **meta), torch.empty(1, 1, 64, 32, **meta), torch.empty((), **meta)
    lengths = torch.empty(1, dtype=torch.int32, **meta)
    far = torch.empty(1, 2, 64, 16, **meta).as_strided((1, 2, 64, 16), (0, 16, 2**25, 1))
    with pytest.raises(ValueError, match="k steps 33554432 elements between rows"):
        torch.ops.diffattn.triton_decode(q, far, v, lam, lengths, True, 0.25, 1, 64)
    torch.ops.diffattn.triton_decode(q, far, v, lam, lengths, True, 0.25, 1, 32)  # 32 rows of 2**25: 2**30
    far_v = torch.empty(1, 1, 64, 32, **meta).as_strided((1, 1, 64, 32), (0, 0, 2**26, 1))
    with pytest.raises(ValueError, match="v steps"):
        torch.ops.diffattn.triton_decode(q, torch.empty(1, 2, 64, 16, **meta), far_v, lam, lengths, True, 0.25, 1, 32)
    many = torch.empty(1, 2, 4, 16, **meta).as_strided((1, 2, 4, 16), (0, 16, 2**30, 1))  # 4 queries 2**30 apart
    with pytest.raises(ValueError, match="q steps"):
        torch.ops.diffattn.triton_decode(many, torch.empty(1, 2, 64, 16, **meta), v, lam, lengths, True, 0.25, 1, 16)
