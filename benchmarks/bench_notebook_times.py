"""How long notebooks take to run from an empty training cache, at two commits, side by side in one run.

A learner who opens a chapter for the first time trains its toy models before anything is cached: that wall time
is what a change to training (a kernel's backward, a new ``auto`` rule) moves. For each notebook this checks out
both commits (``git worktree``, in a temporary folder), then runs the notebook once per commit, one after the
other, each in a fresh kernel with an empty ``DIFFATTN_CACHE`` and that commit's package first on the path (the
kernel's first cell checks it imported that copy). Nothing is written into the notebooks.

    python benchmarks/bench_notebook_times.py --before fa594be [--after HEAD] [--notebooks 07 10 12 13]

Writes ``benchmarks/results_notebook_times_<cpu>.json``: the seconds of each notebook at each commit, with the
load average at its end (the machine should be otherwise idle).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import nbformat
from nbclient import NotebookClient

from diffattn_tutorial.measure.gpu import results_header, write_json
from diffattn_tutorial.measure.timing import slug

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def checkout(rev: str, where: Path) -> tuple[Path, str]:
    """A detached worktree of ``rev`` under ``where``; returns its folder and full commit id."""
    commit = subprocess.run(["git", "rev-parse", rev], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    folder = where / commit[:12]
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(folder), commit], cwd=ROOT, check=True)
    return folder, commit


def run_notebook(repo: Path, name: str) -> float:
    """Seconds to execute ``repo``'s notebook ``name`` in a fresh kernel, from an empty cache, importing ``repo``."""
    work, cache = Path(tempfile.mkdtemp(prefix="nbtime-")), tempfile.mkdtemp(prefix="nbtime-cache-")
    nb = nbformat.read(repo / "notebooks" / name, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell("import diffattn_tutorial\nprint(diffattn_tutorial.__file__)"))
    env = {"DIFFATTN_CACHE": cache, "PYTHONPATH": str(repo), "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        t0 = time.perf_counter()
        NotebookClient(nb, timeout=1800, kernel_name="python3", resources={"metadata": {"path": str(work)}}).execute()
        seconds = time.perf_counter() - t0
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)
    where = nb.cells[0].outputs[0]["text"].strip()
    if not where.startswith(str(repo)):
        raise RuntimeError(f"{name} imported {where}, not the checkout {repo}")
    return seconds


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the earlier commit")
    ap.add_argument("--after", default="HEAD", help="the later commit (default HEAD)")
    ap.add_argument("--notebooks", nargs="+", default=["07", "10", "12", "13"], help="chapter numbers")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    header = results_header("cpu", "benchmarks/bench_notebook_times.py", argv if argv is not None else sys.argv[1:])
    rows = []
    with tempfile.TemporaryDirectory(prefix="nbtime-trees-") as tmp:
        trees = {which: checkout(rev, Path(tmp)) for which, rev in (("before", args.before), ("after", args.after))}
        try:
            for number in args.notebooks:
                name = next(p.name for p in (ROOT / "notebooks").glob(f"{number}_*.ipynb"))
                row = {"notebook": name}
                for which, (folder, _) in trees.items():
                    row[which] = round(run_notebook(folder, name), 1)
                    row[f"load_{which}"] = round(os.getloadavg()[0], 2)
                print(f"{name:36s} before {row['before']:7.1f} s   after {row['after']:7.1f} s", flush=True)
                rows.append(row)
        finally:
            for folder, _ in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(folder)], cwd=ROOT, check=False)
    commits = {which: commit for which, (_, commit) in trees.items()}
    out = args.out or HERE / f"results_notebook_times_{slug(header['device'])}.json"
    write_json(out, {**header, "commits": commits, "rows": rows})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
