"""Sphinx configuration of the course website. Build it with ``python docs/build.py`` (see that file).

Why Sphinx with MyST-NB (and not Jupyter Book): the site needs an API reference generated from the library's
docstrings with cross-references checked (``sphinx.ext.autodoc`` and ``nitpicky``), which only Sphinx has; MyST-NB
is the notebook reader Jupyter Book 1 itself wraps, so using it directly gives the same rendered notebooks without
Jupyter Book's own configuration layer (Jupyter Book 2 builds with the MyST Node.js tool chain, which has no
autodoc). Notebooks are rendered from their stored outputs (``nb_execution_mode = "off"``): the test suite already
executes them, so the build only renders.

The source folder is the repository root, read through ``include_patterns``, so the notebooks are rendered where
they live (``notebooks/``, ``exercises/``, ``solutions/``) and their relative links to each other and to the README
resolve inside the site; the pages this folder adds are ``docs/index.md`` and the API pages. The chapter lists are
globs, so a new ``notebooks/NN_*.ipynb`` gets its page with no edit here.

Maintained extensions do the work: autosummary writes the API pages (``docs/api/index.rst``, with the module
template in ``_templates/``), napoleon reads the Google-style docstrings, sphinx-mathjax-offline serves MathJax
from the site itself. ``_ext/course_site.py`` adds only what no package does (the chapters' Colab and download
banner, static widgets, search that works from ``file://``).
"""

import importlib.util
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))

project = "diffattn-tutorial"
author = "diffattn-tutorial maintainers"
copyright = "diffattn-tutorial maintainers, MIT licence"

root_doc = "docs/index"
include_patterns = ["docs/index.md", "docs/api/**", "README.md", "CONTRIBUTING.md", "benchmarks/NOTES.md",
                    "notebooks/[0-9][0-9]_*.ipynb", "exercises/[0-9][0-9]_*.ipynb", "solutions/[0-9][0-9]_*.ipynb"]
exclude_patterns = ["docs/_build/**"]
templates_path = [str(DOCS / "_templates")]  # absolute: autosummary reads it from the source folder

extensions = ["myst_nb", "sphinx.ext.autodoc", "sphinx.ext.autosummary", "sphinx.ext.napoleon",
              "sphinx-mathjax-offline", "course_site"]

# notebooks: stored outputs, never executed here
nb_execution_mode = "off"
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3

# API reference: autosummary, one page per module (the template documents what a module defines); the exercises'
# checks are left out (their docstrings describe the answers). Triton, when it is not installed, is mocked: its
# modules' docs are their docstrings, and importing a module for its docs compiles no kernel.
autosummary_generate = True
autosummary_context = {"api_excluded": ["diffattn_tutorial.checks"]}
autodoc_mock_imports = [] if importlib.util.find_spec("triton") else ["triton"]
autodoc_member_order = "bysource"
autodoc_typehints_format = "short"
autodoc_inherit_docstrings = False  # a method without a docstring shows none, not torch.nn.Module's
toc_object_entries = False  # each API page opens with its own summary table; a toctree of every object costs ~3 s
napoleon_use_rtype = False
napoleon_use_ivar = True

# Every explicit cross-reference must resolve (a short name of the package, ``MultiheadDiffAttn`` in interop's
# docstrings, resolves as Sphinx resolves ``.MultiheadDiffAttn``: see course_site). Let through, as code: names of
# packages the site does not document (no network at build time for their inventories), and the package's private
# names and constants that have no docstring of their own, which have no page; that every name a docstring's role
# gives exists is tests/test_docstring_references.py's job.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|numpy|np|einops|matplotlib|plt|triton|tl|nbformat|ipywidgets|tqdm|argparse|pathlib|"
               r"collections|dataclasses|enum|types|typing|typing_extensions|contextlib|concurrent|subprocess|"
               r"json|os|io|re|random|threading|multiprocessing|datetime|functools|itertools|importlib|warnings|ctypes)(\..*)?"),
    (r"py:class", r"Tensor"),  # torch.Tensor, as napoleon's Args/Returns types name it
    (r"py:.*", r"([\w.]*\.)?_\w*"),  # private: _diff_attn_fwd, flash_kernels._key_tile_bounds
    (r"py:data", r"([\w.]*\.)?[A-Z][A-Z0-9_]*"),  # a constant without a docstring (MAX_SPLITS)
    (r"py:mod", r"diffattn_tutorial\.checks(\..*)?"),  # left out of the reference (see autosummary_context)
    (r"py:class", r"diffattn_tutorial\.[\w.]+\.(T|Signal)"),  # type variables in signatures
    (r"py:class", r"[a-z_][a-z0-9_]*"),  # napoleon's "steps, lr: ..." field names several attributes, read as types
]


html_theme = "furo"
html_title = "diffattn-tutorial"
html_static_path = ["_static"]
html_css_files = ["course.css"]
html_copy_source = False
html_show_sourcelink = False
html_last_updated_fmt = None


def setup(app):
    """Math: MathJax 3 from the site itself (sphinx-mathjax-offline copies it), in its SVG output, which draws glyphs
    as paths, so a page opened from ``file://`` needs no web fonts. The package sets its CHTML build in its own
    ``setup``, after this file's settings are read; this runs after every extension's ``setup``."""
    app.config.mathjax_path = "mathjax/tex-svg.js"
