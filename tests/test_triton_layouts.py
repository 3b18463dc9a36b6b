"""backend="triton" on every memory layout a user can pass, forward **and backward**, against ``naive``.

A property test (hypothesis) draws a layout per tensor: q, k and v each contiguous, transposed but dense, a slice
of a fused projection (a row stride with a gap, at a storage offset), a strided slice of the rows (``[:, :, ::2]``)
or of the last dim (``[..., ::2]``), ``expand()``ed over the batch or over the rows (stride 0), or at a storage
offset; lambda scalar, per head, per token, expanded per token, strided; the mask absent, bool or additive,
broadcast, expanded (stride 0), stored transposed or a slice with a gap. Gradients are taken with respect to the
tensors the views were cut from (the leaves), so autograd's own view backward (the sums of ``expand``, the scatter
of a slice) is part of what is compared.

The kernels write raw pointers: a gradient buffer written with the wrong strides corrupts the heap (issue 23: the
backward wrote with the input's strides into a dense buffer). So the examples run in a **worker child process**
(``tests/children/triton_layouts.py`` by ``forked.Worker``; under Triton's interpreter without a GPU, compiled on
one): a crash fails the example (and hypothesis shrinks it) instead of ending pytest. Every buffer the kernels write is filled with NaN first (``DIFFATTN_TRITON_POISON=1``),
so an unwritten gradient shows.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("triton")
from forked import Worker, run_module  # noqa: E402
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

LAYOUTS = ("contiguous", "transposed", "fused_slice", "rows_strided", "last_strided", "expanded_batch",
           "expanded_rows", "offset")
LAM_LAYOUTS = ("scalar", "head", "token", "token_expanded", "token_strided", "token_offset")
MASK_LAYOUTS = ("none", "bool_2d", "bool_expanded", "additive_transposed", "additive_gap", "additive_offset")
EXAMPLE_TIMEOUT_S = 300

pytestmark = pytest.mark.slow  # runs the kernels in Triton's interpreter, in a worker process (about 30 s)


@pytest.fixture(scope="module")
def worker():
    env = dict(os.environ, DIFFATTN_TRITON_POISON="1", DIFFATTN_TRITON_AUTOTUNE="0",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    w = Worker("children.triton_layouts", env=env, timeout=EXAMPLE_TIMEOUT_S)
    yield w
    w.close()


EXAMPLES = st.fixed_dictionaries({
    "B": st.integers(1, 2), "heads": st.sampled_from([(1, 1), (2, 1), (2, 2)]), "Nq": st.integers(1, 20),
    "Nk": st.integers(1, 20), "d": st.sampled_from([4, 8, 16]), "causal": st.booleans(),
    "q": st.sampled_from(LAYOUTS), "k": st.sampled_from(LAYOUTS), "v": st.sampled_from(LAYOUTS),
    "lam": st.sampled_from(LAM_LAYOUTS), "mask": st.sampled_from(MASK_LAYOUTS), "seed": st.integers(0, 2**16)})


def _example(**kw) -> dict:
    base = {"B": 2, "heads": (2, 1), "Nq": 19, "Nk": 19, "d": 8, "causal": True, "q": "contiguous",
            "k": "contiguous", "v": "contiguous", "lam": "scalar", "mask": "none", "seed": 0}
    return {**base, **kw}


def check(worker, ex: dict) -> None:
    (H, Hkv), rest = ex["heads"], {k: v for k, v in ex.items() if k != "heads"}
    answer = worker.run({**rest, "H": H, "Hkv": Hkv})
    assert answer["ok"], f"{ex}: {answer['msg']}"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ex=EXAMPLES)
# the layouts issue 23 found crashing or wrong, each always run: a view with a row gap in q, in k, in v; strided
# rows; expanded tensors (the gradient was uninitialised memory)
@example(ex=_example(q="fused_slice"))
@example(ex=_example(k="fused_slice", lam="token_expanded"))
@example(ex=_example(v="fused_slice", mask="additive_gap"))
@example(ex=_example(q="rows_strided", k="rows_strided", v="rows_strided", lam="token_strided"))
@example(ex=_example(q="expanded_batch", k="expanded_batch", v="expanded_rows", mask="bool_expanded"))
def test_every_layout_forward_and_backward_matches_naive(worker, ex):
    check(worker, ex)


def test_a_crash_fails_the_example_and_the_worker_restarts(worker):
    """What the property test relies on: a worker that dies mid-example gives a failed answer naming the exit
    code, and the next example starts a fresh worker."""
    answer = worker.run({"abort": True})
    assert not answer["ok"] and "exit code -6 (a crash: True)" in answer["msg"], answer
    assert worker.child is None
    check(worker, _example(Nq=3, Nk=4))  # a fresh worker answers the next example


def test_a_mask_that_requires_grad_is_refused_with_the_fix():
    """The kernels give no gradient for the mask: refusing is better than a silent zero (run in the worker's
    interpreter set-up, in a subprocess, as everything here)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = run_module("children.triton_refusals", ["mask_requires_grad"], env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "refused:" in proc.stdout and "detach()" in proc.stdout and "naive" in proc.stdout, proc.stdout
