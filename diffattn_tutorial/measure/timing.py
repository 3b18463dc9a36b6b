"""Side-by-side timing and peak-memory measurements of the ``diff_attention`` backends.

Used by ``diffattn-tutorial bench``, notebook 08 and ``benchmarks/``. Every backend runs on the same inputs
in one process (ratios are measured side by side), and its output is compared with ``"naive"``.

* Time: median of ``reps`` calls after ``warmup`` calls (CUDA: CUDA events around each call).
* Peak extra memory: bytes allocated above the inputs while one call runs (:func:`cuda_peak_extra`,
  :func:`cpu_peak_extra`: the output excluded; :func:`peak_extra_memory`, for any function: included by default).
  On CUDA: ``torch.cuda.max_memory_allocated``. On a Linux CPU: the resident-set high-water mark
  (``VmHWM``, reset through ``/proc/self/clear_refs``) in a child process where glibc serves every large
  block with ``mmap``, so freed memory really leaves the process and the peak is exact to a page.
  Elsewhere (macOS, Windows) CPU memory is not measured (``None``).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import torch

from diffattn_tutorial.functional import diff_attention
from diffattn_tutorial.paths import package_root

Tensor = torch.Tensor
DEFAULT_BACKENDS = ("naive", "chunked", "sdpa_wide", "sdpa_split", "sdpa_stacked", "sdpa_padded", "auto")
DEFAULT_LENGTHS = (512, 1024, 2048, 4096)


@dataclass
class Row:
    """One measurement: a backend at one sequence length."""

    backend: str
    n: int
    ms: float
    extra_mib: Optional[float]
    max_abs_err: float  # against "naive" on the same inputs


def device_name(device: str | torch.device) -> str:
    """A readable name for a results file: the GPU's name, or the CPU's with its thread count."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def cpu_identity() -> dict:
    """What a CPU results file records beside :func:`device_name`: the processor's name and, where Linux lists
    them, its vendor, family and model numbers (two machines of one name can differ in generation: AMD's family 25
    is Zen 3 and 4, family 26 Zen 5)."""
    found = {"name": platform.processor() or platform.machine()}
    keys = {"model name": "name", "vendor_id": "vendor", "cpu family": "family", "model": "model"}
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                key, _, value = (part.strip() for part in line.partition(":"))
                if key in keys and keys[key] not in found.keys() - {"name"}:
                    found[keys[key]] = value
                if not key:  # the first processor's block ends
                    break
    except OSError:
        pass
    return found


def slug(text: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``, for file names."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def make_inputs(b: int, h: int, n: int, d: int, *, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Random ``q (b, 2h, n, d)``, ``k (b, 2h, n, d)``, ``v (b, h, n, 2d)`` and a scalar ``lam``."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, 2 * h, n, d, generator=g) for _ in range(2))
    v = torch.randn(b, h, n, 2 * d, generator=g)
    lam = torch.tensor(0.6)
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v, lam))  # type: ignore[return-value]


def median_time(fn: Callable[[], object], *, warmup: int = 1, reps: int = 5, device: str | torch.device = "cpu") -> float:
    """Median seconds of ``reps`` calls of ``fn`` after ``warmup`` calls."""
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cuda_peak_extra(fn: Callable[[], Tensor]) -> int:
    """Peak CUDA bytes allocated while ``fn`` runs, above what was allocated before, output excluded."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base - out.numel() * out.element_size()


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1))  # type: ignore[union-attr]


def cpu_memory_supported() -> bool:
    """True where the RSS high-water mark can be reset and read (Linux)."""
    return sys.platform.startswith("linux") and os.path.exists("/proc/self/clear_refs")


def _cpu_peak_extra_here(fn: Callable[[], Tensor], include_output: bool) -> int:
    """Run in the measuring child only (see module docstring). The fused CPU kernel's work buffers, kept between
    calls, are freed first, so that the measured call allocates them again and they count."""
    fused = sys.modules.get("diffattn_tutorial.kernels.cpu.cpu_fused")
    if fused is not None:
        fused.release_buffers()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = _status_kib("VmRSS") * 1024
    out = fn()
    kept = 0 if include_output else out.numel() * out.element_size()
    return max(0, _status_kib("VmHWM") * 1024 - base - kept)


_CHILD_PREAMBLE = "\n".join([
    "import math", "import torch", "import torch.nn.functional as F", "from einops import rearrange",
    "from diffattn_tutorial import functional", "from diffattn_tutorial.functional import diff_attention", ""])
"""What a function sent to the memory child as source may use without importing it."""


def _child_function(entry: dict) -> Callable[..., Tensor]:
    """The callable an entry of the child's spec names: imported by module and name, else built from its source."""
    if "module" in entry:
        try:
            fn = importlib.import_module(entry["module"])
            for part in entry["name"].split("."):
                fn = getattr(fn, part)
            return fn
        except (ImportError, AttributeError):
            if "source" not in entry:
                raise
    namespace: dict = {}
    exec(_CHILD_PREAMBLE + entry["source"], namespace)  # the caller's own code, sent by peak_extra_memory
    return namespace[entry["name"].split(".")[-1]]


def _memory_child(spec: dict) -> dict[str, int]:
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: large blocks mmapped, freed at once
    torch.set_num_threads(spec["threads"])
    q, k, v, lam = make_inputs(spec["b"], spec["h"], spec["n"], spec["d"], dtype=getattr(torch, spec["dtype"]))
    result = {}
    with torch.no_grad():
        for label, entry in spec["functions"].items():
            function, kwargs = _child_function(entry), entry.get("kwargs", {})
            fn = lambda: function(q, k, v, lam, causal=spec["causal"], **kwargs)  # noqa: E731
            fn()  # first call allocates one-off workspaces
            result[label] = min(_cpu_peak_extra_here(fn, spec["include_output"]) for _ in range(2))
    return result


def _function_entry(fn: Callable[..., Tensor], helpers: Sequence[Callable]) -> dict:
    """How the child finds ``fn``: by module and name where it can import them, else by its source (with
    ``helpers``' sources), for functions defined in a notebook, a script or a test module."""
    kwargs = {}
    if isinstance(fn, functools.partial):
        fn, kwargs = fn.func, dict(fn.keywords)
    entry: dict = {"name": fn.__qualname__, "kwargs": kwargs}
    module = getattr(fn, "__module__", None)
    if module and module != "__main__" and "<" not in fn.__qualname__:
        entry["module"] = module
    if not module or not module.startswith("diffattn_tutorial"):
        try:
            entry["source"] = "\n".join(inspect.getsource(f) for f in (*helpers, fn))
        except (OSError, TypeError):
            if "module" not in entry:
                raise ValueError(f"cannot find the source of {fn!r} to run it in a child process; define it in a "
                                 f"file or a notebook cell, or import it from a module") from None
    return entry


def peak_extra_memory(functions: Mapping[str, Callable[..., Tensor]], *, b: int, h: int, n: int, d: int,
                      causal: bool = False, dtype: torch.dtype = torch.float32, include_output: bool = True,
                      helpers: Sequence[Callable] = (), threads: Optional[int] = None) -> dict[str, Optional[int]]:
    """Peak extra resident bytes of each ``fn(q, k, v, lam, causal=causal)`` in a fresh process (Linux).

    The inputs are :func:`make_inputs` ``(b, h, n, d)``: q, k ``(b, 2h, n, d)``, v ``(b, h, n, 2d)``. Each
    function runs in one child process, once to warm up and twice measured (the smaller peak counts), in
    inference mode; the figure is the growth of the resident-set high-water mark above the inputs, the
    output included unless ``include_output=False``. Functions are found by the child by module and name
    (library functions, ``functools.partial`` of them with keywords) or, when defined in a notebook or
    script, sent as source together with ``helpers`` (the functions they call); the source may use
    ``torch``, ``F``, ``math``, ``rearrange``, ``functional`` and ``diff_attention`` without importing them.
    Returns ``{label: bytes}``, or ``{label: None}`` where CPU memory cannot be measured (macOS, Windows).
    A function that raises ``ValueError``, ``TypeError`` or ``MemoryError`` in the child raises it here, with its
    message (any other error as a ``RuntimeError`` naming it).

    >>> import functools
    >>> mem = peak_extra_memory({"naive": functools.partial(diff_attention, backend="naive")}, b=1, h=1, n=64, d=8)
    >>> mem["naive"] is None or mem["naive"] >= 0
    True
    """
    if not cpu_memory_supported():
        return {label: None for label in functions}
    spec = {"functions": {label: _function_entry(fn, helpers) for label, fn in functions.items()},
            "b": b, "h": h, "n": n, "d": d, "causal": causal, "dtype": str(dtype).removeprefix("torch."),
            "threads": threads or torch.get_num_threads(), "include_output": include_output}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_package_root(), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "diffattn_tutorial.measure.timing", "--memory-child", json.dumps(spec)],
                          capture_output=True, text=True, env=env)
    if proc.returncode == _CHILD_RAISED:
        ename, message = json.loads(proc.stdout.strip().splitlines()[-1])["error"]
        raise _CHILD_ERRORS.get(ename, RuntimeError)(message if ename in _CHILD_ERRORS else f"{ename}: {message}")
    if proc.returncode == -getattr(signal, "SIGKILL", 9):
        raise MemoryError("the memory-measuring child was killed (SIGKILL), most likely by the system for want of "
                          "memory")
    if proc.returncode:
        raise RuntimeError(f"the memory-measuring child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


_CHILD_RAISED = 3
"""Exit code of a memory child whose function raised; its last line of output is ``{"error": [name, message]}``."""
_CHILD_ERRORS = {"ValueError": ValueError, "TypeError": TypeError, "MemoryError": MemoryError}
"""Errors of a measured function that :func:`peak_extra_memory` raises again as themselves (bad options, no memory);
any other becomes a ``RuntimeError`` naming it."""


def _package_root() -> str:
    """The folder holding the ``diffattn_tutorial`` package, so the child imports this very copy."""
    return str(package_root())


def cpu_peak_extra(backends: Sequence[str], *, b: int, h: int, n: int, d: int, causal: bool,
                   dtype: torch.dtype = torch.float32, include_output: bool = False) -> dict[str, Optional[int]]:
    """Peak extra CPU bytes of each ``diff_attention`` backend (:func:`peak_extra_memory`), output excluded by
    default (as the CUDA figure); ``None`` where unsupported."""
    functions = {name: functools.partial(diff_attention, backend=name) for name in backends}
    return peak_extra_memory(functions, b=b, h=h, n=n, d=d, causal=causal, dtype=dtype,
                             include_output=include_output)


def run(device: str | torch.device = "cpu", *, lengths: Sequence[int] = DEFAULT_LENGTHS,
        backends: Sequence[str] = DEFAULT_BACKENDS, b: int = 1, h: int = 8, d: int = 64, causal: bool = False,
        dtype: torch.dtype = torch.float32, warmup: int = 1, reps: int = 5, memory: bool = True,
        progress: Callable[[str], None] | None = None) -> list[Row]:
    """Time every backend on the same inputs for each length, in inference mode; ``naive`` first.

    Returns one :class:`Row` per (length, backend).
    """
    device = torch.device(device)
    backends = ["naive"] + [name for name in dict.fromkeys(backends) if name != "naive"]
    rows = []
    for n in lengths:
        q, k, v, lam = make_inputs(b, h, n, d, dtype=dtype, device=device)
        with torch.no_grad():
            ref = diff_attention(q, k, v, lam, causal=causal, backend="naive")
            # every backend's first call (its warm-up) here: one refusing these options raises its own error
            # before a memory-measuring child starts
            errs = {name: (diff_attention(q, k, v, lam, causal=causal, backend=name).float() - ref.float())
                    .abs().max().item() for name in backends}
            mem: dict[str, Optional[int]] = {name: None for name in backends}
            if memory and device.type == "cpu":
                mem = cpu_peak_extra(backends, b=b, h=h, n=n, d=d, causal=causal, dtype=dtype)
            for name in backends:
                fn = lambda: diff_attention(q, k, v, lam, causal=causal, backend=name)  # noqa: E731
                err = errs[name]
                if memory and device.type == "cuda":
                    mem[name] = cuda_peak_extra(fn)
                sec = median_time(fn, warmup=warmup, reps=reps, device=device)
                extra = mem[name]
                rows.append(Row(name, n, sec * 1e3, None if extra is None else extra / 2**20, err))
                if progress:
                    progress(f"N={n} {name}: {sec * 1e3:.1f} ms")
        q = k = v = ref = None  # free this length's inputs before the next one is made
    return rows


def format_table(rows: Sequence[Row]) -> str:
    """A Markdown table: time and extra memory of each backend, with ratios against ``naive``."""
    naive = {r.n: r for r in rows if r.backend == "naive"}
    lines = ["| N | backend | median ms | speed-up vs naive | peak extra MiB | memory vs naive | max abs err |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        base = naive[r.n]
        mem = "n/a" if r.extra_mib is None else f"{r.extra_mib:.1f}"
        ratio = "n/a" if r.extra_mib is None or not base.extra_mib else f"{r.extra_mib / base.extra_mib:.3f}"
        lines.append(f"| {r.n} | {r.backend} | {r.ms:.1f} | {base.ms / r.ms:.2f}x | {mem} | {ratio} | {r.max_abs_err:.1e} |")
    return "\n".join(lines)


def _main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="internal: the memory-measuring child of diffattn-tutorial bench")
    ap.add_argument("--memory-child", required=True)
    args = ap.parse_args(argv)
    try:
        result = _memory_child(json.loads(args.memory_child))
    except Exception as e:  # noqa: BLE001 - the parent raises it again (see _CHILD_ERRORS)
        print(json.dumps({"error": [type(e).__name__, str(e)]}))
        return _CHILD_RAISED
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
