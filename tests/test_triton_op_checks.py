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
lam or of the mask, a float mask), the same result as the ``naive`` backend. The examples run in a worker child
process under Triton's interpreter (``tests/children/triton_op_checks.py`` by ``forked.Worker``), so a crash fails
one example instead of pytest.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("triton")
from children.triton_op_checks import DTYPES, OPS  # noqa: E402
from forked import Worker, run_module  # noqa: E402
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def test_the_decode_operator_refuses_k_and_v_of_different_lengths():
    """The case of the report: 2000 keys in k, 1 in v, straight into the operator (interpreter, subprocess)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = run_module("children.triton_refusals", ["k_and_v_lengths"], env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for op in ("triton_decode", "triton_forward"):
        assert f"{op} refused: diffattn::{op}: v has shape (1, 1, 1, 16)" in proc.stdout, proc.stdout
    assert "(B, Hkv, Nk, 2d) = (1, 1, 2000, 16)" in proc.stdout and "pass v of shape" in proc.stdout, proc.stdout


@pytest.fixture(scope="module")
def worker():
    env = dict(os.environ, DIFFATTN_TRITON_POISON="1", DIFFATTN_TRITON_AUTOTUNE="0", PYTHONPATH=str(REPO))
    w = Worker("children.triton_op_checks", env=env)
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
@example(ex=_example(op="backward", arg="flag", change="device"))  # ... and checks what the operator checks
def test_a_changed_argument_is_refused_by_name_or_gives_naive_result(worker, ex):
    answer = worker.run(ex)
    assert answer["ok"], f"{ex}: {answer['msg']}"
