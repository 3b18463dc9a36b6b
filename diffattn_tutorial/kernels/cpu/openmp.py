"""Which threads the fused CPU kernel runs on: torch's OpenMP pool where the process has that one OpenMP runtime,
else threads it starts per call.

The pool's threads keep spinning for a while after each of torch's parallel calls, so that threads of the kernel's
own would share the cores with them; but where a library loaded before the kernel brought a second OpenMP runtime
beside torch's, the kernel's runtime is not torch's. The runtimes mapped into the process are read from Linux's
``/proc/self/maps``; elsewhere the kernel starts threads of its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
from pathlib import Path
from typing import Iterator, Optional

CHOSEN: dict[str, bool] = {}
"""Of the loaded kernel (set by :func:`choose`): ``"built"`` with OpenMP, runs on its pool (``"openmp"``)."""


def is_openmp_runtime(filename: str) -> bool:
    """Whether a library file is an OpenMP runtime: GNU's ``libgomp``, Intel's ``libiomp5`` or LLVM's ``libomp``,
    also under a wheel's renamed copy (``libgomp-a34b3233.so.1``); not an offloading plugin (``libgomp-plugin-*``)."""
    return "plugin" not in filename and \
        re.fullmatch(r"lib(gomp|iomp5|omp)([-.][^/]*)?\.(so|dylib)(\.[0-9.]+)?", filename) is not None


def openmp_runtimes() -> Optional[set[str]]:
    """The files of the OpenMP runtimes mapped into this process, from Linux's ``/proc/self/maps`` (a file replaced
    since it was loaded counts as well: `` (deleted)``); None where the process cannot list them."""
    try:
        maps = Path("/proc/self/maps").read_bytes()
    except OSError:
        return None
    return runtimes_in(maps)


def runtimes_in(maps: bytes) -> set[str]:
    """The OpenMP runtimes' files in a ``/proc/<pid>/maps`` listing (its paths are any bytes, not always UTF-8)."""
    lines = maps.decode("utf-8", "surrogateescape").splitlines()
    files = {fields[5].removesuffix(" (deleted)") for fields in (line.split(None, 5) for line in lines)
             if len(fields) == 6}
    return {f for f in files if is_openmp_runtime(os.path.basename(f))}


def use_openmp(lib: ctypes.CDLL, wanted: bool) -> bool:
    """Run the kernel on OpenMP's thread pool (``wanted``) or on threads it starts per call; returns whether it now
    runs on OpenMP's (never where it was built without OpenMP)."""
    return bool(lib.diff_attention_cpu_use_openmp(int(wanted))) and wanted


def choose(lib: ctypes.CDLL) -> None:
    """Choose the threads of a freshly loaded kernel: OpenMP's pool where this process has exactly one OpenMP
    runtime, the kernel loaded (then it is torch's, or, where torch uses none, the kernel's alone); threads of its
    own per call where the kernel brought a second runtime or the runtimes cannot be listed. Noted in
    :data:`CHOSEN`."""
    built = use_openmp(lib, True)
    try:
        runtimes = openmp_runtimes()
    except Exception:  # noqa: BLE001 - whatever it is, the kernel's own threads are always safe
        runtimes = None
    CHOSEN.update(built=built, openmp=use_openmp(lib, runtimes is not None and len(runtimes) == 1))


@contextlib.contextmanager
def own_threads(lib: ctypes.CDLL) -> Iterator[None]:
    """Within: the kernel starts threads of its own per call, as it does where it cannot use torch's pool (for
    tests, and for the benchmarks that measure what the pool buys)."""
    use_openmp(lib, False)
    try:
        yield
    finally:
        use_openmp(lib, CHOSEN["openmp"])
