"""``diffattn-tutorial check NOTEBOOK``: exit codes 0/1/2 and one scorecard line per task, through the CLI on
copies of an exercise in a temporary folder; the grading rules on hand-made executed notebooks (no kernel)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import nbformat
import pytest
from forked import run_module
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from diffattn_tutorial.cli import main
from diffattn_tutorial.course.scorecard import (
    FAILED,
    KERNEL_DIED,
    NOT_ATTEMPTED,
    NOT_RUN,
    PASSED,
    check_notebook,
    execute,
    find_tasks,
    format_results,
    score,
)

ROOT = Path(__file__).resolve().parents[1]
NAME = "01_differential_amplifier.ipynb"  # the lightest exercise: three tasks, floats and small tensors


def task_lines(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.lstrip().startswith("TASK ")]


def test_solved_copy_passes(tmp_path, capsys):
    nb = tmp_path / "my_copy.ipynb"
    shutil.copy(ROOT / "solutions" / NAME, nb)
    assert main(["check", str(nb)]) == 0
    out = capsys.readouterr().out
    lines = task_lines(out)
    assert len(lines) == 3 and all(ln.endswith(PASSED) for ln in lines), out
    assert "3/3 tasks passed" in out


def test_unsolved_copy_is_not_attempted(tmp_path, capsys):
    """Also: outputs saved in the copy (here the solution's PASSED lines) do not count, only this run's."""
    ex = nbformat.read(ROOT / "exercises" / NAME, as_version=4)
    sol = nbformat.read(ROOT / "solutions" / NAME, as_version=4)
    for a, b in zip(ex.cells, sol.cells):
        if a.cell_type == "code":
            a.outputs, a.execution_count = b.outputs, b.execution_count
    nb = tmp_path / NAME
    nbformat.write(ex, nb)
    assert main(["check", str(nb)]) == 1
    out = capsys.readouterr().out
    lines = task_lines(out)
    assert len(lines) == 3 and all(NOT_ATTEMPTED in ln for ln in lines), out
    assert "0/3 tasks passed, 3 not attempted" in out


def test_one_wrong_answer_fails_with_its_hint(tmp_path, capsys):
    """Also: TASK 1 solved in a copy pasted below its stub (as people do in Jupyter) is one task, graded by the
    copy that ran last, and the scorecard says which copy counts."""
    nb = nbformat.read(ROOT / "solutions" / NAME, as_version=4)
    tasks = find_tasks(nb)
    task3 = nb.cells[tasks[2].task_cell]
    task3.source = task3.source.replace("20 * math.log10", "10 * math.log10")
    assert "10 * math.log10" in task3.source
    stub = nbformat.read(ROOT / "exercises" / NAME, as_version=4).cells[tasks[0].task_cell]
    nb.cells.insert(tasks[0].task_cell, stub)
    path = tmp_path / "wrong.ipynb"
    nbformat.write(nb, path)
    assert main(["check", str(path)]) == 1
    out = capsys.readouterr().out
    lines = task_lines(out)
    assert [ln.split(":")[0].strip() for ln in lines] == ["TASK 1", "TASK 2", "TASK 3"], out
    assert lines[0].endswith(PASSED) and lines[1].endswith(PASSED)
    assert f"{FAILED}: cmrr_db is not right. Likely mistake: used 10 * log10" in lines[2]
    assert "2/3 tasks passed." in out and "not attempted" not in out
    assert "note: TASK 1 is in 2 cells; the last one is graded" in out


def test_jupyter_and_the_scorecard_show_the_same_one_line(tmp_path):
    """In the kernel a failed check renders as ``FAILED: <hint>`` (no traceback into the check's source, which
    holds the answer), a stub as ``TASK n not attempted yet: ...``; the scorecard prints the same hint."""
    nb = nbformat.read(ROOT / "exercises" / NAME, as_version=4)
    sol = nbformat.read(ROOT / "solutions" / NAME, as_version=4)
    tasks = find_tasks(nb)
    nb.cells[tasks[0].task_cell].source = sol.cells[tasks[0].task_cell].source.replace(
        "gain_plus * v_plus - gain_minus * v_minus", "gain_plus * v_plus + gain_minus * v_minus")
    execute(nb, tmp_path, timeout=120)
    (tb1,) = [o["traceback"] for o in nb.cells[tasks[0].check_cell].outputs if o["output_type"] == "error"]
    (tb2,) = [o["traceback"] for o in nb.cells[tasks[1].check_cell].outputs if o["output_type"] == "error"]
    plain = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in tb1 + tb2]
    hint = "output_from_modes is not right. Likely mistake: added the inputs"
    assert len(plain) == 2 and plain[0].startswith(f"FAILED: {hint}"), plain
    assert plain[1] == "TASK 2 not attempted yet: replace `raise NotImplementedError` in `gains` with your answer"
    assert not any("checks/nb01.py" in line or "Traceback" in line for line in plain)
    lines = format_results(score(nb, tasks))
    assert lines[0].endswith(plain[0]), (lines[0], plain[0])
    assert lines[1].endswith(f"{NOT_ATTEMPTED}: replace `raise NotImplementedError` with your answer")


def test_long_hints_are_not_cut(tmp_path):
    hint = "x" * 900 + " the end"
    cells = [new_code_cell("# TASK 1: t\ndef f(): ..."),
             new_code_cell("# CHECK 1\ncheck_f(f)", outputs=[_err("CheckFailed", hint)])]
    nb = new_notebook(cells=cells)
    (res,) = score(nb, find_tasks(nb))
    assert res.detail == hint


def test_not_a_course_notebook(tmp_path, capsys):
    path = tmp_path / "analysis.ipynb"
    nbformat.write(new_notebook(cells=[new_markdown_cell("# Notes"), new_code_cell("print(1 + 1)")]), path)
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not an exercise notebook of the course" in err


@pytest.mark.parametrize("content", [b"this is not JSON", b'{"cells": 3}', None])
def test_unreadable_file(tmp_path, capsys, content):
    path = tmp_path / "broken.ipynb"
    if content is not None:
        path.write_bytes(content)
    assert main(["check", str(path)]) == 2  # garbage, JSON that is no notebook, a missing file
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: cannot read")


def test_runs_in_its_own_folder_times_out_and_goes_on(tmp_path, capsys, monkeypatch):
    """A learner's copy elsewhere: relative paths resolve next to the notebook; a check stuck in a loop is
    interrupted after --timeout seconds and the next cells still run."""
    folder = tmp_path / "my work"
    folder.mkdir()
    (folder / "data.txt").write_text("hello")
    nb = new_notebook(cells=[
        new_code_cell("# TASK 1: read a file\ndef read():\n    return open('data.txt').read()"),
        new_code_cell("# CHECK 1\nassert read() == 'hello'\nprint('PASSED: yes')"),
        new_code_cell("# TASK 2: spin\ndef spin():\n    while True:\n        pass"),
        new_code_cell("# CHECK 2\nspin()"),
        new_code_cell("# TASK 3: later\ndef later():\n    raise NotImplementedError('write me')"),
        new_code_cell("# CHECK 3\nlater()"),
    ])
    nbformat.write(nb, folder / "mine.ipynb")
    monkeypatch.chdir(tmp_path)
    assert main(["check", str(folder / "mine.ipynb"), "--timeout", "1"]) == 1
    lines = task_lines(capsys.readouterr().out)
    assert lines[0].endswith(PASSED)
    assert FAILED in lines[1] and "timed out after 1 s" in lines[1]
    assert NOT_ATTEMPTED in lines[2]


def test_an_error_outside_the_tasks_names_its_cell_and_line(tmp_path, capsys):
    """A bare ``assert`` in a plain cell has no message: the note quotes the cell's first line and the line that
    raised, not an empty 'AssertionError:' and a cell number Jupyter never shows."""
    nb = new_notebook(cells=[
        new_code_cell("# TASK 1: one\ndef one():\n    return 1"),
        new_code_cell("# CHECK 1\nassert one() == 1\nprint('PASSED: yes')"),
        new_code_cell("# compare the two\ntotal = one() + one()\nassert total == 3"),
    ])
    nbformat.write(nb, tmp_path / "mine.ipynb")
    assert main(["check", str(tmp_path / "mine.ipynb")]) == 0
    note = next(line for line in capsys.readouterr().out.splitlines() if "note:" in line)
    assert "the cell starting `total = one() + one()`" in note and "AssertionError at `assert total == 3`" in note


def test_a_cell_that_swallows_the_interrupt_is_stopped_and_later_tasks_fail(tmp_path):
    """A check that catches KeyboardInterrupt would be interrupted for ever: after the timeout and a grace of
    min(timeout, 5) s the kernel is stopped, that task fails as timed out, later tasks fail as not run, exit 1.
    Run as the learner runs it (a child process), so a hang fails the test instead of stalling the suite."""
    nb = new_notebook(cells=[
        new_code_cell("# TASK 1: ok\nx = 1"),
        new_code_cell("# CHECK 1\nassert x == 1\nprint('PASSED: yes')"),
        new_code_cell("# TASK 2: stubborn\nimport time\ndef stubborn():\n    while True:\n        try:\n"
                      "            time.sleep(0.05)\n        except KeyboardInterrupt:\n            pass"),
        new_code_cell("# CHECK 2\nstubborn()"),
        new_code_cell("# TASK 3: later\ny = 2"),
        new_code_cell("# CHECK 3\nassert y == 2\nprint('PASSED: yes')"),
    ])
    nbformat.write(nb, tmp_path / "stubborn.ipynb")
    done = run_module("diffattn_tutorial.cli", ["check", "stubborn.ipynb", "--timeout", "1"], cwd=tmp_path,
                      timeout=180)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = task_lines(done.stdout)
    assert lines[0].endswith(PASSED)
    assert f"{FAILED}: the check timed out after 1 s and ignored the interrupt" in lines[1]
    assert f"{FAILED}: not run: the kernel stopped at cell 4" in lines[2]
    assert "1/3 tasks passed" in done.stdout


def test_a_kernel_that_dies_fails_its_task_and_the_rest_are_not_run(tmp_path):
    nb = new_notebook(cells=[
        new_code_cell("# TASK 1: crash\nimport os, signal\nos.kill(os.getpid(), signal.SIGKILL)"),
        new_code_cell("# CHECK 1\npass"),
        new_code_cell("print('never')"),
    ])
    execute(nb, tmp_path, timeout=60)
    assert nb.cells[0].outputs[-1]["ename"] == KERNEL_DIED
    assert [o["ename"] for c in nb.cells[1:] for o in c.outputs] == [NOT_RUN, NOT_RUN]
    (res,) = score(nb, find_tasks(nb), timeout=60)
    assert res.status == FAILED and res.detail == "the kernel died while the TASK cell ran (a crash, or out of memory)"


@pytest.mark.parametrize("timeout", ["0", "-1"])
def test_timeout_below_one_second_is_a_usage_error(tmp_path, capsys, timeout):
    """0 and negative values mean "no limit" to nbclient: refused before any kernel starts."""
    assert main(["check", str(tmp_path / "any.ipynb"), "--timeout", timeout]) == 2  # a usage error, one line
    assert f"argument --timeout: {timeout} must be at least 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match=f"timeout must be at least 1 second per cell .*; got {timeout}"):
        check_notebook(tmp_path / "any.ipynb", timeout=int(timeout))
    with pytest.raises(TypeError, match="timeout must be a whole number of seconds"):
        execute(new_notebook(), tmp_path, timeout=2.5)


# --------------------------------------------------------------------------------------------
# the grading rules, on executed notebooks made by hand
# --------------------------------------------------------------------------------------------


def _err(ename: str, evalue: str):
    return new_output("error", ename=ename, evalue=evalue, traceback=[])


def test_score_rules():
    cells = [
        new_code_cell("# TASK 1: ok\ndef f(): ..."),
        new_code_cell("# CHECK 1\ncheck_f(f)", outputs=[new_output("stream", name="stdout", text="PASSED: yes\n")]),
        new_code_cell("# TASK 2: hinted\ndef g(): ..."),
        new_code_cell("# CHECK 2\ncheck_g(g)", outputs=[_err("CheckFailed", "g is not right. Likely mistake: X")]),
        new_code_cell("# TASK 3: stub\ndef h(): ..."),
        new_code_cell("# CHECK 3\ncheck_h(h)", outputs=[_err("NotAttempted", "TASK 3 not attempted yet: ...")]),
        new_code_cell("# TASK 4: broken\ndef k(:", outputs=[_err("SyntaxError", "invalid syntax")]),
        new_code_cell("# CHECK 4\ncheck_k(k)", outputs=[_err("NameError", "name 'k' is not defined")]),
        new_code_cell("# TASK 5: crashes in the check\ndef m(): ..."),
        new_code_cell("# CHECK 5\ncheck_m(m)", outputs=[_err("ZeroDivisionError", "division by zero")]),
        new_code_cell("# TASK 6: no check cell\ndef n(): ..."),
        new_code_cell("# CHECK 7\ncheck_p(p)", outputs=[_err("KeyboardInterrupt", "")]),
        new_code_cell("# TASK 7: slow\ndef p(): ..."),
    ]
    nb = new_notebook(cells=cells)
    tasks = find_tasks(nb)
    assert [t.number for t in tasks] == [1, 2, 3, 4, 5, 6, 7]
    res = {r.task.number: r for r in score(nb, tasks, timeout=9)}
    assert res[1].status == PASSED
    assert res[2].status == FAILED and res[2].detail == "g is not right. Likely mistake: X"
    assert res[3].status == NOT_ATTEMPTED and res[3].detail == "replace `raise NotImplementedError` with your answer"
    assert res[4].status == FAILED and res[4].detail == "the TASK cell raised SyntaxError: invalid syntax"
    assert res[5].status == FAILED and res[5].detail == "ZeroDivisionError: division by zero"
    assert res[6].status == FAILED and "no '# CHECK 6' cell" in res[6].detail
    assert res[7].status == FAILED and "timed out after 9 s" in res[7].detail


def _passed():
    return new_output("stream", name="stdout", text="PASSED: right.\n")  # what a check prints when it passes


def test_a_copied_task_cell_is_one_task_graded_by_the_last_copy():
    """A TASK (or CHECK) cell pasted again: the notebook still has its declared tasks, each once, and the copy
    that ran last is graded (the earlier one's error is neither the task's nor a note of its own)."""
    cells = [
        new_code_cell("# TASK 1: one\ndef f(): raise NotImplementedError"),
        new_code_cell("# CHECK 1\ncheck_f(f)", outputs=[_err("NotAttempted", "TASK 1 not attempted yet")]),
        new_code_cell("# TASK 1: one\ndef f(): return 1"),
        new_code_cell("# CHECK 1\ncheck_f(f)", outputs=[_passed()]),
        new_code_cell("# TASK 2: two\ndef g(:", outputs=[_err("SyntaxError", "invalid syntax")]),
        new_code_cell("# TASK 2: two\ndef g(): return 2"),
        new_code_cell("# CHECK 2\ncheck_g(g)", outputs=[_passed()]),
        new_code_cell("# TASK 3: three\ndef h(): return 3"),
        new_code_cell("# CHECK 3\ncheck_h(h)", outputs=[_err("NotAttempted", "TASK 3 not attempted yet")]),
    ]
    nb = new_notebook(cells=cells)
    tasks = find_tasks(nb)
    assert [(t.number, t.task_cell, t.check_cell, t.copies) for t in tasks] == [
        (1, 2, 3, (0, 1)), (2, 5, 6, (4,)), (3, 7, 8, ())]
    assert [r.status for r in score(nb, tasks)] == [PASSED, PASSED, NOT_ATTEMPTED]

