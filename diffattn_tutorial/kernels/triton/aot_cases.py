"""Which workloads the ahead-of-time compile covers (:mod:`~diffattn_tutorial.kernels.triton.aot` compiles them).

A :class:`Case` is one call of the library (head dim, dtype, causal, mask, GQA group, lambda's kind, training or
inference, plan); the host code decides which launches it makes. The lists here say which cases each record and
check compiles: the full check (:func:`all_cases`), the committed record per target (:func:`record_cases`), the
suite's live subset (:func:`subset_cases`), the decode kernels (:func:`decode_cases`), and two lists compiled but
not checked: :data:`LESSONS` (notebook 09's counter-examples) and :data:`EXCLUSIONS` (why a table keeps an entry
from a variant).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional, Sequence

from diffattn_tutorial.kernels.triton.aot_keys import ARCHS, DECODE_GROUPS, DECODE_HEAD_DIMS

HEAD_DIMS = (16, 32, 64, 128)
"""Every padded head dim the kernels support (d = 1..128 is padded to the next of these)."""
DTYPES = ("bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Case:
    """One workload; the host code decides which launches it makes (forward and backward)."""

    head_dim: int
    dtype: str = "bfloat16"
    causal: bool = False
    mask: str = "none"  # "none", "bool" or "additive"
    group: int = 1  # GQA: differential heads per KV group
    lam: str = "scalar"  # "scalar" or "token"
    grad: bool = True  # training (forward stores o2, backward launches) or inference (forward only)
    plan: str = "auto"  # the library's plan for the head dim, or "fused" / "split" to compare
    decode: bool = False  # the split-K decode kernels (one query token over a KV cache) instead

    @property
    def label(self) -> str:
        if self.decode:
            return f"d{self.head_dim} {self.dtype} decode{' gqa' + str(self.group) if self.group > 1 else ''}"
        return (f"d{self.head_dim} {self.dtype}{' causal' if self.causal else ''}"
                f"{'' if self.mask == 'none' else ' mask=' + self.mask}{' gqa' + str(self.group) if self.group > 1 else ''}"
                f"{' lam=token' if self.lam == 'token' else ''}{'' if self.grad else ' inference'}"
                f"{'' if self.plan == 'auto' else ' plan=' + self.plan}")


def all_cases(head_dims: Sequence[int] = HEAD_DIMS, dtypes: Sequence[str] = DTYPES) -> list[tuple[Case, bool]]:
    """``(case, every_config)`` for the full check: per dtype and head dim, every autotune configuration of
    the plain training case, of the heaviest variant (causal, additive mask, per-token lambda) and of the
    inference forward; the pinned configuration of the other variants whose code differs (a bool mask,
    GQA 4:1 with its dK/dV loop over heads)."""
    cases = []
    for dt in dtypes:
        for d in head_dims:
            cases += [(Case(d, dt), True), (Case(d, dt, causal=True, mask="additive", lam="token"), True),
                      (Case(d, dt, grad=False), True), (Case(d, dt, mask="bool"), False),
                      (Case(d, dt, group=4), False)]
    return cases


def record_cases(arch: str, head_dims: Sequence[int] = HEAD_DIMS) -> list[tuple[Case, bool]]:
    """What the record holds for ``arch``, what the checks need: in the target's first dtype (bf16; fp16 on sm_75),
    every autotune configuration of the training case at each head dim (forward, careful forward, backward), the
    pinned inference forward, and on sm_90a also the heaviest variant (causal, additive mask, per-token lambda) at
    d = 64 and 128, training and inference, and GQA 4:1 at d = 64, in every configuration (the TMA twins,
    ``configs.TMA_TWINS``, beside their pointer entries), the atomic plans (``configs.ATOMIC_TWINS``) at d = 64 and 128
    (every configuration; d = 128 also in the heaviest variant), the fused plan at d = 64 (every configuration,
    plain, per-token lambda, heaviest and GQA 4:1) and its atomic form ``fused_atomic`` (plain, per-token lambda,
    GQA 4:1; not yet a bool mask, the other calls it runs). fp16 beside bf16 and the heavy variants on every target were
    recorded until 2026-11-28 (about three hours on two cores) and showed no problem the plain case did not."""
    dt = ARCHS[arch].dtypes[0]
    cases = [c for d in head_dims for c in ((Case(d, dt), True), (Case(d, dt, grad=False), False))]
    if arch == "sm_90a":
        cases += [(Case(d, dt, causal=True, mask="additive", lam="token", grad=grad), True) for d in (64, 128)
                  for grad in (True, False) if d in head_dims] + [(Case(64, dt, group=4), True)] * (64 in head_dims)
        cases += [(Case(d, dt, plan=plan), True) for d, plan in ((64, "split_kv_atomic"), (128, "split_atomic"))
                  if d in head_dims]  # the atomic plans (chosen by name), their own table entries
        cases += [(Case(128, dt, causal=True, mask="additive", lam="token", plan="split_atomic"), True)] * (
            128 in head_dims)
        cases += [(Case(64, dt, plan="fused", **kw), True) for kw in (  # the fused plan at d = 64 (by name)
            {}, {"lam": "token"}, {"causal": True, "mask": "additive", "lam": "token"}, {"group": 4})] * (
            64 in head_dims)
        cases += [(Case(64, dt, plan="fused_atomic", **kw), True) for kw in (  # and its atomic form, where it runs
            {}, {"lam": "token"}, {"group": 4})] * (64 in head_dims)
    return cases


def subset_cases(arch: str = "sm_90a") -> list[tuple[Case, bool]]:
    """The representative subset the test suite compiles for ``arch``: the pinned configuration of every launch of
    the plain training case at d = 64 and d = 128 in the target's first dtype (bf16; on sm_75 fp16, and d = 128
    as inference, see :func:`case_on`)."""
    dtype = ARCHS[arch].dtypes[0]
    return [(Case(64, dtype), False), (Case(128, dtype), False)]


def decode_cases(head_dims: Sequence[int] = DECODE_HEAD_DIMS, dtypes: Sequence[str] = DTYPES) -> list[tuple[Case, bool]]:
    """``(case, every_config)`` for the decode kernels (one launch configuration each) per dtype, head dim, group."""
    return [(Case(d, dt, causal=True, group=g, grad=False, decode=True), False)
            for dt in dtypes for d in head_dims for g in DECODE_GROUPS]


def case_on(case: Case, arch: str) -> Optional[Case]:
    """``case`` as the library runs it on ``arch``: None where its dtype does not run there (bf16 on sm_75), its
    inference forward where the head dim is past the target's training limit (d = 128 on sm_75)."""
    target = ARCHS[arch]
    if case.dtype != "float32" and case.dtype not in target.dtypes:
        return None
    if case.grad and case.head_dim > target.train_head_dim:
        return dataclasses.replace(case, grad=False)
    return case


def plan_work(cases: Iterable[tuple[Case, bool]], archs: Sequence[str],
              every_config: Optional[bool] = None) -> list[tuple[Case, bool, str]]:
    """``(case, every_config, arch)`` for each target and each case that runs there (:func:`case_on`);
    ``every_config`` overrides each case's own choice between every configuration and the pinned one."""
    cases = list(cases)
    out = []
    for arch in archs:  # each architecture has its own plans and autotune tables
        for case, every in cases:
            on = case_on(case, arch)
            if on is not None:
                out.append((on, every if every_config is None else every_config, arch))
    return out


LESSONS = [  # (case, kernel, configs): what the fused plan would meet at d = 128 (notebook 09), not checked
    (Case(128, grad=False, plan="fused"), "_diff_attn_fwd", [(64, 64, 8, 2), (64, 64, 4, 2), (128, 64, 8, 2)]),
    (Case(128, plan="fused"), "_diff_attn_bwd_dkdv", [(32, 128, 8, 2), (16, 64, 4, 2)]),
    (Case(128, plan="fused"), "_diff_attn_bwd_dq", [(128, 32, 8, 2), (64, 32, 4, 2)]),
]


EXCLUSIONS = [  # (case, kernel, configs): entries the sm_90a table keeps from a variant, compiled in it, not checked
    # configs.UNMASKED_ONLY: the d = 128 forward's 128x128 tile beside a mask tile (map 2's launch)
    (Case(128, mask="additive"), "_diff_attn_fwd", [(128, 128, 8, 2)]),
    # the fused plan's dK/dV at d = 64: 32x128 w8 s2 (UNMASKED_ONLY, NON_CAUSAL_ONLY), and why 16x128 is pinned
    # with 1 stage
    (Case(64, mask="additive", plan="fused"), "_diff_attn_bwd_dkdv", [(32, 128, 8, 2)]),
    (Case(64, causal=True, lam="token", plan="fused"), "_diff_attn_bwd_dkdv", [(32, 128, 8, 2), (16, 128, 8, 2)]),
    # the fused atomic plan's one launch (its table entry) where the plan refuses calls: causal, masked
    # (configs.plan_refusal), a bool mask spilling in GQA
    (Case(64, causal=True, plan="fused_atomic"), "_diff_attn_bwd_dkdq", [(16, 128, 8, 2)]),
    (Case(64, mask="additive", plan="fused_atomic"), "_diff_attn_bwd_dkdq", [(16, 128, 8, 2)]),
    (Case(64, mask="bool", group=4, plan="fused_atomic"), "_diff_attn_bwd_dkdq", [(16, 128, 8, 2)]),
]
