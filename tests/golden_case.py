"""One check shared by every golden-file test: a loaded layer reproduces the reference implementation's own
recorded run (exact weights, output, input gradient, every parameter after one SGD step)."""

from typing import Callable

import torch

RTOL, ATOL = 1e-4, 1e-5
"""Float32 tolerance of the golden files."""


def assert_reproduces_golden_case(layer: torch.nn.Module, case: dict, export: Callable[[torch.nn.Module], dict]) -> None:
    """``layer`` was loaded from ``case["state_dict"]``; ``export`` writes it back in the reference's names."""
    before = export(layer)
    assert list(before) == list(case["state_dict"]), "the reference's names, in its order"
    for key, ref in case["state_dict"].items():
        torch.testing.assert_close(before[key], ref, rtol=0, atol=0, msg=key)

    x = case["x"].clone().requires_grad_(True)
    rope = case["rope"]
    out = layer(x, rope=tuple(rope) if rope is not None else None, causal=case["causal"],
                attn_mask=case["attn_mask"])
    torch.testing.assert_close(out, case["out"], rtol=RTOL, atol=ATOL)
    (out * case["g"]).sum().backward()
    torch.testing.assert_close(x.grad, case["x_grad"], rtol=RTOL, atol=ATOL)

    with torch.no_grad():
        for p in layer.parameters():
            assert p.grad is not None, "every parameter must receive a gradient"
            p -= case["lr"] * p.grad
    after = export(layer)
    assert after.keys() == case["state_dict_after_sgd"].keys()
    for key, ref in case["state_dict_after_sgd"].items():
        torch.testing.assert_close(after[key], ref, rtol=RTOL, atol=ATOL, msg=key)
