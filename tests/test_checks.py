"""The exercise checks catch real mistakes: for every check, plausible wrong answers (written the way a learner
would write them) fail with the hint that names the mistake, and a right answer written by hand passes."""

from __future__ import annotations

import math

import pytest
import torch
from einops import rearrange

from diffattn_tutorial import checks
from diffattn_tutorial.checks import CheckFailed
from diffattn_tutorial.course.toys import amplifier_output
from diffattn_tutorial.functional import (
    causal_mask,
    expand_kv_groups,
    rms_norm,
    softmax_attention,
)
from diffattn_tutorial.layers.attention import MultiheadDiffAttn
from diffattn_tutorial.measure.attention_stats import answer_noise_shares


def fails(check, fn, match: str) -> None:
    with pytest.raises(CheckFailed, match=match):
        check(fn)


# --------------------------------------------------------------------------------------------
# every check: the library passes, a stub is "not attempted", a crash is reported as a hint
# --------------------------------------------------------------------------------------------


def _rms_by_hand(x, eps):
    """RMSNorm over the last dim, no weight, written out (check_rms_norm refuses the library's and PyTorch's)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _grouped_rms(x, weight=None, eps=1e-5, group=None):
    out = _rms_by_hand(x if group is None else x.unflatten(-1, (-1, group)), eps).reshape(x.shape)
    return out if weight is None else out * weight


def _expand_kv_by_hand(k, v, num_heads):
    """GQA for differential heads written out (check_expand_kv refuses the library's expand_kv_groups)."""
    rep = num_heads // v.shape[1]
    k = rearrange(k, "b (g two) n d -> b g two n d", two=2).repeat_interleave(rep, dim=1).flatten(1, 2)
    return k, v.repeat_interleave(rep, dim=1)


def _diff_attn_by_hand(q, k, v, lam):
    """The dual softmax on DiffLlama's blocked layout, written out (check_diff_attn refuses diff_attention)."""
    (q1, q2), (k1, k2) = q.chunk(2, dim=1), k.chunk(2, dim=1)
    s = q.shape[-1] ** -0.5
    return (torch.softmax(q1 @ k1.transpose(-1, -2) * s, -1) - lam * torch.softmax(q2 @ k2.transpose(-1, -2) * s, -1)) @ v


def _forward_by_hand(x, layer):
    """``layer(x, causal=True)`` with the maps written out (check_forward refuses the layer and diff_attention)."""
    d, n = layer.head_dim, x.shape[1]
    q = rearrange(layer.q_proj(x), "b n (h d) -> b h n d", d=d)
    k, v = expand_kv_groups(rearrange(layer.k_proj(x), "b n (h d) -> b h n d", d=d),
                            rearrange(layer.v_proj(x), "b n (h d) -> b h n d", d=2 * d), layer.num_heads)
    a = torch.softmax((q @ k.transpose(-1, -2) / d ** 0.5).masked_fill(~causal_mask(n, n), float("-inf")), -1)
    heads = layer.subln((a[:, 0::2] - layer.lambda_full() * a[:, 1::2]) @ v) * (1 - layer.lambda_init)
    return layer.out_proj(rearrange(heads, "b h n e -> b n (h e)"))


# right answers, written by hand: a check refuses the library's implementation of what its task builds (each such
# refusal is asserted in tests/test_checks_refuse_library.py)
LIBRARY = {
    "check_amplifier_output": lambda v_cm, v_d, gain_plus=1.0, gain_minus=1.0: (
        gain_plus * (v_cm + v_d / 2) - gain_minus * (v_cm - v_d / 2)),
    "check_gains": lambda amp: (amp(0.5, -0.5) - amp(0.0, 0.0), amp(1.0, 1.0) - amp(0.0, 0.0)),
    "check_cmrr_db": lambda ad, acm: math.inf if acm == 0 else 20 * math.log10(abs(ad) / abs(acm)),
    "check_attention": lambda q, k, v, keep: torch.softmax(  # by hand: the check refuses the library's attention
        (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~keep[:, None, None, :], float("-inf")), -1) @ v,
    "check_answer_noise_shares": lambda attn, answer, context: ((attn * answer).sum(-1),  # by hand: refused too
                                                                (attn * (context & ~answer)).sum(-1)),
    "check_split_pairs": lambda t: (t[:, 0::2], t[:, 1::2]),
    "check_diff_attn": _diff_attn_by_hand,  # q, k in the blocked layout (DiffLlama's)
    "check_lambda_init": lambda depth: 0.8 - 0.6 * math.exp(-0.3 * depth),
    "check_reparam_lambda": lambda q1, k1, q2, k2, li: torch.exp((q1 * k1).sum(-1)) - torch.exp((q2 * k2).sum(-1)) + li,
    "check_rms_norm": lambda x, weight=None, eps=1e-5, group=None: _grouped_rms(x, weight, eps, group),
    "check_subln": lambda x, num_heads, lambda_init, weight=None, eps=1e-5: rms_norm(
        x.unflatten(-1, (num_heads, -1)), weight, eps).flatten(-2) * (1 - lambda_init),
    "check_causal_mask": lambda nq, nk: torch.arange(nk)[None] <= torch.arange(nq)[:, None] + nk - nq,  # refused too
    "check_expand_kv": _expand_kv_by_hand,
    "check_forward": _forward_by_hand,
}
OUR_CHECKS = sorted(LIBRARY)


def test_every_check_of_notebooks_01_to_06_is_covered():
    ours = {n for n in checks.__all__ if n.startswith("check_")
            and getattr(checks, n).__module__.rsplit(".", 1)[-1] in {f"nb0{i}" for i in range(1, 7)}}
    assert ours == set(OUR_CHECKS)


@pytest.mark.parametrize("name", OUR_CHECKS)
def test_library_passes(name, capsys):
    getattr(checks, name)(LIBRARY[name])
    out = capsys.readouterr().out
    assert out.startswith("PASSED: ") and out.count("\n") == 1


@pytest.mark.parametrize("name", OUR_CHECKS)
def test_stub_is_not_attempted(name):
    def stub(*args, **kwargs):
        raise NotImplementedError("write this")

    check = getattr(checks, name)
    with pytest.raises(checks.NotAttempted) as info:
        check(stub)
    assert str(info.value) == (f"TASK {check.task} not attempted yet: replace `raise NotImplementedError` in "
                               f"`{check.function_name}` with your answer")
    assert isinstance(info.value, NotImplementedError) and info.value.__cause__ is None


@pytest.mark.parametrize("name", OUR_CHECKS)
def test_crash_is_a_hint(name):
    def crash(*args, **kwargs):
        raise IndexError("index 7 is out of bounds")

    fails(getattr(checks, name), crash, "raised IndexError: index 7 is out of bounds "
                                        "\\(line \\d+ of its cell: `raise IndexError")


# --------------------------------------------------------------------------------------------
# how a failure looks: one line in Jupyter (IPython's _render_traceback_), no traceback into the check
# --------------------------------------------------------------------------------------------


def test_failure_renders_as_its_hint_only():
    with pytest.raises(CheckFailed) as info:
        checks.check_lambda_init(lambda depth: 0.8 - 0.6 * math.exp(0.3 * depth))
    e = info.value
    lines = e._render_traceback_()
    assert len(lines) == 1 and "\n" not in lines[0]
    assert lines[0].endswith(f"FAILED:\x1b[0m {e}") and "wrong sign" in str(e)
    assert e.__cause__ is None and e.__suppress_context__  # no "during handling" chain into the check either


def test_not_attempted_renders_one_line():
    e = checks.NotAttempted(2, "diff_attn")
    assert e._render_traceback_() == [
        "\x1b[1;33mTASK 2 not attempted yet: replace `raise NotImplementedError` in `diff_attn` with your answer\x1b[0m"]


def test_a_surprise_inside_a_check_is_one_line_too():
    from diffattn_tutorial.checks._core import exercise_check

    @exercise_check(task=4, name="thing")
    def check_thing(fn):
        return torch.ones(2) @ fn()  # the learner's return value breaks the check itself

    with pytest.raises(CheckFailed, match="could not use what `thing` returned \\(RuntimeError"):
        check_thing(lambda: torch.ones(3))
    assert check_thing.task == 4 and check_thing.function_name == "thing"


def test_checks_know_their_task():
    for name in OUR_CHECKS:
        check = getattr(checks, name)
        assert isinstance(check.task, int) and check.function_name.isidentifier()


@pytest.mark.parametrize("name", OUR_CHECKS)
def test_checks_leave_the_rng_alone(name):
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    getattr(checks, name)(LIBRARY[name])
    assert torch.equal(before, torch.random.get_rng_state())


# --------------------------------------------------------------------------------------------
# 01 the differential amplifier
# --------------------------------------------------------------------------------------------


def _modes(fn):
    """A mistake written on the wires, run on the modes the check passes."""
    return lambda v_cm, v_d, gain_plus=1.0, gain_minus=1.0: fn(v_cm + v_d / 2, v_cm - v_d / 2, gain_plus, gain_minus)


def test_amplifier_output_mistakes():
    c = checks.check_amplifier_output
    fails(c, _modes(lambda vp, vm, gp, gm: gm * vm - gp * vp), "wrong order")
    fails(c, _modes(lambda vp, vm, gp, gm: gp * vp + gm * vm), "added the inputs")
    fails(c, _modes(lambda vp, vm, gp, gm: gm * vp - gp * vm), "gains are swapped")
    fails(c, _modes(lambda vp, vm, gp, gm: vp - vm), "gains are ignored")
    fails(c, _modes(lambda vp, vm, gp, gm: gp * (vp - vm)), "one gain for both")
    fails(c, _modes(lambda vp, vm, gp, gm: (gp * vp - gm * vm).sum()), "shape")
    fails(c, _modes(lambda vp, vm, gp, gm: 2 * gp * vp - gm * vm), "differs")
    out = lambda vp, vm, gain_plus=1.0, gain_minus=1.0: gain_plus * vp - gain_minus * vm  # noqa: E731 - by hand
    fails(c, out, "not the wires' voltages")  # the chapter's formula, on the modes
    fails(c, lambda cm, d, gain_plus=1.0, gain_minus=1.0: out(cm + d, cm - d, gain_plus, gain_minus),
          "whole difference")
    fails(c, lambda cm, d, gain_plus=1.0, gain_minus=1.0: out(cm - d / 2, cm + d / 2, gain_plus, gain_minus),
          "wrong sign")
    fails(c, amplifier_output, "calls the library's amplifier_output")


def _measure(*, offset=True, per_volt=True, order=True, cm_scale=1.0, absolute=False):
    def gains(amp):
        y0 = amp(0.0, 0.0) if offset else 0.0
        ad = (amp(0.5, -0.5) if per_volt else amp(1.0, -1.0)) - y0
        acm = amp(cm_scale, cm_scale) - y0
        ad, acm = (abs(ad), abs(acm)) if absolute else (ad, acm)
        return (ad, acm) if order else (acm, ad)
    return gains


def test_gains_mistakes():
    c = checks.check_gains
    checks.check_gains(_measure())
    fails(c, _measure(offset=False), "offset is counted as gain")
    fails(c, lambda amp: (amp(0.5, -0.5), amp(1.0, 1.0) - amp(0.0, 0.0)), "one reading only")
    fails(c, _measure(order=False), "wrong order")
    fails(c, _measure(per_volt=False), "divided by that difference")
    fails(c, _measure(cm_scale=0.5), "halved")
    fails(c, lambda amp: (amp(0.5, -0.5) - amp(0.0, 0.0)), "pair")
    fails(c, lambda amp: ("big", 1.0), "number")
    fails(checks.check_gains, lambda gp, gm: ((gp + gm) / 2, gp - gm), "could not use|raised TypeError")


def test_gains_keep_their_sign():
    c = checks.check_gains
    fails(c, lambda amp: (abs(amp(0.5, -0.5) - amp(0, 0)), amp(1.0, 1.0) - amp(0, 0)), "differential gain lost its sign")
    fails(c, lambda amp: (amp(0.5, -0.5) - amp(0, 0), abs(amp(1.0, 1.0) - amp(0, 0))), "common-mode gain lost its sign")


def test_cmrr_db_mistakes():
    c = checks.check_cmrr_db
    fails(c, lambda ad, acm: math.inf if acm == 0 else 20 * math.log10(ad / acm), "domain error.*either sign")
    fails(c, lambda ad, acm: math.inf if acm == 0 else abs(20 * math.log10(abs(ad / acm))), "below 0 dB.*positive")
    fails(c, lambda ad, acm: math.inf if acm == 0 else max(0.0, 20 * math.log10(abs(ad / acm))), "below 0 dB.*as 0")

    def guard(f):
        return lambda ad, acm: math.inf if acm == 0 else f(ad, acm)

    fails(c, guard(lambda ad, acm: 10 * math.log10(abs(ad / acm))), "power ratios")
    fails(c, guard(lambda ad, acm: 20 * math.log10(abs(acm / ad))), "upside down")
    fails(c, guard(lambda ad, acm: 20 * math.log(abs(ad / acm))), "natural log")
    fails(c, guard(lambda ad, acm: abs(ad / acm)), "plain ratio")
    fails(c, guard(lambda ad, acm: torch.log10(torch.tensor(ad / acm)) * 20), "NaN for gains of opposite signs")
    fails(c, guard(lambda ad, acm: math.log10(abs(ad / acm))), "forgot the factor")


# --------------------------------------------------------------------------------------------
# 02 softmax attention and noise
# --------------------------------------------------------------------------------------------


def _attn(scale_of, dim=-1, fill=float("-inf"), after=False, mask=lambda keep: keep[:, None, None, :]):
    def f(q, k, v, keep):
        s = q @ k.transpose(-1, -2) * scale_of(q, v)
        if after:
            return torch.softmax(s, dim=dim).masked_fill(~mask(keep), 0.0) @ v
        return torch.softmax(s.masked_fill(~mask(keep), fill), dim=dim) @ v
    return f


_D = lambda q, v: q.shape[-1] ** -0.5  # noqa: E731 - the right scale


def test_attention_mistakes():
    c = checks.check_attention
    fails(c, _attn(lambda q, v: 1.0), "forgot the scale")
    fails(c, _attn(lambda q, v: 1 / q.shape[-1]), "scaled by 1/d")
    fails(c, _attn(lambda q, v: v.shape[-1] ** -0.5), "value width")
    fails(c, _attn(lambda q, v: q.shape[-1] ** 0.5), "instead of dividing")
    fails(c, _attn(_D, dim=-2), "wrong axis")
    fails(c, lambda q, k, v, keep: torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, -1), "attention map")
    fails(c, lambda q, k, v, keep: LIBRARY["check_attention"](q, k, v.detach(), keep), "gradient")
    fails(c, lambda q, k, v, keep: LIBRARY["check_attention"](q.detach(), k.detach(), v.detach(), keep), "differentiabl")


def test_attention_padding_mistakes():
    c = checks.check_attention
    fails(c, _attn(_D, mask=lambda keep: torch.ones_like(keep)[:, None, None, :]), "padding keys still get weight")
    fails(c, lambda q, k, v, keep: _attn(_D)(q, k, v, torch.ones_like(keep)), "padding keys still get weight")
    fails(c, _attn(_D, mask=lambda keep: ~keep[:, None, None, :]), "inverted")
    fails(c, _attn(_D, after=True), "after the softmax")
    fails(c, _attn(_D, fill=0.0), "scores were set to 0")
    fails(c, _attn(_D, mask=lambda keep: keep[:, None, :, None]), "queries instead of the keys")


def test_attention_renormalised_after_the_softmax_is_right(capsys):
    def renormalised(q, k, v, keep):
        w = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, -1) * keep[:, None, None, :]
        return w / w.sum(-1, keepdim=True) @ v
    checks.check_attention(renormalised)
    assert capsys.readouterr().out.startswith("PASSED")


def test_attention_refuses_the_implementations():
    import torch.nn.functional as F
    c = checks.check_attention
    fails(c, lambda q, k, v, keep: F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :]),
          "calls PyTorch's scaled_dot_product_attention: .*rule")
    fails(c, lambda q, k, v, keep: softmax_attention(q, k, v, attn_mask=keep[:, None, None, :]),
          "calls the library's softmax_attention")
    fails(checks.check_answer_noise_shares, answer_noise_shares, "calls the library's answer_noise_shares: .*rule")


def test_answer_noise_shares_mistakes():
    c = checks.check_answer_noise_shares

    def share(attn, m):
        return (attn * m).sum(-1)

    fails(c, lambda a, ans, ctx: (share(a, ans), share(a, ctx)), "noise includes the answer")
    fails(c, lambda a, ans, ctx: (share(a, ans), 1 - share(a, ans)), "everything that is not the answer")
    fails(c, lambda a, ans, ctx: (share(a, ctx & ~ans), share(a, ans)), "wrong order")
    fails(c, lambda a, ans, ctx: ((a * ans).sum(-1) / ans.sum(-1), share(a, ctx & ~ans)), "averaged")
    fails(c, lambda a, ans, ctx: ((a * ans).sum(-2), (a * (ctx & ~ans)).sum(-2)), "summed over the queries")
    fails(c, lambda a, ans, ctx: share(a, ans), "pair")


_shares = LIBRARY["check_answer_noise_shares"]


def test_answer_noise_shares_on_differential_maps():
    """The maps include differential ones: negative entries, rows summing to 1 - lambda."""
    c = checks.check_answer_noise_shares
    fails(c, lambda a, ans, ctx: _shares(a.clamp(min=0), ans, ctx), "clamped the map")
    fails(c, lambda a, ans, ctx: _shares(a.abs(), ans, ctx), "absolute value of the map")
    fails(c, lambda a, ans, ctx: _shares(a / a.sum(-1, keepdim=True), ans, ctx), "renormalised")

    def clamp_renorm(a, ans, ctx):
        a = a.clamp(min=0)
        return _shares(a / a.sum(-1, keepdim=True), ans, ctx)

    fails(c, clamp_renorm, "clamped .* and renormalised")
    fails(c, lambda a, ans, ctx: tuple(t.clamp(min=0) for t in _shares(a, ans, ctx)), "lost its sign")


# --------------------------------------------------------------------------------------------
# 03 dual softmax
# --------------------------------------------------------------------------------------------


def test_split_pairs_mistakes():
    c = checks.check_split_pairs
    fails(c, lambda t: t.chunk(2, dim=1), "blocked")
    fails(c, lambda t: (t[:, 1::2], t[:, 0::2]), "swapped")
    fails(c, lambda t: t.chunk(2, dim=-1), "head dim d in halves")
    fails(c, lambda t: tuple(t.chunk(2, dim=1))[::-1], "blocked and swapped")
    fails(c, lambda t: t[:, 0::2], "pair")
    fails(c, lambda t: (t[:, 0::2], t[:, 1::2][:, :1]), "shape")


def _dual(q, k, v, lam, *, scale=None, dim=-1, blocked=False, order=1, lam_float=False):
    H = q.shape[1] // 2
    if blocked:
        q1, q2, k1, k2 = q[:, :H], q[:, H:], k[:, :H], k[:, H:]
    else:
        q1, q2, k1, k2 = q[:, 0::2], q[:, 1::2], k[:, 0::2], k[:, 1::2]
    if order < 0:
        q1, q2, k1, k2 = q2, q1, k2, k1
    s = q.shape[-1] ** -0.5 if scale is None else scale
    a1 = torch.softmax(q1 @ k1.transpose(-1, -2) * s, dim=dim)
    a2 = torch.softmax(q2 @ k2.transpose(-1, -2) * s, dim=dim)
    return (a1 - (lam.item() if lam_float else lam) * a2) @ v


def _blocked(fn):
    """A mistake written on the interleaved layout, run on the blocked heads the check passes."""
    from diffattn_tutorial.checks._helpers import blocked_as_interleaved
    return lambda q, k, v, lam: fn(blocked_as_interleaved(q), blocked_as_interleaved(k), v, lam)


def test_diff_attn_mistakes():
    c = lambda fn: checks.check_diff_attn(_blocked(fn))  # noqa: E731
    c(_dual)
    fails(c, lambda q, k, v, lam: _dual(q, k, v, lam, scale=1.0), "forgot the scale")
    fails(c, lambda q, k, v, lam: _dual(q, k, v, lam, scale=v.shape[-1] ** -0.5), "full head dim \\(2d\\)")
    fails(c, lambda q, k, v, lam: _dual(q, k, v, lam, scale=1 / q.shape[-1]), "scaled by 1/d")
    fails(c, lambda q, k, v, lam: _dual(q, k, v, lam, order=-1), "wrong order")
    fails(checks.check_diff_attn, _dual, "interleaved \\(2i with 2i \\+ 1, Task 1")
    fails(c, lambda q, k, v, lam: _dual(q, k, v, lam, dim=-2), "wrong axis")
    fails(c, lambda q, k, v, lam: lam * _dual(q, k, v, torch.tensor(1.0, dtype=q.dtype)), "both maps")
    fails(c, lambda q, k, v, lam: _dual(q, k, v, torch.tensor(1.0, dtype=q.dtype)), "lambda is ignored")
    fails(c, lambda q, k, v, lam: _dual(q, k, v, lam, lam_float=True), "lam gets no gradient.*lam.item")
    fails(c, lambda q, k, v, lam: _dual(q, k, v, lam.abs()), "lambda lost its sign")
    fails(c, lambda q, k, v, lam: _dual(q, k, v, lam.clamp(min=0)), "lambda was clamped")

    def before_softmax(q, k, v, lam):
        s = (q[:, 0::2] @ k[:, 0::2].transpose(-1, -2) - lam * q[:, 1::2] @ k[:, 1::2].transpose(-1, -2))
        return torch.softmax(s / q.shape[-1] ** 0.5, -1) @ v

    fails(c, before_softmax, "before one softmax")

    def split_v(q, k, v, lam):
        va, vb = v.chunk(2, dim=-1)
        s = q.shape[-1] ** -0.5
        return (torch.softmax(q[:, 0::2] @ k[:, 0::2].transpose(-1, -2) * s, -1) @ va
                - lam * torch.softmax(q[:, 1::2] @ k[:, 1::2].transpose(-1, -2) * s, -1) @ vb)

    fails(c, split_v, "width d")
    fails(c, lambda q, k, v, lam: torch.softmax(q @ k.transpose(-1, -2), -1) @ v.repeat_interleave(2, 1), "2H heads")


# --------------------------------------------------------------------------------------------
# 04 lambda
# --------------------------------------------------------------------------------------------


def test_lambda_init_mistakes():
    c = checks.check_lambda_init
    fails(c, lambda depth: 0.8 - 0.6 * math.exp(-0.3 * (depth - 1)), "off by one layer.*do not subtract 1")
    fails(c, lambda depth: 0.8 - 0.6 * math.exp(-0.3 * (depth + 1)), "off by one layer.*do not add 1")
    fails(c, lambda depth: 0.8 - 0.6 * math.exp(0.3 * depth), "wrong sign")
    fails(c, lambda depth: 0.6 - 0.8 * math.exp(-0.3 * depth), "swapped")
    fails(c, lambda depth: 0.8 + 0.6 * math.exp(-0.3 * depth), "added instead")
    fails(c, lambda depth: 0.8 - 0.6 * torch.exp(torch.tensor(-0.3 * depth)), "returned a tensor: return a Python float")
    fails(c, lambda depth: 0.8, "differs")
    fails(c, lambda depth: [0.8], "number")


def test_reparam_lambda_mistakes():
    c = checks.check_reparam_lambda

    def dot(a, b):
        return (a * b).sum(-1)

    fails(c, lambda q1, k1, q2, k2, li: torch.exp(dot(q1, k1)) - torch.exp(dot(q2, k2)), "forgot lambda_init")
    fails(c, lambda q1, k1, q2, k2, li: torch.exp(dot(q2, k2)) - torch.exp(dot(q1, k1)) + li, "wrong order")
    fails(c, lambda q1, k1, q2, k2, li: dot(q1, k1) - dot(q2, k2) + li, "forgot the exp")
    fails(c, lambda q1, k1, q2, k2, li: (torch.exp(q1 * k1).sum(-1) - torch.exp(q2 * k2).sum(-1) + li), "exp before the sum")
    fails(c, lambda q1, k1, q2, k2, li: torch.exp(dot(q1, q2)) - torch.exp(dot(k1, k2)) + li, "wrong vectors")
    fails(c, lambda q1, k1, q2, k2, li: torch.exp(dot(q1, k2)) - torch.exp(dot(q2, k1)) + li, "crossed the pairs")
    fails(c, lambda q1, k1, q2, k2, li: torch.exp(dot(q1, k1) - dot(q2, k2)) + li, "one exp of the difference")
    fails(c, lambda q1, k1, q2, k2, li: torch.exp(dot(q1, k1)) - torch.exp(dot(q2, k2)) - li, "subtracted lambda_init")
    fails(c, lambda q1, k1, q2, k2, li: math.exp(dot(q1, k1).sum()) - math.exp(dot(q2, k2).sum()) + li, "Python number")
    fails(c, lambda q1, k1, q2, k2, li: torch.exp(q1 * k1) - torch.exp(q2 * k2) + li, "the vectors' own")
    fails(c, lambda q1, k1, q2, k2, li: torch.exp(dot(q1, k1.detach())) - torch.exp(dot(q2, k2)) + li,
          "lambda_k1 gets no gradient")
    dots = [lambda a, b: (a * b).sum(), lambda a, b: (a * b).sum(0), lambda a, b: a @ b.transpose(-1, -2)]
    for dot_, match in zip(dots, ["one number for", "summed over the heads", r"\(H, H\) matrix"]):
        fails(c, lambda q1, k1, q2, k2, li, f=dot_: torch.exp(f(q1, k1)) - torch.exp(f(q2, k2)) + li, match)


def test_reparam_lambda_any_dot_product_over_d_passes(capsys):
    c = checks.check_reparam_lambda
    c(lambda q1, k1, q2, k2, li: torch.exp(torch.einsum("...d,...d->...", q1, k1))
      - torch.exp(torch.einsum("...d,...d->...", q2, k2)) + li)
    assert capsys.readouterr().out.startswith("PASSED")


# --------------------------------------------------------------------------------------------
# 05 sub-norm
# --------------------------------------------------------------------------------------------


def _rms(dim=-1, center=False, eps_inside=True, sqrt=True, mean=True, use_weight=True, groups="consecutive"):
    def f(x, weight=None, eps=1e-5, group=None):
        D = x.shape[-1]
        if group is not None and groups == "consecutive":
            parts = x.unflatten(-1, (-1, group))
        elif group is not None and groups == "strided":
            parts = x.unflatten(-1, (group, -1)).transpose(-1, -2)
        else:
            parts = x
        y = parts - parts.mean(dim, keepdim=True) if center else parts
        ms = y.pow(2).mean(dim, keepdim=True) if mean else y.pow(2).sum(dim, keepdim=True)
        den = (ms + eps).sqrt() if eps_inside and sqrt else (ms.sqrt() + eps if sqrt else ms + eps)
        out = y / den
        out = out.transpose(-1, -2).reshape(x.shape) if (group is not None and groups == "strided") else \
            out.reshape(*x.shape[:-1], D)
        return out * weight if (weight is not None and use_weight) else out
    return f


def test_rms_norm_mistakes():
    c = checks.check_rms_norm
    checks.check_rms_norm(_rms())
    fails(c, _rms(dim=-2), "wrong axis")
    fails(c, _rms(center=True), "LayerNorm")
    fails(c, _rms(eps_inside=False), "eps is outside")
    fails(c, _rms(sqrt=False), "square root")
    fails(c, _rms(mean=False), "L2 norm")
    fails(c, _rms(use_weight=False), "forgot the weight")
    fails(c, _rms(groups="ignored"), "group is ignored")
    fails(c, _rms(groups="strided"), "strided")
    fails(c, lambda x, weight=None, eps=1e-5, group=None: torch.nn.functional.layer_norm(
        x, x.shape[-1:], weight, eps=eps), "LayerNorm")
    fails(c, lambda x, weight=None, eps=1e-5, group=None: _grouped_rms(
        x, None if weight is None else weight.abs(), eps, group), "lost its sign")
    fails(c, lambda x, weight=None, eps=1e-6, group=None: _grouped_rms(x, weight, eps, group), "default eps")


def test_subln_mistakes():
    c = checks.check_subln

    def subln(norm, factor, *, split="(h e)", tile="repeat", use_weight=True):
        def f(x, num_heads, lambda_init, weight=None, eps=1e-5):
            heads = rearrange(x, f"b n {split} -> b h n e", h=num_heads)
            out = norm(heads, None, eps)
            out = rearrange(out, f"b h n e -> b n {split}")
            if weight is not None and use_weight:
                out = out * (weight.repeat(num_heads) if tile == "repeat" else weight.repeat_interleave(num_heads))
            return out * factor(lambda_init)
        return f

    right = lambda li: 1 - li  # noqa: E731
    checks.check_subln(subln(_rms(), right))
    fails(c, subln(_rms(), lambda li: 1.0), "missing \\(1 - lambda_init\\)")
    fails(c, subln(_rms(), lambda li: li), "multiplied by lambda_init")
    fails(c, subln(_rms(), lambda li: 1 + li), "1 \\+ lambda_init")
    fails(c, subln(_rms(), right, split="(e h)"), "split the heads the wrong way")
    fails(c, subln(_rms(), right, tile="interleave"), "spread wrongly over the heads")
    fails(c, subln(_rms(), right, use_weight=False), "forgot the weight")

    def joint(x, num_heads, lambda_init, weight=None, eps=1e-5):
        return rms_norm(x, None, eps) * (1 if weight is None else weight.repeat(num_heads)) * (1 - lambda_init)

    fails(c, joint, "all heads of a token together")

    def per_half(x, num_heads, lambda_init, weight=None, eps=1e-5):
        out = _grouped_rms(x, None, eps, group=x.shape[-1] // num_heads // 2)
        return out * (1 if weight is None else weight.repeat(num_heads)) * (1 - lambda_init)

    fails(c, per_half, "each half")


# --------------------------------------------------------------------------------------------
# 06 full module
# --------------------------------------------------------------------------------------------


def _mask(rel):
    def f(nq, nk):
        i, j = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
        return rel(i, j, nk - nq)
    return f


def test_causal_mask_mistakes():
    c = checks.check_causal_mask
    checks.check_causal_mask(_mask(lambda i, j, off: j <= i + off))
    fails(c, _mask(lambda i, j, off: j < i + off), "diagonal is wrong")
    fails(c, _mask(lambda i, j, off: j <= i), "top-left")
    fails(c, lambda nq, nk: torch.ones(nq, nk, dtype=torch.bool).tril(), "top-left")
    fails(c, _mask(lambda i, j, off: j > i + off), "inverted")
    fails(c, lambda nq, nk: torch.ones(nq, nk, dtype=torch.bool).triu(1), "inverted")
    fails(c, _mask(lambda i, j, off: j >= i + off), "inverted and its diagonal")
    right = _mask(lambda i, j, off: j <= i + off)
    fails(c, lambda nq, nk: torch.zeros(nq, nk).masked_fill(~right(nq, nk), -math.inf), "dtype")
    fails(c, lambda nq, nk: right(nq, nk).int(), "bool mask")
    fails(c, causal_mask, "calls the library's causal_mask")


def test_expand_kv_mistakes():
    c = checks.check_expand_kv

    def rep_of(v, H):
        return H // v.shape[1]

    fails(c, lambda k, v, H: (k.repeat(1, rep_of(v, H), 1, 1), v.repeat(1, rep_of(v, H), 1, 1)),
          "k and v are tiled")
    expand_kv_groups = _expand_kv_by_hand  # the check refuses the library's
    fails(c, lambda k, v, H: (expand_kv_groups(k, v, H)[0], v.repeat(1, rep_of(v, H), 1, 1)), "wrong for v")
    fails(c, lambda k, v, H: (k.repeat_interleave(rep_of(v, H), 1), v.repeat_interleave(rep_of(v, H), 1)),
          "one at a time.*unilm")
    fails(c, lambda k, v, H: (k.repeat(1, rep_of(v, H), 1, 1), expand_kv_groups(k, v, H)[1]), "keys are tiled")
    fails(c, lambda k, v, H: (expand_kv_groups(k, v, H)[0], v.repeat_interleave(2 * rep_of(v, H), 1)), "2H heads")
    fails(c, lambda k, v, H: (k, v), "shape")
    fails(c, lambda k, v, H: expand_kv_groups(k, v, H)[0], "pair")
    fails(c, lambda k, v, H: tuple(t.detach() for t in expand_kv_groups(k, v, H)), "differentiabl")


def learner_forward(x, layer, *, scale="d", swap=False, blocked=False, mask="causal", gqa="right",
                    factor="right", norm="subln", merge="right", lambda_init=None, lam_const=False):
    """A learner's full forward written from scratch with explicit maps, with one knob per mistake."""
    B, N, C = x.shape
    H, Hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    q = layer.q_proj(x).view(B, N, 2 * H, d).transpose(1, 2)
    k = layer.k_proj(x).view(B, N, 2 * Hkv, d).transpose(1, 2)
    v = layer.v_proj(x).view(B, N, Hkv, 2 * d).transpose(1, 2)
    rep = H // Hkv
    if gqa == "right":
        k, v = expand_kv_groups(k, v, H)
    elif gqa == "tile":
        k, v = k.repeat(1, rep, 1, 1), v.repeat(1, rep, 1, 1)
    elif gqa == "one_by_one":
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    if blocked:
        q1, q2, k1, k2 = q[:, :H], q[:, H:], k[:, :H], k[:, H:]
    else:
        q1, q2, k1, k2 = q[:, 0::2], q[:, 1::2], k[:, 0::2], k[:, 1::2]
    if swap:
        q1, q2, k1, k2 = q2, q1, k2, k1
    s = {"d": d ** -0.5, "2d": (2 * d) ** -0.5, "none": 1.0}[scale]
    li = layer.lambda_init if lambda_init is None else lambda_init
    lam = torch.exp((layer.lambda_q1 * layer.lambda_k1).sum()) - torch.exp((layer.lambda_q2 * layer.lambda_k2).sum()) + li
    if lam_const:
        lam = lam.item()
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    future = {"causal": j > i, "strict": j >= i, "strict_big": j >= i, "strict_add": j >= i, "none": torch.zeros(N, N, dtype=torch.bool),
              "inverted": j <= i, "anti": j < i}[mask]
    fill = -1e9 if mask == "strict_big" else -math.inf
    if mask == "strict_add":  # an additive float mask with a large negative number
        add = torch.zeros(N, N, dtype=x.dtype).masked_fill(future, -1e9)
        a1 = torch.softmax(q1 @ k1.transpose(-1, -2) * s + add, -1)
        a2 = torch.softmax(q2 @ k2.transpose(-1, -2) * s + add, -1)
    else:
        a1 = torch.softmax((q1 @ k1.transpose(-1, -2) * s).masked_fill(future, fill), -1)
        a2 = torch.softmax((q2 @ k2.transpose(-1, -2) * s).masked_fill(future, fill), -1)
    o = (a1 - lam * a2) @ v  # (B, H, N, 2d)
    if norm == "subln":
        o = layer.subln(o)
    elif norm == "tokens":
        o = o * torch.rsqrt(o.pow(2).mean(-2, keepdim=True) + 1e-5) * layer.subln.weight
    if factor == "right":
        o = o * (1 - li)
    if merge == "right":
        o = o.transpose(1, 2).reshape(B, N, H * 2 * d)
    else:
        o = o.reshape(B, N, H * 2 * d)
    return layer.out_proj(o)


def test_forward_reference_learner_passes():
    checks.check_forward(learner_forward)


@pytest.mark.parametrize("knobs, match", [
    ({"scale": "none"}, "forgot the scale"),
    ({"scale": "2d"}, "full head dim \\(2d\\)"),
    ({"swap": True}, "wrong order"),
    ({"blocked": True}, "blocked"),
    ({"mask": "none"}, "no causal mask"),
    ({"mask": "strict"}, "NaN for the first token.*diagonal"),
    ({"mask": "strict_big"}, "diagonal is wrong.*large negative fill"),
    ({"mask": "strict_add"}, "diagonal is wrong.*large negative number added"),
    ({"mask": "inverted"}, "NaN for the last token.*inverted"),
    ({"mask": "anti"}, "mask is inverted: it hides the past"),
    ({"factor": "none"}, "missing \\(1 - lambda_init\\)"),
    ({"norm": "none"}, "no sub-norm"),
    ({"norm": "tokens"}, "sub-norm over the wrong axis"),
    ({"merge": "no_transpose"}, "mixes tokens"),
    ({"gqa": "tile"}, "GQA grouping wrong.*tiled"),
    ({"gqa": "one_by_one"}, "GQA grouping wrong.*one at a time"),
    ({"lam_const": True}, "lambda_q1 gets no gradient"),
])
def test_forward_mistakes(knobs, match):
    fails(checks.check_forward, lambda x, layer: learner_forward(x, layer, **knobs), match)


def test_forward_lambda_init_off_by_one():
    def one_based(x, layer):  # the paper's l - 1 applied to an index that is already 0-based
        return learner_forward(x, layer, lambda_init=0.8 - 0.6 * math.exp(-0.3 * (layer.depth - 1)))

    fails(checks.check_forward, one_based, "lambda_init off by one layer")


def test_forward_detached_input_and_copied_weights():
    fails(checks.check_forward, lambda x, layer: learner_forward(x.detach(), layer).detach(), "differentiabl")

    def copied(x, layer):
        import copy
        return learner_forward(x, copy.deepcopy(layer))

    fails(checks.check_forward, copied, "none of the layer's parameters gets a gradient")


def test_forward_variants_cover_the_module():
    """The hint builder, with every knob at its default, is the module itself (else the hints could lie)."""
    from diffattn_tutorial.checks import nb06
    from diffattn_tutorial.checks._core import close, randn

    for i, (C, H, Hkv, depth, B, N) in enumerate(nb06._LAYERS):
        layer = nb06._make_layer(i, C, H, Hkv, depth)
        assert isinstance(layer, MultiheadDiffAttn)
        x = randn(B, N, C, seed=1)
        with torch.no_grad():
            assert close(nb06._variant(layer, x), layer(x, causal=True))


def test_package_exports_exactly_every_submodule_check():
    """``checks/__init__.py`` imports each submodule's checks by name: a new or renamed check must be listed there."""
    import importlib
    import pkgutil

    exported = {n for n in checks.__all__ if n.startswith("check_")}
    declared = set()
    for info in pkgutil.iter_modules(checks.__path__):
        if info.name.startswith("nb"):
            declared |= set(importlib.import_module(f"{checks.__name__}.{info.name}").__all__)
    assert exported == declared, f"only in __init__: {exported - declared}; missing there: {declared - exported}"
    assert all(callable(getattr(checks, n)) for n in exported)
