"""The checks of exercise 14 pass right answers and name each plausible wrong one: mutants of the exact V2
conversion, of V1's shared-map positive term and of the fine-tuning loop with the negative branch's warm-up."""

import copy
import math

import pytest
import torch

from diffattn_tutorial.checks import CheckFailed, NotAttempted
from diffattn_tutorial.checks.nb14 import check_finetune, check_mirror_to_v2, check_shared_map_values
from diffattn_tutorial.layers.attention import DiffAttnV2
from diffattn_tutorial.layers.convert import set_warmup, to_diff_v2
from diffattn_tutorial.training.study import retrieval_loss

# --- TASK 1 -----------------------------------------------------------------------------------------------------


@torch.no_grad()
def mirror(layer, *, order="pairs", negative="mirror", scale=2.0, lam_zero=True, kv=True, gqa=True):
    H, d = layer.num_heads, layer.head_dim
    new = DiffAttnV2(layer.embed_dim, H, num_kv_heads=layer.num_kv_heads if gqa else None, head_dim=d)
    w = layer.q_proj.weight.unflatten(0, (H, d))
    neg = w if negative == "mirror" else torch.zeros_like(w)
    new.q_proj.weight.copy_(torch.stack([w, neg], 1).flatten(0, 2) if order == "pairs" else torch.cat([w, neg]).flatten(0, 1))
    if kv:
        new.k_proj.weight.copy_(layer.k_proj.weight)
        new.v_proj.weight.copy_(layer.v_proj.weight)
    new.o_proj.weight.copy_(layer.out_proj.weight * scale)
    if lam_zero:
        new.lambda_proj.weight.zero_()
    return new


def test_mirror_accepts_right_answers(capsys):
    check_mirror_to_v2(mirror)
    assert capsys.readouterr().out.count("PASSED") == 1


def test_mirror_refuses_the_library_converter():
    with pytest.raises(CheckFailed, match="calls the library's to_diff_v2: .*rule"):
        check_mirror_to_v2(to_diff_v2)
    with pytest.raises(CheckFailed, match="calls the library's to_diff_v2"):
        check_mirror_to_v2(lambda layer: to_diff_v2(layer))


@pytest.mark.parametrize("kwargs,hint", [
    (dict(scale=1.0), "out_proj \\* 2"), (dict(scale=0.5), "not halve"), (dict(negative="zero"), "it is zero"),
    (dict(order="blocked"), "interleave them"), (dict(lam_zero=False), "lambda_proj must start at zero"),
    (dict(kv=False), "k_proj and v_proj must be the baseline's"), (dict(gqa=False), "num_kv_heads"),
])
def test_mirror_names_the_mistake(kwargs, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_mirror_to_v2(lambda layer: mirror(layer, **kwargs))


def test_mirror_stub_and_wrong_type():
    def stub(layer):
        raise NotImplementedError

    with pytest.raises(NotAttempted):
        check_mirror_to_v2(stub)
    with pytest.raises(CheckFailed, match="should return a DiffAttnV2"):
        check_mirror_to_v2(lambda layer: layer)


# --- TASK 2 -----------------------------------------------------------------------------------------------------


def shared(q, k, v, *, first=0, causal=True, scale=True, values="cat", minus=False, pairs="halves"):
    """The positive term with one knob per mistake; pairs: "halves" (i with i + H/2) or "adjacent" (2i, 2i+1)."""
    d, h = q.shape[-1], q.shape[1] // 2
    one, two = (slice(0, h), slice(h, None)) if pairs == "halves" else (slice(0, None, 2), slice(1, None, 2))
    mine = two if first else one
    qq, kk = q[:, mine], k[:, mine]
    wide = torch.cat([v[:, one], v[:, two]], -1) if values == "cat" else v.reshape(v.shape[0], -1, v.shape[2], 2 * d)
    if values == "swapped":
        wide = torch.cat([v[:, two], v[:, one]], -1)
    s = qq @ kk.transpose(-1, -2) / (math.sqrt(d) if scale else 1.0)
    if causal:
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.softmax(s, -1) @ wide
    return out - shared(q, k, v, first=1, pairs=pairs) if minus else out


def test_shared_accepts_the_right_answer(capsys):
    check_shared_map_values(shared)
    assert "PASSED" in capsys.readouterr().out


@pytest.mark.parametrize("kwargs,hint", [
    (dict(first=1), "map of head i \\+ H/2"), (dict(causal=False), "causal mask"), (dict(scale=False), "1/sqrt"),
    (dict(values="reshape"), "reshaped instead of concatenated"), (dict(minus=True), "positive term A1 v only"),
    (dict(values="swapped"), "value halves are in the wrong order"),
    (dict(pairs="adjacent"), "adjacent heads \\(2i with 2i \\+ 1"),
])
def test_shared_names_the_mistake(kwargs, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_shared_map_values(lambda q, k, v: shared(q, k, v, **kwargs))


def test_set_warmup_between_forward_and_backward_is_named():
    """Not autograd's in-place error: what the learner did, and where the mix goes."""
    def between(model, batches, *, lr, warmup_steps):
        opt, losses = torch.optim.SGD(model.parameters(), lr=lr), []
        for t, batch in enumerate(batches):
            loss = retrieval_loss(model, batch)
            set_warmup(model, min(1.0, t / warmup_steps))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    with pytest.raises(CheckFailed, match="set_warmup ran between a step's forward and its backward") as info:
        check_finetune(between)
    assert "inplace" not in str(info.value)


# --- TASK 3 -----------------------------------------------------------------------------------------------------


def finetune(model, batches, *, lr, warmup_steps, shift=0, after=False, zero=True, none=False, n=None, item=True):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for t, batch in enumerate(batches):
        mix = 1.0 if none else min(1.0, (t + shift) / warmup_steps)
        if not after:
            set_warmup(model, mix)
        loss = retrieval_loss(model, batch)
        if zero:
            opt.zero_grad()
        loss.backward()
        opt.step()
        if after:
            set_warmup(model, mix)
        losses.append(loss.item() if item else loss)
    return losses[:n] if n else losses


@pytest.mark.slow
def test_finetune_accepts_the_right_answer_and_names_mistakes(capsys):
    check_finetune(finetune)
    assert "PASSED" in capsys.readouterr().out
    for kwargs, hint in [(dict(none=True), "warm-up is missing"), (dict(shift=1), "one step ahead"),
                         (dict(after=True), "set after the step"), (dict(zero=False), "never zeroed"),
                         (dict(n=3), "list of 5 losses"), (dict(item=False), r"not tensors")]:
        with pytest.raises(CheckFailed, match=hint):
            check_finetune(lambda m, b, **kw: finetune(m, b, **kw, **kwargs))

    def on_a_copy(model, batches, **kw):
        return finetune(copy.deepcopy(model), batches, **kw)

    with pytest.raises(CheckFailed, match="final weights"):
        check_finetune(on_a_copy)
