"""The C boundary of the fused CPU kernel: each call passes ``ctypes`` Structures that mirror the C++ structs of
``diff_attention_cpu.cpp`` field by field (:class:`Inputs`, :class:`ForwardArgs`, :class:`BackwardArgs`), and
:func:`forward` / :func:`backward` lay tensors out as the kernel reads them and fill those structs by name.

ctypes passes pointers unchecked, so :func:`load` compares these Structures with the layout the library reports
(``diff_attention_cpu_fields``: each struct's size, each field's name, offset and size, in order) and refuses a
library that disagrees. Adding an argument: one field in the C++ struct and its row in ``boundary_fields`` there,
one field here, and the line of :func:`forward` or :func:`backward` that fills it.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from diffattn_tutorial.constants import LOG2E
from diffattn_tutorial.kernels.cpu.build import KernelUnavailable

Tensor = torch.Tensor
c_long, c_int, c_float, ptr = ctypes.c_long, ctypes.c_int, ctypes.c_float, ctypes.c_void_p

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


class Layout(ctypes.Structure):
    """Element strides of a tensor's batch, head and row dims (its last dim is contiguous)."""
    _fields_ = [("b", c_long), ("h", c_long), ("r", c_long)]


class Inputs(ctypes.Structure):
    """One problem, as the forward and the backward read it (C++ ``Inputs``)."""
    _fields_ = [("q", ptr), ("k", ptr), ("v", ptr), ("lam", ptr), ("mask", ptr),
                ("lq", Layout), ("lk", Layout), ("lv", Layout),
                ("mask_b", c_long), ("mask_h", c_long), ("mask_q", c_long), ("mask_k", c_long),
                ("batch", c_int), ("heads", c_int), ("kv_heads", c_int), ("nq", c_int), ("nk", c_int), ("d", c_int),
                ("dv", c_int), ("block_rows", c_int), ("causal", c_int), ("n_threads", c_int),
                ("qk_scale", c_float), ("exp_scale", c_float)]


class ForwardArgs(ctypes.Structure):
    """The forward's own arguments (C++ ``ForwardArgs``); the kernel writes ``nonfinite``."""
    _fields_ = [("out", ptr), ("maps", ptr), ("lo", Layout), ("scan", c_int), ("nonfinite", c_int)]


class BackwardArgs(ctypes.Structure):
    """The backward's own arguments (C++ ``BackwardArgs``)."""
    _fields_ = [("dout", ptr), ("maps", ptr), ("gq", ptr), ("gk", ptr), ("gv", ptr), ("glam", ptr),
                ("ldo", Layout), ("lgq", Layout), ("lgk", Layout), ("lgv", Layout)]


STRUCTS = (Layout, Inputs, ForwardArgs, BackwardArgs)


class FieldAt(ctypes.Structure):
    """A row of the library's ``boundary_fields``: a struct's size (empty field name) or a field's offset and size."""
    _fields_ = [("type", ctypes.c_char_p), ("field", ctypes.c_char_p), ("offset", c_long), ("size", c_long)]


def load(path: Path) -> ctypes.CDLL:
    """The library at ``path`` with its functions' C types set. Raises OSError or AttributeError where it cannot be
    loaded or lacks a function, KernelUnavailable where its structs differ from these (:func:`check_layout`)."""
    lib = ctypes.CDLL(str(path))
    types = {"diff_attention_cpu_forward": ([ctypes.POINTER(Inputs), ctypes.POINTER(ForwardArgs)], c_int),
             "diff_attention_cpu_backward": ([ctypes.POINTER(Inputs), ctypes.POINTER(BackwardArgs)], c_int),
             "diff_attention_cpu_fields": ([ctypes.POINTER(ctypes.POINTER(FieldAt))], c_int),
             "diff_attention_cpu_use_openmp": ([c_int], c_int), "diff_attention_cpu_release": ([], None),
             "diff_attention_cpu_kept_bytes": ([], c_long), "diff_attention_cpu_keep_at_most": ([c_long], c_long),
             "diff_attention_cpu_on_openmp": ([], c_int), "diff_attention_cpu_last_threads": ([], c_int),
             "diff_attention_cpu_vector_floats": ([], c_int)}
    for name, (args, result) in types.items():
        getattr(lib, name).argtypes, getattr(lib, name).restype = args, result
    check_layout(lib)
    return lib


def library_layout(lib: ctypes.CDLL) -> dict[str, list[tuple[str, int, int]]]:
    """Per struct, as the library was compiled: ``[("", 0, sizeof), (field, offset, size), ...]`` in order."""
    rows = ctypes.POINTER(FieldAt)()
    count = lib.diff_attention_cpu_fields(ctypes.byref(rows))
    layout: dict[str, list[tuple[str, int, int]]] = {}
    for row in rows[:count]:
        layout.setdefault(row.type.decode(), []).append((row.field.decode(), row.offset, row.size))
    return layout


def python_layout() -> dict[str, list[tuple[str, int, int]]]:
    """The same table for this module's Structures."""
    return {s.__name__: [("", 0, ctypes.sizeof(s))] + [(n, getattr(s, n).offset, getattr(s, n).size)
                                                      for n, _ in s._fields_] for s in STRUCTS}


def check_layout(lib: ctypes.CDLL) -> None:
    """Raise KernelUnavailable where the library's structs differ from this module's (a stale build, or a field
    added on one side only): a call would hand the kernel misplaced pointers."""
    ours, theirs = python_layout(), library_layout(lib)
    if ours != theirs:
        wrong = sorted(name for name in ours.keys() | theirs.keys() if ours.get(name) != theirs.get(name))
        raise KernelUnavailable(f"the compiled kernel's argument structs {wrong} differ from boundary.py's ctypes "
                                f"Structures (fields, order or sizes); add the field on both sides")


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def heads_inside_rows(q: Tensor) -> bool:
    """Whether q is a projection's ``(B, N, heads, d)`` output viewed as ``(B, heads, N, d)`` (its heads closer in
    memory than its rows): then the output is laid out the same way, and the layer's ``(B, N, H * 2d)`` view of it
    for ``out_proj`` needs no copy."""
    return q.shape[1] > 1 and q.shape[2] > 1 and q.stride(1) < q.stride(2)


def new_output(q: Tensor, B: int, H: int, nq: int, width: int, dtype: torch.dtype) -> Tensor:
    """An empty ``(B, H, nq, width)`` output, laid out as q (:func:`heads_inside_rows`), else contiguous."""
    if heads_inside_rows(q):
        return q.new_empty(B, nq, H, width, dtype=dtype).transpose(1, 2)
    return q.new_empty(B, H, nq, width, dtype=dtype)


def output_strides(q: Tensor, H: int, nq: int, width: int) -> tuple[int, ...]:
    """The strides of :func:`new_output`'s tensor, without making one."""
    if heads_inside_rows(q):
        return (nq * H * width, width, H * width, 1)
    return (H * nq * width, nq * width, width, 1)


def maps_shape(q: Tensor, k: Tensor) -> tuple:
    """The shape of the kept maps, ``(B, H, 2, Nq, Nk_pad)``."""
    B, H2, nq, _ = q.shape
    return (B, H2 // 2, 2, nq, round_up(k.shape[2], KEY_MULTIPLE))


def backward_block_rows(nq: int, nk_pad: int, d_pad: int) -> int:
    """The backward's rows per block: as the forward's, or :data:`BACKWARD_ROWS_LONG` over long keys and many query
    rows (fewer rows would be mostly padding in tall blocks). Shapes alone decide, so that the gradients do not
    depend on the machine or the thread count."""
    if nk_pad * 4 * d_pad * 4 > PARTIAL_BYTES_IN_CACHE and nq >= BACKWARD_LONG_MIN_ROWS:
        return BACKWARD_ROWS_LONG
    return BLOCK_ROWS[0] if nq <= BLOCK_ROWS[0] else BLOCK_ROWS[1]


def float_mask(mask: Tensor) -> Tensor:
    """An additive float32 mask from a bool (True = may attend) or additive one, any broadcastable shape, on the
    mask's device. An additive entry ``<= finfo(dtype).min`` becomes ``-inf``: masked, as ``diff_attention`` and the
    Triton kernel count it (a row of them sees no key and gives zero, not a uniform average)."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))
    low = mask <= torch.finfo(mask.dtype).min
    return mask.float().masked_fill(low, float("-inf")) if low.any() else mask.float()


def kernel_layout(t: Tensor, width: int) -> Tensor:
    """``t`` as the kernel reads it: float32 of last dim ``width`` with contiguous rows, anywhere else in memory (the
    kernel takes the strides of batch, head and row: a transposed view of a projection's output is read where it
    is); a copy only where ``t`` is of another dtype, narrower (zero-padded) or has strided rows."""
    t = t.float()
    if t.shape[-1] < width:
        return F.pad(t, (0, width - t.shape[-1]))
    return t if t.stride(-1) == 1 else t.contiguous()


def layout(t: Tensor) -> Layout:
    """The element strides of batch, head and row of a 4-d tensor."""
    return Layout(*t.stride()[:3])


def _inputs(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, mask: Optional[Tensor], causal: bool, scale: float,
            block_rows: int) -> tuple[Inputs, tuple[Tensor, ...]]:
    """The Inputs of a call on q, k, v already laid out (:func:`kernel_layout`), and the tensors it points into
    (kept alive by the caller until the call returns)."""
    B, H2, nq, d_pad = q.shape
    H, nk = H2 // 2, k.shape[2]
    lam_rows = lam.float().expand(B, H, nq, 1)[..., 0].contiguous()  # (B, H, Nq)
    m = None
    if mask is not None:
        m = float_mask(mask)
        if m.shape[-1] != 1 and m.stride(-1) != 1:
            m = m.contiguous()
        m = m.expand(B, H, nq, nk)  # contiguous along keys, or broadcast there
    strides = (0, 0, 0, 0) if m is None else [s if n > 1 else 0 for s, n in zip(m.stride(), m.shape)]
    ins = Inputs(q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), lam=lam_rows.data_ptr(),
                 mask=None if m is None else m.data_ptr(), lq=layout(q), lk=layout(k), lv=layout(v),
                 mask_b=strides[0], mask_h=strides[1], mask_q=strides[2], mask_k=strides[3],
                 batch=B, heads=H, kv_heads=v.shape[1], nq=nq, nk=nk, d=d_pad, dv=v.shape[3], block_rows=block_rows,
                 causal=int(causal), n_threads=torch.get_num_threads(), qk_scale=scale, exp_scale=LOG2E)
    return ins, (lam_rows, m)


def _raise_for(rc: int, ins: Inputs, what: str, buffers: str) -> None:
    if rc == -2:
        raise MemoryError(f"the fused CPU kernel's {what} could not allocate its buffers ({buffers}); use "
                          f"backend='sdpa_padded'")
    if rc != 0:
        sizes = {n: getattr(ins, n) for n in ("batch", "heads", "kv_heads", "nq", "nk", "d", "dv", "block_rows")}
        raise RuntimeError(f"the fused CPU kernel's {what} refused sizes {sizes} (code {rc}); please report this")


def forward(lib: ctypes.CDLL, q: Tensor, k: Tensor, v: Tensor, lam: Tensor, mask: Optional[Tensor], causal: bool,
            scale: float, scan: bool = False, maps: Optional[Tensor] = None) -> tuple[Tensor, bool]:
    """``(out, nonfinite)``: the kernel's float32 output (laid out by :func:`new_output`, sliced to ``2d`` where the
    head width was padded) and, with ``scan``, whether q, k or v holds a NaN or an infinity (then out is not to be
    used). float32 inputs with contiguous rows and a head width that is a multiple of 32 are read where they are (no
    copy), whatever their batch, head and row strides. ``maps``: ``(B, H, 2, Nq, Nk_pad)`` float32 contiguous
    (:func:`maps_shape`), where the kernel keeps the normalised maps for :func:`backward`; runs on torch's thread
    count."""
    B, H2, nq, d = q.shape
    d_pad = round_up(d, VALUE_MULTIPLE // 2)  # the value width 2 * d_pad is a multiple of the 64-column tile
    out = new_output(q, B, H2 // 2, nq, 2 * d_pad, torch.float32)
    q, k, v = (kernel_layout(t, width) for t, width in ((q, d_pad), (k, d_pad), (v, 2 * d_pad)))
    block_rows = BLOCK_ROWS[0] if nq <= BLOCK_ROWS[0] else BLOCK_ROWS[1]
    ins, alive = _inputs(q, k, v, lam, mask, causal, scale, block_rows)  # alive: what ins points into
    args = ForwardArgs(out=out.data_ptr(), maps=None if maps is None else maps.data_ptr(), lo=layout(out),
                       scan=int(scan))
    rc = lib.diff_attention_cpu_forward(ctypes.byref(ins), ctypes.byref(args))
    _raise_for(rc, ins, "forward", f"k transposed, and {block_rows} x {round_up(ins.nk, KEY_MULTIPLE)} scores per "
                                   f"thread")
    return (out if d_pad == d else out[..., : 2 * d]), bool(args.nonfinite)


def backward(lib: ctypes.CDLL, grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, lam: Tensor,
             mask: Optional[Tensor], causal: bool, scale: float,
             maps: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gradients of :func:`forward`'s output: float32 ``dq, dk, dv`` shaped as q, k, v (and laid out as them
    where they are dense) and ``dlam`` per row, ``(B, H, Nq)`` (the caller sums it to lam's shape). Inputs read as
    the forward reads them; ``maps``: the forward's kept maps (else the kernel recomputes them)."""
    B, H2, nq, d = q.shape
    d_pad = round_up(d, VALUE_MULTIPLE // 2)
    q, k, v, grad_out = (kernel_layout(t, width) for t, width in
                         ((q, d_pad), (k, d_pad), (v, 2 * d_pad), (grad_out, 2 * d_pad)))
    block_rows = backward_block_rows(nq, round_up(k.shape[2], KEY_MULTIPLE), d_pad)
    ins, alive = _inputs(q, k, v, lam, mask, causal, scale, block_rows)  # alive: what ins points into
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # laid out as q, k, v where dense
    dlam = q.new_empty(B, H2 // 2, nq, dtype=torch.float32)
    args = BackwardArgs(dout=grad_out.data_ptr(), maps=None if maps is None else maps.data_ptr(), gq=dq.data_ptr(),
                        gk=dk.data_ptr(), gv=dv.data_ptr(), glam=dlam.data_ptr(), ldo=layout(grad_out),
                        lgq=layout(dq), lgk=layout(dk), lgv=layout(dv))
    rc = lib.diff_attention_cpu_backward(ctypes.byref(ins), ctypes.byref(args))
    _raise_for(rc, ins, "backward", "k and v transposed, partial sums of dk and dv, and a block of scores per thread")
    if d_pad != d:
        dq, dk, dv = dq[..., :d], dk[..., :d], dv[..., : 2 * d]
    return dq, dk, dv, dlam
