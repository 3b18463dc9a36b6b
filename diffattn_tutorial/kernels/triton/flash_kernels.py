"""The ``@triton.jit`` code of the fused differential flash-attention kernel, in the order the host launches it.

Forward (:func:`_diff_attn_fwd`): one program per query tile of one (batch, differential head) walks the key tiles
of its KV group in two loops, the tiles that need no masking, then those that cross ``Nk`` or the causal diagonal
(:func:`_key_tile_bounds`). Per key tile it loads ``k1``, ``k2`` and ``v`` once and feeds them to one online-softmax
stream per map (:func:`_fwd_map_step`), each with its running max, sum and float32 accumulator; the epilogue
combines ``o1 - lam o2`` and stores each map's base-2 log-sum-exp. Backward: :func:`_diff_attn_bwd_preprocess`
computes ``delta = dO . o`` per map and row, :func:`_diff_attn_bwd_dkdv` (one program per key tile, looping over
the query tiles and the heads of its KV group) recomputes the probabilities from the saved log-sum-exps and
accumulates dK and dV; dQ follows in :mod:`~diffattn_tutorial.kernels.triton.dq_kernels` (one program per query
tile), or, in the atomic plans, from :mod:`~diffattn_tutorial.kernels.triton.atomic_kernels`, whose dK programs add
dQ by atomics. Nothing of size ``Nq x Nk`` is stored.

Contract: every kernel reads its tensors through the strides it is given and writes only its output buffers;
which maps a launch computes (``MAPS``, ``DK_MAPS``, ``DQ_MAPS``) and what the mask holds (``MASK_KIND``) are the
flags of :mod:`~diffattn_tutorial.kernels.triton.flags`, the same constants on both sides. Inner loops are
``@triton.jit`` helpers; every ``tl.constexpr`` switch is passed by name. The host code that checks the inputs and
launches these kernels is :mod:`~diffattn_tutorial.kernels.triton.flash_diff`."""

from __future__ import annotations

import triton
import triton.language as tl

from diffattn_tutorial.constants import LOG2E  # 1 / ln 2: the kernels use exp2 (base-2 scores)
from diffattn_tutorial.kernels.triton import flags

_LOG2E = tl.constexpr(LOG2E)  # the same number, visible inside @triton.jit functions
# the variant flags of flags.py as constexprs, visible inside @triton.jit functions under the same names
MAPS_NONE, MAPS_1, MAPS_2, MAPS_BOTH = (tl.constexpr(flags.MAPS_NONE), tl.constexpr(flags.MAPS_1),
                                        tl.constexpr(flags.MAPS_2), tl.constexpr(flags.MAPS_BOTH))
MASK_NONE, MASK_BOOL, MASK_ADD = (tl.constexpr(flags.MASK_NONE), tl.constexpr(flags.MASK_BOOL),
                                   tl.constexpr(flags.MASK_ADD))


@triton.jit
def _dot(a, b, acc, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` in float32. ``UPCAST``: multiply bfloat16 tiles as float32 (the interpreter stores
    bfloat16 as raw 16-bit integers and cannot multiply them; the values, already rounded, are exact)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _apply_mask(s, mvals, MASK_KIND: tl.constexpr, MASK_MIN: tl.constexpr):
    """Scores ``s`` (base 2) with the user's mask tile: bool (``mvals != 0`` may attend) or additive (natural
    log units, so times ``LOG2E``; entries ``<= MASK_MIN``, the dtype's most negative finite number, count as
    masked, as Hugging Face models fill their masks). NaN in an additive mask stays NaN."""
    if MASK_KIND == MASK_BOOL:
        s = tl.where(mvals != 0, s, float("-inf"))
    elif MASK_KIND == MASK_ADD:
        mf = mvals.to(tl.float32)
        s = tl.where(mf <= MASK_MIN, float("-inf"), s + mf * _LOG2E)
    return s


@triton.jit
def _visible(s, rows, cols, Nq, Nk, EDGE: tl.constexpr, CAUSAL: tl.constexpr):
    """``-inf`` where key ``cols`` is past ``Nk`` or, causal (bottom-right aligned: query ``i`` sees keys
    ``j <= i + Nk - Nq``), after the query's diagonal. ``rows``, ``cols``: the query and key index of each entry
    of ``s``, broadcastable to its shape (``rows[:, None]``, ``cols[None, :]``). Only tiles that cross an edge
    (``EDGE``) pay for it."""
    if EDGE:
        ok = cols < Nk
        if CAUSAL:
            ok = ok & (cols <= rows + (Nk - Nq))
        s = tl.where(ok, s, float("-inf"))
    return s


@triton.jit
def _load_mask_tile(MASK, q_off, k_off, q_ok, k_ok, stride_mm, stride_mn, MASK_KIND: tl.constexpr):
    """The user's mask tile, or 0 without one (``MASK_KIND == MASK_NONE``). ``MASK`` points at the tile's first entry;
    ``q_off``, ``k_off`` are the query and key offsets inside the tile and ``q_ok``, ``k_ok`` which of them exist,
    broadcastable to the tile's shape. One load serves both maps of a head."""
    mvals = 0
    if MASK_KIND != MASK_NONE:
        mvals = tl.load(MASK + q_off * stride_mm + k_off * stride_mn, mask=q_ok & k_ok, other=0)
    return mvals


@triton.jit
def _scores(a, b, mvals, rows, cols, Nq, Nk, qk_scale, EDGE: tl.constexpr, CAUSAL: tl.constexpr,
            MASK_KIND: tl.constexpr, MASK_MIN: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One masked score tile in base-2 units: ``a @ b * qk_scale`` (``qk_scale = scale * LOG2E``), the user's
    mask tile ``mvals`` applied and, on edge tiles (``EDGE``), keys past ``Nk`` and after the causal diagonal
    hidden (:func:`_visible`). ``a = q`` ``(BLOCK_M, d)`` and ``b = k^T`` ``(d, BLOCK_N)`` give
    ``(BLOCK_M, BLOCK_N)``; the dK/dV kernel passes ``k`` and ``q^T`` for the transposed tile, ``EDGE`` off (it
    masks the diagonal on the probabilities, see :func:`_probs_t`)."""
    s = _dot(a, b, None, DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST) * qk_scale
    s = _apply_mask(s, mvals, MASK_KIND=MASK_KIND, MASK_MIN=MASK_MIN)
    return _visible(s, rows, cols, Nq, Nk, EDGE=EDGE, CAUSAL=CAUSAL)


@triton.jit
def _score_grad(p, dp, delta, lam, MAP2: tl.constexpr):
    """Softmax's backward for one map's tile: ``dS = P (dP - delta)``, ``delta = rowsum(dO . O)`` of that map.
    Map 2 receives the upstream gradient times ``-lam`` (``MAP2``): ``dS2 = -lam P2 (dP - delta2)``. ``delta``
    and ``lam`` are per query row, broadcastable to ``p`` (a column, or a row in the transposed dK/dV tiles)."""
    if MAP2:
        p = -lam * p
    return p * (dp - delta)


@triton.jit
def _key_tile_bounds(start_m, Nq, Nk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """``(full_hi, hi)`` for the query tile at row ``start_m``: key tiles ``[0, full_hi)`` need no masking,
    ``[full_hi, hi)`` cross ``Nk`` or the causal diagonal, keys from ``hi`` on are never visited (causal: all
    above the diagonal). Plain arithmetic (``min``, ``max`` are Triton's inside a kernel), so
    :func:`tile_schedule` runs this same function on Python ints."""
    nk_full = (Nk // BLOCK_N) * BLOCK_N
    if CAUSAL:
        hi = min(Nk, max(start_m + BLOCK_M + (Nk - Nq), 0))  # one past the last key the tile's last row sees
        full_hi = min(nk_full, (max(start_m + 1 + (Nk - Nq), 0) // BLOCK_N) * BLOCK_N)  # the first row sees these
    else:
        hi = Nk
        full_hi = nk_full
    return full_hi, hi


@triton.jit
def _query_tile_bounds(start_n, Nq, Nk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """``(lo, mid)`` for the key tile at ``start_n``, causal: query rows ``i < start_n - (Nk - Nq)`` see none of
    its keys (tiles before ``lo`` are skipped), tiles ``[lo, mid)`` cross the diagonal, rows from ``mid`` on see
    the whole key tile. Not causal: ``(0, 0)`` (every query tile, none masked)."""
    lo = 0
    mid = 0
    if CAUSAL:
        lo = (tl.maximum(start_n - (Nk - Nq), 0) // BLOCK_M) * BLOCK_M
        mid = tl.minimum(tl.maximum(start_n + BLOCK_N - (Nk - Nq), lo), Nq)  # first row that sees the whole tile
        mid = lo + tl.cdiv(mid - lo, BLOCK_M) * BLOCK_M
    return lo, mid


@triton.jit
def _key_tile_offsets(stride_kn, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Offsets inside a key tile, for the kernels that walk key tiles: ``offs_n`` (key rows), ``offs_dv`` (value
    columns, width ``2 BLOCK_D``), ``kt_off`` (the k tile loaded transposed, ``d x BLOCK_N``), and which head
    dims of k (``d_ok``) and of v (``dv_ok``) are real rather than padding."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, 2 * BLOCK_D)
    kt_off = offs_n[None, :] * stride_kn + offs_d[:, None]
    return offs_n, offs_dv, kt_off, offs_d < HEAD_DIM, offs_dv < 2 * HEAD_DIM


@triton.jit
def _online_softmax_step(acc, m, l, s, v, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One key tile of one map's online softmax: ``s`` the ``(BLOCK_M, BLOCK_N)`` base-2 scores, ``v`` the
    ``(BLOCK_N, 2d)`` values. New running max, rescale the old sum and accumulator by ``alpha``, add the tile."""
    m_new = tl.maximum(m, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key so far
    p = tl.math.exp2(s - m_ref[:, None])
    alpha = tl.math.exp2(m - m_ref)
    l = l * alpha + tl.sum(p, 1)
    acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST)
    return acc, m_new, l


# ============================================================================================
# forward
# ============================================================================================


@triton.jit
def _finite(x):
    """``(x with its NaN and infinities zeroed, which entries were finite)``, compared in float32 (the interpreter
    keeps bfloat16 as raw integers)."""
    xf = x.to(tl.float32)
    ok = (xf == xf) & (tl.abs(xf) != float("inf"))
    return tl.where(ok, xf, 0.0).to(x.dtype), ok


@triton.jit
def _fwd_map_step(acc, m, l, chk, q, qbad, K, start_n, kt_off, kt_mask, v, vbad, mvals, rows, cols, Nq, Nk, qk_scale,
                  EDGE: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, MASK_MIN: tl.constexpr,
                  CAREFUL: tl.constexpr, TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One key tile of one map's stream: load its k tile (``K`` points at the tile; ``TMA``: ``K`` is the head's
    tensor descriptor, read at key ``start_n``), score it against ``q``, one online-softmax step with the shared
    ``v`` tile. Returns the new ``(acc, m, l, chk)``. ``chk`` per row:
    the sum of the raw scores (non-finite once q or k held a NaN or an infinity: the scan, one add per score);
    ``CAREFUL``: k zeroed where not finite, and the count of visible entries that read a non-finite value
    (``qbad`` per row, ``vbad`` per key, k's own per key)."""
    if TMA:  # rows past Nk and columns past the head dim arrive as 0, filled by the copy engine
        kt = tl.trans(K.load([start_n, 0]))
    else:
        kt = tl.load(K + kt_off, mask=kt_mask, other=0.0)
    if CAREFUL:
        kt, k_ok = _finite(kt)  # (d, BLOCK_N)
        vbad = vbad | (tl.sum((~k_ok).to(tl.int32), 0) > 0)
    s_raw = _dot(q, kt, None, DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST) * qk_scale
    s = _visible(_apply_mask(s_raw, mvals, MASK_KIND=MASK_KIND, MASK_MIN=MASK_MIN), rows[:, None], cols[None, :],
                 Nq, Nk, EDGE=EDGE, CAUSAL=CAUSAL)
    if CAREFUL:
        reads_bad = (s > float("-inf")) & (vbad[None, :] | qbad[:, None])
        chk = chk + tl.sum(reads_bad.to(tl.float32), 1)
    else:
        chk = chk + tl.sum(s_raw, 1)
    acc, m, l = _online_softmax_step(acc, m, l, s, v, DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST)
    return acc, m, l, chk


@triton.jit
def _fwd_kv_loop(acc1, m1, l1, chk1, acc2, m2, l2, chk2, q1, q2, qbad1, qbad2,  # the maps' state, query tiles
                 K1, K2, V, MASK,  # base pointers: this (batch, KV group) / the mask rows of this query tile
                 start_m, lo, hi, Nq, Nk, qk_scale, stride_kn, stride_vn, stride_mm, stride_mn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                 EDGE: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, MASK_MIN: tl.constexpr,
                 TWO_MAPS: tl.constexpr, CAREFUL: tl.constexpr, TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 UPCAST: tl.constexpr):
    """Key/value tiles ``[lo, hi)``. ``TWO_MAPS``: both online-softmax streams from one load of each tile
    (the fused form); otherwise only stream 1. ``EDGE``: tiles may cross ``Nk`` or the causal diagonal.
    ``CAREFUL``: v zeroed where not finite (a hidden key's NaN would reach its rows through ``0 * NaN``).
    ``TMA``: ``K1``, ``K2``, ``V`` are tensor descriptors (:func:`_tile_descriptors`), not pointers."""
    offs_m = tl.arange(0, BLOCK_M)
    rows = start_m + offs_m
    offs_n, offs_dv, kt_off, d_ok, dv_ok = _key_tile_offsets(stride_kn, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
                                                             HEAD_DIM=HEAD_DIM)
    v_off = offs_n[:, None] * stride_vn + offs_dv[None, :]
    for start_n in range(lo, hi, BLOCK_N):
        n64 = tl.cast(start_n, tl.int64)  # tile bases in int64, offsets inside a tile in int32
        cols = start_n + offs_n
        if EDGE:
            col_ok = cols < Nk
            kt_mask = d_ok[:, None] & col_ok[None, :]
            v_mask = col_ok[:, None] & dv_ok[None, :]
        else:
            kt_mask = d_ok[:, None]
            v_mask = dv_ok[None, :]
        if TMA:
            v = V.load([start_n, 0])
            Kt1, Kt2 = K1, K2
        else:
            v = tl.load(V + n64 * stride_vn + v_off, mask=v_mask, other=0.0)
            Kt1, Kt2 = K1 + n64 * stride_kn, K2 + n64 * stride_kn
        vbad = offs_n < 0  # (BLOCK_N,) False
        if CAREFUL:
            v, v_ok = _finite(v)
            vbad = tl.sum((~v_ok).to(tl.int32), 1) > 0
        mvals = _load_mask_tile(MASK + n64 * stride_mn, offs_m[:, None], offs_n[None, :], rows[:, None] < Nq,
                                cols[None, :] < Nk, stride_mm, stride_mn, MASK_KIND=MASK_KIND)
        acc1, m1, l1, chk1 = _fwd_map_step(acc1, m1, l1, chk1, q1, qbad1, Kt1, start_n, kt_off, kt_mask, v,
                                           vbad, mvals, rows, cols, Nq, Nk, qk_scale, EDGE=EDGE, CAUSAL=CAUSAL,
                                           MASK_KIND=MASK_KIND, MASK_MIN=MASK_MIN, CAREFUL=CAREFUL, TMA=TMA,
                                           DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST)
        if TWO_MAPS:  # map 2: the same update with its own state, the same v and mask tiles
            acc2, m2, l2, chk2 = _fwd_map_step(acc2, m2, l2, chk2, q2, qbad2, Kt2, start_n, kt_off, kt_mask,
                                               v, vbad, mvals, rows, cols, Nq, Nk, qk_scale, EDGE=EDGE, CAUSAL=CAUSAL,
                                               MASK_KIND=MASK_KIND, MASK_MIN=MASK_MIN, CAREFUL=CAREFUL, TMA=TMA,
                                               DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST)
    return acc1, m1, l1, chk1, acc2, m2, l2, chk2


@triton.jit
def _tile_descriptors(X1, Y, stride_xh, stride_xn, stride_yn, N, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                      BLOCK_D: tl.constexpr):
    """Tensor descriptors of one head's two maps at ``X1`` and ``X1 + stride_xh`` (``(N, d)`` each) and of the
    ``(N, 2d)`` tensor at ``Y``, read ``BLOCK`` rows at a time by Hopper's copy engine (TMA) instead of per-thread
    pointer loads: no address registers, and the engine fills rows past ``N`` and columns past the head dim with
    0. The forward's are k1, k2 and v (key tiles), the dK kernels' q1, q2 and dO (query tiles). The host passes
    them only where the base and every stride but the last are multiples of 16 bytes (``launch.tma_ok``)."""
    xd1 = tl.make_tensor_descriptor(X1, shape=[N, HEAD_DIM], strides=[stride_xn, 1], block_shape=[BLOCK, BLOCK_D])
    xd2 = tl.make_tensor_descriptor(X1 + stride_xh, shape=[N, HEAD_DIM], strides=[stride_xn, 1],
                                    block_shape=[BLOCK, BLOCK_D])
    yd = tl.make_tensor_descriptor(Y, shape=[N, 2 * HEAD_DIM], strides=[stride_yn, 1], block_shape=[BLOCK, 2 * BLOCK_D])
    return xd1, xd2, yd


@triton.jit
def _lse(m, l):
    """Base-2 log-sum-exp of a row; ``+inf`` marks a row with no visible key (the backward's P becomes 0)."""
    return tl.where(l == 0.0, float("inf"), m + tl.math.log2(tl.where(l == 0.0, 1.0, l)))


@triton.jit
def _diff_attn_fwd(Q, K, V, LAM, MASK, OUT, O2, LSE, FLAG,
                   stride_qb, stride_qh, stride_qm,
                   stride_kb, stride_kh, stride_kn,
                   stride_vb, stride_vh, stride_vn,
                   stride_ob, stride_oh, stride_om,
                   stride_lb, stride_lh, stride_lm,
                   stride_mb, stride_mh, stride_mm, stride_mn,
                   H, Nq, Nk, qk_scale, N_BUCKET,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, MASK_MIN: tl.constexpr,
                   MAPS: tl.constexpr, STORE_O2: tl.constexpr, CAREFUL: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr):
    """One program: one query tile of one (batch, differential head), on a 1-D grid (no 65535 limit).

    ``MAPS == MAPS_BOTH``: both maps, output ``o1 - lam o2``. ``MAPS_2``: map 2 only, stores ``o2`` (float32) and
    its log-sum-exp. ``MAPS_1``: map 1 only, reads ``o2`` back and stores the output (run after ``MAPS_2``).

    The scan: a program that met a NaN or an infinity (a raw score or an accumulator not finite) stores 1 in
    ``FLAG``. ``CAREFUL`` (a second launch, after every plain one): a program does nothing unless ``FLAG`` is set;
    then it computes its rows again with non-finite entries of q, k, v zeroed and makes NaN exactly the rows that
    read one (their output and log-sum-exp): ``diff_attention``'s contract, with no pass of the host's.

    ``TMA`` (a configuration's switch, sm_90a tables only): the key tiles arrive by tensor descriptor."""
    go = True
    if CAREFUL:  # the careful launch: only after the plain one found a non-finite value
        go = tl.load(FLAG) != 0
    if go:
        BLOCK_DV: tl.constexpr = 2 * BLOCK_D
        n_m = tl.cdiv(Nq, BLOCK_M)
        pid = tl.program_id(0)
        off_bh = pid // n_m
        start_m = (n_m - 1 - pid % n_m) * BLOCK_M  # the longest rows first (causal: the most keys)
        b = off_bh // H
        h = off_bh % H
        g = h // GROUP  # the KV group of this differential head
        b64, h64, g64, m64 = b.to(tl.int64), h.to(tl.int64), g.to(tl.int64), start_m.to(tl.int64)
        FIRST: tl.constexpr = 1 if MAPS == MAPS_2 else 0  # the map held in slot 1 (its head offset)
        Q1 = Q + b64 * stride_qb + (2 * h64 + FIRST) * stride_qh + m64 * stride_qm
        K1 = K + b64 * stride_kb + (2 * g64 + FIRST) * stride_kh
        Vg = V + b64 * stride_vb + g64 * stride_vh
        MASKm = MASK + b64 * stride_mb + h64 * stride_mh + m64 * stride_mm
        K1s, K2s, Vs = K1, K1 + stride_kh, Vg  # where the loops read k1, k2, v: pointers, or descriptors
        if TMA:
            K1s, K2s, Vs = _tile_descriptors(K1, Vg, stride_kh, stride_kn, stride_vn, Nk, HEAD_DIM=HEAD_DIM,
                                             BLOCK=BLOCK_N, BLOCK_D=BLOCK_D)

        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        row_ok = start_m + offs_m < Nq
        q_off = offs_m[:, None] * stride_qm + offs_d[None, :]
        q_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
        q1 = tl.load(Q1 + q_off, mask=q_mask, other=0.0)
        qbad1 = row_ok & False
        if CAREFUL:
            q1, q_ok = _finite(q1)
            qbad1 = tl.sum((~q_ok).to(tl.int32), 1) > 0
        chk1 = tl.zeros([BLOCK_M], tl.float32)
        m1 = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l1 = tl.zeros([BLOCK_M], tl.float32)
        acc1 = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        TWO_MAPS: tl.constexpr = MAPS == MAPS_BOTH
        if TWO_MAPS:
            q2 = tl.load(Q1 + stride_qh + q_off, mask=q_mask, other=0.0)
            qbad2 = qbad1
            if CAREFUL:
                q2, q_ok = _finite(q2)
                qbad2 = tl.sum((~q_ok).to(tl.int32), 1) > 0
            chk2 = tl.zeros([BLOCK_M], tl.float32)
            m2 = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l2 = tl.zeros([BLOCK_M], tl.float32)
            acc2 = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        else:  # placeholders: the loop leaves slot 2 untouched
            q2, m2, l2, acc2, qbad2, chk2 = q1, m1, l1, acc1, qbad1, chk1

        # key tiles [0, full_hi) need no masking; [full_hi, hi) cross Nk or the causal diagonal
        full_hi, hi = _key_tile_bounds(start_m, Nq, Nk, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CAUSAL=CAUSAL)
        acc1, m1, l1, chk1, acc2, m2, l2, chk2 = _fwd_kv_loop(
            acc1, m1, l1, chk1, acc2, m2, l2, chk2, q1, q2, qbad1, qbad2, K1s, K2s, Vs, MASKm, start_m, lo=0,
            hi=full_hi, Nq=Nq, Nk=Nk,
            qk_scale=qk_scale, stride_kn=stride_kn, stride_vn=stride_vn, stride_mm=stride_mm, stride_mn=stride_mn,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, HEAD_DIM=HEAD_DIM, EDGE=False, CAUSAL=CAUSAL,
            MASK_KIND=MASK_KIND, MASK_MIN=MASK_MIN, TWO_MAPS=TWO_MAPS, CAREFUL=CAREFUL, TMA=TMA,
            DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST)
        acc1, m1, l1, chk1, acc2, m2, l2, chk2 = _fwd_kv_loop(
            acc1, m1, l1, chk1, acc2, m2, l2, chk2, q1, q2, qbad1, qbad2, K1s, K2s, Vs, MASKm, start_m,
            lo=full_hi, hi=hi, Nq=Nq, Nk=Nk,
            qk_scale=qk_scale, stride_kn=stride_kn, stride_vn=stride_vn, stride_mm=stride_mm, stride_mn=stride_mn,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, HEAD_DIM=HEAD_DIM, EDGE=True, CAUSAL=CAUSAL,
            MASK_KIND=MASK_KIND, MASK_MIN=MASK_MIN, TWO_MAPS=TWO_MAPS, CAREFUL=CAREFUL, TMA=TMA,
            DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST)

        # epilogue: normalise, combine with lambda; fully masked rows (l == 0) give 0
        offs_dv = tl.arange(0, BLOCK_DV)
        o_off = b64 * stride_ob + h64 * stride_oh + m64 * stride_om + offs_m[:, None] * stride_om + offs_dv[None, :]
        o_mask = row_ok[:, None] & (offs_dv[None, :] < 2 * HEAD_DIM)
        LSEm = LSE + off_bh.to(tl.int64) * 2 * Nq + start_m + offs_m
        o_slot1 = acc1 / tl.where(l1 == 0.0, 1.0, l1)[:, None]
        if CAREFUL:  # the rows that read a NaN or an infinity: NaN, and their log-sum-exps (the backward's P)
            bad = (chk1 > 0) | (chk2 > 0)
            o_slot1 = tl.where(bad[:, None], float("nan"), o_slot1)
            l1 = tl.where(bad, float("nan"), l1)
            l2 = tl.where(bad, float("nan"), l2)
        else:  # the scan: one sum per row of the accumulators, then at most one store of the flag
            seen = chk1 + tl.sum(acc1, 1)
            if TWO_MAPS:
                seen += chk2 + tl.sum(acc2, 1)
            n_bad = tl.sum(((seen != seen) | (tl.abs(seen) == float("inf"))).to(tl.int32), 0)
            tl.store(FLAG, n_bad * 0 + 1, mask=n_bad > 0)
        if MAPS == MAPS_2:
            tl.store(O2 + o_off, o_slot1.to(O2.dtype.element_ty), mask=o_mask)
            tl.store(LSEm + Nq, _lse(m1, l1), mask=row_ok)
        else:
            lam = tl.load(LAM + b64 * stride_lb + h64 * stride_lh + (start_m + offs_m) * stride_lm, mask=row_ok,
                          other=0.0).to(tl.float32)
            if TWO_MAPS:
                o2 = acc2 / tl.where(l2 == 0.0, 1.0, l2)[:, None]
                if STORE_O2:
                    tl.store(O2 + o_off, o2.to(O2.dtype.element_ty), mask=o_mask)
                tl.store(LSEm + Nq, _lse(m2, l2), mask=row_ok)
                out = o_slot1 - lam[:, None] * o2
                tl.store(OUT + o_off, out.to(OUT.dtype.element_ty), mask=o_mask)
            else:  # o2 comes back from memory, one half of its width at a time (a whole tile would not fit
                # next to the accumulator in registers)
                o_a, o_b = tl.split(tl.permute(tl.reshape(o_slot1, [BLOCK_M, 2, BLOCK_D]), [0, 2, 1]))
                h_off = b64 * stride_ob + h64 * stride_oh + m64 * stride_om + offs_m[:, None] * stride_om + offs_d[None, :]
                a_mask = row_ok[:, None] & (offs_d[None, :] < 2 * HEAD_DIM)  # columns [0, BLOCK_D)
                b_mask = row_ok[:, None] & (BLOCK_D + offs_d[None, :] < 2 * HEAD_DIM)  # [BLOCK_D, 2 BLOCK_D)
                o2_a = tl.load(O2 + h_off, mask=a_mask, other=0.0)
                tl.store(OUT + h_off, (o_a - lam[:, None] * o2_a).to(OUT.dtype.element_ty), mask=a_mask)
                o2_b = tl.load(O2 + BLOCK_D + h_off, mask=b_mask, other=0.0)
                tl.store(OUT + BLOCK_D + h_off, (o_b - lam[:, None] * o2_b).to(OUT.dtype.element_ty), mask=b_mask)
            tl.store(LSEm, _lse(m1, l1), mask=row_ok)


# ============================================================================================
# backward
# ============================================================================================


@triton.jit
def _diff_attn_bwd_preprocess(OUT, O2, DO, LAM, DELTA, FLAG,
                              stride_ob, stride_oh, stride_om,
                              stride_gb, stride_gh, stride_gm,
                              stride_lb, stride_lh, stride_lm,
                              H, Nq,
                              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """Per query row: ``delta1 = dO . o1`` (``o1 = out + lam o2``) and ``delta2 = dO . o2``, in float32; NaN
    where the forward's scan set ``FLAG`` (a call that read a NaN or an infinity: every gradient is NaN then)."""
    BLOCK_DV: tl.constexpr = 2 * BLOCK_D
    n_m = tl.cdiv(Nq, BLOCK_M)
    pid = tl.program_id(0)
    off_bh = pid // n_m
    start_m = (pid % n_m) * BLOCK_M
    b = (off_bh // H).to(tl.int64)
    h = (off_bh % H).to(tl.int64)
    m64 = start_m.to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = start_m + offs_m < Nq
    mask = row_ok[:, None] & (offs_dv[None, :] < 2 * HEAD_DIM)
    o_off = b * stride_ob + h * stride_oh + m64 * stride_om + offs_m[:, None] * stride_om + offs_dv[None, :]
    out = tl.load(OUT + o_off, mask=mask, other=0.0).to(tl.float32)
    o2 = tl.load(O2 + o_off, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + b * stride_gb + h * stride_gh + m64 * stride_gm + offs_m[:, None] * stride_gm
                 + offs_dv[None, :], mask=mask, other=0.0).to(tl.float32)
    lam = tl.load(LAM + b * stride_lb + h * stride_lh + (start_m + offs_m) * stride_lm, mask=row_ok,
                  other=0.0).to(tl.float32)
    poison = tl.where(tl.load(FLAG) != 0, float("nan"), 0.0)
    delta2 = tl.sum(do * o2, 1) + poison
    delta1 = tl.sum(do * out, 1) + lam * delta2
    DELTA = DELTA + off_bh.to(tl.int64) * 2 * Nq + start_m + offs_m
    tl.store(DELTA, delta1, mask=row_ok)
    tl.store(DELTA + Nq, delta2, mask=row_ok)


@triton.jit
def _probs_t(k, Q, start_m, qt_off, qt_mask, LSE, mvals, visible, rows, row_ok, qk_scale, TMA: tl.constexpr,
             DIAG: tl.constexpr, MASK_KIND: tl.constexpr, MASK_MIN: tl.constexpr, DOT_PRECISION: tl.constexpr,
             UPCAST: tl.constexpr):
    """One map's probabilities for one query tile against the key tile ``k``, recomputed and transposed,
    ``(BLOCK_N, BLOCK_M)``: ``P^T = 2^(k q^T qk_scale - lse)`` from the saved base-2 log-sum-exp (``LSE`` of this
    map; rows past ``Nq`` load ``+inf``, so their P is 0). On diagonal tiles (``DIAG``) the entries outside
    ``visible``, one tile for both maps, become 0 after the exponential (hiding the scores before it, as the
    other kernels do with :func:`_visible`, costs the heaviest dK variants register spills: compile facts).
    Returns ``(p^T, q^T)``: the dK product reuses q^T. ``Q`` points at the query tile, or (``TMA``) is the map's
    tensor descriptor, read at row ``start_m`` (rows past ``Nq``, columns past the head dim: 0, as masked)."""
    if TMA:
        qt = tl.trans(Q.load([start_m, 0]))
    else:
        qt = tl.load(Q + qt_off, mask=qt_mask, other=0.0)
    st = _scores(k, qt, mvals, 0, 0, 0, 0, qk_scale, EDGE=False, CAUSAL=False, MASK_KIND=MASK_KIND,
                 MASK_MIN=MASK_MIN, DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST)
    pt = tl.math.exp2(st - tl.load(LSE + rows, mask=row_ok, other=float("inf"))[None, :])
    if DIAG:
        pt = tl.where(visible, pt, 0.0)
    return pt, qt


@triton.jit
def _query_tile(Q1, Q2, DOh, start_m, do_off, do_mask, stride_qm, stride_gm, TMA: tl.constexpr):
    """For the dK kernels' loops, one query tile: its ``dO`` tile, loaded, and where :func:`_probs_t` reads its
    ``q1`` and ``q2`` tiles: pointers moved to row ``start_m``, or (``TMA``) the maps' descriptors themselves."""
    if TMA:
        do = DOh.load([start_m, 0])
        Qt1, Qt2 = Q1, Q2
    else:
        m64 = tl.cast(start_m, tl.int64)
        do = tl.load(DOh + m64 * stride_gm + do_off, mask=do_mask, other=0.0)
        Qt1, Qt2 = Q1 + m64 * stride_qm, Q2 + m64 * stride_qm
    return do, Qt1, Qt2


@triton.jit
def _bwd_kv_loop(dk1, dk2, dv, k1, k2, v,  # accumulators and the key tile's k1, k2 (BLOCK_N x d), v (BLOCK_N x 2d)
                 Q1, Q2, DOh, LSEh, DELTAh, LAMh, MASKh,  # this head's query maps / dO / statistics / lambda / mask
                 start_n, lo, hi, Nq, Nk, qk_scale,
                 stride_qm, stride_gm, stride_lm, stride_mm, stride_mn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                 DIAG: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, MASK_MIN: tl.constexpr,
                 DV_OUT: tl.constexpr, DK_MAPS: tl.constexpr, TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 UPCAST: tl.constexpr):
    """Query tiles ``[lo, hi)`` against one key tile, everything transposed (rows are keys). ``DIAG``: the
    tiles cross the causal diagonal (mask them). Rows past ``Nq`` load ``lse = +inf``, so their P is 0.
    ``TMA``: ``Q1``, ``Q2``, ``DOh`` are tensor descriptors (:func:`_tile_descriptors`), not pointers."""
    offs_mb = tl.arange(0, BLOCK_M)
    offs_nl = tl.arange(0, BLOCK_N)  # key rows inside the tile (MASKh already points at key start_n)
    offs_n = start_n + offs_nl
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, 2 * BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < 2 * HEAD_DIM
    DK1: tl.constexpr = DK_MAPS == MAPS_1 or DK_MAPS == MAPS_BOTH
    DK2: tl.constexpr = DK_MAPS == MAPS_2 or DK_MAPS == MAPS_BOTH
    NEED1: tl.constexpr = DV_OUT or DK1  # dV needs both maps' probabilities
    NEED2: tl.constexpr = DV_OUT or DK2
    qt_off = offs_mb[None, :] * stride_qm + offs_d[:, None]
    do_off = offs_mb[:, None] * stride_gm + offs_dv[None, :]
    for start_m in range(lo, hi, BLOCK_M):
        m64 = tl.cast(start_m, tl.int64)
        rows = start_m + offs_mb
        row_ok = rows < Nq
        qt_mask = row_ok[None, :] & d_ok[:, None]
        do, Qt1, Qt2 = _query_tile(Q1, Q2, DOh, start_m, do_off, row_ok[:, None] & dv_ok[None, :], stride_qm,
                                   stride_gm, TMA=TMA)
        lam = tl.load(LAMh + rows * stride_lm, mask=row_ok, other=0.0).to(tl.float32)
        mvals = _load_mask_tile(MASKh + m64 * stride_mm, offs_mb[None, :], offs_nl[:, None], row_ok[None, :],
                                offs_n[:, None] < Nk, stride_mm, stride_mn, MASK_KIND=MASK_KIND)
        visible = 0
        if DIAG:  # key j seen by query i (bottom-right aligned causal), transposed
            visible = offs_n[:, None] <= rows[None, :] + (Nk - Nq)
        # recompute the maps, transposed: (BLOCK_N, BLOCK_M); map 2's upstream gradient is -lam dO
        if NEED1:
            p1t, q1t = _probs_t(k1, Qt1, start_m, qt_off, qt_mask, LSEh, mvals, visible, rows, row_ok, qk_scale,
                                TMA=TMA, DIAG=DIAG, MASK_KIND=MASK_KIND, MASK_MIN=MASK_MIN,
                                DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST)
        if NEED2:
            p2t, q2t = _probs_t(k2, Qt2, start_m, qt_off, qt_mask, LSEh + Nq, mvals, visible, rows, row_ok,
                                qk_scale, TMA=TMA, DIAG=DIAG, MASK_KIND=MASK_KIND, MASK_MIN=MASK_MIN,
                                DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST)
        if DV_OUT:  # dV += (P1 - lam P2)^T dO: the differential map, transposed
            dv = _dot((p1t - lam[None, :] * p2t).to(do.dtype), do, dv, DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST)
        if DK_MAPS != MAPS_NONE:  # dP = dO v^T, shared by both maps
            dpt = _dot(v, tl.trans(do), None, DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST)
            if DK1:
                delta1 = tl.load(DELTAh + rows, mask=row_ok, other=0.0)
                ds1t = _score_grad(p1t, dpt, delta1[None, :], lam[None, :], MAP2=False)
                dk1 = _dot(ds1t.to(q1t.dtype), tl.trans(q1t), dk1, DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST)
            if DK2:
                delta2 = tl.load(DELTAh + Nq + rows, mask=row_ok, other=0.0)
                ds2t = _score_grad(p2t, dpt, delta2[None, :], lam[None, :], MAP2=True)
                dk2 = _dot(ds2t.to(q2t.dtype), tl.trans(q2t), dk2, DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST)
    return dk1, dk2, dv


@triton.jit
def _diff_attn_bwd_dkdv(Q, K, V, LAM, MASK, DO, LSE, DELTA, DK, DV, FLAG,
                        stride_qb, stride_qh, stride_qm,
                        stride_kb, stride_kh, stride_kn,
                        stride_vb, stride_vh, stride_vn,
                        stride_gb, stride_gh, stride_gm,
                        stride_lb, stride_lh, stride_lm,
                        stride_mb, stride_mh, stride_mm, stride_mn,
                        stride_dkb, stride_dkh, stride_dkn,  # the gradients' own strides (not k's, v's)
                        stride_dvb, stride_dvh, stride_dvn,
                        H, Hkv, Nq, Nk, qk_scale, sm_scale, N_BUCKET,
                        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                        CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, MASK_MIN: tl.constexpr,
                        DV_OUT: tl.constexpr, DK_MAPS: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, TMA: tl.constexpr):
    """One program: one key tile of one (batch, KV group); it sums over the ``GROUP`` differential heads that
    share the group, so each dK/dV row has one writer. ``DV_OUT``: accumulate dV; ``DK_MAPS``: dK of
    ``MAPS_1``, ``MAPS_2``, ``MAPS_BOTH`` or ``MAPS_NONE``. ``DK``, ``DV`` are written with their own strides: a
    gradient buffer is dense even where k or v is a view with gaps, overlaps (``expand``) or a storage offset.
    ``TMA`` (a configuration's switch, sm_90a tables only): the query and dO tiles arrive by tensor descriptor."""
    BLOCK_DV: tl.constexpr = 2 * BLOCK_D
    n_n = tl.cdiv(Nk, BLOCK_N)
    pid = tl.program_id(0)
    off_bg = pid // n_n
    start_n = (pid % n_n) * BLOCK_N
    b64 = (off_bg // Hkv).to(tl.int64)
    g64 = (off_bg % Hkv).to(tl.int64)
    n64 = start_n.to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_ok = start_n + offs_n < Nk
    k_off = offs_n[:, None] * stride_kn + offs_d[None, :]
    k_mask = col_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    K1 = K + b64 * stride_kb + (2 * g64) * stride_kh + n64 * stride_kn
    k1 = tl.load(K1 + k_off, mask=k_mask, other=0.0)
    k2 = tl.load(K1 + stride_kh + k_off, mask=k_mask, other=0.0)
    v_off = b64 * stride_vb + g64 * stride_vh + n64 * stride_vn + offs_n[:, None] * stride_vn + offs_dv[None, :]
    v_mask = col_ok[:, None] & (offs_dv[None, :] < 2 * HEAD_DIM)
    v = tl.load(V + v_off, mask=v_mask, other=0.0)
    dk1 = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dk2 = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)

    lo, mid = _query_tile_bounds(start_n, Nq, Nk, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CAUSAL=CAUSAL)
    for r in range(GROUP):
        h64 = g64 * GROUP + r
        bh = b64 * H + h64
        Q1 = Q + b64 * stride_qb + (2 * h64) * stride_qh
        DOh = DO + b64 * stride_gb + h64 * stride_gh
        LAMh = LAM + b64 * stride_lb + h64 * stride_lh
        MASKh = MASK + b64 * stride_mb + h64 * stride_mh + n64 * stride_mn
        LSEh = LSE + bh * 2 * Nq
        DELTAh = DELTA + bh * 2 * Nq
        Q1s, Q2s, DOs = Q1, Q1 + stride_qh, DOh  # where the loops read q1, q2, dO: pointers, or descriptors
        if TMA:
            Q1s, Q2s, DOs = _tile_descriptors(Q1, DOh, stride_qh, stride_qm, stride_gm, Nq, HEAD_DIM=HEAD_DIM,
                                              BLOCK=BLOCK_M, BLOCK_D=BLOCK_D)
        if CAUSAL:  # the query tiles [lo, mid) cross the diagonal
            dk1, dk2, dv = _bwd_kv_loop(
                dk1, dk2, dv, k1, k2, v, Q1s, Q2s, DOs, LSEh, DELTAh, LAMh, MASKh, start_n, lo=lo, hi=mid, Nq=Nq,
                Nk=Nk, qk_scale=qk_scale, stride_qm=stride_qm, stride_gm=stride_gm,
                stride_lm=stride_lm, stride_mm=stride_mm, stride_mn=stride_mn, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                BLOCK_D=BLOCK_D, HEAD_DIM=HEAD_DIM, DIAG=True, CAUSAL=CAUSAL, MASK_KIND=MASK_KIND,
                MASK_MIN=MASK_MIN, DV_OUT=DV_OUT, DK_MAPS=DK_MAPS, TMA=TMA, DOT_PRECISION=DOT_PRECISION,
                UPCAST=UPCAST)
        dk1, dk2, dv = _bwd_kv_loop(
            dk1, dk2, dv, k1, k2, v, Q1s, Q2s, DOs, LSEh, DELTAh, LAMh, MASKh, start_n, lo=mid, hi=Nq, Nq=Nq,
            Nk=Nk, qk_scale=qk_scale, stride_qm=stride_qm, stride_gm=stride_gm,
            stride_lm=stride_lm, stride_mm=stride_mm, stride_mn=stride_mn, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
            BLOCK_D=BLOCK_D, HEAD_DIM=HEAD_DIM, DIAG=False, CAUSAL=CAUSAL, MASK_KIND=MASK_KIND,
            MASK_MIN=MASK_MIN, DV_OUT=DV_OUT, DK_MAPS=DK_MAPS, TMA=TMA, DOT_PRECISION=DOT_PRECISION,
            UPCAST=UPCAST)

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
