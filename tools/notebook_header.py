"""Write every notebook's header from the one repository URL in ``pyproject.toml`` (``[project.urls] Repository``).

    python tools/notebook_header.py                  # every notebook in notebooks/, exercises/, solutions/
    python tools/notebook_header.py notebooks/06_full_module.ipynb ...
    python tools/notebook_header.py --check          # exit 1 naming each notebook that differs; writes nothing

The header is two things, both derived from the URL:

* an "Open in Colab" badge in the **first markdown cell**, on its own line right after the title line, linking
  to ``https://colab.research.google.com/github/<owner>/<repo>/blob/main/<path of this notebook>``;
* the install URL in the **first code cell**: its ``git+<url>`` (the ``%pip install`` that runs only under Colab)
  is this repository's.

Only cell sources change (no outputs, no re-execution). The tool is idempotent: a second run changes nothing.
Move the repository by editing ``pyproject.toml`` and running this tool.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the dev extra installs tomli
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("notebooks", "exercises", "solutions")
BRANCH = "main"
BADGE_IMAGE = "https://colab.research.google.com/assets/colab-badge.svg"
BADGE_LINE = re.compile(r"^\[!\[Open In Colab\]\([^)\s]*\)\]\([^)\s]*\)[ \t]*\n*", re.MULTILINE)
INSTALL_URL = re.compile(r"git\+https?://[^\s\"'@#]+")
GITHUB_URL = re.compile(r"^https://github\.com/([A-Za-z0-9_.-]+)/([A-Za-z0-9_.-]+?)/?$")


def repository_url(pyproject: Path = ROOT / "pyproject.toml") -> str:
    """``[project.urls] Repository`` of ``pyproject``: ``https://github.com/<owner>/<repo>``."""
    urls = tomllib.loads(pyproject.read_text())["project"].get("urls", {})
    url = urls.get("Repository", "")
    if not GITHUB_URL.match(url):
        raise ValueError(f"{pyproject}: [project.urls] Repository must be https://github.com/<owner>/<repo> "
                         f"(Colab opens notebooks from GitHub); got {url!r}")
    return url.rstrip("/")


def colab_link(repo_url: str, rel_path: str) -> str:
    """The Colab address that opens ``rel_path`` (e.g. ``notebooks/06_full_module.ipynb``) from ``repo_url``."""
    owner, repo = GITHUB_URL.match(repo_url).groups()
    return f"https://colab.research.google.com/github/{owner}/{repo}/blob/{BRANCH}/{rel_path}"


def badge(repo_url: str, rel_path: str) -> str:
    """The "Open in Colab" badge line, in Markdown."""
    return f"[![Open In Colab]({BADGE_IMAGE})]({colab_link(repo_url, rel_path)})"


def with_badge(markdown: str, badge_line: str) -> str:
    """``markdown`` with any old badge line removed and ``badge_line`` after its title line (or first)."""
    title, sep, body = markdown.partition("\n") if markdown.startswith("#") else ("", "", markdown)
    body = BADGE_LINE.sub("", body.lstrip("\n"))
    if not title:
        return f"{badge_line}\n\n{body}"
    return f"{title}\n\n{badge_line}\n\n{body}" if body else f"{title}\n\n{badge_line}"


def with_install_url(code: str, repo_url: str, where: str) -> str:
    """``code`` (the first code cell) with its ``git+<url>`` set to ``repo_url``."""
    if not INSTALL_URL.search(code):
        raise ValueError(f"{where}: the first code cell has no `git+<url>` Colab install line; start the notebook "
                         f"with the course's set-up cell (see notebooks/00_setup_and_roadmap.ipynb)")
    return INSTALL_URL.sub(f"git+{repo_url}", code)


def apply(nb: nbformat.NotebookNode, rel_path: str, repo_url: str) -> bool:
    """Write the header into ``nb`` in place; True when anything changed."""
    first_md = next((c for c in nb.cells if c.cell_type == "markdown"), None)
    first_code = next((c for c in nb.cells if c.cell_type == "code"), None)
    if first_md is None or first_code is None:
        raise ValueError(f"{rel_path}: a course notebook needs a markdown cell (the title) and a code cell (set-up)")
    before = (first_md.source, first_code.source)
    first_md.source = with_badge(first_md.source, badge(repo_url, rel_path))
    first_code.source = with_install_url(first_code.source, repo_url, rel_path)
    return (first_md.source, first_code.source) != before


def course_notebooks(root: Path = ROOT) -> list[Path]:
    """Every notebook the header applies to: ``NN_*.ipynb`` in notebooks/, exercises/ and solutions/."""
    return [p for folder in FOLDERS for p in sorted((root / folder).glob("[0-9][0-9]_*.ipynb"))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", type=Path, help="notebooks (default: every course notebook)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if any notebook differs")
    args = ap.parse_args(argv)
    repo_url = repository_url()
    differ = []
    for path in [p.resolve() for p in args.paths] or course_notebooks():
        rel = path.relative_to(ROOT).as_posix()
        nb = nbformat.read(path, as_version=4)
        if not apply(nb, rel, repo_url):
            continue
        differ.append(rel)
        if not args.check:
            nbformat.write(nb, path)
    if args.check:
        if differ:
            print("header differs from what tools/notebook_header.py writes (run it): " + ", ".join(differ),
                  file=sys.stderr)
            return 1
        print("every header matches")
        return 0
    print("written: " + (", ".join(differ) or "none (every header already matched)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
