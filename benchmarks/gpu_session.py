"""Everything the GPU half needs from a GPU, in steps that each fit a 10-minute command.

    python benchmarks/gpu_session.py                      # the default steps in order of value, then collect
    python benchmarks/gpu_session.py --list               # the steps in order, their minutes, what each runs
    python benchmarks/gpu_session.py --step tests --out-dir DIR     # one step; its files go to DIR
    python benchmarks/gpu_session.py --collect DIR [DIR ...]        # merge the steps' files into the package
    python benchmarks/gpu_session.py --deadline-s 540 --archive FILE.tar.gz   # one command, one file back

It runs on any CUDA GPU the library targets (T4, RTX 30xx/40xx, L4, A100, H100) and records which one: every
step's file carries the device name, compute capability, memory, driver, versions and date, and the results
files are named after the device. The 16-bit dtype is the GPU's own (``measure.gpu.preferred_half_dtype``: bf16
from compute capability 8.0, fp16 below), and the benchmarks run at N = 8192 on GPUs with at least 40 GiB (A100,
H100) and N = 4096 on smaller ones (:func:`bench_length`), so each step fits its limit there too. The kernel's
speed goals are judged on an H100 only (``measure.gpu.GOALS_DEVICE``); elsewhere they are recorded as not judged.

The steps, in order of value (each a subprocess with its own time limit, ``--step-timeout``, default 540 s; the
default ones and the machine's start fit 15 minutes of device time, :data:`DEVICE_MINUTES`):

1. ``bench64`` and 2. ``bench128``: ``benchmarks/bench_triton.py``, one head dim each, causal and not, fwd and
   fwd+bwd, with the new sm_90a tables: the kernel through ``diff_attention`` against every SDPA formulation under
   the flash, cuDNN and efficient backends, each selected explicitly (a backend the GPU lacks is recorded as
   refused); time and peak memory;
3. ``atomic``: the same benchmark, fwd+bwd at d = 64 and 128, the kernel with its default plan beside the atomic
   twin (``configs.ATOMIC_TWINS``: dQ added by the dK programs with float32 atomics), the fused plan at d = 64
   (dV and both dK in one launch) and its atomic form (every gradient from one launch; non-causal calls only), and
   the TMA twins (``configs.TMA_TWINS``) forced on and off, into the session file;
4. ``probe``: ``benchmarks/probe_triton.py``: where the forward loses its time (the copy and matmul ceilings, the
   forward per plan and tile shape, Nsight Compute's counters where ``ncu`` runs);
5. ``tests``: ``pytest tests/test_triton.py`` on the GPU with every kernel pinned to its first configuration
   (``DIFFATTN_TRITON_AUTOTUNE=0``) and every buffer poisoned with NaN: the CPU suite's cases compiled (every
   plan, masks, finfo.min masks, fused-qkv slices, NaN), B * H > 65535, a mask past 2**31 elements; and
   ``tests/test_triton_layouts.py``, forward and backward on every input layout;
6. ``tests16``: 16-bit (the dtypes the GPU has) and float32 forward and gradients against float64 by
   norm-relative error, for masks, Nq != Nk, GQA 4:1, scalar / per-head / per-token lambda, at d = 64 and 128;
7. ``autotune``: the test that autotunes at N = 8192 (d = 64 and 128, the default plans and their atomic twins,
   the fused plan and its atomic form at d = 64)
   and checks the picked configurations' answers;
8. ``sdpa`` (only when named): ``benchmarks/bench_sdpa.py`` (notebook 08's table);
9. ``compile`` (only when named; it needs no GPU): ``python -m diffattn_tutorial.kernels.triton.aot --all`` with
   the Triton installed there (registers can differ between versions).

Each step writes ``session_<step>.json`` (command, exit code, seconds, device, versions, date, the log's tail)
and ``session_<step>.log`` into ``--out-dir``; the benchmark steps also write their results part. ``--collect``
merges them into ``diffattn_tutorial/recorded/``: ``bench_triton_<device>.json``, ``bench_sdpa_<device>.json``
and ``gpu_session_<device>.json`` (the steps, the test outcome, the autotuner's picks, the kernel's speed goals
checked), which notebooks 08 and 09 show from any folder (``diffattn_tutorial.measure.gpu.find_recorded``). Where
each command has a time limit, run one step per command, all with the same ``--out-dir`` (or one folder each),
on the same machine so the Triton cache carries over, then ``--collect`` the folders and commit the three files.
Or run the default steps as one command inside its limit: ``--deadline-s S`` starts a step only while its expected
minutes fit in what is left of S seconds (a later, cheaper step may still run; each step's time limit is cut to
what is left), and ``--archive FILE.tar.gz`` packs the out-dir into one file to copy back; ``--collect`` takes that
file as it takes a folder.
The scripts import the package from this checkout (``PYTHONPATH`` is set for each step), so the GPU machine needs
torch and triton only.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a script from a checkout: import the package from the repository
    sys.path.insert(0, str(ROOT))

from diffattn_tutorial.measure import gpu as gpu_bench  # noqa: E402  (imports torch, not triton)
from diffattn_tutorial.measure.gpu import SESSION_SCHEMA as SCHEMA  # noqa: E402

STEPS = {  # name: (what it runs, minutes on an H100, the command's arguments after the python), in order of value:
#   the new tables' numbers first (issue 51's goals are read from them), then the probe, then the GPU tests; the
#   minutes are the recorded sessions' (2026-11-26: bench steps about a minute each, the probe 47 s without ncu,
#   tests and tests16 about 2.5 and 1.5 min, autotune 32-43 s), rounded up, with what was added since: the probe's
#   four TMA twins (about 3 s each), the autotune step's atomic plans and the fused plans at d = 64 (3 times its
#   cases), the atomic step's fused plans (d = 64 only, the atomic form non-causal only; refused in no time)
    "bench64": ("bench_triton at d = 64 with the new sm_90a table (N = 8192; 4096 below 40 GiB): the kernel through "
                "diff_attention against every SDPA formulation and backend", 1,
                ["benchmarks/bench_triton.py", "--lengths", "{n}", "--head-dims", "64", "--out",
                 "{out}/results_triton_part_d64.json"]),
    "bench128": ("bench_triton at d = 128 with the new sm_90a table (N = 8192; 4096 below 40 GiB)", 1,
                 ["benchmarks/bench_triton.py", "--lengths", "{n}", "--head-dims", "128", "--out",
                  "{out}/results_triton_part_d128.json"]),
    "atomic": ("the backward's atomic plans (dQ added by the dK programs), the fused plan at d = 64 (one dK/dV "
               "launch) and its atomic form (one launch, non-causal), the TMA twins forced on and off, beside the "
               "default, fwd+bwd at d = 64 and 128, side by side in one run (no SDPA: bench64/bench128 have it)", 1,
               ["benchmarks/bench_triton.py", "--lengths", "{n}", "--head-dims", "64", "128", "--modes", "fwd_bwd",
                "--impls", "triton,triton_atomic,triton_tma,triton_pointers,triton_fused,triton_fused_atomic", "--out",
                "{out}/results_triton_atomic.json"]),
    "probe": ("probe_triton: copy and matmul ceilings, the forward per plan and tile shape, ncu counters", 1,
              ["benchmarks/probe_triton.py", "--out", "{out}/probe_triton.json"]),
    "tests": ("GPU tests: the CPU suite's cases compiled (the scan and the careful launch too), every input "
              "layout, grid and int32 limits; pinned, poisoned", 3,
              ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_triton.py", "tests/test_triton_layouts.py",
               "-k", "not autotuned_configs_at_8192 and not low_precision"]),
    "tests16": ("GPU tests: 16-bit / fp32 forward and gradients vs float64, d = 64 and 128", 2,
                ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_triton.py", "-k", "low_precision"]),
    "autotune": ("the autotuner's picks at N = 8192, checked, for the default and the atomic plans and the fused "
                 "plans at d = 64", 2,
                 ["-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "tests/test_triton.py", "-k",
                  "autotuned_configs_at_8192"]),
    "sdpa": ("bench_sdpa, N = 8192 (4096 below 40 GiB): recorded on the H100 and the H200 already", 1,
             ["benchmarks/bench_sdpa.py", "--lengths", "{n}", "--out", "{out}/results_sdpa_part.json"]),
    "compile": ("the ahead-of-time compile check with the GPU machine's own Triton (no GPU used)", 6,
                ["-m", "diffattn_tutorial.kernels.triton.aot", "--all", "--jobs", "16", "--json",
                 "{out}/compile_facts_gpu_machine.json"]),
}

START_MINUTES = 4
"""A fresh GPU machine's start, counted against the session's device time (it takes minutes)."""
DEVICE_MINUTES = 15
"""The device time a GPU session has, start included: the default steps and the start fit it."""
OPTIONAL_STEPS = ("sdpa", "compile")
"""Run only when named: ``sdpa`` is recorded for the H100 and the H200 already, ``compile`` needs no GPU."""
DEFAULT_STEPS = [name for name in STEPS if name not in OPTIONAL_STEPS]
"""What a plain run does, in order of value (the steps that fit :data:`DEVICE_MINUTES` after the start)."""


def bench_length(gpu_memory_gib: Optional[float]) -> int:
    """The benchmarks' sequence length: 8192 (the goals' N) on GPUs with at least 40 GiB (A100, H100), 4096 on
    smaller ones (T4, L4, RTX), whose slower kernels would not finish a step in its limit at 8192."""
    return 8192 if (gpu_memory_gib or 0) >= 40 else 4096


def environment() -> dict:
    """Device, versions and date, as every recorded GPU result carries them."""
    env = {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "python": platform.python_version(), "host": platform.node()}
    try:
        import torch

        env.update(torch=torch.__version__, cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)
        if torch.cuda.is_available():
            env.update(device=torch.cuda.get_device_name(),
                       capability=".".join(map(str, torch.cuda.get_device_capability())),
                       gpu_memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
                       half_dtype=str(gpu_bench.preferred_half_dtype()).removeprefix("torch."))
    except ImportError:
        pass
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,power.limit",
                            "--format=csv,noheader"], capture_output=True, text=True, check=False)
        env["nvidia_smi"] = q.stdout.strip()
    return env


def run_step(name: str, out_dir: Path, timeout: int) -> dict:
    """Run one step as a subprocess with a time limit; write ``session_<name>.json`` and ``.log``."""
    what, minutes, argv = STEPS[name]
    env_now = environment()
    n = bench_length(env_now.get("gpu_memory_gib"))
    argv = [a.replace("{out}", str(out_dir)).replace("{n}", str(n)) for a in argv]
    env = dict(os.environ, PYTHONUNBUFFERED="1", TRITON_DEFAULT_FP_FUSION=os.environ.get("TRITON_DEFAULT_FP_FUSION", "1"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if name == "autotune":
        env["DIFFATTN_CHOSEN_CONFIGS"] = str(out_dir / "chosen_configs_tests.json")
    log_path = out_dir / f"session_{name}.log"
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=timeout, check=False)
            code, status = proc.returncode, "passed" if proc.returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            code, status = None, f"timed out after {timeout} s"
    seconds = time.perf_counter() - t0
    tail = log_path.read_text(errors="replace")[-4000:]
    record = {"schema": SCHEMA, "step": name, "what": what, "command": " ".join(["python", *argv]),
              "returncode": code, "status": status, "seconds": round(seconds, 1), "expected_minutes": minutes,
              "environment": env_now, "log_tail": tail}
    (out_dir / f"session_{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"[{name}] {status} in {seconds:.0f} s ({what})", flush=True)
    return record


def run_steps(names: Sequence[str], out_dir: Path, step_timeout: int, deadline_s: Optional[float] = None,
              clock=time.perf_counter) -> tuple[list[dict], list[str]]:
    """Run ``names`` in order; with ``deadline_s``, skip a step whose expected minutes do not fit in what is left
    and cut each step's time limit to it. Returns the steps' records and the names skipped."""
    start, records, skipped = clock(), [], []
    for name in names:
        left = None if deadline_s is None else deadline_s - (clock() - start)
        if left is not None and STEPS[name][1] * 60 > left:
            print(f"[{name}] skipped: ~{STEPS[name][1]} min expected, {max(left, 0):.0f} s left of the deadline",
                  flush=True)
            skipped.append(name)
            continue
        records.append(run_step(name, out_dir, step_timeout if left is None else min(step_timeout, int(left))))
    return records, skipped


def archive(out_dir: Path, path: Path) -> Path:
    """Pack the files of ``out_dir`` (the steps' records, logs and results) into ``path``, a .tar.gz."""
    with tarfile.open(path, "w:gz") as tar:
        for p in sorted(out_dir.iterdir()):
            if p.is_file() and p.resolve() != path.resolve():
                tar.add(p, arcname=p.name)
    return path


def _unpacked(paths: Sequence[Path]) -> list[Path]:
    """Folders to collect from: each folder as it is, each .tar.gz (from ``--archive``) unpacked into a new one."""
    dirs = []
    for p in map(Path, paths):
        if p.is_file() and p.name.endswith(".tar.gz"):
            dest = Path(tempfile.mkdtemp(prefix="gpu_session_archive_"))
            with tarfile.open(p) as tar:  # the archive's plain files, by their names alone, into dest
                files = [m for m in tar.getmembers() if m.isfile() and Path(m.name).name == m.name]
                tar.extractall(dest, members=files, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
            p = dest
        dirs.append(p)
    return dirs


def _problems(facts: dict) -> list[str]:
    """One line per compile with a problem in a ``kernels.triton.aot --json`` file."""
    from diffattn_tutorial.kernels.triton.aot import Facts

    found = [Facts.from_row(r) for r in facts["facts"]]
    return [f"{f.kernel} {f.form} d{f.head_dim} {f.dtype} {f.arch} {f.config} [{f.case}]: {'; '.join(f.problems())}"
            for f in found if f.problems()]


def collect(dirs: Sequence[Path], dest: Optional[Path] = None) -> dict:
    """Merge the steps' files found in ``dirs`` into ``dest`` (default ``diffattn_tutorial/recorded/``): the
    ``bench_triton`` and ``bench_sdpa`` results and ``gpu_session_<device>.json``; a ``.tar.gz`` from
    ``--archive`` counts as the folder it packed."""
    dirs = _unpacked(dirs)
    steps, triton_parts, sdpa_parts, picks = {}, [], [], {}
    for d in dirs:
        d = Path(d)
        for p in sorted(d.glob("session_*.json")):
            rec = json.loads(p.read_text())
            steps[rec["step"]] = rec
        triton_parts += [json.loads(p.read_text()) for p in sorted(d.glob("results_triton_part_*.json"))]
        sdpa_parts += [json.loads(p.read_text()) for p in sorted(d.glob("results_sdpa_part*.json"))]
        for p in d.glob("chosen_configs_tests.json"):
            picks.update(json.loads(p.read_text()))
    if not steps:
        raise SystemExit(f"no session_*.json in {[str(d) for d in dirs]}")
    env = next(iter(steps.values()))["environment"]
    written = []
    session = {"schema": SCHEMA, "recorded": env, "steps": {}, "autotune_picks_in_tests": picks}
    for name in STEPS:
        if name in steps:
            rec = steps[name]
            session["steps"][name] = {k: rec[k] for k in ("what", "command", "status", "returncode", "seconds")}
            session["steps"][name]["log_tail"] = rec["log_tail"][-1500:]
    if triton_parts:
        merged = gpu_bench.merge_triton(triton_parts)
        written.append(gpu_bench.write_json(gpu_bench.recorded_path("bench_triton", merged["recorded"]["device"],
                                                                    dest), merged))
        session["goals"] = gpu_bench.goals(merged, n=gpu_bench.goals_length(merged))
        if not all(g["judged"] for g in session["goals"]):
            session["goals_note"] = (f"recorded on {merged['recorded']['device']}: the goals are judged on an "
                                     f"{gpu_bench.GOALS_DEVICE} in {gpu_bench.GOALS_DTYPE} at N = "
                                     f"{gpu_bench.GOALS_N} only")
        session["summary"] = gpu_bench.triton_summary(merged)
    for d in dirs:
        for p in Path(d).glob("probe_triton.json"):
            session["probe"] = json.loads(p.read_text())
        for p in Path(d).glob("results_triton_atomic.json"):  # the atomic plans beside the default ones
            session["atomic_plans"] = json.loads(p.read_text())
        for p in Path(d).glob("compile_facts_gpu_machine.json"):
            facts = json.loads(p.read_text())
            session["compile_facts_gpu_machine"] = {"recorded": facts["recorded"], "problems": _problems(facts)}
    for part in sdpa_parts:
        written.append(gpu_bench.write_json(gpu_bench.recorded_path("bench_sdpa", part["recorded"]["device"], dest),
                                            part))
    device = env.get("device", "unknown device")
    written.append(gpu_bench.write_json(gpu_bench.recorded_path("gpu_session", device, dest), session))
    for p in written:
        print(f"wrote {p}")
    return session


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="print the steps and exit")
    ap.add_argument("--step", choices=list(STEPS), action="append", help="run only this step (repeatable)")
    ap.add_argument("--out-dir", type=Path, default=None, help="where the steps write (default: a temporary folder)")
    ap.add_argument("--step-timeout", type=int, default=540, help="seconds per step (a 10-minute command fits one)")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="seconds for all the steps: skip a step whose expected minutes do not fit what is left")
    ap.add_argument("--archive", type=Path, default=None, metavar="FILE.tar.gz",
                    help="pack the out-dir's files into this one file after the steps")
    ap.add_argument("--collect", type=Path, nargs="+", default=None, metavar="DIR",
                    help="merge the files of earlier steps in DIR... (or --archive files) into "
                         "diffattn_tutorial/recorded/")
    args = ap.parse_args(argv)
    if args.list:
        used = START_MINUTES
        print(f"machine start ~{START_MINUTES} min; device time {DEVICE_MINUTES} min; steps in order of value:")
        for name, (what, minutes, cmd) in STEPS.items():
            optional = name in OPTIONAL_STEPS
            used += 0 if optional else minutes
            when = "only when named" if optional else f"done by ~{used} min"
            print(f"{name:<9} ~{minutes} min ({when})  {what}\n          python {' '.join(cmd)}")
        print("as one command within a 10-minute limit, one file to copy back (then --collect FILE):\n"
              "          python benchmarks/gpu_session.py --deadline-s 540 --out-dir DIR --archive DIR/gs.tar.gz")
        return 0
    if args.collect:
        collect(args.collect)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU here: the session needs one (the CPU half is `pytest` and "
              "`python -m diffattn_tutorial.kernels.triton.aot --all`)", file=sys.stderr)
        return 2
    out = args.out_dir or Path(tempfile.mkdtemp(prefix="gpu_session_"))
    out.mkdir(parents=True, exist_ok=True)
    names = args.step or DEFAULT_STEPS
    t0 = time.perf_counter()
    records, skipped = run_steps(names, out, args.step_timeout, args.deadline_s)
    print(f"{len(records)} steps in {time.perf_counter() - t0:.0f} s"
          f"{f', skipped {skipped}' if skipped else ''}; files in {out}")
    if args.archive:
        print(f"wrote {archive(out, args.archive)}")
    if args.step is None and records:  # the whole session: collect into diffattn_tutorial/recorded/
        collect([out])
    return 0 if records and all(r["status"] == "passed" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
