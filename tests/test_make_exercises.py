"""``tools/make_exercises.py``: every committed exercise is what its solution generates, and the generator follows
its convention (``# STUB:`` lines and ``# END TASK`` in a solution's task cells) on a tiny synthetic notebook,
failing with the notebook and cell named when the markers are wrong. No kernel runs here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("make_exercises", ROOT / "tools" / "make_exercises.py")
mx = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = mx  # dataclasses look their module up there
_spec.loader.exec_module(mx)

_spec = importlib.util.spec_from_file_location("notebook_header", ROOT / "tools" / "notebook_header.py")
header = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(header)

SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
NAME = "99_toy.ipynb"
COLAB = "https://colab.research.google.com/github/owner/repo/blob/main"
BADGE = "[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({}/{}/99_toy.ipynb)"
INTRO = f"# Exercises 99 · Toy\n\nStuck? The same notebook, solved, is [`solutions/{NAME}`](../solutions/{NAME})."
SETUP = ('# NBVAL_IGNORE_OUTPUT\nimport sys\nif "google.colab" in sys.modules:\n'
         '    get_ipython().run_line_magic("pip", "install -q git+https://github.com/owner/repo")\n'
         'from diffattn_tutorial.course.notebook import setup\ndevice = setup(seed=0)')
HEAD = '# TASK 1: double it\ndef double(x):\n    """2 x, for a float or a tensor x."""\n'
SOLVED = HEAD + '    # STUB: raise NotImplementedError("add x to itself")\n    return x + x\n    # END TASK'
STUB = HEAD + '    raise NotImplementedError("add x to itself")'
CHECK = "# CHECK 1\nassert double(2) == 4\nprint('PASSED')"


def _executed(source: str, count: int, text: str) -> nbformat.NotebookNode:
    cell = new_code_cell(source, execution_count=count)
    cell.outputs = [new_output("stream", name="stdout", text=text)]
    return cell


def toy_solution(task_source: str = SOLVED) -> nbformat.NotebookNode:
    """A solved, executed notebook with a Colab badge, an unmarked code cell, a task and its check."""
    return new_notebook(cells=[
        new_markdown_cell(BADGE.format(COLAB, "solutions") + "\n" + INTRO),
        _executed(SETUP, 1, "device: cpu\n"),
        _executed(task_source, 2, ""),
        _executed(CHECK, 3, "PASSED\n"),
        new_markdown_cell(f"**Solved:** [`solutions/{NAME}`](../solutions/{NAME})"),
    ], metadata={"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                 "widgets": {"state": {}}})


def toy_exercise() -> nbformat.NotebookNode:
    nb = mx.make_exercise(toy_solution(), NAME)
    nb.cells[2].source = STUB  # today's form, written by hand
    return nb


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_committed_exercise_is_generated_from_its_solution(path):
    problems = mx.check(path)
    assert not problems, "\n".join(problems) + "\nrun: python tools/make_exercises.py"


def test_every_exercise_has_its_solution():
    assert len(SOLUTIONS) >= 11
    assert mx._orphans(SOLUTIONS) == []


def test_generates_the_exercise():
    solution = toy_solution()
    ex = mx.make_exercise(solution, NAME)
    assert [c.cell_type for c in ex.cells] == [c.cell_type for c in solution.cells]
    assert ex.cells[0].source == BADGE.format(COLAB, "exercises") + "\n" + INTRO  # only the badge's path changed
    assert ex.cells[1].source == SETUP and ex.cells[3].source == CHECK  # unmarked cells are copied
    assert ex.cells[2].source == STUB
    assert ex.cells[4].source == solution.cells[4].source  # the link to the solution stays
    assert all(c.outputs == [] and c.execution_count is None for c in ex.cells if c.cell_type == "code")
    assert set(ex.metadata) == {"kernelspec", "language_info"}  # cleaned as tools/run_notebooks.py cleans
    assert solution.cells[2].outputs[0].text == "" and solution.cells[2].source == SOLVED  # the solution untouched


def test_multiline_stub_keeps_indentation_and_the_lines_after_end():
    source = ("# TASK 2: clip\ndef clip(x, lo, hi):\n    # lo <= hi\n    # STUB: if lo > hi:\n"
              "    # STUB:     raise ValueError(lo)\n    # STUB:\n    # STUB: raise NotImplementedError('clamp')\n"
              "    return min(max(x, lo), hi)\n    # END TASK\nclipped = clip")
    assert mx.exercise_source(source, mx.Where("toy", 2, "# TASK 2")) == (
        "# TASK 2: clip\ndef clip(x, lo, hi):\n    # lo <= hi\n    if lo > hi:\n        raise ValueError(lo)\n\n"
        "    raise NotImplementedError('clamp')\nclipped = clip")


@pytest.mark.parametrize("source, message", [
    (SOLVED.replace("\n    # END TASK", ""), "the answer has no end: add a line '# END TASK'"),
    (HEAD + "    return x + x\n    # END TASK", "a task cell needs its stub"),
    (SOLVED.replace("# STUB: raise NotImplementedError(\"add x to itself\")", "# STUB: pass"),
     "the last '# STUB:' line must be the learner's"),
    (SOLVED.replace("# STUB:", "#STUB:"), "is misspelt"),
    (SOLVED.replace("# END TASK", "# end task"), "is misspelt"),
    (SOLVED.replace("    return x + x\n", ""), "there is no answer"),
    (SOLVED + "\n    # END TASK", "one '# END TASK'"),
    (SOLVED.replace("    return x + x", "    return x + x\n    # STUB: raise NotImplementedError('twice')"),
     "must form one block"),
    (SOLVED.replace("    # STUB: raise", "        # STUB: raise"), "put each '# STUB:' at the indentation"),
])
def test_a_marker_mistake_names_the_notebook_and_the_cell(source, message):
    with pytest.raises(mx.MarkerError) as info:
        mx.make_exercise(toy_solution(source), NAME)
    assert str(info.value).startswith(f"solutions/{NAME} cell 3 (# TASK 1: double it): ")
    assert message in str(info.value)


def test_a_marker_outside_a_task_cell_is_an_error():
    solution = toy_solution()
    solution.cells[1].source += "\n# END TASK"
    with pytest.raises(mx.MarkerError, match=rf"^solutions/{NAME} cell 2 \(# NBVAL_IGNORE_OUTPUT\): "
                                             r"'# END TASK' is outside a task cell"):
        mx.make_exercise(solution, NAME)


@pytest.mark.parametrize("solution", [toy_solution, lambda: nbformat.read(SOLUTIONS[0], as_version=4)],
                         ids=["toy", "first solution"])
def test_agrees_with_the_colab_header_tool(solution):
    """The header (badge, install URL) written into a solution becomes, in its exercise, the header that
    ``notebook_header.py`` writes into the exercise: the two tools never undo each other."""
    repo = "https://github.com/someone/some-course"
    solved = solution()
    solved.cells[0].source = solved.cells[0].source.replace(BADGE.format(COLAB, "solutions") + "\n", "")
    assert header.apply(solved, f"solutions/{NAME}", repo)
    assert f"{header.colab_link(repo, 'solutions/' + NAME)})" in solved.cells[0].source
    exercise = mx.make_exercise(solved, NAME)
    assert f"{header.colab_link(repo, 'exercises/' + NAME)})" in exercise.cells[0].source
    assert not header.apply(exercise, f"exercises/{NAME}", repo), "the header tool would rewrite the exercise"


def _write_pair(tmp_path: Path, solution, exercise) -> tuple[Path, Path]:
    (tmp_path / "solutions").mkdir()
    (tmp_path / "exercises").mkdir()
    paths = tmp_path / "solutions" / NAME, tmp_path / "exercises" / NAME
    for nb, path in zip((solution, exercise), paths):
        path.write_text(mx.notebook_text(nb), encoding="utf-8")
    return paths


def test_cli_writes_then_check_names_the_cell_that_differs(tmp_path, capsys):
    sol, ex = _write_pair(tmp_path, toy_solution(), toy_solution())
    assert mx.main(["--check", str(sol)]) == 1  # the exercise is still a copy of the solution
    assert mx.main([str(sol)]) == 0
    assert nbformat.read(ex, as_version=4) == mx.make_exercise(toy_solution(), NAME)
    assert mx.main(["--check", str(sol)]) == 0
    stale = nbformat.read(ex, as_version=4)
    stale.cells[2].source = STUB.replace("add x to itself", "an old hint")
    ex.write_text(mx.notebook_text(stale), encoding="utf-8")
    capsys.readouterr()
    assert mx.main(["--check", str(sol)]) == 1
    assert f"exercises/{NAME} cell 3 (# TASK 1: double it): its source differs" in capsys.readouterr().err


def test_orphan_exercise_is_reported(tmp_path):
    sol, _ = _write_pair(tmp_path, toy_solution(), toy_exercise())
    gone = "98_gone.ipynb"
    (tmp_path / "exercises" / gone).write_text("{}", encoding="utf-8")
    assert mx._orphans([sol]) == [f"exercises/{gone} has no solution to generate it from"]
