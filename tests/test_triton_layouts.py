"""backend="triton" on every memory layout a user can pass, forward **and backward**, against ``naive``.

A property test (hypothesis) draws a layout per tensor: q, k and v each contiguous, transposed but dense, a slice
of a fused projection (a row stride with a gap, at a storage offset), a strided slice of the rows (``[:, :, ::2]``)
or of the last dim (``[..., ::2]``), ``expand()``ed over the batch or over the rows (stride 0), or at a storage
offset; lambda scalar, per head, per token, expanded per token, strided; the mask absent, bool or additive,
broadcast, expanded (stride 0), stored transposed or a slice with a gap. Gradients are taken with respect to the
tensors the views were cut from (the leaves), so autograd's own view backward (the sums of ``expand``, the scatter
of a slice) is part of what is compared.

The kernels write raw pointers: a gradient buffer written with the wrong strides corrupts the heap (issue 23: the
backward wrote with the input's strides into a dense buffer). So the examples run in a **worker subprocess**
(under Triton's interpreter without a GPU, compiled on one): a crash fails the example (and hypothesis shrinks it)
instead of ending pytest. Every buffer the kernels write is filled with NaN first (``DIFFATTN_TRITON_POISON=1``),
so an unwritten gradient shows.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
from pathlib import Path

LAYOUTS = ("contiguous", "transposed", "fused_slice", "rows_strided", "last_strided", "expanded_batch",
           "expanded_rows", "offset")
LAM_LAYOUTS = ("scalar", "head", "token", "token_expanded", "token_strided", "token_offset")
MASK_LAYOUTS = ("none", "bool_2d", "bool_expanded", "additive_transposed", "additive_gap", "additive_offset")
EXAMPLE_TIMEOUT_S = 300


# ------------------------------------------------------------------------------------------------------------
# the worker: a subprocess (Triton interpreted without a GPU); one JSON example per stdin line, one answer per line
# ------------------------------------------------------------------------------------------------------------


def _tensor_layout(values, kind):
    """``(leaf values, view)``: a leaf to differentiate with respect to and a function giving the tensor with
    ``values``' shape ``(B, heads, N, w)`` in memory layout ``kind`` (``expanded_*`` keep the first batch / row
    of ``values``)."""
    import torch

    B, heads, N, w = values.shape
    if kind == "transposed":  # stored (B, N, heads, w): dense, not contiguous
        return values.transpose(1, 2).contiguous(), lambda t: t.transpose(1, 2)
    if kind == "fused_slice":  # columns [3, 3 + heads * w) of a wider (B, N, 3 + heads * w + 5) projection
        rows = values.transpose(1, 2).flatten(2)
        leaf = torch.cat([torch.randn(B, N, 3), rows, torch.randn(B, N, 5)], -1)
        return leaf, lambda t: t[..., 3:3 + heads * w].unflatten(-1, (heads, w)).transpose(1, 2)
    if kind == "rows_strided":
        leaf = torch.randn(B, heads, 2 * N, w)
        leaf[:, :, ::2] = values
        return leaf, lambda t: t[:, :, ::2]
    if kind == "last_strided":
        leaf = torch.randn(B, heads, N, 2 * w)
        leaf[..., ::2] = values
        return leaf, lambda t: t[..., ::2]
    if kind == "expanded_batch":
        return values[:1].clone(), lambda t: t.expand(B, heads, N, w)
    if kind == "expanded_rows":
        return values[:, :, :1].clone(), lambda t: t.expand(B, heads, N, w)
    if kind == "offset":  # dense, at a storage offset of 5 elements (not 16-byte aligned)
        leaf = torch.cat([torch.randn(5), values.flatten(), torch.randn(3)])
        return leaf, lambda t: t[5:5 + values.numel()].view(values.shape)
    return values.clone(), lambda t: t


def _lam_layout(kind, B, H, Nq, g):
    import torch

    if kind == "scalar":
        return torch.tensor(0.37), lambda t: t
    if kind == "head":
        return 0.2 + 0.5 * torch.rand(H, 1, 1, generator=g), lambda t: t
    if kind == "token_expanded":  # per head, expanded to per token (stride 0 over batch and rows)
        return torch.rand(1, H, 1, 1, generator=g), lambda t: t.expand(B, H, Nq, 1)
    if kind == "token_strided":
        return torch.rand(B, H, 2 * Nq, 1, generator=g), lambda t: t[:, :, ::2]
    if kind == "token_offset":
        return torch.rand(B * H * Nq + 7, generator=g), lambda t: t[7:].view(B, H, Nq, 1)
    return torch.rand(B, H, Nq, 1, generator=g), lambda t: t


def _mask_layout(kind, B, H, Nq, Nk, g):
    """``(stored, view)``: the mask (no gradient) in layout ``kind`` is ``view(stored)``; ``(None, None)`` for
    ``none``."""
    import torch

    allowed = torch.rand(B, 1, Nq, Nk, generator=g) < 0.75
    bias = torch.randn(Nq, Nk, generator=g).masked_fill(~allowed[0, 0], float("-inf"))
    if kind == "bool_2d":
        return allowed[0, 0], lambda t: t
    if kind == "bool_expanded":  # (B, 1, Nq, Nk) expanded over the heads: stride 0
        return allowed, lambda t: t.expand(B, H, Nq, Nk)
    if kind == "additive_transposed":  # stored (Nk, Nq): the last dim is strided
        return bias.t().contiguous(), lambda t: t.t()
    if kind == "additive_gap":  # a slice of a wider buffer: rows with a gap, at an offset
        wide = torch.randn(Nq, Nk + 4, generator=g)
        wide[:, 1:Nk + 1] = bias
        return wide, lambda t: t[:, 1:Nk + 1]
    if kind == "additive_offset":
        return torch.cat([torch.randn(3, generator=g), bias.flatten()]), lambda t: t[3:].view(Nq, Nk)
    return None, None


def run_example(ex: dict) -> dict:
    """Forward and the gradients of ``(out * g).sum()`` with respect to every leaf, triton against naive."""
    import torch

    from diffattn_tutorial.functional import diff_attention

    device = "cuda" if torch.cuda.is_available() else "cpu"  # a GPU compiles the kernels; a CPU interprets them
    g = torch.Generator().manual_seed(ex["seed"])
    B, H, Hkv, Nq, Nk, d = ex["B"], ex["H"], ex["Hkv"], ex["Nq"], ex["Nk"], ex["d"]
    shapes = {"q": (B, 2 * H, Nq, d), "k": (B, 2 * Hkv, Nk, d), "v": (B, Hkv, Nk, 2 * d)}
    made = {name: _tensor_layout(torch.randn(*shape, generator=g), ex[name]) for name, shape in shapes.items()}
    made["lam"] = _lam_layout(ex["lam"], B, H, Nq, g)
    stored, mask_view = _mask_layout(ex["mask"], B, H, Nq, Nk, g)
    mask = None if stored is None else mask_view(stored.to(device))  # the layout made where it is used
    upstream = torch.randn(B, H, Nq, 2 * d, generator=g).to(device)
    results = {}
    for backend in ("triton", "naive"):
        leaves = {n: leaf.detach().clone().to(device).requires_grad_() for n, (leaf, _) in made.items()}
        views = {n: made[n][1](leaves[n]) for n in made}
        out = diff_attention(views["q"], views["k"], views["v"], views["lam"], causal=ex["causal"],
                             attn_mask=mask, backend=backend)
        grads = torch.autograd.grad((out * upstream).sum(), list(leaves.values()))
        results[backend] = {"out": out.detach(), **{f"d{n}": gr for n, gr in zip(leaves, grads)}}
    bad = []
    for name, ref in results["naive"].items():
        got = results["triton"][name]
        if got.shape != ref.shape:
            bad.append(f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}")
        elif got.isnan().any() and not ref.isnan().any():
            bad.append(f"{name}: NaN (an unwritten element) at {got.isnan().nonzero()[0].tolist()}")
        elif not torch.allclose(got, ref, rtol=1e-4, atol=5e-5):
            bad.append(f"{name}: max abs difference {(got - ref).abs().max().item():.3g}")
    return {"ok": not bad, "msg": "; ".join(bad)}


def worker_main(run=run_example) -> None:
    """Answer one JSON line per example read from stdin with ``run(example)`` (an exception is an answer too; a
    crash is not)."""
    import torch  # before triton: whether the interpreter is needed (no GPU) must be known first

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

    from diffattn_tutorial import functional  # noqa: F401

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        ex = json.loads(line)
        if ex.get("abort"):  # the test of the harness itself: die as heap corruption does (SIGABRT)
            os.abort()
        try:
            answer = run(ex)
        except Exception as e:  # noqa: BLE001 - reported to the test, which fails
            answer = {"ok": False, "msg": f"{type(e).__name__}: {e}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    worker_main()
    sys.exit(0)


# ------------------------------------------------------------------------------------------------------------
# the tests (in the pytest process: no triton import here)
# ------------------------------------------------------------------------------------------------------------

import pytest  # noqa: E402

pytest.importorskip("triton")
from forked import run_python  # noqa: E402
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = pytest.mark.slow  # runs the kernels in Triton's interpreter, in a worker process (about 30 s)


class Worker:
    """A subprocess answering examples (``script --worker``, default this file's worker); restarted after a
    crash, which it reports as a failed answer."""

    def __init__(self, script: str = __file__):
        self.env = dict(os.environ, DIFFATTN_TRITON_POISON="1", DIFFATTN_TRITON_AUTOTUNE="0",
                        PYTHONPATH=str(Path(__file__).resolve().parents[1]))
        self.script = script
        self.proc = None
        self.stderr = None

    def _start(self) -> None:
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, self.script, "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=self.env)
        assert json.loads(self._read_line(120) or "{}").get("ready"), self._died()

    def _read_line(self, timeout: float) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return self.proc.stdout.readline() if ready else ""

    def _died(self) -> str:
        self.proc.kill()
        code = self.proc.wait()
        self.stderr.seek(0)
        tail = self.stderr.read().decode(errors="replace")[-1500:]
        self.proc = None
        return f"worker ended with exit code {code} (a crash: {code < 0 or code == 134}):\n{tail}"

    def run(self, ex: dict) -> dict:
        if self.proc is None:
            self._start()
        try:
            self.proc.stdin.write(json.dumps(ex) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            return {"ok": False, "msg": self._died()}
        line = self._read_line(EXAMPLE_TIMEOUT_S)
        return json.loads(line) if line else {"ok": False, "msg": self._died()}

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.close()


EXAMPLES = st.fixed_dictionaries({
    "B": st.integers(1, 2), "heads": st.sampled_from([(1, 1), (2, 1), (2, 2)]), "Nq": st.integers(1, 20),
    "Nk": st.integers(1, 20), "d": st.sampled_from([4, 8, 16]), "causal": st.booleans(),
    "q": st.sampled_from(LAYOUTS), "k": st.sampled_from(LAYOUTS), "v": st.sampled_from(LAYOUTS),
    "lam": st.sampled_from(LAM_LAYOUTS), "mask": st.sampled_from(MASK_LAYOUTS), "seed": st.integers(0, 2**16)})


def _example(**kw) -> dict:
    base = {"B": 2, "heads": (2, 1), "Nq": 19, "Nk": 19, "d": 8, "causal": True, "q": "contiguous",
            "k": "contiguous", "v": "contiguous", "lam": "scalar", "mask": "none", "seed": 0}
    return {**base, **kw}


def check(worker, ex: dict) -> None:
    (H, Hkv), rest = ex["heads"], {k: v for k, v in ex.items() if k != "heads"}
    answer = worker.run({**rest, "H": H, "Hkv": Hkv})
    assert answer["ok"], f"{ex}: {answer['msg']}"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ex=EXAMPLES)
# the layouts issue 23 found crashing or wrong, each always run: a view with a row gap in q, in k, in v; strided
# rows; expanded tensors (the gradient was uninitialised memory)
@example(ex=_example(q="fused_slice"))
@example(ex=_example(k="fused_slice", lam="token_expanded"))
@example(ex=_example(v="fused_slice", mask="additive_gap"))
@example(ex=_example(q="rows_strided", k="rows_strided", v="rows_strided", lam="token_strided"))
@example(ex=_example(q="expanded_batch", k="expanded_batch", v="expanded_rows", mask="bool_expanded"))
def test_every_layout_forward_and_backward_matches_naive(worker, ex):
    check(worker, ex)


def test_a_crash_fails_the_example_and_the_worker_restarts(worker):
    """What the property test relies on: a worker that dies mid-example gives a failed answer naming the exit
    code, and the next example starts a fresh worker."""
    answer = worker.run({"abort": True})
    assert not answer["ok"] and "exit code -6 (a crash: True)" in answer["msg"], answer
    assert worker.proc is None
    check(worker, _example(Nq=3, Nk=4))  # a fresh worker answers the next example


def test_a_mask_that_requires_grad_is_refused_with_the_fix():
    """The kernels give no gradient for the mask: refusing is better than a silent zero (run in the worker's
    interpreter set-up, in a subprocess, as everything here)."""
    code = ("import os; os.environ['TRITON_INTERPRET'] = '1'\n"
            "import torch\nfrom diffattn_tutorial.functional import diff_attention\n"
            "q = torch.randn(1, 2, 4, 8); k = torch.randn(1, 2, 4, 8); v = torch.randn(1, 1, 4, 16)\n"
            "bias = torch.zeros(4, 4, requires_grad=True)\n"
            "try:\n    diff_attention(q, k, v, 0.5, attn_mask=bias, backend='triton')\n"
            "except ValueError as e:\n    print('refused:', e)\n")
    proc = run_python(code, env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "refused:" in proc.stdout and "detach()" in proc.stdout and "naive" in proc.stdout, proc.stdout
