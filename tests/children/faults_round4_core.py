"""Child processes of ``tests/test_faults_round4_core.py`` (crash-prone cases: a kernel handed memory it cannot
read segfaults the process). ``python -m children.faults_round4_core CASE``; prints one JSON line, exits 0.

* ``meta``: the first ``diff_attention`` call of the process (the fused CPU kernel loads and checks itself then)
  inside ``with torch.device("meta")``, on CPU tensors with a bool mask: every backend's output and gradients
  against the reference computed outside the context.
"""

from __future__ import annotations

import json
import sys

import torch


def meta() -> dict:
    from diffattn_tutorial.functional import diff_attention, diff_attention_maps, diff_attention_v2, softmax_attention
    from diffattn_tutorial.layers.rope import interleaved_to_half_split

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 6, 32, generator=g), torch.randn(1, 4, 6, 32, generator=g)
    v = torch.randn(1, 2, 6, 64, generator=g)
    mask = torch.rand(6, 6, generator=g) > 0.5
    mask[:, 0] = True
    errors = {}
    for backend in ("auto", "cpu_fused", "naive", "sdpa_padded", "chunked"):
        for grad in (False, True):
            outs = []
            for context in (torch.device("meta"), torch.device("cpu")):
                leaves = [t.clone().requires_grad_(grad) for t in (q, k, v)]
                with context:
                    out = diff_attention(*leaves, 0.5, attn_mask=mask, causal=True,
                                         backend=backend if context.type == "meta" else "naive")
                    if grad:
                        out.square().sum().backward()
                outs.append([out, *(t.grad for t in leaves if grad)])
            errors[f"{backend} grad={grad}"] = max((a - b).abs().max().item() for a, b in zip(*outs))
    with torch.device("meta"):
        plain = softmax_attention(q[:, :2], k[:, :2], v[:, :, :, :32], attn_mask=mask)
        v2 = diff_attention_v2(q, k[:, :2], v[:, :, :, :32], 0.5, attn_mask=mask)
        maps = diff_attention_maps(q, k, 0.5, attn_mask=mask)[2]
        rows = interleaved_to_half_split(torch.randn(8, 3, device="cpu"), 4)
    devices = [t.device.type for t in (plain, v2, maps, rows)]
    return {"errors": errors, "devices": devices}


if __name__ == "__main__":
    print(json.dumps({"meta": meta}[sys.argv[1]]()))
