"""GPU benchmark helpers shared by the scripts in ``benchmarks/`` and notebooks 08, 09 and 12.

* :func:`median_seconds`: the one GPU timer, ``triton.testing.do_bench`` on CUDA (median of CUDA events, no host
  sync between calls, L2 flushed before each), unlike :func:`diffattn_tutorial.measure.timing.median_time`, which
  syncs after every call (fine for the CPU backends it compares, not for a kernel of about a millisecond), and
  which it falls back to elsewhere.
* :func:`sdpa_backend` runs under one SDPA kernel chosen explicitly, or PyTorch's own dispatch; :func:`refusal`
  words why a kernel declined a call; :func:`sdpa_kernels_here` says which kernels the device has at all.
* :func:`preferred_half_dtype`: bfloat16 where the GPU has bf16 tensor cores (compute capability 8.0 and up),
  float16 below (it needs a ``torch.amp.GradScaler`` to train); :func:`check_half_dtype` refuses bfloat16 there.
* :func:`shape_for`: the FlashAttention benchmarks' shapes; :func:`results_header`: the device, versions, date and
  command every results file carries.
* A GPU run's results live in :mod:`diffattn_tutorial.recorded` (:func:`recorded_path`, :func:`find_recorded`):
  :func:`merge_triton` joins runs of ``bench_triton``, :func:`triton_summary` and :func:`sdpa_summary` tabulate
  them, :func:`goals` checks the Triton kernel's goals.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import platform
import re
import sys
import traceback
import warnings
from pathlib import Path
from typing import Callable, ContextManager, Optional, Sequence

import torch

from diffattn_tutorial.measure.timing import device_name, median_time, slug

TRITON_SCHEMA = "diffattn-tutorial/bench_triton/2"
SDPA_SCHEMA = "diffattn-tutorial/bench_sdpa/1"
SESSION_SCHEMA = "diffattn-tutorial/gpu_session/1"
KINDS = {"bench_triton": TRITON_SCHEMA, "bench_sdpa": SDPA_SCHEMA, "gpu_session": SESSION_SCHEMA}
"""Recorded file kind (the name's prefix) -> the schema its files carry."""
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "math": "MATH", "default": None}
"""Backend names -> ``torch.nn.attention.SDPBackend`` members (``default``: PyTorch's own dispatch)."""
KERNEL_GOALS = {"fwd_speedup_vs_best_sdpa": 1.2, "fwd_tflops": {64: 400.0, 128: 450.0},
                "fwd_bwd_speedup_vs_best_sdpa": 1.0}
"""The fused kernel's speed goals (issue 51: H100, bf16, N = 8192, d = 64 and 128, causal and not): its forward
against the best SDPA formulation and in TFLOP/s (a floor per head dim), its forward + backward against the best
SDPA formulation."""
GOALS = KERNEL_GOALS  # the name the notebooks and tools print
GOALS_DEVICE = "H100"
"""The goals are judged on this GPU only (its name contains it); results from other GPUs are recorded, not judged."""
GOALS_N = 8192
"""The goals' sequence length: rows at another length are informative, not judged."""
GOALS_DTYPE = "bfloat16"
"""The goals' dtype: a run in another dtype is informative, not judged."""
RECORDED_DIR = Path(__file__).resolve().parents[1] / "recorded"  # the package's recorded/
BF16_CAPABILITY = (8, 0)
"""The compute capability from which NVIDIA GPUs have bfloat16 tensor cores (Ampere); below it (Turing's T4,
Volta) bfloat16 has no arithmetic of its own and float16 is the 16-bit dtype."""


# ----------------------------------------------------------------------------------------------------------
# the device: 16-bit dtype, SDPA kernels
# ----------------------------------------------------------------------------------------------------------


def cuda_capability(device: torch.device | str | None = None) -> Optional[tuple[int, int]]:
    """``(major, minor)`` of a CUDA ``device`` (None: the current CUDA device if there is one), else None."""
    device = torch.device("cuda") if device is None and torch.cuda.is_available() else device
    if device is None or torch.device(device).type != "cuda":
        return None
    return tuple(torch.cuda.get_device_capability(torch.device(device)))


def preferred_half_dtype(device: torch.device | str | None = None) -> torch.dtype:
    """The 16-bit dtype to compute in on ``device``: float16 on a CUDA GPU below compute capability 8.0 (no
    bfloat16 tensor cores; train it with ``torch.amp.GradScaler``), else bfloat16 (recent GPUs; CPUs, whose
    autocast is bfloat16)."""
    capability = cuda_capability(device)
    return torch.float16 if capability is not None and capability < BF16_CAPABILITY else torch.bfloat16


def check_half_dtype(dtype: torch.dtype, device: torch.device | str | None = None, what: str = "dtype") -> None:
    """Raise ``ValueError`` naming float16 if ``dtype`` is bfloat16 and ``device`` a GPU without bf16 arithmetic."""
    capability = cuda_capability(device)
    if dtype == torch.bfloat16 and capability is not None and capability < BF16_CAPABILITY:
        name = torch.cuda.get_device_name(torch.device(device or "cuda"))
        raise ValueError(f"{what}: bfloat16 on {name} (compute capability {capability[0]}.{capability[1]}) has no "
                         f"tensor cores or arithmetic of its own; use float16 (preferred_half_dtype(device) "
                         f"picks it; train it with torch.amp.GradScaler)")



def benchmark_dtype(device: str, dtype: str | None) -> str:
    """The dtype name a benchmark script runs in: ``dtype`` when given (checked against the GPU: bf16 on a GPU
    without bf16 tensor cores raises ValueError naming fp16), else the GPU's own 16-bit dtype on CUDA, float32
    elsewhere."""
    if device.startswith("cuda") and torch.cuda.is_available():
        dtype = dtype or str(preferred_half_dtype(device)).removeprefix("torch.")
        check_half_dtype(getattr(torch, dtype), device, what="--dtype")
    return dtype or "float32"


def sdpa_kernels_here(device: torch.device | str, dtype: Optional[torch.dtype] = None) -> dict[str, str]:
    """For each SDPA kernel of :data:`SDPA_BACKENDS` (not ``default``): ``"ok"`` if it takes a plain call on
    ``device`` (q, k, v of shape (1, 2, 64, 64), equal head dims, no mask, ``dtype`` default
    :func:`preferred_half_dtype` on CUDA and float32 on a CPU), else ``"unavailable: <PyTorch's reason>"``:
    the kernel does not exist there (flash below sm_80, cuDNN attention on a CPU), whatever the formulation."""
    device = torch.device(device)
    dtype = dtype or (preferred_half_dtype(device) if device.type == "cuda" else torch.float32)
    q = torch.randn(1, 2, 64, 64, device=device, dtype=dtype)
    found = {}
    for name in SDPA_BACKENDS:
        if name == "default":
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with sdpa_backend(name), torch.no_grad():
                    torch.nn.functional.scaled_dot_product_attention(q, q, q)
                found[name] = "ok"
            except RuntimeError as e:
                found[name] = "unavailable: " + refusal(e, caught).removeprefix("refused: ")
    return found


# ----------------------------------------------------------------------------------------------------------
# measuring
# ----------------------------------------------------------------------------------------------------------


def median_seconds(call: Callable[[], object], device: torch.device | str, *, warmup: int = 1,
                   reps: int = 10) -> float:
    """Median seconds of one ``call()``. CUDA: ``triton.testing.do_bench`` (its own warm-up; it repeats the call
    for at least ``max(100, 10 * reps)`` ms); without triton, or on a CPU: ``measure.timing.median_time``."""
    if torch.device(device).type == "cuda":
        try:
            import triton.testing
        except ImportError:
            return median_time(call, warmup=max(warmup, 3), reps=reps, device=device)
        return float(triton.testing.do_bench(call, warmup=25, rep=max(100, 10 * reps), return_mode="median")) / 1e3
    return median_time(call, warmup=warmup, reps=reps, device=device)


def sdpa_backend(name: str) -> ContextManager:
    """A context that runs SDPA calls on the one kernel ``name`` (a key of :data:`SDPA_BACKENDS`); ``default``
    leaves PyTorch's dispatch alone (as for code that calls no SDPA)."""
    if name not in SDPA_BACKENDS:
        raise ValueError(f"unknown SDPA backend {name!r}; choose from {tuple(SDPA_BACKENDS)}")
    member = SDPA_BACKENDS[name]
    if member is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, member)])


def _reason(message: str) -> str:
    """PyTorch's warning text without the '(Triggered internally at ...)' tail."""
    return re.sub(r"\s*\(Triggered internally at .*", "", message, flags=re.S).strip()


def refusal(error: Exception, caught: Sequence[warnings.WarningMessage], limit: int = 400) -> str:
    """``"refused: <PyTorch's reason>"`` for an SDPA kernel that declined a call: the warnings it raised (they
    name each failed check; the 'not used because' headers dropped), else the error's first line."""
    reasons = [_reason(str(w.message)) for w in caught]
    reasons = [r for r in reasons if r and "not used because" not in r]
    text = "; ".join(dict.fromkeys(reasons)) or (_reason(str(error)).splitlines() or [type(error).__name__])[0]
    return f"refused: {text[:limit]}"


def is_refusal(error: Exception) -> bool:
    """True if ``error`` is SDPA saying that no selected kernel takes the call."""
    return isinstance(error, RuntimeError) and ("No available kernel" in str(error)
                                                or "No viable backend" in str(error))


def shape_for(n: int, d: int, tokens: int = 16384, model_width: int = 2048) -> tuple[int, int]:
    """``(B, H)`` as the FlashAttention benchmarks choose them: ``B = tokens // n`` sequences (at least 1) and
    ``H = model_width // (2 d)`` differential heads, so every length does the same work per token."""
    if model_width % (2 * d):
        raise ValueError(f"model_width {model_width} is not a multiple of 2d = {2 * d}; pick a width divisible by "
                         f"{2 * d}")
    return max(1, tokens // n), model_width // (2 * d)


def results_header(device: torch.device | str, script: str, argv: Optional[Sequence[str]]) -> dict:
    """The ``recorded`` block of a results file: date, device, versions and the command (``argv`` None: none)."""
    import diffattn_tutorial

    device = torch.device(device)
    try:
        import triton

        triton_version: Optional[str] = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "python": platform.python_version(),
        "diffattn_tutorial": diffattn_tutorial.__version__,
        "command": " ".join(["python", script, *argv]) if argv is not None else "",
    }


# ----------------------------------------------------------------------------------------------------------
# recorded results
# ----------------------------------------------------------------------------------------------------------


def recorded_path(kind: str, device: str, folder: Optional[Path] = None) -> Path:
    """Where a GPU run's file goes: ``<folder>/<kind>_<device slug>.json``, by default in the package's
    ``recorded/`` folder (so ``recorded.load`` finds it)."""
    if kind not in KINDS:
        raise ValueError(f"unknown results kind {kind!r}; choose from {tuple(KINDS)}")
    return Path(folder or RECORDED_DIR) / f"{kind}_{slug(device)}.json"


def write_json(path: Path, data: dict) -> Path:
    """Write a results file (indented, newline at the end), creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def add_output_args(parser: argparse.ArgumentParser, kind: str) -> None:
    """A benchmark script's ``--out``, ``--no-record-argv`` (tests) and ``-q``, for results of ``kind``."""
    parser.add_argument("--out", type=Path, default=None,
                        help=f"results file (default on CUDA: diffattn_tutorial/recorded/{kind}_<device>.json; "
                             "needed on a CPU, whose runs are not recorded)")
    parser.add_argument("--no-record-argv", dest="record_argv", action="store_false", help=argparse.SUPPRESS)
    parser.add_argument("-q", "--quiet", action="store_true")


def run_and_record(args: argparse.Namespace, run: Callable, kind: str, *, cpu_run: str,
                   summary: Optional[Callable[[dict], str]] = None) -> int:
    """A benchmark script's end: refuse a CUDA run without a GPU (``cpu_run`` says how to smoke-run on a CPU) and
    a CPU run without ``--out``, run ``run(args, progress)``, write its results (where ``--out`` says, else in
    :mod:`diffattn_tutorial.recorded`) and say where; 1, with the traceback, where the run fails."""
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device cuda asked for, but torch sees no CUDA GPU (use {cpu_run} for a smoke run)")
    if args.out is None and not args.device.startswith("cuda"):
        raise SystemExit("a CPU run needs --out PATH (diffattn_tutorial/recorded/ holds GPU results only)")
    progress = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    try:
        results = run(args, progress)
    except Exception:
        traceback.print_exc()
        return 1
    out = write_json(args.out or recorded_path(kind, results["recorded"]["device"]), results)
    if summary is not None and not args.quiet:
        print(summary(results))
    print(f"wrote {len(results['rows'])} rows to {out}")
    return 0


def find_recorded(kind: str, device_type: Optional[str] = "cuda",
                  folder: Optional[Path] = None) -> list[tuple[str, dict]]:
    """Every recorded file of ``kind`` (``bench_triton``, ``bench_sdpa``, ``gpu_session``) as ``(name, data)``,
    sorted by name: those with the kind's schema, recorded on ``device_type`` (None: any). ``folder``: look there
    instead of the package's ``recorded/`` (tests); unreadable files are skipped."""
    if kind not in KINDS:
        raise ValueError(f"unknown results kind {kind!r}; choose from {tuple(KINDS)}")
    found = []
    for path in sorted(Path(folder or RECORDED_DIR).glob(f"{kind}_*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if data.get("schema") != KINDS[kind]:
            continue
        recorded_on = data.get("recorded", {}).get("device_type", "cuda")  # a session file runs on CUDA only
        if device_type is None or recorded_on == device_type:
            found.append((path.stem, data))
    return found


def merge_triton(results: Sequence[dict]) -> dict:
    """One ``bench_triton`` results dict from several runs on one device (e.g. one per head dim, as the GPU
    session's steps run them): rows concatenated, configs and autotune picks united, the first run's header kept."""
    first = json.loads(json.dumps(results[0]))
    devices = {r["recorded"]["device"] for r in results}
    if len(devices) > 1:
        raise ValueError(f"results from different devices cannot be merged: {sorted(devices)}")
    for r in results[1:]:
        first["rows"] += r["rows"]
        first["chosen_configs"].update(r.get("chosen_configs", {}))
        for key in ("head_dims", "lengths", "modes", "causal"):
            first["config"][key] = sorted(set(first["config"][key]) | set(r["config"][key]))
        first["recorded"]["command"] += " && " + r["recorded"]["command"]
    return first


def _fmt(x: Optional[float], spec: str) -> str:
    return "-" if x is None else format(x, spec)


def triton_summary(results: dict) -> str:
    """A Markdown table of ``bench_triton`` results: per configuration, the fused kernel and the best SDPA
    (formulation, backend): ms, TFLOP/s, peak extra MiB, and the speed-up."""
    lines = ["| d | causal | mode | N | triton ms | TFLOP/s | MiB | best SDPA | ms | TFLOP/s | MiB | speed-up |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    keyed: dict[tuple, dict[str, dict]] = {}
    for r in results["rows"]:
        g = keyed.setdefault((r["d"], r["causal"], r["mode"], r["n"]), {})
        if r["impl"] == "triton":
            g["triton"] = r
        if r["best_sdpa"]:
            g["best"] = r
    for (d, causal, mode, n), g in keyed.items():
        t, b = g.get("triton", {}), g.get("best", {})
        best_name = f"{b['impl']}[{b['backend']}]" if b else "-"
        lines.append(f"| {d} | {causal} | {mode} | {n} | {_fmt(t.get('ms'), '.3f')} | {_fmt(t.get('tflops'), '.0f')} | "
                     f"{_fmt(t.get('peak_extra_mib'), '.0f')} | {best_name} | {_fmt(b.get('ms'), '.3f')} | "
                     f"{_fmt(b.get('tflops'), '.0f')} | {_fmt(b.get('peak_extra_mib'), '.0f')} | "
                     f"{_fmt(t.get('speedup_vs_best_sdpa'), '.2f')} |")
    return "\n".join(lines)


def goal_threshold(name: str, d: int) -> float:
    """The goal ``name`` of :data:`KERNEL_GOALS` at head dim ``d`` (one value, or one per head dim)."""
    value = KERNEL_GOALS[name]
    return value[d] if isinstance(value, dict) else value


def goals_length(results: dict) -> int:
    """The length to read the goals at in ``bench_triton`` results: :data:`GOALS_N` where it was measured, else the
    longest length measured (informative there: :func:`kernel_goals` judges only at :data:`GOALS_N`)."""
    lengths = results["config"]["lengths"]
    return GOALS_N if GOALS_N in lengths else max(lengths)


def kernel_goals(results: dict, n: int = GOALS_N) -> list[dict]:
    """The fused kernel's speed goals (:data:`KERNEL_GOALS`) checked against ``bench_triton`` results: the rows at
    ``n`` for d = 64 and 128, non-causal and causal; ``met`` says which hold (a missing measurement is not met),
    ``judged`` whether the results come from the goals' GPU, length and dtype (:data:`GOALS_DEVICE`,
    :data:`GOALS_N`, :data:`GOALS_DTYPE`; elsewhere ``met`` is informative only)."""
    judged = (GOALS_DEVICE in results["recorded"].get("device", "") and n == GOALS_N
              and results["config"].get("dtype") == GOALS_DTYPE)
    out = []
    for d in (64, 128):
        for causal in (False, True):
            rows = {r["mode"]: r for r in results["rows"]
                    if r["impl"] == "triton" and r["d"] == d and r["n"] == n and bool(r["causal"]) == causal}
            fwd, fb = rows.get("fwd", {}), rows.get("fwd_bwd", {})
            g = {"d": d, "causal": causal, "fwd_speedup_vs_best_sdpa": fwd.get("speedup_vs_best_sdpa"),
                 "fwd_tflops": fwd.get("tflops"), "fwd_bwd_speedup_vs_best_sdpa": fb.get("speedup_vs_best_sdpa")}
            g["met"] = {k: (g[k] is not None and g[k] >= goal_threshold(k, d)) for k in KERNEL_GOALS}
            g["judged"] = judged
            out.append(g)
    return out


def _shown(value: float, threshold: float) -> str:
    """``value`` to 3 significant digits, or more where 3 would round it across ``threshold`` (0.9996 -> 0.9996)."""
    for digits in range(max(3, len(str(int(abs(value))))), 17):
        text = f"{value:.{digits}g}"
        if (float(text) >= threshold) == (value >= threshold):
            return text
    return repr(value)


def goal_verdict(g: dict) -> str:
    """One row of :func:`kernel_goals` in words: ``d = 64, causal: fwd_speedup_vs_best_sdpa 0.877 < 1.2 (not met),
    ...``; a value is never rounded across its threshold, and a missing one reads ``not measured``."""
    parts = []
    for k, ok in g["met"].items():
        t = goal_threshold(k, g["d"])
        parts.append(f"{k} not measured (goal >= {t:g}, not met)" if g[k] is None else
                     f"{k} {_shown(g[k], t)} {'>=' if ok else '<'} {t:g} ({'met' if ok else 'not met'})")
    return f"d = {g['d']}, {'causal' if g['causal'] else 'non-causal'}: " + ", ".join(parts)


goals = kernel_goals  # the name the notebooks and tools call


def sdpa_summary(results: dict, *, d: Optional[int] = None, causal: Optional[bool] = None,
                 mode: Optional[str] = None) -> str:
    """A Markdown table of ``bench_sdpa`` results: median milliseconds, one row per (d, causal, mode, N), one
    column per formulation, and the best V1 SDPA formulation's time over the baseline's ("oom" where it ran out
    of memory)."""
    forms = results["config"]["formulations"]
    cells: dict[tuple, dict[str, dict]] = {}
    for r in results["rows"]:
        keep = (d is None or r["d"] == d) and (causal is None or r["causal"] == causal)
        if keep and (mode is None or r["mode"] == mode):
            cells.setdefault((r["d"], r["causal"], r["mode"], r["n"]), {})[r["formulation"]] = r
    head = "| d | causal | pass | N | " + " | ".join(forms) + " | best V1 SDPA / baseline |"
    lines = [head, "|" + "---:|" * 4 + "---:|" * len(forms) + "---:|"]
    for (row_d, row_causal, row_mode, n), row in cells.items():
        def show(f: str) -> str:
            r = row.get(f)
            if r is None:
                return ""
            return f"{r['ms']:.2f}" if r["status"] == "ok" else r["status"].split(":")[0]
        sdpa = [row[f]["ms"] for f in ("sdpa_wide", "sdpa_split", "sdpa_stacked") if f in row and row[f]["ms"]]
        base = row.get("baseline", {}).get("ms")
        ratio = f"{min(sdpa) / base:.2f}x" if sdpa and base else ""
        lines.append(f"| {row_d} | {'yes' if row_causal else 'no'} | {row_mode} | {n} | "
                     + " | ".join(show(f) for f in forms) + f" | {ratio} |")
    return "\n".join(lines)


__all__ = ["cuda_capability", "preferred_half_dtype", "check_half_dtype", "benchmark_dtype", "sdpa_kernels_here", "BF16_CAPABILITY",
           "median_seconds", "sdpa_backend", "refusal", "is_refusal", "shape_for", "results_header",
           "recorded_path", "write_json", "add_output_args", "run_and_record", "find_recorded", "merge_triton", "triton_summary", "goals",
           "kernel_goals", "KERNEL_GOALS", "goal_threshold", "goal_verdict", "goals_length",
           "sdpa_summary", "SDPA_BACKENDS", "GOALS", "GOALS_DEVICE", "GOALS_N", "GOALS_DTYPE", "KINDS", "TRITON_SCHEMA", "SDPA_SCHEMA",
           "SESSION_SCHEMA",
           "RECORDED_DIR"]
