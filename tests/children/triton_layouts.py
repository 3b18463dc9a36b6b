"""The worker of ``tests/test_triton_layouts.py``: ``backend="triton"`` against ``naive`` on one example of memory
layouts per request, forward and backward (``forked.Worker("children.triton_layouts")``; the kernels write raw
pointers, so a wrong stride may crash the process, not pytest). Every buffer the kernels write is filled with NaN
first (``DIFFATTN_TRITON_POISON=1`` in the environment), so an unwritten gradient shows."""

import torch

from children.worker import serve
from diffattn_tutorial.functional import diff_attention


def _tensor_layout(values, kind):
    """``(leaf values, view)``: a leaf to differentiate with respect to and a function giving the tensor with
    ``values``' shape ``(B, heads, N, w)`` in memory layout ``kind`` (``expanded_*`` keep the first batch / row
    of ``values``)."""
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


if __name__ == "__main__":
    serve(run_example)
