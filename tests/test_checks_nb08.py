"""The checks of exercise 08 fail on plausible wrong answers with the matching hint, pass a right answer written by
hand, and refuse the library's differential attention as task 1's answer."""

import pytest
import torch
import torch.nn.functional as F

from diffattn_tutorial.checks import CheckFailed, check_sdpa_split, check_sdpa_split_flops
from diffattn_tutorial.functional import causal_mask, diff_attention
from diffattn_tutorial.measure import flops


def make_split(*, pairs="interleaved", halves="chunk", order="ab", lam_on=True, sign=-1.0, causal_mode="right",
               gqa="sdpa", scale=None, width="full"):
    """A four-call implementation with one knob per plausible mistake (the defaults are right)."""

    def fn(q, k, v, lam, *, causal=False):
        if pairs == "interleaved":
            q1, q2, k1, k2 = q[:, 0::2], q[:, 1::2], k[:, 0::2], k[:, 1::2]
        elif pairs == "blocked":
            (q1, q2), (k1, k2) = q.chunk(2, dim=1), k.chunk(2, dim=1)
        else:  # blocked queries only
            (q1, q2), k1, k2 = q.chunk(2, dim=1), k[:, 0::2], k[:, 1::2]
        va, vb = v.chunk(2, dim=-1) if halves == "chunk" else (v[..., 0::2], v[..., 1::2])
        h, hkv = q1.shape[1], k1.shape[1]
        if gqa == "tile" and h != hkv:
            k1, k2, va, vb = (t.repeat(1, h // hkv, 1, 1) for t in (k1, k2, va, vb))
        nq, nk = q.shape[2], k.shape[2]
        mask, is_causal = None, False
        if causal and causal_mode == "right":
            mask, is_causal = (causal_mask(nq, nk), False) if nq != nk else (None, True)
        elif causal and causal_mode == "top_left":
            is_causal = True

        def attend(qi, ki, vi):
            return F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, is_causal=is_causal, scale=scale,
                                                  enable_gqa=qi.shape[1] != ki.shape[1])

        if width == "half":  # map 1 with va, map 2 with vb
            return attend(q1, k1, va) - lam * attend(q2, k2, vb)
        o1a, o1b, o2a, o2b = attend(q1, k1, va), attend(q1, k1, vb), attend(q2, k2, va), attend(q2, k2, vb)
        o1 = torch.cat([o1a, o1b] if order == "ab" else [o1b, o1a], dim=-1)
        o2 = torch.cat([o2a, o2b] if order == "ab" else [o2b, o2a], dim=-1)
        return o1 + sign * (lam if lam_on else 1.0) * o2

    return fn


def test_a_right_answer_passes_and_the_library_is_refused(capsys):
    check_sdpa_split(make_split())
    assert capsys.readouterr().out.count("PASSED") == 1
    for backend in ("sdpa_split", "sdpa_stacked"):
        with pytest.raises(CheckFailed, match="calls the library's diff_attention: .*rule"):
            check_sdpa_split(lambda q, k, v, lam, causal=False: diff_attention(q, k, v, lam, causal=causal,
                                                                               backend=backend))


@pytest.mark.parametrize("kwargs, match", [
    ({"lam_on": False}, "lambda is missing"),
    ({"sign": +1.0}, "sign is flipped"),
    ({"order": "ba"}, "V halves come back swapped"),
    ({"halves": "strided"}, "not contiguous"),
    ({"pairs": "blocked"}, "interleaved"),
    ({"pairs": "blocked_q"}, r"q is split in halves"),
    ({"gqa": "tile"}, "tiled the groups"),
    ({"causal_mode": "top_left"}, "aligns the mask top-left"),
    ({"causal_mode": "ignore"}, "causal mask is missing"),
    ({"scale": 1 / 4.0}, r"1/sqrt\(2d\)|differs from the reference"),
    ({"width": "half"}, "BOTH halves of V"),
])
def test_wrong_answers_fail_with_hint(kwargs, match):
    with pytest.raises(CheckFailed, match=match):
        check_sdpa_split(make_split(**kwargs))


def test_scale_hint():
    # 1/sqrt(2d) computed from v's width, as a learner might
    def fn(q, k, v, lam, *, causal=False):
        return make_split(scale=v.shape[-1] ** -0.5)(q, k, v, lam, causal=causal)

    with pytest.raises(CheckFailed, match=r"not 1/sqrt\(2d\)"):
        check_sdpa_split(fn)


def test_crash_and_stub():
    def stub(q, k, v, lam, *, causal=False):
        raise NotImplementedError("write sdpa_split")

    with pytest.raises(NotImplementedError):
        check_sdpa_split(stub)
    with pytest.raises(CheckFailed, match="raised TypeError"):
        check_sdpa_split(lambda q, k, v, lam: q)  # no causal keyword
    with pytest.raises(CheckFailed, match="returned 4 heads, expected H = 2"):  # forgot to combine the pairs
        check_sdpa_split(lambda q, k, v, lam, causal=False: torch.cat([q, q], dim=-1))


def test_gradients_checked():
    """Right forward, but lambda used as a constant: no gradient reaches it."""

    def fn(q, k, v, lam, *, causal=False):
        return make_split()(q, k, v, lam.detach(), causal=causal)

    with pytest.raises(CheckFailed, match="input 3 gets no gradient"):
        check_sdpa_split(fn)


def test_flops_check():
    right = lambda b, h, n, d, causal=False: flops.formulation_flops("sdpa_split", b, h, n, d, causal=causal)  # noqa: E731
    check_sdpa_split_flops(right)
    check_sdpa_split_flops(lambda b, h, n, d, causal=False: 16 * b * h * n * n * d * (0.5 if causal else 1))
    cases = [
        (lambda b, h, n, d, causal=False: 12 * b * h * n * n * d * (0.5 if causal else 1), "each map once"),
        (lambda b, h, n, d, causal=False: 8 * b * h * n * n * d * (0.5 if causal else 1), "four calls, not two"),
        (lambda b, h, n, d, causal=False: 32 * b * h * n * n * d * (0.5 if causal else 1), "not 2H"),
        (lambda b, h, n, d, causal=False: 24 * b * h * n * n * d * (0.5 if causal else 1), "width d"),
        (lambda b, h, n, d, causal=False: 16 * b * h * n * n * d, "counts half"),
        (lambda b, h, n, d, causal=False: 17 * b * h * n * n * d, "expected"),
        (lambda b, h, n, d, causal=False: "many", "should return a number"),
    ]
    for fn, match in cases:
        with pytest.raises(CheckFailed, match=match):
            check_sdpa_split_flops(fn)
