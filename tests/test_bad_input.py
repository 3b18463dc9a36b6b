"""Inputs a learner's code really produces, on every backend: NaNs, Hugging Face's ``finfo.min`` masks in half
precision, and q/k/v that are strided views (slices of one fused projection, transposed or expanded tensors).

Each gives the ``naive`` answer (computed on contiguous float64 copies) or a ``ValueError``/``TypeError``;
none crashes the process or hides a NaN. The Triton backend runs in Triton's interpreter on a CPU
(``TRITON_INTERPRET=1``, which ``tests/conftest.py`` sets before ``triton`` is imported), on small shapes.
"""

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffattn_tutorial.functional import BACKENDS, FORWARD_ONLY, backend_status, causal_mask, diff_attention

ALL = [*BACKENDS, "auto"]  # "triton" where Triton cannot run here is skipped, saying why (runs_here)
FAST = [b for b in ALL if b != "triton"]  # Triton's interpreter is slow: it gets fewer, smaller cases


@functools.cache
def _triton_status() -> tuple[bool, str]:
    """Whether the Triton backend runs here: asked when a test first needs it, not while pytest imports this file
    (``backend_status`` also builds the C++ kernel)."""
    return backend_status("cpu")["triton"]


def runs_here(backend: str) -> str:
    if backend == "triton" and not _triton_status()[0]:
        pytest.skip(f"Triton unavailable: {_triton_status()[1]}")
    return backend


def reference(q, k, v, lam, *, causal=False, attn_mask=None):
    """The naive backend on contiguous float64 copies."""
    f64 = [t.detach().contiguous().double() for t in (q, k, v)]
    lam = lam.double() if isinstance(lam, torch.Tensor) else lam
    mask = attn_mask.double() if attn_mask is not None and attn_mask.is_floating_point() else attn_mask
    return diff_attention(*f64, lam, causal=causal, attn_mask=mask, backend="naive")


def inputs(B=1, H=2, Hkv=1, Nq=8, Nk=8, d=4, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, 2 * H, Nq, d, generator=g), torch.randn(B, 2 * Hkv, Nk, d, generator=g)
    v = torch.randn(B, Hkv, Nk, 2 * d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


# ---------------------------------------------------------------------------------------------------------
# NaN: it reaches exactly the rows that read it
# ---------------------------------------------------------------------------------------------------------

MASKS = ["none", "bool", "additive"]


def key_mask(kind, nq, nk):
    """A mask that hides key 5 from every row (None for "none")."""
    if kind == "none":
        return None
    allowed = torch.ones(nq, nk, dtype=torch.bool)
    allowed[:, 5] = False
    return allowed if kind == "bool" else torch.zeros(nq, nk).masked_fill(~allowed, float("-inf"))


def rows_reading(q, k, v, mask, causal):
    """Independent of the library: ``(H, Nq)`` True where an output row reads a NaN or an infinity (batch 1,
    H == Hkv)."""
    nq, nk = q.shape[2], k.shape[2]
    visible = torch.ones(nq, nk, dtype=torch.bool)
    if mask is not None:
        visible &= mask if mask.dtype == torch.bool else mask > float("-inf")
    if causal:
        visible &= causal_mask(nq, nk)
    q_nan = ~q[0].isfinite().all(-1).view(-1, 2, nq).all(1)  # (H, Nq): either map's query
    key_nan = ~k[0].isfinite().all(-1).view(-1, 2, nk).all(1) | ~v[0].isfinite().all(-1)  # (H, Nk)
    return q_nan | (visible[None] & key_nan[:, None, :]).any(-1)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask_kind", MASKS)
def test_nan_reaches_exactly_the_rows_that_read_it(backend, where, causal, mask_kind):
    runs_here(backend)
    q, k, v = inputs(H=2, Hkv=2, Nq=8, Nk=8)
    poisoned = {"q": q, "k": k, "v": v}[where]
    poisoned[0, 2 if where != "v" else 1, 3, 1] = float("nan")  # head 1 (map 1 of q/k), position 3
    if where == "k":
        k[0, 0, 5, 0] = float("nan")  # a NaN key that the mask hides (seen only without a mask)
    mask = key_mask(mask_kind, 8, 8)
    out = diff_attention(q, k, v, 0.4, causal=causal, attn_mask=mask, backend=backend)
    expected_nan = rows_reading(q, k, v, mask, causal)
    assert torch.equal(out[0].isnan().any(-1), expected_nan), "NaN rows differ from the rows that read a NaN"
    assert not out[0][~expected_nan].isnan().any(), "a row mixes NaN and numbers"
    clean = [t.nan_to_num(0.0) for t in (q, k, v)]
    ref = reference(*clean, 0.4, causal=causal, attn_mask=mask)[0]
    torch.testing.assert_close(out[0][~expected_nan].double(), ref[~expected_nan], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("value", [float("inf"), float("-inf")])
@pytest.mark.parametrize("mask_kind", ["bool", "additive", "causal"])
def test_an_infinity_makes_exactly_the_rows_that_read_it_nan(backend, value, mask_kind):
    """Masked keys never influence the output, whatever they hold: a hidden key holding +-inf in k and in v
    gave NaN everywhere with auto, cpu_fused and the SDPA forms (naive too, for v). A visible one makes the rows
    that read it NaN (as a NaN does), in every backend alike, and the other rows are the finite answer."""
    runs_here(backend)
    q, k, v = inputs(H=2, Hkv=2, Nq=8, Nk=8)
    k[0, 0, 5, 0] = v[0, 1, 5, 2] = value  # key 5: hidden from every row by the masks, from rows < 5 by causal
    q[0, 3, 6, 1] = value  # head 1 (map 2), row 6
    causal = mask_kind == "causal"
    mask = None if causal else key_mask(mask_kind, 8, 8)
    out = diff_attention(q, k, v, 0.4, causal=causal, attn_mask=mask, backend=backend)
    expected_nan = rows_reading(q, k, v, mask, causal)
    assert torch.equal(out[0].isnan().any(-1), expected_nan), "NaN rows differ from the rows that read an inf"
    assert out[0][~expected_nan].isfinite().all(), "a row mixes NaN and numbers, or holds an inf"
    clean = [t.nan_to_num(0.0, posinf=0.0, neginf=0.0) for t in (q, k, v)]
    ref = reference(*clean, 0.4, causal=causal, attn_mask=mask)[0]
    torch.testing.assert_close(out[0][~expected_nan].double(), ref[~expected_nan], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", FAST)
def test_nan_query_row_under_gqa_and_grad(backend):
    """GQA (two heads per KV group) and autograd: the NaN query row is NaN, the other rows keep finite grads."""
    runs_here(backend)
    q, k, v = inputs(B=2, H=4, Hkv=2, Nq=6, Nk=9)
    q[1, 5, 2, 0] = float("nan")  # batch 1, head 2 (map 2), row 2
    q.requires_grad_(backend not in FORWARD_ONLY)
    out = diff_attention(q, k, v, 0.3, causal=True, backend=backend)
    nan_rows = out.isnan().any(-1)
    assert nan_rows.sum() == 1 and nan_rows[1, 2, 2]
    if backend in FORWARD_ONLY:
        return
    out.nan_to_num(0.0).sum().backward()
    assert q.grad[0].isfinite().all()


@pytest.mark.parametrize("backend", FAST)
def test_a_nan_query_in_a_row_that_causal_masks_fully_gives_zeros(backend):
    """Causal with Nq > Nk: the first Nq - Nk rows see no key, so they are zero even where their query is NaN (a
    fully masked row reads nothing), in every backend alike; cpu_fused, which applies causal itself, made them
    NaN."""
    runs_here(backend)
    q, k, v = inputs(Nq=8, Nk=5)
    q[0, 1, 1, 0] = float("nan")  # row 1: fully masked (row i sees keys j <= i - 3)
    q[0, 2, 6, 0] = float("nan")  # row 6 of head 1: sees keys 0..3, so NaN
    out = diff_attention(q, k, v, 0.3, causal=True, backend=backend)
    expected = torch.zeros(2, 8, dtype=torch.bool)
    expected[1, 6] = True
    assert torch.equal(out[0].isnan().any(-1), expected)
    assert torch.equal(out[0, :, :3], torch.zeros_like(out[0, :, :3]))


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
def test_a_nan_query_in_a_fully_masked_row_gives_zeros_and_zero_gradients_with_grad_too(backend, mask_kind):
    """With q requiring grad, a NaN query in a row the mask hides every key from: the row is still zero and its
    query gets a zero gradient (it reads nothing); a NaN query in a row that sees keys still gets NaN, and a NaN
    gradient to exactly that entry."""
    runs_here(backend)
    q, k, v = inputs(Nq=6, Nk=5)
    allowed = torch.ones(6, 5, dtype=torch.bool)
    allowed[2] = False  # row 2 sees no key
    mask = allowed if mask_kind == "bool" else torch.zeros(6, 5).masked_fill(~allowed, float("-inf"))
    q[0, 0, 2, 1] = float("nan")  # head 0, the hidden row
    q[0, 3, 4, 0] = float("nan")  # head 1 (its second map), a row that sees keys
    q.requires_grad_()
    out = diff_attention(q, k, v, 0.3, attn_mask=mask, backend=backend)
    expected = torch.zeros(2, 6, dtype=torch.bool)
    expected[1, 4] = True
    assert torch.equal(out[0].isnan().any(-1), expected)
    assert torch.equal(out[0, 0, 2], torch.zeros_like(out[0, 0, 2]))
    out.nan_to_num(0.0).sum().backward()
    assert q.grad[0, 0, 2].abs().max() == 0 and q.grad[0, 3, 4, 0].isnan()
    assert q.grad.isnan().sum() == 1


# ---------------------------------------------------------------------------------------------------------
# Hugging Face's finfo(dtype).min masks in float16 and bfloat16
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_finfo_min_mask_in_half_precision(backend, dtype):
    """An additive mask filled with ``finfo(dtype).min`` (one row fully masked) equals the -inf mask."""
    runs_here(backend)
    q, k, v = inputs(B=1, H=2, Hkv=1, Nq=6, Nk=7, d=8, dtype=dtype)
    allowed = causal_mask(6, 7) & (torch.arange(7) != 4)
    allowed[2] = False  # a fully masked row: zeros
    hf = torch.zeros(6, 7, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    out = diff_attention(q, k, v, 0.5, attn_mask=hf, backend=backend)
    ref = reference(q, k, v, 0.5, attn_mask=allowed)
    assert out.dtype == dtype
    assert out[:, :, 2].abs().max() == 0
    err = (out.double() - ref).norm() / ref.norm()
    assert err < 1e-2, f"relative error {err:.2e} in {dtype}"


@pytest.mark.parametrize("backend", ALL)
def test_a_half_precision_finfo_min_mask_stays_masked_with_float32_inputs(backend):
    """A float16 model's mask (``finfo(float16).min = -65504``) given with float32 q, k, v (an upcast model):
    the entries were masked in the mask's own dtype and stay masked, a row of them gives zero (before: -65504 in
    float32 was a number, and that row averaged every value)."""
    runs_here(backend)
    q, k, v = inputs(B=1, H=2, Hkv=1, Nq=6, Nk=7, d=8, dtype=torch.float32)
    allowed = causal_mask(6, 7) & (torch.arange(7) != 4)
    allowed[2] = False
    hf = torch.zeros(6, 7, dtype=torch.float16).masked_fill(~allowed, torch.finfo(torch.float16).min)
    out = diff_attention(q, k, v, 0.5, attn_mask=hf, backend=backend)
    assert out[:, :, 2].abs().max() == 0
    torch.testing.assert_close(out.double(), reference(q, k, v, 0.5, attn_mask=allowed), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# strided inputs: a property test over layouts, every backend
# ---------------------------------------------------------------------------------------------------------

LAYOUTS = ["contiguous", "fused_projection", "transposed", "last_dim_strided", "expanded"]


def layout(t: torch.Tensor, kind: str, other_heads: int) -> torch.Tensor:
    """The same values as ``t (B, heads, N, w)`` in the memory layout ``kind``."""
    B, heads, N, w = t.shape
    if kind == "fused_projection":  # one (B, N, all heads * w) projection, this tensor a slice of it
        fused = torch.randn(B, N, (heads + other_heads) * w)
        fused[..., other_heads * w:] = t.transpose(1, 2).reshape(B, N, heads * w)
        return fused[..., other_heads * w:].unflatten(-1, (heads, w)).transpose(1, 2)
    if kind == "transposed":  # stored (B, N, heads, w)
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if kind == "last_dim_strided":  # stored (B, heads, w, N): the last dim has stride N
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if kind == "expanded":  # one batch row broadcast (stride 0); the values become that row's
        return t[:1].expand(B, heads, N, w)
    return t


def check_layouts(backend, B, H, Hkv, Nq, Nk, d, kinds, causal, seed):
    runs_here(backend)
    q, k, v = inputs(B=B, H=H, Hkv=Hkv, Nq=Nq, Nk=Nk, d=d, seed=seed)
    q, k, v = (layout(t, kind, other) for t, kind, other in zip((q, k, v), kinds, (2 * Hkv, 3 * Hkv, 0)))
    try:
        out = diff_attention(q, k, v, 0.45, causal=causal, backend=backend)
    except (ValueError, TypeError) as e:  # allowed, if it names the fix
        assert "contiguous" in str(e) or "stride" in str(e), f"unclear error for {kinds}: {e}"
        return
    torch.testing.assert_close(out.double(), reference(q, k, v, 0.45, causal=causal), rtol=1e-4, atol=1e-5)


SIZES = st.tuples(st.integers(1, 2), st.sampled_from([(1, 1), (2, 1), (2, 2), (4, 2)]), st.integers(1, 9),
                  st.integers(1, 9), st.sampled_from([2, 4, 8]))
KINDS = st.tuples(*(st.sampled_from(LAYOUTS) for _ in range(3)))


@pytest.mark.parametrize("backend", FAST)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=SIZES, kinds=KINDS, causal=st.booleans(), seed=st.integers(0, 2**16))
def test_strided_inputs_give_the_naive_answer(backend, sizes, kinds, causal, seed):
    B, (H, Hkv), Nq, Nk, d = sizes
    check_layouts(backend, B, H, Hkv, Nq, Nk, d, kinds, causal, seed)


@settings(max_examples=6, deadline=None)
@given(kinds=KINDS, causal=st.booleans(), seed=st.integers(0, 2**16))
def test_strided_inputs_triton(kinds, causal, seed):
    """The fused kernel reads raw pointers with strides: every layout, a small shape (interpreter)."""
    check_layouts("triton", 2, 2, 1, 5, 7, 4, kinds, causal, seed)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("kinds", [("fused_projection",) * 3, ("last_dim_strided",) * 3, ("expanded",) * 3])
def test_every_layout_on_every_backend(backend, kinds):
    """The layouts that crashed the process (strided last dims under the interpreter), each on every backend."""
    check_layouts(backend, 2, 2, 1, 6, 6, 4, kinds, True, 0)


@pytest.mark.parametrize("causal", ["no", "False", None, 2])
def test_causal_that_is_not_a_bool_is_refused(causal):
    """``causal="no"`` is truthy: it used to run a causal attention without a word (a red-team finding)."""
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 16)
    with pytest.raises(TypeError, match=f"causal must be True or False, got {causal!r}"):
        diff_attention(q, k, v, 0.5, causal=causal)
