"""Time and peak memory of every SDPA formulation of differential attention, on a GPU, into a JSON file.

    python benchmarks/bench_sdpa.py                       # full run on CUDA: bf16 (fp16 on a T4), N 1K..16K, d 64
                                                          # and 128, into
                                                          # diffattn_tutorial/recorded/bench_sdpa_<device>.json
    python benchmarks/bench_sdpa.py --lengths 1024 2048 --head-dims 64 --causal no --modes fwd
    python benchmarks/bench_sdpa.py --device cpu --dtype float32 --lengths 64 --heads 2 --batch 1 --out /tmp/r.json

What runs (``H`` differential heads of q/k dim ``d``; every layer has model width ``2 H d``):

* ``naive``, ``sdpa_wide``, ``sdpa_split``, ``sdpa_stacked``: DIFF V1 through ``diff_attention``'s backends
  (q ``(B, 2H, N, d)``, k ``(B, 2H, N, d)``, v ``(B, H, N, 2d)``).
* ``triton`` (only if asked for with ``--formulations`` and usable): the fused kernel of notebook 09.
* ``diff_v2``: DIFF V2 of the same width: one call over ``4H`` query heads of dim ``d`` with ``2H`` KV heads
  (``diff_attention_v2``), so ``2H`` output heads of dim ``d``.
* ``baseline``: softmax attention of the same width, ``2H`` heads of dim ``d`` (``softmax_attention``).

Each runs forward (``fwd``, inference mode) and forward + backward (``fwd_bwd``, lambda trainable), causal
and not, for every length and head dim. Per row: median milliseconds (``diffattn_tutorial.measure.gpu.
median_seconds``: ``triton.testing.do_bench`` on CUDA, device events, no host sync between calls), achieved
TFLOP/s (FLOPs from ``diffattn_tutorial.measure.flops``: the work each formulation really does), peak extra memory above
the inputs, output excluded (CUDA only, ``diffattn_tutorial.measure.timing.cuda_peak_extra``), and the largest
difference from a reference V1 formulation on the same inputs. Out-of-memory is
recorded as ``"status": "oom"``. The file also records which SDPA kernels (flash, memory-efficient, cuDNN,
math) accept each formulation's calls on this device, probed with ``torch.nn.attention.sdpa_kernel``.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

if __package__ in (None, ""):  # run as a script from a checkout: import the package from the repository
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffattn_tutorial.functional import diff_attention, diff_attention_v2, softmax_attention  # noqa: E402
from diffattn_tutorial.measure import flops, gpu  # noqa: E402
from diffattn_tutorial.measure.timing import cuda_peak_extra, make_inputs  # noqa: E402

V1_FORMULATIONS = ("naive", "sdpa_wide", "sdpa_split", "sdpa_stacked")
DEFAULT_FORMULATIONS = (*V1_FORMULATIONS, "diff_v2", "baseline")
ALL_FORMULATIONS = (*V1_FORMULATIONS, "triton", "diff_v2", "baseline")
SDPA_KERNELS = {"FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "efficient", "CUDNN_ATTENTION": "cudnn",
                "MATH": "math"}
"""The SDPA kernels probed, as ``torch.nn.attention.SDPBackend`` members -> ``measure.gpu.sdpa_backend`` names."""
ROW_KEYS = ("formulation", "mode", "causal", "n", "d", "status", "ms", "tflops", "flops", "peak_extra_mib",
            "max_abs_err")

Tensor = torch.Tensor
_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


# ----------------------------------------------------------------------------------------------------------
# inputs and the function each formulation runs
# ----------------------------------------------------------------------------------------------------------


def make_case(formulation: str, b: int, h: int, n: int, d: int, *, dtype: torch.dtype, device: torch.device,
              seed: int = 0) -> tuple[Tensor, ...]:
    """Random inputs for one formulation (see the module docstring for the shapes); the last one is lambda.

    The V1 formulations share their inputs for a given seed, so their outputs can be compared.
    """
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    if formulation in (*V1_FORMULATIONS, "triton"):
        return make_inputs(b, h, n, d, dtype=dtype, device=device, seed=seed)
    if formulation == "diff_v2":  # 2H output heads: 4H query heads, 2H KV heads, per-token sigmoid lambda
        lam = torch.sigmoid(torch.randn(b, 2 * h, n, 1, generator=g)).to(device=device, dtype=dtype)
        return rnd(b, 4 * h, n, d), rnd(b, 2 * h, n, d), rnd(b, 2 * h, n, d), lam
    if formulation == "baseline":
        return rnd(b, 2 * h, n, d), rnd(b, 2 * h, n, d), rnd(b, 2 * h, n, d)
    raise ValueError(f"unknown formulation {formulation!r}; choose from {ALL_FORMULATIONS}")


def forward_fn(formulation: str, causal: bool) -> Callable[..., Tensor]:
    """The function of the inputs :func:`make_case` builds."""
    if formulation in (*V1_FORMULATIONS, "triton"):
        return lambda q, k, v, lam: diff_attention(q, k, v, lam, causal=causal, backend=formulation)
    if formulation == "diff_v2":
        return lambda q, k, v, lam: diff_attention_v2(q, k, v, lam, causal=causal, backend="sdpa")
    if formulation == "baseline":
        return lambda q, k, v: softmax_attention(q, k, v, causal=causal, backend="sdpa")
    raise ValueError(f"unknown formulation {formulation!r}")


def count_flops(formulation: str, b: int, h: int, n: int, d: int, causal: bool, mode: str) -> float:
    """FLOPs one call performs, from ``diffattn_tutorial.measure.flops`` (the work each formulation really does)."""
    pass_ = "fwd" if mode == "fwd" else "fwd_bwd"
    if formulation == "diff_v2":
        return flops.diff_v2_attention_flops(b, 2 * h, n, d, causal=causal, pass_=pass_)
    if formulation == "baseline":
        return flops.baseline_attention_flops(b, 2 * h, n, d, causal=causal, pass_=pass_)
    return flops.formulation_flops(formulation, b, h, n, d, causal=causal, pass_=pass_)


# ----------------------------------------------------------------------------------------------------------
# which SDPA kernels accept a formulation's calls
# ----------------------------------------------------------------------------------------------------------


def kernel_support(formulation: str, d: int, *, dtype: torch.dtype, device: torch.device,
                   causal: bool = False, n: int = 128) -> dict[str, str]:
    """For each SDPA kernel: ``"ok"`` or ``"refused: <PyTorch's reason>"`` for this formulation's calls.

    Probed by running the formulation with ``torch.nn.attention.sdpa_kernel([kernel])``: a kernel that
    refuses raises ``RuntimeError`` and PyTorch's warnings say why. ``naive`` calls no SDPA kernel.
    """
    if formulation in ("naive", "triton"):
        return {name: "not used (no SDPA call)" for name in SDPA_KERNELS}
    inputs = make_case(formulation, 1, 2, n, d, dtype=dtype, device=device)
    fn = forward_fn(formulation, causal)
    result = {}
    for name, backend in SDPA_KERNELS.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with gpu.sdpa_backend(backend), torch.no_grad():
                    fn(*inputs)
                result[name] = "ok"
            except RuntimeError as e:
                result[name] = gpu.refusal(e, caught)
    return result


# ----------------------------------------------------------------------------------------------------------
# measuring
# ----------------------------------------------------------------------------------------------------------


def measure(formulation: str, mode: str, causal: bool, *, b: int, h: int, n: int, d: int, dtype: torch.dtype,
            device: torch.device, warmup: int, reps: int,
            reference: Optional[Tensor] = None) -> tuple[dict, Optional[Tensor]]:
    """One row of the results (a dict with :data:`ROW_KEYS`) and the forward output (for comparisons)."""
    row = {"formulation": formulation, "mode": mode, "causal": causal, "n": n, "d": d, "status": "ok", "ms": None,
           "tflops": None, "flops": count_flops(formulation, b, h, n, d, causal, mode), "peak_extra_mib": None,
           "max_abs_err": None}
    out = None
    try:
        inputs = make_case(formulation, b, h, n, d, dtype=dtype, device=device)
        fn = forward_fn(formulation, causal)
        if mode == "fwd":
            with torch.inference_mode():
                out = fn(*inputs)
                call = lambda: fn(*inputs)  # noqa: E731
                if device.type == "cuda":
                    row["peak_extra_mib"] = cuda_peak_extra(call) / 2**20
                sec = gpu.median_seconds(call, device, warmup=warmup, reps=reps)
        else:
            leaves = [t.detach().requires_grad_(True) for t in inputs]
            out = fn(*leaves)
            grad = torch.randn_like(out)

            def call() -> Tensor:
                for t in leaves:
                    t.grad = None
                o = fn(*leaves)
                o.backward(grad)
                return o

            call()
            if device.type == "cuda":
                row["peak_extra_mib"] = cuda_peak_extra(call) / 2**20
            sec = gpu.median_seconds(call, device, warmup=warmup, reps=reps)
            out = out.detach()
        row["ms"] = sec * 1e3
        row["tflops"] = row["flops"] / sec / 1e12
        if reference is not None and out is not None:
            row["max_abs_err"] = (out.float() - reference.float()).abs().max().item()
    except _OOM:
        row["status"], out = "oom", None
    except Exception as e:  # noqa: BLE001 - a refused or failing formulation is a result, not a crash
        row["status"], out = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}", None
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row, out


def run(args: argparse.Namespace, progress: Callable[[str], None] = lambda s: None) -> dict:
    """Every (formulation, mode, causal, head dim, length); returns the JSON-ready results dict."""
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    causal_values = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    rows: list[dict] = []
    support: dict[str, dict[str, dict[str, str]]] = {}
    for d in args.head_dims:
        support[str(d)] = {f: kernel_support(f, d, dtype=dtype, device=device) for f in args.formulations}
        for causal in causal_values:
            for mode in args.modes:
                for n in args.lengths:
                    reference = None
                    for f in args.formulations:
                        row, out = measure(f, mode, causal, b=args.batch, h=args.heads, n=n, d=d, dtype=dtype,
                                           device=device, warmup=args.warmup, reps=args.reps,
                                           reference=reference if f in (*V1_FORMULATIONS, "triton") else None)
                        if reference is None and out is not None and f in (*V1_FORMULATIONS, "triton"):
                            reference = out  # the first V1 formulation that ran is the reference
                        rows.append(row)
                        ms = "-" if row["ms"] is None else f"{row['ms']:.2f} ms"
                        progress(f"d={d} causal={causal} {mode} N={n} {f}: {ms} {row['status']}")
                    del reference
    return {
        "schema": gpu.SDPA_SCHEMA,
        "recorded": gpu.results_header(device, "benchmarks/bench_sdpa.py", sys.argv[1:] if args.record_argv else None),
        "config": {
            "batch": args.batch, "heads": args.heads, "dtype": args.dtype, "lengths": list(args.lengths),
            "head_dims": list(args.head_dims), "causal": causal_values, "modes": list(args.modes),
            "formulations": list(args.formulations), "warmup": args.warmup, "reps": args.reps,
            "shapes": {
                "v1": "q (B, 2H, N, d), k (B, 2H, N, d), v (B, H, N, 2d)",
                "diff_v2": "q (B, 4H, N, d), k and v (B, 2H, N, d): 2H output heads of dim d",
                "baseline": "q, k, v (B, 2H, N, d): softmax attention of the same width 2Hd",
            },
            "flops": "diffattn_tutorial.measure.flops; causal counts half; fwd_bwd = 3.5 x fwd",
            "peak_extra_mib": "bench.cuda_peak_extra: CUDA bytes allocated above the inputs while the call runs, "
                              "output excluded",
        },
        "kernel_support": support,
        "rows": rows,
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32", "float64"],
                    help="default: the GPU's 16-bit dtype (bfloat16; float16 below compute capability 8.0), "
                         "float32 on CPU")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384], metavar="N")
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128], metavar="D", help="q/k head dim d")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8, help="differential heads H (width 2Hd)")
    ap.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    ap.add_argument("--modes", nargs="+", default=["fwd", "fwd_bwd"], choices=["fwd", "fwd_bwd"])
    ap.add_argument("--formulations", type=lambda s: s.split(","), default=list(DEFAULT_FORMULATIONS),
                    help=f"comma-separated, from {','.join(ALL_FORMULATIONS)}")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    gpu.add_output_args(ap, "bench_sdpa")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:  # the GPU's own 16-bit dtype: bf16, fp16 on a T4
        args.dtype = gpu.benchmark_dtype(args.device, args.dtype)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    bad = [f for f in args.formulations if f not in ALL_FORMULATIONS]
    if bad:
        raise SystemExit(f"unknown formulations {bad}; choose from {ALL_FORMULATIONS}")
    return gpu.run_and_record(args, run, "bench_sdpa", cpu_run="--device cpu")


if __name__ == "__main__":
    sys.exit(main())
