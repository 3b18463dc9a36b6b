"""What the Triton kernels refuse to run on this GPU or in this mode, whoever calls them: the public call
(``flash_diff.triton_diff_attention``) and the operators called directly (``torch.ops.diffattn.triton_forward``,
``triton_backward``) run the same checks, so a direct call cannot reach a launch the public one refuses."""

from __future__ import annotations

import torch
import triton

from diffattn_tutorial.kernels.triton import launch
from diffattn_tutorial.kernels.triton.configs import PLANS, plan_refusal, train_head_dim_limit

Tensor = torch.Tensor


def check_plan(plan: str) -> None:
    """A plan by name: known; an atomic one not in deterministic mode (``configs.plan_refusal``: the calls a plan
    refuses)."""
    if plan not in ("auto", *PLANS):
        raise ValueError(f"plan must be 'auto' or one of {tuple(PLANS)}, got {plan!r}")
    if PLANS.get(plan, PLANS["fused"]).kq_maps and torch.are_deterministic_algorithms_enabled():
        raise RuntimeError(f"plan={plan!r} adds dQ with atomics, in whatever order the programs run, so its dQ is not "
                           f"reproducible bit for bit, and torch.use_deterministic_algorithms(True) is set; use "
                           f"plan='auto' (the same result from its own dQ launch)")


def check_target(q: Tensor, block_d: int, capability: int, training: bool) -> None:
    """What a GPU below sm_80 (a T4) cannot run: bfloat16 (no bf16 arithmetic there) and the backward
    (``training``) at head dims above :func:`train_head_dim_limit`."""
    if capability >= 80:
        return
    gpu = f"compute capability {capability / 10:.1f}"
    if q.dtype == torch.bfloat16:
        raise TypeError(f"backend='triton': this GPU ({gpu}) has no bfloat16 arithmetic; pass float16 inputs "
                        f"(gpu_bench.preferred_half_dtype(device) picks it) or use backend='auto'")
    if training and block_d > train_head_dim_limit(capability):
        raise ValueError(f"backend='triton' on this GPU ({gpu}) trains head dims up to "
                         f"{train_head_dim_limit(capability)} (the backward at d = {q.shape[-1]} spills registers "
                         f"in every configuration); use backend='auto' for training, or run under torch.no_grad()")


def check_runs_here(q: Tensor, plan: str, *, causal: bool, masked: bool, training: bool, capability: int) -> None:
    """What the kernels refuse on this GPU or in this mode, whoever calls them: the public call and the operators
    called directly (``torch.ops.diffattn.triton_forward``) alike. ``plan``: a name in :data:`PLANS`;
    ``training``: the call keeps what a backward reads (the backward operator: always). Refuses an atomic plan in
    deterministic mode (:func:`check_plan`), what the target cannot run (:func:`check_target`) and a plan's
    refused calls (``configs.plan_refusal``; not while recording compile facts, which record why)."""
    check_plan(plan)
    block_d = max(16, triton.next_power_of_2(q.shape[-1]))
    check_target(q, block_d, capability, training)
    why = plan_refusal(PLANS[plan], causal=causal, masked=masked, training=training, block_d=block_d, dtype=q.dtype,
                       capability=capability, compiled=not launch.interpret_mode())
    if why and not launch.capturing():
        raise ValueError(f"plan={plan!r}: {why}; use plan='split_kv_atomic' or 'fused'")


__all__ = ["check_plan", "check_target", "check_runs_here"]
