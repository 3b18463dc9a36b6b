"""Triton harness kernels for the notebook-09 checks: each loads tiles, calls the learner's ``@triton.jit``
device function (passed in as a ``tl.constexpr``) and stores what it returns, so a check can compare it
with the library.

Imported lazily by :mod:`diffattn_tutorial.checks.nb09` (not an ``nbNN`` module, so importing
``diffattn_tutorial.checks`` never imports triton, which must see ``TRITON_INTERPRET`` before its first import).
All tensors are contiguous float32 on the CPU; the checks run the harnesses in Triton's interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def online_softmax_harness(Q, K, V, LO, HI, M, L, ACC, Nq, Nk, qk_scale, STEP: tl.constexpr,
                           D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Flash-attention forward of one head (q ``(Nq, D)``, k and v ``(Nk, D)``) around the learner's
    ``STEP(m, l, acc, s_t, v) -> (m, l, acc)``, which gets each tile's scores **transposed**, ``s_t`` of shape
    ``(BLOCK_N, BLOCK_M)`` (keys by queries, the layout the backward's dK/dV program holds its tiles in). Row ``r``
    sees keys ``LO[r] <= j < HI[r]`` (a padding mask: its first tiles, or all of them, may be entirely masked).
    Stores the final state ``m``, ``l`` and ``acc`` as they are; the check normalises them."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, D)
    q = tl.load(Q + rows[:, None] * D + dims[None, :], mask=rows[:, None] < Nq, other=0.0)
    lo = tl.load(LO + rows, mask=rows < Nq, other=0)
    hi = tl.load(HI + rows, mask=rows < Nq, other=0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start_n in range(0, Nk, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        kt = tl.load(K + cols[None, :] * D + dims[:, None], mask=cols[None, :] < Nk, other=0.0)
        v = tl.load(V + cols[:, None] * D + dims[None, :], mask=cols[:, None] < Nk, other=0.0)
        s = tl.dot(q, kt) * qk_scale
        visible = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
        s = tl.where(visible, s, float("-inf"))
        m, l, acc = STEP(m, l, acc, tl.trans(s), v)  # (BLOCK_N, BLOCK_M): keys by queries
    tl.store(M + rows, m, mask=rows < Nq)
    tl.store(L + rows, l, mask=rows < Nq)
    tl.store(ACC + rows[:, None] * D + dims[None, :], acc, mask=rows[:, None] < Nq)


@triton.jit
def combine_harness(ACC1, L1, ACC2, L2, LAM, OUT, N, COMBINE: tl.constexpr, DV: tl.constexpr,
                    BLOCK_M: tl.constexpr):
    """Rows ``[pid * BLOCK_M, ...)``: ``OUT = COMBINE(acc1, l1, acc2, l2, lam)`` (accumulators ``(N, DV)``)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, DV)
    ok = rows < N
    off = rows[:, None] * DV + dims[None, :]
    acc1 = tl.load(ACC1 + off, mask=ok[:, None], other=0.0)
    acc2 = tl.load(ACC2 + off, mask=ok[:, None], other=0.0)
    l1 = tl.load(L1 + rows, mask=ok, other=1.0)
    l2 = tl.load(L2 + rows, mask=ok, other=1.0)
    lam = tl.load(LAM + rows, mask=ok, other=0.0)
    out = COMBINE(acc1, l1, acc2, l2, lam)
    tl.store(OUT + off, out, mask=ok[:, None])


@triton.jit
def grads_harness(P1, P2, DP, DELTA1, DELTA2, LAM, DS1, DS2, Nq, Nk, GRADS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tile ``(pid0, pid1)`` of ``(Nq, Nk)`` maps: ``DS1, DS2 = GRADS(p1, p2, dp, delta1, delta2, lam)``."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (rows[:, None] < Nq) & (cols[None, :] < Nk)
    off = rows[:, None] * Nk + cols[None, :]
    p1 = tl.load(P1 + off, mask=ok, other=0.0)
    p2 = tl.load(P2 + off, mask=ok, other=0.0)
    dp = tl.load(DP + off, mask=ok, other=0.0)
    delta1 = tl.load(DELTA1 + rows, mask=rows < Nq, other=0.0)
    delta2 = tl.load(DELTA2 + rows, mask=rows < Nq, other=0.0)
    lam = tl.load(LAM + rows, mask=rows < Nq, other=0.0)
    ds1, ds2 = GRADS(p1, p2, dp, delta1, delta2, lam)
    tl.store(DS1 + off, ds1, mask=ok)
    tl.store(DS2 + off, ds2, mask=ok)
