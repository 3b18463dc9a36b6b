"""Every notebook runs the way Colab or a pip install runs it: against the package built as a wheel (not this
editable checkout), from an empty folder, with no access to the repository.

The wheel is built from a copy of the package sources and installed with ``pip install --target``; the kernel
finds it first through ``PYTHONPATH``, its first cell drops the editable install's import hook (so a module missing
from the wheel cannot be found in the checkout) and asserts that ``diffattn_tutorial`` comes from the wheel. Each
notebook is copied alone into an empty folder and executed there top to bottom; the test fails naming the first
cell that raised, with its error.

One test class per notebook: ``pytest``'s default ``--dist loadscope`` keeps a class on one worker, so the
notebooks spread over the workers instead of running one after the other on one. Notebooks 07 and 10 load their
trained models from the session's training cache (``DIFFATTN_CACHE``, see the root ``conftest.py``), whose key
depends on the library's source, not on where it is installed (checked below).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell

from diffattn_tutorial.course.scorecard import cell_error, execute

pytestmark = pytest.mark.slow  # builds the wheel and runs every notebook again from an empty folder

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
CELL_TIMEOUT_S = 600
ANSI = re.compile(r"\x1b\[[0-9;]*m")

FROM_THE_WHEEL = '''import pathlib, sys
# the editable install's import hook would find a module missing from the wheel in the checkout: drop it
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
sys.path_hooks[:] = [h for h in sys.path_hooks if not getattr(h, "__module__", "").startswith("__editable__")]
sys.path_importer_cache.clear()
import diffattn_tutorial

assert pathlib.Path(diffattn_tutorial.__file__).resolve().is_relative_to(pathlib.Path({site!r}).resolve()), \\
    f"diffattn_tutorial comes from {{diffattn_tutorial.__file__}}, not from the wheel"'''


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


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="session")
def wheel_site(wheel, tmp_path_factory) -> Path:
    """A folder holding only the installed wheel (``pip install --no-deps --target``)."""
    site = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", str(wheel), "--no-deps", "--no-index", "--quiet",
                    "--target", str(site)], check=True, capture_output=True, text=True)
    return site


def test_the_wheel_ships_the_data_the_notebooks_read(wheel):
    from diffattn_tutorial import golden, recorded

    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"diffattn_tutorial/golden/{n}.pt" for n in golden.names()} <= names
    assert {f"diffattn_tutorial/recorded/{n}.json" for n in recorded.available()} <= names
    assert not any(n.startswith(("tests/", "notebooks/", "benchmarks/")) or "__pycache__" in n for n in names)


def test_the_training_cache_key_does_not_depend_on_the_install_path(wheel_site, monkeypatch):
    """Notebooks 07 and 10 run twice per test session (nbval and here) and must train once."""
    from diffattn_tutorial.training import study

    key = {"attention": "diff", "seed": 0}
    monkeypatch.setenv("DIFFATTN_CACHE", str(wheel_site / "cache"))
    probe = ("import json; from diffattn_tutorial.training import study as e; "
             f"print(json.dumps([e.__file__, str(e._cache_file(True, {key!r}))]))")
    done = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": str(wheel_site)},
                          cwd=wheel_site, capture_output=True, text=True, check=True)
    wheel_file, wheel_key = json.loads(done.stdout)
    assert Path(wheel_file).is_relative_to(wheel_site) and not Path(study.__file__).is_relative_to(wheel_site)
    assert wheel_key == str(study._cache_file(True, key))


def first_error(nb) -> str | None:
    """``cell N raised E: message``, its source and traceback, for the first code cell that raised; else None."""
    for index, cell in enumerate(nb.cells):
        error = cell_error(cell) if cell.get("cell_type") == "code" else None
        if error is None:
            continue
        trace = next(o.get("traceback", []) for o in cell.outputs if o.get("output_type") == "error")
        return (f"cell {index} (counting the wheel check as 0) raised {error[0]}: {error[1]}\n--- source ---\n"
                f"{cell.source}\n--- traceback ---\n" + ANSI.sub("", "\n".join(trace)))
    return None


class RunsFromTheWheel:
    """Base of the per-notebook classes below (not collected: its name does not start with ``Test``)."""

    notebook: Path

    def test_runs_from_an_empty_folder_against_the_wheel(self, wheel_site, tmp_path, monkeypatch):
        folder = tmp_path / "learner"
        folder.mkdir()
        copy = folder / self.notebook.name
        shutil.copy(self.notebook, copy)
        nb = nbformat.read(copy, as_version=4)
        nb.cells.insert(0, new_code_cell(FROM_THE_WHEEL.format(site=str(wheel_site))))
        monkeypatch.setenv("PYTHONPATH", str(wheel_site))  # the kernel (and what it starts) imports the wheel
        execute(nb, folder, timeout=CELL_TIMEOUT_S)
        error = first_error(nb)
        assert error is None, f"{self.notebook.name}, run from an empty folder against the wheel: {error}"


for _path in NOTEBOOKS:
    _name = f"TestNotebook{_path.name[:2]}"
    globals()[_name] = type(_name, (RunsFromTheWheel,), {"notebook": _path, "__doc__": _path.name})
