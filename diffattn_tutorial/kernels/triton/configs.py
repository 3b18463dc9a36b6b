"""Which tile sizes, warps and stages each kernel variant may launch with, per GPU architecture and head dim.

A :class:`Plan` splits the work of one attention call into launches: which maps each forward, dK/dV and dQ program
computes (the flags of :mod:`~diffattn_tutorial.kernels.triton.flags`). Fewer maps per program means fewer float32
accumulators in registers, at the price of a second launch; :func:`plan_for` picks the plan by padded head dim and
compute capability. Each variant (a *form*: ``fused``/``map`` forward, ``dkdv``/``dv``/``dk``/``dk_map``,
``dkdq``/``dkdq_map``/``dkdvdq``, ``dq``/``dq_map``, see :func:`form`) has a short list of configurations per head dim, one table per architecture
(``_CONFIGS_16BIT`` Hopper, ``_CONFIGS_AMPERE`` sm_80/86/89, ``_CONFIGS_TURING`` sm_75, ``_CONFIGS_FP32``); the first
entry is the one ``DIFFATTN_TRITON_AUTOTUNE=0`` pins, the others are what the autotuner may pick (on sm_90a the
lists of the forward and the dK kernels end with TMA twins, :data:`TMA_TWINS`: the same tiles read by tensor
descriptor). Every entry is
checked by :mod:`~diffattn_tutorial.kernels.triton.aot` to compile for its targets without register spills, within
their shared memory and on their matrix instructions (``diffattn_tutorial/recorded/compile_facts.json``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional

import torch
import triton

from diffattn_tutorial.kernels.triton.flags import MAPS_1, MAPS_2, MAPS_BOTH, MAPS_NONE, MASK_NONE

MAX_HEAD_DIM = 128
AUTOTUNE_ENV = "DIFFATTN_TRITON_AUTOTUNE"
"""Set to ``0`` to pin every kernel to the first configuration of its list instead of autotuning."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """How the work is split into launches: which maps a forward program computes, which gradients a dK/dV
    program accumulates, which maps a dQ program computes. Splitting gives each program fewer float32
    accumulators (registers) at the price of recomputing some score tiles in a second launch."""

    name: str
    fwd_maps: tuple[int, ...]  # forward launches in order, each its MAPS flag (map 2 before map 1: it stores o2)
    kv_parts: tuple[tuple[bool, int], ...]  # dK/dV launches, each (DV_OUT, DK_MAPS)
    dq_maps: tuple[int, ...]  # dQ launches, each its DQ_MAPS flag
    kq_maps: tuple[int, ...] = ()  # dK launches that also add dQ by float32 atomics, each its DK_MAPS flag
    kq_dv: bool = False  # the (one, both maps') dK + dQ launch accumulates dV too: every gradient from one launch


PLANS = {
    # d <= 32: one launch per kernel, both maps per program; at d = 64 on sm_90a by name only (HOPPER.md's design 2:
    # dV and both dK in one launch, 16-row query tiles) until a GPU session records that it beats split_kv
    "fused": Plan("fused", (MAPS_BOTH,), ((True, MAPS_BOTH),), (MAPS_BOTH,)),
    # d = 64: dK1, dK2 (4d float32 per key row with dV) do not fit next to the score tiles: dV and dK apart
    "split_kv": Plan("split_kv", (MAPS_BOTH,), ((True, MAPS_NONE), (False, MAPS_BOTH)), (MAPS_BOTH,)),
    # d = 128: one map per forward and dQ program, dV and each map's dK apart
    "split": Plan("split", (MAPS_2, MAPS_1), ((True, MAPS_NONE), (False, MAPS_1), (False, MAPS_2)), (MAPS_1, MAPS_2)),
    # the atomic twins of the last two (FlashAttention-2's backward, kernels/triton/HOPPER.md): the dK programs add
    # dQ from the dS tiles they hold with float32 atomics, so no dQ launch recomputes the scores and dP. Chosen by
    # name only (plan="split_kv_atomic" / "split_atomic") until a GPU session records that they win. dQ's float32
    # sums then depend on the order the programs run: not reproducible bit for bit (refused in deterministic mode)
    "split_kv_atomic": Plan("split_kv_atomic", (MAPS_BOTH,), ((True, MAPS_NONE),), (), (MAPS_BOTH,)),
    "split_atomic": Plan("split_atomic", (MAPS_2, MAPS_1), ((True, MAPS_NONE),), (), (MAPS_1, MAPS_2)),
    # both at once at d = 64 (HOPPER.md's designs 1 and 2): one launch computes dV, dK1, dK2 and adds dQ, the
    # minimum matrix work; by name only, sm_90a entries only, unmeasured
    "fused_atomic": Plan("fused_atomic", (MAPS_BOTH,), (), (), (MAPS_BOTH,), kq_dv=True),
}
ATOMIC_TWINS = {"split_kv": "split_kv_atomic", "split": "split_atomic"}
"""Each plan with a dQ launch that has an atomic twin: the same forward and dV launches, dQ added by the dK ones."""


def plan_for(block_d: int, capability: int = 90) -> Plan:
    """The plan the library uses for a padded head dim ``block_d`` (the register budget decides, see
    notebook 09 and benchmarks/NOTES.md): fused up to 32, dK/dV split at 64, everything split at 128
    (below Hopper, ``capability < 90``, whose ``mma.sync`` or FMA dots hold their operands in registers: split
    at every head dim, :data:`AMPERE_PLANS`)."""
    if capability < 90 and block_d in AMPERE_PLANS:
        return PLANS[AMPERE_PLANS[block_d]]
    return PLANS["split" if block_d >= 128 else ("split_kv" if block_d >= 64 else "fused")]


def plan_refusal(plan: Plan, *, causal: bool, masked: bool, training: bool, block_d: int, dtype: torch.dtype,
                 capability: int, compiled: bool) -> Optional[str]:
    """Why ``plan``, chosen by name, does not run a call (None: it does). ``fused_atomic`` (``kq_dv``: one backward
    launch for every gradient) has one table entry, 16-bit at padded head dim 64 on sm_90a, clean only for calls
    neither causal nor masked (the compile facts' excluded rows: it spills causal, with an additive mask, with a
    bool mask in GQA): its training calls are refused outside that, and on a GPU (``compiled``) in 16 bits at
    another head dim or target; inference (its forward is ``fused``'s) and float32 (its own table) run."""
    if not plan.kq_dv or not training:
        return None
    if causal or masked:
        return ("it trains calls neither causal nor masked (its one launch spills on the others on sm_90a: "
                "recorded/compile_facts.json, excluded rows)")
    if compiled and dtype != torch.float32 and (block_d != 64 or capability < 90):
        return (f"its one launch has a table entry at head dim 64 on compute capability 9.0+ only (here padded "
                f"head dim {block_d}, {capability / 10:.1f})")
    return None


def train_head_dim_limit(capability: int) -> int:
    """The largest padded head dim whose backward runs on a GPU of compute ``capability``: 64 below sm_80 (see
    ``_CONFIGS_TURING``), else :data:`MAX_HEAD_DIM`."""
    return 64 if capability < 80 else MAX_HEAD_DIM


TMA_KERNELS = ("_diff_attn_fwd", "_diff_attn_bwd_dkdv", "_diff_attn_bwd_dkdq", "_diff_attn_bwd_dq")
"""The kernels with a ``TMA`` switch: the forward and the dQ kernel read their k and v tiles, the dK kernels their q
and dO tiles, by tensor descriptor (Hopper's copy engine) where a configuration says ``TMA=True`` (:data:`TMA_TWINS`)."""


def config(bm: int, bn: int, warps: int, stages: int, tma: Optional[bool] = None) -> triton.Config:
    """A configuration: tile rows ``BLOCK_M`` (queries) and ``BLOCK_N`` (keys), warps, stages, and for the
    kernels of :data:`TMA_KERNELS` ``TMA`` (``None``: not set; :func:`autotune_configs` sets it ``False``)."""
    switches = {} if tma is None else {"TMA": tma}
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, **switches}, num_warps=warps, num_stages=stages)


def _twin(bm: int, bn: int, warps: int, stages: int) -> triton.Config:
    return config(bm, bn, warps, stages, tma=True)


_cfg = config  # the short name the tables below use


# (kernel, form) -> padded head dim -> configs, first = the pinned one. Each entry compiles for sm_90a
# without spills, with every 16-bit dot on wgmma and no dot duplicated across warpgroups
# (tests/test_triton_compile.py; python -m diffattn_tutorial.kernels.triton.aot --all;
# diffattn_tutorial/recorded/compile_facts.json).
_CONFIGS_16BIT: dict[tuple[str, str], dict[int, list[triton.Config]]] = {
    ("_diff_attn_fwd", "fused"): {
        16: [_cfg(128, 64, 8, 2), _cfg(64, 64, 4, 3)],
        32: [_cfg(128, 32, 8, 3), _cfg(64, 64, 4, 3)],
        # 64x64 w4 s3: the H100 probe's faster shape (MEASURED_SPILLS), then its TMA twin (TMA_TWINS) in the place
        # of 128x32 w8 s3, the probe's 20% slower former first entry (inputs the copy engine cannot read: 64x64 only)
        64: [_cfg(64, 64, 4, 3), _twin(64, 64, 4, 3)],
    },
    ("_diff_attn_fwd", "map"): {
        # the probe's faster 128x128 w8 s2 for calls without a mask only (UNMASKED_ONLY)
        128: [_cfg(128, 64, 8, 2), _cfg(128, 128, 8, 2), _twin(128, 64, 8, 2), _twin(128, 128, 8, 2)],
    },
    ("_diff_attn_bwd_dkdv", "dkdv"): {
        16: [_cfg(32, 128, 8, 2), _cfg(32, 64, 4, 2)],
        32: [_cfg(32, 128, 8, 2), _cfg(16, 128, 8, 2)],
        # the fused plan at d = 64 (chosen by name): dV, dK1 and dK2 of 128 keys in float32 take most registers;
        # 16x128 w8 s1 is pinned, clean in every variant recorded (with 2 stages a causal call with a per-token
        # lambda spills 8 B: aot_cases.EXCLUSIONS), 32x128 w8 s2 only without a mask and not causal (NON_CAUSAL_ONLY,
        # UNMASKED_ONLY), then their twins; all unmeasured
        64: [_cfg(16, 128, 8, 1), _cfg(32, 128, 8, 2), _twin(16, 128, 8, 1), _twin(32, 128, 8, 2)],
    },
    # the dK kernels' TMA twins (q and dO tiles by descriptor) last, of the pinned entry (TMA_TWINS)
    ("_diff_attn_bwd_dkdv", "dv"): {
        64: [_cfg(32, 128, 8, 2), _cfg(32, 64, 4, 2), _twin(32, 128, 8, 2)],
        128: [_cfg(16, 128, 8, 2), _twin(16, 128, 8, 2)],
    },
    ("_diff_attn_bwd_dkdv", "dk"): {
        64: [_cfg(32, 128, 8, 2), _cfg(16, 128, 8, 2), _twin(32, 128, 8, 2)],
    },
    ("_diff_attn_bwd_dkdv", "dk_map"): {
        128: [_cfg(32, 128, 8, 3), _twin(32, 128, 8, 3)],
    },
    ("_diff_attn_bwd_dkdq", "dkdq"): {  # the dk shapes (unmeasured: the atomic plans wait for a GPU session)
        64: [_cfg(32, 128, 8, 2), _cfg(16, 128, 8, 2), _twin(32, 128, 8, 2)],
    },
    ("_diff_attn_bwd_dkdq", "dkdq_map"): {
        128: [_cfg(32, 128, 8, 3), _twin(32, 128, 8, 3)],
    },
    ("_diff_attn_bwd_dkdq", "dkdvdq"): {  # plan fused_atomic (by name; training calls neither causal nor masked):
        64: [_cfg(16, 128, 8, 2)],  # clean at 16 rows, 2 stages; its twin spills (unmeasured either way)
    },
    ("_diff_attn_bwd_dq", "dq"): {  # the dQ kernel's twins read k and v by descriptor (TMA_TWINS)
        16: [_cfg(128, 64, 8, 2), _cfg(64, 64, 4, 2)],
        32: [_cfg(128, 64, 8, 2), _cfg(64, 64, 4, 2)],
        64: [_cfg(128, 32, 8, 2), _cfg(64, 32, 4, 3), _twin(128, 32, 8, 2)],
    },
    ("_diff_attn_bwd_dq", "dq_map"): {
        128: [_cfg(128, 32, 8, 2), _cfg(64, 32, 4, 3), _twin(128, 32, 8, 2)],
    },
}
MEASURED_SPILLS: dict[tuple[str, str, int, str], str] = {
    ("_diff_attn_fwd", "fused", 64, "64x64 w4 s3"):
        "spilled 16 B before the scan, 24 B with it (sm_90a); timed about 20% faster than 128x32 w8 s3 on the H100 "
        "probe of 2026-11-26 (recorded/gpu_session_nvidia-h100-80gb-hbm3.json), spills and all",
    ("_diff_attn_fwd", "map", 128, "128x64 w8 s2"):
        "spills 16-36 B in the heaviest variant (causal, additive mask, per-token lambda) since the in-kernel NaN "
        "scan, none before; the only d = 128 map shape left (128x128 needs more shared memory than sm_90a has); "
        "its speed with the scan is unmeasured",
    ("_diff_attn_fwd", "map", 128, "128x128 w8 s2"):
        "spilled 56 B before the scan and was timed 1.25x faster than 128x64 w8 s2 on the H100 probe of 2026-11-26; "
        "spills 100-236 B with it (sm_90a); never pinned (UNMASKED_ONLY), so the autotuner, which times both on "
        "the GPU, takes it only where it is faster; its speed with the scan is unmeasured",
}
"""sm_90a entries kept although they spill: ``(kernel, form, padded head dim, config) -> why``. A spill is a problem
(:mod:`~diffattn_tutorial.kernels.triton.aot`) everywhere else; each entry says why it stays (two were timed faster
on the H100's probe, spills and all; none has been timed with the in-kernel scan)."""
UNMASKED_ONLY: dict[tuple[str, str, int, str], str] = {
    ("_diff_attn_fwd", "map", 128, "128x128 w8 s2"):
        "timed 1.25x faster than 128x64 w8 s2 on the H100 probe of 2026-11-26 (recorded/gpu_session_nvidia-h100-"
        "80gb-hbm3.json, before the in-kernel NaN scan); with an additive mask tile beside it, the launch needs "
        "262144 B of shared memory, over sm_90a's 232448 (recorded/compile_facts.json, its excluded rows: "
        "aot_cases.EXCLUSIONS)",
    ("_diff_attn_bwd_dkdv", "dkdv", 64, "32x128 w8 s2"):
        "the fused plan's dK/dV launch at d = 64 spills 36 B stored / 24 B loaded with an additive mask "
        "(recorded/compile_facts.json, its excluded rows: aot_cases.EXCLUSIONS), so masked calls keep the pinned "
        "16x128 w8 s1 (also NON_CAUSAL_ONLY)",
}
"""Table entries the autotuner may pick only for calls without a mask (``MASK_KIND`` none): ``(kernel, form, padded
head dim, config) -> why``. Never first in their list, so the pinned configuration runs every variant."""
NON_CAUSAL_ONLY: dict[tuple[str, str, int, str], str] = {
    ("_diff_attn_bwd_dkdv", "dkdv", 64, "32x128 w8 s2"):
        "the fused plan's dK/dV launch at d = 64 spills 24 B stored / 32 B loaded when causal with a per-token "
        "lambda (recorded/compile_facts.json, its excluded rows: aot_cases.EXCLUSIONS), none in the plain, "
        "per-token lambda and GQA 4:1 cases the record compiles; the lambda's kind is no constexpr, so every "
        "causal call is left to the pinned 16x128 w8 s1",
}
"""Table entries the autotuner may pick only for calls that are not causal (``CAUSAL`` false), as
:data:`UNMASKED_ONLY` for masks: ``(kernel, form, padded head dim, config) -> why``; never first in their list."""
TMA_TWINS = ("the sm_90a entries with TMA=True (the forward's, the dK kernels' and the dQ kernel's, TMA_KERNELS): the "
             "same tile as an entry before them, the tiles its loop walks (the forward's and the dQ kernel's k and v, "
             "the dK kernels' q and dO) loaded by "
             "tensor descriptor (Hopper's copy engine) instead of per-thread pointers. In the cases the record "
             "compiles them (training at each head dim, the heaviest variant's training and inference, GQA 4:1, "
             "the atomic plans and the fused plan at d = 64, every configuration; not yet fp16 or a careful launch) "
             "they spill no more than their pointer entry (tests/test_triton_compile.py checks it; most use fewer "
             "registers, some more: kernels/triton/HOPPER.md names them), so they share its MEASURED_SPILLS, UNMASKED_ONLY and "
             "NON_CAUSAL_ONLY entries; their speed is unmeasured. Never "
             "first in a list: by default only the autotuner, timing both on the GPU, picks one, and only for inputs "
             "whose base and strides are multiples of 16 bytes (launch.tma_ok); tma=True forces them (the pinned "
             "and careful launches then run the first twin)")
"""Why the sm_90a lists of :data:`TMA_KERNELS` end with TMA twins (``TMA=True`` in a configuration's kwargs)."""

# float32: no tensor cores unless TF32 is allowed ("ieee" products are FMA loops), small tiles only, any plan
_FP32_FWD, _FP32_KV, _FP32_Q = [_cfg(32, 16, 4, 2)], [_cfg(16, 16, 4, 2)], [_cfg(32, 16, 4, 2)]
_CONFIGS_FP32: dict[tuple[str, str], dict[int, list[triton.Config]]] = {
    **{("_diff_attn_fwd", form): {d: _FP32_FWD for d in (16, 32, 64, 128)} for form in ("fused", "map")},
    **{(kernel, form): {d: _FP32_KV for d in (16, 32, 64, 128)} for kernel, form in (
        ("_diff_attn_bwd_dkdv", "dkdv"), ("_diff_attn_bwd_dkdv", "dv"), ("_diff_attn_bwd_dkdv", "dk"),
        ("_diff_attn_bwd_dkdv", "dk_map"), ("_diff_attn_bwd_dkdq", "dkdq"), ("_diff_attn_bwd_dkdq", "dkdq_map"),
        ("_diff_attn_bwd_dkdq", "dkdvdq"))},
    **{("_diff_attn_bwd_dq", form): {**{d: _FP32_Q for d in (16, 32, 64)}, 128: _FP32_KV} for form in ("dq", "dq_map")},
}
# Ampere and Ada (sm_80, sm_86, sm_89: mma.sync, both operands in registers): one map per program at every head
# dim, smaller tiles; each entry clean on all three targets (their ptxas allocate registers differently)
_CONFIGS_AMPERE: dict[tuple[str, str], dict[int, list[triton.Config]]] = {
    ("_diff_attn_fwd", "map"): {
        16: [_cfg(64, 64, 4, 2), _cfg(128, 64, 8, 2)],
        32: [_cfg(128, 64, 8, 2), _cfg(64, 32, 4, 2)],
        64: [_cfg(64, 64, 4, 2), _cfg(128, 32, 8, 2)],
        128: [_cfg(64, 64, 8, 2)],
    },
    ("_diff_attn_bwd_dkdv", "dv"): {
        16: [_cfg(32, 64, 4, 2), _cfg(32, 128, 8, 2)],
        32: [_cfg(32, 64, 4, 2), _cfg(32, 128, 8, 2)],
        64: [_cfg(16, 128, 8, 2)],
        128: [_cfg(32, 64, 8, 2)],
    },
    ("_diff_attn_bwd_dkdv", "dk_map"): {
        16: [_cfg(32, 64, 4, 2), _cfg(32, 128, 8, 2)],
        32: [_cfg(32, 64, 4, 2), _cfg(32, 128, 8, 2)],
        64: [_cfg(16, 64, 4, 1), _cfg(16, 32, 2, 2)],  # 16x64 w4 s2 spilled 4 B on sm_86 (GQA 4:1)
        128: [_cfg(32, 32, 4, 2)],
    },
    ("_diff_attn_bwd_dq", "dq_map"): {  # spilled 4-32 B on sm_80/86/89 at 255 registers: 64x64 w4 (d 32),
        16: [_cfg(64, 32, 4, 2)],  # 128x32 w8 (d 64), 32x32 w4 (d 128); 8 warps over 32 or 64 rows compute
        32: [_cfg(64, 32, 4, 2), _cfg(128, 32, 8, 2)],  # the same product twice (dup 2): not kept either
        64: [_cfg(64, 16, 4, 2), _cfg(128, 16, 8, 2)],
        128: [_cfg(32, 32, 2, 2), _cfg(32, 16, 2, 2)],
    },
}
# Turing (sm_75: T4, RTX 20xx; float16 only, 64 KiB of shared memory per block). This Triton (3.9) has no
# tensor-core path below sm_80: every tl.dot compiles to FMA loops (no mma instruction in the PTX, recorded in the
# compile facts) and nothing is software-pipelined (so 1 stage). FMA dots hold their operands in registers: the
# tiles are small, most with 8 warps, each clean in every variant. The backward at d = 128 is not run there
# (:func:`train_head_dim_limit`): its dK launch spilled 200-5000 B in every shape tried (16x16 to 32x32, 4-16 warps).
_CONFIGS_TURING: dict[tuple[str, str], dict[int, list[triton.Config]]] = {
    ("_diff_attn_fwd", "map"): {
        16: [_cfg(64, 32, 8, 1), _cfg(32, 32, 8, 1)],
        32: [_cfg(64, 32, 8, 1), _cfg(32, 32, 8, 1)],
        64: [_cfg(32, 32, 8, 1), _cfg(64, 16, 8, 1)],
        128: [_cfg(32, 16, 8, 1), _cfg(16, 16, 4, 1)],
    },
    ("_diff_attn_bwd_dkdv", "dv"): {
        16: [_cfg(16, 64, 8, 1), _cfg(32, 32, 8, 1)],
        32: [_cfg(16, 64, 8, 1), _cfg(32, 32, 8, 1)],
        64: [_cfg(16, 64, 8, 1), _cfg(32, 16, 16, 1)],
    },
    ("_diff_attn_bwd_dkdv", "dk_map"): {
        16: [_cfg(16, 64, 8, 1), _cfg(32, 32, 8, 1)],
        32: [_cfg(16, 64, 8, 1), _cfg(32, 32, 8, 1)],
        64: [_cfg(16, 16, 8, 1)],
    },
    ("_diff_attn_bwd_dq", "dq_map"): {
        16: [_cfg(64, 16, 8, 1), _cfg(32, 32, 8, 1)],
        32: [_cfg(64, 16, 8, 1), _cfg(32, 16, 8, 1)],  # 32x32 w8 spilled 8 B without a mask
        64: [_cfg(64, 16, 8, 1), _cfg(32, 16, 16, 1)],
    },
}
AMPERE_PLANS: dict[int, str] = {16: "split", 32: "split", 64: "split", 128: "split"}


def form(name: str, consts: dict) -> str:
    """A short name for the kernel variant the constexprs select (the autotune lists are per variant): ``fused``
    (forward, both maps) or ``map`` (one map); ``dkdv`` (dV and both maps' dK), ``dv``, ``dk`` (both maps) or
    ``dk_map`` (one map); ``dkdq`` (both maps' dK and dQ by atomics), ``dkdq_map`` (one map) or ``dkdvdq`` (dV
    too); ``dq`` (both maps)
    or ``dq_map`` (one map); ``pre`` (the backward's preprocess)."""
    if name == "_diff_attn_fwd":
        return "fused" if consts["MAPS"] == MAPS_BOTH else "map"
    if name == "_diff_attn_bwd_dkdv":
        dv, dk = consts["DV_OUT"], consts["DK_MAPS"]
        if dk == MAPS_NONE:
            return "dv"
        return ("dkdv" if dv else "dk") if dk == MAPS_BOTH else "dk_map"
    if name == "_diff_attn_bwd_dkdq":
        if consts.get("DV_OUT"):
            return "dkdvdq"
        return "dkdq" if consts["DK_MAPS"] == MAPS_BOTH else "dkdq_map"
    if name == "_diff_attn_bwd_dq":
        return "dq" if consts["DQ_MAPS"] == MAPS_BOTH else "dq_map"
    return "pre"


def autotune_configs(name: str, consts: dict, dtype: torch.dtype, capability: int = 90,
                     tma: Optional[bool] = False) -> list[triton.Config]:
    """The configurations the autotuner may pick for one launch (kernel ``name`` with constexprs ``consts``) on
    a GPU of compute ``capability`` (90 and up: the Hopper table; 80-89: Ampere and Ada; below 80: Turing); the
    first is the one ``DIFFATTN_TRITON_AUTOTUNE=0`` pins. ``tma``: ``False`` the pointer entries only, ``True``
    the TMA twins only, ``None`` both (:data:`TMA_TWINS`). Empty where the table lists none for the launch: a TMA
    twin asked for where there is none, or a plan chosen by name at a head dim whose tables lack one of its launches
    (which ``flash_diff`` refuses on a GPU: no configuration the compile facts do not check runs there)."""
    if name == "_diff_attn_bwd_preprocess":
        return [triton.Config({}, num_warps=4, num_stages=1)]
    table = _table(dtype, capability)
    variant = form(name, consts)
    configs = [c for c in table.get((name, variant), {}).get(consts["BLOCK_D"], [])
               if _offered((name, variant, consts["BLOCK_D"], shape(c)), consts)
               and (tma is None or bool(c.kwargs.get("TMA")) == tma)]
    if name in TMA_KERNELS:  # their switch is always passed: False where an entry does not set it
        return [c if "TMA" in c.kwargs else config(*_numbers(c), tma=False) for c in configs]
    return configs


def _table(dtype: torch.dtype, capability: int) -> dict[tuple[str, str], dict[int, list[triton.Config]]]:
    """The autotune table of ``dtype`` on a GPU of compute ``capability``."""
    if dtype == torch.float32:
        return _CONFIGS_FP32
    return _CONFIGS_16BIT if capability >= 90 else (_CONFIGS_AMPERE if capability >= 80 else _CONFIGS_TURING)


def _launch_consts(plan: Plan, training: bool) -> list[tuple[str, dict]]:
    """``(kernel, the constexprs that choose its form)`` of each launch ``plan`` makes (the backward's with
    ``training``)."""
    launches = [("_diff_attn_fwd", {"MAPS": m}) for m in plan.fwd_maps]
    if training:
        launches += [("_diff_attn_bwd_dkdv", {"DV_OUT": dv, "DK_MAPS": dk}) for dv, dk in plan.kv_parts]
        launches += [("_diff_attn_bwd_dq", {"DQ_MAPS": m}) for m in plan.dq_maps]
        launches += [("_diff_attn_bwd_dkdq", {"DV_OUT": plan.kq_dv, "DK_MAPS": m}) for m in plan.kq_maps]
    return launches


def plan_launches(plan: Plan, training: bool) -> list[tuple[str, str]]:
    """``(kernel, form)`` of each launch ``plan`` makes: its forward's, and with ``training`` its backward's."""
    return [(name, form(name, consts)) for name, consts in _launch_consts(plan, training)]


def untabled_launches(plan: Plan, *, training: bool, block_d: int, dtype: torch.dtype, capability: int,
                      configs_for: Optional[Callable] = None) -> list[str]:
    """The launches of ``plan`` (:func:`plan_launches`) with no configuration at padded head dim ``block_d`` for
    ``dtype`` on compute ``capability``, each once as ``"kernel (form)"``: on a GPU they do not run (empty: every
    one has). ``configs_for``: the lookup the launches use (default :func:`autotune_configs`; a benchmark may pin
    it, as ``benchmarks/probe_triton.py`` does)."""
    configs_for = configs_for or autotune_configs
    missing: list[str] = []
    for name, consts in _launch_consts(plan, training):
        consts = dict(consts, BLOCK_D=block_d, MASK_KIND=MASK_NONE, CAUSAL=False)  # the pinned entry serves all
        label = f"{name} ({form(name, consts)})"
        if label not in missing and not configs_for(name, consts, dtype, capability):
            missing.append(label)
    return missing


def _offered(key, consts: dict) -> bool:
    """Whether the entry ``(kernel, form, padded head dim, shape)`` is offered to a launch with ``consts``: not one
    of :data:`UNMASKED_ONLY` with a mask, nor of :data:`NON_CAUSAL_ONLY` when causal (a launch whose ``consts``
    do not say counts as masked, causal)."""
    masked = consts.get("MASK_KIND") != MASK_NONE
    return not (masked and key in UNMASKED_ONLY) and not (consts.get("CAUSAL", True) and key in NON_CAUSAL_ONLY)


def _numbers(c: triton.Config) -> tuple[int, int, int, int]:
    return c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages


def shape(c: triton.Config) -> str:
    """A configuration's tile, warps and stages, ``"128x64 w8 s2"``: the key of :data:`MEASURED_SPILLS`,
    :data:`UNMASKED_ONLY` and :data:`NON_CAUSAL_ONLY`, which a TMA twin shares with its pointer entry
    (:data:`TMA_TWINS`)."""
    return f"{c.kwargs['BLOCK_M']}x{c.kwargs['BLOCK_N']} w{c.num_warps} s{c.num_stages}"


def label(c: triton.Config) -> str:
    """:func:`shape`, and ``" tma"`` for a TMA twin: a configuration's name in the compile facts and reports."""
    return shape(c) + (" tma" if c.kwargs.get("TMA") else "")


def config_tables() -> dict[str, dict[tuple[str, str], dict[int, list[triton.Config]]]]:
    """Every autotune table, by name (``hopper``, ``ampere``, ``turing``, ``float32``): what the ahead-of-time
    compile hashes and what the tests read (the tables themselves stay private to this module)."""
    return {"hopper": _CONFIGS_16BIT, "ampere": _CONFIGS_AMPERE, "turing": _CONFIGS_TURING, "float32": _CONFIGS_FP32}


def autotune_enabled() -> bool:
    return os.environ.get(AUTOTUNE_ENV, "1") not in ("0", "", "false", "False")


__all__ = ["MAX_HEAD_DIM", "AUTOTUNE_ENV", "Plan", "PLANS", "ATOMIC_TWINS", "AMPERE_PLANS", "MEASURED_SPILLS", "plan_for",
           "UNMASKED_ONLY", "NON_CAUSAL_ONLY", "plan_refusal", "TMA_TWINS", "TMA_KERNELS", "config", "shape", "label", "train_head_dim_limit", "autotune_configs",
           "plan_launches", "untabled_launches", "autotune_enabled", "config_tables", "form"]
