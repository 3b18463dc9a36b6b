"""``torch.func`` transforms (``grad``, ``vmap``, ``jacrev``, ``jvp``, ``jacfwd``, ``hessian``, nested ones) and
``torch.autograd.forward_ad`` through ``diff_attention`` and the layers: every backend made of PyTorch ops runs under
them and equals naive's answer with autograd's gradients, ``vmap`` over any one input alone included; the kernels,
which hand their inputs' memory to compiled code, are refused by name, and ``auto`` runs a PyTorch backend there
instead, inside ``torch.compile`` too. Per-sample gradients of a layer (``vmap(grad(...))`` over
``functional_call``, the torch.func recipe) equal a loop of backward calls."""

import pytest
import torch
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vmap

from diffattn_tutorial import backend_table, backends
from diffattn_tutorial.functional import diff_attention
from diffattn_tutorial.layers.attention import DiffAttnV2, MultiheadDiffAttn

CPU = torch.device("cpu")
PYTORCH_BACKENDS = [n for n in backends.BACKENDS if n != "sdpa" and backends.get_backend(n).transforms
                    and backends.get_backend(n).runs_on(CPU)]
KERNELS = [n for n in backends.BACKENDS if n != "sdpa" and not backends.get_backend(n).transforms]
pytestmark = [pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),  # SDPA under vmap
              pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")]  # jacfwd


def inputs(B=2, H=2, nq=5, nk=7, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, 2 * H, nq, d, generator=g), torch.randn(B, 2 * H, nk, d, generator=g)
    return q, k, torch.randn(B, H, nk, 2 * d, generator=g), torch.rand(B, H, nq, 1, generator=g)


def mask_with_a_hidden_row(nq=5, nk=7):
    mask = torch.rand(nq, nk, generator=torch.Generator().manual_seed(1)) > 0.4
    mask[1] = False  # a row that sees no key: zeros, and zero gradients
    mask[:, 0] = mask[:, 0] | (torch.arange(nq) != 1)
    return mask


def test_the_kernels_are_the_backends_that_do_not_take_transforms():
    assert set(KERNELS) == {"cpu_fused", "triton"}
    assert "naive" in PYTORCH_BACKENDS and "sdpa_padded" in PYTORCH_BACKENDS


@pytest.mark.parametrize("backend", PYTORCH_BACKENDS)
@pytest.mark.parametrize("masking", ["causal", "mask"])
def test_grad_under_torch_func_equals_autograd_on_naive(backend, masking):
    q, k, v, lam = inputs()
    kw = dict(causal=True) if masking == "causal" else dict(attn_mask=mask_with_a_hidden_row())
    w = torch.randn(2, 2, 5, 16, generator=torch.Generator().manual_seed(2))

    def loss(q, k, v, lam, backend):
        return (diff_attention(q, k, v, lam, backend=backend, **kw) * w).sum()

    got = grad(loss, argnums=(0, 1, 2, 3))(q, k, v, lam, backend)
    ins = [t.clone().requires_grad_() for t in (q, k, v, lam)]
    expected = torch.autograd.grad(loss(*ins, "naive"), ins)
    for name, a, b in zip("q k v lam".split(), got, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{backend} d{n}: {m}")
    if masking == "mask":
        assert got[0][:, :, 1].abs().sum() == 0  # the hidden row's query: no gradient


@pytest.mark.parametrize("backend", PYTORCH_BACKENDS)
def test_vmap_over_a_batch_of_problems_equals_one_call_each(backend):
    """Batched q, k, v, lambda and mask (the mask's row that sees nothing in one problem only)."""
    problems = [inputs(B=1, seed=s) for s in range(3)]
    masks = torch.stack([mask_with_a_hidden_row(), torch.ones(5, 7, dtype=torch.bool),
                         torch.ones(5, 7, dtype=torch.bool).tril(2)])  # the last: causal, aligned bottom-right
    stacked = [torch.stack(ts) for ts in zip(*problems)]
    got = vmap(lambda q, k, v, lam, m: diff_attention(q, k, v, lam, attn_mask=m, backend=backend))(*stacked, masks)
    for i, (q, k, v, lam) in enumerate(problems):
        torch.testing.assert_close(got[i], diff_attention(q, k, v, lam, attn_mask=masks[i], backend="naive"),
                                   atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", PYTORCH_BACKENDS + ["auto"])
def test_vmap_over_lambda_alone_equals_one_call_each(backend):
    """q, k and v shared (in_dims None), a batch of lambdas: a sweep over lambda (sdpa_padded's inference path
    wrote lam * o2 into the unbatched o2 in place, which vmap refuses)."""
    q, k, v, _ = inputs()
    lams = torch.tensor([0.1, 0.5, 0.9])
    got = vmap(lambda lam: diff_attention(q, k, v, lam, causal=True, backend=backend))(lams)
    for i, lam in enumerate(lams):
        torch.testing.assert_close(got[i], diff_attention(q, k, v, lam, causal=True, backend="naive"),
                                   atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", PYTORCH_BACKENDS + ["auto"])
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_vmap_over_the_mask_alone_equals_one_call_each(backend, kind):
    """q, k, v and lambda shared, a batch of masks (chunked wrote the batched mask into the unbatched scores in
    place, which vmap refuses)."""
    q, k, v, lam = inputs()
    masks = torch.stack([mask_with_a_hidden_row(), torch.ones(5, 7, dtype=torch.bool).tril(2)])
    if kind == "additive":
        masks = torch.zeros(masks.shape).masked_fill(~masks, float("-inf"))
    got = vmap(lambda m: diff_attention(q, k, v, lam, attn_mask=m, backend=backend))(masks)
    for i, m in enumerate(masks):
        torch.testing.assert_close(got[i], diff_attention(q, k, v, lam, attn_mask=m, backend="naive"),
                                   atol=1e-5, rtol=1e-4)


def test_jacrev_through_auto_equals_naives():
    q, k, v, lam = inputs(B=1, H=1, nq=3, nk=4, d=4)
    f = lambda backend: lambda q: diff_attention(q, k, v, lam, causal=True, backend=backend)  # noqa: E731
    torch.testing.assert_close(jacrev(f("auto"))(q), jacrev(f("naive"))(q), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_the_kernels_are_refused_by_name_under_transforms(backend, transform):
    q, k, v, lam = inputs()
    call = lambda q: diff_attention(q, k, v, lam, backend=backend)  # noqa: E731
    with pytest.raises(ValueError, match=rf"backend '{backend}' does not run under torch.func transforms .*"
                                         r"use backend='auto' or '\w+' there"):
        if transform == "grad":
            grad(lambda q: call(q).sum())(q)
        else:
            vmap(call)(torch.stack([q, q]))  # two problems


def test_auto_runs_a_pytorch_backend_under_transforms_where_it_would_run_the_kernel():
    training = backend_table.Needs(dtype=torch.float32, grad=True, queries=64, head_dim=64)
    assert backends.resolve("auto", CPU, training._replace(transforms=True)) == "sdpa_padded"
    inference = backend_table.Needs(dtype=torch.float32, queries=64, head_dim=64, transforms=True)
    assert backends.resolve("auto", CPU, inference) == "sdpa_padded"
    assert "cpu_fused` for float32 inference and for training with a head dim of at least" in \
           backends.describe_auto(CPU) and ", outside torch.func transforms" in backends.describe_auto(CPU)


@pytest.mark.parametrize("layer", [MultiheadDiffAttn, DiffAttnV2])
def test_per_sample_gradients_of_a_layer_equal_a_loop_of_backward_calls(layer):
    """The torch.func recipe for per-sample gradients, at a head dim where ``auto`` trains on the kernel outside
    transforms (``MultiheadDiffAttn(128, 2)``: 128 / 2 heads / 2 maps = 32)."""
    torch.manual_seed(0)
    m = layer(128, 2)
    x = torch.randn(3, 6, 128)
    params = {n: p.detach() for n, p in m.named_parameters()}

    def loss(p, xi):
        return functional_call(m, p, (xi.unsqueeze(0),), {"causal": True}).square().mean()

    per_sample = vmap(grad(loss), in_dims=(None, 0))(params, x)
    for i in range(len(x)):
        m.zero_grad()
        loss(dict(m.named_parameters()), x[i]).backward()
        for n, p in m.named_parameters():
            torch.testing.assert_close(per_sample[n][i], p.grad, atol=1e-6, rtol=1e-5, msg=lambda s, n=n: f"{n}: {s}")


def test_vmap_over_some_parameters_of_a_layer_in_inference():
    """``vmap`` over the sub-norm's weight alone (the other parameters shared, ``in_dims`` None) without gradients:
    the layer's in-place sub-norm wrote the batched weight into the unbatched attention output, which vmap refuses.
    Over the lambda vectors alone too (sdpa_padded's in-place lambda)."""
    torch.manual_seed(0)
    m = MultiheadDiffAttn(32, 2)
    x = torch.randn(2, 5, 32)
    params = {n: p.detach() for n, p in m.named_parameters()}
    for batched in (("subln.weight",), ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")):
        stacked = {n: torch.stack([p, 2 * p]) if n in batched else p for n, p in params.items()}
        dims = ({n: 0 if n in batched else None for n in params},)
        with torch.no_grad():
            got = vmap(lambda p: functional_call(m, p, (x,), {"causal": True}), in_dims=dims)(stacked)
            for i in range(2):
                one = {n: p[i] if n in batched else p for n, p in stacked.items()}
                torch.testing.assert_close(got[i], functional_call(m, one, (x,), {"causal": True}),
                                           atol=1e-5, rtol=1e-4, msg=lambda s, b=batched: f"{b}: {s}")


@pytest.mark.parametrize("backend", PYTORCH_BACKENDS + ["auto", "sdpa"])
def test_forward_mode_transforms_equal_naives(backend):
    """jvp, jacfwd and hessian (jacfwd over jacrev): SDPA's fused CPU kernel has no forward-mode derivative
    (NotImplementedError from PyTorch, through auto too); the SDPA backends run SDPA's math kernel there."""
    q, k, v, lam = inputs(B=1, H=1, nq=3, nk=4, d=4)
    t = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    f = lambda b: lambda q: diff_attention(q, k, v, lam, causal=True, backend=b)  # noqa: E731
    torch.testing.assert_close(jvp(f(backend), (q,), (t,))[1], jvp(f("naive"), (q,), (t,))[1], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(jacfwd(f(backend))(q), jacrev(f("naive"))(q), atol=1e-5, rtol=1e-4)
    loss = lambda b: lambda q: f(b)(q).square().sum()  # noqa: E731
    torch.testing.assert_close(hessian(loss(backend))(q), hessian(loss("naive"))(q), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layer", [MultiheadDiffAttn, DiffAttnV2])
def test_jvp_through_a_layer_equals_naives(layer):
    torch.manual_seed(0)
    m = layer(32, 2)
    x, t = torch.randn(1, 4, 32), torch.randn(1, 4, 32)
    got = jvp(lambda x: m(x, causal=True), (x,), (t,))[1]
    m.backend = "naive"
    torch.testing.assert_close(got, jvp(lambda x: m(x, causal=True), (x,), (t,))[1], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", [*PYTORCH_BACKENDS, "auto", *KERNELS])
def test_forward_ad_dual_tensors_get_their_tangent_or_a_refusal(backend):
    """torch.autograd.forward_ad's dual tensors (no torch.func wrapper): the kernels dropped the tangent without a
    word (auto ran cpu_fused there, a None tangent); now they are refused by name and auto runs a PyTorch backend."""
    import torch.autograd.forward_ad as fwAD

    q, k, v, lam = inputs(B=1, H=2, nq=6, nk=6, d=32)
    t = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    expected = jvp(lambda q: diff_attention(q, k, v, lam, backend="naive"), (q,), (t,))[1]
    with fwAD.dual_level():
        if backend in KERNELS:
            with pytest.raises(ValueError, match=f"backend '{backend}' does not run under torch.func transforms"):
                diff_attention(fwAD.make_dual(q, t), k, v, lam, backend=backend)
            return
        out = diff_attention(fwAD.make_dual(q, t), k, v, lam, backend=backend)
        tangent = fwAD.unpack_dual(out).tangent
    assert tangent is not None
    torch.testing.assert_close(tangent, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", PYTORCH_BACKENDS + ["auto", "sdpa"])
def test_second_derivatives_by_nested_transforms_equal_naives(backend):
    """grad of grad and jacrev of jacrev: SDPA's flash CPU kernel's backward has no derivative (PyTorch's
    RuntimeError through auto too); the SDPA backends run SDPA's math kernel under two nested grad transforms."""
    q, k, v, lam = inputs(B=1, H=1, nq=3, nk=4, d=4)
    f = lambda b: lambda q: diff_attention(q, k, v, lam, causal=True, backend=b)  # noqa: E731
    gg = lambda b: grad(lambda q: grad(lambda q: f(b)(q).square().sum())(q).sin().sum())(q)  # noqa: E731
    torch.testing.assert_close(gg(backend), gg("naive"), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(jacrev(jacrev(f(backend)))(q), jacrev(jacrev(f("naive")))(q), atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(), reason="torch.compile is not supported here")
@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_a_transform_inside_torch_compile_runs_a_pytorch_backend_under_auto(transform):
    """``torch.compile(fullgraph=True)`` of a function that applies a transform: the transform is traced into the
    graph, and ``auto`` must see it there too (the kernel's operator has no rule for a transform)."""
    q, k, v, lam = inputs(B=1, H=2, nq=40, nk=40, d=32)  # a head dim where auto would train on the kernel

    def f(backend):
        call = lambda q: diff_attention(q, k, v, lam, causal=True, backend=backend)  # noqa: E731
        return (lambda q: grad(lambda q: call(q).sum())(q)) if transform == "grad" else vmap(call)

    x = q if transform == "grad" else torch.stack([q, q.flip(2)])
    torch.testing.assert_close(torch.compile(f("auto"), backend="eager", fullgraph=True)(x), f("naive")(x),
                               atol=1e-5, rtol=1e-4)
