"""Checks for ``exercises/13_serving.ipynb``: the three pieces of serving a differential-attention model.

1. one decoding step with a static KV cache for a batch of sequences at their own positions: write each new key
   and value in place at its sequence's position ``pos[b]`` of preallocated buffers, then attend over the buffer
   with each sequence's unwritten slots masked;
2. the split-K combine: per map, merge the partial outputs of the key splits with weights from their
   log-sum-exps, then ``o1 - lam * o2``, and return each map's log-sum-exp over all the keys;
3. the next token from logits: greedy at temperature 0, otherwise a seeded draw from the softmax of
   ``logits / temperature`` restricted to the ``top_k`` most likely tokens.

References: ``functional.softmax_attention`` (task 1, on each sequence's written prefix), ``diff_attention(...,
backend="naive")`` and ``torch.logsumexp`` (task 2, on the whole key range) and ``model.next_token`` (task 3, with the same generator seed).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from diffattn_tutorial.checks._core import call, exercise_check, expect, fail, passed, randn
from diffattn_tutorial.functional import diff_attention, softmax_attention
from diffattn_tutorial.training.model import next_token

__all__ = ["check_static_step", "check_combine_splits", "check_sample_next"]

Tensor = torch.Tensor


# --- TASK 1: one static-cache step, a batch of sequences at their own positions ---------------------------------

# (B, heads, max_len, d, positions: one per sequence)
_STEP_CASES = [(1, 2, 8, 4, (0,)), (2, 3, 8, 4, (3, 0)), (3, 2, 6, 8, (5, 2, 4)), (2, 1, 16, 4, (9, 9))]


def _attend_rows(q: Tensor, k: Tensor, v: Tensor, keys) -> Tensor:
    """Softmax attention of each sequence ``b`` of ``q`` over its first ``keys[b]`` keys (none: NaN, what a
    softmax over a row of -inf gives)."""
    rows = []
    for b, n in enumerate(keys):
        if n <= 0:
            rows.append(torch.full_like(q[b:b + 1], float("nan")))
        else:
            rows.append(softmax_attention(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n]))
    return torch.cat(rows)


@exercise_check(task=1, name="static_step")
def check_static_step(fn: Callable) -> None:
    """``fn(q, k_new, v_new, k_buf, v_buf, pos)``: ``pos`` a ``(B,)`` long tensor, sequence ``b`` at position
    ``pos[b]``. Writes ``k_new``/``v_new`` ``(B, H, 1, d)`` into the buffers ``(B, H, max_len, d)`` at each
    sequence's own position, in place, and returns ``(B, H, 1, d)``: each sequence's query over its keys
    ``0..pos[b]``."""
    what = "static_step"
    for i, (b, h, n, d, positions) in enumerate(_STEP_CASES):
        pos = torch.tensor(positions, dtype=torch.long)
        q, k_new, v_new = (randn(b, h, 1, d, seed=1300 + 10 * i + j) for j in range(3))
        k_buf, v_buf = randn(b, h, n, d, seed=1305 + 10 * i), randn(b, h, n, d, seed=1306 + 10 * i)
        for row, p in enumerate(positions):  # the slots not written yet hold zeros, as StaticKVCache allocates them
            k_buf[row, :, p:] = 0.0
            v_buf[row, :, p:] = 0.0
        k_want, v_want = k_buf.clone(), v_buf.clone()
        for row, p in enumerate(positions):
            k_want[row, :, p], v_want[row, :, p] = k_new[row, :, 0], v_new[row, :, 0]
        k_got, v_got = k_buf.clone(), v_buf.clone()
        got = call(fn, q.clone(), k_new.clone(), v_new.clone(), k_got, v_got, pos.clone(), what=what)
        where = f"{what}(..., pos={positions}) with buffers of {n} positions"
        if torch.equal(k_got, k_buf) and torch.equal(v_got, v_buf):
            fail(f"{where} left the buffers unchanged. Write k_new and v_new into k_buf and v_buf in place, not "
                 f"into a copy")
        if not (torch.equal(k_got, k_want) and torch.equal(v_got, v_want)):
            first = k_buf.clone()
            first[:, :, positions[0]] = k_new[:, :, 0]
            shifted = k_buf.clone()
            for row, p in enumerate(positions):
                shifted[row, :, min(p + 1, n - 1)] = k_new[row, :, 0]
            hint = (" (every sequence was written at the first sequence's position: each sequence b has its own "
                    "pos[b])" if len(set(positions)) > 1 and torch.equal(k_got, first) else
                    " (written one slot too far: position pos is index pos)" if torch.equal(k_got, shifted) else "")
            fail(f"{where} wrote the wrong slots of the buffers{hint}: only each sequence's own position takes its "
                 f"new key and value, in k_buf and v_buf alike, every other slot keeps its value")
        keys = [p + 1 for p in positions]
        wrong = {
            "the new token's own key is masked out (keys < pos). The query at pos sees every key at 0..pos, itself "
            "included": _attend_rows(q, k_want, v_want, positions),
            "the unwritten slots are not masked: they hold zeros, and a zero key still gets weight exp(0) in the "
            "softmax. Mask every key after pos with -inf": _attend_rows(q, k_want, v_want, [n] * b),
            "the scores are not scaled by 1/sqrt(d)": _attend_rows(q * math.sqrt(d), k_want, v_want, keys),
        }
        if len(set(positions)) > 1:
            wrong["every sequence is masked at the first sequence's position: each sequence b sees its own keys "
                  "0..pos[b], so the mask has one row per sequence"] = \
                _attend_rows(q, k_want, v_want, [positions[0] + 1] * b)
        expect(got, _attend_rows(q, k_want, v_want, keys), what=where, wrong=wrong)
    passed("each sequence's key and value land at its own position, in place, and its query sees exactly its keys "
           "0..pos[b]: the same as a cache grown by torch.cat, one sequence at a time.")


# --- TASK 2: combine split-K partials, and their log-sum-exp ------------------------------------------------------

# (B, H, Nk, d, splits, length, score scale)
# (B, H, Nk, d, splits, length, score scale per sequence): the large scales put log-sum-exps in the hundreds, and the
# last case mixes a sequence with large scores and one with small ones, so that a max over everything underflows
# the small one while no max at all overflows the large one
_SPLIT_CASES = [(1, 2, 16, 4, 2, 16, (1.0,)), (2, 1, 24, 4, 3, 24, (1.0, 1.0)), (1, 2, 32, 8, 4, 20, (1.0,)),
                (2, 1, 16, 4, 4, 16, (900.0, 1.0)), (1, 1, 16, 4, 4, 16, (900.0,)), (2, 2, 12, 4, 3, 12, (1.0, 1.0))]


def split_partials(q: Tensor, k: Tensor, v: Tensor, splits: int, length: int) -> tuple[Tensor, Tensor]:
    """Each split's per-map normalised outputs ``(S, B, H, 2, Nq, 2d)`` and natural log-sum-exps
    ``(S, B, H, 2, Nq, 1)`` (``-inf``, and zeros, for a split past ``length``), for q ``(B, 2H, Nq, d)``,
    k ``(B, 2H, Nk, d)``, v ``(B, H, Nk, 2d)``."""
    b, h2, nq, d = q.shape
    scores = (q.unflatten(1, (h2 // 2, 2)) * d ** -0.5) @ k.unflatten(1, (h2 // 2, 2)).transpose(-1, -2)
    scores[..., length:] = float("-inf")  # (B, H, 2, Nq, Nk); keys from length on are not in the cache yet
    chunk = -(-k.shape[2] // splits)
    outs, lses = [], []
    for lo in range(0, k.shape[2], chunk):
        s = scores[..., lo:lo + chunk]
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
        p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse))
        outs.append(p @ v[:, :, None, lo:lo + chunk])
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def _weights_sum(outs: Tensor, lses: Tensor, lam: Tensor, *, normalise: bool = True, base: float = math.e,
                 shift: str = "splits") -> Tensor:
    """The combine with one deliberate change: ``shift`` is the max subtracted before the exponential, over the
    splits (right), over everything (``"global"``) or none (``"none"``)."""
    m = {"splits": lses.amax(0), "global": lses.amax(), "none": torch.zeros_like(lses[0])}[shift]
    w = torch.pow(base, lses - m)
    o = (w * outs).sum(0) / (w.sum(0) if normalise else 1.0)
    return o[:, :, 0] - lam * o[:, :, 1]


@exercise_check(task=2, name="combine_splits")
def check_combine_splits(fn: Callable) -> None:
    """``fn(outs, lses, lam) -> (out, lse)``: outs ``(S, B, H, 2, Nq, 2d)`` (each split's output per map, normalised
    within the split), lses ``(S, B, H, 2, Nq, 1)`` (natural log-sum-exps, ``-inf`` for an empty split), lam a
    number; ``out`` ``(B, H, Nq, 2d)`` is the differential attention over all the keys and ``lse``
    ``(B, H, 2, Nq, 1)`` each map's log-sum-exp over all the keys (so the result can be merged again)."""
    what = "combine_splits"
    for i, (b, h, nk, d, splits, length, amp) in enumerate(_SPLIT_CASES):
        q = randn(b, 2 * h, 1, d, seed=1330 + i) * torch.tensor(amp, dtype=torch.float64).view(b, 1, 1, 1)
        k, v = randn(b, 2 * h, nk, d, seed=1340 + i), randn(b, h, nk, 2 * d, seed=1350 + i)
        lam = 0.3 + 0.1 * i
        outs, lses = split_partials(q, k, v, splits, length)
        if i == 1:  # log-sum-exps below 0 (every score far below 0): the merged one is negative too
            lses = lses - 50.0
        expected = diff_attention(q, k[:, :, :length], v[:, :, :length], lam, causal=False, backend="naive")
        got = call(fn, outs.clone(), lses.clone(), lam, what=what)
        if not (isinstance(got, tuple) and len(got) == 2):
            fail(f"{what} should return two tensors, (out, lse): the combined output and each map's log-sum-exp "
                 f"over all the keys; got {type(got).__name__}")
        got_out, got_lse = got
        where = f"{what} ({splits} splits of {nk} keys, {length} of them cached" + (
            ", scores in the hundreds)" if max(amp) > 1 else ")")
        lam_t = torch.tensor(lam, dtype=outs.dtype)
        big = ("scores in the hundreds: exp(lse) overflows to inf (or underflows to 0), and inf / inf or 0 / 0 "
               "is NaN. Subtract each row's max over the splits before the exponential")
        with torch.no_grad():
            expect(got_out, expected, what=where, wrong={
                "the splits are averaged with equal weights. A split's output is normalised by its own sum "
                "exp(lse_s); weight it by exp(lse_s - max lse) and divide by the sum of those weights":
                    outs.mean(0)[:, :, 0] - lam * outs.mean(0)[:, :, 1],
                "the weighted sum is not divided by the sum of the weights": _weights_sum(outs, lses, lam_t,
                                                                                          normalise=False),
                "the weights use base 2 (2 ** lse); these log-sum-exps are natural logs, so use exp":
                    _weights_sum(outs, lses, lam_t, base=2.0),
                "the maps are combined as o1 + lam * o2; differential attention subtracts the second map":
                    _weights_sum(outs, lses, -lam_t),
                "the maps are swapped: lam multiplies the second map (index 1 of dim 3)":
                    _weights_sum(outs.flip(3), lses.flip(3), lam_t),
                "no max is subtracted before the exponential, " + big: _weights_sum(outs, lses, lam_t, shift="none"),
                "one max over everything is subtracted (every row, head and map): a row whose log-sum-exps lie far "
                "below that global max gets weights exp(-hundreds) = 0 and 0 / 0 = NaN. Subtract each row's own max "
                "over the splits (dim 0)": _weights_sum(outs, lses, lam_t, shift="global"),
            }, default_hint="Per map: w_s = exp(lse_s - max_s lse_s), o = sum_s w_s o_s / sum_s w_s, then "
                            "o1 - lam * o2 (subtract the max before exp, or large scores overflow)")
            m = lses.amax(0)
            w_sum = torch.exp(lses - m).sum(0)
            expect(got_lse, torch.logsumexp(lses, dim=0), what=where.replace(what, f"{what}'s lse", 1), wrong={
                "the max was not added back: log(sum_s exp(lse_s - m)) is the log-sum-exp minus m; add m":
                    torch.log(w_sum),
                "the lse is the largest split's only: the other splits add log(sum_s exp(lse_s - m)) to it": m,
                "the lse is the sum of the splits' log-sum-exps; log-sum-exps combine by log-sum-exp, not by a sum":
                    lses.sum(0),
                "log(sum_s exp(lse_s)) overflows (or underflows) where the log-sum-exps are in the hundreds: "
                "subtract their max m before the exponential and add m back after the log":
                    torch.log(torch.exp(lses).sum(0)),
            })
    passed("the partial results of every split merge into exactly the attention over all the keys, for both maps, "
           "and their log-sum-exps into the log-sum-exp over all the keys.")


# --- TASK 3: sampling ----------------------------------------------------------------------------------------------

# (rows, vocab, temperature, top_k, logit scale)
_SAMPLE_CASES = [(64, 10, 0.0, None, 1.0), (256, 12, 1.0, None, 1.0), (256, 12, 0.5, None, 1.0),
                 (256, 12, 2.0, 3, 1.0), (256, 8, 1.0, 1, 1.0), (128, 6, 1.0, 6, 1.0), (256, 10, 0.7, 4, 1.0),
                 (256, 9, 1.0, 2, 0.0), (8, 40, 1.0, 50, 1.0)]


def _filtered_draw(logits: Tensor, temperature: float, top_k: Optional[int], seed: int, *,
                   keep: str = "ties", fill: float = float("-inf"), scale: str = "divide") -> Tensor:
    """A draw with one deliberate change (``keep``/``fill``/``scale``), from the same generator seed."""
    scaled = logits / temperature if scale == "divide" else logits * temperature
    if top_k is not None and top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        drop = scaled <= kth if keep == "strict" else scaled < kth
        scaled = scaled.masked_fill(drop, fill)
    probs = torch.softmax(scaled, dim=-1)
    if not torch.isfinite(probs).all() or (probs.sum(-1) <= 0).any():
        return torch.full((logits.shape[0], 1), -1, dtype=torch.long)
    return torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed))


@exercise_check(task=3, name="sample_next", refuses=lambda: {next_token: "the library's next_token (training.model)"})
def check_sample_next(fn: Callable) -> None:
    """``fn(logits, temperature, top_k, generator)``: logits ``(B, vocab)`` -> ``(B, 1)`` token ids. Greedy
    (argmax) at temperature 0; otherwise one ``torch.multinomial`` draw with ``generator`` from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` largest logits (ties kept; None: all)."""
    what = "sample_next"
    for i, (rows, vocab, temp, top_k, amp) in enumerate(_SAMPLE_CASES):
        logits = randn(rows, vocab, seed=1370 + i) * amp
        seed = 1380 + i
        expected = next_token(logits, temperature=temp, top_k=top_k, generator=torch.Generator().manual_seed(seed))
        got = call(fn, logits.clone(), temp, top_k, torch.Generator().manual_seed(seed), what=what)
        where = f"{what}(logits of shape {tuple(logits.shape)}, temperature={temp}, top_k={top_k})"
        if not isinstance(got, Tensor):
            fail(f"{where} should return a tensor of token ids, got {type(got).__name__}")
        if got.dtype != torch.long:
            fail(f"{where} should return token ids as torch.long (int64), got dtype {got.dtype}")
        if got.shape != expected.shape:
            fail(f"{where} should return shape {tuple(expected.shape)}: one token per row, in a column (B, 1), "
                 f"got shape {tuple(got.shape)}" + (": the column dimension was dropped" if got.dim() == 1 else ""))
        if torch.equal(got, expected):
            continue
        if temp == 0:
            fail(f"{where} is not greedy: at temperature 0 return logits.argmax(-1, keepdim=True), no draw")
        wrong = {
            "the logits are multiplied by the temperature; divide them (a high temperature flattens the "
            "distribution)": _filtered_draw(logits, temp, top_k, seed, scale="multiply"),
            "the k-th largest logit is dropped too (<= instead of <): keep the top_k largest, ties included":
                _filtered_draw(logits, temp, top_k, seed, keep="strict"),
            "the dropped logits are set to 0, which still leaves them probability; set them to -inf":
                _filtered_draw(logits, temp, top_k, seed, fill=0.0),
            "top_k is ignored: keep only the top_k largest logits": _filtered_draw(logits, temp, None, seed),
        }
        for hint, candidate in wrong.items():
            if torch.equal(got, candidate):
                fail(f"{where} is not right. Likely mistake: {hint}")
        fail(f"{where} draws different tokens from the reference with the same generator seed: one "
             f"torch.multinomial(softmax(filtered logits / temperature), 1, generator=generator), nothing else "
             f"drawn from the generator first")
    passed("greedy at temperature 0, and the same seeded draws as generate(): temperature divides, top-k keeps "
           "the k largest logits (ties kept).")
