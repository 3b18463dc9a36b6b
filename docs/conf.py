"""Sphinx configuration of the course website. Build it with ``python docs/build.py`` (see that file).

Why Sphinx with MyST-NB (and not Jupyter Book): the site needs an API reference generated from the library's
docstrings with cross-references checked (``sphinx.ext.autodoc`` and ``nitpicky``), which only Sphinx has; MyST-NB
is the notebook reader Jupyter Book 1 itself wraps, so using it directly gives the same rendered notebooks without
Jupyter Book's own configuration layer (Jupyter Book 2 builds with the MyST Node.js tool chain, which has no
autodoc). Notebooks are rendered from their stored outputs (``nb_execution_mode = "off"``): the test suite already
executes them, and a build then takes seconds.

The source folder is the repository root, read through ``include_patterns``, so the notebooks are rendered where
they live (``notebooks/``, ``exercises/``; the solutions are left out) and their relative links to each other
resolve; the pages this folder adds are ``docs/index.md`` and the API pages. The chapter lists are globs, so a new
``notebooks/NN_*.ipynb`` gets its page with no edit here.
"""

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))

project = "diffattn-tutorial"
author = "diffattn-tutorial maintainers"
copyright = "diffattn-tutorial maintainers, MIT licence"

root_doc = "docs/index"
include_patterns = ["docs/index.md", "docs/api/**", "notebooks/[0-9][0-9]_*.ipynb", "exercises/[0-9][0-9]_*.ipynb"]
exclude_patterns = ["docs/_build/**"]

extensions = ["myst_nb", "sphinx.ext.autodoc", "course_site"]  # course_site runs napoleon on docstrings

# notebooks: stored outputs, never executed here
nb_execution_mode = "off"
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3

# API reference: every explicit cross-reference must resolve. Type hints name torch, numpy and other packages
# that the site does not document (no network at build time for their inventories): those targets are let through.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|numpy|np|einops|matplotlib|plt|triton|tl|nbformat|ipywidgets|tqdm|argparse|pathlib|"
               r"collections|dataclasses|enum|types|typing|typing_extensions|contextlib|concurrent|subprocess|"
               r"json|os|io|re|random|threading|multiprocessing|datetime|functools|itertools|importlib|warnings|ctypes)(\..*)?"),
]
autodoc_member_order = "bysource"
toc_object_entries = False  # each API page opens with its own list of names; a toctree of every object costs ~3 s
autodoc_typehints_format = "short"
autodoc_inherit_docstrings = False  # a method without a docstring shows none, not torch.nn.Module's
autodoc_mock_imports = __import__("course_site").MOCK_IMPORTS  # triton, when it is not installed

# math: MathJax 3 served from the site itself (copied by course_site), SVG output needs no web fonts
mathjax_path = "mathjax/tex-svg.js"

html_theme = "furo"
html_title = "diffattn-tutorial"
html_static_path = ["_static"]
html_css_files = ["course.css"]
html_copy_source = False
html_show_sourcelink = False
html_last_updated_fmt = None
