"""interop.from_llama: a Hugging Face LlamaForCausalLM into the course's TinyLM, exactly (golden logits recorded by
transformers, and live when transformers is importable), then converted to DIFF V2 exactly."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from diffattn_tutorial import golden, interop
from diffattn_tutorial.layers.convert import convert_model

CASES = golden.names("llama")


def test_the_golden_cases_ship():
    assert CASES == ["llama/gqa_untied", "llama/mha_tied"]


@pytest.mark.parametrize("name", CASES)
def test_logits_equal_transformers_recorded_ones(name):
    case = golden.load(name)
    model = interop.from_llama(case["state_dict"], config=case["config"])
    torch.testing.assert_close(model(case["input_ids"]), case["logits"], rtol=1e-4, atol=1e-5)
    assert model.cfg.norm_eps == case["config"]["rms_norm_eps"]
    assert model.cfg.rope_base == case["config"]["rope_parameters"]["rope_theta"]
    v2 = convert_model(model, "diff_v2")  # and on to DIFF V2, the same function
    torch.testing.assert_close(v2(case["input_ids"]), case["logits"], rtol=1e-4, atol=1e-5)


def test_without_the_rope_reordering_the_logits_differ():
    """The q/k rows must be reordered from Llama's half-split RoPE layout: loading them as they are is wrong."""
    case = golden.load("llama/gqa_untied")
    model = interop.from_llama(case["state_dict"], config=case["config"])
    with torch.no_grad():
        for i, block in enumerate(model.blocks):
            for p in ("q", "k"):
                getattr(block.attn, f"{p}_proj").weight.copy_(case["state_dict"][f"model.layers.{i}.self_attn.{p}_proj.weight"])
    assert (model(case["input_ids"]) - case["logits"]).abs().max() > 1e-2


def test_what_tinylm_lacks_is_refused_by_name():
    case = golden.load("llama/gqa_untied")
    cfg = case["config"]
    for change, match in [(dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500.0}), "RoPE type 'llama3'"),
                          (dict(attention_bias=True), "attention_bias"), (dict(hidden_act="gelu"), "hidden_act"),
                          (dict(head_dim=16), "head_dim=16"), (dict(model_type="mistral"), "'mistral' config")]:
        with pytest.raises(ValueError, match=match):
            interop.from_llama(case["state_dict"], config={**cfg, **change})
    with pytest.raises(ValueError, match="missing \\['lm_head.weight'\\]"):
        interop.from_llama({k: v for k, v in case["state_dict"].items() if k != "lm_head.weight"}, config=cfg)
    with pytest.raises(ValueError, match="unexpected \\['model.layers.1"):
        interop.from_llama(case["state_dict"], config={**cfg, "num_hidden_layers": 1})
    with pytest.raises(ValueError, match="other shapes"):
        interop.from_llama(case["state_dict"], config={**cfg, "intermediate_size": 40})
    with pytest.raises(TypeError, match="'vocab_size'"):
        interop.from_llama(case["state_dict"], hidden_size=32)
    for bad in (-1.0, 0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="rope_theta must be a number > 0"):
            interop.from_llama(case["state_dict"], config={**cfg, "rope_theta": bad, "rope_parameters": None})
    with pytest.raises(TypeError, match="config must be a LlamaConfig .* got str 'meta-llama/Llama-3.2-1B'; .*"
                                        "AutoConfig.from_pretrained"):
        interop.from_llama(case["state_dict"], config="meta-llama/Llama-3.2-1B")


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_live_against_transformers():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=50, hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=6,
                      num_key_value_heads=3, max_position_embeddings=32, initializer_range=0.2)
    hf = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 50, (2, 11))
    model = interop.from_llama(hf.state_dict(), config=hf.config)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(input_ids=ids).logits, rtol=1e-4, atol=1e-5)


def test_norm_eps_is_checked():
    from diffattn_tutorial.training.model import LMConfig

    for bad in (0, -1e-6, True, "1e-6", float("nan")):
        with pytest.raises(ValueError, match="norm_eps must be a number > 0"):
            LMConfig(vocab_size=4, norm_eps=bad)
        with pytest.raises(ValueError, match="rope_base must be a number > 0"):
            LMConfig(vocab_size=4, rope_base=bad)
