"""The checks of exercises 07 (measuring attention) and 10 (DIFF V2): the library passes, a stub is not attempted,
a crash is a one-line hint, and plausible wrong answers fail with the hint that names the mistake."""

from __future__ import annotations

import pytest
import torch
from einops import rearrange

from diffattn_tutorial import checks
from diffattn_tutorial.checks import CheckFailed
from diffattn_tutorial.functional import diff_attention_v2, rms_norm, softmax_attention
from diffattn_tutorial.measure.attention_stats import answer_noise_shares
from diffattn_tutorial.training.model import AttentionProbe
from diffattn_tutorial.training.study import attention_scores, logit_outliers


def fails(check, fn, match: str) -> None:
    with pytest.raises(CheckFailed, match=match):
        check(fn)


# ---------------------------------------------------------------- exercise 07


def rows_of(maps, pos):
    B, H, L, _ = maps.shape
    return maps.gather(2, pos[:, None, :, None].expand(B, H, -1, L))


def shares(*, shift=0, answer="own", clamp=False, renorm=False, columns=False):
    """A learner's query_shares with one knob per mistake (the defaults are right)."""

    def fn(maps, batch):
        m = maps.clamp(min=0) if clamp else maps
        if columns:
            m = m.transpose(-1, -2)
        rows = rows_of(m, (batch.query_pos + shift).clamp(0, maps.shape[-1] - 1))
        if renorm:
            rows = rows / rows.sum(-1, keepdim=True)
        ans = batch.answer_mask if answer == "own" else batch.answer_mask.any(1, keepdim=True).expand_as(batch.answer_mask)
        return answer_noise_shares(rows, ans[:, None], batch.context_mask)

    return fn


def test_query_shares_library_passes(capsys):
    checks.check_query_shares(lambda maps, batch: tuple(attention_scores([AttentionProbe(maps, maps)], batch, 0).values()))
    checks.check_query_shares(shares())
    assert capsys.readouterr().out.count("PASSED") == 2


@pytest.mark.parametrize("knobs, match", [
    ({"shift": 1}, "one position after"),
    ({"shift": -1}, "one position before"),
    ({"columns": True}, "columns instead of rows"),
    ({"answer": "any"}, "every queried needle"),
    ({"clamp": True}, "clamped"),
    ({"renorm": True}, "renormalised"),
])
def test_query_shares_mistakes(knobs, match):
    fails(checks.check_query_shares, shares(**knobs), match)


def test_query_shares_shapes():
    def per_position(maps, batch):
        return answer_noise_shares(maps, batch.answer_mask.any(1)[:, None, None], batch.context_mask)[0].sum(-2), \
            maps.sum(-1)

    fails(checks.check_query_shares, per_position, "one share per position")

    def heads_averaged(maps, batch):
        a, n = shares()(maps, batch)
        return a.mean(1), n.mean(1)

    fails(checks.check_query_shares, heads_averaged, "one share per head")
    fails(checks.check_query_shares, lambda maps, batch: shares()(maps, batch)[0], "pair")


def ratio(*, finite="drop", signed=False, reduce="median", per_layer=False):
    def fn(logits):
        if per_layer:
            return sum(ratio()([lg]) for lg in logits) / len(logits)
        if finite == "drop":
            x = torch.cat([lg[torch.isfinite(lg)] for lg in logits])
        elif finite == "zero":
            x = torch.cat([torch.nan_to_num(lg, neginf=0.0).flatten() for lg in logits])
        else:
            x = torch.cat([lg.flatten() for lg in logits])
        a = x if signed else x.abs()
        middle = {"median": a.median, "mean": a.mean, "interpolated": lambda: torch.quantile(a, 0.5)}[reduce]()
        return (a.max() / middle).item()

    return fn


def test_logit_outlier_ratio_library_passes(capsys):
    checks.check_logit_outlier_ratio(lambda logits: logit_outliers([AttentionProbe(lg, lg) for lg in logits]))
    checks.check_logit_outlier_ratio(ratio())
    assert capsys.readouterr().out.count("PASSED") == 2


@pytest.mark.parametrize("knobs, match", [
    ({"finite": "keep"}, "returned (inf|nan).*finite logits"),
    ({"finite": "zero"}, "as zeros"),
    ({"signed": True}, "signed logits"),
    ({"reduce": "mean"}, "mean instead of the median"),
    ({"reduce": "interpolated"}, "mean of the two middle values"),
    ({"per_layer": True}, "averaged the per-layer ratios"),
])
def test_logit_outlier_ratio_mistakes(knobs, match):
    fails(checks.check_logit_outlier_ratio, ratio(**knobs), match)


# ---------------------------------------------------------------- exercise 10


def v2(*, sigmoid=True, lam_layout="right", pairs="interleaved", sign=-1.0, subln=False, causal_mode="right"):
    """A learner's diff_v2 with one knob per mistake (the defaults are right)."""

    def fn(q, k, v, lam_logits, *, causal=False):
        s = torch.sigmoid(lam_logits) if sigmoid else lam_logits
        lam = rearrange(s, "b n h -> b h n 1") if lam_layout == "right" else s.reshape(q.shape[0], -1, q.shape[2], 1)
        if pairs == "blocked":
            q = rearrange(q, "b (two h) n d -> b (h two) n d", two=2)
        out = softmax_attention(q, k, v, causal=causal and causal_mode == "right")
        h = q.shape[1] // 2
        o = out[:, :h] + sign * lam * out[:, h:] if pairs == "halves" else out[:, 0::2] + sign * lam * out[:, 1::2]
        return rms_norm(o, None, 1e-5) if subln else o

    return fn


def test_diff_v2_library_passes(capsys):
    checks.check_diff_v2(lambda q, k, v, lg, causal=False: diff_attention_v2(
        q, k, v, rearrange(torch.sigmoid(lg), "b n h -> b h n 1"), causal=causal))
    checks.check_diff_v2(v2())
    assert capsys.readouterr().out.count("PASSED") == 2


@pytest.mark.parametrize("knobs, match", [
    ({"sigmoid": False}, "without its sigmoid"),
    ({"lam_layout": "reshape"}, "axes are mixed up"),
    ({"pairs": "blocked"}, "blocked"),
    ({"pairs": "halves"}, "head i with head i \\+ H"),
    ({"sign": 1.0}, "sign is flipped"),
    ({"subln": True}, "sub-norm"),
    ({"causal_mode": "none"}, "causal mask is missing"),
])
def test_diff_v2_mistakes(knobs, match):
    fails(checks.check_diff_v2, v2(**knobs), match)


def test_pair_groups():
    checks.check_pair_groups(lambda H, Hkv: (torch.arange(2 * H) // (2 * H // Hkv)).view(H, 2))
    fails(checks.check_pair_groups, lambda H, Hkv: (torch.arange(2 * H) % Hkv).view(H, 2), "tiled")
    fails(checks.check_pair_groups, lambda H, Hkv: (torch.arange(H) // (H // Hkv)).repeat_interleave(2).view(H, 2),
          "grouped the H output heads")
    fails(checks.check_pair_groups, lambda H, Hkv: torch.arange(2 * H) // (2 * H // Hkv), "one row per pair")
    fails(checks.check_pair_groups, lambda H, Hkv: (torch.arange(2 * H) / (2 * H / Hkv)).floor().view(H, 2), "floats")


def forward_v2(*, sigmoid=True, out_proj=True, transpose=True):
    def fn(x, layer):
        B, N, _ = x.shape
        H, Hkv = layer.num_heads, layer.num_kv_heads
        q = rearrange(layer.q_proj(x), "b n (h d) -> b h n d", h=2 * H)
        k = rearrange(layer.k_proj(x), "b n (h d) -> b h n d", h=Hkv)
        v = rearrange(layer.v_proj(x), "b n (h d) -> b h n d", h=Hkv)
        heads = v2(sigmoid=sigmoid)(q, k, v, layer.lambda_proj(x), causal=True)
        merged = rearrange(heads, "b h n d -> b n (h d)") if transpose else heads.reshape(B, N, -1)
        return layer.o_proj(merged) if out_proj else merged

    return fn


def test_forward_v2():
    checks.check_forward_v2(forward_v2())
    checks.check_forward_v2(lambda x, layer: layer(x, causal=True))
    fails(checks.check_forward_v2, forward_v2(sigmoid=False), "without its sigmoid")
    fails(checks.check_forward_v2, forward_v2(out_proj=False), "output projection is missing")
    fails(checks.check_forward_v2, forward_v2(transpose=False), "mixes tokens")
    fails(checks.check_forward_v2, lambda x, layer: forward_v2()(x.detach(), layer), "x gets no gradient")


# ---------------------------------------------------------------- every check of 07 and 10

NAMES = ["check_query_shares", "check_logit_outlier_ratio", "check_diff_v2", "check_pair_groups", "check_forward_v2"]


@pytest.mark.parametrize("name", NAMES)
def test_stub_and_crash(name):
    check = getattr(checks, name)

    def stub(*args, **kwargs):
        raise NotImplementedError("write this")

    def crash(*args, **kwargs):
        raise IndexError("index 7 is out of bounds")

    with pytest.raises(checks.NotAttempted, match=f"TASK {check.task} not attempted yet"):
        check(stub)
    fails(check, crash, "raised IndexError: index 7 is out of bounds")


@pytest.mark.parametrize("name", NAMES)
def test_checks_leave_the_rng_alone(name):
    right = {"check_query_shares": shares(), "check_logit_outlier_ratio": ratio(), "check_diff_v2": v2(),
             "check_pair_groups": lambda H, Hkv: (torch.arange(2 * H) // (2 * H // Hkv)).view(H, 2),
             "check_forward_v2": forward_v2()}[name]
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    getattr(checks, name)(right)
    assert torch.equal(before, torch.random.get_rng_state())
