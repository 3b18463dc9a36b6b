"""Generate every exercise notebook from its solution: ``solutions/NN_*.ipynb`` is the one source of a chapter.

    python tools/make_exercises.py                    # write exercises/NN_*.ipynb from every solution
    python tools/make_exercises.py --check            # exit 1, naming notebook and cell, if one differs
    python tools/make_exercises.py solutions/03_dual_softmax.ipynb [--check]

**The convention.** A solution notebook is an exercise notebook with the answers filled in and marked. A task
cell is a code cell whose first line is ``# TASK <n>: <title>`` (what ``diffattn-tutorial check`` grades),
followed later by a ``# CHECK <n>`` cell. Inside a task cell:

* the lines the learner is given (the function's signature, its docstring, hints as comments) are written once
  and kept as they are;
* then come the **stub** lines, each written as a comment ``# STUB: <line>``: the exercise shows ``<line>``
  at the marker's indentation, and the last stub line is the ``raise NotImplementedError("<hint>")`` the learner
  replaces;
* then the answer, closed by a line ``# END TASK``. Lines after it are kept as they are.

For example, in the solution::

    # TASK 1: the amplifier's output
    def amplifier_output(v_plus, v_minus, gain_plus=1.0, gain_minus=1.0):
        \"\"\"Output of a differential amplifier for inputs v_plus, v_minus.\"\"\"
        # STUB: raise NotImplementedError("return the amplified difference of the two inputs")
        return gain_plus * v_plus - gain_minus * v_minus
        # END TASK

and in the generated exercise, the stub in place of everything from ``# STUB:`` to ``# END TASK``::

    # TASK 1: the amplifier's output
    def amplifier_output(v_plus, v_minus, gain_plus=1.0, gain_minus=1.0):
        \"\"\"Output of a differential amplifier for inputs v_plus, v_minus.\"\"\"
        raise NotImplementedError("return the amplified difference of the two inputs")

The markers are comments, so they change neither what the solution computes nor its outputs. Every other cell
is copied as it is, with outputs and execution counts cleared and the notebook metadata cleaned as
``tools/run_notebooks.py`` cleans it. The one rewrite: an "Open in Colab" link to this solution
(``https://colab.research.google.com/github/<owner>/<repo>/blob/<branch>/solutions/<name>``) points to
``exercises/<name>`` in the exercise, so the header that ``tools/notebook_header.py`` writes into both agrees.
Each task cell has one block of stub lines and one ``# END TASK``; a marker outside a task cell, a misspelt
marker, a missing ``# END TASK``, an empty answer or a stub that does not end with the ``raise`` is an error
naming the notebook and the cell.
"""

from __future__ import annotations

import argparse
import ast
import copy
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import nbformat

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tools"), str(ROOT)]  # run as a script from anywhere, installed or not
from run_notebooks import clean  # noqa: E402 - the one home of the notebook JSON clean-up

from diffattn_tutorial.course.scorecard import is_task_cell  # noqa: E402

STUB_PREFIX, END_TASK = "# STUB:", "# END TASK"
STUB_LINE = re.compile(r"^(?P<indent>[ \t]*)# STUB:(?: (?P<code>.*))?$")
END_LINE = re.compile(r"^[ \t]*# END TASK$")
ANY_MARKER = re.compile(r"^[ \t]*#+\s*(?:STUB\b|END[ _-]*TASK\b)", re.IGNORECASE)  # to catch misspellings
STUB_RAISE = "raise NotImplementedError"
COLAB_TO_SOLUTION = r"(https://colab\.research\.google\.com/github/[^\s()\"'<>]+?/)solutions/"


class MarkerError(ValueError):
    """A solution notebook's task markers do not follow the convention; the message names notebook and cell."""


@dataclass(frozen=True)
class Where:
    """A cell of a notebook, for error messages: ``solutions/03_dual_softmax.ipynb cell 5 (# TASK 1: ...)``."""

    notebook: str
    index: int  # 0-based
    first_line: str

    def __str__(self) -> str:
        return f"{self.notebook} cell {self.index + 1} ({self.first_line})"


def _where(notebook: str, index: int, source: str) -> Where:
    return Where(notebook, index, source.lstrip().split("\n", 1)[0].strip()[:60])


# ---------------------------------------------------------------------------------------------------------------
# one cell
# ---------------------------------------------------------------------------------------------------------------


def _check_spelling(lines: list[str], where: Where) -> None:
    for line in lines:
        if ANY_MARKER.match(line) and not (STUB_LINE.match(line) or END_LINE.match(line)):
            raise MarkerError(f"{where}: the marker line {line.strip()!r} is misspelt; write "
                              f"'{STUB_PREFIX} <line of the exercise>' or '{END_TASK}' exactly")


def _stub_block(lines: list[str], where: Where) -> tuple[int, int]:
    """``(first, end)``: the stub lines are ``lines[first:end]``, one contiguous block."""
    stubs = [i for i, line in enumerate(lines) if STUB_LINE.match(line)]
    if not stubs:
        raise MarkerError(f"{where}: a task cell needs its stub: a line '{STUB_PREFIX} "
                          f"{STUB_RAISE}(\"<hint>\")' where the answer starts")
    first, end = stubs[0], stubs[-1] + 1
    if stubs != list(range(first, end)):
        raise MarkerError(f"{where}: the '{STUB_PREFIX}' lines must form one block (lines {first + 2}-{end + 1}"
                          f" of the cell are interrupted by other lines)")
    return first, end


def _end_line(lines: list[str], stub_end: int, where: Where) -> int:
    ends = [i for i, line in enumerate(lines) if END_LINE.match(line)]
    if not ends:
        raise MarkerError(f"{where}: the answer has no end: add a line '{END_TASK}' after the last line of the "
                          f"answer")
    if len(ends) > 1 or ends[0] < stub_end:
        raise MarkerError(f"{where}: a task cell has one '{END_TASK}', after its '{STUB_PREFIX}' lines and the "
                          f"answer")
    if not any(line.strip() for line in lines[stub_end:ends[0]]):
        raise MarkerError(f"{where}: there is no answer between the '{STUB_PREFIX}' lines and '{END_TASK}'")
    return ends[0]


def _unstub(line: str) -> str:
    m = STUB_LINE.match(line)
    return (m["indent"] + m["code"]) if m["code"] else ""


def exercise_source(source: str, where: Where) -> str:
    """The exercise's version of a solution task cell's source: the marked answer replaced by the stub."""
    lines = source.split("\n")
    _check_spelling(lines, where)
    first, end = _stub_block(lines, where)
    stop = _end_line(lines, end, where)
    stub = [_unstub(line) for line in lines[first:end]]
    if not stub[-1].strip().startswith(STUB_RAISE):
        raise MarkerError(f"{where}: the last '{STUB_PREFIX}' line must be the learner's "
                          f"'{STUB_RAISE}(\"<hint>\")', not {stub[-1].strip()!r}")
    out = "\n".join(lines[:first] + stub + lines[stop + 1:])
    try:
        ast.parse(out)
    except SyntaxError as e:
        raise MarkerError(f"{where}: the exercise's cell would not be valid Python ({e.msg}, line {e.lineno}); "
                          f"put each '{STUB_PREFIX}' at the indentation its line needs") from None
    return out


def _check_unmarked(source: str, where: Where) -> None:
    for line in source.split("\n"):
        if ANY_MARKER.match(line):
            raise MarkerError(f"{where}: {line.strip()!r} is outside a task cell; a task cell's first line is "
                              f"'# TASK <n>: <title>'")


def _colab_to_exercise(text: str, name: str) -> str:
    return re.sub(COLAB_TO_SOLUTION + f"(?={re.escape(name)})", r"\1exercises/", text)


# ---------------------------------------------------------------------------------------------------------------
# one notebook
# ---------------------------------------------------------------------------------------------------------------


def exercise_path(solution: Path) -> Path:
    """``<repo>/exercises/NN_x.ipynb`` for ``<repo>/solutions/NN_x.ipynb``."""
    return solution.resolve().parent.parent / "exercises" / solution.name


def make_exercise(solution: nbformat.NotebookNode, name: str) -> nbformat.NotebookNode:
    """The exercise notebook generated from the solution notebook ``solutions/<name>``."""
    label = f"solutions/{name}"
    nb = copy.deepcopy(solution)
    for i, cell in enumerate(nb.cells):
        where = _where(label, i, cell.source)
        if cell.cell_type == "markdown":
            cell.source = _colab_to_exercise(cell.source, name)
        elif cell.cell_type == "code":
            if is_task_cell(cell):
                cell.source = exercise_source(cell.source, where)
            else:
                _check_unmarked(cell.source, where)
            cell.outputs, cell.execution_count = [], None
    if not any(is_task_cell(c) for c in nb.cells):
        raise MarkerError(f"{label}: no task cell (a code cell whose first line is '# TASK <n>: <title>')")
    clean(nb)
    return nb


def notebook_text(nb: nbformat.NotebookNode) -> str:
    """The file text ``nbformat.write`` (and so ``tools/run_notebooks.py``) writes."""
    text = nbformat.writes(nb)
    return text if text.endswith("\n") else text + "\n"


def differences(expected: nbformat.NotebookNode, committed: nbformat.NotebookNode, label: str) -> list[str]:
    """One line per cell of ``committed`` (the exercise at ``label``) that is not what the generator makes."""
    out = []
    if len(expected.cells) != len(committed.cells):
        out.append(f"{label}: {len(committed.cells)} cells, the solution makes {len(expected.cells)}")
    for i, (want, have) in enumerate(zip(expected.cells, committed.cells)):
        keys = [k for k in ("cell_type", "source", "metadata", "outputs", "execution_count")
                if want.get(k) != have.get(k)]
        if keys:
            verb = "differs" if len(keys) == 1 else "differ"
            out.append(f"{_where(label, i, have.source)}: its {' and '.join(keys)} {verb} from what the solution "
                       f"generates")
    if not out and notebook_text(expected) != notebook_text(committed):
        out.append(f"{label}: the notebook metadata or format differ")
    return out


def check(solution_path: Path) -> list[str]:
    """What differs between the committed exercise of ``solution_path`` and the generated one (empty if none)."""
    target = exercise_path(solution_path)
    label = f"exercises/{target.name}"
    expected = make_exercise(nbformat.read(solution_path, as_version=4), solution_path.name)
    if not target.exists():
        return [f"{label} is missing"]
    return differences(expected, nbformat.read(target, as_version=4), label)


def write(solution_path: Path) -> bool:
    """Write the exercise of ``solution_path``; True if the file changed."""
    target = exercise_path(solution_path)
    text = notebook_text(make_exercise(nbformat.read(solution_path, as_version=4), solution_path.name))
    if target.exists() and target.read_text(encoding="utf-8") == text:
        return False
    target.write_text(text, encoding="utf-8")
    return True


# ---------------------------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------------------------


def _solutions(paths: list[Path]) -> list[Path]:
    return paths or sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))


def _orphans(solutions: list[Path]) -> list[str]:
    """Exercises in the folders of ``solutions`` that no solution generates."""
    names = {p.name for p in solutions}
    folders = {exercise_path(p).parent for p in solutions}
    return [f"exercises/{p.name} has no solution to generate it from" for folder in folders
            for p in sorted(folder.glob("[0-9][0-9]_*.ipynb")) if p.name not in names]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("solutions", nargs="*", type=Path, help="solution notebooks (default: solutions/NN_*.ipynb)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if an exercise differs")
    args = ap.parse_args(argv)
    solutions = _solutions(args.solutions)
    problems: list[str] = []
    for path in solutions:
        try:
            if args.check:
                problems += check(path)
            elif write(path):
                print(f"wrote {exercise_path(path)}")
        except MarkerError as e:
            problems.append(str(e))
    if args.check and not args.solutions:
        problems += _orphans(solutions)
    for line in problems:
        print(line, file=sys.stderr)
    if problems and args.check:
        print("run: python tools/make_exercises.py (the solutions are the source; never edit an exercise by hand)",
              file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
