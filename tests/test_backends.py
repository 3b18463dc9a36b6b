"""The backend registry (``diffattn_tutorial.backends``): every entry says what its backend really does (a backend
declared forward-only refuses a gradient, one declared without dropout refuses it, the dtypes it lists are the
ones it takes, ...); ``"auto"`` and ``"sdpa"`` choose in the table's order; and a backend registered in a test shows
up in every list, status and ranking with nothing else edited."""

import dataclasses
import functools

import pytest
import torch
from forked import run_python

from diffattn_tutorial import backends
from diffattn_tutorial.backends import (
    FLOAT_DTYPES,
    Backend,
    Choice,
    Needs,
    auto_order,
    registered,
    registry,
    resolve,
)
from diffattn_tutorial.functional import (
    BACKENDS,
    FORWARD_ONLY,
    SDPA_FORMULATIONS,
    backend_status,
    diff_attention,
    resolve_backend,
)
from diffattn_tutorial.kernels.cpu import cpu_fused
from diffattn_tutorial.layers.attention import MultiheadDiffAttn

ENTRIES = {b.name: b for b in registry()}


@functools.cache
def fused_ok() -> bool:
    """Whether the fused CPU kernel builds here: asked when a test first needs it, not while pytest imports this
    file (asking builds the kernel)."""
    return backend_status("cpu")["cpu_fused"][0]


def usable_here(name):
    ok, why = backend_status("cpu")[name]
    if not ok:
        pytest.skip(f"{name} does not work here: {why}")
    return ENTRIES[name]


def inputs(dtype=torch.float32, seed=0, nq=6, nk=7):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, 4, nq, 8, generator=g), torch.randn(1, 2, nk, 8, generator=g)
    v = torch.randn(1, 1, nk, 16, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype), torch.tensor(0.3, dtype=dtype)


@pytest.fixture
def ran(monkeypatch):
    """The names of the backends that ran, in order: every registered ``run`` (and ``run_scanning``) wrapped by a
    recorder."""
    log = []

    def recorded(name, run):
        def recording(call):
            log.append(name)
            return run(call)

        return None if run is None else recording

    for name, b in list(backends._REGISTRY.items()):
        monkeypatch.setitem(backends._REGISTRY, name, dataclasses.replace(
            b, run=recorded(name, b.run), run_scanning=recorded(name, b.run_scanning)))
    return log


# ---------------------------------------------------------------------------------------------------------------
# every entry agrees with what its backend does
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ENTRIES)
def test_backward_as_declared(name):
    b = usable_here(name)
    q, k, v, lam = inputs()
    q.requires_grad_()
    if not b.backward:
        with pytest.raises(ValueError, match=f"backend '{name}' is forward-only .* torch.no_grad"):
            diff_attention(q, k, v, lam, backend=name)
        return
    (dq,) = torch.autograd.grad(diff_attention(q, k, v, lam, backend=name).square().sum(), q)
    assert dq.isfinite().all() and dq.abs().sum() > 0


@pytest.mark.parametrize("name", ENTRIES)
def test_dropout_as_declared(name):
    b = usable_here(name)
    q, k, v, lam = inputs()
    with torch.no_grad():
        if not b.dropout:
            with pytest.raises(ValueError, match=f"backend '{name}' does not support attention dropout"):
                diff_attention(q, k, v, lam, dropout_p=0.5, backend=name)
            return
        torch.manual_seed(0)
        dropped = diff_attention(q, k, v, lam, dropout_p=0.5, backend=name)
    assert not torch.allclose(dropped, diff_attention(q, k, v, lam, backend=name))  # dropout did something


@pytest.mark.parametrize("name", ENTRIES)
def test_learned_mask_gradient_as_declared(name):
    b = usable_here(name)
    q, k, v, lam = inputs()
    bias = torch.zeros(6, 7, requires_grad=True)
    if not b.mask_grad:
        with pytest.raises(ValueError, match=f"attn_mask requires grad .* backend '{name}' gives a mask no gradient"):
            diff_attention(q, k, v, lam, attn_mask=bias, backend=name)
        return
    (grad,) = torch.autograd.grad(diff_attention(q, k, v, lam, attn_mask=bias, backend=name).square().sum(), bias)
    assert grad.abs().sum() > 0


@pytest.mark.parametrize("name", ENTRIES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_dtypes_as_declared(name, dtype):
    b = usable_here(name)
    q, k, v, lam = inputs(dtype)
    with torch.no_grad():
        if dtype not in b.dtypes:
            with pytest.raises(TypeError, match=f"backend '{name}' takes .* got {str(dtype)[6:]}; .* 'naive'"):
                diff_attention(q, k, v, lam, backend=name)
            return
        out = diff_attention(q, k, v, lam, backend=name)
        expected = diff_attention(q.double(), k.double(), v.double(), lam.double(), backend="naive")
    assert out.dtype == dtype
    tol = 1e-9 if dtype == torch.float64 and b.compute_dtype is None else 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", ENTRIES)
def test_torch_compile_as_declared(name):
    """A backend declared to compile runs inside ``torch.compile(fullgraph=True)`` with eager's numbers; one
    declared not to cannot (when it becomes a registered operator, flip ``compiles``)."""
    usable_here(name)
    q, k, v, lam = inputs()
    f = torch.compile(lambda *t: diff_attention(*t, causal=True, backend=name), fullgraph=True, backend="eager")
    torch._dynamo.reset()
    with torch.no_grad():
        if not ENTRIES[name].compiles:
            with pytest.raises(Exception):
                f(q, k, v, lam)
            return
        assert torch.equal(f(q, k, v, lam), diff_attention(q, k, v, lam, causal=True, backend=name))


@pytest.mark.parametrize("name", ENTRIES)
def test_devices_and_status_as_declared(name):
    b = ENTRIES[name]
    ok, why = b.status(torch.device("cpu"))
    assert isinstance(ok, bool) and why
    assert backend_status("cpu")[name] == ((ok, why) if b.runs_on(torch.device("cpu")) else
                                           (False, backends.backend_status("cpu")[name][1]))
    meta = torch.device("meta")  # a device no backend names: only those declared for any device run there
    if not b.runs_on(meta):
        assert backend_status(meta)[name][0] is False and "only" in backend_status(meta)[name][1]
        q, k, v, lam = (t.to("meta") for t in inputs())
        with pytest.raises(ValueError, match=f"backend '{name}' runs on .* the inputs are on meta"):
            diff_attention(q, k, v, lam, backend=name)


def test_the_lists_are_views_of_the_registry():
    assert BACKENDS == ("naive", "sdpa", "sdpa_wide", "sdpa_split", "sdpa_stacked", "sdpa_padded", "chunked",
                        "triton", "cpu_fused")
    assert FORWARD_ONLY == tuple(n for n, b in ENTRIES.items() if not b.backward) == ()
    assert SDPA_FORMULATIONS == ("sdpa_wide", "sdpa_split", "sdpa_stacked")
    assert ("auto",) + BACKENDS == ("auto", *BACKENDS) and BACKENDS + ("auto",) == (*BACKENDS, "auto")
    assert repr(BACKENDS) == repr(tuple(BACKENDS)) and "sdpa" in BACKENDS and "auto" not in BACKENDS
    assert list(backend_status("cpu")) == [*BACKENDS, "auto"]


# ---------------------------------------------------------------------------------------------------------------
# what "auto" and "sdpa" choose
# ---------------------------------------------------------------------------------------------------------------

CPU_FUSED_OR_PADDED = "cpu_fused where it builds, else sdpa_padded"  # in a parameter list; see fused_or_padded


def fused_or_padded() -> str:
    return "cpu_fused" if fused_ok() else "sdpa_padded"


@pytest.mark.parametrize("device, needs, expected", [
    ("cpu", Needs(torch.float32), CPU_FUSED_OR_PADDED),
    ("cpu", Needs(torch.float32, compiling=True), CPU_FUSED_OR_PADDED),  # a registered operator: it compiles
    ("cpu", Needs(torch.float32, grad=True, head_dim=64), CPU_FUSED_OR_PADDED),  # the kernel has a backward
    ("cpu", Needs(torch.float32, grad=True, head_dim=16), "sdpa_padded"),  # ... measured slower for narrow heads
    ("cpu", Needs(torch.float32, grad=True), "sdpa_padded"),  # the head dim unknown
    ("cpu", Needs(torch.float32, mask_grad=True), "sdpa_padded"),
    ("cpu", Needs(torch.float64), "sdpa_padded"),
    ("cpu", Needs(torch.bfloat16), "sdpa_padded"),  # the kernel takes it, but auto is measured on float32 only
    ("cpu", Needs(torch.float32, dropout=True), "sdpa_wide"),
    ("cpu", backends.ANY_CALL, "sdpa_padded"),
    ("cuda", Needs(torch.float16), "sdpa_split"),
    ("cuda", Needs(torch.float32, grad=True), "sdpa_split"),
    ("cuda", Needs(torch.bfloat16, dropout=True), "sdpa_wide"),
    ("mps", Needs(torch.float32), "sdpa_split"),
])
def test_auto_chooses_in_order_what_takes_the_call(device, needs, expected):
    if expected == CPU_FUSED_OR_PADDED:
        expected = fused_or_padded()
    assert resolve("auto", device, needs) == expected


def test_sdpa_is_a_fixed_order_of_formulations_on_every_device():
    for device in ("cpu", "cuda"):
        assert resolve_backend("sdpa", device) == "sdpa_split"
        assert resolve_backend("sdpa", device, dropout=True) == "sdpa_wide"


def test_diff_attention_runs_what_auto_chooses(ran):
    q, k, v, lam = inputs()
    with torch.no_grad():
        diff_attention(q, k, v, lam)
        diff_attention(q.double(), k.double(), v.double(), lam)
        diff_attention(q, k, v, lam, attn_mask=torch.zeros(6, 7, requires_grad=True))  # no_grad: no gradient
    diff_attention(q.requires_grad_(), k, v, lam)
    diff_attention(q, k, v, lam, dropout_p=0.1)
    assert ran == [fused_or_padded(), "sdpa_padded", fused_or_padded(), "sdpa_padded", "sdpa_wide"]  # d = 8


def test_auto_decodes_one_query_row_with_naive_on_a_cpu(ran):
    """One query row (a decode step): naive, whatever the dtype or gradient (benchmarks/bench_cpu_queries.py);
    two rows: the ranking above. A GPU has no such rule."""
    q, k, v, lam = inputs(nq=1)
    with torch.no_grad():
        diff_attention(q, k, v, lam)
    diff_attention(q.requires_grad_(), k, v, lam, dropout_p=0.1)
    with torch.no_grad():
        diff_attention(*inputs(nq=2))
    assert ran == ["naive", "naive", fused_or_padded()]
    assert resolve("auto", "cpu", Needs(torch.float32, queries=1)) == "naive"
    assert resolve("auto", "cpu", Needs(torch.float32)) == fused_or_padded()  # the number of rows unknown
    assert resolve("auto", "cuda", Needs(torch.float16, queries=1)) == "sdpa_split"


def test_auto_skips_a_backend_that_does_not_work_here(monkeypatch, ran):
    def unavailable():
        raise cpu_fused.KernelUnavailable("no C++ compiler found (test)")

    monkeypatch.setattr(cpu_fused, "_kernel", unavailable)
    with torch.no_grad():
        diff_attention(*inputs())
    assert ran == ["sdpa_padded"]
    assert backend_status("cpu")["auto"] == (True, "-> naive for calls with one query row (decoding), else "
                                                  "sdpa_padded (sdpa_wide with dropout)")


def test_the_prose_comes_from_the_registry():
    assert backends.describe_auto("cpu") == ('On a CPU, `backend="auto"` runs `naive` for calls with one query row '
                                             '(decoding), else `cpu_fused` for float32 inference and for training '
                                             'with a head dim of at least 32 and no learned mask, outside torch.func '
                                             'transforms (needs a C++ compiler), else `sdpa_padded` (`sdpa_wide` '
                                             'with dropout).')
    assert backends.describe_auto("cuda") == 'On a GPU, `backend="auto"` runs `sdpa_split` (`sdpa_wide` with dropout).'
    for ask in (backends.describe_auto, backends.backend_status, backends.auto_order):
        with pytest.raises(ValueError, match="device 'gpu' is not a torch device: give 'cpu', 'cuda'"):
            ask("gpu")
    table = backends.backend_table().splitlines()
    assert [row.split(" | ")[0] for row in table[2:]] == [f"| `{n}`" for n in (*BACKENDS, "auto")]
    assert "| float32, float16, bfloat16 (computed in float32) | yes | no | no | yes | no |" in table[2 + BACKENDS.index(
        "cpu_fused")]
    if fused_ok():
        assert backend_status("cpu")["auto"][1] == ("-> naive for calls with one query row (decoding), else cpu_fused "
                                                    "for float32 inference and for training with a head dim of at least 32 and no "
                                                    "learned mask, outside torch.func transforms, else sdpa_padded (sdpa_wide "
                                                    "with dropout)")


# ---------------------------------------------------------------------------------------------------------------
# a backend registered here appears everywhere, with nothing else edited
# ---------------------------------------------------------------------------------------------------------------


def fake_backend(**fields):
    def run(call):  # naive's numbers, times 2: recognisable
        return 2 * ENTRIES["naive"].run(call)

    declared = {"name": "fake", "summary": "a test's backend", "run": run, "backward": False,
                "dtypes": (torch.float64,)}
    return Backend(**{**declared, **fields})


def second_on_a_cpu(name="fake"):
    """``"auto"``'s order on a CPU with ``name`` tried right after naive's decoding rule."""
    return {"cpu": (auto_order("cpu")[0], Choice(name), *auto_order("cpu")[1:])}


def test_a_registered_backend_appears_in_every_list_status_and_ranking(ran):
    def status(device):
        return True, "fake status"

    with registered(fake_backend(status=status), auto=second_on_a_cpu()):
        assert BACKENDS[-1] == "fake" and "fake" in FORWARD_ONLY and "fake" not in SDPA_FORMULATIONS
        assert backend_status("cpu")["fake"] == (True, "fake status")
        assert backend_status("cpu")["auto"][1].startswith("-> naive for calls with one query row (decoding), else "
                                                           "fake for float64 inference, ")
        assert "`fake` for float64 inference" in backends.describe_auto("cpu")
        assert "| `fake` | a test's backend | any device | float64 | no |" in backends.backend_table()
        q, k, v, lam = inputs(torch.float64)
        with torch.no_grad():
            out = diff_attention(q, k, v, lam)  # tried first on a CPU, and it takes float64 inference
            diff_attention(q.float(), k.float(), v.float(), lam)  # not float64: the next in order
        torch.testing.assert_close(out, 2 * diff_attention(q, k, v, lam, backend="naive"))  # fake's numbers
        assert ran[0] == fused_or_padded()  # (``ran`` records the backends registered before it)
        assert resolve_backend("auto", "cpu") == "sdpa_padded"  # any call: it has no backward
        assert MultiheadDiffAttn(32, 2, depth=0, backend="fake").backend == "fake"
        with pytest.raises(ValueError, match="'fake' is forward-only .* use backend='auto' or 'sdpa_padded'"):
            diff_attention(q.requires_grad_(), k, v, lam, backend="fake")
    assert "fake" not in BACKENDS and "fake" not in backend_status("cpu")
    with pytest.raises(ValueError, match="unknown backend 'fake'"):
        diff_attention(*inputs(), backend="fake")


def test_a_registered_backend_that_does_not_work_here_is_skipped_by_auto(ran):
    with registered(fake_backend(status=lambda device: (False, "broken (test)")), auto=second_on_a_cpu()):
        assert backend_status("cpu")["fake"] == (False, "broken (test)")
        q, k, v, lam = inputs(torch.float64)
        with torch.no_grad():
            diff_attention(q, k, v, lam)
            with pytest.raises(RuntimeError, match="backend 'fake' is unavailable here: broken"):
                diff_attention(q, k, v, lam, backend="fake")
    assert ran == ["sdpa_padded"]


def test_registering_refuses_what_would_be_ambiguous():
    with pytest.raises(ValueError, match="already registered"):
        backends.register_backend(fake_backend(name="naive"))
    for name in ("auto", "sdpa", "not a name"):
        with pytest.raises(ValueError, match="must be an identifier other than"):
            fake_backend(name=name)
    with pytest.raises(ValueError, match="causal must be one of"):
        fake_backend(causal="top_left")
    with pytest.raises(ValueError, match="dtypes must be some of its dtypes"):
        backends.register_backend(fake_backend(), auto={"cpu": (Choice("fake", dtypes=(torch.float32,)),)})
    with pytest.raises(ValueError, match="names 'missing', which is not registered"):
        backends.register_backend(fake_backend(), auto={"cpu": (Choice("missing"),)})
    for key in ("gpu", "cuda:0", 0):  # never a call's device type: auto's order for it would never be read
        with pytest.raises(ValueError, match=f"auto's key {key!r} is not a device type"):
            backends.register_backend(fake_backend(), auto={key: (Choice("fake"),)})
    for order in ("fake", Choice("fake"), (), ("fake",)):
        with pytest.raises(TypeError, match="auto\\['cpu'\\] must be a non-empty tuple of Choice"):
            backends.register_backend(fake_backend(), auto={"cpu": order})
    assert "fake" not in BACKENDS and auto_order("cpu") == backends.AUTO["cpu"]  # nothing half-registered
    with pytest.raises(TypeError, match="takes a Backend"):
        backends.register_backend("naive")


@pytest.mark.parametrize("wrong", ["shape", "dtype", "not a tensor"])
def test_a_registered_backend_that_returns_the_wrong_result_is_named(wrong):
    """diff_attention checks a registered backend's result (the table's are tested): a wrong shape or dtype raises,
    naming the backend and what it must return, instead of flowing into the caller's model."""
    bad = {"shape": lambda call: torch.zeros(1, 1, 1, 1, dtype=call.q.dtype),
           "dtype": lambda call: ENTRIES["naive"].run(call).float(),
           "not a tensor": lambda call: None}[wrong]
    with registered(fake_backend(run=bad)):
        with pytest.raises(RuntimeError, match="backend 'fake' returned .*; its run must return \\(B, H, Nq, 2d\\)"):
            diff_attention(*inputs(torch.float64), backend="fake")


def test_importing_the_library_does_not_import_the_compiler():
    """Marking the status functions with torch.compiler.assume_constant_result imported torch._dynamo (and sympy)
    with the library: a second more per import, and another allocator state in every process (it showed in
    test_cpu's peak-memory figures). The mark is set without it, and is the one the decorator sets."""
    code = ("import sys; import diffattn_tutorial, diffattn_tutorial.kernels.cpu.cpu_fused, diffattn_tutorial.cli; "
            "print('torch._dynamo' in sys.modules)")
    done = run_python(code)  # forked from a process that imported torch only
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr[-2000:]
    marked = backends.constant_under_compile(lambda: 0)
    assert vars(torch.compiler.assume_constant_result(lambda: 0)) == vars(marked) == {"_dynamo_marked_constant": True}


@pytest.mark.parametrize("training", [False, True])
def test_a_choice_says_whether_auto_trains_with_its_backend(training):
    """A backend with a backward can still be ``"auto"``'s choice for inference only (``Choice.training=False``):
    the rule and the prose say which."""
    fake = fake_backend(backward=True, dtypes=FLOAT_DTYPES)
    order = {"cpu": (Choice("fake", dtypes=(torch.float64,), training=training), *auto_order("cpu"))}
    with registered(fake, auto=order):
        assert resolve("auto", "cpu", Needs(torch.float64)) == "fake"
        assert resolve("auto", "cpu", Needs(torch.float64, grad=True)) == ("fake" if training else "sdpa_padded")
        assert backends.describe_auto("cpu").startswith(
            f'On a CPU, `backend="auto"` runs `fake` for float64 {"calls" if training else "inference"}, else')
