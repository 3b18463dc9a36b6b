"""The Triton path's refusals, in a process of its own under Triton's interpreter (``TRITON_INTERPRET=1`` in the
environment; the operators read raw pointers). ``python -m children.triton_refusals CASE``, CASE one of:

- ``mask_requires_grad`` (``tests/test_triton_layouts.py``): a mask that requires grad; prints ``refused: <error>``;
- ``k_and_v_lengths`` (``tests/test_triton_op_checks.py``): 2000 keys in k and 1 in v straight into the decode and
  forward operators; prints ``<op> refused: <error>`` (or ``<op> returned, finite: <bool>``) for each.
"""

import sys

import torch

import diffattn_tutorial.kernels.triton.decode  # noqa: F401 (registers torch.ops.diffattn.triton_decode)
from diffattn_tutorial.functional import diff_attention


def mask_requires_grad() -> None:
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 1, 4, 16)
    bias = torch.zeros(4, 4, requires_grad=True)
    try:
        diff_attention(q, k, v, 0.5, attn_mask=bias, backend="triton")
    except ValueError as e:
        print("refused:", e)


def k_and_v_lengths() -> None:
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 2000, 8), torch.randn(1, 1, 1, 16)
    lam, lens = torch.tensor(0.3), torch.tensor([2000], dtype=torch.int32)
    for op, args in (("triton_decode", (q, k, v, lam, lens, True, 0.35, 4, 16)),
                     ("triton_forward", (q, k, v, lam, None, False, 0.35, [], "fused", False))):
        try:
            out = getattr(torch.ops.diffattn, op)(*args)
            print(op, "returned, finite:", bool(out[0].isfinite().all()))
        except ValueError as e:
            print(op, "refused:", e)


if __name__ == "__main__":
    {"mask_requires_grad": mask_requires_grad, "k_and_v_lengths": k_and_v_lengths}[sys.argv[1]]()
