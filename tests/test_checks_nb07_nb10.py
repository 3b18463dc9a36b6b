"""The checks of exercises 07 (measuring attention) and 10 (DIFF V2): a right answer passes, the library is refused,
a stub is not attempted, a crash is a one-line hint, and plausible wrong answers fail with the hint that names the mistake."""

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


def test_query_shares_passes_a_right_answer_and_refuses_the_library(capsys):
    checks.check_query_shares(shares())  # gathers the rows by hand (answer_noise_shares, exercise 02's, is allowed)
    assert capsys.readouterr().out.count("PASSED") == 1
    fails(checks.check_query_shares, lambda maps, batch: tuple(
        attention_scores([AttentionProbe(maps, maps)], batch, 0).values()), "calls the library's attention_scores")


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


def test_logit_outlier_ratio_passes_a_right_answer_and_refuses_the_library(capsys):
    checks.check_logit_outlier_ratio(ratio())
    assert capsys.readouterr().out.count("PASSED") == 1
    fails(checks.check_logit_outlier_ratio, lambda logits: logit_outliers([AttentionProbe(lg, lg) for lg in logits]),
          "calls the library's logit_outliers")


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


def attend(q, k, v, *, causal=False, causal_mode="right", gqa="interleave"):
    """Softmax attention by hand, GQA and the causal mask included, with one knob per mistake."""
    rep = q.shape[1] // k.shape[1]
    k, v = ((k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)) if gqa == "interleave"
            else (k.repeat(1, rep, 1, 1), v.repeat(1, rep, 1, 1)))
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal and causal_mode != "none":
        nq, nk = s.shape[-2:]
        offset = {"right": nk - nq + 1, "top_left": 1, "strict": nk - nq}[causal_mode]
        s = s.masked_fill(torch.ones(nq, nk, dtype=torch.bool).triu(offset), float("-inf"))
    return torch.softmax(s, -1) @ v


def v2(*, sigmoid=True, lam_layout="right", pairs="interleaved", sign=-1.0, subln=False, causal_mode="right",
       gqa="interleave", library=False):
    """A learner's diff_v2 with one knob per mistake (the defaults are right)."""

    def fn(q, k, v, lam_logits, *, causal=False):
        s = torch.sigmoid(lam_logits) if sigmoid else lam_logits
        lam = rearrange(s, "b n h -> b h n 1") if lam_layout == "right" else s.reshape(q.shape[0], -1, q.shape[2], 1)
        if pairs == "blocked":
            q = rearrange(q, "b (two h) n d -> b (h two) n d", two=2)
        out = (softmax_attention(q, k, v, causal=causal) if library
               else attend(q, k, v, causal=causal, causal_mode=causal_mode, gqa=gqa))
        h = q.shape[1] // 2
        o = out[:, :h] + sign * lam * out[:, h:] if pairs == "halves" else out[:, 0::2] + sign * lam * out[:, 1::2]
        return rms_norm(o, None, 1e-5) if subln else o

    return fn


def test_diff_v2_by_hand_passes(capsys):
    checks.check_diff_v2(v2())
    assert capsys.readouterr().out.count("PASSED") == 1


def test_diff_v2_refuses_the_library():
    fails(checks.check_diff_v2, lambda q, k, v, lg, causal=False: diff_attention_v2(
        q, k, v, rearrange(torch.sigmoid(lg), "b n h -> b h n 1"), causal=causal), "calls the library's diff_attention_v2")
    fails(checks.check_diff_v2, v2(library=True), "calls the library's softmax_attention: .*rule")


@pytest.mark.parametrize("knobs, match", [
    ({"sigmoid": False}, "without its sigmoid"),
    ({"lam_layout": "reshape"}, "axes are mixed up"),
    ({"pairs": "blocked"}, "blocked"),
    ({"pairs": "halves"}, "head i with head i \\+ H"),
    ({"sign": 1.0}, "sign is flipped"),
    ({"subln": True}, "sub-norm"),
    ({"causal_mode": "none"}, "causal mask is missing"),
    ({"causal_mode": "top_left"}, "aligned top-left"),
    ({"causal_mode": "strict"}, "hides the query's own position"),
    ({"gqa": "tile"}, "KV heads are tiled"),
])
def test_diff_v2_mistakes(knobs, match):
    fails(checks.check_diff_v2, v2(**knobs), match)


def groups(H, Hkv, tiled=False, *, tiled_mode="right"):
    j = torch.arange(2 * H)
    if tiled:
        return (j % (Hkv if tiled_mode == "right" else 2 * H // Hkv)).view(H, 2)
    return (j // (2 * H // Hkv)).view(H, 2)


def test_pair_groups():
    checks.check_pair_groups(groups)
    fails(checks.check_pair_groups, lambda H, Hkv, tiled=False: (torch.arange(2 * H) % Hkv).view(H, 2), "tiled")
    fails(checks.check_pair_groups, lambda H, Hkv, tiled=False: groups(H, Hkv), "tiled=True this is the standard")
    fails(checks.check_pair_groups, lambda H, Hkv, tiled=False: groups(H, Hkv, tiled, tiled_mode="rep"),
          "tiled over the wrong count")
    fails(checks.check_pair_groups, lambda H, Hkv, tiled=False: (torch.arange(H) // (H // Hkv)).repeat_interleave(2)
          .view(H, 2), "grouped the H output heads")
    fails(checks.check_pair_groups, lambda H, Hkv, tiled=False: torch.arange(2 * H) // (2 * H // Hkv),
          "one row per pair")
    fails(checks.check_pair_groups, lambda H, Hkv, tiled=False: (torch.arange(2 * H) / (2 * H / Hkv)).floor()
          .view(H, 2), "floats")


def forward_v2(*, sigmoid="once", out_proj=True, merge="right", kv_from="memory", lam_from="x", diff=None):
    """A learner's cross-attention forward with one knob per mistake; diff: the learner's diff_v2 (Task 1)."""
    def fn(x, memory, layer):
        B, N, _ = x.shape
        H, Hkv = layer.num_heads, layer.num_kv_heads
        src = memory if kv_from == "memory" else x
        q = rearrange(layer.q_proj(x), "b n (h d) -> b h n d", h=2 * H)
        k = rearrange(layer.k_proj(src), "b n (h d) -> b h n d", h=Hkv)
        v = rearrange(layer.v_proj(src), "b n (h d) -> b h n d", h=Hkv)
        logits = layer.lambda_proj(x if lam_from == "x" else memory)
        logits = {"once": logits, "twice": torch.sigmoid(logits)}[sigmoid]
        heads = (diff or v2())(q, k, v, logits)
        merged = {"right": lambda: rearrange(heads, "b h n d -> b n (h d)"), "reshape": lambda: heads.reshape(B, N, -1),
                  "d_h": lambda: rearrange(heads, "b h n d -> b n (d h)")}[merge]()
        return layer.o_proj(merged) if out_proj else merged

    return fn


def test_forward_v2():
    checks.check_forward_v2(forward_v2())
    fails(checks.check_forward_v2, lambda x, memory, layer: layer(x), "calls the layer's own forward")
    fails(checks.check_forward_v2, forward_v2(sigmoid="twice"), "sigmoid is applied twice")
    fails(checks.check_forward_v2, forward_v2(out_proj=False), "output projection is missing")
    fails(checks.check_forward_v2, forward_v2(merge="reshape"), "mixes tokens")
    fails(checks.check_forward_v2, forward_v2(merge="d_h"), r"\(\(d h\)\)")
    fails(checks.check_forward_v2, forward_v2(kv_from="x"), "keys and values come from x")
    fails(checks.check_forward_v2, forward_v2(lam_from="memory"), "lambda is computed from the memory")
    fails(checks.check_forward_v2, lambda x, memory, layer: forward_v2()(x.detach(), memory, layer),
          "x gets no gradient")


def test_forward_v2_points_at_task_1():
    """A Task 1 mistake (here: no sigmoid in the learner's diff_v2) fails Task 3 naming Task 1, not generically."""
    ns = {"diff_v2": v2(sigmoid=False), "rearrange": rearrange, "torch": torch}
    exec(compile("def forward_v2(x, memory, layer):\n"
                 "    H, Hkv = layer.num_heads, layer.num_kv_heads\n"
                 "    q = rearrange(layer.q_proj(x), 'b n (h d) -> b h n d', h=2 * H)\n"
                 "    k = rearrange(layer.k_proj(memory), 'b n (h d) -> b h n d', h=Hkv)\n"
                 "    v = rearrange(layer.v_proj(memory), 'b n (h d) -> b h n d', h=Hkv)\n"
                 "    heads = diff_v2(q, k, v, layer.lambda_proj(x))\n"
                 "    return layer.o_proj(rearrange(heads, 'b h n d -> b n (h d)'))\n", "<cell>", "exec"), ns)
    with pytest.raises(CheckFailed, match="fix Task 1 first. Task 1's check says: .*without its sigmoid") as info:
        checks.check_forward_v2(ns["forward_v2"])
    assert "differs from the reference" not in str(info.value)


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
             "check_pair_groups": groups,
             "check_forward_v2": forward_v2()}[name]
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    getattr(checks, name)(right)
    assert torch.equal(before, torch.random.get_rng_state())
