"""The checks of exercise 13 pass right answers and name each plausible wrong one: mutants of the static-cache
step, of the split-K combine and of the sampler."""

import math

import pytest
import torch

from diffattn_tutorial.checks import CheckFailed, NotAttempted
from diffattn_tutorial.checks.nb13 import check_combine_splits, check_sample_next, check_static_step
from diffattn_tutorial.training.model import next_token

# --- TASK 1 -----------------------------------------------------------------------------------------------------


def step(q, k_new, v_new, k_buf, v_buf, pos, *, write_at=0, keys=1, scale=True, in_place=True, v_too=True,
         first_only=False):
    """The batched static step (``pos`` a ``(B,)`` tensor), right or with one deliberate mistake."""
    rows = torch.arange(k_buf.shape[0])
    where = pos[:1].expand_as(pos) if first_only else pos
    if in_place:
        k_buf[rows, :, where + write_at] = k_new[:, :, 0]
        if v_too:
            v_buf[rows, :, where + write_at] = v_new[:, :, 0]
    scores = q @ k_buf.transpose(-1, -2) / (math.sqrt(q.shape[-1]) if scale else 1.0)
    visible = torch.arange(k_buf.shape[2])[None, :] < (where + keys)[:, None]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v_buf


def test_static_step_accepts_right_answers(capsys):
    check_static_step(step)

    def loop(q, k_new, v_new, k_buf, v_buf, pos):  # one sequence at a time, with index_copy_ and SDPA
        outs = []
        for b in range(q.shape[0]):
            idx = pos[b:b + 1]
            k_buf[b].index_copy_(1, idx, k_new[b])
            v_buf[b].index_copy_(1, idx, v_new[b])
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                q[b:b + 1], k_buf[b:b + 1], v_buf[b:b + 1], attn_mask=(torch.arange(k_buf.shape[2]) <= pos[b])[None, :]))
        return torch.cat(outs)

    check_static_step(loop)
    assert capsys.readouterr().out.count("PASSED") == 2


@pytest.mark.parametrize("kw, match", [
    (dict(keys=0), "own key is masked out"),  # `< pos`: at pos 0 a softmax over no key is NaN, named all the same
    (dict(keys=100), "unwritten slots are not masked"),
    (dict(scale=False), "not scaled"),
    (dict(in_place=False), "left the buffers unchanged"),
    (dict(write_at=1), "one slot too far|raised IndexError"),
    (dict(v_too=False), "wrong slots"),
    (dict(first_only=True), "first sequence's position"),
])
def test_static_step_mistakes_are_named(kw, match):
    with pytest.raises(CheckFailed, match=match):
        check_static_step(lambda *a: step(*a, **kw))


def test_static_step_one_mask_for_the_batch_is_named():
    def one_mask(q, k_new, v_new, k_buf, v_buf, pos):  # writes right, masks every sequence at pos[0]
        rows = torch.arange(k_buf.shape[0])
        k_buf[rows, :, pos] = k_new[:, :, 0]
        v_buf[rows, :, pos] = v_new[:, :, 0]
        scores = q @ k_buf.transpose(-1, -2) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~(torch.arange(k_buf.shape[2]) <= pos[0]), float("-inf"))
        return torch.softmax(scores, dim=-1) @ v_buf

    with pytest.raises(CheckFailed, match="masked at the first sequence's position"):
        check_static_step(one_mask)


def test_static_step_copy_not_in_place_is_caught():
    def on_copy(q, k_new, v_new, k_buf, v_buf, pos):
        k_buf, v_buf = k_buf.clone(), v_buf.clone()
        return step(q, k_new, v_new, k_buf, v_buf, pos)

    with pytest.raises(CheckFailed, match="in place"):
        check_static_step(on_copy)


# --- TASK 2 -----------------------------------------------------------------------------------------------------


def combine(outs, lses, lam, *, shift="splits", normalise=True, base=math.e, sign=-1.0, maps=(0, 1), lse="right"):
    m = {"splits": lses.amax(0), "global": lses.amax(), "none": torch.zeros_like(lses[0])}[shift]
    w = torch.pow(base, lses - m)
    o = (w * outs).sum(0) / (w.sum(0) if normalise else 1.0)
    m0 = lses.amax(0)
    total = {"right": m0 + torch.log(torch.exp(lses - m0).sum(0)), "no_max": torch.log(torch.exp(lses - m0).sum(0)),
             "max_only": m0, "sum": lses.sum(0), "overflow": torch.log(torch.exp(lses).sum(0))}[lse]
    return o[:, :, maps[0]] + sign * lam * o[:, :, maps[1]], total


def test_combine_splits_accepts_right_answer(capsys):
    check_combine_splits(combine)
    check_combine_splits(lambda outs, lses, lam: (combine(outs, lses, lam)[0], torch.logsumexp(lses, dim=0)))
    assert capsys.readouterr().out.count("PASSED") == 2


@pytest.mark.parametrize("kw, match", [
    (dict(shift="none"), "no max is subtracted before the exponential"),
    (dict(shift="global"), "one max over everything is subtracted"),
    (dict(normalise=False), "not divided by the sum of the weights"),
    (dict(base=2.0), "base 2"),
    (dict(sign=1.0), r"o1 \+ lam \* o2"),
    (dict(maps=(1, 0)), "maps are swapped"),
    (dict(lse="no_max"), "max was not added back"),
    (dict(lse="max_only"), "largest split's only"),
    (dict(lse="sum"), "sum of the splits' log-sum-exps"),
    (dict(lse="overflow"), r"log\(sum_s exp\(lse_s\)\) overflows"),
])
def test_combine_splits_mistakes_are_named(kw, match):
    with pytest.raises(CheckFailed, match=match):
        check_combine_splits(lambda outs, lses, lam: combine(outs, lses, lam, **kw))


def test_combine_splits_equal_weights_and_a_missing_lse_are_named():
    with pytest.raises(CheckFailed, match="averaged with equal weights"):
        check_combine_splits(lambda outs, lses, lam: (outs.mean(0)[:, :, 0] - lam * outs.mean(0)[:, :, 1],
                                                      torch.logsumexp(lses, dim=0)))
    with pytest.raises(CheckFailed, match=r"should return two tensors, \(out, lse\)"):
        check_combine_splits(lambda outs, lses, lam: combine(outs, lses, lam)[0])


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
    assert capsys.readouterr().out.count("PASSED") == 1
    with pytest.raises(CheckFailed, match="calls the library's next_token"):  # right, but not written by hand
        check_sample_next(lambda logits, t, k, g: next_token(logits, temperature=t, top_k=k, generator=g))


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
