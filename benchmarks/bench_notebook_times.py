"""How long notebooks take to run from an empty training cache, at two commits, side by side in one run.

A learner who opens a chapter for the first time trains its toy models before anything is cached: that wall time
is what a change to training (a kernel's backward, a new ``auto`` rule) moves. This checks out both commits
(``git worktree``, in a temporary folder), then runs each notebook once per commit, one after the other (which
commit goes first alternates from notebook to notebook), each in a fresh kernel with empty caches (the training
cache ``DIFFATTN_CACHE``, inductor's and Triton's) and that commit's package first on the path (the kernel's first
cell checks it imported that copy). Nothing is written into the notebooks.

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
from diffattn_tutorial.measure.timing import cpu_identity, slug

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def commit_of(rev: str) -> str:
    """The full id of the commit ``rev`` names (a tag's commit, not the tag object)."""
    done = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=ROOT, capture_output=True,
                          text=True)
    if done.returncode:
        raise SystemExit(f"bench_notebook_times: {rev!r} is not a commit of this repository")
    return done.stdout.strip()


def run_notebook(repo: Path, name: str) -> float:
    """Seconds to execute ``repo``'s notebook ``name`` in a fresh kernel, from an empty cache, importing ``repo``."""
    work, cache = Path(tempfile.mkdtemp(prefix="nbtime-")), Path(tempfile.mkdtemp(prefix="nbtime-cache-"))
    nb = nbformat.read(repo / "notebooks" / name, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell("import diffattn_tutorial\nprint(diffattn_tutorial.__file__)"))
    env = {"DIFFATTN_CACHE": str(cache / "study"), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
           "TRITON_CACHE_DIR": str(cache / "triton"), "PYTHONPATH": str(repo),
           "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
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
    where = "".join(o.get("text", "") for o in nb.cells[0].outputs if o.get("name") == "stdout").strip()
    if not Path(where).resolve().is_relative_to(repo.resolve()):
        raise RuntimeError(f"{name} imported {where!r}, not the checkout {repo}")
    return seconds


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the earlier commit")
    ap.add_argument("--after", default="HEAD", help="the later commit (default HEAD)")
    ap.add_argument("--notebooks", nargs="+", default=["07", "10", "12", "13"], help="chapter numbers")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    header = results_header("cpu", "benchmarks/bench_notebook_times.py", argv if argv is not None else sys.argv[1:])
    header["cpu"] = cpu_identity()  # the processor, which the device string does not name
    commits = {"before": commit_of(args.before), "after": commit_of(args.after)}
    names = {}
    for number in args.notebooks:
        found = sorted((ROOT / "notebooks").glob(f"{number}_*.ipynb"))
        if not found:
            raise SystemExit(f"bench_notebook_times: no notebook {number}_*.ipynb in notebooks/")
        names[number] = found[0].name
    rows = []
    with tempfile.TemporaryDirectory(prefix="nbtime-trees-") as tmp:
        trees = {}
        try:
            for which, commit in commits.items():
                trees[which] = Path(tmp) / which
                subprocess.run(["git", "worktree", "add", "--detach", "-q", str(trees[which]), commit], cwd=ROOT,
                               check=True)
            for i, name in enumerate(names.values()):
                row = {"notebook": name}
                for which in (("before", "after") if i % 2 == 0 else ("after", "before")):
                    if not (trees[which] / "notebooks" / name).exists():
                        raise SystemExit(f"bench_notebook_times: {name} does not exist at the {which} commit")
                    row[which] = round(run_notebook(trees[which], name), 1)
                    row[f"load_{which}"] = round(os.getloadavg()[0], 2)
                print(f"{name:36s} before {row['before']:7.1f} s   after {row['after']:7.1f} s", flush=True)
                rows.append(row)
        finally:
            for folder in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(folder)], cwd=ROOT, check=False)
            subprocess.run(["git", "worktree", "prune"], cwd=ROOT, check=False)
    out = args.out or HERE / f"results_notebook_times_{slug(header['device'])}.json"
    write_json(out, {**header, "commits": commits, "rows": rows})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
