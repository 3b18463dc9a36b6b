"""Where the Triton kernel's forward loses its time on a GPU: the ceilings, and the forward per plan and tile shape.

The recorded GPU sessions ran the kernel slower than the best SDPA formulation (cuDNN's; the README's generated
GPU block gives the ratios), and left open why. This probe measures, in one run (the ``probe`` step of ``benchmarks/gpu_session.py``):

1. **the two ceilings** (METHOD: a large device-to-device copy, bytes read plus written; a large bf16 matrix
   product on random data);
2. **the forward per candidate**: each ``(head dim, plan, BLOCK_M, BLOCK_N, warps, stages)`` of :data:`CANDIDATES`
   pinned for the forward launch (the backward keeps its tables' pinned entries), at the benchmark's shapes
   (N = 8192, 16384 tokens per batch, model width 2048, bf16, non-causal): median ms, TFLOP/s (``12 B H N^2 d``)
   and the error against the library's own choice (its plan, autotuned), so a faster shape that is wrong cannot pass;
3. **the hardware counters** of the pinned forward at d = 64 and 128 where Nsight Compute (``ncu``) runs
   (``--clock-control none``: the clocks as found), its speed-of-light, warp-state and compute sections.

The candidates are the tables' own entries and shapes beside them (wider key tiles, the one-map ``split`` plan at
d = 64); a shape that does not compile or spills shows as such. Writes JSON (``--out``); ``gpu_session --collect``
puts it into ``gpu_session_<device>.json``.

    python benchmarks/probe_triton.py --out probe_triton.json          # on a CUDA GPU
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import glob
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

N = 8192
CANDIDATES: list[tuple[int, str, tuple]] = [  # (d, plan, (BLOCK_M, BLOCK_N, warps, stages[, tma]))
    *[(64, "split_kv", c) for c in ((64, 64, 4, 3), (64, 64, 4, 3, True), (128, 32, 8, 3), (128, 32, 8, 3, True),
                                    (128, 32, 8, 4), (64, 32, 4, 3), (128, 64, 8, 2))],
    *[(64, "split", c) for c in ((128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 8, 3))],
    *[(128, "split", c) for c in ((128, 64, 8, 2), (128, 64, 8, 2, True), (128, 128, 8, 2), (128, 128, 8, 2, True),
                                  (128, 32, 8, 3), (128, 32, 8, 2), (64, 64, 4, 3))],
]
"""The forward shapes timed: the library's table entries (the first of each head dim is the pinned one; a fifth
``True``: the TMA twin, k and v tiles by tensor descriptor, ``configs.TMA_TWINS``), each TMA twin right after its
pointer entry, and neighbours the tables do not use."""
NCU_SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "WarpStateStats", "Occupancy", "LaunchStats")


def ceilings() -> dict:
    """Device-to-device copy GB/s (bytes read + written) and a bf16 8192^3 product's TFLOP/s, random data."""
    from triton.testing import do_bench

    x = torch.randn(2**28, device="cuda", dtype=torch.bfloat16)  # 512 MiB
    y = torch.empty_like(x)
    copy_ms = do_bench(lambda: y.copy_(x), return_mode="median")
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mm_ms = do_bench(lambda: a @ b, return_mode="median")
    return {"copy_gb_per_s": 2 * x.numel() * 2 / copy_ms / 1e6, "matmul_bf16_tflops": 2 * 8192**3 / mm_ms / 1e9}


@contextlib.contextmanager
def forward_config(config: tuple):
    """The forward launch pinned to ``config`` (``(BLOCK_M, BLOCK_N, warps, stages[, tma])``); every other launch
    to its table's first entry."""
    from diffattn_tutorial.kernels.triton import flash_diff
    from diffattn_tutorial.kernels.triton.configs import AUTOTUNE_ENV, autotune_configs
    from diffattn_tutorial.kernels.triton.configs import config as cfg

    def pinned(name, consts, dtype, capability=90, tma=False):
        if name == "_diff_attn_fwd":
            return [cfg(*config[:4], tma=bool(config[4:5] and config[4]))]
        return autotune_configs(name, consts, dtype, capability)  # pointer loads: the tables' first entries

    old_env, old_fn = os.environ.get(AUTOTUNE_ENV), flash_diff.autotune_configs
    os.environ[AUTOTUNE_ENV], flash_diff.autotune_configs = "0", pinned
    try:
        yield
    finally:
        flash_diff.autotune_configs = old_fn
        if old_env is None:
            os.environ.pop(AUTOTUNE_ENV)
        else:
            os.environ[AUTOTUNE_ENV] = old_env


def inputs(d: int, n: int = N, device: str = "cuda", shape: Optional[tuple[int, int]] = None):
    """bf16 inputs at the benchmark's shapes (``shape``: ``(B, H)`` instead, for a check on small ones)."""
    from diffattn_tutorial.measure import gpu
    from diffattn_tutorial.measure.timing import make_inputs

    b, h = shape or gpu.shape_for(n, d)
    return make_inputs(b, h, n, d, dtype=torch.bfloat16, device=device)


def time_candidates(candidates: Sequence = CANDIDATES, n: int = N, device: str = "cuda",
                    shape: Optional[tuple[int, int]] = None, bench=None,
                    on_row: Optional[Callable[[dict], None]] = None) -> list[dict]:
    """One row per candidate: its forward's median ms (``bench``, default ``triton.testing.do_bench``), TFLOP/s
    and norm-relative error against the library's own choice (its plan, autotuned) on the same inputs. ``on_row``
    is called with each row as it is made (the probe writes its file after each: a killed run keeps its rows)."""
    from diffattn_tutorial.kernels.triton.flash_diff import triton_diff_attention
    from diffattn_tutorial.measure import flops

    if bench is None:
        from triton.testing import do_bench as bench
    rows, reference = [], {}
    for d, plan, config in candidates:
        q, k, v, lam = inputs(d, n, device, shape)
        b, h = q.shape[0], q.shape[1] // 2
        row = {"d": d, "plan": plan, "block_m": config[0], "block_n": config[1], "warps": config[2],
               "stages": config[3], "tma": bool(config[4:5] and config[4]), "batch": b, "heads": h, "n": n}
        try:
            with torch.inference_mode():
                if d not in reference:
                    reference[d] = triton_diff_attention(q, k, v, lam).float()  # the library's own choice
                with forward_config(config):
                    out = triton_diff_attention(q, k, v, lam, plan=plan)
                    ms = bench(lambda: triton_diff_attention(q, k, v, lam, plan=plan), return_mode="median")
            err = ((out.float() - reference[d]).norm() / reference[d].norm()).item()
            row.update(status="ok", ms=ms, rel_err_vs_default=err,
                       tflops=flops.diff_v1_attention_flops(b, h, n, d) / ms / 1e9)
        except Exception as e:  # noqa: BLE001 - a shape that fails to compile or run is a result
            row.update(status=f"failed: {type(e).__name__}: {str(e).strip()[:300]}")
        print(json.dumps(row), flush=True)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def _ncu() -> Optional[str]:
    found = shutil.which("ncu") or sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))
    return found if isinstance(found, str) else (found[-1] if found else None)


def forward_launches(d: int, capability: int) -> int:
    """Forward launches per call at head dim ``d`` under the library's plan: 2 where the plan splits the maps
    (``split``: map 2, then map 1), else 1."""
    import triton

    from diffattn_tutorial.kernels.triton.configs import plan_for

    return len(plan_for(max(16, triton.next_power_of_2(d)), capability).fwd_maps)


def ncu_profile(d: int, timeout: int = 180, capability: Optional[int] = None) -> dict:
    """Nsight Compute's sections for the pinned forward at head dim ``d``: every forward launch of the third call
    (two warm-up calls first; a split plan launches the forward twice per call, so both of that call's are
    profiled, not the second call's first)."""
    ncu = _ncu()
    if ncu is None:
        return {"status": "ncu not found"}
    if capability is None:
        major, minor = torch.cuda.get_device_capability()
        capability = 10 * major + minor
    per_call = forward_launches(d, capability)
    cmd = [ncu, "--clock-control", "none", "--kernel-name", "regex:_diff_attn_fwd", "--launch-skip",
           str(2 * per_call), "--launch-count", str(per_call), *[a for s in NCU_SECTIONS for a in ("--section", s)],
           "--csv", "--page", "details", sys.executable, str(Path(__file__).resolve()), "--one", str(d)]
    env = dict(os.environ, DIFFATTN_TRITON_AUTOTUNE="0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired:
        return {"status": f"timed out after {timeout} s"}
    lines = [line for line in run.stdout.splitlines() if line.startswith('"')]
    metrics = [{"id": r.get("ID"), "kernel": r.get("Kernel Name", "")[:60], "section": r.get("Section Name"),
                "metric": r.get("Metric Name"), "unit": r.get("Metric Unit"), "value": r.get("Metric Value")}
               for r in csv.DictReader(io.StringIO("\n".join(lines)))]
    return {"status": "ok" if run.returncode == 0 and metrics else f"exit {run.returncode}",
            "command": " ".join(cmd[:-3] + ["probe_triton.py", "--one", str(d)]), "metrics": metrics,
            "stderr_tail": run.stderr[-1500:]}


def one(d: int) -> None:
    """Three forwards with the pinned configurations (what ``ncu`` profiles)."""
    from diffattn_tutorial.kernels.triton.flash_diff import triton_diff_attention

    q, k, v, lam = inputs(d)
    with torch.inference_mode():
        for _ in range(3):
            triton_diff_attention(q, k, v, lam)
    torch.cuda.synchronize()


def table(rows: list[dict]) -> str:
    lines = ["| d | plan | BLOCK_M x BLOCK_N | warps | stages | loads | ms | TFLOP/s | error vs default |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = (f"| {r['d']} | {r['plan']} | {r['block_m']} x {r['block_n']} | {r['warps']} | {r['stages']} | "
                f"{'TMA' if r.get('tma') else 'pointers'} | ")
        if r["status"] == "ok":
            lines.append(head + f"{r['ms']:.3f} | {r['tflops']:.0f} | {r['rel_err_vs_default']:.1e} |")
        else:
            lines.append(head + f"{r['status'][:60]} | | |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="results JSON (default: print only)")
    ap.add_argument("--one", type=int, default=None, metavar="D", help=argparse.SUPPRESS)  # what ncu runs
    ap.add_argument("--no-ncu", action="store_true", help="skip the hardware counters")
    args = ap.parse_args(argv)
    if args.one is not None:
        one(args.one)
        return 0
    if not torch.cuda.is_available():
        print("no CUDA GPU here: the probe measures a GPU (run it in a GPU session)", file=sys.stderr)
        return 2
    from diffattn_tutorial.measure import gpu

    t0 = time.perf_counter()

    def save() -> None:  # after every stage and row: a run killed at its step's time limit keeps what it measured
        result["seconds"] = round(time.perf_counter() - t0, 1)
        if args.out:  # whole or not at all: a kill while writing leaves the last whole file
            part = gpu.write_json(args.out.with_name(args.out.name + ".part"), result)
            os.replace(part, args.out)

    result = {"recorded": gpu.results_header("cuda", "benchmarks/probe_triton.py", argv if argv is not None
                                             else sys.argv[1:]), "complete": False, "forward": [], "ncu": {}}
    result["ceilings"] = ceilings()
    save()
    print(json.dumps(result["ceilings"]), flush=True)
    time_candidates(on_row=lambda row: (result["forward"].append(row), save()))
    for d in () if args.no_ncu else (64, 128):
        result["ncu"][f"d{d}"] = ncu_profile(d)
        save()
    result["complete"] = True
    save()
    c = result["ceilings"]
    print(f"copy {c['copy_gb_per_s']:.0f} GB/s, bf16 matmul {c['matmul_bf16_tflops']:.0f} TFLOP/s")
    print(table(result["forward"]))
    for name, prof in result["ncu"].items():
        print(f"ncu {name}: {prof['status']}, {len(prof.get('metrics', []))} metrics")
    return 0


if __name__ == "__main__":
    sys.exit(main())
