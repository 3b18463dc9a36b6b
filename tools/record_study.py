"""Train toy retrieval models over seeds (and budgets) and record their measurements in a results file.

    python tools/record_study.py seed_study                       # notebook 07: 3 attentions x seeds 0-9
    python tools/record_study.py v2_budget --kinds baseline diff diff_v2 --seeds 0 1 2 --steps 500 1000 2000
    python tools/record_study.py v2_lr --kinds baseline diff_v2 --seeds 0 1 2 --lr 1e-3 3e-3 1e-2

Every run is ``training.study.retrieval_study`` with the notebooks' settings (one CPU thread, deterministic), so a
row repeats on the same machine; the file names the device, torch version, date, command and settings.
It is written to ``diffattn_tutorial/recorded/NAME.json`` (read with ``diffattn_tutorial.recorded.load``).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import platform
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from diffattn_tutorial.training.model import ATTENTIONS
from diffattn_tutorial.training.study import retrieval_study

OUT_DIR = Path(__file__).resolve().parents[1] / "diffattn_tutorial" / "recorded"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", help="results file name (diffattn_tutorial/recorded/NAME.json)")
    ap.add_argument("--kinds", nargs="+", default=list(ATTENTIONS), choices=ATTENTIONS)
    ap.add_argument("--seeds", nargs="+", type=int, default=list(range(10)))
    ap.add_argument("--steps", nargs="+", type=int, default=[500])
    ap.add_argument("--lr", nargs="+", type=float, default=[3e-3])
    args = ap.parse_args(argv)

    grid = list(itertools.product(args.steps, args.lr, args.seeds, args.kinds))
    rows = []
    for steps, lr, seed, kind in tqdm(grid, desc=args.name, unit="model"):
        r = retrieval_study(kind, seed=seed, steps=steps, lr=lr, progress=False)
        rows.append({**r.summary(), "lr": lr})
    record = {
        "script": "tools/record_study.py", "command": " ".join(["python", "tools/record_study.py", *sys.argv[1:]])
        if argv is None else " ".join(["python", "tools/record_study.py", *argv]),
        "device": f"CPU: {cpu_name()}, 1 torch thread", "torch": torch.__version__,
        "python": platform.python_version(), "date": datetime.date.today().isoformat(),
        "settings": "retrieval_study defaults (d_model 64, 2 layers, 4 heads, batch 32, NeedleTask(), "
                    "256 evaluation sequences per setting, num_threads 1) with the steps/lr of each row",
        "rows": rows,
    }
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    out = OUT_DIR / f"{args.name}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out.relative_to(OUT_DIR.parents[1])} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
