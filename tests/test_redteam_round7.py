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
    from diffattn_tutorial.kernels.triton import configs, launch

    dtype = torch.float16 if capability < 80 else torch.bfloat16
    ins = _inputs(d, dtype)
    monkeypatch.setattr(launch, "interpret_mode", lambda: False)  # the check as on a GPU (compiled kernels)
    with pytest.raises(ValueError, match="plan='fused_atomic'") as caught:
        configs.check_runs_here(ins[0], "fused_atomic", causal=True, masked=False, training=True,
                                capability=capability)
    monkeypatch.undo()
    named = [p for p in ("auto", *PLANS) if f"'{p}'" in str(caught.value).split("; use ")[-1]]
    assert named, str(caught.value)
    for plan in named:
        with capture_launches(capability):
            triton_diff_attention(*_inputs(d, dtype), plan=plan, causal=True).sum().backward()
