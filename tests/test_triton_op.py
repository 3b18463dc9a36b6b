"""The Triton kernels as registered torch operators (``diffattn::triton_forward``, ``diffattn::triton_backward``):
schema, fake implementations and autograd registration pass ``torch.library.opcheck``; ``torch.compile(fullgraph=True)``
of ``diff_attention(..., backend="triton")`` traces into one graph holding the forward operator, with forward and
backward bit for bit eager's; the operator's outputs never alias; :func:`capture_launches` still records every launch.

Each check runs the kernels in Triton's CPU interpreter (tiny shapes, a few seconds) in a subprocess of its own with
``TRITON_INTERPRET=1`` set before triton is imported, so a crash of the interpreter fails a test instead of pytest.
"""

import os

import pytest
from forked import run_module

pytest.importorskip("triton")


def run_script(case: str, timeout: int = 300) -> str:
    """``python -m children.triton_op_cases CASE`` in a child process (``forked.run_module``); fail with its output
    unless it exits 0 and prints ``OK``."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "DIFFATTN_TRITON_POISON": "1"}
    proc = run_module("children.triton_op_cases", [case], env=env, timeout=timeout)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "OK" in proc.stdout, output[-4000:]
    return proc.stdout


def test_the_operators_pass_opcheck():
    """Schema, fake implementation (shapes, dtypes, strides), AOT dispatch and autograd registration of the forward
    operator, for a scalar and a per-token lambda, a broadcast bool mask, an additive one, the split plan, fixed
    blocks, GQA and a forward without o2; schema, fake and AOT dispatch of the backward operator."""
    run_script("opcheck")


def test_compile_fullgraph_and_export_equal_eager():
    """The call traces into one graph (a graph break raises under fullgraph=True) whose only diffattn node is the
    forward operator (counting backend); forward and every gradient equal eager's exactly, through dynamo alone and
    through AOT autograd (``aot_eager``: the backward operator's fake implementation traced into the joint graph).
    ``torch.export`` records the forward operator as one node and the exported program gives eager's output."""
    run_script("compile_export")


def test_outputs_do_not_alias_and_capture_still_records():
    """Without a gradient the operator's o2 is empty, never ``out`` itself (an operator's outputs must not alias);
    with one it is its own float32 buffer. :func:`capture_launches` records the forward's and the backward's launches
    through the operators instead of running them."""
    run_script("no_alias")
