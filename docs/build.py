"""Build the course website into a folder that opens in any browser, from ``file://``, with no server.

    pip install -e ".[docs]"
    python docs/build.py                 # -> docs/_build/html/index.html
    python docs/build.py OUT_DIR         # somewhere else

It renders the committed notebooks from their stored outputs (nothing is executed), the exercises' texts and the
API reference from the library's docstrings, with warnings as errors: a broken cross-reference, a missing page or
a docstring that names an object that does not exist fails the build. ``docs/conf.py`` says why Sphinx with
MyST-NB, and ``docs/_ext/course_site.py`` what the site adds (API pages, Colab and download links, widgets, offline
math).
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
DEFAULT_OUT = DOCS / "_build" / "html"
HOME = "docs/index.html"  # where Sphinx writes the home page (the source folder is the repository root)

REDIRECT = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>diffattn-tutorial</title>
<meta http-equiv="refresh" content="0; url={home}"></head>
<body><p><a href="{home}">diffattn-tutorial: the course</a></p></body></html>
"""


def build(out: Path = DEFAULT_OUT, *, quiet: bool = False) -> int:
    """Build the site into ``out`` (warnings are errors); 0 on success, as ``sphinx-build`` returns."""
    from sphinx.cmd.build import build_main

    out = Path(out)
    args = ["-W", "--keep-going", "-b", "html", "-c", str(DOCS), "-d", str(out / ".doctrees"), str(ROOT), str(out)]
    status = build_main(args + (["-q"] if quiet else []))
    if status == 0:
        (out / "index.html").write_text(REDIRECT.format(home=HOME))  # the folder's index opens the home page
    return status


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else DEFAULT_OUT
    status = build(out)
    if status == 0:
        print(f"open {(out / 'index.html').resolve().as_uri()}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
