"""layers.convert: baseline -> DIFF V2 / V1, exact where ``why_not_exact`` says so and measurably not elsewhere;
GQA groups kept, warm-up, exports through interop; training.finetune on a tiny base run."""

from __future__ import annotations

import pytest
import torch

from diffattn_tutorial import interop
from diffattn_tutorial.layers.attention import DiffAttnV2, MultiheadAttention, MultiheadDiffAttn
from diffattn_tutorial.layers.convert import (
    convert_layer,
    convert_model,
    finish_warmup,
    set_warmup,
    to_diff_v1,
    to_diff_v2,
    warmup_mix,
    why_not_exact,
)
from diffattn_tutorial.layers.rope import rope_cos_sin
from diffattn_tutorial.training.model import build_model

OPTIONS = [
    ("diff_v2", dict(negative="mirror")), ("diff_v2", dict(negative="zero")),
    ("diff_v2", dict(negative="zero", warmup=True)), ("diff_v2", dict(negative="mirror", warmup=True)),
    ("diff", dict(heads="split")), ("diff", dict(heads="split", subln=False)),
    ("diff", dict(heads="split", warmup=True, subln=False)),
    ("diff", dict(heads="double", subln=False)), ("diff", dict(heads="double", negative="zero", subln=False)),
    ("diff", dict(heads="double", negative="zero", subln=False, warmup=True)), ("diff", dict(heads="double")),
]


def _layer(H: int = 4, Hkv: int = 4, C: int = 32, seed: int = 0) -> tuple[MultiheadAttention, torch.Tensor, tuple]:
    torch.manual_seed(seed)
    layer = MultiheadAttention(C, H, num_kv_heads=Hkv)
    return layer, torch.randn(2, 9, C), rope_cos_sin(9, C // H)


@pytest.mark.parametrize("H,Hkv", [(4, 4), (4, 2)])
@pytest.mark.parametrize("attention,options", OPTIONS, ids=lambda o: str(o))
def test_exact_where_claimed_and_measurably_not_elsewhere(attention, options, H, Hkv):
    base, x, rope = _layer(H, Hkv)
    reason = why_not_exact(attention, **options)
    if attention == "diff" and options["heads"] == "split" and Hkv != H:
        with pytest.raises(ValueError, match="heads='double'"):
            convert_layer(base, attention, depth=1, **options)
        return
    new = convert_layer(base, attention, depth=1, **options)
    ref, out = base(x, rope=rope, causal=True), new(x, rope=rope, causal=True)
    gap = (out - ref).abs().max().item()
    if reason is None:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    else:
        assert gap > 1e-2, (reason, gap)


def test_v2_mirror_is_bit_exact_and_keeps_gqa_groups():
    base, x, rope = _layer(4, 2)
    new = to_diff_v2(base)
    assert isinstance(new, DiffAttnV2) and new.num_kv_heads == 2 and new.num_heads == 4
    assert torch.equal(new.k_proj.weight, base.k_proj.weight) and torch.equal(new.v_proj.weight, base.v_proj.weight)
    q = new.q_proj.weight.unflatten(0, (4, 2, -1))  # (H, pair, d, C): both query heads of pair i are baseline head i
    assert torch.equal(q[:, 0], q[:, 1]) and torch.equal(q[:, 0].flatten(0, 1), base.q_proj.weight)
    assert torch.equal(new(x, rope=rope, causal=True), base(x, rope=rope, causal=True))


def test_v1_split_copies_the_baseline_weights():
    base, _, _ = _layer(4, 4)
    new = to_diff_v1(base, depth=2)
    assert isinstance(new, MultiheadDiffAttn) and new.num_heads == 2 and new.subln is not None
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        assert torch.equal(getattr(new, name).weight, getattr(base, name).weight)
    assert new.lambda_full().item() == torch.tensor(new.lambda_init).float().item()  # equal pairs: lambda_init


def test_bad_options_are_refused():
    base, _, _ = _layer(4, 4)
    with pytest.raises(ValueError, match="negative must be one of"):
        to_diff_v2(base, negative="copy")
    with pytest.raises(ValueError, match="leave negative=None"):
        to_diff_v1(base, depth=0, heads="split", negative="zero")
    with pytest.raises(ValueError, match="heads must be one of"):
        to_diff_v1(base, depth=0, heads="triple")
    with pytest.raises(ValueError, match="even head count"):
        to_diff_v1(MultiheadAttention(24, 3), depth=0)
    with pytest.raises(TypeError, match="MultiheadAttention"):
        to_diff_v2(DiffAttnV2(32, 4))
    with pytest.raises(ValueError, match="bias=False"):
        to_diff_v2(MultiheadAttention(32, 4, bias=True))
    with pytest.raises(ValueError, match="'diff' \\(V1\\) or 'diff_v2'"):
        convert_layer(base, "v3")
    with pytest.raises(ValueError, match="mix must be"):
        set_warmup(base, 1.5)


def test_warmup_goes_from_the_baseline_to_the_plain_layer_and_exports_after():
    base, x, rope = _layer(4, 2)
    warm = to_diff_v2(base, negative="zero", warmup=True)
    assert type(warm) is DiffAttnV2 and float(warm.lambda_mix) == 0.0
    torch.testing.assert_close(warm(x, rope=rope, causal=True), base(x, rope=rope, causal=True))
    with pytest.raises(ValueError, match="warm-up"):
        interop.to_unilm_v2(warm)
    with pytest.raises(ValueError, match="lambda_mix is 0"):
        finish_warmup(torch.nn.Sequential(warm))
    set_warmup(warm, 1.0)
    plain = to_diff_v2(base, negative="zero")
    torch.testing.assert_close(warm(x, rope=rope, causal=True), plain(x, rope=rope, causal=True))
    holder = finish_warmup(torch.nn.Sequential(warm))
    assert type(holder[0]) is DiffAttnV2 and "lambda_mix" not in holder[0].state_dict()
    back = interop.from_unilm_v2(interop.to_unilm_v2(holder[0]), d_model=32, num_heads=4, num_kv_heads=2)
    torch.testing.assert_close(back(x, rope=rope, causal=True), plain(x, rope=rope, causal=True))
    assert [warmup_mix(s, 4) for s in (0, 2, 4, 9)] == [0.0, 0.5, 1.0, 1.0] and warmup_mix(3, 0) == 1.0
    for bad in ((-5, 10), (1, -2)):
        with pytest.raises(ValueError, match="must be >= 0"):
            warmup_mix(*bad)


@pytest.mark.parametrize("n_kv_heads", [None, 2])
def test_whole_model_v2_is_exact_generates_alike_and_exports(n_kv_heads):
    torch.manual_seed(0)
    base = build_model("baseline", 40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, max_len=32).eval()
    idx = torch.randint(0, 40, (2, 12))
    new = convert_model(base, "diff_v2").eval()
    assert new.cfg.attention == "diff_v2" and base.cfg.attention == "baseline"
    torch.testing.assert_close(new(idx), base(idx), rtol=1e-5, atol=1e-5)
    assert torch.equal(new.generate(idx[:1, :4], 6), base.generate(idx[:1, :4], 6))
    for block in new.blocks:
        sd = interop.to_unilm_v2(block.attn)
        again = interop.from_unilm_v2(sd, d_model=32, num_heads=4, num_kv_heads=n_kv_heads)
        h = torch.randn(1, 5, 32)
        torch.testing.assert_close(again(h, causal=True), block.attn(h, causal=True))


def test_whole_model_v1_split_has_the_diff_models_shapes_and_exports_to_unilm():
    torch.manual_seed(0)
    base = build_model("baseline", 40, d_model=32, n_layers=2, n_heads=4, max_len=32).eval()
    new = convert_model(base, "diff")
    fresh = build_model("diff", 40, d_model=32, n_layers=2, n_heads=4, max_len=32)
    fresh.load_state_dict(new.state_dict())  # the course's parameter-matched "diff" TinyLM, key for key
    sd = interop.to_unilm(new.blocks[1].attn)
    again = interop.from_unilm(sd, embed_dim=32, num_heads=2, depth=1)
    h = torch.randn(1, 5, 32)
    torch.testing.assert_close(again(h, causal=True), new.blocks[1].attn(h, causal=True))
    with pytest.raises(ValueError, match="convert a baseline"):
        convert_model(new, "diff_v2")


def test_finetune_config_refuses_contradictions():
    from diffattn_tutorial.training.finetune import FinetuneConfig
    from diffattn_tutorial.training.study import StudyConfig

    with pytest.raises(ValueError, match="warmup_steps needs"):
        FinetuneConfig("diff_v2", warmup_steps=5)
    with pytest.raises(ValueError, match="0 < warmup_steps < steps"):
        FinetuneConfig("diff_v2", (("warmup", True),), steps=10, warmup_steps=10)
    with pytest.raises(ValueError, match="no options"):
        FinetuneConfig("baseline", (("negative", "zero"),))
    with pytest.raises(ValueError, match="base must be a baseline"):
        FinetuneConfig("diff", base=StudyConfig("diff"))


@pytest.mark.parametrize("kw, message", [
    (dict(steps=-5), "steps must be a whole number of at least 1, got -5"),
    (dict(steps=2.5), "steps must be a whole number"), (dict(batch_size=0), "batch_size must be"),
    (dict(warmup_steps=-1), "warmup_steps must be a whole number of at least 0"),
    (dict(lr=float("nan")), "lr must be a positive finite number, got nan"), (dict(lr=-1e-3), "lr must be"),
    (dict(lr=True), "lr must be"),
])
def test_finetune_config_refuses_a_bad_budget_by_name(kw, message):
    """Before any training: a negative or fractional step count, a NaN learning rate (red-team findings)."""
    from diffattn_tutorial.training.finetune import FinetuneConfig

    with pytest.raises(ValueError, match=message):
        FinetuneConfig("diff_v2", **kw)


def test_unknown_conversion_options_are_refused_by_name():
    from diffattn_tutorial.training.finetune import FinetuneConfig, finetune_study

    with pytest.raises(TypeError, match=r"unknown option\(s\) \['heads'\] for attention='diff_v2': it takes "
                                        r"negative, warmup"):
        FinetuneConfig("diff_v2", (("heads", "split"),))
    with pytest.raises(TypeError, match=r"\['negatve'\] for attention='diff'"):
        finetune_study("diff", negatve="zero", cache=False, progress=False)  # refused before the base run trains
    with pytest.raises(ValueError, match="heads must be one of"):
        why_not_exact("diff", heads="triple")
    with pytest.raises(ValueError, match="negative must be one of"):
        why_not_exact("diff_v2", negative="ones")


@pytest.mark.slow
def test_finetune_on_a_tiny_base_records_lambda_warms_up_and_caches(tmp_path):
    from diffattn_tutorial.training.finetune import finetune_study
    from diffattn_tutorial.training.study import StudyConfig, deterministic, measure

    base = StudyConfig("baseline", steps=4, n_eval=8, d_model=16, n_layers=1, n_heads=2, batch_size=4)
    kw = dict(cache=tmp_path, progress=False, steps=4, base=base)
    exact = finetune_study("diff_v2", **kw)
    assert exact.conversion_logit_error < 1e-5 and exact.conversion_loss == pytest.approx(exact.base_loss, abs=1e-5)
    assert len(exact.lambdas) == 4 and exact.lambdas[0] == [0.5]  # lambda_proj starts at zero: sigmoid(0)
    warm = finetune_study("diff_v2", negative="zero", warmup=True, warmup_steps=2, **kw)
    assert warm.conversion_logit_error < 1e-5 and [row[0] for row in warm.lambdas[:2]] == [0.0, 0.25]
    assert type(warm.model.blocks[0].attn) is DiffAttnV2  # the warm-up finished
    again = finetune_study("diff_v2", negative="zero", warmup=True, warmup_steps=2, **kw)
    assert again.cached and not warm.cached and again.losses == warm.losses and again.metrics == warm.metrics
    with deterministic(base.num_threads):  # the metrics the entry keeps are those of the loaded model
        assert again.metrics == measure(again.model, base.task, base.settings, base.n_eval)[0]
    for p, q in zip(again.model.parameters(), warm.model.parameters(), strict=True):
        assert torch.equal(p, q)
    v1 = finetune_study("diff", **kw)
    assert v1.conversion_logit_error > 1e-3 and v1.metrics.lambdas is not None
