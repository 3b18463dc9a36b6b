"""The registered CPU operators refuse what they cannot compute, by name: ``torch.ops.diffattn.cpu_fused_forward``
(and its backward) read raw pointers, so a mismatched shape was a segmentation fault or a wrong answer. The checks
are on shapes, dtypes, devices and layouts only (no scan of the data), in the operator and in its fake
implementation. Every call that could crash runs in a child process, so a crash fails a test instead of pytest."""

import os
import subprocess
import textwrap

import pytest
from forked import run_python

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


# The child draws mismatches with hypothesis: every dimension of every tensor argument, a wrong rank, dtype,
# device or layout, and checks the operator (its real and its fake implementation, forward and backward) names the
# argument in a ValueError or TypeError; a control call on the valid inputs must still agree with the formula.
PROPERTY = """
import re
import torch
from hypothesis import given, settings, strategies as st, HealthCheck
from torch._subclasses.fake_tensor import FakeTensorMode
from diffattn_tutorial.kernels.cpu import cpu_fused

NAMES = ("q", "k", "v", "lam", "attn_mask")
def grad_out(a):  # the output's gradient for valid arguments, whatever is wrong with them
    q = a[0] if a[0].dim() == 4 else torch.zeros(1, 2, 1, 1)
    return torch.zeros(q.shape[0], max(1, q.shape[1] // 2), q.shape[2], 2 * q.shape[3], device=q.device)

OPS = {"forward": lambda a: torch.ops.diffattn.cpu_fused_forward(*a, False, 0.3),
       "backward": lambda a: torch.ops.diffattn.cpu_fused_backward(grad_out(a), *a, False, 0.3)}

@st.composite
def mismatches(draw):
    B, Nq, Nk = (draw(st.integers(2, 3)) for _ in range(3))  # > 1: lam and mask cannot broadcast past a change
    Hkv = draw(st.integers(1, 2)); H, d = 2 * Hkv, draw(st.sampled_from([4, 8, 32]))
    args = [torch.randn(B, 2 * H, Nq, d), torch.randn(B, 2 * Hkv, Nk, d), torch.randn(B, Hkv, Nk, 2 * d),
            torch.rand(B, H, Nq, 1), torch.zeros(B, H, Nq, Nk)]
    which, kind = draw(st.integers(0, 4)), draw(st.sampled_from(["size"] * 4 + ["rank", "dtype", "device", "layout"]))
    t = args[which]
    if kind == "size":  # any other size, also 0 and one too large for the issue's reads past v
        dim = draw(st.integers(0, 3))
        bad = [n for n in (0, 1, 2, 3, 5, 7, 64, 20000) if n != t.shape[dim] and not (which >= 3 and n == 1)]
        shape = list(t.shape)
        shape[dim] = draw(st.sampled_from(bad))
        args[which] = torch.randn(shape)
    elif kind == "rank":  # lam and mask may have fewer dims (they broadcast), not more
        args[which] = t[0] if which < 3 and draw(st.booleans()) else t.unsqueeze(0).expand(2, *t.shape)
    elif kind == "dtype":
        args[which] = t.to(draw(st.sampled_from([torch.int64, torch.float64] if which < 3 else
                                                [torch.int32, torch.complex64])))
    elif kind == "device":
        args[which] = t.to("meta")
    else:
        args[which] = t.to_sparse()
    return args, NAMES[which], kind

def named_error(fn, name):
    try:
        fn()
    except (ValueError, TypeError) as e:
        assert re.search(rf"\\b{name}\\b", str(e)), (name, str(e))
        return
    raise AssertionError(f"no error for a mismatched {name}")

@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(mismatches())
def check(case):
    args, name, kind = case
    for op in OPS.values():
        named_error(lambda: op(args), name)
        if kind not in ("device", "layout"):  # the fake implementation, as torch.compile traces the call
            with FakeTensorMode() as mode:
                fake = [mode.from_tensor(a) for a in args]
                named_error(lambda: op(fake), name)

check()
print("PROPERTY OK")
"""


def test_random_mismatches_in_every_argument_are_named_never_a_crash():
    proc = child("MAX_EXAMPLES = 150\n" + PROPERTY)
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
