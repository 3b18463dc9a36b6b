"""The fused CPU kernel (``backend="cpu_fused"``, ``diffattn_tutorial.kernels.cpu.cpu_fused``): exact against the paper's
formula in float64, independent of the thread count and of input strides, chosen by ``auto`` only where it
applies, and refused with a message that names the fix where it does not. Its speed is measured by
``benchmarks/bench_cpu_auto.py``, not here."""

import os
import subprocess

import pytest
import torch
from forked import run_module

from diffattn_tutorial import backend_table
from diffattn_tutorial.functional import backend_status, diff_attention
from diffattn_tutorial.kernels.cpu import boundary, cpu_fused, selfcheck
from diffattn_tutorial.measure.cpu_threads import threads
from diffattn_tutorial.paths import package_root

NO_COMPILER = cpu_fused.compiler() is None
needs_compiler = pytest.mark.skipif(NO_COMPILER, reason="no C++ compiler here: backend='auto' uses sdpa_padded "
                                                        "(test_without_a_compiler checks that)")


def inputs(B, H, Hkv, Nq, Nk, d, seed=0, lam_kind="head"):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, 2 * H, Nq, d, generator=g), torch.randn(B, 2 * Hkv, Nk, d, generator=g)
    v = torch.randn(B, Hkv, Nk, 2 * d, generator=g)
    lam = {"scalar": torch.tensor(0.4), "head": torch.rand(1, H, 1, 1, generator=g),
           "token": torch.rand(B, H, Nq, 1, generator=g)}[lam_kind]
    return q, k, v, lam


def reference(q, k, v, lam, **kw):
    mask = kw.get("attn_mask")
    if mask is not None and mask.is_floating_point():
        kw["attn_mask"] = mask.double()
    return diff_attention(q.double(), k.double(), v.double(), lam.double(), backend="naive", **kw)


def fused(q, k, v, lam, **kw):
    with torch.no_grad():
        return diff_attention(q, k, v, lam, backend="cpu_fused", **kw)


@needs_compiler
@pytest.mark.parametrize("B,H,Hkv,Nq,Nk,d", [
    (1, 1, 1, 1, 1, 64),       # one query, one key
    (2, 4, 2, 50, 70, 32),     # GQA, tails in rows (50 = 48 + 2) and keys (70 = 2 * 32 + 6)
    (1, 2, 1, 100, 37, 64),    # Nq > Nk: causal leaves rows without keys
    (1, 4, 4, 5, 33, 20),      # a head width the kernel pads (20 -> 32)
    (2, 2, 1, 49, 1, 64),      # one key
    (1, 2, 2, 24, 300, 128),   # exactly one 24-row block; wide heads
    (1, 3, 1, 97, 97, 16),     # three heads per KV group
    (1, 2, 1, 530, 45, 32),    # more rows than the row-major scores take: k transposed, the score tiles
])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lam_kind", ["scalar", "head", "token"])
def test_matches_the_formula_in_float64(B, H, Hkv, Nq, Nk, d, causal, lam_kind):
    q, k, v, lam = inputs(B, H, Hkv, Nq, Nk, d, lam_kind=lam_kind)
    out = fused(q, k, v, lam, causal=causal)
    assert out.shape == (B, H, Nq, 2 * d) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(q, k, v, lam, causal=causal), rtol=1e-5, atol=2e-6)


@needs_compiler
@pytest.mark.parametrize("mask_kind", ["bool_2d", "bool_rows_fully_masked", "float_per_head", "finfo_min",
                                       "key_padding"])
@pytest.mark.parametrize("causal", [False, True])
def test_masks(mask_kind, causal):
    B, H, Hkv, Nq, Nk = 2, 2, 1, 29, 41
    q, k, v, lam = inputs(B, H, Hkv, Nq, Nk, 32, seed=1, lam_kind="token")
    g = torch.Generator().manual_seed(2)
    if mask_kind == "bool_2d":
        mask = torch.rand(Nq, Nk, generator=g) > 0.3
    elif mask_kind == "bool_rows_fully_masked":
        mask = torch.rand(B, 1, Nq, Nk, generator=g) > 0.3
        mask[0, :, 3] = False
    elif mask_kind == "float_per_head":
        mask = torch.randn(1, H, Nq, Nk, generator=g)
    elif mask_kind == "finfo_min":  # Hugging Face's convention: finfo.min marks a masked key
        mask = torch.zeros(B, 1, Nq, Nk).masked_fill(torch.rand(B, 1, Nq, Nk, generator=g) > 0.7,
                                                     torch.finfo(torch.float32).min)
    else:  # (B, 1, 1, Nk): one padding mask for every row, broadcast along queries
        mask = (torch.arange(Nk) < torch.tensor([30, 41]).view(B, 1)).view(B, 1, 1, Nk)
    out = fused(q, k, v, lam, causal=causal, attn_mask=mask)
    expected = reference(q, k, v, lam, causal=causal, attn_mask=mask)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=2e-6)
    if mask_kind == "bool_rows_fully_masked":
        assert out[0, :, 3].abs().max() == 0


HUGE_MASKS = {  # additive masks with entries beyond about 2.4e38, where base-2 units (x LOG2E) overflow
    "huge positive on some keys": lambda m: m[:, ::5].fill_(3.0e38),
    "huge negative on every key of a row": lambda m: m[3].fill_(-3.0e38),
    "both in one row": lambda m: (m[:, 0].fill_(3.3e38), m[:, 1].fill_(-3.3e38)),
    "float32's largest": lambda m: m[:, 2].fill_(torch.finfo(torch.float32).max),
}


@needs_compiler
@pytest.mark.parametrize("kind", HUGE_MASKS)
@pytest.mark.parametrize("causal", [False, True])
def test_additive_masks_anywhere_in_float32s_range_give_naives_answer(kind, causal):
    """The kernel gave zeros or a NaN row where float32 naive gives normal values: it scaled the mask to base-2
    units before adding it. Scores and mask now stay in natural units, as naive's."""
    q, k, v, lam = inputs(1, 2, 1, 29, 41, 32, seed=4, lam_kind="token")
    mask = torch.randn(29, 41, generator=torch.Generator().manual_seed(5))
    HUGE_MASKS[kind](mask)
    with torch.no_grad():
        expected = diff_attention(q, k, v, lam, causal=causal, attn_mask=mask, backend="naive")
    out = fused(q, k, v, lam, causal=causal, attn_mask=mask)
    assert expected.isfinite().all()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-6)


def test_contiguous_float32_inputs_reach_the_kernel_uncopied():
    """The docstring's promise: no input copies for contiguous float32 with a head width that is a multiple of
    32 (``F.pad(t, (0, 0))`` copied q, k and v on every call). A width the kernel pads is copied, once."""
    seen = {}

    class Recorder:  # stands in for the compiled library: notes the pointers it is given
        @staticmethod
        def diff_attention_cpu_forward(ins, args):
            ins = ins._obj  # the Inputs passed by reference
            seen.update(q=ins.q, k=ins.k, v=ins.v)
            return 0

    for d, copied in ((64, False), (32, False), (20, True)):
        q, k, v, lam = inputs(1, 2, 1, 40, 40, d)
        boundary.forward(Recorder(), q, k, v, lam, None, False, d ** -0.5)
        assert (seen == {"q": q.data_ptr(), "k": k.data_ptr(), "v": v.data_ptr()}) != copied


@needs_compiler
def test_a_projections_transposed_views_are_read_in_place_and_get_gradients_laid_out_alike():
    """q, k, v as a layer has them, (B, N, heads, d) projections viewed as (B, heads, N, d), reach the kernel
    uncopied, and dq, dk, dv come back as the same views of dense tensors: the projections' backward reads them
    without a copy (rows strided by heads * d)."""
    B, N, H, d = 2, 50, 2, 32
    g = torch.Generator().manual_seed(5)
    proj = [torch.randn(B, N, w, d, generator=g) for w in (2 * H, 2 * H, H)]  # q, k (2 maps a head), v: d wide
    q, k = (t.transpose(1, 2).requires_grad_() for t in proj[:2])
    v = torch.randn(B, N, H, 2 * d, generator=g).transpose(1, 2).requires_grad_()
    lam = torch.tensor(0.3)
    seen = {}
    real = cpu_fused._kernel()

    class Recorder:  # the compiled library, noting the pointers it is given
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def diff_attention_cpu_forward(ins, args):
            seen.update(q=ins._obj.q, k=ins._obj.k, v=ins._obj.v)
            return real.diff_attention_cpu_forward(ins, args)

    out, _ = boundary.forward(Recorder(), q.detach(), k.detach(), v.detach(), lam, None, True, d ** -0.5)
    assert seen == {"q": q.data_ptr(), "k": k.data_ptr(), "v": v.data_ptr()}
    grad_out = torch.randn(B, N, H, 2 * d, generator=g).transpose(1, 2)  # the gradient of a transposed output
    diff_attention(q, k, v, lam, causal=True, backend="cpu_fused").backward(grad_out)
    for t in (q, k, v):
        assert t.grad.stride() == t.stride(), (t.grad.stride(), t.stride())
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = diff_attention(*ref, lam.double(), causal=True, backend="naive")
    expected.backward(grad_out.double())
    torch.testing.assert_close(out.double(), expected.detach(), rtol=1e-5, atol=1e-5)
    for t, r in zip((q, k, v), ref):
        torch.testing.assert_close(t.grad.double(), r.grad, rtol=1e-4, atol=1e-5)


@needs_compiler
def test_the_same_numbers_on_any_thread_count_and_for_any_strides():
    """Each row is computed by one thread in a fixed order: the output does not depend on the thread count
    (bit for bit), nor on whether q, k, v are views into a fused projection."""
    B, H, N, d = 2, 4, 75, 64
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(B, N, 3 * 2 * H * d, generator=g)  # one fused projection, sliced as models do
    q, k, vv = qkv.split(2 * H * d, dim=-1)
    q, k = (t.unflatten(-1, (2 * H, d)).transpose(1, 2) for t in (q, k))
    v = vv.unflatten(-1, (H, 2 * d)).transpose(1, 2)
    assert not q.is_contiguous()
    lam = torch.tensor(0.3)
    outs = []
    for n in (1, 2, 3):
        with threads(n):
            outs.append(fused(q, k, v, lam, causal=True))
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert torch.equal(outs[0], fused(q.contiguous(), k.contiguous(), v.contiguous(), lam, causal=True))
    torch.testing.assert_close(outs[0].double(), reference(q, k, v, lam, causal=True), rtol=1e-5, atol=2e-6)


@needs_compiler
@pytest.mark.parametrize("Nq", [1, 3, 17, 512, 513])  # 513: one row past the row-major scores, through the tiles
@pytest.mark.parametrize("causal", [False, True])
def test_row_major_scores_and_the_tiles_give_the_formula(Nq, causal):
    """At most 512 query rows (decoding, a draft to verify, a chunk of a prompt, a short sequence): the kernel takes
    each score as a dot product along d without transposing k, and computes only the rows there are. Masks, GQA, a
    row that sees no key and thread counts behave as on the tiled path of longer calls."""
    B, H, Hkv, Nk = 2, 4, 2, 333
    q, k, v, lam = inputs(B, H, Hkv, Nq, Nk, 64, seed=3, lam_kind="token")
    mask = torch.rand(B, 1, Nq, Nk, generator=torch.Generator().manual_seed(4)) > 0.2
    mask[1, :, 0] = False  # a query that may attend to nothing
    for kw in ({}, {"attn_mask": mask}):
        out = fused(q, k, v, lam, causal=causal, **kw)
        torch.testing.assert_close(out.double(), reference(q, k, v, lam, causal=causal, **kw), rtol=1e-5, atol=2e-6)
    assert out[1, :, 0].abs().max() == 0
    with threads(3):
        assert torch.equal(fused(q, k, v, lam, causal=causal, attn_mask=mask), out)



def test_vector_floats_is_public_as_kernel_threads_is():
    """README and notebook 08 name ``cpu_fused.vector_floats()`` beside ``kernel_threads()``: it is in the module's
    ``__all__`` as that one is (a star import dropped it)."""
    assert {"kernel_threads", "vector_floats"} <= set(cpu_fused.__all__)


@needs_compiler
def test_the_kernel_is_built_for_the_widest_vectors_whose_tiles_stay_in_registers():
    """AVX-512 builds take 16-float vectors; every other target 8-float vectors and smaller tiles, which the narrow
    build gives on any CPU (``-DDIFFATTN_NARROW``): before, a build for AVX2 spilled its 16-float tiles to the stack on
    every step and ran about ten times slower than naive. The narrow build, in a child, equals naive's float64 answer
    forward and backward on both score paths and on any thread count."""
    from diffattn_tutorial.kernels.cpu import build

    # what the compiler targets with the build's flags (a compiler that refuses them builds without: 8-float vectors)
    macros = subprocess.run([*cpu_fused.compiler(), *build.NATIVE_FLAGS, "-dM", "-E", "-x", "c++", os.devnull],
                            capture_output=True, text=True)
    wide = macros.returncode == 0 and "__AVX512F__" in macros.stdout
    assert cpu_fused.vector_floats() == (16 if wide else 8)
    run = run_module("children.cpu_kernel_cases", ["narrow_build"], timeout=600)
    assert run.returncode == 0 and "narrow build ok" in run.stdout, run.stderr[-3000:]


@needs_compiler
def test_half_precision_inputs_are_computed_in_float32():
    q, k, v, lam = inputs(1, 2, 1, 30, 30, 32)
    for dtype in (torch.float16, torch.bfloat16):
        out = fused(q.to(dtype), k.to(dtype), v.to(dtype), lam, causal=True)
        assert out.dtype == dtype
        expected = reference(q.to(dtype), k.to(dtype), v.to(dtype), lam, causal=True)
        torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-2)


@needs_compiler
def test_auto_runs_it_for_float32_inference_and_training_with_heads_of_32_or_more():
    q, k, v, lam = inputs(1, 2, 1, 40, 40, 32)
    assert ("else cpu_fused for float32 inference and for training with a head dim of at least 32 and no learned "
            "mask, outside torch.func transforms, else sdpa_padded") in backend_status()["auto"][1]
    with torch.no_grad():
        assert torch.equal(diff_attention(q, k, v, lam), diff_attention(q, k, v, lam, backend="cpu_fused"))
    qg = q.clone().requires_grad_()
    out = diff_attention(qg, k, v, lam)
    assert "cpu_fused_forward" in type(out.grad_fn).__name__  # the operator's node in eager training
    assert torch.equal(out.detach(), diff_attention(q, k, v, lam, backend="cpu_fused"))
    out.sum().backward()
    assert qg.grad is not None and qg.grad.isfinite().all()
    q16, k16, v16, lam16 = inputs(1, 2, 1, 40, 40, backend_table.CPU_FUSED_TRAIN_MIN_HEAD_DIM - 1)  # narrow heads: sdpa_padded
    out = diff_attention(q16.requires_grad_(), k16, v16, lam16)
    assert "cpu_fused" not in type(out.grad_fn).__name__ and "CpuFused" not in type(out.grad_fn).__name__
    assert torch.equal(out, diff_attention(q16, k16, v16, lam16, backend="sdpa_padded"))


@needs_compiler
def test_what_it_cannot_do_is_refused_with_the_fix():
    q, k, v, lam = inputs(1, 2, 1, 8, 8, 32)
    with pytest.raises(TypeError, match=r"takes float32, float16 and bfloat16 \(it computes in float32\), got "
                                        r"float64; for float64 use backend='auto' or 'naive'"):
        fused(q.double(), k.double(), v.double(), lam)
    bias = torch.zeros(8, 8, requires_grad=True)
    with pytest.raises(ValueError, match="attn_mask requires grad .* backend 'cpu_fused' gives a mask no gradient"):
        diff_attention(q, k, v, lam, attn_mask=bias, backend="cpu_fused")
    with pytest.raises(ValueError, match="does not support attention dropout"):
        diff_attention(q, k, v, lam, backend="cpu_fused", dropout_p=0.1)


@needs_compiler
def test_a_kernel_that_computes_wrong_numbers_is_never_used():
    class Wrong:  # returns success without writing its output
        @staticmethod
        def diff_attention_cpu_forward(*args):
            return 0

    with pytest.raises(cpu_fused.KernelUnavailable, match="disagrees with the naive formula"):
        selfcheck.self_check(Wrong())


@needs_compiler
def test_the_build_is_cached_per_source_compiler_and_cpu():
    first = cpu_fused.library_path()
    mtime = first.stat().st_mtime_ns
    assert cpu_fused.library_path() == first and first.stat().st_mtime_ns == mtime  # not rebuilt


def test_without_a_compiler(monkeypatch, tmp_path):
    """No compiler (most Windows machines): the status says why, auto uses sdpa_padded, the name alone fails
    with the reason."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(cpu_fused.KernelUnavailable, match="could not be run"):
        cpu_fused.library_path()
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(cpu_fused.KernelUnavailable, match=r"no C\+\+ compiler found .* use backend='sdpa_padded'"):
        cpu_fused.library_path()

    def unavailable():
        raise cpu_fused.KernelUnavailable("no C++ compiler found (test)")

    monkeypatch.setattr(cpu_fused, "_kernel", unavailable)
    assert backend_status()["cpu_fused"] == (False, "no C++ compiler found (test)")
    q, k, v, lam = inputs(1, 2, 1, 8, 8, 32)
    with torch.no_grad():
        assert torch.equal(diff_attention(q, k, v, lam), diff_attention(q, k, v, lam, backend="sdpa_padded"))
        with pytest.raises(RuntimeError, match="'cpu_fused' is unavailable here: no C\\+\\+ compiler found"):
            diff_attention(q, k, v, lam, backend="cpu_fused")


# ---------------------------------------------------------------------------------------------------------------
# the kernel as a torch operator: it compiles, and auto keeps it under torch.compile
# ---------------------------------------------------------------------------------------------------------------

needs_dynamo = pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(), reason="torch.compile is not supported here")


@needs_compiler
def test_the_operator_passes_opcheck():
    """Schema, fake implementation (shape, dtype, strides) and AOT dispatch, for the layouts diff_attention passes:
    no mask, a broadcast bool mask, an additive per-head one, a padded head width, half precision. Autograd is
    checked in test_cpu_backward.py."""
    q, k, v, lam = inputs(1, 2, 1, 9, 11, 20, lam_kind="token")
    cases = [(q, k, v, lam, None, True), (q, k, v, lam, torch.rand(1, 1, 9, 11) > 0.3, False),
             (q, k, v, lam, torch.randn(1, 2, 9, 11), True),
             (q.half(), k.half(), v.half(), lam, None, False)]
    for q_, k_, v_, lam_, mask, causal in cases:
        torch.library.opcheck(cpu_fused.cpu_fused_forward, (q_, k_, v_, lam_, mask, causal, 20 ** -0.5),
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@needs_compiler
def test_the_operator_refuses_a_mask_that_requires_grad_by_name():
    q, k, v, lam = inputs(1, 2, 1, 8, 8, 32)
    bias = torch.zeros(8, 8, requires_grad=True)
    with pytest.raises(ValueError, match=r"attn_mask requires grad .* attn_mask.detach\(\)"):
        cpu_fused.fused_diff_attention(q.requires_grad_(), k, v, lam, attn_mask=bias, scale=0.2)
    with pytest.raises(ValueError, match=r"attn_mask requires grad"):  # the operator itself, as compiled code calls it
        torch.ops.diffattn.cpu_fused_forward(q, k, v, lam, bias, False, 0.2)


@needs_compiler
@needs_dynamo
def test_the_operator_keeps_lengths_symbolic_under_dynamic_compile():
    """A compiled step whose length grows every call (decoding without a cache) compiles once: the operator's input
    checks compare symbolic sizes instead of turning them into ints, which pinned each graph to one length (a
    recompile per token until torch's recompile limit)."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    step = torch.compile(lambda q, k, v, lam: diff_attention(q, k, v, lam, causal=True, backend="cpu_fused"),
                         backend=counting, dynamic=True, fullgraph=True)
    with torch.no_grad():
        for n in (33, 34, 35, 41):
            q, k, v, lam = inputs(1, 2, 1, n, n, 32)
            assert torch.equal(step(q, k, v, lam), diff_attention(q, k, v, lam, causal=True, backend="cpu_fused"))
    assert len(graphs) == 1, f"{len(graphs)} graphs for 4 lengths"


@needs_compiler
@needs_dynamo
@pytest.mark.parametrize("compiler", ["counting", pytest.param("inductor", marks=pytest.mark.slow)])  # ~7 s
def test_auto_runs_the_operator_under_torch_compile_fullgraph(compiler, monkeypatch):
    """Under torch.compile, auto fell back to sdpa_padded (a ctypes call would break the graph). Now the kernel is an
    operator: one node in one graph, the numbers bit for bit eager's (inductor: the graph compiled to C++)."""
    q, k, v, lam = inputs(2, 2, 1, 40, 40, 32, lam_kind="token")
    mask = torch.rand(40, 40, generator=torch.Generator().manual_seed(7)) > 0.2

    def f(q, k, v, lam, mask):
        return diff_attention(q, k, v, lam, causal=True, attn_mask=mask)  # backend="auto"

    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    calls = []
    real = boundary.forward
    monkeypatch.setattr(boundary, "forward", lambda *a: calls.append(1) or real(*a))
    torch._dynamo.reset()
    with torch.no_grad():
        eager = f(q, k, v, lam, mask)
        assert torch.equal(eager, diff_attention(q, k, v, lam, causal=True, attn_mask=mask, backend="cpu_fused"))
        calls.clear()
        compiled = torch.compile(f, fullgraph=True, **({"backend": counting} if compiler == "counting" else {}))
        assert torch.equal(compiled(q, k, v, lam, mask), eager)
    assert calls == [1]  # the kernel ran, once
    if compiler == "counting":
        (graph,) = graphs
        ops = [n.target for n in graph.graph.nodes if n.op == "call_function" and "diffattn" in str(n.target)]
        assert ops == [torch.ops.diffattn.cpu_fused_forward.default]


@needs_compiler
def test_the_operator_called_first_in_a_process_loads_a_working_kernel():
    """The kernel's first use may be a direct operator call, where autograd is off for the thread: the self-check
    of its backward used to fail there and leave the kernel unusable for the whole process."""
    done = run_module("children.cpu_kernel_cases", ["first_use_operator"],
                      env={**os.environ, "PYTHONPATH": str(package_root())}, timeout=600)
    assert done.returncode == 0 and done.stdout.split() == ["True", "True"], done.stdout + done.stderr[-2000:]


@needs_compiler
def test_a_first_use_under_torch_func_leaves_a_working_kernel():
    """The kernel's first use may be its status, asked inside a torch.func transform (``backend_status()`` in a
    function under ``grad`` or ``vmap``), where fresh tensors are the transform's, with no memory to hand the kernel:
    its self-check used to fail there and leave the kernel unusable for the whole process."""
    done = run_module("children.cpu_kernel_cases", ["first_use_under_torch_func"],
                      env={**os.environ, "PYTHONPATH": str(package_root())}, timeout=600)
    assert done.returncode == 0 and done.stdout.split() == ["True", "True", "True"], done.stdout + done.stderr[-2000:]


@needs_compiler
def test_a_nan_query_gives_a_nan_gradient_not_a_hidden_one():
    """The kernel turns a NaN query row into numbers and the output gets its NaN back; the gradient must too."""
    q, k, v, lam = inputs(1, 2, 1, 5, 5, 8)
    q[0, 0, 2, 0] = float("nan")
    q.requires_grad_()
    out = diff_attention(q, k, v, lam, backend="cpu_fused")
    out.sum().backward()
    assert out[0, 0, 2].isnan().all() and out[0, 0, [0, 1, 3, 4]].isfinite().all()
    assert q.grad[0, 0, 2, 0].isnan() and q.grad[0, 1:].isfinite().all()



@needs_compiler
def test_the_kernel_keeps_its_work_buffers_between_calls_and_frees_large_ones():
    """A call carves its buffers from a block kept for the calling thread's next call (no fresh pages to fault in),
    frees a block above the limit after its call, and ``release_buffers`` frees it at once."""
    env = {**os.environ, "PYTHONPATH": str(package_root()), "OMP_NUM_THREADS": "2"}
    done = run_module("children.cpu_kernel_cases", ["kept_buffers"], env=env, timeout=600)
    assert done.returncode == 0 and "KEPT OK" in done.stdout, done.stdout + done.stderr[-3000:]


def _projected(B, H, Hkv, N, d, seed=0):
    """q, k, v as a layer's projections give them: ``(B, N, heads * width)`` viewed as ``(B, heads, N, width)``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N, 2 * H * d, generator=g).view(B, N, 2 * H, d).transpose(1, 2)
    k = torch.randn(B, N, 2 * Hkv * d, generator=g).view(B, N, 2 * Hkv, d).transpose(1, 2)
    v = torch.randn(B, N, Hkv * 2 * d, generator=g).view(B, N, Hkv, 2 * d).transpose(1, 2)
    return q, k, v


@needs_compiler
@pytest.mark.parametrize("N", [5, 70])  # few rows (no transposed k: a scan of its own), and blocks with tails
@pytest.mark.parametrize("where", ["q map 1, first row", "q map 2, last row", "k map 1, last key",
                                   "k map 2, first key", "v, last key, last column", "nowhere"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("grad", [False, True])
def test_a_scanning_call_finds_every_nonfinite_input_and_else_gives_the_same_bits(N, where, value, grad):
    """``scan=True``: the kernel reads q, k and v once more as it goes and returns None where one entry is not
    finite (diff_attention then takes its careful path), wherever it sits (first or last row, either map, the
    value's last column, GQA's second group); otherwise the very output of the call without the scan."""
    q, k, v = _projected(1, 4, 2, N, 32)
    lam = torch.tensor(0.3)
    at = {"q map 1, first row": (q, (0, 6, 0, 3)), "q map 2, last row": (q, (0, 1, N - 1, 31)),
          "k map 1, last key": (k, (0, 2, N - 1, 0)), "k map 2, first key": (k, (0, 3, 0, 17)),
          "v, last key, last column": (v, (0, 1, N - 1, 63)), "nowhere": (None, None)}[where]
    if at[0] is not None:
        at[0][at[1]] = value
    with torch.enable_grad() if grad else torch.no_grad():
        ins = [t.detach().requires_grad_(grad) for t in (q, k, v)]
        scanned = cpu_fused.fused_diff_attention(*ins, lam, causal=False, scale=0.2, scan=True)
        plain = cpu_fused.fused_diff_attention(*ins, lam, causal=False, scale=0.2)
    if where == "nowhere":
        assert scanned is not None and torch.equal(scanned, plain)
        assert (scanned.grad_fn is not None) == grad
    else:
        assert scanned is None


@needs_compiler
def test_diff_attention_leaves_the_scan_to_the_kernel_and_keeps_its_contract(monkeypatch):
    """An eager CPU call on the kernel makes no summing pass of its own over q, k and v (the kernel scans them);
    a NaN still makes exactly the rows that read it NaN, in the output and in q's gradient."""
    from diffattn_tutorial import functional

    q, k, v = _projected(1, 2, 1, 40, 32)
    lam = torch.tensor(0.3)
    expected = reference(q, k, v, lam)
    monkeypatch.setattr(functional, "may_hold_nonfinite", lambda *t: pytest.fail("a pass of its own"))
    out = diff_attention(q, k, v, lam, backend="cpu_fused")
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=2e-6)
    q = q.clone().requires_grad_()
    with torch.no_grad():
        q[0, 1, 7, 0] = float("nan")
    out = diff_attention(q, k, v, lam, backend="cpu_fused")
    out.sum().backward()
    assert out[0, 0, 7].isnan().all() and out[0, 0, :7].isfinite().all() and out[0, 1].isfinite().all()
    assert q.grad[0, 1, 7, 0].isnan() and q.grad[0, 2:].isfinite().all()
