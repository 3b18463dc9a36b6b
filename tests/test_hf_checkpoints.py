"""hf.checkpoints.from_hf: Llama 3, Qwen2 and Mistral checkpoints into TinyLM exactly (golden logits and greedy
tokens recorded by transformers; live where transformers is importable), converted to DIFF V2 exactly, and every
checkpoint it cannot load refused by name."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from diffattn_tutorial import golden
from diffattn_tutorial.hf.checkpoints import (
    CheckpointError,
    from_hf,
    hf_lm_config,
    read_folder,
    read_safetensors,
    write_safetensors,
)
from diffattn_tutorial.layers.attention import MultiheadAttention
from diffattn_tutorial.layers.convert import convert_model, to_diff_v1, to_diff_v2, why_not_exact
from diffattn_tutorial.layers.rope import llama3_inv_freq, rope_cos_sin

CASES = golden.names("hf")
TOL = dict(rtol=1e-4, atol=1e-5)
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def test_the_golden_cases_ship():
    assert CASES == ["hf/llama3_gqa_untied", "hf/llama3_mha_tied", "hf/mistral_gqa_window", "hf/mistral_mha",
                     "hf/qwen2_gqa_tied", "hf/qwen2_mha_untied"]


@pytest.mark.parametrize("name", CASES)
def test_logits_and_greedy_tokens_equal_transformers_recorded_ones(name):
    case = golden.load(name)
    model = from_hf(case["state_dict"], config=case["config"])
    torch.testing.assert_close(model(case["input_ids"]), case["logits"], **TOL)
    assert torch.equal(model.generate(case["prompt"], 8), case["greedy"])
    v2 = convert_model(model, "diff_v2")  # and on to DIFF V2: the same function, biases and RoPE scaling included
    assert why_not_exact("diff_v2", negative="mirror") is None
    torch.testing.assert_close(v2(case["input_ids"]), case["logits"], **TOL)
    assert torch.equal(v2.generate(case["prompt"], 8), case["greedy"])


def test_each_family_exercises_what_it_needs():
    """The cases carry what makes the families differ: Llama 3's scaling, Qwen2's biases, ties, GQA and MHA."""
    cfgs = {n: from_hf(golden.load(n)["state_dict"], config=golden.load(n)["config"]).cfg for n in CASES}
    assert all(cfgs[n].rope_scaling is not None for n in CASES if "llama3" in n)
    assert all(cfgs[n].qkv_bias == ("qwen2" in n) for n in CASES)
    assert {cfgs[n].kv_heads < cfgs[n].n_heads for n in CASES} == {True, False}


def test_llama3_scaling_touches_all_three_bands_and_matters():
    inv = 1.0 / 500.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    scaled = llama3_inv_freq(inv, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=64)
    assert scaled[0] == inv[0]  # wavelength 6.3 < 16: kept
    assert inv[1] / 8 < scaled[1] < inv[1]  # 29.7: interpolated
    torch.testing.assert_close(scaled[2:], inv[2:] / 8)  # > 64: divided by factor
    case = golden.load("hf/llama3_gqa_untied")
    plain = dict(case["config"], rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    assert (from_hf(case["state_dict"], config=plain)(case["input_ids"]) - case["logits"]).abs().max() > 1e-3
    cos, _ = rope_cos_sin(4, 8, base=500.0)
    assert torch.equal(cos, rope_cos_sin(4, 8, base=500.0, scaling=None)[0])  # the plain path unchanged


def test_without_the_biases_the_qwen2_logits_differ():
    case = golden.load("hf/qwen2_mha_untied")
    sd = {k: (torch.zeros_like(v) if k.endswith(".bias") else v) for k, v in case["state_dict"].items()}
    assert (from_hf(sd, config=case["config"])(case["input_ids"]) - case["logits"]).abs().max() > 1e-3


def _write_folder(folder: Path, case: dict, dtype=torch.float32, shards: int = 1) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(case["config"]))
    names = sorted(case["state_dict"])
    parts = [names[i::shards] for i in range(shards)]
    for i, part in enumerate(parts):
        write_safetensors({k: case["state_dict"][k].to(dtype) for k in part}, folder / f"model-{i}.safetensors")
    if shards > 1:
        index = {"weight_map": {k: f"model-{i}.safetensors" for i, part in enumerate(parts) for k in part}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


@pytest.mark.parametrize("shards", [1, 3])
def test_a_folder_loads_offline_as_the_state_dict_does(tmp_path, shards):
    case = golden.load("hf/qwen2_gqa_tied")
    model = from_hf(_write_folder(tmp_path / "ckpt", case, shards=shards))
    torch.testing.assert_close(model(case["input_ids"]), case["logits"], **TOL)


def test_safetensors_round_trip_keeps_every_dtype(tmp_path):
    ts = {"a": torch.randn(3, 4), "b": torch.randn(5).to(torch.bfloat16), "c": torch.arange(6).reshape(2, 3),
          "d": torch.randn(2, 2).half(), "e": torch.zeros(0)}
    write_safetensors(ts, tmp_path / "x.safetensors")
    back = read_safetensors(tmp_path / "x.safetensors")
    assert set(back) == set(ts) and all(torch.equal(back[k], ts[k]) and back[k].dtype == ts[k].dtype for k in ts)


def test_a_bfloat16_folder_converts_exactly(tmp_path):
    case = golden.load("hf/llama3_mha_tied")
    model = from_hf(_write_folder(tmp_path / "ckpt", case, dtype=torch.bfloat16))
    assert torch.equal(model.embed.weight, case["state_dict"]["model.embed_tokens.weight"].bfloat16().float())


# ---------------------------------------------------------------- bad input, refused by name
def test_a_folder_without_weights_is_refused(tmp_path):
    case = golden.load("hf/mistral_mha")
    folder = tmp_path / "empty"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(case["config"]))
    with pytest.raises(CheckpointError, match="no weights"):
        from_hf(folder)
    (folder / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="pytorch_model.bin"):
        read_folder(folder)
    no_config = _write_folder(tmp_path / "noconfig", case)
    (no_config / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        from_hf(no_config)
    with pytest.raises(FileNotFoundError, match="no folder"):
        from_hf(str(tmp_path / "missing"))


def test_mismatched_shapes_and_missing_weights_are_named():
    case = golden.load("hf/llama3_gqa_untied")
    with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.up_proj.weight: checkpoint \(48, 32\), config \(40, 32\)"):
        from_hf(case["state_dict"], config=dict(case["config"], intermediate_size=40))
    sd = dict(case["state_dict"])
    del sd["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(CheckpointError, match="missing.*model.layers.1.self_attn.k_proj.weight"):
        from_hf(sd, config=case["config"])
    with pytest.raises(CheckpointError, match=r"unexpected \[.model.layers.1.input_layernorm.weight"):
        from_hf(case["state_dict"], config=dict(case["config"], num_hidden_layers=1))  # layer 1 left over


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.complex64])
def test_a_weight_that_loading_would_cast_is_refused_by_name(dtype):
    """The state-dict path too (the folder path reads safetensors): a bool, integer or complex weight was cast to
    float32 without a word before from_hf shared from_llama's checks."""
    case = golden.load("hf/llama3_gqa_untied")
    sd = dict(case["state_dict"])
    sd["model.norm.weight"] = sd["model.norm.weight"].to(dtype)
    with pytest.raises(TypeError, match=rf"from_hf\(\): 'model.norm.weight' is {dtype}.*floating-point"):
        from_hf(sd, config=case["config"])


def test_a_model_built_on_the_meta_device_is_refused():
    case = golden.load("hf/llama3_gqa_untied")
    with torch.device("meta"), pytest.raises(ValueError, match="meta device"):
        from_hf(case["state_dict"], config=case["config"])


def test_from_hf_and_from_llama_load_through_one_mapping():
    """One home for transformers' names and the RoPE row order (training/hf_weights.py): both loaders give the same
    model for a Llama checkpoint that both accept."""
    case = golden.load("hf/llama3_gqa_untied")
    config = dict(case["config"], rope_scaling=None, rope_parameters=None)  # from_llama: RoPE 'default' only
    from diffattn_tutorial.interop import from_llama
    a, b = from_hf(case["state_dict"], config=config), from_llama(case["state_dict"], config=config)
    assert a.state_dict().keys() == b.state_dict().keys()
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())


@pytest.mark.parametrize("family", ["gemma", "gemma2", "phi", "phi3", None])
def test_another_family_is_refused_by_name(family):
    config = dict(golden.load("hf/mistral_mha")["config"], model_type=family)
    with pytest.raises(CheckpointError, match=f"model_type {family!r} is not supported"):
        hf_lm_config(config)


@pytest.mark.parametrize("change, named", [
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "RoPE type 'yarn'"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"), (dict(attention_bias=True), "attention_bias=True"),
    (dict(mlp_bias=True), "mlp_bias=True"), (dict(head_dim=16), "head_dim=16"),
    (dict(pretraining_tp=2), "pretraining_tp=2")])
def test_an_option_that_changes_the_function_is_refused_by_name(change, named):
    config = dict(golden.load("hf/llama3_gqa_untied")["config"], **change)
    with pytest.raises(CheckpointError, match=named.replace("(", r"\(")):
        hf_lm_config(config)


def test_a_sliding_window_that_binds_is_refused_and_max_len_lifts_it():
    case = golden.load("hf/mistral_gqa_window")
    config = dict(case["config"], sliding_window=16)  # 16 < max_position_embeddings 128: it binds
    with pytest.raises(CheckpointError, match="sliding_window=16 shorter than max_len=128.*max_len=16"):
        from_hf(case["state_dict"], config=config)
    model = from_hf(case["state_dict"], config=config, max_len=16)  # sequences of <= 16 tokens: no window binds
    torch.testing.assert_close(model(case["input_ids"]), case["logits"], **TOL)
    qwen = dict(golden.load("hf/qwen2_mha_untied")["config"], use_sliding_window=True, sliding_window=32,
                layer_types=None)
    with pytest.raises(CheckpointError, match="sliding_window=32"):
        hf_lm_config(qwen)


def test_a_source_that_is_no_checkpoint_is_refused():
    with pytest.raises(TypeError, match="needs config="):
        from_hf(golden.load("hf/mistral_mha")["state_dict"])
    with pytest.raises(TypeError, match="transformers model, a checkpoint folder or a state_dict"):
        from_hf(42)
    with pytest.raises(TypeError, match="config must be"):
        hf_lm_config("meta-llama/Llama-3.2-1B")


# ---------------------------------------------------------------- conversion with biases stays exact
@pytest.mark.parametrize("kv", [4, 2])
def test_v2_conversion_of_a_biased_baseline_is_exact(kv):
    torch.manual_seed(0)
    base = MultiheadAttention(32, 4, num_kv_heads=kv, qkv_bias=True, out_bias=False)
    with torch.no_grad():
        for p in (base.q_proj.bias, base.k_proj.bias, base.v_proj.bias):
            p.normal_()
    x, rope = torch.randn(2, 7, 32), rope_cos_sin(7, 8, scaling=dict(factor=8.0, low_freq_factor=1.0,
                                                                     high_freq_factor=4.0,
                                                                     original_max_position_embeddings=4))
    want = base(x, rope=rope, causal=True)
    torch.testing.assert_close(to_diff_v2(base)(x, rope=rope, causal=True), want, rtol=1e-5, atol=1e-6)
    v1 = to_diff_v1(base, depth=1, heads="double", negative="mirror", subln=False)
    assert why_not_exact("diff", heads="double", negative="mirror", subln=False) is None
    torch.testing.assert_close(v1(x, rope=rope, causal=True), want, rtol=1e-5, atol=1e-6)


def test_an_output_bias_is_refused_by_the_conversion():
    with pytest.raises(ValueError, match="out_bias=False"):
        to_diff_v2(MultiheadAttention(32, 4, qkv_bias=True, out_bias=True))


# ---------------------------------------------------------------- live, where transformers is installed
@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers is not installed (the golden tests above stand in)")
@pytest.mark.parametrize("name", ["llama3_gqa_untied", "qwen2_gqa_tied", "mistral_mha"])
def test_live_against_transformers_model_and_its_saved_folder(tmp_path, name):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    try:
        import make_hf_golden
    finally:
        sys.path.pop(0)
    family, keys, seed = make_hf_golden.CASES[name]
    hf = make_hf_golden.build(family, keys, seed + 100)
    ids = torch.randint(0, hf.config.vocab_size, (2, 10))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
    hf.save_pretrained(tmp_path / "saved")  # safetensors, read back without transformers
    for source in (hf, tmp_path / "saved"):
        torch.testing.assert_close(from_hf(source)(ids), want, **TOL)


def test_a_transformers_4_config_json_loads_the_same(tmp_path):
    """Checkpoints saved before transformers 5 say ``rope_theta`` and ``rope_scaling`` (Llama 3.2's config.json)."""
    case = golden.load("hf/llama3_gqa_untied")
    config = {k: v for k, v in case["config"].items() if k != "rope_parameters"}
    params = case["config"]["rope_parameters"]
    config.update(rope_theta=params["rope_theta"], rope_scaling={k: v for k, v in params.items() if k != "rope_theta"},
                  torch_dtype="bfloat16")
    model = from_hf(case["state_dict"], config=config)
    torch.testing.assert_close(model(case["input_ids"]), case["logits"], **TOL)
