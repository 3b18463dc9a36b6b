"""Red-team round five (issue 48's last item): faults found trying this round's changed entry points with bad and
edge-case input. Each test reproduces a fault before its fix."""

import json

import pytest
import torch

from diffattn_tutorial import golden
from diffattn_tutorial.hf import CheckpointError, from_hf, hf_lm_config, read_folder, save_hf
from diffattn_tutorial.hf.checkpoints import write_safetensors
from diffattn_tutorial.training.hf_weights import their_name
from diffattn_tutorial.training.model import LMConfig, TinyLM

CONFIG = dict(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)


def _hf_state() -> dict:
    torch.manual_seed(0)
    return {their_name(k): v.clone() for k, v in TinyLM(hf_lm_config(CONFIG)).state_dict().items()}


def _tiny() -> TinyLM:
    return TinyLM(LMConfig(vocab_size=32, attention="baseline", d_model=16, n_layers=1, n_heads=2, max_len=16))


def test_save_hf_overwrite_must_be_a_bool_not_a_truthy_string(tmp_path):
    # Was: overwrite="no" is truthy, so the existing folder (and whatever the user kept in it) was replaced.
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    with pytest.raises(TypeError, match="overwrite must be True or False"):
        save_hf(_tiny(), folder, overwrite="no")
    assert (folder / "notes.txt").read_text() == "keep me"


def test_save_hf_overwrite_refuses_a_folder_that_is_no_checkpoint(tmp_path):
    # Was: save_hf(model, folder, overwrite=True) deleted a folder of anything (a project, a runs folder) whole.
    (tmp_path / "train.py").write_text("print('my work')")
    with pytest.raises(FileExistsError, match="not a checkpoint folder"):
        save_hf(_tiny(), tmp_path, overwrite=True)
    assert (tmp_path / "train.py").is_file()
    target = tmp_path / "ckpt"
    save_hf(_tiny(), target)
    save_hf(_tiny(), target, overwrite=True)  # a checkpoint folder (config.json) is still replaced
    assert (target / "config.json").is_file()


def test_save_hf_overwrite_refuses_a_file(tmp_path):
    (tmp_path / "model.bin").write_text("weights")
    with pytest.raises(FileExistsError, match="not a checkpoint folder"):
        save_hf(_tiny(), tmp_path / "model.bin", overwrite=True)
    assert (tmp_path / "model.bin").read_text() == "weights"


def test_read_folder_refuses_a_weight_found_in_two_files(tmp_path):
    # Was: a stale second *.safetensors (or a shard holding another's names) silently overwrote weights, by file
    # name order: the model loaded was some mix of the two.
    sd = _hf_state()
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    write_safetensors(sd, tmp_path / "model.safetensors")
    write_safetensors({k: v + 1 for k, v in sd.items()}, tmp_path / "model_v2.safetensors")
    with pytest.raises(CheckpointError, match="is in both model.safetensors and model_v2.safetensors"):
        read_folder(tmp_path)


def test_read_folder_names_a_broken_json_file(tmp_path):
    # Was: json's bare "Expecting value: line 1 column 1" (or KeyError 'weight_map'), naming no file.
    write_safetensors(_hf_state(), tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{bad json")
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        read_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(CheckpointError, match="config.json .*object"):
        read_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="index.json has no 'weight_map'"):
        read_folder(tmp_path)


def test_hf_lm_config_refuses_zero_kv_heads_and_a_window_that_is_no_number():
    # Was: num_key_value_heads=0 silently became num_attention_heads; sliding_window="4" a bare TypeError from '<'.
    with pytest.raises(CheckpointError, match="num_key_value_heads"):
        hf_lm_config({**CONFIG, "num_key_value_heads": 0})
    with pytest.raises(CheckpointError, match="sliding_window"):
        hf_lm_config({**CONFIG, "model_type": "mistral", "sliding_window": "4"})
    with pytest.raises(CheckpointError, match="sliding_window"):
        hf_lm_config({**CONFIG, "model_type": "mistral", "sliding_window": 0})


def test_a_bias_the_config_has_no_place_for_is_named_by_transformers_name():
    # Was: torch's load_state_dict error, 'Unexpected key(s) in state_dict: "blocks.0.attn.q_proj.bias"' (TinyLM's
    # name, no fix), for a Llama-labelled checkpoint that carries q/k/v biases (a Qwen2 one).
    from diffattn_tutorial.interop import from_llama

    sd = {**_hf_state(), "model.layers.0.self_attn.q_proj.bias": torch.zeros(16)}
    loose = {k: v for k, v in CONFIG.items() if k != "model_type"}
    for load in (lambda: from_hf(sd, config=CONFIG), lambda: from_llama(sd, **loose)):
        with pytest.raises(CheckpointError, match=r"unexpected \['model.layers.0.self_attn.q_proj.bias'\]"):
            load()


def test_from_llama_points_a_llama3_rope_to_from_hf_and_refuses_zero_kv_heads():
    # Was: "TinyLM has no RoPE type 'llama3'", though TinyLM has it and from_hf loads it; num_key_value_heads=0
    # was taken as num_attention_heads.
    from diffattn_tutorial.interop import from_llama

    loose = {k: v for k, v in CONFIG.items() if k != "model_type"}
    rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
    with pytest.raises(ValueError, match="from_hf"):
        from_llama(_hf_state(), config={**loose, "rope_parameters": rope})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        from_llama(_hf_state(), config={**loose, "num_key_value_heads": 0})


@pytest.mark.parametrize("value", ["false", 0, None])
def test_a_tie_word_embeddings_that_is_no_bool_is_refused(value):
    """A hand-written config's "false" counted as True (the head copied from the embedding where lm_head is absent)."""
    case = golden.load("hf/llama3_gqa_untied")
    with pytest.raises(CheckpointError, match=rf"tie_word_embeddings must be true or false, got {value!r}"):
        from_hf(case["state_dict"], config=dict(case["config"], tie_word_embeddings=value))


@pytest.mark.parametrize("backend", ["naive", "chunked", "sdpa_padded", "cpu_fused", "auto"])
def test_a_mask_row_of_nan_gives_a_nan_row_not_a_masked_one(backend):
    """A row of an additive mask that is all NaN passed for fully masked (zeros) on every backend, while one NaN entry
    gave NaN: the max skips NaN, and ``mask > finfo.min`` is False for NaN. Now that row reads a NaN: NaN output and
    gradient rows, on every backend alike; a row of -inf stays fully masked (zeros)."""
    from diffattn_tutorial.functional import backend_status, diff_attention

    if not backend_status("cpu")[backend][0]:
        pytest.skip(backend_status("cpu")[backend][1])
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 4, 6, 32, generator=g, requires_grad=True) for _ in range(2))
    v = torch.randn(1, 2, 6, 64, generator=g, requires_grad=True)
    mask = torch.zeros(1, 1, 6, 6)
    mask[..., 2, :], mask[..., 4, :] = float("nan"), float("-inf")
    out = diff_attention(q, k, v, 0.5, attn_mask=mask, backend=backend)
    out.sum().backward()
    nan_rows = [r for r in range(6) if torch.isnan(out[0, :, r]).all()]
    zero_rows = [r for r in range(6) if (out[0, :, r] == 0).all()]
    assert (nan_rows, zero_rows) == ([2], [4])
    assert [r for r in range(6) if torch.isnan(q.grad[0, :, r]).any()] == [2]
