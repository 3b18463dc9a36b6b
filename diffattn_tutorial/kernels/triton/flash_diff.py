"""A fused differential flash-attention kernel in Triton, forward and backward (``backend="triton"``).

Computes ``softmax(q1 k1^T s) v - lam * softmax(q2 k2^T s) v`` without ever writing an ``N x N`` map,
in the layout of :func:`diffattn_tutorial.functional.diff_attention`: q ``(B, 2H, Nq, d)`` with the two
maps of differential head ``i`` at heads ``2i`` and ``2i+1``, k ``(B, 2Hkv, Nk, d)``, v ``(B, Hkv, Nk, 2d)``;
differential head ``i`` reads KV group ``i // (H // Hkv)`` for both maps.

Forward (:func:`_diff_attn_fwd`), one program per (query tile, batch x differential head), in one of two
forms (part of a :class:`Plan`, chosen per head dim by :func:`plan_for`):

* **fused** (``MAP=0``, head dims up to 64 on Hopper): the query tiles of **both** maps stay on chip; each
  ``k1``, ``k2``, ``v`` tile is loaded **once** and feeds two online-softmax streams, each with its running max
  ``m``, running sum ``l`` and a float32 accumulator of width ``2d``; the lambda combine ``o1 - lam * o2``
  happens in registers at the end;
* **split maps** (``MAP=2`` then ``MAP=1``, head dim 128, and every head dim on Ampere): two launches of the
  same kernel, one map per program. Two accumulators of ``BLOCK_M x 2d`` float32 do not fit one program's registers at ``d = 128``
  (notebook 09 counts them), so the map-2 launch writes ``o2`` (float32) and the map-1 launch reads it back
  in its epilogue for the combine. No matrix product is done twice.

Both store the log-sum-exp of each map (base 2, ``m + log2 l``) and, when a gradient is needed, ``o2``.

Backward, from those statistics (nothing of size ``N x N`` is kept between passes):

* a preprocess kernel computes, per query row, ``delta1 = dO . o1`` and ``delta2 = dO . o2`` (with
  ``o1 = out + lam * o2``). Map 1 sees the upstream gradient ``dO``, map 2 sees ``-lam * dO``, so map 2's
  ``rowsum(dO2 * O2)`` is ``-lam * delta2`` and ``dlam = -delta2`` per row (summed over broadcast dims on the host);
* a dK/dV kernel, one program per (key tile, batch x KV group), loops over the heads of its group and
  over the query tiles, **recomputes** ``P1``, ``P2`` from ``q``, ``k`` and the saved log-sum-exps, and
  accumulates ``dV += (P1 - lam P2)^T dO``, ``dK1 += dS1^T q1``, ``dK2 += dS2^T q2`` (no atomics); from
  ``d = 64`` dV and dK are separate launches of it (``DV_OUT``, ``DK_MAPS``), at ``d = 128`` each map's dK
  too, for the same register reason;
* a dQ kernel, one program per (query tile, batch x head), recomputes the same tiles and accumulates
  ``dQ1 += dS1 k1``, ``dQ2 += dS2 k2`` (one map per launch at ``d = 128``, ``DQ_MAPS``). With
  ``dP = dO v^T``: ``dS1 = P1 (dP - delta1)`` and ``dS2 = -lam P2 (dP - delta2)``.

The plans (:data:`PLANS`): ``fused`` (d <= 32), ``split_kv`` (d = 64), ``split`` (d = 128, and every head dim on
Ampere). Every launch's configurations are listed per head dim in small tables (``_CONFIGS_16BIT`` for Hopper,
``_CONFIGS_AMPERE`` for sm_80/86/89, ``_CONFIGS_TURING`` for sm_75, ``_CONFIGS_FP32``), each entry checked to
compile cleanly for its targets (see below).

Supported: scalar and per-token/per-head ``lam``; ``causal`` (bottom-right aligned, fully masked key
tiles skipped); an ``attn_mask`` (bool or additive float, broadcastable to ``(B, H, Nq, Nk)``, read tile
by tile; additive entries ``<= torch.finfo(dtype).min``, the Hugging Face convention, count as masked);
GQA/MQA; any ``Nq``, ``Nk`` (edge tiles masked); head dims 1..128 (padded to a power of two >= 16);
float32/float16/bfloat16 inputs with float32 accumulation. Any layout: the kernels read q, k, v, lam and the
mask through their own strides (views with gaps such as slices of a fused qkv projection, strided slices,
``expand()``ed tensors with stride 0, transposes, storage offsets), and write every gradient into a fresh dense
buffer through **that buffer's** strides (:func:`_grad_buffer`); autograd's view backward then scatters or sums
it into the caller's layout. One case is copied: a q, k or v whose **last** dim is not contiguous (such as
``qkv.unflatten(-1, (heads, d, 3))[..., 0]``) is made contiguous once, costing one extra read and write of that
tensor in the forward and of its gradient in the backward (the kernels load rows as 16-byte vectors). The mask
gets no gradient (a mask that requires one is refused). Fully masked query rows give zeros and zero gradients;
NaN inputs give NaN outputs. Not supported: attention dropout, float64 (use the ``naive`` or ``chunked``
backends).

Where it runs: on a CUDA GPU (block sizes autotuned over a few configurations per kernel, each checked by
:mod:`diffattn_tutorial.kernels.triton.aot` to compile without register spills and within the shared memory of
every target: H100 (sm_90a, on ``wgmma``), A100 (sm_80), RTX 30xx (sm_86), L4 and RTX 40xx (sm_89), T4
(sm_75: float16 only, training up to d = 64, FMA dots: this Triton has no tensor-core path below sm_80), or
on the CPU in Triton's interpreter when the environment variable ``TRITON_INTERPRET=1`` is set **before
triton is first imported** (exact but slow: for learning and tests; the interpreter cannot multiply
bfloat16 tiles, so there they are multiplied as the float32 values they hold, see ``_dot``).
``DIFFATTN_TRITON_AUTOTUNE=0`` in the environment pins every kernel to the first configuration of its list
(no autotuning: the GPU tests use it to finish in minutes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Iterator, Optional

import torch
import triton
import triton.language as tl

from diffattn_tutorial.constants import LOG2E  # 1 / ln 2: the kernels use exp2 (base-2 scores)

Tensor = torch.Tensor

_LOG2E = tl.constexpr(LOG2E)  # the same number, visible inside @triton.jit functions
MAX_HEAD_DIM = 128
INTERPRETER_BLOCK = 16
"""Tile size under the interpreter: small, so the CPU tests cover several tiles and ragged edges."""
AUTOTUNE_ENV = "DIFFATTN_TRITON_AUTOTUNE"
"""Set to ``0`` to pin every kernel to the first configuration of its list instead of autotuning."""
POISON_ENV = "DIFFATTN_TRITON_POISON"
"""Set to ``1`` to fill every buffer the kernels write (outputs, gradients, statistics) with NaN before they
run, instead of leaving it uninitialised: a tile that is never written then shows as NaN (tests use it)."""
MAX_TILE_ROWS = 256
"""Offsets inside a tile are int32: ``stride * MAX_TILE_ROWS`` must stay below 2**31 (checked on the host)."""

MASK_NONE, MASK_BOOL, MASK_ADD = 0, 1, 2


def _interpret_mode() -> bool:
    """True when Triton itself was imported for its CPU interpreter (``TRITON_INTERPRET=1`` set first).

    ``@triton.jit`` chooses between the compiler and the interpreter when it decorates a function, and
    Triton's own library functions (``tl.sum``, ``tl.zeros``, ...) are decorated when ``triton`` is first
    imported, so the variable must be set **before** the first ``import triton`` in the process.
    """
    return type(tl.sum).__name__ == "InterpretedFunction"


def _interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_LATE_INTERPRET = ("TRITON_INTERPRET=1 was set after triton had been imported, so Triton is not in interpreter "
                   "mode; set it before the first `import triton` (at the top of the script or notebook, or "
                   "in the shell) and restart")


def triton_available() -> tuple[bool, str]:
    """``(usable, why)``: can the Triton kernels run here? On a CPU only under ``TRITON_INTERPRET=1``."""
    if _interpret_mode():
        return True, (f"Triton {triton.__version__} interpreter (TRITON_INTERPRET=1): runs on the CPU, "
                      f"exact but slow, for learning and tests")
    if torch.cuda.is_available():
        return True, f"Triton {triton.__version__} compiled kernels on {torch.cuda.get_device_name()}"
    if _interpret_requested():
        return False, _LATE_INTERPRET
    return False, ("no CUDA GPU; set the environment variable TRITON_INTERPRET=1 before importing triton to "
                   "run the kernels in Triton's CPU interpreter (slow: for learning and tests)")


# ============================================================================================
# building blocks shared by the kernels
# ============================================================================================


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
    if MASK_KIND == 1:
        s = tl.where(mvals != 0, s, float("-inf"))
    elif MASK_KIND == 2:
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
    """The user's mask tile, or 0 without one (``MASK_KIND == 0``). ``MASK`` points at the tile's first entry;
    ``q_off``, ``k_off`` are the query and key offsets inside the tile and ``q_ok``, ``k_ok`` which of them exist,
    broadcastable to the tile's shape. One load serves both maps of a head."""
    mvals = 0
    if MASK_KIND != 0:
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
    s = _dot(a, b, None, DOT_PRECISION, UPCAST) * qk_scale
    return _visible(_apply_mask(s, mvals, MASK_KIND, MASK_MIN), rows, cols, Nq, Nk, EDGE, CAUSAL)


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
    acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], DOT_PRECISION, UPCAST)
    return acc, m_new, l


# ============================================================================================
# forward
# ============================================================================================


@triton.jit
def _fwd_map_step(acc, m, l, q, K, kt_off, kt_mask, v, mvals, rows, cols, Nq, Nk, qk_scale,
                  EDGE: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, MASK_MIN: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One key tile of one map's stream: load its k tile (``K`` points at the tile), score it against ``q``,
    one online-softmax step with the shared ``v`` tile. Returns the new ``(acc, m, l)``."""
    kt = tl.load(K + kt_off, mask=kt_mask, other=0.0)
    s = _scores(q, kt, mvals, rows[:, None], cols[None, :], Nq, Nk, qk_scale, EDGE, CAUSAL, MASK_KIND, MASK_MIN,
                DOT_PRECISION, UPCAST)
    return _online_softmax_step(acc, m, l, s, v, DOT_PRECISION, UPCAST)


@triton.jit
def _fwd_kv_loop(acc1, m1, l1, acc2, m2, l2, q1, q2,  # running state of the map(s), the query tiles
                 K1, K2, V, MASK,  # base pointers: this (batch, KV group) / the mask rows of this query tile
                 start_m, lo, hi, Nq, Nk, qk_scale, stride_kn, stride_vn, stride_mm, stride_mn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                 EDGE: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, MASK_MIN: tl.constexpr,
                 TWO_MAPS: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Key/value tiles ``[lo, hi)``. ``TWO_MAPS``: both online-softmax streams from one load of each tile
    (the fused form); otherwise only stream 1. ``EDGE``: tiles may cross ``Nk`` or the causal diagonal."""
    offs_m = tl.arange(0, BLOCK_M)
    rows = start_m + offs_m
    offs_n, offs_dv, kt_off, d_ok, dv_ok = _key_tile_offsets(stride_kn, BLOCK_N, BLOCK_D, HEAD_DIM)
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
        v = tl.load(V + n64 * stride_vn + v_off, mask=v_mask, other=0.0)
        mvals = _load_mask_tile(MASK + n64 * stride_mn, offs_m[:, None], offs_n[None, :], rows[:, None] < Nq,
                                cols[None, :] < Nk, stride_mm, stride_mn, MASK_KIND)
        acc1, m1, l1 = _fwd_map_step(acc1, m1, l1, q1, K1 + n64 * stride_kn, kt_off, kt_mask, v, mvals, rows, cols,
                                     Nq, Nk, qk_scale, EDGE, CAUSAL, MASK_KIND, MASK_MIN, DOT_PRECISION, UPCAST)
        if TWO_MAPS:  # map 2: the same update with its own state, the same v and mask tiles
            acc2, m2, l2 = _fwd_map_step(acc2, m2, l2, q2, K2 + n64 * stride_kn, kt_off, kt_mask, v, mvals, rows,
                                         cols, Nq, Nk, qk_scale, EDGE, CAUSAL, MASK_KIND, MASK_MIN, DOT_PRECISION,
                                         UPCAST)
    return acc1, m1, l1, acc2, m2, l2


@triton.jit
def _lse(m, l):
    """Base-2 log-sum-exp of a row; ``+inf`` marks a row with no visible key (the backward's P becomes 0)."""
    return tl.where(l == 0.0, float("inf"), m + tl.math.log2(tl.where(l == 0.0, 1.0, l)))


@triton.jit
def _diff_attn_fwd(Q, K, V, LAM, MASK, OUT, O2, LSE,
                   stride_qb, stride_qh, stride_qm,
                   stride_kb, stride_kh, stride_kn,
                   stride_vb, stride_vh, stride_vn,
                   stride_ob, stride_oh, stride_om,
                   stride_lb, stride_lh, stride_lm,
                   stride_mb, stride_mh, stride_mm, stride_mn,
                   H, Nq, Nk, qk_scale, N_BUCKET,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, MASK_MIN: tl.constexpr,
                   MAP: tl.constexpr, STORE_O2: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: one query tile of one (batch, differential head), on a 1-D grid (no 65535 limit).

    ``MAP = 0``: both maps, output ``o1 - lam o2``. ``MAP = 2``: map 2 only, stores ``o2`` (float32) and its
    log-sum-exp. ``MAP = 1``: map 1 only, reads ``o2`` back and stores the output (run after ``MAP = 2``)."""
    BLOCK_DV: tl.constexpr = 2 * BLOCK_D
    n_m = tl.cdiv(Nq, BLOCK_M)
    pid = tl.program_id(0)
    off_bh = pid // n_m
    start_m = (n_m - 1 - pid % n_m) * BLOCK_M  # the longest rows first (causal: the most keys)
    b = off_bh // H
    h = off_bh % H
    g = h // GROUP  # the KV group of this differential head
    b64, h64, g64, m64 = b.to(tl.int64), h.to(tl.int64), g.to(tl.int64), start_m.to(tl.int64)
    FIRST: tl.constexpr = 1 if MAP == 2 else 0  # the map held in slot 1
    Q1 = Q + b64 * stride_qb + (2 * h64 + FIRST) * stride_qh + m64 * stride_qm
    K1 = K + b64 * stride_kb + (2 * g64 + FIRST) * stride_kh
    V = V + b64 * stride_vb + g64 * stride_vh
    MASK = MASK + b64 * stride_mb + h64 * stride_mh + m64 * stride_mm

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = start_m + offs_m < Nq
    q_off = offs_m[:, None] * stride_qm + offs_d[None, :]
    q_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q1 = tl.load(Q1 + q_off, mask=q_mask, other=0.0)
    m1 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l1 = tl.zeros([BLOCK_M], tl.float32)
    acc1 = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    TWO_MAPS: tl.constexpr = MAP == 0
    if TWO_MAPS:
        q2 = tl.load(Q1 + stride_qh + q_off, mask=q_mask, other=0.0)
        m2 = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l2 = tl.zeros([BLOCK_M], tl.float32)
        acc2 = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    else:  # placeholders: the loop leaves slot 2 untouched
        q2, m2, l2, acc2 = q1, m1, l1, acc1

    # key tiles [0, full_hi) need no masking; [full_hi, hi) cross Nk or the causal diagonal
    full_hi, hi = _key_tile_bounds(start_m, Nq, Nk, BLOCK_M, BLOCK_N, CAUSAL)
    acc1, m1, l1, acc2, m2, l2 = _fwd_kv_loop(
        acc1, m1, l1, acc2, m2, l2, q1, q2, K1, K1 + stride_kh, V, MASK, start_m, 0, full_hi, Nq, Nk, qk_scale,
        stride_kn, stride_vn, stride_mm, stride_mn, BLOCK_M, BLOCK_N, BLOCK_D, HEAD_DIM,
        False, CAUSAL, MASK_KIND, MASK_MIN, TWO_MAPS, DOT_PRECISION, UPCAST)
    acc1, m1, l1, acc2, m2, l2 = _fwd_kv_loop(
        acc1, m1, l1, acc2, m2, l2, q1, q2, K1, K1 + stride_kh, V, MASK, start_m, full_hi, hi, Nq, Nk, qk_scale,
        stride_kn, stride_vn, stride_mm, stride_mn, BLOCK_M, BLOCK_N, BLOCK_D, HEAD_DIM,
        True, CAUSAL, MASK_KIND, MASK_MIN, TWO_MAPS, DOT_PRECISION, UPCAST)

    # epilogue: normalise, combine with lambda; fully masked rows (l == 0) give 0
    offs_dv = tl.arange(0, BLOCK_DV)
    o_off = b64 * stride_ob + h64 * stride_oh + m64 * stride_om + offs_m[:, None] * stride_om + offs_dv[None, :]
    o_mask = row_ok[:, None] & (offs_dv[None, :] < 2 * HEAD_DIM)
    LSE = LSE + off_bh.to(tl.int64) * 2 * Nq + start_m + offs_m
    o_slot1 = acc1 / tl.where(l1 == 0.0, 1.0, l1)[:, None]
    if MAP == 2:
        tl.store(O2 + o_off, o_slot1.to(O2.dtype.element_ty), mask=o_mask)
        tl.store(LSE + Nq, _lse(m1, l1), mask=row_ok)
    else:
        lam = tl.load(LAM + b64 * stride_lb + h64 * stride_lh + (start_m + offs_m) * stride_lm, mask=row_ok,
                      other=0.0).to(tl.float32)
        if TWO_MAPS:
            o2 = acc2 / tl.where(l2 == 0.0, 1.0, l2)[:, None]
            if STORE_O2:
                tl.store(O2 + o_off, o2.to(O2.dtype.element_ty), mask=o_mask)
            tl.store(LSE + Nq, _lse(m2, l2), mask=row_ok)
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
        tl.store(LSE, _lse(m1, l1), mask=row_ok)


# ============================================================================================
# backward
# ============================================================================================


@triton.jit
def _diff_attn_bwd_preprocess(OUT, O2, DO, LAM, DELTA,
                              stride_ob, stride_oh, stride_om,
                              stride_gb, stride_gh, stride_gm,
                              stride_lb, stride_lh, stride_lm,
                              H, Nq,
                              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """Per query row: ``delta1 = dO . o1`` (``o1 = out + lam o2``) and ``delta2 = dO . o2``, in float32."""
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
    delta2 = tl.sum(do * o2, 1)
    delta1 = tl.sum(do * out, 1) + lam * delta2
    DELTA = DELTA + off_bh.to(tl.int64) * 2 * Nq + start_m + offs_m
    tl.store(DELTA, delta1, mask=row_ok)
    tl.store(DELTA + Nq, delta2, mask=row_ok)


@triton.jit
def _probs_t(k, Q, qt_off, qt_mask, LSE, mvals, visible, rows, row_ok, qk_scale, DIAG: tl.constexpr,
             MASK_KIND: tl.constexpr, MASK_MIN: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One map's probabilities for one query tile against the key tile ``k``, recomputed and transposed,
    ``(BLOCK_N, BLOCK_M)``: ``P^T = 2^(k q^T qk_scale - lse)`` from the saved base-2 log-sum-exp (``LSE`` of this
    map; rows past ``Nq`` load ``+inf``, so their P is 0). On diagonal tiles (``DIAG``) the entries outside
    ``visible``, one tile for both maps, become 0 after the exponential (hiding the scores before it, as the
    other kernels do with :func:`_visible`, costs the heaviest dK variants register spills: compile facts).
    Returns ``(p^T, q^T)``: the dK product reuses q^T."""
    qt = tl.load(Q + qt_off, mask=qt_mask, other=0.0)
    st = _scores(k, qt, mvals, 0, 0, 0, 0, qk_scale, False, False, MASK_KIND, MASK_MIN, DOT_PRECISION, UPCAST)
    pt = tl.math.exp2(st - tl.load(LSE + rows, mask=row_ok, other=float("inf"))[None, :])
    if DIAG:
        pt = tl.where(visible, pt, 0.0)
    return pt, qt


@triton.jit
def _bwd_kv_loop(dk1, dk2, dv, k1, k2, v,  # accumulators and the key tile's k1, k2 (BLOCK_N x d), v (BLOCK_N x 2d)
                 Q1, DOh, LSEh, DELTAh, LAMh, MASKh,  # this head's query map 1 / dO / statistics / lambda / mask
                 start_n, lo, hi, Nq, Nk, qk_scale,
                 stride_qh, stride_qm, stride_gm, stride_lm, stride_mm, stride_mn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                 DIAG: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, MASK_MIN: tl.constexpr,
                 DV_OUT: tl.constexpr, DK_MAPS: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Query tiles ``[lo, hi)`` against one key tile, everything transposed (rows are keys). ``DIAG``: the
    tiles cross the causal diagonal (mask them). Rows past ``Nq`` load ``lse = +inf``, so their P is 0."""
    offs_mb = tl.arange(0, BLOCK_M)
    offs_nl = tl.arange(0, BLOCK_N)  # key rows inside the tile (MASKh already points at key start_n)
    offs_n = start_n + offs_nl
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, 2 * BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < 2 * HEAD_DIM
    NEED1: tl.constexpr = DV_OUT or DK_MAPS == 1 or DK_MAPS == 3
    NEED2: tl.constexpr = DV_OUT or DK_MAPS == 2 or DK_MAPS == 3
    qt_off = offs_mb[None, :] * stride_qm + offs_d[:, None]
    do_off = offs_mb[:, None] * stride_gm + offs_dv[None, :]
    for start_m in range(lo, hi, BLOCK_M):
        m64 = tl.cast(start_m, tl.int64)
        rows = start_m + offs_mb
        row_ok = rows < Nq
        qt_mask = row_ok[None, :] & d_ok[:, None]
        do = tl.load(DOh + m64 * stride_gm + do_off, mask=row_ok[:, None] & dv_ok[None, :], other=0.0)
        lam = tl.load(LAMh + rows * stride_lm, mask=row_ok, other=0.0).to(tl.float32)
        mvals = _load_mask_tile(MASKh + m64 * stride_mm, offs_mb[None, :], offs_nl[:, None], row_ok[None, :],
                                offs_n[:, None] < Nk, stride_mm, stride_mn, MASK_KIND)
        visible = 0
        if DIAG:  # key j seen by query i (bottom-right aligned causal), transposed
            visible = offs_n[:, None] <= rows[None, :] + (Nk - Nq)
        # recompute the maps, transposed: (BLOCK_N, BLOCK_M); map 2's upstream gradient is -lam dO
        if NEED1:
            p1t, q1t = _probs_t(k1, Q1 + m64 * stride_qm, qt_off, qt_mask, LSEh, mvals, visible, rows, row_ok, qk_scale,
                                DIAG, MASK_KIND, MASK_MIN, DOT_PRECISION, UPCAST)
        if NEED2:
            p2t, q2t = _probs_t(k2, Q1 + stride_qh + m64 * stride_qm, qt_off, qt_mask, LSEh + Nq, mvals, visible, rows,
                                row_ok, qk_scale, DIAG, MASK_KIND, MASK_MIN, DOT_PRECISION, UPCAST)
        if DV_OUT:  # dV += (P1 - lam P2)^T dO: the differential map, transposed
            dv = _dot((p1t - lam[None, :] * p2t).to(do.dtype), do, dv, DOT_PRECISION, UPCAST)
        if DK_MAPS != 0:  # dP = dO v^T, shared by both maps
            dpt = _dot(v, tl.trans(do), None, DOT_PRECISION, UPCAST)
            if NEED1 and DK_MAPS != 2:
                delta1 = tl.load(DELTAh + rows, mask=row_ok, other=0.0)
                ds1t = _score_grad(p1t, dpt, delta1[None, :], lam[None, :], False)
                dk1 = _dot(ds1t.to(q1t.dtype), tl.trans(q1t), dk1, DOT_PRECISION, UPCAST)
            if NEED2 and DK_MAPS != 1:
                delta2 = tl.load(DELTAh + Nq + rows, mask=row_ok, other=0.0)
                ds2t = _score_grad(p2t, dpt, delta2[None, :], lam[None, :], True)
                dk2 = _dot(ds2t.to(q2t.dtype), tl.trans(q2t), dk2, DOT_PRECISION, UPCAST)
    return dk1, dk2, dv


@triton.jit
def _diff_attn_bwd_dkdv(Q, K, V, LAM, MASK, DO, LSE, DELTA, DK, DV,
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
                        BLOCK_N: tl.constexpr):
    """One program: one key tile of one (batch, KV group); it sums over the ``GROUP`` differential heads that
    share the group, so each dK/dV row has one writer. ``DV_OUT``: accumulate dV; ``DK_MAPS``: dK of map 1
    (1), map 2 (2), both (3) or none (0). ``DK``, ``DV`` are written with their own strides: a gradient buffer
    is dense even where k or v is a view with gaps, overlaps (``expand``) or a storage offset."""
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

    lo, mid = _query_tile_bounds(start_n, Nq, Nk, BLOCK_M, BLOCK_N, CAUSAL)
    for r in range(GROUP):
        h64 = g64 * GROUP + r
        bh = b64 * H + h64
        Q1 = Q + b64 * stride_qb + (2 * h64) * stride_qh
        DOh = DO + b64 * stride_gb + h64 * stride_gh
        LAMh = LAM + b64 * stride_lb + h64 * stride_lh
        MASKh = MASK + b64 * stride_mb + h64 * stride_mh + n64 * stride_mn
        LSEh = LSE + bh * 2 * Nq
        DELTAh = DELTA + bh * 2 * Nq
        if CAUSAL:
            dk1, dk2, dv = _bwd_kv_loop(dk1, dk2, dv, k1, k2, v, Q1, DOh, LSEh, DELTAh, LAMh, MASKh,
                                        start_n, lo, mid, Nq, Nk, qk_scale,
                                        stride_qh, stride_qm, stride_gm, stride_lm, stride_mm, stride_mn,
                                        BLOCK_M, BLOCK_N, BLOCK_D, HEAD_DIM, True, CAUSAL, MASK_KIND, MASK_MIN,
                                        DV_OUT, DK_MAPS, DOT_PRECISION, UPCAST)
        dk1, dk2, dv = _bwd_kv_loop(dk1, dk2, dv, k1, k2, v, Q1, DOh, LSEh, DELTAh, LAMh, MASKh,
                                    start_n, mid, Nq, Nq, Nk, qk_scale,
                                    stride_qh, stride_qm, stride_gm, stride_lm, stride_mm, stride_mn,
                                    BLOCK_M, BLOCK_N, BLOCK_D, HEAD_DIM, False, CAUSAL, MASK_KIND, MASK_MIN,
                                    DV_OUT, DK_MAPS, DOT_PRECISION, UPCAST)

    dk_off = offs_n[:, None] * stride_dkn + offs_d[None, :]
    DK1 = DK + b64 * stride_dkb + (2 * g64) * stride_dkh + n64 * stride_dkn
    if DK_MAPS == 1 or DK_MAPS == 3:
        tl.store(DK1 + dk_off, (dk1 * sm_scale).to(DK.dtype.element_ty), mask=k_mask)
    if DK_MAPS == 2 or DK_MAPS == 3:
        tl.store(DK1 + stride_dkh + dk_off, (dk2 * sm_scale).to(DK.dtype.element_ty), mask=k_mask)
    if DV_OUT:
        dv_off = b64 * stride_dvb + g64 * stride_dvh + n64 * stride_dvn + offs_n[:, None] * stride_dvn + offs_dv[None, :]
        tl.store(DV + dv_off, dv.to(DV.dtype.element_ty), mask=v_mask)


@triton.jit
def _dq_map_step(dq, q, K, kt_off, kt_mask, mvals, rows, cols, lse, delta, lam, dp, Nq, Nk, qk_scale,
                 EDGE: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, MASK_MIN: tl.constexpr,
                 MAP2: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One key tile of one map: load its k tile (``K`` points at the tile), recompute ``P = 2^(s - lse)`` from
    the scores, ``dQ += dS k`` with ``dS`` from :func:`_score_grad` (``MAP2``: map 2's ``-lam``)."""
    kt = tl.load(K + kt_off, mask=kt_mask, other=0.0)
    s = _scores(q, kt, mvals, rows[:, None], cols[None, :], Nq, Nk, qk_scale, EDGE, CAUSAL, MASK_KIND, MASK_MIN,
                DOT_PRECISION, UPCAST)
    ds = _score_grad(tl.math.exp2(s - lse[:, None]), dp, delta[:, None], lam[:, None], MAP2)
    return _dot(ds.to(kt.dtype), tl.trans(kt), dq, DOT_PRECISION, UPCAST)


@triton.jit
def _bwd_q_loop(dq1, dq2, q1, q2, do, lse1, lse2, delta1, delta2, lam,  # this query tile's state
                K1, V, MASK, start_m, lo, hi, Nq, Nk, qk_scale, stride_kh, stride_kn, stride_vn, stride_mm, stride_mn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                EDGE: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, MASK_MIN: tl.constexpr,
                DQ_MAPS: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Key tiles ``[lo, hi)`` for one query tile: ``dQ_m += dS_m k_m`` for the maps in ``DQ_MAPS``."""
    offs_m = tl.arange(0, BLOCK_M)
    rows = start_m + offs_m
    offs_n, offs_dv, kt_off, d_ok, dv_ok = _key_tile_offsets(stride_kn, BLOCK_N, BLOCK_D, HEAD_DIM)
    vt_off = offs_n[None, :] * stride_vn + offs_dv[:, None]
    for start_n in range(lo, hi, BLOCK_N):
        n64 = tl.cast(start_n, tl.int64)
        cols = start_n + offs_n
        col_ok = cols < Nk
        kt_mask = d_ok[:, None] & col_ok[None, :]
        vt = tl.load(V + n64 * stride_vn + vt_off, mask=dv_ok[:, None] & col_ok[None, :], other=0.0)  # (2d, BLOCK_N)
        dp = _dot(do, vt, None, DOT_PRECISION, UPCAST)  # dP = dO v^T, shared by both maps
        mvals = _load_mask_tile(MASK + n64 * stride_mn, offs_m[:, None], offs_n[None, :], rows[:, None] < Nq,
                                col_ok[None, :], stride_mm, stride_mn, MASK_KIND)
        if DQ_MAPS != 2:
            dq1 = _dq_map_step(dq1, q1, K1 + n64 * stride_kn, kt_off, kt_mask, mvals, rows, cols, lse1, delta1, lam,
                               dp, Nq, Nk, qk_scale, EDGE, CAUSAL, MASK_KIND, MASK_MIN, False, DOT_PRECISION, UPCAST)
        if DQ_MAPS != 1:
            dq2 = _dq_map_step(dq2, q2, K1 + stride_kh + n64 * stride_kn, kt_off, kt_mask, mvals, rows, cols, lse2,
                               delta2, lam, dp, Nq, Nk, qk_scale, EDGE, CAUSAL, MASK_KIND, MASK_MIN, True,
                               DOT_PRECISION, UPCAST)
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
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: one query tile of one (batch, differential head); dQ of map 1 (``DQ_MAPS`` 1), map 2 (2)
    or both (3), written with ``DQ``'s own strides."""
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
    if DQ_MAPS != 2:
        q1 = tl.load(Q1 + q_off, mask=q_mask, other=0.0)
        lse1 = tl.load(LSE + rows, mask=row_ok, other=float("inf"))
        delta1 = tl.load(DELTA + rows, mask=row_ok, other=0.0)
    if DQ_MAPS != 1:
        q2 = tl.load(Q1 + stride_qh + q_off, mask=q_mask, other=0.0)
        lse2 = tl.load(LSE + Nq + rows, mask=row_ok, other=float("inf"))
        delta2 = tl.load(DELTA + Nq + rows, mask=row_ok, other=0.0)
    K1 = K + b64 * stride_kb + (2 * g64) * stride_kh
    V = V + b64 * stride_vb + g64 * stride_vh
    MASK = MASK + b64 * stride_mb + h64 * stride_mh + m64 * stride_mm

    full_hi, hi = _key_tile_bounds(start_m, Nq, Nk, BLOCK_M, BLOCK_N, CAUSAL)
    dq1, dq2 = _bwd_q_loop(dq1, dq2, q1, q2, do, lse1, lse2, delta1, delta2, lam, K1, V, MASK, start_m, 0, full_hi,
                           Nq, Nk, qk_scale, stride_kh, stride_kn, stride_vn, stride_mm, stride_mn,
                           BLOCK_M, BLOCK_N, BLOCK_D, HEAD_DIM, False, CAUSAL, MASK_KIND, MASK_MIN, DQ_MAPS,
                           DOT_PRECISION, UPCAST)
    dq1, dq2 = _bwd_q_loop(dq1, dq2, q1, q2, do, lse1, lse2, delta1, delta2, lam, K1, V, MASK, start_m, full_hi, hi,
                           Nq, Nk, qk_scale, stride_kh, stride_kn, stride_vn, stride_mm, stride_mn,
                           BLOCK_M, BLOCK_N, BLOCK_D, HEAD_DIM, True, CAUSAL, MASK_KIND, MASK_MIN, DQ_MAPS,
                           DOT_PRECISION, UPCAST)

    DQ1 = DQ + b64 * stride_dqb + (2 * h64) * stride_dqh + m64 * stride_dqm
    dq_off = offs_m[:, None] * stride_dqm + offs_d[None, :]
    if DQ_MAPS != 2:
        tl.store(DQ1 + dq_off, (dq1 * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)
    if DQ_MAPS != 1:
        tl.store(DQ1 + stride_dqh + dq_off, (dq2 * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)


# ============================================================================================
# plans, configurations, launching
# ============================================================================================


@dataclasses.dataclass(frozen=True)
class Plan:
    """How the work is split into launches: which maps a forward program computes, which gradients a dK/dV
    program accumulates, which maps a dQ program computes. Splitting gives each program fewer float32
    accumulators (registers) at the price of recomputing some score tiles in a second launch."""

    name: str
    fwd_maps: tuple[int, ...]  # forward launches, in order (MAP): (0,) both maps; (2, 1) map 2, then map 1
    kv_parts: tuple[tuple[bool, int], ...]  # dK/dV launches (DV_OUT, DK_MAPS): DK_MAPS 3 = both maps
    dq_maps: tuple[int, ...]  # dQ launches (DQ_MAPS): (3,) both maps, or (1, 2)


PLANS = {
    # d <= 32: one launch per kernel, both maps per program
    "fused": Plan("fused", (0,), ((True, 3),), (3,)),
    # d = 64: dK1, dK2 (4d float32 per key row with dV) do not fit next to the score tiles: dV and dK apart
    "split_kv": Plan("split_kv", (0,), ((True, 0), (False, 3)), (3,)),
    # d = 128: one map per forward and dQ program, dV and each map's dK apart
    "split": Plan("split", (2, 1), ((True, 0), (False, 1), (False, 2)), (1, 2)),
}


def plan_for(block_d: int, capability: int = 90) -> Plan:
    """The plan the library uses for a padded head dim ``block_d`` (the register budget decides, see
    notebook 09 and benchmarks/NOTES.md): fused up to 32, dK/dV split at 64, everything split at 128
    (below Hopper, ``capability < 90``, whose ``mma.sync`` or FMA dots hold their operands in registers: split
    at every head dim, :data:`AMPERE_PLANS`)."""
    if capability < 90 and block_d in AMPERE_PLANS:
        return PLANS[AMPERE_PLANS[block_d]]
    return PLANS["split" if block_d >= 128 else ("split_kv" if block_d >= 64 else "fused")]


def train_head_dim_limit(capability: int) -> int:
    """The largest padded head dim whose backward runs on a GPU of compute ``capability``: 64 below sm_80 (see
    ``_CONFIGS_TURING``), else :data:`MAX_HEAD_DIM`."""
    return 64 if capability < 80 else MAX_HEAD_DIM


def _cfg(bm: int, bn: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)


# (kernel, form) -> padded head dim -> configs, first = the pinned one. Each entry compiles for sm_90a
# without spills, with every 16-bit dot on wgmma and no dot duplicated across warpgroups
# (tests/test_triton_compile.py; python -m diffattn_tutorial.kernels.triton.aot --all; diffattn_tutorial/recorded/compile_facts.json).
_C = _cfg
_CONFIGS_16BIT: dict[tuple[str, str], dict[int, list[triton.Config]]] = {
    ("_diff_attn_fwd", "fused"): {
        16: [_C(128, 64, 8, 2), _C(128, 64, 8, 3), _C(64, 64, 4, 3), _C(128, 32, 8, 3)],
        32: [_C(128, 32, 8, 3), _C(64, 64, 4, 3), _C(128, 32, 8, 4), _C(64, 32, 4, 3)],
        64: [_C(128, 32, 8, 3), _C(128, 32, 8, 4), _C(64, 32, 4, 3)],
    },
    ("_diff_attn_fwd", "map"): {
        128: [_C(128, 64, 8, 2), _C(128, 32, 8, 3), _C(128, 32, 8, 2)],
    },
    ("_diff_attn_bwd_dkdv", "dkdv"): {
        16: [_C(32, 128, 8, 2), _C(32, 64, 4, 2), _C(16, 128, 8, 2), _C(32, 128, 8, 3)],
        32: [_C(32, 128, 8, 2), _C(16, 128, 8, 2), _C(32, 128, 8, 3), _C(16, 64, 4, 2)],
    },
    ("_diff_attn_bwd_dkdv", "dv"): {
        64: [_C(32, 128, 8, 2), _C(32, 64, 4, 2), _C(32, 128, 8, 3), _C(16, 128, 8, 2)],
        128: [_C(16, 128, 8, 2)],
    },
    ("_diff_attn_bwd_dkdv", "dk"): {
        64: [_C(32, 128, 8, 2), _C(16, 128, 8, 2), _C(16, 128, 8, 3), _C(16, 64, 4, 2)],
    },
    ("_diff_attn_bwd_dkdv", "dk1"): {
        128: [_C(32, 128, 8, 3)],
    },
    ("_diff_attn_bwd_dq", "dq2"): {
        16: [_C(128, 64, 8, 2), _C(64, 64, 4, 2), _C(128, 32, 8, 2), _C(64, 32, 4, 3)],
        32: [_C(128, 64, 8, 2), _C(64, 64, 4, 2), _C(128, 32, 8, 2), _C(64, 32, 4, 3)],
        64: [_C(128, 32, 8, 2), _C(64, 32, 4, 3)],
    },
    ("_diff_attn_bwd_dq", "dq1"): {
        128: [_C(128, 32, 8, 2), _C(64, 32, 4, 3)],
    },
}
# float32: no tensor cores unless TF32 is allowed ("ieee" products are FMA loops), small tiles only, any plan
_FP32_FWD, _FP32_KV, _FP32_Q = [_C(32, 16, 4, 2)], [_C(16, 16, 4, 2)], [_C(32, 16, 4, 2)]
_CONFIGS_FP32: dict[tuple[str, str], dict[int, list[triton.Config]]] = {
    **{("_diff_attn_fwd", form): {d: _FP32_FWD for d in (16, 32, 64, 128)} for form in ("fused", "map")},
    **{("_diff_attn_bwd_dkdv", form): {d: _FP32_KV for d in (16, 32, 64, 128)} for form in ("dkdv", "dv", "dk", "dk1")},
    **{("_diff_attn_bwd_dq", form): {**{d: _FP32_Q for d in (16, 32, 64)}, 128: _FP32_KV} for form in ("dq2", "dq1")},
}
# Ampere and Ada (sm_80, sm_86, sm_89: mma.sync, both operands in registers): one map per program at every head
# dim, smaller tiles; each entry clean on all three targets (their ptxas allocate registers differently)
_CONFIGS_AMPERE: dict[tuple[str, str], dict[int, list[triton.Config]]] = {
    ("_diff_attn_fwd", "map"): {
        16: [_C(64, 64, 4, 2), _C(128, 64, 8, 2), _C(64, 32, 4, 2)],
        32: [_C(128, 64, 8, 2), _C(64, 32, 4, 2)],
        64: [_C(64, 64, 4, 2), _C(128, 32, 8, 2), _C(64, 32, 4, 2)],
        128: [_C(64, 64, 8, 2)],
    },
    ("_diff_attn_bwd_dkdv", "dv"): {
        16: [_C(32, 64, 4, 2), _C(16, 64, 4, 2), _C(32, 128, 8, 2)],
        32: [_C(32, 64, 4, 2), _C(16, 64, 4, 2), _C(32, 128, 8, 2)],
        64: [_C(16, 128, 8, 2)],
        128: [_C(32, 64, 8, 2)],
    },
    ("_diff_attn_bwd_dkdv", "dk1"): {
        16: [_C(32, 64, 4, 2), _C(32, 128, 8, 2)],
        32: [_C(32, 64, 4, 2), _C(32, 128, 8, 2)],
        64: [_C(16, 64, 4, 1), _C(16, 32, 2, 2)],  # 16x64 w4 s2 spilled 4 B on sm_86 (GQA 4:1)
        128: [_C(32, 32, 4, 2)],
    },
    ("_diff_attn_bwd_dq", "dq1"): {  # spilled 4-32 B on sm_80/86/89 at 255 registers: 64x64 w4 (d 32),
        16: [_C(64, 32, 4, 2)],  # 128x32 w8 (d 64), 32x32 w4 (d 128); 8 warps over 32 or 64 rows compute
        32: [_C(64, 32, 4, 2), _C(128, 32, 8, 2)],  # the same product twice (dup 2): not kept either
        64: [_C(64, 16, 4, 2), _C(128, 16, 8, 2)],
        128: [_C(32, 32, 2, 2), _C(32, 16, 2, 2)],
    },
}
# Turing (sm_75: T4, RTX 20xx; float16 only, 64 KiB of shared memory per block). This Triton (3.9) has no
# tensor-core path below sm_80: every tl.dot compiles to FMA loops (no mma instruction in the PTX, recorded in the
# compile facts) and nothing is software-pipelined (so 1 stage). FMA dots hold their operands in registers: the
# tiles are small, most with 8 warps, each clean in every variant. The backward at d = 128 is not run there
# (:func:`train_head_dim_limit`): its dK launch spilled 200-5000 B in every shape tried (16x16 to 32x32, 4-16 warps).
_CONFIGS_TURING: dict[tuple[str, str], dict[int, list[triton.Config]]] = {
    ("_diff_attn_fwd", "map"): {
        16: [_C(64, 32, 8, 1), _C(32, 32, 8, 1)],
        32: [_C(64, 32, 8, 1), _C(32, 32, 8, 1)],
        64: [_C(32, 32, 8, 1), _C(64, 16, 8, 1)],
        128: [_C(32, 16, 8, 1), _C(16, 16, 4, 1)],
    },
    ("_diff_attn_bwd_dkdv", "dv"): {
        16: [_C(16, 64, 8, 1), _C(32, 32, 8, 1)],
        32: [_C(16, 64, 8, 1), _C(32, 32, 8, 1)],
        64: [_C(16, 64, 8, 1), _C(32, 16, 16, 1)],
    },
    ("_diff_attn_bwd_dkdv", "dk1"): {
        16: [_C(16, 64, 8, 1), _C(32, 32, 8, 1)],
        32: [_C(16, 64, 8, 1), _C(32, 32, 8, 1)],
        64: [_C(16, 16, 8, 1)],
    },
    ("_diff_attn_bwd_dq", "dq1"): {
        16: [_C(64, 16, 8, 1), _C(32, 32, 8, 1)],
        32: [_C(64, 16, 8, 1), _C(32, 16, 8, 1)],  # 32x32 w8 spilled 8 B without a mask
        64: [_C(64, 16, 8, 1), _C(32, 16, 16, 1)],
    },
}
AMPERE_PLANS: dict[int, str] = {16: "split", 32: "split", 64: "split", 128: "split"}


def _form(name: str, consts: dict) -> str:
    """A short name for the kernel variant the constexprs select (the autotune lists are per variant)."""
    if name == "_diff_attn_fwd":
        return "fused" if consts["MAP"] == 0 else "map"
    if name == "_diff_attn_bwd_dkdv":
        dv, dk = consts["DV_OUT"], consts["DK_MAPS"]
        return "dkdv" if dv and dk else ("dv" if dv else ("dk" if dk == 3 else "dk1"))
    if name == "_diff_attn_bwd_dq":
        return "dq2" if consts["DQ_MAPS"] == 3 else "dq1"
    return "pre"


def autotune_configs(name: str, consts: dict, dtype: torch.dtype, capability: int = 90) -> list[triton.Config]:
    """The configurations the autotuner may pick for one launch (kernel ``name`` with constexprs ``consts``) on
    a GPU of compute ``capability`` (90 and up: the Hopper table; 80-89: Ampere and Ada; below 80: Turing); the
    first is the one ``DIFFATTN_TRITON_AUTOTUNE=0`` pins."""
    if name == "_diff_attn_bwd_preprocess":
        return [triton.Config({}, num_warps=4, num_stages=1)]
    if dtype == torch.float32:
        table = _CONFIGS_FP32
    else:
        table = _CONFIGS_16BIT if capability >= 90 else (_CONFIGS_AMPERE if capability >= 80 else _CONFIGS_TURING)
    by_d = table.get((name, _form(name, consts)), {})
    return list(by_d.get(consts["BLOCK_D"], [])) or [_cfg(64, 32, 4, 2)]


def autotune_enabled() -> bool:
    return os.environ.get(AUTOTUNE_ENV, "1") not in ("0", "", "false", "False")


@dataclasses.dataclass
class Launch:
    """One kernel launch as the host code makes it (recorded by :func:`capture_launches`)."""

    name: str
    args: tuple
    consts: dict
    configs: list
    dtype: torch.dtype


_capture: Optional[list[Launch]] = None
_capture_capability = 90
_tuned: dict[tuple, object] = {}


@contextlib.contextmanager
def capture_launches(capability: int = 90) -> Iterator[list[Launch]]:
    """Record the kernel launches of :func:`triton_diff_attention` (forward and backward) instead of running
    them, on tensors of any device, as they would be on a GPU of compute ``capability`` (90: H100, 80: A100);
    :mod:`diffattn_tutorial.kernels.triton.aot` compiles what it records."""
    global _capture, _capture_capability
    saved = _capture, _capture_capability
    _capture, _capture_capability = [], capability
    try:
        yield _capture
    finally:
        _capture, _capture_capability = saved


def _capability(device: torch.device) -> int:
    """Compute capability as 10 * major + minor: the capture's, the GPU's, or 90 (unused by the interpreter)."""
    if _capture is not None:
        return _capture_capability
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return 10 * major + minor
    return 90


_AUTOTUNE_KEYS = ("N_BUCKET", "GROUP", "HEAD_DIM", "CAUSAL", "MASK_KIND", "MASK_MIN")


def _tuned_kernel(name: str, consts: dict, configs: list):
    key = (name, _form(name, consts), consts.get("BLOCK_D"), tuple((c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"],
                                                                   c.num_warps, c.num_stages) for c in configs))
    if key not in _tuned:
        _tuned[key] = triton.autotune(configs, key=list(_AUTOTUNE_KEYS))(globals()[name])
    return _tuned[key]


def _launch(name: str, n_programs, args: tuple, consts: dict, blocks: Optional[tuple[int, int]], interpret: bool,
            dtype: torch.dtype, capability: int) -> None:
    """Launch kernel ``name`` on a 1-D grid of ``n_programs(meta)`` programs: the interpreter's fixed
    blocks, ``blocks`` when given, the pinned first configuration (``DIFFATTN_TRITON_AUTOTUNE=0``), or
    the autotuner over :func:`autotune_configs`."""
    configs = autotune_configs(name, consts, dtype, capability)
    if _capture is not None:
        _capture.append(Launch(name, args, dict(consts), configs, dtype))
        return
    kernel = globals()[name]
    if name == "_diff_attn_bwd_preprocess":
        kernel[(n_programs(consts),)](*args, **consts)
        return
    if interpret or blocks is not None:
        bm, bn = blocks or (INTERPRETER_BLOCK, INTERPRETER_BLOCK)
        meta = {"BLOCK_M": bm, "BLOCK_N": bn}
        same = [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) == (bm, bn)]
        opts = {} if interpret else {"num_warps": same[0].num_warps if same else 4,
                                     "num_stages": same[0].num_stages if same else 2}
        kernel[(n_programs(meta),)](*args, **consts, **meta, **opts)
    elif not autotune_enabled():
        c = configs[0]
        kernel[(n_programs(c.kwargs),)](*args, **consts, **c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)
    else:
        _tuned_kernel(name, consts, configs)[lambda meta: (n_programs(meta),)](*args, **consts)


def chosen_configs() -> dict[str, dict]:
    """What the autotuner picked so far, per kernel variant and key: ``{"fwd/fused/d64": {key: config}}``."""
    picked = {}
    for (name, form, block_d, _), tuner in _tuned.items():
        cache = getattr(tuner, "cache", {})
        picked[f"{name}/{form}/d{block_d}"] = {str(k): str(c) for k, c in cache.items()}
    return picked


# ============================================================================================
# host side: autograd.Function and the public entry point
# ============================================================================================


def _dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs: exact ("ieee") products unless torch allows TF32 for matmuls (16-bit: tensor cores)."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _mask_args(mask: Optional[Tensor], shape4: tuple[int, int, int, int], q: Tensor):
    """``(tensor, strides, kind, min)`` for the kernels (a dummy pointer when there is no mask). Additive masks
    are read in their own dtype; their entries ``<= finfo(dtype).min`` count as masked."""
    if mask is None:
        return q, (0, 0, 0, 0), MASK_NONE, 0.0
    m = mask.expand(shape4)
    if m.dtype == torch.bool:
        return m.view(torch.uint8), tuple(m.stride()), MASK_BOOL, 0.0  # same bytes; the kernels test != 0
    return m, tuple(m.stride()), MASK_ADD, float(torch.finfo(m.dtype).min)


def _unit_last_stride(t: Tensor) -> Tensor:
    """The kernels read the last dim with unit stride (16-byte vector loads). A tensor whose last dim is
    strided, such as ``qkv.unflatten(-1, (heads, d, 3))[..., 0]`` of a fused projection, is copied once (one
    read and one write of it; every other layout is read in place)."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _check_offsets(**tensors: Tensor) -> None:
    for name, t in tensors.items():
        if t is not None and max((abs(s) for s in t.stride()), default=0) * MAX_TILE_ROWS >= 2**31:
            raise ValueError(f"backend='triton': {name} has a stride of {max(t.stride())} elements, too large for "
                             f"the kernels' int32 offsets inside a tile (limit {2**31 // MAX_TILE_ROWS}); pass "
                             f"{name}.contiguous() or use backend='sdpa'")


def tile_schedule(nq: int, nk: int, block_m: int, block_n: int, causal: bool) -> Tensor:
    """Which (query tile, key tile) pairs the forward kernel visits, as an int8 ``(cdiv(nq, block_m),
    cdiv(nk, block_n))`` tensor: 0 skipped, 1 visited with masking (the tile crosses ``nk`` or the causal
    diagonal), 2 visited without masking: the bounds of the two loops of :func:`_diff_attn_fwd`, computed by
    the same function, :func:`_key_tile_bounds`."""
    n_m, n_n = triton.cdiv(nq, block_m), triton.cdiv(nk, block_n)
    schedule = torch.zeros(n_m, n_n, dtype=torch.int8)
    for t in range(n_m):
        full_hi, hi = _key_tile_bounds.fn(t * block_m, nq, nk, block_m, block_n, bool(causal))  # the kernels' own
        for start_n in range(0, hi, block_n):
            schedule[t, start_n // block_n] = 2 if start_n < full_hi else 1
    return schedule


def _poison() -> bool:
    return os.environ.get(POISON_ENV, "0") not in ("0", "", "false", "False")


def _alloc(*shape: int, like: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """A buffer every element of which a kernel writes: uninitialised, or NaN under ``DIFFATTN_TRITON_POISON=1``."""
    dtype = like.dtype if dtype is None else dtype
    if _poison():
        return torch.full(shape, float("nan"), device=like.device, dtype=dtype)
    return torch.empty(shape, device=like.device, dtype=dtype)


def _grad_buffer(t: Tensor, written: bool) -> Tensor:
    """A dense, contiguous gradient buffer of ``t``'s shape, whatever ``t``'s strides: the kernels write it with
    its own strides, never ``t``'s. (``torch.empty_like`` keeps the strides of a dense ``t`` only; writing a
    gradient of a view with gaps, of a strided slice or of an ``expand()``ed tensor with the input's strides
    went past the buffer or left it partly unwritten.) ``written``: a kernel writes every element (uninitialised
    or NaN-poisoned), else zeros."""
    return _alloc(*t.shape, like=t) if written else torch.zeros(t.shape, device=t.device, dtype=t.dtype)


def _lam4(lam: Tensor, B: int, H: int, Nq: int) -> Tensor:
    """``lam`` as a ``(B, H, Nq, 1)`` view for the kernels, which index its rows as ``row * stride`` in int32: a
    per-token lambda whose row stride times ``Nq`` reaches 2**31 (a slice of a wide tensor) is copied (``B H Nq``
    values, read-only: its gradient is computed on the host)."""
    lam4 = lam.reshape((1,) * (4 - lam.ndim) + tuple(lam.shape)).expand(B, H, Nq, 1)
    return lam4.contiguous() if abs(lam4.stride(2)) * Nq >= 2**31 else lam4


class _DiffAttnFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, lam, mask, causal, scale, blocks, plan):
        B, H2, Nq, d = q.shape
        H, Hkv, Nk = H2 // 2, v.shape[1], k.shape[2]
        interpret = _interpret_mode()
        cap = _capability(q.device)
        lam4 = _lam4(lam, B, H, Nq)
        m, m_strides, mask_kind, mask_min = _mask_args(mask, (B, H, Nq, Nk), q)
        needs_o2 = any(ctx.needs_input_grad[:4])
        out = _alloc(B, H, Nq, 2 * d, like=q)
        # o2 in float32: it travels between the split plan's launches, and the backward's dlam = -dO . o2
        # keeps its precision (a 16-bit o2 would round it)
        o2 = _alloc(B, H, Nq, 2 * d, like=q, dtype=torch.float32) if needs_o2 or plan.fwd_maps != (0,) else out
        lse = _alloc(B, H, 2, Nq, like=q, dtype=torch.float32)
        block_d = max(16, triton.next_power_of_2(d))
        consts = dict(GROUP=H // Hkv, HEAD_DIM=d, BLOCK_D=block_d, CAUSAL=bool(causal), MASK_KIND=mask_kind,
                      MASK_MIN=mask_min, DOT_PRECISION=_dot_precision(q.dtype),
                      UPCAST=interpret and q.dtype == torch.bfloat16)
        n_bucket = triton.next_power_of_2(max(Nq, Nk, 1))
        if out.numel():
            args = (q, k, v, lam4, m, out, o2, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                    *out.stride()[:3], *lam4.stride()[:3], *m_strides, H, Nq, Nk, scale * LOG2E, n_bucket)
            for map_ in plan.fwd_maps:
                _launch("_diff_attn_fwd", lambda meta: triton.cdiv(Nq, meta["BLOCK_M"]) * B * H, args,
                        dict(consts, MAP=map_, STORE_O2=needs_o2), blocks, interpret, q.dtype, cap)
        ctx.save_for_backward(q, k, v, lam, m if mask_kind else None, out, o2 if needs_o2 else None, lse)
        ctx.setup = (causal, scale, blocks, consts, m_strides, n_bucket, plan, cap)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, lam, m, out, o2, lse = ctx.saved_tensors
        causal, scale, blocks, consts, m_strides, n_bucket, plan, cap = ctx.setup
        interpret = _interpret_mode()
        B, H2, Nq, d = q.shape
        H, Hkv, Nk = H2 // 2, v.shape[1], k.shape[2]
        lam4 = _lam4(lam, B, H, Nq)
        dout = _unit_last_stride(dout)
        _check_offsets(dout=dout)
        if m is None:
            m = q
        runs = bool(out.numel() and Nk)  # else there is nothing to attend to: every gradient is 0
        dq, dk, dv = (_grad_buffer(t, runs) for t in (q, k, v))
        delta = _alloc(B, H, 2, Nq, like=q, dtype=torch.float32) if runs else q.new_zeros(B, H, 2, Nq,
                                                                                         dtype=torch.float32)
        if runs:
            pre_bm = INTERPRETER_BLOCK if interpret else 4096 // (2 * consts["BLOCK_D"])  # 3 tiles of 2d
            _launch("_diff_attn_bwd_preprocess", lambda meta: triton.cdiv(Nq, pre_bm) * B * H,
                    (out, o2, dout, lam4, delta, *out.stride()[:3], *dout.stride()[:3], *lam4.stride()[:3], H, Nq),
                    dict(HEAD_DIM=d, BLOCK_D=consts["BLOCK_D"], BLOCK_M=pre_bm), None, interpret, q.dtype, cap)
            common = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3], *lam4.stride()[:3],
                      *m_strides)
            if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
                for dv_out, dk_maps in plan.kv_parts:
                    if not (dv_out and ctx.needs_input_grad[2]) and not (dk_maps and ctx.needs_input_grad[1]):
                        continue
                    _launch("_diff_attn_bwd_dkdv", lambda meta: triton.cdiv(Nk, meta["BLOCK_N"]) * B * Hkv,
                            (q, k, v, lam4, m, dout, lse, delta, dk, dv, *common, *dk.stride()[:3],
                             *dv.stride()[:3], H, Hkv, Nq, Nk, scale * LOG2E, scale, n_bucket),
                            dict(consts, DV_OUT=dv_out, DK_MAPS=dk_maps), blocks, interpret, q.dtype, cap)
            if ctx.needs_input_grad[0]:
                for dq_maps in plan.dq_maps:
                    _launch("_diff_attn_bwd_dq", lambda meta: triton.cdiv(Nq, meta["BLOCK_M"]) * B * H,
                            (q, k, v, lam4, m, dout, lse, delta, dq, *common, *dq.stride()[:3], H, Nq, Nk,
                             scale * LOG2E, scale, n_bucket), dict(consts, DQ_MAPS=dq_maps), blocks, interpret,
                            q.dtype, cap)
        dlam = None
        if ctx.needs_input_grad[3]:
            # out = o1 - lam * o2, so dlam = -(dO . o2) per row, summed over the dims lam broadcast over
            lam_shape4 = (1,) * (4 - lam.ndim) + tuple(lam.shape)
            dlam = (-delta[:, :, 1]).unsqueeze(-1).sum_to_size(lam_shape4)
            dlam = dlam.reshape(lam.shape).to(lam.dtype)
        need = ctx.needs_input_grad
        return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None, dlam,
                None, None, None, None, None)


def triton_diff_attention(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, *, causal: bool = False,
                          attn_mask: Optional[Tensor] = None, scale: Optional[float] = None,
                          blocks: Optional[tuple[int, int]] = None, plan: str = "auto") -> Tensor:
    """Differential attention with the fused Triton kernels (differentiable in ``q``, ``k``, ``v``, ``lam``).

    Shapes as :func:`diffattn_tutorial.functional.diff_attention` (which validates them and calls this
    for ``backend="triton"``): q ``(B, 2H, Nq, d)``, k ``(B, 2Hkv, Nk, d)``, v ``(B, Hkv, Nk, 2d)``, ``lam``
    a 0-dim tensor or 4-D broadcastable to ``(B, H, Nq, 1)``, ``attn_mask`` None or 4-D bool/additive
    broadcastable to ``(B, H, Nq, Nk)``. Returns ``(B, H, Nq, 2d)`` in q's dtype.

    ``blocks=(BLOCK_M, BLOCK_N)`` fixes the tile sizes (default: autotuned on a GPU, 16 x 16 in the
    interpreter). ``plan``: a name in :data:`PLANS` or ``"auto"`` (:func:`plan_for`, by head dim).
    Raises ``RuntimeError`` where Triton cannot run (a CPU without ``TRITON_INTERPRET=1``).
    """
    if _capture is None:
        _check_mode(q.device)
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"backend='triton' runs float32, float16 and bfloat16, got {q.dtype}; for {q.dtype} use "
                        f"backend='naive' or 'chunked'")
    d = q.shape[-1]
    if d > MAX_HEAD_DIM:
        raise ValueError(f"backend='triton' supports q/k head dims up to {MAX_HEAD_DIM} (V up to "
                         f"{2 * MAX_HEAD_DIM}), got d={d}; use backend='sdpa' or 'naive'")
    if blocks is not None and (len(blocks) != 2 or min(blocks) < 16 or any(b & (b - 1) for b in blocks)):
        raise ValueError(f"blocks must be two powers of two >= 16 (BLOCK_M, BLOCK_N), got {blocks}")
    if attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled():
        raise ValueError("backend='triton' gives no gradient for attn_mask (the kernels never form the N x N "
                         "score gradient); pass attn_mask.detach() if the mask is not learned, or use "
                         "backend='naive' for a learned additive bias")
    if plan not in ("auto", *PLANS):
        raise ValueError(f"plan must be 'auto' or one of {tuple(PLANS)}, got {plan!r}")
    block_d = max(16, triton.next_power_of_2(d))
    cap = _capability(q.device)
    _check_target(q, k, v, lam, block_d, cap)
    the_plan = plan_for(block_d, cap) if plan == "auto" else PLANS[plan]
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    _check_offsets(q=q, k=k, v=v, attn_mask=attn_mask)
    scale = d ** -0.5 if scale is None else float(scale)
    lam = lam.to(device=q.device, dtype=q.dtype)
    return _DiffAttnFn.apply(q, k, v, lam, attn_mask, bool(causal), scale, blocks, the_plan)


def _check_target(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, block_d: int, capability: int) -> None:
    """What a GPU below sm_80 (a T4) cannot run: bfloat16 (no bf16 arithmetic there) and the backward at head dims
    above :func:`train_head_dim_limit`."""
    if capability >= 80:
        return
    gpu = f"compute capability {capability / 10:.1f}"
    if q.dtype == torch.bfloat16:
        raise TypeError(f"backend='triton': this GPU ({gpu}) has no bfloat16 arithmetic; pass float16 inputs "
                        f"(gpu_bench.preferred_half_dtype(device) picks it) or use backend='auto'")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, lam)) and \
            block_d > train_head_dim_limit(capability):
        raise ValueError(f"backend='triton' on this GPU ({gpu}) trains head dims up to "
                         f"{train_head_dim_limit(capability)} (the backward at d = {q.shape[-1]} spills registers "
                         f"in every configuration); use backend='auto' for training, or run under torch.no_grad()")


def _check_mode(device: torch.device) -> bool:
    """Return True if the kernels run in the interpreter; raise where they cannot run on ``device``."""
    interpret = _interpret_mode()
    if type(_diff_attn_fwd).__name__ != type(tl.sum).__name__:
        raise RuntimeError("diffattn_tutorial.kernels.triton.flash_diff was imported under a different TRITON_INTERPRET "
                           "setting than triton itself; set TRITON_INTERPRET once, before importing either")
    if device.type != "cuda" and not interpret:
        why = _LATE_INTERPRET if _interpret_requested() else (
            f"backend='triton' needs CUDA tensors, or Triton's interpreter for {device.type} tensors (set "
            f"os.environ['TRITON_INTERPRET'] = '1' before importing triton)")
        raise RuntimeError(f"{why}; or use backend='naive', 'chunked' or 'sdpa'")
    return interpret


__all__ = ["triton_available", "triton_diff_attention", "tile_schedule", "plan_for", "autotune_configs",
           "capture_launches", "chosen_configs", "train_head_dim_limit", "Plan", "PLANS", "LOG2E",
           "INTERPRETER_BLOCK", "MAX_HEAD_DIM", "AUTOTUNE_ENV"]
