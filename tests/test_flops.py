"""FLOP and byte accounting (diffattn_tutorial.measure.flops): the closed forms the notebooks quote."""

import doctest

import pytest
import torch

import diffattn_tutorial.measure.flops as F


def test_doctests():
    assert doctest.testmod(F).failed == 0


@pytest.mark.parametrize("b,h,n,d", [(1, 8, 1024, 64), (2, 3, 77, 128)])
def test_closed_forms(b, h, n, d):
    assert F.diff_v1_attention_flops(b, h, n, d) == 12 * b * h * n * n * d
    assert F.baseline_attention_flops(b, 2 * h, n, d) == 8 * b * h * n * n * d
    assert F.diff_v2_attention_flops(b, h, n, d) == 8 * b * h * n * n * d
    assert F.formulation_flops("sdpa_split", b, h, n, d) == 16 * b * h * n * n * d
    assert F.formulation_flops("sdpa_stacked", b, h, n, d) == F.formulation_flops("sdpa_split", b, h, n, d)
    assert F.formulation_flops("sdpa_wide", b, h, n, d) == F.diff_v1_attention_flops(b, h, n, d)
    assert F.formulation_flops("naive", b, h, n, d) == 8 * b * h * n * n * d  # (A1 - lam A2) V: one P v
    assert F.diff_v1_attention_flops(b, h, n, d, causal=True) == 6 * b * h * n * n * d
    assert F.diff_v1_attention_flops(b, h, n, d, pass_="fwd_bwd") == 3.5 * 12 * b * h * n * n * d


def test_formulations_match_calls():
    # sdpa_wide = two calls with V of width 2d; sdpa_split = four calls of equal dims
    b, h, n, d = 2, 4, 100, 32
    assert F.formulation_flops("sdpa_wide", b, h, n, d) == 2 * F.attention_call_flops(b, h, n, n, d, 2 * d)
    assert F.formulation_flops("sdpa_split", b, h, n, d) == 4 * F.attention_call_flops(b, h, n, n, d, d)
    assert F.formulation_flops("sdpa_stacked", b, h, n, d) == F.attention_call_flops(b, 4 * h, n, n, d, d)


def test_visible_fraction_matches_mask():
    from diffattn_tutorial.functional import causal_mask

    for nq, nk in [(1, 9), (5, 12), (7, 7)]:
        exact = causal_mask(nq, nk).float().mean().item()
        got = F.visible_fraction(nq, nk, True)
        assert got == (0.5 if nq == nk else pytest.approx(exact))
    assert F.visible_fraction(3, 8, False) == 1.0
    with pytest.raises(ValueError):
        F.visible_fraction(0, 3, True)


def test_bytes():
    assert F.kv_cache_bytes_per_token("diff_v1", 4, 64) == F.kv_cache_bytes_per_token("baseline", 8, 64)
    assert F.kv_cache_bytes_per_token("diff_v2", 4, 64, layers=2, dtype=torch.float32) == 2 * 2 * 4 * 64 * 4
    assert F.decode_kv_bytes_read("diff_v2", 4, 64, 1000) == F.decode_kv_bytes_read("baseline", 4, 64, 1000)
    once = F.decode_kv_bytes_read("naive", 4, 64, 1000)
    assert F.decode_kv_bytes_read("sdpa_wide", 4, 64, 1000) == 1.5 * once
    assert F.decode_kv_bytes_read("sdpa_split", 4, 64, 1000) == 2 * once
    assert F.attention_map_bytes(1, 2, 3, 4, dtype="bfloat16") == 48
    for bad in (lambda: F.dtype_bytes("int7"), lambda: F.pass_factor("both"),
                lambda: F.formulation_flops("flash", 1, 1, 1, 1), lambda: F.kv_cache_bytes_per_token("v3", 1, 1)):
        with pytest.raises(ValueError):
            bad()


def test_matches_torch_flop_counter():
    """torch's own FLOP counter (math kernel: it decomposes into counted matmuls) agrees with every formula."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from diffattn_tutorial.functional import diff_attention, diff_attention_v2, softmax_attention

    b, h, n, d = 2, 2, 24, 8
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(b, 2 * h, n, d, generator=g), torch.randn(b, 2 * h, n, d, generator=g)
    v = torch.randn(b, h, n, 2 * d, generator=g)

    def counted(fn):
        with sdpa_kernel([SDPBackend.MATH]), FlopCounterMode(display=False) as fc:
            fn()
        return fc.get_total_flops()

    for name in ("naive", "chunked", "sdpa_wide", "sdpa_split", "sdpa_stacked"):
        assert counted(lambda: diff_attention(q, k, v, 0.5, backend=name)) == F.formulation_flops(name, b, h, n, d)
    assert counted(lambda: softmax_attention(q, k, k)) == F.baseline_attention_flops(b, 2 * h, n, d)
    assert counted(lambda: diff_attention_v2(q, k[:, :h], k[:, :h], 0.5)) == F.diff_v2_attention_flops(b, h, n, d)
