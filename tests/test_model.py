"""TinyLM: parameter matching, causality, cached generation, and probes that agree with the layers."""

import pytest
import torch
from einops import rearrange

from diffattn_tutorial.layers.attention import DiffAttnV2, KVCache, MultiheadAttention, MultiheadDiffAttn, StaticKVCache
from diffattn_tutorial.training.model import ATTENTIONS, CACHES, LMConfig, TinyLM, build_model, parameter_counts

V = 40


def model(kind, **kw):
    torch.manual_seed(0)
    return build_model(kind, V, max_len=32, **kw).double().eval()


@pytest.mark.parametrize("kind", ATTENTIONS)
def test_shapes_and_layer_types(kind):
    m = model(kind, n_layers=3)
    assert m(torch.randint(0, V, (2, 7))).shape == (2, 7, V)
    want = {"baseline": MultiheadAttention, "diff": MultiheadDiffAttn, "diff_v2": DiffAttnV2}[kind]
    assert all(type(b.attn) is want for b in m.blocks)
    if kind == "diff":  # depth = layer index, heads halved, same head width as the baseline
        assert [b.attn.depth for b in m.blocks] == [0, 1, 2]
        assert all(b.attn.num_heads == 2 and b.attn.head_dim == 16 for b in m.blocks)


def test_parameter_matching_as_in_the_paper():
    counts = parameter_counts(V, d_model=64, n_layers=2, n_heads=4)
    base, diff, v2 = (counts[k] for k in ATTENTIONS)
    # DIFF's q/k/v/out projections have the baseline's shapes; it adds only lambda (4 x d) and the sub-norm (2d)
    head_dim = 16
    assert diff["attention"] - base["attention"] == 2 * (4 * head_dim + 2 * head_dim)
    assert diff["total"] - base["total"] == diff["attention"] - base["attention"]
    # V2 doubles the query projection and adds lambda_proj (d_model -> H) per layer
    assert v2["attention"] - base["attention"] == 2 * (64 * 64 + 64 * 4)
    gqa = parameter_counts(V, d_model=64, n_heads=4, n_kv_heads=2)
    assert gqa["diff"]["attention"] - gqa["baseline"]["attention"] == 2 * (6 * head_dim)


@pytest.mark.parametrize("kind", ATTENTIONS)
def test_causal(kind):
    m = model(kind)
    x = torch.randint(0, V, (2, 12))
    y = x.clone()
    y[:, 8] = (y[:, 8] + 1) % V
    torch.testing.assert_close(m(x)[:, :8], m(y)[:, :8], rtol=0, atol=0)
    assert not torch.allclose(m(x)[:, 8:], m(y)[:, 8:])


@pytest.mark.parametrize("kind", ATTENTIONS)
@pytest.mark.parametrize("kv", [None, 2])
def test_cached_generation_equals_recomputing(kind, kv):
    m = model(kind, n_kv_heads=kv)
    prompt = torch.randint(0, V, (3, 5))
    tokens = {cache: m.generate(prompt, 9, cache=cache) for cache in CACHES}
    fast = tokens["dynamic"]
    assert fast.shape == (3, 14) and torch.equal(fast[:, :5], prompt)
    for cache in ("static", None):
        assert torch.equal(tokens[cache], fast), cache
    # and the cached logits equal the full forward's at every step, with either cache
    full = m(fast)
    caches = [KVCache() for _ in m.blocks]
    steps = [m(fast[:, :5], caches=caches)] + [m(fast[:, t:t + 1], caches=caches) for t in range(5, 14)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-10)
    static = [StaticKVCache(16) for _ in m.blocks]
    steps = [m(fast[:, :5], caches=static, positions=torch.arange(5))]
    steps += [m(fast[:, t:t + 1], caches=static, positions=torch.tensor([t])) for t in range(5, 14)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", ATTENTIONS)
def test_probe_maps_reproduce_the_layer(kind):
    """The probe's maps, times V, give the layer's own attention output; the logits give its softmax maps."""
    m = model(kind, n_kv_heads=2)
    idx = torch.randint(0, V, (2, 9))
    probes = m.probe(idx)
    assert len(probes) == 2
    x = m.embed(idx)
    for block, p in zip(m.blocks, probes):
        attn, h = block.attn, block.attn_norm(x)
        rope = m._rope(0, 9)
        future = torch.ones(9, 9, dtype=torch.bool).triu(1)
        assert (p.maps[..., future] == 0).all() and torch.isinf(p.logits[..., future]).all()
        if kind == "diff":
            H = attn.num_heads
            _, _, v = attn.project_qkv(h, None, rope, None, 2 * H, 2 * attn.num_kv_heads, attn.num_kv_heads)
            v = v.repeat_interleave(H // attn.num_kv_heads, dim=1)
            torch.testing.assert_close(p.maps @ v, attn.attention_heads(h, rope=rope, causal=True))
            lam = attn.lambda_full().double()
            torch.testing.assert_close(p.maps.sum(-1), (1 - lam).expand(2, H, 9))
            sm = torch.softmax(p.logits, -1)  # heads 2i, 2i+1 are the two maps of differential head i
            torch.testing.assert_close(p.maps, sm[:, 0::2] - lam * sm[:, 1::2])
        else:
            Hq = attn.num_heads * (2 if kind == "diff_v2" else 1)
            _, _, v = attn.project_qkv(h, None, rope, None, Hq, attn.num_kv_heads, attn.num_kv_heads)
            v = v.repeat_interleave(attn.num_heads // attn.num_kv_heads, dim=1)
            out = (p.maps @ v)
            proj = attn.o_proj if kind == "diff_v2" else attn.out_proj
            torch.testing.assert_close(proj(rearrange(out, "b h n d -> b n (h d)")),
                                       attn(h, rope=rope, causal=True))
            sm = torch.softmax(p.logits, -1)
            if kind == "baseline":
                torch.testing.assert_close(p.maps, sm)
            else:
                torch.testing.assert_close(p.maps, sm[:, 0::2] - attn.lambda_full(h) * sm[:, 1::2])
        x = block(x, rope)


def test_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="attention must be one of"):
        LMConfig(vocab_size=V, attention="flash")
    with pytest.raises(ValueError, match="even"):
        LMConfig(vocab_size=V, attention="diff", n_heads=3, d_model=48)
    with pytest.raises(ValueError, match="divisible"):
        LMConfig(vocab_size=V, d_model=30, n_heads=4)
    m = TinyLM(LMConfig(vocab_size=V, max_len=8))
    with pytest.raises(ValueError, match="max_len"):
        m(torch.randint(0, V, (1, 9)))
    with pytest.raises(ValueError, match="token ids"):
        m(torch.randn(1, 4))


@pytest.mark.parametrize("field,value", [("n_heads", 0), ("n_layers", -1), ("n_layers", 0), ("d_model", 0),
                                         ("vocab_size", -5), ("n_kv_heads", 0), ("max_len", 0), ("n_heads", 2.0),
                                         ("ffn_hidden", 0)])
def test_config_rejects_sizes_that_are_not_positive_integers(field, value):
    with pytest.raises(ValueError, match=f"LMConfig.{field} must be a positive whole number"):
        LMConfig(vocab_size=32, **{field: value}) if field != "vocab_size" else LMConfig(vocab_size=value)


def test_inference_applies_the_sub_norm_in_place_with_the_same_bits_and_honours_hooks_and_replacements():
    """Under ``no_grad`` the layer normalises its heads in place (no temporaries): the same bits as with grad; a
    hook on ``subln``, or another norm put in its place, is called as in training, not bypassed."""
    torch.manual_seed(0)
    layer, x = MultiheadDiffAttn(64, 2, backend="naive"), torch.randn(2, 5, 64)
    with torch.no_grad():
        fast = layer(x)
    assert torch.equal(fast, layer(x).detach())
    hook = layer.subln.register_forward_hook(lambda module, inputs, out: out * 0)
    with torch.no_grad():
        assert layer(x).abs().max() == 0 == layer(x.requires_grad_()).abs().max()
    hook.remove()
    layer.subln = torch.nn.LayerNorm(2 * layer.head_dim)
    with torch.no_grad():
        swapped = layer(x)
    assert torch.equal(swapped, layer(x).detach()) and not torch.equal(swapped, fast)
