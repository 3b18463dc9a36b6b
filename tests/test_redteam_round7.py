"""Faults found by the seventh red-team round, each reproduced before its fix.

The Triton host code: a plan chosen by name whose backward has no table entry on the target was refused only in
``.backward()``, after its forward had run (the captured launches show it, as on a GPU of each compute
capability); the fix a plan's refusal names must run where it is named.
"""

import pytest
import torch

pytest.importorskip("triton")

from diffattn_tutorial.kernels.triton.configs import PLANS  # noqa: E402
from diffattn_tutorial.kernels.triton.flash_diff import capture_launches, triton_diff_attention  # noqa: E402


def _inputs(d, dtype=torch.bfloat16, train=True):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*s, generator=g).to(dtype) for s in ((1, 4, 8, d), (1, 2, 8, d), (1, 1, 8, 2 * d)))
    return [t.requires_grad_(train) for t in (q, k, v, torch.tensor(0.3, dtype=dtype))]


@pytest.mark.parametrize("capability, plan, d", [(90, "split_kv", 16), (90, "split_kv_atomic", 32),
                                                 (80, "split_atomic", 64), (86, "split_atomic", 16),
                                                 (75, "split_atomic", 32)])
def test_a_plan_whose_backward_is_untabled_is_refused_before_its_forward_runs(capability, plan, d):
    """A training call with such a plan launched its whole forward, then failed in ``.backward()``: refused at the
    call now, before any launch, naming each untabled launch and the fixes (plan='auto', blocks=, no_grad)."""
    dtype = torch.float16 if capability < 80 else torch.bfloat16
    with capture_launches(capability) as launches:
        with pytest.raises(ValueError, match=r"no table entry .*use plan='auto'.*blocks=") as caught:
            triton_diff_attention(*_inputs(d, dtype), plan=plan)
        assert launches == [], [x.name for x in launches]
    assert "_diff_attn_bwd" in str(caught.value) and "torch.no_grad()" in str(caught.value)
    with capture_launches(capability) as launches:  # inference runs it, and blocks= chooses the tile
        triton_diff_attention(*_inputs(d, dtype, train=False), plan=plan)
        triton_diff_attention(*_inputs(d, dtype), plan=plan, blocks=(16, 16)).sum().backward()
    assert launches


@pytest.mark.parametrize("capability, d", [(90, 16), (90, 32), (80, 64), (75, 32)])
def test_the_fused_atomic_plans_refusal_names_plans_that_run_here(capability, d, monkeypatch):
    """``fused_atomic`` refused on a GPU (causal training) named ``split_kv_atomic`` or ``fused``, which no table
    lists at these head dims and targets; every plan the message names runs the call (captured as on that GPU)."""
    from diffattn_tutorial.kernels.triton import launch, refusals

    dtype = torch.float16 if capability < 80 else torch.bfloat16
    ins = _inputs(d, dtype)
    monkeypatch.setattr(launch, "interpret_mode", lambda: False)  # the check as on a GPU (compiled kernels)
    with pytest.raises(ValueError, match="plan='fused_atomic'") as caught:
        refusals.check_runs_here(ins[0], "fused_atomic", causal=True, masked=False, training=True,
                                 capability=capability)
    monkeypatch.undo()
    named = [p for p in ("auto", *PLANS) if f"'{p}'" in str(caught.value).split("; use ")[-1]]
    assert named, str(caught.value)
    for plan in named:
        with capture_launches(capability):
            triton_diff_attention(*_inputs(d, dtype), plan=plan, causal=True).sum().backward()


# --------------------------------------------------------------------------------------------
# the exercise checks: a refused implementation reached another way, torch state left changed by an answer
# --------------------------------------------------------------------------------------------


def _by_hand_scores(q, k, keep):
    return (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~keep[:, None, None, :], float("-inf"))


def _sdpa(q, k, v, keep):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])


def _through_aten(q, k, v, keep):
    return torch.ops.aten.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])


def _through_an_overload(q, k, v, keep):
    return torch.ops.aten.scaled_dot_product_attention.default(q, k, v, attn_mask=keep[:, None, None, :])


def _watch_switched_off(q, k, v, keep):
    import sys

    sys.setprofile(None)
    return _sdpa(q, k, v, keep)


def _in_a_thread(q, k, v, keep):
    import threading

    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("out", _sdpa(q, k, v, keep)))
    worker.start()
    worker.join()
    return result["out"]


@pytest.mark.parametrize("answer, says", [(_through_aten, "calls PyTorch's scaled_dot_product_attention"),
                                          (_through_an_overload, "calls PyTorch's scaled_dot_product_attention"),
                                          (_watch_switched_off, r"switches off the check's watch \(sys.setprofile\)"),
                                          (_in_a_thread, "calls PyTorch's scaled_dot_product_attention")])
def test_a_refused_implementation_reached_another_way_is_refused(answer, says):
    """Exercise 02 task 1 refuses PyTorch's SDPA; these answers passed with it: through ``torch.ops.aten`` (the op's
    packet or an overload), after switching off the check's profiler, from a thread the profiler did not watch."""
    from diffattn_tutorial import checks

    with pytest.raises(checks.CheckFailed, match=says):
        checks.check_attention(answer)
    checks.check_attention(lambda q, k, v, keep: torch.softmax(_by_hand_scores(q, k, keep), -1) @ v)  # still passes


def test_an_answer_that_switches_gradients_off_decides_no_later_check(capsys):
    """An answer that turns gradients off (``torch.set_grad_enabled(False)``) passed, and the next check failed a
    right answer ("does not depend differentiably"); a notebook cell that turned them off did the same. A check
    runs with gradients on and gives torch's grad mode, default dtype and deterministic mode back as it found them."""
    import math

    from diffattn_tutorial import checks

    def rms_norm(x, weight, eps):  # by hand: the check refuses the library's rms_norm
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def lambda_init(depth):
        torch.set_grad_enabled(False)
        torch.set_default_dtype(torch.float64)
        torch.use_deterministic_algorithms(True)
        return 0.8 - 0.6 * math.exp(-0.3 * depth)

    def grouped(x, weight=None, eps=1e-5, group=None):
        out = rms_norm(x if group is None else x.unflatten(-1, (-1, group)), None, eps).reshape(x.shape)
        return out if weight is None else out * weight

    try:
        checks.check_lambda_init(lambda_init)
        assert torch.is_grad_enabled() and torch.get_default_dtype() == torch.float32
        assert not torch.are_deterministic_algorithms_enabled()
        with torch.no_grad():  # a cell's state before the check: the check runs with gradients on all the same
            checks.check_rms_norm(grouped)
            assert not torch.is_grad_enabled()
    finally:
        torch.set_grad_enabled(True)
        torch.set_default_dtype(torch.float32)
        torch.use_deterministic_algorithms(False)
    assert capsys.readouterr().out.count("PASSED") == 2


def test_a_check_cell_that_no_longer_calls_its_check_does_not_pass():
    """``diffattn-tutorial check`` graded a CHECK cell that ran without an error as passed, so a learner who
    commented out the check call (debugging, or to be done) got "passed" for a task never checked. A passed task
    needs the check's own ``PASSED:`` line in its CHECK cell's output now; the failure says what to put back."""
    from nbformat.v4 import new_code_cell, new_notebook, new_output

    from diffattn_tutorial.course.scorecard import FAILED, PASSED, find_tasks, score

    passed = new_output("stream", name="stdout", text="PASSED: the answer matches.\n")
    nb = new_notebook(cells=[new_code_cell("# TASK 1: one\ndef f(): return 1"),
                             new_code_cell("# CHECK 1\n# check_f(f)"),
                             new_code_cell("# TASK 2: two\ndef g(): return 2"),
                             new_code_cell("# CHECK 2\ncheck_g(g)", outputs=[passed])])
    one, two = score(nb, find_tasks(nb))
    assert one.status == FAILED and "no PASSED line" in one.detail and "check call" in one.detail, one.detail
    assert two.status == PASSED


def test_the_probe_still_times_the_split_plan_at_d64_with_its_own_forward_configuration():
    """``benchmarks/probe_triton.py`` pins the forward launch (``forward_config``) to time shapes the tables do not
    use, the one-map ``split`` plan at d = 64 among them; the call's refusal of untabled launches must read the same
    configurations the launch does (it refused these four candidates, recorded as failures on the GPU)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "probe_triton.py"
    spec = importlib.util.spec_from_file_location("probe_triton_rt7", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    q, k, v, lam = _inputs(64, train=False)
    for d, plan, config in probe.CANDIDATES:
        if d == 64:
            with torch.inference_mode(), capture_launches(90) as launches, probe.forward_config(config):
                triton_diff_attention(q, k, v, lam, plan=plan)
            assert launches[0].configs[0].kwargs["BLOCK_M"] == config[0], (plan, config)
    with pytest.raises(ValueError, match=r"plan='split': _diff_attn_fwd \(map\) has no table entry"):
        with capture_launches(90):
            triton_diff_attention(q, k, v, lam, plan="split")  # unpinned: refused, each launch named once


def test_the_compile_facts_still_record_notebook_09s_lessons():
    """``aot.LESSONS`` (the fused plan at d = 128: why the library splits the maps) records the launches of a plan
    the tables do not list there, to compile them with configurations of its own; since plans by name at untabled
    head dims are refused, ``aot.launches_for`` raised on them (``aot --all`` with its lessons could not run); it
    records them with ``untabled=True``, as ``aot.lesson_facts`` asks, while a plain capture refuses them."""
    from diffattn_tutorial.kernels.triton import aot
    from diffattn_tutorial.kernels.triton.aot_cases import EXCLUSIONS, LESSONS

    with pytest.raises(ValueError, match="no table entry"):
        aot.launches_for(LESSONS[0][0], n=16)
    for case, kernel, _configs in (*LESSONS, *EXCLUSIONS):
        assert kernel in [x.name for x in aot.launches_for(case, n=16, untabled=True)], case  # as lesson_facts asks


def test_a_check_run_under_cprofile_passes_and_gives_the_profiler_back():
    """A learner profiling a cell (``cProfile``, ``%prun``) ran the check's watch, whose restore handed
    ``sys.setprofile`` the C profiler's object: the check failed a right answer ("'Profile' object is not
    callable"). The check passes, and the profiler records what runs after it."""
    import cProfile
    import pstats

    from diffattn_tutorial import checks

    def by_hand(v_cm, v_d, gain_plus=1.0, gain_minus=1.0):
        return gain_plus * (v_cm + v_d / 2) - gain_minus * (v_cm - v_d / 2)

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        checks.check_amplifier_output(by_hand)
        sum(range(3))
    finally:
        profiler.disable()
    assert any(name == "<built-in method builtins.sum>" for *_, name in pstats.Stats(profiler).stats)
