"""The fused CPU kernel's one typed boundary and one autograd path.

- The ctypes Structures of ``kernels/cpu/boundary.py`` have the C++ structs' fields, in order, at their offsets and
  sizes (the library lists them), and a library that differs is refused before any call.
- Eager and compiled training run the operator ``diffattn::cpu_fused_forward`` and its one autograd formula; the
  forward's maps reach the backward as the operator's second output; a scanning call that finds a NaN returns None
  (no exception carries it).
- Forward-mode AD and ``torch.func`` transforms through the operators are refused by name (issue 48: a wrong
  tangent, None, or functorch's setup_context message before).
"""

import ctypes
import subprocess
import sys

import pytest
import torch
from torch.autograd import forward_ad
from torch.func import grad, jacfwd, jvp, vmap

from diffattn_tutorial.kernels.cpu import boundary, cpu_fused

pytestmark = pytest.mark.skipif(cpu_fused.compiler() is None, reason="no C++ compiler here (test_cpu_kernel checks "
                                                                     "what runs instead)")
op, backward_op = torch.ops.diffattn.cpu_fused_forward, torch.ops.diffattn.cpu_fused_backward
REFUSED = r"no forward-mode derivative and does not run under torch.func transforms .* backend='auto'"


def inputs(B=1, H=1, Hkv=1, nq=5, nk=7, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, 2 * H, nq, d, generator=g), torch.randn(B, 2 * Hkv, nk, d, generator=g),
            torch.randn(B, Hkv, nk, 2 * d, generator=g), torch.rand(B, H, nq, 1, generator=g))


# ---------------------------------------------------------------------------------------------------------------
# the structs
# ---------------------------------------------------------------------------------------------------------------

def test_the_python_structures_match_the_compiled_structs_field_by_field():
    lib = cpu_fused._kernel()
    compiled = boundary.library_layout(lib)
    assert set(compiled) == {"Layout", "Inputs", "ForwardArgs", "BackwardArgs"}
    for name, struct in zip(compiled, boundary.STRUCTS):
        assert name == struct.__name__
        rows = compiled[name]
        assert rows[0] == ("", 0, ctypes.sizeof(struct)), name  # sizeof
        assert [r[0] for r in rows[1:]] == [f for f, _ in struct._fields_], name  # names, in order
        assert rows[1:] == [(f, getattr(struct, f).offset, getattr(struct, f).size) for f, _ in struct._fields_]
    assert boundary.python_layout() == compiled


class FakeFields:
    """A library whose ``diff_attention_cpu_fields`` lists ``rows``."""

    def __init__(self, rows):
        self.rows = (boundary.FieldAt * len(rows))(*[boundary.FieldAt(t.encode(), f.encode(), o, s)
                                                     for t, f, o, s in rows])

    def diff_attention_cpu_fields(self, out):
        out._obj.contents = self.rows[0]
        return len(self.rows)


def _rows(layout):
    return [(t, f, o, s) for t, fields in layout.items() for f, o, s in fields]


@pytest.mark.parametrize("change", ["a field added in C++ only", "two fields swapped", "a field renamed",
                                    "a field narrowed"])
def test_a_library_whose_structs_differ_is_refused_by_name(change):
    rows = _rows(boundary.python_layout())
    i = next(j for j, r in enumerate(rows) if r[:2] == ("Inputs", "nq"))
    t, f, o, s = rows[i]
    if change == "a field added in C++ only":
        rows.insert(i + 1, ("Inputs", "window", o + s, 4))
    elif change == "two fields swapped":
        rows[i], rows[i + 1] = (t, rows[i + 1][1], o, s), (t, f, rows[i + 1][2], s)
    elif change == "a field renamed":
        rows[i] = (t, "n_queries", o, s)
    else:
        rows[i] = (t, f, o, 2)
    assert boundary.library_layout(FakeFields(_rows(boundary.python_layout()))) == boundary.python_layout()
    with pytest.raises(cpu_fused.KernelUnavailable, match=r"argument structs \['Inputs'\] differ .* both sides"):
        boundary.check_layout(FakeFields(rows))


# ---------------------------------------------------------------------------------------------------------------
# one autograd path
# ---------------------------------------------------------------------------------------------------------------

def test_a_new_process_trains_through_the_operator_without_importing_the_compiler():
    """The operators are defined with ``torch.library.define`` and ``impl``: ``custom_op``'s wrapper imported
    ``torch._dynamo`` on the first call, a second or more of a new process's first training step. A fresh interpreter
    (not a forked child): what it has imported is the point."""
    probe = ("import sys, torch; from diffattn_tutorial.functional import diff_attention; "
             "q = torch.randn(1, 4, 6, 8, requires_grad=True); k = torch.randn(1, 4, 6, 8); v = torch.randn(1, 2, 6, 16); "
             "out = diff_attention(q, k, v, torch.tensor(0.5), backend='cpu_fused'); out.sum().backward(); "
             "print(type(out.grad_fn).__name__, q.grad is not None, 'torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    name, has_grad, dynamo = done.stdout.split()
    assert "cpu_fused_forward" in name and has_grad == "True"
    assert dynamo == "False", "the first eager training call imported torch._dynamo"


def test_eager_training_runs_the_operator_and_its_one_formula():
    assert not hasattr(cpu_fused, "CpuFusedTraining") and not hasattr(cpu_fused, "_NotFinite")
    leaves = [t.requires_grad_() for t in inputs(d=32)]
    out = cpu_fused.fused_diff_attention(*leaves, scale=0.2)
    assert "cpu_fused_forward" in type(out.grad_fn).__name__
    assert out.grad_fn.saved_tensors[5].shape == (1, 1, 2, 5, 32)  # the kept maps, as the backward reads them
    out.sum().backward()
    ref = [t.detach().double().requires_grad_() for t in leaves]
    from diffattn_tutorial.formulations import naive_reference
    naive_reference(*ref, scale=0.2).sum().backward()
    for a, b in zip(leaves, ref):
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-5, atol=1e-6)


def test_the_operators_kept_maps_give_the_backward_of_the_recomputed_ones():
    q, k, v, lam = inputs(1, 2, 1, 30, 40, 32)
    out, maps, nonfinite = op(q, k, v, lam, None, True, 0.2, keep_maps=True)
    plain, empty, _ = op(q, k, v, lam, None, True, 0.2)
    assert torch.equal(out, plain) and maps.shape == (1, 2, 2, 30, 64) and empty.numel() == 0
    assert nonfinite.dtype == torch.bool and not nonfinite
    grad_out = torch.randn(1, 2, 30, 64)
    kept = backward_op(grad_out, q, k, v, lam, None, True, 0.2, maps)
    recomputed = backward_op(grad_out, q, k, v, lam, None, True, 0.2)
    for a, b in zip(kept, recomputed):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"maps has shape \(1, 2, 2, 30, 32\) .* pass the forward's kept maps"):
        backward_op(grad_out, q, k, v, lam, None, True, 0.2, maps[..., :32])


@pytest.mark.parametrize("grad_mode", [False, True])
def test_a_scanning_call_that_finds_a_nan_returns_none(grad_mode):
    q, k, v, lam = inputs(d=32)
    k[0, 1, 3, 0] = float("nan")
    with torch.set_grad_enabled(grad_mode):
        assert cpu_fused.fused_diff_attention(q.requires_grad_(grad_mode), k, v, lam, scale=0.2, scan=True) is None
    assert bool(op(q.detach(), k, v, lam, None, False, 0.2, scan=True)[2])


# ---------------------------------------------------------------------------------------------------------------
# forward-mode AD and torch.func transforms: refused by name
# ---------------------------------------------------------------------------------------------------------------

def _dual(requires_grad):
    q, k, v, lam = inputs()
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(q.requires_grad_(requires_grad), torch.randn_like(q))
        return op(dual, k, v, lam, None, False, 0.3)


CALLS = {
    "jvp": lambda q, k, v, lam: jvp(lambda q: op(q, k, v, lam, None, False, 0.3)[0], (q,), (torch.ones_like(q),)),
    "jacfwd": lambda q, k, v, lam: jacfwd(lambda q: op(q, k, v, lam, None, False, 0.3)[0])(q),
    "forward_ad": lambda *a: _dual(False),
    "forward_ad, q requires grad": lambda *a: _dual(True),
    "grad": lambda q, k, v, lam: grad(lambda q: op(q, k, v, lam, None, False, 0.3)[0].sum())(q),
    "vmap": lambda q, k, v, lam: vmap(lambda q: op(q, k, v, lam, None, False, 0.3)[0])(q[None]),
    "grad of the backward": lambda q, k, v, lam: grad(
        lambda q: backward_op(torch.ones(1, 1, 5, 16), q, k, v, lam, None, False, 0.3)[0].sum())(q),
    "fused_diff_attention under jvp": lambda q, k, v, lam: jvp(
        lambda q: cpu_fused.fused_diff_attention(q, k, v, lam, scale=0.3), (q,), (torch.ones_like(q),)),
}


@pytest.mark.parametrize("call", CALLS)
def test_forward_mode_and_transforms_through_the_operators_are_refused_by_name(call):
    with pytest.raises(RuntimeError, match=REFUSED):
        CALLS[call](*inputs())


def test_an_open_dual_level_alone_does_not_stop_the_operator():
    """Tensors without a tangent inside ``forward_ad.dual_level()``: the operator runs (only tangents are refused)."""
    q, k, v, lam = inputs(d=32)
    expected = op(q, k, v, lam, None, False, 0.3)[0]
    with forward_ad.dual_level():
        assert torch.equal(op(q, k, v, lam, None, False, 0.3)[0], expected)
