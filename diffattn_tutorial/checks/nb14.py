"""Checks for ``exercises/14_converting_trained_models.ipynb``: turning a trained baseline into differential attention.

1. the exact DIFF V2 conversion: a ``DiffAttnV2`` that computes what the baseline computes, built by hand (the
   library's converters are refused);
2. what keeps the paper's V1 from being exact: the positive term of a conversion that pairs baseline heads by
   halves (axolotl's ``--split-heads``), one map applied to a value of width ``2d``;
3. the fine-tuning loop with the negative branch's warm-up.

References: the baseline layer's own output (task 1), ``functional.softmax_attention`` (task 2) and a plain SGD
loop over ``training.study.retrieval_loss`` with ``layers.convert.set_warmup`` (task 3).
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Callable

import torch

from diffattn_tutorial.checks._core import CheckFailed, call, close, exercise_check, expect, fail, passed, randn
from diffattn_tutorial.checks._helpers import seeded
from diffattn_tutorial.functional import softmax_attention
from diffattn_tutorial.layers.attention import DiffAttnV2, MultiheadAttention
from diffattn_tutorial.layers.convert import convert_model, set_warmup, warmup_mix
from diffattn_tutorial.layers.rope import rope_cos_sin

__all__ = ["check_mirror_to_v2", "check_shared_map_values", "check_finetune"]

Tensor = torch.Tensor


# --- TASK 1: the exact V2 conversion -----------------------------------------------------------------------------

_V2_CASES = [(32, 4, 4), (32, 4, 2), (24, 2, 1)]  # (C, H, Hkv)


def _conversions() -> dict:
    from diffattn_tutorial.layers import convert
    return {f: f"the library's {f.__name__}" for f in (convert.to_diff_v2, convert.convert_layer, convert.convert_model)}


def _refuse_shared_weights(new: torch.nn.Module, given: torch.nn.Module, label: str) -> None:
    """A conversion copies: a weight that shares memory with the baseline's (``.data =`` or the Parameter assigned)
    changes the baseline whenever the new layer is fine-tuned."""
    memory = {p.untyped_storage().data_ptr(): name for name, p in given.named_parameters()}
    shared = [f"{name} (the baseline's {memory[p.untyped_storage().data_ptr()]})"
              for name, p in new.named_parameters() if p.untyped_storage().data_ptr() in memory]
    if shared:
        fail(f"{label}: {', '.join(shared)} share memory with the baseline layer: fine-tuning the new layer would "
             f"change the baseline too; copy the values into the new layer's own weights (weight.copy_(...) under "
             f"torch.no_grad()) instead of assigning .data or the Parameter")


@exercise_check(task=1, name="mirror_to_v2", refuses=_conversions)
def check_mirror_to_v2(fn: Callable) -> None:
    """``fn(layer)``: a ``MultiheadAttention`` (no biases) -> a ``DiffAttnV2`` computing the same function."""
    what = "mirror_to_v2"
    for i, (C, H, Hkv) in enumerate(_V2_CASES):
        with seeded(1400 + i):
            base = MultiheadAttention(C, H, num_kv_heads=Hkv).double()
        label = f"{what} (embed_dim={C}, num_heads={H}, num_kv_heads={Hkv})"
        given = copy.deepcopy(base)
        new = call(fn, given, what=label)
        if not isinstance(new, DiffAttnV2):
            fail(f"{label} should return a DiffAttnV2, got {type(new).__name__}")
        _refuse_shared_weights(new, given, label)
        d = C // H
        if new.num_heads != H or new.head_dim != d:
            fail(f"{label}: the DiffAttnV2 has {new.num_heads} heads of width {new.head_dim}; keep the baseline's "
                 f"{H} heads of width {d} (V2 doubles the query heads inside: 2H of them)")
        if new.num_kv_heads != Hkv:
            fail(f"{label}: the DiffAttnV2 has num_kv_heads={new.num_kv_heads}; keep the baseline's {Hkv} KV "
                 f"heads (its GQA groups): pass num_kv_heads=layer.num_kv_heads")
        if not (torch.equal(new.k_proj.weight.double(), base.k_proj.weight)
                and torch.equal(new.v_proj.weight.double(), base.v_proj.weight)):
            fail(f"{label}: k_proj and v_proj must be the baseline's, copied as they are: only the queries double")
        if new.lambda_proj.weight.abs().sum() != 0:
            fail(f"{label}: lambda_proj must start at zero, so lambda = sigmoid(0) = 1/2 on every token; a random "
                 f"lambda_proj gives every token its own lambda and the outputs no longer match")
        q = new.q_proj.weight.double().unflatten(0, (H, 2, d))  # (H, pair, d, C)
        if torch.equal(new.q_proj.weight.double(), torch.cat([base.q_proj.weight] * 2)):
            fail(f"{label}: the query heads are stacked as [all H heads, all H heads again], so pair i = query heads "
                 f"(2i, 2i+1) holds two different baseline heads; interleave them: heads 2i and 2i+1 are both "
                 f"baseline head i")
        if torch.equal(new.q_proj.weight.double(), base.q_proj.weight.repeat_interleave(2, dim=0)):
            fail(f"{label}: every row of q_proj is repeated, so a query head holds half of one baseline head twice; "
                 f"a head is a block of d rows: repeat the blocks (unflatten the weight to (H, d, C) first)")
        if not torch.equal(q[:, 0].flatten(0, 1), base.q_proj.weight):
            fail(f"{label}: query head 2i (the positive map) must be the baseline's head i, copied")
        if not torch.equal(q[:, 1], q[:, 0]):
            hint = " (it is zero: a zero query gives a uniform map, not the baseline's)" if q[:, 1].abs().sum() == 0 else ""
            fail(f"{label}: query head 2i+1 (the negative map) must mirror head 2i{hint}, so that both maps are equal")
        o = new.o_proj.weight.double()
        for factor, hint in [(1.0, "o_proj is the baseline's out_proj as it is: with lambda = 1/2 the pair outputs "
                                   "a - a/2 = a/2, so o_proj must be out_proj * 2"),
                             (0.5, "o_proj is out_proj / 2: the pair outputs a/2, so o_proj must double it, not halve")]:
            if torch.allclose(o, base.out_proj.weight * factor):
                fail(f"{label}: {hint}")
        x = randn(2, 7, C, seed=1410 + i)
        rope = tuple(t.double() for t in rope_cos_sin(7, d))
        expect(new.double()(x, rope=rope, causal=True), base(x, rope=rope, causal=True), what=label,
               default_hint="Mirror the queries, copy k and v, zero lambda_proj, double o_proj.")
    passed("query heads 2i and 2i+1 are both baseline head i, lambda = 1/2 everywhere and o_proj doubled: the same "
           "function as the baseline, GQA included.")


# --- TASK 2: the positive term of a split V1 conversion -----------------------------------------------------------

_SPLIT_CASES = [(1, 4, 6, 4), (2, 2, 5, 8), (1, 6, 4, 4)]  # (B, H, N, d)


def _shared(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True) -> Tensor:
    """The reference: pair i = baseline heads i and i + H/2; its map 1 is head i's, its value [v_i, v_{i+H/2}]."""
    half = q.shape[1] // 2
    wide = torch.cat([v[:, :half], v[:, half:]], dim=-1)  # (B, H/2, N, 2d)
    return softmax_attention(q[:, :half], k[:, :half], wide, causal=causal, backend="naive")


@exercise_check(task=2, name="shared_map_values")
def check_shared_map_values(fn: Callable) -> None:
    """``fn(q, k, v)``: the baseline's per-head ``q, k, v`` ``(B, H, N, d)`` (after RoPE) -> ``(B, H/2, N, 2d)``,
    V1's positive term after a conversion that pairs the baseline's heads by halves."""
    what = "shared_map_values"
    for i, (B, H, N, d) in enumerate(_SPLIT_CASES):
        q, k, v = (randn(B, H, N, d, seed=1420 + 10 * i + j) for j in range(3))
        label = f"{what} (B={B}, H={H}, N={N}, d={d})"
        got = call(fn, q, k, v, what=label)
        half = H // 2
        wide = torch.cat([v[:, :half], v[:, half:]], dim=-1)

        def attend(qq, kk, vv, causal=True):
            return softmax_attention(qq, kk, vv, causal=causal, backend="naive")

        adjacent_v = torch.cat([v[:, 0::2], v[:, 1::2]], dim=-1)
        expect(got, _shared(q, k, v), what=label, wrong={
            "the pairs are adjacent heads (2i with 2i + 1, the course's heads='split'): this conversion pairs "
            "baseline head i with head i + H/2, the first half of the heads with the second":
                attend(q[:, 0::2], k[:, 0::2], adjacent_v),
            "the map of head i + H/2 is used: the positive term is the map of the first head of the pair, head i":
                attend(q[:, half:], k[:, half:], wide),
            "the value halves are in the wrong order: the positive map's own head i comes first, [v_i, v_{i+H/2}]":
                attend(q[:, :half], k[:, :half], torch.cat([v[:, half:], v[:, :half]], dim=-1)),
            "the values are reshaped instead of concatenated: a reshape to (B, H/2, N, 2d) mixes the rows of two "
            "tokens; put the two heads' values side by side along the last dim":
                attend(q[:, :half], k[:, :half], v.reshape(B, half, N, 2 * d)),
            "the causal mask is missing": attend(q[:, :half], k[:, :half], wide, causal=False),
            "the scores are not scaled by 1/sqrt(d)": attend(q[:, :half] * math.sqrt(d), k[:, :half], wide),
            "this is V1's whole output with lambda = 1 (A1 v - A2 v): return the positive term A1 v only":
                attend(q[:, :half], k[:, :half], wide) - attend(q[:, half:], k[:, half:], wide),
        }, default_hint="Pair i is baseline heads i and i + H/2: compare which head's map you take and which "
                        "values you put side by side.")
    passed("one map per pair applied to a value of width 2d: its first half is baseline head i's output, its "
           "second half is not head i + H/2's.")


# --- TASK 3: the fine-tuning loop with the negative branch's warm-up ----------------------------------------------

_FT_STEPS, _FT_WARMUP, _FT_LR = 5, 3, 0.05


def _reference(model, batches, *, lr, warmup_steps, variant: str = "") -> tuple[list[float], Tensor]:
    from diffattn_tutorial.training.study import retrieval_loss

    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for t, batch in enumerate(batches):
        mix = {"none": 1.0, "late": warmup_mix(t + 1, warmup_steps),
               "floor": float(t >= warmup_steps)}.get(variant, warmup_mix(t, warmup_steps))
        if variant != "after":
            set_warmup(model, mix)
        loss = retrieval_loss(model, batch)
        if variant != "accumulate":
            opt.zero_grad()
        loss.backward()
        opt.step()
        if variant == "after":
            set_warmup(model, mix)
        losses.append(loss.item())
    return losses, torch.cat([p.detach().flatten() for p in model.parameters()])


def _tiny_converted():
    from diffattn_tutorial.training.model import build_model
    from diffattn_tutorial.training.needle import NeedleTask

    task = NeedleTask()
    with seeded(1440):
        base = build_model("baseline", task.vocab_size, d_model=16, n_layers=1, n_heads=2,
                           max_len=task.seq_len(2)).double()
    model = convert_model(base, "diff_v2", negative="zero", warmup=True)
    gen = torch.Generator().manual_seed(1441)
    batches = [task.sample(2, 2, 2, generator=gen) for _ in range(_FT_STEPS)]
    return model, batches


_WRONG_FINETUNES = [
    ("none", "the warm-up is missing: lambda_mix must be set before every step's forward, from 0 at step 0 to 1 at "
             "step warmup_steps, so the model starts as the baseline"),
    ("late", "the warm-up is one step ahead (mix = (t + 1) / warmup_steps): at step 0 the negative branch must be "
             "off, mix = t / warmup_steps"),
    ("floor", "the mix jumps from 0 to 1 at step warmup_steps (integer division, t // warmup_steps?): it rises "
              "step by step, mix = min(1, t / warmup_steps)"),
    ("after", "lambda_mix is set after the step: set it before the forward of the step it belongs to"),
    ("accumulate", "the gradients are never zeroed: call opt.zero_grad() every step, or they add up")]


@functools.lru_cache(maxsize=1)
def _finetune_case() -> tuple:
    """The model, its batches, the right losses and final weights, and the losses of each mistake: computed once
    per process (every call of the check, a mutation run's too, would train the same five runs again); callers
    get copies of the model and the batches."""
    model, batches = _tiny_converted()
    want, want_params = _reference(copy.deepcopy(model), batches, lr=_FT_LR, warmup_steps=_FT_WARMUP)
    wrong = {hint: torch.tensor(_reference(copy.deepcopy(model), batches, lr=_FT_LR, warmup_steps=_FT_WARMUP,
                                           variant=variant)[0], dtype=torch.float64)
             for variant, hint in _WRONG_FINETUNES}
    return model, batches, torch.tensor(want, dtype=torch.float64), want_params, wrong


@exercise_check(task=3, name="finetune")
def check_finetune(fn: Callable) -> None:
    """``fn(model, batches, *, lr, warmup_steps)``: fine-tunes ``model`` in place with the warm-up, one step per
    batch; returns the loss of every step."""
    what = f"finetune (SGD, {_FT_STEPS} steps, warmup_steps={_FT_WARMUP})"
    model, batches, want, want_params, wrong = _finetune_case()
    learner = copy.deepcopy(model)
    try:
        got = call(fn, learner, copy.deepcopy(batches), lr=_FT_LR, warmup_steps=_FT_WARMUP, what=what)
    except CheckFailed as e:
        if "modified by an inplace operation" in str(e):
            fail(f"{what}: set_warmup ran between a step's forward and its backward. It changes lambda_mix in place, "
                 f"and the backward needs the value the forward used: set the mix before the step's forward")
        raise
    if not isinstance(got, (list, tuple)) or len(got) != _FT_STEPS:
        fail(f"{what} should return a list of {_FT_STEPS} losses, one per batch, got {type(got).__name__}"
             + (f" of length {len(got)}" if isinstance(got, (list, tuple)) else ""))
    if any(isinstance(x, torch.Tensor) for x in got):
        fail(f"{what} should return Python numbers, loss.item(), not tensors (each would carry its step's autograd "
             f"history; loss.item() is the plain number the losses are compared as)")
    try:
        got_t = torch.tensor([float(x) for x in got], dtype=torch.float64)
    except (TypeError, ValueError):
        fail(f"{what} should return numbers (loss.item()), got {[type(x).__name__ for x in got][:2]}")
    expect(got_t, want, what=f"{what}: the loss of each step", wrong=wrong,
           default_hint="One SGD step per batch on retrieval_loss, set_warmup(model, min(1, t / warmup_steps)) "
                        "before each forward.")
    params = torch.cat([p.detach().flatten() for p in learner.parameters()])
    if not close(params, want_params, rtol=1e-6, atol=1e-8):
        fail(f"{what}: the losses match but the model's final weights do not: train the model you were given, in "
             f"place, and take the optimizer step after the last batch too")
    passed("the negative branch fades in from 0 (the baseline's function) to 1 over warmup_steps, one SGD step per "
           "batch.")
