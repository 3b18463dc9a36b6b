"""The fused CPU kernel's backward (``diffattn::cpu_fused_backward``): gradients to q, k, v and lam equal the naive
formula's in float64 over shapes, layouts (views of a fused projection, slices, expanded tensors), masks (bool,
additive, causal, key padding, fully masked rows), GQA, ``Nq != Nk`` and lambda shapes; they do not depend on the
thread count; ``opcheck`` passes and ``torch.compile(fullgraph=True)`` trains through the operators. The property
test runs in a child process (the kernel reads raw pointers: a crash fails one test, not pytest). Its speed is
measured by ``benchmarks/bench_cpu_train.py``, not here."""

import os

import pytest
import torch
from forked import run_module

from diffattn_tutorial.functional import diff_attention
from diffattn_tutorial.kernels.cpu import boundary, cpu_fused
from diffattn_tutorial.measure.cpu_threads import threads

pytestmark = pytest.mark.skipif(cpu_fused.compiler() is None, reason="no C++ compiler here (test_cpu_kernel covers "
                                                                     "that)")


def inputs(B, H, Hkv, Nq, Nk, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, 2 * H, Nq, d, generator=g), torch.randn(B, 2 * Hkv, Nk, d, generator=g),
            torch.randn(B, Hkv, Nk, 2 * d, generator=g), torch.rand(B, H, Nq, 1, generator=g))


def test_gradients_equal_naives_in_float64_on_any_thread_count():
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    proc = run_module("children.cpu_backward_property", ["60"], env=env, timeout=900)
    assert proc.returncode == 0, f"exit status {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "PROPERTY OK" in proc.stdout



def test_gradients_summed_over_row_groups_and_heads_equal_naives():
    """Many row blocks per head: the partial sums of dk and dv of every group of row blocks (and of every head of a
    GQA group) add up to naive's gradients, with the same bits on 1 and 3 threads."""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    proc = run_module("children.cpu_backward_cases", ["groups"], env=env, timeout=600)
    assert proc.returncode == 0, f"exit status {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "GROUPS OK" in proc.stdout


def test_a_scalar_lambdas_gradient_does_not_depend_on_the_thread_count():
    """lam's gradient sums the kernel's per-row dlam over B * H * Nq rows: in a fixed order, the same bits on 1, 2
    and 3 threads (torch's own sum splits the work by thread count)."""
    q, k, v, _ = inputs(4, 8, 8, 4096, 7, 32)
    got = []
    for n in (1, 2, 3):
        lam = torch.tensor(0.4, requires_grad=True)
        with threads(n):
            diff_attention(q, k, v, lam, backend="cpu_fused").sum().backward()
        got.append(lam.grad.item())
    assert got[0] == got[1] == got[2], got



def test_an_empty_batch_gives_empty_gradients_not_a_crash():
    """B = 0 reaches the kernel through the operators (diff_attention sends it to the reference instead)."""
    proc = run_module("children.cpu_backward_cases", ["empty"], timeout=300)
    assert proc.returncode == 0 and "EMPTY OK" in proc.stdout, f"exit {proc.returncode}: {proc.stderr[-3000:]}"


def test_half_precision_gradients_come_back_in_the_inputs_dtype():
    q, k, v, lam = inputs(1, 2, 1, 30, 30, 32)
    ins = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    diff_attention(*ins, lam, causal=True, backend="cpu_fused").float().sum().backward()
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    diff_attention(*ref, lam.double(), causal=True, backend="naive").sum().backward()
    for a, b in zip(ins, ref):
        assert a.grad.dtype == torch.bfloat16
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=3e-2, atol=3e-2)


def test_the_operators_pass_opcheck_with_autograd():
    """Schema, fake implementations, autograd registration and AOT dispatch (forward and backward compared with
    eager), for a padded head width, GQA, a mask and per-token, per-head and scalar lambdas."""
    q, k, v, lam = inputs(1, 2, 1, 9, 11, 20)
    mask = torch.rand(1, 1, 9, 11, generator=torch.Generator().manual_seed(1)) > 0.2
    cases = [(q, k, v, lam, None, True), (q, k, v, lam[:1, :, :1], mask, False), (q, k, v, torch.tensor(0.3), None,
                                                                                  False)]
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    for q_, k_, v_, lam_, m, causal in cases:
        args = (q_.requires_grad_(), k_.requires_grad_(), v_.requires_grad_(), lam_.requires_grad_(), m, causal,
                20 ** -0.5)
        torch.library.opcheck(cpu_fused.cpu_fused_forward, args, test_utils=utils)
    grad_out = torch.randn(1, 2, 9, 40)
    torch.library.opcheck(cpu_fused.cpu_fused_backward, (grad_out, q.detach(), k.detach(), v.detach(),
                                                         lam.detach(), mask, True, 0.25),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_a_second_derivative_is_refused_with_the_fix():
    """``create_graph=True`` builds the first gradients as usual; differentiating them again (a gradient penalty)
    names what to use instead, not torch's "no autograd formula was registered"."""
    q, k, v, lam = (t.requires_grad_() for t in inputs(1, 2, 1, 9, 9, 32))
    out = diff_attention(q, k, v, lam, backend="cpu_fused")
    (gq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match=r"no second derivative .* backend='naive'\) there") as refused:
        gq.sum().backward()
    named = refused.value.args[0].split("backend='")[1].split("'")[0]
    leaves = [t.detach().requires_grad_() for t in (q, k, v, lam)]  # the backend it names takes the penalty
    (gq,) = torch.autograd.grad(diff_attention(*leaves, backend=named).square().sum(), leaves[0], create_graph=True)
    gq.sum().backward()
    assert all(t.grad is not None and t.grad.isfinite().all() for t in leaves[1:3])


@pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(), reason="torch.compile is not supported here")
def test_torch_compile_fullgraph_trains_through_the_operators():
    """A training step compiled with fullgraph=True (auto's choice: the kernel): the graph holds the forward
    operator, its backward runs the backward operator, and the gradients equal eager's."""
    q, k, v, lam = inputs(1, 2, 1, 40, 40, 32)

    def loss(q, k, v, lam):
        return diff_attention(q, k, v, lam, causal=True).square().mean()  # backend="auto"

    def gradients(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, lam)]
        fn(*leaves).backward()
        return [t.grad for t in leaves]

    eager = gradients(loss)
    calls = []
    real = boundary.backward
    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    try:
        boundary.backward = lambda *a: calls.append(1) or real(*a)
        got = gradients(compiled)
    finally:
        boundary.backward = real
    assert calls == [1]
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_rule_benchmark_writes_what_it_timed(tmp_path, monkeypatch):
    """``bench_cpu_train.py --rule`` (what ``auto``'s head-dim rule for training rests on): every shape timed on both
    backends, the ratio the medians' ratio, the file saying how it was made. Tiny shapes; the times mean nothing."""
    import importlib.util
    import json
    import statistics
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_cpu_train.py"
    spec = importlib.util.spec_from_file_location("bench_cpu_train", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "RULE_SHAPES", [(1, 1, 8, 8), (1, 1, 4, 32)])
    out = tmp_path / "rule.json"
    assert bench.main(["--rule", "--rounds", "2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {"device", "torch", "python", "date", "command", "threads"} <= set(data)
    assert [(r["B"], r["H"], r["N"], r["d"]) for r in data["rows"]] == [(1, 1, 8, 8), (1, 1, 4, 32)]
    for r in data["rows"]:
        assert all(len(r["times_s"][name]) == 2 for name in ("cpu_fused", "sdpa_padded"))
        med = {name: statistics.median(ts) for name, ts in r["times_s"].items()}
        assert r["sdpa_padded_over_cpu_fused"] == pytest.approx(med["sdpa_padded"] / med["cpu_fused"])


def test_the_rule_benchmark_with_flags_names_its_file_after_them(tmp_path, monkeypatch):
    """``--rule --flags=...`` (another build's tiles) wrote the default rule file, over the native build's record, and
    did not say which build it timed; its file's name now ends in the flags, as the other run's does, and says them."""
    import importlib.util
    import json
    from pathlib import Path

    from diffattn_tutorial.kernels.cpu import build

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_cpu_train.py"
    spec = importlib.util.spec_from_file_location("bench_cpu_train", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "RULE_SHAPES", [(1, 1, 8, 32)])
    monkeypatch.setattr(bench, "HERE", tmp_path)
    monkeypatch.setattr(build, "NATIVE_FLAGS", build.NATIVE_FLAGS)  # main sets it; restored after
    flags = " ".join(build.NATIVE_FLAGS)  # the loaded kernel's own: nothing is built again
    assert bench.main(["--rule", "--rounds", "1", f"--flags={flags}"]) == 0
    written = [p.name for p in tmp_path.iterdir()]
    assert written == [f"results_cpu_train_rule_{bench.timing.slug(bench.timing.device_name('cpu'))}_"
                       f"{bench.timing.slug(flags)}.json"], written
    data = json.loads((tmp_path / written[0]).read_text())
    assert data["kernel"] == {"flags": list(build.NATIVE_FLAGS), "vector_floats": cpu_fused.vector_floats(),
                              "compiler": build.compiler_version()}
    assert data["kernel"]["compiler"] and data["cpu"] == bench.timing.cpu_identity() and data["cpu"]["name"]


def test_short_calls_keep_their_maps_for_the_backward_and_long_ones_recompute_them(monkeypatch):
    """Eager training keeps the forward's two normalised maps for the backward where they are small
    (``MAPS_KEPT_BYTES``: the operator's second output, saved for its backward), frees them with the graph after the
    backward (read again by a second one with ``retain_graph=True``), and recomputes them above that size; the
    gradients agree either way."""
    q, k, v, lam = inputs(1, 2, 1, 40, 50, 32)
    seen = []
    real, _ = boundary.backward, cpu_fused._kernel()  # built and self-checked before the spy
    monkeypatch.setattr(boundary, "backward", lambda *a: seen.append(a[9]) or real(*a))

    def grads(retain=False):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, lam)]
        out = diff_attention(*leaves, causal=True, backend="cpu_fused")
        first = torch.autograd.grad(out, leaves, torch.ones_like(out), retain_graph=retain)
        second = torch.autograd.grad(out, leaves, torch.ones_like(out)) if retain else None
        with pytest.raises(RuntimeError, match="freed"):  # the saved maps went with the graph
            out.grad_fn.saved_tensors
        return first, second

    kept, again = grads(retain=True)
    assert seen[0].shape == seen[1].shape == (1, 2, 2, 40, 64)  # (B, H, 2, Nq, Nk padded to 32), twice
    monkeypatch.setattr(cpu_fused, "MAPS_KEPT_BYTES", 1 << 10)
    recomputed, _ = grads()
    assert seen[2] is None
    for a, b, c in zip(kept, again, recomputed):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)



def test_the_kernels_float32_buffers_do_not_follow_torchs_default_dtype():
    """The kept maps, dlam and a bool mask's additive copy are float32 whatever ``torch.set_default_dtype`` says:
    the kernel writes and reads float32 there (a float16 default made the kept maps half as long as it writes)."""
    proc = run_module("children.cpu_backward_cases", ["default_dtype"], timeout=300)
    assert proc.returncode == 0 and "DEFAULT DTYPE OK" in proc.stdout, f"exit {proc.returncode}: {proc.stderr[-3000:]}"


def test_kept_maps_give_fully_masked_rows_zero_gradients_as_recomputed_ones(monkeypatch):
    """Causal with Nq > Nk, and a mask's fully masked row: rows that see no key (kept as zero maps). A NaN in their
    output's gradient reaches no gradient (their output is the constant 0), dv included (not as 0 * NaN), with the
    maps kept as where they are recomputed, and as on naive."""
    q, k, v, lam = inputs(1, 1, 1, 40, 7, 32)
    mask = torch.ones(40, 7, dtype=torch.bool)
    mask[9] = False

    def grads(kept, masking, backend="cpu_fused"):
        monkeypatch.setattr(cpu_fused, "MAPS_KEPT_BYTES", kept)
        leaves = [t.clone().requires_grad_() for t in (q, k, v, lam)]
        kw = dict(causal=True) if masking == "causal" else dict(attn_mask=mask)
        out = (diff_attention(*leaves, backend=backend, **kw) if backend != "op" else
               cpu_fused.fused_diff_attention(*leaves, scale=32 ** -0.5, **kw))  # the operator itself, too
        grad_out = torch.ones_like(out)
        grad_out[0, 0, 5 if masking == "causal" else 9] = float("nan")  # causal: row i sees keys j <= i - 33
        return torch.autograd.grad(out, leaves, grad_out)

    for masking in ("causal", "mask"):
        naive = grads(0, masking, "naive")
        for kept in (cpu_fused.MAPS_KEPT_BYTES, 0):
            for backend in ("cpu_fused", "op"):
                got = grads(kept, masking, backend)
                for name, a, b in zip(("dq", "dk", "dv", "dlam"), got, naive):
                    assert a.isfinite().all(), (masking, kept, backend, name)
                    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
