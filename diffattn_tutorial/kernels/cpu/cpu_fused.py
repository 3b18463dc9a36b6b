"""The fused CPU kernel of differential attention: ``diff_attention(..., backend="cpu_fused")``.

Every SDPA formulation does twice the multiply-adds of the naive one, because SDPA applies V to each map
separately; naive forms ``A1 - lam * A2`` first and applies V once, but writes both maps to memory. The kernel in
``diff_attention_cpu.cpp`` keeps naive's arithmetic and keeps the maps in cache: one thread takes a block
of query rows of one head, computes both score blocks, their softmax numerators, the differential map in place,
and multiplies it by V. Notebook 08 walks through it; ``benchmarks/bench_cpu_auto.py`` measures it.

The backward (``diff_attention_cpu_backward``), one pass over blocks of query rows, sums dk and dv per row block in
a fixed order (gradients independent of the thread count). Eager training keeps the forward's maps for it up to
:data:`MAPS_KEPT_BYTES` (16 MiB); above that, and under ``torch.compile``, it recomputes them block by block as
flash attention does, keeping no N x N tensor.
The threads are those of torch's OpenMP pool where the process has that one OpenMP runtime (:func:`kernel_threads`):
its threads keep spinning for a while after each of torch's parallel calls, so threads of the kernel's own would
share the cores with them.
The calls are the torch operators :data:`OP_NAME` and :data:`BACKWARD_OP_NAME` (``torch.library.define`` and
``impl``, with ``register_autograd`` and fake implementations that check their inputs as the operators do), so
``torch.compile(fullgraph=True)`` trains through them. The library
is built, cached and loaded by :mod:`diffattn_tutorial.kernels.cpu.build` and checked against the naive
formula before it is used (:mod:`~diffattn_tutorial.kernels.cpu.selfcheck`); where any step fails,
:func:`kernel_status` says why (and :func:`~diffattn_tutorial.backends.describe_auto` what runs instead).

>>> ok, why = kernel_status()
>>> isinstance(ok, bool) and isinstance(why, str)
True
"""

from __future__ import annotations

import ctypes
import math
from typing import Optional

import torch
from torch.autograd import forward_ad

from diffattn_tutorial.kernels.cpu import boundary, build, openmp
from diffattn_tutorial.kernels.cpu.boundary import BLOCK_ROWS
from diffattn_tutorial.kernels.cpu.build import SOURCE, KernelUnavailable, compiler, library_path
from diffattn_tutorial.kernels.cpu.selfcheck import self_check
from diffattn_tutorial.validation import forward_ad_active, under_torch_func

Tensor = torch.Tensor

MAPS_KEPT_BYTES = 16 << 20
"""Eager training keeps the forward's normalised maps for the backward where they take at most this many bytes
(``B * H * 2 * Nq * Nk``, keys padded to 32, float32; the issue's layer up to N = 512): the backward then reads them
instead of computing the scores and the softmax again, a fifth of its work. Longer calls recompute them
(FlashAttention's trade: no N x N tensor kept). Shapes alone decide, so the gradients do not depend on the machine."""


def _first_load() -> ctypes.CDLL:
    """Build (or find), load, choose the threads of, and self-check the kernel. Raises KernelUnavailable."""
    path = library_path()
    try:
        lib = boundary.load(path)
    except (OSError, AttributeError) as e:
        raise KernelUnavailable(f"the compiled kernel {path} could not be loaded ({e}); delete it to rebuild, "
                                f"or use backend='sdpa_padded'") from e
    openmp.choose(lib)
    self_check(lib)
    return lib


def _kernel() -> ctypes.CDLL:
    """The checked kernel, loaded once per process (:func:`build.load_once`). Raises KernelUnavailable."""
    return build.load_once(_first_load)


def kernel_status() -> tuple[bool, str]:
    """``(usable here, why)``: whether the fused CPU kernel builds, loads and agrees with the naive formula.
    Never raises: any failure is the reason it is not usable."""
    try:
        _kernel()
    except Exception as e:
        return False, str(e)
    return True, build.loaded_note()


def kernel_threads() -> str:
    """Where the loaded kernel's work runs now: ``"openmp"``, the OpenMP thread pool of torch's own parallel calls,
    or ``"own"``, threads it starts per call: where it was built without OpenMP, where the process has more than one
    OpenMP runtime (one that a library loaded before the kernel brought beside torch's) or cannot list them (off
    Linux), and in a child forked after it was loaded. The numbers are the same bit for bit. Raises
    KernelUnavailable where the kernel cannot be had."""
    return "openmp" if _kernel().diff_attention_cpu_on_openmp() else "own"


def own_threads():
    """A context in which the kernel starts threads of its own per call instead of running on torch's OpenMP pool
    (:func:`~diffattn_tutorial.kernels.cpu.openmp.own_threads`; for tests and benchmarks). Raises KernelUnavailable."""
    return openmp.own_threads(_kernel())


def vector_floats() -> int:
    """Floats per vector of the loaded kernel: 16 built for AVX-512, else 8 (and smaller tiles). Raises KernelUnavailable."""
    return _kernel().diff_attention_cpu_vector_floats()


def release_buffers() -> None:
    """Free the work buffers the kernel keeps for the calling thread between its calls. A call carves k transposed,
    its blocks of scores (and in the backward the partial sums of dk and dv) from one block per calling thread,
    kept for the next call (freed at once when above 64 MiB, and when the thread ends): returning those pages to
    the system and faulting them in again on every call cost more than the work at short sequences. Nothing to do
    where the kernel is not loaded; ``timing.peak_extra_memory`` calls this before each measured call, so that
    the block counts in the kernel's peak."""
    lib = build.loaded()
    if lib is not None:
        lib.diff_attention_cpu_release()


def keeps_maps(q: Tensor, k: Tensor) -> bool:
    """Whether a training call on q and k keeps the forward's maps for the backward (:data:`MAPS_KEPT_BYTES`)."""
    return math.prod(boundary.maps_shape(q, k)) * 4 <= MAPS_KEPT_BYTES


KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""The dtypes the operators take for q, k and v (computed in float32)."""

_INT_MAX = 2 ** 31 - 1  # the kernel's sizes are C ints


def _shape(t: Tensor) -> tuple:
    """``t``'s shape as a tuple; no ``int()``: under ``torch.compile`` the sizes stay symbolic, so a check does not
    specialize a compiled graph to one length."""
    return tuple(t.shape)


def _check_tensor(name: str, t: object, device: torch.device, *, optional: bool = False) -> None:
    if t is None and optional:
        return
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(f"{name} is a {t.layout} tensor; the kernel reads dense memory: pass {name}.to_dense()")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}: pass every argument on one device "
                         f"({name}.to(q.device))")
    if any(n > _INT_MAX for n in t.shape):
        raise ValueError(f"{name} has shape {_shape(t)}: the kernel takes sizes below 2**31 per dimension")


def _broadcasts(shape: tuple, target: tuple) -> bool:
    return len(shape) <= len(target) and all(a in (1, b) for a, b in zip(reversed(shape), reversed(target)))


def _check_scale(scale: float) -> None:
    if not (math.isfinite(scale) and scale > 0):  # as diff_attention's (a negative scale inverts the softmax)
        raise ValueError(f"scale must be a positive finite number (the softmax scale, usually d ** -0.5), got {scale}")


def check_operator_inputs(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, attn_mask: Optional[Tensor],
                          grad_out: Optional[Tensor] = None) -> None:
    """Refuse, naming the argument and the fix, inputs the operators cannot compute (shapes, dtypes, devices and
    layouts only: nothing reads the data). Runs in the operators and in their fake implementations."""
    if not isinstance(q, Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v), ("lam", lam)):
        _check_tensor(name, t, q.device)
    _check_tensor("attn_mask", attn_mask, q.device, optional=True)
    if q.dtype not in KERNEL_DTYPES:
        raise TypeError(f"q is {q.dtype}: the kernel takes float32, float16 or bfloat16 (it computes in float32); "
                        f"pass q.float(), or use diff_attention(..., backend='naive') for other dtypes")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} is {t.dtype} but q is {q.dtype}: q, k and v share one dtype; pass "
                            f"{name}.to(q.dtype)")
    if not lam.is_floating_point():
        raise TypeError(f"lam is {lam.dtype}: pass a floating-point tensor (lam.float())")
    if attn_mask is not None and not (attn_mask.dtype == torch.bool or attn_mask.is_floating_point()):
        raise TypeError(f"attn_mask is {attn_mask.dtype}: pass a bool mask (True = may attend) or an additive "
                        f"floating-point one")
    for name, t, layout in (("q", q, "(B, 2H, Nq, d)"), ("k", k, "(B, 2Hkv, Nk, d)"), ("v", v, "(B, Hkv, Nk, 2d)")):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D {layout}, got shape {_shape(t)}")
    B, H2, Nq, d = q.shape
    if H2 % 2 or H2 == 0 or d == 0:
        raise ValueError(f"q has shape {_shape(q)}: it must be (B, 2H, Nq, d) with an even, nonzero number of "
                         f"heads (the two maps of each differential head) and d > 0")
    if k.shape[0] != B or k.shape[3] != d:
        raise ValueError(f"k has shape {_shape(k)} and q {_shape(q)}: k must be (B, 2Hkv, Nk, d) with q's batch "
                         f"size B and head dim d")
    if k.shape[1] % 2 or k.shape[1] == 0 or (H2 // 2) % (k.shape[1] // 2):
        raise ValueError(f"k has {k.shape[1]} heads and q {H2}: k must have 2Hkv heads, an even number with Hkv "
                         f"dividing q's H = {H2 // 2} (grouped-query attention)")
    Hkv, Nk = k.shape[1] // 2, k.shape[2]
    expected_v = (B, Hkv, Nk, 2 * d)
    if _shape(v) != expected_v:
        raise ValueError(f"v has shape {_shape(v)}, but q {_shape(q)} and k {_shape(k)} need v of shape "
                         f"(B, Hkv, Nk, 2d) = {expected_v} (v has {v.shape[2]} keys, k has {Nk})")
    H = H2 // 2
    if not _broadcasts(_shape(lam), (B, H, Nq, 1)):
        raise ValueError(f"lam has shape {_shape(lam)}, which does not broadcast to (B, H, Nq, 1) = {(B, H, Nq, 1)} "
                         f"(from q's shape {_shape(q)}); pass one lambda per head (1, H, 1, 1), per token "
                         f"(B, H, Nq, 1) or a 0-dim tensor")
    if attn_mask is not None and not _broadcasts(_shape(attn_mask), (B, H, Nq, Nk)):
        raise ValueError(f"attn_mask has shape {_shape(attn_mask)}, which does not broadcast to (B, H, Nq, Nk) = "
                         f"{(B, H, Nq, Nk)} (from q's and k's shapes)")
    if grad_out is not None:
        _check_tensor("grad_out", grad_out, q.device)
        if _shape(grad_out) != (B, H, Nq, 2 * d) or not grad_out.is_floating_point():
            raise ValueError(f"grad_out has shape {_shape(grad_out)} and dtype {grad_out.dtype}: it must be the "
                             f"output's gradient, floating-point of shape (B, H, Nq, 2d) = {(B, H, Nq, 2 * d)}")




def _check_maps(maps: Optional[Tensor], q: Tensor, k: Tensor) -> Optional[Tensor]:
    """The backward's ``maps`` argument as the kernel takes it: None for none or an empty tensor (not kept), else
    the forward's ``(B, H, 2, Nq, Nk_pad)`` contiguous float32 maps (anything else is refused: the kernel would read
    past it)."""
    if maps is None or maps.numel() == 0:
        return None
    _check_tensor("maps", maps, q.device)
    shape = boundary.maps_shape(q, k)
    if _shape(maps) != shape or maps.dtype != torch.float32 or not maps.is_contiguous():
        raise ValueError(f"maps has shape {_shape(maps)} and dtype {maps.dtype}: pass the forward's kept maps "
                         f"(cpu_fused_forward(..., keep_maps=True)[1], contiguous float32 of shape {shape}) or None")
    return maps


def _refuse_forward_ad(*tensors: Optional[Tensor]) -> None:
    """Forward-mode AD (``torch.autograd.forward_ad``) reaches the kernel with dual tensors; it would drop their
    tangents (the kernel has no forward-mode derivative)."""
    if any(t is not None and forward_ad.unpack_dual(t).tangent is not None for t in tensors):
        raise RuntimeError(NO_TRANSFORMS)


NO_TRANSFORMS = ("the fused CPU kernel has no forward-mode derivative and does not run under torch.func transforms "
                 "(torch.autograd.forward_ad, jvp, jacfwd, grad, vmap, ...): it hands its inputs' memory to compiled "
                 "code; use diff_attention(..., backend='auto'), which runs a PyTorch backend there, or "
                 "backend='naive'")
"""What the operators say under ``torch.func`` transforms and forward-mode AD."""


_LIBRARY = torch.library.Library("diffattn", "FRAGMENT")


def _operator(name: str, kernel):
    """Defines ``diffattn::<name>`` with ``kernel``'s signature as its schema and ``kernel`` as its CPU
    implementation; returns the operator. (``torch.library.custom_op`` does the same, but its wrapper imports
    ``torch._dynamo`` on the operator's first call: a second or more of every new process's first training step.)"""
    torch.library.define(f"diffattn::{name}", torch.library.infer_schema(kernel, mutates_args=()), lib=_LIBRARY)
    torch.library.impl(f"diffattn::{name}", "cpu", kernel, lib=_LIBRARY)
    return getattr(torch.ops.diffattn, name).default


OP_NAME = "diffattn::cpu_fused_forward"
"""The kernel as a torch operator: ``torch.ops.diffattn.cpu_fused_forward(q, k, v, lam, attn_mask, causal, scale,
keep_maps=False, scan=False)`` gives ``(out, maps, nonfinite)``; one node in a ``torch.compile`` graph (its fake
implementation gives the outputs' shapes and dtypes)."""


def _cpu_fused_forward(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, attn_mask: Optional[Tensor], causal: bool,
                      scale: float, keep_maps: bool = False, scan: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """The fused forward on CPU tensors, as :func:`fused_diff_attention` describes. ``out``: a new
    ``(B, H, Nq, 2d)`` tensor in q's dtype, contiguous, or, where q is a projection's ``(B, Nq, 2H, d)`` output
    viewed as ``(B, 2H, Nq, d)``, the same view of a ``(B, Nq, H, 2d)`` tensor; gradients flow to q, k, v and lam
    (:data:`BACKWARD_OP_NAME`); an ``attn_mask`` that requires grad is refused. ``maps``: with ``keep_maps``, the
    normalised maps ``(B, H, 2, Nq, Nk_pad)`` float32 that the backward then reads instead of computing them
    again, else empty. ``nonfinite``: a 0-dim bool, with ``scan`` whether q, k or v holds a NaN or an infinity
    (then ``out`` is not to be used; the kernel checks them as it reads them), else False."""
    _refuse_forward_ad(q, k, v, lam, attn_mask)
    return _forward_checked(q, k, v, lam, attn_mask, causal, scale, keep_maps, scan)


def _forward_checked(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, attn_mask: Optional[Tensor], causal: bool,
                     scale: float, keep_maps: bool = False, scan: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """The operator's body: its checks, then the kernel (:func:`cpu_fused_forward`'s outputs)."""
    check_operator_inputs(q, k, v, lam, attn_mask)
    _check_scale(scale)
    maps = q.new_empty(boundary.maps_shape(q, k) if keep_maps else (0,), dtype=torch.float32)
    out, nonfinite = boundary.forward(_kernel(), q, k, v, lam, attn_mask, causal, scale, scan,
                                      maps if keep_maps else None)
    B, H2, nq, d = q.shape
    if out.dtype != q.dtype or out.stride() != boundary.output_strides(q, H2 // 2, nq, 2 * d):
        out = boundary.new_output(q, B, H2 // 2, nq, 2 * d, q.dtype).copy_(out)  # what the fake promises
    return out, maps, torch.tensor(nonfinite, device=q.device)  # on q's device, whatever the default device


cpu_fused_forward = _operator("cpu_fused_forward", _cpu_fused_forward)


@torch.library.register_fake(OP_NAME, lib=_LIBRARY)
def _(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, attn_mask: Optional[Tensor], causal: bool, scale: float,
      keep_maps: bool = False, scan: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    check_operator_inputs(q, k, v, lam, attn_mask)
    _check_scale(scale)
    B, H2, nq, d = q.shape
    return (boundary.new_output(q, B, H2 // 2, nq, 2 * d, q.dtype),
            q.new_empty(boundary.maps_shape(q, k) if keep_maps else (0,), dtype=torch.float32),
            q.new_empty((), dtype=torch.bool))


BACKWARD_OP_NAME = "diffattn::cpu_fused_backward"
"""The kernel's backward as a torch operator: ``torch.ops.diffattn.cpu_fused_backward(grad_out, q, k, v, lam,
attn_mask, causal, scale, maps=None)`` gives ``(dq, dk, dv, dlam)``, dlam per row ``(B, H, Nq)`` in float32."""


def _cpu_fused_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, lam: Tensor, attn_mask: Optional[Tensor],
                       causal: bool, scale: float,
                       maps: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gradients of :func:`cpu_fused_forward`'s output ``grad_out``: dq, dk, dv in q's dtype, laid out as
    ``torch.empty_like`` lays out q, k and v (a transposed view's gradient is the same view of a dense tensor, as a
    projection's backward wants it), and dlam per row, ``(B, H, Nq)`` float32; fully masked rows get zero
    gradients. ``maps``: the forward's kept maps (its second output), read instead of computed again; None or
    empty: computed again."""
    _refuse_forward_ad(grad_out, q, k, v, lam, attn_mask)
    check_operator_inputs(q, k, v, lam, attn_mask, grad_out)
    _check_scale(scale)
    grads = boundary.backward(_kernel(), grad_out, q, k, v, lam, attn_mask, causal, scale, _check_maps(maps, q, k))
    return (*(_like(g, t) for g, t in zip(grads, (q, k, v))), grads[3])


def _like(grad: Tensor, t: Tensor) -> Tensor:
    """``grad`` in ``t``'s dtype and ``torch.empty_like(t)``'s layout (what the fake implementation promises)."""
    like = torch.empty_like(t)
    if grad.dtype == like.dtype and grad.stride() == like.stride():
        return grad
    return like.copy_(grad)


cpu_fused_backward = _operator("cpu_fused_backward", _cpu_fused_backward)


@torch.library.register_fake(BACKWARD_OP_NAME, lib=_LIBRARY)
def _(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, lam: Tensor, attn_mask: Optional[Tensor], causal: bool,
      scale: float, maps: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    check_operator_inputs(q, k, v, lam, attn_mask, grad_out)
    _check_scale(scale)
    _check_maps(maps, q, k)
    B, H2, nq, _ = q.shape
    return (torch.empty_like(q), torch.empty_like(k, dtype=q.dtype), torch.empty_like(v, dtype=q.dtype),
            q.new_empty(B, H2 // 2, nq, dtype=torch.float32))


def _refuse_mask_grad(attn_mask: Optional[Tensor]) -> None:
    if attn_mask is not None and attn_mask.requires_grad:
        raise ValueError("attn_mask requires grad (a learned bias?), but the fused CPU kernel gives a mask no "
                         "gradient; pass attn_mask.detach() if it is not to be learned, or use "
                         "diff_attention(..., backend='naive') to learn it")


def _setup_context(ctx, inputs: tuple, output: tuple) -> None:
    q, k, v, lam, attn_mask, causal, scale, *_ = inputs
    _refuse_mask_grad(attn_mask)
    if forward_ad_active():  # the inputs' tangents are hidden here; the formula has none for them (no jvp)
        raise RuntimeError(NO_TRANSFORMS)
    _, maps, nonfinite = output
    ctx.mark_non_differentiable(maps, nonfinite)
    ctx.save_for_backward(q, k, v, lam, attn_mask, maps)  # maps: empty where not kept; freed after the backward
    ctx.causal, ctx.scale = causal, scale


def _autograd_backward(ctx, grad_out: Tensor, _maps_grad, _nonfinite_grad) -> tuple:
    q, k, v, lam, attn_mask, maps = ctx.saved_tensors
    dq, dk, dv, dlam = cpu_fused_backward(grad_out, q, k, v, lam, attn_mask, ctx.causal, ctx.scale, maps)
    dlam = _ordered_sum_to(dlam.unsqueeze(-1), lam.shape).to(lam.dtype) if ctx.needs_input_grad[3] else None
    return dq, dk, dv, dlam, None, None, None, None, None


def _ordered_sum_to(t: Tensor, shape: torch.Size) -> Tensor:
    """``t.sum_to_size(shape)`` (per row -> lam's broadcast shape) in a fixed order, float64 running sums along each
    summed dim: torch's own sum splits the work by thread count, and lam's gradient would depend on it."""
    if t.numel() == 0:
        return t.sum_to_size(shape)  # zeros
    t, lead = t.double(), t.dim() - len(shape)
    for dim in range(t.dim()):
        if (dim < lead or shape[dim - lead] == 1) and t.shape[dim] > 1:
            t = t.cumsum(dim).narrow(dim, t.shape[dim] - 1, 1)
    return t.reshape(shape)


torch.library.register_autograd(OP_NAME, _autograd_backward, setup_context=_setup_context, lib=_LIBRARY)


def _no_second_derivative(ctx, *grads) -> tuple:
    raise RuntimeError("the fused CPU kernel has no second derivative (a gradient of its gradients, as a gradient "
                       "penalty takes): use diff_attention(..., backend='naive') there (SDPA's fused CPU kernel, "
                       "which backend='sdpa_padded' reaches, has none either)")


torch.library.register_autograd(BACKWARD_OP_NAME, _no_second_derivative,
                                setup_context=lambda ctx, inputs, output: None, lib=_LIBRARY)


def _refuse_layout(q, k, v, lam, attn_mask, *rest):
    check_operator_inputs(q, k, v, lam, attn_mask)  # raises: some argument is not dense
    raise ValueError("the fused CPU kernel reads dense (strided) tensors only; pass t.to_dense() for each")


def _refuse_layout_backward(grad_out, q, k, v, lam, attn_mask, *rest):
    check_operator_inputs(q, k, v, lam, attn_mask, grad_out)  # raises: some argument is not dense
    raise ValueError("the fused CPU kernel reads dense (strided) tensors only; pass t.to_dense() for each")


def _refuse_transforms(*args, **kwargs):
    raise RuntimeError(NO_TRANSFORMS)


for _key in ("SparseCPU", "SparseCsrCPU"):  # a sparse argument reaches the check, not a dispatch error
    _LIBRARY.impl("cpu_fused_forward", _refuse_layout, _key)
    _LIBRARY.impl("cpu_fused_backward", _refuse_layout_backward, _key)
del _key
# Every torch.func transform (grad, vmap, jvp, jacrev, ...) enters an operator at this dispatch key: refused there by
# name. Without it, grad reached the autograd formula's functorch check (which asks for a setup_context that
# register_autograd does not give) and jvp ran the kernel on the primal, returning a wrong tangent.
_LIBRARY.impl("cpu_fused_forward", _refuse_transforms, "FuncTorchDynamicLayerFrontMode")
_LIBRARY.impl("cpu_fused_backward", _refuse_transforms, "FuncTorchDynamicLayerFrontMode")


def fused_diff_attention(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, *, attn_mask: Optional[Tensor] = None,
                         causal: bool = False, scale: float, scan: bool = False) -> Optional[Tensor]:
    """Differential attention by the fused CPU kernel, on inputs :func:`~diffattn_tutorial.functional.diff_attention`
    has validated: q ``(B, 2H, Nq, d)``, k ``(B, 2Hkv, Nk, d)``, v ``(B, Hkv, Nk, 2d)``, lam broadcastable to
    ``(B, H, Nq, 1)`` (a tensor), ``attn_mask`` bool or additive broadcastable to ``(B, H, Nq, Nk)`` (entries
    ``<= finfo(dtype).min`` masked; a fully masked row gives zero output and gradients), ``causal`` bottom-right
    aligned. Computes in float32; returns ``(B, H, Nq, 2d)`` in q's dtype (laid out as q where q is a projection's
    transposed view, else contiguous), with gradients to q, k, v and lam (laid out as them). Raises
    KernelUnavailable where the kernel cannot be built (see :func:`kernel_status`), ValueError for an
    ``attn_mask`` that requires grad (the kernel gives a mask no gradient).

    Where there is something to differentiate, and while ``torch.compile`` traces, it runs the operator
    :data:`OP_NAME` (one node in a compiled graph), its autograd formula the one for eager and compiled runs; eager
    training keeps the forward's maps for the backward where they are small (:data:`MAPS_KEPT_BYTES`). Eager
    inference runs the operator's body without the dispatcher (no autograd node to make).

    ``scan=True`` (eager calls; ignored while ``torch.compile`` traces): the kernel also scans q, k and v for NaN
    and infinities as it reads them, and the call returns None where it finds one (``diff_attention`` then takes its
    careful path), without a pass of its own over them first."""
    if not isinstance(lam, Tensor):  # on every path (the dispatcher's own message would not name the fix)
        raise TypeError(f"lam must be a torch.Tensor, got {type(lam).__name__}: pass torch.tensor(lam)")
    grad = torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in (q, k, v, lam))
    if torch.is_grad_enabled():
        _refuse_mask_grad(attn_mask)
    if torch.compiler.is_compiling():
        return cpu_fused_forward(q, k, v, lam, attn_mask, bool(causal), float(scale))[0]
    if grad or under_torch_func():  # the operator: its autograd formula, or its refusal under transforms
        out, _, nonfinite = cpu_fused_forward(q, k, v, lam, attn_mask, bool(causal), float(scale),
                                              keep_maps=grad and keeps_maps(q, k), scan=bool(scan))
    else:
        out, _, nonfinite = _forward_checked(q, k, v, lam, attn_mask, bool(causal), float(scale), scan=bool(scan))
    return None if scan and nonfinite else out


__all__ = ["SOURCE", "BLOCK_ROWS", "OP_NAME", "BACKWARD_OP_NAME", "KernelUnavailable", "compiler", "library_path",
           "kernel_status", "kernel_threads", "vector_floats", "check_operator_inputs", "cpu_fused_forward",
           "cpu_fused_backward", "fused_diff_attention", "release_buffers"]
