"""The fused Triton kernel against every SDPA formulation under every SDPA backend, into a JSON file.

    python benchmarks/bench_triton.py                 # CUDA headline: bf16, N = 8192, d 64 and 128, causal and not,
                                                      # fwd and fwd+bwd (about 4 min per head dim on an H100)
    python benchmarks/bench_triton.py --head-dims 64 --out /tmp/r64.json    # one head dim (one GPU-session step)
    python benchmarks/bench_triton.py --lengths 1024 2048 4096 8192 16384   # a sweep (much longer)
    TRITON_INTERPRET=1 python benchmarks/bench_triton.py --device cpu --lengths 32 --head-dims 16 --tokens 32 --model-width 64
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

Time: ``triton.testing.do_bench`` (median; CUDA events, no host sync between calls). ``fwd`` runs under
``torch.inference_mode()``; ``fwd_bwd`` runs forward and backward with lambda trainable. ``peak_extra_mib``:
``torch.cuda.max_memory_allocated`` above what was allocated before the call (the forward's output excluded;
gradients included for ``fwd_bwd``). TFLOP/s use one FLOP count for every implementation, the DIFF V1
layer's ``12 B H N^2 d`` forward, half for causal, 3.5x for forward + backward
(``diffattn_tutorial.flops.diff_v1_attention_flops``): it compares layer throughput (``sdpa_split`` really does
16/12 of that work). ``max_abs_err`` compares with the first SDPA row that ran.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import platform
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

import diffattn_tutorial
from diffattn_tutorial import flops
from diffattn_tutorial.bench import device_name, slug
from diffattn_tutorial.functional import SDPA_FORMULATIONS, diff_attention

SCHEMA = "diffattn-tutorial/bench_triton/2"
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "math": "MATH", "default": None}
"""``--backends`` names -> ``torch.nn.attention.SDPBackend`` members (``default``: PyTorch's own dispatch)."""
ROW_KEYS = ("impl", "backend", "mode", "causal", "n", "d", "batch", "heads", "status", "ms", "tflops",
            "peak_extra_mib", "best_sdpa", "speedup_vs_best_sdpa", "max_abs_err")
_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
GOALS = {"fwd_speedup_vs_best_sdpa": 1.2, "fwd_tflops": 350.0, "fwd_bwd_speedup_vs_best_sdpa": 1.0}
"""Issue 13's goals (H100, bf16, N = 8192, non-causal, d = 64 and 128)."""

Tensor = torch.Tensor


def shape_for(n: int, d: int, tokens: int, model_width: int) -> tuple[int, int]:
    """``(B, H)``: ``B = tokens // n`` sequences (at least 1), ``H = model_width // (2 d)`` differential heads."""
    if model_width % (2 * d):
        raise ValueError(f"model width {model_width} is not a multiple of 2d = {2 * d}")
    return max(1, tokens // n), model_width // (2 * d)


def make_inputs(b: int, h: int, n: int, d: int, *, dtype: torch.dtype, device: torch.device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, 2 * h, n, d, generator=g).to(device=device, dtype=dtype) for _ in range(2))
    v = torch.randn(b, h, n, 2 * d, generator=g).to(device=device, dtype=dtype)
    return q, k, v, torch.tensor(0.6, device=device, dtype=dtype)


def bench_ms(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median milliseconds of ``fn``: ``triton.testing.do_bench`` on CUDA, a plain median elsewhere."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=max(100, 10 * reps), return_mode="median"))
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def backend_context(backend: str):
    """``sdpa_kernel([that backend])``, or nothing for ``default`` (and for the non-SDPA implementations)."""
    member = SDPA_BACKENDS.get(backend)
    if member is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, member)])


def _refusal(e: Exception, caught: list) -> str:
    """PyTorch's reason a backend refused: the warnings it raised (they name the failed check), else the error."""
    reasons = [str(w.message).splitlines()[0] for w in caught if "kernel" in str(w.message).lower()]
    text = reasons[0] if reasons else str(e).splitlines()[0]
    return f"refused: {text[:240]}"


def peak_extra_mib(call: Callable[[], Tensor], device: torch.device, exclude_output: bool) -> Optional[float]:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = call()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    if exclude_output:
        extra -= out.numel() * out.element_size()
    return extra / 2**20


def measure(impl: str, backend: str, mode: str, causal: bool, inputs: tuple, *, device: torch.device, reps: int):
    """``(ms, peak_extra_mib, output, status)`` of one implementation under one SDPA backend on ``inputs``."""
    q, k, v, lam = inputs
    caught: list = []
    try:
        with warnings.catch_warnings(record=True) as caught, backend_context(backend):
            warnings.simplefilter("always")
            if mode == "fwd":
                with torch.inference_mode():
                    call = lambda: diff_attention(q, k, v, lam, causal=causal, backend=impl)  # noqa: E731
                    out = call()  # the first triton call autotunes
                    ms = bench_ms(call, device, reps)
                    peak = peak_extra_mib(call, device, exclude_output=True)
            else:
                leaves = [t.detach().requires_grad_(True) for t in inputs]
                grad = torch.randn(q.shape[0], q.shape[1] // 2, q.shape[2], 2 * q.shape[3], device=device,
                                   dtype=q.dtype)

                def call() -> Tensor:
                    for t in leaves:
                        t.grad = None
                    o = diff_attention(*leaves, causal=causal, backend=impl)
                    o.backward(grad)
                    return o

                out = call().detach()
                ms = bench_ms(call, device, reps)
                peak = peak_extra_mib(call, device, exclude_output=False)
        return ms, peak, out, "ok"
    except _OOM:
        return None, None, None, "oom"
    except RuntimeError as e:
        if backend != "default" and impl in SDPA_FORMULATIONS and ("No available kernel" in str(e)
                                                                    or "No viable backend" in str(e)):
            return None, None, None, _refusal(e, caught)
        return None, None, None, f"error: RuntimeError: {str(e).splitlines()[0][:200]}"
    except Exception as e:  # noqa: BLE001 - a failing implementation is a result, not a crash
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
            pairs.append((impl, "triton" if impl == "triton" else "none"))
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
                        if best is not None and r["impl"] == "triton" and r["ms"] is not None:
                            r["speedup_vs_best_sdpa"] = best["ms"] / r["ms"]
                        if ref is not None and (r["impl"], r["backend"]) in outs:
                            r["max_abs_err"] = (outs[(r["impl"], r["backend"])].float() - ref.float()).abs().max().item()
                    rows.extend(group)
                    del inputs, outs, ref
    import triton

    from diffattn_tutorial.triton_diff import chosen_configs

    return {
        "schema": SCHEMA,
        "recorded": {
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": device_name(device),
            "device_type": device.type,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "python": platform.python_version(),
            "diffattn_tutorial": diffattn_tutorial.__version__,
            "command": " ".join(["python", "benchmarks/bench_triton.py", *sys.argv[1:]]) if args.record_argv else "",
        },
        "config": {
            "tokens": args.tokens, "model_width": args.model_width, "dtype": args.dtype,
            "lengths": list(args.lengths), "head_dims": list(args.head_dims), "causal": causal_values,
            "modes": list(args.modes), "impls": list(args.impls), "backends": list(args.backends), "reps": args.reps,
            "naive_max_n": args.naive_max_n,
            "shapes": "q (B, 2H, N, d), k (B, 2H, N, d), v (B, H, N, 2d); B = tokens // N, H = model_width / (2d)",
            "flops": "12 B H N^2 d forward for every impl (DIFF V1 layer), causal half, fwd_bwd 3.5x",
            "timer": "triton.testing.do_bench median (CUDA); perf_counter median (CPU)",
            "peak_extra_mib": "torch.cuda.max_memory_allocated above the inputs (fwd: output excluded)",
        },
        "chosen_configs": chosen_configs(),
        "rows": rows,
    }


def merge(results: Sequence[dict]) -> dict:
    """One results dict from several runs on one device (e.g. one per head dim, as the GPU session's steps run
    them): rows concatenated, configs and autotune picks united, the first run's header kept."""
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


def find_results(folder: Path, device_type: Optional[str] = "cuda") -> list[tuple[Path, dict]]:
    """Every ``results_triton_*.json`` in ``folder`` written by this script (on ``device_type``; None: any)."""
    found = []
    for path in sorted(Path(folder).glob("results_triton_*.json")):
        try:
            results = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if results.get("schema") == SCHEMA and device_type in (None, results["recorded"]["device_type"]):
            found.append((path, results))
    return found


def summary(results: dict) -> str:
    """A Markdown table: per configuration, triton and the best SDPA (formulation, backend), ms, TFLOP/s, MiB."""
    lines = ["| d | causal | mode | N | triton ms | TFLOP/s | MiB | best SDPA | ms | TFLOP/s | MiB | speed-up |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    keyed: dict[tuple, dict[str, dict]] = {}
    for r in results["rows"]:
        g = keyed.setdefault((r["d"], r["causal"], r["mode"], r["n"]), {})
        if r["impl"] == "triton":
            g["triton"] = r
        if r["best_sdpa"]:
            g["best"] = r

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    for (d, causal, mode, n), g in keyed.items():
        t, b = g.get("triton", {}), g.get("best", {})
        best_name = f"{b['impl']}[{b['backend']}]" if b else "-"
        lines.append(f"| {d} | {causal} | {mode} | {n} | {f(t.get('ms'), '.3f')} | {f(t.get('tflops'), '.0f')} | "
                     f"{f(t.get('peak_extra_mib'), '.0f')} | {best_name} | {f(b.get('ms'), '.3f')} | "
                     f"{f(b.get('tflops'), '.0f')} | {f(b.get('peak_extra_mib'), '.0f')} | "
                     f"{f(t.get('speedup_vs_best_sdpa'), '.2f')} |")
    return "\n".join(lines)


def goals(results: dict, n: int = 8192) -> list[dict]:
    """Issue 13's goals checked against a results file: non-causal rows at ``n`` for d = 64 and 128."""
    out = []
    for d in (64, 128):
        rows = {r["mode"]: r for r in results["rows"]
                if r["impl"] == "triton" and r["d"] == d and r["n"] == n and not r["causal"]}
        fwd, fb = rows.get("fwd", {}), rows.get("fwd_bwd", {})
        out.append({"d": d,
                    "fwd_speedup_vs_best_sdpa": fwd.get("speedup_vs_best_sdpa"),
                    "fwd_tflops": fwd.get("tflops"),
                    "fwd_bwd_speedup_vs_best_sdpa": fb.get("speedup_vs_best_sdpa")})
        out[-1]["met"] = {k: (out[-1][k] is not None and out[-1][k] >= v) for k, v in GOALS.items()}
    return out


def build_parser() -> argparse.ArgumentParser:
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if cuda else "cpu")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                    help="default bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192], metavar="N")
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128], metavar="D", help="q/k head dim d")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per batch: B = tokens // N")
    ap.add_argument("--model-width", type=int, default=2048, help="2 H d: H = width / (2d) differential heads")
    ap.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    ap.add_argument("--modes", nargs="+", default=["fwd", "fwd_bwd"], choices=["fwd", "fwd_bwd"])
    ap.add_argument("--impls", type=lambda s: s.split(","), default=["triton", *SDPA_FORMULATIONS, "naive"],
                    help="comma-separated, from triton,sdpa_wide,sdpa_split,sdpa_stacked,naive")
    ap.add_argument("--backends", nargs="+", default=None, choices=list(SDPA_BACKENDS),
                    help="SDPA backends, each selected explicitly (default: flash cudnn efficient on CUDA, "
                         "default on a CPU)")
    ap.add_argument("--naive-max-n", type=int, default=4096, help="skip naive above this length (O(N^2) memory)")
    ap.add_argument("--reps", type=int, default=10, help="CPU: timed calls; CUDA: sets do_bench's rep >= 10x ms")
    ap.add_argument("--out", type=Path, default=None,
                    help="results file (default benchmarks/results_triton_<device>.json)")
    ap.add_argument("--no-record-argv", dest="record_argv", action="store_false", help=argparse.SUPPRESS)
    ap.add_argument("-q", "--quiet", action="store_true")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.backends = args.backends or (["flash", "cudnn", "efficient"] if args.device.startswith("cuda")
                                      else ["default"])
    known = ("triton", *SDPA_FORMULATIONS, "naive")
    bad = [i for i in args.impls if i not in known]
    if bad:
        raise SystemExit(f"unknown implementations {bad}; choose from {known}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for, but torch sees no CUDA GPU (use --device cpu with "
                         "TRITON_INTERPRET=1 for a smoke run)")
    progress = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    try:
        results = run(args, progress)
    except Exception:
        traceback.print_exc()
        return 1
    out = args.out or Path(__file__).resolve().parent / f"results_triton_{slug(results['recorded']['device'])}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    if not args.quiet:
        print(summary(results))
    print(f"wrote {len(results['rows'])} rows to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
