"""Every course notebook opens with an "Open in Colab" badge and installs from the repository URL, both written by
``tools/notebook_header.py`` from the one URL in ``pyproject.toml``; the tool itself on small synthetic notebooks."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("notebook_header", ROOT / "tools" / "notebook_header.py")
header = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(header)

URL = "https://github.com/someone/some-course"
SETUP = ('# NBVAL_IGNORE_OUTPUT\nimport sys\nif "google.colab" in sys.modules:\n'
         '    get_ipython().run_line_magic("pip", "install -q git+https://github.com/old/place")\n'
         'from diffattn_tutorial.course.notebook import setup\ndevice = setup(seed=0)')


def synthetic(title: str = "# 99 · A title\n\nSome text.") -> nbformat.NotebookNode:
    return new_notebook(cells=[new_markdown_cell(title), new_code_cell(SETUP), new_code_cell("x = 1")])


@pytest.mark.parametrize("path", header.course_notebooks(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_notebook_has_the_header_the_tool_writes(path):
    nb = nbformat.read(path, as_version=4)
    rel = path.relative_to(ROOT).as_posix()
    assert not header.apply(nb, rel, header.repository_url()), \
        f"{rel}: run `python tools/notebook_header.py {rel}` (badge and install URL come from pyproject.toml)"


def test_the_course_has_notebooks_and_the_url_is_a_github_repository():
    names = {p.relative_to(ROOT).parts[0] for p in header.course_notebooks()}
    assert names == set(header.FOLDERS)
    owner, repo = header.GITHUB_URL.match(header.repository_url()).groups()
    assert owner and repo


def test_badge_after_the_title_and_install_url_idempotent():
    nb = synthetic()
    assert header.apply(nb, "notebooks/NN_example.ipynb", URL)
    link = "https://colab.research.google.com/github/someone/some-course/blob/main/notebooks/NN_example.ipynb"
    assert nb.cells[0].source == (f"# 99 · A title\n\n[![Open In Colab]({header.BADGE_IMAGE})]({link})\n\n"
                                  "Some text.")
    assert 'install -q git+https://github.com/someone/some-course")' in nb.cells[1].source
    assert nb.cells[2].source == "x = 1"
    once = [c.source for c in nb.cells]
    assert not header.apply(nb, "notebooks/NN_example.ipynb", URL)
    assert [c.source for c in nb.cells] == once


def test_a_moved_repository_or_notebook_replaces_the_old_badge():
    nb = synthetic()
    header.apply(nb, "solutions/NN_example.ipynb", "https://github.com/old/place")
    assert header.apply(nb, "exercises/NN_example.ipynb", URL)
    assert nb.cells[0].source.count("Open In Colab") == 1
    assert "some-course/blob/main/exercises/NN_example.ipynb)" in nb.cells[0].source
    assert "git+https://github.com/old" not in nb.cells[1].source


def test_a_first_cell_without_a_title_gets_the_badge_first():
    nb = synthetic(title="Plain text.")
    header.apply(nb, "notebooks/NN_example.ipynb", URL)
    assert nb.cells[0].source.startswith("[![Open In Colab](") and nb.cells[0].source.endswith("\n\nPlain text.")


def test_errors_name_the_fix(tmp_path):
    nb = synthetic()
    nb.cells[1].source = "import torch"
    with pytest.raises(ValueError, match="no `git\\+<url>` Colab install line"):
        header.apply(nb, "notebooks/NN_example.ipynb", URL)
    bad = tmp_path / "pyproject.toml"
    bad.write_text('[project]\nname = "x"\n[project.urls]\nRepository = "https://gitlab.com/a/b"\n')
    with pytest.raises(ValueError, match="Repository must be https://github.com/<owner>/<repo>"):
        header.repository_url(bad)


def test_check_mode_writes_nothing_and_fails_on_a_difference(tmp_path, monkeypatch, capsys):
    (tmp_path / "notebooks").mkdir()
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    path = tmp_path / "notebooks" / "NN_example.ipynb"
    nbformat.write(synthetic(), path)
    monkeypatch.setattr(header, "ROOT", tmp_path)
    monkeypatch.setattr(header, "repository_url", lambda: URL)
    before = path.read_bytes()
    assert header.main(["--check", str(path)]) == 1 and path.read_bytes() == before
    assert "notebooks/NN_example.ipynb" in capsys.readouterr().err
    assert header.main([str(path)]) == 0 and path.read_bytes() != before
    assert header.main(["--check", str(path)]) == 0
