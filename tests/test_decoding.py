"""Cached step-by-step decoding equals the full causal forward, for every module and GQA setting."""

import pytest
import torch

from diffattn_tutorial.modules import DiffAttnV2, KVCache, MultiheadAttention, MultiheadDiffAttn
from diffattn_tutorial.rope import rope_cos_sin

LAYERS = {
    "baseline": lambda: MultiheadAttention(64, 8, num_kv_heads=2),
    "diff": lambda: MultiheadDiffAttn(64, 4, depth=3),
    "diff_gqa": lambda: MultiheadDiffAttn(64, 4, num_kv_heads=2, qk_norm=True),
    "diff_mqa_dual": lambda: MultiheadDiffAttn(64, 4, num_kv_heads=1, lambda_mode="dual"),
    "v2_gqa": lambda: DiffAttnV2(64, 4, num_kv_heads=2, head_dim=16),
}


@pytest.mark.parametrize("name", LAYERS)
@pytest.mark.parametrize("prefill", [0, 3])
def test_cached_decoding_equals_full_forward(name, prefill):
    torch.manual_seed(0)
    layer = LAYERS[name]().double().eval()
    x = torch.randn(2, 9, 64, dtype=torch.float64)
    rot = layer.head_dim
    full = layer(x, rope=rope_cos_sin(9, rot, dtype=torch.float64), causal=True)
    cache, outs = KVCache(), []
    if prefill:
        outs.append(layer(x[:, :prefill], rope=rope_cos_sin(prefill, rot, dtype=torch.float64), causal=True,
                          cache=cache))
    for t in range(prefill, 9):
        outs.append(layer(x[:, t:t + 1], rope=rope_cos_sin(1, rot, offset=t, dtype=torch.float64), causal=True,
                          cache=cache))
    assert cache.seq_len == 9
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-10, atol=1e-12)


def test_cross_attention_uses_context_for_keys_and_values():
    torch.manual_seed(0)
    layer = MultiheadDiffAttn(64, 4, kdim=32)
    x, ctx = torch.randn(2, 5, 64), torch.randn(2, 7, 32)
    out = layer(x, context=ctx)
    assert out.shape == (2, 5, 64)
    ctx2 = ctx.clone()
    ctx2[:, -1] += 1.0
    assert not torch.allclose(layer(x, context=ctx2), out)
    pad = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    pad[:, ..., -1] = False  # masking the changed context token makes the change invisible
    torch.testing.assert_close(layer(x, context=ctx2, attn_mask=pad), layer(x, context=ctx, attn_mask=pad))


def test_dropout_only_in_training_and_gradients_flow_through_every_parameter():
    torch.manual_seed(0)
    layer = MultiheadDiffAttn(64, 4, dropout=0.5, qk_norm=True, qkv_bias=True, out_bias=True)
    x = torch.randn(2, 6, 64)
    layer.eval()
    torch.testing.assert_close(layer(x), layer(x))
    layer.train()
    assert not torch.allclose(layer(x), layer(x))
    layer(x, causal=True).square().sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("backend", ["naive", "sdpa_wide", "sdpa_split", "sdpa_stacked", "chunked"])
def test_module_backends_agree(backend):
    torch.manual_seed(0)
    ref = MultiheadDiffAttn(64, 4, num_kv_heads=2).double()
    layer = MultiheadDiffAttn(64, 4, num_kv_heads=2, backend=backend).double()
    layer.load_state_dict(ref.state_dict())
    x = torch.randn(2, 7, 64, dtype=torch.float64)
    mask = torch.rand(2, 1, 7, 7) > 0.3
    torch.testing.assert_close(layer(x, causal=True, attn_mask=mask), ref(x, causal=True, attn_mask=mask))
