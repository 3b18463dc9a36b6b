"""Training step time of notebook 07's toy models on an idle CPU and with one other CPU-bound process running.

Both models (``baseline`` and ``diff``, ``StudyConfig``'s defaults: d_model 64, 2 layers, 4 heads, batch 32,
the needle task cycling through its settings) take the same AdamW training steps as
``training.study.train_toy_model`` (forward, loss, backward, gradient clipping, optimiser step). Each is timed under two
thread policies:

* ``torch default``: one intra-op thread per core, as a fresh ``import torch`` gives;
* ``recommended``: :func:`diffattn_tutorial.measure.cpu_threads.recommended_threads`, the cores not kept busy by other
  programs (decided again at the start of each phase).

Phase 1 is "idle" (no load of ours; other programs on the machine may run), phase 2 "loaded": this script
starts one CPU-bound process (a Python busy loop) and stops it after. Each cell is the median of ``steps``
steps after two warm-up steps, repeated ``repeats`` times with the phases alternating, so the table shows the
ratio of the medians over repeats (the project's one definition of a time ratio) and the spread (min-max) of the
per-repeat ratios. The goals (issue 15): with the
recommended threads, DIFF's loaded step within 2x its idle step and within 1.5x the baseline's loaded step.
Writes ``benchmarks/results_busy_cpu_<cpu>.json``.

    python benchmarks/bench_busy_cpu.py [--steps 10] [--repeats 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from diffattn_tutorial.measure import cpu_threads, timing
from diffattn_tutorial.training.model import TinyLM
from diffattn_tutorial.training.study import SETTINGS, StudyConfig, retrieval_loss

HERE = Path(__file__).resolve().parent
MODELS = ("baseline", "diff")
POLICIES = ("torch default", "recommended")


def step_seconds(attention: str, threads: int, steps: int) -> float:
    """Median wall time of ``steps`` training steps (after two warm-up steps) on ``threads`` threads."""
    cfg = StudyConfig(attention)
    task = cfg.task
    torch.manual_seed(0)
    model = TinyLM(cfg.lm_config())
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.01)
    gen = torch.Generator().manual_seed(0)
    times = []
    with cpu_threads.threads(threads):
        for t in range(steps + 2):
            n, r = SETTINGS[t % len(SETTINGS)]
            batch = task.sample(cfg.batch_size, n, r, generator=gen)
            t0 = time.perf_counter()
            loss = retrieval_loss(model, batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def phase(default_threads: int, steps: int) -> dict:
    """Step time of every model under every policy, in the machine's current state."""
    chosen = cpu_threads.recommended_threads()
    threads = {"torch default": default_threads, "recommended": chosen}
    return {"threads": threads, "seconds": {f"{m} | {p}": step_seconds(m, threads[p], steps)
                                            for m in MODELS for p in POLICIES}}


def run(steps: int, repeats: int) -> dict:
    """``repeats`` rounds of (idle phase, loaded phase)."""
    default_threads = torch.get_num_threads()
    rounds = []
    for _ in range(repeats):
        idle = phase(default_threads, steps)
        with cpu_threads.cpu_load():
            loaded = phase(default_threads, steps)
        rounds.append({"idle": idle, "loaded": loaded})
    return {"default_threads": default_threads, "rounds": rounds}


def summary(result: dict) -> list[dict]:
    """One row per (model, policy): medians over rounds, loaded/idle and loaded/baseline-loaded ratios."""
    rows = []
    for key in result["rounds"][0]["idle"]["seconds"]:
        model, policy = key.split(" | ")
        idle = [r["idle"]["seconds"][key] for r in result["rounds"]]
        loaded = [r["loaded"]["seconds"][key] for r in result["rounds"]]
        base = [r["loaded"]["seconds"][f"baseline | {policy}"] for r in result["rounds"]]
        slow = [b / a for a, b in zip(idle, loaded)]
        vs_base = [a / b for a, b in zip(loaded, base)]
        rows.append({"model": model, "policy": policy,
                     "threads_idle": [r["idle"]["threads"][policy] for r in result["rounds"]],
                     "threads_loaded": [r["loaded"]["threads"][policy] for r in result["rounds"]],
                     "idle_ms": 1e3 * statistics.median(idle), "loaded_ms": 1e3 * statistics.median(loaded),
                     "loaded_over_idle": statistics.median(loaded) / statistics.median(idle),
                     "loaded_over_idle_range": [min(slow), max(slow)],
                     "over_baseline_loaded": statistics.median(loaded) / statistics.median(base),
                     "over_baseline_loaded_range": [min(vs_base), max(vs_base)]})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | threads policy | threads idle / loaded | idle ms | loaded ms | loaded / idle (spread) "
             "| loaded / baseline loaded (spread) |", "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        th = f"{','.join(map(str, r['threads_idle']))} / {','.join(map(str, r['threads_loaded']))}"
        lo, hi = r["loaded_over_idle_range"]
        blo, bhi = r["over_baseline_loaded_range"]
        lines.append(f"| {r['model']} | {r['policy']} | {th} | {r['idle_ms']:.0f} | {r['loaded_ms']:.0f} "
                     f"| {r['loaded_over_idle']:.2f}x ({lo:.2f}-{hi:.2f}) "
                     f"| {r['over_baseline_loaded']:.2f}x ({blo:.2f}-{bhi:.2f}) |")
    return "\n".join(lines)


def goals(rows: list[dict]) -> dict[str, bool]:
    """Issue 15's two goals, for the recommended threads (medians over rounds)."""
    diff = next(r for r in rows if r["model"] == "diff" and r["policy"] == "recommended")
    return {"diff loaded <= 2x idle": diff["loaded_over_idle"] <= 2.0,
            "diff loaded <= 1.5x baseline loaded": diff["over_baseline_loaded"] <= 1.5}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="default benchmarks/results_busy_cpu_<cpu>.json")
    args = ap.parse_args(argv)
    device = timing.device_name("cpu")
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    result = run(args.steps, args.repeats)
    rows = summary(result)
    print(f"{device}, torch {torch.__version__}, {cpu_threads.usable_cores()} usable cores, load average before {load}")
    print(table(rows))
    met = goals(rows)
    for goal, ok in met.items():
        print(f"{'met' if ok else 'MISSED'}: {goal}")
    out = args.out or HERE / f"results_busy_cpu_{timing.slug(device)}.json"
    command = "python benchmarks/bench_busy_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out.write_text(json.dumps({"device": device, "cpu": timing.cpu_identity(), "torch": torch.__version__,
                               "python": platform.python_version(),
                               "date": datetime.date.today().isoformat(), "command": command.strip(),
                               "load_average_before": load,
                               "steps": args.steps, "summary": rows, "goals": met, **result}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
