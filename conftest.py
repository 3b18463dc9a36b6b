"""Repository-wide pytest set-up: what ``pytest`` from the repository root means.

* **Notebooks run under strict nbval when nbval is installed** (the ``dev`` extra). Without nbval, ``pytest``
  still runs every unit test; the notebooks are simply not collected. ``--nbval-lax`` keeps its meaning.
* **Two workers when pytest-xdist is installed** (the ``dev`` extra) and the machine has two or more cores:
  ``--dist loadscope`` keeps each notebook's cells (and each test module) on one worker, in order. ``-n 0`` runs
  everything in this process; ``-n N`` chooses N workers.
* **A fast set**: ``pytest tests -m "not slow"`` leaves out the tests marked ``slow`` (training, notebooks run
  from a built wheel, kernel compiles, the mutation test) and the notebooks.
* **Without Triton** (``pip install -e ".[notebooks,test]"``, which leaves out its 1 GB), the tests that execute
  notebook 09, its solution or its exercise are skipped with the reason; the Triton tests skip themselves.
* **A fresh training cache per test session.** Notebooks 07 and 10 and their tests train toy models through
  ``retrieval_study(cache=True)``. The suite points ``DIFFATTN_CACHE`` at an empty folder of its own (unless you
  set it), so every run trains from scratch once and shares the result between the notebooks and tests of that
  run, never with models a learner or another process trained.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import pytest

_OWN_CACHE: list[str] = []

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


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "slow: trains models, executes notebooks, compiles kernels or mutates "
                                       "solutions (deselect with -m 'not slow' for the fast set)")
    opt = config.option
    if config.pluginmanager.hasplugin("nbval") and not (opt.nbval or opt.nbval_lax):
        opt.nbval = True
        opt.nbval_current_env = True
        if opt.nbval_sanitize_with is None:
            opt.nbval_sanitize_with = str(Path(__file__).parent / "tests" / "nbval_sanitize.cfg")
    if "DIFFATTN_CACHE" not in os.environ:
        _OWN_CACHE.append(tempfile.mkdtemp(prefix="diffattn-test-cache-"))
        os.environ["DIFFATTN_CACHE"] = _OWN_CACHE[0]


def _has_triton() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def pytest_collection_modifyitems(config, items) -> None:
    """Without Triton (``pip install -e ".[notebooks,test]"``), what executes notebook 09 is skipped, saying why."""
    if _has_triton():
        return
    skip = pytest.mark.skip(reason='notebook 09 needs Triton: pip install -e ".[dev]" (or pip install triton)')
    for item in items:
        if "09_triton_kernel" in item.nodeid or "TestNotebook09" in item.nodeid:
            item.add_marker(skip)


def pytest_unconfigure(config) -> None:
    for folder in _OWN_CACHE:
        shutil.rmtree(folder, ignore_errors=True)
