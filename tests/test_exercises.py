"""Every exercise notebook (``exercises/NN_*.ipynb``) and its solution (``solutions/NN_*.ipynb``).

The exercise is generated from the solution by ``tools/make_exercises.py`` (``tests/test_make_exercises.py``
fails when a committed one differs), so the two have the same cells and only the task cells' answers differ;
strict nbval executes the solution. What remains to check here:

* Structure (no kernel): tasks are numbered 1..n, each ``# TASK n`` cell is followed by its ``# CHECK n`` cell,
  which calls ``check_*`` of ``diffattn_tutorial.checks``; the first code cell is the course's set-up; the
  exercise points back to its notebook; every solution's CHECK cell shows ``PASSED`` in its committed output
  (strict nbval then guarantees a re-run prints the same).
* Each ``CHECK n`` cell calls the check registered for ``TASK n`` (``check.task``) on the function that TASK
  defines (``check.function_name``).
* Every relative link in an exercise or solution resolves, and each one ends with links back to its notebook
  and to its solution.
* Execution (cells in sequence in one fresh namespace, going on after errors, in this process: a kernel start per
  notebook would cost more than most exercises' cells; ``tests/test_scorecard.py`` runs exercises in a real
  kernel, as ``diffattn-tutorial check`` does): the exercise as shipped, where each CHECK cell must fail with one
  clean line, ``NotAttempted`` (``TASK n not attempted yet: ...``, which Jupyter shows without a traceback), and
  no other cell may fail. (The solved run is the solution notebook itself, which strict nbval executes: the
  generator makes the exercise with the solution's answers exactly that notebook.)
"""

from __future__ import annotations

import ast
import contextlib
import io
import linecache
import os
import re
import warnings
from pathlib import Path
from urllib.parse import unquote

import nbformat
import pytest

from diffattn_tutorial import checks
from diffattn_tutorial.course.scorecard import CHECK_RE, find_tasks, is_check_cell

ROOT = Path(__file__).resolve().parents[1]
EXERCISES = sorted((ROOT / "exercises").glob("[0-9][0-9]_*.ipynb"))


def read(path: Path):
    return nbformat.read(path, as_version=4)


def solution_of(path: Path) -> Path:
    return ROOT / "solutions" / path.name


def test_there_are_exercises():
    assert len(EXERCISES) >= 6, "exercises/NN_*.ipynb are missing"


@pytest.mark.parametrize("path", EXERCISES, ids=lambda p: p.stem)
def test_structure(path):
    ex, sol = read(path), read(solution_of(path))
    md = "\n".join(c.source for c in ex.cells if c.cell_type == "markdown")
    nn = path.name[:2]
    assert f"notebooks/{path.name}" in md or re.search(rf"notebook\W*{nn}\b", md, re.IGNORECASE), \
        "an exercise points back to its notebook"
    setup = [c for c in ex.cells if c.cell_type == "code"][0].source
    assert setup.startswith("# NBVAL_IGNORE_OUTPUT\n") and "device = setup(seed=0)" in setup, \
        "the first code cell must be the course's set-up cell (Colab install guard, seeded setup)"
    tasks = find_tasks(ex)
    assert tasks, "no # TASK cells"
    assert [t.number for t in tasks] == list(range(1, len(tasks) + 1)), "tasks must be numbered 1..n"
    for t in tasks:
        assert t.check_cell == t.task_cell + 1, f"TASK {t.number} must be followed by its CHECK cell"
        src = ex.cells[t.check_cell].source
        called = [name for name in checks.__all__ if name.startswith("check_") and f"{name}(" in src]
        assert called, f"CHECK {t.number} must call a check_* from diffattn_tutorial.checks"
        shown = "".join(o.get("text", "") for o in sol.cells[t.check_cell].outputs if o.get("output_type") == "stream")
        assert "PASSED" in shown, f"solutions/{path.name}: CHECK {t.number} does not show PASSED"
    assert len([c for c in ex.cells if is_check_cell(c)]) == len(tasks), "a CHECK cell without its TASK"


def run_cells(nb, folder: Path) -> list:
    """Each code cell of ``nb`` run in order in one fresh namespace with ``folder`` as the working directory, an
    error ending only its cell, as a kernel runs them; returns (cell index, exception or None) per code cell. The
    process's torch threads, random state and figures are restored afterwards."""
    import matplotlib.pyplot as plt
    import torch

    ns: dict = {"__name__": "__main__"}
    results, cwd, threads, rng = [], os.getcwd(), torch.get_num_threads(), torch.random.get_rng_state()
    os.chdir(folder)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i, cell in enumerate(nb.cells):
                if cell.cell_type != "code":
                    continue
                name = f"<{folder.name}-cell-{i}>"  # in linecache: Triton and inspect read a function's source
                linecache.cache[name] = (len(cell.source), None, cell.source.splitlines(keepends=True), name)
                try:
                    exec(compile(cell.source, name, "exec"), ns)  # noqa: S102 - the course's own notebooks
                    results.append((i, None))
                except Exception as exc:  # noqa: BLE001 - recorded, and the next cell runs, as in Jupyter
                    results.append((i, exc))
    finally:
        os.chdir(cwd)
        plt.close("all")
        torch.set_num_threads(threads)
        torch.random.set_rng_state(rng)
    return results


@pytest.mark.parametrize("path", EXERCISES, ids=lambda p: p.stem)
def test_unsolved_fails_only_in_checks(path):
    ex = read(path)
    for i, err in run_cells(ex, path.parent):
        cell = ex.cells[i]
        if CHECK_RE.match(cell.source):
            task = int(cell.source.split()[2])
            assert isinstance(err, checks.NotAttempted), \
                f"unsolved {path.name} cell {i + 1} ({cell.source.splitlines()[0]}) gave {err!r}, expected NotAttempted"
            shown = err._render_traceback_()  # what Jupyter shows instead of a traceback
            assert len(shown) == 1 and f"TASK {task} not attempted yet: replace `raise NotImplementedError`" in \
                shown[0], f"unsolved {path.name} cell {i + 1} shows {shown}"
        else:
            assert err is None, f"unsolved {path.name} cell {i + 1} raised {type(err).__name__}: {err}"


@pytest.mark.parametrize("path", EXERCISES, ids=lambda p: p.stem)
def test_checks_match_their_tasks(path):
    """CHECK n calls the check of TASK n, on the function TASK n defines."""
    ex = read(path)
    for t in find_tasks(ex):
        src = ex.cells[t.check_cell].source
        called = [name for name in checks.__all__ if name.startswith("check_") and f"{name}(" in src]
        assert len(called) == 1, f"CHECK {t.number} should call exactly one check, calls {called}"
        check = getattr(checks, called[0])
        assert check.task == t.number, f"{called[0]} is the check of TASK {check.task}, not of TASK {t.number}"
        defined = [n.name for n in ast.parse(ex.cells[t.task_cell].source).body if isinstance(n, ast.FunctionDef)]
        assert check.function_name in defined, f"TASK {t.number} defines {defined}, {called[0]} checks " \
                                               f"{check.function_name}"
        assert f"{called[0]}({check.function_name})" in src


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("path", EXERCISES + sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")),
                         ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_links_resolve_and_lead_back(path):
    nb = read(path)
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        for target in LINK.findall(cell.source):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            file = (path.parent / unquote(target.split("#")[0])).resolve()
            assert file.exists(), f"{path.name}: the link {target} does not resolve"
    last = nb.cells[-1]
    assert last.cell_type == "markdown", "an exercise ends with its recap and links"
    targets = LINK.findall(last.source)
    assert f"../notebooks/{path.name}" in targets, "the last cell links back to the notebook"
    assert f"../solutions/{path.name}" in targets, "the last cell links to the solved notebook"


def test_run_cells_reports_each_cells_error_and_goes_on(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in (
        "x = 1", "raise ValueError('boom')", "import os; here = os.getcwd()", "y = x + 1")])
    (a, ok), (b, boom), (c, ok2), (d, ok3) = run_cells(nb, tmp_path)
    assert (a, b, c, d) == (0, 1, 2, 3) and ok is ok2 is ok3 is None
    assert isinstance(boom, ValueError) and str(boom) == "boom" and Path.cwd() != tmp_path
