"""Repository-wide pytest set-up: what ``pytest`` from the repository root means.

* **Notebooks run under strict nbval when nbval is installed** (the ``dev`` extra). Without nbval, ``pytest``
  still runs every unit test; the notebooks are simply not collected. ``--nbval-lax`` keeps its meaning.
* **Two workers when pytest-xdist is installed** (the ``dev`` extra) and the machine has two or more cores:
  ``--dist loadscope`` keeps each notebook's cells (and each test module) on one worker, in order; the longest
  work starts first (:func:`_run_order`), so the two workers finish together; and each worker
  runs torch with its share of the cores (``OMP_NUM_THREADS``, unless you set it). ``-n 0`` runs everything in
  this process; ``-n N`` chooses N workers.
* **A fast set**: ``pytest tests -m "not slow"`` leaves out the tests marked ``slow`` (training, the wheel
  build, kernel compiles, the mutation test) and the notebooks.
* **Without Triton** (``pip install -e ".[notebooks,test]"``, which leaves out its 1 GB), the tests that execute
  notebook 09, its solution or its exercise are skipped with the reason; the Triton tests skip themselves.
* **Every notebook runs once, and that run checks two things**: its stored outputs (strict nbval) and that it runs
  the way Colab or a pip install runs it, against the package built as a wheel (not this checkout) from an empty
  folder. The wheel is built once per test session; each notebook kernel starts with an IPython start-up file that
  puts the wheel first on its path, drops the editable install's import hook and moves into an empty folder
  (``tests/test_wheel.py`` checks that this holds).
* **A fresh training cache per test session.** Notebooks 07 and 10 and their tests train toy models through
  ``retrieval_study(cache=True)``. The suite points ``DIFFATTN_CACHE`` at an empty folder of its own (unless you
  set it), so every run trains from scratch once and shares the result between the notebooks and tests of that
  run, never with models a learner or another process trained.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from filelock import FileLock

ROOT = Path(__file__).resolve().parent
_OWN_FOLDERS: list[str] = []
RUN_DIR = "DIFFATTN_TEST_RUN_DIR"  # this test session's scratch folder, shared by the xdist workers

# Two workers share two cores, so a multi-threaded op in one always waits for a core the other holds. OpenMP's
# default wait policy spins while it waits, burning the core it waits for: measured here, 60 training steps of the
# DIFF toy model on 2 threads with one other busy process took 13.0 s spinning and 6.8 s passive. Workers, and
# the notebook kernels they start, inherit this before torch loads OpenMP. It changes speed, never results.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config) -> None:
    opt = config.option
    if "PYTEST_XDIST_WORKER" in os.environ or hasattr(config, "workerinput"):
        return  # a worker: never start workers of its own
    if not config.pluginmanager.hasplugin("xdist") or getattr(opt, "numprocesses", None) is not None:
        return
    if (os.cpu_count() or 1) >= 2 and not opt.collectonly and not getattr(opt, "usepdb", False):
        opt.numprocesses = 2
        if opt.dist == "no":
            opt.dist = "loadscope"
            opt.loadscopereorder = False  # xdist would start the scopes with most items first: see _run_order
        # each worker (and the notebook kernels and child processes it starts) gets its share of the cores, so
        # that two workers do not run four threads on two cores; a test that needs a thread count sets it
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // opt.numprocesses)))


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "slow: trains models, executes notebooks, compiles kernels or mutates "
                                       "solutions (deselect with -m 'not slow' for the fast set)")
    config.addinivalue_line("markers", "random_order(disabled=True): keep a notebook's cells in order under "
                                       "pytest-random-order (registered here too, for runs without the plugin)")
    opt = config.option
    if config.pluginmanager.hasplugin("nbval") and not (opt.nbval or opt.nbval_lax):
        opt.nbval = True
        opt.nbval_current_env = True
        if opt.nbval_sanitize_with is None:
            opt.nbval_sanitize_with = str(Path(__file__).parent / "tests" / "nbval_sanitize.cfg")
    if "DIFFATTN_CACHE" not in os.environ:
        _OWN_FOLDERS.append(tempfile.mkdtemp(prefix="diffattn-test-cache-"))
        os.environ["DIFFATTN_CACHE"] = _OWN_FOLDERS[-1]
    if RUN_DIR not in os.environ:  # set before the workers start, so they share it
        _OWN_FOLDERS.append(tempfile.mkdtemp(prefix="diffattn-test-run-"))
        os.environ[RUN_DIR] = _OWN_FOLDERS[-1]


def _has_triton() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


# Notebook 07 trains the three study models (the longest work of the suite) and starts first. What reads those runs
# from the same cache (a lock per run) comes after the other notebooks, when they are cached: the notebooks that call
# retrieval_study (10, 14) last among the notebooks, test_experiments.py with the slow modules. (Started side by side
# with notebook 07, test_experiments met it on the middle model and one waited; notebook 10 waited 75 s for its lock.)
TRAINS_FIRST = "notebooks/07_experiments.ipynb"


@functools.lru_cache(maxsize=None)
def _reads_the_study(path: Path) -> bool:
    return "retrieval_study(" in path.read_text(encoding="utf-8", errors="replace")


def _run_order(item) -> int:
    """Longest first, so that no long notebook is left for the end with one worker busy and the other idle: the
    notebook that trains, the other course notebooks (those that read its runs last), the modules with slow tests,
    then the rest (xdist's own order, most items first, starts the notebooks last)."""
    where = Path(str(item.fspath)).resolve()
    path = where.relative_to(ROOT).as_posix() if ROOT in where.parents else where.as_posix()
    if path == TRAINS_FIRST:
        return 0
    if path.startswith("notebooks/"):
        return 2 if where.is_file() and _reads_the_study(where) else 1
    return 3 if item.get_closest_marker("slow") else 4


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    """Items in :func:`_run_order` (a stable sort: each file's items stay in order). A notebook's cells run in order
    under a random-order plugin too (``pytest-random-order`` shuffles a module's items: a notebook's cells depend on
    the ones before). Without Triton (``pip install -e ".[notebooks,test]"``), what executes notebook 09 is skipped,
    saying why."""
    rank: dict[str, int] = {}
    for item in items:  # a file's rank is its lowest item's: its items stay together
        rank[str(item.fspath)] = min(rank.get(str(item.fspath), 4), _run_order(item))
    items.sort(key=lambda item: rank[str(item.fspath)])
    in_order = pytest.mark.random_order(disabled=True)
    for item in items:
        if str(item.fspath).endswith(".ipynb"):
            item.add_marker(in_order)
    if _has_triton():
        return
    skip = pytest.mark.skip(reason='notebook 09 needs Triton: pip install -e ".[dev]" (or pip install triton)')
    for item in items:
        if "09_triton_kernel" in item.nodeid:
            item.add_marker(skip)


def pytest_unconfigure(config) -> None:
    for folder in _OWN_FOLDERS:
        shutil.rmtree(folder, ignore_errors=True)


# --- the notebooks run from the wheel -------------------------------------------------------------------------------

def build_wheel(out: Path) -> Path:
    """Build the wheel from a copy of what a source distribution holds (the package, pyproject.toml, README.md)."""
    src = out / "src"
    shutil.copytree(ROOT / "diffattn_tutorial", src / "diffattn_tutorial",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                    "--quiet", "-w", str(out / "dist")], check=True, capture_output=True, text=True)
    (wheel,) = (out / "dist").glob("diffattn_tutorial-*.whl")
    return wheel


def wheel_site() -> Path:
    """A folder holding only the package installed from its wheel: built once per test session, by whichever worker
    asks first (the others wait on a lock)."""
    run = Path(os.environ[RUN_DIR])
    site, done = run / "site", run / "site.done"
    with FileLock(run / "wheel.lock"):
        if not done.exists():
            shutil.rmtree(run / "wheel", ignore_errors=True)
            wheel = build_wheel(run / "wheel")
            subprocess.run([sys.executable, "-m", "pip", "install", str(wheel), "--no-deps", "--no-index",
                            "--quiet", "--target", str(site)], check=True, capture_output=True, text=True)
            done.write_text(wheel.name)
    return site


FROM_THE_WHEEL = '''def _from_the_wheel():
    """Test set-up (conftest.py): import the course from its wheel, from an empty folder, as Colab or pip would."""
    import os, sys, tempfile
    # the editable install's import hook would find a module missing from the wheel in the checkout: drop it
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
    sys.path_hooks[:] = [h for h in sys.path_hooks if not getattr(h, "__module__", "").startswith("__editable__")]
    sys.path_importer_cache.clear()
    sys.path.insert(0, {site!r})
    os.environ["PYTHONPATH"] = os.pathsep.join([{site!r}, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    os.chdir(tempfile.mkdtemp(prefix="learner-", dir={run!r}))


_from_the_wheel()
del _from_the_wheel
'''


def learner_ipython_dir() -> Path:
    """An ``IPYTHONDIR`` whose start-up file makes a kernel import the wheel from an empty folder."""
    run = Path(os.environ[RUN_DIR])
    startup = run / "ipython" / "profile_default" / "startup"
    if not (startup / "00_from_the_wheel.py").exists():
        source = FROM_THE_WHEEL.format(site=str(wheel_site()), run=str(run))
        startup.mkdir(parents=True, exist_ok=True)
        tmp = startup / f".{os.getpid()}.tmp"
        tmp.write_text(source)
        tmp.replace(startup / "00_from_the_wheel.py")  # atomic: a worker never reads half a file
    return run / "ipython"


@pytest.fixture(scope="session")
def wheel_site_dir() -> Path:
    return wheel_site()


@pytest.fixture(scope="session")
def learner_ipython() -> Path:
    return learner_ipython_dir()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """Before a notebook's kernel starts (nbval starts it when its first cell is set up), point it at the wheel."""
    notebook = item.parent
    if type(notebook).__name__ != "IPyNbFile" or getattr(notebook, "kernel", None) is not None:
        yield
        return
    before = os.environ.get("IPYTHONDIR")
    os.environ["IPYTHONDIR"] = str(learner_ipython_dir())
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("IPYTHONDIR", None)
        else:
            os.environ["IPYTHONDIR"] = before
