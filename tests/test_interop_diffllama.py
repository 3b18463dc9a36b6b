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


def full_config_dict(cfg: dict) -> dict:
    """What ``DiffLlamaConfig(...).to_dict()`` returns for the attention keys of ``cfg`` (written out by hand from
    transformers' ``configuration_diffllama.py`` and ``PreTrainedConfig.to_dict``, so transformers is not needed):
    the model's keys, the base class's generic ones, and the layer's."""
    layer = {k: cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                  "rms_norm_eps", "attention_bias")}
    return {
        "vocab_size": 32000, "max_position_embeddings": 2048, "intermediate_size": 4 * cfg["hidden_size"],
        "num_hidden_layers": 4, "hidden_act": "silu", "initializer_range": 0.02, "use_cache": True,
        "rope_theta": 10000.0, "rope_scaling": None, "attention_dropout": 0.0, "lambda_std_dev": 0.1, **layer,
        "return_dict": True, "output_hidden_states": False, "output_attentions": False, "torchscript": False,
        "dtype": "float32", "pruned_heads": {}, "tie_word_embeddings": False, "chunk_size_feed_forward": 0,
        "is_encoder_decoder": False, "is_decoder": False, "cross_attention_hidden_size": None,
        "add_cross_attention": False, "tie_encoder_decoder": False, "architectures": ["DiffLlamaForCausalLM"],
        "finetuning_task": None, "id2label": {"0": "LABEL_0", "1": "LABEL_1"}, "label2id": {"LABEL_0": 0, "LABEL_1": 1},
        "task_specific_params": None, "problem_type": None, "tokenizer_class": None, "prefix": None,
        "bos_token_id": 1, "pad_token_id": None, "eos_token_id": 2, "sep_token_id": None,
        "decoder_start_token_id": None, "_name_or_path": "kajuma/DiffLlama-0.3B-handcut",
        "transformers_version": "4.57.1", "model_type": "diffllama"}


class FakeDiffLlamaConfig:
    """Stands in for a ``DiffLlamaConfig`` object: attributes and ``to_dict()``."""

    def __init__(self, values: dict) -> None:
        self.__dict__.update(values)
        self._values = values

    def to_dict(self) -> dict:
        return dict(self._values)


@pytest.mark.parametrize("name", CASES)
def test_a_whole_diffllama_config_is_accepted_as_transformers_gives_it(name):
    """``from_diffllama(sd, **model.config.to_dict(), layer_idx=L)`` and ``config=model.config`` load the same exact
    layer as the layer's own keys (the keys that do not concern one attention layer are ignored)."""
    case = load(name)
    full, layer_idx = full_config_dict(case["config"]), case["config"]["layer_idx"]
    for layer in (from_diffllama(case["state_dict"], **full, layer_idx=layer_idx, backend="naive"),
                  from_diffllama(case["state_dict"], config=FakeDiffLlamaConfig(full), layer_idx=layer_idx),
                  from_diffllama(case["state_dict"], config=full, layer_idx=layer_idx)):
        assert_reproduces_golden_case(layer, case, to_diffllama)


def test_a_diffllama_config_is_checked_not_guessed():
    case = load("gqa_bias_padding")
    cfg, sd = case["config"], case["state_dict"]
    loose = {k: v for k, v in cfg.items() if k != "num_key_value_heads"}
    with pytest.raises(TypeError, match=r"'num_key_value_head' \(did you mean 'num_key_value_heads'\?\).*hidden_size"):
        from_diffllama(sd, **loose, num_key_value_head=4)  # misspelled: must not fall back to the MHA default
    full = full_config_dict(cfg)
    with pytest.raises(ValueError, match="'llama' config, not DiffLlama's"):
        from_diffllama(sd, config={**full, "model_type": "llama"}, layer_idx=3)
    with pytest.raises(ValueError, match="head_dim=4 contradicts config.head_dim=8"):
        from_diffllama(sd, config=full, layer_idx=3, head_dim=4)
    with pytest.raises(TypeError, match="DiffLlamaConfig"):
        from_diffllama(sd, config=42, layer_idx=3)
    with pytest.raises(TypeError, match="needs hidden_size and num_attention_heads"):
        from_diffllama(sd, layer_idx=3)
    layer = from_diffllama(sd, config={**full, "attention_dropout": 0.25}, layer_idx=3)
    assert layer.dropout == 0.25  # DiffLlama's attention dropout is the layer's (training only)
