"""Checks for ``exercises/02_softmax_attention_and_noise.ipynb``: scaled dot-product attention over padded keys
(without PyTorch's or the library's attention) and the share of attention that lands on the answer versus the noise. References: ``functional.softmax_attention``
and ``measure.attention_stats.answer_noise_shares``."""

from __future__ import annotations

from typing import Callable

import torch

from diffattn_tutorial.checks._core import call, exercise_check, expect, expect_grads, fail, passed, randn
from diffattn_tutorial.functional import softmax_attention
from diffattn_tutorial.measure.attention_stats import answer_noise_shares

__all__ = ["check_attention", "check_answer_noise_shares"]

Tensor = torch.Tensor

# (B, H, Nq, Nk, d, dv): odd lengths, Nq != Nk, dv != d so a scale by sqrt(dv) shows, batch > 1; the first has
# Nq == Nk, so that a mask over the queries has the keys' shape (and gets its hint, not a crash)
_ATTN_SHAPES = [(3, 2, 9, 9, 16, 4), (2, 3, 5, 7, 8, 6), (3, 1, 4, 11, 4, 10)]


def _keep(B: int, nk: int, seed: int) -> Tensor:
    """A padding mask ``(B, Nk)``, True = a real key: sequence b keeps its first ``length_b`` keys, at least one
    and fewer than Nk (every sequence is padded, so an inverted mask has a key in every row too)."""
    lengths = torch.randint(1, nk, (B,), generator=torch.Generator().manual_seed(seed))
    return torch.arange(nk) < lengths[:, None]


def _manual(q, k, v, keep, *, scale, dim=-1, fill=float("-inf"), after=False, axis="keys"):
    """Attention with one mistake at a time (the knobs), for the hints."""
    s = q @ k.transpose(-1, -2) * scale  # (B, H, Nq, Nk)
    m = keep[:, None, None, :] if axis == "keys" else keep[:, None, :, None]
    if after:
        return torch.softmax(s, dim=dim).masked_fill(~m, 0.0) @ v
    return torch.softmax(s.masked_fill(~m, fill), dim=dim) @ v


def _reference(q, k, v, keep):
    return softmax_attention(q, k, v, attn_mask=keep[:, None, None, :], backend="naive")


def _attention_implementations() -> dict:
    import diffattn_tutorial.formulations as formulations
    return {torch.nn.functional.scaled_dot_product_attention: "PyTorch's scaled_dot_product_attention",
            softmax_attention: "the library's softmax_attention",
            **{f: f"the library's {f.__name__}" for f in vars(formulations).values()
               if callable(f) and getattr(f, "__module__", "") == formulations.__name__ and "attention" in f.__name__}}


@exercise_check(task=1, name="attention", refuses=_attention_implementations)
def check_attention(fn: Callable) -> None:
    """``fn(q, k, v, keep)`` with q ``(B, H, Nq, d)``, k ``(B, H, Nk, d)``, v ``(B, H, Nk, dv)`` and ``keep`` a bool
    ``(B, Nk)`` (True = a real key, False = padding) -> ``(B, H, Nq, dv)``."""
    what = "attention"
    for i, (B, H, nq, nk, d, dv) in enumerate(_ATTN_SHAPES):
        q, k, v = randn(B, H, nq, d, seed=100 + i) * 1.5, randn(B, H, nk, d, seed=110 + i) * 1.5, randn(B, H, nk, dv, seed=120 + i)
        keep = _keep(B, nk, seed=140 + i)
        expected = _reference(q, k, v, keep)
        got = call(fn, q, k, v, keep.clone(), what=what)
        if isinstance(got, torch.Tensor) and got.shape == (B, H, nq, nk):
            fail(f"{what} returned the attention map (B, H, Nq, Nk): the output is the weighted sum of the values, "
                 f"(B, H, Nq, dv)")
        wrong = {
            "the padding keys still get weight: keep is False for padding, and a padding key must get none":
                _manual(q, k, v, torch.ones_like(keep), scale=d ** -0.5),
            "the mask is inverted: keep is True for the real keys, False for padding":
                _manual(q, k, v, ~keep, scale=d ** -0.5),
            "the padding weights were set to 0 after the softmax: the weights left no longer sum to 1; a padding "
            "key must be out of the softmax itself": _manual(q, k, v, keep, scale=d ** -0.5, after=True),
            "the padding scores were set to 0: a score of 0 still gets weight exp(0) in the softmax; a padding key "
            "needs a score that the softmax turns into exactly 0": _manual(q, k, v, keep, scale=d ** -0.5, fill=0.0),
            "forgot the scale: divide the scores q k^T by sqrt(d) before the softmax": _manual(q, k, v, keep, scale=1.0),
            "scaled by 1/d: the scale is 1/sqrt(d)": _manual(q, k, v, keep, scale=1 / d),
            "scaled by the value width: the scale is 1/sqrt(d) with d the q/k head dim, not v's width dv":
                _manual(q, k, v, keep, scale=dv ** -0.5),
            "multiplied by sqrt(d) instead of dividing": _manual(q, k, v, keep, scale=d ** 0.5),
            "normalised over the wrong axis: the softmax runs over the keys (the last axis of the scores), so "
            "each query's weights sum to 1": _manual(q, k, v, keep, scale=d ** -0.5, dim=-2),
        }
        if nq == nk:
            wrong["masked the queries instead of the keys: keep (B, Nk) marks keys, so it broadcasts as (B, 1, 1, Nk) "
                  "against the (B, H, Nq, Nk) scores"] = _manual(q, k, v, keep, scale=d ** -0.5, axis="queries")
        expect(got, expected, what=what, wrong=wrong)
    B, H, nq, nk, d, dv = _ATTN_SHAPES[0]
    keep = _keep(B, nk, seed=150)
    expect_grads(lambda q, k, v: fn(q, k, v, keep.clone()), lambda q, k, v: _reference(q, k, v, keep),
                 {"q": randn(B, H, nq, d, seed=130), "k": randn(B, H, nk, d, seed=131),
                  "v": randn(B, H, nk, dv, seed=132)}, what=what)
    passed("softmax(q k^T / sqrt(d)) v over the real keys only, gradients included.")


def _shares_case(i: int, B: int, H: int, nq: int, nk: int, per_batch: bool, differential: bool):
    """A map (softmax, or a differential map A1 - lambda A2 whose rows sum to 1 - lambda and hold negative
    entries), and answer/context masks; the context never covers every key (a first token, the question)."""
    attn = torch.softmax(randn(B, H, nq, nk, seed=200 + i) * 2, dim=-1)
    if differential:
        attn = attn - 0.7 * torch.softmax(randn(B, H, nq, nk, seed=220 + i) * 2, dim=-1)
    g = torch.Generator().manual_seed(210 + i)
    if per_batch:  # one answer span and context per sequence, (B, 1, 1, Nk)
        answer = torch.zeros(B, 1, 1, nk, dtype=torch.bool)
        context = torch.zeros(B, 1, 1, nk, dtype=torch.bool)
        for b in range(B):
            s = int(torch.randint(1, nk - 3, (1,), generator=g))
            answer[b, 0, 0, s:s + 2] = True
            context[b, 0, 0, 1:nk - 1] = True
    else:  # one span for the whole batch, (Nk,)
        answer = torch.zeros(nk, dtype=torch.bool)
        answer[nk // 2:nk // 2 + 3] = True
        context = torch.zeros(nk, dtype=torch.bool)
        context[1:nk - 2] = True  # not every key is context (e.g. a first token and the question)
    return attn, answer, context


_CLAMP_HINT = ("clamped the map's negative weights to 0: a differential map has negative entries, and they count "
               "with their sign (a negative weight on the noise is noise being cancelled)")
_ABS_HINT = ("took the absolute value of the map: a differential map's negative weights count with their sign "
             "(a negative weight on the noise is noise being cancelled)")
_RENORM_HINT = ("renormalised the rows of the map: a differential map's rows sum to 1 - lambda, not 1, and the "
                "shares are measured on the map as it is")
_OUT_SIGN_HINT = ("{name} lost its sign: on a differential map a share can be negative (more weight subtracted "
                  "than added there); keep the sum as it is, no absolute value or clamp")


@exercise_check(task=2, name="answer_noise_shares",
                refuses=lambda: {answer_noise_shares: "the library's answer_noise_shares"})
def check_answer_noise_shares(fn: Callable) -> None:
    """``fn(attn, answer, context)`` -> ``(to_answer, to_noise)``, each ``(..., Nq)``.

    ``attn`` ``(..., Nq, Nk)``; ``answer`` and ``context`` bool masks broadcastable to it. Noise is the
    context outside the answer. The maps include differential ones (negative entries, rows summing to 1 - lambda).
    """
    what = "answer_noise_shares"
    for i, (B, H, nq, nk, per_batch, diff) in enumerate([(2, 3, 5, 13, False, False), (3, 2, 1, 9, True, True),
                                                         (1, 4, 7, 17, True, True), (2, 2, 6, 11, False, True)]):
        attn, answer, context = _shares_case(i, B, H, nq, nk, per_batch, diff)
        exp_a, exp_n = answer_noise_shares(attn, answer, context)
        res = call(fn, attn, answer, context, what=what)
        if not isinstance(res, (tuple, list)) or len(res) != 2:
            fail(f"{what} should return a pair (to_answer, to_noise), got {type(res).__name__}")
        got_a, got_n = res
        for name, got in (("to_answer", got_a), ("to_noise", got_n)):
            if isinstance(got, torch.Tensor) and got.shape != exp_a.shape and nq != nk:
                if got.shape == attn.sum(-2).shape:
                    fail(f"{what}: {name} has shape {tuple(got.shape)}: you summed over the queries; a share sums "
                         f"one query's weights over the keys, one share per query")
                if got.numel() == 1:
                    fail(f"{what}: {name} is a single number: keep one share per query, shape (..., Nq)")
        a_f, c_f = answer.to(attn.dtype), context.to(attn.dtype)
        n_f = (context & ~answer).to(attn.dtype)
        maps = {_CLAMP_HINT: attn.clamp(min=0), _ABS_HINT: attn.abs(), _RENORM_HINT: attn / attn.sum(-1, keepdim=True),
                "clamped the map's negative weights to 0 and renormalised the rows: a differential map is measured "
                "as it is, negative entries and rows summing to 1 - lambda included":
                    attn.clamp(min=0) / attn.clamp(min=0).sum(-1, keepdim=True)}
        if not diff:  # a softmax map has neither negative entries nor rows that sum to anything but 1
            maps = {}
        expect(got_a, exp_a, what=f"{what} (to_answer)", wrong={
            "the pair is in the wrong order: return (to_answer, to_noise)": exp_n,
            "averaged instead of summed: the share is the sum of the attention weights on the answer positions":
                (attn * a_f).sum(-1) / a_f.sum(-1).clamp_min(1),
            "averaged over all keys instead of summed: the share is the sum of the attention weights on the "
            "answer positions": (attn * a_f).mean(-1),
            "the answer mask is not applied: the share counts only the weights on the answer positions":
                attn.sum(-1),
            **{hint: (m * a_f).sum(-1) for hint, m in maps.items()},
            **({_OUT_SIGN_HINT.format(name="to_answer"): exp_a.abs()} if diff else {}),
            **({_OUT_SIGN_HINT.format(name="to_answer") + " (here it was clamped at 0)": exp_a.clamp(min=0)}
               if diff else {}),
        })
        expect(got_n, exp_n, what=f"{what} (to_noise)", wrong={
            "the noise includes the answer: noise is the context outside the answer span":
                (attn * c_f).sum(-1),
            "the noise is everything that is not the answer: keys that are not context (a first token, the "
            "question) count for neither share": (attn * (~answer).to(attn.dtype)).sum(-1),
            "the pair is in the wrong order: return (to_answer, to_noise)": exp_a,
            "averaged instead of summed: the share is the sum of the attention weights on the noise positions":
                (attn * n_f).sum(-1) / n_f.sum(-1),
            "averaged over all keys instead of summed: the share is the sum of the attention weights on the "
            "noise positions": (attn * n_f).mean(-1),
            "the noise mask is not applied: the share counts only the weights on the noise positions":
                attn.sum(-1),
            **{hint: (m * n_f).sum(-1) for hint, m in maps.items()},
            **({_OUT_SIGN_HINT.format(name="to_noise"): exp_n.abs()} if diff else {}),
            **({_OUT_SIGN_HINT.format(name="to_noise") + " (here it was clamped at 0)": exp_n.clamp(min=0)}
               if diff else {}),
        })
    passed("attention to the answer span and to the rest of the context (noise), one share per query.")
