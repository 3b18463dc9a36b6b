"""The fused CPU kernel of differential attention (forward, inference): ``diff_attention(..., backend="cpu_fused")``.

Every SDPA formulation does twice the multiply-adds of the naive one, because SDPA applies V to each map
separately; naive forms ``A1 - lam * A2`` first and applies V once, but writes both maps to memory. The kernel in
``csrc/diff_attention_cpu.cpp`` keeps naive's arithmetic and keeps the maps in cache: one thread takes a block
of query rows of one head, computes both score blocks, their base-2 softmax numerators, the differential map
in place, and multiplies it by V. Notebook 08 walks through it; ``benchmarks/bench_cpu_auto.py`` measures it.

It is compiled on first use with the system's C++ compiler (``$CXX``, else ``c++``, ``g++`` or ``clang++``;
about a second, no PyTorch headers), cached in ``<cache_dir()>/kernels`` under a key of the source, compiler and
CPU, loaded with ``ctypes``, and checked against the naive formula on a small problem before it is used. Where
any step fails (no compiler, as on most Windows machines), :func:`kernel_status` says why and
``backend="auto"`` uses ``sdpa_padded`` instead.

>>> ok, why = kernel_status()
>>> isinstance(ok, bool) and isinstance(why, str)
True
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from diffattn_tutorial.functional import LOG2E

Tensor = torch.Tensor

SOURCE = "csrc/diff_attention_cpu.cpp"
"""The kernel's source, inside the package."""

BLOCK_ROWS = (24, 48)
"""Query rows per work item (multiples of the kernel's 8-row score and 6-row output tiles): 24 for short
queries (less padding), 48 otherwise (fewer passes over K and V; 1-2% faster than 24 at N=2048 on the
machine of the benchmarks, within its noise)."""

KEY_MULTIPLE = 32  # the kernel pads keys to the score tile's 32 columns
VALUE_MULTIPLE = 64  # the value width to the output tile's 64 columns
COMMON_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-pthread")
NATIVE_FLAGS = ("-march=native",)  # tried first; a compiler that does not take it builds without it


class KernelUnavailable(RuntimeError):
    """The fused CPU kernel cannot be built, loaded or trusted here; the message says why."""


def compiler() -> Optional[str]:
    """The C++ compiler to build with: ``$CXX``, else the first of ``c++``, ``g++``, ``clang++`` on the PATH."""
    if os.environ.get("CXX", "").strip():
        return shutil.which(os.environ["CXX"].strip()) or os.environ["CXX"].strip()
    return next((path for name in ("c++", "g++", "clang++") if (path := shutil.which(name))), None)


def _source_text() -> str:
    return resources.files("diffattn_tutorial").joinpath(SOURCE).read_text()


def _cpu_fingerprint() -> str:
    """What ``-march=native`` depends on: the CPU's feature flags where Linux lists them, else its name."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build_dir() -> Path:
    from diffattn_tutorial.experiments import cache_dir  # the course's one cache folder

    folder = cache_dir()
    if folder is None:  # DIFFATTN_CACHE=0: nothing kept between processes
        return Path(tempfile.mkdtemp(prefix="diffattn_kernels_"))
    return folder / "kernels"


def _compile(cxx: str, source: Path, target: Path) -> None:
    """Build ``target`` from ``source``; native flags first, then without them. Raises KernelUnavailable."""
    errors = []
    for extra in (NATIVE_FLAGS, ()):
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        cmd = [cxx, *COMMON_FLAGS, *extra, str(source), "-o", str(tmp)]
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise KernelUnavailable(f"the C++ compiler {cxx!r} could not be run ({e}); set CXX to a working "
                                    f"compiler, or use backend='sdpa_padded'") from e
        if run.returncode == 0:
            os.replace(tmp, target)  # atomic: a parallel process sees the whole library or none
            return
        errors.append(f"$ {' '.join(cmd)}\n{run.stderr.strip()[-1500:]}")
    raise KernelUnavailable("the fused CPU kernel did not compile:\n" + "\n".join(errors))


def library_path() -> Path:
    """The compiled kernel for this source, compiler and CPU, built first if it is not in the cache yet."""
    cxx = compiler()
    if cxx is None:
        raise KernelUnavailable("no C++ compiler found (looked for $CXX, c++, g++, clang++): install one, or "
                                "use backend='sdpa_padded' (what backend='auto' does without it)")
    text = _source_text()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelUnavailable(f"the C++ compiler {cxx!r} could not be run ({e})") from e
    key = hashlib.sha256("\0".join([text, cxx, version, *COMMON_FLAGS, *NATIVE_FLAGS, platform.machine(),
                                    _cpu_fingerprint()]).encode()).hexdigest()[:16]
    folder = _build_dir()
    target = folder / f"diff_attention_cpu_{key}.so"
    if not target.exists():
        folder.mkdir(parents=True, exist_ok=True)
        source = folder / f"diff_attention_cpu_{key}.cpp"
        source.write_text(text)
        _compile(cxx, source, target)
    return target


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    f = lib.diff_attention_cpu_forward
    ptr, c_int = ctypes.c_void_p, ctypes.c_int
    f.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_float, ctypes.c_float, ptr, ptr, c_int, c_int]
    f.restype = c_int
    return lib


@functools.lru_cache(maxsize=None)
def _kernel() -> ctypes.CDLL:
    """Build (or find), load and self-check the kernel once per process. Raises KernelUnavailable."""
    try:
        lib = _load(library_path())
    except OSError as e:
        raise KernelUnavailable(f"the compiled kernel could not be loaded ({e})") from e
    _self_check(lib)
    return lib


def kernel_status() -> tuple[bool, str]:
    """``(usable here, why)``: whether the fused CPU kernel builds, loads and agrees with the naive formula."""
    try:
        _kernel()
    except KernelUnavailable as e:
        return False, str(e)
    return True, f"fused C++ kernel, compiled with {compiler()}"


def _self_check(lib: ctypes.CDLL) -> None:
    """A small problem with every feature (GQA, tails in every dimension, causal, a mask, per-token lambda)
    against the naive formula in float64: a miscompiled kernel is never used."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 29, 24, generator=g), torch.randn(2, 2, 37, 24, generator=g)
    v, lam = torch.randn(2, 1, 37, 48, generator=g), torch.rand(2, 2, 29, 1, generator=g)
    mask = torch.randn(29, 37, generator=g).expand(2, 2, 29, 37)
    from diffattn_tutorial.functional import diff_attention  # noqa: PLC0415 (functional imports this module lazily)

    for causal, m in ((False, None), (True, None), (False, mask)):
        out = _forward(lib, q, k, v, lam, m, causal, 24 ** -0.5)
        ref = diff_attention(q.double(), k.double(), v.double(), lam.double(), causal=causal,
                             attn_mask=None if m is None else m.double(), backend="naive")
        err = (out.double() - ref).abs().max().item()
        if not err < 1e-4:
            raise KernelUnavailable(f"the compiled kernel disagrees with the naive formula (max error {err:.3g}, "
                                    f"causal={causal}, mask={m is not None}); it is not used")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _float_mask(mask: Tensor) -> Tensor:
    """An additive float32 mask from a bool (True = may attend) or additive one, any broadcastable shape."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
    return mask.float()


def _forward(lib: ctypes.CDLL, q: Tensor, k: Tensor, v: Tensor, lam: Tensor, mask: Optional[Tensor], causal: bool,
             scale: float) -> Tensor:
    """Lay the inputs out as the kernel expects (see the source's header) and run it on torch's thread count.
    Contiguous float32 inputs with a head width that is a multiple of 32 are used as they are (no copy)."""
    B, H2, nq, d = q.shape
    H, Hkv, nk = H2 // 2, v.shape[1], k.shape[2]
    d_pad = _round_up(d, VALUE_MULTIPLE // 2)  # the value width 2 * d_pad is a multiple of the 64-column tile
    q, k = (F.pad(t.float(), (0, d_pad - d)).contiguous() for t in (q, k))
    v = F.pad(v.float(), (0, 2 * (d_pad - d))).contiguous()
    lam_rows = lam.float().expand(B, H, nq, 1)[..., 0].contiguous()  # (B, H, Nq)
    block_rows = BLOCK_ROWS[0] if nq <= BLOCK_ROWS[0] else BLOCK_ROWS[1]
    strides = (ctypes.c_long * 4)(0, 0, 0, 0)
    mask_ptr = None
    if mask is not None:
        m = _float_mask(mask)
        if m.shape[-1] != 1 and m.stride(-1) != 1:
            m = m.contiguous()
        m = m.expand(B, H, nq, nk)
        strides = (ctypes.c_long * 4)(*(s if n > 1 else 0 for s, n in zip(m.stride(), m.shape)))
        mask_ptr = m.data_ptr()
    out = torch.empty(B, H, nq, 2 * d_pad)
    sizes = (ctypes.c_int * 8)(B, H, Hkv, nq, nk, d_pad, 2 * d_pad, block_rows)
    rc = lib.diff_attention_cpu_forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), lam_rows.data_ptr(), mask_ptr,
                                        strides, LOG2E, scale * LOG2E, out.data_ptr(), sizes, int(causal),
                                        torch.get_num_threads())
    if rc == -2:
        raise MemoryError(f"the fused CPU kernel could not allocate its buffers (k transposed, and {block_rows} x "
                          f"{_round_up(nk, KEY_MULTIPLE)} scores per thread); use backend='sdpa_padded'")
    if rc != 0:
        raise RuntimeError(f"the fused CPU kernel refused sizes {tuple(sizes)} (code {rc}); please report this")
    return out if d_pad == d else out[..., : 2 * d]


def fused_diff_attention(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, *, attn_mask: Optional[Tensor] = None,
                         causal: bool = False, scale: float) -> Tensor:
    """Differential attention by the fused CPU kernel, on inputs :func:`~diffattn_tutorial.functional.diff_attention`
    has validated: q ``(B, 2H, Nq, d)``, k ``(B, 2Hkv, Nk, d)``, v ``(B, Hkv, Nk, 2d)``, lam broadcastable to
    ``(B, H, Nq, 1)``, ``attn_mask`` bool or additive broadcastable to ``(B, H, Nq, Nk)`` with no fully masked
    row, ``causal`` bottom-right aligned. Computes in float32; returns ``(B, H, Nq, 2d)`` in q's dtype.
    Raises KernelUnavailable where the kernel cannot be built (see :func:`kernel_status`)."""
    return _forward(_kernel(), q, k, v, lam, attn_mask, causal, scale).to(q.dtype)


__all__ = ["SOURCE", "BLOCK_ROWS", "KernelUnavailable", "compiler", "library_path", "kernel_status",
           "fused_diff_attention"]
