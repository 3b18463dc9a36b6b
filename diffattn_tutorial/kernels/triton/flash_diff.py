"""The host side of the fused differential flash-attention kernel (``backend="triton"``): checks, launches, autograd.

Computes ``softmax(q1 k1^T s) v - lam softmax(q2 k2^T s) v`` without forming an ``Nq x Nk`` map, in the layout of
:func:`~diffattn_tutorial.functional.diff_attention`: q ``(B, 2H, Nq, d)`` with the maps of head ``i`` at ``2i`` and
``2i+1``, k ``(B, 2Hkv, Nk, d)``, v ``(B, Hkv, Nk, 2d)``; head ``i`` reads KV group ``i // (H // Hkv)``. The kernels
(:mod:`~diffattn_tutorial.kernels.triton.flash_kernels`) run one online softmax per map in the forward and recompute
the probabilities from the saved log-sum-exps in the backward. A plan (``configs.plan_for``, by head dim and GPU)
says which maps each launch computes, with the flags of
:mod:`~diffattn_tutorial.kernels.triton.flags`: both maps per program while two float32 accumulators of width
``2d`` fit in registers, one map per launch beyond (the map-2 launch stores ``o2``, the map-1 launch combines).

Contract of :func:`triton_diff_attention`: float32, float16 or bfloat16; head dims 1 to 128; lam scalar, per head or
per token; ``causal`` bottom-right aligned; a bool or additive mask (entries ``<= finfo(dtype).min`` count as
masked); GQA; any lengths and strides (a strided last dim is copied once). Gradients for q, k, v and lam, none for
the mask; fully masked rows give zeros. A NaN or an infinity in q, k or v makes exactly the output rows that read it
NaN (a hidden key never counts), and a call whose q, k or v holds one gives NaN gradients, every one (even where
the value sits only in a hidden key or a fully masked row, which the CPU backends give finite gradients): the
forward kernel scans its scores and accumulators and sets a flag, and a careful launch that does nothing unless
the flag is set recomputes, all on the device (no pass of the host's, no synchronisation). It runs the operators :data:`FORWARD_OP` and :data:`BACKWARD_OP` (one node
under ``torch.compile``), which refuse mismatched shapes, dtypes, devices and layouts themselves
(:func:`check_op_inputs`). On a CUDA GPU the tile sizes are autotuned over the tables of
:mod:`~diffattn_tutorial.kernels.triton.configs` (on Hopper also whether the forward's k and v, the backward's q
and dO, arrive by tensor descriptor, ``configs.TMA_TWINS``, where :func:`tma_ok` holds); on a CPU the kernels run in Triton's interpreter when
``TRITON_INTERPRET=1`` is set before triton is first imported (exact but slow: for learning and tests).
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from diffattn_tutorial.constants import LOG2E
from diffattn_tutorial.kernels.triton import atomic_kernels, dq_kernels, flash_kernels, launch
from diffattn_tutorial.kernels.triton.configs import (
    MAX_HEAD_DIM,
    PLANS,
    TMA_KERNELS,
    autotune_configs,
    autotune_enabled,
    form,
    plan_for,
)
from diffattn_tutorial.kernels.triton.flags import MAPS_BOTH, MAPS_NONE, MASK_ADD, MASK_BOOL, MASK_NONE
from diffattn_tutorial.kernels.triton.launch import (  # noqa: F401 (POISON_ENV, MAX_TILE_ROWS: named here too)
    MAX_TILE_ROWS,
    POISON_ENV,
    Launch,
    capture_launches,
    tma_ok,
)
from diffattn_tutorial.kernels.triton.launch import alloc as _alloc
from diffattn_tutorial.kernels.triton.launch import strides as _strides
from diffattn_tutorial.kernels.triton.refusals import check_plan, check_runs_here

Tensor = torch.Tensor

INTERPRETER_BLOCK = 16
"""Tile size under the interpreter: small, so the CPU tests cover several tiles and ragged edges."""


_interpret_mode = launch.interpret_mode


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


KERNELS = {"_diff_attn_fwd": flash_kernels._diff_attn_fwd, "_diff_attn_bwd_preprocess": flash_kernels._diff_attn_bwd_preprocess,
           "_diff_attn_bwd_dkdv": flash_kernels._diff_attn_bwd_dkdv, "_diff_attn_bwd_dkdq": atomic_kernels._diff_attn_bwd_dkdq,
           "_diff_attn_bwd_dq": dq_kernels._diff_attn_bwd_dq}
"""Every kernel the host code launches, by name (a launch names its kernel; :class:`Launch` records the name)."""

_tuned: dict[tuple, object] = {}
_AUTOTUNE_KEYS = ("N_BUCKET", "GROUP", "HEAD_DIM", "CAUSAL", "MASK_KIND", "MASK_MIN")


ACCUMULATED = {"_diff_attn_bwd_dkdq": ["DQACC"]}
"""The arguments a kernel adds into (atomics) rather than writes: the autotuner, which runs each configuration
several times on the real arguments to time it, restores them after each run, so only the final launch adds."""


def _tuned_kernel(name: str, consts: dict, configs: list, offered: str = ""):
    """The autotuner over ``configs`` for kernel ``name`` (one per variant, head dim, configuration list and
    ``offered``, the TMA entries the caller's choice left: :func:`chosen_configs` reports each apart)."""
    key = (name, form(name, consts), consts.get("BLOCK_D"), offered, tuple(
        (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs.get("TMA"), c.num_warps, c.num_stages) for c in configs))
    if key not in _tuned:
        _tuned[key] = triton.autotune(configs, key=list(_AUTOTUNE_KEYS), restore_value=ACCUMULATED.get(name))(
            KERNELS[name])
    return _tuned[key]


def _table_configs(*args, **kwargs) -> list:
    """``autotune_configs`` as :func:`_launch` looks it up here, for the checks before any launch (a benchmark may
    pin it: ``benchmarks/probe_triton.py``'s ``forward_config``)."""
    return autotune_configs(*args, **kwargs)


def _launch(name: str, n_programs, args: dict, consts: dict, blocks: Optional[tuple[int, int]], interpret: bool,
            dtype: torch.dtype, capability: int, tma: Optional[bool] = False) -> None:
    """Launch kernel ``name`` on a 1-D grid of ``n_programs(meta)`` programs: the interpreter's fixed
    blocks, ``blocks`` when given, the pinned first configuration (``DIFFATTN_TRITON_AUTOTUNE=0``), or
    the autotuner over :func:`autotune_configs`. The forward's careful launch (``CAREFUL``) always takes the
    pinned configuration: it runs only where the scan found a non-finite value, so there is nothing to tune.
    ``tma`` (from ``launch.tma_choice``; for the kernels of ``configs.TMA_KERNELS``): which of the table's entries it
    may take, pointer loads (``False``), tensor descriptors (``True``) or either (``None``, the autotuner's)."""
    tma = tma if name in TMA_KERNELS else False
    configs = autotune_configs(name, consts, dtype, capability, tma=tma)
    if not configs and (launch.capturing() or not interpret) and blocks is None:
        if tma and name == "_diff_attn_fwd":  # tma=True, and no twin here
            raise ValueError(f"tma=True: no TMA configuration in the tables for this call ({dtype}, padded head dim "
                             f"{consts['BLOCK_D']}, compute capability {capability / 10:.1f}; configs.TMA_TWINS: "
                             f"sm_90a, 16-bit, head dims 64 and 128); pass tma=None, or blocks=(BLOCK_M, BLOCK_N)")
        tma, configs = False, autotune_configs(name, consts, dtype, capability, tma=False)  # a backward launch
        if not configs and not launch.capturing_untabled():  # a plan by name where no table lists this launch
            raise ValueError(f"{name} ({form(name, consts)}) has no table entry for {dtype} at padded head dim "
                             f"{consts['BLOCK_D']} on compute capability {capability / 10:.1f}, so the plan chosen "
                             f"by name does not run here (only configurations the compile facts check run on a GPU); "
                             f"use plan='auto', or blocks=(BLOCK_M, BLOCK_N) to choose the tile yourself")
    both = autotune_configs(name, consts, dtype, capability, tma=None)
    offered = "" if tma is None or all(bool(c.kwargs.get("TMA")) == tma for c in both) else (
        "/tma" if tma else "/pointers")
    if consts.get("CAREFUL"):
        configs = configs[:1]
    if launch.capturing():
        launch.record(Launch(name, args, dict(consts), configs, dtype))
        return
    kernel = KERNELS[name]
    if name == "_diff_attn_bwd_preprocess":
        kernel[(n_programs(consts),)](**args, **consts)
        return
    if interpret or blocks is not None:
        bm, bn = blocks or (INTERPRETER_BLOCK, INTERPRETER_BLOCK)
        meta = {"BLOCK_M": bm, "BLOCK_N": bn, **({"TMA": bool(tma)} if name in TMA_KERNELS else {})}
        same = [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) == (bm, bn)]
        opts = {} if interpret else {"num_warps": same[0].num_warps if same else 4,
                                     "num_stages": same[0].num_stages if same else 2}
        fn, grid, kw = kernel, (n_programs(meta),), {**meta, **opts}
    elif not autotune_enabled() or consts.get("CAREFUL"):
        c = configs[0]
        fn, grid, kw = kernel, (n_programs(c.kwargs),), {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
    else:
        fn, grid, kw = _tuned_kernel(name, consts, configs, offered), lambda meta: (n_programs(meta),), {}
    # the interpreter builds its descriptors without a workspace
    launch.call(fn[grid], workspace=tma is not False and not interpret, **args, **consts, **kw)


def chosen_configs() -> dict[str, dict]:
    """What the autotuner picked so far, per kernel variant and key: ``{"_diff_attn_fwd/fused/d64": {key:
    config}}`` (``{"any": config}`` for a list of one); ``.../d64/tma`` and ``.../d64/pointers`` where the caller's
    ``tma`` left only the TMA twins or only the pointer entries of a list that has both (``configs.TMA_TWINS``)."""
    picked: dict[str, dict] = {}
    for (name, variant, block_d, offered, _), tuner in _tuned.items():
        cache = getattr(tuner, "cache", {}) or (  # Triton's autotuner keeps no cache over one configuration
            {"any": tuner.configs[0]} if len(tuner.configs) == 1 else {})
        picked.setdefault(f"{name}/{variant}/d{block_d}{offered}", {}).update(
            {str(k): str(c) for k, c in cache.items()})
    return picked


# ============================================================================================
# host side: the operators (forward, backward, autograd) and the public entry point
# ============================================================================================


_dot_precision = launch.dot_precision


def _mask_args(mask: Optional[Tensor], shape4: tuple[int, int, int, int], q: Tensor):
    """``(tensor, strides, kind, min)`` for the kernels (a dummy pointer when there is no mask), the strides as
    :func:`_strides` names them. Additive masks are read in their own dtype; their entries ``<= finfo(dtype).min``
    count as masked."""
    if mask is None:
        return q, dict(stride_mb=0, stride_mh=0, stride_mm=0, stride_mn=0), MASK_NONE, 0.0
    m = mask.expand(shape4)
    if m.dtype == torch.bool:
        return m.view(torch.uint8), _strides(m, "m", "bhmn"), MASK_BOOL, 0.0  # same bytes; the kernels test != 0
    return m, _strides(m, "m", "bhmn"), MASK_ADD, float(torch.finfo(m.dtype).min)


def _unit_last_stride(t: Tensor) -> Tensor:
    """The kernels read the last dim with unit stride (16-byte vector loads). A tensor whose last dim is
    strided, such as ``qkv.unflatten(-1, (heads, d, 3))[..., 0]`` of a fused projection, is copied once (one
    read and one write of it; every other layout is read in place)."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _check_offsets(**tensors: Tensor) -> None:
    """Tile bases are int64, offsets inside a tile int32: the strides that step inside a tile (the rows' of q, k,
    v and dout; the last two of a mask) times ``MAX_TILE_ROWS`` must stay below 2**31. The batch and head strides
    may be anything (a contiguous ``(2, 32, 8192, 64)`` q has a batch stride of 2**24)."""
    for name, t in tensors.items():
        if t is not None and not launch.tile_offsets_fit(name, t):
            step = launch.tile_step(name, t)
            raise ValueError(f"backend='triton': {name} steps {step} elements between rows, too large for "
                             f"the kernels' int32 offsets inside a tile (limit {2**31 // MAX_TILE_ROWS}); pass "
                             f"{name}.contiguous() or use backend='sdpa'")


def _dout_for_kernels(dout: Tensor) -> Tensor:
    """The upstream gradient as the kernels read it: unit last stride, and rows close enough for int32 offsets
    inside a tile. Autograd chose its layout, so the caller cannot pass another: a layout the kernels cannot read
    (a seq-first ``(N, B, H, 2d)`` gradient permuted back steps ``B H 2d`` elements between rows) is copied once
    instead of refused."""
    dout = _unit_last_stride(dout)
    return dout if launch.tile_offsets_fit("dout", dout) else dout.contiguous()


def tile_schedule(nq: int, nk: int, block_m: int, block_n: int, causal: bool) -> Tensor:
    """Which (query tile, key tile) pairs the forward kernel visits, as an int8 ``(cdiv(nq, block_m),
    cdiv(nk, block_n))`` tensor: 0 skipped, 1 visited with masking (the tile crosses ``nk`` or the causal
    diagonal), 2 visited without masking: the bounds of the two loops of :func:`_diff_attn_fwd`, computed by
    the same function, :func:`~diffattn_tutorial.kernels.triton.flash_kernels._key_tile_bounds`."""
    n_m, n_n = triton.cdiv(nq, block_m), triton.cdiv(nk, block_n)
    schedule = torch.zeros(n_m, n_n, dtype=torch.int8)
    for t in range(n_m):
        full_hi, hi = flash_kernels._key_tile_bounds.fn(t * block_m, nq, nk, block_m, block_n, bool(causal))  # the kernels' own
        for start_n in range(0, hi, block_n):
            schedule[t, start_n // block_n] = 2 if start_n < full_hi else 1
    return schedule


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


# ============================================================================================
# the operators' own checks: shapes, dtypes, devices and layouts, never the data
# ============================================================================================

QKV_LAYOUTS = {"q": ("B", "2H", "Nq", "d"), "k": ("B", "2Hkv", "Nk", "d"), "v": ("B", "Hkv", "Nk", "2d")}
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_shapes(op: str, layouts: dict[str, tuple], tensors: dict[str, Tensor], sizes: Optional[dict] = None
                 ) -> dict[str, int]:
    """Bind the symbols of each layout in turn (``"B"``, ``"2H"`` = twice ``H``, a number = that size) to the
    sizes of the tensor it describes; refuse, naming ``op``, the tensor, its shape and the shape expected, the first
    tensor whose dims disagree with what the earlier ones fixed. Returns the sizes (``{"B": 1, "H": 2, ...}``)."""
    sizes, fixed_by = dict(sizes or {}), {}
    for name, layout in layouts.items():
        t = tensors[name]
        if t.ndim != len(layout):
            raise ValueError(f"{op}: {name} must be {len(layout)}-D ({', '.join(layout)}), got shape {tuple(t.shape)}")
        for sym, n in zip(layout, t.shape):
            factor, base = (2, sym[1:]) if sym.startswith("2") and len(sym) > 1 else (1, sym)
            if base.isdigit() or base in sizes:
                want = int(base) if base.isdigit() else factor * sizes[base]
                if n != want:
                    expected = ", ".join(_expected(s, sizes) for s in layout)
                    source = f" (from {fixed_by.get(base, 'q, k, v')})" if not base.isdigit() else ""
                    raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}, but ({', '.join(layout)}) = "
                                     f"({expected}) is expected: its {sym} is {n}, not {want}{source}; pass {name} "
                                     f"of shape ({expected})")
            elif n % factor:
                raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}: its {sym} = {n} must be even (two maps "
                                 f"per head, layout ({', '.join(layout)})); pass {name} with {sym} even")
            else:
                sizes[base], fixed_by[base] = n // factor, name
    return sizes


def _expected(sym: str, sizes: dict) -> str:
    factor, base = (2, sym[1:]) if sym.startswith("2") and len(sym) > 1 else (1, sym)
    return base if base.isdigit() else (str(factor * sizes[base]) if base in sizes else sym)


def _broadcasts(shape: tuple, target: tuple) -> bool:
    """``shape`` broadcasts to ``target`` (aligned on the right, each dim 1 or equal), with no more dims."""
    return len(shape) <= len(target) and all(n in (1, want) for n, want in zip(reversed(shape), reversed(target)))


def check_same(op: str, q: Tensor, dtype: Optional[torch.dtype] = None, **tensors: Tensor) -> None:
    """Each tensor on ``q``'s device and of ``dtype`` (default q's): else an error naming it and the fix."""
    for name, t in tensors.items():
        if dtype is None and t.dtype != q.dtype:
            raise TypeError(f"{op}: {name} is {t.dtype} and q {q.dtype}: they must share one dtype; pass "
                            f"{name}.to(q.dtype)")
        if dtype is not None and t.dtype != dtype:
            raise TypeError(f"{op}: {name} is {t.dtype}, it must be {dtype}; pass {name}.to({dtype})")
        if t.device != q.device:
            raise ValueError(f"{op}: {name} is on {t.device} but q on {q.device}; pass {name}.to(q.device)")


def check_op_inputs(op: str, q: Tensor, k: Tensor, v: Tensor, lam: Tensor) -> dict[str, int]:
    """What every operator checks of q, k, v and lam before any kernel reads them (shapes, dtypes, devices, unit
    last stride); returns the sizes ``B, H, Hkv, Nq, Nk, d``."""
    for name, t in dict(q=q, k=k, v=v, lam=lam).items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if q.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{op}: q is {q.dtype}; the kernels run float32, float16 and bfloat16: cast q, k, v and lam "
                        f"with .float(), or use diff_attention(..., backend='naive') for {q.dtype}")
    check_same(op, q, k=k, v=v, lam=lam)
    sizes = check_shapes(op, QKV_LAYOUTS, dict(q=q, k=k, v=v))
    if not 1 <= sizes["d"] <= MAX_HEAD_DIM:
        raise ValueError(f"{op}: head dim d = {sizes['d']} (q {tuple(q.shape)}); the kernels run d from 1 to "
                         f"{MAX_HEAD_DIM}; use diff_attention(..., backend='sdpa') or 'naive'")
    if sizes["Hkv"] == 0 or sizes["H"] % sizes["Hkv"]:
        raise ValueError(f"{op}: k has Hkv = {sizes['Hkv']} KV groups for q's H = {sizes['H']} differential heads; "
                         f"H must be a positive multiple of Hkv (k (B, 2Hkv, Nk, d), v (B, Hkv, Nk, 2d))")
    if not _broadcasts(tuple(lam.shape), (sizes["B"], sizes["H"], sizes["Nq"], 1)):
        raise ValueError(f"{op}: lam of shape {tuple(lam.shape)} does not broadcast to (B, H, Nq, 1) = "
                         f"({sizes['B']}, {sizes['H']}, {sizes['Nq']}, 1) (from q); pass a 0-dim tensor, one per "
                         f"head (H, 1, 1) or one per token (B, H, Nq, 1)")
    for name, t in dict(q=q, k=k, v=v).items():
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{op}: {name}'s last dim has stride {t.stride(-1)}; the kernels read it with unit "
                             f"stride: pass {name}.contiguous()")
    return sizes


def _check_mask_arg(op: str, attn_mask: Optional[Tensor], q: Tensor, sizes: dict) -> None:
    if attn_mask is None:
        return
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise TypeError(f"{op}: attn_mask is {attn_mask.dtype}; pass a bool mask (True = may attend) or an "
                        f"additive float one (attn_mask.bool() for 0/1)")
    if attn_mask.device != q.device:
        raise ValueError(f"{op}: attn_mask is on {attn_mask.device} but q on {q.device}; pass attn_mask.to(q.device)")
    target = (sizes["B"], sizes["H"], sizes["Nq"], sizes["Nk"])
    if not _broadcasts(tuple(attn_mask.shape), target):
        raise ValueError(f"{op}: attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (B, H, Nq, Nk) = "
                         f"{target} (from q and k); pass one of shape (Nq, Nk), (B, 1, Nq, Nk) or (B, H, Nq, Nk)")


def _check_launch_args(op: str, scale: float, blocks: list[int], plan: str) -> None:
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"{op}: scale must be a positive finite number (1/sqrt(d) by default), got {scale!r}")
    if blocks and (len(blocks) != 2 or min(blocks) < 16 or max(blocks) > MAX_TILE_ROWS
                   or any(b & (b - 1) for b in blocks)):
        raise ValueError(f"{op}: blocks must be [] or two powers of two from 16 to {MAX_TILE_ROWS} [BLOCK_M, "
                         f"BLOCK_N] (int32 offsets inside a tile are checked for {MAX_TILE_ROWS} rows), got {blocks}")
    if plan not in PLANS:
        raise ValueError(f"{op}: plan must be one of {tuple(PLANS)}, got {plan!r}")


def _check_forward(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, attn_mask: Optional[Tensor], scale: float,
                   blocks: list[int], plan: str) -> dict[str, int]:
    """The forward operator's checks (in the operator and its fake implementation)."""
    sizes = check_op_inputs(FORWARD_OP, q, k, v, lam)
    _check_mask_arg(FORWARD_OP, attn_mask, q, sizes)
    _check_launch_args(FORWARD_OP, scale, blocks, plan)
    _check_offsets(q=q, k=k, v=v, attn_mask=attn_mask)  # the operator is public: it refuses what would overflow
    return sizes


def _check_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lam: Tensor, attn_mask: Optional[Tensor],
                    out: Tensor, o2: Tensor, lse: Tensor, flag: Tensor, scale: float, blocks: list[int], plan: str,
                    needs: list[bool]) -> dict[str, int]:
    """The backward operator's checks (its fake's too): the forward's, and ``dout``, ``out``, ``o2``, ``lse``,
    ``flag`` as the forward (with ``store_o2``) made them."""
    op = BACKWARD_OP
    sizes = check_op_inputs(op, q, k, v, lam)
    _check_mask_arg(op, attn_mask, q, sizes)
    _check_launch_args(op, scale, blocks, plan)
    _check_offsets(q=q, k=k, v=v, attn_mask=attn_mask)
    check_same(op, q, dout=dout, out=out)
    check_same(op, q, torch.float32, o2=o2, lse=lse)
    check_same(op, q, torch.int32, flag=flag)
    outs = {"dout": ("B", "H", "Nq", "2d"), "out": ("B", "H", "Nq", "2d"), "o2": ("B", "H", "Nq", "2d"),
            "lse": ("B", "H", "2", "Nq"), "flag": ("1",)}
    check_shapes(op, outs, dict(dout=dout, out=out, o2=o2, lse=lse, flag=flag), sizes)
    if o2.stride() != out.stride() or (out.shape[-1] > 1 and out.stride(-1) != 1) or not lse.is_contiguous():
        raise ValueError(f"{op}: out, o2 and lse must be the forward operator's outputs (out and o2 with one dense "
                         f"layout, lse contiguous); got strides out {out.stride()}, o2 {o2.stride()}, lse "
                         f"{lse.stride()}: run {FORWARD_OP} with store_o2=True and pass what it returns")
    _check_offsets(out=out)  # o2 shares its strides; the preprocess steps their rows inside a tile in int32
    if len(needs) != 3:
        raise ValueError(f"{op}: needs must be three flags [dq, dk, dv], got {needs}")
    return sizes


def _check_mode(device: torch.device) -> bool:
    """Return True if the kernels run in the interpreter; raise where they cannot run on ``device``."""
    interpret = _interpret_mode()
    if type(flash_kernels._diff_attn_fwd).__name__ != type(tl.sum).__name__:
        raise RuntimeError("diffattn_tutorial.kernels.triton.flash_diff was imported under a different TRITON_INTERPRET "
                           "setting than triton itself; set TRITON_INTERPRET once, before importing either")
    if device.type != "cuda" and not interpret:
        why = _LATE_INTERPRET if _interpret_requested() else (
            f"backend='triton' needs CUDA tensors, or Triton's interpreter for {device.type} tensors (set "
            f"os.environ['TRITON_INTERPRET'] = '1' before importing triton)")
        raise RuntimeError(f"{why}; or use backend='naive', 'chunked' or 'sdpa'")
    return interpret


FORWARD_OP = "diffattn::triton_forward"
BACKWARD_OP = "diffattn::triton_backward"
"""The kernels as torch operators (``torch.library.custom_op``, each with a fake implementation for shapes and
``register_autograd`` joining them), so ``torch.compile`` (``fullgraph=True`` included) keeps a call as one node and
``torch.export`` records it with its schema. Not ``torch.library.triton_op``: its ``wrap_triton`` accepts compiled
``@triton.jit`` functions only, so under ``TRITON_INTERPRET=1`` (an ``InterpretedFunction``) the kernel would be
called on fake tensors while tracing ("Cannot access data pointer of Tensor"), and the launcher (autotune tables per
capability, :func:`capture_launches`) is host code a trace should not enter. Arguments that are not schema types
travel as such: the plan by its name in :data:`PLANS`, ``blocks`` as ``[]`` or ``[BLOCK_M, BLOCK_N]``."""


def _setup(q: Tensor, v: Tensor, mask: Optional[Tensor], causal: bool):
    """What the forward and the backward launches share: the mask's arguments, the kernels' constants and the
    length bucket of the autotune key."""
    B, H2, Nq, d = q.shape
    H, Hkv, Nk = H2 // 2, v.shape[1], v.shape[2]
    m, m_strides, mask_kind, mask_min = _mask_args(mask, (B, H, Nq, Nk), q)
    consts = dict(GROUP=H // Hkv, HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), CAUSAL=bool(causal),
                  MASK_KIND=mask_kind, MASK_MIN=mask_min, DOT_PRECISION=_dot_precision(q.dtype),
                  UPCAST=_interpret_mode() and q.dtype == torch.bfloat16)
    return m, m_strides, consts, triton.next_power_of_2(max(Nq, Nk, 1))


def _blocks(blocks: list[int]) -> Optional[tuple[int, int]]:
    return (blocks[0], blocks[1]) if blocks else None


@torch.library.custom_op(FORWARD_OP, mutates_args=())
def triton_forward(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, attn_mask: Optional[Tensor], causal: bool,
                   scale: float, blocks: list[int], plan: str, store_o2: bool, tma: Optional[bool] = None
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The forward kernels on inputs :func:`triton_diff_attention` has checked: ``(out, o2, lse, flag)``, ``out``
    ``(B, H, Nq, 2d)`` in q's dtype, ``o2`` the map-2 output in float32 (``(B, H, Nq, 2d)`` when ``store_o2``, for
    the backward, else empty), ``lse`` the two maps' base-2 log-sum-exps ``(B, H, 2, Nq)`` float32 and ``flag``
    ``(1,)`` int32, 1 where the kernels' scan met a NaN or an infinity (then the careful launches have made exactly
    the rows that read one NaN, and the backward makes every gradient NaN). Refuses inputs the kernels cannot read
    safely (:func:`check_op_inputs`: shapes, dtypes, devices, layouts) and what
    :func:`refusals.check_runs_here` refuses on this target. ``tma``: ``launch.tma_choice``."""
    _check_forward(q, k, v, lam, attn_mask, scale, blocks, plan)
    if not launch.capturing():
        _check_mode(q.device)
    B, H2, Nq, d = q.shape
    H, Nk = H2 // 2, k.shape[2]
    the_plan, interpret, cap = PLANS[plan], _interpret_mode(), launch.capability(q.device)
    check_runs_here(q, plan, causal=causal, masked=attn_mask is not None, training=store_o2, capability=cap,
                    tiled=bool(blocks), configs_for=_table_configs)
    tma = launch.tma_choice(tma, cap, interpret and not launch.capturing(), k=k, v=v)  # a recording is as on a GPU
    lam4 = _lam4(lam, B, H, Nq)
    m, m_strides, consts, n_bucket = _setup(q, v, attn_mask, causal)
    out = _alloc(B, H, Nq, 2 * d, like=q)
    # o2 in float32: it travels between the split plan's launches, and the backward's dlam = -dO . o2
    # keeps its precision (a 16-bit o2 would round it)
    split_maps = the_plan.fwd_maps != (MAPS_BOTH,)  # the map-1 launch reads o2 back from the map-2 launch
    o2 = _alloc(B, H, Nq, 2 * d, like=q, dtype=torch.float32) if store_o2 or split_maps else out
    lse = _alloc(B, H, 2, Nq, like=q, dtype=torch.float32)
    flag = torch.zeros(1, device=q.device, dtype=torch.int32)  # the scan's: set by a program that met a NaN or inf
    if out.numel():
        args = dict(Q=q, K=k, V=v, LAM=lam4, MASK=m, OUT=out, O2=o2, LSE=lse, FLAG=flag, **_strides(q, "q", "bhm"),
                    **_strides(k, "k", "bhn"), **_strides(v, "v", "bhn"), **_strides(out, "o", "bhm"),
                    **_strides(lam4, "l", "bhm"), **m_strides, H=H, Nq=Nq, Nk=Nk, qk_scale=scale * LOG2E,
                    N_BUCKET=n_bucket)
        for careful in (False, True):  # the careful launches do nothing unless a plain one set the flag
            for maps in the_plan.fwd_maps:
                _launch("_diff_attn_fwd", lambda meta: triton.cdiv(Nq, meta["BLOCK_M"]) * B * H, args,
                        dict(consts, MAPS=maps, STORE_O2=store_o2, CAREFUL=careful), _blocks(blocks), interpret,
                        q.dtype, cap, tma)
    return out, (o2 if store_o2 else lse.new_empty(0)), lse, flag  # never out itself: outputs do not alias


@triton_forward.register_fake
def _(q, k, v, lam, attn_mask, causal, scale, blocks, plan, store_o2, tma=None):
    _check_forward(q, k, v, lam, attn_mask, scale, blocks, plan)
    B, H2, Nq, d = q.shape
    o2 = q.new_empty(B, H2 // 2, Nq, 2 * d, dtype=torch.float32) if store_o2 else q.new_empty(0, dtype=torch.float32)
    return (q.new_empty(B, H2 // 2, Nq, 2 * d), o2, q.new_empty(B, H2 // 2, 2, Nq, dtype=torch.float32),
            q.new_empty(1, dtype=torch.int32))


def _wanted(needs: list[bool]) -> tuple[bool, bool, bool]:
    """Which of dq, dk, dv the backward allocates: dk and dv together (a dK/dV launch may write both)."""
    return needs[0], needs[1] or needs[2], needs[1] or needs[2]


@torch.library.custom_op(BACKWARD_OP, mutates_args=())
def triton_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lam: Tensor, attn_mask: Optional[Tensor],
                    out: Tensor, o2: Tensor, lse: Tensor, flag: Tensor, causal: bool, scale: float, blocks: list[int], plan: str,
                    needs: list[bool], tma: Optional[bool] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The backward kernels: ``(dq, dk, dv, delta)``, each of dq, dk, dv a dense buffer of its input's shape where
    ``needs`` (three flags: dq, dk, dv) asks for it (dk and dv come together, :func:`_wanted`), else empty;
    ``delta`` ``(B, H, 2, Nq)`` float32 (per row ``dO . o1`` and ``dO . o2``, from which ``dlam`` follows).
    Refuses what the forward operator refuses, and ``dout``, ``out``, ``o2``, ``lse``, ``flag`` not shaped as it
    made them. Where ``flag`` is set (the forward met a NaN or an infinity) every gradient is NaN. ``tma``: the dK
    launches' q and dO loads and the dQ launches' k and v, as the forward's k and v (``launch.tma_choice``)."""
    _check_backward(dout, q, k, v, lam, attn_mask, out, o2, lse, flag, scale, blocks, plan, needs)
    if not launch.capturing():
        _check_mode(q.device)
    the_plan, interpret, cap = PLANS[plan], _interpret_mode(), launch.capability(q.device)
    check_runs_here(q, plan, causal=causal, masked=attn_mask is not None, training=True, capability=cap,
                    tiled=bool(blocks), configs_for=_table_configs)
    B, H2, Nq, d = q.shape
    H, Hkv, Nk = H2 // 2, v.shape[1], k.shape[2]
    lam4 = _lam4(lam, B, H, Nq)
    dout = _dout_for_kernels(dout)
    # the dQ launches read k and v as the forward did (checked there when forced)
    tma_dq = launch.tma_choice(tma, cap, interpret and not launch.capturing(), k=k, v=v)
    if tma and not tma_ok(q, dout):  # forced for the forward; dO's layout is autograd's: pointer loads here then
        tma = False
    tma = launch.tma_choice(tma, cap, interpret and not launch.capturing(), q=q, dout=dout)
    m, m_strides, consts, n_bucket = _setup(q, v, attn_mask, causal)
    runs = bool(out.numel() and Nk)  # else there is nothing to attend to: every gradient is 0
    dq, dk, dv = (_grad_buffer(t, runs) if need else t.new_empty(0) for t, need in zip((q, k, v), _wanted(needs)))
    delta = _alloc(B, H, 2, Nq, like=q, dtype=torch.float32) if runs else q.new_zeros(B, H, 2, Nq,
                                                                                     dtype=torch.float32)
    if not runs:
        return dq, dk, dv, delta
    pre_bm = INTERPRETER_BLOCK if interpret else 4096 // (2 * consts["BLOCK_D"])  # 3 tiles of 2d
    _launch("_diff_attn_bwd_preprocess", lambda meta: triton.cdiv(Nq, pre_bm) * B * H,
            dict(OUT=out, O2=o2, DO=dout, LAM=lam4, DELTA=delta, FLAG=flag, **_strides(out, "o", "bhm"),
                 **_strides(dout, "g", "bhm"), **_strides(lam4, "l", "bhm"), H=H, Nq=Nq),
            dict(HEAD_DIM=d, BLOCK_D=consts["BLOCK_D"], BLOCK_M=pre_bm), None, interpret, q.dtype, cap)
    common = dict(Q=q, K=k, V=v, LAM=lam4, MASK=m, DO=dout, LSE=lse, DELTA=delta, **_strides(q, "q", "bhm"),
                  **_strides(k, "k", "bhn"), **_strides(v, "v", "bhn"), **_strides(dout, "g", "bhm"),
                  **_strides(lam4, "l", "bhm"), **m_strides, H=H, Nq=Nq, Nk=Nk, qk_scale=scale * LOG2E,
                  sm_scale=scale, N_BUCKET=n_bucket)
    for dv_out, dk_maps in the_plan.kv_parts if needs[1] or needs[2] else ():
        if not (dv_out and needs[2]) and not (dk_maps != MAPS_NONE and needs[1]):
            continue
        _launch("_diff_attn_bwd_dkdv", lambda meta: triton.cdiv(Nk, meta["BLOCK_N"]) * B * Hkv,
                dict(common, DK=dk, DV=dv, FLAG=flag, **_strides(dk, "dk", "bhn"), **_strides(dv, "dv", "bhn"),
                     Hkv=Hkv),
                dict(consts, DV_OUT=dv_out, DK_MAPS=dk_maps), _blocks(blocks), interpret, q.dtype, cap, tma)
    for dq_maps in the_plan.dq_maps if needs[0] else ():
        _launch("_diff_attn_bwd_dq", lambda meta: triton.cdiv(Nq, meta["BLOCK_M"]) * B * H,
                dict(common, DQ=dq, **_strides(dq, "dq", "bhm")), dict(consts, DQ_MAPS=dq_maps), _blocks(blocks),
                interpret, q.dtype, cap, tma_dq)
    if the_plan.kq_maps and (needs[0] or needs[1] or (the_plan.kq_dv and needs[2])):
        _dk_and_atomic_dq(the_plan, common, consts, q, k, v, dq, dk, dv, flag, needs, blocks, interpret, cap, tma)
    return dq, dk, dv, delta


def _dk_and_atomic_dq(the_plan, common: dict, consts: dict, q: Tensor, k: Tensor, v: Tensor, dq: Tensor, dk: Tensor,
                      dv: Tensor, flag: Tensor, needs: list[bool], blocks: list[int], interpret: bool, cap: int,
                      tma: Optional[bool]) -> None:
    """An atomic plan's dK launches, which add dQ into float32 sums (zeros first: every key tile adds to them),
    then dQ = the sums times the scale, in q's dtype (one pass over dQ); with ``kq_dv`` they write dV too. ``dk``
    and ``dv`` are empty where neither dK nor dV is asked for (they come together, :func:`_wanted`): the launches
    write them to scratch buffers then (dV's stand-in is dK's where the launches do not write dV)."""
    B, Nk, Hkv = q.shape[0], k.shape[2], k.shape[1] // 2
    dq_sums = torch.zeros(q.shape, device=q.device, dtype=torch.float32)  # (B, 2H, Nq, d)
    dk_out = dk if dk.numel() == k.numel() else _alloc(*k.shape, like=k)
    dv_out = (dv if dv.numel() == v.numel() else _alloc(*v.shape, like=v)) if the_plan.kq_dv else dk_out
    for dk_maps in the_plan.kq_maps:
        _launch("_diff_attn_bwd_dkdq", lambda meta: triton.cdiv(Nk, meta["BLOCK_N"]) * B * Hkv,
                dict(common, DK=dk_out, DQACC=dq_sums, DV=dv_out, FLAG=flag, **_strides(dk_out, "dk", "bhn"),
                     **_strides(dq_sums, "aq", "bhm"), **_strides(dv_out, "dv", "bhn"), Hkv=Hkv),
                dict(consts, DK_MAPS=dk_maps, DV_OUT=the_plan.kq_dv), _blocks(blocks), interpret, q.dtype, cap, tma)
    if needs[0]:
        dq.copy_(dq_sums.mul_(common["sm_scale"]))


@triton_backward.register_fake
def _(dout, q, k, v, lam, attn_mask, out, o2, lse, flag, causal, scale, blocks, plan, needs, tma=None):
    _check_backward(dout, q, k, v, lam, attn_mask, out, o2, lse, flag, scale, blocks, plan, needs)
    B, H2, Nq, _ = q.shape
    grads = (t.new_empty(t.shape) if need else t.new_empty(0) for t, need in zip((q, k, v), _wanted(needs)))
    return (*grads, q.new_empty(B, H2 // 2, 2, Nq, dtype=torch.float32))


def _save(ctx, inputs, output) -> None:
    q, k, v, lam, attn_mask, causal, scale, blocks, plan, _store_o2, tma = inputs
    out, o2, lse, flag = output
    ctx.save_for_backward(q, k, v, lam, attn_mask, out, o2, lse, flag)
    ctx.setup, ctx.tma = (causal, scale, blocks, plan), tma
    ctx.set_materialize_grads(False)  # o2, lse and flag get no gradient: autograd would fill an o2-sized zeros


def _backward(ctx, dout, _do2, _dlse, _dflag):
    q, k, v, lam, attn_mask, out, o2, lse, flag = ctx.saved_tensors
    need = ctx.needs_input_grad
    if dout is None:  # out itself took no part in the loss
        return (None,) * 11
    dq, dk, dv, delta = triton_backward(dout, q, k, v, lam, attn_mask, out, o2, lse, flag, *ctx.setup,
                                        list(need[:3]), ctx.tma)
    dlam = None
    if need[3]:
        # out = o1 - lam * o2, so dlam = -(dO . o2) per row, summed over the dims lam broadcast over
        lam_shape4 = (1,) * (4 - lam.ndim) + tuple(lam.shape)
        dlam = (-delta[:, :, 1]).unsqueeze(-1).sum_to_size(lam_shape4).reshape(lam.shape).to(lam.dtype)
    return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None, dlam,
            None, None, None, None, None, None, None)


triton_forward.register_autograd(_backward, setup_context=_save)


def triton_diff_attention(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, *, causal: bool = False,
                          attn_mask: Optional[Tensor] = None, scale: Optional[float] = None,
                          blocks: Optional[tuple[int, int]] = None, plan: str = "auto",
                          tma: Optional[bool] = None) -> Tensor:
    """Differential attention with the fused Triton kernels (differentiable in ``q``, ``k``, ``v``, ``lam``).

    Shapes as :func:`diffattn_tutorial.functional.diff_attention` (which validates them and calls this
    for ``backend="triton"``): q ``(B, 2H, Nq, d)``, k ``(B, 2Hkv, Nk, d)``, v ``(B, Hkv, Nk, 2d)``, ``lam``
    a 0-dim tensor or 4-D broadcastable to ``(B, H, Nq, 1)``, ``attn_mask`` None or 4-D bool/additive
    broadcastable to ``(B, H, Nq, Nk)``. Returns ``(B, H, Nq, 2d)`` in q's dtype.

    ``blocks=(BLOCK_M, BLOCK_N)`` fixes the tile sizes (default: autotuned on a GPU, 16 x 16 in the
    interpreter). ``plan``: a name in :data:`PLANS` or ``"auto"`` (:func:`plan_for`, by head dim); a plan by
    name runs on a GPU where the autotune tables list each of its launches at the call's head dim, else it is refused. ``tma``: how
    the forward reads k and v on Hopper, by tensor descriptor (``True``), by pointers (``False``) or as the
    autotuner times faster (``None``, where :func:`tma_ok` holds; pointers in the interpreter); the backward's
    dK launches read q and dO, its dQ launches k and v, the same way.
    Checks its inputs, then runs the operator :data:`FORWARD_OP` (its backward :data:`BACKWARD_OP`), so a call
    compiles (``torch.compile(fullgraph=True)``) as one node. Raises ``RuntimeError`` where Triton cannot run (a CPU without ``TRITON_INTERPRET=1``).
    """
    if not launch.capturing():
        _check_mode(q.device)
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"backend='triton' runs float32, float16 and bfloat16, got {q.dtype}; for {q.dtype} use "
                        f"backend='naive' or 'chunked'")
    d = q.shape[-1]
    if d > MAX_HEAD_DIM:
        raise ValueError(f"backend='triton' supports q/k head dims up to {MAX_HEAD_DIM} (V up to "
                         f"{2 * MAX_HEAD_DIM}), got d={d}; use backend='sdpa' or 'naive'")
    if blocks is not None and (len(blocks) != 2 or min(blocks) < 16 or max(blocks) > MAX_TILE_ROWS
                               or any(b & (b - 1) for b in blocks)):
        raise ValueError(f"blocks must be two powers of two from 16 to {MAX_TILE_ROWS} (BLOCK_M, BLOCK_N; int32 "
                         f"offsets inside a tile are checked for {MAX_TILE_ROWS} rows), got {blocks}")
    if attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled():
        raise ValueError("backend='triton' gives no gradient for attn_mask (the kernels never form the N x N "
                         "score gradient); pass attn_mask.detach() if the mask is not learned, or use "
                         "backend='naive' for a learned additive bias")
    check_plan(plan)
    block_d = max(16, triton.next_power_of_2(d))
    cap = launch.capability(q.device)
    the_plan = plan_for(block_d, cap) if plan == "auto" else PLANS[plan]
    store_o2 = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, lam))  # the backward reads o2
    # refused before any copy; the operators check the same (refusals.check_runs_here), as they may be called directly
    check_runs_here(q, the_plan.name, causal=bool(causal), masked=attn_mask is not None, training=store_o2,
                    capability=cap, tiled=blocks is not None, configs_for=_table_configs)
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    _check_offsets(q=q, k=k, v=v, attn_mask=attn_mask)
    scale = d ** -0.5 if scale is None else float(scale)
    lam = lam.to(device=q.device, dtype=q.dtype)
    out, _o2, _lse, _flag = triton_forward(q, k, v, lam, attn_mask, bool(causal), scale, list(blocks or ()), the_plan.name,
                                    store_o2, tma)
    return out


__all__ = ["triton_available", "triton_diff_attention", "tile_schedule", "tma_ok", "capture_launches", "chosen_configs",
           "KERNELS", "Launch", "INTERPRETER_BLOCK", "POISON_ENV", "FORWARD_OP", "BACKWARD_OP", "triton_forward",
           "triton_backward"]
