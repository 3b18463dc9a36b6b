"""Which CPU backend is fastest for few query rows (decoding), side by side in one run.

For a key count ``Nk`` (a KV cache) and query counts ``Nq`` from 1 (one new token) up, times ``naive``,
``sdpa_padded`` and ``cpu_fused`` on the same float32 inputs (B=1, H=8 differential heads, d=64, no mask,
inference), ``--rounds`` rounds each timing every candidate once in turn; reports the median milliseconds and
which is fastest, next to what ``backend="auto"`` runs for that call. The SDPA forms pad q and k on every call;
the fused kernel takes calls of at most 512 query rows without transposing K, one dot product per score.

``--flags`` builds the kernel with other target flags in place of ``-march=native``: ``--flags=-march=x86-64-v3``
gives on an x86-64 CPU with AVX-512 the build an AVX2 CPU runs (8-float vectors and their tiles).

    python benchmarks/bench_cpu_queries.py [--keys 512 4096] [--queries 1 4 16 64 256] [--rounds 7] [--threads 1]
    python benchmarks/bench_cpu_queries.py --flags=-march=x86-64-v3

Writes ``benchmarks/results_cpu_queries_<cpu>.json`` (the CPU name says the thread count; with ``--flags``, the flags
are added to the name).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from diffattn_tutorial.backends import Needs, resolve
from diffattn_tutorial.functional import diff_attention
from diffattn_tutorial.kernels.cpu import build, cpu_fused
from diffattn_tutorial.measure.gpu import results_header, write_json
from diffattn_tutorial.measure.timing import cpu_identity, slug

HERE = Path(__file__).resolve().parent
CANDIDATES = ("naive", "sdpa_padded", "cpu_fused")
H, D = 8, 64


def inputs(nq: int, nk: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2 * H, nq, D, generator=g)
    k = torch.randn(1, 2 * H, nk, D, generator=g)
    v = torch.randn(1, H, nk, 2 * D, generator=g)
    return q, k, v


def one_round(cases: dict, times: dict) -> None:
    for key, (q, k, v) in cases.items():
        for name in CANDIDATES:
            t0 = time.perf_counter()
            diff_attention(q, k, v, 0.5, backend=name)
            times[key][name].append(time.perf_counter() - t0)


def run(keys: list[int], queries: list[int], rounds: int) -> list[dict]:
    cases = {(nk, nq): inputs(nq, nk) for nk in keys for nq in queries}
    times = {key: {name: [] for name in CANDIDATES} for key in cases}
    with torch.inference_mode():
        one_round(cases, {key: {name: [] for name in CANDIDATES} for key in cases})  # warm-up (and the build)
        for _ in range(rounds):
            one_round(cases, times)
    rows = []
    for (nk, nq), per in times.items():
        ms = {name: 1e3 * statistics.median(t) for name, t in per.items()}
        rows.append({"keys": nk, "queries": nq, "ms": {n: round(m, 4) for n, m in ms.items()},
                     "fastest": min(ms, key=ms.get), "auto": resolve("auto", "cpu", Needs(torch.float32, queries=nq, head_dim=D))})
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'Nk':>6} {'Nq':>5} " + " ".join(f"{n:>12}" for n in CANDIDATES) + "   fastest      auto"]
    for r in rows:
        lines.append(f"{r['keys']:>6} {r['queries']:>5} " + " ".join(f"{r['ms'][n]:>9.3f} ms" for n in CANDIDATES)
                     + f"   {r['fastest']:<12} {r['auto']}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--queries", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128, 256])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--flags", default=None, help="kernel target flags in place of -march=native")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.flags is not None:
        build.NATIVE_FLAGS = tuple(args.flags.split())  # before the kernel's first use: its build and cache key
    header = results_header("cpu", "benchmarks/bench_cpu_queries.py", argv if argv is not None else sys.argv[1:])
    header["cpu"] = cpu_identity()  # the processor, which the device string does not name
    rows = run(args.keys, args.queries, args.rounds)
    kernel = {"flags": list(build.NATIVE_FLAGS), "vector_floats": cpu_fused.vector_floats()}
    print(f"{header['device']}, {args.threads} thread(s), torch {header['torch']}, B=1 H={H} d={D} float32, "
          f"{args.rounds} rounds (median); kernel built with {' '.join(kernel['flags'])} "
          f"({kernel['vector_floats']}-float vectors)")
    print(table(rows))
    name = slug(header["device"]) + ("" if args.flags is None else "_" + slug(args.flags))
    out = args.out or HERE / f"results_cpu_queries_{name}.json"
    write_json(out, {**header, "threads": args.threads, "kernel": kernel, "rows": rows})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
