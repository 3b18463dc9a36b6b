"""Hugging Face DiffLlama interop, against transformers' own ``DiffLlamaAttention`` outputs.

The golden cases ``diffattn_tutorial.golden.names("diffllama")`` were written by ``tools/make_diffllama_golden.py``
(transformers is needed only to regenerate them). Each pins the forward output, the input gradient and every
parameter after one plain SGD step, as ``test_conformance.py`` does for unilm and timm.
"""

import pytest
import torch
from golden_case import ATOL, RTOL, assert_reproduces_golden_case

from diffattn_tutorial import MultiheadDiffAttn, golden, rope_cos_sin
from diffattn_tutorial.interop import from_diffllama, from_unilm, to_diffllama, to_timm, to_unilm

CASES = [name.removeprefix("diffllama/") for name in golden.names("diffllama")]


def load(name: str) -> dict:
    """The DiffLlama golden case ``name`` (e.g. ``"mha_causal"``)."""
    return golden.load(f"diffllama/{name}")


def test_the_golden_cases_cover_gqa_bias_padding_and_head_dim():
    cases = [load(n) for n in CASES]
    assert len(cases) == 3 and all(c["source"] == "diffllama" for c in cases)
    cfgs = [c["config"] for c in cases]
    assert any(c["num_key_value_heads"] < c["num_attention_heads"] for c in cfgs)
    assert any(c["attention_bias"] for c in cfgs)
    assert any(c["head_dim"] * c["num_attention_heads"] != c["hidden_size"] for c in cfgs)
    assert any(c["attn_mask"] is not None for c in cases) and any(not c["causal"] for c in cases)
    assert len({c["layer_idx"] for c in cfgs}) == 3


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("backend", ["naive", "sdpa_split", "sdpa_stacked", "chunked"])
def test_matches_transformers_diffllama(name, backend):
    case = load(name)
    layer = from_diffllama(case["state_dict"], **case["config"], backend=backend)
    assert_reproduces_golden_case(layer, case, to_diffllama)


def test_layer_is_the_papers_layer_with_halves_pairing():
    case = load("gqa_bias_padding")
    cfg = case["config"]
    layer = from_diffllama(case["state_dict"], **cfg)
    H, Hkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    assert (layer.num_heads, layer.num_kv_heads, layer.head_dim) == (H // 2, Hkv // 2, d)
    assert layer.depth == cfg["layer_idx"] and not layer.rope_interleaved
    assert layer.subln.weight is None and layer.subln.eps == cfg["rms_norm_eps"]
    # this library's differential head 0 = DiffLlama's maps 0 and H/2
    q = case["state_dict"]["q_proj.weight"]
    torch.testing.assert_close(layer.q_proj.weight[:d], q[:d], rtol=0, atol=0)
    torch.testing.assert_close(layer.q_proj.weight[d:2 * d], q[H // 2 * d:(H // 2 + 1) * d], rtol=0, atol=0)


def test_rope_tables_equal_the_librarys_half_of_diffllamas():
    case = load("mha_causal")
    n, d = case["x"].shape[1], case["config"]["head_dim"]
    for ours, ref in zip(rope_cos_sin(n, d), case["rope"]):
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)


def test_round_trip_from_a_library_layer_with_interleaved_rope():
    """A unilm-style layer (interleaved RoPE) exports to DiffLlama with q/k rows permuted: same function."""
    torch.manual_seed(0)
    src = MultiheadDiffAttn(32, 2, depth=4, num_kv_heads=1, subln_affine=False)
    sd = to_diffllama(src)
    dst = from_diffllama(sd, layer_idx=4, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    x, rope = torch.randn(2, 6, 32), rope_cos_sin(6, 8)
    torch.testing.assert_close(dst(x, rope=rope, causal=True), src(x, rope=rope, causal=True))
    back = to_diffllama(dst)
    assert all(torch.equal(back[k], sd[k]) for k in sd)


def test_errors_name_the_fix():
    case = load("mha_causal")
    cfg = case["config"]
    sd = {f"model.layers.0.self_attn.{k}": v for k, v in case["state_dict"].items()}
    with pytest.raises(ValueError, match="model.layers.0.self_attn."):
        from_diffllama(sd, **cfg)
    with pytest.raises(ValueError, match="missing.*lambda_k2"):
        from_diffllama({k: v for k, v in case["state_dict"].items() if k != "lambda_k2"}, **cfg)
    with pytest.raises(ValueError, match="o_proj.bias"):
        from_diffllama(case["state_dict"], **{**cfg, "attention_bias": True})
    with pytest.raises(ValueError, match="q_proj.weight: checkpoint"):
        from_diffllama(case["state_dict"], **{**cfg, "head_dim": 4})
    with pytest.raises(ValueError, match="even"):
        from_diffllama(case["state_dict"], **{**cfg, "num_key_value_heads": 1})
    with pytest.raises(ValueError, match="affine weight"):
        to_diffllama(MultiheadDiffAttn(32, 2))
    with pytest.raises(ValueError, match="lambda_init"):
        to_diffllama(MultiheadDiffAttn(32, 2, subln_affine=False, lambda_init=0.8))
    with pytest.raises(TypeError):
        to_diffllama(torch.nn.Linear(2, 2))
    # a DiffLlama layer with head_dim != hidden / (2 * heads) cannot go to unilm or timm
    wide = from_diffllama(load("gqa_bias_padding")["state_dict"], **load("gqa_bias_padding")["config"])
    with pytest.raises(ValueError, match="head_dim"):
        to_unilm(wide)
    with pytest.raises(ValueError, match="head_dim"):
        to_timm(wide)


def test_head_dim_option_keeps_the_default_layer():
    torch.manual_seed(0)
    a = MultiheadDiffAttn(64, 4)
    torch.manual_seed(0)
    b = MultiheadDiffAttn(64, 4, head_dim=8)
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    c = MultiheadDiffAttn(48, 4, head_dim=8, num_kv_heads=2)
    assert c.q_proj.weight.shape == (64, 48) and c.out_proj.weight.shape == (48, 64)
    assert c(torch.randn(1, 5, 48), rope=rope_cos_sin(5, 8), causal=True).shape == (1, 5, 48)
    with pytest.raises(ValueError, match="or pass head_dim"):
        MultiheadDiffAttn(48, 5)
    # unilm export still works for the default layout
    assert from_unilm(to_unilm(MultiheadDiffAttn(64, 4)), embed_dim=64, num_heads=4, depth=0)


def test_diffllamas_own_additive_mask_can_be_passed_as_it_is():
    case = load("gqa_bias_padding")
    b, n = case["x"].shape[:2]
    allowed = torch.ones(n, n, dtype=torch.bool).tril()[None, None] & case["attn_mask"]
    hf_mask = torch.zeros(b, 1, n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)
    layer = from_diffllama(case["state_dict"], **case["config"])
    torch.testing.assert_close(layer(case["x"], rope=tuple(case["rope"]), attn_mask=hf_mask), case["out"],
                               rtol=RTOL, atol=ATOL)
