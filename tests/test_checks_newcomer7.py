"""Wrong answers to exercises 05, 06 and 11 that a learner plausibly writes: each fails its check with a hint that
names the mistake, and handing in the library's own implementation of the task is refused by name."""

import math

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange

from diffattn_tutorial import causal_mask as library_causal_mask
from diffattn_tutorial import diff_attention
from diffattn_tutorial.checks import (
    CheckFailed,
    check_axonml_fixed,
    check_causal_mask,
    check_forward,
    check_four_calls_gqa,
    check_subln,
)

# --- exercise 05, TASK 2 -------------------------------------------------------------------------------------------


def subln_feature_major(x, num_heads, lambda_init, weight=None, eps=1e-5):
    """Heads read as "(d h)": feature j of every head side by side, not head after head."""
    h = rearrange(x, "b n (d h) -> b h n d", h=num_heads)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (1 if weight is None else weight)
    return rearrange(h * (1 - lambda_init), "b h n d -> b n (d h)")


def test_subln_heads_read_feature_major_is_named():
    with pytest.raises(CheckFailed, match=r"consecutive|head h's features"):
        check_subln(subln_feature_major)


# --- exercise 06 ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule, hint", [(lambda i, j, off: j <= i - off, "offset has the wrong sign"),
                                        (lambda i, j, off: j <= i + off + 1, "off by one")])
def test_causal_mask_offset_mistakes_are_named(rule, hint):
    def mask(nq, nk):
        return rule(torch.arange(nq)[:, None], torch.arange(nk)[None, :], nk - nq)

    with pytest.raises(CheckFailed, match=hint):
        check_causal_mask(mask)


def test_causal_mask_from_the_library_is_refused():
    with pytest.raises(CheckFailed, match="calls the library's causal_mask"):
        check_causal_mask(lambda nq, nk: library_causal_mask(nq, nk))


def forward_by_the_layer(x, layer):
    return layer(x, causal=True)


def forward_by_attention_heads(x, layer):
    heads = layer.subln(layer.attention_heads(x, causal=True)) * (1 - layer.lambda_init)
    return layer.out_proj(rearrange(heads, "b h n e -> b n (h e)"))


def forward_by_diff_attention(x, layer):
    d = layer.head_dim
    q = rearrange(layer.q_proj(x), "b n (h d) -> b h n d", d=d)
    k = rearrange(layer.k_proj(x), "b n (h d) -> b h n d", d=d)
    v = rearrange(layer.v_proj(x), "b n (h d) -> b h n d", d=2 * d)
    heads = diff_attention(q, k, v, layer.lambda_full(), causal=True)
    heads = layer.subln(heads) * (1 - layer.lambda_init)
    return layer.out_proj(rearrange(heads, "b h n e -> b n (h e)"))


@pytest.mark.parametrize("answer, called", [(forward_by_the_layer, "the layer's own forward"),
                                            (forward_by_attention_heads, "the layer's attention_heads"),
                                            (forward_by_diff_attention, "the library's diff_attention")])
def test_forward_by_the_library_is_refused(answer, called):
    with pytest.raises(CheckFailed, match=f"calls {called}"):
        check_forward(answer)


def make_forward(*, lam="right", sign=-1.0, factor="after", order="a1 first"):
    """The exercise's forward by hand, MHA or GQA, one knob per mistake (the defaults are right)."""

    def forward(x, layer):
        H, Hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        q = rearrange(layer.q_proj(x), "b n (h d) -> b h n d", d=d)
        k = rearrange(layer.k_proj(x), "b n (h two d) -> b h two n d", two=2, d=d)
        v = rearrange(layer.v_proj(x), "b n (h d) -> b h n d", d=2 * d)
        k = rearrange(k.repeat_interleave(H // Hkv, 1), "b h two n d -> b (h two) n d")
        v = v.repeat_interleave(H // Hkv, 1)
        lam_ = (torch.exp((layer.lambda_q1 * layer.lambda_k1).sum())
                - torch.exp((layer.lambda_q2 * layer.lambda_k2).sum()))
        lam_ = {"right": lam_ + layer.lambda_init, "no_lambda_init": lam_, "init_only": layer.lambda_init}[lam]
        n = x.shape[1]
        s = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(~library_causal_mask(n, n), float("-inf"))
        a = torch.softmax(s, -1)
        heads = (a[:, 0::2] + sign * lam_ * a[:, 1::2]) @ v
        heads = -heads if order == "a2 first" else heads
        fac = {"one_minus_lambda": 1 - lam_, "one_plus": 1 + layer.lambda_init}.get(factor, 1 - layer.lambda_init)
        heads = layer.subln(heads * fac) if factor == "before" else layer.subln(heads) * fac
        return layer.out_proj(rearrange(heads, "b h n e -> b n (h e)"))

    return forward


def test_forward_by_hand_passes(capsys):
    check_forward(make_forward())
    assert "PASSED" in capsys.readouterr().out


@pytest.mark.parametrize("knobs, hint", [
    ({"lam": "no_lambda_init"}, r"lambda without lambda_init"),
    ({"sign": +1.0}, r"added lambda A2"),
    ({"factor": "one_minus_lambda"}, r"\(1 - lambda\) instead of \(1 - lambda_init\)"),
    ({"factor": "before"}, r"before the sub-norm"),
    ({"lam": "init_only"}, r"lambda is lambda_init alone"),
    ({"order": "a2 first"}, r"subtracted the wrong way round"),
    ({"factor": "one_plus"}, r"\(1 \+ lambda_init\)"),
])
def test_forward_mistakes_are_named(knobs, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_forward(make_forward(**knobs))


# --- exercise 11 ---------------------------------------------------------------------------------------------------


def axonml_by_diff_attention(q, k, v, lam, attn_mask):
    """The library's diff_attention on axonml's halves, rearranged into interleaved maps."""
    split = lambda t: rearrange(t, "b h n (two d) -> b (h two) n d", two=2)  # noqa: E731
    return diff_attention(split(q), split(k), v, lam, attn_mask=attn_mask)


def four_calls_by_diff_attention(q, k, v, lam):
    return diff_attention(q, k, v, lam, causal=True)


def test_axonml_by_the_library_is_refused():
    with pytest.raises(CheckFailed, match="calls the library's diff_attention"):
        check_axonml_fixed(axonml_by_diff_attention)


def test_four_calls_by_the_library_is_refused():
    with pytest.raises(CheckFailed, match="calls the library's diff_attention"):
        check_four_calls_gqa(four_calls_by_diff_attention)


def four_calls_two_sdpa(q, k, v, lam):
    """Two SDPA calls with V of width 2d, right under GQA: allowed (PyTorch's SDPA is what the task uses)."""
    rep = q.shape[1] // k.shape[1]
    k1, k2 = k[:, 0::2].repeat_interleave(rep, 1), k[:, 1::2].repeat_interleave(rep, 1)
    v = v.repeat_interleave(rep, 1)
    sdpa = lambda q, k: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    return sdpa(q[:, 0::2], k1) - lam * sdpa(q[:, 1::2], k2)


def test_four_calls_with_sdpa_still_pass(capsys):
    check_four_calls_gqa(four_calls_two_sdpa)
    assert "PASSED" in capsys.readouterr().out


# --- more named mistakes: exercise 05 TASK 1, exercise 11 TASKS 1 and 3 ---------------------------------------------

from diffattn_tutorial.checks import check_rms_norm  # noqa: E402


def rms_norm_right(x, weight=None, eps=1e-5, group=None):
    g = x.shape[-1] if group is None else group
    parts = x.unflatten(-1, (-1, g))
    out = (parts * torch.rsqrt(parts.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    return out if weight is None else out * weight


def rms_norm_in_place(x, weight=None, eps=1e-5, group=None):
    out = rms_norm_right(x, weight, eps, group)
    x.mul_(0.0)  # scratch reuse of the input: the caller's tensor is lost
    return out


def rms_norm_fixed_eps(x, weight=None, eps=1e-5, group=None):
    return rms_norm_right(x, weight, 1e-5, group)


@pytest.mark.parametrize("answer, hint", [(rms_norm_in_place, "changed its input x in place"),
                                          (rms_norm_fixed_eps, "eps argument is ignored")])
def test_rms_norm_mistakes_are_named(answer, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_rms_norm(answer)


def axonml_inverted_mask(q, k, v, lam, attn_mask):
    half = q.shape[-1] // 2
    s1 = q[..., :half] @ k[..., :half].transpose(-1, -2) * half ** -0.5
    s2 = q[..., half:] @ k[..., half:].transpose(-1, -2) * half ** -0.5
    if attn_mask is not None:  # fills where the mask is True: the keys a query may attend
        s1, s2 = s1.masked_fill(attn_mask, float("-inf")), s2.masked_fill(attn_mask, float("-inf"))
    return (torch.softmax(s1, -1) - lam * torch.softmax(s2, -1)) @ v


def test_axonml_inverted_mask_is_named():
    with pytest.raises(CheckFailed, match="mask is inverted"):
        check_axonml_fixed(axonml_inverted_mask)


def four_calls_values_tiled(q, k, v, lam):
    rep = q.shape[1] // k.shape[1]
    k1, k2 = k[:, 0::2].repeat_interleave(rep, 1), k[:, 1::2].repeat_interleave(rep, 1)
    va, vb = v.repeat(1, rep, 1, 1).chunk(2, dim=-1)  # the keys right, the values tiled
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    q1, q2 = q[:, 0::2], q[:, 1::2]
    return (torch.cat([sdpa(q1, k1, va), sdpa(q1, k1, vb)], -1) - lam * torch.cat([sdpa(q2, k2, va), sdpa(q2, k2, vb)], -1))


def test_four_calls_values_tiled_is_named():
    with pytest.raises(CheckFailed, match="values are tiled"):
        check_four_calls_gqa(four_calls_values_tiled)


# --- exercise 07 TASK 2, exercise 10 TASK 1 --------------------------------------------------------------------------

from diffattn_tutorial.checks import check_diff_v2, check_logit_outlier_ratio  # noqa: E402


def _finite_abs(logits):
    return torch.cat([lg[torch.isfinite(lg)] for lg in logits])


@pytest.mark.parametrize("answer, hint", [
    (lambda logits: (_finite_abs(logits).abs().max() / _finite_abs(logits).median()).item(), "signed median"),
    (lambda logits: max((_finite_abs([lg]).abs().max() / _finite_abs([lg]).abs().median()).item() for lg in logits),
     "one layer's ratio"),
    (lambda logits: (_finite_abs(logits[:1]).abs().max() / _finite_abs(logits[:1]).abs().median()).item(),
     "one layer's ratio|only the first layer"),
])
def test_outlier_ratio_mistakes_are_named(answer, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_logit_outlier_ratio(answer)


def make_diff_v2(*, scale=True, lam_on="second"):
    def diff_v2(q, k, v, lam_logits, *, causal=False):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale else 1.0)
        if causal:
            nq, nk = q.shape[2], k.shape[2]
            s = s.masked_fill(torch.arange(nk)[None] > torch.arange(nq)[:, None] + nk - nq, float("-inf"))
        o = torch.softmax(s, -1) @ v
        lam = torch.sigmoid(lam_logits).transpose(1, 2)[..., None]
        return o[:, 0::2] - lam * o[:, 1::2] if lam_on == "second" else lam * o[:, 0::2] - o[:, 1::2]

    return diff_v2


def test_diff_v2_by_hand_passes(capsys):
    check_diff_v2(make_diff_v2())
    assert "PASSED" in capsys.readouterr().out


@pytest.mark.parametrize("knobs, hint", [({"scale": False}, "forgot the scale"),
                                         ({"lam_on": "first"}, "lambda scales the first head")])
def test_diff_v2_mistakes_are_named(knobs, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_diff_v2(make_diff_v2(**knobs))


# --- exercise 06 TASK 2, exercise 05 TASK 2: more named mistakes --------------------------------------------------

from diffattn_tutorial.checks import check_expand_kv  # noqa: E402


def expand_kv_blocked_in(k, v, num_heads):
    """Reads the key heads as all k1 maps, then all k2 maps."""
    rep = num_heads // v.shape[1]
    k = rearrange(k, "b (two g) n d -> b g two n d", two=2).repeat_interleave(rep, 1)
    return rearrange(k, "b g two n d -> b (g two) n d"), v.repeat_interleave(rep, 1)


def expand_kv_blocked_out(k, v, num_heads):
    """Right pairs, but the result written as all k1 maps, then all k2 maps."""
    rep = num_heads // v.shape[1]
    k = rearrange(k, "b (g two) n d -> b g two n d", two=2).repeat_interleave(rep, 1)
    return rearrange(k, "b g two n d -> b (two g) n d"), v.repeat_interleave(rep, 1)


@pytest.mark.parametrize("answer", [expand_kv_blocked_in, expand_kv_blocked_out])
def test_expand_kv_blocked_maps_are_named(answer):
    with pytest.raises(CheckFailed, match="read or written blocked"):
        check_expand_kv(answer)


def subln_group_of_num_heads(x, num_heads, lambda_init, weight=None, eps=1e-5):
    w = 1.0 if weight is None else weight.repeat(num_heads)
    parts = x.unflatten(-1, (-1, num_heads))  # runs of num_heads features, not of 2d
    return (parts * torch.rsqrt(parts.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2) * w * (1 - lambda_init)


def subln_over_tokens(x, num_heads, lambda_init, weight=None, eps=1e-5):
    h = rearrange(x, "b n (h e) -> b h n e", h=num_heads)
    h = h * torch.rsqrt(h.pow(2).mean(-2, keepdim=True) + eps) * (1.0 if weight is None else weight)
    return rearrange(h * (1 - lambda_init), "b h n e -> b n (h e)")


@pytest.mark.parametrize("answer, hint", [(subln_group_of_num_heads, "runs of num_heads"),
                                          (subln_over_tokens, "normalised over the tokens")])
def test_subln_mistakes_are_named(answer, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_subln(answer)
