"""What the Triton kernels refuse to run on this GPU or in this mode, whoever calls them: the public call
(``flash_diff.triton_diff_attention``) and the operators called directly (``torch.ops.diffattn.triton_forward``,
``triton_backward``) run the same checks, so a direct call cannot reach a launch the public one refuses."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import triton

from diffattn_tutorial.kernels.triton import launch
from diffattn_tutorial.kernels.triton.configs import PLANS, plan_refusal, train_head_dim_limit, untabled_launches

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


def check_runs_here(q: Tensor, plan: str, *, causal: bool, masked: bool, training: bool, capability: int,
                    tiled: bool = False, configs_for: Optional[Callable] = None) -> None:
    """What the kernels refuse on this GPU or in this mode, whoever calls them: the public call and the operators
    called directly (``torch.ops.diffattn.triton_forward``) alike, before any launch. ``plan``: a name in
    :data:`PLANS`; ``training``: the call keeps what a backward reads (the backward operator: always); ``tiled``:
    the caller chose the tile (``blocks=``); ``configs_for``: as ``configs.untabled_launches``. Refuses an atomic
    plan in deterministic mode (:func:`check_plan`), what the target cannot run (:func:`check_target`), on a GPU (or
    recorded as on one, unless ``launch.capturing_untabled``) a launch no table lists (``configs.untabled_launches``,
    the backward's too when ``training``) and a plan's refused calls (``configs.plan_refusal``; not while recording
    compile facts, which record why), naming plans that run."""
    check_plan(plan)
    block_d = max(16, triton.next_power_of_2(q.shape[-1]))
    check_target(q, block_d, capability, training)
    on_gpu = (launch.capturing() or not launch.interpret_mode()) and not launch.capturing_untabled()

    def untabled(name: str) -> list[str]:
        return untabled_launches(PLANS[name], training=training, block_d=block_d, dtype=q.dtype, capability=capability,
                                 configs_for=configs_for) if on_gpu and not tiled else []

    if untabled(plan):
        raise ValueError(f"plan={plan!r}: {', '.join(untabled(plan))} has no table entry for {q.dtype} at padded head "
                         f"dim {block_d} on compute capability {capability / 10:.1f} (only configurations the compile "
                         f"facts check run on a GPU; a backward launch counts where a gradient is asked for); use "
                         f"plan='auto', or blocks=(BLOCK_M, BLOCK_N) to choose the tile yourself, or torch.no_grad() "
                         f"where only the backward's launch is missing")
    why = plan_refusal(PLANS[plan], causal=causal, masked=masked, training=training, block_d=block_d, dtype=q.dtype,
                       capability=capability, compiled=not launch.interpret_mode())
    if why and not launch.capturing():
        others = [name for name in ("split_kv_atomic", "fused") if not untabled(name)] or ["auto"]
        raise ValueError(f"plan={plan!r}: {why}; use plan=" + " or ".join(f"'{name}'" for name in others))


__all__ = ["check_plan", "check_target", "check_runs_here"]
