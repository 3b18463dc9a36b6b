"""Checks for ``exercises/07_experiments.ipynb``: the two measurements notebook 07 makes on a model's attention,
attention to the answer and to the noise from the query rows of a retrieval batch (the paper's Table 3), and the
attention-logit outlier ratio (Table 5). References: ``training.study.attention_scores`` and
``training.study.logit_outliers`` (through ``measure.attention_stats.answer_noise_shares`` and ``measure.attention_stats.top1_over_median``).

The inputs are maps and logits built here (causal, differential ones with negative entries, logits with
outliers of either sign) and the probes of small untrained models: no training, so the checks take a second.
"""

from __future__ import annotations

from typing import Callable

import torch

from diffattn_tutorial.checks._core import call, exercise_check, expect, fail, passed, randn
from diffattn_tutorial.checks._helpers import as_numbers, seeded
from diffattn_tutorial.measure.attention_stats import answer_noise_shares, top1_over_median
from diffattn_tutorial.training.model import AttentionProbe, build_model
from diffattn_tutorial.training.needle import NeedleTask
from diffattn_tutorial.training.study import attention_scores, logit_outliers

__all__ = ["check_query_shares", "check_logit_outlier_ratio"]

Tensor = torch.Tensor

_TASK = NeedleTask(context_len=24)  # a short haystack: the same structure, small maps


def _causal_maps(B: int, H: int, L: int, seed: int, differential: bool) -> Tensor:
    """Causal attention maps ``(B, H, L, L)``: softmax rows, or ``A1 - lambda A2`` (negative entries, rows
    summing to ``1 - lambda``)."""
    future = torch.ones(L, L, dtype=torch.bool).triu(1)
    a1 = torch.softmax((randn(B, H, L, L, seed=seed) * 2.5).masked_fill(future, float("-inf")), dim=-1)
    if not differential:
        return a1
    a2 = torch.softmax((randn(B, H, L, L, seed=seed + 1) * 2.5).masked_fill(future, float("-inf")), dim=-1)
    return a1 - 0.8 * a2


def _rows(maps: Tensor, pos: Tensor) -> Tensor:
    """Rows ``pos (B, R)`` of ``maps (B, H, L, L)``: ``(B, H, R, L)``."""
    B, H, _, L = maps.shape
    return maps.gather(2, pos[:, None, :, None].expand(B, H, -1, L))


def _model_maps(kind: str, seed: int, tokens: Tensor) -> Tensor:
    with seeded(seed):
        model = build_model(kind, _TASK.vocab_size, d_model=32, n_layers=1, n_heads=4).double().eval()
    with torch.no_grad():
        return model.probe(tokens)[0].maps


@exercise_check(task=1, name="query_shares", refuses=lambda: {attention_scores: "the library's attention_scores (training.study)"})
def check_query_shares(fn: Callable) -> None:
    """``fn(maps, batch)``: maps ``(B, H, L, L)`` of one layer, batch a ``NeedleBatch`` -> ``(to_answer,
    to_noise)``, each ``(B, H, R)``: the shares of the query rows (``batch.query_pos``) on each query's own answer
    needle and on the rest of the haystack."""
    what = "query_shares"
    cases = [("a DIFF map (negative entries, rows summing to 1 - lambda)", 3, 4, 2, "diff"),
             ("a softmax map", 2, 3, 3, "softmax"),
             ("an untrained DIFF TinyLM's map", 2, 2, 2, "model_diff"),
             ("an untrained baseline TinyLM's map", 2, 4, 1, "model_baseline")]
    for i, (name, B, H, R, kind) in enumerate(cases):
        batch = _TASK.sample(B, 4, R, generator=torch.Generator().manual_seed(700 + i))
        L = batch.tokens.shape[1]
        if kind.startswith("model_"):
            maps = _model_maps(kind[6:], 710 + i, batch.tokens)
            H = maps.shape[1]
        else:
            maps = _causal_maps(B, H, L, 720 + 2 * i, differential=kind == "diff")
        ref = attention_scores([AttentionProbe(maps, maps)], batch, layer=0)
        exp_a, exp_n = ref["answer"], ref["noise"]
        res = call(fn, maps.clone(), batch, what=what)
        if not isinstance(res, (tuple, list)) or len(res) != 2:
            fail(f"{what} should return a pair (to_answer, to_noise), got {type(res).__name__}")
        for label, got in zip(("to_answer", "to_noise"), res):
            if isinstance(got, Tensor) and got.shape == (B, R) and H > 1:
                fail(f"{what}: {label} has shape {tuple(got.shape)}: keep one share per head, (B, H, R); the paper "
                     f"averages over heads only when it reports")
            if isinstance(got, Tensor) and got.shape == (B, H, L):
                fail(f"{what}: {label} has shape {tuple(got.shape)}: that is one share per position; only the query "
                     f"rows count, the queried keys' positions, one share per query, (B, H, R)")
        context = batch.context_mask.expand_as(batch.answer_mask)[:, None]
        answer = batch.answer_mask[:, None]
        noise_f = (context & ~answer).to(maps.dtype)
        rows = _rows(maps, batch.query_pos)

        def shares(rows_, answer_=answer, context_=context):
            return answer_noise_shares(rows_, answer_, context_)

        def candidates() -> dict:
            next_pos = (batch.query_pos + 1).clamp_max(L - 1)
            prev_pos = batch.query_pos - 1
            cols = maps.gather(3, batch.query_pos[:, None, None, :].expand(B, maps.shape[1], L, -1)).transpose(2, 3)
            any_answer = batch.answer_mask.any(1, keepdim=True).expand_as(batch.answer_mask)[:, None]
            flipped = batch.answer_mask.flip(1)[:, None]
            return {
                "read the rows one position after the queried keys: the model predicts the answer value at the "
                "queried key itself (the next token is the value), so the query row is the key's position":
                    shares(_rows(maps, next_pos)),
                "read the rows one position before the queried keys (the query marker): the query row is the "
                "queried key's own position, where the model predicts the value": shares(_rows(maps, prev_pos)),
                "read columns instead of rows: row i of a map is query i's attention over the keys; a query's "
                "shares come from its own row": shares(cols),
                "counted every queried needle as the answer: each query row has its own answer needle (the mask "
                "for query r)": shares(rows, any_answer, context),
                "paired the query rows with the wrong answers: query r's answer needle is the r-th answer mask":
                    shares(rows, flipped, context),
                "clamped the map's negative weights to 0: a DIFF map's negative entries count with their sign":
                    shares(rows.clamp(min=0)),
                "renormalised the rows: a DIFF map's rows sum to 1 - lambda and are measured as they are":
                    shares(rows / rows.sum(-1, keepdim=True)),
                "the noise counts the whole row outside the answer: noise is the haystack (the context) outside "
                "the answer; the BOS token and the queries count for neither": (shares(rows)[0],
                                                                                   rows.sum(-1) - shares(rows)[0]),
                "the noise includes the answer: noise is the haystack outside the answer needle":
                    (shares(rows)[0], (rows * context.to(rows.dtype)).sum(-1)),
                "the pair is in the wrong order: return (to_answer, to_noise)": (exp_n, exp_a),
                "averaged the weights instead of summing them: a share is the sum of the row's weights on those "
                "positions": ((rows * answer.to(rows.dtype)).mean(-1), (rows * noise_f).mean(-1)),
            }

        for label, r, e in zip(("to_answer", "to_noise"), res, (exp_a, exp_n)):
            if not isinstance(r, Tensor) or r.shape != e.shape:
                expect(r, e, what=f"{what} ({label}) on {name}")  # names the type or shape that is wrong
        got, expected = torch.stack([res[0].to(exp_a.dtype), res[1].to(exp_a.dtype)]), torch.stack([exp_a, exp_n])
        wrong = {hint: torch.stack(list(pair)) for hint, pair in candidates().items()}
        expect(got, expected, what=f"{what} on {name}", wrong=wrong,
               default_hint="Gather each query's row (its queried key's position), then sum the row's weights on "
                            "that query's answer needle and on the rest of the haystack.")
    passed("shares of the query rows on their own answer needle and on the rest of the haystack, DIFF maps "
           "counted with their sign (the paper's Table 3 measurement).")


# --------------------------------------------------------------------------------------------
# TASK 2: the attention-logit outlier ratio
# --------------------------------------------------------------------------------------------


def _causal_logits(B: int, H: int, N: int, seed: int, scale: float, outliers: list[tuple[int, float]]) -> Tensor:
    """Pre-softmax scores ``(B, H, N, N)`` with ``-inf`` above the diagonal, a few large entries planted below."""
    x = randn(B, H, N, N, seed=seed) * scale
    flat = x.view(-1)
    i = torch.arange(N)
    lower = (i[:, None] >= i[None, :]).expand(B, H, N, N).reshape(-1).nonzero().flatten()
    for j, (where, value) in enumerate(outliers):
        flat[lower[where % len(lower)]] = value
    return x.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))


@exercise_check(task=2, name="logit_outlier_ratio", refuses=lambda: {
    logit_outliers: "the library's logit_outliers (training.study)",
    top1_over_median: "the library's top1_over_median (measure.attention_stats)"})
def check_logit_outlier_ratio(fn: Callable) -> None:
    """``fn(logits)``: a list of per-layer logits ``(B, Hq, N, N)`` (``-inf`` above the diagonal) -> the float
    ``max |logit| / median |logit|`` over the finite logits of every layer and head."""
    what = "logit_outlier_ratio"
    batch = _TASK.sample(2, 4, 2, generator=torch.Generator().manual_seed(760))
    with seeded(761):
        model = build_model("diff", _TASK.vocab_size, d_model=32, n_layers=2, n_heads=4).double().eval()
    with torch.no_grad():
        model_logits = [p.logits for p in model.probe(batch.tokens)]
    cases = [
        ("two layers of logits with a negative outlier", [
            _causal_logits(2, 4, 9, 770, 1.0, [(5, -40.0), (17, 12.0)]),
            _causal_logits(2, 4, 9, 771, 3.0, [(3, 25.0)])]),
        ("one layer, outliers of both signs", [_causal_logits(1, 6, 12, 772, 0.5, [(40, 18.0), (2, -30.0)])]),
        ("an untrained DIFF TinyLM's logits (two layers)", model_logits),
    ]
    for name, logits in cases:
        probes = [AttentionProbe(lg, lg) for lg in logits]
        expected = logit_outliers(probes)
        raw = call(fn, [lg.clone() for lg in logits], what=what)
        got = float(as_numbers([raw], what=what)[0])
        if got != got or got in (float("inf"), float("-inf")):
            fail(f"{what} on {name} returned {got}: the masked (future) positions hold -inf, which are no scores; "
                 f"measure only the finite logits")
        finite = torch.cat([lg[torch.isfinite(lg)] for lg in logits])
        zeros = torch.cat([torch.where(torch.isfinite(lg), lg, torch.zeros_like(lg)).flatten() for lg in logits])
        per_layer = [(lg[torch.isfinite(lg)].abs().max() / lg[torch.isfinite(lg)].abs().median()).item()
                     for lg in logits]
        a = finite.abs()
        wrong = {
            "counted the masked (future) positions as zeros: they are no scores, so they must not pull the median "
            "down; measure only the finite logits": (zeros.abs().max() / zeros.abs().median()).item(),
            "took the signed logits: an outlier is large in magnitude, of either sign; compare absolute values":
                (finite.max() / finite.median()).item(),
            "used the mean instead of the median: the paper's Table 5 divides the top-1 by the median, which a "
            "few outliers cannot move": (a.max() / a.mean()).item(),
            "the ratio is upside down: it is the largest magnitude over the median magnitude": (a.median() / a.max()).item(),
            "computed one ratio per layer: the paper pools every layer and head into one top-1 and one median":
                per_layer[-1],
            "averaged the per-layer ratios: pool every layer's finite logits, then take one top-1 and one median":
                sum(per_layer) / len(per_layer),
            "returned the top-1 alone: the ratio divides it by the median magnitude": a.max().item(),
            "took the magnitude of the top-1 but the signed median: both are of |logit|":
                (a.max() / finite.median()).item(),
            "took one layer's ratio (the largest per-layer one, or the first layer's): pool every layer's finite "
            "logits, then take one top-1 and one median": max(per_layer),
            "measured only the first layer (one ratio per layer): pool every layer and head into one top-1 and one "
            "median": per_layer[0],
            "took the mean of the two middle values (np.median, torch.quantile(x, 0.5)): the median here is "
            "torch's, Tensor.median, the lower of the two middle values when their count is even":
                (a.max() / a.quantile(0.5)).item(),
        }
        if len(logits) == 1:
            wrong = {h: v for h, v in wrong.items() if "per-layer" not in h and "per layer" not in h}
        got_t, exp_t = torch.tensor([got], dtype=torch.float64), torch.tensor([expected], dtype=torch.float64)
        expect(got_t, exp_t, what=f"{what} on {name}", rtol=1e-5, atol=1e-7,
               wrong={h: torch.tensor([v], dtype=torch.float64) for h, v in wrong.items()})
    passed("max |logit| / median |logit| over the finite logits of every layer and head (the paper's Table 5).")
