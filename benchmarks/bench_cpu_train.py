"""Training and inference on a CPU, side by side: the project's ``MultiheadDiffAttn`` against the layers people
would pick instead.

The layers, at the issue's sizes (width 512, 4 differential heads of q/k dim 64, value width 128, B=1, float32):

* ``ours``: :class:`diffattn_tutorial.layers.MultiheadDiffAttn` with ``backend="auto"`` (on a CPU with a C++
  compiler the fused kernel, forward and backward; ``describe_auto("cpu")`` says the rule);
* ``timm``: timm's ``DiffAttention`` on its fused path (two ``scaled_dot_product_attention`` calls);
* ``hf``: transformers' ``DiffLlamaAttention`` with ``attn_implementation="sdpa"`` (its rotary embedding included);
* with ``--own-threads``, also ``ours, own threads``: the same layer with the kernel starting threads of its own per
  call instead of running on torch's OpenMP pool (``cpu_fused.kernel_threads()``), what the pool buys;
* ``projections alone``: our layer's four projections (q, k, v, out) with nothing between them: the same matmuls
  in every implementation.

Cases: inference and inference causal (a forward under ``torch.no_grad()``), training step and training step
causal (forward and backward of the layer, parameters included). Each N runs ``rounds`` rounds; a round times
every layer once per case, so a burst of load from other programs hits all alike. The ratio is the peer's median
time over ours (a ratio of medians, the project's one definition; above 1: ours is faster). A peer that is not
importable is skipped, with the command that installs it.

The bound: for each case and peer, the time our attention (and everything else in the layer but the projections)
may take for a ratio of 1.5 (the peer's median / 1.5 - the projections' median), and the rate at which the attention
would have to run naive's arithmetic to fit in it; where that is above the matmul rate (below), 1.5x is out of reach
for an attention that does naive's arithmetic at a matmul's speed.

The kernel alone: its achieved GFLOP/s forward and backward at each N (FLOPs counted as
``measure.flops.formulation_flops("naive", ...)``: naive's arithmetic, the backward at the FlashAttention
convention of 2.5 times the forward), and where eager training keeps the forward's maps for the backward
(``cpu_fused.MAPS_KEPT_BYTES``) both again with the maps kept, next to this CPU's float32 matmul peak measured in
the same run (a 2048^3 ``torch.mm``). Memory: the peak extra memory of one training step of the attention call at N=2048, ``cpu_fused``
against ``sdpa_padded`` (:func:`diffattn_tutorial.measure.timing.peak_extra_memory`). Writes
``benchmarks/results_cpu_train_<cpu>.json``.

``--rule`` times instead what ``auto``'s head-dim rule for training rests on
(``backend_table.CPU_FUSED_TRAIN_MIN_HEAD_DIM``): a causal training step of the attention call alone on
``cpu_fused`` and on ``sdpa_padded``, at the course's small shapes (:data:`RULE_SHAPES`), rounds interleaved, and
writes ``benchmarks/results_cpu_train_rule_<cpu>.json``.

``--flags`` builds the kernel with other target flags in place of ``-march=native`` (``--flags=-march=x86-64-v3``: on
an x86-64 CPU with AVX-512, the build an AVX2 CPU runs); the results file's name then ends in the flags (``--rule``'s
too).

    python benchmarks/bench_cpu_train.py [--n 512 2048 4096] [--rounds 5] [--no-memory] [--own-threads] [--flags F]
    python benchmarks/bench_cpu_train.py --rule [--rounds 15]
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
from typing import Callable, Optional

import torch

from diffattn_tutorial import backends
from diffattn_tutorial.functional import diff_attention
from diffattn_tutorial.kernels.cpu import build, cpu_fused
from diffattn_tutorial.layers.attention import MultiheadDiffAttn
from diffattn_tutorial.measure import flops, timing

HERE = Path(__file__).resolve().parent
WIDTH, HEADS = 512, 4  # 4 differential heads: q/k dim 64, value width 128
CASES = ("inference", "inference causal", "training step", "training step causal")
OWN = "ours, own threads"
PROJ = "projections alone"
GOAL = 1.5  # the goal: every peer's time at least 1.5 times ours
INSTALL = {"timm": "pip install 'timm>=1.0.31'", "hf": "pip install 'transformers>=5.24'"}


def timm_layer() -> Optional[torch.nn.Module]:
    try:
        from timm.layers import DiffAttention
    except ImportError:
        return None
    layer = DiffAttention(WIDTH, num_heads=HEADS)
    assert layer.fused_attn, "timm's DiffAttention is not on its fused path (TIMM_FUSED_ATTN=0?)"
    return layer


def hf_layer() -> Optional[tuple]:
    try:
        from transformers import DiffLlamaConfig
        from transformers.models.diffllama.modeling_diffllama import DiffLlamaAttention, DiffLlamaRotaryEmbedding
    except ImportError:
        return None
    config = DiffLlamaConfig(hidden_size=WIDTH, num_attention_heads=2 * HEADS, num_key_value_heads=2 * HEADS,
                             attn_implementation="sdpa")
    return DiffLlamaAttention(config, layer_idx=0), DiffLlamaRotaryEmbedding(config)


def layers(own_threads: bool = False) -> dict[str, Callable[[torch.Tensor, bool], torch.Tensor]]:
    """Label -> ``run(x, causal)``, for the layers importable here (and ours on threads of its own)."""
    ours = MultiheadDiffAttn(WIDTH, HEADS)
    runs = {"ours": lambda x, causal: ours(x, causal=causal)}
    if own_threads:
        runs[OWN] = runs["ours"]  # timed under cpu_fused.own_threads(), forward and backward (layer_times)
    runs[PROJ] = lambda x, causal: ours.out_proj(ours.q_proj(x) + ours.k_proj(x) + ours.v_proj(x))
    timm = timm_layer()
    if timm is not None:
        runs["timm"] = lambda x, causal: timm(x, is_causal=causal)
    hf = hf_layer()
    if hf is not None:
        attn, rope = hf

        def run_hf(x, causal):
            cos_sin = rope(x, torch.arange(x.shape[1])[None])
            return attn(x, position_embeddings=cos_sin, attention_mask=None, is_causal=causal)[0]

        runs["hf"] = run_hf
    return runs


def one_case(run: Callable, x: torch.Tensor, case: str) -> float:
    causal = case.endswith("causal")
    t0 = time.perf_counter()
    if case.startswith("inference"):
        with torch.no_grad():
            run(x, causal)
    else:
        run(x.requires_grad_(), causal).backward(torch.ones(x.shape))
    return time.perf_counter() - t0


def layer_times(n: int, rounds: int, own_threads: bool = False) -> dict:
    """``{case: {layer: [seconds per round]}}`` at sequence length ``n``."""
    torch.manual_seed(0)
    runs = layers(own_threads)
    x = torch.randn(1, n, WIDTH)
    times = {case: {name: [] for name in runs} for case in CASES}
    for case in CASES:  # warm-up: first calls build, load and allocate
        for run in runs.values():
            one_case(run, x.detach(), case)
    for _ in range(rounds):
        for case in CASES:
            for name, run in runs.items():
                with cpu_fused.own_threads() if name == OWN else contextlib.nullcontext():
                    times[case][name].append(one_case(run, x.detach(), case))
    return times


def kernel_rates(n: int, rounds: int) -> dict:
    """The kernel alone (``cpu_fused_forward`` and ``cpu_fused_backward``: the maps computed again in the backward),
    non-causal; where eager training keeps the forward's maps for the backward (``cpu_fused.MAPS_KEPT_BYTES``) the
    same two calls with the maps kept (``forward, maps kept``, ``backward, maps kept``); and a 2048^3 float32
    ``torch.mm`` (this CPU's matmul peak) in the same rounds: median seconds and GFLOP/s (naive's arithmetic)."""
    q, k, v, lam = timing.make_inputs(1, HEADS, n, WIDTH // HEADS // 2)
    scale, grad_out = q.shape[-1] ** -0.5, torch.randn(1, HEADS, n, v.shape[-1])
    calls = {"forward": lambda: torch.ops.diffattn.cpu_fused_forward(q, k, v, lam, None, False, scale),
             "backward": lambda: torch.ops.diffattn.cpu_fused_backward(grad_out, q, k, v, lam, None, False, scale)}
    if cpu_fused.keeps_maps(q, k):  # else training recomputes them
        maps = torch.ops.diffattn.cpu_fused_forward(q, k, v, lam, None, False, scale, keep_maps=True)[1]
        calls["forward, maps kept"] = lambda: torch.ops.diffattn.cpu_fused_forward(q, k, v, lam, None, False, scale,
                                                                                   keep_maps=True)
        calls["backward, maps kept"] = lambda: torch.ops.diffattn.cpu_fused_backward(grad_out, q, k, v, lam, None,
                                                                                     False, scale, maps)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    calls["matmul"] = lambda: a @ b
    for fn in calls.values():
        fn()
    ts = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            ts[name].append(time.perf_counter() - t0)
    d = q.shape[-1]
    fwd, bwd = (flops.formulation_flops("naive", 1, HEADS, n, d, pass_=p) for p in ("fwd", "bwd"))
    count = {"forward": fwd, "backward": bwd, "forward, maps kept": fwd, "backward, maps kept": bwd,
             "matmul": 2 * 2048 ** 3}
    return {name: {"median_s": statistics.median(t), "gflop_per_s": count[name] / statistics.median(t) / 1e9}
            for name, t in ts.items()}


def train_step(q, k, v, lam, causal=False, backend="auto"):
    """One training step of the attention call: forward, and the gradients of q, k, v."""
    with torch.enable_grad():
        ins = [t.detach().requires_grad_() for t in (q, k, v)]
        out = diff_attention(*ins, lam, causal=causal, backend=backend)
        torch.autograd.grad(out, ins, torch.ones_like(out))
    return out.detach()


RULE_SHAPES = [(32, 2, 103, 16), (8, 2, 32, 16), (8, 2, 64, 16), (8, 2, 128, 16), (4, 4, 128, 16), (8, 2, 64, 32),
               (4, 4, 128, 32), (1, 4, 512, 64)]
"""``(B, H, N, d)`` for ``--rule``: the toy DIFF model's attention call (notebook 07: batch 32, 2 differential heads of
q/k width 16, its longest sequences of 103 tokens), d = 16 and 32 at the sizes the rule was first measured at, and
the issue's layer (d = 64)."""


def head_dim_rule(rounds: int) -> list[dict]:
    """Per shape of :data:`RULE_SHAPES`: median seconds of a causal training step of the attention call on
    ``cpu_fused`` and ``sdpa_padded`` (rounds interleaved), and their ratio (above 1: the kernel is faster)."""
    rows = []
    for B, H, n, d in RULE_SHAPES:
        q, k, v, lam = timing.make_inputs(B, H, n, d)
        steps = {name: functools.partial(train_step, q, k, v, lam, True, name) for name in ("cpu_fused", "sdpa_padded")}
        ts = {name: [] for name in steps}
        for step in steps.values():
            step()
        for _ in range(rounds):
            for name, step in steps.items():
                t0 = time.perf_counter()
                step()
                ts[name].append(time.perf_counter() - t0)
        rows.append({"B": B, "H": H, "N": n, "d": d, "times_s": ts,
                     "sdpa_padded_over_cpu_fused": statistics.median(ts["sdpa_padded"]) / statistics.median(ts["cpu_fused"])})
    return rows


def rule_table(rows: list[dict]) -> str:
    lines = ["| B | H | N | d | cpu_fused ms | sdpa_padded ms | sdpa_padded / cpu_fused |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['B']} | {r['H']} | {r['N']} | {r['d']} | {statistics.median(r['times_s']['cpu_fused']) * 1e3:.2f} "
                     f"| {statistics.median(r['times_s']['sdpa_padded']) * 1e3:.2f} | {r['sdpa_padded_over_cpu_fused']:.2f}x |")
    return "\n".join(lines)


def memory(n: int) -> dict:
    fns = {name: functools.partial(train_step, backend=name) for name in ("cpu_fused", "sdpa_padded")}
    return timing.peak_extra_memory(fns, b=1, h=HEADS, n=n, d=WIDTH // HEADS // 2, include_output=True)


def ratios(times: dict) -> dict:
    """``{case: {peer: peer median / our median}}``."""
    return {case: {name: statistics.median(ts) / statistics.median(by_layer["ours"])
                   for name, ts in by_layer.items() if name not in ("ours", PROJ)}
            for case, by_layer in times.items()}


def attention_flops(n: int, case: str) -> float:
    """Naive's arithmetic for the case's attention call: the forward, and for a training step the backward at 2.5
    times it; half of it causal."""
    fwd = flops.formulation_flops("naive", 1, HEADS, n, WIDTH // HEADS // 2, pass_="fwd")
    return fwd * (1 if case.startswith("inference") else 3.5) / (2 if case.endswith("causal") else 1)


def bounds(n: int, times: dict) -> dict:
    """``{case: {peer: {"budget_s", "needed_gflop_per_s"}}}``: the time left for our attention (and the rest of the
    layer but its projections) at a ratio of :data:`GOAL`, and the rate it would need (None: no time left)."""
    out = {}
    for case, by_layer in times.items():
        proj = statistics.median(by_layer[PROJ])
        out[case] = {}
        for peer in (p for p in by_layer if p not in ("ours", OWN, PROJ)):
            budget = statistics.median(by_layer[peer]) / GOAL - proj
            out[case][peer] = {"budget_s": budget, "needed_gflop_per_s":
                               attention_flops(n, case) / budget / 1e9 if budget > 0 else None}
    return out


def table(results: dict) -> str:
    peers = sorted({p for r in results.values() for case in r["ratio"].values() for p in case})
    head = "| N | case | ours ms | " + " | ".join(f"{p} ms | vs {p}" for p in peers) + " |"
    lines = [head, "|" + "---|" * (3 + 2 * len(peers))]
    for n, r in results.items():
        for case, by_layer in r["times_s"].items():
            cells = [f"{statistics.median(by_layer[p]) * 1e3:.0f} | {r['ratio'][case][p]:.2f}x" for p in peers]
            lines.append(f"| {n} | {case} | {statistics.median(by_layer['ours']) * 1e3:.0f} | " + " | ".join(cells)
                         + " |")
    return "\n".join(lines)


def bound_table(results: dict) -> str:
    peers = sorted({p for r in results.values() for case in r["bound"].values() for p in case})
    lines = ["| N | case | projections alone ms | " + " | ".join(
        f"attention budget vs {p} ms | GFLOP/s needed" for p in peers) + " | matmul GFLOP/s |",
        "|" + "---|" * (4 + 2 * len(peers))]
    for n, r in results.items():
        for case, by_peer in r["bound"].items():
            cells = []
            for p in peers:
                b = by_peer[p]
                rate = "none left" if b["needed_gflop_per_s"] is None else f"{b['needed_gflop_per_s']:.0f}"
                cells.append(f"{b['budget_s'] * 1e3:.1f} | {rate}")
            lines.append(f"| {n} | {case} | {statistics.median(r['times_s'][case][PROJ]) * 1e3:.1f} | "
                         + " | ".join(cells) + f" | {r['kernel']['matmul']['gflop_per_s']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[512, 2048, 4096])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    ap.add_argument("--own-threads", action="store_true", help="also time our layer with the kernel on threads of "
                                                               "its own (not torch's OpenMP pool)")
    ap.add_argument("--rule", action="store_true", help="time auto's head-dim rule for training instead (RULE_SHAPES)")
    ap.add_argument("--flags", default=None, help="kernel target flags in place of -march=native")
    ap.add_argument("--out", type=Path, default=None, help="results file (default "
                                                           "benchmarks/results_cpu_train[_rule]_<cpu>.json)")
    args = ap.parse_args(argv)
    if args.flags is not None:
        build.NATIVE_FLAGS = tuple(args.flags.split())  # before the kernel's first use: its build and cache key
    device = timing.device_name("cpu")
    command = "python benchmarks/bench_cpu_train.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.rule:
        return _rule(args, device, command.strip())
    missing = [f"{name}: {INSTALL[name]}" for name, layer in (("timm", timm_layer), ("hf", hf_layer))
               if layer() is None]
    for line in missing:
        print(f"skipped (not importable), install with {line}")
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    results = {}
    for n in args.n:
        times = layer_times(n, args.rounds, args.own_threads)
        results[n] = {"times_s": times, "ratio": ratios(times), "bound": bounds(n, times),
                      "kernel": kernel_rates(n, args.rounds)}
    mem = None if args.no_memory else memory(2048)
    kernel = {"flags": list(build.NATIVE_FLAGS), "vector_floats": cpu_fused.vector_floats(),
              "compiler": build.compiler_version()}
    cpu = timing.cpu_identity()
    print(f"{device} ({', '.join(f'{k} {v}' for k, v in cpu.items())}), torch {torch.__version__}, width {WIDTH}, {HEADS} differential heads, B=1, float32, "
          f"{args.rounds} rounds, load average before {load}; kernel built with {' '.join(kernel['flags'])} "
          f"({kernel['vector_floats']}-float vectors)")
    print(backends.describe_auto("cpu"))
    print(table(results))
    print(f"What a ratio of {GOAL} leaves our attention (peer / {GOAL} - our projections), and the rate it would need:")
    print(bound_table(results))
    for n, r in results.items():
        k = r["kernel"]
        kept = "" if "forward, maps kept" not in k else (
            f"; with the maps kept: forward {k['forward, maps kept']['gflop_per_s']:.0f}, backward "
            f"{k['backward, maps kept']['gflop_per_s']:.0f}")
        print(f"N={n}: kernel forward {k['forward']['gflop_per_s']:.0f} GFLOP/s, backward "
              f"{k['backward']['gflop_per_s']:.0f} GFLOP/s{kept}; float32 matmul in the same rounds "
              f"{k['matmul']['gflop_per_s']:.0f} GFLOP/s")
    if mem is not None:
        print("training step peak extra MiB at N=2048: " + ", ".join(
            f"{name} {b / 2**20:.1f}" for name, b in mem.items() if b is not None))
    flags = "" if args.flags is None else "_" + timing.slug(args.flags)
    out = args.out or HERE / f"results_cpu_train_{timing.slug(device)}{flags}.json"
    versions = {"timm": _version("timm"), "transformers": _version("transformers")}
    out.write_text(json.dumps({"device": device, "cpu": cpu, "torch": torch.__version__, "python": platform.python_version(),
                               "peers": versions, "date": datetime.date.today().isoformat(),
                               "command": command.strip(), "load_average_before": load,
                               "auto_rule": backends.describe_auto("cpu"),
                               "kernel_threads": cpu_fused.kernel_threads(), "kernel": kernel,
                               "results": results, "train_step_peak_extra_bytes_n2048": mem}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


def _rule(args: argparse.Namespace, device: str, command: str) -> int:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    rows = head_dim_rule(args.rounds)
    print(f"{device}, torch {torch.__version__}, {torch.get_num_threads()} threads, float32, causal training step of "
          f"the attention call, {args.rounds} rounds, load average before {load}")
    print(backends.describe_auto("cpu"))
    print(rule_table(rows))
    flags = "" if args.flags is None else "_" + timing.slug(args.flags)  # another build's: not the native record
    out = args.out or HERE / f"results_cpu_train_rule_{timing.slug(device)}{flags}.json"
    kernel = {"flags": list(build.NATIVE_FLAGS), "vector_floats": cpu_fused.vector_floats(),
              "compiler": build.compiler_version()}
    out.write_text(json.dumps({"device": device, "cpu": timing.cpu_identity(), "torch": torch.__version__,
                               "python": platform.python_version(),
                               "date": datetime.date.today().isoformat(), "command": command,
                               "threads": torch.get_num_threads(), "load_average_before": load,
                               "auto_rule": backends.describe_auto("cpu"), "kernel": kernel, "rows": rows},
                              indent=1) + "\n")
    print(f"wrote {out}")
    return 0


def _version(module: str) -> Optional[str]:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


if __name__ == "__main__":
    sys.exit(main())
