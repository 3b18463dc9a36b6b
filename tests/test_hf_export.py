"""hf.export.save_hf: a TinyLM back in transformers' format (Llama/Qwen2, DiffLlama, a DIFF V2 remote-code folder),
read back by this library here and by transformers alone where it is installed; refusals write nothing."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from diffattn_tutorial import golden
from diffattn_tutorial.hf.checkpoints import CheckpointError, from_hf, read_folder
from diffattn_tutorial.hf.export import V2_MODELING_FILE, save_hf, v2_modeling_source
from diffattn_tutorial.layers.convert import convert_model, finish_warmup, set_warmup

TOL = dict(rtol=1e-4, atol=1e-5)
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def _model(name="hf/llama3_mha_tied"):
    case = golden.load(name)
    return from_hf(case["state_dict"], config=case["config"]), case


def _fine_tune(model, ids, steps=3):
    """A few SGD steps on every parameter but the V1 sub-norms (DiffLlama's have no weight)."""
    opt = torch.optim.SGD([p for n, p in model.named_parameters() if "subln" not in n], lr=0.05)
    for _ in range(steps):
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.mark.parametrize("name", ["hf/llama3_gqa_untied", "hf/qwen2_mha_untied"])
def test_a_baseline_saved_as_its_family_loads_back_the_same(tmp_path, name):
    model, case = _model(name)
    folder = save_hf(_fine_tune(model, case["input_ids"]), tmp_path / "out")
    config, _ = read_folder(folder)
    assert config["model_type"] == ("qwen2" if "qwen2" in name else "llama")
    assert config["rope_parameters"]["rope_type"] == ("llama3" if "llama3" in name else "default")
    torch.testing.assert_close(from_hf(folder)(case["input_ids"]), model(case["input_ids"]), **TOL)


def test_a_v2_folder_carries_its_modelling_file_and_tinylm_weights(tmp_path):
    model, case = _model("hf/qwen2_gqa_tied")
    v2 = _fine_tune(convert_model(model, "diff_v2"), case["input_ids"])
    folder = save_hf(v2, tmp_path / "v2")
    config, sd = read_folder(folder)
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_diffattn_v2.DiffAttnV2ForCausalLM"
    assert config["qkv_bias"] is True and sorted(sd) == sorted(v2.state_dict())
    assert all(torch.equal(sd[k], v) for k, v in v2.state_dict().items())
    text = (folder / V2_MODELING_FILE).read_text()
    compile(text, V2_MODELING_FILE, "exec")  # a whole Python file
    assert "def llama3_inv_freq" in text and "def apply_rope" in text and text == v2_modeling_source()


def test_a_v1_model_is_saved_as_diffllama(tmp_path):
    model, case = _model("hf/llama3_mha_tied")  # MHA and rms_norm_eps 1e-5: what DiffLlama can hold
    v1 = _fine_tune(convert_model(model, "diff"), case["input_ids"])
    config, sd = read_folder(save_hf(v1, tmp_path / "v1"))
    assert config["model_type"] == "diffllama" and config["num_attention_heads"] == 4
    assert "model.layers.1.self_attn.lambda_q1" in sd and not any("subln" in k or "groupnorm" in k for k in sd)


# ---------------------------------------------------------------- refusals, by name, with nothing written
def _nothing_written(tmp_path):
    return not any(p for p in tmp_path.iterdir())


def test_a_v1_sub_norm_with_a_trained_weight_is_refused(tmp_path):
    model, case = _model("hf/llama3_mha_tied")
    v1 = convert_model(model, "diff")
    with torch.no_grad():
        v1.blocks[1].attn.subln.weight.mul_(1.5)
    with pytest.raises(CheckpointError, match="layer 1: the sub-norm has a weight other than all ones"):
        save_hf(v1, tmp_path / "v1")
    assert _nothing_written(tmp_path)


def test_a_v1_model_without_sub_norm_is_refused(tmp_path):
    model, _ = _model("hf/llama3_mha_tied")
    v1 = convert_model(model, "diff", heads="split", subln=False)
    with pytest.raises(CheckpointError, match=r"layer 0 has no sub-norm \(subln=False\)"):
        save_hf(v1, tmp_path / "v1")
    assert _nothing_written(tmp_path)


@pytest.mark.parametrize("name, named", [("hf/qwen2_mha_untied", "sub-norm uses rms_norm_eps"),
                                         ("hf/llama3_gqa_untied", None)])
def test_what_diffllama_cannot_express_is_refused(tmp_path, name, named):
    model, _ = _model(name)
    if named is None:  # GQA: the split V1 conversion itself refuses; the doubled one is no DiffLlama layout
        v1 = convert_model(model, "diff", heads="double", negative="mirror")
        named = "doubled-head V1 model"
    else:
        v1 = convert_model(model, "diff")
    with pytest.raises(CheckpointError, match=named):
        save_hf(v1, tmp_path / "v1")
    assert _nothing_written(tmp_path)


def test_a_warm_up_in_progress_is_refused_and_a_finished_one_saves(tmp_path):
    model, case = _model()
    v2 = convert_model(model, "diff_v2", warmup=True)
    with pytest.raises(CheckpointError, match="warm-up"):
        save_hf(v2, tmp_path / "v2")
    assert _nothing_written(tmp_path)
    set_warmup(v2, 1.0)
    finish_warmup(v2)
    assert (save_hf(v2, tmp_path / "v2") / "model.safetensors").is_file()


def test_an_existing_folder_is_kept_unless_overwrite(tmp_path):
    model, _ = _model()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    (tmp_path / "out" / "config.json").write_text("{}")  # a checkpoint folder: only such is replaced
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_hf(model, tmp_path / "out")
    assert (tmp_path / "out" / "mine.txt").read_text() == "keep"
    save_hf(model, tmp_path / "out", overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["out"] and not (tmp_path / "out" / "mine.txt").exists()


def test_a_failure_while_writing_leaves_no_half_written_folder(tmp_path, monkeypatch):
    from diffattn_tutorial.hf import export as hf_export

    def broken(tensors, path):
        open(path, "wb").write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(hf_export, "write_safetensors", broken)
    with pytest.raises(OSError, match="disk full"):
        save_hf(_model()[0], tmp_path / "out")
    assert _nothing_written(tmp_path)


def test_not_a_tinylm_is_refused(tmp_path):
    with pytest.raises(TypeError, match="saves a TinyLM"):
        save_hf(torch.nn.Linear(2, 2), tmp_path / "x")


# ---------------------------------------------------------------- live: transformers alone loads what was saved
@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers is not installed (the folders are checked above)")
@pytest.mark.parametrize("name, kind", [("hf/llama3_gqa_untied", "baseline"), ("hf/qwen2_mha_untied", "baseline"),
                                        ("hf/llama3_mha_tied", "diff"), ("hf/llama3_gqa_untied", "diff_v2"),
                                        ("hf/qwen2_gqa_tied", "diff_v2")])
def test_live_transformers_loads_the_saved_folder_alone(tmp_path, monkeypatch, name, kind):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    from transformers import AutoModelForCausalLM

    model, case = _model(name)
    ids = case["input_ids"]
    ours = model if kind == "baseline" else _fine_tune(convert_model(model, kind), ids)
    back = AutoModelForCausalLM.from_pretrained(save_hf(ours, tmp_path / kind), trust_remote_code=True).eval()
    prompt = case["prompt"]
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ours(ids), **TOL)
        tokens = back.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                               pad_token_id=0, eos_token_id=None)
    assert torch.equal(tokens, ours.generate(prompt, 8))
    assert json.loads((tmp_path / kind / "config.json").read_text())["architectures"][0] == type(back).__name__


def test_q_k_v_biases_without_an_output_bias_are_refused_for_diffllama(tmp_path):
    case = golden.load("hf/qwen2_mha_untied")
    model = from_hf(case["state_dict"], config=dict(case["config"], rms_norm_eps=1e-5))  # DiffLlama's sub-norm eps
    with pytest.raises(CheckpointError, match="layer 0: .*biases on some projections only"):
        save_hf(convert_model(model, "diff"), tmp_path / "v1")
    assert _nothing_written(tmp_path)
