"""The registered CPU operators refuse what they cannot compute, by name: ``torch.ops.diffattn.cpu_fused_forward``
(and its backward) read raw pointers, so a mismatched shape was a segmentation fault or a wrong answer. The checks
are on shapes, dtypes, devices and layouts only (no scan of the data), in the operator and in its fake
implementation. Every call that could crash runs in a child process, so a crash fails a test instead of pytest."""

import os
import subprocess

import pytest
from forked import run_module

from diffattn_tutorial.kernels.cpu import cpu_fused

pytestmark = pytest.mark.skipif(cpu_fused.compiler() is None, reason="no C++ compiler here (test_cpu_kernel covers that)")


def child(case: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -m children.cpu_op_cases CASE`` on one thread, in a child process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return run_module("children.cpu_op_cases", [case], env=env, timeout=timeout)


def test_the_issues_segfault_is_a_named_error():
    """Issue 30's call: 200000 keys in k and one in v, read as if v had as many (SIGSEGV before)."""
    proc = child("issue_segfault")
    assert proc.returncode == 0, f"exit status {proc.returncode}:\n{proc.stderr[-2000:]}"
    assert "REFUSED v has shape (1, 2, 1, 16)" in proc.stdout and "(v has 1 keys, k has 200000)" in proc.stdout


def test_random_mismatches_in_every_argument_are_named_never_a_crash():
    """The child (``tests/children/cpu_op_mismatches.py``) draws a mismatch in every argument with hypothesis."""
    proc = run_module("children.cpu_op_mismatches", ["150"], env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 0, f"exit status {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert "PROPERTY OK" in proc.stdout


def test_scale_lam_and_finfo_min_rows_as_diff_attention_takes_them():
    """The operator refuses a scale diff_attention refuses (zero or negative: the softmax would be inverted or flat)
    and a number for lam (by name, not an AttributeError); an additive mask entry <= finfo(its dtype).min is masked
    (a row of them gives zero output and gradients, as in diff_attention and the Triton kernel, not a uniform
    average of every value)."""
    proc = child("scale_lam_rows")
    assert proc.returncode == 0, f"exit status {proc.returncode}:\n{proc.stderr[-2000:]}"
    out = proc.stdout
    assert out.count("SCALE scale must be a positive finite number") == 2, out
    assert out.count("LAM lam must be a torch.Tensor, got float") == 2, out
    assert [line.split()[2:] for line in out.splitlines() if line.startswith("ROW")] == [["0.0", "0.0", "True"]] * 3, out
