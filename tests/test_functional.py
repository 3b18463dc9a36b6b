"""diff_attention: every backend gives the same answer on every input it accepts (property tests),
gradients are right (gradcheck), and the pieces (lambda, masks, rms_norm) do what the paper says."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diffattn_tutorial.backends import get_backend
from diffattn_tutorial.functional import (
    BACKENDS,
    FORWARD_ONLY,
    _RMSNormScaled,
    causal_mask,
    diff_attention,
    diff_attention_maps,
    diff_attention_v2,
    dual_lambda,
    expand_kv_groups,
    lambda_init_fn,
    reparam_lambda,
    resolve_backend,
    rms_norm,
    rms_norm_scaled,
    softmax_attention,
)

CPU_BACKENDS = [b for b in BACKENDS if b != "triton"] + ["auto"]
FLOAT32_ONLY = [b for b in BACKENDS if b not in ("sdpa", "auto") and torch.float64 not in get_backend(b).dtypes]
TOL = {torch.float64: (1e-9, 1e-10), torch.float32: (1e-4, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


def reference(q, k, v, lam, causal=False, attn_mask=None):
    """Straight from the paper, one differential head at a time, in float64 (independent of the library)."""
    B, H2, Nq, d = q.shape
    H, Hkv, Nk = H2 // 2, v.shape[1], k.shape[2]
    q, k, v = q.double(), k.double(), v.double()
    lam = torch.as_tensor(lam, dtype=torch.float64).expand(B, H, Nq, 1) if torch.is_tensor(lam) else \
        torch.full((B, H, Nq, 1), float(lam), dtype=torch.float64)
    allowed = torch.ones(B, H, Nq, Nk, dtype=torch.bool)
    if causal:
        for i in range(Nq):
            allowed[:, :, i, max(0, i + (Nk - Nq) + 1):] = False
    additive = torch.zeros(B, H, Nq, Nk, dtype=torch.float64)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed &= attn_mask.expand(B, H, Nq, Nk)
        else:
            additive = additive + attn_mask.double().expand(B, H, Nq, Nk)
            allowed &= (attn_mask > float("-inf")).expand(B, H, Nq, Nk)
    out = torch.zeros(B, H, Nq, 2 * d, dtype=torch.float64)
    for h in range(H):
        g = h // (H // Hkv)
        maps = []
        for m in range(2):
            s = q[:, 2 * h + m] @ k[:, 2 * g + m].transpose(-1, -2) / math.sqrt(d) + additive[:, h]
            maps.append(torch.softmax(s.masked_fill(~allowed[:, h], float("-inf")), -1))
        o = maps[0] @ v[:, g] - lam[:, h] * (maps[1] @ v[:, g])
        out[:, h] = torch.where(allowed[:, h].any(-1, keepdim=True), o, 0.0)
    return out


def make(B, H, Hkv, Nq, Nk, d, dtype=torch.float32, seed=0, lam_kind="scalar", mask_kind=None):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    q, k, v = r(B, 2 * H, Nq, d), r(B, 2 * Hkv, Nk, d), r(B, Hkv, Nk, 2 * d)
    lam = {"scalar": torch.tensor(0.37, dtype=dtype), "head": r(H, 1, 1), "token": r(B, H, Nq, 1)}[lam_kind]
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(B, 1, Nq, Nk, generator=g) > 0.3
    elif mask_kind == "padding":
        mask = torch.ones(B, 1, 1, Nk, dtype=torch.bool)
        mask[0, ..., Nk // 2:] = False
    elif mask_kind == "float":
        mask = (torch.randn(Nq, Nk, generator=g, dtype=torch.float64) * 2).to(dtype)
        mask[0, : Nk // 3] = float("-inf")
    return q, k, v, lam, mask


@settings(max_examples=40, deadline=None)
@given(
    B=st.integers(1, 2), Hkv=st.sampled_from([1, 2]), rep=st.sampled_from([1, 2, 3]),
    Nq=st.integers(1, 13), Nk=st.integers(1, 13), d=st.sampled_from([4, 8, 16]),
    causal=st.booleans(), lam_kind=st.sampled_from(["scalar", "head", "token"]),
    mask_kind=st.sampled_from([None, "bool", "padding", "float"]),
    dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 2**16),
)
def test_all_backends_agree_with_the_paper(B, Hkv, rep, Nq, Nk, d, causal, lam_kind, mask_kind, dtype, seed):
    q, k, v, lam, mask = make(B, Hkv * rep, Hkv, Nq, Nk, d, dtype, seed, lam_kind, mask_kind)
    expected = reference(q, k, v, lam, causal, mask)
    rtol, atol = TOL[dtype]
    for backend in CPU_BACKENDS:
        if backend in FLOAT32_ONLY and dtype == torch.float64:  # computes in float32: refuses, naming the fix
            with pytest.raises(TypeError, match=r"computes in float32\), got float64; for float64 use backend='auto' "
                                                r"or 'naive'"):
                diff_attention(q, k, v, lam, causal=causal, attn_mask=mask, backend=backend)
            continue
        out = diff_attention(q, k, v, lam, causal=causal, attn_mask=mask, backend=backend)
        assert out.dtype == dtype and out.shape == (B, Hkv * rep, Nq, 2 * d)
        assert not out.isnan().any(), backend
        torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=atol, msg=backend)


@settings(max_examples=25, deadline=None)
@given(
    chunk=st.integers(1, 5), rep=st.sampled_from([1, 2]), Nq=st.integers(1, 11), Nk=st.integers(1, 11),
    causal=st.booleans(), lam_kind=st.sampled_from(["scalar", "token"]),
    mask_kind=st.sampled_from([None, "bool", "padding", "float"]), seed=st.integers(0, 2**16),
)
def test_chunked_small_chunks_and_causal_key_skipping(chunk, rep, Nq, Nk, causal, lam_kind, mask_kind, seed):
    """Many chunks per call: slicing of mask, per-token lambda and (causal) the visible keys stays exact."""
    from diffattn_tutorial.formulations import chunked
    from diffattn_tutorial.validation import combine_masks, fix_fully_masked

    q, k, v, lam, mask = make(2, 2 * rep, 2, Nq, Nk, 8, torch.float64, seed, lam_kind, mask_kind)
    lam4 = lam.reshape((1,) * (4 - lam.ndim) + tuple(lam.shape))
    mask4 = None if mask is None else mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
    full, valid = fix_fully_masked(combine_masks(mask4, causal, Nq, Nk, q.device))
    out = chunked(q, k, v, lam4, full, 8 ** -0.5, 0.0, causal=causal, chunk=chunk)
    if valid is not None:
        out = out.masked_fill(~valid, 0.0)
    torch.testing.assert_close(out, reference(q, k, v, lam, causal, mask), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_bfloat16_close_to_float64(backend):
    q, k, v, lam, mask = make(2, 4, 2, 9, 11, 16, torch.bfloat16, seed=3, lam_kind="token", mask_kind="bool")
    out = diff_attention(q, k, v, lam, causal=True, attn_mask=mask, backend=backend)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), reference(q, k, v, lam, True, mask), rtol=5e-2, atol=5e-2)


def test_fully_masked_rows_are_zero_with_zero_grads_everywhere():
    # causal with Nq > Nk: the first Nq - Nk queries see no key at all
    q, k, v, lam, _ = make(1, 2, 1, 6, 3, 8, torch.float64)
    for backend in CPU_BACKENDS:
        dtype = torch.float32 if backend in FLOAT32_ONLY else torch.float64
        qq, kk, vv = (t.to(dtype).clone().requires_grad_() for t in (q, k, v))
        out = diff_attention(qq, kk, vv, lam, causal=True, backend=backend)
        assert out[:, :, :3].abs().max() == 0 and out[:, :, 3:].abs().min() > 0, backend
        out.sum().backward()
        for t in (qq, kk, vv):
            assert torch.isfinite(t.grad).all(), backend
        assert qq.grad[:, :, :3].abs().max() == 0, backend


def test_gradcheck_float64_every_input_and_lambda():
    q, k, v, lam, mask = make(1, 2, 1, 5, 6, 4, torch.float64, lam_kind="token", mask_kind="bool")
    for backend in ["naive", "sdpa_wide", "sdpa_split", "sdpa_stacked", "chunked"]:
        inputs = tuple(t.clone().requires_grad_() for t in (q, k, v, lam))
        f = lambda q_, k_, v_, l_: diff_attention(q_, k_, v_, l_, causal=True, attn_mask=mask, backend=backend)  # noqa: E731
        assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6), backend


def test_lambda_parameters_all_receive_gradients():
    torch.manual_seed(0)
    vecs = [torch.randn(8, dtype=torch.float64, requires_grad=True) * 0.1 for _ in range(4)]
    vecs = [v.detach().requires_grad_() for v in vecs]
    q, k, v, _, _ = make(1, 2, 2, 4, 4, 8, torch.float64)
    f = lambda *p: diff_attention(q, k, v, reparam_lambda(*p, lambda_init_fn(3)), backend="naive")  # noqa: E731
    assert torch.autograd.gradcheck(f, tuple(vecs))
    diff_attention(q, k, v, reparam_lambda(*vecs, 0.5)).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in vecs)


def test_lambda_formulas():
    assert lambda_init_fn(0) == pytest.approx(0.2)
    assert lambda_init_fn(1) == pytest.approx(0.8 - 0.6 * math.exp(-0.3))
    assert lambda_init_fn(100) == pytest.approx(0.8, abs=1e-6)
    lq1, lk1, lq2, lk2 = (torch.full((4,), x) for x in (0.5, 0.5, 0.1, 0.2))
    assert reparam_lambda(lq1, lk1, lq2, lk2, 0.2).item() == pytest.approx(math.exp(1.0) - math.exp(0.08) + 0.2)
    assert dual_lambda(torch.tensor(0.0), torch.tensor(0.0), 0.35).item() == pytest.approx(0.35)
    with pytest.raises(ValueError, match="0-based"):
        lambda_init_fn(-1)
    with pytest.raises(ValueError, match="share one shape"):
        reparam_lambda(lq1, lk1, lq2, torch.zeros(3), 0.2)


def test_rms_norm_normalises_last_dim():
    x = torch.randn(3, 5, 16) * 7
    y = rms_norm(x, eps=0.0)
    torch.testing.assert_close(y.pow(2).mean(-1), torch.ones(3, 5))
    w = torch.randn(16)
    torch.testing.assert_close(rms_norm(x, w, eps=1e-5), torch.nn.functional.rms_norm(x, (16,), w, 1e-5))


def test_causal_mask_is_bottom_right_aligned():
    m = causal_mask(2, 5)
    assert m.tolist() == [[True, True, True, True, False], [True] * 5]
    assert torch.equal(causal_mask(4, 4), torch.ones(4, 4, dtype=torch.bool).tril())


def test_maps_match_output_and_rows_sum_to_one():
    q, k, v, lam, mask = make(2, 2, 1, 7, 9, 8, torch.float64, lam_kind="token", mask_kind="bool")
    a1, a2, d = diff_attention_maps(q, k, lam, causal=True, attn_mask=mask)
    out = diff_attention(q, k, v, lam, causal=True, attn_mask=mask, backend="naive")
    torch.testing.assert_close(d @ v.repeat_interleave(2, dim=1), out)
    rows = a1.sum(-1)
    assert torch.all(((rows - 1).abs() < 1e-12) | (rows == 0))


@pytest.mark.parametrize("backend", ["naive", "sdpa", "auto"])
def test_softmax_attention_matches_sdpa_with_gqa(backend):
    q, k, v = torch.randn(2, 6, 5, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 3)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1))
    torch.testing.assert_close(softmax_attention(q, k, v, backend=backend), ref)
    out = softmax_attention(q, k, v, causal=True, backend=backend)  # bottom-right: last query sees every key
    torch.testing.assert_close(out[:, :, -1], ref[:, :, -1])


def test_v2_pairs_share_their_group():
    q, k, v = torch.randn(1, 8, 5, 8, dtype=torch.float64), torch.randn(1, 2, 5, 8, dtype=torch.float64), \
        torch.randn(1, 2, 5, 8, dtype=torch.float64)
    lam = torch.rand(1, 4, 5, 1, dtype=torch.float64)
    out = diff_attention_v2(q, k, v, lam, causal=True)
    full = softmax_attention(q, k, v, causal=True, backend="naive")  # query head j uses KV head j // 4
    torch.testing.assert_close(out, full[:, 0::2] - lam * full[:, 1::2])
    with pytest.raises(ValueError, match="different GQA groups"):
        diff_attention_v2(torch.randn(1, 6, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), 0.5)


def test_auto_resolves_per_device_and_dropout():
    """auto: the two-call padded formulation on a CPU, the four-call split one elsewhere, sdpa_wide with dropout."""
    assert resolve_backend("auto", "cpu") == "sdpa_padded"
    assert resolve_backend("auto", "cuda") == "sdpa_split"
    assert resolve_backend("sdpa", "cpu") == "sdpa_split"
    assert resolve_backend("auto", "cpu", dropout=True) == resolve_backend("auto", "cuda", dropout=True) == "sdpa_wide"
    with pytest.raises(ValueError, match="does not support attention dropout"):
        resolve_backend("sdpa_padded", "cpu", dropout=True)


@pytest.mark.parametrize("H, Hkv", [(2, 2), (4, 2), (4, 1)])
def test_expand_kv_groups_pairs_both_maps_with_their_group(H, Hkv):
    """Differential head i reads key heads 2g and 2g+1 and value head g, with g = i // (H // Hkv)."""
    k, v = torch.randn(1, 2 * Hkv, 3, 4), torch.randn(1, Hkv, 3, 8)
    k_rep, v_rep = expand_kv_groups(k, v, H)
    assert k_rep.shape == (1, 2 * H, 3, 4) and v_rep.shape == (1, H, 3, 8)
    for i in range(H):
        g = i // (H // Hkv)
        assert torch.equal(k_rep[:, 2 * i], k[:, 2 * g]) and torch.equal(k_rep[:, 2 * i + 1], k[:, 2 * g + 1])
        assert torch.equal(v_rep[:, i], v[:, g])


def test_padded_inference_subtracts_in_place_but_grad_flows():
    """sdpa_padded reuses its first output buffer only without autograd; with it, gradients equal naive's."""
    q, k, v = torch.randn(1, 4, 6, 4), torch.randn(1, 4, 6, 4), torch.randn(1, 2, 6, 8)
    lam = torch.tensor(0.3, requires_grad=True)
    grads = {}
    for backend in ("naive", "sdpa_padded"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        lam.grad = None
        diff_attention(*leaves, lam, causal=True, backend=backend).square().sum().backward()
        grads[backend] = [t.grad for t in leaves] + [lam.grad]
    for a, b in zip(grads["naive"], grads["sdpa_padded"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# a learned additive mask, and empty problems (issue 24, item 4 b and d)
# ---------------------------------------------------------------------------------------------------------

GRAD_BACKENDS = [b for b in CPU_BACKENDS if b in ("auto", "sdpa") or get_backend(b).mask_grad]


@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_a_learned_additive_mask_gets_its_gradient(backend):
    """A mask that requires grad (a learned bias) must make the call differentiable: ``auto`` picked the
    forward-only fused kernel for float32 and the gradient was lost."""
    q, k, v, lam, _ = make(2, 2, 1, 5, 7, 8, lam_kind="token")
    bias = torch.randn(1, 2, 5, 7, generator=torch.Generator().manual_seed(1)).requires_grad_()
    out = diff_attention(q, k, v, lam, attn_mask=bias, backend=backend)
    assert out.requires_grad
    g = torch.randn_like(out)
    (grad,) = torch.autograd.grad((out * g).sum(), bias)
    bias64 = bias.detach().double().requires_grad_()
    (expected,) = torch.autograd.grad((reference(q, k, v, lam, attn_mask=bias64) * g.double()).sum(), bias64)
    torch.testing.assert_close(grad.double(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["cpu_fused", "triton"])
def test_backends_that_give_a_mask_no_gradient_refuse_a_learned_one(backend):
    q, k, v, lam, _ = make(1, 2, 1, 4, 4, 32)
    bias = torch.zeros(4, 4, requires_grad=True)
    with pytest.raises(ValueError, match=f"attn_mask requires grad .* backend '{backend}' gives a mask no gradient; "
                                         r"use backend='auto', 'sdpa_padded' or 'naive' .* attn_mask\.detach\(\)"):
        diff_attention(q, k, v, lam, attn_mask=bias, backend=backend)


EMPTY = {  # (B, H, Hkv, Nq, Nk)
    "Nq = 0": (2, 2, 1, 0, 5),
    "Nk = 0": (2, 2, 1, 4, 0),
    "B = 0": (0, 2, 1, 4, 5),
    "H = 0": (1, 0, 1, 4, 5),
}


@pytest.mark.parametrize("backend", BACKENDS + ("auto",))
@pytest.mark.parametrize("case", EMPTY)
@pytest.mark.parametrize("causal", [False, True])
def test_empty_problems_give_an_empty_output_or_zeros(backend, case, causal):
    """Nq = 0 raised in chunked; every backend now gives the (B, H, Nq, 2d) output, zeros where Nk = 0 (no key
    to attend to, as a fully masked row), with gradients (zero) where the backend has autograd."""
    B, H, Hkv, Nq, Nk = EMPTY[case]
    q, k, v, lam, _ = make(B, H, Hkv, Nq, Nk, 8)
    mask = torch.ones(Nq, Nk, dtype=torch.bool)
    grad = backend not in FORWARD_ONLY
    q.requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        for attn_mask in (None, mask):
            out = diff_attention(q, k, v, lam, causal=causal, attn_mask=attn_mask, backend=backend)
            assert out.shape == (B, H, Nq, 16) and out.dtype == q.dtype
            assert not out.any()
    if grad:
        (dq,) = torch.autograd.grad(out.sum(), q, allow_unused=True)
        assert dq is None or not dq.any()


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("layout", ["contiguous", "heads_transposed"])
def test_rms_norm_scaled_forward_bits_and_backward_equal_the_formula(affine, layout):
    """The layers' sub-norm in training: the formula's forward bits in the input's layout, and gradients of x and
    the weight equal autograd's of the formula (float64), a zero row (a fully masked one) and a NaN row included."""
    torch.manual_seed(0)
    x = (torch.randn(2, 5, 3, 16) * 3).transpose(1, 2)  # (B, H, N, D) over (B, N, H, D) memory: the kernel's output
    x = x if layout == "heads_transposed" else x.contiguous()
    x[0, 1, 2] = 0.0
    x[1, 2, 4] = float("nan")
    w = (torch.rand(16) + 0.5) if affine else None
    g = torch.randn(x.shape)

    def run(fn, dtype):
        xs = x.to(dtype).clone().requires_grad_()  # clone: a leaf of its own, in x's layout
        ws = w.to(dtype).clone().requires_grad_() if affine else None
        y = fn(xs, ws)
        y.backward(g.to(dtype))
        return y, xs.grad, ws.grad if affine else None

    fast = run(lambda a, b: rms_norm_scaled(a, b, 1e-5, 0.35), torch.float32)
    formula = run(lambda a, b: rms_norm(a, b, 1e-5) * 0.35, torch.float32)
    exact = run(lambda a, b: rms_norm(a, b, 1e-5) * 0.35, torch.float64)
    assert torch.equal(fast[0].nan_to_num(7.0), formula[0].nan_to_num(7.0)) and fast[0].stride() == x.stride()
    assert fast[1][1, 2, 4].isnan().all() and fast[1][0, 1, 2].isfinite().all()
    fine = torch.ones(x.shape[:-1], dtype=torch.bool)
    fine[1, 2, 4] = False
    torch.testing.assert_close(fast[1][fine], exact[1][fine].float(), rtol=1e-5, atol=1e-5)
    if affine:  # the NaN row reaches every entry of the weight's gradient, in both
        assert fast[2].isnan().all() and exact[2].isnan().all()


def test_rms_norm_scaled_second_derivatives_and_weight_gradient_are_exact():
    """gradcheck and gradgradcheck in float64 (a gradient penalty differentiates the backward), and the weight's
    gradient where no row is NaN."""
    torch.manual_seed(1)
    x = torch.randn(2, 3, 4, 6, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(6, dtype=torch.float64) + 0.5).requires_grad_()
    f = lambda a, b: _RMSNormScaled.apply(a, b, 1e-5, 0.35)  # noqa: E731 (float64: the Function itself)
    assert torch.autograd.gradcheck(f, (x, w)) and torch.autograd.gradgradcheck(f, (x, w))


def test_rms_norm_scaled_takes_a_single_row():
    """A 1-D x (one row, as ``rms_norm`` takes it): the weight's gradient is that row's, not summed to a scalar."""
    torch.manual_seed(2)
    x = torch.randn(6, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(6, dtype=torch.float64) + 0.5).requires_grad_()
    f = lambda a, b: _RMSNormScaled.apply(a, b, 1e-5, 0.35)  # noqa: E731 (float64: the Function itself)
    assert torch.autograd.gradcheck(f, (x, w)) and torch.autograd.gradgradcheck(f, (x, w))
    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    rms_norm_scaled(xf, wf, 1e-5, 0.35).backward(torch.ones(6))
    (rms_norm(x, w, 1e-5) * 0.35).backward(torch.ones(6, dtype=torch.float64))
    torch.testing.assert_close(xf.grad.double(), x.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(wf.grad.double(), w.grad, rtol=1e-5, atol=1e-6)


def test_rms_norm_scaled_other_dtypes_and_bad_weight():
    """bfloat16 runs the formula itself (the same output); a weight of the wrong size is refused by name."""
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    assert torch.equal(rms_norm_scaled(x, None, 1e-5, 0.5), rms_norm(x, None, 1e-5) * 0.5)
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm_scaled(torch.randn(3, 8), torch.ones(4), 1e-5, 0.5)
