"""The registered Triton operators refuse mismatched inputs by name, in the operator and in its fake implementation.

``torch.ops.diffattn.triton_forward``, ``triton_backward`` and ``triton_decode`` are public entry points: called
directly, with shapes :func:`~diffattn_tutorial.functional.diff_attention` never lets through, the kernels read past
a tensor (the decode operator with 2000 keys in k and 1 in v returned a non-finite tensor). Every operator now checks
shapes, dtypes, devices and layouts (never the data) before a kernel runs, and its fake implementation (what
``torch.compile`` traces with) makes the same checks.

A property test draws a small valid call of one operator and changes one thing of one argument: one dim's size,
the number of dims, the dtype, or the device (``meta``: the dispatcher then runs the fake implementation), run
eagerly or under a ``FakeTensorMode``. The answer must be a ``ValueError``/``TypeError`` whose message starts with
the operator's name and names the changed argument, or, where the change is still a valid call (a broadcast dim of
lam or of the mask, a float mask), the same result as the ``naive`` backend. The examples run in a worker subprocess
under Triton's interpreter (:class:`test_triton_layouts.Worker`), so a crash fails one example instead of pytest.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

OPS = {  # each operator's tensor arguments, in its schema's order
    "forward": ("q", "k", "v", "lam", "attn_mask"),
    "backward": ("dout", "q", "k", "v", "lam", "attn_mask", "out", "o2", "lse", "flag"),
    "decode": ("q", "k", "v", "lam", "lengths"),
}
DTYPES = ("float64", "float16", "bfloat16", "int32", "bool")


# ------------------------------------------------------------------------------------------------------------
# the worker side (a subprocess with Triton's interpreter): build a valid call, change one thing, call
# ------------------------------------------------------------------------------------------------------------


def _call(ex: dict) -> tuple[dict, dict]:
    """``(tensors, others)``: a valid call of ``ex["op"]`` at the example's sizes, with the example's change. The
    backward gets ``out``, ``o2``, ``lse`` from the forward of its (changed) inputs where the forward accepts them:
    a change of lam's shape that stays valid is then a valid call (not statistics of another lam)."""
    import torch

    g = torch.Generator().manual_seed(ex["seed"])
    B, H, Hkv, Nq, Nk, d = (ex[n] for n in ("B", "H", "Hkv", "Nq", "Nk", "d"))
    t = dict(q=torch.randn(B, 2 * H, Nq, d, generator=g), k=torch.randn(B, 2 * Hkv, Nk, d, generator=g),
             v=torch.randn(B, Hkv, Nk, 2 * d, generator=g))
    t["lam"] = torch.rand(B, H, Nq, 1, generator=g) if ex["lam_per_token"] else torch.tensor(0.4)
    if ex["op"] == "decode":
        t["lengths"] = torch.full((B,), Nk, dtype=torch.int32)
        return _change(t, ex), dict(causal=True, scale=d ** -0.5, num_splits=2, block_n=16)
    t["attn_mask"] = torch.rand(B, 1, Nq, Nk, generator=g) < 0.8 if ex["mask"] else None
    others = dict(causal=False, scale=d ** -0.5, blocks=[], plan="split")
    if ex["op"] == "forward":
        return _change(t, ex), others
    forward = torch.ops.diffattn.triton_forward
    stats = forward(*(t[n] for n in OPS["forward"]), *others.values(), True)
    t = dict(dout=torch.randn(B, H, Nq, 2 * d, generator=g), **t)
    if ex["arg"] in OPS["forward"]:
        t = _change(t, ex)
        try:
            stats = forward(*(t[n] for n in OPS["forward"]), *others.values(), True)
        except (ValueError, TypeError):
            pass  # the backward must refuse the change too
    t.update(zip(("out", "o2", "lse", "flag"), stats))
    return (t if ex["arg"] in OPS["forward"] else _change(t, ex)), others


def _change(t: dict, ex: dict) -> dict:
    import torch

    arg = ex["arg"]
    if t.get(arg) is None:  # no mask to change: start from one of the wrong size
        t[arg] = torch.ones(1, 1, ex["Nq"] + 1, ex["Nk"], dtype=torch.bool)
    return {**t, arg: _changed(t[arg], ex)}


def _changed(t, ex: dict):
    """``t`` with the example's one change."""
    import torch

    kind, shape = ex["change"], list(t.shape)
    if kind == "dim" and t.ndim:
        i = ex["dim"] % t.ndim
        shape[i] = ex["size"] if ex["size"] != shape[i] else shape[i] + 1
    elif kind == "dim" or (kind == "ndim" and ex["size"] % 2):
        shape = [1, *shape]  # one more dim (a 0-dim lam gets one)
    elif kind == "ndim":
        shape = shape[1:] if shape else [1]
    if kind == "device":
        return torch.empty(shape, dtype=t.dtype, device="meta")
    dtype = getattr(torch, ex["dtype"]) if kind == "dtype" else t.dtype
    if dtype == t.dtype and kind == "dtype":
        dtype = torch.float64 if t.dtype != torch.float64 else torch.float32
    if dtype == torch.bool:
        return torch.rand(shape) < 0.8
    if dtype == torch.int32:
        return torch.randint(1, 3, shape, dtype=torch.int32)
    return torch.rand(shape).to(dtype) if kind == "dtype" else torch.randn(shape).to(dtype)


def _reference(op: str, t: dict, others: dict):
    """What the ``naive`` backend gives for the same call (the gradients for the backward)."""
    import torch

    from diffattn_tutorial.functional import diff_attention

    if op == "decode":
        return diff_attention(t["q"], t["k"], t["v"], t["lam"], causal=others["causal"], backend="naive")
    if op == "forward":
        return diff_attention(t["q"], t["k"], t["v"], t["lam"], attn_mask=t["attn_mask"], backend="naive")
    leaves = [t[n].detach().clone().requires_grad_() for n in ("q", "k", "v")]
    out = diff_attention(*leaves, t["lam"], attn_mask=t["attn_mask"], backend="naive")
    return torch.autograd.grad(out, leaves, t["dout"])


def _args(op: str, t: dict, others: dict) -> list:
    """The operator's arguments in its schema's order."""
    last = {"forward": [False], "backward": [[True, True, True]], "decode": []}[op]  # store_o2 / needs
    return [t[n] for n in OPS[op]] + list(others.values()) + last


def run_example(ex: dict) -> dict:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from diffattn_tutorial.kernels.triton import decode  # noqa: F401 - registers diffattn::triton_decode

    op, arg = ex["op"], ex["arg"]
    t, others = _call(ex)
    call = getattr(torch.ops.diffattn, f"triton_{op}")
    try:
        if ex["fake"]:
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                call(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in _args(op, t, others)])
            return {"ok": True, "msg": ""}  # accepted: a valid call, whose result the eager examples check
        got = call(*_args(op, t, others))
    except (ValueError, TypeError) as e:
        named = str(e).startswith(f"diffattn::triton_{op}: ") and re.search(rf"\b{arg}\b", str(e))
        return {"ok": bool(named), "msg": f"an error not naming the operator and {arg}: {type(e).__name__}: {e}"}
    try:
        ref = _reference(op, t, others)
    except (ValueError, TypeError) as e:
        return {"ok": False, "msg": f"accepted a call the naive backend refuses ({e})"}
    pairs = zip(got[:3], ref) if op == "backward" else [(got[0] if op == "forward" else got, ref)]
    bad = [f"{tuple(a.shape)} vs naive {tuple(b.shape)}" for a, b in pairs
           if a.shape != b.shape or not torch.allclose(a.float(), b.float(), rtol=1e-3, atol=1e-4)]
    return {"ok": not bad, "msg": f"accepted, but differs from naive: {bad}"}


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    import torch  # noqa: I001 - before triton: whether the interpreter is needed must be known first

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from test_triton_layouts import worker_main

    worker_main(run_example)
    sys.exit(0)


# ------------------------------------------------------------------------------------------------------------
# the tests (in the pytest process: no triton import here)
# ------------------------------------------------------------------------------------------------------------

import pytest  # noqa: E402

pytest.importorskip("triton")
from forked import run_python  # noqa: E402
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_triton_layouts import Worker  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def test_the_decode_operator_refuses_k_and_v_of_different_lengths():
    """The case of the report: 2000 keys in k, 1 in v, straight into the operator (interpreter, subprocess)."""
    code = ("import os; os.environ['TRITON_INTERPRET'] = '1'\n"
            "import torch\nimport diffattn_tutorial.kernels.triton.decode\n"
            "q = torch.randn(1, 4, 1, 8); k = torch.randn(1, 2, 2000, 8); v = torch.randn(1, 1, 1, 16)\n"
            "lam, lens = torch.tensor(0.3), torch.tensor([2000], dtype=torch.int32)\n"
            "for op, args in (('triton_decode', (q, k, v, lam, lens, True, 0.35, 4, 16)),\n"
            "                 ('triton_forward', (q, k, v, lam, None, False, 0.35, [], 'fused', False))):\n"
            "    try:\n        out = getattr(torch.ops.diffattn, op)(*args)\n"
            "        print(op, 'returned, finite:', bool(out[0].isfinite().all()))\n"
            "    except ValueError as e:\n        print(op, 'refused:', e)\n")
    proc = run_python(code, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for op in ("triton_decode", "triton_forward"):
        assert f"{op} refused: diffattn::{op}: v has shape (1, 1, 1, 16)" in proc.stdout, proc.stdout
    assert "(B, Hkv, Nk, 2d) = (1, 1, 2000, 16)" in proc.stdout and "pass v of shape" in proc.stdout, proc.stdout


@pytest.fixture(scope="module")
def worker():
    w = Worker(__file__)
    yield w
    w.close()


@st.composite
def examples(draw) -> dict:
    op = draw(st.sampled_from(tuple(OPS)))
    H, Hkv = draw(st.sampled_from([(1, 1), (2, 1), (2, 2)]))
    return {"op": op, "B": draw(st.integers(1, 2)), "H": H, "Hkv": Hkv,
            "Nq": draw(st.integers(1, 2)) if op == "decode" else draw(st.integers(1, 6)),
            "Nk": draw(st.integers(1, 9)), "d": draw(st.sampled_from([4, 8])), "lam_per_token": draw(st.booleans()),
            "mask": draw(st.booleans()), "arg": draw(st.sampled_from(OPS[op])),
            "change": draw(st.sampled_from(["dim", "dim", "dim", "ndim", "dtype", "device"])),
            "dim": draw(st.integers(0, 3)), "size": draw(st.integers(0, 12)), "dtype": draw(st.sampled_from(DTYPES)),
            "fake": draw(st.booleans()), "seed": draw(st.integers(0, 2**16))}


def _example(**kw) -> dict:
    base = {"op": "forward", "B": 2, "H": 2, "Hkv": 1, "Nq": 5, "Nk": 7, "d": 8, "lam_per_token": True,
            "mask": True, "arg": "v", "change": "dim", "dim": 2, "size": 1, "dtype": "float64", "fake": False,
            "seed": 0}
    return {**base, **kw}


@pytest.mark.slow  # the kernels run in Triton's interpreter for the changes that stay valid
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ex=examples())
@example(ex=_example(op="decode", Nq=1, Nk=9, size=1))  # the report's case: v with 1 key, k with more
@example(ex=_example(fake=True))  # the same in the forward's fake implementation
@example(ex=_example(op="backward", arg="o2", dim=3, size=4))  # the backward reads o2 with out's layout
@example(ex=_example(op="backward", arg="lse", change="dtype", dtype="float16"))
@example(ex=_example(arg="lam", dim=1, size=1))  # a lambda per token shared by the heads: still valid
@example(ex=_example(op="backward", arg="lam", lam_per_token=False, change="ndim", size=1))  # lam (1,): valid
@example(ex=_example(arg="attn_mask", change="dtype", dtype="float64"))  # an additive mask: valid
@example(ex=_example(op="decode", arg="lengths", change="dtype", dtype="float64"))
@example(ex=_example(arg="k", change="device"))  # meta: the fake implementation answers
def test_a_changed_argument_is_refused_by_name_or_gives_naive_result(worker, ex):
    answer = worker.run(ex)
    assert answer["ok"], f"{ex}: {answer['msg']}"
