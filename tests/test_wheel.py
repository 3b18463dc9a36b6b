"""Every notebook runs the way Colab or a pip install runs it: against the package built as a wheel (not this
editable checkout), from an empty folder, with no access to the repository.

The root ``conftest.py`` builds the wheel once per test session and gives every notebook kernel an IPython start-up
file that puts the wheel first on its path, drops the editable install's import hook and moves into an empty
folder; so the one strict-nbval run of each notebook also proves that it runs from the wheel. These tests check that
set-up: what the wheel ships, that a kernel started that way imports the wheel from an empty folder (and cannot
reach a module missing from the wheel), and that the training cache key does not depend on the install path (the
notebooks and the tests share trained models).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell

from diffattn_tutorial.course.scorecard import cell_error, execute

pytestmark = pytest.mark.slow  # builds the wheel

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_ships_the_data_the_notebooks_read(wheel_site_dir):
    from diffattn_tutorial import golden, recorded

    wheel = next((wheel_site_dir.parent / "wheel" / "dist").glob("diffattn_tutorial-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"diffattn_tutorial/golden/{n}.pt" for n in golden.names()} <= names
    assert {f"diffattn_tutorial/recorded/{n}.json" for n in recorded.available()} <= names
    assert not any(n.startswith(("tests/", "notebooks/", "benchmarks/")) or "__pycache__" in n for n in names)


PROBE = """import json, os, sys, diffattn_tutorial
print(json.dumps({"file": diffattn_tutorial.__file__, "cwd": os.getcwd(), "listing": os.listdir("."),
                  "pythonpath": os.environ.get("PYTHONPATH", ""),
                  "hooks": [getattr(f, "__module__", "") for f in sys.meta_path if "editable" in getattr(f, "__module__", "")],
                  "leaked": [n for n in ("_from_the_wheel", "tempfile") if n in dir()]}))"""


def test_a_notebook_kernel_imports_the_wheel_from_an_empty_folder(learner_ipython, wheel_site_dir, tmp_path,
                                                                   monkeypatch):
    """The set-up every nbval kernel gets (conftest.py): a kernel started as nbval starts one, in the notebooks'
    folder, imports the wheel, works in an empty folder and passes the wheel on to the processes it starts."""
    monkeypatch.setenv("IPYTHONDIR", str(learner_ipython))
    nb = nbformat.v4.new_notebook(cells=[new_code_cell(PROBE)])
    execute(nb, ROOT / "notebooks", timeout=120)
    assert cell_error(nb.cells[0]) is None, nb.cells[0].outputs
    seen = json.loads("".join(o.get("text", "") for o in nb.cells[0].outputs))
    assert Path(seen["file"]).resolve().is_relative_to(wheel_site_dir.resolve()), seen
    assert seen["listing"] == [] and not Path(seen["cwd"]).resolve().is_relative_to(ROOT), seen
    assert seen["pythonpath"].split(os.pathsep)[0] == str(wheel_site_dir), seen
    assert seen["hooks"] == [], "the editable install's import hook would find a module missing from the wheel"
    assert not seen["leaked"], f"the start-up file left names in the notebook's namespace: {seen['leaked']}"


def test_the_training_cache_key_does_not_depend_on_the_install_path(wheel_site_dir, monkeypatch):
    """Notebooks 07 and 10 and the tests share trained models: one key, wherever the package is installed."""
    from diffattn_tutorial.training import study

    key = {"attention": "diff", "seed": 0}
    monkeypatch.setenv("DIFFATTN_CACHE", str(wheel_site_dir / "cache"))
    probe = ("import json; from diffattn_tutorial.training import study as e; "
             f"print(json.dumps([e.__file__, str(e._cache_file(True, {key!r}))]))")
    done = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": str(wheel_site_dir)},
                          cwd=wheel_site_dir, capture_output=True, text=True, check=True)
    wheel_file, wheel_key = json.loads(done.stdout)
    assert Path(wheel_file).is_relative_to(wheel_site_dir) and not Path(study.__file__).is_relative_to(wheel_site_dir)
    assert wheel_key == str(study._cache_file(True, key))
