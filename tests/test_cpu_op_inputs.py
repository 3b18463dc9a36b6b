"""The registered CPU operators refuse what they cannot compute, by name: ``torch.ops.diffattn.cpu_fused_forward``
(and its backward) read raw pointers, so a mismatched shape was a segmentation fault or a wrong answer. The checks
are on shapes, dtypes, devices and layouts only (no scan of the data), in the operator and in its fake
implementation. Every call that could crash runs in a child process, so a crash fails a test instead of pytest."""

import os
import subprocess
import textwrap

import pytest
from forked import run_module, run_python

from diffattn_tutorial.kernels.cpu import cpu_fused

pytestmark = pytest.mark.skipif(cpu_fused.compiler() is None, reason="no C++ compiler here (test_cpu_kernel covers that)")


def child(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return run_python(textwrap.dedent(code), env=env, timeout=timeout)


def test_the_issues_segfault_is_a_named_error():
    """Issue 30's call: 200000 keys in k and one in v, read as if v had as many (SIGSEGV before)."""
    proc = child("""
        import torch, diffattn_tutorial.kernels.cpu.cpu_fused
        q = torch.randn(1, 4, 5, 8); k = torch.randn(1, 4, 200000, 8); v = torch.randn(1, 2, 1, 16)
        try:
            torch.ops.diffattn.cpu_fused_forward(q, k, v, torch.rand(1, 2, 5, 1), None, False, 0.35)
        except ValueError as e:
            print("REFUSED", e)
    """)
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
    proc = child("""
        import torch
        from diffattn_tutorial.functional import diff_attention
        from diffattn_tutorial.kernels.cpu.cpu_fused import fused_diff_attention
        g = torch.Generator().manual_seed(0)
        q, k, v = torch.randn(1, 4, 9, 8, generator=g), torch.randn(1, 4, 9, 8, generator=g), torch.randn(1, 2, 9, 16, generator=g)
        lam = torch.tensor(0.4)
        for scale in (-1.0, 0.0):
            try:
                fused_diff_attention(q, k, v, lam, scale=scale)
            except ValueError as e:
                print("SCALE", e)
        for grad in (False, True):  # the eager body, and the operator's dispatch
            try:
                fused_diff_attention(q.clone().requires_grad_(grad), k, v, 0.4, scale=0.3)
            except TypeError as e:
                print("LAM", e)
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            mask = torch.zeros(9, 9, dtype=dtype)
            mask[3] = torch.finfo(dtype).min
            mask[5, :4] = torch.finfo(dtype).min
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            out = fused_diff_attention(qq, kk, vv, lam, attn_mask=mask, scale=8 ** -0.5)
            out.sum().backward()
            ref = diff_attention(q, k, v, 0.4, attn_mask=mask, backend="naive")
            print("ROW", dtype, out[0, :, 3].abs().max().item(), qq.grad[0, :, 3].abs().max().item(),
                  (out - ref).abs().max().item() < 1e-5)
    """)
    assert proc.returncode == 0, f"exit status {proc.returncode}:\n{proc.stderr[-2000:]}"
    out = proc.stdout
    assert out.count("SCALE scale must be a positive finite number") == 2, out
    assert out.count("LAM lam must be a torch.Tensor, got float") == 2, out
    assert [line.split()[2:] for line in out.splitlines() if line.startswith("ROW")] == [["0.0", "0.0", "True"]] * 3, out
