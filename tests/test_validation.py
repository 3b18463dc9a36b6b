"""Bad input never returns a silently wrong answer: it raises, and the message names the argument and the fix."""

import pytest
import torch

from diffattn_tutorial import interop
from diffattn_tutorial.functional import diff_attention, diff_attention_v2, softmax_attention
from diffattn_tutorial.layers.attention import DiffAttnV2, KVCache, MultiheadAttention, MultiheadDiffAttn
from diffattn_tutorial.layers.rope import apply_rope, rope_cos_sin

B, H, HKV, N, D = 2, 4, 2, 5, 8


def qkv(**over):
    t = dict(q=torch.randn(B, 2 * H, N, D), k=torch.randn(B, 2 * HKV, N, D), v=torch.randn(B, HKV, N, 2 * D))
    t.update(over)
    return t["q"], t["k"], t["v"]


BAD_FUNCTIONAL = [
    ("q 3-D", dict(q=torch.randn(2 * H, N, D)), {}, ValueError, r"q must be 4-D \(B, 2H, Nq, d\)"),
    ("odd q heads", dict(q=torch.randn(B, 7, N, D)), {}, ValueError, "odd number"),
    ("odd k heads", dict(k=torch.randn(B, 3, N, D)), {}, ValueError, "k has 3 heads, an odd number"),
    ("v width d", dict(v=torch.randn(B, HKV, N, D)), {}, ValueError, "v head dim must be 2d"),
    ("v heads", dict(v=torch.randn(B, 2 * HKV, N, 2 * D)), {}, ValueError, "v must carry Hkv"),
    ("H not multiple of Hkv", dict(q=torch.randn(B, 6, N, D)), {}, ValueError, "not a multiple of Hkv"),
    ("q/k dim", dict(k=torch.randn(B, 2 * HKV, N, D + 2)), {}, ValueError, "head dims differ"),
    ("k/v length", dict(v=torch.randn(B, HKV, N + 1, 2 * D)), {}, ValueError, "sequence lengths differ"),
    ("batch", dict(k=torch.randn(B + 1, 2 * HKV, N, D)), {}, ValueError, "batch sizes differ"),
    ("d = 0", dict(q=torch.randn(B, 2 * H, N, 0), k=torch.randn(B, 2 * HKV, N, 0), v=torch.randn(B, HKV, N, 0)),
     {}, ValueError, "head dim d = 0: give them at least one feature"),
    ("Hkv = 0", dict(k=torch.randn(B, 0, N, D), v=torch.randn(B, 0, N, 2 * D)), {}, ValueError,
     r"k has no heads \(Hkv = 0\): pass at least one KV group"),
    ("dtype", dict(k=torch.randn(B, 2 * HKV, N, D, dtype=torch.float64)), {}, TypeError, r"k\.to\(q\.dtype\)"),
    ("int input", dict(q=torch.ones(B, 2 * H, N, D, dtype=torch.long)), {}, TypeError, "floating-point"),
    ("backend", {}, dict(backend="flash"), ValueError, "unknown backend 'flash'"),
    ("mask shape", {}, dict(attn_mask=torch.ones(N, N + 1, dtype=torch.bool)), ValueError, "does not broadcast"),
    ("mask dtype", {}, dict(attn_mask=torch.ones(N, N, dtype=torch.long)), TypeError, r"attn_mask\.bool\(\)"),
    ("lam shape", {}, dict(lam=torch.ones(B, H, N, 2)), ValueError, r"lam of shape .* does not broadcast"),
    ("lam type", {}, dict(lam="0.5"), TypeError, "lam must be a float or a tensor"),
    ("scale", {}, dict(scale=-1.0), ValueError, "scale must be a positive"),
    ("dropout", {}, dict(dropout_p=1.5), ValueError, r"dropout_p must be in \[0, 1\)"),
    ("dropout split", {}, dict(dropout_p=0.1, backend="sdpa_split"), ValueError, "does not support attention dropout"),
]


@pytest.mark.parametrize("case", BAD_FUNCTIONAL, ids=[c[0] for c in BAD_FUNCTIONAL])
def test_diff_attention_rejects_bad_input(case):
    _, tensors, kwargs, exc, msg = case
    q, k, v = qkv(**tensors)
    lam = kwargs.pop("lam", 0.5)
    with pytest.raises(exc, match=msg):
        diff_attention(q, k, v, lam, **kwargs)


def test_softmax_attention_rejects_bad_gqa():
    with pytest.raises(ValueError, match="not a multiple of 2 KV heads"):
        softmax_attention(torch.randn(1, 3, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8))


def test_plain_attention_rejects_zero_head_dim_and_zero_kv_heads():
    """They raised ZeroDivisionError (``0 ** -0.5``, ``Hq % 0``)."""
    with pytest.raises(ValueError, match="head dim d = 0"):
        softmax_attention(torch.randn(1, 2, 4, 0), torch.randn(1, 2, 4, 0), torch.randn(1, 2, 4, 8))
    with pytest.raises(ValueError, match=r"no heads \(Hkv = 0\)"):
        softmax_attention(torch.randn(1, 2, 4, 8), torch.randn(1, 0, 4, 8), torch.randn(1, 0, 4, 8))
    with pytest.raises(ValueError, match=r"no heads \(Hkv = 0\)"):
        diff_attention_v2(torch.randn(1, 4, 4, 8), torch.randn(1, 0, 4, 8), torch.randn(1, 0, 4, 8), 0.5)


@pytest.mark.parametrize("make, msg", [
    (lambda: MultiheadDiffAttn(60, 4), "divisible by 2 \\* num_heads"),
    (lambda: MultiheadDiffAttn(64, 4, num_kv_heads=3), "multiple of num_kv_heads"),
    (lambda: MultiheadDiffAttn(64, 4, lambda_mode="vector"), "lambda_mode must be"),
    (lambda: MultiheadDiffAttn(64, 4, backend="cuda"), "unknown backend"),
    (lambda: MultiheadAttention(60, 7), "divisible by num_heads"),
    (lambda: DiffAttnV2(64, 4, num_kv_heads=3), "one GQA group"),
])
def test_constructors_reject_bad_head_counts(make, msg):
    with pytest.raises(ValueError, match=msg):
        make()


def test_module_forward_rejects_bad_x_rope_and_context():
    layer = MultiheadDiffAttn(64, 4)
    with pytest.raises(ValueError, match=r"x must be \(B, N, embed_dim=64\)"):
        layer(torch.randn(2, 5, 32))
    with pytest.raises(TypeError, match="cast with"):
        layer(torch.randn(2, 5, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match="rope covers 4 positions"):
        layer(torch.randn(2, 5, 64), rope=rope_cos_sin(4, 8))
    with pytest.raises(ValueError, match="rot_dim <= 8"):
        layer(torch.randn(2, 5, 64), rope=rope_cos_sin(5, 16))
    with pytest.raises(TypeError, match="rope must be a tuple"):
        layer(torch.randn(2, 5, 64), rope=torch.zeros(5, 4))
    with pytest.raises(ValueError, match="context must be"):
        layer(torch.randn(2, 5, 64), context=torch.randn(2, 3, 32))
    with pytest.raises(ValueError, match="rope and cache are for self-attention"):
        layer(torch.randn(2, 5, 64), context=torch.randn(2, 3, 64), rope=rope_cos_sin(5, 8))


def test_rope_builder_rejects_odd_dim():
    with pytest.raises(ValueError, match="positive even"):
        rope_cos_sin(4, 7)


def test_cache_rejects_mixing_layers():
    cache = KVCache()
    cache.update(torch.randn(1, 4, 2, 8), torch.randn(1, 2, 2, 16))
    with pytest.raises(ValueError, match="one KVCache per layer"):
        cache.update(torch.randn(1, 2, 1, 8), torch.randn(1, 1, 1, 16))


def test_interop_rejects_mismatched_checkpoints_and_exports():
    sd = MultiheadDiffAttn(64, 4, subln_affine=False).state_dict()
    with pytest.raises(ValueError, match=r"missing \['subln.weight'\]"):
        interop.from_unilm(sd, embed_dim=64, num_heads=4, depth=0, subln_affine=True)
    with pytest.raises(TypeError):
        interop.from_unilm(sd, embed_dim=64, num_heads=4, depth=0, heads=3)  # unknown config key
    with pytest.raises(ValueError, match="qk_norm"):
        interop.to_unilm(MultiheadDiffAttn(64, 4, qk_norm=True))
    with pytest.raises(ValueError, match="GQA"):
        interop.to_timm(MultiheadDiffAttn(64, 4, num_kv_heads=2))
    with pytest.raises(ValueError, match="scale_norm"):
        interop.from_timm({}, dim=64, num_heads=4, scale_norm=True)
    with pytest.raises(ValueError, match="MultiheadAttention instead"):
        interop.from_unilm_v2({}, d_model=64, num_heads=4, head_dim=16, use_diff_v2=False)


def test_interop_errors_name_the_checkpoints_own_keys_and_shapes():
    timm_sd = interop.to_timm(MultiheadDiffAttn(64, 4, qkv_bias=False, out_bias=True))
    with pytest.raises(ValueError, match=r"missing \['qkv\.bias'\]"):  # the checkpoint's own key, once
        interop.from_timm(timm_sd, dim=64, num_heads=4, qkv_bias=True)
    no_sub = {k: v for k, v in timm_sd.items() if k != "sub_norm.weight"}
    with pytest.raises(ValueError, match=r"missing \['sub_norm\.weight'\]"):
        interop.from_timm(no_sub, dim=64, num_heads=4)
    with pytest.raises(ValueError, match=r"qkv\.weight has 192 rows .*this config \(dim=96, num_heads=4\) needs 288"):
        interop.from_timm(timm_sd, dim=96, num_heads=4)  # the fused key, its rows and the config to check
    unilm_sd = MultiheadDiffAttn(64, 4).state_dict()
    with pytest.raises(ValueError, match=r"lambda_q1: checkpoint \(8,\), this config \(16,\)"):
        interop.from_unilm(unilm_sd, embed_dim=64, num_heads=2, depth=0)  # wrong head count: not a RuntimeError


def test_round_trips_are_exact():
    torch.manual_seed(0)
    for layer, to, frm, cfg in [
        (MultiheadDiffAttn(64, 4, depth=2, subln_affine=False), interop.to_unilm, interop.from_unilm,
         dict(embed_dim=64, num_heads=4, depth=2, subln_affine=False)),
        (MultiheadDiffAttn(64, 2, num_kv_heads=1, depth=1), interop.to_unilm, interop.from_unilm,
         dict(embed_dim=64, num_heads=2, depth=1, num_kv_heads=1)),
        (MultiheadDiffAttn(48, 3, lambda_mode="dual", qk_norm=True, qkv_bias=True, out_bias=True), interop.to_timm,
         interop.from_timm, dict(dim=48, num_heads=3, dual_lambda=True, qk_norm=True, qkv_bias=True)),
        (DiffAttnV2(64, 4, num_kv_heads=2, head_dim=16), interop.to_unilm_v2, interop.from_unilm_v2,
         dict(d_model=64, num_heads=4, num_kv_heads=2, head_dim=16)),
    ]:
        back = frm(to(layer), **cfg)
        x = torch.randn(2, 6, layer.embed_dim)
        torch.testing.assert_close(back(x, causal=True), layer(x, causal=True), rtol=0, atol=0)


def test_apply_rope_layouts_are_a_permutation_apart():
    from diffattn_tutorial.layers.rope import interleaved_to_half_split

    x = torch.randn(2, 3, 7, 16, dtype=torch.float64)
    cos, sin = rope_cos_sin(7, 16, dtype=torch.float64)
    perm = interleaved_to_half_split(torch.eye(16, dtype=torch.float64), 16)  # rows reordered
    inter = apply_rope(x, cos, sin, interleaved=True)
    half = apply_rope(x @ perm.T, cos, sin, interleaved=False)
    torch.testing.assert_close(half, inter @ perm.T)
    # rotation keeps norms and relative positions: <R_m q, R_n k> depends on m - n only
    torch.testing.assert_close(inter.norm(dim=-1), x.norm(dim=-1))
