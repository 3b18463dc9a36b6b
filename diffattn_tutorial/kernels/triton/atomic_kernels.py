"""The atomic plans' backward kernel (``configs.ATOMIC_TWINS``): dK programs that also add dQ, FlashAttention-2's way.

:func:`_diff_attn_bwd_dkdq` runs where the default plans run :func:`~.flash_kernels._diff_attn_bwd_dkdv`'s dK
launches and :func:`~.dq_kernels._diff_attn_bwd_dq`: one program per key tile of one (batch, KV group) walks
the query tiles of the heads of its group, recomputes each map's probabilities from the saved log-sum-exps, and
from the ``dS`` tile it holds adds dK (its own rows, in registers) and each query row's dQ share (float32 atomics
into a buffer the host then scales). The dQ launch's second computation of the scores and ``dP`` is gone; the
price is the atomics, and dQ sums whose order is the programs' (not reproducible bit for bit). Chosen by name
only until a GPU session times it (``kernels/triton/HOPPER.md``). The helpers it shares with the other kernels
are :mod:`~diffattn_tutorial.kernels.triton.flash_kernels`'; their names are part of the compile facts' cache keys
(``aot_keys.kernel_source_hash``), so they keep them."""

from __future__ import annotations

import triton
import triton.language as tl

from diffattn_tutorial.kernels.triton.flash_kernels import (
    MAPS_1,
    MAPS_2,
    MAPS_BOTH,
    _dot,
    _load_mask_tile,
    _probs_t,
    _query_tile,
    _query_tile_bounds,
    _score_grad,
    _tile_descriptors,
)


@triton.jit
def _kq_map_step(dk, k, Q, start_m, qt_off, qt_mask, LSE, DELTA, DQ, dqt_off, dpt, mvals, visible, key_ok, rows, row_ok,
                 lam, qk_scale, TMA: tl.constexpr, DIAG: tl.constexpr, MAP2: tl.constexpr, MASK_KIND: tl.constexpr,
                 MASK_MIN: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One map of one query tile against the key tile ``k``: ``dS^T`` from the recomputed ``P^T`` and the shared
    ``dP^T``, then ``dK += dS^T q`` (returned, with ``P^T`` for dV) and ``dQ += dS k`` added into the float32 sums
    ``DQ`` with atomics (other key tiles add to the same rows), computed transposed, ``dQ^T = k^T dS^T`` ``(d, BLOCK_M)``: a matrix
    product of ``d >= 64`` rows runs on Hopper's ``wgmma``, one of ``BLOCK_M`` (16 or 32) rows would not. Keys past ``Nk`` (``key_ok``) are zeroed in ``dS``: their ``k`` rows are
    0, but ``P`` there is not, and an infinite ``P`` times 0 would be NaN."""
    pt, qt = _probs_t(k, Q, start_m, qt_off, qt_mask, LSE, mvals, visible, rows, row_ok, qk_scale, TMA=TMA, DIAG=DIAG,
                      MASK_KIND=MASK_KIND, MASK_MIN=MASK_MIN, DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST)
    delta = tl.load(DELTA + rows, mask=row_ok, other=0.0)
    dst = tl.where(key_ok[:, None], _score_grad(pt, dpt, delta[None, :], lam[None, :], MAP2=MAP2), 0.0)
    dk = _dot(dst.to(qt.dtype), tl.trans(qt), dk, DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST)
    dqt = _dot(tl.trans(k), dst.to(k.dtype), None, DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST)  # (d, BLOCK_M)
    tl.atomic_add(DQ + dqt_off, dqt, mask=qt_mask, sem="relaxed")
    return dk, pt


@triton.jit
def _bwd_kq_loop(dk1, dk2, dv, k1, k2, v,  # accumulators and the key tile's k1, k2 (BLOCK_N x d), v (BLOCK_N x 2d)
                 Q1, Q2, DOh, LSEh, DELTAh, LAMh, MASKh, DQ1,  # this head's query maps / ... / dQ sums of map 1
                 start_n, lo, hi, Nq, Nk, qk_scale,
                 stride_qm, stride_gm, stride_lm, stride_mm, stride_mn, stride_aqh, stride_aqm,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                 DIAG: tl.constexpr, MASK_KIND: tl.constexpr, MASK_MIN: tl.constexpr, DK_MAPS: tl.constexpr,
                 DV_OUT: tl.constexpr, TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Query tiles ``[lo, hi)`` against one key tile, transposed as in :func:`_bwd_kv_loop`: ``dP^T = v dO^T``
    once for both maps, then per map in ``DK_MAPS`` :func:`_kq_map_step`, then (``DV_OUT``, both maps)
    ``dV += (P1 - lam P2)^T dO``. ``TMA``: ``Q1``, ``Q2``, ``DOh`` are tensor descriptors."""
    offs_mb = tl.arange(0, BLOCK_M)
    offs_nl = tl.arange(0, BLOCK_N)
    offs_n = start_n + offs_nl
    key_ok = offs_n < Nk
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, 2 * BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < 2 * HEAD_DIM
    qt_off = offs_mb[None, :] * stride_qm + offs_d[:, None]
    do_off = offs_mb[:, None] * stride_gm + offs_dv[None, :]
    dqt_off = offs_mb[None, :] * stride_aqm + offs_d[:, None]  # dQ^T's tile, shaped as q^T's
    for start_m in range(lo, hi, BLOCK_M):
        m64 = tl.cast(start_m, tl.int64)
        rows = start_m + offs_mb
        row_ok = rows < Nq
        qt_mask = row_ok[None, :] & d_ok[:, None]
        do, Qt1, Qt2 = _query_tile(Q1, Q2, DOh, start_m, do_off, row_ok[:, None] & dv_ok[None, :], stride_qm,
                                   stride_gm, TMA=TMA)
        lam = tl.load(LAMh + rows * stride_lm, mask=row_ok, other=0.0).to(tl.float32)
        mvals = _load_mask_tile(MASKh + m64 * stride_mm, offs_mb[None, :], offs_nl[:, None], row_ok[None, :],
                                key_ok[:, None], stride_mm, stride_mn, MASK_KIND=MASK_KIND)
        visible = 0
        if DIAG:  # key j seen by query i (bottom-right aligned causal), transposed
            visible = offs_n[:, None] <= rows[None, :] + (Nk - Nq)
        dpt = _dot(v, tl.trans(do), None, DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST)  # dP^T, shared by both maps
        if DK_MAPS == MAPS_1 or DK_MAPS == MAPS_BOTH:
            dk1, p1t = _kq_map_step(dk1, k1, Qt1, start_m, qt_off, qt_mask, LSEh, DELTAh, DQ1 + m64 * stride_aqm,
                               dqt_off, dpt, mvals, visible, key_ok, rows, row_ok, lam, qk_scale, TMA=TMA, DIAG=DIAG,
                               MAP2=False, MASK_KIND=MASK_KIND, MASK_MIN=MASK_MIN, DOT_PRECISION=DOT_PRECISION,
                               UPCAST=UPCAST)
        if DK_MAPS == MAPS_2 or DK_MAPS == MAPS_BOTH:
            dk2, p2t = _kq_map_step(dk2, k2, Qt2, start_m, qt_off, qt_mask, LSEh + Nq, DELTAh + Nq,
                               DQ1 + stride_aqh + m64 * stride_aqm, dqt_off, dpt, mvals, visible, key_ok,
                               rows, row_ok, lam, qk_scale, TMA=TMA, DIAG=DIAG, MAP2=True, MASK_KIND=MASK_KIND,
                               MASK_MIN=MASK_MIN, DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST)
        if DV_OUT:  # dV += (P1 - lam P2)^T dO, from the probabilities both map steps recomputed
            dv = _dot((p1t - lam[None, :] * p2t).to(do.dtype), do, dv, DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST)
    return dk1, dk2, dv


@triton.jit
def _diff_attn_bwd_dkdq(Q, K, V, LAM, MASK, DO, LSE, DELTA, DK, DQACC, DV, FLAG,
                        stride_qb, stride_qh, stride_qm,
                        stride_kb, stride_kh, stride_kn,
                        stride_vb, stride_vh, stride_vn,
                        stride_gb, stride_gh, stride_gm,
                        stride_lb, stride_lh, stride_lm,
                        stride_mb, stride_mh, stride_mm, stride_mn,
                        stride_dkb, stride_dkh, stride_dkn,
                        stride_aqb, stride_aqh, stride_aqm,  # the float32 dQ sums' strides
                        stride_dvb, stride_dvh, stride_dvn,
                        H, Hkv, Nq, Nk, qk_scale, sm_scale, N_BUCKET,
                        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                        CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, MASK_MIN: tl.constexpr,
                        DK_MAPS: tl.constexpr, DV_OUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr):
    """The atomic plans' dK launch (FlashAttention-2's backward): one program per key tile of one (batch, KV
    group), as :func:`_diff_attn_bwd_dkdv`, computing dK of the maps in ``DK_MAPS`` and, from the same ``dS``
    tiles, each query row's ``dQ`` share, added with float32 atomics into ``DQACC`` ``(B, 2H, Nq, d)`` (zeros
    before; the host scales it by ``sm_scale`` into dQ). This replaces the dQ launches, which recompute the
    scores and ``dP`` a second time. dV: with ``DV_OUT`` (``DK_MAPS`` both; plan ``fused_atomic``, every gradient
    from one launch) here, else the ``DV_OUT`` launch of :func:`_diff_attn_bwd_dkdv`. ``TMA``: the query and dO
    tiles arrive by tensor descriptor."""
    n_n = tl.cdiv(Nk, BLOCK_N)
    pid = tl.program_id(0)
    off_bg = pid // n_n
    start_n = (pid % n_n) * BLOCK_N
    b64 = (off_bg // Hkv).to(tl.int64)
    g64 = (off_bg % Hkv).to(tl.int64)
    n64 = start_n.to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, 2 * BLOCK_D)
    col_ok = start_n + offs_n < Nk
    k_off = offs_n[:, None] * stride_kn + offs_d[None, :]
    k_mask = col_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    K1 = K + b64 * stride_kb + (2 * g64) * stride_kh + n64 * stride_kn
    k1 = tl.load(K1 + k_off, mask=k_mask, other=0.0)
    k2 = tl.load(K1 + stride_kh + k_off, mask=k_mask, other=0.0)
    v_mask = col_ok[:, None] & (offs_dv[None, :] < 2 * HEAD_DIM)
    v = tl.load(V + b64 * stride_vb + g64 * stride_vh + n64 * stride_vn + offs_n[:, None] * stride_vn
                + offs_dv[None, :], mask=v_mask, other=0.0)
    dk1 = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dk2 = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, 2 * BLOCK_D], tl.float32)

    lo, mid = _query_tile_bounds(start_n, Nq, Nk, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CAUSAL=CAUSAL)
    for r in range(GROUP):
        h64 = g64 * GROUP + r
        bh = b64 * H + h64
        Q1 = Q + b64 * stride_qb + (2 * h64) * stride_qh
        DOh = DO + b64 * stride_gb + h64 * stride_gh
        LAMh = LAM + b64 * stride_lb + h64 * stride_lh
        MASKh = MASK + b64 * stride_mb + h64 * stride_mh + n64 * stride_mn
        DQ1 = DQACC + b64 * stride_aqb + (2 * h64) * stride_aqh
        Q1s, Q2s, DOs = Q1, Q1 + stride_qh, DOh  # where the loops read q1, q2, dO: pointers, or descriptors
        if TMA:
            Q1s, Q2s, DOs = _tile_descriptors(Q1, DOh, stride_qh, stride_qm, stride_gm, Nq, HEAD_DIM=HEAD_DIM,
                                              BLOCK=BLOCK_M, BLOCK_D=BLOCK_D)
        if CAUSAL:  # the query tiles [lo, mid) cross the diagonal
            dk1, dk2, dv = _bwd_kq_loop(
                dk1, dk2, dv, k1, k2, v, Q1s, Q2s, DOs, LSE + bh * 2 * Nq, DELTA + bh * 2 * Nq, LAMh, MASKh, DQ1,
                start_n, lo=lo, hi=mid, Nq=Nq, Nk=Nk, qk_scale=qk_scale, stride_qm=stride_qm,
                stride_gm=stride_gm, stride_lm=stride_lm, stride_mm=stride_mm, stride_mn=stride_mn,
                stride_aqh=stride_aqh, stride_aqm=stride_aqm, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
                HEAD_DIM=HEAD_DIM, DIAG=True, MASK_KIND=MASK_KIND, MASK_MIN=MASK_MIN, DK_MAPS=DK_MAPS,
                DV_OUT=DV_OUT, TMA=TMA, DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST)
        dk1, dk2, dv = _bwd_kq_loop(
            dk1, dk2, dv, k1, k2, v, Q1s, Q2s, DOs, LSE + bh * 2 * Nq, DELTA + bh * 2 * Nq, LAMh, MASKh, DQ1, start_n,
            lo=mid, hi=Nq, Nq=Nq, Nk=Nk, qk_scale=qk_scale, stride_qm=stride_qm,
            stride_gm=stride_gm, stride_lm=stride_lm, stride_mm=stride_mm, stride_mn=stride_mn,
            stride_aqh=stride_aqh, stride_aqm=stride_aqm, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
            HEAD_DIM=HEAD_DIM, DIAG=False, MASK_KIND=MASK_KIND, MASK_MIN=MASK_MIN, DK_MAPS=DK_MAPS,
            DV_OUT=DV_OUT, TMA=TMA, DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST)

    dk_off = offs_n[:, None] * stride_dkn + offs_d[None, :]
    DK1 = DK + b64 * stride_dkb + (2 * g64) * stride_dkh + n64 * stride_dkn
    if DK_MAPS == MAPS_1 or DK_MAPS == MAPS_BOTH:
        tl.store(DK1 + dk_off, (dk1 * sm_scale).to(DK.dtype.element_ty), mask=k_mask)
    if DK_MAPS == MAPS_2 or DK_MAPS == MAPS_BOTH:
        tl.store(DK1 + stride_dkh + dk_off, (dk2 * sm_scale).to(DK.dtype.element_ty), mask=k_mask)
    if DV_OUT:
        dv_off = (b64 * stride_dvb + g64 * stride_dvh + n64 * stride_dvn + offs_n[:, None] * stride_dvn
                  + offs_dv[None, :])
        dv += tl.where(tl.load(FLAG) != 0, float("nan"), 0.0)  # dK and dQ take NaN from delta (preprocess)
        tl.store(DV + dv_off, dv.to(DV.dtype.element_ty), mask=v_mask)
