"""The checks of exercise 13 pass right answers and name each plausible wrong one: mutants of the static-cache
step, of the split-K combine and of the sampler."""

import math

import pytest
import torch

from diffattn_tutorial.checks import CheckFailed, NotAttempted
from diffattn_tutorial.checks.nb13 import check_combine_splits, check_sample_next, check_static_step
from diffattn_tutorial.training.model import next_token

# --- TASK 1 -----------------------------------------------------------------------------------------------------


def step(q, k_new, v_new, k_buf, v_buf, pos, *, write_at=0, keys=1, scale=True, in_place=True, v_too=True):
    if in_place:
        k_buf[:, :, pos + write_at] = k_new[:, :, 0]
        if v_too:
            v_buf[:, :, pos + write_at] = v_new[:, :, 0]
    scores = q @ k_buf.transpose(-1, -2) / (math.sqrt(q.shape[-1]) if scale else 1.0)
    visible = torch.arange(k_buf.shape[2]) < pos + keys
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v_buf


def test_static_step_accepts_right_answers(capsys):
    check_static_step(step)

    def index_copy(q, k_new, v_new, k_buf, v_buf, pos):
        idx = torch.tensor([pos])
        k_buf.index_copy_(2, idx, k_new)
        v_buf.index_copy_(2, idx, v_new)
        return torch.nn.functional.scaled_dot_product_attention(
            q, k_buf, v_buf, attn_mask=(torch.arange(k_buf.shape[2]) <= pos)[None, :])

    check_static_step(index_copy)
    assert capsys.readouterr().out.count("PASSED") == 2


@pytest.mark.parametrize("kw, match", [
    (dict(keys=0), "own key is masked out|NaN"),
    (dict(keys=100), "unwritten slots are not masked"),
    (dict(scale=False), "not scaled"),
    (dict(in_place=False), "left the buffers unchanged"),
    (dict(write_at=1), "one slot too far|raised IndexError"),
    (dict(v_too=False), "wrong slots"),
])
def test_static_step_mistakes_are_named(kw, match):
    with pytest.raises(CheckFailed, match=match):
        check_static_step(lambda *a: step(*a, **kw))


def test_static_step_copy_not_in_place_is_caught():
    def on_copy(q, k_new, v_new, k_buf, v_buf, pos):
        k_buf, v_buf = k_buf.clone(), v_buf.clone()
        return step(q, k_new, v_new, k_buf, v_buf, pos)

    with pytest.raises(CheckFailed, match="in place"):
        check_static_step(on_copy)


# --- TASK 2 -----------------------------------------------------------------------------------------------------


def combine(outs, lses, lam, *, sub_max=True, normalise=True, base=math.e, sign=-1.0, maps=(0, 1)):
    w = torch.pow(base, lses - (lses.amax(0) if sub_max else 0.0))
    o = (w * outs).sum(0) / (w.sum(0) if normalise else 1.0)
    return o[:, :, maps[0]] + sign * lam * o[:, :, maps[1]]


def test_combine_splits_accepts_right_answer(capsys):
    check_combine_splits(combine)
    check_combine_splits(lambda outs, lses, lam: combine(outs, lses, lam, base=math.e))
    assert capsys.readouterr().out.count("PASSED") == 2


@pytest.mark.parametrize("kw, match", [
    (dict(sub_max=False), "NaN|differs"),
    (dict(normalise=False), "not divided by the sum of the weights"),
    (dict(base=2.0), "base 2"),
    (dict(sign=1.0), r"o1 \+ lam \* o2"),
    (dict(maps=(1, 0)), "maps are swapped"),
])
def test_combine_splits_mistakes_are_named(kw, match):
    with pytest.raises(CheckFailed, match=match):
        check_combine_splits(lambda outs, lses, lam: combine(outs, lses, lam, **kw))


def test_combine_splits_equal_weights_named():
    with pytest.raises(CheckFailed, match="averaged with equal weights"):
        check_combine_splits(lambda outs, lses, lam: outs.mean(0)[:, :, 0] - lam * outs.mean(0)[:, :, 1])


# --- TASK 3 -----------------------------------------------------------------------------------------------------


def sample(logits, temperature, top_k, generator, *, scale="divide", keep="ties", fill=float("-inf"),
           use_top_k=True):
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    z = logits / temperature if scale == "divide" else logits * temperature
    if top_k is not None and use_top_k:
        kth = z.topk(min(top_k, z.shape[-1]), dim=-1).values[:, -1:]
        z = z.masked_fill(z <= kth if keep == "strict" else z < kth, fill)
    return torch.multinomial(torch.softmax(z, -1), 1, generator=generator)


def test_sample_next_accepts_right_answers(capsys):
    check_sample_next(sample)
    check_sample_next(lambda logits, t, k, g: next_token(logits, temperature=t, top_k=k, generator=g))
    assert capsys.readouterr().out.count("PASSED") == 2


@pytest.mark.parametrize("kw, match", [
    (dict(scale="multiply"), "multiplied by the temperature"),
    (dict(keep="strict"), r"<= instead of <|raised RuntimeError"),
    (dict(fill=0.0), "set to 0"),
    (dict(use_top_k=False), "top_k is ignored"),
])
def test_sample_next_mistakes_are_named(kw, match):
    with pytest.raises(CheckFailed, match=match):
        check_sample_next(lambda *a: sample(*a, **kw))


@pytest.mark.parametrize("fn, match", [
    (lambda logits, t, k, g: torch.multinomial(torch.softmax(logits, -1), 1, generator=g), "not greedy"),
    # a 1-D result: the shape is the mistake, not the dtype (both are int64)
    (lambda logits, t, k, g: logits.argmax(-1), r"should return shape \(64, 1\).*got shape \(64,\): the column "
                                                r"dimension was dropped"),
    (lambda logits, t, k, g: logits.argmax(-1, keepdim=True).float(), r"as torch.long \(int64\), got dtype "
                                                                      r"torch.float32"),
    (lambda logits, t, k, g: (torch.rand(1, generator=g), sample(logits, t, k, g))[1], "different tokens"),
])
def test_sample_next_other_mistakes(fn, match):
    with pytest.raises(CheckFailed, match=match):
        check_sample_next(fn)


def test_stubs_report_not_attempted():
    def stub(*args):
        raise NotImplementedError

    for check in (check_static_step, check_combine_splits, check_sample_next):
        with pytest.raises(NotAttempted):
            check(stub)
