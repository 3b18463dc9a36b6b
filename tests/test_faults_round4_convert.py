"""Faults round four (issue 48, items 3-7 and 9-12): conversion, interop, fine-tuning and runs, each case a careful
user's that went wrong (a parameter an optimizer no longer trains, an export that computes another function, a
misspelled key taken as the default, a log that lost its steps, a refusal that names the wrong reason)."""

from __future__ import annotations

import math

import pytest
import torch
from forked import run_module

from diffattn_tutorial import golden, interop
from diffattn_tutorial.layers.attention import DiffAttnV2, MultiheadAttention, MultiheadDiffAttn
from diffattn_tutorial.layers.convert import (
    convert_model,
    finish_warmup,
    set_warmup,
    to_diff_v1,
    to_diff_v2,
    warmup_mix,
)
from diffattn_tutorial.layers.rope import rope_cos_sin
from diffattn_tutorial.training.model import build_model


def _baseline(H: int = 4, Hkv: int = 4, C: int = 32, **kw) -> MultiheadAttention:
    torch.manual_seed(0)
    return MultiheadAttention(C, H, num_kv_heads=Hkv, **kw)


# --- item 3: finish_warmup keeps the parameters an optimizer holds, and works on the layer itself ----------------

@pytest.mark.parametrize("attention,options", [("diff_v2", dict(negative="zero")),
                                               ("diff", dict(heads="double", subln=False))])
def test_finish_warmup_keeps_the_parameters_an_optimizer_holds(attention, options):
    torch.manual_seed(0)
    base = build_model("baseline", 40, d_model=32, n_layers=2, n_heads=4, max_len=32)
    model = convert_model(base, attention, warmup=True, **options)
    before = dict(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    set_warmup(model, 1.0)
    assert finish_warmup(model) is model
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in after)
    q = model.blocks[0].attn.q_proj.weight
    start = q.detach().clone()
    model(torch.randint(0, 40, (2, 8))).square().mean().backward()
    opt.step()
    assert not torch.equal(q, start)  # the optimizer still trains the model's own weights
    assert "lambda_mix" not in "".join(model.state_dict())


def test_finish_warmup_on_the_layer_itself_finishes_it():
    base, x, rope = _baseline(4, 2), torch.randn(2, 9, 32), rope_cos_sin(9, 8)
    warm = to_diff_v2(base, negative="zero", warmup=True)
    set_warmup(warm, 1.0)
    done = finish_warmup(warm)
    assert done is warm and "lambda_mix" not in warm.state_dict()
    sd = interop.to_unilm_v2(warm)  # the export no longer says the layer is in its warm-up
    back = interop.from_unilm_v2(sd, d_model=32, num_heads=4, num_kv_heads=2)
    torch.testing.assert_close(back(x, rope=rope, causal=True), warm(x, rope=rope, causal=True))


# --- item 4: exports that would compute another function --------------------------------------------------------

def test_a_lambda_init_override_is_refused_by_name_on_export():
    layer = MultiheadDiffAttn(32, 2, depth=3, lambda_init=0.8)
    for export in (interop.to_unilm, interop.to_timm):
        with pytest.raises(ValueError, match=r"lambda_init=0\.8 other than lambda_init\(depth=3\)"):
            export(layer)


@pytest.mark.parametrize("make,export,load", [
    (lambda: MultiheadDiffAttn(32, 2, depth=1, num_kv_heads=1, rope_interleaved=False, subln_affine=False),
     interop.to_unilm, lambda sd: interop.from_unilm(sd, embed_dim=32, num_heads=2, depth=1, num_kv_heads=1,
                                                     subln_affine=False)),
    (lambda: DiffAttnV2(32, 4, num_kv_heads=2, rope_interleaved=False),
     interop.to_unilm_v2, lambda sd: interop.from_unilm_v2(sd, d_model=32, num_heads=4, num_kv_heads=2)),
])
def test_a_half_split_rope_layer_exports_in_the_references_interleaved_layout(make, export, load):
    torch.manual_seed(0)
    layer = make()
    x = torch.randn(2, 7, 32)
    rope = rope_cos_sin(7, layer.head_dim)
    back = load(export(layer))  # the reference's layout: interleaved RoPE
    assert back.rope_interleaved
    torch.testing.assert_close(back(x, rope=rope, causal=True), layer(x, rope=rope, causal=True))


# --- item 5 and item 9: from_llama's keys, shapes and state dicts -------------------------------------------------

def _llama_loose(case: dict) -> dict:
    cfg = case["config"]
    return {k: cfg[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                "num_attention_heads", "num_key_value_heads", "tie_word_embeddings")}


@pytest.mark.parametrize("key,close", [("rope_thta", "rope_theta"), ("rms_norm_epsilon", "rms_norm_eps")])
def test_from_llama_refuses_a_misspelled_loose_key_naming_the_close_one(key, close):
    case = golden.load("llama/gqa_untied")
    with pytest.raises(TypeError, match=rf"'{key}' \(did you mean '{close}'\?\)"):
        interop.from_llama(case["state_dict"], **_llama_loose(case), **{key: 1e-5})


@pytest.mark.parametrize("damage", [lambda t: t[:-2], lambda t: t.sum()])  # 30 rows of 32, or 0-d
def test_from_llama_names_a_wrong_projection_shape(damage):
    case = golden.load("llama/gqa_untied")
    sd = dict(case["state_dict"])
    for p in ("q", "k"):
        key = f"model.layers.0.self_attn.{p}_proj.weight"
        bad = {**sd, key: damage(sd[key])}
        with pytest.raises(ValueError, match=rf"{key}: checkpoint \({', '.join(map(str, damage(sd[key]).shape))}"):
            interop.from_llama(bad, config=case["config"])


def _loaders():
    llama = golden.load("llama/gqa_untied")
    return [
        ("from_unilm", lambda sd: interop.from_unilm(sd, embed_dim=32, num_heads=2, depth=0)),
        ("from_timm", lambda sd: interop.from_timm(sd, dim=32, num_heads=2)),
        ("from_unilm_v2", lambda sd: interop.from_unilm_v2(sd, d_model=32, num_heads=4)),
        ("from_diffllama", lambda sd: interop.from_diffllama(sd, layer_idx=0, hidden_size=32, num_attention_heads=4)),
        ("from_llama", lambda sd: interop.from_llama(sd, config=llama["config"])),
    ]


@pytest.mark.parametrize("name,load", _loaders(), ids=lambda v: v if isinstance(v, str) else "")
def test_a_path_or_numpy_arrays_instead_of_a_state_dict_are_named(name, load):
    with pytest.raises(TypeError, match=rf"{name}\(\): .*state dict of tensors.*weights_only=True.*load_file"):
        load("layer.pt")
    sd = {k: v.numpy() for k, v in MultiheadDiffAttn(32, 2).state_dict().items()}
    with pytest.raises(TypeError, match=rf"{name}\(\): '[\w.]+' is a numpy.ndarray, not a tensor.*torch.from_numpy"):
        load(sd)


# --- item 6: a resume killed while it rewrites metrics.jsonl keeps the steps ----------------------------------------

def test_a_rewrite_of_the_metrics_log_cut_short_loses_no_step(tmp_path):
    """The child rewrites a 40-step log to its first 30 steps under a file-size limit that stops any write past
    1000 bytes, as a kill mid-write would: the log must still hold every step (all 40, or the 30 kept)."""
    log = tmp_path / "metrics.jsonl"
    from diffattn_tutorial.training.runlog import MetricsLog, read_steps

    metrics = MetricsLog(log)
    for step in range(1, 41):
        metrics.write({"event": "step", "step": step, "loss": 1.0 / step, "lr": 1e-3, "seconds": 0.01 * step})
    assert log.stat().st_size > 2000
    child = run_module("children.truncate_metrics", [str(log), "30", "1000"], timeout=120)
    assert "cut short" in child.stdout, (child.stdout, child.stderr)
    steps = [r["step"] for r in read_steps(log)]
    assert steps in (list(range(1, 41)), list(range(1, 31))), steps
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temporary file left behind


# --- item 7: set_warmup on a model without a warm-up ---------------------------------------------------------------

def test_set_warmup_on_a_model_without_warmup_layers_is_refused_by_name():
    torch.manual_seed(0)
    model = convert_model(build_model("baseline", 40, d_model=32, n_layers=1, n_heads=4, max_len=16), "diff_v2")
    with pytest.raises(ValueError, match="no warm-up layer.*warmup=True"):
        set_warmup(model, 0.0)


# --- item 10: from_diffllama's numbers ---------------------------------------------------------------------------

@pytest.mark.parametrize("key,value", [("rms_norm_eps", "1e-5"), ("rms_norm_eps", math.nan), ("rms_norm_eps", -1),
                                       ("rms_norm_eps", True), ("attention_dropout", 1.5),
                                       ("attention_dropout", -0.1), ("attention_dropout", "0.1")])
def test_from_diffllama_refuses_a_bad_eps_or_dropout_by_name(key, value):
    sd = interop.to_diffllama(MultiheadDiffAttn(32, 2, subln_affine=False))
    with pytest.raises(ValueError, match=rf"{key} must be"):
        interop.from_diffllama(sd, layer_idx=0, hidden_size=32, num_attention_heads=4, **{key: value})


# --- item 11: the fine-tune's config and the warm-up's schedule -----------------------------------------------------

@pytest.mark.parametrize("attention,options,match", [
    ("diff_v2", (("negative", "bogus"),), "negative must be one of"),
    ("diff", (("heads", "tripple"),), "heads must be one of"),
    ("diff", (("heads", "split"), ("negative", "mirror")), "leave negative=None"),
    ("diff_v2", (("warmup", "no"),), "warmup must be True or False"),
    ("diff", (("subln", "no"),), "subln must be True or False"),
])
def test_finetune_config_checks_the_conversion_options_before_training(attention, options, match):
    from diffattn_tutorial.training.finetune import FinetuneConfig

    with pytest.raises(ValueError, match=match):
        FinetuneConfig(attention, options)


def test_finetune_config_names_a_base_that_is_no_study_config():
    from diffattn_tutorial.training.finetune import FinetuneConfig

    with pytest.raises(TypeError, match="base must be a StudyConfig"):
        FinetuneConfig("diff_v2", base="baseline")


def test_finetune_study_takes_a_batch_size(monkeypatch):
    from diffattn_tutorial.training import finetune

    seen = []
    monkeypatch.setattr(finetune, "run_finetune", lambda config, **kw: seen.append(config))
    finetune.finetune_study("diff_v2", batch_size=8, progress=False)
    assert seen[0].batch_size == 8


@pytest.mark.parametrize("step,warmup_steps,name", [(math.nan, 10, "step"), (5, math.inf, "warmup_steps"),
                                                    ("5", 10, "step"), (5, None, "warmup_steps"),
                                                    (True, 10, "step")])
def test_warmup_mix_refuses_what_is_no_step_count_by_name(step, warmup_steps, name):
    with pytest.raises((TypeError, ValueError), match=rf"{name} must be"):
        warmup_mix(step, warmup_steps)


# --- item 12: the baseline's form -------------------------------------------------------------------------------

def test_a_cross_attention_baseline_is_refused_for_being_one():
    with pytest.raises(ValueError, match=r"cross-attention baseline \(kdim=16") as info:
        to_diff_v2(_baseline(kdim=16))
    assert "bias" not in str(info.value)
    with pytest.raises(ValueError, match=r"projection biases"):
        to_diff_v1(_baseline(bias=True), depth=0)


def test_v1_keeps_the_baselines_attention_dropout_and_v2_refuses_to_drop_it():
    assert to_diff_v1(_baseline(dropout=0.25), depth=0).dropout == 0.25
    assert to_diff_v1(_baseline(dropout=0.25), depth=0, heads="double").dropout == 0.25
    with pytest.raises(ValueError, match="dropout=0.25"):
        to_diff_v2(_baseline(dropout=0.25))


@pytest.mark.parametrize("H,Hkv", [(3, None), (6, 3)])
def test_convert_model_doubles_what_to_diff_v1_doubles(H, Hkv):
    torch.manual_seed(0)
    base = build_model("baseline", 40, d_model=24, n_layers=2, n_heads=H, n_kv_heads=Hkv, max_len=16).eval()
    new = convert_model(base, "diff", heads="double", subln=False).eval()
    idx = torch.randint(0, 40, (2, 8))
    torch.testing.assert_close(new(idx), base(idx), rtol=1e-5, atol=1e-5)
    for block, old in zip(new.blocks, base.blocks):
        layer = to_diff_v1(old.attn, depth=block.attn.depth, heads="double", subln=False)
        assert block.attn.num_heads == layer.num_heads == H

