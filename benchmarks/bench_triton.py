"""The fused Triton kernel against every SDPA formulation under every SDPA backend, into a JSON file.

    python benchmarks/bench_triton.py                 # CUDA headline: bf16 (fp16 on a T4), N = 8192, d 64 and 128, causal and not,
                                                      # fwd and fwd+bwd (about 4 min per head dim on an H100)
    python benchmarks/bench_triton.py --head-dims 64 --out /tmp/r64.json    # one head dim (one GPU-session step)
                                                      # default --out on CUDA: diffattn_tutorial/recorded/
                                                      # bench_triton_<device>.json (notebook 09 shows it)
    python benchmarks/bench_triton.py --lengths 1024 2048 4096 8192 16384   # a sweep (much longer)
    TRITON_INTERPRET=1 python benchmarks/bench_triton.py --device cpu --lengths 32 --head-dims 16 --tokens 32 \
        --model-width 64 --out /tmp/r.json
                                                      # a CPU smoke run of the plumbing (interpreter; meaningless times)

Shapes follow the FlashAttention benchmarks: a fixed number of tokens per batch (``--tokens``, default 16384,
so ``B = tokens // N``) and a fixed model width (``--model-width`` 2048 = ``2 H d``, so ``H = 2048 / (2d)``
differential heads), so every length does the same amount of work per token and small ``N`` still fills the GPU.

Per (head dim, causal, mode, N), one row per implementation and SDPA backend, all on the same inputs:

* ``triton``: ``diff_attention(..., backend="triton")`` (block sizes autotuned over a few configurations per
  kernel; the first call tunes, and the picks are recorded under ``chosen_configs``);
* ``sdpa_wide``, ``sdpa_split``, ``sdpa_stacked`` under each of ``--backends`` (default on CUDA: ``flash``,
  ``cudnn``, ``efficient``, each selected explicitly with ``torch.nn.attention.sdpa_kernel``; a backend that
  refuses a formulation is recorded as ``refused: <PyTorch's reason>``). The fastest (formulation, backend)
  per configuration is marked ``best_sdpa``, and ``triton``'s ``speedup_vs_best_sdpa`` is taken against it;
* ``naive``: explicit maps, up to ``--naive-max-n`` (default 4096: it needs ``O(N^2)`` memory).

Time: ``diffattn_tutorial.measure.gpu.median_seconds`` (on CUDA ``triton.testing.do_bench``: median, CUDA
events, no host sync between calls). ``fwd`` runs under ``torch.inference_mode()``; ``fwd_bwd`` runs forward
and backward with lambda trainable. ``peak_extra_mib``: ``diffattn_tutorial.measure.timing.cuda_peak_extra``, bytes
allocated above what was allocated before the call, the output excluded (gradients included for ``fwd_bwd``).
TFLOP/s use one FLOP count for every implementation, the DIFF V1 layer's ``12 B H N^2 d`` forward, half for
causal, 3.5x for forward + backward (``diffattn_tutorial.measure.flops.diff_v1_attention_flops``): it compares layer
throughput (``sdpa_split`` really does 16/12 of that work). ``max_abs_err`` compares with the first SDPA row
that ran.
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

from diffattn_tutorial.functional import SDPA_FORMULATIONS, diff_attention  # noqa: E402
from diffattn_tutorial.measure import flops  # noqa: E402
from diffattn_tutorial.measure.gpu import (  # noqa: E402
    SDPA_BACKENDS,
    TRITON_SCHEMA,
    add_output_args,
    benchmark_dtype,
    is_refusal,
    median_seconds,
    refusal,
    results_header,
    run_and_record,
    sdpa_backend,
    shape_for,
    triton_summary,
)
from diffattn_tutorial.measure.timing import cuda_peak_extra, make_inputs  # noqa: E402

ROW_KEYS = ("impl", "backend", "mode", "causal", "n", "d", "batch", "heads", "status", "ms", "tflops",
            "peak_extra_mib", "best_sdpa", "speedup_vs_best_sdpa", "max_abs_err")
_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)

Tensor = torch.Tensor


def _peak_mib(call: Callable[[], Tensor], device: torch.device) -> Optional[float]:
    return cuda_peak_extra(call) / 2**20 if device.type == "cuda" else None


TRITON_VARIANTS = {"triton_atomic": "the atomic twin of the kernel's plan (configs.ATOMIC_TWINS), d = 33 to 128",
                   "triton_tma": "the kernel with its TMA twins only (configs.TMA_TWINS), sm_90a, d = 64 and 128",
                   "triton_pointers": "the kernel with pointer loads only (no TMA twin)",
                   "triton_fused": "the fused plan (dV and both dK in one launch, HOPPER.md's design 2), sm_90a, d <= 64",
                   "triton_fused_atomic": "dV, dK and dQ in one launch (plan fused_atomic), sm_90a, d = 64, neither "
                                          "causal nor masked"}
"""The Triton kernel's variants chosen by name, beside its default (``triton``, through ``diff_attention``)."""


def attention(impl: str, q: Tensor, k: Tensor, v: Tensor, lam: Tensor, causal: bool) -> Tensor:
    """``diff_attention`` with backend ``impl``, or a variant of :data:`TRITON_VARIANTS`, called through
    ``triton_diff_attention`` (chosen by name only): ``triton_atomic``, the atomic twin of the plan the kernel
    would use (dQ added by the dK programs; head dims whose plan has no twin, d <= 32, are refused, and below
    sm_90 the library refuses its 16-bit training calls: the dK + dQ launch has 16-bit table entries on sm_90a only);
    ``triton_tma`` / ``triton_pointers``, every launch that can read by tensor descriptor made to, or not to;
    ``triton_fused`` / ``triton_fused_atomic``, the fused plan (one dK/dV launch) or its atomic form (one launch
    for every gradient), which have table entries up to d = 64 (refused above; the atomic form refuses causal
    calls itself)."""
    if impl not in TRITON_VARIANTS:
        return diff_attention(q, k, v, lam, causal=causal, backend=impl)
    from diffattn_tutorial.kernels.triton import launch
    from diffattn_tutorial.kernels.triton.configs import ATOMIC_TWINS, plan_for
    from diffattn_tutorial.kernels.triton.flash_diff import triton_diff_attention

    if impl in ("triton_fused", "triton_fused_atomic"):
        if q.shape[-1] > 64 or launch.capability(q.device) < 90:
            raise ValueError(f"d = {q.shape[-1]}, compute capability {launch.capability(q.device) / 10:.1f}: the "
                             f"fused plan has table entries up to d = 64 on sm_90a only (its register need at d = 128 "
                             f"is notebook 09's lesson); {impl} runs d <= 64 on Hopper")
        return triton_diff_attention(q, k, v, lam, causal=causal, plan=impl.removeprefix("triton_"))
    if impl != "triton_atomic":
        return triton_diff_attention(q, k, v, lam, causal=causal, tma=impl == "triton_tma")

    plan = plan_for(max(16, 1 << (q.shape[-1] - 1).bit_length()), launch.capability(q.device)).name
    if plan not in ATOMIC_TWINS:
        raise ValueError(f"plan {plan!r} (d = {q.shape[-1]}) has no atomic twin; triton_atomic runs d = 33 to 128")
    return triton_diff_attention(q, k, v, lam, causal=causal, plan=ATOMIC_TWINS[plan])


def measure(impl: str, backend: str, mode: str, causal: bool, inputs: tuple, *, device: torch.device, reps: int):
    """``(ms, peak_extra_mib, output, status)`` of one implementation under one SDPA backend on ``inputs``."""
    q, k, v, lam = inputs
    caught: list = []
    try:
        selected = sdpa_backend(backend if impl in SDPA_FORMULATIONS else "default")  # triton, naive: no SDPA
        with warnings.catch_warnings(record=True) as caught, selected:
            warnings.simplefilter("always")
            if mode == "fwd":
                with torch.inference_mode():
                    call = lambda: attention(impl, q, k, v, lam, causal)  # noqa: E731
                    out = call()  # the first triton call autotunes
                    ms = median_seconds(call, device, reps=reps) * 1e3
                    peak = _peak_mib(call, device)
            else:
                leaves = [t.detach().requires_grad_(True) for t in inputs]
                grad = torch.randn(q.shape[0], q.shape[1] // 2, q.shape[2], 2 * q.shape[3], device=device,
                                   dtype=q.dtype)

                def call() -> Tensor:
                    for t in leaves:
                        t.grad = None
                    o = attention(impl, *leaves, causal)
                    o.backward(grad)
                    return o

                out = call().detach()
                ms = median_seconds(call, device, reps=reps) * 1e3
                peak = _peak_mib(call, device)
        return ms, peak, out, "ok"
    except _OOM:
        return None, None, None, "oom"
    except Exception as e:  # noqa: BLE001 - a refusing or failing implementation is a result, not a crash
        if backend != "default" and impl in SDPA_FORMULATIONS and is_refusal(e):
            return None, None, None, refusal(e, caught, limit=240)
        if impl.startswith("triton") and isinstance(e, (TypeError, ValueError)):  # what the kernel does not run on this GPU
            return None, None, None, f"refused: {str(e)[:240]}"  # (training at d = 128 on a T4), naming the fix
        return None, None, None, f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


def impl_list(args: argparse.Namespace) -> list[tuple[str, str]]:
    """``(impl, backend)`` pairs in the order they run."""
    pairs = []
    for impl in args.impls:
        if impl in SDPA_FORMULATIONS:
            pairs += [(impl, b) for b in args.backends]
        else:
            pairs.append((impl, "triton" if impl.startswith("triton") else "none"))
    return pairs


def run(args: argparse.Namespace, progress: Callable[[str], None] = lambda s: None) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    causal_values = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    rows: list[dict] = []
    for d in args.head_dims:
        for causal in causal_values:
            for mode in args.modes:
                for n in args.lengths:
                    b, h = shape_for(n, d, args.tokens, args.model_width)
                    inputs = make_inputs(b, h, n, d, dtype=dtype, device=device)
                    fl = flops.diff_v1_attention_flops(b, h, n, d, causal=causal,
                                                       pass_="fwd" if mode == "fwd" else "fwd_bwd")
                    group, outs = [], {}
                    for impl, backend in impl_list(args):
                        row = {"impl": impl, "backend": backend, "mode": mode, "causal": causal, "n": n, "d": d,
                               "batch": b, "heads": h, "status": "skipped (naive above --naive-max-n)", "ms": None,
                               "tflops": None, "peak_extra_mib": None, "best_sdpa": False,
                               "speedup_vs_best_sdpa": None, "max_abs_err": None}
                        if not (impl == "naive" and n > args.naive_max_n):
                            ms, row["peak_extra_mib"], out, row["status"] = measure(
                                impl, backend, mode, causal, inputs, device=device, reps=args.reps)
                            if ms is not None:
                                row["ms"], row["tflops"] = ms, fl / (ms * 1e-3) / 1e12
                                outs[(impl, backend)] = out
                        group.append(row)
                        ms_txt = "-" if row["ms"] is None else f"{row['ms']:.3f} ms"
                        progress(f"d={d} causal={causal} {mode} N={n} B={b} H={h} {impl}[{backend}]: {ms_txt} "
                                 f"{row['status']}")
                    sdpa = [r for r in group if r["impl"] in SDPA_FORMULATIONS and r["ms"] is not None]
                    best = min(sdpa, key=lambda r: r["ms"]) if sdpa else None
                    ref = outs.get((sdpa[0]["impl"], sdpa[0]["backend"])) if sdpa else None
                    for r in group:
                        r["best_sdpa"] = r is best
                        if best is not None and r["impl"].startswith("triton") and r["ms"] is not None:
                            r["speedup_vs_best_sdpa"] = best["ms"] / r["ms"]
                        if ref is not None and (r["impl"], r["backend"]) in outs:
                            err = outs[(r["impl"], r["backend"])].float() - ref.float()
                            r["max_abs_err"] = err.abs().max().item()
                    rows.extend(group)
                    del inputs, outs, ref
    from diffattn_tutorial.kernels.triton.flash_diff import chosen_configs

    return {
        "schema": TRITON_SCHEMA,
        "recorded": results_header(device, "benchmarks/bench_triton.py",
                                   sys.argv[1:] if args.record_argv else None),
        "config": {
            "tokens": args.tokens, "model_width": args.model_width, "dtype": args.dtype,
            "lengths": list(args.lengths), "head_dims": list(args.head_dims), "causal": causal_values,
            "modes": list(args.modes), "impls": list(args.impls), "backends": list(args.backends), "reps": args.reps,
            "naive_max_n": args.naive_max_n,
            "shapes": "q (B, 2H, N, d), k (B, 2H, N, d), v (B, H, N, 2d); B = tokens // N, H = model_width / (2d)",
            "flops": "12 B H N^2 d forward for every impl (DIFF V1 layer), causal half, fwd_bwd 3.5x",
            "timer": "gpu_bench.median_seconds: triton.testing.do_bench median (CUDA); perf_counter median (CPU)",
            "peak_extra_mib": "bench.cuda_peak_extra: CUDA bytes allocated above the inputs, output excluded",
        },
        "chosen_configs": chosen_configs(),
        "rows": rows,
    }


def build_parser() -> argparse.ArgumentParser:
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if cuda else "cpu")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                    help="default: the GPU's 16-bit dtype (bfloat16; float16 below compute capability 8.0), "
                         "float32 on CPU")
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192], metavar="N")
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128], metavar="D", help="q/k head dim d")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per batch: B = tokens // N")
    ap.add_argument("--model-width", type=int, default=2048, help="2 H d: H = width / (2d) differential heads")
    ap.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    ap.add_argument("--modes", nargs="+", default=["fwd", "fwd_bwd"], choices=["fwd", "fwd_bwd"])
    ap.add_argument("--impls", type=lambda s: s.split(","), default=["triton", *SDPA_FORMULATIONS, "naive"],
                    help="comma-separated, from triton,triton_atomic,triton_tma,triton_pointers,sdpa_wide,sdpa_split,"
                         "sdpa_stacked,naive (" + "; ".join(f"{k}: {v}" for k, v in TRITON_VARIANTS.items()) + ")")
    ap.add_argument("--backends", nargs="+", default=None, choices=list(SDPA_BACKENDS),
                    help="SDPA backends, each selected explicitly (default: flash cudnn efficient on CUDA, "
                         "default on a CPU)")
    ap.add_argument("--naive-max-n", type=int, default=4096, help="skip naive above this length (O(N^2) memory)")
    ap.add_argument("--reps", type=int, default=10, help="CPU: timed calls; CUDA: sets do_bench's rep >= 10x ms")
    add_output_args(ap, "bench_triton")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:  # the GPU's own 16-bit dtype: bf16, fp16 on a T4
        args.dtype = benchmark_dtype(args.device, args.dtype)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    args.backends = args.backends or (["flash", "cudnn", "efficient"] if args.device.startswith("cuda")
                                      else ["default"])
    known = ("triton", *TRITON_VARIANTS, *SDPA_FORMULATIONS, "naive")
    bad = [i for i in args.impls if i not in known]
    if bad:
        raise SystemExit(f"unknown implementations {bad}; choose from {known}")
    return run_and_record(args, run, "bench_triton", cpu_run="--device cpu with TRITON_INTERPRET=1",
                          summary=triton_summary)


if __name__ == "__main__":
    sys.exit(main())
