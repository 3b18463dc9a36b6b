"""The CPU operators' refusals, the cases of ``tests/test_cpu_op_inputs.py`` that could crash the process (the
operators read raw pointers). ``python -m children.cpu_op_cases CASE``, CASE one of ``issue_segfault``,
``scale_lam_rows``; each prints the lines its test reads."""

import sys

import torch

from diffattn_tutorial.functional import diff_attention
from diffattn_tutorial.kernels.cpu.cpu_fused import fused_diff_attention


def issue_segfault() -> None:
    """Issue 30's call: 200000 keys in k and one in v, read as if v had as many (SIGSEGV before): prints the
    ValueError after ``REFUSED``."""
    q = torch.randn(1, 4, 5, 8)
    k = torch.randn(1, 4, 200000, 8)
    v = torch.randn(1, 2, 1, 16)
    try:
        torch.ops.diffattn.cpu_fused_forward(q, k, v, torch.rand(1, 2, 5, 1), None, False, 0.35)
    except ValueError as e:
        print("REFUSED", e)


def scale_lam_rows() -> None:
    """Prints ``SCALE <error>`` for a zero and a negative scale, ``LAM <error>`` for a number as lam (eager body and
    the operator's dispatch), and per mask dtype ``ROW <dtype> <max |out|> <max |dq|> <close to naive>`` for a row of
    ``finfo.min`` entries."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 9, 8, generator=g), torch.randn(1, 4, 9, 8, generator=g)
    v = torch.randn(1, 2, 9, 16, generator=g)
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


CASES = {f.__name__: f for f in (issue_segfault, scale_lam_rows)}

if __name__ == "__main__":
    CASES[sys.argv[1]]()
