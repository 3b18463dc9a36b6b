"""backend="triton": the fused differential flash-attention kernel equals the naive backend, forward and
backward (dq, dk, dv, dlambda), on ragged lengths, causal and not, Nq != Nk, GQA/MQA, every lambda form,
masks and fully masked rows.

On a CPU the kernels run in Triton's interpreter: ``TRITON_INTERPRET=1`` must be in the environment
before ``triton`` is first imported (Triton decorates its own library functions at import), which
``tests/conftest.py`` sets for the whole session. With a CUDA GPU the same kernels are compiled, and the
GPU-only tests at the end check float16/bfloat16 at realistic head dims (the library's plans: both maps per
forward program at d = 64, split maps at d = 128) against a float64 reference by norm-relative error.

Every buffer the kernels write is filled with NaN first (``DIFFATTN_TRITON_POISON=1``), so a tile no program
writes fails the test instead of reading as 0. On a GPU the kernels run with their pinned configuration
(``DIFFATTN_TRITON_AUTOTUNE=0``: no autotuning, the suite finishes in minutes), except the test of the
configurations the autotuner picks at N = 8192. Set ``DIFFATTN_TRITON_AUTOTUNE=1`` to autotune everywhere.
"""

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
pytest.importorskip("triton")

from diffattn_tutorial.functional import causal_mask, check_diff_inputs, diff_attention  # noqa: E402
from diffattn_tutorial.kernels.triton.configs import train_head_dim_limit  # noqa: E402
from diffattn_tutorial.kernels.triton.flags import MAPS_1, MAPS_2  # noqa: E402
from diffattn_tutorial.kernels.triton.flash_diff import (  # noqa: E402
    capture_launches,
    tile_schedule,
    triton_available,
    triton_diff_attention,
)
from diffattn_tutorial.layers.attention import MultiheadDiffAttn  # noqa: E402
from diffattn_tutorial.measure import gpu as gpu_bench  # noqa: E402

pytestmark = pytest.mark.slow  # runs the kernels in Triton's interpreter (about 90 s)


@pytest.fixture(autouse=True, scope="module")
def _kernels_run_here():
    """Loud, not skipped: a silently skipped kernel test would hide a broken CI set-up."""
    ok, why = triton_available()
    if not ok:
        pytest.fail(f"the Triton kernels cannot run in this test session: {why}", pytrace=False)


@pytest.fixture(autouse=True)
def _poisoned_and_pinned(monkeypatch):
    """NaN-filled buffers and the pinned configuration for every test here, unless the environment already says
    otherwise (``DIFFATTN_TRITON_AUTOTUNE=1`` autotunes everywhere); undone after each test."""
    for name, value in (("DIFFATTN_TRITON_POISON", "1"), ("DIFFATTN_TRITON_AUTOTUNE", "0")):
        if name not in os.environ:
            monkeypatch.setenv(name, value)


DEVICE = "cuda" if CUDA else "cpu"
CAPABILITY = 10 * torch.cuda.get_device_capability()[0] + torch.cuda.get_device_capability()[1] if CUDA else 90
HALF = gpu_bench.preferred_half_dtype(DEVICE) if CUDA else torch.bfloat16
"""The GPU's 16-bit dtype (bf16; fp16 below compute capability 8.0, e.g. a T4); bf16 in the interpreter."""


def unsupported_here(dtype, d, grad=True):
    """Why the kernels do not run ``dtype`` / head dim ``d`` (with a backward when ``grad``) on this GPU, or None:
    no bf16 below sm_80, no backward past ``train_head_dim_limit`` (d = 64 on a T4)."""
    if dtype == torch.bfloat16 and CAPABILITY < 80:
        return f"this GPU (compute capability {CAPABILITY / 10:.1f}) has no bfloat16; the float16 cases run"
    if grad and d > train_head_dim_limit(CAPABILITY):
        return f"the kernels train up to d = {train_head_dim_limit(CAPABILITY)} on this GPU"
    return None


def make(B, H, Hkv, Nq, Nk, d, *, dtype=torch.float32, lam_kind="scalar", seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    q, k, v = r(B, 2 * H, Nq, d), r(B, 2 * Hkv, Nk, d), r(B, Hkv, Nk, 2 * d)
    lam = {
        "scalar": lambda: torch.tensor(0.37, device=device, dtype=dtype),
        "head": lambda: 0.2 + 0.5 * torch.rand(H, 1, 1, generator=g).to(device=device, dtype=dtype),
        "batch_head": lambda: torch.rand(B, H, 1, 1, generator=g).to(device=device, dtype=dtype),
        "token": lambda: torch.rand(B, H, Nq, 1, generator=g).to(device=device, dtype=dtype),
    }[lam_kind]()
    return q, k, v, lam


def run(backend, q, k, v, lam, g, **kw):
    """Output and the gradients of ``(out * g).sum()`` with respect to q, k, v and lam."""
    ins = [t.detach().clone().requires_grad_() for t in (q, k, v, lam)]
    out = diff_attention(*ins, backend=backend, **kw)
    grads = torch.autograd.grad((out * g).sum(), ins)
    return out.detach(), grads


def assert_matches_naive(q, k, v, lam, *, rtol=1e-4, atol=5e-5, **kw):
    ref_out = diff_attention(q, k, v, lam, backend="naive", **kw)
    g = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(7)).to(ref_out)
    out, grads = run("triton", q, k, v, lam, g, **kw)
    ref_out, ref_grads = run("naive", q, k, v, lam, g, **kw)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref_out, rtol=rtol, atol=atol, msg="forward")
    for name, a, b in zip(("dq", "dk", "dv", "dlam"), grads, ref_grads):
        assert a.shape == b.shape, name
        assert not a.isnan().any(), name
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=name)


CASES = [  # B, H, Hkv, Nq, Nk, d, causal, lambda
    (1, 1, 1, 16, 16, 16, False, "scalar"),  # exactly one tile
    (2, 2, 1, 37, 50, 24, False, "token"),  # ragged edges, Nq < Nk, MQA, d not a power of two
    (1, 2, 2, 37, 37, 16, True, "scalar"),  # causal, ragged, square
    (1, 4, 2, 50, 21, 16, True, "token"),  # causal with Nq > Nk: the first 29 rows see no key
    (1, 2, 1, 21, 50, 32, True, "head"),  # causal with a longer key cache, per-head lambda
    (1, 1, 1, 1, 45, 8, True, "token"),  # one decoding query, d < 16 (padded)
    (2, 4, 1, 33, 33, 16, False, "batch_head"),  # GQA 4:1, lambda per batch and head
]


@pytest.mark.parametrize("B,H,Hkv,Nq,Nk,d,causal,lam_kind", CASES)
def test_forward_and_gradients_match_naive(B, H, Hkv, Nq, Nk, d, causal, lam_kind):
    q, k, v, lam = make(B, H, Hkv, Nq, Nk, d, lam_kind=lam_kind, seed=Nq + Nk)
    assert_matches_naive(q, k, v, lam, causal=causal)


@pytest.mark.parametrize("blocks", [(32, 16), (16, 32)])
def test_block_shapes_do_not_change_the_answer(blocks):
    q, k, v, lam = make(1, 2, 1, 45, 39, 16, lam_kind="token", seed=3)
    ref = diff_attention(q, k, v, lam, causal=True, backend="naive")
    out = triton_diff_attention(q, k, v, lam.reshape(1, 2, 45, 1), causal=True, blocks=blocks)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=5e-5)


def test_bool_padding_mask_and_fully_masked_rows():
    B, H, N, d = 2, 2, 29, 16
    q, k, v, lam = make(B, H, H, N, N, d, lam_kind="token", seed=11)
    mask = torch.ones(B, 1, N, N, dtype=torch.bool, device=DEVICE)
    mask[0, ..., 20:] = False  # padded keys
    mask[1, 0, 5] = False  # a query that may attend to nothing
    assert_matches_naive(q, k, v, lam, attn_mask=mask)
    out = diff_attention(q, k, v, lam, attn_mask=mask, backend="triton")
    assert out[1, :, 5].abs().max() == 0


def test_additive_mask_with_causal():
    q, k, v, lam = make(1, 2, 1, 27, 31, 16, seed=12)
    mask = torch.randn(27, 31, generator=torch.Generator().manual_seed(0)).to(DEVICE) * 2
    mask[3] = float("-inf")  # a fully masked row, through the additive mask
    assert_matches_naive(q, k, v, lam, causal=True, attn_mask=mask)


def test_fully_masked_rows_give_zero_output_and_zero_gradients():
    q, k, v, lam = make(1, 2, 1, 40, 8, 16, lam_kind="token", seed=5)
    g = torch.ones(1, 2, 40, 32, device=DEVICE)
    out, (dq, dk, dv, dlam) = run("triton", q, k, v, lam, g, causal=True)
    hidden = 40 - 8  # with Nq > Nk, queries 0..31 see no key (bottom-right alignment)
    assert out[:, :, :hidden].abs().max() == 0
    assert dq[:, :, :hidden].abs().max() == 0 and dlam[:, :, :hidden].abs().max() == 0
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()


def test_non_contiguous_inputs():
    """q, k, v as views of (B, N, heads, d) projections, the layout the modules produce."""
    q = torch.randn(2, 19, 4, 16, device=DEVICE).transpose(1, 2)
    k = torch.randn(2, 23, 2, 16, device=DEVICE).transpose(1, 2)
    v = torch.randn(2, 23, 1, 32, device=DEVICE).transpose(1, 2)
    assert not q.is_contiguous()
    assert_matches_naive(q, k, v, torch.tensor(0.3, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_as_close_to_float32_as_naive(dtype):
    """In 16-bit the kernel accumulates in float32: no further from the float32 answer than naive."""
    if unsupported_here(dtype, 32, grad=False):
        pytest.skip(unsupported_here(dtype, 32, grad=False))
    q, k, v, lam = make(1, 2, 1, 40, 40, 32, dtype=dtype, lam_kind="token", seed=2)
    exact = diff_attention(q.float(), k.float(), v.float(), lam.float(), causal=True, backend="naive")
    err = (diff_attention(q, k, v, lam, causal=True, backend="triton").float() - exact).abs().max()
    err_naive = (diff_attention(q, k, v, lam, causal=True, backend="naive").float() - exact).abs().max()
    assert err <= 2 * err_naive + 1e-3, (err, err_naive)


def test_module_trains_with_the_triton_backend():
    """One SGD step of MultiheadDiffAttn (GQA, paper lambda): every parameter's gradient equals naive's."""
    torch.manual_seed(0)
    mods = {b: MultiheadDiffAttn(64, 4, num_kv_heads=2, depth=2, backend=b).to(DEVICE) for b in ("naive", "triton")}
    mods["triton"].load_state_dict(mods["naive"].state_dict())
    x = torch.randn(2, 21, 64, device=DEVICE)
    grads = {}
    for b, m in mods.items():
        m(x, causal=True).pow(2).sum().backward()
        grads[b] = {n: p.grad for n, p in m.named_parameters()}
    for name, g in grads["naive"].items():
        torch.testing.assert_close(grads["triton"][name], g, rtol=1e-4, atol=1e-5, msg=name)


def test_clear_errors():
    q, k, v, lam = make(1, 1, 1, 8, 8, 16)
    with pytest.raises(TypeError, match="naive"):
        diff_attention(q.double(), k.double(), v.double(), 0.5, backend="triton")
    with pytest.raises(ValueError, match="head dims up to 128"):
        big = make(1, 1, 1, 4, 4, 160)
        diff_attention(*big, backend="triton")
    with pytest.raises(ValueError, match="powers of two"):
        triton_diff_attention(q, k, v, lam, blocks=(24, 16))
    with pytest.raises(ValueError, match="dropout"):
        diff_attention(q, k, v, lam, dropout_p=0.1, backend="triton")


@pytest.mark.parametrize("nq,nk,bm,bn", [(37, 37, 16, 16), (50, 21, 16, 32), (21, 50, 32, 16), (1, 45, 16, 16),
                                         (64, 64, 16, 16), (100, 130, 64, 32)])
@pytest.mark.parametrize("causal", [False, True])
def test_tile_schedule_covers_every_visible_pair_and_masks_only_where_needed(nq, nk, bm, bn, causal):
    sched = tile_schedule(nq, nk, bm, bn, causal)
    visible = causal_mask(nq, nk) if causal else torch.ones(nq, nk, dtype=torch.bool)
    for t in range(sched.shape[0]):
        for u in range(sched.shape[1]):
            block = visible[t * bm:(t + 1) * bm, u * bn:(u + 1) * bn]
            if block.any():
                assert sched[t, u] >= 1, (t, u)  # a tile with a visible pair is never skipped
            if sched[t, u] == 2:  # unmasked: the whole tile lies inside nk and below the diagonal
                assert (u + 1) * bn <= nk and block.all(), (t, u)
    if causal and nq == nk and nq >= 4 * bm and bm == bn:
        assert (sched == 0).sum() > 0  # tiles above the diagonal are skipped


def test_triton_available_explains_itself():
    ok, why = triton_available()
    assert ok and ("interpreter" in why if not CUDA else "compiled" in why)


# ------------------------------------------------------------------------------------------------
# plans, masks in the Hugging Face convention, strides, NaN, switches (interpreter on a CPU)
# ------------------------------------------------------------------------------------------------


def run_plan(plan, q, k, v, lam, g, **kw):
    """``run`` through ``triton_diff_attention`` with an explicit plan (inputs validated as diff_attention does)."""
    lam_t, mask, _ = check_diff_inputs(q, k, v, lam, kw.pop("attn_mask", None))
    ins = [t.detach().clone().requires_grad_() for t in (q, k, v, lam_t)]
    out = triton_diff_attention(*ins, attn_mask=mask, plan=plan, **kw)
    return out.detach(), torch.autograd.grad((out * g).sum(), ins)


PLAN_CASES = [  # B, H, Hkv, Nq, Nk, d, causal, lambda, mask
    (2, 2, 1, 37, 50, 24, False, "token", None),  # ragged, MQA, d padded to 32 (the o2 halves)
    (1, 4, 2, 50, 21, 16, True, "scalar", None),  # causal with Nq > Nk
    (1, 4, 1, 29, 29, 16, True, "batch_head", "bool"),  # GQA 4:1, a bool mask and causal
]


@pytest.mark.parametrize("plan", ["fused", "split_kv", "split", "split_kv_atomic", "split_atomic"])
@pytest.mark.parametrize("B,H,Hkv,Nq,Nk,d,causal,lam_kind,mask_kind", PLAN_CASES)
def test_both_plans_match_naive(plan, B, H, Hkv, Nq, Nk, d, causal, lam_kind, mask_kind):
    """Every plan gives naive's answer: fused (d <= 32), dV and dK apart (d = 64), one map per program (d = 128),
    and the atomic twins of the last two (dQ added by the dK programs: every key tile adds to the same dQ rows,
    so GQA, a causal Nq > Nk and ragged tiles are where a lost or doubled share would show)."""
    q, k, v, lam = make(B, H, Hkv, Nq, Nk, d, lam_kind=lam_kind, seed=Nq * Nk)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(B, 1, Nq, Nk, generator=torch.Generator().manual_seed(1)).to(DEVICE) > 0.3
    g = torch.randn(B, H, Nq, 2 * d, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    out, grads = run_plan(plan, q, k, v, lam, g, causal=causal, attn_mask=mask)
    ref_out, ref_grads = run("naive", q, k, v, lam, g, causal=causal, attn_mask=mask)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=5e-5, msg="forward")
    for name, a, b in zip(("dq", "dk", "dv", "dlam"), grads, ref_grads):
        torch.testing.assert_close(a.reshape(b.shape), b, rtol=1e-4, atol=5e-5, msg=name)


def test_the_fused_atomic_plan_matches_naive_where_it_runs_and_refuses_the_rest_with_the_fix():
    """``fused_atomic`` (dV, dK and dQ from one launch) gives naive's answer for training calls neither causal nor
    masked (MQA with ragged tiles and a per-token lambda; GQA with Nq < Nk), also where only some inputs need a
    gradient (only v: the launch runs for dV alone; only q), and refuses causal and masked training calls (bool
    or additive) naming the plans that run them; without a backward (inference) it runs them."""
    for B, H, Hkv, Nq, Nk, d, lam_kind in ((2, 2, 1, 37, 50, 24, "token"), (1, 4, 2, 21, 40, 16, "batch_head")):
        q, k, v, lam = make(B, H, Hkv, Nq, Nk, d, lam_kind=lam_kind, seed=Nq * Nk)
        g = torch.randn(B, H, Nq, 2 * d, generator=torch.Generator().manual_seed(2)).to(DEVICE)
        out, grads = run_plan("fused_atomic", q, k, v, lam, g)
        ref_out, ref_grads = run("naive", q, k, v, lam, g)
        torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=5e-5, msg="forward")
        for name, a, b in zip(("dq", "dk", "dv", "dlam"), grads, ref_grads):
            torch.testing.assert_close(a.reshape(b.shape), b, rtol=1e-4, atol=5e-5, msg=name)
        for only in (2, 0):  # only v, only q requires grad
            ins = [t.detach().clone().requires_grad_(i == only) for i, t in enumerate((q, k, v, lam))]
            grad, = torch.autograd.grad((triton_diff_attention(*ins, plan="fused_atomic") * g).sum(), ins[only])
            torch.testing.assert_close(grad.reshape(ref_grads[only].shape), ref_grads[only], rtol=1e-4, atol=5e-5)
    q, k, v, lam = make(1, 2, 1, 8, 8, 16, seed=1)
    masks = ({"causal": True}, {"attn_mask": torch.zeros(1, 1, 8, 8, device=DEVICE)},
             {"attn_mask": torch.ones(1, 1, 8, 8, dtype=torch.bool, device=DEVICE)})
    for kw in masks:
        with pytest.raises(ValueError, match="plan='split_kv_atomic' or 'fused'"):
            triton_diff_attention(q, k, v, lam.requires_grad_(), plan="fused_atomic", **kw)
        with torch.no_grad():
            torch.testing.assert_close(triton_diff_attention(q, k, v, lam, plan="fused_atomic", **kw),
                                       triton_diff_attention(q, k, v, lam, plan="fused", **kw))


def test_the_operators_called_directly_refuse_what_the_public_call_refuses(monkeypatch):
    """``torch.ops.diffattn.triton_forward`` and ``triton_backward`` are public entry points: called directly they
    refuse what :func:`triton_diff_attention` refuses, by the same check and words: a plan's refused training calls
    (``fused_atomic`` causal), an atomic plan in deterministic mode (its dQ sums in the programs' order), bfloat16
    where the GPU has no bf16 arithmetic (a T4's compute capability, 7.5). What they run still runs."""
    forward, backward = torch.ops.diffattn.triton_forward, torch.ops.diffattn.triton_backward
    q, k, v, lam = make(1, 2, 1, 8, 8, 16, seed=1)
    scale = 16 ** -0.5
    with pytest.raises(ValueError, match="plan='fused_atomic': it trains calls neither causal nor masked"):
        forward(q, k, v, lam, None, True, scale, [], "fused_atomic", True)
    out, o2, lse, flag = forward(q, k, v, lam, None, True, scale, [], "fused_atomic", False)  # inference runs it
    torch.testing.assert_close(out, diff_attention(q, k, v, lam, causal=True, backend="naive"), rtol=1e-4, atol=5e-5)
    out, o2, lse, flag = forward(q, k, v, lam, None, False, scale, [], "split_kv_atomic", True)
    torch.use_deterministic_algorithms(True)
    try:
        for call in (lambda: forward(q, k, v, lam, None, False, scale, [], "split_kv_atomic", True),
                     lambda: backward(torch.ones_like(out), q, k, v, lam, None, out, o2, lse, flag, False, scale, [],
                                      "split_kv_atomic", [True, True, True])):
            with pytest.raises(RuntimeError, match="use plan='auto'"):
                call()
    finally:
        torch.use_deterministic_algorithms(False)
    from diffattn_tutorial.kernels.triton import launch
    monkeypatch.setattr(launch, "capability", lambda device: 75)
    with pytest.raises(TypeError, match=r"compute capability 7\.5\) has no bfloat16 arithmetic"):
        forward(*(t.bfloat16() for t in (q, k, v, lam)), None, False, scale, [], "split", False)


def test_a_plan_chosen_by_name_runs_on_a_gpu_only_where_the_tables_list_each_of_its_launches():
    """On a GPU (the launches captured as on sm_90a, sm_80 and sm_75) a plan chosen by name whose launch has no table
    entry at the call's head dim is refused, naming the fix: ``fused`` at d = 128 (both maps' dK/dV in one launch),
    ``split`` training at d = 64 (its one-map launches). It ran a fallback tile no compile fact checks before.
    ``plan="auto"`` has an entry for every launch on every target, with and without masks, causal or not."""
    def call(d, plan, capability, train=True, dtype=torch.bfloat16, **kw):
        q, k, v, lam = make(1, 2, 1, 8, 8, d, dtype=dtype, seed=1)
        with capture_launches(capability) as captured:
            out = triton_diff_attention(*(t.requires_grad_(train) for t in (q, k, v, lam)), plan=plan, **kw)
            if train:
                out.sum().backward()
        return [x.name for x in captured]

    for d, plan in ((128, "fused"), (64, "split")):
        with pytest.raises(ValueError, match="has no table entry .* use plan='auto', or blocks="):
            call(d, plan, 90)
    assert "_diff_attn_bwd_dq" in call(64, "fused", 90) and "_diff_attn_bwd_dq" in call(64, "split_kv", 90)
    q, k, v, lam = make(1, 2, 1, 8, 8, 128, dtype=torch.bfloat16, seed=1)
    with capture_launches(90, untabled=True) as captured:  # the compile facts' lessons: recorded, no configuration
        triton_diff_attention(q, k, v, lam, plan="fused")
    assert [(x.name, x.configs) for x in captured if x.name == "_diff_attn_fwd"] == [("_diff_attn_fwd", [])] * 2
    mask = torch.zeros(8, 8, device=DEVICE)
    for capability, dtype in ((90, torch.bfloat16), (80, torch.bfloat16), (75, torch.float16)):
        for d in (16, 32, 64, 128):
            for kw in ({}, {"causal": True}, {"attn_mask": mask}, {"attn_mask": mask < 0}):
                train = d <= train_head_dim_limit(capability)
                assert call(d, "auto", capability, train=train, dtype=dtype, **kw), (capability, d, kw)


def test_finfo_min_additive_mask_counts_as_masked():
    """Hugging Face fills masks with torch.finfo(dtype).min: such entries are masked, and a row of them is a
    fully masked row (zeros, zero gradients) in every backend, as with -inf."""
    q, k, v, lam = make(2, 2, 1, 23, 30, 16, lam_kind="token", seed=21)
    low = torch.finfo(torch.float32).min
    mask = torch.zeros(2, 1, 23, 30, device=DEVICE)
    mask[0, :, :, 20:] = low  # padded keys
    mask[1, :, 4] = low  # a query that may attend to nothing
    assert_matches_naive(q, k, v, lam, attn_mask=mask)
    for backend in ("triton", "naive", "sdpa_split"):
        out = diff_attention(q, k, v, lam, attn_mask=mask, backend=backend)
        assert out[1, :, 4].abs().max() == 0, backend
        masked = diff_attention(q, k, v, lam, attn_mask=mask.masked_fill(mask == low, float("-inf")), backend=backend)
        torch.testing.assert_close(out, masked, rtol=1e-5, atol=1e-6, msg=backend)


def test_slices_of_a_fused_qkv_projection():
    """q, k, v cut from one fused projection (last dim strided, as unflatten(-1, (heads, d, 3))[..., i] gives)
    are copied once and computed right, forward and backward."""
    B, N, H, d = 2, 21, 2, 16
    qkv = torch.randn(B, N, 2 * H * d * 3, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    q = qkv.view(B, N, 2 * H, d, 3)[..., 0].transpose(1, 2)
    k = qkv.view(B, N, 2 * H, d, 3)[..., 1].transpose(1, 2)
    v = qkv.view(B, N, H, 2 * d, 3)[..., 2].transpose(1, 2)
    assert q.stride(-1) == 3 and v.stride(-1) == 3
    assert_matches_naive(q, k, v, torch.tensor(0.4, device=DEVICE), causal=True)


def test_nan_is_never_hidden():
    q, k, v, lam = make(1, 2, 1, 20, 20, 16, seed=8)
    q[0, 0, 3, 5] = float("nan")  # one query row of map 1, head 0
    out = diff_attention(q, k, v, lam, backend="triton")
    assert out[0, 0, 3].isnan().all() and not out[0, 0, :3].isnan().any() and not out[0, 1].isnan().any()
    mask = torch.zeros(20, 20, device=DEVICE)
    mask[7, 2] = float("nan")
    out = diff_attention(*make(1, 2, 1, 20, 20, 16, seed=9), attn_mask=mask, backend="triton")
    assert out[:, :, 7].isnan().all() and not out[:, :, 8].isnan().any()


def test_strides_too_large_for_tile_offsets_are_rejected_with_the_fix():
    base = torch.randn(2 ** 23 + 32, device=DEVICE)
    q = base.as_strided((1, 2, 2, 16), (0, 16, 2 ** 23, 1))  # rows 2**23 elements apart
    k, v = torch.randn(1, 2, 2, 16, device=DEVICE), torch.randn(1, 1, 2, 32, device=DEVICE)
    with pytest.raises(ValueError, match=r"q\.contiguous\(\)"):
        triton_diff_attention(q, k, v, torch.tensor(0.5, device=DEVICE))


def test_autotune_tables_are_small_and_the_switches_work(monkeypatch):
    from diffattn_tutorial.kernels.triton import configs as tc_configs
    from diffattn_tutorial.kernels.triton import flash_diff as td

    for table in tc_configs.config_tables().values():
        for (name, form), by_d in table.items():
            for d, cfgs in by_d.items():
                assert 1 <= len(cfgs) <= 4, (name, form, d)
                assert len({str(c) for c in cfgs}) == len(cfgs), (name, form, d)
    for d, plan in ((16, "fused"), (32, "fused"), (64, "split_kv"), (128, "split")):
        assert tc_configs.plan_for(d).name == plan
    monkeypatch.setenv(tc_configs.AUTOTUNE_ENV, "0")
    assert not tc_configs.autotune_enabled()
    monkeypatch.setenv(tc_configs.AUTOTUNE_ENV, "1")
    assert tc_configs.autotune_enabled()
    monkeypatch.setenv(td.POISON_ENV, "1")
    assert td._alloc(3, like=torch.zeros(1)).isnan().all()


def _zeros_qkv(d, dtype, grad=True):
    q = torch.zeros(1, 2, 32, d, dtype=dtype, requires_grad=grad)
    k = torch.zeros(1, 2, 32, d, dtype=dtype, requires_grad=grad)
    v = torch.zeros(1, 1, 32, 2 * d, dtype=dtype, requires_grad=grad)
    return q, k, v


@pytest.mark.parametrize("capability", [90, 89, 86, 80, 75])
def test_every_launch_has_autotune_configs_for_its_variant(capability):
    """The launches of the plan each target uses at every head dim (recorded from the host code, not run) find
    an entry in that target's table (a launch without one is refused: there is no default configuration). Hopper: fused at
    d <= 32, split_kv at 64, split at 128; below Hopper split everywhere; on sm_75 fp16, trained up to d = 64."""
    from diffattn_tutorial.kernels.triton import configs as tc_configs

    half = torch.float16 if capability < 80 else torch.bfloat16
    tables = tc_configs.config_tables()
    table16 = tables["hopper"] if capability >= 90 else (tables["ampere"] if capability >= 80 else tables["turing"])
    for d in (16, 32, 64, 128):
        for dtype in (half, torch.float32):
            q, k, v = _zeros_qkv(d, dtype)
            grad = d <= tc_configs.train_head_dim_limit(capability)
            with capture_launches(capability) as launches, torch.set_grad_enabled(grad):
                out = triton_diff_attention(q, k, v, torch.tensor(0.5, dtype=dtype))
                if grad:
                    out.sum().backward()
            names = [(x.name, tc_configs.form(x.name, x.consts)) for x in launches]
            # each forward launch is followed by its careful launch (a no-op on finite inputs)
            if capability >= 90:  # fwd, pre, dkdv, dq; dkdv -> dv, dk; 2 fwd, 2 dk, 2 dq
                expected = {16: 5, 32: 5, 64: 6, 128: 10}[d]
            else:  # split: 2 fwd, pre, dv, 2 dk, 2 dq; inference: 2 fwd
                expected = 10 if grad else 4
            assert len(launches) == expected, names
            table = tables["float32"] if dtype == torch.float32 else table16
            for x, key in zip(launches, names):
                if x.name != "_diff_attn_bwd_preprocess":
                    assert d in table[key], (capability, key, d)


def test_a_gpu_without_bf16_is_told_to_use_fp16():
    """On a T4 (compute capability 7.5, recorded as the host code would launch there): bf16 is refused naming
    float16, and training at d = 128 is refused naming backend='auto'; inference at d = 128 runs."""
    lam = torch.tensor(0.5)
    with capture_launches(75), pytest.raises(TypeError, match="float16"):
        triton_diff_attention(*_zeros_qkv(64, torch.bfloat16), lam.bfloat16())
    with capture_launches(75), pytest.raises(ValueError, match="backend='auto'"):
        triton_diff_attention(*_zeros_qkv(128, torch.float16), lam.half())
    with capture_launches(75) as launches, torch.no_grad():
        triton_diff_attention(*_zeros_qkv(128, torch.float16), lam.half())
    assert [(x.consts["MAPS"], x.consts["CAREFUL"]) for x in launches] == [  # map 2 stores o2, map 1 combines;
        (MAPS_2, False), (MAPS_1, False), (MAPS_2, True), (MAPS_1, True)]  # then the careful launches, in that order


# ------------------------------------------------------------------------------------------------
# 16-bit inputs against float64, every feature (GPU sizes on a GPU, small ones in the interpreter)
# ------------------------------------------------------------------------------------------------


def rel_err(a, b):
    """Norm-relative error ||a - b|| / ||b|| in float64 (NaN when a has NaN)."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


REL_FLOOR = {torch.bfloat16: 4e-3, torch.float16: 5e-4, torch.float32: 1e-6}
"""About two units of roundoff of each dtype (bfloat16 2**-8, float16 2**-11)."""
REL_CAP = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
"""Hard ceilings on the norm-relative error. Below them the kernel must stay within twice the naive backend's
own error in the same dtype, or within ``REL_FLOOR`` (measured in the interpreter: bfloat16 about 5e-3 for
the output and 6e-3 for the gradients at d = 128, float16 about 3e-4)."""

GPU_CASES = [  # B, H, Hkv, Nq, Nk, d, causal, lambda, mask, dtype
    (2, 4, 2, 301, 301, 64, False, "token", None, torch.bfloat16),
    (2, 4, 2, 301, 301, 128, True, "token", None, torch.bfloat16),
    (1, 4, 1, 200, 333, 64, True, "scalar", "bool", torch.bfloat16),  # Nq != Nk, GQA 4:1, a bool mask
    (1, 4, 4, 333, 200, 128, False, "scalar", "finfo", torch.bfloat16),  # Nq > Nk, HF additive mask
    (1, 8, 2, 256, 256, 128, True, "head", "additive", torch.float16),  # GQA 4:1, per-head lambda
    (2, 2, 2, 150, 400, 64, False, "token", "finfo", torch.float16),
    (1, 2, 1, 130, 257, 64, True, "scalar", "bool", torch.float32),  # float32: the FMA path
    (1, 2, 1, 130, 130, 128, False, "token", "additive", torch.float32),
]
CPU_CASES = [  # the same test on small shapes in the interpreter (it checks the test as much as the kernel)
    (1, 4, 1, 40, 45, 128, True, "token", "finfo", torch.bfloat16),
    (1, 2, 2, 33, 33, 64, False, "scalar", "bool", torch.float16),
]


def make_mask(kind, B, Nq, Nk, dtype, seed=3):
    g = torch.Generator().manual_seed(seed)
    if kind is None:
        return None
    keep = torch.rand(B, 1, Nq, Nk, generator=g) > 0.25
    keep[:, :, 1] = False  # one fully masked query row
    if kind == "bool":
        return keep.to(DEVICE)
    if kind == "finfo":
        low = torch.finfo(dtype).min
        return torch.where(keep, 0.0, low).to(device=DEVICE, dtype=dtype)
    return torch.where(keep, torch.randn(B, 1, Nq, Nk, generator=g), float("-inf")).to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("B,H,Hkv,Nq,Nk,d,causal,lam_kind,mask_kind,dtype", GPU_CASES if CUDA else CPU_CASES)
def test_low_precision_against_float64(B, H, Hkv, Nq, Nk, d, causal, lam_kind, mask_kind, dtype):
    """Forward and every gradient (dq, dk, dv, dlambda) in 16-bit (and float32) against float64 by norm-relative
    error, no worse than the naive backend in the same dtype; outputs and gradients poisoned with NaN first."""
    if unsupported_here(dtype, d):
        pytest.skip(unsupported_here(dtype, d))
    q, k, v, lam = make(B, H, Hkv, Nq, Nk, d, dtype=dtype, lam_kind=lam_kind, seed=d + Nq)
    mask = make_mask(mask_kind, B, Nq, Nk, dtype)
    g = torch.randn(B, H, Nq, 2 * d, generator=torch.Generator().manual_seed(4)).to(device=DEVICE, dtype=dtype)
    out, grads = run("triton", q, k, v, lam, g, causal=causal, attn_mask=mask)
    low, low_grads = run("naive", q, k, v, lam, g, causal=causal, attn_mask=mask)
    up = lambda t: None if t is None else t.double()  # noqa: E731
    mask64 = mask
    if mask is not None and mask.is_floating_point():  # finfo(dtype).min means masked in dtype, not in float64
        mask64 = mask.double().masked_fill(mask <= torch.finfo(mask.dtype).min, float("-inf"))
    exact, exact_grads = run("naive", up(q), up(k), up(v), up(lam), up(g), causal=causal, attn_mask=mask64)
    for name, a, n, e in zip(("out", "dq", "dk", "dv", "dlam"), (out, *grads), (low, *low_grads),
                             (exact, *exact_grads)):
        assert not a.isnan().any(), f"{name}: NaN (an element no program wrote, or a NaN that should not be)"
        err, err_naive = rel_err(a, e), rel_err(n, e)
        assert err <= max(2 * err_naive, REL_FLOOR[dtype]) and err <= REL_CAP[dtype], (name, err, err_naive)
    if mask_kind is not None:
        assert out[:, :, 1].abs().max() == 0  # the fully masked row


def test_offsets_guard_reads_only_strides_inside_a_tile():
    """Tile bases are int64, so large batch and head strides pass (a contiguous (2, 32, 8192, 64) q, a 46400^2
    mask); a row stride whose tile would pass 2**31 elements is refused by name. Meta tensors: strides, no data."""
    from diffattn_tutorial.kernels.triton.flash_diff import MAX_TILE_ROWS, _check_offsets

    meta = dict(device="meta", dtype=torch.bfloat16)
    q = torch.empty(2, 32, 8192, 64, **meta)
    mask = torch.empty(1, 1, 46400, 46400, device="meta", dtype=torch.bool)
    padding = torch.empty(2, 1, 1, 8192, **meta).as_strided((2, 1, 1, 8192), (2**40, 2**40, 2**40, 1))
    _check_offsets(q=q, k=q, v=q, attn_mask=mask)
    _check_offsets(attn_mask=padding)  # broadcast dims: their strides are never stepped
    tall = torch.empty(1, 1, 16, 64, **meta).as_strided((1, 1, 16, 64), (0, 0, 2**31 // MAX_TILE_ROWS, 1))
    with pytest.raises(ValueError, match="k steps .* between rows"):
        _check_offsets(q=q, k=tall)
    wide = torch.empty(1, 1, 16, 16, **meta).as_strided((1, 1, 16, 16), (0, 0, 1, 2**31 // MAX_TILE_ROWS))
    with pytest.raises(ValueError, match="attn_mask steps"):
        _check_offsets(attn_mask=wide)


def test_the_operators_refuse_rows_too_far_apart_for_tile_offsets():
    """``diffattn::triton_forward`` and ``triton_backward`` are public (``torch.ops``, ``torch.export``): they refuse
    themselves, in their fake implementations too, a layout whose tile offsets would pass int32 (rows 2**23
    elements apart), as :func:`triton_diff_attention` does; they ran it (int32 offsets wrapping on a GPU). Meta
    tensors: shapes and strides only."""
    meta = dict(device="meta")
    far = torch.empty(1, 2, 2, 16, **meta).as_strided((1, 2, 2, 16), (0, 16, 2**23, 1))
    k, v, lam = torch.empty(1, 2, 8, 16, **meta), torch.empty(1, 1, 8, 32, **meta), torch.empty((), **meta)
    with pytest.raises(ValueError, match="q steps 8388608 elements between rows"):
        torch.ops.diffattn.triton_forward(far, k, v, lam, None, False, 0.25, [], "fused", False)
    q = torch.empty(1, 2, 2, 16, **meta)
    out, o2, lse, flag = torch.ops.diffattn.triton_forward(q, k, v, lam, None, False, 0.25, [], "fused", True)
    with pytest.raises(ValueError, match="q steps"):
        torch.ops.diffattn.triton_backward(out, far, k, v, lam, None, out, o2, lse, flag, False, 0.25, [], "fused",
                                           [True, True, True])
    mask = torch.empty(2, 8, dtype=torch.bool, **meta).as_strided((2, 8), (2**23, 1))
    with pytest.raises(ValueError, match="attn_mask steps"):
        torch.ops.diffattn.triton_forward(q, k, v, lam, mask, False, 0.25, [], "fused", False)


def test_the_backward_operator_refuses_out_rows_too_far_apart():
    """The backward's preprocess reads ``out`` and ``o2`` (one layout) with ``offs_m * stride_om`` in int32, up to
    128 rows a tile: the public operator took them in any layout with a unit last stride, so rows 2**23 elements
    apart passed its checks (and wrapped on a GPU). It refuses them by name, as it refuses q, k, v. Meta tensors."""
    meta = dict(device="meta")
    q, k, v, lam = (torch.empty(1, 2, 2, 16, **meta), torch.empty(1, 2, 8, 16, **meta),
                    torch.empty(1, 1, 8, 32, **meta), torch.empty((), **meta))
    out, o2, lse, flag = torch.ops.diffattn.triton_forward(q, k, v, lam, None, False, 0.25, [], "fused", True)
    far_out = torch.empty(1, 1, 2, 32, **meta).as_strided((1, 1, 2, 32), (0, 0, 2**23, 1))
    far_o2 = torch.empty(1, 1, 2, 32, dtype=torch.float32, **meta).as_strided((1, 1, 2, 32), (0, 0, 2**23, 1))
    with pytest.raises(ValueError, match="out steps 8388608 elements between rows"):
        torch.ops.diffattn.triton_backward(out, q, k, v, lam, None, far_out, far_o2, lse, flag, False, 0.25, [], "fused",
                                           [True, True, True])
    torch.ops.diffattn.triton_backward(out, q, k, v, lam, None, out, o2, lse, flag, False, 0.25, [], "fused",
                                       [True, True, True])


def test_a_mask_of_one_dim_passes_the_offsets_guard():
    """A mask broadcast from ``(Nk,)`` has no row dim; the guard read ``shape[-2]`` and raised IndexError."""
    from diffattn_tutorial.kernels.triton.flash_diff import _check_offsets

    _check_offsets(attn_mask=torch.empty(8, dtype=torch.bool, device="meta"))
    with pytest.raises(ValueError, match="attn_mask steps"):  # its key dim is still stepped inside a tile
        _check_offsets(attn_mask=torch.empty(8, device="meta").as_strided((8,), (2**30,)))


def test_blocks_past_the_guarded_tile_rows_are_refused():
    """The offsets guard allows row strides up to ``2**31 / MAX_TILE_ROWS``: a tile of more rows (``blocks=(512,
    16)``) would pass int32 there, so such blocks are refused, by the entry point and by the operator."""
    from diffattn_tutorial.kernels.triton.flash_diff import MAX_TILE_ROWS

    where = dict(device=DEVICE if CUDA else "meta")  # meta runs nothing, but only under the interpreter
    q, k, v, lam = (torch.zeros(1, 2, 4, 16, **where), torch.zeros(1, 2, 8, 16, **where),
                    torch.zeros(1, 1, 8, 32, **where), torch.zeros((), **where))
    with pytest.raises(ValueError, match=f"powers of two from 16 to {MAX_TILE_ROWS}"):
        triton_diff_attention(q, k, v, lam, blocks=(2 * MAX_TILE_ROWS, 16))
    with pytest.raises(ValueError, match=f"powers of two from 16 to {MAX_TILE_ROWS}"):
        torch.ops.diffattn.triton_forward(q, k, v, lam, None, False, 0.25, [16, 2 * MAX_TILE_ROWS], "fused", False)
    triton_diff_attention(q, k, v, lam, blocks=(MAX_TILE_ROWS, 16))  # accepted (on meta: checked, nothing runs)


def test_an_upstream_gradient_with_rows_far_apart_is_copied_not_refused():
    """Autograd chooses dout's layout: a seq-first ``(N, B, H, 2d)`` gradient permuted back steps ``B H 2d``
    elements between rows (2**23 at B = 256, H = 128, d = 128). The backward refused it, naming a fix
    (``dout.contiguous()``) the caller cannot apply; it copies it now. The launches are recorded, not run; dout
    is a 32 MiB virtual buffer of which two rows are read."""
    from diffattn_tutorial.kernels.triton.flash_diff import triton_backward, triton_forward

    q, k, v, lam = make(1, 1, 1, 2, 8, 16, lam_kind="token")
    dout = torch.empty(2**23 + 32, device=DEVICE).as_strided((1, 1, 2, 32), (0, 0, 2**23, 1))
    with capture_launches() as launches:
        out, o2, lse, flag = triton_forward(q, k, v, lam, None, False, 0.25, [], "fused", True)
        triton_backward(dout, q, k, v, lam, None, out, o2, lse, flag, False, 0.25, [], "fused", [True, True, True])
    strides = {launch.args["stride_gm"] for launch in launches if "stride_gm" in launch.args}
    assert strides == {32}, strides


@pytest.mark.parametrize("plan,launches", [("split_kv_atomic", ["_diff_attn_bwd_dkdv", "_diff_attn_bwd_dkdq"]),
                                            ("split_atomic", ["_diff_attn_bwd_dkdv"] + ["_diff_attn_bwd_dkdq"] * 2),
                                            ("fused_atomic", ["_diff_attn_bwd_dkdq"])])
def test_atomic_plans_launch_no_dq_kernel_and_keep_the_nan_contract(plan, launches):
    """The atomic twins launch the forward, the preprocess, dV, then dK with dQ (``_diff_attn_bwd_dkdq``); the
    fused one dV, dK and dQ in one launch: no dQ launch recomputes the scores. They refuse deterministic mode (the
    sums' order varies). A call that read a NaN still gives NaN gradients, every one: the forward's flag reaches
    every dS through delta, so every dQ share the dK programs add is NaN, and the launch that writes dV adds it."""
    q, k, v, lam = make(1, 2, 1, 20, 20, 16, seed=8)
    with capture_launches() as captured:
        triton_diff_attention(*(t.requires_grad_() for t in (q, k, v, lam)), plan=plan).sum().backward()
    assert [x.name for x in captured if x.name.startswith("_diff_attn_bwd_d")] == launches
    q, k, v, lam = make(2, 2, 1, 20, 20, 16, seed=8)  # two batches: a NaN in one reaches the other by the flag only
    torch.use_deterministic_algorithms(True)
    try:  # the sums' order is the programs': refused where the caller asked for bitwise reproducible results
        with pytest.raises(RuntimeError, match="use plan='auto'"):
            triton_diff_attention(q, k, v, lam, plan=plan)
    finally:
        torch.use_deterministic_algorithms(False)
    q[0, 0, 3, 5] = float("nan")
    _, grads = run_plan(plan, q, k, v, lam, torch.ones(2, 2, 20, 32, device=DEVICE))
    assert all(g.isnan().all() for g in grads), [g.isnan().float().mean().item() for g in grads]


def test_a_kernel_that_adds_with_atomics_is_autotuned_with_its_sums_restored():
    """The autotuner times each configuration by running it on the real arguments, several times: a kernel that
    adds into a buffer (``tl.atomic_add``) would add each run's share. Every such kernel names its summed
    arguments in ``flash_diff.ACCUMULATED``, and its autotuner restores them after each timed run."""
    import inspect

    from diffattn_tutorial.kernels.triton import flash_diff
    from diffattn_tutorial.kernels.triton.configs import autotune_configs

    def source(fn, seen=()):  # a jit function's code and that of the jit functions it calls
        text = inspect.getsource(fn.fn)
        calls = [obj for name, obj in fn.fn.__globals__.items() if f"{name}(" in text and name not in seen
                 and type(obj).__name__ in ("JITFunction", "InterpretedFunction")]
        return text + "".join(source(c, (*seen, fn.fn.__name__, *(c.fn.__name__ for c in calls))) for c in calls)

    adding = {name for name, fn in flash_diff.KERNELS.items() if "tl.atomic_add(" in source(fn)}
    assert adding == set(flash_diff.ACCUMULATED) == {"_diff_attn_bwd_dkdq"}, adding
    consts = {"BLOCK_D": 64, "DK_MAPS": 3, "MASK_KIND": 0}
    before = set(flash_diff._tuned)
    tuner = flash_diff._tuned_kernel("_diff_attn_bwd_dkdq", consts,
                                     autotune_configs("_diff_attn_bwd_dkdq", consts, torch.bfloat16, 90, tma=None))
    try:
        assert tuner.restore_value == ["DQACC"] and len(tuner.configs) == 3
    finally:
        for key in set(flash_diff._tuned) - before:  # no tuner left behind for the other tests
            del flash_diff._tuned[key]


# ------------------------------------------------------------------------------------------------
# GPU only: limits of the grid and of int32 offsets, the autotuner's choices at N = 8192
# ------------------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (the CPU tests above use the interpreter)")


@gpu
def test_gpu_more_than_65535_heads_times_batch():
    """The grid is 1-D (tiles x batch x heads), so B * H may exceed the 65535 limit of grid axes 1 and 2."""
    q, k, v, lam = make(3, 25000, 25000, 16, 16, 16, dtype=HALF, lam_kind="token")
    out = diff_attention(q, k, v, lam, backend="triton")
    ref = diff_attention(q.double(), k.double(), v.double(), lam.double(), backend="naive")
    assert rel_err(out, ref) < 1e-2


@gpu
def test_gpu_mask_offsets_past_2_31():
    """A bool mask with Nq * Nk > 2**31 elements: the last query rows read their mask at offsets that overflow
    int32; the kernels address tiles in int64. Checked on the last rows against naive on those rows."""
    n, d = 46400, 16
    q, k, v, lam = make(1, 1, 1, n, n, d, dtype=HALF, seed=6)
    mask = torch.ones(n, n, dtype=torch.bool, device="cuda")
    mask[-64:, ::3] = False
    with torch.no_grad():
        out = diff_attention(q, k, v, lam, attn_mask=mask, backend="triton")[:, :, -64:]
        ref = diff_attention(q[:, :, -64:].double(), k.double(), v.double(), lam.double(), attn_mask=mask[-64:],
                             backend="naive")
    assert rel_err(out, ref) < 1e-2


@gpu
@pytest.mark.parametrize("d,plan", [(64, "auto"), (128, "auto"), (64, "atomic"), (128, "atomic"), (64, "fused"),
                                    (64, "fused_atomic")])
def test_gpu_autotuned_configs_at_8192(d, plan, monkeypatch):
    """With autotuning on (as in the benchmarks), the configurations picked at N = 8192 compute the right
    answer, forward and backward, judged as :func:`test_low_precision_against_float64` judges: no worse than the
    naive backend in the same dtype. lambda is per token: a scalar lambda's gradient is one sum of 16384 rows'
    terms of both signs, whose relative error is no measure of the kernel (an H200 gave 1.5% at d = 128).
    ``plan``: the library's, its atomic twin (whose dK kernel adds dQ with atomics while the autotuner times it,
    ``flash_diff.ACCUMULATED``), or at d = 64 the fused plan or its atomic form (chosen by name, HOPPER.md's
    designs 1 and 2). The picks are printed (and written to $DIFFATTN_CHOSEN_CONFIGS if set)."""
    import json

    from diffattn_tutorial.kernels.triton.flash_diff import chosen_configs

    if unsupported_here(HALF, d):
        pytest.skip(unsupported_here(HALF, d))
    monkeypatch.setenv("DIFFATTN_TRITON_AUTOTUNE", "1")
    q, k, v, lam = make(1, 2, 2, 8192, 8192, d, dtype=HALF, lam_kind="token", seed=d)
    g = torch.randn(1, 2, 8192, 2 * d, generator=torch.Generator().manual_seed(1)).to(device="cuda", dtype=HALF)
    if plan == "atomic":
        from diffattn_tutorial.kernels.triton.configs import ATOMIC_TWINS, plan_for

        out, grads = run_plan(ATOMIC_TWINS[plan_for(d, CAPABILITY).name], q, k, v, lam, g)
    elif plan in ("fused", "fused_atomic"):
        out, grads = run_plan(plan, q, k, v, lam, g)
    else:
        out, grads = run("triton", q, k, v, lam, g)
    low, low_grads = run("naive", q, k, v, lam, g)
    exact, exact_grads = run("naive", q.double(), k.double(), v.double(), lam.double(), g.double())
    for name, a, n, e in zip(("out", "dq", "dk", "dv", "dlam"), (out, *grads), (low, *low_grads),
                             (exact, *exact_grads)):
        assert not a.isnan().any(), name
        err, err_naive = rel_err(a, e), rel_err(n, e)
        assert err <= max(2 * err_naive, REL_FLOOR[HALF]) and err <= REL_CAP[HALF], (name, err, err_naive)
    picked = chosen_configs()
    backward = {"auto": "_diff_attn_bwd_dq" if d == 64 else "_diff_attn_bwd_dq/dq_map", "atomic": "_diff_attn_bwd_dkdq",
                "fused": "_diff_attn_bwd_dkdv/dkdv", "fused_atomic": "_diff_attn_bwd_dkdq/dkdvdq"}[plan]
    assert any(key.startswith(backward) and f"/d{d}" in key and cfgs for key, cfgs in picked.items()), (backward, picked)
    print(json.dumps(picked, indent=1))
    if os.environ.get("DIFFATTN_CHOSEN_CONFIGS"):
        path = os.environ["DIFFATTN_CHOSEN_CONFIGS"]
        old = json.loads(open(path).read()) if os.path.exists(path) else {}
        old.update(picked)
        with open(path, "w") as f:
            json.dump(old, f, indent=1)


def test_gradient_for_lambda_only():
    """A frozen layer with a trainable lambda: only dlambda is computed, and it is right."""
    q, k, v, lam = make(1, 2, 1, 20, 20, 16, lam_kind="head", seed=9)
    grads = {}
    for backend in ("triton", "naive"):
        lam_leaf = lam.clone().requires_grad_()
        out = diff_attention(q, k, v, lam_leaf, causal=True, backend=backend)
        grads[backend] = torch.autograd.grad(out.square().sum(), lam_leaf)[0]
    torch.testing.assert_close(grads["triton"], grads["naive"], rtol=1e-4, atol=1e-4)


def test_lambda_rows_past_int32_offsets_are_copied():
    """The kernels index lambda's rows as ``row * stride`` in int32: a per-token lambda cut from a wide tensor
    whose row stride times Nq reaches 2**31 is passed as a contiguous copy (shapes only: meta tensors)."""
    from diffattn_tutorial.kernels.triton.flash_diff import _lam4

    wide = torch.empty(1, 2, 65536, 2**15, device="meta")[..., :1]  # row stride 2**15, 2**16 rows
    assert _lam4(wide, 1, 2, 65536).stride() == (131072, 65536, 1, 1)
    narrow = torch.empty(1, 2, 1000, 8, device="meta")[..., :1]
    assert _lam4(narrow, 1, 2, 1000).stride()[2] == 8  # read in place
