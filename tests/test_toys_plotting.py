"""The notebooks' toy problems (``diffattn_tutorial.course.toys``) and plotting helpers (``diffattn_tutorial.course.plotting``)."""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from einops import rearrange  # noqa: E402

from diffattn_tutorial.course.plotting import attention_heatmaps, curves, share_bars, symmetric_limit, to_numpy  # noqa: E402
from diffattn_tutorial.course.toys import (  # noqa: E402
    amplifier_gains,
    amplifier_output,
    amplifier_signals,
    cmrr_db,
    retrieval_toy,
)
from diffattn_tutorial.functional import diff_attention_maps  # noqa: E402
from diffattn_tutorial.measure.attention_stats import answer_noise_shares  # noqa: E402

# ---------------------------------------------------------------- amplifier


def test_amplifier_output_on_floats_arrays_and_tensors():
    assert amplifier_output(3.0, 1.0) == 2.0
    assert amplifier_output(3.0, 1.0, 2.0, 0.5) == 5.5
    np.testing.assert_allclose(amplifier_output(np.ones(4), np.ones(4), 1.0, 0.9), np.full(4, 0.1))
    torch.testing.assert_close(amplifier_output(torch.ones(2, 3), torch.zeros(2, 3), 2.0), torch.full((2, 3), 2.0))


def test_gains_split_the_output_into_differential_and_common_mode():
    rng = np.random.default_rng(0)
    v_cm, v_d = rng.standard_normal(50), rng.standard_normal(50)
    for gp, gm in [(1.0, 1.0), (1.0, 0.9), (2.0, 0.5), (0.3, 1.7)]:
        ad, acm = amplifier_gains(gp, gm)
        out = amplifier_output(v_cm + v_d / 2, v_cm - v_d / 2, gp, gm)
        np.testing.assert_allclose(out, ad * v_d + acm * v_cm, atol=1e-12)


def test_cmrr_db_values_and_edge_cases():
    assert math.isclose(cmrr_db(1.0, 0.01), 40.0)
    assert math.isclose(cmrr_db(-1.0, 0.1), 20.0)  # magnitudes
    assert cmrr_db(1.0, 0.0) == math.inf
    assert cmrr_db(0.0, 1.0) == -math.inf
    with pytest.raises(ValueError, match="both"):
        cmrr_db(0.0, 0.0)
    t = cmrr_db(torch.tensor([1.0, 1.0]), torch.tensor([0.1, 0.0]))
    assert torch.isclose(t[0], torch.tensor(20.0, dtype=torch.float64)) and torch.isinf(t[1])


def test_amplifier_signals_seeded_and_consistent():
    a, b = amplifier_signals(seed=3), amplifier_signals(seed=3)
    np.testing.assert_array_equal(a.common, b.common)
    np.testing.assert_allclose(a.v_plus - a.v_minus, a.signal, atol=1e-12)
    np.testing.assert_allclose((a.v_plus + a.v_minus) / 2, a.common, atol=1e-12)
    double = amplifier_signals(seed=3, noise_level=2.0)
    np.testing.assert_allclose(double.common, 2 * a.common)  # same noise, scaled
    with pytest.raises(ValueError):
        amplifier_signals(1)


# ---------------------------------------------------------------- retrieval toy


def test_retrieval_toy_shapes_masks_and_determinism():
    t = retrieval_toy(40, n_queries=5, n_distractors=6, head_dim=8, seed=1)
    assert t.q.shape == t.q_common.shape == (1, 1, 5, 8)
    assert t.k.shape == (1, 1, 40, 8) and t.v.shape == (1, 1, 40, 16)
    assert t.answer.shape == t.context.shape == (5, 40) and t.answer.dtype == torch.bool
    assert (t.answer.sum(-1) == 1).all() and bool(t.context.all())
    assert int(t.distractor.sum()) == 6 and not bool((t.distractor & t.answer.any(0)).any())
    assert torch.equal(t.answer.float().argmax(-1), t.needles)
    u = retrieval_toy(40, n_queries=5, n_distractors=6, head_dim=8, seed=1)
    assert torch.equal(t.k, u.k) and torch.equal(t.q, u.q) and torch.equal(t.needles, u.needles)
    assert not torch.equal(retrieval_toy(40, n_queries=5, n_distractors=6, head_dim=8, seed=2).k, t.k)


def test_retrieval_toy_logits_follow_the_documented_structure():
    t = retrieval_toy(key_noise=0.0, topic_jitter=0.0, match=2.0)
    logits = (t.q @ t.k.transpose(-1, -2))[0, 0] / math.sqrt(t.head_dim)
    torch.testing.assert_close(logits[t.answer], torch.full((8,), 4.0))            # 2 * match on the answer
    others = t.answer.any(0) & ~t.answer
    torch.testing.assert_close(logits[others], torch.full((56,), 2.0))            # match on other needles
    dist = logits[:, t.distractor]
    assert bool(((dist >= 1.2 - 1e-5) & (dist <= 2.0 + 1e-5)).all())              # 0.6-1 x match
    filler = ~t.answer.any(0) & ~t.distractor
    torch.testing.assert_close(logits[:, filler], torch.zeros(8, int(filler.sum())), atol=1e-5, rtol=0)


def test_retrieval_toy_validates_sizes():
    with pytest.raises(ValueError, match="head_dim"):
        retrieval_toy(n_queries=16, head_dim=16)
    with pytest.raises(ValueError, match="n_keys"):
        retrieval_toy(10, n_queries=8, n_distractors=8)


def test_topic_only_second_map_cancels_the_shared_noise():
    """The claim notebook 03 makes: with no private key noise, one lambda cancels nearly all the noise."""
    t = retrieval_toy(key_noise=0.0)
    q = rearrange([t.q, t.q_common], "two b h n d -> b (h two) n d")
    k = rearrange([t.k, t.k], "two b h n d -> b (h two) n d")
    a1 = diff_attention_maps(q, k, 0.0)[0][0, 0]
    softmax_noise = answer_noise_shares(a1, t.answer, t.context)[1].mean()
    best = min(float((diff_attention_maps(q, k, lam)[2][0, 0].abs() * ~t.answer).sum(-1).mean())
               for lam in torch.linspace(0, 1, 51).tolist())
    assert softmax_noise > 0.5 and best < 0.01


# ---------------------------------------------------------------- plotting


def test_attention_heatmaps_share_one_scale():
    a = torch.softmax(torch.randn(4, 6), -1)
    fig, axes = attention_heatmaps([a, a - 0.5 * a.flip(-1)], ["A", "diff"], outline=torch.eye(4, 6).bool(),
                                   key_marks={"x": torch.arange(6) % 2 == 0})
    images = [ax.get_images()[0] for ax in axes]
    lims = {im.norm.vmin for im in images}, {im.norm.vmax for im in images}
    assert len(lims[0]) == 1 and len(lims[1]) == 1        # one scale for every panel
    assert images[0].norm.vmin == -images[0].norm.vmax    # diverging (a negative entry), centred on 0
    plt.close(fig)
    fig, axes = attention_heatmaps([a], ["A"], vmax=0.1)
    assert axes[0].get_images()[0].norm.vmin == 0.0 and axes[0].get_images()[0].norm.vmax == 0.1
    plt.close(fig)
    with pytest.raises(ValueError, match="titles"):
        attention_heatmaps([a], ["A", "B"])
    with pytest.raises(ValueError, match="2-D"):
        attention_heatmaps([a[0]], ["A"])


def test_curves_share_bars_and_helpers():
    fig, ax = curves([1, 2, 3], {"a": torch.tensor([1.0, 2.0, 3.0]), "b": np.zeros(3)}, logx=True, styles={"b": "--"})
    assert len(ax.get_lines()) == 2
    plt.close(fig)
    with pytest.raises(ValueError, match="shape"):
        curves([1, 2], {"a": [1.0]})
    fig, ax = share_bars({"s": {"answer": 0.4, "noise": 0.6}, "d": {"answer": 0.37, "noise": -0.01}})
    assert len(ax.patches) == 4
    assert {t.get_text() for t in ax.texts} == {"0.40", "0.60", "0.37", "-0.01"}
    plt.close(fig)
    fig, ax = share_bars({"d": {"answer": 0.365, "noise": 0.005}}, value_format="{:.3f}")
    assert [t.get_text() for t in ax.texts] == ["0.365", "0.005"]
    plt.close(fig)
    with pytest.raises(ValueError, match="parts"):
        share_bars({"s": {"answer": 0.4}, "d": {"noise": 0.1}})
    assert symmetric_limit([torch.tensor([[-2.0, 1.0]]), np.array([[0.5]])]) == 2.0
    assert to_numpy(torch.ones(2, requires_grad=True)).dtype == np.float64


def test_show_interactive_saves_readable_text_not_the_widget_repr(monkeypatch):
    import json

    import ipywidgets

    from diffattn_tutorial.course import plotting

    shown, calls = [], []
    monkeypatch.setattr(plotting, "_display", shown.append)

    def draw(a: float = 1.0, b: float = 2.0) -> None:
        calls.append((a, b))

    assert plotting.show_interactive(draw, "sliders a and b (need a running kernel)",
                                     a=ipywidgets.FloatSlider(value=0.5, min=0.0, max=1.0),
                                     b=ipywidgets.FloatSlider(value=3.0, min=0.0, max=5.0)) is None
    assert calls == [(0.5, 3.0)]                           # drawn once at the sliders' values, inside the widget
    (bundle,) = shown
    assert bundle["text/plain"] == "sliders a and b (need a running kernel)"
    assert "model_id" in bundle["application/vnd.jupyter.widget-view+json"]
    assert "interactive(" not in json.dumps(bundle)
