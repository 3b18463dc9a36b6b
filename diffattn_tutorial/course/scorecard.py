"""``diffattn-tutorial check NOTEBOOK``: run a learner's exercise notebook and print one line per task.

An exercise notebook of the course has answer cells whose first line is ``# TASK <n>: <title>`` and, right
after each, a cell starting ``# CHECK <n>`` that calls a check from :mod:`diffattn_tutorial.checks`. The
notebook runs top to bottom in its own folder, in a ``python3`` kernel of the current environment, one cell
after the other, going on after errors. Then each task is

* **passed**: its CHECK cell ran without an error and shows the check's ``PASSED:`` line (a cell whose check
  call was commented out fails, saying so);
* **failed**: its CHECK cell raised ``CheckFailed`` (the line shows the hint, the same line Jupyter shows) or any
  other error, or its TASK cell raised;
* **not attempted**: its CHECK cell raised ``NotAttempted`` or ``NotImplementedError`` (the stub is still there).

A task counts once however many cells carry its ``# TASK <n>`` (or ``# CHECK <n>``) line: a solved copy pasted
below the stub, as people do in Jupyter, is graded by the copy that ran last, and the scorecard says so.

A cell running past the timeout is interrupted (it shows ``KeyboardInterrupt``) and the next cells run. A cell
that ignores the interrupt (it catches ``KeyboardInterrupt``) gets ``min(timeout, 5)`` seconds more; then the
kernel is stopped, that cell's task fails as timed out and every later task fails as not run.

Exit code: 0 when every task passed, 1 otherwise, 2 when the file cannot be read or is not an exercise
notebook of the course (no ``# TASK`` / ``# CHECK`` cells). The helpers below are also what the test harness
for the exercises uses.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

TASK_RE = re.compile(r"^#\s*TASK\s+(\d+)\s*:\s*(.*?)\s*$")
CHECK_RE = re.compile(r"^#\s*CHECK\s+(\d+)\b")

PASSED, FAILED, NOT_ATTEMPTED = "passed", "FAILED", "not attempted"
NOT_ATTEMPTED_ERRORS = ("NotAttempted", "NotImplementedError")
STUB_ADVICE = "replace `raise NotImplementedError` with your answer"
INTERRUPT_GRACE_S = 5
"""Seconds a cell may still run after the interrupt sent at its timeout (at most the timeout itself)."""
KERNEL_STOPPED, KERNEL_DIED, NOT_RUN = "KernelStopped", "KernelDied", "NotRun"
"""Error names :func:`execute` records itself: the cell whose kernel it stopped, the cell that was running when
the kernel died on its own, and the cells after either (never run)."""


@dataclass
class Task:
    """One exercise: its number, title, the indices of its TASK and CHECK cells (None if missing; the last cell
    of each when the notebook has copies), and the indices of the earlier copies (not graded)."""

    number: int
    title: str
    task_cell: int
    check_cell: Optional[int]
    copies: tuple[int, ...] = ()


@dataclass
class Result:
    task: Task
    status: str  # PASSED, FAILED or NOT_ATTEMPTED
    detail: str = ""


def _first_line(cell) -> str:
    src = cell.get("source", "")
    src = "".join(src) if isinstance(src, list) else src
    return src.lstrip().split("\n", 1)[0].strip()


def find_tasks(nb) -> list[Task]:
    """The tasks of an exercise notebook, each number once, in the order they first appear, each with its TASK
    and CHECK cell indices: the last cell of each (the one that ran last), earlier copies in ``copies``."""
    task_cells: dict[int, list[int]] = {}
    titles: dict[int, str] = {}
    check_cells: dict[int, list[int]] = {}
    for i, cell in enumerate(nb.cells):
        if cell.get("cell_type") != "code":
            continue
        line = _first_line(cell)
        if m := TASK_RE.match(line):
            task_cells.setdefault(int(m.group(1)), []).append(i)
            titles[int(m.group(1))] = m.group(2)
        elif m := CHECK_RE.match(line):
            check_cells.setdefault(int(m.group(1)), []).append(i)
    tasks = []
    for number, cells in task_cells.items():
        checks = check_cells.get(number, [])
        copies = tuple(sorted(cells[:-1] + checks[:-1]))
        tasks.append(Task(number, titles[number], cells[-1], checks[-1] if checks else None, copies))
    return tasks


def is_check_cell(cell) -> bool:
    return cell.get("cell_type") == "code" and bool(CHECK_RE.match(_first_line(cell)))


def is_task_cell(cell) -> bool:
    return cell.get("cell_type") == "code" and bool(TASK_RE.match(_first_line(cell)))


def cell_error(cell) -> Optional[tuple[str, str]]:
    """``(ename, evalue)`` of the error an executed code cell raised, or None."""
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            return out.get("ename", "Error"), out.get("evalue", "")
    return None


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_FAILING_LINE = re.compile(r"^\s*-+>\s*\d+\s+(.*\S)")  # IPython's marker of the line that raised


def _describe_cell_error(cell, error: tuple[str, str]) -> str:
    """A non-task cell's error in words a learner can act on: the cell by its first code line, the error, and
    the line that raised (an ``assert`` without a message says nothing else)."""
    ename, evalue = error
    first = next((line.strip() for line in cell.get("source", "").splitlines()
                  if line.strip() and not line.lstrip().startswith("#")), "")
    raised = ""
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            lines = _ANSI.sub("", "\n".join(out.get("traceback", []))).splitlines()
            marked = [m.group(1) for m in map(_FAILING_LINE.match, lines) if m]
            raised = marked[-1] if marked else ""
    what = f"{ename}: {evalue}" if evalue else ename
    where = f" at `{raised}`" if raised else ""
    return f"the cell starting `{first}` (not a task) raised {what}{where}"


def _kernel_manager_class():
    """A kernel manager class whose ``python3`` kernel is this Python (the current environment), whatever
    kernelspecs are installed (as nbval's ``--nbval-current-env``)."""
    import ipykernel.kernelspec
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    class CurrentEnvSpecs(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            if kernel_name == "python3":
                return self.kernel_spec_class(resource_dir=ipykernel.kernelspec.RESOURCES,
                                              **ipykernel.kernelspec.get_kernel_dict())
            return super().get_kernel_spec(kernel_name)

    class CurrentEnvKernelManager(AsyncKernelManager):
        def __init__(self, **kwargs):
            kwargs.setdefault("kernel_spec_manager", CurrentEnvSpecs())
            super().__init__(**kwargs)

    return CurrentEnvKernelManager


def check_timeout(timeout: int) -> int:
    """``timeout`` (seconds per cell) if it is a whole number >= 1, else a ``TypeError``/``ValueError`` naming
    the fix. (nbclient reads 0 and negative values as "no limit", which would let an endless loop run forever.)"""
    if isinstance(timeout, bool) or not isinstance(timeout, int):
        raise TypeError(f"timeout must be a whole number of seconds per cell, e.g. 600; got {timeout!r}")
    if timeout < 1:
        raise ValueError(f"timeout must be at least 1 second per cell (e.g. 600); got {timeout}")
    return timeout


class _Watchdog:
    """Stops the kernel when a cell outlives its timeout plus the grace after nbclient's interrupt (a cell that
    catches ``KeyboardInterrupt`` would otherwise be interrupted again and again, for ever).

    nbclient calls :meth:`on_cell_execute` before each code cell and :meth:`on_cell_executed` after it."""

    def __init__(self, client, timeout: int) -> None:
        self.client = client
        self.limit_s = timeout + min(INTERRUPT_GRACE_S, timeout)
        self.running: Optional[int] = None  # index of the cell running now
        self.stopped: Optional[int] = None  # index of the cell whose kernel this watchdog stopped
        self._timer: Optional[threading.Timer] = None

    def on_cell_execute(self, cell, cell_index: int) -> None:
        self.running = cell_index
        self._timer = threading.Timer(self.limit_s, self._stop_kernel, args=(cell_index,))
        self._timer.daemon = True
        self._timer.start()

    def on_cell_executed(self, cell, cell_index: int, execute_reply) -> None:
        self.cancel()
        self.running = None

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _stop_kernel(self, cell_index: int) -> None:
        """SIGKILL to the kernel's process group (as jupyter_client's own ``kill``), else to the kernel."""
        self.stopped = cell_index
        provisioner = getattr(self.client.km, "provisioner", None)
        process = getattr(provisioner, "process", None)
        if process is None:
            return
        kill = getattr(signal, "SIGKILL", signal.SIGTERM)
        try:
            if getattr(provisioner, "pgid", None) and hasattr(os, "killpg"):
                os.killpg(provisioner.pgid, kill)
            else:
                process.kill()
        except OSError:  # already gone
            pass


def _error_output(ename: str, evalue: str):
    from nbformat.v4 import new_output

    return new_output("error", ename=ename, evalue=evalue, traceback=[f"{ename}: {evalue}"])


def _record_stopped_kernel(nb, running: int, stopped_by_watchdog: bool, timeout: int) -> None:
    """The kernel is gone while cell ``running`` ran: record why in that cell, and mark every later code cell
    as not run, so nothing after it can pass."""
    if stopped_by_watchdog:
        reason = (KERNEL_STOPPED, f"cell {running + 1} ran past the {timeout} s timeout and ignored the interrupt "
                                  f"(does it catch KeyboardInterrupt?), so the kernel was stopped")
    else:
        reason = (KERNEL_DIED, f"the kernel died while cell {running + 1} ran (a crash, or out of memory)")
    nb.cells[running].outputs.append(_error_output(*reason))
    for cell in nb.cells[running + 1:]:
        if cell.get("cell_type") == "code" and cell.get("source", "").strip():
            cell.outputs = [_error_output(NOT_RUN, f"not run: the kernel stopped at cell {running + 1}")]


def execute(nb, cwd: Union[str, Path], timeout: int = 600):
    """Execute ``nb`` in place, cell by cell, going on after errors; a cell running past ``timeout`` seconds
    is interrupted (it then shows a ``KeyboardInterrupt``). A cell that is still running
    ``min(timeout, INTERRUPT_GRACE_S)`` seconds after the interrupt has its kernel stopped: it gets a
    ``KernelStopped`` error and every later code cell a ``NotRun`` error (``KernelDied`` when the kernel died on
    its own). Returns ``nb``.

    The kernel is this Python's, started in ``cwd``; its own log lines (not the cells' output) are dropped.
    """
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    check_timeout(timeout)
    for cell in nb.cells:  # outputs saved by the learner must not be mistaken for this run's
        if cell.get("cell_type") == "code":
            cell.outputs, cell.execution_count = [], None
    env_backup = dict(os.environ)
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")  # no GUI windows
    client = NotebookClient(nb, kernel_name="python3", kernel_manager_class=_kernel_manager_class(),
                            timeout=timeout, allow_errors=True, interrupt_on_timeout=True, record_timing=False,
                            resources={"metadata": {"path": str(cwd)}})
    watchdog = _Watchdog(client, timeout)
    client.on_cell_execute, client.on_cell_executed = watchdog.on_cell_execute, watchdog.on_cell_executed
    try:
        client.execute(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except DeadKernelError:
        if watchdog.running is None:
            raise
        _record_stopped_kernel(nb, watchdog.running, watchdog.stopped == watchdog.running, timeout)
    finally:
        watchdog.cancel()
        os.environ.clear()
        os.environ.update(env_backup)
    return nb


def _one_line(text: str, limit: int = 400) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _kernel_gone_detail(error: tuple[str, str], where: str, timeout: int) -> str:
    """The scorecard's words for a cell whose kernel :func:`execute` stopped, that ran when the kernel died, or
    that never ran because of either."""
    ename, evalue = error
    if ename == KERNEL_STOPPED:
        return (f"{where} timed out after {timeout} s and ignored the interrupt (does it catch "
                f"KeyboardInterrupt?), so the kernel was stopped")
    if ename == KERNEL_DIED:
        return f"the kernel died while {where} ran (a crash, or out of memory)"
    return _one_line(evalue)


def _shows_passed(cell) -> bool:
    """Whether a CHECK cell printed a check's success line (``checks._core.passed``: ``PASSED: ...``)."""
    return any(line.startswith("PASSED: ") for out in cell.get("outputs", []) if out.get("output_type") == "stream"
               for line in "".join(out.get("text", "")).splitlines())


def score(nb, tasks: list[Task], timeout: int = 600) -> list[Result]:
    """Grade the tasks of an executed notebook from the errors its TASK and CHECK cells raised."""
    results = []
    for t in tasks:
        if t.check_cell is None:
            results.append(Result(t, FAILED, f"there is no '# CHECK {t.number}' cell; copy it back from the "
                                             f"course's exercise notebook"))
            continue
        task_err = cell_error(nb.cells[t.task_cell])
        err = cell_error(nb.cells[t.check_cell])
        if task_err is not None and task_err[0] == "KeyboardInterrupt":
            results.append(Result(t, FAILED, f"the TASK cell timed out after {timeout} s"))
        elif task_err is not None and task_err[0] in (KERNEL_STOPPED, KERNEL_DIED, NOT_RUN):
            results.append(Result(t, FAILED, _kernel_gone_detail(task_err, "the TASK cell", timeout)))
        elif task_err is not None:
            results.append(Result(t, FAILED, _one_line(f"the TASK cell raised {task_err[0]}: {task_err[1]}")))
        elif err is None and not _shows_passed(nb.cells[t.check_cell]):
            results.append(Result(t, FAILED, "its CHECK cell ran with no PASSED line from a check (is the check call "
                                             "commented out or deleted?); put back the check call of the course's "
                                             "exercise notebook, `check_<name>(<your function>)`"))
        elif err is None:
            results.append(Result(t, PASSED))
        elif err[0] in NOT_ATTEMPTED_ERRORS:
            results.append(Result(t, NOT_ATTEMPTED, STUB_ADVICE))
        elif err[0] == "CheckFailed":  # the hint in full: it is one line, and a cut hint is no hint
            results.append(Result(t, FAILED, _one_line(err[1], limit=2000)))
        elif err[0] == "KeyboardInterrupt":
            results.append(Result(t, FAILED, f"the check timed out after {timeout} s (an endless loop?)"))
        elif err[0] in (KERNEL_STOPPED, KERNEL_DIED, NOT_RUN):
            results.append(Result(t, FAILED, _kernel_gone_detail(err, "the check", timeout)))
        else:
            results.append(Result(t, FAILED, _one_line(f"{err[0]}: {err[1]}")))
    return results


def format_results(results: list[Result]) -> list[str]:
    width = max((len(f"TASK {r.task.number}: {r.task.title}") for r in results), default=0)
    lines = []
    for r in results:
        head = f"TASK {r.task.number}: {r.task.title}".ljust(width)
        lines.append(f"  {head}  {r.status}" + (f": {r.detail}" if r.detail and r.status != PASSED else ""))
    return lines


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _check_sources(nb) -> None:
    """A ``ValueError`` naming the first cell whose source is not text (what grading and running need)."""
    for i, cell in enumerate(nb.cells):
        src = cell.get("source", "")
        if not isinstance(src, str) and not (isinstance(src, list) and all(isinstance(s, str) for s in src)):
            raise ValueError(f"cell {i + 1}'s source is {type(src).__name__}, not text")


def _copies_note(nb, task: Task) -> str:
    """The scorecard's words for a task whose TASK or CHECK line is in several cells."""
    cells = [nb.cells[i] for i in (task.task_cell, task.check_cell, *task.copies) if i is not None]
    counts = [(kind, n, sum(1 for c in cells if pattern.match(_first_line(c))))
              for kind, n, pattern in (("TASK", task.number, TASK_RE), ("CHECK", task.number, CHECK_RE))]
    copied = [f"{kind} {n} is in {count} cells" for kind, n, count in counts if count > 1]
    last = "the last one is" if len(copied) == 1 else "the last of each is"
    return f"{' and '.join(copied)}; {last} graded (delete the other copies)"


def check_notebook(path: Union[str, Path], timeout: int = 600) -> int:
    """Run the exercise notebook at ``path`` and print its scorecard; return the exit code (0, 1 or 2)."""
    import nbformat

    check_timeout(timeout)
    path = Path(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # nbformat's notes on older notebooks (cells without ids): harmless here
            nb = nbformat.read(path, as_version=4)
        _check_sources(nb)
    except Exception as e:  # noqa: BLE001 - missing, unreadable, not JSON, not a notebook: all the same to the learner
        reason = e.strerror if isinstance(e, OSError) and e.strerror else (_one_line(str(e), 160) or type(e).__name__)
        return _error(f"cannot read {path} as a Jupyter notebook ({reason})")
    tasks = find_tasks(nb)
    if not tasks or not any(is_check_cell(c) for c in nb.cells):
        return _error(f"{path} is not an exercise notebook of the course (no '# TASK' / '# CHECK' cells); "
                      f"check one of exercises/NN_*.ipynb")
    print(f"Checking {path.name} ({len(tasks)} tasks; running every cell, this can take a minute) ...", flush=True)
    try:
        execute(nb, path.resolve().parent, timeout=timeout)
    except Exception as e:  # noqa: BLE001 - the kernel could not start or died: report, do not grade
        return _error(_one_line(f"could not run {path.name}: {type(e).__name__}: {e}", 300))
    results = score(nb, tasks, timeout)
    for line in format_results(results):
        print(line)
    n_pass = sum(r.status == PASSED for r in results)
    n_todo = sum(r.status == NOT_ATTEMPTED for r in results)
    summary = f"{n_pass}/{len(results)} tasks passed"
    if n_todo:
        summary += f", {n_todo} not attempted"
    for t in tasks:
        if t.copies:
            print(_one_line(f"  note: {_copies_note(nb, t)}"))
    task_cells = {t.task_cell for t in tasks} | {t.check_cell for t in tasks} | {i for t in tasks for i in t.copies}
    others = [(i, e) for i, c in enumerate(nb.cells) if c.get("cell_type") == "code" and i not in task_cells
              for e in [cell_error(c)] if e is not None]
    if others:
        i, error = others[0]
        print(_one_line(f"  note: {_describe_cell_error(nb.cells[i], error)}"))
    print(summary + (". All done!" if n_pass == len(results) else "."))
    return 0 if n_pass == len(results) else 1
