"""Build the course website into a folder that opens in any browser, from ``file://``, with no server.

    pip install -e ".[docs]"
    python docs/build.py                 # -> docs/_build/html/index.html
    python docs/build.py OUT_DIR         # somewhere else

It renders the committed notebooks from their stored outputs (nothing is executed), the exercises, their
solutions, the README and the API reference from the library's docstrings, with warnings as errors: a broken
cross-reference, a missing page or a docstring that names an object that does not exist fails the build.
``docs/conf.py`` says why Sphinx with MyST-NB and which extensions do what.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
DEFAULT_OUT = DOCS / "_build" / "html"
GENERATED = DOCS / "api" / "generated"  # autosummary's pages, written into the source folder by every build
HOME = "docs/index.html"  # where Sphinx writes the home page (the source folder is the repository root)

# The folder's own index.html: a page with a link to the home page, not a redirect (an instant meta refresh keeps
# a headless browser's screenshot of the folder waiting for a page that never finishes loading).
LANDING = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>diffattn-tutorial</title></head>
<body style="font-family: sans-serif; max-width: 40em; margin: 3em auto; line-height: 1.5">
<h1>diffattn-tutorial</h1>
<p>Learn differential attention by building it: a course of Jupyter notebooks and the library they build.</p>
<p><a href="{home}">Open the course</a></p>
</body></html>
"""


def build(out: Path = DEFAULT_OUT, *, quiet: bool = False) -> int:
    """Build the site into ``out`` (warnings are errors); 0 on success, as ``sphinx-build`` returns."""
    from sphinx.cmd.build import build_main

    out = Path(out)
    # autosummary writes a page per module and never deletes one: a page of a module since removed or left out
    # of the reference would linger, outside every toctree (a warning, so a failed build); start from none
    shutil.rmtree(GENERATED, ignore_errors=True)
    args = ["-W", "--keep-going", "-b", "html", "-c", str(DOCS), "-d", str(out / ".doctrees"), str(ROOT), str(out)]
    status = build_main(args + (["-q"] if quiet else []))
    if status == 0:
        (out / "index.html").write_text(LANDING.format(home=HOME))
    return status


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else DEFAULT_OUT
    status = build(out)
    if status == 0:
        print(f"open {(out / 'index.html').resolve().as_uri()}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
