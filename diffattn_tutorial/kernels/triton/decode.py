"""Flash-decoding for differential attention: a split-K Triton kernel for a few query tokens over a long KV cache.

While a model generates, each step has one query token per sequence against the whole cache. The flash kernel
parallelises over query tiles, so it would run one program per (sequence, head), far too few to read the cache at
the GPU's speed. Flash-decoding (Dao, Haziza, Massa and Sizov, 2023) splits the **keys** instead, in two kernels:
:func:`_decode_partial`, one program per (sequence, KV group, split), holds the query rows of every head of the
group (padded to ``BLOCK_M >= 16`` rows for ``tl.dot``), reads each ``k1``, ``k2``, ``v`` tile of its split once for
both maps and stores per map the split's normalised output and base-2 log-sum-exp; :func:`_decode_combine`, one
program per query row, merges the splits with weights ``2^(lse_s - max lse)`` and returns ``o1 - lam o2``.

Contract of :func:`decode_attention`: the layout of :func:`~diffattn_tutorial.functional.diff_attention`; ``lengths``
valid keys per sequence (a static cache's fill level: the rest of the buffer is never read); ``causal`` bottom-right
aligned; a query that sees no key gives zeros; no gradient. It runs the operator :data:`DECODE_OP`, which checks its
inputs' shapes, dtypes and devices itself. :func:`split_k_reference` is the same algorithm in PyTorch, for reading and
as the tests' oracle. Both kernels run on a CUDA GPU, or in Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
import triton
import triton.language as tl

from diffattn_tutorial.constants import LOG2E
from diffattn_tutorial.kernels.triton import launch
from diffattn_tutorial.kernels.triton.configs import MAX_HEAD_DIM
from diffattn_tutorial.kernels.triton.flash_diff import (
    INTERPRETER_BLOCK,
    check_op_inputs,
    check_same,
    check_shapes,
    triton_available,
)
from diffattn_tutorial.kernels.triton.flash_kernels import _dot, _online_softmax_step
from diffattn_tutorial.kernels.triton.launch import alloc, capture_launches, capturing, dot_precision, interpret_mode
from diffattn_tutorial.validation import check_diff_inputs

Tensor = torch.Tensor

MAX_ROWS_X_DIM = 4096
"""``BLOCK_M x BLOCK_D`` at most: the query rows one program holds (``(H // Hkv) * Nq``, padded to a power of two
>= 16) times the padded head dim. Its two float32 accumulators are ``BLOCK_M x 2 BLOCK_D``; up to this size every
configuration compiled for sm_90a and sm_80 without register spills (``ptxas -v``, Triton 3.9, 8 warps from
:data:`WIDE_TILE` on): 128 rows at d <= 32, 64 at d = 64, 32 at d = 128; twice as many spilled."""
WIDE_TILE = 2048
"""From this ``BLOCK_M x BLOCK_D`` on the partial kernel runs 8 warps instead of 4 (d = 128 with 16 rows spilled
40 bytes at 4 warps on sm_90a, none at 8)."""
BLOCK_KEYS = 64
"""Keys per tile on a GPU from sm_80 on (:data:`~diffattn_tutorial.kernels.triton.flash_diff.INTERPRETER_BLOCK` in
the interpreter)."""
BLOCK_KEYS_TURING = 16
"""Keys per tile below sm_80 (a T4), where this Triton lowers the dots to FMA loops: 64 keys spilled about 4 KB of
registers per thread at d = 64 and 128 and needed 80 KiB of shared memory at d = 128 (over the T4's 64 KiB), 32 keys
still spilled; 16 compile clean (``recorded/compile_facts_decode.json``)."""
PROGRAMS_PER_SM = 2
"""The default split count aims at this many partial programs per multiprocessor (flash-decoding's heuristic)."""
MAX_SPLITS = 64


# ============================================================================================
# kernels
# ============================================================================================


@triton.jit
def _split_lse(m, l_sum):
    """Base-2 log-sum-exp of a row of one split; ``-inf`` where the split has no visible key (weight 0)."""
    return tl.where(l_sum == 0.0, float("-inf"), m + tl.math.log2(tl.where(l_sum == 0.0, 1.0, l_sum)))


@triton.jit
def _decode_partial(Q, K, V, LENS, O_PART, LSE_PART,
                    stride_qb, stride_qh, stride_qm,
                    stride_kb, stride_kh, stride_kn,
                    stride_vb, stride_vh, stride_vn,
                    H, Hkv, Nq, Nk, qk_scale, keys_per_split,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: the ``GROUP * Nq`` query rows of KV group ``g`` of sequence ``b``, both maps, against the keys
    ``[split * keys_per_split, (split + 1) * keys_per_split)`` that are valid (below the sequence's length)."""
    BLOCK_DV: tl.constexpr = 2 * BLOCK_D
    pid = tl.program_id(0)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    b = pid // Hkv
    g = pid % Hkv
    length = tl.minimum(tl.maximum(tl.load(LENS + b), 0), Nk)  # clamped: never a read past the buffer
    b64, g64 = b.to(tl.int64), g.to(tl.int64)

    # query rows: r = (head within the group) * Nq + query, so the group's rows are consecutive in (H, Nq)
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < GROUP * Nq
    head = g64 * GROUP + offs_m // Nq
    query = offs_m % Nq
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_off = b64 * stride_qb + (2 * head[:, None]) * stride_qh + query[:, None] * stride_qm + offs_d[None, :]
    q_mask = row_ok[:, None] & d_ok[None, :]
    q1 = tl.load(Q + q_off, mask=q_mask, other=0.0)
    q2 = tl.load(Q + stride_qh + q_off, mask=q_mask, other=0.0)
    last = tl.zeros([BLOCK_M], tl.int32) + length - 1  # the last key each row may see
    if CAUSAL:
        last = length - Nq + query  # bottom-right aligned: the newest query sees the newest key

    m1 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l1 = tl.zeros([BLOCK_M], tl.float32)
    acc1 = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    m2 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l2 = tl.zeros([BLOCK_M], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    K1 = K + b64 * stride_kb + (2 * g64) * stride_kh
    V = V + b64 * stride_vb + g64 * stride_vh
    offs_n = tl.arange(0, BLOCK_N)
    offs_dv = tl.arange(0, BLOCK_DV)
    kt_off = offs_n[None, :] * stride_kn + offs_d[:, None]  # a k tile loaded transposed, (d, BLOCK_N)
    v_off = offs_n[:, None] * stride_vn + offs_dv[None, :]
    lo = split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, length)
    for start_n in range(lo, hi, BLOCK_N):
        n64 = tl.cast(start_n, tl.int64)
        cols = start_n + offs_n
        col_ok = cols < hi
        kt_mask = d_ok[:, None] & col_ok[None, :]
        v = tl.load(V + n64 * stride_vn + v_off, mask=col_ok[:, None] & (offs_dv[None, :] < 2 * HEAD_DIM), other=0.0)
        visible = col_ok[None, :] & (cols[None, :] <= last[:, None])
        kt1 = tl.load(K1 + n64 * stride_kn + kt_off, mask=kt_mask, other=0.0)
        s1 = _dot(q1, kt1, None, DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST) * qk_scale
        acc1, m1, l1 = _online_softmax_step(acc1, m1, l1, tl.where(visible, s1, float("-inf")), v,
                                            DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST)
        kt2 = tl.load(K1 + stride_kh + n64 * stride_kn + kt_off, mask=kt_mask, other=0.0)
        s2 = _dot(q2, kt2, None, DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST) * qk_scale
        acc2, m2, l2 = _online_softmax_step(acc2, m2, l2, tl.where(visible, s2, float("-inf")), v,
                                            DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST)

    # partial results, float32: O_PART (2, B*H*Nq, n_splits, 2d), LSE_PART (2, B*H*Nq, n_splits)
    rows = (b64 * H + g64 * GROUP) * Nq + offs_m  # this group's rows in (B, H, Nq) order
    # int64: map 2's partials start n_rows * n_splits * 2 BLOCK_D floats in, past 2**31 for large batches
    n_rows = (tl.num_programs(0) // Hkv).to(tl.int64) * H * Nq
    part = rows * n_splits + split
    o_off = part[:, None] * BLOCK_DV + offs_dv[None, :]
    tl.store(O_PART + o_off, acc1 / tl.where(l1 == 0.0, 1.0, l1)[:, None], mask=row_ok[:, None])
    tl.store(O_PART + n_rows * n_splits * BLOCK_DV + o_off, acc2 / tl.where(l2 == 0.0, 1.0, l2)[:, None],
             mask=row_ok[:, None])
    tl.store(LSE_PART + part, _split_lse(m1, l1), mask=row_ok)
    tl.store(LSE_PART + n_rows * n_splits + part, _split_lse(m2, l2), mask=row_ok)


@triton.jit
def _merge_splits(O_PART, LSE_PART, row, n_splits, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr):
    """One map's output for one query row from its splits: ``sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max)``
    (0 where no split saw a key)."""
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < n_splits
    lse = tl.load(LSE_PART + row * n_splits + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.math.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # 0 for empty splits
    offs_dv = tl.arange(0, BLOCK_DV)
    o = tl.load(O_PART + (row * n_splits + offs_s[:, None]) * BLOCK_DV + offs_dv[None, :], mask=s_ok[:, None],
                other=0.0)
    den = tl.sum(w, 0)
    return tl.sum(w[:, None] * o, 0) / tl.where(den == 0.0, 1.0, den)


@triton.jit
def _decode_combine(O_PART, LSE_PART, LAM, OUT, n_splits,
                    stride_lb, stride_lh, stride_lm,
                    stride_ob, stride_oh, stride_om,
                    H, Nq,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """One program per query row ``(b, h, i)`` (in that order): both maps merged, ``out = o1 - lam * o2``."""
    BLOCK_DV: tl.constexpr = 2 * BLOCK_D
    row = tl.program_id(0).to(tl.int64)
    n_rows = tl.num_programs(0).to(tl.int64)  # int64: map 2's partials start past 2**31 floats in at large sizes
    b = row // (H * Nq)
    h = (row // Nq) % H
    i = row % Nq
    o1 = _merge_splits(O_PART, LSE_PART, row, n_splits, BLOCK_DV=BLOCK_DV, BLOCK_S=BLOCK_S)
    o2 = _merge_splits(O_PART + n_rows * n_splits * BLOCK_DV, LSE_PART + n_rows * n_splits, row, n_splits,
                       BLOCK_DV=BLOCK_DV, BLOCK_S=BLOCK_S)
    lam = tl.load(LAM + b * stride_lb + h * stride_lh + i * stride_lm).to(tl.float32)
    offs_dv = tl.arange(0, BLOCK_DV)
    tl.store(OUT + b * stride_ob + h * stride_oh + i * stride_om + offs_dv, (o1 - lam * o2).to(OUT.dtype.element_ty),
             mask=offs_dv < 2 * HEAD_DIM)


# ============================================================================================
# host side
# ============================================================================================


def _lengths(lengths: Union[None, int, Tensor], B: int, Nk: int, device: torch.device) -> Tensor:
    """``(B,)`` int32 valid-key counts on ``device``. Tensors are taken as they are (the kernel clamps each count to
    ``[0, Nk]``, so no value reads outside the buffer); Python numbers are checked here."""
    if lengths is None:
        lengths = Nk
    if isinstance(lengths, int) and not isinstance(lengths, bool):
        if not 0 <= lengths <= Nk:
            raise ValueError(f"lengths={lengths} must be between 0 and the cache size Nk={Nk}")
        return torch.full((B,), lengths, dtype=torch.int32, device=device)
    if not isinstance(lengths, Tensor) or lengths.dtype.is_floating_point or lengths.dtype == torch.bool \
            or lengths.shape not in ((B,), ()):
        raise ValueError(f"lengths must be None, an int, or an integer tensor of shape (B,) = ({B},) (valid keys per "
                         f"sequence), got {lengths!r}")
    if lengths.device != device:
        raise ValueError(f"lengths is on {lengths.device} but q is on {device}; move it with lengths.to(q.device)")
    return lengths.expand(B).to(torch.int32).contiguous()


def default_splits(batch_kv: int, nk: int, block_n: int, device: torch.device) -> int:
    """How many key splits: enough programs for :data:`PROGRAMS_PER_SM` per multiprocessor (at least one tile
    per split, at most :data:`MAX_SPLITS`). In the interpreter: up to 4, so a test walks several splits."""
    tiles = max(1, triton.cdiv(nk, block_n))
    if device.type != "cuda":
        return min(4, tiles)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(MAX_SPLITS, tiles, triton.cdiv(PROGRAMS_PER_SM * sms, batch_kv)))


def tile_shape(group: int, nq: int, d: int) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_D)`` of the partial kernel: query rows and head dim, padded to powers of two >= 16."""
    return max(16, triton.next_power_of_2(group * nq)), max(16, triton.next_power_of_2(d))


def _on_gpu() -> bool:
    """Launch as on a GPU: outside the interpreter, or recording launches for the ahead-of-time compile."""
    return not interpret_mode() or capturing()


def default_block_keys(device: torch.device) -> int:
    """Keys per tile: the interpreter's small tile, :data:`BLOCK_KEYS_TURING` below sm_80, else :data:`BLOCK_KEYS`."""
    if not _on_gpu():
        return INTERPRETER_BLOCK
    return BLOCK_KEYS if launch.capability(device) >= 80 else BLOCK_KEYS_TURING


def _check_decode(q: Tensor, group: int, nq: int, d: int) -> None:
    """Refuse what the kernels cannot run; where they run is not checked inside
    :func:`~diffattn_tutorial.kernels.triton.launch.capture_launches` (launches recorded, never run)."""
    recording = capturing()
    ok, why = triton_available()
    if not ok and not recording:
        raise RuntimeError(f"the Triton decode kernel cannot run here: {why}")
    if q.dtype == torch.float64:
        raise ValueError("the Triton decode kernel computes in float32 at most; for float64 use "
                         "diff_attention(..., backend='naive')")
    if d > MAX_HEAD_DIM:
        raise ValueError(f"head dim {d} is above the kernel's {MAX_HEAD_DIM}; use diff_attention(..., backend='sdpa')")
    _check_rows(group, nq, d)
    if not recording and not interpret_mode() and q.device.type != "cuda":
        raise ValueError(f"the Triton decode kernel runs on a CUDA GPU (or in the interpreter), q is on {q.device}")


def _check_rows(group: int, nq: int, d: int) -> None:
    block_m, block_d = tile_shape(group, nq, d)
    if block_m * block_d > MAX_ROWS_X_DIM:
        raise ValueError(f"(H // Hkv) * Nq = {group} * {nq} query rows per KV group at head dim {d} exceed the "
                         f"kernel's {MAX_ROWS_X_DIM // block_d} rows: it decodes a few tokens; for more queries use "
                         f"diff_attention(..., backend='triton')")


def _check_op(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, lengths: Tensor, scale: float, num_splits: int,
              block_n: int) -> dict:
    """The decode operator's checks, in the operator and its fake implementation: shapes, dtypes, devices and
    layouts of its tensors (:func:`~diffattn_tutorial.kernels.triton.flash_diff.check_op_inputs`), never the data."""
    sizes = check_op_inputs(DECODE_OP, q, k, v, lam)
    check_same(DECODE_OP, q, torch.int32, lengths=lengths)
    check_shapes(DECODE_OP, {"lengths": ("B",)}, dict(lengths=lengths), sizes)
    if lengths.stride(0) != 1 and sizes["B"] > 1:
        raise ValueError(f"{DECODE_OP}: lengths has stride {lengths.stride(0)}; pass lengths.contiguous()")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"{DECODE_OP}: scale must be a positive finite number (1/sqrt(d) by default), got {scale!r}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"{DECODE_OP}: num_splits must be a whole number >= 1, got {num_splits!r}")
    if isinstance(block_n, bool) or not isinstance(block_n, int) or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"{DECODE_OP}: block_n must be a power of two >= 16, got {block_n!r}")
    _check_rows(sizes["H"] // sizes["Hkv"], sizes["Nq"], sizes["d"])
    # tile bases are int64, the rows inside a tile int32: a query row's offset (up to Nq rows), a key row's (up to
    # block_n rows) must stay below 2**31, as the flash kernels' guard (flash_diff._check_offsets) requires
    for name, t, rows in (("q", q, sizes["Nq"]), ("k", k, block_n), ("v", v, block_n)):
        step = launch.tile_step(name, t)
        if step * rows >= 2**31:
            raise ValueError(f"{DECODE_OP}: {name} steps {step} elements between rows, too large for the kernel's "
                             f"int32 offsets inside a tile ({rows} rows); pass {name}.contiguous() or a smaller "
                             f"block_n")
    return sizes


DECODE_OP = "diffattn::triton_decode"
""":func:`decode_attention`'s kernels as a torch operator (``torch.library.custom_op`` with a fake implementation,
as :data:`~diffattn_tutorial.kernels.triton.flash_diff.FORWARD_OP`), so a compiled decode step
(``torch.compile(fullgraph=True)``) keeps the call as one node. Forward only: decoding needs no gradient."""

KERNELS = {"_decode_partial": _decode_partial, "_decode_combine": _decode_combine}
"""The decode kernels by name, as :data:`~diffattn_tutorial.kernels.triton.flash_diff.KERNELS` (a recorded
:class:`~diffattn_tutorial.kernels.triton.launch.Launch` names its kernel; the ahead-of-time compile looks
it up in both tables)."""


def _launch_options(name: str, tile: int = 0) -> dict:
    """Launch options of a decode kernel on a GPU (none in the interpreter): the partial kernel runs 8 warps from
    a ``BLOCK_M x BLOCK_D`` tile of :data:`WIDE_TILE` on, else 4; the combine 4."""
    if not _on_gpu():
        return {}
    wide = name == "_decode_partial" and tile >= WIDE_TILE
    return {"num_warps": 8 if wide else 4, "num_stages": 2}


def _launch(name: str, grid: tuple, args: dict, consts: dict, opts: dict, dtype: torch.dtype) -> None:
    """Run kernel ``name``, or record the launch inside
    :func:`~diffattn_tutorial.kernels.triton.launch.capture_launches` (what the ahead-of-time compile reads)."""
    if capturing():
        config = triton.Config({}, num_warps=opts.get("num_warps", 4), num_stages=opts.get("num_stages", 2))
        launch.record(launch.Launch(name, args, dict(consts), [config], dtype))
        return
    KERNELS[name][grid](**args, **consts, **opts)


@torch.library.custom_op(DECODE_OP, mutates_args=())
def triton_decode(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, lengths: Tensor, causal: bool, scale: float,
                  num_splits: int, block_n: int) -> Tensor:
    """The two decode kernels: ``(B, H, Nq, 2d)`` in q's dtype, for ``lengths`` ``(B,)`` int32, ``num_splits >= 1``,
    ``block_n`` a power of two >= 16. Refuses anything else, and mismatched shapes, dtypes or devices, by name
    (:func:`_check_op`), before a kernel reads memory."""
    sizes = _check_op(q, k, v, lam, lengths, scale, num_splits, block_n)
    if not capturing():
        _check_decode(q, sizes["H"] // sizes["Hkv"], sizes["Nq"], sizes["d"])
    B, H2, Nq, d = q.shape
    H, Hkv, Nk = H2 // 2, v.shape[1], k.shape[2]
    group = H // Hkv
    keys_per_split = triton.cdiv(triton.cdiv(max(Nk, 1), num_splits), block_n) * block_n
    splits = max(1, triton.cdiv(Nk, keys_per_split))  # no split that starts past the buffer
    block_m, block_d = tile_shape(group, Nq, d)
    o_part = alloc(2, B * H * Nq, splits, 2 * block_d, like=q, dtype=torch.float32)
    lse_part = alloc(2, B * H * Nq, splits, like=q, dtype=torch.float32)
    upcast = not _on_gpu() and q.dtype == torch.bfloat16
    _launch("_decode_partial", (B * Hkv, splits),
            dict(Q=q, K=k, V=v, LENS=lengths, O_PART=o_part, LSE_PART=lse_part, **launch.strides(q, "q", "bhm"),
                 **launch.strides(k, "k", "bhn"), **launch.strides(v, "v", "bhn"), H=H, Hkv=Hkv, Nq=Nq, Nk=Nk,
                 qk_scale=scale * LOG2E, keys_per_split=keys_per_split),
            dict(GROUP=group, HEAD_DIM=d, BLOCK_D=block_d, CAUSAL=bool(causal), DOT_PRECISION=dot_precision(q.dtype),
                 UPCAST=upcast, BLOCK_M=block_m, BLOCK_N=block_n),
            _launch_options("_decode_partial", block_m * block_d), q.dtype)
    out = torch.empty(B, H, Nq, 2 * d, dtype=q.dtype, device=q.device)
    lam4 = lam.reshape((1,) * (4 - lam.ndim) + tuple(lam.shape)).expand(B, H, Nq, 1)
    _launch("_decode_combine", (B * H * Nq,),
            dict(O_PART=o_part, LSE_PART=lse_part, LAM=lam4, OUT=out, n_splits=splits, **launch.strides(lam4, "l", "bhm"),
                 **launch.strides(out, "o", "bhm"), H=H, Nq=Nq),
            dict(HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(splits)),
            _launch_options("_decode_combine"), q.dtype)
    return out


@triton_decode.register_fake
def _(q, k, v, lam, lengths, causal, scale, num_splits, block_n):
    _check_op(q, k, v, lam, lengths, scale, num_splits, block_n)
    B, H2, Nq, d = q.shape
    return q.new_empty(B, H2 // 2, Nq, 2 * d)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, lam: Union[float, Tensor], *,
                     lengths: Union[None, int, Tensor] = None, causal: bool = True, scale: Optional[float] = None,
                     num_splits: Optional[int] = None, block_n: Optional[int] = None) -> Tensor:
    """Differential attention of a few query tokens over a KV cache, split over the keys (flash-decoding).

    Args:
        q: ``(B, 2H, Nq, d)``, a few query tokens (see :data:`MAX_ROWS_X_DIM`); k ``(B, 2Hkv, Nk, d)``;
            v ``(B, Hkv, Nk, 2d)`` (a static cache's whole buffers may be passed: see ``lengths``).
        lam: a number, or a tensor broadcastable to ``(B, H, Nq, 1)``.
        lengths: valid keys per sequence (an int, or a ``(B,)`` integer tensor); keys from there on are never
            read. Default: all ``Nk``.
        causal: query ``i`` sees keys ``j <= length - Nq + i`` (the last query the last valid key); otherwise
            every valid key. With one query token the two agree.
        scale: softmax scale, default ``1/sqrt(d)``.
        num_splits: key splits (default :func:`default_splits`); block_n: keys per tile (default
            :func:`default_block_keys`).

    Returns:
        ``(B, H, Nq, 2d)`` in q's dtype, equal to ``diff_attention(q, k[..., :length, :], ...)`` per sequence.
        Checks its inputs, then runs the operator :data:`DECODE_OP` (one node under ``torch.compile``). No
        gradient: inputs that require one are refused while autograd is on.
    """
    lam_t, _, (B, H, Hkv, Nq, Nk, d) = check_diff_inputs(q, k, v, lam)
    group = H // Hkv
    _check_decode(q, group, Nq, d)
    if torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in (q, k, v, lam)):
        raise ValueError("decode_attention gives no gradient (decoding is inference); call it under "
                         "torch.no_grad() or torch.inference_mode(), or pass .detach()ed tensors; to train, use "
                         "diff_attention(..., backend='triton')")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be a whole number >= 1 or None, got {num_splits!r}")
    if block_n is not None and (not isinstance(block_n, int) or block_n < 16 or block_n & (block_n - 1)):
        raise ValueError(f"block_n must be a power of two >= 16 or None, got {block_n!r}")
    lens = _lengths(lengths, B, Nk, q.device)
    scale = d ** -0.5 if scale is None else float(scale)
    block_n = block_n or default_block_keys(q.device)
    splits = num_splits or default_splits(B * Hkv, Nk, block_n, q.device)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return triton_decode(q, k, v, lam_t, lens, bool(causal), scale, splits, block_n)


def capture_step(head_dim: int, dtype: torch.dtype, group: int, capability: int) -> list:
    """The launches (:class:`~diffattn_tutorial.kernels.triton.launch.Launch`) one decode step makes on a GPU of
    compute ``capability``: one query token, ``group`` heads per KV group (2 groups), 4096 cached keys in
    :data:`MAX_SPLITS` splits (the combine's widest ``BLOCK_S``), recorded by
    :func:`~diffattn_tutorial.kernels.triton.launch.capture_launches` on CPU tensors, never run
    (:mod:`~diffattn_tutorial.kernels.triton.aot` compiles them)."""
    B, Hkv, n, d = 1, 2, 4096, head_dim
    q, k = torch.zeros(B, 2 * Hkv * group, 1, d, dtype=dtype), torch.zeros(B, 2 * Hkv, n, d, dtype=dtype)
    v, lam = torch.zeros(B, Hkv, n, 2 * d, dtype=dtype), torch.zeros(B, Hkv * group, 1, 1, dtype=dtype)
    with capture_launches(capability) as launches, torch.no_grad():
        decode_attention(q, k, v, lam, num_splits=MAX_SPLITS)
    return launches


# ============================================================================================
# the same algorithm in PyTorch
# ============================================================================================


def split_k_reference(q: Tensor, k: Tensor, v: Tensor, lam: Union[float, Tensor], *,
                      lengths: Union[None, int, Tensor] = None, causal: bool = True, scale: Optional[float] = None,
                      num_splits: int = 4) -> Tensor:
    """:func:`decode_attention` in PyTorch, step by step: per split of the keys and per map, the split's softmax
    output and log-sum-exp; then the splits merged with weights ``exp(lse_s - max)``. Same arguments and result
    (computed in q's dtype, float32 at least); for reading, and as the kernel's test oracle next to ``naive``."""
    lam_t, _, (B, H, Hkv, Nq, Nk, d) = check_diff_inputs(q, k, v, lam)
    lens = _lengths(lengths, B, Nk, q.device).long().clamp(0, Nk)
    dtype = torch.promote_types(q.dtype, torch.float32)
    scale = d ** -0.5 if scale is None else float(scale)
    group = H // Hkv
    kh = k.to(dtype).unflatten(1, (Hkv, 2)).repeat_interleave(group, dim=1)  # (B, H, 2, Nk, d): head i's group
    keys = torch.arange(Nk, device=q.device)
    valid = (keys[None, :] < lens[:, None])[:, None, :, None]  # (B, 1, Nk, 1): past the length is never read
    vh = torch.where(valid, v.to(dtype), 0.0).repeat_interleave(group, dim=1)  # (B, H, Nk, 2d)
    scores = (q.to(dtype).unflatten(1, (H, 2)) * scale) @ kh.transpose(-1, -2)  # (B, H, 2, Nq, Nk)
    last = lens[:, None] - 1 + ((torch.arange(Nq, device=q.device) - (Nq - 1)) if causal else 0)  # (B, Nq)
    visible = (keys[None, None, :] < lens[:, None, None]) & (keys[None, None, :] <= last[:, :, None])
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    chunk = -(-max(Nk, 1) // num_splits)
    parts, lses = [], []
    for lo in range(0, max(Nk, 1), chunk):  # each split on its own: its softmax and its log-sum-exp
        s = scores[..., lo:lo + chunk]
        lse = torch.logsumexp(s, dim=-1, keepdim=True)  # -inf where the split sees no key
        p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse))
        parts.append(p @ vh[:, :, None, lo:lo + chunk])  # (B, H, 2, Nq, 2d)
        lses.append(lse)
    lse = torch.stack(lses)  # (S, B, H, 2, Nq, 1)
    top = lse.amax(0)
    w = torch.exp(lse - torch.where(torch.isinf(top), 0.0, top))
    o = (w * torch.stack(parts)).sum(0) / w.sum(0).clamp_min(torch.finfo(dtype).tiny)  # (B, H, 2, Nq, 2d)
    return (o[:, :, 0] - lam_t.to(dtype) * o[:, :, 1]).to(q.dtype)


__all__ = ["MAX_ROWS_X_DIM", "WIDE_TILE", "BLOCK_KEYS", "BLOCK_KEYS_TURING", "DECODE_OP", "KERNELS", "capture_step", "decode_attention",
           "default_block_keys", "default_splits", "split_k_reference", "tile_shape", "triton_decode"]
