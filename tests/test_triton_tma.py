"""The TMA twins (``configs.TMA_TWINS``): the tiles a kernel's loop walks (the forward's k and v, the dK kernels'
q and dO) read by tensor descriptor (``tl.make_tensor_descriptor``, Hopper's copy engine) instead of per-thread
pointer loads.

In Triton's interpreter on a CPU (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``): the descriptors' loads give
the pointer loads' answer, at ragged lengths and padded head dims (where the copy engine fills with 0 what
the pointer loads mask), forward and backward, and keep the NaN contract; the host offers the twins only on
Hopper and only for inputs the copy engine can read, refuses ``tma=True`` elsewhere with the fix; the workspace
Triton needs for device-side descriptors is set for the launch only. Their speed is a GPU question
(``benchmarks/probe_triton.py`` times each twin beside its pointer entry).
"""

import contextvars

import pytest
import torch

pytest.importorskip("triton")

from diffattn_tutorial.kernels.triton import configs  # noqa: E402
from diffattn_tutorial.kernels.triton.flash_diff import (  # noqa: E402
    capture_launches,
    tma_ok,
    triton_diff_attention,
)

pytestmark = pytest.mark.slow  # the kernels in Triton's interpreter (a session without it fails: RuntimeError)


@pytest.fixture(autouse=True)
def _poisoned(monkeypatch):
    """NaN-filled output buffers: a tile no program writes fails instead of reading as 0."""
    monkeypatch.setenv("DIFFATTN_TRITON_POISON", "1")


def make(B, H, Hkv, Nq, Nk, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*s, generator=g).to(dtype) for s in ((B, 2 * H, Nq, d), (B, 2 * Hkv, Nk, d),
                                                                 (B, Hkv, Nk, 2 * d)))
    return q, k, v, torch.rand(B, H, Nq, 1, generator=g).to(dtype)


def out_and_grads(q, k, v, lam, **kw):
    ins = [t.detach().clone().requires_grad_() for t in (q, k, v, lam)]
    out = triton_diff_attention(*ins, **kw)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.dtype)
    return [out.detach(), *torch.autograd.grad((out * g).sum(), ins)]


CASES = [  # B, H, Hkv, Nq, Nk, d, causal, mask, dtype, plan
    (2, 2, 1, 37, 50, 24, False, None, torch.float32, "auto"),  # ragged tiles, MQA, d padded to 32: filled with 0
    (1, 4, 2, 50, 21, 64, True, "bool", torch.float32, "auto"),  # causal, Nq > Nk, GQA, a mask: split_kv
    (1, 2, 2, 29, 45, 128, False, None, torch.bfloat16, "auto"),  # split: one map per launch, 16-bit
    (1, 4, 2, 37, 29, 64, True, None, torch.float32, "split_kv_atomic"),  # the dK kernel that adds dQ
    (1, 4, 2, 29, 37, 64, False, None, torch.float32, "fused_atomic"),  # ... and writes dV
]


@pytest.mark.parametrize("B,H,Hkv,Nq,Nk,d,causal,mask_kind,dtype,plan", CASES)
def test_descriptor_loads_give_the_pointer_loads_answer(B, H, Hkv, Nq, Nk, d, causal, mask_kind, dtype, plan):
    """The same tiles reach the same arithmetic: output and every gradient equal to float rounding (not bit for
    bit: the interpreter's products of a k tile loaded transposed and of one transposed after loading sum in
    different orders), none NaN (a zero fill gone wrong would read the poisoned buffers or NaN past the edges)."""
    q, k, v, lam = make(B, H, Hkv, Nq, Nk, d, dtype, seed=Nq + Nk)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(B, 1, Nq, Nk, generator=torch.Generator().manual_seed(1)) > 0.3
    kw = dict(causal=causal, attn_mask=mask, plan=plan)
    pointers = out_and_grads(q, k, v, lam, tma=False, **kw)
    descriptors = out_and_grads(q, k, v, lam, tma=True, **kw)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dlam"), descriptors, pointers):
        assert not a.isnan().any(), name
        torch.testing.assert_close(a, b, msg=name)  # torch's defaults for the dtype: 1.3e-6 relative in float32


def test_descriptor_loads_keep_the_nan_contract():
    """A NaN in q makes its row NaN, an infinity in v exactly the rows that see its key (causal); every gradient
    of such a call is NaN."""
    q, k, v, lam = make(1, 2, 1, 20, 23, 16, seed=4)
    q[0, 0, 3, 5] = float("nan")  # map 1 of head 0, row 3
    out = triton_diff_attention(q, k, v, lam, tma=True)
    assert out[0, 0, 3].isnan().all() and not out[0, 0, :3].isnan().any() and not out[0, 1].isnan().any()
    q[0, 0, 3, 5] = 0.0
    v[0, 0, 21, 0] = float("inf")  # a key in the ragged tile; causal, bottom-right: rows 18 and 19 see it
    out = triton_diff_attention(q, k, v, lam, tma=True, causal=True)
    assert out[0, :, 18:].isnan().all() and not out[0, :, :18].isnan().any()
    grads = out_and_grads(q, k, v, lam, tma=True)[1:]
    assert all(g.isnan().all() for g in grads)


def offered(q, k, v, capability=90, **kw):
    """The forward launches' configurations as the host records them for a GPU of ``capability``:
    ``[(careful, [label, ...])]``."""
    with capture_launches(capability) as launches, torch.no_grad():
        triton_diff_attention(q, k, v, torch.tensor(0.5, dtype=q.dtype), **kw)
    return [(x.consts["CAREFUL"], [configs.label(c) for c in x.configs]) for x in launches
            if x.name == "_diff_attn_fwd"]


def offered_backward(q, k, v, dout, capability=90, **kw):
    """The backward launches' configurations, recorded: ``{kernel/form: [label, ...]}``."""
    ins = [t.detach().requires_grad_() for t in (q, k, v, torch.tensor(0.5, dtype=q.dtype))]
    with capture_launches(capability) as launches:
        triton_diff_attention(*ins, **kw).backward(dout)
    return {f"{x.name}/{configs.form(x.name, x.consts)}": [configs.label(c) for c in x.configs] for x in launches
            if x.name in ("_diff_attn_bwd_dkdv", "_diff_attn_bwd_dkdq", "_diff_attn_bwd_dq")}


def test_the_autotuner_is_offered_the_twins_on_hopper_for_aligned_inputs_only():
    q, k, v, _ = make(1, 2, 1, 64, 64, 64, torch.bfloat16)
    plain, careful = offered(q, k, v)
    assert plain == (False, ["64x64 w4 s3", "64x64 w4 s3 tma"])  # never first: never pinned
    assert careful == (True, ["64x64 w4 s3"])
    assert offered(q, k, v, tma=False)[0][1] == ["64x64 w4 s3"]
    assert offered(q, k, v, tma=True)[0][1] == ["64x64 w4 s3 tma"]
    assert offered(q, k, v, capability=80)[0][1] == ["64x64 w4 s2", "128x32 w8 s2"]  # no copy engine below Hopper
    shifted = torch.zeros(k.numel() + 1, dtype=k.dtype)[1:].view(k.shape)  # 2 bytes past a 16-byte boundary
    assert not tma_ok(shifted) and tma_ok(k, v)
    assert offered(q, shifted, v)[0][1] == ["64x64 w4 s3"]
    q20, k20, v20, _ = make(1, 2, 1, 64, 64, 20, torch.bfloat16)  # rows of 40 bytes: not a multiple of 16
    assert not tma_ok(k20)
    assert all("tma" not in c for c in offered(q20, k20, v20)[0][1])


def test_the_dk_kernels_are_offered_their_twins_for_q_and_do_the_copy_engine_can_read(monkeypatch):
    """The dK kernels read q and dO by descriptor, the dQ kernel k and v: each is offered its twins where the
    copy engine can read what it reads."""
    q, k, v, _ = make(1, 2, 1, 64, 64, 64, torch.bfloat16)
    dout = torch.ones(1, 2, 64, 128, dtype=torch.bfloat16)
    assert offered_backward(q, k, v, dout) == {
        "_diff_attn_bwd_dkdv/dv": ["32x128 w8 s2", "32x64 w4 s2", "32x128 w8 s2 tma"],
        "_diff_attn_bwd_dkdv/dk": ["32x128 w8 s2", "16x128 w8 s2", "32x128 w8 s2 tma"],
        "_diff_attn_bwd_dq/dq": ["128x32 w8 s2", "64x32 w4 s3", "128x32 w8 s2 tma"]}
    assert offered_backward(q, k, v, dout, plan="split_kv_atomic")["_diff_attn_bwd_dkdq/dkdq"][-1] == "32x128 w8 s2 tma"
    far = torch.ones(1, 2, 64, 129, dtype=torch.bfloat16)[..., :128]  # dO rows of 258 bytes
    assert not tma_ok(far)
    assert {launch: [c for c in cs if "tma" in c] for launch, cs in offered_backward(q, k, v, far).items()} == {
        "_diff_attn_bwd_dkdv/dv": [], "_diff_attn_bwd_dkdv/dk": [], "_diff_attn_bwd_dq/dq": ["128x32 w8 s2 tma"]}
    shifted = torch.zeros(k.numel() + 1, dtype=k.dtype)[1:].view(k.shape)  # k 2 bytes past a 16-byte boundary
    assert offered_backward(q, shifted, v, dout)["_diff_attn_bwd_dq/dq"] == ["128x32 w8 s2", "64x32 w4 s3"]
    # tma=True is the forward's to force: autograd chose dO's layout, so the backward reads by pointers then, and
    # a launch with no twin (below: a table without them) takes its pointer entries instead of failing
    assert offered_backward(q, k, v, far, tma=True)["_diff_attn_bwd_dkdv/dk"] == ["32x128 w8 s2", "16x128 w8 s2"]
    assert offered_backward(q, k, v, dout, tma=True)["_diff_attn_bwd_dkdv/dk"] == ["32x128 w8 s2 tma"]
    assert offered_backward(q, k, v, dout, tma=True, plan="fused")["_diff_attn_bwd_dkdv/dkdv"] == [
        "16x128 w8 s1 tma", "32x128 w8 s2 tma"]
    fused = configs.config_tables()["hopper"][("_diff_attn_bwd_dkdv", "dkdv")]
    monkeypatch.setitem(fused, 64, [c for c in fused[64] if not c.kwargs.get("TMA")])  # a table without twins
    assert offered_backward(q, k, v, dout, tma=True, plan="fused")["_diff_attn_bwd_dkdv/dkdv"] == [
        "16x128 w8 s1", "32x128 w8 s2"]


def test_tma_true_is_refused_where_the_copy_engine_cannot_read_with_the_fix():
    q, k, v, lam = make(1, 2, 1, 16, 16, 20, torch.bfloat16)
    with pytest.raises(ValueError, match=r"k.contiguous\(\) and v.contiguous\(\)"):
        triton_diff_attention(q, k, v, lam, tma=True)  # rows of 40 bytes
    q, k, v, lam = make(1, 2, 1, 16, 16, 64, torch.bfloat16)
    with capture_launches(80), pytest.raises(ValueError, match="does not have; pass tma=None"):
        triton_diff_attention(q, k, v, lam, tma=True)
    assert not tma_ok(k[:, :, :1].expand(k.shape))  # keys expanded along the sequence: rows 0 bytes apart
    out = triton_diff_attention(q, k[:, :, :0], v[:, :, :0], lam, tma=True)  # no key: nothing read, no refusal
    assert out.shape == (1, 2, 16, 128) and not out.any()


def test_the_descriptor_workspace_is_set_for_the_launch_only():
    """Triton asks ``triton.set_allocator``'s allocator (a ``ContextVar``) for device-side descriptors' memory; the
    host sets its own for a launch that may build them, in a copy of the context, and leaves the caller's."""
    import triton
    from triton.runtime import _allocation

    from diffattn_tutorial.kernels.triton import launch

    def caller():
        def mine(size, alignment, stream):
            raise AssertionError("not called here")

        triton.set_allocator(mine)
        seen = []
        launch.call(lambda: seen.append(_allocation._allocator.get()), workspace=True)
        assert seen == [launch.descriptor_workspace]
        assert _allocation._allocator.get() is mine  # the caller's, as it was
        launch.call(lambda: seen.append(_allocation._allocator.get()), workspace=False)
        assert seen[-1] is mine

    contextvars.copy_context().run(caller)  # this test's own allocator does not outlive it either
