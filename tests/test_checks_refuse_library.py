"""An exercise answer that calls the library's (or PyTorch's) implementation of what its task builds is refused:
the check fails, naming what the answer called, even though the answer it returns is right.

Each case below is such an answer (right, built on the refused function) for a task whose check passed it before
``refuses=`` named that function. The right answers written by hand pass: tests/test_checks*.py.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange

from diffattn_tutorial import checks, formulations
from diffattn_tutorial.checks import CheckFailed
from diffattn_tutorial.course import toys
from diffattn_tutorial.functional import (
    causal_mask,
    diff_attention_maps,
    expand_kv_groups,
    lambda_init_fn,
    reparam_lambda,
    rms_norm,
    rms_norm_scaled,
)
from diffattn_tutorial.interop import diffllama_order, permute_maps
from diffattn_tutorial.layers.attention import RMSNorm
from diffattn_tutorial.measure.attention_stats import top1_over_median
from diffattn_tutorial.training.distributed import fsdp_local_shard
from diffattn_tutorial.training.model import AttentionProbe, next_token
from diffattn_tutorial.training.study import attention_scores, logit_outliers


def _interleaved(t):
    """DiffLlama's blocked heads (map 1 = heads :H) -> the library's interleaved pairs."""
    return rearrange(t, "b (two h) n d -> b (h two) n d", two=2)


def _groups_then_naive(q, k, v, lam, mask):
    return formulations.naive(q, k, v, lam, mask, q.shape[-1] ** -0.5, 0.0)


def _rms_with(norm):
    """check_rms_norm's signature over a norm of the last dim ``norm(x, eps)``, groups by unflattening."""
    def fn(x, weight=None, eps=1e-5, group=None):
        out = norm(x if group is None else x.unflatten(-1, (-1, group)), eps).reshape(x.shape)
        return out if weight is None else out * weight
    return fn


def _nn_rmsnorm(x, eps):
    return torch.nn.RMSNorm(x.shape[-1], eps=eps, elementwise_affine=False, dtype=x.dtype)(x)


def _forward_by_naive(x, layer):
    """check_forward's answer with the maps from formulations.naive (the layer's other steps by hand)."""
    d, n = layer.head_dim, x.shape[1]
    q = rearrange(layer.q_proj(x), "b n (h d) -> b h n d", d=d)
    k = rearrange(layer.k_proj(x), "b n (h d) -> b h n d", d=d)
    v = rearrange(layer.v_proj(x), "b n (h d) -> b h n d", d=2 * d)
    heads = _groups_then_naive(q, k, v, layer.lambda_full(), causal_mask(n, n)[None, None])
    heads = layer.subln(heads) * (1 - layer.lambda_init)
    return layer.out_proj(rearrange(heads, "b h n e -> b n (h e)"))


def _sdpa_split_bottom_right(q, k, v, lam, *, causal=False):
    nq, nk = q.shape[2], k.shape[2]
    mask = causal_mask(nq, nk)[None, None] if causal and nq != nk else None
    return formulations.sdpa_split(q, k, v, lam, mask, causal and nq == nk, q.shape[-1] ** -0.5, 0.0)


def _axonml_by_reference(q, k, v, lam, attn_mask):
    halves = [rearrange(t, "b h n (two d) -> b (h two) n d", two=2) for t in (q, k)]
    return formulations.naive_reference(*halves, v, lam, attn_mask=attn_mask)


def _four_calls_expanded(q, k, v, lam):
    k, v = expand_kv_groups(k, v, q.shape[1] // 2)
    va, vb = v.chunk(2, dim=-1)

    def sdpa(qi, ki, vi):
        return F.scaled_dot_product_attention(qi, ki, vi, is_causal=True)

    q1, q2, k1, k2 = q[:, 0::2], q[:, 1::2], k[:, 0::2], k[:, 1::2]
    return torch.cat([sdpa(q1, k1, va), sdpa(q1, k1, vb)], -1) - lam * torch.cat([sdpa(q2, k2, va), sdpa(q2, k2, vb)], -1)


CASES = {
    "01 T1 amplifier_output": (checks.check_amplifier_output, "the library's amplifier_output",
                               lambda v_cm, v_d, gain_plus=1.0, gain_minus=1.0: toys.amplifier_output(
                                   v_cm + v_d / 2, v_cm - v_d / 2, gain_plus, gain_minus)),
    "01 T3 cmrr_db": (checks.check_cmrr_db, "the library's cmrr_db",
                      lambda ad, acm: math.inf if acm == 0 else float(toys.cmrr_db(ad, acm))),
    "03 T1 formulations.split_pairs": (checks.check_split_pairs, "the library's formulations.split_pairs",
                                       formulations.split_pairs),
    "03 T2 diff_attention_maps": (checks.check_diff_attn, "the library's diff_attention_maps",
                                  lambda q, k, v, lam: diff_attention_maps(_interleaved(q), _interleaved(k), lam)[2] @ v),
    "03 T2 formulations.naive": (checks.check_diff_attn, "the library's formulations.naive",
                                 lambda q, k, v, lam: _groups_then_naive(_interleaved(q), _interleaved(k), v, lam, None)),
    "04 T1 lambda_init_fn": (checks.check_lambda_init, "the library's lambda_init_fn", lambda_init_fn),
    "04 T2 reparam_lambda": (checks.check_reparam_lambda, "the library's reparam_lambda", reparam_lambda),
    "05 T1 rms_norm": (checks.check_rms_norm, "the library's rms_norm", _rms_with(lambda x, eps: rms_norm(x, None, eps))),
    "05 T1 RMSNorm": (checks.check_rms_norm, "the library's RMSNorm layer",
                      _rms_with(lambda x, eps: RMSNorm(x.shape[-1], eps, affine=False)(x))),
    "05 T1 F.rms_norm": (checks.check_rms_norm, "PyTorch's torch.nn.functional.rms_norm",
                         _rms_with(lambda x, eps: F.rms_norm(x, x.shape[-1:], eps=eps))),
    "05 T1 torch.rms_norm": (checks.check_rms_norm, "PyTorch's torch.rms_norm",
                             _rms_with(lambda x, eps: torch.rms_norm(x, x.shape[-1:], eps=eps))),
    "05 T1 nn.RMSNorm": (checks.check_rms_norm, "PyTorch's torch.nn.RMSNorm", _rms_with(_nn_rmsnorm)),
    "05 T2 rms_norm_scaled": (checks.check_subln, "the library's rms_norm_scaled",
                              lambda x, num_heads, lambda_init, weight=None, eps=1e-5: rms_norm_scaled(
                                  x.unflatten(-1, (num_heads, -1)), weight, eps, 1 - lambda_init).flatten(-2)),
    "06 T2 expand_kv_groups": (checks.check_expand_kv, "the library's expand_kv_groups", expand_kv_groups),
    "06 T3 formulations.naive": (checks.check_forward, "the library's formulations.naive", _forward_by_naive),
    "07 T1 attention_scores": (checks.check_query_shares, "the library's attention_scores",
                               lambda maps, batch: tuple(attention_scores([AttentionProbe(maps, maps)], batch).values())),
    "07 T2 logit_outliers": (checks.check_logit_outlier_ratio, "the library's logit_outliers",
                             lambda logits: logit_outliers([AttentionProbe(lg, lg) for lg in logits])),
    "07 T2 top1_over_median": (checks.check_logit_outlier_ratio, "the library's top1_over_median",
                               lambda logits: top1_over_median(torch.cat([lg[lg.isfinite()] for lg in logits])).item()),
    "08 T1 formulations.sdpa_split": (checks.check_sdpa_split, "the library's formulations.sdpa_split",
                                      _sdpa_split_bottom_right),
    "11 T1 formulations.naive_reference": (checks.check_axonml_fixed, "the library's formulations.naive_reference",
                                           _axonml_by_reference),
    "11 T3 expand_kv_groups": (checks.check_four_calls_gqa, "the library's expand_kv_groups", _four_calls_expanded),
    "11 T3 formulations.sdpa_split": (checks.check_four_calls_gqa, "the library's formulations.sdpa_split",
                                      lambda q, k, v, lam: formulations.sdpa_split(q, k, v, lam, None, True,
                                                                                   q.shape[-1] ** -0.5, 0.0)),
    "11 T4 diffllama_order": (checks.check_diffllama_rows, "the library's diffllama_order",
                              lambda w, maps, head_dim: w.unflatten(0, (maps, head_dim))[diffllama_order(maps)].flatten(0, 1)),
    "11 T4 permute_maps": (checks.check_diffllama_rows, "the library's permute_maps",
                           lambda w, maps, head_dim: permute_maps(
                               w, torch.arange(maps).view(2, -1).t().flatten(), head_dim)),
    "12 T2 fsdp_local_shard": (checks.check_local_shard, "the library's fsdp_local_shard", fsdp_local_shard),
    "13 T3 next_token": (checks.check_sample_next, "the library's next_token",
                         lambda logits, t, k, g: next_token(logits, temperature=t, top_k=k, generator=g)),
}


@pytest.mark.parametrize("case", CASES)
def test_calling_the_library_fails_naming_it(case, capsys):
    check, what, answer = CASES[case]
    with pytest.raises(CheckFailed, match=rf"`{check.function_name}` calls {re.escape(what)}.*: this task asks you "
                                          r"to build that yourself \(rule: "):
        check(answer)
    assert "PASSED" not in capsys.readouterr().out


@pytest.mark.parametrize("case", CASES)
def test_each_answer_is_right_but_for_the_rule(case, capsys):
    """The refusal is the only thing wrong with each answer: without the watch (the check's undecorated body) it
    passes, so the failure above is the rule and not a mistake in the test's answer."""
    check, _, answer = CASES[case]
    check.__wrapped__(answer)
    assert capsys.readouterr().out.startswith("PASSED")
