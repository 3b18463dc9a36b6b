"""The CPU operators name the argument of any mismatch, never crash: hypothesis draws every dimension of every
tensor argument, a wrong rank, dtype, device or layout, and checks the operator (its real and its fake
implementation, forward and backward) names the argument in a ValueError or TypeError. Run in a child process by
``tests/test_cpu_op_inputs.py``: ``python -m children.cpu_op_mismatches MAX_EXAMPLES`` from ``tests/``; prints
``PROPERTY OK``."""

import re
import sys

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from diffattn_tutorial.kernels.cpu import cpu_fused  # noqa: F401 (registers torch.ops.diffattn.cpu_fused_*)

NAMES = ("q", "k", "v", "lam", "attn_mask")


def grad_out(a):  # the output's gradient for valid arguments, whatever is wrong with them
    q = a[0] if a[0].dim() == 4 else torch.zeros(1, 2, 1, 1)
    return torch.zeros(q.shape[0], max(1, q.shape[1] // 2), q.shape[2], 2 * q.shape[3], device=q.device)


OPS = {"forward": lambda a: torch.ops.diffattn.cpu_fused_forward(*a, False, 0.3),
       "backward": lambda a: torch.ops.diffattn.cpu_fused_backward(grad_out(a), *a, False, 0.3)}


@st.composite
def mismatches(draw):
    B, Nq, Nk = (draw(st.integers(2, 3)) for _ in range(3))  # > 1: lam and mask cannot broadcast past a change
    Hkv = draw(st.integers(1, 2))
    H, d = 2 * Hkv, draw(st.sampled_from([4, 8, 32]))
    args = [torch.randn(B, 2 * H, Nq, d), torch.randn(B, 2 * Hkv, Nk, d), torch.randn(B, Hkv, Nk, 2 * d),
            torch.rand(B, H, Nq, 1), torch.zeros(B, H, Nq, Nk)]
    which, kind = draw(st.integers(0, 4)), draw(st.sampled_from(["size"] * 4 + ["rank", "dtype", "device", "layout"]))
    t = args[which]
    if kind == "size":  # any other size, also 0 and one too large for the reads past v
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
        assert re.search(rf"\b{name}\b", str(e)), (name, str(e))
        return
    raise AssertionError(f"no error for a mismatched {name}")


def check(case):
    args, name, kind = case
    for op in OPS.values():
        named_error(lambda: op(args), name)
        if kind not in ("device", "layout"):  # the fake implementation, as torch.compile traces the call
            with FakeTensorMode() as mode:
                fake = [mode.from_tensor(a) for a in args]
                named_error(lambda: op(fake), name)


def main(max_examples: int) -> None:
    settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
             suppress_health_check=list(HealthCheck))(given(mismatches())(check))()
    print("PROPERTY OK")


if __name__ == "__main__":
    main(int(sys.argv[1]))
