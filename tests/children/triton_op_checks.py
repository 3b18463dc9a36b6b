"""The worker of ``tests/test_triton_op_checks.py`` (``forked.Worker("children.triton_op_checks")``): per request,
a valid call of one registered Triton operator with one thing of one argument changed, called eagerly or under a
``FakeTensorMode``. The answer is ok where the operator refuses by name (its name and the argument's in a
``ValueError``/``TypeError``) or, where the change is still a valid call, gives the ``naive`` backend's result."""

import re

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from children.worker import serve
from diffattn_tutorial.functional import diff_attention

OPS = {  # each operator's tensor arguments, in its schema's order
    "forward": ("q", "k", "v", "lam", "attn_mask"),
    "backward": ("dout", "q", "k", "v", "lam", "attn_mask", "out", "o2", "lse", "flag"),
    "decode": ("q", "k", "v", "lam", "lengths"),
}
DTYPES = ("float64", "float16", "bfloat16", "int32", "bool")


def _call(ex: dict) -> tuple[dict, dict]:
    """``(tensors, others)``: a valid call of ``ex["op"]`` at the example's sizes, with the example's change. The
    backward gets ``out``, ``o2``, ``lse`` from the forward of its (changed) inputs where the forward accepts them:
    a change of lam's shape that stays valid is then a valid call (not statistics of another lam)."""
    g = torch.Generator().manual_seed(ex["seed"])
    B, H, Hkv, Nq, Nk, d = (ex[n] for n in ("B", "H", "Hkv", "Nq", "Nk", "d"))
    t = dict(q=torch.randn(B, 2 * H, Nq, d, generator=g), k=torch.randn(B, 2 * Hkv, Nk, d, generator=g),
             v=torch.randn(B, Hkv, Nk, 2 * d, generator=g))
    t["lam"] = torch.rand(B, H, Nq, 1, generator=g) if ex["lam_per_token"] else torch.tensor(0.4)
    if ex["op"] == "decode":
        t["lengths"] = torch.full((B,), Nk, dtype=torch.int32)
        return _change(t, ex), dict(causal=True, scale=d ** -0.5, num_splits=2, block_n=16)
    t["attn_mask"] = torch.rand(B, 1, Nq, Nk, generator=g) < 0.8 if ex["mask"] else None
    others = dict(causal=False, scale=d ** -0.5, blocks=[], plan="split")
    if ex["op"] == "forward":
        return _change(t, ex), others
    forward = torch.ops.diffattn.triton_forward
    stats = forward(*(t[n] for n in OPS["forward"]), *others.values(), True)
    t = dict(dout=torch.randn(B, H, Nq, 2 * d, generator=g), **t)
    if ex["arg"] in OPS["forward"]:
        t = _change(t, ex)
        try:
            stats = forward(*(t[n] for n in OPS["forward"]), *others.values(), True)
        except (ValueError, TypeError):
            pass  # the backward must refuse the change too
    t.update(zip(("out", "o2", "lse", "flag"), stats))
    return (t if ex["arg"] in OPS["forward"] else _change(t, ex)), others


def _change(t: dict, ex: dict) -> dict:
    arg = ex["arg"]
    if t.get(arg) is None:  # no mask to change: start from one of the wrong size
        t[arg] = torch.ones(1, 1, ex["Nq"] + 1, ex["Nk"], dtype=torch.bool)
    return {**t, arg: _changed(t[arg], ex)}


def _changed(t, ex: dict):
    """``t`` with the example's one change."""
    kind, shape = ex["change"], list(t.shape)
    if kind == "dim" and t.ndim:
        i = ex["dim"] % t.ndim
        shape[i] = ex["size"] if ex["size"] != shape[i] else shape[i] + 1
    elif kind == "dim" or (kind == "ndim" and ex["size"] % 2):
        shape = [1, *shape]  # one more dim (a 0-dim lam gets one)
    elif kind == "ndim":
        shape = shape[1:] if shape else [1]
    if kind == "device":
        return torch.empty(shape, dtype=t.dtype, device="meta")
    dtype = getattr(torch, ex["dtype"]) if kind == "dtype" else t.dtype
    if dtype == t.dtype and kind == "dtype":
        dtype = torch.float64 if t.dtype != torch.float64 else torch.float32
    if dtype == torch.bool:
        return torch.rand(shape) < 0.8
    if dtype == torch.int32:
        return torch.randint(1, 3, shape, dtype=torch.int32)
    return torch.rand(shape).to(dtype) if kind == "dtype" else torch.randn(shape).to(dtype)


def _reference(op: str, t: dict, others: dict):
    """What the ``naive`` backend gives for the same call (the gradients for the backward)."""
    if op == "decode":
        return diff_attention(t["q"], t["k"], t["v"], t["lam"], causal=others["causal"], backend="naive")
    if op == "forward":
        return diff_attention(t["q"], t["k"], t["v"], t["lam"], attn_mask=t["attn_mask"], backend="naive")
    leaves = [t[n].detach().clone().requires_grad_() for n in ("q", "k", "v")]
    out = diff_attention(*leaves, t["lam"], attn_mask=t["attn_mask"], backend="naive")
    return torch.autograd.grad(out, leaves, t["dout"])


def _args(op: str, t: dict, others: dict) -> list:
    """The operator's arguments in its schema's order."""
    last = {"forward": [False], "backward": [[True, True, True]], "decode": []}[op]  # store_o2 / needs
    return [t[n] for n in OPS[op]] + list(others.values()) + last


def run_example(ex: dict) -> dict:
    from diffattn_tutorial.kernels.triton import decode  # noqa: F401 - registers diffattn::triton_decode

    op, arg = ex["op"], ex["arg"]
    t, others = _call(ex)
    call = getattr(torch.ops.diffattn, f"triton_{op}")
    try:
        if ex["fake"]:
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                call(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in _args(op, t, others)])
            return {"ok": True, "msg": ""}  # accepted: a valid call, whose result the eager examples check
        got = call(*_args(op, t, others))
    except (ValueError, TypeError) as e:
        named = str(e).startswith(f"diffattn::triton_{op}: ") and re.search(rf"\b{arg}\b", str(e))
        return {"ok": bool(named), "msg": f"an error not naming the operator and {arg}: {type(e).__name__}: {e}"}
    try:
        ref = _reference(op, t, others)
    except (ValueError, TypeError) as e:
        return {"ok": False, "msg": f"accepted a call the naive backend refuses ({e})"}
    pairs = zip(got[:3], ref) if op == "backward" else [(got[0] if op == "forward" else got, ref)]
    bad = [f"{tuple(a.shape)} vs naive {tuple(b.shape)}" for a, b in pairs
           if a.shape != b.shape or not torch.allclose(a.float(), b.float(), rtol=1e-3, atol=1e-4)]
    return {"ok": not bad, "msg": f"accepted, but differs from naive: {bad}"}


if __name__ == "__main__":
    serve(run_example)
