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
The calls are the torch operators :data:`OP_NAME` and :data:`BACKWARD_OP_NAME` (``torch.library.custom_op``, with
``register_autograd`` and fake implementations that check their inputs as the operators do), so
``torch.compile(fullgraph=True)`` trains through them. The library
is built, cached and loaded by :mod:`diffattn_tutorial.kernels.cpu.build` and checked here against the naive
formula before it is used; where any step fails, :func:`kernel_status` says why (and
:func:`~diffattn_tutorial.backends.describe_auto` what runs instead).

>>> ok, why = kernel_status()
>>> isinstance(ok, bool) and isinstance(why, str)
True
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import re
import threading
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from diffattn_tutorial.constants import LOG2E
from diffattn_tutorial.kernels.cpu import build
from diffattn_tutorial.kernels.cpu.build import SOURCE, KernelUnavailable, compiler, library_path

Tensor = torch.Tensor

BLOCK_ROWS = (24, 48)
"""Query rows per work item (multiples of the kernel's 8-row score and 6-row output tiles): 24 for short
queries (less padding), 48 otherwise (fewer passes over K and V)."""

BACKWARD_ROWS_LONG = 144
"""Query rows per block of the backward where one head's partial sums of dk and dv (``Nk x 4d`` floats) are larger
than :data:`PARTIAL_BYTES_IN_CACHE`: every block of rows reads and writes all of them, so that fewer, taller blocks
pass over them less often (a multiple of the 8-row score and 12-row dq tiles)."""

PARTIAL_BYTES_IN_CACHE = 2 << 20  # 2 MiB: about what a core's L2 (and its share of L3) keeps at hand
BACKWARD_LONG_MIN_ROWS = 1024  # tall blocks only where there are many of them

KEY_MULTIPLE = 32  # the kernel pads keys to the score tile's 32 columns
VALUE_MULTIPLE = 64  # the value width to the output tile's 64 columns


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    f = lib.diff_attention_cpu_forward
    ptr, c_int = ctypes.c_void_p, ctypes.c_int
    f.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_float, ctypes.c_float, ptr, ptr, c_int, c_int, ptr, ptr]
    f.restype = c_int
    b = lib.diff_attention_cpu_backward
    b.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_float, ctypes.c_float, ptr, ptr, ptr, ptr, ptr,
                  c_int, c_int, ptr]
    b.restype = c_int
    lib.diff_attention_cpu_use_openmp.argtypes, lib.diff_attention_cpu_use_openmp.restype = [c_int], c_int
    lib.diff_attention_cpu_release.argtypes, lib.diff_attention_cpu_release.restype = [], None
    lib.diff_attention_cpu_kept_bytes.argtypes, lib.diff_attention_cpu_kept_bytes.restype = [], ctypes.c_long
    lib.diff_attention_cpu_keep_at_most.argtypes = [ctypes.c_long]
    lib.diff_attention_cpu_keep_at_most.restype = ctypes.c_long
    for name in ("diff_attention_cpu_on_openmp", "diff_attention_cpu_last_threads", "diff_attention_cpu_vector_floats"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [], c_int
    return lib


def _is_openmp_runtime(filename: str) -> bool:
    """Whether a library file is an OpenMP runtime: GNU's ``libgomp``, Intel's ``libiomp5`` or LLVM's ``libomp``,
    also under a wheel's renamed copy (``libgomp-a34b3233.so.1``); not an offloading plugin (``libgomp-plugin-*``)."""
    return "plugin" not in filename and \
        re.fullmatch(r"lib(gomp|iomp5|omp)([-.][^/]*)?\.(so|dylib)(\.[0-9.]+)?", filename) is not None


def _openmp_runtimes() -> Optional[set[str]]:
    """The files of the OpenMP runtimes mapped into this process, from Linux's ``/proc/self/maps`` (a file replaced
    since it was loaded counts as well: `` (deleted)``); None where the process cannot list them."""
    try:
        maps = Path("/proc/self/maps").read_bytes()
    except OSError:
        return None
    return _runtimes_in(maps)


def _runtimes_in(maps: bytes) -> set[str]:
    """The OpenMP runtimes' files in a ``/proc/<pid>/maps`` listing (its paths are any bytes, not always UTF-8)."""
    lines = maps.decode("utf-8", "surrogateescape").splitlines()
    files = {fields[5].removesuffix(" (deleted)") for fields in (line.split(None, 5) for line in lines)
             if len(fields) == 6}
    return {f for f in files if _is_openmp_runtime(os.path.basename(f))}


def _use_openmp(lib: ctypes.CDLL, wanted: bool) -> bool:
    """Run the kernel on OpenMP's thread pool (``wanted``) or on threads it starts per call; returns whether it now
    runs on OpenMP's (never where it was built without OpenMP)."""
    return bool(lib.diff_attention_cpu_use_openmp(int(wanted))) and wanted


def _choose_threads(lib: ctypes.CDLL) -> bool:
    """OpenMP's pool where this process has exactly one OpenMP runtime, the kernel loaded: then it is torch's (or,
    where torch uses none, the kernel's alone), and its threads, still spinning from torch's last parallel call,
    take the kernel's work at once, where threads of the kernel's own would share the cores with them. Where the
    kernel brought a second runtime, or the runtimes cannot be listed, it starts threads of its own per call."""
    try:
        runtimes = _openmp_runtimes()
    except Exception:  # noqa: BLE001 - whatever it is, the kernel's own threads are always safe
        runtimes = None
    return _use_openmp(lib, runtimes is not None and len(runtimes) == 1)


def _first_load() -> ctypes.CDLL:
    """Build (or find), load, choose the threads of, and self-check the kernel. Raises KernelUnavailable."""
    path = library_path()
    try:
        lib = _load(path)
    except (OSError, AttributeError) as e:
        raise KernelUnavailable(f"the compiled kernel {path} could not be loaded ({e}); delete it to rebuild, "
                                f"or use backend='sdpa_padded'") from e
    _THREADS.update(built=_use_openmp(lib, True), openmp=_choose_threads(lib))
    with torch._C._DisableFuncTorch():  # a first use under torch.func (its status asked) checks plain tensors
        _self_check(lib)
    return lib


_THREADS: dict[str, bool] = {}  # of the loaded kernel: "built" with OpenMP, runs on its pool ("openmp")


@contextlib.contextmanager
def _own_threads() -> Iterator[None]:
    """Within: the kernel starts threads of its own per call, as it does where it cannot use torch's pool (for
    tests, and for the benchmarks that measure what the pool buys)."""
    lib = _kernel()
    _use_openmp(lib, False)
    try:
        yield
    finally:
        _use_openmp(lib, _THREADS["openmp"])


def kernel_threads() -> str:
    """Where the loaded kernel's work runs now: ``"openmp"``, the OpenMP thread pool of torch's own parallel calls,
    or ``"own"``, threads it starts per call: where it was built without OpenMP, where the process has more than one
    OpenMP runtime (one that a library loaded before the kernel brought beside torch's) or cannot list them (off
    Linux), and in a child forked after it was loaded. The numbers are the same bit for bit. Raises
    KernelUnavailable where the kernel cannot be had."""
    return "openmp" if _kernel().diff_attention_cpu_on_openmp() else "own"


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


def _self_check(lib: ctypes.CDLL) -> None:
    """A small problem with every feature (GQA, tails in every dimension, causal, a mask, per-token lambda)
    against the naive formula in float64: a miscompiled kernel is never used."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 29, 24, generator=g), torch.randn(2, 2, 37, 24, generator=g)
    v, lam = torch.randn(2, 1, 37, 48, generator=g), torch.rand(2, 2, 29, 1, generator=g)
    mask = torch.randn(29, 37, generator=g).expand(2, 2, 29, 37)
    from diffattn_tutorial.formulations import naive_reference  # the reference (a layer above the kernels)

    tall = torch.randn(1, 2, 523, 24, generator=g)  # more rows than ROW_MAJOR_ROWS: k transposed, the score tiles
    for qq, kk, vv, ll, causal, m in ((q, k, v, lam, False, None), (q, k, v, lam, True, None), (q, k, v, lam, False,
                                      mask), (tall, k[:1, :2], v[:1, :1], lam[:1, :1, :1], False, None)):
        out = _forward(lib, qq, kk, vv, ll, m, causal, 24 ** -0.5)
        ref = naive_reference(qq.double(), kk.double(), vv.double(), ll.double(), causal=causal,
                              attn_mask=None if m is None else m.double())
        err = (out.double() - ref).abs().max().item()
        if not err < 1e-4:
            raise KernelUnavailable(f"the compiled kernel disagrees with the naive formula (max error {err:.3g}, "
                                    f"causal={causal}, mask={m is not None}); it is not used")
    for causal, m in ((True, None), (False, mask)):
        grad_out = torch.randn(2, 2, 29, 48, generator=g)
        expected = _reference_gradients(naive_reference, (q, k, v, lam), m, causal, grad_out)
        dq, dk, dv, dlam = _backward(lib, grad_out, q, k, v, lam, m, causal, 24 ** -0.5)
        got = (dq, dk, dv, dlam.unsqueeze(-1))
        err = max((a.double() - b).abs().max().item() for a, b in zip(got, expected))
        if not err < 1e-4:
            raise KernelUnavailable(f"the compiled kernel's gradients disagree with the naive formula's (max error "
                                    f"{err:.3g}, causal={causal}, mask={m is not None}); it is not used")


def _reference_gradients(reference, inputs, mask, causal, grad_out) -> tuple[Tensor, ...]:
    """The float64 reference's gradients, computed in a thread of its own: the first use of the kernel may come from
    inside an operator call (``torch.ops.diffattn.cpu_fused_forward``), where autograd is switched off for the
    calling thread whatever ``torch.enable_grad`` says; a new thread starts with autograd on."""
    result: list = []

    def run() -> None:
        try:
            ins = [t.double().requires_grad_() for t in inputs]
            ref = reference(*ins, causal=causal, attn_mask=None if mask is None else mask.double())
            result.append(torch.autograd.grad(ref, ins, grad_out.double()))
        except Exception as e:  # noqa: BLE001 - raised again in the caller's thread
            result.append(e)

    worker = threading.Thread(target=run, name="cpu_fused self-check")
    worker.start()
    worker.join()
    if isinstance(result[0], Exception):
        raise result[0]
    return result[0]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _backward_block_rows(nq: int, nk_pad: int, d_pad: int) -> int:
    """The backward's rows per block: as the forward's, or :data:`BACKWARD_ROWS_LONG` over long keys and many query
    rows (fewer rows would be mostly padding in tall blocks). Shapes alone decide, so that the gradients do not
    depend on the machine or the thread count."""
    if nk_pad * 4 * d_pad * 4 > PARTIAL_BYTES_IN_CACHE and nq >= BACKWARD_LONG_MIN_ROWS:
        return BACKWARD_ROWS_LONG
    return BLOCK_ROWS[0] if nq <= BLOCK_ROWS[0] else BLOCK_ROWS[1]


def _float_mask(mask: Tensor) -> Tensor:
    """An additive float32 mask from a bool (True = may attend) or additive one, any broadcastable shape. An
    additive entry ``<= finfo(dtype).min`` becomes ``-inf``: masked, as ``diff_attention`` and the Triton kernel
    count it (a row of them sees no key and gives zero, not a uniform average)."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(~mask, float("-inf"))
    low = mask <= torch.finfo(mask.dtype).min
    return mask.float().masked_fill(low, float("-inf")) if low.any() else mask.float()


def _kernel_layout(t: Tensor, width: int) -> Tensor:
    """``t`` as the kernel reads it: float32 of last dim ``width`` with contiguous rows, anywhere else in memory (the
    kernel takes the strides of batch, head and row: a transposed view of a projection's output is read where it
    is); a copy only where ``t`` is of another dtype, narrower (zero-padded) or has strided rows."""
    t = t.float()
    if t.shape[-1] < width:
        return F.pad(t, (0, width - t.shape[-1]))
    return t if t.stride(-1) == 1 else t.contiguous()


def _heads_inside_rows(q: Tensor) -> bool:
    """Whether q is a projection's ``(B, N, heads, d)`` output viewed as ``(B, heads, N, d)`` (its heads closer in
    memory than its rows): then the output is laid out the same way, and the layer's ``(B, N, H * 2d)`` view of it
    for ``out_proj`` needs no copy."""
    return q.shape[1] > 1 and q.shape[2] > 1 and q.stride(1) < q.stride(2)


def _new_output(q: Tensor, B: int, H: int, nq: int, width: int, dtype: torch.dtype) -> Tensor:
    """An empty ``(B, H, nq, width)`` output, laid out as q (:func:`_heads_inside_rows`), else contiguous."""
    if _heads_inside_rows(q):
        return q.new_empty(B, nq, H, width, dtype=dtype).transpose(1, 2)
    return q.new_empty(B, H, nq, width, dtype=dtype)


MAPS_KEPT_BYTES = 16 << 20
"""Eager training keeps the forward's normalised maps for the backward where they take at most this many bytes
(``B * H * 2 * Nq * Nk``, keys padded to 32, float32; the issue's layer up to N = 512): the backward then reads them
instead of computing the scores and the softmax again, a fifth of its work. Longer calls recompute them
(FlashAttention's trade: no N x N tensor kept). Shapes alone decide, so the gradients do not depend on the machine."""


def _new_maps(q: Tensor, k: Tensor) -> Optional[Tensor]:
    """An empty ``(B, H, 2, Nq, Nk_pad)`` float32 tensor for the kernel's kept maps, or None above
    :data:`MAPS_KEPT_BYTES`."""
    B, H2, nq, _ = q.shape
    nk_pad = _round_up(k.shape[2], KEY_MULTIPLE)
    if B * H2 * nq * nk_pad * 4 > MAPS_KEPT_BYTES:
        return None
    return q.new_empty(B, H2 // 2, 2, nq, nk_pad, dtype=torch.float32)  # not torch's default dtype or device


def _output_strides(q: Tensor, H: int, nq: int, width: int) -> tuple[int, ...]:
    """The strides of :func:`_new_output`'s tensor, without making one."""
    if _heads_inside_rows(q):
        return (nq * H * width, width, H * width, 1)
    return (H * nq * width, nq * width, width, 1)


def _layouts(*tensors: Tensor) -> ctypes.Array:
    """The element strides of batch, head and row of each 4-d tensor, as the kernel takes them."""
    return (ctypes.c_long * (3 * len(tensors)))(*(s for t in tensors for s in t.stride()[:3]))


def _mask_view(mask: Optional[Tensor], shape: tuple) -> tuple[Optional[Tensor], ctypes.Array]:
    """The mask as the kernel reads it: float32, expanded to ``shape`` (B, H, Nq, Nk), contiguous along keys
    (or broadcast there), and its element strides (0 where broadcast)."""
    if mask is None:
        return None, (ctypes.c_long * 4)(0, 0, 0, 0)
    m = _float_mask(mask)
    if m.shape[-1] != 1 and m.stride(-1) != 1:
        m = m.contiguous()
    m = m.expand(shape)
    return m, (ctypes.c_long * 4)(*(s if n > 1 else 0 for s, n in zip(m.stride(), m.shape)))


def _forward(lib: ctypes.CDLL, q: Tensor, k: Tensor, v: Tensor, lam: Tensor, mask: Optional[Tensor], causal: bool,
             scale: float, scan: bool = False, maps: Optional[Tensor] = None) -> Optional[Tensor]:
    """Lay the inputs out as the kernel expects (see the source's header) and run it on torch's thread count.
    float32 inputs with contiguous rows and a head width that is a multiple of 32 are read where they are (no copy),
    whatever their batch, head and row strides. With ``scan``: None where q, k or v holds a NaN or an infinity.
    ``maps`` (:func:`_new_maps`): where the kernel keeps the normalised maps for :func:`_backward`."""
    B, H2, nq, d = q.shape
    H, Hkv, nk = H2 // 2, v.shape[1], k.shape[2]
    d_pad = _round_up(d, VALUE_MULTIPLE // 2)  # the value width 2 * d_pad is a multiple of the 64-column tile
    out = _new_output(q, B, H, nq, 2 * d_pad, torch.float32)
    q, k, v = (_kernel_layout(t, width) for t, width in ((q, d_pad), (k, d_pad), (v, 2 * d_pad)))
    lam_rows = lam.float().expand(B, H, nq, 1)[..., 0].contiguous()  # (B, H, Nq)
    block_rows = BLOCK_ROWS[0] if nq <= BLOCK_ROWS[0] else BLOCK_ROWS[1]
    m, strides = _mask_view(mask, (B, H, nq, nk))
    mask_ptr = None if m is None else m.data_ptr()
    sizes = (ctypes.c_int * 8)(B, H, Hkv, nq, nk, d_pad, 2 * d_pad, block_rows)
    seen = ctypes.c_int(0)
    rc = lib.diff_attention_cpu_forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), lam_rows.data_ptr(), mask_ptr,
                                        strides, _layouts(q, k, v, out), LOG2E, scale, out.data_ptr(), sizes,
                                        int(causal), torch.get_num_threads(), ctypes.byref(seen) if scan else None,
                                        None if maps is None else maps.data_ptr())
    if rc == -2:
        raise MemoryError(f"the fused CPU kernel could not allocate its buffers (k transposed, and {block_rows} x "
                          f"{_round_up(nk, KEY_MULTIPLE)} scores per thread); use backend='sdpa_padded'")
    if rc != 0:
        raise RuntimeError(f"the fused CPU kernel refused sizes {tuple(sizes)} (code {rc}); please report this")
    if seen.value:
        return None
    return out if d_pad == d else out[..., : 2 * d]


def _backward(lib: ctypes.CDLL, grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, lam: Tensor,
              mask: Optional[Tensor], causal: bool, scale: float,
              maps: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gradients of :func:`_forward`'s output: float32 ``dq, dk, dv`` shaped as q, k, v (and laid out as them
    where they are dense) and ``dlam`` per row, ``(B, H, Nq)`` (the caller sums it to lam's shape). Inputs read as
    the forward reads them; ``maps``: the forward's kept maps (else the kernel recomputes them)."""
    B, H2, nq, d = q.shape
    H, Hkv, nk = H2 // 2, v.shape[1], k.shape[2]
    d_pad = _round_up(d, VALUE_MULTIPLE // 2)
    q, k, v, grad_out = (_kernel_layout(t, width) for t, width in
                         ((q, d_pad), (k, d_pad), (v, 2 * d_pad), (grad_out, 2 * d_pad)))
    lam_rows = lam.float().expand(B, H, nq, 1)[..., 0].contiguous()  # (B, H, Nq)
    block_rows = _backward_block_rows(nq, _round_up(nk, KEY_MULTIPLE), d_pad)
    m, strides = _mask_view(mask, (B, H, nq, nk))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # laid out as q, k, v where dense
    dlam = torch.empty(B, H, nq, dtype=torch.float32)
    sizes = (ctypes.c_int * 8)(B, H, Hkv, nq, nk, d_pad, 2 * d_pad, block_rows)
    rc = lib.diff_attention_cpu_backward(q.data_ptr(), k.data_ptr(), v.data_ptr(), lam_rows.data_ptr(),
                                         None if m is None else m.data_ptr(), strides, grad_out.data_ptr(),
                                         _layouts(q, k, v, grad_out, dq, dk, dv), LOG2E, scale, dq.data_ptr(),
                                         dk.data_ptr(), dv.data_ptr(), dlam.data_ptr(), sizes, int(causal),
                                         torch.get_num_threads(), None if maps is None else maps.data_ptr())
    if rc == -2:
        raise MemoryError("the fused CPU kernel's backward could not allocate its buffers (k and v transposed, "
                          "partial sums of dk and dv, and a block of scores per thread); use backend='sdpa_padded'")
    if rc != 0:
        raise RuntimeError(f"the fused CPU kernel's backward refused sizes {tuple(sizes)} (code {rc}); please "
                           f"report this")
    if d_pad != d:
        dq, dk, dv = dq[..., :d], dk[..., :d], dv[..., : 2 * d]
    return dq, dk, dv, dlam


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


OP_NAME = "diffattn::cpu_fused_forward"
"""The kernel as a torch operator: ``torch.ops.diffattn.cpu_fused_forward(q, k, v, lam, attn_mask, causal, scale)``,
one node in a ``torch.compile`` graph (its fake implementation gives the output's shape and dtype)."""


@torch.library.custom_op(OP_NAME, mutates_args=(), device_types="cpu")
def cpu_fused_forward(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, attn_mask: Optional[Tensor], causal: bool,
                      scale: float) -> Tensor:
    """The fused forward on CPU tensors, as :func:`fused_diff_attention` describes; a new ``(B, H, Nq, 2d)``
    tensor in q's dtype, contiguous, or, where q is a projection's ``(B, Nq, 2H, d)`` output viewed as
    ``(B, 2H, Nq, d)``, the same view of a ``(B, Nq, H, 2d)`` tensor. Gradients flow to q, k, v and lam
    (:data:`BACKWARD_OP_NAME`); an ``attn_mask`` that requires grad is refused."""
    return _forward_checked(q, k, v, lam, attn_mask, causal, scale)


def _forward_checked(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, attn_mask: Optional[Tensor], causal: bool,
                     scale: float, scan: bool = False, maps: Optional[Tensor] = None) -> Optional[Tensor]:
    """The operator's body: its checks, then the kernel (with ``scan``: None where q, k or v is not finite;
    ``maps``: kept there for the backward)."""
    check_operator_inputs(q, k, v, lam, attn_mask)
    _check_scale(scale)
    out = _forward(_kernel(), q, k, v, lam, attn_mask, causal, scale, scan, maps)
    if out is None:
        return None
    B, H2, nq, d = q.shape
    if out.dtype == q.dtype and out.stride() == _output_strides(q, H2 // 2, nq, 2 * d):
        return out  # laid out as _new_output lays it out: what the fake implementation promises
    return _new_output(q, B, H2 // 2, nq, 2 * d, q.dtype).copy_(out)


@cpu_fused_forward.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, attn_mask: Optional[Tensor], causal: bool,
      scale: float) -> Tensor:
    check_operator_inputs(q, k, v, lam, attn_mask)
    _check_scale(scale)
    B, H2, nq, d = q.shape
    return _new_output(q, B, H2 // 2, nq, 2 * d, q.dtype)


BACKWARD_OP_NAME = "diffattn::cpu_fused_backward"
"""The kernel's backward as a torch operator: ``torch.ops.diffattn.cpu_fused_backward(grad_out, q, k, v, lam,
attn_mask, causal, scale)`` gives ``(dq, dk, dv, dlam)``, dlam per row ``(B, H, Nq)`` in float32."""


@torch.library.custom_op(BACKWARD_OP_NAME, mutates_args=(), device_types="cpu")
def cpu_fused_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, lam: Tensor, attn_mask: Optional[Tensor],
                       causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gradients of :func:`cpu_fused_forward`'s output ``grad_out``: dq, dk, dv in q's dtype, laid out as
    ``torch.empty_like`` lays out q, k and v (a transposed view's gradient is the same view of a dense tensor, as a
    projection's backward wants it), and dlam per row, ``(B, H, Nq)`` float32; fully masked rows get zero
    gradients."""
    return _backward_checked(grad_out, q, k, v, lam, attn_mask, causal, scale)


def _backward_checked(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, lam: Tensor, attn_mask: Optional[Tensor],
                      causal: bool, scale: float, maps: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The backward operator's body: its checks, then the kernel (from the forward's kept ``maps`` if given)."""
    check_operator_inputs(q, k, v, lam, attn_mask, grad_out)
    _check_scale(scale)
    grads = _backward(_kernel(), grad_out, q, k, v, lam, attn_mask, causal, scale, maps)
    return (*(_like(g, t) for g, t in zip(grads, (q, k, v))), grads[3])


def _like(grad: Tensor, t: Tensor) -> Tensor:
    """``grad`` in ``t``'s dtype and ``torch.empty_like(t)``'s layout (what the fake implementation promises)."""
    like = torch.empty_like(t)
    if grad.dtype == like.dtype and grad.stride() == like.stride():
        return grad
    return like.copy_(grad)


@cpu_fused_backward.register_fake
def _(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, lam: Tensor, attn_mask: Optional[Tensor], causal: bool,
      scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    check_operator_inputs(q, k, v, lam, attn_mask, grad_out)
    _check_scale(scale)
    B, H2, nq, _ = q.shape
    return (torch.empty_like(q), torch.empty_like(k, dtype=q.dtype), torch.empty_like(v, dtype=q.dtype),
            q.new_empty(B, H2 // 2, nq, dtype=torch.float32))


def _refuse_mask_grad(attn_mask: Optional[Tensor]) -> None:
    if attn_mask is not None and attn_mask.requires_grad:
        raise ValueError("attn_mask requires grad (a learned bias?), but the fused CPU kernel gives a mask no "
                         "gradient; pass attn_mask.detach() if it is not to be learned, or use "
                         "diff_attention(..., backend='naive') to learn it")


def _setup_context(ctx, inputs: tuple, output: Tensor) -> None:
    q, k, v, lam, attn_mask, causal, scale = inputs
    _refuse_mask_grad(attn_mask)
    ctx.save_for_backward(q, k, v, lam, attn_mask)
    ctx.causal, ctx.scale = causal, scale


def _autograd_backward(ctx, grad_out: Tensor) -> tuple:
    q, k, v, lam, attn_mask = ctx.saved_tensors
    dq, dk, dv, dlam = cpu_fused_backward(grad_out, q, k, v, lam, attn_mask, ctx.causal, ctx.scale)
    return dq, dk, dv, _ordered_sum_to(dlam.unsqueeze(-1), lam.shape).to(lam.dtype), None, None, None


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


cpu_fused_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


class CpuFusedTraining(torch.autograd.Function):
    """The forward operator with its gradients in eager mode, without the dispatcher: the operators' bodies, the
    same kernel calls, without the operators' dispatch in every step, and with the maps kept for the backward where
    they are small (:data:`MAPS_KEPT_BYTES`). ``torch.compile`` traces the
    operators themselves (:func:`fused_diff_attention`), and a graph of the gradients (``create_graph=True``) is
    built from the backward operator, whose node refuses a second derivative by name."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, lam: Tensor, attn_mask: Optional[Tensor], causal: bool,
                scale: float, scan: bool) -> Tensor:
        maps = _new_maps(q, k)  # short calls: the backward reads the maps instead of computing them again
        out = _forward_checked(q, k, v, lam, attn_mask, causal, scale, scan, maps)
        if out is None:
            raise _NotFinite  # caught by fused_diff_attention: no node is made
        _setup_context(ctx, (q, k, v, lam, attn_mask, causal, scale), out)
        ctx.maps = maps
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple:
        if torch.is_grad_enabled():  # create_graph
            return (*_autograd_backward(ctx, grad_out), None)
        q, k, v, lam, attn_mask = ctx.saved_tensors
        dq, dk, dv, dlam = _backward_checked(grad_out, q, k, v, lam, attn_mask, ctx.causal, ctx.scale, ctx.maps)
        ctx.maps = None  # freed now; a second backward (retain_graph=True) computes them again
        dlam = _ordered_sum_to(dlam.unsqueeze(-1), lam.shape).to(lam.dtype) if ctx.needs_input_grad[3] else None
        return dq, dk, dv, dlam, None, None, None, None


class _NotFinite(Exception):
    """A scanning call's inputs held a NaN or an infinity (inside :class:`CpuFusedTraining`'s forward)."""


def _no_second_derivative(ctx, *grads) -> tuple:
    raise RuntimeError("the fused CPU kernel has no second derivative (a gradient of its gradients, as a gradient "
                       "penalty takes): use diff_attention(..., backend='naive') there (SDPA's fused CPU kernel, "
                       "which backend='sdpa_padded' reaches, has none either)")


cpu_fused_backward.register_autograd(_no_second_derivative, setup_context=lambda ctx, inputs, output: None)


def _refuse_layout(q, k, v, lam, attn_mask, *rest):
    check_operator_inputs(q, k, v, lam, attn_mask)  # raises: some argument is not dense
    raise ValueError("the fused CPU kernel reads dense (strided) tensors only; pass t.to_dense() for each")


_SPARSE = torch.library.Library("diffattn", "FRAGMENT")  # a sparse argument reaches the check, not a dispatch error
def _refuse_layout_backward(grad_out, q, k, v, lam, attn_mask, *rest):
    check_operator_inputs(q, k, v, lam, attn_mask, grad_out)  # raises: some argument is not dense
    raise ValueError("the fused CPU kernel reads dense (strided) tensors only; pass t.to_dense() for each")


for _key in ("SparseCPU", "SparseCsrCPU"):
    _SPARSE.impl("cpu_fused_forward", _refuse_layout, _key)
    _SPARSE.impl("cpu_fused_backward", _refuse_layout_backward, _key)
del _key


def fused_diff_attention(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, *, attn_mask: Optional[Tensor] = None,
                         causal: bool = False, scale: float, scan: bool = False) -> Optional[Tensor]:
    """Differential attention by the fused CPU kernel, on inputs :func:`~diffattn_tutorial.functional.diff_attention`
    has validated: q ``(B, 2H, Nq, d)``, k ``(B, 2Hkv, Nk, d)``, v ``(B, Hkv, Nk, 2d)``, lam broadcastable to
    ``(B, H, Nq, 1)`` (a tensor), ``attn_mask`` bool or additive broadcastable to ``(B, H, Nq, Nk)`` (entries
    ``<= finfo(dtype).min`` masked; a fully masked row gives zero output and gradients), ``causal`` bottom-right
    aligned. Computes in float32; returns ``(B, H, Nq, 2d)`` in q's dtype (laid out as q where q is a projection's
    transposed view, else contiguous), with gradients to q, k, v and lam (laid out as them). Runs the operator :data:`OP_NAME`, so it compiles (``torch.compile(fullgraph=True)``) as
    one node. Raises KernelUnavailable where the kernel cannot be built (see :func:`kernel_status`), ValueError
    for an ``attn_mask`` that requires grad (the kernel gives a mask no gradient).

    ``scan=True`` (eager calls; ignored while ``torch.compile`` traces): the kernel also scans q, k and v for NaN
    and infinities as it reads them, and the call returns None where it finds one (``diff_attention`` then takes its
    careful path), without a pass of its own over them first.

    An eager call runs the operators' bodies without the dispatcher (:class:`CpuFusedTraining` where there is
    something to differentiate): the same checks and kernel, without torch importing ``torch._dynamo`` on the
    operator's first call (about a second, in every new process)."""
    if not isinstance(lam, Tensor):  # on every path (the dispatcher's own message would not name the fix)
        raise TypeError(f"lam must be a torch.Tensor, got {type(lam).__name__}: pass torch.tensor(lam)")
    grad = torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in (q, k, v, lam))
    if torch.is_grad_enabled():
        _refuse_mask_grad(attn_mask)
    if torch.compiler.is_compiling():
        return cpu_fused_forward(q, k, v, lam, attn_mask, bool(causal), float(scale))
    if not grad:
        return _forward_checked(q, k, v, lam, attn_mask, bool(causal), float(scale), bool(scan))
    try:
        return CpuFusedTraining.apply(q, k, v, lam, attn_mask, bool(causal), float(scale), bool(scan))
    except _NotFinite:
        return None


__all__ = ["SOURCE", "BLOCK_ROWS", "OP_NAME", "BACKWARD_OP_NAME", "KernelUnavailable", "compiler", "library_path",
           "kernel_status", "kernel_threads", "vector_floats", "check_operator_inputs", "cpu_fused_forward",
           "cpu_fused_backward", "fused_diff_attention", "release_buffers"]
