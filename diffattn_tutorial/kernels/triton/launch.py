"""What every host module of the Triton kernels shares to launch them: the launch recorder, strides, buffers.

:func:`capture_launches` records the launches the host code would make (:class:`Launch`: kernel name, runtime
arguments, constexprs, the configurations its autotuner may pick) instead of running them, as on a GPU of a given
compute capability; :mod:`~diffattn_tutorial.kernels.triton.aot` compiles what it records. :func:`strides` names a
tensor's strides as the kernels take them, :func:`alloc` makes a buffer the kernels write whole (NaN-poisoned under
``DIFFATTN_TRITON_POISON=1``, for tests), :func:`tile_step` is the stride a tile steps in int32, :func:`tma_ok` says
whether a kernel may read a tensor by tensor descriptor and :func:`call` launches with the workspace those need. The training
kernels' host code (:mod:`~diffattn_tutorial.kernels.triton.flash_diff`) and the decode kernels'
(:mod:`~diffattn_tutorial.kernels.triton.decode`) both use these, and neither reaches into the other.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from typing import Callable, Iterator, Optional

import torch

Tensor = torch.Tensor

POISON_ENV = "DIFFATTN_TRITON_POISON"
"""Set to ``1`` to fill every buffer the kernels write (outputs, gradients, statistics) with NaN before they
run, instead of leaving it uninitialised: a tile that is never written then shows as NaN (tests use it)."""
MAX_TILE_ROWS = 256
"""Offsets inside a tile are int32: a row stride times ``MAX_TILE_ROWS`` must stay below 2**31 (checked on the host)."""


@dataclasses.dataclass
class Launch:
    """One kernel launch as the host code makes it (recorded by :func:`capture_launches`)."""

    name: str
    args: dict  # the kernel's runtime arguments, by name
    consts: dict  # its tl.constexpr arguments, by name
    configs: list
    dtype: torch.dtype


_recording: Optional[list[Launch]] = None
_recording_capability = 90
_recording_untabled = False


@contextlib.contextmanager
def capture_launches(capability: int = 90, *, untabled: bool = False) -> Iterator[list[Launch]]:
    """Record the kernel launches of the host code (training and decode kernels) instead of running them, on
    tensors of any device, as they would be on a GPU of compute ``capability`` (90: H100, 80: A100). A launch no
    autotune table lists is refused as on a GPU, unless ``untabled`` (it is then recorded without configurations:
    the compile facts' lessons compile such launches in configurations of their own)."""
    global _recording, _recording_capability, _recording_untabled
    saved = _recording, _recording_capability, _recording_untabled
    _recording, _recording_capability, _recording_untabled = [], capability, untabled
    try:
        yield _recording
    finally:
        _recording, _recording_capability, _recording_untabled = saved


def capturing_untabled() -> bool:
    """Whether :func:`capture_launches` records launches no table lists (``untabled=True``)."""
    return _recording is not None and _recording_untabled


def capturing() -> bool:
    """Whether :func:`capture_launches` is recording (launches are then recorded, never run)."""
    return _recording is not None


def record(launch: Launch) -> None:
    """Add ``launch`` to the active recording (call only while :func:`capturing`)."""
    if _recording is None:
        raise RuntimeError("launch.record called outside capture_launches()")
    _recording.append(launch)


def interpret_mode() -> bool:
    """True when Triton itself was imported for its CPU interpreter (``TRITON_INTERPRET=1`` set before the first
    ``import triton``: ``@triton.jit`` and Triton's own library functions choose then)."""
    import triton.language as tl

    return type(tl.sum).__name__ == "InterpretedFunction"


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs: exact ("ieee") products unless torch allows TF32 for matmuls (16-bit: tensor cores)."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def capability(device: torch.device) -> int:
    """Compute capability as 10 * major + minor: the recording's, the GPU's, or 90 (unused by the interpreter)."""
    if _recording is not None:
        return _recording_capability
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return 10 * major + minor
    return 90


def strides(t: Tensor, letter: str, dims: str) -> dict[str, int]:
    """``t``'s strides as the kernels name them: ``strides(q, "q", "bhm")`` is ``{"stride_qb": ..., "stride_qh":
    ..., "stride_qm": ...}`` (the first ``len(dims)`` dims)."""
    return {f"stride_{letter}{dim}": stride for dim, stride in zip(dims, t.stride())}


def poison() -> bool:
    """Whether ``DIFFATTN_TRITON_POISON`` asks for NaN-filled buffers."""
    return os.environ.get(POISON_ENV, "0") not in ("0", "", "false", "False")


def alloc(*shape: int, like: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """A buffer every element of which a kernel writes: uninitialised, or NaN under ``DIFFATTN_TRITON_POISON=1``."""
    dtype = like.dtype if dtype is None else dtype
    if poison():
        return torch.full(shape, float("nan"), device=like.device, dtype=dtype)
    return torch.empty(shape, device=like.device, dtype=dtype)


def tile_step(name: str, t: Tensor) -> int:
    """The largest stride ``t`` steps inside a tile (its rows'; a mask's last two dims'), 0 if none: a broadcast
    (size-1) dim is never stepped, and a mask of fewer than 2 dims (it broadcasts) has no row dim."""
    dims = (-2, -1) if name == "attn_mask" else (-2,)
    steps = [abs(t.stride(i)) for i in dims if -i <= t.ndim and t.shape[i] > 1]
    return max(steps) if steps else 0  # not max(..., default=0): torch.compile traces this


def tile_offsets_fit(name: str, t: Tensor) -> bool:
    """Whether ``t``'s in-tile steps times :data:`MAX_TILE_ROWS` stay in int32."""
    return tile_step(name, t) * MAX_TILE_ROWS < 2**31


def descriptor_workspace(size: int, alignment: int, stream: Optional[int]) -> Tensor:
    """Global memory for the tensor descriptors a kernel builds on the device (Triton's allocator protocol)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")  # the caching allocator's blocks are 512-byte aligned


def call(kernel: Callable, workspace: bool, **kwargs) -> None:
    """``kernel(**kwargs)``; ``workspace``: the kernel may build tensor descriptors on the device
    (``tl.make_tensor_descriptor``), for which Triton asks the allocator of ``triton.set_allocator`` for a
    global-memory workspace at each launch. It is set in a copy of the current context (Triton keeps it in a
    ``ContextVar``), so it holds for this launch only and whatever allocator the caller set stays as it was."""
    if not workspace:
        kernel(**kwargs)
        return

    def scoped() -> None:
        import triton

        triton.set_allocator(descriptor_workspace)
        kernel(**kwargs)

    contextvars.copy_context().run(scoped)


def tma_ok(*tensors: Tensor) -> bool:
    """Whether a kernel may read these tensors (the forward's k and v, the dK kernels' q and dO) by tensor
    descriptor: the copy engine needs each base address and every stride but the last (which is 1) to be a multiple
    of 16 bytes, and rows that are rows (a row stride of 0, an expanded sequence, is left to the pointer loads)."""
    return all(t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and (t.shape[-2] <= 1 or t.stride(-2) != 0) and
               all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1]) for t in tensors)


def tma_choice(tma: Optional[bool], capability: int, interpret: bool, **tensors: Tensor) -> Optional[bool]:
    """``tma`` for ``flash_diff._launch`` from the caller's, for launches that read ``tensors`` by descriptor (the forward
    k and v, the backward q and dO): ``None`` (default) offers the sm_90a table's TMA twins to the autotuner where
    :func:`tma_ok` holds, on a GPU (``False`` in the interpreter: the pinned entry); ``True`` forces them and
    refuses, naming the fix, what they cannot read."""
    if tma is False or any(t.numel() == 0 for t in tensors.values()):  # nothing to read by descriptor
        return False
    if tma is None:
        return None if capability >= 90 and not interpret and tma_ok(*tensors.values()) else False
    names = " and ".join(tensors)
    if capability < 90 and not interpret:
        raise ValueError(f"tma=True reads {names} with Hopper's copy engine (TMA), which this GPU (compute capability "
                         f"{capability / 10:.1f}) does not have; pass tma=None")
    if not tma_ok(*tensors.values()):
        got = ", ".join(f"{n} strides {tuple(t.stride())}" for n, t in tensors.items())
        raise ValueError(f"tma=True needs {names} with 16-byte aligned base addresses and strides (the copy engine's "
                         f"rule; a contiguous tensor's rows are when the head dim is a multiple of 8 in 16-bit, of 4 in "
                         f"float32); got {got}: pass {' and '.join(n + '.contiguous()' for n in tensors)} where the "
                         f"head dim allows it, or tma=None (pointer loads then)")
    return True


__all__ = ["POISON_ENV", "MAX_TILE_ROWS", "Launch", "capture_launches", "capturing", "capturing_untabled", "record", "capability",
           "interpret_mode", "dot_precision",
           "strides", "poison", "alloc", "tile_step", "tile_offsets_fit", "tma_ok", "tma_choice", "call", "descriptor_workspace"]
