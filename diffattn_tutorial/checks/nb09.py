"""Checks for exercises/09_triton_kernel.ipynb: three ``@triton.jit`` device functions of the fused kernel.

* ``online_softmax_step(m, l, acc, s_t, v) -> (m, l, acc)``: one key tile of the online softmax (base 2), its
  scores given transposed, keys by queries;
* ``diff_combine(acc1, l1, acc2, l2, lam) -> out``: the lambda combine of the two streams (epilogue);
* ``diff_softmax_grads(p1, p2, dp, delta1, delta2, lam) -> (ds1, ds2)``: the score gradients of both maps.

Each check launches a small harness kernel (``checks/_nb09_kernels.py``) around the learner's function in
Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is imported), on fresh random inputs of
several shapes (ragged tiles, fully masked rows), and compares with the library: ``softmax_attention`` for
the online softmax, ``diff_attention`` for the combine, and autograd through ``diff_attention`` for the
gradients. On a mismatch it builds the outputs of plausible wrong answers and names the one that matches.
Triton is imported only when a check runs, so importing ``diffattn_tutorial.checks`` does not import it.
"""

from __future__ import annotations

import torch

from diffattn_tutorial.checks._core import call, close, exercise_check, expect, fail, passed, randn
from diffattn_tutorial.functional import causal_mask, diff_attention, diff_attention_maps

__all__ = ["check_online_softmax_step", "check_diff_combine", "check_diff_softmax_grads"]

Tensor = torch.Tensor

_INTERPRETER_HINT = ("the checks run your kernel in Triton's interpreter, but triton was imported without it: "
                     "restart the kernel and run the notebook from the top (its first cells set "
                     "os.environ['TRITON_INTERPRET'] = '1' before `import triton`)")


def _harness():
    """The harness kernels, after making sure Triton runs in its interpreter."""
    import triton.language as tl

    if type(tl.sum).__name__ != "InterpretedFunction":
        fail(_INTERPRETER_HINT)
    from diffattn_tutorial.checks import _nb09_kernels

    return _nb09_kernels


def _check_jit(fn, name: str) -> None:
    if type(fn).__name__ not in ("JITFunction", "InterpretedFunction"):
        fail(f"{name} must be a Triton device function: put @triton.jit on the line above `def {name}(...)`")


def _log2e() -> float:
    """The kernels' factor from natural-log to base-2 scores, the library's ``LOG2E`` (imported when a check runs,
    after :func:`_harness`: ``kernels.triton.flash_diff`` imports triton)."""
    from diffattn_tutorial.constants import LOG2E

    return LOG2E


def _innermost(error: BaseException) -> BaseException:
    """What the learner's code raised: Triton's interpreter wraps it in a chain of ``InterpreterError``."""
    seen = set()
    while id(error) not in seen and (error.__cause__ or error.__context__) is not None:
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return error


def _launch(kernel, grid, *args, what: str) -> None:
    """Run a harness kernel through :func:`_core.call` (a stub's NotImplementedError passes through, anything else
    becomes a one-line hint), unwrapped from the interpreter's errors first."""

    def run() -> None:
        try:
            kernel[grid](*args)
        except Exception as e:  # noqa: BLE001 - re-raised as the learner's own exception
            raise _innermost(e) from None

    call(run, what=what)


# --------------------------------------------------------------------------------------------
# TASK 1: the online-softmax update
# --------------------------------------------------------------------------------------------

_STEP_CASES = [  # Nq, Nk, D, BLOCK_M, BLOCK_N, kind: one tile first, then several, ragged; then the hard inputs
    (16, 16, 16, 16, 16, "plain"),
    (20, 37, 16, 16, 16, "plain"),
    (33, 70, 32, 16, 32, "plain"),
    (24, 50, 16, 16, 16, "padded"),  # a padding mask: some rows see no key in their first tiles, or none at all
    (16, 40, 16, 16, 16, "large"),  # rows whose scores are all far below 0, rows whose scores span 300 units
]

_STEP_HINTS = {
    "natural": "you used the natural exponential: the scores s arrive in base-2 units (already multiplied by "
               "log2(e)), so every exponential in the update is base 2, the rescale factor's too.",
    "no_rescale": "the old running sum and the accumulator are never rescaled: both were kept relative to the old "
                  "running max, so when the max grows both must be multiplied by the factor 2^(m - m_new) before "
                  "this tile is added.",
    "no_rescale_acc": "the accumulator is not rescaled (the running sum is): both were kept relative to the old "
                      "running max, so both take the factor 2^(m - m_new).",
    "no_rescale_l": "the running sum is not rescaled (the accumulator is): both were kept relative to the old "
                    "running max, so both take the factor 2^(m - m_new).",
    "tile_max": "the weights p are computed against this tile's own max: they must use the running max m_new, "
                "the one the running sum and the accumulator are kept relative to.",
    "untransposed": "the weights meet v untransposed: s_t, and so the weights, are (BLOCK_N, BLOCK_M), keys by "
                    "queries, while acc is (BLOCK_M, D): transpose the weights (tl.trans) before tl.dot with v.",
}


def _simulate_step(q: Tensor, k: Tensor, v: Tensor, scale: float, block_n: int, mistake: str = "") -> Tensor:
    """The harness loop in PyTorch (float64), right or with one ``mistake``; returns ``[acc / l | lse]``."""
    s_all = (q @ k.T) * scale * _log2e()
    nq = q.shape[0]
    m = torch.full((nq,), float("-inf"), dtype=q.dtype)
    l = torch.zeros(nq, dtype=q.dtype)
    acc = torch.zeros(nq, v.shape[1], dtype=q.dtype)
    exp = torch.exp if mistake == "natural" else torch.exp2
    for start in range(0, k.shape[0], block_n):
        s, vt = s_all[:, start:start + block_n], v[start:start + block_n]
        m_new = torch.maximum(m, s.max(-1).values)
        alpha = exp(m - m_new)
        p = exp(s - (s.max(-1).values if mistake == "tile_max" else m_new)[:, None])
        l = (l if mistake in ("no_rescale_l", "no_rescale") else l * alpha) + p.sum(-1)
        acc = (acc if mistake in ("no_rescale_acc", "no_rescale") else acc * alpha[:, None]) + (
            p.T @ vt if mistake == "untransposed" else p @ vt)  # untransposed: square tiles only
        m = m_new
    return torch.cat([acc / l[:, None], (m + torch.log2(l))[:, None]], dim=-1)


def _step_inputs(i: int, nq: int, nk: int, d: int, kind: str):
    """q, k, v (float32) and each row's visible key range ``[lo, hi)``."""
    q, k, v = (randn(n, d, seed=90 + 3 * i + j, dtype=torch.float32) for j, n in enumerate((nq, nk, nk)))
    lo = torch.zeros(nq, dtype=torch.int32)
    hi = torch.full((nq,), nk, dtype=torch.int32)
    if kind == "padded":  # left padding of 0 to nk + 1 keys (the first one, two or all tiles hidden), a few rows
        lo = (torch.arange(nq, dtype=torch.int32) * 11) % (nk + 2)  # cut short on the right as well
        hi[1::4] = nk - 3
    if kind == "large":  # two features that put scores far from 0: every key of feature 0 is 1, of feature 1 +-1
        a = 220.0 / (d ** -0.5 * _log2e())  # a score of 220 in base-2 units
        k[:, 0] = 1.0
        k[:, 1] = torch.where(torch.arange(nk) % 2 == 0, 1.0, -1.0)
        q[:, :2] = 0.0
        q[:nq // 2, 0] = -a  # rows whose scores are all near -220: no weight survives unless relative to their max
        q[nq // 2:, 1] = a / 1.5  # rows whose scores are near +147 or -147: a spread of about 300
    return q.contiguous(), k.contiguous(), v.contiguous(), lo, hi


def _step_reference(q: Tensor, k: Tensor, v: Tensor, lo: Tensor, hi: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """``[o | lse]`` in float64 from the float32 inputs (0 and 0 for a row that sees no key), and the empty rows."""
    s = (q.double() @ k.double().T) * scale
    j = torch.arange(k.shape[0])[None, :]
    visible = (j >= lo[:, None]) & (j < hi[:, None])
    s = s.masked_fill(~visible, float("-inf"))
    empty = ~visible.any(-1)
    lse = torch.logsumexp(s, dim=-1) * _log2e()
    o = torch.softmax(s, dim=-1) @ v.double()
    o = torch.where(empty[:, None], torch.zeros_like(o), o)
    lse = torch.where(empty, torch.zeros_like(lse), lse)
    return torch.cat([o, lse[:, None]], dim=-1), empty


def expected_max(q: Tensor, k: Tensor, lo: Tensor, hi: Tensor, scale: float) -> Tensor:
    """Each row's largest visible score in base-2 units (``-inf`` for a row that sees no key): the running max the
    state must hold after the last tile."""
    s = (q.double() @ k.double().T) * scale * _log2e()
    j = torch.arange(k.shape[0])[None, :]
    return s.masked_fill(~((j >= lo[:, None]) & (j < hi[:, None])), float("-inf")).amax(-1)


@exercise_check(task=1, name="online_softmax_step")
def check_online_softmax_step(online_softmax_step) -> None:
    """``online_softmax_step(m, l, acc, s_t, v)``: one tile of the online softmax in base 2, the scores ``s_t``
    transposed, ``(BLOCK_N, BLOCK_M)`` (see the exercise)."""
    _check_jit(online_softmax_step, "online_softmax_step")
    kernels = _harness()
    for i, (nq, nk, d, bm, bn, kind) in enumerate(_STEP_CASES):
        q, k, v, lo, hi = _step_inputs(i, nq, nk, d, kind)
        scale = d ** -0.5
        m_out, l_out, acc_out = torch.empty(nq), torch.empty(nq), torch.empty(nq, d)
        _launch(kernels.online_softmax_harness, ((nq + bm - 1) // bm,), q, k, v, lo, hi, m_out, l_out, acc_out,
                nq, nk, scale * _log2e(), online_softmax_step, d, bm, bn, what="online_softmax_step")
        m64, l64, acc64 = m_out.double(), l_out.double(), acc_out.double()
        safe_l = torch.where(l64 == 0, torch.ones_like(l64), l64)
        got = torch.cat([acc64 / safe_l[:, None], torch.where(l64 == 0, torch.zeros_like(m64),
                                                                m64 + torch.log2(safe_l))[:, None]], dim=-1)
        expected, empty = _step_reference(q, k, v, lo, hi, scale)
        what = f"online_softmax_step (Nq={nq}, Nk={nk}, BLOCK_N={bn}: {-(-nk // bn)} tiles"
        bad = ~torch.isfinite(got).all(-1)
        if kind == "plain" and bad.any():
            fail("online_softmax_step produced NaN. At the first tile the running max m is -inf: the rescale "
                 "factor 2^(m - m_new) must be 0 there (nothing seen so far counts), not 2^(m_new - m), and the "
                 "weights p must be taken against the NEW running max, never the old one.")
        if kind == "padded":
            first_hidden = (lo >= bn) | empty
            nan_rows = torch.isnan(m64) | torch.isnan(l64) | torch.isnan(acc64).any(-1)
            if (nan_rows & first_hidden).any():
                fail(f"{what}, a padding mask) gave NaN on rows whose first key tiles are entirely masked: there m "
                     f"and m_new are both -inf, and -inf - (-inf) is NaN. A row that has seen no key yet needs a "
                     f"finite reference for its exponentials (all its weights are 0 anyway, so any finite value "
                     f"works); m_new itself may stay -inf.")
            if (l64[empty] != 0).any() or (acc64[empty] != 0).any():
                fail(f"{what}, a padding mask): a row that sees no key at all must end with l = 0 and acc = 0 "
                     f"(no weight was ever added)")
        if kind == "large":
            low = torch.arange(nq) < nq // 2
            if bad.any():
                fail(f"{what}, scores spanning hundreds of units) overflowed to inf or NaN: the exponentials must "
                     f"be taken relative to the running maximum, the largest score seen so far, so that no weight "
                     f"exceeds 1.")
            if (l64[low] == 0).any() or not close(got[low], expected[low], rtol=1e-4, atol=2e-5):
                fail(f"{what}) is wrong on rows whose scores are all far below 0 (about -220): their weights "
                     f"underflowed. The reference for the exponentials must be the running maximum itself, "
                     f"whatever its sign (not 0, not its absolute value).")
            if not close(got, expected, rtol=1e-4, atol=2e-5):
                fail(f"{what}) is wrong on rows whose scores span about 300 units: the exponentials must be taken "
                     f"relative to the running maximum, the largest score seen so far.")
        running_max = expected_max(q, k, lo, hi, scale)
        seen = ~empty if kind == "padded" else torch.ones(nq, dtype=torch.bool)
        off = seen & ~torch.isclose(m64, running_max, rtol=1e-4, atol=1e-3)
        if off.any():
            fail(f"{what}{', a padding mask' if kind == 'padded' else ''}): the state's m is not the running max on "
                 f"{int(off.sum())} of {nq} rows: m_new must be each query row's largest score seen so far, "
                 f"max(m, this tile's max over its keys), not this tile's max alone (a later tile with smaller "
                 f"scores, or one the mask hides entirely, would pull it down), nor a max over the queries (in s_t "
                 f"the keys run down the rows, axis 0)")
        wrong = {}
        if kind == "plain":
            qd, kd, vd = q.double(), k.double(), v.double()
            wrong = {hint: _simulate_step(qd, kd, vd, scale, bn, mistake) for mistake, hint in _STEP_HINTS.items()
                     if mistake != "untransposed" or nq == bm == bn == nk}
        expect(got, expected, what=what + (", a padding mask)" if kind == "padded" else ")"), wrong=wrong,
               rtol=1e-4, atol=2e-5, default_hint="Return the state after this tile, (m_new, l_new, acc_new) in "
                                                  "that order, each in float32.")
    passed("online_softmax_step: the harness reproduces softmax attention and its base-2 log-sum-exp, "
           "for one tile and many ragged tiles, rows hidden by a padding mask, and scores far from 0")


# --------------------------------------------------------------------------------------------
# TASK 2: the lambda combine
# --------------------------------------------------------------------------------------------

_COMBINE_CASES = [  # Nq, Nk, d, causal: the causal case has Nq > Nk, so its first rows see no key
    (16, 40, 8, False),
    (21, 13, 16, True),
]


def _lambdas(nq: int, seed: int) -> Tensor:
    """One lambda per row, ``(1, 1, nq, 1)``: mostly in (0.2, 0.9), a third of them negative (lambda may be)."""
    lam = 0.2 + 0.5 * randn(1, 1, nq, 1, seed=seed).abs()
    lam[:, :, 1::3] *= -1
    return lam


def _unnormalised(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, seed: int) -> tuple[Tensor, Tensor]:
    """``acc = exp(s - c) v`` and ``l = sum exp(s - c)`` with an arbitrary per-row shift ``c`` (0 for empty rows)."""
    s = (q @ k.T) * q.shape[-1] ** -0.5
    s = s.masked_fill(~visible, float("-inf"))
    c = s.max(-1).values
    c = torch.where(torch.isfinite(c), c, torch.zeros_like(c)) + randn(s.shape[0], seed=seed)  # any shift works
    p = torch.exp(s - c[:, None])
    return p @ v, p.sum(-1)


@exercise_check(task=2, name="diff_combine")
def check_diff_combine(diff_combine) -> None:
    """``diff_combine(acc1, l1, acc2, l2, lam)``: the epilogue that turns the two streams' accumulators into the
    differential output (see the exercise)."""
    _check_jit(diff_combine, "diff_combine")
    kernels = _harness()
    for i, (nq, nk, d, causal) in enumerate(_COMBINE_CASES):
        seed = 200 + 10 * i
        q, k = randn(1, 2, nq, d, seed=seed), randn(1, 2, nk, d, seed=seed + 1)
        v, lam = randn(1, 1, nk, 2 * d, seed=seed + 2), _lambdas(nq, seed + 3)
        visible = causal_mask(nq, nk) if causal else torch.ones(nq, nk, dtype=torch.bool)
        acc1, l1 = _unnormalised(q[0, 0], k[0, 0], v[0, 0], visible, seed + 4)
        acc2, l2 = _unnormalised(q[0, 1], k[0, 1], v[0, 0], visible, seed + 5)
        lam_rows = lam[0, 0, :, 0]
        out = torch.empty(nq, 2 * d)
        f32 = [t.float().contiguous() for t in (acc1, l1, acc2, l2, lam_rows)]
        _launch(kernels.combine_harness, ((nq + 15) // 16,), *f32, out, nq, diff_combine, 2 * d, 16,
                what="diff_combine")
        expected = diff_attention(q, k, v, lam, causal=causal, backend="naive")[0, 0]
        got = out.double()
        empty = ~visible.any(-1)
        if torch.isnan(got).any():
            if empty.any() and torch.isnan(got[empty]).any():
                fail(f"diff_combine returned NaN on the {int(empty.sum())} rows that see no key (causal with Nq={nq} > "
                     f"Nk={nk}): there l1 = l2 = 0 and acc1 = acc2 = 0, and 0 / 0 is NaN. Such a row's output is "
                     f"defined as 0: divide those rows by a harmless nonzero number instead.")
            fail("diff_combine returned NaN values (a division by zero?)")
        safe = lambda x: torch.where(x == 0, torch.ones_like(x), x)[:, None]  # noqa: E731
        o1, o2, lr = acc1 / safe(l1), acc2 / safe(l2), lam_rows[:, None]
        wrong = {
            "lambda is missing: the output is map 1's normalised stream minus lambda times map 2's.": o1 - o2,
            "the sign is flipped: map 2 is subtracted, not added.": o1 + lr * o2,
            "lambda multiplies the wrong map: lambda scales map 2, the one subtracted.": lr * o1 - o2,
            ("the accumulators are not normalised: each is a sum of unnormalised weights times values, and becomes "
             "an attention output only once divided by its own running sum."): acc1 - lr * acc2,
            ("both maps are divided by map 1's running sum: each stream has its own softmax denominator."):
                (acc1 - lr * acc2) / safe(l1),
            "the normalisers are swapped: each accumulator is divided by its own stream's running sum.":
                acc1 / safe(l2) - lr * acc2 / safe(l1),
            "lambda lost its sign: lambda can be negative (some rows here have a negative lambda); use it as it is.":
                o1 - lr.abs() * o2,
            "lambda was clamped at 0: lambda can be negative (some rows here have one); use it as it is.":
                o1 - lr.clamp(min=0) * o2,
        }
        if 2 * d == 16:  # lam * o2 without [:, None] broadcasts lam along the columns when 2d == BLOCK_M
            idx = (torch.arange(nq) // 16 * 16)[:, None] + torch.arange(2 * d)[None, :]
            lam_cols = torch.cat([lam_rows, torch.zeros(16, dtype=lam_rows.dtype)])[idx]
            wrong["lambda is broadcast along the columns: it is one number per row, so it must be shaped as a "
                  "column to scale each row of map 2."] = \
                o1 - lam_cols * o2
        expect(got, expected, what=f"diff_combine (Nq={nq}, Nk={nk}{', causal' if causal else ''})", wrong=wrong,
               rtol=1e-4, atol=1e-5)
    passed("diff_combine: acc1 / l1 - lam * acc2 / l2 equals diff_attention, and rows with no visible key give 0")


# --------------------------------------------------------------------------------------------
# TASK 3: the score gradients of both maps
# --------------------------------------------------------------------------------------------

_GRAD_CASES = [  # Nq, Nk, d, causal
    (9, 20, 8, False),
    (13, 13, 8, True),
]


def _by_column(delta: Tensor, nq: int, nk: int, block: int = 16) -> Tensor:
    """What ``delta[None, :]`` gives in the harness's ``block`` x ``block`` tiles: entry ``(r, c)`` reads the row
    statistic of row ``tile start + c mod block`` (0 past the last row), not of row ``r``."""
    idx = (torch.arange(nq) // block * block)[:, None] + (torch.arange(nk) % block)[None, :]
    return torch.cat([delta, torch.zeros(block, dtype=delta.dtype)])[idx.clamp(max=nq + block - 1)].where(
        idx < nq, torch.zeros((), dtype=delta.dtype))


@exercise_check(task=3, name="diff_softmax_grads")
def check_diff_softmax_grads(diff_softmax_grads) -> None:
    """``diff_softmax_grads(p1, p2, dp, delta1, delta2, lam) -> (ds1, ds2)``, checked through autograd of
    ``diff_attention``: ``dq_m = scale * ds_m @ k_m`` and ``dk_m = scale * ds_m^T @ q_m`` must match."""
    _check_jit(diff_softmax_grads, "diff_softmax_grads")
    kernels = _harness()
    for i, (nq, nk, d, causal) in enumerate(_GRAD_CASES):
        seed = 300 + 10 * i
        q = randn(1, 2, nq, d, seed=seed).requires_grad_()
        k = randn(1, 2, nk, d, seed=seed + 1).requires_grad_()
        v = randn(1, 1, nk, 2 * d, seed=seed + 2)
        lam = _lambdas(nq, seed + 3)
        g = randn(1, 1, nq, 2 * d, seed=seed + 4)
        (diff_attention(q, k, v, lam, causal=causal, backend="naive") * g).sum().backward()
        expected = torch.cat([q.grad[0].flatten(), k.grad[0].flatten()])
        with torch.no_grad():
            a1, a2, _ = diff_attention_maps(q, k, lam, causal=causal)
            p1, p2, vv, do = a1[0, 0], a2[0, 0], v[0, 0], g[0, 0]
            dp = do @ vv.T
            delta1 = (do * (p1 @ vv)).sum(-1)
            delta2 = (do * (p2 @ vv)).sum(-1)
            lr = lam[0, 0, :, 0]
        ds1, ds2 = torch.empty(nq, nk), torch.empty(nq, nk)
        f32 = [t.float().contiguous() for t in (p1, p2, dp, delta1, delta2, lr)]
        _launch(kernels.grads_harness, ((nq + 15) // 16, (nk + 15) // 16), *f32, ds1, ds2, nq, nk,
                diff_softmax_grads, 16, 16, what="diff_softmax_grads")
        scale = d ** -0.5
        q0, k0 = q.detach()[0], k.detach()[0]

        def through(s1: Tensor, s2: Tensor) -> Tensor:
            """dq and dk of both maps from score gradients, flattened like ``expected``."""
            dq = torch.stack([s1 @ k0[0], s2 @ k0[1]]) * scale
            dk = torch.stack([s1.T @ q0[0], s2.T @ q0[1]]) * scale
            return torch.cat([dq.flatten(), dk.flatten()])

        got = through(ds1.double(), ds2.double())
        L = lr[:, None]
        d1, d2 = delta1[:, None], delta2[:, None]
        right1 = p1 * (dp - d1)
        wrong = {
            ("the sign of ds2 is flipped: the output is O1 - lambda O2, so map 2 receives the upstream gradient "
             "times -lambda."): through(right1, L * p2 * (dp - d2)),
            ("lambda is missing from ds2: the output is O1 - lambda O2, so map 2 receives the upstream gradient "
             "times -lambda, not just its negative."): through(right1, -p2 * (dp - d2)),
            ("map 2's factor -lambda is missing: the output is O1 - lambda O2, so map 2 receives the upstream "
             "gradient times -lambda, while map 1 receives it as it is."): through(right1, p2 * (dp - d2)),
            ("ds2 uses delta1: each map subtracts its own row statistic, rowsum(dO * O2) = delta2 for map 2."):
                through(right1, -L * p2 * (dp - d1)),
            ("ds1 uses delta2: each map subtracts its own row statistic, rowsum(dO * O1) = delta1 for map 1."):
                through(p1 * (dp - d2), -L * p2 * (dp - d2)),
            ("delta1 and delta2 are swapped: map 1 subtracts delta1 = rowsum(dO * O1), map 2 delta2 = "
             "rowsum(dO * O2)."): through(p1 * (dp - d2), -L * p2 * (dp - d1)),
        }
        axis = ("broadcast along the wrong axis: the row statistics hold one number per query row, so they "
                "broadcast as columns, delta[:, None], against the (BLOCK_M, BLOCK_N) tile.")
        c1, c2 = _by_column(delta1, nq, nk), _by_column(delta2, nq, nk)
        wrong |= {
            f"delta1 and delta2 are {axis}": through(p1 * (dp - c1), -L * p2 * (dp - c2)),
            f"delta1 is {axis}": through(p1 * (dp - c1), -L * p2 * (dp - d2)),
            f"delta2 is {axis}": through(right1, -L * p2 * (dp - c2)),
            ("the row statistics are not subtracted: softmax's backward is P * (dP - rowsum(dP * P)), and the "
             "row sums are the delta1 and delta2 you are given."): through(p1 * dp, -L * p2 * dp),
            ("map 2's row statistic also carries -lambda: with dP2 = -lambda dP, rowsum(dP2 * P2) = -lambda delta2, so "
             "-lambda multiplies both terms."): through(right1, p2 * (-L * dp - d2)),
            "ds1 and ds2 come back swapped: map 1's gradient comes first.": through(-L * p2 * (dp - d2), right1),
            "lambda lost its sign: lambda can be negative (some rows here have a negative lambda); use it as it is.":
                through(right1, -L.abs() * p2 * (dp - d2)),
            "lambda was clamped at 0: lambda can be negative (some rows here have one); use it as it is.":
                through(right1, -L.clamp(min=0) * p2 * (dp - d2)),
        }
        expect(got, expected, what=f"diff_softmax_grads (Nq={nq}, Nk={nk}{', causal' if causal else ''}), "
               f"through dq and dk", wrong=wrong, rtol=1e-4, atol=2e-5)
    passed("diff_softmax_grads: the score gradients of both maps give diff_attention's dq and dk")
