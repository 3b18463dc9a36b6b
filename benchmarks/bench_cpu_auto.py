"""Which exact formulation should ``diff_attention(backend="auto")`` run on a CPU? Every candidate side by side.

At B=1, H=8, N=2048, d=64, float32 (the sizes of issue 15's goal: ``auto`` at least 3x faster than ``naive``
with at most 0.1x its peak extra memory), in inference mode, on this machine's CPU with torch's own thread
count. Candidates:

* ``naive``: explicit maps, the reference and the denominator.
* ``sdpa_split``: four SDPA calls with V split in halves (equal head dims reach the fused CPU flash kernel).
* ``sdpa_stacked``: the same four products stacked into one SDPA call over 4H heads.
* ``sdpa_wide``: two SDPA calls with V of width 2d (unequal head dims: the unfused math path).
* ``sdpa_padded``: two SDPA calls with q and k zero-padded to width 2d (``q.k`` is unchanged, every head dim
  is 2d, so both calls reach the fused kernel), the second half subtracted in place.
* ``padded_one_call``: one SDPA call over the 2H maps, q/k padded, V repeated per map.
* ``shared_keys_one_call``: one SDPA call, q padded on complementary sides so both maps share one key head
  ``[k1 | k2]`` per KV group, V as it is (GQA).
* ``split_into_one``: ``sdpa_split`` writing its four products into one preallocated output.
* ``chunked``: explicit maps over query chunks.
* ``cpu_fused``: the fused C++ kernel (``diffattn_tutorial.kernels.cpu.cpu_fused``): naive's arithmetic, one pass per block
  of query rows, the maps kept in cache.
* ``auto``: what ``diff_attention`` runs by default here (``cpu_fused`` where it builds, else ``sdpa_padded``).

Time: ``rounds`` rounds, each timing every candidate once (so a burst of load from other programs hits all of
them alike); the table shows each candidate's median time, its speed-up (naive's median time over its median
time, the project's one definition) and the spread (min-max) of the per-round ratios.
Memory: :func:`diffattn_tutorial.measure.timing.peak_extra_memory`, the growth of the resident-set high-water mark
of a fresh process, output included. Writes ``benchmarks/results_cpu_auto_<cpu>.json``.

    python benchmarks/bench_cpu_auto.py [--n 2048] [--rounds 7] [--causal] [--load]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from diffattn_tutorial.functional import diff_attention
from diffattn_tutorial.measure import cpu_threads, timing

HERE = Path(__file__).resolve().parent


def padded_one_call(q, k, v, lam, causal=False):
    """One SDPA call over the 2H maps: q/k zero-padded to 2d, V repeated so map j of head i reads its group."""
    d, H, Hkv = q.shape[-1], q.shape[1] // 2, v.shape[1]
    rep = H // Hkv
    qp = F.pad(q, (0, d)).unflatten(1, (Hkv, rep, 2)).transpose(2, 3).flatten(1, 3)  # (B, 2H), map-major per group
    kp = F.pad(k, (0, d))  # (B, 2Hkv, N, 2d): key head 2g + j
    o = F.scaled_dot_product_attention(qp, kp, v.repeat_interleave(2, dim=1), is_causal=causal, scale=d ** -0.5,
                                       enable_gqa=rep > 1)
    o = o.unflatten(1, (Hkv, 2, rep)).transpose(2, 3).flatten(1, 2)  # (B, H, 2, N, 2d)
    return o[:, :, 0] - lam * o[:, :, 1]


def shared_keys_one_call(q, k, v, lam, causal=False):
    """One SDPA call, keys shared by both maps: ``[q1 | 0] . [k1 | k2] = q1 . k1`` and ``[0 | q2] . [k1 | k2] =
    q2 . k2``, so each KV group holds one key head ``[k1 | k2]`` of width 2d and V stays as it is (GQA)."""
    d, H, Hkv = q.shape[-1], q.shape[1] // 2, v.shape[1]
    rep = H // Hkv
    q1, q2 = F.pad(q[:, 0::2], (0, d)), F.pad(q[:, 1::2], (d, 0))  # (B, H, N, 2d) each
    qs = torch.stack([q1, q2], dim=2).unflatten(1, (Hkv, rep)).flatten(1, 3)  # (B, Hkv * rep * 2, N, 2d)
    ks = torch.cat([k[:, 0::2], k[:, 1::2]], dim=-1)  # (B, Hkv, N, 2d)
    o = F.scaled_dot_product_attention(qs, ks, v, is_causal=causal, scale=d ** -0.5, enable_gqa=True)
    o = o.unflatten(1, (H, 2))  # (B, H, 2, N, 2d)
    return o[:, :, 0] - lam * o[:, :, 1]


def split_into_one(q, k, v, lam, causal=False):
    """``sdpa_split``'s four calls written into one preallocated ``(B, H, N, 2d)`` output."""
    d = q.shape[-1]

    def sdpa(q_, k_, v_):
        return F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal, scale=d ** -0.5,
                                              enable_gqa=q_.shape[1] != k_.shape[1])

    va, vb = v.chunk(2, dim=-1)
    out = q.new_empty(q.shape[0], q.shape[1] // 2, q.shape[2], 2 * d)
    for half, vh in ((slice(0, d), va), (slice(d, 2 * d), vb)):
        out[..., half] = sdpa(q[:, 0::2], k[:, 0::2], vh)
        out[..., half].sub_(lam * sdpa(q[:, 1::2], k[:, 1::2], vh))
    return out


def candidates() -> dict:
    """Label -> ``fn(q, k, v, lam, causal=...)``."""
    library = {name: functools.partial(diff_attention, backend=name)
               for name in ("naive", "sdpa_split", "sdpa_stacked", "sdpa_wide", "sdpa_padded", "chunked", "cpu_fused",
                            "auto")}
    return {**library, "padded_one_call": padded_one_call, "shared_keys_one_call": shared_keys_one_call,
            "split_into_one": split_into_one}


def measure(n: int, rounds: int, causal: bool) -> dict:
    """Times (every round) and peak memory of every candidate; errors against naive."""
    fns = candidates()
    q, k, v, lam = timing.make_inputs(1, 8, n, 64)
    times: dict[str, list[float]] = {name: [] for name in fns}
    with torch.no_grad():
        ref = fns["naive"](q, k, v, lam, causal=causal)
        err = {name: (f(q, k, v, lam, causal=causal) - ref).abs().max().item() for name, f in fns.items()}
        for _ in range(rounds):
            for name, f in fns.items():
                t0 = time.perf_counter()
                f(q, k, v, lam, causal=causal)
                times[name].append(time.perf_counter() - t0)
    mem = timing.peak_extra_memory(fns, b=1, h=8, n=n, d=64, causal=causal, include_output=True)
    return {"times_s": times, "peak_extra_bytes": mem, "max_abs_err": err}


def table(result: dict) -> str:
    """Markdown table: median ms, speed-up vs naive (ratio of the medians; min-max of the per-round ratios),
    memory vs naive."""
    times, mem = result["times_s"], result["peak_extra_bytes"]
    lines = ["| candidate | median ms | speed-up vs naive | spread over rounds | peak extra MiB | memory vs naive "
             "| max abs err |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, ts in times.items():
        ratios = [a / b for a, b in zip(times["naive"], ts)]
        m = mem[name]
        mib = "n/a" if m is None else f"{m / 2**20:.1f}"
        rel = "n/a" if m is None or not mem["naive"] else f"{m / mem['naive']:.3f}"
        speedup = statistics.median(times["naive"]) / statistics.median(ts)
        lines.append(f"| {name} | {statistics.median(ts) * 1e3:.0f} | {speedup:.2f}x "
                     f"| {min(ratios):.2f}-{max(ratios):.2f}x | {mib} | {rel} | {result['max_abs_err'][name]:.1e} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--load", action="store_true",
                    help="time with one other CPU-bound process running (memory is unaffected)")
    ap.add_argument("--out", type=Path, default=None,
                    help="results file (default benchmarks/results_cpu_auto_<cpu>[_loaded].json)")
    args = ap.parse_args(argv)
    device = timing.device_name("cpu")
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    with cpu_threads.cpu_load() if args.load else contextlib.nullcontext():
        result = measure(args.n, args.rounds, args.causal)
    ours = ", one CPU-bound process of ours running" if args.load else ""
    print(f"{device}, torch {torch.__version__}, B=1 H=8 N={args.n} d=64 float32, causal={args.causal}, "
          f"{args.rounds} rounds, load average before {load}{ours}")
    print(table(result))
    out = args.out or HERE / f"results_cpu_auto_{timing.slug(device)}{'_loaded' if args.load else ''}.json"
    command = "python benchmarks/bench_cpu_auto.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out.write_text(json.dumps({"device": device, "cpu": timing.cpu_identity(), "torch": torch.__version__,
                               "python": platform.python_version(),
                               "date": datetime.date.today().isoformat(), "command": command.strip(),
                               "n": args.n, "causal": args.causal,
                               "load_average_before": load, "own_load_process": args.load, **result}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
