"""The default plans' dQ kernel: one program per query tile recomputes the scores and ``dP`` and sums dQ.

:func:`_diff_attn_bwd_dq` runs after the dK/dV launches of :mod:`~diffattn_tutorial.kernels.triton.flash_kernels`
(the atomic plans replace it, :mod:`~diffattn_tutorial.kernels.triton.atomic_kernels`): one program per query tile
of one (batch, differential head) walks the key tiles of its KV group in two loops (as the forward does: tiles that
need no masking, then those that cross ``Nk`` or the causal diagonal), recomputes each map's probabilities from the
saved log-sum-exps and adds ``dQ += dS k``; each dQ row has one writer. ``TMA`` (a configuration's switch, sm_90a
tables only): the k and v tiles arrive by tensor descriptor, as the forward's do. Moved here from
:mod:`~diffattn_tutorial.kernels.triton.flash_kernels` unchanged, with the names of the jit helpers it imports from
there: a helper's name is part of each compile fact's cache key (``aot_keys.kernel_source_hash``)."""

from __future__ import annotations

import triton
import triton.language as tl

from diffattn_tutorial.kernels.triton.flash_kernels import (
    MAPS_1,
    MAPS_2,
    MAPS_BOTH,
    _dot,
    _key_tile_bounds,
    _key_tile_offsets,
    _load_mask_tile,
    _score_grad,
    _scores,
    _tile_descriptors,
)


@triton.jit
def _dq_map_step(dq, q, K, start_n, kt_off, kt_mask, mvals, rows, cols, lse, delta, lam, dp, Nq, Nk, qk_scale,
                 EDGE: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, MASK_MIN: tl.constexpr,
                 MAP2: tl.constexpr, TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One key tile of one map: load its k tile (``K`` points at the tile; ``TMA``: ``K`` is the map's tensor
    descriptor, read at key ``start_n``), recompute ``P = 2^(s - lse)`` from the scores, ``dQ += dS k`` with ``dS``
    from :func:`_score_grad` (``MAP2``: map 2's ``-lam``)."""
    if TMA:  # rows past Nk and columns past the head dim arrive as 0, filled by the copy engine
        kt = tl.trans(K.load([start_n, 0]))
    else:
        kt = tl.load(K + kt_off, mask=kt_mask, other=0.0)
    s = _scores(q, kt, mvals, rows[:, None], cols[None, :], Nq, Nk, qk_scale, EDGE=EDGE, CAUSAL=CAUSAL,
                MASK_KIND=MASK_KIND, MASK_MIN=MASK_MIN, DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST)
    ds = _score_grad(tl.math.exp2(s - lse[:, None]), dp, delta[:, None], lam[:, None], MAP2=MAP2)
    return _dot(ds.to(kt.dtype), tl.trans(kt), dq, DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST)


@triton.jit
def _bwd_q_loop(dq1, dq2, q1, q2, do, lse1, lse2, delta1, delta2, lam,  # this query tile's state
                K1, K2, V, MASK, start_m, lo, hi, Nq, Nk, qk_scale, stride_kn, stride_vn, stride_mm, stride_mn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                EDGE: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, MASK_MIN: tl.constexpr,
                DQ_MAPS: tl.constexpr, TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Key tiles ``[lo, hi)`` for one query tile: ``dQ_m += dS_m k_m`` for the maps in ``DQ_MAPS``. ``K1``, ``K2``,
    ``V``: this KV group's maps and values, pointers, or (``TMA``) tensor descriptors (:func:`_tile_descriptors`)."""
    offs_m = tl.arange(0, BLOCK_M)
    rows = start_m + offs_m
    offs_n, offs_dv, kt_off, d_ok, dv_ok = _key_tile_offsets(stride_kn, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
                                                             HEAD_DIM=HEAD_DIM)
    vt_off = offs_n[None, :] * stride_vn + offs_dv[:, None]
    for start_n in range(lo, hi, BLOCK_N):
        n64 = tl.cast(start_n, tl.int64)
        cols = start_n + offs_n
        col_ok = cols < Nk
        kt_mask = d_ok[:, None] & col_ok[None, :]
        if TMA:
            vt = tl.trans(V.load([start_n, 0]))  # (2d, BLOCK_N)
            Kt1, Kt2 = K1, K2
        else:
            vt = tl.load(V + n64 * stride_vn + vt_off, mask=dv_ok[:, None] & col_ok[None, :], other=0.0)
            Kt1, Kt2 = K1 + n64 * stride_kn, K2 + n64 * stride_kn
        dp = _dot(do, vt, None, DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST)  # dP = dO v^T, shared by both maps
        mvals = _load_mask_tile(MASK + n64 * stride_mn, offs_m[:, None], offs_n[None, :], rows[:, None] < Nq,
                                col_ok[None, :], stride_mm, stride_mn, MASK_KIND=MASK_KIND)
        if DQ_MAPS == MAPS_1 or DQ_MAPS == MAPS_BOTH:
            dq1 = _dq_map_step(dq1, q1, Kt1, start_n, kt_off, kt_mask, mvals, rows, cols, lse1, delta1, lam, dp, Nq,
                               Nk, qk_scale, EDGE=EDGE, CAUSAL=CAUSAL, MASK_KIND=MASK_KIND, MASK_MIN=MASK_MIN,
                               MAP2=False, TMA=TMA, DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST)
        if DQ_MAPS == MAPS_2 or DQ_MAPS == MAPS_BOTH:
            dq2 = _dq_map_step(dq2, q2, Kt2, start_n, kt_off, kt_mask, mvals, rows, cols, lse2, delta2, lam, dp, Nq,
                               Nk, qk_scale, EDGE=EDGE, CAUSAL=CAUSAL, MASK_KIND=MASK_KIND, MASK_MIN=MASK_MIN,
                               MAP2=True, TMA=TMA, DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST)
    return dq1, dq2


@triton.jit
def _diff_attn_bwd_dq(Q, K, V, LAM, MASK, DO, LSE, DELTA, DQ,
                      stride_qb, stride_qh, stride_qm,
                      stride_kb, stride_kh, stride_kn,
                      stride_vb, stride_vh, stride_vn,
                      stride_gb, stride_gh, stride_gm,
                      stride_lb, stride_lh, stride_lm,
                      stride_mb, stride_mh, stride_mm, stride_mn,
                      stride_dqb, stride_dqh, stride_dqm,  # dQ's own strides (not q's)
                      H, Nq, Nk, qk_scale, sm_scale, N_BUCKET,
                      GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                      CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, MASK_MIN: tl.constexpr,
                      DQ_MAPS: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr):
    """One program: one query tile of one (batch, differential head); dQ of the maps in ``DQ_MAPS`` (``MAPS_1``,
    ``MAPS_2`` or ``MAPS_BOTH``), written with ``DQ``'s own strides. ``TMA`` (a configuration's switch, sm_90a
    tables only): the key and value tiles arrive by tensor descriptor."""
    BLOCK_DV: tl.constexpr = 2 * BLOCK_D
    n_m = tl.cdiv(Nq, BLOCK_M)
    pid = tl.program_id(0)
    off_bh = pid // n_m
    start_m = (n_m - 1 - pid % n_m) * BLOCK_M
    b64 = (off_bh // H).to(tl.int64)
    h64 = (off_bh % H).to(tl.int64)
    g64 = h64 // GROUP
    m64 = start_m.to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = start_m + offs_m
    row_ok = rows < Nq
    q_off = offs_m[:, None] * stride_qm + offs_d[None, :]
    q_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    Q1 = Q + b64 * stride_qb + (2 * h64) * stride_qh + m64 * stride_qm
    do = tl.load(DO + b64 * stride_gb + h64 * stride_gh + m64 * stride_gm + offs_m[:, None] * stride_gm
                 + offs_dv[None, :], mask=row_ok[:, None] & (offs_dv[None, :] < 2 * HEAD_DIM), other=0.0)
    LSE = LSE + off_bh.to(tl.int64) * 2 * Nq
    DELTA = DELTA + off_bh.to(tl.int64) * 2 * Nq
    lam = tl.load(LAM + b64 * stride_lb + h64 * stride_lh + rows * stride_lm, mask=row_ok, other=0.0)
    lam = lam.to(tl.float32)
    dq1 = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dq2 = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # the maps this program does not compute get placeholders (the loop never reads them)
    q1, lse1, delta1 = do, lam, lam
    q2, lse2, delta2 = do, lam, lam
    if DQ_MAPS == MAPS_1 or DQ_MAPS == MAPS_BOTH:
        q1 = tl.load(Q1 + q_off, mask=q_mask, other=0.0)
        lse1 = tl.load(LSE + rows, mask=row_ok, other=float("inf"))
        delta1 = tl.load(DELTA + rows, mask=row_ok, other=0.0)
    if DQ_MAPS == MAPS_2 or DQ_MAPS == MAPS_BOTH:
        q2 = tl.load(Q1 + stride_qh + q_off, mask=q_mask, other=0.0)
        lse2 = tl.load(LSE + Nq + rows, mask=row_ok, other=float("inf"))
        delta2 = tl.load(DELTA + Nq + rows, mask=row_ok, other=0.0)
    K1 = K + b64 * stride_kb + (2 * g64) * stride_kh
    V = V + b64 * stride_vb + g64 * stride_vh
    K1s, K2s, Vs = K1, K1 + stride_kh, V  # where the loops read k1, k2, v: pointers, or descriptors
    if TMA:
        K1s, K2s, Vs = _tile_descriptors(K1, V, stride_kh, stride_kn, stride_vn, Nk, HEAD_DIM=HEAD_DIM, BLOCK=BLOCK_N,
                                         BLOCK_D=BLOCK_D)
    MASK = MASK + b64 * stride_mb + h64 * stride_mh + m64 * stride_mm

    full_hi, hi = _key_tile_bounds(start_m, Nq, Nk, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CAUSAL=CAUSAL)
    dq1, dq2 = _bwd_q_loop(
        dq1, dq2, q1, q2, do, lse1, lse2, delta1, delta2, lam, K1s, K2s, Vs, MASK, start_m, lo=0, hi=full_hi, Nq=Nq,
        Nk=Nk, qk_scale=qk_scale, stride_kn=stride_kn, stride_vn=stride_vn, stride_mm=stride_mm,
        stride_mn=stride_mn, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, HEAD_DIM=HEAD_DIM, EDGE=False,
        CAUSAL=CAUSAL, MASK_KIND=MASK_KIND, MASK_MIN=MASK_MIN, DQ_MAPS=DQ_MAPS, TMA=TMA, DOT_PRECISION=DOT_PRECISION,
        UPCAST=UPCAST)
    dq1, dq2 = _bwd_q_loop(
        dq1, dq2, q1, q2, do, lse1, lse2, delta1, delta2, lam, K1s, K2s, Vs, MASK, start_m, lo=full_hi, hi=hi, Nq=Nq,
        Nk=Nk, qk_scale=qk_scale, stride_kn=stride_kn, stride_vn=stride_vn, stride_mm=stride_mm,
        stride_mn=stride_mn, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, HEAD_DIM=HEAD_DIM, EDGE=True,
        CAUSAL=CAUSAL, MASK_KIND=MASK_KIND, MASK_MIN=MASK_MIN, DQ_MAPS=DQ_MAPS, TMA=TMA, DOT_PRECISION=DOT_PRECISION,
        UPCAST=UPCAST)

    DQ1 = DQ + b64 * stride_dqb + (2 * h64) * stride_dqh + m64 * stride_dqm
    dq_off = offs_m[:, None] * stride_dqm + offs_d[None, :]
    if DQ_MAPS == MAPS_1 or DQ_MAPS == MAPS_BOTH:
        tl.store(DQ1 + dq_off, (dq1 * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)
    if DQ_MAPS == MAPS_2 or DQ_MAPS == MAPS_BOTH:
        tl.store(DQ1 + stride_dqh + dq_off, (dq2 * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)
