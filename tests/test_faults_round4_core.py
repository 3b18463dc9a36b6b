"""Issue 48 (faults round four), the library core's items, each reproduced first: a bool mask under a default-device
context (2), ``causal``/``scale`` refused by name everywhere (8), the backend registry's refusals and broken
statuses (13), a second derivative through ``"auto"`` (14), ``check`` under Ctrl-C and decoding's numbers and shapes
(15), ``llama_lm_config``'s head counts (9); and validation's helpers public (issue 50)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from forked import run_module

from diffattn_tutorial import backends, cli, validation
from diffattn_tutorial.backends import Backend, Choice, backend_status, get_backend, registered
from diffattn_tutorial.functional import diff_attention, diff_attention_maps, diff_attention_v2, softmax_attention
from diffattn_tutorial.layers.attention import DiffAttnV2, KVCache, MultiheadAttention, MultiheadDiffAttn


def inputs(d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 4, 5, d, generator=g), torch.randn(1, 4, 5, d, generator=g),
            torch.randn(1, 2, 5, 2 * d, generator=g))


def child(case: str) -> dict:
    """``python -m children.faults_round4_core CASE`` in a process of its own (a segfault fails only this test)."""
    proc = run_module("children.faults_round4_core", [case], timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------------------------
# item 2: a bool mask under `with torch.device("meta")`
# ---------------------------------------------------------------------------------------------------------------


def test_a_default_device_context_neither_drops_the_mask_nor_crashes_the_kernels_first_load():
    """The mask's float copy (and the kernel's self-check, and its gradient buffers) were allocated on the default
    device: the mask was dropped (max error 1.69), and a first call under the context segfaulted."""
    got = child("meta")
    assert max(got["errors"].values()) < 1e-5, got["errors"]
    assert got["devices"] == ["cpu"] * 4


# ---------------------------------------------------------------------------------------------------------------
# item 8: causal and scale
# ---------------------------------------------------------------------------------------------------------------

CAUSAL_CALLS = {
    "softmax_attention": lambda c: softmax_attention(*inputs(16)[:2], inputs(16)[0], causal=c),
    "diff_attention_v2": lambda c: diff_attention_v2(inputs()[0], *[t[:, :2] for t in inputs()[:2]], 0.5, causal=c),
    "diff_attention_maps": lambda c: diff_attention_maps(*inputs()[:2], 0.5, causal=c),
    "MultiheadAttention": lambda c: MultiheadAttention(32, 4)(torch.randn(1, 5, 32), causal=c),
    "DiffAttnV2": lambda c: DiffAttnV2(32, 2)(torch.randn(1, 5, 32), causal=c),
    "MultiheadDiffAttn": lambda c: MultiheadDiffAttn(32, 2)(torch.randn(1, 5, 32), causal=c),
    "diff_attention": lambda c: diff_attention(*inputs(), 0.5, causal=c),
}


@pytest.mark.parametrize("name", CAUSAL_CALLS)
@pytest.mark.parametrize("causal", ["no", 2, None, 0.5])
def test_causal_that_is_no_bool_is_refused_everywhere(name, causal):
    with pytest.raises(TypeError, match=r"causal must be True or False, got"):
        CAUSAL_CALLS[name](causal)


@pytest.mark.parametrize("name", CAUSAL_CALLS)
def test_causal_as_a_bool_or_0_1_still_runs(name):
    for causal in (True, False, 0, 1, np.bool_(True)):
        CAUSAL_CALLS[name](causal)


def test_a_layer_refuses_causal_before_it_writes_its_cache():
    layer, cache = MultiheadDiffAttn(32, 2), KVCache()
    with pytest.raises(TypeError, match="causal must be True or False"):
        layer(torch.randn(1, 3, 32), causal="no", cache=cache)
    assert cache.seq_len == 0


SCALE_CALLS = {
    "diff_attention": lambda s: diff_attention(*inputs(), 0.5, scale=s),
    "softmax_attention": lambda s: softmax_attention(*inputs(16)[:2], inputs(16)[0], scale=s),
    "diff_attention_v2": lambda s: diff_attention_v2(inputs()[0], *[t[:, :2] for t in inputs()[:2]], 0.5, scale=s),
    "diff_attention_maps": lambda s: diff_attention_maps(*inputs()[:2], 0.5, scale=s),
}


@pytest.mark.parametrize("name", SCALE_CALLS)
@pytest.mark.parametrize("scale", [math.inf, -math.inf, math.nan, True, 0.0, -1.0, "0.5", torch.tensor(0.5)])
def test_a_scale_that_is_no_finite_positive_number_is_refused_by_name(name, scale):
    """``scale=inf`` gave NaN and ``scale=True`` 1.0 outside the kernel, with no word."""
    with pytest.raises((TypeError, ValueError), match=r"scale must be a positive finite number"):
        SCALE_CALLS[name](scale)


@pytest.mark.parametrize("name", SCALE_CALLS)
def test_a_numpy_or_int_scale_is_taken(name):
    ref = SCALE_CALLS[name](0.25)
    for scale in (np.float32(0.25), np.float64(0.25)):
        torch.testing.assert_close(SCALE_CALLS[name](scale), ref)
    SCALE_CALLS[name](1)


# ---------------------------------------------------------------------------------------------------------------
# item 13: the registry
# ---------------------------------------------------------------------------------------------------------------


def naive_run(call):
    return get_backend("naive").run(call)


@pytest.mark.parametrize("run", [None, "naive", 3])
def test_a_backend_without_a_run_function_is_refused_when_made(run):
    with pytest.raises(TypeError, match=r"run must be a function .*get_backend\('naive'\)\.run"):
        Backend("mine", "test", run)


def test_a_backend_status_that_is_no_function_is_refused_when_made():
    with pytest.raises(TypeError, match="status must be a function"):
        Backend("mine", "test", naive_run, status=(True, "ok"))


@pytest.mark.parametrize("devices, fix", [(("gpu",), "a GPU is 'cuda'"), (("cuda:1",), "not a torch device type"),
                                          ("cuda", "tuple of device types"), ((), "non-empty tuple")])
def test_a_backend_on_a_device_that_is_no_device_type_is_refused_when_made(devices, fix):
    with pytest.raises((TypeError, ValueError), match=re_escape(fix)):
        Backend("mine", "test", naive_run, devices=devices)


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


def raising_status(device):
    raise OSError("the driver is gone (test)")


@pytest.mark.parametrize("status, why", [(raising_status, "its status raised OSError: the driver is gone"),
                                         (lambda device: True, "its status answered True, not (works: bool"),
                                         (lambda device: ("yes", 1), "its status answered ('yes', 1)")])
def test_a_broken_status_makes_its_backend_unavailable_not_every_listing(status, why, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_version", lambda module: "(not asked)")  # importing jupyter's packages sets warnings
    mine = Backend("mine", "test", naive_run, status=status)
    with registered(mine, auto={"cpu": (Choice("mine"), *backends.auto_order("cpu"))}):
        ok, reason = backend_status("cpu")["mine"]
        assert not ok and why in reason
        assert cli.main(["doctor"]) == 0
        assert why in capsys.readouterr().out
        q, k, v = inputs()
        torch.testing.assert_close(diff_attention(q, k, v, 0.5), diff_attention(q, k, v, 0.5, backend="naive"))
        with pytest.raises(RuntimeError, match=re_escape(f"backend 'mine' is unavailable here: {why}")):
            diff_attention(q, k, v, 0.5, backend="mine")


def test_an_auto_order_of_forward_only_backends_still_trains_on_the_reference():
    """Every training call failed ("no registered backend takes this call")."""
    mine = Backend("mine", "test", naive_run, backward=False, dropout=False)
    with registered(mine, auto={"cpu": (Choice("mine"),)}):
        q, k, v = (t.requires_grad_() for t in inputs())
        out = diff_attention(q, k, v, 0.5)
        out.sum().backward()
        assert q.grad is not None
        assert diff_attention(q, k, v, 0.5, dropout_p=0.1).shape == out.shape
        with torch.no_grad():
            assert torch.equal(diff_attention(q, k, v, 0.5), out)
        assert backends.resolve("auto", "cpu") == "naive"
        assert "`naive`" in backends.describe_auto("cpu")


# ---------------------------------------------------------------------------------------------------------------
# item 14: a second derivative through "auto"
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend, d", [("auto", 8), ("auto", 32), ("sdpa", 8), ("sdpa_padded", 8)])
def test_a_second_derivative_names_backend_naive(backend, d):
    """It gave PyTorch's "derivative for aten::_scaled_dot_product_flash_attention_for_cpu_backward is not
    implemented"."""
    q, k, v = (t.requires_grad_() for t in inputs(d))
    (gq,) = torch.autograd.grad(diff_attention(q, k, v, 0.5, backend=backend).square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match=r"no second derivative .*use diff_attention\(\.\.\., backend='naive'\)"):
        gq.square().sum().backward()
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    (gq,) = torch.autograd.grad(diff_attention(*leaves, 0.5, backend="naive").square().sum(), leaves[0],
                                create_graph=True)
    gq.square().sum().backward()
    assert leaves[1].grad.isfinite().all()


def test_first_derivatives_with_create_graph_are_unchanged():
    """Only a derivative of the gradients is refused: the gradients themselves, built as a graph, are the same."""
    q, k, v = (t.requires_grad_() for t in inputs(32))
    plain = torch.autograd.grad(diff_attention(q, k, v, 0.5).square().sum(), (q, k, v))
    graph = torch.autograd.grad(diff_attention(q, k, v, 0.5).square().sum(), (q, k, v), create_graph=True)
    for a, b in zip(plain, graph):
        torch.testing.assert_close(a, b.detach())


# ---------------------------------------------------------------------------------------------------------------
# item 15: check under Ctrl-C, decoding's numbers and shapes
# ---------------------------------------------------------------------------------------------------------------


def exercise_notebook(path: Path) -> None:
    source = "# TASK 1: wait\nimport pathlib, time\npathlib.Path('started').write_text('1')\ntime.sleep(120)"
    cells = [{"cell_type": "code", "source": source, "metadata": {}, "outputs": [], "execution_count": None},
             {"cell_type": "code", "source": "# CHECK 1\nassert True", "metadata": {}, "outputs": [],
              "execution_count": None}]
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))


@pytest.mark.parametrize("to_group", [False, True], ids=["to-the-command", "to-its-process-group"])
def test_check_interrupted_while_a_cell_runs_exits_130_with_a_message(tmp_path, to_group):
    """It exited 2 ("could not run ...: AssertionError", nbclient's own SIGINT handler) or 1 with nothing on stderr.
    A terminal's Ctrl-C reaches the whole process group (the kernel too); ``kill -INT`` the command alone."""
    exercise_notebook(tmp_path / "ex.ipynb")
    proc = subprocess.Popen([sys.executable, "-m", "diffattn_tutorial.cli", "check", "ex.ipynb"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "started").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (tmp_path / "started").exists(), proc.communicate(timeout=60)
        if to_group:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, (out, err)
    assert err.strip().splitlines() == ["diffattn-tutorial check: stopped (Ctrl-C)"], err


def tiny_model():
    from diffattn_tutorial.training.model import build_model

    torch.manual_seed(0)
    return build_model("diff", 11, d_model=16, n_layers=1, n_heads=2, max_len=16).eval()


def test_generate_takes_numpy_scalars():
    """``temperature=np.float32(0.5)`` was refused as "not a finite number", ``np.int64`` counts likewise."""
    model, idx = tiny_model(), torch.tensor([[1, 2, 3]])
    want = model.generate(idx, 3, temperature=0.5, top_k=4, generator=torch.Generator().manual_seed(0))
    got = model.generate(idx, np.int64(3), temperature=np.float32(0.5), top_k=np.int64(4),
                         generator=torch.Generator().manual_seed(0))
    assert torch.equal(got, want)


@pytest.mark.parametrize("shape", [(7,), (2, 3, 7), (2, 0)])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_next_token_names_logits_and_their_shape(shape, temperature):
    from diffattn_tutorial.training.model import next_token

    with pytest.raises(ValueError, match=re_escape("logits must be a float tensor (B, vocab)")):
        next_token(torch.randn(shape), temperature=temperature)


# ---------------------------------------------------------------------------------------------------------------
# item 9: llama_lm_config's head count
# ---------------------------------------------------------------------------------------------------------------

LLAMA = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4)


@pytest.mark.parametrize("key, value", [("num_attention_heads", 0), ("num_attention_heads", "4"),
                                        ("num_attention_heads", 2.0), ("hidden_size", -16), ("vocab_size", True),
                                        ("num_key_value_heads", "2")])
def test_llama_lm_config_names_a_count_that_is_no_whole_number(key, value):
    """``num_attention_heads=0`` gave ZeroDivisionError, ``"4"`` an unsupported operand."""
    from diffattn_tutorial.interop import llama_lm_config

    with pytest.raises(ValueError, match=re_escape(f"{key} must be a whole number >= 1, got {value!r}")):
        llama_lm_config(**{**LLAMA, key: value})


# ---------------------------------------------------------------------------------------------------------------
# issue 50: validation's helpers are public
# ---------------------------------------------------------------------------------------------------------------


def test_functional_imports_only_public_names_from_validation():
    import ast

    import diffattn_tutorial.functional as functional

    tree = ast.parse(Path(functional.__file__).read_text())
    imported = [a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.module == "diffattn_tutorial.validation" for a in node.names]
    assert imported and not [n for n in imported if n.startswith("_")]
    assert set(imported) <= set(validation.__all__)
    assert all(hasattr(validation, n) for n in validation.__all__)
